"""CONTRIBUTING.md says what the tree holds: its table of where things live and its list of skips.

- **Where things live**: every module of the library (`haiku_bridge/_src/**.py`, tests aside) is
  named in the table of the section "Where things live", so that a new module cannot land unplaced.
- **Skips and expected failures**: the section "Skips and expected failures" lists, per test file,
  how many `skipTest` / `SkipTest` / `skipIf` / `skipUnless` and `expectedFailure` the file
  holds, with their reasons; each count is the code's.
"""

import glob
import os
import re

from absl.testing import absltest

# Under Bazel the test reads the checkout through its runfiles' links.
_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
_SKIP = re.compile(r"\bskipTest\(|\bSkipTest\(|\bskipIf\(|\bskipUnless\(")
_XFAIL = re.compile(r"@unittest\.expectedFailure\b|@absltest\.expectedFailure\b")


def section(title: str) -> str:
  with open(os.path.join(_ROOT, "CONTRIBUTING.md")) as f:
    text = f.read()
  found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
  assert found, f"no section '## {title}' in CONTRIBUTING.md"
  return found[1]


def library_modules() -> list[str]:
  """The library's modules, `_src/...` paths, tests and package entry points aside."""
  src = os.path.join(_ROOT, "haiku_bridge", "_src")
  paths = glob.glob(os.path.join(src, "**", "*.py"), recursive=True)
  return sorted(
    os.path.relpath(p, os.path.dirname(src))
    for p in paths
    if not p.endswith("_test.py") and os.path.basename(p) != "__init__.py"
  )


def skips_in_code() -> dict[str, tuple[int, int]]:
  """`{test file: (skips, expected failures)}`, for each file that has any."""
  found = {}
  for pattern in ("haiku_bridge/**/*_test.py", "testing/**/*_test.py", "examples/*_test.py"):
    for path in glob.glob(os.path.join(_ROOT, pattern), recursive=True):
      with open(path) as f:
        code = f.read()
      # A test of the test machinery may name these in strings; only code lines count.
      lines = [line for line in code.splitlines() if not line.lstrip().startswith("#")]
      counts = (
        sum(len(_SKIP.findall(line)) for line in lines),
        sum(len(_XFAIL.findall(line)) for line in lines),
      )
      if any(counts):
        found[os.path.relpath(path, _ROOT)] = counts
  return found


def skips_listed() -> dict[str, tuple[int, int]]:
  """The table's rows: `| `file` | skips | expected failures | why |`."""
  rows = re.findall(
    r"^\| `([^`]+_test\.py)` \| (\d+) \| (\d+) \|",
    section("Skips and expected failures"),
    re.MULTILINE,
  )
  return {path: (int(skips), int(xfails)) for path, skips, xfails in rows}


class ContributingTest(absltest.TestCase):
  def test_where_things_live_names_every_module(self):
    table = section("Where things live")
    modules = library_modules()
    self.assertGreater(len(modules), 30)
    unnamed = [
      m for m in modules if f"`{m}`" not in table and f"`{os.path.basename(m)}`" not in table
    ]
    self.assertEqual(
      unnamed, [], "modules CONTRIBUTING.md's table of where things live does not name"
    )

  def test_every_skip_and_expected_failure_is_listed(self):
    in_code, listed = skips_in_code(), skips_listed()
    self.assertGreater(len(in_code), 10)
    self.assertEqual(
      listed,
      in_code,
      "CONTRIBUTING.md's 'Skips and expected failures' against "
      "the code ((skips, expected failures) per file)",
    )


if __name__ == "__main__":
  absltest.main()
