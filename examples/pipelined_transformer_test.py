"""The pipelined transformer example trains as the same model without the pipeline."""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl.testing import absltest
import chex
import haiku_bridge as hkb
import numpy as np

from examples import pipelined_transformer as example

NUM_STEPS = 3


class PipelinedTransformerTest(absltest.TestCase):
  def test_circular_pipeline_trains_as_the_unpipelined_model(self):
    # Ground truth: the same model and steps, the blocks scanned plainly.
    losses, params = example.train(NUM_STEPS, None)
    got_losses, got_params = example.train(NUM_STEPS, hkb.Pipeline("stage", 8, "circular"))
    np.testing.assert_allclose(got_losses, losses, rtol=1e-5)
    chex.assert_trees_all_close(
      jax.device_get(got_params), jax.device_get(params), rtol=1e-4, atol=1e-5
    )
    # Each device holds its stage's 2 blocks.
    w = got_params["blocks/mlp/~/linear_0"]["w"]
    self.assertEqual({s.data.shape[0] for s in w.addressable_shards}, {2})


if __name__ == "__main__":
  absltest.main()
