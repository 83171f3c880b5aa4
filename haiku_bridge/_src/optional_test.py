"""The adapters load on first use; without their library, calling one names the extra."""

import importlib
import types

from absl.testing import absltest

import haiku_bridge as hkb
from haiku_bridge._src import optional


class OptionalTest(absltest.TestCase):
  def test_a_missing_library_is_named_through_the_error_path(self):
    cause = ImportError("No module named 'flax'")
    missing = optional._needs_extra("from_flax", "flax", cause)
    self.assertEqual(missing.__name__, "from_flax")
    with self.assertRaisesRegex(
      ImportError,
      r"^hkb\.from_flax: needs the optional dependency 'flax', which could not "
      r"be imported \(No module named 'flax'\)\. Install it with: pip install flax",
    ) as raised:
      missing()
    self.assertIs(raised.exception.__cause__, cause)  # The traceback shows the import's.

  def test_each_extra_is_the_library_its_module_imports(self):
    for name, (module, extra) in optional.ADAPTERS.items():
      try:
        loaded = importlib.import_module(module)
      except ImportError:
        continue  # The library is not installed here.
      imported = {
        value.__name__.split(".")[0]
        for value in vars(loaded).values()
        if isinstance(value, types.ModuleType)
      }
      self.assertIn(extra, imported, name)

  def test_adapters_resolve_to_their_modules(self):
    self.assertEqual(set(optional.ADAPTERS) & set(hkb.__all__), set(optional.ADAPTERS))
    with self.assertRaisesRegex(AttributeError, "no attribute 'from_torch'"):
      optional.module_getattr("from_torch")


if __name__ == "__main__":
  absltest.main()
