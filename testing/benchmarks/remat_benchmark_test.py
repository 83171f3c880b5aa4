"""Keeps testing/benchmarks/remat_benchmark.py from rotting: its quick mode runs to the end.

No timing is asserted; the memory relations are in structure_test.py.
"""

import contextlib
import io

from absl.testing import absltest

from testing.benchmarks import remat_benchmark
from testing.benchmarks.lib import remat_bench


class QuickRematBenchmarkTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
      cls.report = remat_benchmark.report(remat_bench.QUICK, "remat_benchmark_test --quick")
    cls.progress = stderr.getvalue()

  def test_reports_the_run(self):
    for text in (
      "Command: `remat_benchmark_test --quick`",
      "Mode: quick",
      "| CPU count |",
      "| jax |",
      "| haiku_bridge |",
    ):
      self.assertIn(text, self.report)

  def test_every_row_and_variant_in_both_tables(self):
    temp, step = self.report.split("### Step time")
    for table in (temp, step.split("### Targets")[0]):
      for variant in remat_bench.VARIANTS:
        self.assertIn(variant, table)
      for row in remat_bench.QUICK.rows:
        self.assertIn(f"| {row.model} | {row.depth} | {row.tokens} |", table)

  def test_progress_goes_to_stderr(self):
    self.assertIn("remat schedules: step times:", self.progress)

  def test_haiku_nesting_uses_the_divisors_nearest_the_square_root(self):
    self.assertEqual(remat_bench.nested_shape(64), (8, 8))
    self.assertEqual(remat_bench.nested_shape(128), (16, 8))
    self.assertEqual(remat_bench.nested_shape(7), (7, 1))


if __name__ == "__main__":
  absltest.main()
