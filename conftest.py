"""Lets pytest run the absltest files (`*_test.py`) that Bazel runs.

absltest reads its flags (e.g. --test_tmpdir, used by `create_tempdir`) after `absltest.main()` has
parsed them; pytest never calls it, so take every flag's default here.
"""

import os

# Set before anything imports jax: the sharding tests need 8 (CPU) devices, and
# under pytest one process imports every test file. Bazel sets it per target.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import flags  # pylint: disable=g-import-not-at-top


def pytest_configure(config):
  del config  # Unused.
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
