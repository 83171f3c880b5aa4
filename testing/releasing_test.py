"""RELEASING.md's version bump makes a release the changelog and citation checks accept.

Step 2's commands run, as written, on copies of the three files they edit, with a version and a date
of this test's; the result must name the version where changelog_test and citation_test look, and
move what `## [Unreleased]` held under the new heading. The files and modules the procedure runs
must exist.
"""

import os
import re
import shutil
import subprocess

from absl.testing import absltest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BUMPED = ("haiku_bridge/__init__.py", "CHANGELOG.md", "CITATION.cff")
_HEADING = re.compile(r"^## \[(?P<name>[^\]]+)\](?: - (?P<date>\S+))?$", re.MULTILINE)


def read(path: str, root: str = ROOT) -> str:
  with open(os.path.join(root, path)) as f:
    return f.read()


def step(number: int) -> str:
  """The shell block of RELEASING.md's step `number`."""
  section = re.search(rf"^## {number}\. .*?(?=^## |\Z)", read("RELEASING.md"), re.M | re.S)
  assert section, f"RELEASING.md has no step {number}"
  (block,) = re.findall(r"^```sh\n(.*?)^```", section[0], re.M | re.S)
  return block


def changelog_sections(text: str) -> list[tuple[str, str | None, str]]:
  """`(name, date, body)` of each `## [...]` section, in order."""
  found = list(_HEADING.finditer(text))
  ends = [m.start() for m in found[1:]] + [len(text)]
  return [(m["name"], m["date"], text[m.end() : end]) for m, end in zip(found, ends)]


class ReleasingTest(absltest.TestCase):
  def test_version_bump_makes_a_release(self):
    work = self.create_tempdir().full_path
    for path in _BUMPED:
      os.makedirs(os.path.join(work, os.path.dirname(path)), exist_ok=True)
      shutil.copy(os.path.join(ROOT, path), os.path.join(work, path))
    commands = step(2).replace("git diff\n", "")
    ran = subprocess.run(
      ["bash", "-euc", f"VERSION=9.9.9\nDATE=2099-01-02\n{commands}"],
      cwd=work,
      capture_output=True,
      text=True,
      check=False,
    )
    self.assertEqual(ran.returncode, 0, ran.stderr)

    version = re.findall(r'^__version__ = "(.*)"$', read("haiku_bridge/__init__.py", work), re.M)
    self.assertEqual(version, ["9.9.9"])
    self.assertEqual(yaml.safe_load(read("CITATION.cff", work))["version"], "9.9.9")
    before = changelog_sections(read("CHANGELOG.md"))
    after = changelog_sections(read("CHANGELOG.md", work))
    self.assertEqual(after[0][:2], ("Unreleased", None))
    self.assertEqual(after[0][2].strip(), "")
    self.assertEqual(after[1], ("9.9.9", "2099-01-02", before[0][2]))
    self.assertEqual(after[2:], before[1:])

  def test_version_bump_commits_what_it_changed(self):
    self.assertEqual(
      step(4).splitlines()[0],
      'git commit -m "Release $VERSION" -- ' + " ".join(_BUMPED),
    )
    self.assertIn("sed -i", step(2))

  def test_what_the_procedure_runs_exists(self):
    for path in ("testing/setup.sh", "testing/package_metadata.py", *_BUMPED):
      self.assertTrue(os.path.exists(os.path.join(ROOT, path)), path)
    self.assertIn("bazel test //...", step(3))
    self.assertIn("python -m testing.package_metadata /tmp/hb-release/dist/*", step(6))
    self.assertIn("python -m twine check --strict /tmp/hb-release/dist/*", step(6))


if __name__ == "__main__":
  absltest.main()
