"""Tests for unstack_params / stack_params: a layer scan's names to a loop's and back."""

from absl.testing import absltest
import chex
import haiku as hk
import jax
import jax.numpy as jnp

import haiku_bridge as hkb
from haiku_bridge._src import unrolled_names

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), [2, 4])
DEPTH = 3


def block(x):
  """A layer with nested modules and a top-level parameter."""
  h = hk.nets.MLP([8, x.shape[-1]], activation=jnp.tanh)(x)
  return x + h * hk.get_parameter("gate", [], init=jnp.ones)


class NameMappingTest(absltest.TestCase):
  def test_round_trip(self):
    f = hk.transform(lambda x: hk.nets.MLP([4])(x) + hkb.repeat_layer(block, x, DEPTH, name="enc"))
    params = f.init(KEY, X)
    loop_params = unrolled_names.unstack_params(
      params, stack="enc", num_layers=DEPTH, layer_scope="blocks/layer_{i}"
    )
    self.assertIn("blocks/layer_2/mlp/~/linear_0", loop_params)
    self.assertIn("blocks/layer_0", loop_params)  # the layer's own "gate".
    self.assertIn("mlp/~/linear_0", loop_params)  # untouched.
    chex.assert_trees_all_equal(
      unrolled_names.stack_params(
        loop_params, stack="enc", num_layers=DEPTH, layer_scope="blocks/layer_{i}"
      ),
      params,
    )

  def test_missing_layer(self):
    with self.assertRaisesRegex(
      ValueError,
      r"enc/lin/w is missing for layers"
      r" \[1\]",
    ):
      unrolled_names.stack_params({"layer_0/lin": {"w": jnp.ones([1])}}, stack="enc", num_layers=2)

  def test_a_bundle_that_only_starts_like_a_layer_is_kept(self):
    # `layer_0_norm` is not layer 0 of `layer_{i}`: it stays as it is.
    w = jnp.arange(2.0)
    params = {"layer_0/lin": {"w": w}, "layer_1/lin": {"w": w + 1}, "layer_0_norm": {"scale": w}}
    out = unrolled_names.stack_params(params, stack="enc", num_layers=2)
    chex.assert_trees_all_equal(
      out, {"layer_0_norm": {"scale": w}, "enc/lin": {"w": jnp.stack([w, w + 1])}}
    )


if __name__ == "__main__":
  absltest.main()
