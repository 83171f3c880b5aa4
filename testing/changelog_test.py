"""CHANGELOG.md keeps the Keep-a-Changelog form, and its latest release is the package's version.

`haiku_bridge.__version__` is read from haiku_bridge/__init__.py as setuptools reads it for the
package's metadata (`[tool.setuptools.dynamic]` in pyproject.toml, checked below), without
importing JAX; //testing:wheel_test checks the installed package's `__version__` against the
wheel's.
"""

import ast
import datetime
import os
import re
import tomllib

from absl.testing import absltest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `## [Unreleased]`, `## [0.1.0] - 2026-12-02`.
_RELEASE = re.compile(r"^## \[(?P<name>[^\]]+)\](?: - (?P<date>\S+))?$", re.MULTILINE)
_KINDS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")


def read(path: str) -> str:
  with open(os.path.join(_ROOT, path)) as f:
    return f.read()


def package_version() -> str:
  """The string assigned to `__version__` in haiku_bridge/__init__.py."""
  for node in ast.parse(read("haiku_bridge/__init__.py")).body:
    if (
      isinstance(node, ast.Assign)
      and len(node.targets) == 1
      and getattr(node.targets[0], "id", None) == "__version__"
    ):
      return ast.literal_eval(node.value)
  raise AssertionError("haiku_bridge/__init__.py assigns no __version__")


def releases(text: str) -> list[tuple[str, str | None, str]]:
  """`(name, date, body)` of each `## [...]` section, in order."""
  found = list(_RELEASE.finditer(text))
  ends = [m.start() for m in found[1:]] + [len(text)]
  return [(m["name"], m["date"], text[m.end() : end]) for m, end in zip(found, ends)]


def version_key(version: str) -> tuple[int, ...]:
  return tuple(int(part) for part in version.split("."))


class ChangelogTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    self.releases = releases(read("CHANGELOG.md"))

  def test_unreleased_comes_first(self):
    self.assertEqual(self.releases[0][0], "Unreleased")
    self.assertIsNone(self.releases[0][1])

  def test_releases_are_dated_and_newest_first(self):
    released = self.releases[1:]
    self.assertNotEmpty(released)
    for name, date, _ in released:
      self.assertRegex(name, r"^\d+\.\d+\.\d+$")
      self.assertIsNotNone(date, name)
      datetime.date.fromisoformat(date)
    versions = [version_key(name) for name, _, _ in released]
    self.assertEqual(versions, sorted(versions, reverse=True))
    self.assertLen(set(versions), len(versions))
    dates = [date for _, date, _ in released]
    self.assertEqual(dates, sorted(dates, reverse=True))

  def test_sections_are_keep_a_changelog_kinds(self):
    for name, _, body in self.releases:
      for kind in re.findall(r"^### (.*)$", body, re.MULTILINE):
        self.assertIn(kind, _KINDS, f"## [{name}] has a section {kind!r}")

  def test_latest_release_is_the_package_version(self):
    self.assertEqual(self.releases[1][0], package_version())

  def test_pyproject_takes_the_version_from_the_package(self):
    project = tomllib.loads(read("pyproject.toml"))
    self.assertIn("version", project["project"]["dynamic"])
    self.assertNotIn("version", project["project"])
    self.assertEqual(
      project["tool"]["setuptools"]["dynamic"]["version"], {"attr": "haiku_bridge.__version__"}
    )

  def test_parser_reads_a_changelog(self):
    # Guards the parsing above on a small text of known shape.
    text = (
      "# Changelog\n\n## [Unreleased]\n\n### Added\n\n- x\n\n"
      "## [0.2.0] - 2027-01-02\n\n### Fixed\n\n- y\n\n"
      "## [0.1.0] - 2026-12-02\n"
    )
    self.assertEqual(
      [(n, d) for n, d, _ in releases(text)],
      [("Unreleased", None), ("0.2.0", "2027-01-02"), ("0.1.0", "2026-12-02")],
    )
    self.assertIn("### Fixed", releases(text)[1][2])


if __name__ == "__main__":
  absltest.main()
