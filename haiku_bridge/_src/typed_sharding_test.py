"""Tests for typed_sharding: reading an array's typed split, and the mesh's axes."""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl.testing import absltest
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from haiku_bridge._src import typed_sharding


def mesh(*types):
  return jax.make_mesh((2, 4), ("stage", "data"), axis_types=types)


class TypedShardingTest(absltest.TestCase):
  def test_entry_without(self):
    self.assertEqual(
      typed_sharding.entry_without(("stage", "data"), ("stage",)), "data"
    )  # One axis left: as jax writes it, a name.
    self.assertIsNone(typed_sharding.entry_without("stage", ("stage",)))
    self.assertEqual(typed_sharding.entry_without(("a", "b", "c"), ("b",)), ("a", "c"))

  def test_spec_and_sizes_under_an_explicit_mesh(self):
    with jax.set_mesh(mesh(AxisType.Explicit, AxisType.Explicit)):
      a = jax.device_put(jnp.ones([8, 4, 2]), P(("stage", "data")))
      # The type's own split, each axis (jax's spec may leave out the last).
      self.assertEqual(typed_sharding.spec(a), (("stage", "data"), None, None))
      self.assertEqual(jax.typeof(a).sharding.spec[0], ("stage", "data"))
      self.assertEqual(typed_sharding.axis_size(("stage", "data")), 8)
      self.assertEqual(typed_sharding.axis_size("data"), 4)
      self.assertEqual(typed_sharding.axis_size(None), 1)
      b = typed_sharding.without(a, ("stage",))
      self.assertEqual(jax.typeof(b).sharding.spec[0], "data")
      c = jax.device_put(jnp.ones([2, 8]), P("stage", "data"))
      c = typed_sharding.without(c, ("data",))
      self.assertEqual(tuple(jax.typeof(c).sharding.spec), ("stage", None))
    with jax.set_mesh(mesh(AxisType.Explicit, AxisType.Auto)):
      self.assertTrue(typed_sharding.is_explicit("stage"))
      self.assertFalse(typed_sharding.is_explicit("data"))  # Auto.
      self.assertFalse(typed_sharding.is_explicit("model"))  # Not an axis.
    self.assertEqual(typed_sharding.spec(jnp.ones([2, 3])), (None, None))


if __name__ == "__main__":
  absltest.main()
