"""Keeps testing/benchmarks/time_scan_benchmark.py from rotting: its quick mode runs to the end.

No timing is asserted; the memory relations are in haiku_bridge/_src/time_scan_test.py.
"""

import contextlib
import io
import os
import tempfile
from xml.etree import ElementTree

from absl.testing import absltest

from testing.benchmarks import time_scan_benchmark
from testing.benchmarks.lib import time_scan_bench

_SVG = {"svg": "http://www.w3.org/2000/svg"}


class QuickTimeScanBenchmarkTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.plot = os.path.join(tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR")), "memory.svg")
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
      cls.report = time_scan_benchmark.report(
        time_scan_bench.QUICK, "time_scan_benchmark_test --quick", cls.plot
      )
    cls.progress = stderr.getvalue()

  def test_reports_the_run(self):
    for text in (
      "Command: `time_scan_benchmark_test --quick`",
      "Mode: quick",
      "| CPU count |",
      "| jax |",
      "| haiku_bridge |",
    ):
      self.assertIn(text, self.report)

  def test_every_length_form_and_variant_in_the_tables(self):
    temp, rest = self.report.split("### Carries kept")
    for form in time_scan_bench.FORMS:
      table = temp.split(f": {form}\n")[1].split("###")[0]
      step = rest.split(f"### Step time / {time_scan_bench.BASELINE}: {form};")[1].split("###")[0]
      for variant in time_scan_bench.FORM_VARIANTS[form]:
        self.assertIn(variant, table)
        if variant != time_scan_bench.BASELINE:
          self.assertIn(variant, step)
      for length in time_scan_bench.QUICK.lengths:
        self.assertIn(f"| {length} |", table)
        self.assertIn(f"| {length} |", step)
    self.assertIn("### Binomial against Equinox's checkpointed scan", rest)
    self.assertIn("### Lower + compile time (s)", rest)

  def test_plot_draws_each_form_variant_and_length(self):
    self.assertIn(f"Plot: `{self.plot}`", self.report)
    root = ElementTree.parse(self.plot).getroot()
    titles = [t.text or "" for t in root.iterfind(".//svg:title", _SVG)]
    lines = {line.get("class") for line in root.iterfind(".//svg:polyline", _SVG)}
    drawn = [
      (f, v)
      for f in (time_scan_bench.AFTER, time_scan_bench.IN_STEP)
      for v in time_scan_bench.FORM_VARIANTS[f]
    ]
    drawn.append((time_scan_bench.AFTER, 'readout=, remat="binomial"'))
    for form, variant in drawn:
      self.assertIn(variant, lines)
      for length in time_scan_bench.QUICK.lengths:
        prefix = f"{form}: {variant}, T={length}: "
        mib = [float(t[len(prefix) :].split()[0]) for t in titles if t.startswith(prefix)]
        self.assertLen(mib, 1, prefix)
        self.assertGreater(mib[0], 0, prefix)

  def test_progress_goes_to_stderr(self):
    self.assertIn("time scan: step times:", self.progress)

  def test_schedule_slots(self):
    # The carries the table counts: one per step, or the schedule's slots.
    self.assertEqual(time_scan_bench.slots(time_scan_bench.BASELINE, 1024), 1024)
    self.assertEqual(time_scan_bench.slots(time_scan_bench.NESTED, 1024), 62)
    self.assertEqual(time_scan_bench.slots(time_scan_bench.BINOMIAL, 1024), 43)
    self.assertEqual(time_scan_bench.slots(time_scan_bench.EQUINOX, 1024), 44)


if __name__ == "__main__":
  absltest.main()
