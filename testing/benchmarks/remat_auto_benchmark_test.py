"""Keeps testing/benchmarks/remat_auto_benchmark.py from rotting: its quick mode runs to the end.

The budget and prediction relations themselves are tests in
haiku_bridge/_src/remat/plan_test.py; here, that the report and the plot
carry every model, plan and budget.
"""

import contextlib
import io
import os
import tempfile
from unittest import mock
from xml.etree import ElementTree

from absl.testing import absltest
from jax._src import xla_bridge

from haiku_bridge._src.remat import plan as remat_plan
from testing import test_utils
from testing.benchmarks import remat_auto_benchmark
from testing.benchmarks.lib import remat_auto_bench

_NS = {"svg": "http://www.w3.org/2000/svg"}


class QuickRematAutoBenchmarkTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    plot = os.path.join(tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR")), "pareto.svg")
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
      cls.report = remat_auto_benchmark.report(
        remat_auto_bench.QUICK, "remat_auto_benchmark_test --quick", plot
      )
    cls.progress = stderr.getvalue()
    cls.svg = ElementTree.parse(plot).getroot()
    cls.models = list(remat_auto_bench.models(remat_auto_bench.QUICK))

  def test_reports_the_run(self):
    for text in (
      "Command: `remat_auto_benchmark_test --quick`",
      "Mode: quick",
      "| CPU count |",
      "| jax |",
      "| haiku_bridge |",
    ):
      self.assertIn(text, self.report)

  def test_a_row_per_model_and_budget_and_per_compiled_plan(self):
    picks, compiled = self.report.split("### Predicted against compiled")
    for model in self.models:
      for budget in remat_auto_bench.BUDGETS:
        self.assertIn(f"| {model} | {budget} |", picks)
        self.assertIn(f"| {model} | auto ({budget}): ", compiled)
      for remat, _ in remat_auto_bench.MANUAL:
        self.assertIn(f"| {model} | {remat}", compiled)

  def test_plot_marks_every_candidate_and_each_pick(self):
    titles = [t.text or "" for t in self.svg.iterfind(".//svg:title", _NS)]
    for model in self.models:
      self.assertGreater(sum(t.startswith(f"{model} candidate ") for t in titles), 4)
      for budget in remat_auto_bench.BUDGETS:
        self.assertTrue(
          any(t.startswith(f"{model} auto {budget}: ") for t in titles), (model, budget)
        )
        self.assertTrue(
          any(t.startswith(f"{model} {budget} budget: ") for t in titles), (model, budget)
        )
    self.assertLen(self.svg.findall(".//svg:polyline[@class='pareto']", _NS), len(self.models))

  def test_a_row_per_planning_model(self):
    _, planning = self.report.split("### What planning costs")
    for model in remat_auto_bench.planning_models("quick"):
      self.assertIn(f"| {model} | ", planning)

  def test_planning_holds_no_backend_so_its_children_may_hold_a_tpu(self):
    # On a TPU one process at a time may hold the chip: with a key made on
    # import, every child failed ("Unable to initialize backend 'tpu'").
    child = test_utils.run_in_fresh_process(__file__, "plan_with_no_backend")
    self.assertEqual(child.returncode, 0, child.stderr[-3000:])

  def test_planning_times_the_models_named(self):
    with children_faked():
      full = remat_auto_bench.FULL
      named = ["conv_depth_32_c64_w256_batch8", "gru_char_T2048_h256_batch8"]
      self.assertEqual(
        [r.name for r in remat_auto_bench.planning(full)],
        list(remat_auto_bench.planning_models("full")),
      )
      self.assertEqual(
        [r.name for r in remat_auto_bench.planning(full, named)],
        [n for n in remat_auto_bench.planning_models("full") if n in named],
      )
      with self.assertRaisesRegex(
        ValueError,
        r"no planning model named \['gru'\] in full mode; "
        "the models: transformer_24_blocks",
      ):
        remat_auto_bench.planning(full, ["gru"])

  def test_progress_goes_to_stderr(self):
    self.assertIn("remat auto: ", self.progress)

  def test_pareto_front(self):
    c = remat_plan.RematCandidate
    front = remat_auto_bench.pareto(
      [
        c(False, None, None, 100, 0, 0),
        c(True, None, None, 40, 8, 80),
        c("nested", 4, 2, 50, 12, 120),
        c("binomial", 2, None, 30, 20, 200),
      ]
    )
    self.assertEqual([k.temporaries for k in front], [100, 40, 30])


@contextlib.contextmanager
def children_faked():
  """`remat_auto_bench.planning`'s fresh processes replaced by made-up figures (its progress dropped)."""
  figures = {"seconds": 1.0, "cpu_seconds": 1.0, "plan": "binomial, 1 slots", "budget": 1024}
  with (
    mock.patch.object(remat_auto_bench, "_in_fresh_process", return_value=figures),
    contextlib.redirect_stderr(io.StringIO()),
  ):
    yield


def plan_with_no_backend() -> None:
  """In a fresh process: the benchmark imported and its planning run, children faked, start no backend."""
  with children_faked():
    remat_auto_bench.planning(remat_auto_bench.QUICK)
  assert not xla_bridge._backends, xla_bridge._backends  # pylint: disable=protected-access


if __name__ == "__main__":
  absltest.main()
