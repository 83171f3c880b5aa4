"""Runs each Python snippet of README.md and docs/*.md as a reader would: pasted into a fresh file.

Every snippet runs alone, in a new Python process, from an empty directory: it must import what it
uses and set up what it needs (the sharding snippets give JAX 8 CPU devices in their first lines).
The process finds `haiku_bridge` where this test does, as an installed package would be found.
The README's first screen is checked too: its install section and quickstart come first, and the
two commands that run the main example and every test follow before the features. The quickstart
prints what it computed, the output the README shows below it; the contents list after it names
every section (`##`) and subsection (`###`) of the README, in order, each linked to its heading's
anchor as GitHub makes it.
"""

import glob
import os
import re
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

from testing import xla_flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DOCS = ["README.md"] + sorted(
  os.path.relpath(path, _ROOT) for path in glob.glob(os.path.join(_ROOT, "docs", "*.md"))
)
_TIMEOUT_S = 240


def python_snippets(text: str) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def headings(text: str) -> list[tuple[int, str]]:
  """`(level, title)` of each `##` and `###` heading of the Markdown `text`, outside code blocks."""
  prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
  return [
    (len(hashes), title) for hashes, title in re.findall(r"^(###?) (.+)$", prose, re.MULTILINE)
  ]


def contents(text: str) -> list[tuple[int, str, str]]:
  """`(level, title, anchor)` of each entry of the `## Contents` list: level 2, or 3 indented."""
  section = re.search(r"^## Contents\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
  return [
    (2 + len(indent) // 2, title, anchor)
    for indent, title, anchor in re.findall(
      r"^( *)- \[(.+)\]\(#(.+)\)$", section[1] if section else "", re.MULTILINE
    )
  ]


def anchor(title: str) -> str:
  """The anchor GitHub (and the docs site, docs/conf.py) gives a heading: `call_pure-with-a-...`."""
  return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def quickstart_and_output(text: str) -> tuple[str, str]:
  """The quickstart's code, and the output the README shows after it (its first text block)."""
  section = re.search(r"^## Quickstart\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)[1]
  code = re.search(r"^```python\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
  output = re.search(r"^```text\n(.*?)^```", section[code.end() :], re.MULTILINE | re.DOTALL)
  return code[1], output[1] if output else ""


def all_snippets() -> list[tuple[str, int, str]]:
  """`(doc, index, code)` for every Python snippet, in order."""
  out = []
  for doc in _DOCS:
    with open(os.path.join(_ROOT, doc)) as f:
      out += [(doc, i, code) for i, code in enumerate(python_snippets(f.read()))]
  return out


def run_alone(code: str) -> subprocess.CompletedProcess:
  """Runs `code` as the file `snippet.py` of an empty directory, in a new process."""
  with tempfile.TemporaryDirectory() as directory:
    path = os.path.join(directory, "snippet.py")
    with open(path, "w") as f:
      f.write(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    # JAX's device count comes from the snippet alone, never from this process's flags; the
    # compile flags are every test's (testing/xla_flags.py: cheaper code, the same programs), those
    # the installed XLA knows.
    env["XLA_FLAGS"] = xla_flags.flags()
    return subprocess.run(
      [sys.executable, path],
      cwd=directory,
      env=env,
      capture_output=True,
      text=True,
      timeout=_TIMEOUT_S,
      check=False,
    )


class ReadmeTest(parameterized.TestCase):
  def test_docs_are_found(self):
    # Under Bazel the docs are data files; a missing one would pass silently.
    for name in (
      "README.md",
      "docs/comparison.md",
      "docs/errors.md",
      "docs/foreign_libraries.md",
      "docs/install.md",
      "docs/naming.md",
      "docs/remat.md",
      "docs/sharding.md",
    ):
      self.assertIn(name, _DOCS)
    self.assertNotEmpty([s for s in all_snippets() if s[0] == "README.md"])

  def test_readme_opens_with_install_and_quickstart(self):
    # The first screen is what the library is, its install and the quickstart; the version detail
    # is docs/install.md's. The commands that run the main example and every test (CI's) follow,
    # word for word, before the features.
    with open(os.path.join(_ROOT, "README.md")) as f:
      readme = f.read()
    self.assertEqual(re.findall(r"^## (.+)$", readme, re.MULTILINE)[:2], ["Install", "Quickstart"])
    self.assertLess(readme[: readme.index("\n## Quickstart\n")].count("\n"), 30)
    before_features = readme[: readme.index("\n## Features\n")]
    for command in (
      "bash testing/setup.sh && bazel run //examples:custom_vjp_routing",
      "bash testing/setup.sh && bazel test //...",
    ):
      self.assertIn(f"\n{command}\n", before_features)

  def test_contents_lists_every_section(self):
    with open(os.path.join(_ROOT, "README.md")) as f:
      readme = f.read()
    sections = [(level, title) for level, title in headings(readme) if title != "Contents"]
    self.assertContainsSubset([(2, "Features"), (3, "Sharding"), (3, "Pipelines")], sections)
    self.assertEqual([(level, title, anchor(title)) for level, title in sections], contents(readme))

  def test_contents_and_anchor_read_a_list(self):
    text = (
      "## Contents\n\n- [A](#a)\n  - [`b_c` d: e](#b_c-d-e)\n\n## A\n\n```python\n"
      "## not a heading\n```\n\n### `b_c` d: e\n"
    )
    self.assertEqual(contents(text), [(2, "A", "a"), (3, "`b_c` d: e", "b_c-d-e")])
    self.assertEqual(headings(text), [(2, "Contents"), (2, "A"), (3, "`b_c` d: e")])
    self.assertEqual(
      anchor("Haiku functions: inline, or as explicit params"),
      "haiku-functions-inline-or-as-explicit-params",
    )

  def test_quickstart_prints_what_the_readme_shows(self):
    with open(os.path.join(_ROOT, "README.md")) as f:
      code, output = quickstart_and_output(f.read())
    self.assertIn("params:", output)
    result = run_alone(code)
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    self.assertEqual(result.stdout, output)

  def test_a_snippet_runs_alone(self):
    # Guards the runner: a name from another snippet is not defined.
    result = run_alone("import haiku_bridge\nundefined_name")
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("NameError", result.stderr)

  @parameterized.named_parameters(
    (re.sub(r"\W", "_", f"{doc}_{i}"), doc, i, code) for doc, i, code in all_snippets()
  )
  def test_snippet_runs_alone(self, doc, index, code):
    result = run_alone(code)
    self.assertEqual(
      result.returncode, 0, f"{doc} snippet {index} failed alone:\n{result.stderr[-3000:]}"
    )


if __name__ == "__main__":
  absltest.main()
