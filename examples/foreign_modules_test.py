"""Tests for the mixed-library example, against NNX and Equinox run natively."""

from absl.testing import absltest
import equinox as eqx
import jax
import numpy as np

from examples import foreign_modules as example


class ForeignModulesTest(absltest.TestCase):
  def test_training_lowers_the_loss(self):
    _, _, losses = example.train(num_steps=40)
    self.assertLess(losses[-1], 0.5 * losses[0])

  def test_names(self):
    params, state, _ = example.train(num_steps=1)
    self.assertEqual(
      sorted(params),
      [
        "net/embed",
        "net/mlp/layers_0",
        "net/mlp/layers_1",
        "net/mlp/layers_2",
        "net/nnx_block/bn",
        "net/nnx_block/linear1",
        "net/nnx_block/linear2",
      ],
    )
    self.assertEqual(sorted(state), ["net/nnx_block/bn"])

  def test_eval_model_is_the_native_composition(self):
    params, state, _ = example.train(num_steps=3)
    x, _ = example.data(seed=1, n=8)
    ours, _ = example.NET.apply(params, state, None, x, is_training=False)
    block = example.native_nnx_block(params, state)
    block.eval()
    head = example.EQX_HEAD(key=jax.random.PRNGKey(0))
    where = lambda m: [leaf for layer in m.layers for leaf in (layer.weight, layer.bias)]
    head = eqx.tree_at(
      where, head, [params[f"net/mlp/layers_{i}"][n] for i in range(3) for n in ("weight", "bias")]
    )
    h = jax.nn.gelu(x @ params["net/embed"]["w"] + params["net/embed"]["b"])
    native = jax.vmap(head)(block(h))[:, 0]
    np.testing.assert_allclose(ours, native, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
  absltest.main()
