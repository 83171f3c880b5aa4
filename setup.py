"""setuptools' build of haiku_bridge, as pyproject.toml configures it, less the test files.

Each module's test sits beside it (`_src/layer_scan.py`, `_src/layer_scan_test.py`), and
setuptools puts every module of a package into the wheel: pyproject.toml cannot leave modules out
(`exclude-package-data` filters data files only), so this build step drops `*_test.py`.
setuptools lists the sdist's modules through it too, so neither the wheel nor the sdist ships the
tests (they live in the repository). `//testing:wheel_test` checks both.
"""

import setuptools
from setuptools.command import build_py


class BuildPyWithoutTests(build_py.build_py):
  """`build_py` that leaves out the modules named `*_test`."""

  def find_package_modules(self, package, package_dir):
    return [
      (pkg, module, path)
      for pkg, module, path in super().find_package_modules(package, package_dir)
      if not module.endswith("_test")
    ]


setuptools.setup(cmdclass={"build_py": BuildPyWithoutTests})
