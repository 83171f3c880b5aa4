"""A built sdist's and wheel's core metadata, checked as the package index and `twine check` read it.

The core metadata is the wheel's `*.dist-info/METADATA` and the sdist's top-level `PKG-INFO`. It
passes when:

- `packaging.metadata.Metadata.from_email(..., validate=True)` reads it without an error: a known
  Metadata-Version, the required Name and Version, every field known and well formed (a
  Description-Content-Type of a known type, its charset UTF-8);
- no field is `UNKNOWN` (what older setuptools wrote for a value pyproject.toml did not give);
- it has a Summary, and its long description is README.md, declared as `text/markdown`. Markdown
  renders whatever it holds; what `twine check` fails is a description without a content type,
  which it reads as reStructuredText, and this README is not valid reStructuredText.

`//testing:wheel_test` runs `problems` on the sdist and the wheel it builds. Before an upload
(RELEASING.md), from the repository root:

    python -m testing.package_metadata dist/*
"""

import email.message
import email.parser
import os
import sys
import tarfile
import zipfile

from packaging import metadata

_README_TYPE = "text/markdown"
_REQUIRED = ("Metadata-Version", "Name", "Version", "Summary")


def core_metadata(path: str) -> str:
  """The core metadata of the sdist (`.tar.gz`) or wheel (`.whl`) at `path`."""
  if path.endswith(".whl"):
    with zipfile.ZipFile(path) as wheel:
      (name,) = [
        n for n in wheel.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")
      ]
      return wheel.read(name).decode()
  if path.endswith(".tar.gz"):
    with tarfile.open(path) as sdist:
      # `<name>-<version>/PKG-INFO`; the egg-info folder holds another copy.
      (member,) = [
        m for m in sdist.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")
      ]
      return sdist.extractfile(member).read().decode()
  raise ValueError(f"{path}: neither a wheel (.whl) nor an sdist (.tar.gz)")


def _content_type(message: email.message.Message) -> str | None:
  """The Description-Content-Type without its parameters (packaging checks the charset)."""
  if message["Description-Content-Type"] is None:
    return None
  header = email.message.Message()
  header["Content-Type"] = message["Description-Content-Type"]
  return header.get_content_type()


def problems(text: str, readme: str) -> list[str]:
  """What the index or `twine check` would refuse in core metadata `text`; [] where nothing.

  Args:
    text: a METADATA or PKG-INFO file's text.
    readme: the README's text, which must be the long description.

  Returns:
    One line per problem, naming the field.
  """
  found = []
  try:
    metadata.Metadata.from_email(text, validate=True)
  except ExceptionGroup as group:
    found += [f"invalid metadata: {error}" for error in group.exceptions]
  message = email.parser.Parser().parsestr(text)
  found += [f"no {field} field" for field in _REQUIRED if not message[field]]
  found += [f"{field} is UNKNOWN" for field, value in message.items() if value.strip() == "UNKNOWN"]
  description = message.get_payload() or message["Description"] or ""
  content_type = _content_type(message)
  if not description.strip() or description.strip() == "UNKNOWN":
    found.append("no long description (twine check: `long_description` missing)")
  elif description.rstrip("\n") != readme.rstrip("\n"):
    found.append("the long description is not README.md")
  if content_type is None:
    found.append(
      "no Description-Content-Type: twine check reads the description as reStructuredText "
      f"(README.md is {_README_TYPE})"
    )
  elif content_type != _README_TYPE:
    found.append(f"Description-Content-Type is {content_type}, README.md is {_README_TYPE}")
  return found


def main(paths: list[str], readme_path: str = "README.md") -> int:
  """Prints each file's problems; 0 where every file has none, else 1."""
  if not paths:
    print("usage: python -m testing.package_metadata DIST_FILE... (from the repository root)")
    return 2
  with open(readme_path) as f:
    readme = f.read()
  failed = False
  for path in paths:
    found = problems(core_metadata(path), readme)
    failed |= bool(found)
    print(f"{os.path.basename(path)}: " + ("PASSED" if not found else "FAILED"))
    for problem in found:
      print(f"  {problem}")
  return int(failed)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
