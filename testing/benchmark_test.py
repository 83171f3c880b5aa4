"""Keeps testing/benchmark.py from rotting: its quick mode runs to the end.

No timing is asserted (this machine's timings are not the benchmark's
business here); the test checks that every section of the results file is
written, that the structural facts hold, and that the program still writes
its Markdown when matplotlib is missing.
"""

import dataclasses
import os
from unittest import mock

from absl.testing import absltest

from testing import benchmark

SECTIONS = (
    "# haiku_bridge benchmarks",
    "## Run",
    "## Targets",
    "## 1. `call_pure` vs inline Haiku vs `hk.lift`",
    "### Times (ms)",
    "### Ratios to inline, wall-clock (per-repetition pairs)",
    "### Ratios to inline, process CPU time (per-repetition pairs)",
    "### Where the bridged apply trace spends its time",
    "### Tracing work, counted",
    "## 2. Layer scan vs `hk.layer_stack` vs unrolled loop",
    "## 3. Structural facts",
    "### Primitive counts of the `apply` jaxpr (nested jaxprs included)",
    "### Training step: primitives, optimised HLO, compiled memory",
    "## Findings",
    "## Plot",
)


class QuickBenchmarkTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.out_dir = absltest.get_default_test_tmpdir()
    cls.results = benchmark.run(quick=True, out_dir=cls.out_dir,
                                command="benchmark_test --quick",
                                log=lambda _: None)
    with open(os.path.join(cls.out_dir, benchmark.RESULTS_FILE)) as f:
      cls.markdown = f.read()

  def test_writes_every_section_in_order(self):
    positions = [self.markdown.find(s) for s in SECTIONS]
    for section, position in zip(SECTIONS, positions):
      self.assertGreaterEqual(position, 0, f"missing section {section!r}")
    self.assertEqual(positions, sorted(positions))

  def test_records_command_machine_and_versions(self):
    for text in ("Command: `benchmark_test --quick`", "Mode: quick", "Date:",
                 "| CPU count |", "| jax |", "| dm-haiku |",
                 "| haiku_bridge |", "Total run time:"):
      self.assertIn(text, self.markdown)

  def test_every_target_is_reported(self):
    names = [t.name for t in self.results.targets]
    for fragment in ("/ inline step time", "apply trace time, re-trace",
                     "apply trace time, new input shape",
                     "apply trace time, new model",
                     "layer_scan trace+compile", "/ hk.layer_stack step time",
                     "remat temp memory"):
      self.assertTrue(any(fragment in n for n in names), fragment)
    for target in self.results.targets:
      self.assertIn(target.name, self.markdown)
    self.assertEqual(
        self.markdown.count("| PASS |") + self.markdown.count("| **MISS** |"),
        len(self.results.targets))

  def test_bridged_apply_has_the_inline_primitives(self):
    # A structural fact, not a timing: the bridge adds no op to the jaxpr.
    for res in self.results.mlp:
      for variant in benchmark.BRIDGED:
        self.assertEqual(res.apply_counts[variant],
                         res.apply_counts[benchmark.INLINE], variant)
    self.assertIn("Bridged apply counts equal inline: **yes**", self.markdown)

  def test_plot_written_when_matplotlib_is_installed(self):
    plot = os.path.join(self.out_dir, benchmark.PLOT_FILE)
    if benchmark._pyplot() is None:
      self.assertIsNone(self.results.plot_file)
      self.assertIn("Not drawn: matplotlib is not installed", self.markdown)
    else:
      self.assertTrue(os.path.getsize(plot) > 0)
      self.assertIn(f"]({benchmark.PLOT_FILE})", self.markdown)

  def test_markdown_without_matplotlib(self):
    with mock.patch.object(benchmark, "_pyplot", return_value=None):
      self.assertFalse(benchmark.write_plot(self.results, "/nonexistent.png"))
    without_plot = dataclasses.replace(self.results, plot_file=None)
    self.assertIn("Not drawn: matplotlib is not installed",
                  benchmark.markdown(without_plot))


if __name__ == "__main__":
  absltest.main()
