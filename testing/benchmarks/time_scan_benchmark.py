r"""Benchmark of the time scan's remat schedules: memory, step time and compile time against T.

`hkb.dynamic_unroll(remat="nested")` and `remat="binomial"` beside
`hk.dynamic_unroll`, `hk.dynamic_unroll(hk.remat(core))`, Equinox's
checkpointed scan and the two-level `jax.checkpoint` recipe
(`lib/time_scan_bench.py`), for a character language model written three
ways: the loss after the unroll (the usual way), the loss in the step, and
the usual model converted to `readout=`. Grad-step temporaries, step time
and lower + compile time at T = 256, 1024 and 4096, as ratios to the
per-step remat. Prints the run (command, date, machine, versions) and the
tables to stdout, progress to stderr; with `--plot=PATH`, draws the
temporaries against T (an SVG, `lib/svg.py`). `testing/benchmarks/results/RESULTS.md`
holds the conclusions people draw from them; this program never writes it.
Timings never fail the program; the memory relations are tests
(`haiku_bridge/_src/time_scan_test.py`).

    bazel run //testing/benchmarks:time_scan_benchmark              # full run
    bazel run //testing/benchmarks:time_scan_benchmark -- --quick   # smoke run, seconds

or, without Bazel, from the repository root:

    PYTHONPATH=. python3 testing/benchmarks/time_scan_benchmark.py \
        --plot=testing/benchmarks/results/time_scan_memory.svg > time_scan.md
"""

import sys
import time

from absl import app
from absl import flags

from testing.benchmarks.lib import environment
from testing.benchmarks.lib import time_scan_bench


def report(cfg: time_scan_bench.TimeScanConfig, command: str, plot: str = "") -> str:
  """Runs the benchmark; returns the run's description and its tables."""
  start = time.perf_counter()
  result = time_scan_bench.bench_time_scan(cfg)
  text = (
    environment.run_header(
      "Time scan (`testing/benchmarks/time_scan_benchmark.py`)",
      command,
      cfg.mode,
      time.perf_counter() - start,
    )
    + "\n"
    + time_scan_bench.markdown(result)
  )
  if plot:
    with open(plot, "w") as f:
      f.write(time_scan_bench.memory_svg(result))
    text += f"\nPlot: `{plot}`\n"
  return text


def main(argv: list[str]) -> None:
  del argv  # Flags only.
  quick, plot = flags.FLAGS.quick, flags.FLAGS.plot
  print(
    report(
      time_scan_bench.QUICK if quick else time_scan_bench.FULL,
      " ".join(["python3"] + sys.argv),
      plot,
    )
  )


if __name__ == "__main__":
  # Defined here, not on import: the other benchmarks' modules define a
  # `--quick` too, and one process (pytest) may import them all.
  flags.DEFINE_bool("quick", False, "Smoke mode: a tiny model, short sequences, few repetitions.")
  flags.DEFINE_string(
    "plot",
    "",
    "Where to write the plot of memory against T (an SVG); empty: no plot.",
  )
  app.run(main)
