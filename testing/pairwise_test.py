"""Tests for pairwise grids: every pair covered, against all pairs listed by brute force."""

import doctest
import itertools

from absl.testing import absltest
from absl.testing import parameterized

from testing import pairwise

FACTORS = {
  "a": (0, 1, 2),
  "b": ("x", "y"),
  "c": (True, False),
  "d": (1, 2, 3, 4),
  "e": ("p", "q", "r"),
}


def all_pairs(factors):
  return {
    ((a, pairwise.setting(x)), (b, pairwise.setting(y)))
    for a, b in itertools.combinations(list(factors), 2)
    for x in factors[a]
    for y in factors[b]
  }


def covered(rows, factors):
  return set().union(*(pairwise.pairs_of(row, list(factors)) for row in rows))


class PairwiseTest(parameterized.TestCase):
  def test_docstring(self):
    self.assertEqual(doctest.testmod(pairwise).failed, 0)

  @parameterized.parameters(0, 1, 2)
  def test_every_pair_is_in_a_row(self, seed):
    rows = pairwise.pairwise(FACTORS, seed=seed)
    self.assertEqual(covered(rows, FACTORS), all_pairs(FACTORS))
    # Far fewer than all 144 cells; at least the 4 × 3 of the two largest.
    self.assertBetween(len(rows), 12, 30)

  def test_equal_settings_of_other_types_are_distinct(self):
    # `True == 1`: as dict keys they would be one setting, and a grid over
    # `unroll=(1, 2, True)` would never run `True`.
    factors = {"unroll": (1, 2, True), "remat": (False, 0, "nested")}
    rows = pairwise.pairwise(factors)
    self.assertLen(rows, 9)
    self.assertEqual(
      sorted(
        {
          (type(r["unroll"]).__name__, r["unroll"], type(r["remat"]).__name__, r["remat"])
          for r in rows
        },
        key=repr,
      ),
      sorted(
        {
          (type(u).__name__, u, type(m).__name__, m)
          for u in factors["unroll"]
          for m in factors["remat"]
        },
        key=repr,
      ),
    )

  def test_same_rows_every_time(self):
    self.assertEqual(pairwise.pairwise(FACTORS), pairwise.pairwise(FACTORS))

  def test_required_rows_first(self):
    required = [dict(a=2, b="y", c=False, d=4, e="r")]
    rows = pairwise.pairwise(FACTORS, required=required)
    self.assertEqual(rows[0], required[0])
    self.assertEqual(covered(rows, FACTORS), all_pairs(FACTORS))

  def test_required_row_must_name_every_factor(self):
    with self.assertRaisesRegex(ValueError, "names"):
      pairwise.pairwise(FACTORS, required=[dict(a=0)])

  def test_allowed_rows_only(self):
    def allowed(row):  # A triple no row may hold; every pair stays possible.
      return not (row["a"] == 0 and row["b"] == "x" and row["c"])

    rows = pairwise.pairwise(FACTORS, allowed=allowed)
    self.assertTrue(all(allowed(row) for row in rows))
    self.assertEqual(covered(rows, FACTORS), all_pairs(FACTORS))

  def test_allowed_that_refuses_a_pair(self):
    with self.assertRaisesRegex(ValueError, "refuses every row"):
      pairwise.pairwise(FACTORS, allowed=lambda row: row["a"] != 0, candidates=2)


if __name__ == "__main__":
  absltest.main()
