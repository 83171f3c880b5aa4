"""Keeps testing/benchmarks/pipeline_benchmark.py from rotting: its quick mode runs to the end.

No timing is asserted; what the rows must say is checked where the schedule and the
sharding are (haiku_bridge/_src/pipeline/pipeline_test.py). Here: every row is there, the
param bytes per device are 1/S of the data-parallel run's, and the plot (`--plot`, an SVG)
draws the cost table's figures.
"""

import contextlib
import io
import os
import re
import tempfile
from xml.etree import ElementTree

from absl.testing import absltest

from testing import pipeline_cost
from testing.benchmarks import pipeline_benchmark


class QuickPipelineBenchmarkTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    plot = os.path.join(tempfile.mkdtemp(), "memory.svg")
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
      cls.report = pipeline_benchmark.report(
        pipeline_benchmark.QUICK,
        "pipeline_benchmark_test --quick",
        pipeline_benchmark.QUICK_COST,
        plot=plot,
      )
    cls.progress = stderr.getvalue()
    cls.svg = ElementTree.parse(plot).getroot()

  def test_reports_the_run(self):
    for text in (
      "Command: `pipeline_benchmark_test --quick`",
      "Mode: quick",
      "| CPU count |",
      "| jax |",
      "| haiku_bridge |",
    ):
      self.assertIn(text, self.report)

  def test_a_row_per_stage_count_schedule_and_microbatches(self):
    cfg = pipeline_benchmark.QUICK
    for s in cfg.stages:
      for schedule in ("gpipe", "circular"):
        for name in cfg.microbatches:
          m = pipeline_benchmark.microbatch_count(name, s)
          row = re.search(rf"^\| {s} \| {schedule} \| {m} \| \d+ \| ([\d.]+) \|", self.report, re.M)
          self.assertIsNotNone(row, (s, schedule, m))
          self.assertAlmostEqual(float(row[1]), 1 / s, places=3)
          # Step time: paired ratios, median [min–max] (CPU median).
          self.assertRegex(
            self.report,
            rf"(?m)^\| {s} \| {schedule} \| {m} \| .* \| "
            r"\d+\.\d{3} \[\d+\.\d{3}–\d+\.\d{3}\] \(\d+\.\d{2}\) \|$",
          )
          self.assertIn(f"S={s} {schedule} M={m}", self.progress)

  def test_a_cost_row_per_stage_count_schedule_microbatches_placement_and_axes(self):
    cfg = pipeline_benchmark.QUICK_COST
    # Bytes, then measured / theory, "theory 0", or 0 where both are.
    cell = r"(?:\d+ \([\d.]+\)|\d+ \(theory 0\)|0)"
    cells = r" \| ".join([cell] * len(pipeline_cost.ROWS))
    for s in cfg.stages:
      for schedule in ("gpipe", "circular"):
        for name in cfg.microbatches:
          m = pipeline_benchmark.microbatch_count(name, s)
          for placement in pipeline_cost.PLACEMENTS:
            for axes in ("Explicit", "Auto"):
              self.assertRegex(
                self.report,
                rf"(?m)^\| {s} \| {schedule} \| {m} \| {placement} \| "
                rf"{axes} \| \d+ \| \d+ \| [\d.]+ \| {cells} \|$",
              )
            self.assertIn(f"cost: S={s} {schedule} M={m} {placement}", self.progress)

  def test_bytes_against_theory(self):
    # The collective-permute: 2 microbatches per timetable step, exactly,
    # and with circular's params stored over the stages 2 × stage params
    # more (theory is testing/pipeline_cost.py's; pipeline_cost_test pins
    # every kind). Not circular `stage` on Auto axes, whose partitioner
    # moves those params all-to-all and gathers their gradient whole
    # (pipeline_cost_test's expected failure).
    column = 8 + pipeline_cost.ROWS.index("collective-permute")
    rows = 0
    for line in self.report.splitlines():
      if re.match(r"^\| \d+ \| (gpipe|circular) \| \d+ \| (init|stage) \|", line) and not re.match(
        r"^\| \d+ \| circular \| \d+ \| stage \| Auto", line
      ):
        rows += 1
        self.assertRegex(line.split(" | ")[column], r"^\d+ \(1\.00\)$")
    self.assertGreater(rows, 0)

  def test_plot_draws_the_cost_table(self):
    # Each point's title and each panel's bound against the table's bytes.
    ns = {"svg": "http://www.w3.org/2000/svg"}
    titles = {t.text for t in self.svg.iterfind(".//svg:title", ns)}
    cfg = pipeline_benchmark.QUICK_COST
    mib = 2**20
    for s in cfg.stages:
      for schedule in ("gpipe", "circular"):
        for name in cfg.microbatches:
          m = pipeline_benchmark.microbatch_count(name, s)
          for kind in ("Explicit", "Auto"):
            row = re.search(
              rf"(?m)^\| {s} \| {schedule} \| {m} \| init \| "
              rf"{kind} \| (\d+) \| (\d+) \|",
              self.report,
            )
            stage_params, temp = int(row[1]), int(row[2])
            self.assertIn(f"S={s} {schedule} {kind} M={m}: {temp / mib:.3f} MiB", titles)
          self.assertIn(f"S={s} bound: 3 × stage params = {3 * stage_params / mib:.3f} MiB", titles)
    lines = {line.get("class") for line in self.svg.iterfind(".//svg:polyline", ns)}
    self.assertEqual(lines, {"gpipe Explicit", "gpipe Auto", "circular Explicit", "circular Auto"})
    self.assertIn("Plot: `", self.report)


if __name__ == "__main__":
  absltest.main()
