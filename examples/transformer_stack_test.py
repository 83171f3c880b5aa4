"""Tests for the transformer-stack example (structure only, never timings)."""

from absl.testing import absltest

from examples import transformer_stack


class TransformerStackTest(absltest.TestCase):
  def test_scan_and_loop_are_the_same_model(self):
    self.assertLess(transformer_stack.check_same_model(depth=3), 1e-5)

  def test_scan_is_traced_once(self):
    table = transformer_stack.compile_table([1, 3], loop_max_depth=3)
    scan_eqns = [row["eqns"] for row in table["scan"]]
    loop_eqns = [row["eqns"] for row in table["loop"]]
    self.assertEqual(scan_eqns[0], scan_eqns[1])
    self.assertGreater(loop_eqns[1], loop_eqns[0])

  def test_loop_skipped_above_max_depth(self):
    table = transformer_stack.compile_table([1, 2], loop_max_depth=1)
    self.assertIsNone(table["loop"][1])


if __name__ == "__main__":
  absltest.main()
