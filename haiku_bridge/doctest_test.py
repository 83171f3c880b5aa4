"""Runs every `>>>` example in haiku_bridge's docstrings, one test per docstring.

Examples come from the public names (`haiku_bridge.__all__`: functions, classes and their public
methods) and from every module of `haiku_bridge/_src/` (the module docstring, its functions and
classes), the optional-library adapters included. Each example runs in a fresh namespace holding
only the names below, so it must define or import whatever else it uses: an example is what a
user can paste.
"""

import doctest
import importlib
import inspect
import pkgutil
import re
import types

import jax

from testing import devices

devices.use_cpu_devices()  # The sharding examples use a mesh of 8 devices.

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

import haiku_bridge as hkb
from haiku_bridge import _src

OPTION_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# Optional libraries: in the namespace where installed (the Bazel venv has them all). Without one,
# the adapter for it and the examples that use it are left out.
OPTIONAL_MODULES = {"nnx": "flax.nnx", "eqx": "equinox", "optax": "optax"}
OPTIONAL_LIBRARIES = ("flax", "equinox", "optax")
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
  """The names every example may use without importing them."""
  names = dict(hk=hk, hkb=hkb, jax=jax, jnp=jnp, np=np, P=P)
  for name, module in OPTIONAL_MODULES.items():
    try:
      names[name] = importlib.import_module(module)
    except ImportError:
      pass
  return names


def public_objects() -> list[tuple[str, object]]:
  """`("hkb.<name>", object)` for each name in `__all__`; adapters import their module here."""
  return [(f"hkb.{name}", getattr(hkb, name)) for name in hkb.__all__]


def source_modules() -> list[types.ModuleType]:
  """Every module under haiku_bridge/_src/ except the tests (and adapters for missing libraries)."""
  modules = []
  for info in pkgutil.iter_modules(_src.__path__):
    if info.name.endswith("_test"):
      continue
    try:
      modules.append(importlib.import_module(f"{_src.__name__}.{info.name}"))
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
    recurse_finder = (doctest.DocTestFinder(recurse=False)
                      if inspect.ismodule(obj) else finder)
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

  def test_specs_read_alike_on_every_jax(self):
    checker = OutputChecker()
    self.assertTrue(checker.check_output("P(None, 'x')\n", "PartitionSpec(None, 'x')\n", 0))
    self.assertFalse(checker.check_output("P(None, 'x')\n", "PartitionSpec('x',)\n", 0))

  @parameterized.named_parameters(
      (method_name(test), test) for test in EXAMPLES)
  def test_example(self, test: doctest.DocTest):
    test.globs = namespace()
    missing = [name for name in OPTIONAL_MODULES if name not in test.globs
               and re.search(rf"\b{name}\.", test.docstring)]
    if missing:
      self.skipTest(f"{test.name} uses {missing}, which are not installed.")
    for name, since in NEWER_JAX.items():
      if name in test.docstring and missing_jax_name(name):
        self.skipTest(f"{test.name} uses {name}, which needs jax >= {since} (this is jax "
                      f"{jax.__version__}).")
    report = []
    runner = doctest.DocTestRunner(checker=OutputChecker(), optionflags=OPTION_FLAGS)
    try:
      result = runner.run(test, out=report.append, clear_globs=True)
    finally:
      hkb.clear_caches()  # No example sees what an earlier one left in the caches.
    if result.failed:
      self.fail(f"{result.failed} of {result.attempted} examples of {test.name} failed "
                f"({test.filename}:{test.lineno}):\n{''.join(report)}")


if __name__ == "__main__":
  absltest.main()
