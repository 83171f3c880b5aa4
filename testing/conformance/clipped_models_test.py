"""Real models trained through a gradient-clipping `hkb.custom_vjp` block.

The char LSTM (its `hk.DeepRNN` of LSTMs unrolled with `hk.dynamic_unroll`
inside the block) and a transformer block (attention under `hk.remat` inside
the block) train for a few SGD steps; the same networks inline, with the same
clipping applied by hand to the block's gradient, train beside them. Params
after every step, and the loss, must agree; and the clipping must have
changed the block's update (so the test would fail without the custom rule).
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax
import numpy as np

from testing import clipped_models as models

KEY = jax.random.PRNGKey(0)
STEPS = 3


def char_lstm():
  bridged = models.char_lstm_loss(models.clipped(models.lstm_core))
  inline = models.char_lstm_loss(models.lstm_core)
  return bridged, inline, ("lstm",), 1.0


def transformer():
  bridged = models.transformer_loss(models.clipped(models.transformer_block))
  inline = models.transformer_loss(models.transformer_block)
  # The block's modules, named inline at the top level.
  return bridged, inline, ("attention", "ln_", "mlp"), 0.5


class ClippedModelsTest(parameterized.TestCase):
  @parameterized.named_parameters(("char_lstm", char_lstm), ("transformer", transformer))
  def test_train_steps_equal_clipping_by_hand(self, model):
    bridged, inline, block_prefix, learning_rate = model()
    bridged, inline = hk.transform(bridged), hk.transform(inline)
    batches = [models.char_batch(k) for k in jax.random.split(KEY, STEPS)]
    params = inline.init(KEY, batches[0])
    chex.assert_trees_all_equal(bridged.init(KEY, batches[0]), params)
    in_block = lambda b: b.startswith(block_prefix)
    clip_by_hand = models.clip_bundles(block_prefix)
    self.assertTrue(any(map(in_block, params)), sorted(params))
    self.assertTrue(not all(map(in_block, params)), sorted(params))

    step = lambda f, **kw: jax.jit(
      lambda p, b: models.sgd_step(f, p, b, learning_rate=learning_rate, **kw)
    )
    ours, reference, unclipped = (
      step(bridged),
      step(inline, clip_by_hand=clip_by_hand),
      step(inline),
    )
    p_ours = p_ref = params
    for batch in batches:
      np.testing.assert_allclose(
        bridged.apply(p_ours, None, batch), inline.apply(p_ref, None, batch), rtol=1e-5
      )
      p_next = reference(p_ref, batch)
      p_free = unclipped(p_ref, batch)
      p_ours, p_ref = ours(p_ours, batch), p_next
      chex.assert_trees_all_close(p_ours, p_ref, rtol=2e-5, atol=1e-6)
      # The clipping did change the block's step, and only the block's.
      changed = {
        b
        for b in p_next
        if not np.allclose(
          p_next[b]["w"] if "w" in p_next[b] else jax.tree.leaves(p_next[b])[0],
          p_free[b]["w"] if "w" in p_free[b] else jax.tree.leaves(p_free[b])[0],
        )
      }
      self.assertTrue(changed)
      self.assertTrue(all(map(in_block, changed)), changed)


if __name__ == "__main__":
  absltest.main()
