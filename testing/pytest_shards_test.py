"""testing/pytest_shards.py: every test in one shard, classes whole, shards balanced."""

from absl.testing import absltest

from testing import pytest_shards

_IDS = (
  [f"a_test.py::Big::test_{i}" for i in range(6)]
  + [f"a_test.py::Small::test_{i}" for i in range(2)]
  + [f"b_test.py::Other::test_{i}[{j}]" for i in range(2) for j in range(2)]
  + ["c_test.py::test_function"]
)


class ShardsTest(absltest.TestCase):
  def test_each_test_in_exactly_one_shard_and_each_class_whole(self):
    for count in (1, 2, 3):
      shards = [pytest_shards.kept(_IDS, i, count) for i in range(count)]
      for position, nodeid in enumerate(_IDS):
        self.assertEqual(sum(s[position] for s in shards), 1, nodeid)
      for shard in shards:
        kept_groups = {pytest_shards.group(n) for n, k in zip(_IDS, shard) if k}
        dropped_groups = {pytest_shards.group(n) for n, k in zip(_IDS, shard) if not k}
        self.assertEmpty(kept_groups & dropped_groups)

  def test_shards_balanced_by_count(self):
    sizes = [sum(pytest_shards.kept(_IDS, i, 2)) for i in range(2)]
    self.assertEqual(sorted(sizes), [6, 7])  # Big (6) alone; Other (4), Small (2), the function.

  def test_a_bad_shard_is_named(self):
    with self.assertRaisesRegex(ValueError, "shard 2 of 2"):
      pytest_shards.kept(_IDS, 2, 2)
    with self.assertRaisesRegex(ValueError, "HB_PYTEST_SHARD='2'"):
      pytest_shards.parse("2")
    self.assertEqual(pytest_shards.parse("1/3"), (1, 3))


if __name__ == "__main__":
  absltest.main()
