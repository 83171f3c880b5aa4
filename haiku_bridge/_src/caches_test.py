"""Tests for caches: keys hold everything a result depends on; one clear."""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from haiku_bridge._src import caches


class SignatureTest(absltest.TestCase):

  def test_full_shapes_not_ranks(self):
    self.assertNotEqual(caches.signature(jnp.ones([2, 3])),
                        caches.signature(jnp.ones([4, 3])))

  def test_dtype_and_weak_type(self):
    self.assertNotEqual(caches.signature(jnp.ones([2])),
                        caches.signature(jnp.ones([2], jnp.bfloat16)))
    self.assertNotEqual(caches.signature(jnp.asarray(1.0)),
                        caches.signature(jnp.float32(1.0) * jnp.ones([])))

  def test_values_of_python_arguments(self):
    self.assertNotEqual(caches.signature(True), caches.signature(False))
    self.assertEqual(caches.signature(jnp.ones([2]), True),
                     caches.signature(jnp.zeros([2]), True))

  def test_numpy_and_jax_arrays_and_specs_agree(self):
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    self.assertEqual(caches.signature(np.ones([2], np.float32)),
                     caches.signature(jnp.ones([2])))
    self.assertEqual(caches.signature(spec), caches.signature(jnp.ones([2])))

  def test_unhashable_gives_none(self):
    self.assertIsNone(caches.signature([{1, 2}]))
    self.assertIsNone(caches.function_key(lambda: None, [{1}]))
    self.assertIsNone(caches.function_key({}, 1))


class ClearCachesTest(absltest.TestCase):

  def test_clears_every_cache(self):
    cache = caches.Cache("test")
    cleared = []
    caches.register(lambda: cleared.append(True))
    cache.put("k", 1)
    self.assertEqual(cache.get("k"), 1)
    hkb.clear_caches()
    self.assertIsNone(cache.get("k"))
    self.assertEqual(cleared, [True])

  def test_lru_bound(self):
    cache = caches.Cache("small", max_entries=2)
    for key in "abc":
      cache.put(key, key)
    self.assertIsNone(cache.get("a"))
    self.assertEqual(cache.get("c"), "c")

  def test_none_key_is_never_stored(self):
    cache = caches.Cache("none")
    calls = []
    compute = lambda: calls.append(1) or 7
    self.assertEqual(cache.get_or_compute(None, compute), 7)
    self.assertEqual(cache.get_or_compute(None, compute), 7)
    self.assertLen(calls, 2)


if __name__ == "__main__":
  absltest.main()
