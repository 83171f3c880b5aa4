"""Runs the custom-VJP routing example and checks what it claims."""

from unittest import mock

from absl.testing import absltest
import chex
import haiku as hk
import jax
import numpy as np

from examples import custom_vjp_routing as example


class InlineBlock(hk.Module):
  """`RoutedBlock` without the bridge: the MLP runs inline, plain gradient."""

  def __init__(self, block_fn, name=None):
    del block_fn  # The inline block has no explicit-params function.
    super().__init__(name=name or "routed_block")

  def __call__(self, x):
    return x + example.mlp(x)


class CustomVjpRoutingTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.grads = example.gradient_report()

  def test_loss_decreases(self):
    losses = example.train(num_steps=60)
    self.assertLen(losses, 60)
    self.assertTrue(np.all(np.isfinite(losses)))
    self.assertLess(np.mean(losses[-10:]), 0.5 * losses[0])

  def test_routed_gradient_equals_stop_gradient_reference(self):
    chex.assert_trees_all_close(self.grads["routed"], self.grads["reference"], atol=1e-5, rtol=1e-5)

  def test_routed_gradient_differs_from_plain_on_routed_weights_only(self):
    routed, plain = self.grads["routed"], self.grads["plain"]
    routed_modules = [m for m in routed if example.is_routed(m)]
    # Two blocks, two sub-layers each.
    self.assertLen(routed_modules, 4)
    for module in routed:
      with self.subTest(module):
        if example.is_routed(module):
          for name in routed[module]:
            self.assertFalse(
              np.allclose(routed[module][name], plain[module][name], atol=1e-4),
              msg=f"{module}/{name}: routing changed nothing",
            )
        else:
          chex.assert_trees_all_close(routed[module], plain[module], atol=1e-5, rtol=1e-5)

  def test_params_are_those_of_the_inline_network(self):
    bridged = example.init_params(seed=0)
    with mock.patch.object(example, "RoutedBlock", InlineBlock):
      inline = example.make_loss("plain").init(jax.random.PRNGKey(0), next(example.batches()))
    # Same names, shapes and initial values: a checkpoint of the inline
    # network loads into the bridged one.
    chex.assert_trees_all_close(bridged, inline)


if __name__ == "__main__":
  absltest.main()
