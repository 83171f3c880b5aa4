"""Runs the sharded training example briefly and checks what it claims."""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import unittest

from absl.testing import absltest
from absl.testing import flagsaver
from absl.testing import parameterized
import chex
import haiku as hk
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import haiku_bridge as hkb

from examples import processes
from examples import sharded_training as example

# What the example's rules say, written out: per-layer specs of the stack get
# a leading `None` for the layer axis; what no rule names is replicated.
EXPECTED_SPECS = {
  "embed": {"w": P(), "b": P()},
  "custom_mlp": {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()},
  "blocks/up": {"w": P(None, None, "model"), "b": P(None, "model")},
  "blocks/down": {"w": P(None, "model", None), "b": P()},
  "readout": {"w": P(), "b": P()},
}


def setUpModule():
  if jax.device_count() < 8:
    raise unittest.SkipTest(
      f"needs 8 devices, jax has {jax.device_count()} {jax.default_backend()} devices."
    )


def specs(params):
  return jax.tree.map(lambda a: a.sharding.spec, params)


class ShardedTrainingTest(parameterized.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.mesh = example.make_mesh()
    cls.losses, cls.params = example.train(num_steps=40)

  def test_loss_decreases(self):
    self.assertLen(self.losses, 40)
    self.assertTrue(np.all(np.isfinite(self.losses)))
    self.assertLess(np.mean(self.losses[-5:]), 0.3 * self.losses[0])

  def test_trained_params_are_sharded_as_the_rules_say(self):
    self.assertEqual(specs(self.params), EXPECTED_SPECS)
    for leaf in jax.tree.leaves(self.params):
      self.assertLen(leaf.sharding.device_set, 8)

  def test_init_creates_params_sharded(self):
    params, shardings = example.init_params(self.mesh)
    self.assertEqual(specs(params), EXPECTED_SPECS)
    self.assertEqual(shardings["custom_mlp"]["w1"], NamedSharding(self.mesh, P(None, "model")))
    # A replicated weight is whole on each device; a split one is a quarter.
    self.assertEqual(
      params["embed"]["w"].addressable_shards[0].data.shape, (example.IN_FEATURES, example.WIDTH)
    )
    self.assertEqual(
      params["blocks/up"]["w"].addressable_shards[0].data.shape,
      (example.NUM_LAYERS, example.WIDTH, example.HIDDEN // 4),
    )

  def test_unmatched_params_are_reported(self):
    report = hkb.explain_shardings(self.params, example.RULES, mesh=self.mesh)
    self.assertEqual(
      sorted(report.unmatched),
      ["blocks/down/b", "custom_mlp/b2", "embed/b", "embed/w", "readout/b", "readout/w"],
    )
    self.assertEqual(report.unused_rules, [])

  @parameterized.parameters(AxisType.Auto, AxisType.Explicit)
  def test_sharded_custom_vjps_gradient_equals_one_device_autodiff(self, axis_type):
    # Ground truth: the plain block and readout (autodiff gradient; the
    # readout's clipping does not bite on this batch), unsharded.
    mesh = example.make_mesh(axis_type)
    with jax.set_mesh(mesh):
      params, shardings = example.init_params(mesh)
    batch = next(example.batches(3))
    plain = example.make_loss(example.plain_mlp_block, example.readout)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(plain.apply))(
      jax.device_get(params), None, batch
    )
    predict = hk.transform(lambda x: example.network(x, example.plain_mlp_block, example.readout))
    x, y = batch
    out = predict.apply(jax.device_get(params), None, x)
    self.assertLess(np.max(np.abs(2 * (out - y) / y.size)), 1.0)  # d loss/out

    with jax.set_mesh(mesh):
      loss, grads = jax.jit(
        jax.value_and_grad(example.LOSS.apply), out_shardings=(None, shardings)
      )(params, None, processes.global_batch(batch, example.batch_sharding(mesh)))
    self.assertEqual(specs(grads), EXPECTED_SPECS)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-4, atol=1e-5)

  def test_explicit_axes_train_as_auto(self):
    losses, params = example.train(num_steps=5, axis_type=AxisType.Explicit)
    np.testing.assert_allclose(losses, self.losses[:5], rtol=1e-5)
    self.assertEqual(specs(params), EXPECTED_SPECS)

  def test_one_process_feeds_every_row(self):
    sharding = example.batch_sharding(self.mesh)
    self.assertEqual(processes.local_rows(sharding, (64, 3)), slice(0, 64))
    x, y = processes.global_batch(next(example.batches(0)), sharding)
    self.assertEqual(x.sharding, sharding)
    self.assertEqual(y.shape, (example.BATCH_SIZE, example.OUT_FEATURES))

  def test_main_runs(self):
    with flagsaver.flagsaver((example._NUM_STEPS, 3)):
      example.main([])


if __name__ == "__main__":
  absltest.main()
