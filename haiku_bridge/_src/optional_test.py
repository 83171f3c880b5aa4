"""The adapters load on first use; without their library, calling one names the extra."""

from absl.testing import absltest

import haiku_bridge as hkb
from haiku_bridge._src import optional


class OptionalTest(absltest.TestCase):

  def test_a_missing_library_is_named_through_the_error_path(self):
    missing = optional._needs_extra("from_flax", "flax",
                                    ImportError("No module named 'flax'"))
    self.assertEqual(missing.__name__, "from_flax")
    with self.assertRaisesRegex(
        ImportError, r"^hkb\.from_flax: needs the optional dependency 'flax', which could not "
        r"be imported \(No module named 'flax'\)\. Install it with: pip install flax"):
      missing()

  def test_adapters_resolve_to_their_modules(self):
    self.assertEqual(set(optional.ADAPTERS) & set(hkb.__all__), set(optional.ADAPTERS))
    with self.assertRaisesRegex(AttributeError, "no attribute 'from_torch'"):
      optional.module_getattr("from_torch")


if __name__ == "__main__":
  absltest.main()
