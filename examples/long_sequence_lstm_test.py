"""Tests for the long-sequence LSTM example (structure only, never timings)."""

from absl.testing import absltest
import jax.numpy as jnp
import numpy as np

from examples import long_sequence_lstm


class LongSequenceLstmTest(absltest.TestCase):
  def test_text_is_fixed_and_in_the_alphabet(self):
    chars = long_sequence_lstm.text(50, 3)
    self.assertEqual(chars.shape, (51, 3))
    np.testing.assert_array_equal(chars, long_sequence_lstm.text(50, 3))
    self.assertTrue(((chars >= 0) & (chars < long_sequence_lstm.VOCAB)).all())

  def test_schedules_keep_fewer_carries_with_the_same_gradient(self):
    chars = jnp.asarray(long_sequence_lstm.text(256, 4))
    memory = long_sequence_lstm.temporaries(16, chars)
    if None in memory.values():
      self.skipTest("this backend has no memory_analysis")
    plain, baseline, nested, binomial = memory.values()
    self.assertLess(baseline, plain)
    self.assertLess(nested, baseline / 2)
    self.assertLessEqual(binomial, nested)
    self.assertLess(long_sequence_lstm.gradient_difference(16, "nested", chars), 1e-5)


if __name__ == "__main__":
  absltest.main()
