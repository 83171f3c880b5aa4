"""Tests for the stax example, against stax itself."""

from absl.testing import absltest
import chex
import jax
import numpy as np

from examples import foreign_stax


class ForeignStaxTest(absltest.TestCase):
  def test_training_lowers_the_loss(self):
    _, losses = foreign_stax.train(num_steps=30)
    self.assertLess(losses[-1], 0.5 * losses[0])

  def test_head_is_exactly_stax(self):
    params, _ = foreign_stax.train(num_steps=2)
    head = params["net/head"]
    stax_params = [
      (head["layer_0_0"], head["layer_0_1"]),
      (),
      (head["layer_2_0"], head["layer_2_1"]),
    ]
    x, _ = foreign_stax.data()
    encoded = jax.nn.relu(x @ params["net/encoder"]["w"] + params["net/encoder"]["b"])
    chex.assert_trees_all_close(
      foreign_stax.NET.apply(params, x), foreign_stax.HEAD_APPLY(stax_params, encoded), rtol=1e-6
    )

  def test_init_uses_stax_shapes(self):
    x, _ = foreign_stax.data()
    params = foreign_stax.NET.init(jax.random.PRNGKey(0), x)
    _, stax_params = foreign_stax.HEAD_INIT(jax.random.PRNGKey(0), (64, 16))
    self.assertEqual(
      [params["net/head"][k].shape for k in ("layer_0_0", "layer_0_1", "layer_2_0", "layer_2_1")],
      [p.shape for layer in stax_params for p in layer],
    )

  def test_save_and_restore_by_name(self):
    params, _ = foreign_stax.train(num_steps=2)
    restored = foreign_stax.save_and_restore(params)
    self.assertEqual(sorted(restored), sorted(params))
    x, _ = foreign_stax.data(seed=1)
    np.testing.assert_array_equal(
      foreign_stax.NET.apply(restored, x), foreign_stax.NET.apply(params, x)
    )


if __name__ == "__main__":
  absltest.main()
