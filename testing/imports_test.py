"""What the repository's modules import, read from their source (issue 63: each thing in its house).

- **The package ships only what it uses**: every module of `haiku_bridge/` is reached from
  `haiku_bridge/__init__.py` by its imports (an `import` statement, or a module's dotted name as a
  string: `_src/optional.py` imports the adapters on first use). A module that only tests and
  test helpers use belongs in `testing/` (`testing/hlo_collectives.py`).
- **Only tests import tests**: no module of `haiku_bridge/`, `testing/` or `examples/` but a
  `*_test.py` imports a `*_test` module. What a script or helper needs from a test goes in a module
  of its own (`testing/flops_programs.py`, which `testing/remat_auto_check.py` imports).
"""

import ast
import glob
import os
from typing import Iterator

from absl.testing import absltest

# Under Bazel the test reads the checkout through its runfiles' links (as contributing_test does).
_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def modules(*folders: str) -> dict[str, str]:
  """`{dotted name: path from _ROOT}` of the Python files under `folders`, tests included."""
  found = {}
  for folder in folders:
    for path in glob.glob(os.path.join(_ROOT, folder, "**", "*.py"), recursive=True):
      relative = os.path.relpath(path, _ROOT)
      name = relative[: -len(".py")].replace(os.sep, ".")
      found[name.removesuffix(".__init__")] = relative
  return found


def is_test(name: str) -> bool:
  return name.rsplit(".", 1)[-1].endswith("_test")


def imported_names(path: str, strings: bool = True) -> Iterator[str]:
  """Every dotted name the module at `path` imports, and (with `strings`) every string constant.

  `from a import b` gives both `a` and `a.b` (b may be a module or a name in `a`). The repository
  writes absolute imports only; a relative one is refused, not guessed at.
  """
  with open(os.path.join(_ROOT, path), encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        raise ValueError(f"{path}:{node.lineno}: a relative import; write it absolute")
      yield node.module
      yield from (f"{node.module}.{alias.name}" for alias in node.names)
    elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
      yield node.value


def imports(found: dict[str, str], name: str, strings: bool = True) -> set[str]:
  """The modules of `found` that module `name` imports (with `strings`: or names in a string)."""
  return {n for n in imported_names(found[name], strings) if n in found and n != name}


def reached(found: dict[str, str], start: str) -> set[str]:
  """The modules of `found` that `start` reaches by imports, `start` among them."""
  seen, todo = set(), [start]
  while todo:
    name = todo.pop()
    if name not in seen:
      seen.add(name)
      todo.extend(imports(found, name))
  return seen


class ImportsTest(absltest.TestCase):
  def test_every_package_module_is_reached_from_its_public_face(self):
    library = {n: p for n, p in modules("haiku_bridge").items() if not is_test(n)}
    self.assertIn("haiku_bridge._src.flax_bridge", library)  # The scan sees the files.
    self.assertEqual(
      sorted(set(library) - reached(library, "haiku_bridge")),
      [],
      "a module no import from haiku_bridge/__init__.py reaches is not the library's: "
      "move what only tests use to testing/",
    )

  def test_only_tests_import_test_modules(self):
    found = modules("haiku_bridge", "testing", "examples")
    self.assertIn("testing.remat_auto_check", found)  # The scan sees the files.
    imported = {
      name: sorted(n for n in imports(found, name, strings=False) if is_test(n))
      for name in found
      if not is_test(name)
    }
    self.assertEqual(
      {name: tests for name, tests in imported.items() if tests},
      {},
      "a module that is not a test imports a test module: move what it needs out of the test",
    )

  def test_the_scan_resolves_imports_of_every_form(self):
    found = modules("haiku_bridge")
    # `from haiku_bridge._src import errors`, and a module's name as a string.
    self.assertIn("haiku_bridge._src.errors", imports(found, "haiku_bridge._src.optional"))
    self.assertIn("haiku_bridge._src.flax_bridge", imports(found, "haiku_bridge._src.optional"))
    self.assertIn("haiku_bridge._src.remat", reached(found, "haiku_bridge"))


if __name__ == "__main__":
  absltest.main()
