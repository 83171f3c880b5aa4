"""The remat package is entered through its `__init__.py` only: no module outside imports one inside."""

import ast
import os

from absl.testing import absltest

import haiku_bridge
from haiku_bridge._src import remat

_LIBRARY = os.path.dirname(haiku_bridge.__file__)
_PACKAGE = os.path.dirname(remat.__file__)
_INSIDE = {f[:-len(".py")] for f in os.listdir(_PACKAGE)
           if f.endswith(".py") and f != "__init__.py"}


def modules_inside(source: str) -> set[str]:
  """The package's own modules `source` imports (`from ...remat import loop`, `...remat.loop`)."""
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      names = [node.module] + [f"{node.module}.{alias.name}"
                               for alias in node.names]
    else:
      continue
    for name in names:
      parts = name.split(".")
      if parts[:3] == ["haiku_bridge", "_src", "remat"] and len(parts) > 3 and (
          parts[3] in _INSIDE):
        found.add(parts[3])
  return found


class EntryPointTest(absltest.TestCase):

  def test_the_library_imports_only_the_entry_point(self):
    importers, read = {}, set()
    for directory, _, files in os.walk(_LIBRARY):
      if os.path.commonpath([directory, _PACKAGE]) == _PACKAGE:
        continue
      for name in files:
        if name.endswith(".py") and not name.endswith("_test.py"):
          path = os.path.join(directory, name)
          with open(path) as f:
            inside = modules_inside(f.read())
          read.add(os.path.relpath(path, _LIBRARY))
          if inside:
            importers[os.path.relpath(path, _LIBRARY)] = inside
    self.assertEqual(importers, {})
    # Guards the walk: the modules that use the machinery were read.
    for module in ("__init__.py", "_src/scan.py", "_src/time_scan.py",
                   "_src/pipeline/stages.py"):
      self.assertIn(module.replace("/", os.sep), read)

  def test_the_check_sees_a_module_inside(self):
    self.assertEqual(
        modules_inside("from haiku_bridge._src.remat import plan as p\n"
                       "import haiku_bridge._src.remat.loop\n"
                       "from haiku_bridge._src.remat.schedule import nested\n"
                       "from haiku_bridge._src import remat\n"
                       "from haiku_bridge._src.remat import Loop\n"),
        {"plan", "loop", "schedule"})


if __name__ == "__main__":
  absltest.main()
