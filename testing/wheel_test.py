"""The package builds, installs from its wheel alone, and runs the README's quickstart.

As a user would: `python -m build` makes the sdist and, from it, the wheel; the wheel is installed
into a fresh virtual environment with its `flax` and `equinox` extras, and the quickstart runs there,
from an empty directory, so that the installed package is what is imported, not this checkout. A
module or a file missing from the wheel, a test file in it (`*_test.py` stay in the source tree:
setup.py leaves them out), a dependency or an extra that the package does not declare, or a
version that disagrees with the package's fails here. So does a package without its licence: the
LICENSE (Apache-2.0, the text jax, dm-haiku, Flax and Optax ship) and NOTICE must be in the sdist
and the wheel, and the metadata must name the licence, the authors, the project's URLs, its
classifiers and keywords. The core metadata of both must pass what the package index and
`twine check --strict` check (`testing/package_metadata.py`): valid fields, none UNKNOWN, and the
README as the long description, declared Markdown.

Offline, as `testing/installed_package.py` builds and installs it.
"""

import email.parser
import importlib.metadata
import json
import os
import re
import shutil
import tarfile
import tempfile
import textwrap
import zipfile

from absl.testing import absltest

from testing import installed_package
from testing import package_metadata

_ROOT = installed_package.ROOT
_EXTRAS = ("flax", "equinox")
_LICENSE_FILES = ("LICENSE", "NOTICE")

# Run in the fresh environment after the quickstart: where haiku_bridge came from, and whether
# each of its modules and adapters imports.
_CHECKS = textwrap.dedent("""
    import importlib
    import importlib.metadata
    import json
    import sys
    import haiku_bridge

    modules = json.loads(sys.argv[1])
    failed = {}
    for module in modules:
      try:
        importlib.import_module(module)
      except Exception as e:  # pylint: disable=broad-except
        failed[module] = repr(e)
    print(json.dumps({
        "file": haiku_bridge.__file__,
        "version": haiku_bridge.__version__,
        "metadata_version": importlib.metadata.version("haiku-bridge"),
        "failed": failed,
        "adapters": {name: getattr(haiku_bridge, name).__module__
                     for name in ("from_flax", "to_nnx", "from_equinox", "to_equinox")},
    }))
""")


def quickstart(readme: str) -> str:
  """The Python snippet of the README's Quickstart section."""
  return re.search(r"^## Quickstart\n.*?^```python\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)[1]


def package_files(root: str, tests: bool = False) -> set[str]:
  """The package's files under `root`: its modules (and tests) and py.typed, relative to `root`."""
  found = set()
  for directory, subdirs, files in os.walk(os.path.join(root, "haiku_bridge")):
    subdirs[:] = [d for d in subdirs if d != "__pycache__"]
    found |= {
      os.path.relpath(os.path.join(directory, f), root)
      for f in files
      if (f.endswith(".py") and (tests or not f.endswith("_test.py"))) or f == "py.typed"
    }
  return found


def installed_license(distribution: str) -> str:
  """The LICENSE text that an installed distribution ships in its metadata."""
  files = importlib.metadata.distribution(distribution).files or []
  path = next(f for f in files if f.name == "LICENSE")
  return path.read_text()


def read(path: str) -> str:
  with open(os.path.join(_ROOT, path)) as f:
    return f.read()


def module_names(files: set[str]) -> list[str]:
  """The importable modules among `files`, tests left out."""
  return sorted(
    f[: -len(".py")].replace(os.sep, ".").removesuffix(".__init__")
    for f in files
    if f.endswith(".py") and not f.endswith("_test.py")
  )


class WheelTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    cls.src = os.path.join(cls.tmp, "src")
    installed_package.copy_project(cls.src)
    # A test beside its module, as in a checkout (Bazel's runfiles hold none): the build must
    # leave it out.
    with open(os.path.join(cls.src, "haiku_bridge", "_src", "layer_scan_test.py"), "w") as f:
      f.write("raise AssertionError('a test file was packaged')\n")
    cls.dist = os.path.join(cls.tmp, "dist")
    cls.build = installed_package.build(cls.src, cls.dist)

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.tmp, ignore_errors=True)
    super().tearDownClass()

  def built(self) -> tuple[str, str]:
    """The sdist and the wheel that `python -m build` made."""
    self.assertEqual(
      self.build.returncode,
      0,
      f"python -m build failed:\n{self.build.stdout[-3000:]}\n{self.build.stderr[-3000:]}",
    )
    files = sorted(os.listdir(self.dist))
    self.assertLen(files, 2, files)
    sdist, wheel = sorted(files, key=lambda f: f.endswith(".whl"))
    self.assertRegex(sdist, r"^haiku_bridge-[\d.]+\.tar\.gz$")
    self.assertRegex(wheel, r"^haiku_bridge-[\d.]+-py3-none-any\.whl$")
    return os.path.join(self.dist, sdist), os.path.join(self.dist, wheel)

  def test_wheel_holds_the_package_and_declares_the_extras(self):
    _, wheel = self.built()
    with zipfile.ZipFile(wheel) as z:
      names = set(z.namelist())
      metadata_file = next(n for n in names if n.endswith(".dist-info/METADATA"))
      metadata = email.parser.Parser().parsestr(z.read(metadata_file).decode())
    in_wheel = {n for n in names if n.startswith("haiku_bridge/")}
    expected = {f.replace(os.sep, "/") for f in package_files(self.src)}
    self.assertIn("haiku_bridge/py.typed", expected)
    self.assertIn("haiku_bridge/_src/layer_scan.py", expected)
    self.assertEqual(sorted(n for n in names if n.endswith("_test.py")), [])
    self.assertEqual(in_wheel, expected)
    self.assertContainsSubset(
      set(_EXTRAS) | {"docs", "test"}, set(metadata.get_all("Provides-Extra"))
    )

  def test_license_is_apache_2_as_jax_ships_it(self):
    self.assertEqual(read("LICENSE"), installed_license("jax"))
    self.assertIn("Copyright 2026 The haiku_bridge Authors.", read("NOTICE"))

  def test_sdist_and_wheel_ship_the_license(self):
    sdist, wheel = self.built()
    with tarfile.open(sdist) as tar:
      root = tar.getnames()[0].split("/")[0]
      in_sdist = {
        name: tar.extractfile(f"{root}/{name}").read().decode() for name in _LICENSE_FILES
      }
    with zipfile.ZipFile(wheel) as z:
      dist_info = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA")).split("/")[0]
      in_wheel = {name: z.read(f"{dist_info}/licenses/{name}").decode() for name in _LICENSE_FILES}
    expected = {name: read(name) for name in _LICENSE_FILES}
    self.assertEqual(in_sdist, expected)
    self.assertEqual(in_wheel, expected)

  def test_metadata_names_licence_authors_urls_and_classifiers(self):
    _, wheel = self.built()
    with zipfile.ZipFile(wheel) as z:
      metadata = email.parser.Parser().parsestr(
        z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
      )
    self.assertEqual(metadata["License-Expression"], "Apache-2.0")
    self.assertEqual(sorted(metadata.get_all("License-File")), sorted(_LICENSE_FILES))
    self.assertEqual(metadata["Author"], "The haiku_bridge Authors")
    urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL"))
    self.assertContainsSubset({"Homepage", "Documentation", "Source", "Issues"}, set(urls))
    for url in urls.values():
      self.assertStartsWith(url, "https://")
    classifiers = set(metadata.get_all("Classifier"))
    self.assertContainsSubset(
      {
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Science/Research",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
      },
      classifiers,
    )
    # The licence is the SPDX expression above; a `License ::` classifier would restate it.
    self.assertEqual([c for c in classifiers if c.startswith("License ::")], [])
    self.assertIn("haiku", metadata["Keywords"].split(","))

  def test_core_metadata_passes_the_index_checks(self):
    for path in self.built():
      with self.subTest(os.path.basename(path)):
        self.assertEqual(
          package_metadata.problems(package_metadata.core_metadata(path), read("README.md")), []
        )

  def test_sdist_holds_no_tests_either(self):
    # setuptools lists the sdist's modules as the wheel's: the tests live in the repository.
    sdist, _ = self.built()
    with tarfile.open(sdist) as tar:
      names = tar.getnames()
    self.assertTrue(any(n.endswith("haiku_bridge/_src/layer_scan.py") for n in names), names)
    self.assertEqual([n for n in names if n.endswith("_test.py")], [])

  def test_installed_wheel_runs_the_quickstart(self):
    _, wheel = self.built()
    python, purelib = installed_package.fresh_venv(os.path.join(self.tmp, "venv"))
    status, output, unprovided = installed_package.install(python, wheel, _EXTRAS)
    self.assertEqual(status, 0, f"pip install failed:\n{output[-3000:]}")
    self.assertEqual(unprovided, [])

    with open(os.path.join(_ROOT, "README.md")) as f:
      script = quickstart(f.read()) + _CHECKS
    modules = module_names(package_files(self.src))
    workdir = os.path.join(self.tmp, "empty")
    os.makedirs(workdir)
    ran = installed_package.run(
      [python, "-c", script, json.dumps(modules)], cwd=workdir, env=installed_package.clean_env()
    )
    self.assertEqual(ran.returncode, 0, f"the quickstart failed:\n{ran.stderr[-3000:]}")
    report = json.loads(ran.stdout.strip().splitlines()[-1])

    self.assertTrue(report["file"].startswith(purelib + os.sep), report["file"])
    self.assertEqual(report["failed"], {})
    self.assertIn("haiku_bridge._src.flax_bridge", modules)
    self.assertEqual(
      report["adapters"],
      {
        "from_flax": "haiku_bridge._src.flax_bridge",
        "to_nnx": "haiku_bridge._src.flax_bridge",
        "from_equinox": "haiku_bridge._src.equinox_bridge",
        "to_equinox": "haiku_bridge._src.equinox_bridge",
      },
    )
    version = re.match(r"haiku_bridge-([\d.]+)-", os.path.basename(wheel))[1]
    self.assertEqual((report["version"], report["metadata_version"]), (version, version))

  def test_package_files_leaves_tests_out(self):
    # A tree of its own: Bazel's runfiles hold the package's modules, not its tests.
    root = tempfile.mkdtemp(dir=self.tmp)
    os.makedirs(os.path.join(root, "haiku_bridge", "_src"))
    for name in ("__init__.py", "py.typed", "_src/layer_scan.py", "_src/layer_scan_test.py"):
      open(os.path.join(root, "haiku_bridge", name), "w").close()
    files = package_files(root)
    self.assertEqual(
      files,
      {"haiku_bridge/__init__.py", "haiku_bridge/py.typed", "haiku_bridge/_src/layer_scan.py"},
    )
    self.assertEqual(
      package_files(root, tests=True), files | {"haiku_bridge/_src/layer_scan_test.py"}
    )

  def test_module_names(self):
    files = {
      "haiku_bridge/__init__.py",
      "haiku_bridge/py.typed",
      "haiku_bridge/_src/layer_scan.py",
      "haiku_bridge/_src/layer_scan_test.py",
    }
    self.assertEqual(module_names(files), ["haiku_bridge", "haiku_bridge._src.layer_scan"])


if __name__ == "__main__":
  absltest.main()
