"""Keeps testing/benchmarks/benchmark.py from rotting: its quick mode runs to the end.

No timing is asserted. The test checks that the run writes `results.json` and
every section of `tables.md` (and never `RESULTS.md`, which people write),
reports every target, and draws each point of its tables in the plot (an SVG). The
structural facts are in structure_test.py.
"""

import contextlib
import io
import json
import os
from unittest import mock
from xml.etree import ElementTree

from absl.testing import absltest
import jax
import jax.numpy as jnp

import haiku_bridge as hkb

from testing.benchmarks import benchmark
from testing.benchmarks.lib import config
from testing.benchmarks.lib import fresh_process
from testing.benchmarks.lib import harness
from testing.benchmarks.lib import mlp_bench
from testing.benchmarks.lib import models
from testing.benchmarks.lib import plot
from testing.benchmarks.lib import targets
from testing.benchmarks.lib import trace_rows
from testing.benchmarks.lib.mlp_bench import TraceKey
from testing.benchmarks.lib.stack_bench import StackKey

_SVG = {"svg": "http://www.w3.org/2000/svg"}

SECTIONS = (
  "# haiku_bridge benchmark tables",
  "## Run",
  "## Targets",
  "## 1. `call_pure` vs inline Haiku vs `hk.lift`",
  "### Times (ms)",
  "### Ratios to inline (wall clock)",
  "### Fresh process: first trace and its lowering",
  "### Bridged apply trace: excess over inline (ms)",
  "### `call_pure(pure fn)`: first traces against their floor",
  "### Profiles of the apply trace",
  "## 2. Layer scan vs `hk.layer_stack` vs unrolled loop",
  "## Plot",
)


class QuickBenchmarkTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.out_dir = absltest.get_default_test_tmpdir()
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
      cls.results = benchmark.run(config.QUICK, cls.out_dir, command="benchmark_test --quick")
    cls.progress = stderr.getvalue()
    with open(os.path.join(cls.out_dir, benchmark.TABLES_FILE)) as f:
      cls.markdown = f.read()
    with open(os.path.join(cls.out_dir, benchmark.JSON_FILE)) as f:
      cls.json = json.load(f)

  def test_writes_every_section_in_order(self):
    positions = [self.markdown.find(s) for s in SECTIONS]
    for section, position in zip(SECTIONS, positions):
      self.assertGreaterEqual(position, 0, f"missing section {section!r}")
    self.assertEqual(positions, sorted(positions))

  def test_records_command_machine_and_versions(self):
    for text in (
      "Command: `benchmark_test --quick`",
      "Mode: quick",
      "Date:",
      "| CPU count |",
      "| jax |",
      "| dm-haiku |",
      "| haiku_bridge |",
      "Total run time:",
    ):
      self.assertIn(text, self.markdown)
    self.assertEqual(self.json["run"]["command"], "benchmark_test --quick")
    self.assertEqual(self.json["run"]["config"]["mode"], "quick")

  def test_never_writes_results_md(self):
    self.assertFalse(os.path.exists(os.path.join(self.out_dir, "RESULTS.md")))

  def test_every_target_is_reported(self):
    names = [t.name for t in self.results.targets]
    fragments = [
      "/ inline step time",
      "layer_scan trace+compile",
      "/ hk.layer_stack step time",
      "remat temp memory",
    ]
    fragments += [f"apply trace time, {row}" for row in trace_rows.APPLY_ROWS]
    for fragment in fragments:
      self.assertTrue(any(fragment in n for n in names), fragment)
    for target in self.results.targets:
      self.assertIn(f"| {target.name} |", self.markdown)
    self.assertEqual([t["name"] for t in self.json["targets"]], names)

  def test_json_holds_every_kept_sample(self):
    cfg = config.QUICK
    fresh = [
      s
      for s in self.json["samples"]
      if s.get("row") == trace_rows.FRESH_PROCESS and s["phase"] == "trace"
    ]
    self.assertCountEqual(
      [s["variant"] for s in fresh], models.MLP_VARIANTS + (models.INLINE_COPY,)
    )
    for sample in fresh:
      self.assertLen(sample["seconds"], cfg.fresh_process_repeats)
    fresh_shaping = [
      s
      for s in self.json["samples"]
      if s.get("row") == mlp_bench.EVAL_SHAPE_FRESH and s["phase"] == "trace"
    ]
    self.assertEqual([s["variant"] for s in fresh_shaping], [models.BRIDGED_PURE])
    self.assertLen(fresh_shaping[0]["seconds"], cfg.fresh_process_repeats)
    steps = [s for s in self.json["samples"] if s["benchmark"] == "stack" and s["phase"] == "step"]
    for sample in steps:
      self.assertLen(sample["seconds"], cfg.step_repeats)

  def test_profiles_every_row(self):
    self.assertCountEqual({p.row for p in self.results.profiles}, trace_rows.APPLY_ROWS)

  def test_progress_goes_to_stderr(self):
    # One child per sample: each variant's first trace, and the pure
    # function's first eval_shape(init).
    children = (len(models.MLP_VARIANTS) + 2) * config.QUICK.fresh_process_repeats
    self.assertIn(f"fresh process (tiny): {children}/{children}", self.progress)
    self.assertIn("layer stacks: step times:", self.progress)

  def test_plot_draws_each_point_the_tables_hold(self):
    self.assertIn(f"]({plot.FILE})", self.markdown)
    root = ElementTree.parse(os.path.join(self.out_dir, plot.FILE)).getroot()
    titles = [t.text or "" for t in root.iterfind(".//svg:title", _SVG)]
    res = self.results

    def point(what, x, stat):
      return f"{what} at {x:g}: {stat.median:.4g} [{stat.lo:.4g}–{stat.hi:.4g}]"

    for v in models.STACK_VARIANTS:
      for remat in (False, True):
        label = v + (" + remat" if remat else "")
        for d in res.cfg.depths:
          key, base = StackKey(d, remat, v), StackKey(d, remat, models.LAYER_STACK)
          total = harness.Stat.of(res.stack.compile[key]["total"])
          self.assertIn(point(f"trace + compile of the training step: {label}", d, total), titles)
          if v != models.LAYER_STACK:
            ratio = harness.pair_ratios(res.stack.step, key, base, "step")
            what = f"step time / hk.layer_stack's (same remat), wall clock: {label}"
            self.assertIn(point(what, d, ratio), titles)
          if res.stack.temp_bytes[key] is not None:
            what = f"compiled temporaries of the training step: {label} at {d}: "
            self.assertLen([t for t in titles if t.startswith(what)], 1, what)
    for r in res.mlp:
      for v in models.BRIDGED + (models.LIFT,):
        for row in trace_rows.APPLY_ROWS:
          ratio = harness.pair_ratios(
            r.trace, TraceKey(v, row), TraceKey(models.INLINE, row), "trace"
          )
          self.assertIn(
            f"apply trace time / inline Haiku's, by model size: {v}: {row}, {r.size.name}: "
            f"{ratio.median:.4g} [{ratio.lo:.4g}–{ratio.hi:.4g}]",
            titles,
          )
    self.assertIn(
      f"step time / hk.layer_stack's (same remat), wall clock: goal for layer_scan "
      f"({targets.SCAN_STEP_GOAL})",
      titles,
    )


class FreshProcessParamsTest(absltest.TestCase):
  def test_params_survive_the_npz(self):
    size = models.MlpSize("t", 4, 2, 2)
    params = models.mlp_model(size, models.BRIDGED_TRANSFORMED).init(
      models.KEY, jnp.ones([size.batch, size.width])
    )
    path = os.path.join(absltest.get_default_test_tmpdir(), "params.npz")
    fresh_process.save_params(params, path)
    restored = fresh_process.load_params(path)
    self.assertEqual(jax.tree.structure(restored), jax.tree.structure(params))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params)):
      self.assertTrue(jnp.array_equal(a, b))

  def test_first_eval_shape_times_one_eval_shape_of_the_pure_init(self):
    size = models.MlpSize("t", 4, 2, 2)
    shaped = []
    eval_shape = jax.eval_shape

    def spy(fn, *args):
      shaped.append(jax.tree.map(lambda a: a.shape, eval_shape(fn, *args)))
      return shaped[-1]

    with mock.patch.object(jax, "eval_shape", spy):
      phases = fresh_process.first_eval_shape(models.BRIDGED_PURE, size)
    self.assertGreater(phases["trace"], 0)
    self.assertEqual(shaped, [[{"w": (4, 4), "b": (4,)}] * 2])


class RetraceRowTest(absltest.TestCase):
  def test_the_timed_retrace_finds_the_caches_warm(self):
    # The new-model rows clear the caches between re-trace samples; a
    # re-trace must still time what a user's second trace pays.
    size = models.MlpSize("t", 4, 2, 2)
    f = models.mlp_model(size, models.BRIDGED_PURE)
    x = jnp.ones([size.batch, size.width])
    params = f.init(models.KEY, x)
    hkb.clear_caches()
    eval_shapes_timed = []
    trace_time = harness.trace_time

    def counting_trace_time(*args):
      with mock.patch.object(jax, "eval_shape", wraps=jax.eval_shape) as spy:
        phases = trace_time(*args)
      eval_shapes_timed.append(spy.call_count)
      return phases

    with mock.patch.object(harness, "trace_time", counting_trace_time):
      mlp_bench._retrace(f.apply, params, x)  # pylint: disable=protected-access
    self.assertEqual(eval_shapes_timed, [0])


class ProgressTest(absltest.TestCase):
  def test_reports_first_and_last_step_to_stderr(self):
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
      list(harness.with_progress("things", range(3)))
    lines = stderr.getvalue().splitlines()
    self.assertStartsWith(lines[0].strip(), "things: 1/3")
    self.assertStartsWith(lines[-1].strip(), "things: 3/3")


if __name__ == "__main__":
  absltest.main()
