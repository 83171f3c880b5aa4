r"""Benchmark of `remat="auto"` (issue 37): the plans it can pick, predicted and compiled.

For an LSTM (T = 256, 1024, 4096; the loss after the unroll and in the step),
residual MLP stacks and transformer stacks (depth 16 and 64), all small
(`lib/remat_auto_bench.py`): every candidate `hkb.remat_plan` weighs, with
its predicted training-step temporaries and recomputed steps; the manual
plans and auto's picks at a loose, a middle and a tight budget compiled
beside their predictions. Prints the run (command, date, machine, versions)
and the tables to stdout, progress to stderr; with `--plot=PATH`, writes the
Pareto plot (an SVG, no dependencies). `testing/benchmarks/results/RESULTS.md`
holds the conclusions people draw from them; this program never writes it.
The memory relations are tests (`haiku_bridge/_src/remat/plan_test.py`).

    bazel run //testing/benchmarks:remat_auto_benchmark              # full run
    bazel run //testing/benchmarks:remat_auto_benchmark -- --quick   # smoke run
    bazel run //testing/benchmarks:remat_auto_benchmark -- --planning_only
    bazel run //testing/benchmarks:remat_auto_benchmark -- --planning_only \
        --planning_models=gru_char_T2048_h256_batch8  # One model's.

The planning table times each model's first compiled step in fresh
processes (JAX's compilation cache off): with `remat=True`, with
`remat="auto"` planning cold, and in a second process reading the plan
from disk. This process touches no backend while they run, so on a TPU,
which one process holds at a time, they may.

or, without Bazel, from the repository root:

    PYTHONPATH=. python3 testing/benchmarks/remat_auto_benchmark.py \
        --plot=testing/benchmarks/results/remat_auto_pareto.svg > remat_auto.md
"""

import dataclasses
import sys
import time
from typing import Sequence

from absl import app
from absl import flags

from testing.benchmarks.lib import environment
from testing.benchmarks.lib import remat_auto_bench


def report(
  cfg: remat_auto_bench.Config,
  command: str,
  plot: str = "",
  planning_only: bool = False,
  planning_models: Sequence[str] = (),
) -> str:
  """Runs the benchmark; returns the run's description and its tables."""
  start = time.perf_counter()
  # Planning first: its figures come from fresh processes, which on a TPU
  # can hold the chip only while this one does not.
  planning = remat_auto_bench.planning_markdown(remat_auto_bench.planning(cfg, planning_models))
  tables = ""
  if not planning_only:
    results = remat_auto_bench.bench(cfg)
    print("remat auto: results " + repr(results), file=sys.stderr, flush=True)
    tables = remat_auto_bench.markdown(results) + "\n"
  tables += planning
  if plot and not planning_only:
    with open(plot, "w") as f:
      f.write(remat_auto_bench.pareto_svg(results))
    tables += f"\nPlot: `{plot}`\n"
  return (
    environment.run_header(
      "remat=\"auto\" (`testing/benchmarks/remat_auto_benchmark.py`)",
      command,
      cfg.mode,
      time.perf_counter() - start,
    )
    + "\n"
    + tables
  )


def main(argv: list[str]) -> None:
  del argv  # Flags only.
  cfg = remat_auto_bench.QUICK if flags.FLAGS.quick else remat_auto_bench.FULL
  if flags.FLAGS.planning_repeats:
    cfg = dataclasses.replace(cfg, planning_repeats=flags.FLAGS.planning_repeats)
  print(
    report(
      cfg,
      " ".join(["python3"] + sys.argv),
      flags.FLAGS.plot,
      flags.FLAGS.planning_only,
      flags.FLAGS.planning_models,
    )
  )


if __name__ == "__main__":
  # Defined here, not on import: the other benchmarks' modules define a
  # `--quick` too, and one process (pytest) may import them all.
  flags.DEFINE_bool("quick", False, "Smoke mode: tiny models.")
  flags.DEFINE_string("plot", "", "Where to write the Pareto plot (an SVG); empty: no plot.")
  flags.DEFINE_bool("planning_only", False, "Only the planning times (each in fresh processes).")
  flags.DEFINE_integer(
    "planning_repeats", 0, "Fresh processes per planning figure (the least is kept); 0: the mode's."
  )
  flags.DEFINE_list(
    "planning_models", [], "The planning models to time (names as in the table); empty: all."
  )
  app.run(main)
