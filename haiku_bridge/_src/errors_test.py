"""Tests for errors: the public call's name on every message."""

from absl.testing import absltest
import jax
import jax.numpy as jnp

from haiku_bridge._src import errors


class ErrorsTest(absltest.TestCase):

  def test_innermost_entry_names_the_message(self):
    with errors.entry("layer_scan"):
      self.assertEqual(errors.message("x"), "hkb.layer_scan: x")
      with errors.entry("custom_vjp"):
        self.assertEqual(errors.message("y"), "hkb.custom_vjp: y")
      self.assertEqual(errors.message("z"), "hkb.layer_scan: z")

  def test_entry_restored_after_an_error(self):
    with self.assertRaises(ValueError):
      with errors.entry("repeat_layer"):
        raise ValueError()
    self.assertEqual(errors.api(), "call_pure")

  def test_formatting(self):
    self.assertEqual(errors.type_str(jnp.zeros([4, 3], jnp.bfloat16)),
                     "bfloat16[4, 3]")
    self.assertEqual(errors.type_str(jax.ShapeDtypeStruct((), jnp.int32)),
                     "int32[]")
    path = jax.tree_util.tree_leaves_with_path({"w": [0]})[0][0]
    self.assertEqual(errors.keystr(path), "['w'][0]")
    self.assertEqual(errors.keystr(()), "<root>")

  def test_describe(self):
    self.assertEqual(errors.describe((1, 2)), "a tuple of length 2")
    self.assertEqual(errors.describe(jnp.zeros([2], jnp.int32)),
                     "an array int32[2]")
    self.assertEqual(errors.describe({}), "a dict")

  def test_looks_like_a_shard(self):
    self.assertTrue(errors.looks_like_a_shard((4, 1), (4, 8)))
    self.assertFalse(errors.looks_like_a_shard((4, 6), (4, 8)))
    self.assertFalse(errors.looks_like_a_shard((4, 8), (4, 8)))


if __name__ == "__main__":
  absltest.main()
