"""Keeps testing/benchmarks/time_scan_benchmark.py from rotting: its quick mode runs to the end.

No timing is asserted; the memory relations are in haiku_bridge/_src/time_scan_test.py.
"""

import contextlib
import io
import os
import tempfile

from absl.testing import absltest

from testing.benchmarks import time_scan_benchmark
from testing.benchmarks.lib import time_scan_bench


class QuickTimeScanBenchmarkTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.plot = os.path.join(tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR")),
                            "memory.png")
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
      cls.report = time_scan_benchmark.report(
          time_scan_bench.QUICK, "time_scan_benchmark_test --quick", cls.plot)
    cls.progress = stderr.getvalue()

  def test_reports_the_run(self):
    for text in ("Command: `time_scan_benchmark_test --quick`", "Mode: quick",
                 "| CPU count |", "| jax |", "| haiku_bridge |"):
      self.assertIn(text, self.report)

  def test_every_length_and_variant_in_the_tables(self):
    temp, rest = self.report.split("### Carries kept")
    step = rest.split("### Step time")[1]
    for table in (temp, step):
      for variant in time_scan_bench.VARIANTS:
        self.assertIn(variant, table)
      for length in time_scan_bench.QUICK.lengths:
        self.assertIn(f"| {length} |", table)
    self.assertIn("### Growth of the temporaries from T = 8 to T = 32", rest)

  def test_plot_written_or_said_missing(self):
    if os.path.exists(self.plot):
      self.assertIn(f"Plot: `{self.plot}`", self.report)
    else:
      self.assertIn("No plot: matplotlib is not installed.", self.report)

  def test_progress_goes_to_stderr(self):
    self.assertIn("time scan: step times:", self.progress)

  def test_schedule_slots(self):
    # The carries the table counts: one per step, or the schedule's slots.
    self.assertEqual(time_scan_bench.slots(time_scan_bench.BASELINE, 1024),
                     1024)
    self.assertEqual(time_scan_bench.slots(time_scan_bench.NESTED, 1024), 62)


if __name__ == "__main__":
  absltest.main()
