r"""Benchmarks: the bridge against inline Haiku, `hk.lift` and `hk.layer_stack`.

Runs, side by side on this machine, the two benchmarks of `lib/` beside it:

1. `mlp_bench`: `hkb.call_pure` against the same MLP inline in Haiku and
   `hk.lift` + apply: trace time of `init` and of `apply` (re-trace, new input
   shape, new model, fresh process), compile time and step time.
2. `stack_bench`: the layer scan against `hk.layer_stack` and an unrolled loop,
   by depth, with and without remat.

It profiles the apply traces, checks the targets (`lib/targets.py`), and
writes to `--out_dir` (default: `results/` beside this file)
`results.json` (every sample, the targets, the profiles), `tables.md` (the
Markdown tables) and `compile_time_vs_depth.svg` (the plot, `lib/plot.py`).
`RESULTS.md` there holds the conclusions
people draw from the tables; this program never writes it.
Progress goes to stderr; the targets table to stdout. Timings never fail the
program; the structural facts (same optimised HLO, primitive counts) are
tests: `testing/structure_test.py`.

    bazel run //testing/benchmarks:benchmark              # full run, ~10 minutes
    bazel run //testing/benchmarks:benchmark -- --quick   # smoke run, < 1 minute

or, without Bazel, from the repository root:

    PYTHONPATH=. python3 testing/benchmarks/benchmark.py [--quick] [--out_dir=DIR]
"""

import datetime
import os
import sys
import tempfile
import time
from typing import Optional

from absl import app
from absl import flags

from testing.benchmarks.lib import config
from testing.benchmarks.lib import environment
from testing.benchmarks.lib import fresh_process
from testing.benchmarks.lib import harness
from testing.benchmarks.lib import mlp_bench
from testing.benchmarks.lib import models
from testing.benchmarks.lib import plot
from testing.benchmarks.lib import results
from testing.benchmarks.lib import stack_bench
from testing.benchmarks.lib import tables
from testing.benchmarks.lib import targets
from testing.benchmarks.lib import trace_profile
from testing.benchmarks.lib import trace_rows

_QUICK = flags.DEFINE_bool("quick", False, "Smoke mode: tiny models, few repetitions.")
_OUT_DIR = flags.DEFINE_string(
  "out_dir",
  "testing/benchmarks/results",
  "Where to write results.json, tables.md and the plot. A relative path is "
  "taken from the workspace root under `bazel run`, else from the current "
  "directory.",
)

JSON_FILE = "results.json"
TABLES_FILE = "tables.md"
PROFILED_VARIANTS = (models.INLINE,) + models.BRIDGED


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def profiles(cfg: config.Config) -> list[trace_profile.TraceProfile]:
  """Profiles of the apply trace, every row, at the middle model size."""
  size = cfg.mlp_sizes[len(cfg.mlp_sizes) // 2]
  in_process = [
    (row, v)
    for row in trace_rows.APPLY_ROWS
    if row != trace_rows.FRESH_PROCESS
    for v in PROFILED_VARIANTS
  ]
  out = [
    trace_profile.profile_in_process(size, v, row, cfg.profile_repeats)
    for row, v in harness.with_progress("profiles", in_process)
  ]
  x = mlp_bench.example_input(size)
  with tempfile.TemporaryDirectory() as directory:
    paths = fresh_process.write_params(
      size, {v: models.mlp_model(size, v).init(models.KEY, x) for v in PROFILED_VARIANTS}, directory
    )
    for v in harness.with_progress("profiles, fresh process", PROFILED_VARIANTS):
      out.append(fresh_process.profile(size, v, paths[v], cfg.fresh_profile_repeats, directory))
  return out


def run(cfg: config.Config, out_dir: str, command: Optional[str] = None) -> results.Results:
  """Runs every benchmark, writes the results to `out_dir`; returns them."""
  start = time.perf_counter()
  env = environment.environment()
  _log("1. call_pure vs inline vs hk.lift")
  mlp = [mlp_bench.bench_mlp(size, cfg) for size in cfg.mlp_sizes]
  _log("   profiling the apply traces")
  trace_profiles = profiles(cfg)
  _log("2. layer scan vs hk.layer_stack vs loop")
  stack = stack_bench.bench_stack(cfg)

  res = results.Results(
    cfg=cfg,
    command=command or " ".join(["python3"] + sys.argv),
    date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    env=env,
    mlp=mlp,
    stack=stack,
    profiles=trace_profiles,
    targets=targets.evaluate(mlp, stack, cfg),
    run_s=0.0,
  )
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, plot.FILE), "w") as f:
    f.write(plot.figure(res))
  res.run_s = time.perf_counter() - start
  results.write_json(res, os.path.join(out_dir, JSON_FILE))
  with open(os.path.join(out_dir, TABLES_FILE), "w") as f:
    f.write(tables.markdown(res))
  written = [JSON_FILE, TABLES_FILE, plot.FILE]
  _log("Wrote " + ", ".join(os.path.join(out_dir, f) for f in written))
  return res


def resolve_out_dir(out_dir: str) -> str:
  if not os.path.isabs(out_dir) and "BUILD_WORKSPACE_DIRECTORY" in os.environ:
    # `bazel run` starts in the runfiles tree; write into the workspace.
    out_dir = os.path.join(os.environ["BUILD_WORKSPACE_DIRECTORY"], out_dir)
  return out_dir


def main(argv: list[str]) -> None:
  del argv  # Flags only.
  res = run(config.QUICK if _QUICK.value else config.FULL, resolve_out_dir(_OUT_DIR.value))
  print("\n".join(tables.targets_section(res.targets)))


if __name__ == "__main__":
  app.run(main)
