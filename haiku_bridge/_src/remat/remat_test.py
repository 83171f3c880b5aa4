"""The remat package is entered through its `__init__.py` only: no module outside imports one inside; inside, only `tracing.py` reads JAX's internals."""

import ast
import os
from typing import Iterator

from absl.testing import absltest

import haiku_bridge
from haiku_bridge._src import remat

_LIBRARY = os.path.dirname(haiku_bridge.__file__)
_PACKAGE = os.path.dirname(remat.__file__)
_INSIDE = {
  f[: -len(".py")] for f in os.listdir(_PACKAGE) if f.endswith(".py") and f != "__init__.py"
}


def names_read(source: str) -> Iterator[str]:
  """The dotted names `source` imports (each module, and each `module.name` imported from it) or reads off `jax` (`jax.core`)."""
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      yield node.module
      yield from (f"{node.module}.{alias.name}" for alias in node.names)
    elif (
      isinstance(node, ast.Attribute)
      and isinstance(node.value, ast.Name)
      and node.value.id == "jax"
    ):
      yield f"jax.{node.attr}"


def modules_inside(source: str) -> set[str]:
  """The package's own modules `source` imports (`from ...remat import loop`, `...remat.loop`)."""
  found = set()
  for name in names_read(source):
    parts = name.split(".")
    if parts[:3] == ["haiku_bridge", "_src", "remat"] and len(parts) > 3 and (parts[3] in _INSIDE):
      found.add(parts[3])
  return found


# JAX's internals: what its public API (`jax`, `jax.numpy`, `jax.lax`, ...) does not promise to keep.
_JAX_INTERNALS = ("jax._src", "jax.core", "jax.extend", "jax.interpreters")


def jax_internals(source: str) -> set[str]:
  """The modules of JAX's internals `source` imports or reads (`from jax._src import config`, `jax.core.Tracer`)."""
  return {
    internal
    for name in names_read(source)
    for internal in _JAX_INTERNALS
    if name == internal or name.startswith(internal + ".")
  }


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
    for module in (
      "__init__.py",
      "_src/layer_scan.py",
      "_src/time_scan.py",
      "_src/pipeline/stage_program.py",
    ):
      self.assertIn(module.replace("/", os.sep), read)

  def test_the_check_sees_a_module_inside(self):
    self.assertEqual(
      modules_inside(
        "from haiku_bridge._src.remat import plan as p\n"
        "import haiku_bridge._src.remat.loop\n"
        "from haiku_bridge._src.remat.schedule import nested\n"
        "from haiku_bridge._src import remat\n"
        "from haiku_bridge._src.remat import Loop\n"
      ),
      {"plan", "loop", "schedule"},
    )


class JaxInternalsTest(absltest.TestCase):
  def test_only_tracing_reads_jax_internals(self):
    readers = {}
    for module in sorted(_INSIDE):
      if module.endswith("_test"):
        continue
      with open(os.path.join(_PACKAGE, f"{module}.py")) as f:
        internals = jax_internals(f.read())
      if internals:
        readers[module] = internals
    self.assertEqual(list(readers), ["tracing"])
    self.assertIn("jax._src", readers["tracing"])  # Guards the walk.

  def test_the_check_sees_each_kind_of_read(self):
    self.assertEqual(
      jax_internals(
        "from jax._src import config\n"
        "import jax.extend.core\n"
        "from jax.interpreters import ad\n"
        "t = jax.core.Tracer\n"
        "import jax.numpy as jnp\n"
        "from jax import lax\n"
        "jax.tree.map(f, x)\n"
      ),
      {"jax._src", "jax.extend", "jax.interpreters", "jax.core"},
    )
    self.assertEqual(jax_internals("from jax import core\n"), {"jax.core"})


if __name__ == "__main__":
  absltest.main()
