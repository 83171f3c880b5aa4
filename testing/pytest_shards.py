"""A pytest run split into Bazel's test shards: whole test classes to each shard, balanced by count.

Bazel runs a target with `shard_count = n` as n processes at once, each told its index
(`TEST_SHARD_INDEX`, `TEST_TOTAL_SHARDS`); absltest splits its methods itself, pytest does not.
`conftest.py` keeps a shard's part of what pytest collected when `HB_PYTEST_SHARD` is
`"index/count"` (`testing/newest_jax_test.sh` sets it from Bazel's variables). A class goes whole to
one shard, so its `setUpClass` (a compile shared by its tests) runs once; classes go, largest first,
to the shard with the fewest tests so far.
"""

from typing import Sequence


def group(nodeid: str) -> str:
  """The test's file and class (`a_test.py::Class::test_x[1]` -> `a_test.py::Class`)."""
  return "::".join(nodeid.split("::")[:2])


def kept(nodeids: Sequence[str], index: int, count: int) -> list[bool]:
  """For each test (in pytest's order), whether shard `index` of `count` runs it."""
  if not 0 <= index < count:
    raise ValueError(f"shard {index} of {count}: the index must be in [0, {count})")
  sizes: dict[str, int] = {}
  for nodeid in nodeids:
    sizes[group(nodeid)] = sizes.get(group(nodeid), 0) + 1
  loads, owner = [0] * count, {}
  for name in sorted(sizes, key=lambda g: (-sizes[g], g)):  # Largest first; ties by name.
    shard = loads.index(min(loads))
    owner[name] = shard
    loads[shard] += sizes[name]
  return [owner[group(nodeid)] == index for nodeid in nodeids]


def parse(value: str) -> tuple[int, int]:
  """`"index/count"` -> (index, count)."""
  try:
    index, count = (int(part) for part in value.split("/"))
  except ValueError:
    raise ValueError(f"HB_PYTEST_SHARD={value!r}: expected 'index/count', e.g. '0/2'") from None
  return index, count
