"""Tests for conftest.py under pytest: jax's caches are cleared after each test file.

Run as pytest runs the suite: one process over two test files that share a
jitted function. The first compiles it; the second finds jax's cache of it
empty, as a Bazel test's new process would (conftest.py says why: a
whole-suite process kept every compiled program's code, until its memory
maps ran out).
"""

import os
import subprocess
import sys

from absl.testing import absltest

_SHARED = """
import jax
add_one = jax.jit(lambda x: x + 1)
"""
_FIRST = """
import shared

def test_compiles():
  shared.add_one(1)
  assert shared.add_one._cache_size() == 1
"""
_SECOND = """
import shared

def test_finds_it_cleared():
  assert shared.add_one._cache_size() == 0
"""
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ConftestTest(absltest.TestCase):
  def test_caches_cleared_between_files_not_within(self):
    files = self.create_tempdir().full_path
    for name, text in (("shared.py", _SHARED), ("a_test.py", _FIRST), ("b_test.py", _SECOND)):
      with open(os.path.join(files, name), "w") as f:
        f.write(text)
    # conftest.py as the plugin it is to the repository's runs; the files'
    # own directory first on the path, as pytest puts a test's.
    run = subprocess.run(
      [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "conftest",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--rootdir",
        files,
        os.path.join(files, "a_test.py"),
        os.path.join(files, "b_test.py"),
      ],
      cwd=_ROOT,
      env=dict(
        os.environ, PYTHONPATH=os.pathsep.join([files, _ROOT, os.environ.get("PYTHONPATH", "")])
      ),
      capture_output=True,
      text=True,
      check=False,
    )
    self.assertEqual(run.returncode, 0, run.stdout[-3000:] + run.stderr[-3000:])
    self.assertIn("2 passed", run.stdout)


if __name__ == "__main__":
  absltest.main()
