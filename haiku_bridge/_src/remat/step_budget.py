"""`hkb.budgeted_jit`: a whole training step jitted to fit a memory budget, the compiled step deciding.

A loop's own `memory_budget=` (`plan.py`) holds the loop's part of a step,
predicted from programs of the loop alone; what surrounds the loop (a
`jax.vmap` over an ensemble of params, a second loop, the optimizer's
update, the arguments themselves) is not in it. `budgeted_jit` budgets the
step a device runs: every bridged loop inside with `remat="auto"` and no
`memory_budget=` of its own takes its plan from one search over the whole
step, and the figure that decides is the compiled step's own
(`step_bytes`): a plan is taken only once its step, compiled as it will
run, is within the budget.

The search walks one ladder of rungs for all those loops at once, ordered
by the recomputation they allow (`Rung`): every loop plain (`remat=False`),
under its `remat_policy` (loops with one), `remat=True`, then binomial
schedules keeping fewer carries, each loop the fewest slots whose schedule
recomputes at most `extra` forward passes more than `remat=True` (a loop
never past its own `max_recompute`, the step never past the call's).
Memory falls down the ladder; the step takes the first rung that fits:
plain is compiled first, then `remat=True` (and the policy's rung, where
`remat=True` fits), then the last rung (the least memory), then rungs
between chosen on the schedules' line: their compiled bytes in the carries
the loops keep, first a slot a carry from the last rung, then through two
compiled schedules (`_Search._aim`). Each try compiles the step as it
runs, and the chosen rung's compile is the one the step runs (jax's cache
holds it): a step whose plain form fits costs one compile, one that needs
`remat=True` two, one on a schedule three to seven (four where a slot
holds a whole count of carries, as XLA:CPU compiles them). On the CPU the tries compile with
XLA's cheaper code generation, which keeps the buffers
(`measure.measuring_options`), and the choice once more as it runs,
whose figure is the one checked. Elsewhere no cheaper compile keeps the
buffers: the tries compile as the step runs, and on a TPU the search
drafts (`measure.draft_options`: XLA at its least effort, a third of the
cost, its bytes off by a constant along the schedules). There
`remat=True` compiles beside plain (where plain fits, it finishes in its
thread, unused), and three drafts beside `remat=True`: of `remat=True`, a
middle schedule and the last rung. Where `remat=True` does not fit, the
line through the two schedules' drafts, less the offset read at
`remat=True`, aims, and the rung before the aim compiles as it runs; the
line through that compile at the drafts' slope (the schedules' own) then
decides that no rung before it fits, where it says so by a quarter of a
slot's bytes or more, or aims the next compile (`_Search._on_drafted_slope`):
on a schedule, three compiles and three drafts where the aim is a rung late.
A draft's bytes never decide alone. A compile that runs out of device
memory (RESOURCE_EXHAUSTED, as XLA:TPU's compiler raises, fast, for a
program over its HBM) is a rung over any budget, never an error.

The choice is kept on disk (`caches.OnDisk`), keyed on the step lowered
plain (its StableHLO: every shape, dtype and operation), the budget and the
limits, the jit options, the backend, device and versions and this code: a
second process lowers once (twice where the plan is not plain), compiles
the chosen rung once, and checks it against the budget before it runs.
"""

import concurrent.futures
import contextlib
import dataclasses
import contextvars
import fractions
import hashlib
import inspect
import itertools
import math
import os
import re
import sys
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple, Optional

import jax
import jaxlib

from haiku_bridge._src import caches
from haiku_bridge._src import errors
from haiku_bridge._src import modes
from haiku_bridge._src import versions
from haiku_bridge._src.remat import measure
from haiku_bridge._src.remat import plan as remat_plan
from haiku_bridge._src.remat import schedule as remat_schedule
from haiku_bridge._src.remat import tracing
from haiku_bridge._src import pytree
from haiku_bridge._src.pytree import PyTree

_API = "budgeted_jit"
_FALSE, _POLICY, _TRUE, _SCHEDULE = range(4)
# Compiles of the step beyond remat=True's and the least rung's, on the
# schedules' side of the ladder.
_MORE_TRIES = 4
_THREADS = "budgeted_jit"  # The names of a search's compiling threads begin so.


class Rung(NamedTuple):
  """A step on the search's ladder: what every `remat="auto"` loop runs there.

  `kind`: 0 plain, 1 under its `remat_policy` (plain without one), 2
  `remat=True`, 3 a binomial schedule recomputing at most `extra` forward
  passes more than `remat=True` (`extra` > 0, a fraction).
  """

  kind: int
  extra: fractions.Fraction = fractions.Fraction(0)

  def describe(self) -> str:
    if self.kind == _SCHEDULE:
      return f"remat=\"binomial\", at most {1 + float(self.extra):.3g} forward passes recomputed"
    return ("remat=False", "remat=True under remat_policy", "remat=True")[self.kind]


class StepLoop(NamedTuple):
  """What one `remat="auto"` loop of a budgeted step runs (a row of `StepPlan`).

  Attributes:
    length: its steps (layers, time steps).
    remat: `False`, `True` or `"binomial"`.
    slots: the carries a schedule keeps (None without one).
    policy: whether `remat=True` runs under the loop's `remat_policy`.
  """

  length: int
  remat: modes.RematMode
  slots: Optional[int] = None
  policy: bool = False


class StepTry(NamedTuple):
  """One compile of the step: the rung, its bytes (None: out of device memory), its seconds (lowering and compiling).

  `measuring`: compiled with XLA's cheaper code generation, which keeps
  the buffers (on the CPU: `measure.measuring_options`), for its bytes
  only; the chosen rung is then compiled as it runs, and checked.
  `draft`: compiled at XLA's least effort beside the search's other
  compiles (`measure.draft_options`, on a TPU), its bytes off the
  step's by a constant: read for the slope of the schedules' line only.
  """

  rung: str
  bytes: Optional[int]
  seconds: float
  measuring: bool = False
  draft: bool = False

  def __str__(self) -> str:
    how = ", measuring" if self.measuring else ", draft" if self.draft else ""
    return (
      f"{self.rung}: "
      + ("out of device memory" if self.bytes is None else f"{self.bytes:,} bytes")
      + f" ({self.seconds:.1f} s{how})"
    )


class StepPlan(NamedTuple):
  """The plan `hkb.budgeted_jit` makes for a step: its loops' plans and the compiled step's bytes.

  Attributes:
    memory_budget: the budget, bytes of one device.
    bytes: the chosen step's bytes, compiled (`step_bytes`): within the
      budget.
    loops: each `remat="auto"` loop the step runs (`StepLoop`), in the
      order they were traced (a loop traced twice, as under `jax.checkpoint`,
      twice).
    tries: every compile the plan took, in order (`StepTry`): the search's,
      or where the plan was kept on disk, the chosen step's alone.
    kept: whether the plan was kept on disk by an earlier search (for the
      same step, budget and versions), then compiled once and checked.
  """

  memory_budget: int
  bytes: int
  loops: tuple[StepLoop, ...]
  tries: tuple[StepTry, ...]
  kept: bool = False

  def __str__(self) -> str:
    rows = [
      f"{self.bytes:,} bytes of memory_budget={self.memory_budget:,}"
      + (", kept on disk" if self.kept else "")
    ]
    rows += [f"  loop of {loop.length} steps: " + _describe_loop(loop) for loop in self.loops]
    rows += [f"  compiled {t}" for t in self.tries]
    return "\n".join(rows)


def _describe_loop(loop: StepLoop) -> str:
  if loop.remat == "binomial":
    return f"remat=\"binomial\", {loop.slots} slots"
  return f"remat={loop.remat}" + (" under remat_policy" if loop.policy else "")


class _Seen(NamedTuple):
  """A loop as the search's trace saw it."""

  length: int
  policy: bool
  max_recompute: float
  carry_bytes: int


@dataclasses.dataclass
class _Trace:
  """What one trace of the step at a rung records."""

  rung: Rung
  loops: list[_Seen] = dataclasses.field(default_factory=list)


# The rung a step is traced at, with its search's identity: a jit-cache key
# (jax.make_user_context), so that a function the step jits inside is traced
# again at each rung, never its trace at another rung reused.
_RUNG = jax.make_user_context(None)
_TRACE: contextvars.ContextVar[Optional[_Trace]] = contextvars.ContextVar(
  "haiku_bridge_step_budget_trace", default=None
)
_SEARCHES = itertools.count()


def active() -> bool:
  """Whether a step of `budgeted_jit` is being traced (its loops join its budget)."""
  return _TRACE.get() is not None


def loop_plan(length: int, carry: PyTree, policy: bool, max_recompute: float) -> StepLoop:
  """What a `remat="auto"` loop with no budget of its own runs at the traced rung (`active()`)."""
  trace = _TRACE.get()
  assert trace is not None, "loop.resolved asks only while a step is traced"
  trace.loops.append(_Seen(length, policy, max_recompute, pytree.nbytes(carry)))
  return _at(trace.rung, length, policy, max_recompute)


def _at(rung: Rung, length: int, policy: bool, max_recompute: float) -> StepLoop:
  """The plan of a loop at `rung`, within its own `max_recompute`."""
  if rung.kind == _FALSE or (max_recompute < 1 and not (rung.kind >= _POLICY and policy)):
    return StepLoop(length, False)
  if rung.kind == _POLICY or max_recompute < 1:
    return StepLoop(length, policy, policy=policy)
  extra = (
    rung.extra
    if max_recompute == math.inf
    else min(rung.extra, fractions.Fraction(max_recompute) - 1)
  )
  if rung.kind == _TRUE or extra <= 0 or length < 3:
    return StepLoop(length, True)
  slots = remat_schedule.fewest_binomial_slots(length, math.floor(extra * length))
  if slots > length - 2:
    return StepLoop(length, True)
  return StepLoop(length, "binomial", slots)


def _ladder(loops: list[_Seen], max_recompute: float) -> list[Rung]:
  """Every rung that changes some loop's plan, in order of recomputation."""
  rungs = [Rung(_FALSE)]
  if any(loop.policy for loop in loops):
    rungs.append(Rung(_POLICY))
  rungs.append(Rung(_TRUE))
  extras = set()
  for loop in set(loops):
    most = min(max_recompute, loop.max_recompute) - 1
    for slots in range(loop.length - 2, 0, -1):
      extra = fractions.Fraction(remat_schedule.binomial_cost(loop.length, slots), loop.length)
      if extra > most:
        break
      extras.add(extra)
  return rungs + [Rung(_SCHEDULE, extra) for extra in sorted(extras) if extra]


def _carries_kept(rung: Rung, loops: list[_Seen]) -> int:
  """Bytes of the carries the loops keep for the backward pass at `rung` (the line's abscissa)."""
  kept = 0
  for loop in loops:
    plan = _at(rung, loop.length, loop.policy, loop.max_recompute)
    kept += loop.carry_bytes * (plan.slots if plan.slots is not None else loop.length)
  return kept


def step_bytes(analysis: Any, platform: str) -> int:
  """The bytes a compiled step holds on one device: what `budgeted_jit` checks.

  Its arguments, its outputs (less those that reuse a donated argument's
  buffer), its temporaries and its code, as XLA's memory analysis gives
  them. XLA:TPU also gives the peak of the buffers live at once, the
  arguments and outputs among them, and at small sizes reports temporaries
  only in part: there the larger of the two, each buffer counted once.

  >>> from haiku_bridge._src.remat import step_budget
  >>> x = jnp.ones([256, 256])  # 256 KiB.
  >>> compiled = jax.jit(lambda x: jnp.tanh(x @ x)).lower(x).compile()
  >>> step_budget.step_bytes(compiled.memory_analysis(),
  ...                        jax.default_backend()) >= 2 * x.nbytes
  True
  """
  total = (
    analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    - analysis.alias_size_in_bytes
    + analysis.temp_size_in_bytes
    + analysis.generated_code_size_in_bytes
  )
  if platform == "tpu":
    total = max(
      total, getattr(analysis, "peak_memory_in_bytes", 0) + analysis.generated_code_size_in_bytes
    )
  return int(total)


def device_memory() -> Optional[int]:
  """The bytes the default device has for XLA (`memory_stats()["bytes_limit"]`); None where it does not say (the CPU)."""
  stats = jax.devices()[0].memory_stats()
  limit = (stats or {}).get("bytes_limit")
  return int(limit) if limit else None


def out_of_memory(error: Exception) -> bool:
  """Whether a compile failed for want of device memory (XLA's RESOURCE_EXHAUSTED)."""
  return "RESOURCE_EXHAUSTED" in str(error)


class _Compiled(NamedTuple):
  bytes: Optional[int]  # None: out of device memory.
  compiled: Any
  seconds: float  # Lowering and compiling.
  lowered: Any
  measuring: bool  # With `measure.measuring_options`: bytes only.
  draft: bool = False  # With `measure.draft_options`: a line's slope only.


def _compile(lowered: Any, options: dict[str, Any]) -> Any:
  """`lowered.compile(options)`: one seam, where a test runs a device out of memory."""
  return lowered.compile(options) if options else lowered.compile()


def _compiled(lowered: Any, lowering: float, options: dict[str, Any]) -> _Compiled:
  """`lowered` (in `lowering` seconds) compiled with `options`, its bytes read; out of device memory, no bytes."""
  start = time.perf_counter()
  try:
    compiled = _compile(lowered, options)
  except Exception as error:  # pylint: disable=broad-except
    if not out_of_memory(error):
      raise
    compiled = None
  return _Compiled(
    None if compiled is None else step_bytes(compiled.memory_analysis(), jax.default_backend()),
    compiled,
    lowering + time.perf_counter() - start,
    lowered,
    bool(options),
  )


def _drafted(lowered: Any, lowering: float, options: dict[str, Any]) -> _Compiled:
  """A draft of `lowered`: its bytes at `options` (`measure.draft_options`), no program kept; any failure, no bytes (a draft only aims)."""
  try:
    done = _compiled(lowered, lowering, options)
  except Exception as error:  # pylint: disable=broad-except
    tracing.LOG.debug("hkb.%s: a draft compile failed: %s", _API, error)
    done = _Compiled(None, None, lowering, None, False)
  return done._replace(compiled=None, lowered=None, measuring=False, draft=True)


class BudgetedStep:
  """A step jitted to fit a memory budget: `hkb.budgeted_jit`'s result, used like `jax.jit(step)`."""

  def __init__(
    self,
    step: Callable[..., Any],
    memory_budget: Optional[int],
    max_recompute: float,
    jit_kwargs: dict[str, Any],
  ) -> None:
    self._budget = memory_budget
    self._max_recompute = max_recompute
    self._jit_kwargs = jit_kwargs
    self._jitted = jax.jit(step, **jit_kwargs)
    self._statics = _static_positions(jit_kwargs)
    self._plans: dict[Any, tuple[int, Rung, StepPlan]] = {}
    self.__wrapped__ = step
    for attribute in ("__name__", "__qualname__", "__doc__", "__module__"):
      if hasattr(step, attribute):
        setattr(self, attribute, getattr(step, attribute))

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    search, rung, _ = self._planned(args, kwargs)
    with _RUNG((search, rung)), _tracing(rung):
      return self._jitted(*args, **kwargs)

  def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
    """The step lowered with its plan, as `jax.jit(step).lower`."""
    search, rung, _ = self._planned(args, kwargs)
    with _RUNG((search, rung)), _tracing(rung):
      return self._jitted.lower(*args, **kwargs)

  def plan(self, *args: Any, **kwargs: Any) -> StepPlan:
    """The `StepPlan` for these arguments, made (compiled) if not yet."""
    return self._planned(args, kwargs)[2]

  def _budget_bytes(self) -> int:
    if self._budget is not None:
      return self._budget
    limit = device_memory()
    if limit is None:
      raise ValueError(
        errors.message(
          f"the {jax.default_backend()} backend does not say how much memory "
          "its device has (jax.devices()[0].memory_stats()), so the step "
          "has no default budget: pass memory_budget=, in bytes."
        )
      )
    return limit

  def _planned(self, args, kwargs) -> tuple[int, Rung, StepPlan]:
    key = _signature(args, kwargs, self._statics)
    found = self._plans.get(key)
    if found is None:
      with errors.entry(_API):
        found = self._plans[key] = self._search(args, kwargs)
    return found

  def _lowered(
    self, search: int, rung: Rung, args, kwargs, trace: Optional[_Trace] = None
  ) -> tuple[Any, float]:
    """The step lowered at `rung`, and the seconds it took."""
    start = time.perf_counter()
    with _RUNG((search, rung)), _tracing(rung, trace):
      lowered = self._jitted.lower(*args, **kwargs)
    return lowered, time.perf_counter() - start

  def _measuring(self) -> dict[str, Any]:
    """The options a try compiles with for its bytes (none where the step's jit sets its own)."""
    if "compiler_options" in self._jit_kwargs:
      return {}
    return measure.measuring_options()

  def _drafting(self) -> Optional[dict[str, Any]]:
    """The options a draft compiles with; None: no drafts (the CPU, or the step's jit sets its own options)."""
    if "compiler_options" in self._jit_kwargs:
      return None
    return measure.draft_options()

  def _compiled(
    self, search: int, rung: Rung, args, kwargs, options: Optional[dict[str, Any]] = None
  ) -> _Compiled:
    """The step at `rung` compiled (by default, with `_measuring()`'s options)."""
    return _compiled(
      *self._lowered(search, rung, args, kwargs), self._measuring() if options is None else options
    )

  def _search(self, args, kwargs) -> tuple[int, Rung, StepPlan]:
    budget = self._budget_bytes()
    tracing.LOG.info(
      "hkb.%s: planning the step for memory_budget=%d bytes (compiling it with its "
      'remat="auto" loops run a few ways)...',
      _API,
      budget,
    )
    start = time.perf_counter()
    search = next(_SEARCHES)
    trace = _Trace(Rung(_FALSE))
    plain, lowering = self._lowered(search, trace.rung, args, kwargs, trace)
    disk_key = self._disk_key(plain, budget)
    kept = _from_disk(_ON_DISK.get(disk_key), trace.loops)
    if kept is not None:  # The step compiled once, as it runs, and checked.
      done = (
        _compiled(plain, lowering, {})
        if kept == trace.rung
        else self._compiled(search, kept, args, kwargs, {})
      )
      _log_try(kept, done)
      if done.bytes is not None and done.bytes <= budget:
        made = self._plan_of(budget, done.bytes, kept, trace.loops, (_try(kept, done),), kept=True)
        _log_planned(made, kept, time.perf_counter() - start)
        return search, kept, made
    measuring, drafting = self._measuring(), self._drafting()
    ahead = _Ahead(
      lambda rung: self._lowered(search, rung, args, kwargs),
      lambda lowered, seconds: _compiled(lowered, seconds, measuring),
      None if drafting is None else lambda lowered, seconds: _drafted(lowered, seconds, drafting),
    )
    ahead.given(trace.rung, plain, lowering)
    found = _Search(
      budget, self._max_recompute, _ladder(trace.loops, self._max_recompute), trace.loops, ahead
    )
    try:
      while True:
        rung = found.run()
        if rung is None:
          raise ValueError(
            errors.message(found.refusal(self._budget is None, self._unbounded(found, trace.loops)))
          )
        if not found.tried[rung].measuring:
          break
        # The choice compiled as it runs (what the step's calls then use),
        # and checked: its figure, not the measuring compile's, decides.
        found.record(rung, _compiled(found.tried[rung].lowered, 0.0, {}))
        if found.fits(rung):
          break
    finally:
      ahead.close()
    _ON_DISK.put(disk_key, [rung.kind, rung.extra.numerator, rung.extra.denominator])
    made = self._plan_of(budget, found.tried[rung].bytes, rung, trace.loops, tuple(found.made))
    _log_planned(made, rung, time.perf_counter() - start)
    return search, rung, made

  def _unbounded(self, found: "_Search", loops: list[_Seen]) -> str:
    """What the step holds with no bound on recomputation, where the call has one and that holds less."""
    least = _ladder(loops, math.inf)[-1]
    if not loops or least == found.least():
      return ""
    done = found.tried.get(least) or found.compile_at(least)
    named = found.tried[found.least_tried()].bytes
    if done.bytes is None or (named is not None and done.bytes >= named):
      return ""
    return (
      f" With max_recompute=math.inf, at its least "
      f"({least.describe()}), it holds {done.bytes:,} bytes."
    )

  def _plan_of(
    self,
    budget: int,
    compiled_bytes: Optional[int],
    rung: Rung,
    loops: list[_Seen],
    tries: tuple[StepTry, ...],
    kept: bool = False,
  ) -> StepPlan:
    assert compiled_bytes is not None
    return StepPlan(
      budget,
      compiled_bytes,
      tuple(_at(rung, loop.length, loop.policy, loop.max_recompute) for loop in loops),
      tries,
      kept,
    )

  def _disk_key(self, lowered: Any, budget: int) -> Optional[str]:
    device = jax.devices()[0]
    options = re.sub(r" at 0x[0-9a-f]+", "", repr(sorted(self._jit_kwargs.items())))
    text = repr(
      (
        _FORMAT,
        lowered.as_text(),
        budget,
        self._max_recompute,
        options,
        jax.default_backend(),
        device.device_kind,
        getattr(device.client, "platform_version", ""),
        jax.__version__,
        jaxlib.__version__,
        versions.installed(),
        _code_digest(),
        os.environ.get("XLA_FLAGS", ""),
      )
    )
    return hashlib.sha256(text.encode()).hexdigest()


class _Compiler:
  """Compiles the step at a rung when asked (`__call__`), and drafts it (`draft`) where it can; hints let it look ahead."""

  drafting = False  # Whether `draft` compiles.

  def __call__(self, rung: Rung) -> _Compiled:
    raise NotImplementedError

  def draft(self, rung: Rung) -> _Compiled:
    """A draft of the step at `rung` (`_drafted`), where `drafting`."""
    raise NotImplementedError

  def lower(self, rung: Rung) -> None:
    """A hint: `rung` is likely asked for after the compile under way."""

  def start(self, rung: Rung) -> None:
    """`rung` is asked for next: its compile may begin."""

  def start_draft(self, rung: Rung) -> None:
    """`rung`'s draft is asked for next: its compile may begin."""

  def close(self) -> None:
    """Ends what was started."""


class _OneByOne(_Compiler):
  """Each rung compiled (or drafted) when asked, by `compile_at` (`draft_at`): the hints ignored."""

  def __init__(
    self,
    compile_at: Callable[[Rung], _Compiled],
    draft_at: Optional[Callable[[Rung], _Compiled]] = None,
  ):
    self._compile_at, self._draft_at = compile_at, draft_at
    self.drafting = draft_at is not None

  def __call__(self, rung: Rung) -> _Compiled:
    return self._compile_at(rung)

  def draft(self, rung: Rung) -> _Compiled:
    assert self._draft_at is not None
    return self._draft_at(rung)


class _Ahead(_Compiler):
  """A search's compiles in threads, each next rung lowered while the last compiles.

  Lowering traces the step in Python, under the GIL; XLA compiles without
  it. So the rung the search is likely to ask for next is lowered on the
  caller's thread while the one it asked for compiles in another: the
  search waits for the longer of the two, not their sum. Only what the
  search starts is compiled (a rung lowered ahead and never asked for
  costs its lowering, alongside a compile); each figure is its own
  program's. With `draft_lowered` (drafts: `measure.draft_options`) the
  compiles the search starts together run side by side, in
  `measure.DRAFT_CORES` threads, a draft from a lowering of its own; else
  one at a time. The threads run in the caller's context (`contextvars`):
  an error there names the public call. A compile started and not waited
  for finishes in its thread after `close`, unused.
  """

  def __init__(
    self,
    lower_at: Callable[[Rung], tuple[Any, float]],
    compile_lowered: Callable[[Any, float], _Compiled],
    draft_lowered: Optional[Callable[[Any, float], _Compiled]] = None,
  ):
    self._lower_at, self._compile_lowered = lower_at, compile_lowered
    self._draft_lowered = draft_lowered
    self.drafting = draft_lowered is not None
    self._lowered: dict[Rung, tuple[Any, float]] = {}
    self._jobs: dict[Rung, concurrent.futures.Future[_Compiled]] = {}
    self._drafts: dict[Rung, concurrent.futures.Future[_Compiled]] = {}
    self._pool = concurrent.futures.ThreadPoolExecutor(
      measure.DRAFT_CORES if self.drafting else 1, thread_name_prefix=_THREADS
    )

  def given(self, rung: Rung, lowered: Any, seconds: float) -> None:
    """`rung`, already lowered (in `seconds`)."""
    self._lowered[rung] = lowered, seconds

  def lower(self, rung: Rung) -> None:
    if rung not in self._lowered and rung not in self._jobs:
      self._lowered[rung] = self._lower_at(rung)

  def start(self, rung: Rung) -> None:
    if rung not in self._jobs:
      program, seconds = self._lowered.pop(rung) if rung in self._lowered else self._lower_at(rung)
      self._jobs[rung] = self._submit(self._compile_lowered, program, seconds)

  def start_draft(self, rung: Rung) -> None:
    if rung not in self._drafts:
      assert self._draft_lowered is not None
      self._drafts[rung] = self._submit(self._draft_lowered, *self._lower_at(rung))

  def _submit(self, compile_lowered, program, seconds) -> concurrent.futures.Future[_Compiled]:
    context = contextvars.copy_context()
    return self._pool.submit(lambda: context.run(compile_lowered, program, seconds))

  def __call__(self, rung: Rung) -> _Compiled:
    self.start(rung)
    return self._jobs.pop(rung).result()

  def draft(self, rung: Rung) -> _Compiled:
    self.start_draft(rung)
    return self._drafts.pop(rung).result()

  def close(self) -> None:
    # A compile the search did not wait for (remat=True's beside a plain
    # step that fits, drafts beside a remat=True that fits, the rest of a
    # round the choice left behind) finishes in its thread, unused.
    self._pool.shutdown(wait=False, cancel_futures=True)
    self._lowered.clear()
    self._jobs.clear()
    self._drafts.clear()


def unused_compiles_ended() -> None:
  """Returns once the compiles searches started and left unused (`_Ahead.close`) have ended: a timing or a count after it is not shared with them."""
  for thread in threading.enumerate():
    if thread.name.startswith(_THREADS):
      thread.join()


class _Search:
  """The first rung of `ladder` whose compiled step fits `budget`."""

  def __init__(
    self,
    budget: int,
    max_recompute: float,
    ladder: list[Rung],
    loops: list[_Seen],
    compile_at: Callable[[Rung], _Compiled] | _Compiler,
  ):
    self.budget = budget
    self.max_recompute = max_recompute
    self.ladder = ladder
    self.loops = loops
    self.compile_at = compile_at if isinstance(compile_at, _Compiler) else _OneByOne(compile_at)
    self.tried: dict[Rung, _Compiled] = {}  # The last compile of each rung.
    self.made: list[StepTry] = []  # Every compile, in order.

  def record(self, rung: Rung, done: _Compiled) -> None:
    """`done`, a compile of the step at `rung`: kept, and logged."""
    self.tried[rung] = done
    self.made.append(_try(rung, done))
    _log_try(rung, done)

  def fits(self, rung: Rung) -> bool:
    if rung not in self.tried:
      self.record(rung, self.compile_at(rung))
    found = self.tried[rung].bytes
    return found is not None and found <= self.budget

  def least(self) -> Rung:
    """The rung of the least memory: the last (with no loop to plan, the step as it is)."""
    return self.ladder[-1] if self.loops else self.ladder[0]

  def least_tried(self) -> Rung:
    """The rung of the least bytes compiled (the least recomputation among equals): what a refusal names.

    Memory falls down the ladder as a rule, but not always (under
    `jax.jacrev` on jax 0.12, `remat=True` held less than every schedule).
    """
    fitted = [
      (done.bytes, self.ladder.index(rung), rung)
      for rung, done in self.tried.items()
      if done.bytes is not None and rung in self.ladder
    ]
    return min(fitted)[2] if fitted else self.least()

  def _next(self, rung: Rung, then: Optional[Rung] = None) -> None:
    """`rung` is compiled next; `then` lowered meanwhile, where it is likely asked for after."""
    if rung not in self.tried:
      self.compile_at.start(rung)
      if then is not None and then not in self.tried:
        self.compile_at.lower(then)

  def run(self) -> Optional[Rung]:
    true = self.ladder.index(Rung(_TRUE)) if self.loops else 0
    schedules = self.ladder[true + 1 :]
    drafting = self.compile_at.drafting and len(schedules) >= 3
    self._next(self.ladder[0], self.ladder[true] if self.loops else None)
    if drafting:  # remat=True beside plain: where plain fits, it finishes unused.
      self.compile_at.start(self.ladder[true])
    if self.fits(self.ladder[0]):  # Plain, or no loop to plan.
      return self.ladder[0]
    if not self.loops:
      return None
    if not drafting:
      self._next(self.ladder[true], schedules[-1] if schedules else None)
    drafts = (self.ladder[true], schedules[len(schedules) // 2], schedules[-1]) if drafting else ()
    for rung in drafts:  # Beside remat=True's compile.
      self.compile_at.start_draft(rung)
    if self.fits(self.ladder[true]):  # The drafts finish unused.
      return next(r for r in self.ladder[1 : true + 1] if self.fits(r))
    if not schedules:
      return None
    over, fits = true, None  # Indices into the ladder: over the budget, within it.
    line = self._drafted_line(true, drafts) if drafts else None
    if line is not None:
      x_line, b_line, slope = line
      last = len(self.ladder) - 1
      aimed = self._first_on_line(true, last, x_line, b_line, slope)
      # The rung before the aim: the offset read at remat=True is not quite
      # the schedules' (on the TPU 74 MB less, about a slot's bytes: the aim
      # a rung late).
      first = max((last if aimed is None else aimed) - 1, true + 1)
      if self.fits(self.ladder[first]):
        fits = first
      else:
        over = first
      after = self._on_drafted_slope(over, fits, first, slope)
      if after == first:
        return self.ladder[first]
      if after is not None:
        if self.fits(self.ladder[after]):
          fits = after
        else:
          over = after
    if fits is None:
      if not self.fits(schedules[-1]):
        return None
      fits = len(self.ladder) - 1
    for _ in range(_MORE_TRIES):
      between = self._aim(over, fits)
      if between is None:
        break
      if self.fits(self.ladder[between]):
        fits = between
      else:
        over = between
    return self.ladder[fits]

  def _draft(self, rung: Rung) -> Optional[int]:
    """The bytes of `rung`'s draft (None: none), the draft logged and listed."""
    drafted = self.compile_at.draft(rung)
    self.made.append(_try(rung, drafted))
    _log_try(rung, drafted)
    return drafted.bytes

  def _drafted_line(
    self, true: int, drafts: tuple[Rung, ...]
  ) -> Optional[tuple[int, float, float]]:
    """The schedules' line the drafts draw, as (carries kept, bytes, slope) (None: a draft has no bytes).

    `drafts`: remat=True, a middle schedule and the least rung, drafted
    (`measure.draft_options`). The line through the two schedules' drafts
    has the step's slope; a draft holds more than the step as it runs, by
    an amount about constant along the line, read at remat=True (compiled
    both ways) and taken off.
    """
    at_true, middle, least = (self._draft(rung) for rung in drafts)
    compiled = self.tried[self.ladder[true]].bytes
    x_middle, x_least = (_carries_kept(rung, self.loops) for rung in drafts[1:])
    if at_true is None or middle is None or least is None or compiled is None:
      return None
    if x_middle == x_least:
      return None
    return x_least, least - (at_true - compiled), (middle - least) / (x_middle - x_least)

  def _on_drafted_slope(
    self, over: int, fits: Optional[int], first: int, slope: float
  ) -> Optional[int]:
    """The rung to compile after `first` on the line through its compile at the drafts' `slope` (None: none; `first`: it is the choice).

    `first` compiled, the line through it at the drafts' slope is the
    schedules' own (their offset is in it; on the TPU the drafts' slope is
    the compiled one's to 0.01%). Where `first` fits and the line says no
    rung before it fits, by a quarter of a slot's bytes or more, `first` is
    the choice; a nearer call is compiled. Where `first` is over, the line
    aims on.
    """
    b_first = self.tried[self.ladder[first]].bytes
    if b_first is None:
      return None
    x_first = _carries_kept(self.ladder[first], self.loops)
    if fits is None:
      return self._first_on_line(over, len(self.ladder) - 1, x_first, b_first, slope)
    if fits - over < 2:
      return first
    x_before = _carries_kept(self.ladder[fits - 1], self.loops)
    margin = abs(slope * (x_before - x_first)) / 4
    nearer = self._first_on_line(over, fits, x_first, b_first, slope, self.budget + margin)
    return first if nearer is None else nearer

  def _aim(self, over: int, fits: int) -> Optional[int]:
    """The rung between two compiled ones that the schedules' line says fits first (None: none).

    A schedule's compiled bytes lie on a line in the carries its loops
    keep (each slot a carry, times whatever maps the loop: three members
    of a vmapped ensemble, three carries); `remat=True`'s and a policy's
    programs lie off it. So the line runs through `fits` and a second
    compiled schedule: `over` where it is one, else the schedule compiled
    nearest `fits`. With `fits` the only one (the first aim, from the
    least rung), a slot costs a whole count of carries (the slope through
    `over`, rounded; one where `over` has no bytes): that aims the next
    compile but never decides alone: where it says none between fits, the
    line through `over` does (halving where there is none). Only a line
    through two compiles says none between.
    """
    if fits - over < 2:
      return None
    x_fits = _carries_kept(self.ladder[fits], self.loops)
    b_fits = self.tried[self.ladder[fits]].bytes
    assert b_fits is not None
    second = self._second_schedule(over, fits, x_fits)
    if second is not None:
      slopes = [(second[1] - b_fits) / (second[0] - x_fits)]
    else:
      b_over = self.tried[self.ladder[over]].bytes
      x_over = _carries_kept(self.ladder[over], self.loops)
      if b_over is None or x_over == x_fits:
        aimed = self._first_on_line(over, fits, x_fits, b_fits, 1)
        return (over + fits) // 2 if aimed is None else aimed  # No line: halve.
      through_over = (b_over - b_fits) / (x_over - x_fits)
      # A slot holds a carry, or as many as map the loop: the line through
      # `over`, rounded to a whole count of them, aims; it decides.
      slopes = [max(1, round(through_over)), through_over]
    for slope in slopes:
      aimed = self._first_on_line(over, fits, x_fits, b_fits, slope)
      if aimed is not None:
        return aimed
    return None  # The line says none between fits: the one that does.

  def _second_schedule(self, over: int, fits: int, x_fits: int) -> Optional[tuple[int, int]]:
    """(carries kept, bytes) of a compiled schedule besides `fits`, off its abscissa: `over`, else the nearest `fits`."""
    found = []
    for rung, done in self.tried.items():
      if rung.kind != _SCHEDULE or done.bytes is None or rung not in self.ladder:
        continue
      index, x = self.ladder.index(rung), _carries_kept(rung, self.loops)
      if index != fits and x != x_fits:
        found.append((index != over, abs(index - fits), x, done.bytes))
    return min(found)[2:] if found else None

  def _first_on_line(
    self,
    over: int,
    fits: int,
    x_fits: int,
    b_fits: float,
    slope: float,
    budget: Optional[float] = None,
  ) -> Optional[int]:
    """The first rung between `over` and `fits` (neither) whose bytes on the line through (`x_fits`, `b_fits`) at `slope` are within the budget (or `budget`)."""
    budget = self.budget if budget is None else budget
    for i in range(over + 1, fits):
      x = _carries_kept(self.ladder[i], self.loops)
      if b_fits + slope * (x - x_fits) <= budget:
        return i
    return None

  def refusal(self, default_budget: bool, unbounded: str = "") -> str:
    """Why the step does not fit, and what would.

    `unbounded`: the sentence saying what the step holds with no bound on
    recomputation, where that is less (`BudgetedStep._unbounded`), else
    empty: only then is more recomputation offered as a remedy.
    """
    least = self.least_tried()
    found = self.tried[least].bytes
    budget = f"memory_budget={self.budget:,} bytes" + (
      " (the device's memory)" if default_budget else ""
    )
    if found is None:
      held = "runs out of device memory compiling (RESOURCE_EXHAUSTED) even at its least"
    else:
      held = f"holds {found:,} bytes at its least"
      done = self.tried[least].compiled.memory_analysis()
      held += (
        f" (arguments {done.argument_size_in_bytes:,}, outputs "
        f"{done.output_size_in_bytes:,}, of which donated "
        f"{done.alias_size_in_bytes:,}, temporaries "
        f"{done.temp_size_in_bytes:,}, code "
        f"{done.generated_code_size_in_bytes:,})"
      )
    remedy = []
    if self.loops:
      where = f", with every remat=\"auto\" loop at {least.describe()}"
      if least.kind == _FALSE and not unbounded:
        # Every plan held as much (forward mode alone keeps nothing for a
        # backward pass to trade).
        where += ": no remat plan of its loops holds less"
      if unbounded:
        remedy = [f"allow more recomputation (max_recompute=, now {self.max_recompute:g})"]
    else:
      where = ", and it runs no loop with remat=\"auto\" to trade recomputation for memory"
      remedy = [
        "give its loops (hkb.scan, hkb.dynamic_unroll, "
        "hkb.layer_scan, hkb.repeat_layer) remat=\"auto\""
      ]
    remedies = (
      ([] if found is None else [f"pass memory_budget={found:,} or more"])
      + remedy
      + [
        "make the step hold less (a smaller batch, "
        "donate_argnums= for the params and optimizer state)"
      ]
    )
    advice = ", or ".join(remedies)
    return (
      f"the step does not fit {budget}: it {held}{where}. {advice[0].upper()}{advice[1:]}."
      + unbounded
    )


def _try(rung: Rung, done: _Compiled) -> StepTry:
  return StepTry(rung.describe(), done.bytes, done.seconds, done.measuring, done.draft)


def _log_planned(made: StepPlan, rung: Rung, seconds: float) -> None:
  """The lines that end a step's plan: the plan (`str(StepPlan)`) at INFO, then the end, as a loop's plan ends (`plan.end_level`: WARNING when slow)."""
  tracing.LOG.info("hkb.%s: %s", _API, made)
  loops = len(made.loops)
  tracing.LOG.log(
    remat_plan.end_level(seconds),
    "hkb.%s: planned the step in %.1f s: chose %s for its %d remat=\"auto\" loop%s, %d bytes "
    "for memory_budget=%d bytes, %d compile%s%s (step.plan(*args) lists each). %s",
    _API,
    seconds,
    rung.describe(),
    loops,
    "" if loops == 1 else "s",
    made.bytes,
    made.memory_budget,
    len(made.tries),
    "" if len(made.tries) == 1 else "s",
    ", the plan read from disk" if made.kept else "",
    remat_plan.where_kept("The plan", "this step"),
  )


def _log_try(rung: Rung, done: _Compiled) -> None:
  tracing.LOG.info("hkb.%s: compiled %s", _API, _try(rung, done))


@contextlib.contextmanager
def _tracing(rung: Rung, trace: Optional[_Trace] = None) -> Iterator[None]:
  token = _TRACE.set(trace if trace is not None else _Trace(rung))
  try:
    yield
  finally:
    _TRACE.reset(token)


def _static_positions(jit_kwargs: dict[str, Any]) -> tuple[frozenset, frozenset]:
  """The positions and names jit takes as static, as `_signature` needs them."""

  def as_set(value, kind):
    if value is None:
      return frozenset()
    return frozenset((value,) if isinstance(value, kind) else value)

  return (
    as_set(jit_kwargs.get("static_argnums"), int),
    as_set(jit_kwargs.get("static_argnames"), str),
  )


def _signature(args, kwargs, statics) -> Any:
  """What a call's plan depends on: each array's type and sharding, each static value, the mesh and the settings jit traces under."""
  numbers, names = statics

  def of(value):
    leaves, tree = jax.tree.flatten(value)
    return tree, tuple(
      (jax.typeof(leaf), getattr(leaf, "sharding", None) if isinstance(leaf, jax.Array) else None)
      for leaf in leaves
    )

  return (
    tuple(
      ("static", a) if i in numbers or i - len(args) in numbers else of(a)
      for i, a in enumerate(args)
    ),
    tuple(sorted((k, ("static", v) if k in names else of(v)) for k, v in kwargs.items())),
    jax.sharding.get_abstract_mesh(),
    *(getattr(jax.config, name) for name in _TRACED_UNDER),
  )


# The settings jit traces a step under that change its program.
_TRACED_UNDER = ("jax_enable_x64", "jax_default_matmul_precision")


_FORMAT = 1
_ON_DISK = caches.OnDisk("step_budgets")


def _from_disk(value: Any, loops: list[_Seen]) -> Optional[Rung]:
  """A kept rung, if `value` is one this step's ladder holds; else None (a miss)."""
  if not (
    isinstance(value, list)
    and len(value) == 3
    and all(type(v) is int for v in value)
    and value[2] > 0
  ):  # pylint: disable=unidiomatic-typecheck
    return None
  rung = Rung(value[0], fractions.Fraction(value[1], value[2]))
  return rung if rung in _ladder(loops, math.inf) else None


def _jit_options() -> list[str]:
  """The keywords `jax.jit` takes besides the function."""
  return [name for name in inspect.signature(jax.jit).parameters if name != "fun"]


@caches.memoize(maxsize=1)
def _code_digest() -> str:
  code = hashlib.sha256()
  for module in (sys.modules[__name__], remat_schedule):
    with open(str(module.__file__), "rb") as f:
      code.update(f.read())
  return code.hexdigest()


def budgeted_jit(
  step: Callable[..., Any],
  *,
  memory_budget: Optional[int] = None,
  max_recompute: Optional[float] = None,
  **jit_kwargs: Any,
) -> BudgetedStep:
  """`jax.jit(step)`, with every `remat="auto"` loop inside planned so the compiled step fits `memory_budget`.

  The budget is the whole step's, on one device: its arguments (params,
  optimizer state, batch), outputs and temporaries, as the compiled step
  holds them (`step_bytes`), by default the device's memory where the
  backend reports it (`memory_stats()["bytes_limit"]`; other arrays you
  keep on the device are not subtracted). Every bridged loop the step runs
  with `remat="auto"` and no `memory_budget=` of its own (`hkb.scan`,
  `hkb.dynamic_unroll`, `hkb.layer_scan`, `hkb.repeat_layer`, a pipeline's
  stages) takes its plan from one search, which compiles the step until a
  plan fits with the least recomputation (README, "A budget for the whole
  step"); a loop with its own `memory_budget=` plans itself, and the step
  around it is still checked. Before the step first runs for a signature
  of arguments, its compiled bytes are checked against the budget; a step
  no plan fits is refused (ValueError) with what it holds at its least.
  The search logs on the `haiku_bridge.remat` logger, as a loop's plan
  does: a line at INFO when it starts, one per compile, the plan, and a
  line when it ends, at WARNING where it took `SLOW_PLAN_SECONDS` (2 s) or
  more (docs/remat.md, "A budget for the whole step").

  Args:
    step: the training step (params, optimizer state, batch → anything), as
      for `jax.jit`.
    memory_budget: bytes one device may hold for the step; None: the
      device's memory, where the backend says it (not on the CPU).
    max_recompute: the most forward passes of a loop a plan may recompute
      (`remat=True` recomputes 1; a loop's own `max_recompute=` bounds that
      loop further); None: 3.
    **jit_kwargs: passed to `jax.jit` (`donate_argnums`, `static_argnums`,
      `in_shardings`, ...).

  Returns:
    The step, called like `jax.jit(step)`; `.lower(...)` gives the step
    lowered with its plan, `.plan(...)` the `StepPlan`.

  >>> def net(xs):
  ...   linear = hk.Linear(16)
  ...   core = lambda h, x: (jnp.tanh(h + linear(x)),) * 2
  ...   h, ys = hkb.scan(core, jnp.zeros([4, 16]), xs, remat="auto")
  ...   return jnp.sum(ys ** 2)
  >>> f = hk.without_apply_rng(hk.transform(net))
  >>> xs = jnp.ones([32, 4, 16])
  >>> params = f.init(jax.random.PRNGKey(0), xs)
  >>> step = hkb.budgeted_jit(jax.grad(f.apply), memory_budget=60_000)
  >>> grads = step(params, xs)
  >>> step.plan(params, xs).bytes <= 60_000
  True
  """
  with errors.entry(_API):
    errors.check_keywords(jit_kwargs, ["step", "memory_budget", "max_recompute", *_jit_options()])
    errors.check_callable("step", step, "the training step, a function")
    if memory_budget is not None:
      memory_budget = remat_plan.check_budget(memory_budget)
    max_recompute = remat_plan.check_max_recompute(max_recompute)
  return BudgetedStep(step, memory_budget, max_recompute, jit_kwargs)
