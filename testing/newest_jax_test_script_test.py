"""testing/newest_jax_test.sh, the newest-jax leg, when no Python >= 3.12 was found for it.

`third_party/python_venv` then builds a `python` script that exits with status 3: the leg says so
and passes on a developer's machine, and fails under CI=true, where the leg must run.
"""

import os
import subprocess
import tempfile

from absl.testing import absltest

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "newest_jax_test.sh")


def run_leg(python_status: int, ci: str) -> subprocess.CompletedProcess:
  """The leg's script with a stand-in `python` that exits with `python_status`."""
  with tempfile.TemporaryDirectory() as directory:
    python = os.path.join(directory, "python")
    with open(python, "w") as f:
      f.write(f"#!/bin/sh\nexit {python_status}\n")
    os.chmod(python, 0o755)
    env = dict(os.environ, CI=ci)
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


if __name__ == "__main__":
  absltest.main()
