"""Runs the README's Python snippets, in order, so the README stays true."""

import os
import re

from absl.testing import absltest

_README = os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")


def python_snippets(text: str) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


class ReadmeTest(absltest.TestCase):

  def test_snippets_run(self):
    with open(_README) as f:
      snippets = python_snippets(f.read())
    self.assertNotEmpty(snippets)
    namespace = {}
    for i, snippet in enumerate(snippets):
      with self.subTest(snippet=i):
        exec(compile(snippet, f"README.md snippet {i}", "exec"), namespace)  # pylint: disable=exec-used


if __name__ == "__main__":
  absltest.main()
