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
The memory relations are tests (`haiku_bridge/_src/remat_plan_test.py`).

    bazel run //testing/benchmarks:remat_auto_benchmark              # full run
    bazel run //testing/benchmarks:remat_auto_benchmark -- --quick   # smoke run

or, without Bazel, from the repository root:

    PYTHONPATH=. python3 testing/benchmarks/remat_auto_benchmark.py \
        --plot=testing/benchmarks/results/remat_auto_pareto.svg > remat_auto.md
"""

import sys
import time

from absl import app
from absl import flags

from testing.benchmarks.lib import environment
from testing.benchmarks.lib import remat_auto_bench


def report(cfg: remat_auto_bench.Config, command: str, plot: str = "") -> str:
  """Runs the benchmark; returns the run's description and its tables."""
  start = time.perf_counter()
  results = remat_auto_bench.bench(cfg)
  print("remat auto: results " + repr(results), file=sys.stderr, flush=True)
  tables = remat_auto_bench.markdown(results)
  tables += "\n" + remat_auto_bench.planning_markdown(
      remat_auto_bench.planning(cfg))
  if plot:
    with open(plot, "w") as f:
      f.write(remat_auto_bench.pareto_svg(results))
    tables += f"\nPlot: `{plot}`\n"
  return environment.run_header(
      "remat=\"auto\" (`testing/benchmarks/remat_auto_benchmark.py`)", command,
      cfg.mode, time.perf_counter() - start) + "\n" + tables


def main(argv: list[str]) -> None:
  del argv  # Flags only.
  print(report(remat_auto_bench.QUICK if flags.FLAGS.quick else
               remat_auto_bench.FULL, " ".join(["python3"] + sys.argv),
               flags.FLAGS.plot))


if __name__ == "__main__":
  # Defined here, not on import: the other benchmarks' modules define a
  # `--quick` too, and one process (pytest) may import them all.
  flags.DEFINE_bool("quick", False, "Smoke mode: tiny models.")
  flags.DEFINE_string("plot", "", "Where to write the Pareto plot (an SVG); "
                      "empty: no plot.")
  app.run(main)
