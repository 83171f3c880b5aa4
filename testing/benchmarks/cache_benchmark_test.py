"""Keeps testing/benchmarks/cache_benchmark.py from rotting: its quick mode runs to the end.

No timing is asserted: only the report's structure, the cache hits it counts
and that turning the caches off changes no jaxpr.
"""

import contextlib
import io

from absl.testing import absltest

from haiku_bridge._src import caches
from testing.benchmarks import cache_benchmark


class QuickCacheBenchmarkTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
      cls.report = cache_benchmark.report(cache_benchmark.QUICK, "cache_benchmark_test --quick")
    cls.progress = stderr.getvalue()

  def test_reports_the_run(self):
    for text in (
      "Command: `cache_benchmark_test --quick`",
      "Mode: quick",
      "| CPU count |",
      "| jax |",
      "| haiku_bridge |",
    ):
      self.assertIn(text, self.report)

  def test_three_tables_with_every_model(self):
    hits, rest = self.report.split("### Re-trace of the grad step")
    retrace, first_step = rest.split("### Time to first step")
    for name in cache_benchmark.CASES:
      self.assertIn(f"| {name} |", hits)
      self.assertIn(f"| {name} |", retrace)
    for name in cache_benchmark.QUICK.first_step_cases:
      self.assertIn(f"| {name} |", first_step)
    rows = [line for line in retrace.splitlines() if line.startswith("| ") and "---" not in line]
    self.assertLen(rows, 1 + len(cache_benchmark.CASES))  # With the header.
    self.assertTrue(all(line.count("|") == 10 for line in rows), rows)

  def test_caches_off_change_no_jaxpr(self):
    retrace = self.report.split("### Re-trace of the grad step")[1].split("### Time to first step")[
      0
    ]
    self.assertNotIn("| NO |", retrace)

  def test_each_bridged_model_hits_its_cache_on_a_retrace(self):
    hits = self.report.split("### Re-trace of the grad step")[0]
    for name, case in cache_benchmark.CASES.items():
      row = next(line for line in hits.splitlines() if line.startswith(f"| {name} |"))
      retrace_cell = row.split("|")[-2]
      if case.uses == "none":
        self.assertEqual(retrace_cell.strip(), "none", row)
      else:
        self.assertIn(case.uses, retrace_cell, row)

  def test_progress_goes_to_stderr(self):
    self.assertIn("caches: re-trace, on and off:", self.progress)
    self.assertIn("caches: first step, a process each:", self.progress)

  def test_caches_off_turns_every_cache_off_and_back_on(self):
    enabled = caches.enabled()
    memos = [getattr(module, attr) for module, attr in cache_benchmark.LRU_CACHES.values()]
    with cache_benchmark.caches_off():
      self.assertFalse(caches.enabled())
      self.assertEqual([memo.cache_info().currsize for memo in memos], [0] * len(memos))
    self.assertEqual(caches.enabled(), enabled)


if __name__ == "__main__":
  absltest.main()
