"""Tests for key_path: the structure of `init`'s params at apply, cached or not.

A cache never changes a result: each case runs cold (caches cleared), warm,
after what it depends on changed, and with caches off
(`caches.disabled()`), and must give what inline reasoning gives: the params
that init made for the same inputs, read back.
"""

import os
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from haiku_bridge._src import caches

KEY = jax.random.PRNGKey(0)
X = jnp.ones([2, 3])

WIDTH = 4  # Read by `init_reading_a_global`; a test changes it.


def matmul(params, x):
  return x @ params["w"]


def init_sized_by(rng, x, n):
  return {"w": jax.random.normal(rng, [x.shape[-1], int(n)])}


def init_reading_a_global(rng, x):
  return {"w": jax.random.normal(rng, [x.shape[-1], WIDTH])}


def init_seeding_numpy(rng, x):
  seed = int(np.asarray(rng).ravel()[0])
  w = np.random.default_rng(seed).normal(size=[x.shape[-1], 4])
  return {"w": jnp.asarray(w, jnp.float32)}


def run(init, *args):
  """Init and apply of `call_pure(matmul, X, *args, init=init)`."""
  f = hk.transform(lambda x, *a: hkb.call_pure(
      lambda p, x, *_: matmul(p, x), x, *a, init=init))
  params = f.init(KEY, X, *args)
  return params, f.apply(params, None, X, *args)


TEMPERATURES = (("cold", "cold"), ("warm", "warm"), ("off", "off"))


class StructureTest(parameterized.TestCase):

  def _apply(self, temperature, init, *args):
    if temperature == "off":
      with caches.disabled():
        return run(init, *args)
    if temperature == "cold":
      hkb.clear_caches()
    return run(init, *args)

  @parameterized.named_parameters(*TEMPERATURES)
  def test_size_in_a_numpy_scalar(self, temperature):
    for n in (np.int64(4), np.int64(5), np.int32(4)):
      params, out = self._apply(temperature, init_sized_by, n)
      np.testing.assert_allclose(out, X @ params["~"]["w"], rtol=1e-6)
      self.assertEqual(out.shape, (2, int(n)))

  @parameterized.named_parameters(*TEMPERATURES)
  def test_a_global_that_changed(self, temperature):
    global WIDTH
    try:
      for WIDTH in (4, 5, 4):
        params, out = self._apply(temperature, init_reading_a_global)
        self.assertEqual(out.shape, (2, WIDTH))
        np.testing.assert_allclose(out, X @ params["~"]["w"], rtol=1e-6)
    finally:
      WIDTH = 4

  @parameterized.named_parameters(*TEMPERATURES)
  def test_a_closure_that_changed(self, temperature):
    width = 4

    def init(rng, x):
      return {"w": jax.random.normal(rng, [x.shape[-1], width])}

    for width in (4, 6):  # pylint: disable=redefined-outer-name
      _, out = self._apply(temperature, init)
      self.assertEqual(out.shape, (2, width))

  @parameterized.named_parameters(*TEMPERATURES)
  def test_numpy_seeded_from_the_key(self, temperature):
    params, out = self._apply(temperature, init_seeding_numpy)
    np.testing.assert_allclose(out, X @ params["~"]["w"], rtol=1e-6)

  def test_numpy_seeded_from_the_key_in_a_fresh_process(self):
    params, expected = run(init_seeding_numpy)
    path = os.path.join(self.create_tempdir().full_path, "w.npy")
    np.save(path, np.asarray(params["~"]["w"]))
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, os.path.abspath(__file__), path],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        capture_output=True, text=True, check=False)
    self.assertEqual(child.returncode, 0, child.stderr[-3000:])
    np.testing.assert_allclose(np.array(child.stdout.split(), np.float32),
                               np.asarray(expected).ravel(), rtol=1e-6)

  def test_values_needed_under_jit_name_the_cause(self):
    f = hk.transform(lambda x, n: hkb.call_pure(
        lambda p, x, n: matmul(p, x), x, n, init=init_sized_by))
    params = f.init(KEY, X, 4)
    with self.assertRaisesRegex(
        TypeError, r"hkb.call_pure: `init` needs concrete values .* under a "
        "JAX transform"):
      jax.jit(f.apply)(params, None, X, jnp.int32(4))


class KeysTest(parameterized.TestCase):

  def _check(self, key, apply_key):
    def init(rng, x):
      return {"w": jax.random.normal(rng, [x.shape[-1], 4])}

    f = hk.transform(lambda x: hkb.call_pure(matmul, x, init=init))
    params = f.init(key, X)
    hkb.clear_caches()
    np.testing.assert_allclose(f.apply(params, apply_key, X),
                               X @ params["~"]["w"], rtol=1e-6)

  @parameterized.parameters("rbg", "unsafe_rbg", "threefry2x32")
  def test_any_prng_implementation(self, impl):
    saved = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", impl)
    try:
      self._check(jax.random.PRNGKey(0), None)
      self._check(jax.random.PRNGKey(0), jax.random.PRNGKey(1))
    finally:
      jax.config.update("jax_default_prng_impl", saved)

  def test_typed_keys(self):
    self._check(jax.random.key(0), None)
    self._check(jax.random.key(0), jax.random.key(1))


_CHILD = """
import importlib.util, sys
import numpy as np
spec = importlib.util.spec_from_file_location("key_path_test", sys.argv[1])
test = importlib.util.module_from_spec(spec)
spec.loader.exec_module(test)
import haiku as hk, jax
f = hk.transform(lambda x: test.hkb.call_pure(test.matmul, x,
                                              init=test.init_seeding_numpy))
params = {"~": {"w": jax.numpy.asarray(np.load(sys.argv[2]))}}
print(" ".join(map(str, np.asarray(f.apply(params, None, test.X)).ravel())))
"""


if __name__ == "__main__":
  absltest.main()
