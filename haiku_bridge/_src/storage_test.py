"""Tests for storage: leaves stored as inline Haiku stores params and state."""

from absl.testing import absltest
import chex
import haiku as hk
import jax
import jax.numpy as jnp

from haiku_bridge._src import errors
from haiku_bridge._src import storage
from testing import test_utils

KEY = jax.random.PRNGKey(0)
W = storage.Leaf("['w']", "outer/proj", "w")


def bf16_creator(next_creator, shape, dtype, init, context):
  del dtype, context
  return next_creator(shape, jnp.bfloat16, init)


class ParamsTest(absltest.TestCase):
  def test_create_meets_creators_as_inline(self):
    value = jnp.full([2, 3], 0.5)

    def bridged():
      with hk.custom_creator(bf16_creator):
        return test_utils.Outer(
          lambda: storage.PARAMS.create([storage.Leaf("['w']", "outer/proj", "w")], [value])
        )()

    def inline():
      with hk.custom_creator(bf16_creator):
        return test_utils.Outer(
          lambda: [
            hk.Linear(3, name="proj", w_init=lambda s, d: value.astype(d), with_bias=False)(
              jnp.ones([1, 2])
            )
          ]
        )()

    p_bridged = hk.transform(bridged).init(KEY)
    p_inline = hk.transform(inline).init(KEY)
    chex.assert_trees_all_equal(p_bridged, p_inline)
    self.assertEqual(p_bridged["outer/proj"]["w"].dtype, jnp.bfloat16)

  def test_read_runs_getters_once(self):
    seen = []

    def getter(next_getter, value, context):
      seen.append(context.full_name)
      return next_getter(2 * value)

    def f():
      with hk.custom_getter(getter):
        return storage.PARAMS.read([W])

    params = {"outer/proj": {"w": jnp.ones([2])}}
    out = hk.transform(f).apply(params, None)
    chex.assert_trees_all_equal(out, [2 * jnp.ones([2])])
    self.assertEqual(seen, ["outer/proj/w"])

  def test_read_checks_presence_and_shape_not_dtype(self):
    def f():
      with errors.entry("call_pure"):  # As the entry point that reads them opens it.
        return storage.PARAMS.read([W], [(2,)])

    read = hk.transform(f)
    with self.assertRaisesRegex(
      ValueError,
      r"hkb.call_pure: parameter 'outer/proj/w' \(params path "
      r"\['w'\]\) is missing at apply",
    ):
      read.apply({}, None)
    with self.assertRaisesRegex(ValueError, r"has shape \[3\] .*needs \[2\] for these"):
      read.apply({"outer/proj": {"w": jnp.ones([3])}}, None)
    half = {"outer/proj": {"w": jnp.ones([2], jnp.float16)}}
    self.assertEqual(read.apply(half, None)[0].dtype, jnp.float16)

  def test_claims(self):
    twins = [storage.Leaf("['a_0']", "a_0", "b"), storage.Leaf("['a'][0]", "a_0", "b")]
    with errors.entry("get_relevant_parameters"):
      with self.assertRaisesRegex(
        ValueError,
        r"hkb.get_relevant_parameters: params paths \['a_0'\] "
        r"and \['a'\]\[0\] both map to the Haiku parameter 'a_0/b'",
      ):
        hk.transform(lambda: storage.PARAMS.claim(twins)).init(KEY)

    def twice_in_one_call():
      storage.PARAMS.claim([W])
      storage.PARAMS.claim([W])

    with self.assertRaisesRegex(ValueError, "already used by another bridged"):
      hk.transform(twice_in_one_call).init(KEY)

    # Calling one module twice claims afresh: that is weight sharing.
    def module_twice():
      m = test_utils.Outer(lambda: storage.PARAMS.claim([W]))
      m()
      m()

    hk.transform(module_twice).init(KEY)


class StateTest(absltest.TestCase):
  def test_create_read_write_as_inline(self):
    leaf = storage.Leaf("['n']", "~", "n")

    def bridged(step):
      if hk.running_init():
        (n,) = storage.STATE.create([leaf], [jnp.zeros([])], [jnp.zeros([])])
      else:
        (n,) = storage.STATE.read([leaf], [()])
      storage.STATE.write([leaf], [n], [n + step])
      return n

    def inline(step):
      n = hk.get_state("n", [], init=jnp.zeros)
      hk.set_state("n", n + step)
      return n

    ours, theirs = (hk.transform_with_state(bridged), hk.transform_with_state(inline))
    chex.assert_trees_all_equal(ours.init(KEY, 1.0), theirs.init(KEY, 1.0))
    _, state = theirs.init(KEY, 1.0)
    chex.assert_trees_all_equal(
      ours.apply({}, state, None, 2.0), theirs.apply({}, state, None, 2.0)
    )

  def test_create_then_current_value_as_inline_set_state(self):
    # Init sets the state after creating it: what init returns and what the
    # call sees then are inline `hk.get_state` + `hk.set_state`'s.
    leaf = storage.Leaf("['n']", "~", "n")
    seen = {}

    def bridged():
      (n,) = storage.STATE.create([leaf], [jnp.zeros([2])], [jnp.ones([2])])
      seen["bridged"] = (n, hk.get_state("n"))

    def inline():
      hk.get_state("n", [2], init=jnp.zeros)
      hk.set_state("n", jnp.ones([2]))
      seen["inline"] = (jnp.ones([2]), hk.get_state("n"))

    chex.assert_trees_all_equal(
      hk.transform_with_state(bridged).init(KEY), hk.transform_with_state(inline).init(KEY)
    )
    chex.assert_trees_all_equal(seen["bridged"], seen["inline"])

  def test_unchanged_state_is_not_written(self):
    leaf = storage.Leaf("['n']", "~", "n")
    writes = []

    def setter(next_setter, value, context):
      writes.append(context.full_name)
      return next_setter(value)

    def f():
      (n,) = storage.STATE.read([leaf])
      with hk.custom_setter(setter):
        storage.STATE.write([leaf], [n], [n])
        storage.STATE.write([leaf], [n], [n + 1])

    hk.transform_with_state(f).apply({}, {"~": {"n": jnp.zeros([])}}, None)
    self.assertEqual(writes, ["~/n"])


if __name__ == "__main__":
  absltest.main()
