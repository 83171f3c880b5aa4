"""Runs every `>>>` example in haiku_bridge's docstrings, one test per docstring.

Examples come from the public names (`haiku_bridge.__all__`: functions, classes and their public
methods) and from every module of `haiku_bridge/_src/` and of its packages (the module docstring,
its functions and classes), the optional-library adapters included. Each example runs in a fresh
namespace holding only `hk`, `hkb`, `jax`, `jnp` and `np`, so it must define or import whatever else
it uses (`PartitionSpec`, `nnx`, `eqx`, ...): an example is what a user can paste after
`import haiku as hk, haiku_bridge as hkb, jax, jax.numpy as jnp, numpy as np`. An example that
needs more devices than one says so in a comment, `# Needs 8 devices ...`, which this harness reads
(it gives 8 CPU devices, and skips an example that needs more than there are).
"""

import doctest
import importlib
import importlib.util
import inspect
import pkgutil
import re
import types

import jax

from testing import devices

devices.use_cpu_devices(8)  # The sharding examples use a mesh of 8 devices.

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from haiku_bridge import _src

OPTION_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# Optional libraries, which examples import themselves (the Bazel venv has them all). Without one,
# the adapter for it and the examples that import it are left out.
OPTIONAL_LIBRARIES = ("flax", "equinox", "optax")
# `# Needs 8 devices`: an example that needs that many (a mesh) says so.
NEEDS_DEVICES = re.compile(r"#\s*Needs (\d+) devices")
# What builds a mesh, whose examples must say how many devices they need.
MAKES_MESH = re.compile(r"\bjax\.make_mesh\(|\bMesh\(")
# JAX names that examples use and older supported jax lacks: the jax version that added each. An
# example using one is skipped on older jax, saying so.
NEWER_JAX = {"jax.set_mesh": "0.7.0"}


class OutputChecker(doctest.OutputChecker):
  """Reads `PartitionSpec(...)` as `P(...)`: how jax >= 0.9.2 prints a spec, and the examples."""

  def check_output(self, want: str, got: str, optionflags: int) -> bool:
    return super().check_output(want, got.replace("PartitionSpec(", "P("), optionflags)


def missing_jax_name(dotted: str) -> bool:
  obj = jax
  for part in dotted.split(".")[1:]:
    if not hasattr(obj, part):
      return True
    obj = getattr(obj, part)
  return False


def namespace() -> dict[str, object]:
  """The names every example may use without importing them: these five, no more."""
  return dict(hk=hk, hkb=hkb, jax=jax, jnp=jnp, np=np)


def missing_libraries(docstring: str) -> list[str]:
  """The optional libraries that `docstring`'s examples import and this environment lacks."""
  imported = re.findall(r"^\s*(?:>>>|\.\.\.)\s+(?:from|import)\s+(\w+)", docstring, re.MULTILINE)
  missing = []
  for library in dict.fromkeys(imported):
    if library in OPTIONAL_LIBRARIES and importlib.util.find_spec(library) is None:
      missing.append(library)
  return missing


def devices_needed(docstring: str) -> int:
  """The devices an example says it needs (`# Needs 8 devices`); 1 if it says nothing."""
  return max([int(n) for n in NEEDS_DEVICES.findall(docstring)], default=1)


def public_objects() -> list[tuple[str, object]]:
  """`("hkb.<name>", object)` for each name in `__all__`; adapters import their module here."""
  return [(f"hkb.{name}", getattr(hkb, name)) for name in hkb.__all__]


def source_modules() -> list[types.ModuleType]:
  """Every module under haiku_bridge/_src/ and its packages, less the tests (and absent adapters)."""
  modules = []
  for info in pkgutil.walk_packages(_src.__path__, f"{_src.__name__}."):
    if info.name.endswith("_test"):
      continue
    try:
      modules.append(importlib.import_module(info.name))
    except ModuleNotFoundError as e:
      if (e.name or "").split(".")[0] not in OPTIONAL_LIBRARIES:
        raise
  return modules


def find_examples() -> list[doctest.DocTest]:
  """Each docstring with examples, once: public names first, then the modules' own objects."""
  finder = doctest.DocTestFinder()
  found = {}
  for name, obj in public_objects():
    # `hkb.hk` is a module that falls through to Haiku's: its own docstring only.
    recurse_finder = doctest.DocTestFinder(recurse=False) if inspect.ismodule(obj) else finder
    module = inspect.getmodule(obj)
    for test in recurse_finder.find(obj, name, module=module or False, globs={}):
      if test.examples and is_public(test.name):
        found.setdefault(docstring_key(test), test)
  for module in source_modules():
    for test in finder.find(module, module.__name__, globs={}):
      if test.examples:
        found.setdefault(docstring_key(test), test)
  return sorted(found.values(), key=lambda t: t.name)


def is_public(name: str) -> bool:
  """`hkb.ShardingRules.place` yes; `hkb.ShardingRules._match` no (`__init__` yes)."""
  last = name.rsplit(".", 1)[-1]
  return not last.startswith("_") or (last.startswith("__") and last.endswith("__"))


def docstring_key(test: doctest.DocTest) -> tuple[object, ...]:
  return (test.filename, test.lineno, test.docstring)


def method_name(test: doctest.DocTest) -> str:
  return re.sub(r"\W", "_", test.name)


EXAMPLES = find_examples()


class DoctestTest(parameterized.TestCase):
  def test_examples_found(self):
    # Guards the finder: a handful of modules carry examples today.
    files = {test.filename for test in EXAMPLES}
    self.assertGreaterEqual(len(files), 5, sorted(files))
    # It walks the packages of _src/ too.
    self.assertIn("haiku_bridge._src.remat.loop", [m.__name__ for m in source_modules()])

  def test_specs_read_alike_on_every_jax(self):
    checker = OutputChecker()
    self.assertTrue(checker.check_output("P(None, 'x')\n", "PartitionSpec(None, 'x')\n", 0))
    self.assertFalse(checker.check_output("P(None, 'x')\n", "PartitionSpec('x',)\n", 0))

  def test_examples_get_five_names(self):
    self.assertEqual(sorted(namespace()), ["hk", "hkb", "jax", "jnp", "np"])

  def test_examples_with_a_mesh_say_how_many_devices(self):
    silent = [
      test.name
      for test in EXAMPLES
      if MAKES_MESH.search(test.docstring) and devices_needed(test.docstring) < 2
    ]
    self.assertEqual(silent, [])
    self.assertEqual(devices_needed(">>> m = jax.make_mesh((8,), ('d',))  # Needs 8 devices."), 8)

  def test_missing_libraries_reads_the_imports(self):
    self.assertEqual(missing_libraries(">>> import numpy\n>>> from haiku_bridge import x"), [])
    self.assertEqual(missing_libraries(">>> import flax_not_installed_here"), [])

  @parameterized.named_parameters((method_name(test), test) for test in EXAMPLES)
  def test_example(self, test: doctest.DocTest):
    test.globs = namespace()
    missing = missing_libraries(test.docstring)
    if missing:
      self.skipTest(f"{test.name} imports {missing}, which are not installed.")
    needed = devices_needed(test.docstring)
    if needed > len(jax.devices()):
      self.skipTest(f"{test.name} needs {needed} devices; there are {len(jax.devices())}.")
    for name, since in NEWER_JAX.items():
      if name in test.docstring and missing_jax_name(name):
        self.skipTest(
          f"{test.name} uses {name}, which needs jax >= {since} (this is jax {jax.__version__})."
        )
    report = []
    runner = doctest.DocTestRunner(checker=OutputChecker(), optionflags=OPTION_FLAGS)
    try:
      result = runner.run(test, out=report.append, clear_globs=True)
    finally:
      hkb.clear_caches()  # No example sees what an earlier one left in the caches.
    if result.failed:
      self.fail(
        f"{result.failed} of {result.attempted} examples of {test.name} failed "
        f"({test.filename}:{test.lineno}):\n{''.join(report)}"
      )


if __name__ == "__main__":
  absltest.main()
