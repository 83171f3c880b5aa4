"""Side-by-side timing: samples, medians, paired ratios, progress on stderr.

Every measurement is repeated; the first repetitions are warm-up and dropped.
Within a repetition the compared variants run one after another, in an order
rotated each repetition, so that load on a shared machine hits them alike;
ratios are taken pair by pair (variant A's sample over variant B's sample from
the same repetition) and summarised as median [min-max]. Python's garbage
collector is off inside each timed region. Next to wall-clock time each sample
records this process's CPU time, which other processes' load hardly moves.
"""

import dataclasses
import gc
import math
import statistics
import sys
import time
from typing import Any, Callable, Hashable, Iterable, Iterator, NamedTuple, Optional

import jax

# Suffix of the phase that holds process CPU time next to a wall-clock phase:
# `{"trace": 0.01, "trace cpu": 0.009}`.
CPU = " cpu"

Phases = dict[str, float]  # Seconds by phase name, one sample.
Measurement = Callable[[], Phases]
# For each key, for each phase, the kept samples; sample `i` of every key in
# the same group comes from repetition `i`, so ratios pair up.
Samples = dict[Hashable, dict[str, list[float]]]


class Stat(NamedTuple):
  """Median with the range of the samples."""

  median: float
  lo: float
  hi: float

  @classmethod
  def of(cls, samples: Iterable[float]) -> "Stat":
    samples = list(samples)
    return cls(statistics.median(samples), min(samples), max(samples))

  def ms(self, digits: int = 2) -> str:
    return f"{self.median * 1e3:.{digits}f} [{self.lo * 1e3:.{digits}f}–{self.hi * 1e3:.{digits}f}]"

  def ratio(self) -> str:
    return f"{self.median:.3f} [{self.lo:.3f}–{self.hi:.3f}]"


def pair_ratios(samples: Samples, num: Hashable, den: Hashable, phase: str) -> Stat:
  """`num / den` sample by sample (same repetition), summarised."""
  return Stat.of(a / b for a, b in zip(samples[num][phase], samples[den][phase], strict=True))


def timed(fn: Callable[[], Any], phase: str) -> Phases:
  """Wall and process CPU seconds of `fn()`: `{phase: .., phase + CPU: ..}`."""
  gc_was_enabled = gc.isenabled()
  gc.disable()
  try:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return {phase: time.perf_counter() - wall, phase + CPU: time.process_time() - cpu}
  finally:
    if gc_was_enabled:
      gc.enable()


@dataclasses.dataclass
class Progress:
  """Counts done steps of a long run and reports them on stderr.

  On a terminal one line is rewritten in place; otherwise (a log file, a
  pipe) a line is printed at most every `every_s` seconds, and at the end.
  """

  label: str
  total: int
  every_s: float = 10.0
  done: int = dataclasses.field(init=False, default=0)
  _start: float = dataclasses.field(init=False, default_factory=time.perf_counter)
  _last_print: float = dataclasses.field(init=False, default=-math.inf)

  def step(self) -> None:
    self.done += 1
    now = time.perf_counter()
    finished = self.done == self.total
    on_tty = sys.stderr.isatty()
    if not (finished or on_tty or now - self._last_print >= self.every_s):
      return
    self._last_print = now
    elapsed = now - self._start
    left = elapsed / self.done * (self.total - self.done)
    line = f"  {self.label}: {self.done}/{self.total}, {elapsed:.0f} s" + (
      "" if finished else f", ~{left:.0f} s left"
    )
    if on_tty:
      print("\r" + line.ljust(78), end="\n" if finished else "", file=sys.stderr, flush=True)
    else:
      print(line, file=sys.stderr, flush=True)


def interleaved(
  label: str, groups: list[dict[Hashable, Measurement]], repeats: int, warmup: int
) -> Samples:
  """Runs every measurement `warmup + repeats` times, variants side by side.

  Args:
    label: what the progress line on stderr calls this run.
    groups: each a dict from a key to a measurement returning phase times.
      Each repetition walks the groups in order and, within a group, runs the
      variants in an order rotated by one each repetition.
    repeats: repetitions kept.
    warmup: repetitions run first and dropped.

  Returns:
    For each key, for each phase, the `repeats` kept samples in repetition
    order.
  """
  samples: Samples = {}
  progress = Progress(label, (warmup + repeats) * sum(map(len, groups)))
  for rep in range(warmup + repeats):
    gc.collect()
    for group in groups:
      keys = list(group)
      shift = rep % len(keys)
      for key in keys[shift:] + keys[:shift]:
        phases = group[key]()
        progress.step()
        if rep >= warmup:
          for phase, seconds in phases.items():
            samples.setdefault(key, {}).setdefault(phase, []).append(seconds)
  return samples


def _fresh(fn: Callable[..., Any]) -> Callable[..., Any]:
  # A new function object each time, so that jax.jit's trace cache (keyed on
  # the function) misses and the trace is really timed.
  return lambda *args: fn(*args)


def trace_time(fn: Callable[..., Any], *args: Any) -> Phases:
  """Seconds to trace `jax.jit(fn)` at `args` (no trace-cache hit)."""
  return timed(lambda: jax.jit(_fresh(fn)).trace(*args), "trace")


def eval_shape_time(fn: Callable[..., Any], *args: Any) -> Phases:
  """Seconds of `jax.eval_shape(fn, *args)`, as phase "trace"."""
  return timed(lambda: jax.eval_shape(_fresh(fn), *args), "trace")


def trace_and_compile_time(fn: Callable[..., Any], *args: Any) -> Phases:
  """Phases "trace", "compile" (lower + compile) and their sum "total"."""
  traced = []
  times = timed(lambda: traced.append(jax.jit(_fresh(fn)).trace(*args)), "trace")
  times.update(timed(lambda: traced[0].lower().compile(), "compile"))
  for suffix in ("", CPU):
    times["total" + suffix] = times["trace" + suffix] + times["compile" + suffix]
  return times


def step_timer(step: Callable[..., Any], args: tuple[Any, ...], block_s: float) -> Measurement:
  """A measurement of the seconds per call of a compiled `step`.

  Each sample times enough calls to last about `block_s`, and divides.
  """
  jax.block_until_ready(step(*args))
  one = timed(lambda: jax.block_until_ready(step(*args)), "step")["step"]
  calls = max(1, math.ceil(block_s / max(one, 1e-7)))

  def run():
    out = None
    for _ in range(calls):
      out = step(*args)
    jax.block_until_ready(out)

  return lambda: {k: t / calls for k, t in timed(run, "step").items()}


def compile_steps(
  label: str,
  keys: Iterable[Hashable],
  step_and_args: Callable[[Hashable], tuple[Any, tuple[Any, ...]]],
) -> tuple[dict[Hashable, Any], dict[Hashable, tuple[Any, ...]], dict[Hashable, Optional[int]]]:
  """Compiles the jitted step of each key; its temporaries, where jax reports them.

  Args:
    label: what the progress line on stderr calls this loop.
    keys: the variants to compile.
    step_and_args: `key -> (jitted step, its arguments)`.

  Returns:
    `(compiled, args, temp_bytes)`, each by key; `temp_bytes` is None where
    the backend has no `memory_analysis`.
  """
  compiled, args, temp_bytes = {}, {}, {}
  for key in with_progress(label, keys):
    step, args[key] = step_and_args(key)
    compiled[key] = step.lower(*args[key]).compile()
    analysis = compiled[key].memory_analysis()
    temp_bytes[key] = None if analysis is None else analysis.temp_size_in_bytes
  return compiled, args, temp_bytes


def only_phases(measurement: Measurement, prefix: str) -> Measurement:
  """`measurement`, keeping the phases whose names start with `prefix`."""
  return lambda: {k: t for k, t in measurement().items() if k.startswith(prefix)}


def median_ms(samples: Samples, key: Hashable, phase: str) -> Optional[float]:
  if key not in samples:
    return None
  return Stat.of(samples[key][phase]).median * 1e3


def with_progress(label: str, items: Iterable[Any]) -> Iterator[Any]:
  """`items`, reporting on stderr how many are done: for untimed long loops."""
  items = list(items)
  progress = Progress(label, len(items))
  for item in items:
    yield item
    progress.step()
