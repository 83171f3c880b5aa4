"""Runs the Python snippets of README.md and docs/*.md, in order, so the docs stay true.

Each file's snippets share one namespace, in order, as a reader pastes them; each file starts afresh.
"""

import glob
import os
import re

from absl.testing import absltest

from testing import devices

devices.use_cpu_devices(8)  # The sharding snippets use a mesh of 8 devices.

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DOCS = ["README.md"] + sorted(
    os.path.relpath(path, _ROOT) for path in glob.glob(os.path.join(_ROOT, "docs", "*.md")))


def python_snippets(text: str) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


class ReadmeTest(absltest.TestCase):

  def test_docs_are_found(self):
    # Under Bazel the docs are data files; a missing one would pass silently.
    for name in ("README.md", "docs/errors.md", "docs/foreign_libraries.md", "docs/naming.md",
                 "docs/sharding.md"):
      self.assertIn(name, _DOCS)

  def test_snippets_run(self):
    for doc in _DOCS:
      with open(os.path.join(_ROOT, doc)) as f:
        snippets = python_snippets(f.read())
      if doc == "README.md":
        self.assertNotEmpty(snippets)
      namespace = {}
      for i, snippet in enumerate(snippets):
        with self.subTest(doc=doc, snippet=i):
          exec(compile(snippet, f"{doc} snippet {i}", "exec"), namespace)  # pylint: disable=exec-used


if __name__ == "__main__":
  absltest.main()
