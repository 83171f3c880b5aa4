r"""Benchmark of the layer scan's remat schedules: memory and step time.

`layer_scan(remat="nested")` and `remat="binomial"` beside `hk.layer_stack` +
`hk.remat` (`lib/remat_bench.py`): grad-step temporaries and step time, as
ratios, for a residual MLP stack at depths 16, 64 and 128 with 4096 and 64
tokens per step, and for one transformer. Prints the run (command, date,
machine, versions) and the tables to stdout, progress to stderr.
`testing/benchmarks/results/RESULTS.md` holds the conclusions people draw from them;
this program never writes it. Timings never fail the program; the
memory relations are tests (`testing/structure_test.py`).

    bazel run //testing/benchmarks:remat_benchmark              # full run, ~10 minutes
    bazel run //testing/benchmarks:remat_benchmark -- --quick   # smoke run, seconds

or, without Bazel, from the repository root:

    PYTHONPATH=. python3 testing/benchmarks/remat_benchmark.py [--quick] > remat.md
"""

import sys
import time

from absl import app
from absl import flags

from testing.benchmarks.lib import environment
from testing.benchmarks.lib import remat_bench

_QUICK = flags.DEFINE_bool("quick", False, "Smoke mode: tiny models, few repetitions.")


def report(cfg: remat_bench.RematConfig, command: str) -> str:
  """Runs the benchmark; returns the run's description and its tables."""
  start = time.perf_counter()
  result = remat_bench.bench_remat(cfg)
  return (
    environment.run_header(
      "Remat schedules (`testing/benchmarks/remat_benchmark.py`)",
      command,
      cfg.mode,
      time.perf_counter() - start,
    )
    + "\n"
    + remat_bench.markdown(result)
  )


def main(argv: list[str]) -> None:
  del argv  # Flags only.
  print(
    report(
      remat_bench.QUICK if _QUICK.value else remat_bench.FULL, " ".join(["python3"] + sys.argv)
    )
  )


if __name__ == "__main__":
  app.run(main)
