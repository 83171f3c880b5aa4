"""The repository passes ruff's lint and format checks, with the settings of pyproject.toml.

`python -m ruff check` and `python -m ruff format --check` run over the checkout as a developer runs
them from its root (CONTRIBUTING.md, "How we write code and docs"), on the ruff that
requirements.txt pins. Under Bazel this file is a runfiles link to the checkout's: the checkout is
the directory of its real path, and the target is tagged "external" so that Bazel runs it every
time (a file it does not list may have changed).

A check that passes proves little if the settings could silence it, so each also runs, with the same
pyproject.toml, on a file of known faults, and must flag them; and the files ruff checks must be the
tree's Python files, less the folders that `extend-exclude` names.
"""

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib

from absl.testing import absltest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# Folders of the checkout that hold no source of ours; ruff leaves them out as git does.
_NOT_SOURCE = ("__pycache__", "build", "dist", "venv")

# In the house style (2-space indentation, 100 columns), as `ruff format` leaves it.
_FORMATTED = textwrap.dedent('''\
  """A module as ruff format writes it."""

  import os


  def join(parts: list[str], separator: str = "/") -> str:
    if not parts:
      return os.curdir
    return separator.join(parts)
''')
# The same module as the code was written before ruff: 4-space indentation, one blank line
# between top-level definitions, arguments aligned with the open parenthesis.
_UNFORMATTED = textwrap.dedent('''\
  """A module as ruff format would rewrite it."""

  import os

  def join(parts: list[str],
           separator: str = "/") -> str:
      if not parts:
          return os.curdir
      return separator.join(parts)
''')
# One fault of each kind the lint rules are chosen for, by the code that must report it.
_FAULTY = {
  "F401": "import os\n",
  "F821": "def f():\n  return undefined_name\n",
  "F841": "def f():\n  unused = 1\n",
  "E711": "def f(x):\n  return x == None\n",
  "E722": "def f():\n  try:\n    pass\n  except:\n    pass\n",
  "W605": "import re\n\nPATTERN = re.compile('\\d')\n",
  "B006": "def f(x=[]):\n  return x\n",
  "B011": "def f():\n  assert False\n",
  "PLE0101": "class C:\n  def __init__(self):\n    return 1\n",
}


def ruff(*args: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", "ruff", *args, "--no-cache"],
    cwd=cwd,
    capture_output=True,
    text=True,
    check=False,
  )


def read(path: str) -> str:
  with open(os.path.join(ROOT, path)) as f:
    return f.read()


def pinned_ruff() -> str:
  """The version of ruff that requirements.txt pins."""
  return re.search(r"^ruff==(\S+)$", read("requirements.txt"), re.MULTILINE)[1]


def excluded(path: str, patterns: list[str]) -> bool:
  """Whether `path` (relative to the root) lies under one of `extend-exclude`'s `patterns`."""
  parts = path.split("/")
  return any(
    fnmatch.fnmatch("/".join(parts[:n]), pattern)
    for pattern in patterns
    for n in range(1, len(parts) + 1)
  )


def python_files(root: str, patterns: list[str]) -> set[str]:
  """Every `.py` file of the checkout under `root`, relative to it, less the excluded ones."""
  found = set()
  for directory, subdirs, files in os.walk(root):
    subdirs[:] = [d for d in subdirs if not d.startswith((".", "bazel-")) and d not in _NOT_SOURCE]
    for name in files:
      path = os.path.relpath(os.path.join(directory, name), root).replace(os.sep, "/")
      if name.endswith(".py") and not excluded(path, patterns):
        found.add(path)
  return found


class RuffTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    self.settings = tomllib.loads(read("pyproject.toml"))["tool"]["ruff"]

  def in_project(self, files: dict[str, str]) -> str:
    """A directory with this checkout's pyproject.toml and `files`, as ruff finds its settings."""
    directory = self.create_tempdir().full_path
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), directory)
    for name, text in files.items():
      with open(os.path.join(directory, name), "w") as f:
        f.write(text)
    return directory

  def test_tree_passes_the_lint_rules(self):
    checked = ruff("check", "--output-format=concise", ".")
    self.assertEqual(
      checked.returncode,
      0,
      f"`ruff check` found faults (fix them, or `ruff check --fix`):\n"
      f"{checked.stdout}{checked.stderr}",
    )

  def test_tree_is_formatted(self):
    checked = ruff("format", "--check", ".")
    self.assertEqual(
      checked.returncode,
      0,
      f"files `ruff format` would change (run `python -m ruff format`):\n"
      f"{checked.stdout}{checked.stderr}",
    )

  def test_every_python_file_is_checked(self):
    listed = ruff("check", "--show-files", ".")
    self.assertEqual(listed.returncode, 0, listed.stderr)
    shown = {
      os.path.relpath(line.strip(), ROOT).replace(os.sep, "/")
      for line in listed.stdout.splitlines()
      if line.strip()
    }
    expected = python_files(ROOT, self.settings.get("extend-exclude", []))
    self.assertContainsSubset(
      {"conftest.py", "docs/conf.py", "haiku_bridge/__init__.py", "testing/ruff_test.py"},
      expected,
    )
    self.assertContainsSubset(expected, shown)
    self.assertEqual([f for f in shown if f.endswith(".md")], [])

  def test_lint_rules_flag_each_fault(self):
    files = {f"fault_{code.lower()}.py": text for code, text in _FAULTY.items()}
    directory = self.in_project(files)
    checked = ruff("check", "--output-format=concise", ".", cwd=directory)
    self.assertEqual(checked.returncode, 1, checked.stderr)
    for code in _FAULTY:
      self.assertRegex(
        checked.stdout, rf"fault_{code.lower()}\.py:\d+:\d+: {code} ", checked.stdout
      )

  def test_format_check_fails_on_an_unformatted_file_only(self):
    directory = self.in_project({"formatted.py": _FORMATTED, "unformatted.py": _UNFORMATTED})
    checked = ruff("format", "--check", ".", cwd=directory)
    self.assertEqual(checked.returncode, 1, checked.stderr)
    self.assertIn("unformatted.py", checked.stdout)
    self.assertNotRegex(checked.stdout, r"(?<!un)formatted\.py")
    ruff("format", "unformatted.py", cwd=directory)
    with open(os.path.join(directory, "unformatted.py")) as f:
      self.assertEqual(f.read().split("\n", 1)[1], _FORMATTED.split("\n", 1)[1])

  def test_ruff_is_the_pinned_version(self):
    version = ruff("--version").stdout.split()
    self.assertEqual(version, ["ruff", pinned_ruff()])
    project = tomllib.loads(read("pyproject.toml"))["project"]
    self.assertIn(f"ruff=={pinned_ruff()}", project["optional-dependencies"]["test"])

  def test_pre_commit_hooks_run_the_pinned_ruff(self):
    config = yaml.safe_load(read(".pre-commit-config.yaml"))
    (repo,) = [r for r in config["repos"] if r["repo"].endswith("/ruff-pre-commit")]
    self.assertEqual(repo["rev"], f"v{pinned_ruff()}")
    self.assertEqual([hook["id"] for hook in repo["hooks"]], ["ruff-check", "ruff-format"])

  def test_excluded(self):
    patterns = ["bazel-*", "haiku_bridge/_src/remat"]
    self.assertTrue(excluded("bazel-bin/x.py", patterns))
    self.assertTrue(excluded("haiku_bridge/_src/remat/plan.py", patterns))
    self.assertFalse(excluded("haiku_bridge/_src/remat_helper.py", patterns))
    self.assertFalse(excluded("haiku_bridge/_src/layer_scan.py", patterns))


if __name__ == "__main__":
  absltest.main()
