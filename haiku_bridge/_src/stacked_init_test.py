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
  return {"w": jax.random.normal(rng, [x.shape[-1], x.shape[-1]]) * 0.5,
          "b": jnp.zeros([x.shape[-1]])}


class StackedInitTest(absltest.TestCase):

  def test_with_own_scan(self):
    def stack(params, x):
      return jax.lax.scan(lambda h, p: (dense(p, h), None), x, params)[0]

    f = hk.transform(lambda x: hkb.call_pure(
        stack, x, init=stacked_init.stacked_init(init_dense, DEPTH),
        name="stack"))
    params = f.init(KEY, X)
    self.assertEqual(params["stack"]["w"].shape, (DEPTH, 4, 4))
    # Each layer is initialised independently.
    self.assertFalse(jnp.allclose(params["stack"]["w"][0],
                                  params["stack"]["w"][1]))
    g = hk.transform(lambda x: hkb.repeat_layer(dense, x, DEPTH,
                                                init=init_dense))
    chex.assert_trees_all_close(
        f.apply(params, None, X),
        g.apply({f"{STACK}/~": params["stack"]}, None, X), rtol=1e-6)

  def test_in_axes(self):
    xs = jnp.arange(DEPTH, dtype=jnp.float32)
    init = stacked_init.stacked_init(lambda rng, x: {"v": x * jnp.ones([2])},
                                     DEPTH, in_axes=(0,))
    chex.assert_trees_all_equal(init(KEY, xs)["v"],
                                jnp.repeat(xs[:, None], 2, axis=1))


if __name__ == "__main__":
  absltest.main()
