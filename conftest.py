"""Lets pytest run the absltest files (`*_test.py`) that Bazel runs.

Under Bazel each test file is its own process; under pytest one process (or
one per `pytest -n` worker) imports them all. Four things follow:

- absltest reads its flags (e.g. --test_tmpdir, used by `create_tempdir`)
  after `absltest.main()` has parsed them; pytest never calls it, so every
  flag takes its default here.
- The examples and benchmarks are programs, each defining its own flags
  (`--num_steps` in three of them); imported into one process, a later
  definition of a name replaces the earlier one instead of raising
  `DuplicateFlagError`. Their tests set what they read (`flagsaver`).
- The XLA compilation cache and the XLA flags (`testing/xla_flags.py`)
  that `.bazelrc` gives every Bazel test are set here too, unless the
  environment names its own.
- jax's caches keep every program the process compiled, and with it
  XLA:CPU's code: about three memory maps per compiled kernel (jaxlib
  0.11.2: `scan_test.py` ends with 19,507 maps, `pipeline_grid_test.py`
  9,601, `time_scan_test.py` 7,350). A whole-suite process reaches Linux's
  limit of maps per process (`vm.max_map_count`, 65,530), where XLA's next
  compile fails to allocate: jaxlib 0.11.2 segfaults in
  `backend_compile_and_load` ("LLVM compilation error: Cannot allocate
  memory"); 0.10.2's had not returned after 300 s. jax's caches are
  cleared after each file's last test, as a Bazel test's process ends with
  its file.
"""

import os

from absl import flags

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/haiku_bridge_xla_cache")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from testing import xla_flags  # pylint: disable=g-import-not-at-top

if "XLA_FLAGS" not in os.environ:  # Only flags the installed XLA knows (probed, cached).
  os.environ["XLA_FLAGS"] = xla_flags.flags()

from testing import devices  # pylint: disable=g-import-not-at-top

# Before any test file starts jax's backend: under pytest one process imports
# every test file, and the sharding tests need 8 (CPU) devices. Under Bazel,
# each such file calls the same function itself.
devices.use_cpu_devices(8)

import jax  # pylint: disable=g-import-not-at-top

_register_flag = flags.FlagValues.__setitem__


def _register_or_replace(flag_values, name, flag):
  if name in flag_values:
    flag.allow_override = True
  _register_flag(flag_values, name, flag)


flags.FlagValues.__setitem__ = _register_or_replace


def pytest_runtest_teardown(item, nextitem):
  if nextitem is None or nextitem.path != item.path:
    jax.clear_caches()


def pytest_configure(config):
  del config  # Unused.
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def pytest_collection_modifyitems(config, items):
  """Under `HB_PYTEST_SHARD="index/count"`, only this shard's tests (`testing/pytest_shards.py`)."""
  shard = os.environ.get("HB_PYTEST_SHARD")
  if not shard:
    return
  from testing import pytest_shards  # pylint: disable=g-import-not-at-top

  kept = pytest_shards.kept([item.nodeid for item in items], *pytest_shards.parse(shard))
  config.hook.pytest_deselected(items=[item for item, k in zip(items, kept) if not k])
  items[:] = [item for item, k in zip(items, kept) if k]
