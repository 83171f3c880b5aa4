"""Tests for pytree: shape records of arrays, tracers and Python scalars."""

from absl.testing import absltest
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import pytree


class SpecTest(absltest.TestCase):
  def test_arrays_scalars_and_tracers(self):
    self.assertEqual(
      pytree.spec(np.zeros([2, 3], np.int32)), jax.ShapeDtypeStruct((2, 3), jnp.int32)
    )
    self.assertEqual(pytree.spec(1.5), jax.ShapeDtypeStruct((), jnp.float32))
    seen = []
    jax.jit(lambda x: seen.append(pytree.spec(x)))(jnp.ones([4], jnp.bfloat16))
    self.assertEqual(seen, [jax.ShapeDtypeStruct((4,), jnp.bfloat16)])

  def test_specs_keeps_structure(self):
    self.assertEqual(
      pytree.specs({"w": jnp.ones([2]), "b": [jnp.zeros([])]}),
      {"w": jax.ShapeDtypeStruct((2,), jnp.float32), "b": [jax.ShapeDtypeStruct((), jnp.float32)]},
    )


class KeysTest(absltest.TestCase):
  def test_key_spec_is_the_spec_of_the_keys_drawn(self):
    # Ground truth: the key the rng sequence itself draws next.
    def f():
      return (pytree.key_spec(hk.maybe_get_rng_sequence_state()), pytree.spec(hk.next_rng_key()))

    for rng in (jax.random.PRNGKey(0), jax.random.key(0)):
      got, drawn = hk.transform(f).apply({}, rng)
      self.assertEqual(got, drawn)
    self.assertEqual(
      hk.transform(f).apply({}, jax.random.key(0))[0].shape, ()
    )  # A typed key: not the default raw uint32[2].

  def test_is_key(self):
    self.assertTrue(pytree.is_key(jax.random.PRNGKey(0)))  # Raw uint32 data.
    self.assertTrue(pytree.is_key(jax.random.key(0)))
    self.assertFalse(pytree.is_key(jnp.zeros([2], jnp.int32)))
    # Raw key data is a jax.Array; NumPy data is not a key.
    self.assertFalse(pytree.is_key(np.zeros([2], np.uint32)))

  def test_concrete_key_of_a_spec_or_an_error(self):
    for key in (jax.random.PRNGKey(0), jax.random.key(0)):
      spec = pytree.spec(key)
      made = []
      jax.jit(lambda: made.append(pytree.spec(pytree.concrete_key(spec))))()
      self.assertEqual(made, [spec])
    # A typed key of another PRNG than jax.random.key's default.
    other = pytree.spec(jax.random.key(0, impl="rbg"))
    with self.assertRaisesRegex(TypeError, "no key of"):
      pytree.concrete_key(other)


class SplitArraysTest(absltest.TestCase):
  def test_numpy_arrays_only_when_asked_python_values_never(self):
    tree = {
      "jax": jnp.ones([2]),
      "np": np.ones([2]),
      "f": np.float32(1.5),
      "i": np.int64(7),
      "b": np.bool_(True),
      "py": 3,
    }
    for numpy, want in ((False, ["jax"]), (True, ["f", "jax", "np"])):
      arrays, rebuild = pytree.split_arrays(tree, numpy)
      self.assertEqual([a.shape for a in arrays], [np.shape(tree[k]) for k in want])
      rebuilt = rebuild([jnp.zeros(np.shape(a)) for a in arrays])
      for k in tree:
        self.assertIs(rebuilt[k] is tree[k], k not in want, k)


if __name__ == "__main__":
  absltest.main()
