"""Where a trace of `apply` spends its time: cProfile, summarised into records.

Three views of one profile. Self time by package (haiku_bridge, haiku, jax,
...): what the remaining time is spent on. The bridge's own functions, the
model function, `jax.eval_shape` and Haiku's `get_parameter` by cumulative
time. And calls counted per trace, which machine load cannot move.
"""

import cProfile
import dataclasses
import os
import pstats
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from testing.benchmarks.lib import models
from testing.benchmarks.lib import trace_rows

_MODEL_FUNCTIONS = ("mlp", "pure_mlp")
_MODELS_FILE = os.path.realpath(models.__file__)


class ProfileRow(NamedTuple):
  function: str  # "file.py:line(name)".
  calls: float  # Per trace.
  cumulative_s: float  # Per trace.
  share: float  # Of the whole trace.


# Calls counted per trace. `bind` is JAX binding one primitive: how much
# tracing work was done, whether kept in the jaxpr or thrown away.
COUNTED_CALLS: dict[str, Callable[[str, str], bool]] = {
  "primitive binds": lambda f, n: (
    n == "bind" and f.endswith(os.path.join("jax", "_src", "core.py"))
  ),
  "jax.eval_shape": lambda f, n: n == "eval_shape" and "jax" in f,
  "hk.get_parameter": lambda f, n: n == "get_parameter" and "haiku" in f,
}

# Packages that self time is summed under, first match wins.
PACKAGES = ("haiku_bridge", "haiku", "jax", "jaxlib", "numpy")


@dataclasses.dataclass
class TraceProfile:
  variant: str
  row: str  # One of trace_rows.APPLY_ROWS.
  size: str
  total_s: float  # Per trace, under the profiler (inflated by it).
  self_share_by_package: dict[str, float]  # Sums to 1.
  rows: list[ProfileRow]  # The largest, by cumulative time.
  counts: dict[str, float]  # Calls per trace of COUNTED_CALLS.


def _package(filename: str) -> str:
  if filename == "~" or filename.startswith("<"):
    return "builtins (C)"
  if os.path.realpath(filename) == _MODELS_FILE:
    return "benchmark model"
  parts = filename.split(os.sep)
  return next((p for p in PACKAGES if p in parts), "other Python")


def _listed(filename: str, name: str) -> bool:
  """The functions that explain where a bridged apply trace goes."""
  if "haiku_bridge" in filename.split(os.sep):
    return True
  if name == "eval_shape" and "jax" in filename:
    return True  # The abstract run of `init`.
  if name in _MODEL_FUNCTIONS and _package(filename) == "benchmark model":
    return True
  return name == "get_parameter" and "haiku" in filename


def summarize(
  stats: pstats.Stats, repeats: int, variant: str, row: str, size: str, top: int = 12
) -> TraceProfile:
  """A TraceProfile of `stats`, which hold `repeats` traces."""
  total = stats.total_tt / repeats
  by_package: dict[str, float] = {}
  rows, counts = [], {c: 0.0 for c in COUNTED_CALLS}
  for (filename, line, name), (
    _,
    calls,
    tottime,
    cum,
    _,
  ) in stats.stats.items():  # pytype: disable=attribute-error
    package = _package(filename)
    by_package[package] = by_package.get(package, 0.0) + tottime
    for counted, matches in COUNTED_CALLS.items():
      if matches(filename, name):
        counts[counted] += calls / repeats
    if _listed(filename, name):
      rows.append(
        ProfileRow(
          f"{os.path.basename(filename)}:{line}({name})",
          calls / repeats,
          cum / repeats,
          cum / repeats / total,
        )
      )
  rows.sort(key=lambda r: -r.cumulative_s)
  all_self = sum(by_package.values()) or 1.0
  shares = {p: t / all_self for p, t in sorted(by_package.items(), key=lambda item: -item[1])}
  return TraceProfile(variant, row, size, total, shares, rows[:top], counts)


def profile_in_process(size: models.MlpSize, variant: str, row: str, repeats: int) -> TraceProfile:
  """cProfile of `repeats` traces of `apply`, as row `row` traces it.

  `row` is RETRACE, NEW_SHAPE or NEW_MODEL of `trace_rows` (FRESH_PROCESS
  needs a new process: `fresh_process.profile`).
  """
  f = models.mlp_model(size, variant)
  x = jnp.zeros([size.batch, size.width])
  params = f.init(models.KEY, x)
  jax.jit(models.apply_without_rng(f)).trace(params, x)  # Warm the caches.
  profiler = cProfile.Profile()
  for i in range(repeats):
    if row == trace_rows.NEW_MODEL:
      models.clear_caches()
      f = models.mlp_model(size, variant)
    if row == trace_rows.NEW_SHAPE:
      x = jnp.zeros([size.batch + 1 + i, size.width])
    fn = jax.jit(models.apply_without_rng(f))  # New: no trace-cache hit.
    profiler.enable()
    fn.trace(params, x)
    profiler.disable()
  return summarize(pstats.Stats(profiler), repeats, variant, row, size.name)


def find(profile: TraceProfile, function_name: str) -> Optional[ProfileRow]:
  """The listed row of `function_name` with the most cumulative time."""
  rows = [r for r in profile.rows if r.function.endswith(f"({function_name})")]
  return max(rows, key=lambda r: r.cumulative_s, default=None)
