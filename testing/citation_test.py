"""CITATION.cff is valid Citation File Format 1.2.0 and says what the package says.

Its version is `haiku_bridge.__version__` (a release that bumps one and not the other fails here),
and its licence, authors, abstract and repository are those of pyproject.toml's metadata.
"""

import os
import tomllib

from absl.testing import absltest
import yaml

import haiku_bridge

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What CFF 1.2.0 requires of every file (its schema's `required`).
_REQUIRED = ("cff-version", "message", "title", "authors")


def read(path: str) -> str:
  with open(os.path.join(_ROOT, path)) as f:
    return f.read()


class CitationTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    self.cff = yaml.safe_load(read("CITATION.cff"))
    self.project = tomllib.loads(read("pyproject.toml"))["project"]

  def test_is_cff_1_2_0_with_what_it_requires(self):
    self.assertEqual(self.cff["cff-version"], "1.2.0")
    self.assertContainsSubset(_REQUIRED, self.cff)
    self.assertEqual(self.cff["type"], "software")
    self.assertTrue(self.cff["title"].startswith("haiku_bridge"), self.cff["title"])

  def test_version_is_the_package_version(self):
    self.assertIsInstance(self.cff["version"], str)  # "0.10" read as a number would be 0.1.
    self.assertEqual(self.cff["version"], haiku_bridge.__version__)

  def test_metadata_is_pyproject_metadata(self):
    self.assertEqual(self.cff["license"], self.project["license"])
    self.assertEqual(self.cff["authors"], [{"name": a["name"]} for a in self.project["authors"]])
    self.assertEqual(self.cff["abstract"], self.project["description"])
    self.assertEqual(self.cff["repository-code"], self.project["urls"]["Source"])


if __name__ == "__main__":
  absltest.main()
