"""Tests for abstract_init: shapes at apply, traced once per signature."""

from absl.testing import absltest
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from haiku_bridge._src import abstract_init

KEY_SPEC = jax.ShapeDtypeStruct((2,), jnp.uint32)


class AbstractInitTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    abstract_init.clear_cache()
    self.calls = []

  def init(self, rng, x, features=3):
    self.calls.append(features)
    return {"w": jnp.zeros([x.shape[-1], features]) + rng[0]}

  def test_same_signature_traces_once(self):
    a = abstract_init.abstract_init(self.init, KEY_SPEC, (jnp.ones([2, 4]),),
                                    {})
    b = abstract_init.abstract_init(self.init, KEY_SPEC, (jnp.zeros([2, 4]),),
                                    {})
    self.assertLen(self.calls, 1)
    self.assertEqual(a, b)
    self.assertEqual(a["w"].shape, (4, 3))

  def test_shapes_and_python_values_are_part_of_the_signature(self):
    x = jnp.ones([2, 4])
    shapes = [
        abstract_init.abstract_init(self.init, KEY_SPEC, (x,), {}),
        abstract_init.abstract_init(self.init, KEY_SPEC, (jnp.ones([2, 5]),),
                                    {}),
        abstract_init.abstract_init(self.init, KEY_SPEC, (x,),
                                    {"features": 7}),
        abstract_init.abstract_init(self.init, KEY_SPEC, (x.astype(
            jnp.bfloat16),), {}),
    ]
    self.assertLen(self.calls, 4)
    self.assertEqual([s["w"].shape for s in shapes],
                     [(4, 3), (5, 3), (4, 7), (4, 3)])

  def test_unhashable_argument_skips_cache(self):
    x = jnp.ones([2, 4])
    init = lambda rng, x, opts: self.init(rng, x)
    for _ in range(2):
      abstract_init.abstract_init(init, KEY_SPEC, (x, [[1]]), {})
    # A list leaf is a pytree node, its int leaf is hashable: cached.
    self.assertLen(self.calls, 1)
    for _ in range(2):
      abstract_init.abstract_init(init, KEY_SPEC, (x, object.__new__(
          _Unhashable)), {})
    self.assertLen(self.calls, 3)

  def test_apply_traces_init_once(self):
    calls = []

    def init(rng, x):
      calls.append(None)
      return {"w": jax.random.normal(rng, [x.shape[-1], 2])}

    f = hk.transform(lambda x: hkb.call_pure(lambda p, x: x @ p["w"], x,
                                             init=init))
    x = jnp.ones([1, 3])
    params = f.init(jax.random.PRNGKey(0), x)
    for _ in range(3):
      jax.make_jaxpr(lambda p: f.apply(p, None, x))(params)
    # Init ran it once; apply at the same shapes reuses what init showed.
    self.assertLen(calls, 1)
    # A new input shape traces it once more, for shapes.
    for _ in range(3):
      jax.make_jaxpr(lambda p: f.apply(p, None, jnp.ones([5, 3])))(params)
    self.assertLen(calls, 2)

  def test_apply_after_init_skips_the_shape_pass_for_transformed(self):
    calls = []

    def mlp(x):
      calls.append(None)
      return hk.nets.MLP([4, 2])(x)

    inner = hk.transform(mlp)
    f = hk.transform(lambda x: hkb.call_pure(inner, x))
    x = jnp.ones([1, 3])
    params = f.init(jax.random.PRNGKey(0), x)
    calls.clear()
    jax.make_jaxpr(lambda p: f.apply(p, None, x))(params)
    self.assertLen(calls, 1)  # The apply itself; no shape pass.

  def test_repeated_layer_scan_traces_init_once(self):
    calls = []

    def block(x):
      calls.append(None)
      return hk.Linear(x.shape[-1])(x)

    f = hk.transform(lambda x: hkb.repeat_layer(block, x, 4))
    x = jnp.ones([1, 3])
    params = f.init(jax.random.PRNGKey(0), x)
    calls.clear()
    for _ in range(3):
      jax.make_jaxpr(lambda p: f.apply(p, None, x))(params)
    # The scan body each time; the shapes are known from init.
    self.assertLen(calls, 3)
    jax.make_jaxpr(lambda p: f.apply(p, None, jnp.ones([2, 3])))(params)
    self.assertLen(calls, 3 + 2)  # A new shape: shapes once, then the body.


class NewBatchSizeTest(absltest.TestCase):
  """A bridged Haiku function at a new batch size needs no shape pass."""

  def setUp(self):
    super().setUp()
    abstract_init.clear_cache()
    self.calls = []

  def mlp(self, x):
    self.calls.append(x.shape)
    return hk.nets.MLP([4, 2])(x)

  def test_no_shape_pass_and_same_outputs(self):
    f = hk.transform(lambda x: hkb.call_pure(hk.transform(self.mlp), x))
    params = f.init(jax.random.PRNGKey(0), jnp.ones([1, 3]))
    self.calls.clear()
    x = jax.random.normal(jax.random.PRNGKey(1), [7, 3])
    out = f.apply(params, None, x)
    self.assertEqual(self.calls, [(7, 3)])  # The apply itself, once.
    inline = hk.transform(self.mlp)
    np.testing.assert_allclose(out, inline.apply(params, None, x), rtol=1e-6)

  def test_wrong_shape_still_gets_the_bridges_error(self):
    f = hk.transform(lambda x: hkb.call_pure(hk.transform(self.mlp), x))
    params = f.init(jax.random.PRNGKey(0), jnp.ones([1, 3]))
    with self.assertRaisesRegex(
        ValueError, r"parameter 'mlp/~/linear_0/w' \(params path "
        r"mlp/~/linear_0/w\) is float32\[3, 4\].*init gives "
        r"float32\[5, 4\]"):
      f.apply(params, None, jnp.ones([2, 5]))

  def test_wrong_dtype_at_a_new_batch_size(self):
    f = hk.transform(lambda x: hkb.call_pure(hk.transform(self.mlp), x))
    params = f.init(jax.random.PRNGKey(0), jnp.ones([1, 3]))
    params["mlp/~/linear_0"]["b"] = params["mlp/~/linear_0"]["b"].astype(
        jnp.float16)
    with self.assertRaisesRegex(ValueError, r"'mlp/~/linear_0/b'.*float16"):
      f.apply(params, None, jnp.ones([6, 3]))

  def test_state_takes_the_exact_shapes(self):
    def counter(x):
      self.calls.append(x.shape)
      n = hk.get_state("n", [x.shape[-1]], init=jnp.zeros)
      hk.set_state("n", n + 1)
      return x + n

    f = hk.transform_with_state(
        lambda x: hkb.call_pure(hk.transform_with_state(counter), x))
    params, state = f.init(jax.random.PRNGKey(0), jnp.ones([1, 3]))
    self.calls.clear()
    out, state = f.apply(params, state, None, jnp.ones([4, 3]))
    self.assertEqual(self.calls, [(4, 3), (4, 3)])  # Shape pass, then apply.
    np.testing.assert_array_equal(state["~"]["n"], jnp.ones([3]))
    np.testing.assert_array_equal(out, jnp.ones([4, 3]))  # x + initial n.


class _Unhashable:
  __hash__ = None


if __name__ == "__main__":
  absltest.main()
