"""Tests for the migration example: the NNX module against Haiku itself."""

from absl.testing import absltest
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from examples import migration_to_nnx as example


class MigrationTest(absltest.TestCase):
  def test_haiku_training_lowers_the_loss(self):
    _, _, losses = example.train_haiku(30)
    self.assertLess(losses[-1], 0.5 * losses[0])

  def test_checkpoint_carried_over_same_outputs_and_grads(self):
    params, state, _ = example.train_haiku(3)
    model = example.migrate(params, state)
    chex.assert_trees_all_equal(model.haiku_params(), params)
    chex.assert_trees_all_equal(model.haiku_state(), state)
    x, y = example.data(seed=2, n=16)
    key = nnx.Rngs(dropout=0).dropout()  # What the model draws first.

    def haiku_loss(p):
      pred, _ = example.HAIKU.apply(p, state, key, x)
      return jnp.mean((pred - y) ** 2)

    value, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    np.testing.assert_allclose(value, haiku_loss(params), rtol=1e-6)
    chex.assert_trees_all_close(
      nnx.to_pure_dict(grads)["params"], jax.grad(haiku_loss)(params), rtol=1e-5, atol=1e-7
    )

  def test_default_run_lowers_the_loss_in_nnx_and_exports_back(self):
    # The steps of the example's default run; the losses it prints, with dropout off.
    params, state, _ = example.train_haiku(example._HAIKU_STEPS.default)
    model = example.migrate(params, state)
    migrated = example.nnx_loss(model)
    np.testing.assert_allclose(migrated, example.haiku_loss(params, state), rtol=1e-5)
    example.train_nnx(model, example._NNX_STEPS.default)
    self.assertLess(example.nnx_loss(model), 0.5 * migrated)
    x, _ = example.data(seed=1, n=8)
    out, _ = example.HAIKU.apply(
      model.haiku_params(), model.haiku_state(), None, x, is_training=False
    )
    np.testing.assert_allclose(model(x, is_training=False), out, rtol=1e-6)


if __name__ == "__main__":
  absltest.main()
