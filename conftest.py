"""Lets pytest run the absltest files (`*_test.py`) that Bazel runs.

absltest reads its flags (e.g. --test_tmpdir, used by `create_tempdir`) after `absltest.main()` has
parsed them; pytest never calls it, so take every flag's default here.
"""

from absl import flags

from testing import devices

# Before any test file starts jax's backend: under pytest one process imports
# every test file, and the sharding tests need 8 (CPU) devices. Under Bazel,
# each such file calls the same function itself.
devices.use_cpu_devices(8)


def pytest_configure(config):
  del config  # Unused.
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
