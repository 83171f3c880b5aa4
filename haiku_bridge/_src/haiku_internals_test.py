"""Pins the private Haiku facts the bridge reads; a Haiku upgrade fails here first."""

from absl.testing import absltest
import haiku as hk
import jax
import jax.numpy as jnp

from haiku_bridge._src import haiku_internals


class HaikuInternalsTest(absltest.TestCase):

  def test_stored_param_ignores_getters(self):
    def f():
      hk.get_parameter("w", [2], init=jnp.ones)
      with hk.custom_getter(lambda nxt, v, ctx: nxt(v.astype(jnp.bfloat16))):
        return haiku_internals.stored_param("~", "w"), haiku_internals.stored_param(
            "~", "missing")

    stored, missing = hk.transform(f).apply({"~": {"w": jnp.ones([2])}}, None)
    self.assertEqual(stored.dtype, jnp.float32)
    self.assertIsNone(missing)

  def test_stored_state(self):
    def f():
      hk.set_state("s", jnp.zeros([]))
      hk.set_state("s", jnp.ones([]))
      return haiku_internals.stored_state("~", "s"), haiku_internals.stored_state(
          "~", "missing")

    (current, missing), _ = hk.transform_with_state(f).apply(
        {}, {"~": {"s": jnp.zeros([])}}, None)
    self.assertEqual(current, 1.)
    self.assertIsNone(missing)

  def test_inside_raw_jax_transform(self):
    def f(xs):
      seen = [haiku_internals.inside_raw_jax_transform()]
      probe = lambda x: seen.append(haiku_internals.inside_raw_jax_transform())
      hk.vmap(probe, split_rng=False)(xs)
      jax.vmap(probe)(xs)
      return seen

    outside, in_haiku_vmap, in_jax_vmap = hk.transform(f).apply(
        {}, None, jnp.ones([2]))
    self.assertFalse(outside)
    self.assertFalse(in_haiku_vmap)
    self.assertTrue(in_jax_vmap)

  def test_inside_raw_jax_transform_under_jit_of_init(self):
    seen = []
    f = hk.transform(lambda: seen.append(
        haiku_internals.inside_raw_jax_transform()))
    jax.jit(f.init)(jax.random.PRNGKey(0))
    self.assertEqual(seen, [False])

  def test_original_fn(self):
    fn = lambda x: x
    self.assertIs(haiku_internals.original_fn(hk.transform(fn)), fn)
    self.assertIs(haiku_internals.original_fn(
        hk.without_apply_rng(hk.transform_with_state(fn))), fn)
    self.assertIsNone(haiku_internals.original_fn(fn))

  def test_interceptors_suspended(self):
    double = lambda nxt, v, ctx: nxt(2 * v)

    def f():
      with hk.custom_getter(double):
        with haiku_internals.interceptors_suspended():
          inside = hk.get_parameter("w", [], init=jnp.ones)
        return inside, hk.get_parameter("w", [], init=jnp.ones)

    inside, after = hk.transform(f).apply({"~": {"w": jnp.ones([])}}, None)
    self.assertEqual(inside, 1.)
    self.assertEqual(after, 2.)

  def test_getters_active(self):
    getter = lambda nxt, v, ctx: nxt(v)

    def f():
      before = (haiku_internals.getters_active("parameter"),
                haiku_internals.getters_active("state"))
      with hk.custom_getter(getter):
        params_only = (haiku_internals.getters_active("parameter"),
                       haiku_internals.getters_active("state"))
      with hk.custom_getter(getter, params=False, state=True):
        state_only = (haiku_internals.getters_active("parameter"),
                      haiku_internals.getters_active("state"))
      return before, params_only, state_only

    self.assertEqual(hk.transform(f).apply({}, None),
                     ((False, False), (True, False), (False, True)))

  def test_claim_name(self):
    class M(hk.Module):

      def __call__(self):
        return (haiku_internals.claim_name("x"),
                haiku_internals.claim_name("x"))

    def f():
      m = M()
      return m(), m()

    first_call, second_call = hk.transform(f).apply({}, None)
    self.assertEqual(first_call, (True, False))
    self.assertEqual(second_call, (True, False))


if __name__ == "__main__":
  absltest.main()
