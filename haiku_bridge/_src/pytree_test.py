"""Tests for pytree: shape records of arrays, tracers and Python scalars."""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import pytree


class SpecTest(absltest.TestCase):

  def test_arrays_scalars_and_tracers(self):
    self.assertEqual(pytree.spec(np.zeros([2, 3], np.int32)),
                     jax.ShapeDtypeStruct((2, 3), jnp.int32))
    self.assertEqual(pytree.spec(1.5), jax.ShapeDtypeStruct((), jnp.float32))
    seen = []
    jax.jit(lambda x: seen.append(pytree.spec(x)))(jnp.ones([4], jnp.bfloat16))
    self.assertEqual(seen, [jax.ShapeDtypeStruct((4,), jnp.bfloat16)])

  def test_specs_keeps_structure(self):
    self.assertEqual(pytree.specs({"w": jnp.ones([2]), "b": [jnp.zeros([])]}),
                     {"w": jax.ShapeDtypeStruct((2,), jnp.float32),
                      "b": [jax.ShapeDtypeStruct((), jnp.float32)]})


if __name__ == "__main__":
  absltest.main()
