"""Tests for stacked_init: a stack of independent inits of one layer."""

from absl.testing import absltest
import chex
import haiku as hk
import jax
import jax.numpy as jnp

import haiku_bridge as hkb
from haiku_bridge._src import stacked_init

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), [2, 4])
DEPTH = 3
STACK = "__layer_stack_no_per_layer"


def dense(params, x):
  return jnp.tanh(x @ params["w"] + params["b"])


def init_dense(rng, x):
  return {
    "w": jax.random.normal(rng, [x.shape[-1], x.shape[-1]]) * 0.5,
    "b": jnp.zeros([x.shape[-1]]),
  }


class StackedInitTest(absltest.TestCase):
  def test_with_own_scan(self):
    def stack(params, x):
      return jax.lax.scan(lambda h, p: (dense(p, h), None), x, params)[0]

    f = hk.transform(
      lambda x: hkb.call_pure(
        stack, x, init=stacked_init.stacked_init(init_dense, DEPTH), name="stack"
      )
    )
    params = f.init(KEY, X)
    self.assertEqual(params["stack"]["w"].shape, (DEPTH, 4, 4))
    # Each layer is initialised independently.
    self.assertFalse(jnp.allclose(params["stack"]["w"][0], params["stack"]["w"][1]))
    g = hk.transform(lambda x: hkb.repeat_layer(dense, x, DEPTH, init=init_dense))
    chex.assert_trees_all_close(
      f.apply(params, None, X), g.apply({f"{STACK}/~": params["stack"]}, None, X), rtol=1e-6
    )

  def test_values_of_a_haiku_layer_stack(self):
    # Ground truth: hk.layer_stack of the same layer written in Haiku, its
    # weights drawn from the layer's own rng sequence at init.
    def haiku_layer(x):
      w = hk.get_parameter("w", [4, 4], init=lambda *_: init_dense(hk.next_rng_key(), x)["w"])
      b = hk.get_parameter("b", [4], init=jnp.zeros)
      return dense({"w": w, "b": b}, x)

    theirs = hk.transform(lambda x: hk.layer_stack(DEPTH)(haiku_layer)(x))
    ours = hk.transform(
      lambda x: hkb.call_pure(
        lambda p, x: x, x, init=stacked_init.stacked_init(init_dense, DEPTH), name="stack"
      )
    )
    chex.assert_trees_all_equal(ours.init(KEY, X)["stack"], theirs.init(KEY, X)[f"{STACK}/~"])

  def test_keyword_arguments_reach_each_layer(self):
    init = stacked_init.stacked_init(lambda rng, x, scale: {"v": scale * x}, DEPTH)
    chex.assert_trees_all_equal(init(KEY, X, scale=2.0)["v"], jnp.stack([2.0 * X] * DEPTH))

  def test_in_axes(self):
    xs = jnp.arange(DEPTH, dtype=jnp.float32)
    init = stacked_init.stacked_init(lambda rng, x: {"v": x * jnp.ones([2])}, DEPTH, in_axes=(0,))
    chex.assert_trees_all_equal(init(KEY, xs)["v"], jnp.repeat(xs[:, None], 2, axis=1))


if __name__ == "__main__":
  absltest.main()
