"""Lets pytest run the absltest files (`*_test.py`) that Bazel runs.

absltest reads its flags (e.g. --test_tmpdir, used by `create_tempdir`) after `absltest.main()` has
parsed them; pytest never calls it, so take every flag's default here.
"""

from absl import flags


def pytest_configure(config):
  del config  # Unused.
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
