"""Tests for package_metadata: each fault the index or `twine check` refuses, named.

On core metadata written here; //testing:wheel_test runs the same check on what `python -m build`
makes.
"""

import contextlib
import io
import os
import tarfile
import zipfile

from absl.testing import absltest

from testing import package_metadata

README = "# haiku_bridge\n\nExplicit-params JAX code inside `hk.transform`.\n"
HEADERS = {
  "Metadata-Version": "2.4",
  "Name": "haiku-bridge",
  "Version": "0.1.0",
  "Summary": "Explicit-params JAX code inside Haiku transforms.",
  "License-Expression": "Apache-2.0",
  "Requires-Python": ">=3.11",
  "Description-Content-Type": "text/markdown",
}


def metadata(description: str = README, **headers: str | None) -> str:
  """Core metadata of HEADERS with `headers` changed (None drops one), `description` its body."""
  fields = dict(HEADERS, **{name.replace("_", "-"): value for name, value in headers.items()})
  lines = [f"{name}: {value}" for name, value in fields.items() if value is not None]
  return "\n".join(lines) + "\n\n" + description


class ProblemsTest(absltest.TestCase):
  def test_good_metadata_has_none(self):
    self.assertEqual(package_metadata.problems(metadata(), README), [])
    # The charset parameter setuptools may add, and a trailing newline more or less.
    self.assertEqual(
      package_metadata.problems(
        metadata(Description_Content_Type="text/markdown; charset=UTF-8"), README + "\n"
      ),
      [],
    )

  def test_no_content_type(self):
    # What dropping the README's content type from pyproject.toml writes.
    (problem,) = package_metadata.problems(metadata(Description_Content_Type=None), README)
    self.assertStartsWith(problem, "no Description-Content-Type: twine check reads")

  def test_another_content_type(self):
    self.assertEqual(
      package_metadata.problems(metadata(Description_Content_Type="text/x-rst"), README),
      ["Description-Content-Type is text/x-rst, README.md is text/markdown"],
    )
    self.assertEqual(
      package_metadata.problems(
        metadata(Description_Content_Type="text/markdown; charset=latin-1"), README
      ),
      [
        "invalid metadata: 'description-content-type' can only specify the UTF-8 charset, "
        "not 'latin-1'"
      ],
    )

  def test_no_long_description_or_another(self):
    self.assertEqual(
      package_metadata.problems(metadata(description=""), README),
      ["no long description (twine check: `long_description` missing)"],
    )
    self.assertEqual(
      package_metadata.problems(metadata(description="UNKNOWN\n"), README),
      ["no long description (twine check: `long_description` missing)"],
    )
    self.assertEqual(
      package_metadata.problems(metadata(description="# another\n"), README),
      ["the long description is not README.md"],
    )

  def test_required_fields(self):
    for field in ("Name", "Version", "Metadata-Version"):
      with self.subTest(field):
        found = package_metadata.problems(metadata(**{field.replace("-", "_"): None}), README)
        self.assertIn(f"no {field} field", found)
        self.assertTrue(any(p.startswith("invalid metadata: ") for p in found), found)
    self.assertEqual(
      package_metadata.problems(metadata(Summary=None), README), ["no Summary field"]
    )

  def test_unknown(self):
    self.assertEqual(
      package_metadata.problems(metadata(Summary="UNKNOWN"), README), ["Summary is UNKNOWN"]
    )

  def test_what_packaging_refuses(self):
    for field, value in (
      ("Requires-Python", ">=three"),
      ("Version", "one"),
      ("Metadata-Version", "9.9"),
      ("License-Expression", "Apache 2"),
      ("Home-Pages", "https://example.org"),  # No such field.
    ):
      with self.subTest(field):
        found = package_metadata.problems(metadata(**{field.replace("-", "_"): value}), README)
        self.assertNotEmpty(found)
        self.assertTrue(all(p.startswith("invalid metadata: ") for p in found), found)


class CoreMetadataTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    self.tmp = self.create_tempdir().full_path

  def test_reads_the_wheels_metadata(self):
    path = os.path.join(self.tmp, "haiku_bridge-0.1.0-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as wheel:
      wheel.writestr("haiku_bridge/__init__.py", "")
      wheel.writestr("haiku_bridge-0.1.0.dist-info/METADATA", metadata())
    self.assertEqual(package_metadata.core_metadata(path), metadata())

  def test_reads_the_sdists_top_level_pkg_info(self):
    path = os.path.join(self.tmp, "haiku_bridge-0.1.0.tar.gz")
    with tarfile.open(path, "w:gz") as sdist:
      for name, text in (
        ("haiku_bridge-0.1.0/haiku_bridge.egg-info/PKG-INFO", "Metadata-Version: 2.1\n"),
        ("haiku_bridge-0.1.0/PKG-INFO", metadata()),
      ):
        data = text.encode()
        member = tarfile.TarInfo(name)
        member.size = len(data)
        sdist.addfile(member, io.BytesIO(data))
    self.assertEqual(package_metadata.core_metadata(path), metadata())

  def test_main_says_each_files_result(self):
    good = os.path.join(self.tmp, "good-0.1.0-py3-none-any.whl")
    bad = os.path.join(self.tmp, "bad-0.1.0-py3-none-any.whl")
    for path, text in ((good, metadata()), (bad, metadata(Description_Content_Type=None))):
      with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("x-0.1.0.dist-info/METADATA", text)
    readme = os.path.join(self.tmp, "README.md")
    with open(readme, "w") as f:
      f.write(README)
    for paths, status in (([good], 0), ([good, bad], 1), ([], 2)):
      out = io.StringIO()
      with contextlib.redirect_stdout(out):
        self.assertEqual(package_metadata.main(paths, readme), status)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      package_metadata.main([good, bad], readme)
    self.assertEqual(
      out.getvalue().splitlines()[:3],
      [
        "good-0.1.0-py3-none-any.whl: PASSED",
        "bad-0.1.0-py3-none-any.whl: FAILED",
        "  no Description-Content-Type: twine check reads the description as "
        "reStructuredText (README.md is text/markdown)",
      ],
    )


if __name__ == "__main__":
  absltest.main()
