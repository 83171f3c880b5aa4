"""testing/newest_jax_test.sh, the newest-jax leg, when no Python >= 3.12 was found for it.

`third_party/python_venv` then builds a `python` script that exits with status 3: the leg says so
and passes on a developer's machine, and fails under CI=true, where the leg must run.
"""

import os
import subprocess
import tempfile

from absl.testing import absltest

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "newest_jax_test.sh")


def run_leg(python_status: int, ci: str, **env_vars: str) -> subprocess.CompletedProcess:
  """The leg's script with a stand-in `python` that says its shard and exits with `python_status`."""
  with tempfile.TemporaryDirectory() as directory:
    python = os.path.join(directory, "python")
    with open(python, "w") as f:
      f.write(f'#!/bin/sh\necho "shard: $HB_PYTEST_SHARD"\nexit {python_status}\n')
    os.chmod(python, 0o755)
    env = dict(os.environ, CI=ci, **env_vars)
    for name in ("TEST_TOTAL_SHARDS", "TEST_SHARD_INDEX", "HB_PYTEST_SHARD"):
      if name not in env_vars:
        env.pop(name, None)
    return subprocess.run(
      ["bash", _SCRIPT, python, "some_test.py"],
      env=env,
      capture_output=True,
      text=True,
      check=False,
    )


class NewestJaxLegTest(absltest.TestCase):
  def test_without_a_python_it_passes_with_a_notice(self):
    result = run_leg(3, ci="")
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn("skipped, no Python >= 3.12", result.stderr)

  def test_without_a_python_it_fails_under_ci(self):
    result = run_leg(3, ci="true")
    self.assertEqual(result.returncode, 1, result.stderr)
    self.assertIn("CI=true and no Python >= 3.12", result.stderr)

  def test_a_broken_python_fails(self):
    self.assertEqual(run_leg(1, ci="").returncode, 1)

  def test_a_bazel_shard_runs_its_part_and_says_it_shards(self):
    status = os.path.join(self.create_tempdir().full_path, "shard_status")
    result = run_leg(
      0, ci="", TEST_TOTAL_SHARDS="2", TEST_SHARD_INDEX="1", TEST_SHARD_STATUS_FILE=status
    )
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn("shard: 1/2", result.stdout)
    self.assertTrue(os.path.exists(status))  # Bazel's sign that the test shards itself.
    self.assertIn("shard: \n", run_leg(0, ci="").stdout)  # Unsharded: every test.


if __name__ == "__main__":
  absltest.main()
