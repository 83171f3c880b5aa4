"""Pairwise test grids: few rows in which every pair of settings of two factors occurs.

A grid of many factors is too large to run whole (the pipeline's: 11 factors,
248,832 cells), while most bugs need only two settings at once (an Explicit
mesh and params as init returns them). `pairwise(factors)` picks rows so that
for any two factors, every combination of their settings is in some row:

>>> rows = pairwise({"a": (1, 2), "b": ("x", "y"), "c": (True, False)})
>>> len(rows)
4
>>> sorted({(row["a"], row["c"]) for row in rows})
[(1, False), (1, True), (2, False), (2, True)]

Rows are built greedily (each adds the most pairs not yet covered), with a
seeded random choice among ties, so the same factors give the same rows on
every machine. `required` rows come first, as given: the triples a bug needs
are pinned there.

Settings that compare equal but differ in type (`1` and `True`, as
`unroll=` takes them) are different settings here.
"""

import itertools
import random
from typing import Any, Callable, Mapping, Optional, Sequence

Row = dict[str, Any]


def setting(value: Any) -> tuple[type, Any]:
  """`value` as a setting: its type too, so that `True` is not `1`."""
  return type(value), value


def pairs_of(row: Mapping[str, Any], names: Sequence[str]) -> set[tuple]:
  """The pairs of (factor, `setting`) that `row` covers."""
  return {((a, setting(row[a])), (b, setting(row[b]))) for a, b in itertools.combinations(names, 2)}


def pairwise(
  factors: Mapping[str, Sequence[Any]],
  required: Sequence[Mapping[str, Any]] = (),
  allowed: Callable[[Row], bool] = lambda row: True,
  candidates: int = 30,
  seed: int = 0,
) -> list[Row]:
  """Rows covering every pair of settings of `factors` (after `required`).

  Args:
    factors: each factor's name and its settings (at least one each).
    required: rows to include first (each names every factor).
    allowed: whether a row may be used; it must leave every pair some row.
    candidates: rows tried per step; more may give fewer rows.
    seed: for the choice among equally good settings.

  Returns:
    The rows, each a dict from factor name to setting.
  """
  names = list(factors)
  rng = random.Random(seed)
  uncovered = set()
  for a, b in itertools.combinations(names, 2):
    uncovered |= {((a, setting(x)), (b, setting(y))) for x in factors[a] for y in factors[b]}
  rows = []
  for row in required:
    if set(row) != set(names):
      raise ValueError(f"a required row names {sorted(row)}, not {names}.")
    rows.append(dict(row))
    uncovered -= pairs_of(row, names)
  while uncovered:
    best: Optional[Row] = None
    best_gain = -1
    tries = 0
    while best is None or tries < candidates:
      tries += 1
      if tries > 100 * candidates:
        raise ValueError(
          "`allowed` refuses every row tried for the pairs "
          f"left: {sorted(uncovered, key=repr)[:4]}..."
        )
      row = _greedy_row(factors, names, uncovered, rng)
      gain = len(pairs_of(row, names) & uncovered)
      if gain > best_gain and allowed(row):
        best, best_gain = row, gain
    rows.append(best)
    uncovered -= pairs_of(best, names)
  return rows


def _greedy_row(factors, names, uncovered, rng) -> Row:
  """A row seeded with one uncovered pair, each other factor set to cover most."""
  (a, (_, x)), (b, (_, y)) = rng.choice(sorted(uncovered, key=repr))
  row = {a: x, b: y}
  rest = [n for n in names if n not in row]
  rng.shuffle(rest)
  for name in rest:

    def gain(value):
      pairs = (((n, setting(row[n])), (name, setting(value))) for n in row)
      return sum(pair in uncovered or pair[::-1] in uncovered for pair in pairs)

    scores = [(gain(s), rng.random(), i) for i, s in enumerate(factors[name])]
    row[name] = factors[name][max(scores)[2]]
  return {n: row[n] for n in names}
