"""`hkb.budgeted_jit`: a whole training step jitted to fit a memory budget, the compiled step deciding.

A loop's own `memory_budget=` (`plan.py`) holds the loop's part of a step,
predicted from programs of the loop alone; what surrounds the loop (a
`jax.vmap` over an ensemble of params, a second loop, the optimizer's
update, the arguments themselves) is not in it. `budgeted_jit` budgets the
step a device runs: every bridged loop inside with `remat="auto"` and no
`memory_budget=` of its own takes its plan from one search over the whole
step (`step_search.py`: the ladder of plans, walked to the first that
fits), and the figure that decides is the compiled step's own
(`step_compiles.step_bytes`): a plan is taken only once its step, compiled
as it will run, is within the budget. Each try compiles the step as it
runs, and the chosen rung's compile is the one the step runs (jax's cache
holds it). On the CPU plain, `remat=True` and the least rung compile with
XLA's cheaper code generation, which keeps the buffers
(`measure.measuring_options`), and where one of them is the choice, once
more as it runs, whose figure is the one checked; the rungs aimed at
between them compile as they run (an aim is the choice as a rule);
elsewhere every try compiles as the step runs, and on a TPU drafts aim
them (`step_compiles.py`).

This module is the call: the step traced at a rung (each loop asks
`loop_plan` what it runs there), the search run for each signature of
arguments, and the choice kept on disk (`caches.OnDisk`), keyed on the step
lowered plain (its StableHLO: every shape, dtype and operation), the budget
and the limits, the jit options, the backend, device and versions and the
code that chooses: a second process lowers once (twice where the plan is
not plain), compiles the chosen rung once, and checks it against the budget
before it runs. That compile begins before plain is lowered: the last
search's choice is kept as a hint, keyed on what is known before a trace
(`_hint_key`), lowered and compiled in a thread while plain lowers; the plan
under the disk key takes it where it names the same rung, and decides.
"""

import contextlib
import contextvars
import dataclasses
import fractions
import hashlib
import inspect
import itertools
import math
import os
import sys
import time
from typing import Any, Callable, Iterator, NamedTuple, Optional

import jax
import jaxlib

from haiku_bridge._src import caches
from haiku_bridge._src import errors
from haiku_bridge._src import pytree
from haiku_bridge._src import versions
from haiku_bridge._src.pytree import PyTree
from haiku_bridge._src.remat import measure
from haiku_bridge._src.remat import plan as remat_plan
from haiku_bridge._src.remat import schedule as remat_schedule
from haiku_bridge._src.remat import step_compiles
from haiku_bridge._src.remat import step_search
from haiku_bridge._src.remat import tracing
from haiku_bridge._src.remat.step_compiles import StepTry
from haiku_bridge._src.remat.step_search import StepLoop

_API = step_compiles.API  # The call, as its messages name it.


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


@dataclasses.dataclass
class _Trace:
  """What one trace of the step at a rung records."""

  rung: step_search.Rung
  loops: list[step_search.TracedLoop] = dataclasses.field(default_factory=list)


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
  trace.loops.append(step_search.TracedLoop(length, policy, max_recompute, pytree.nbytes(carry)))
  return step_search.plan_at(trace.rung, length, policy, max_recompute)


class _Call(NamedTuple):
  """A call's planning: its search's number, the budget, the loops the plain trace saw, the step lowered plain (and its seconds), the disk key, the arguments."""

  search: int
  budget: int
  loops: list[step_search.TracedLoop]
  plain: tuple[Any, float]
  disk_key: Optional[str]
  args: tuple
  kwargs: dict


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
    self._plans: dict[Any, tuple[int, step_search.Rung, StepPlan]] = {}
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
    limit = step_compiles.device_memory()
    if limit is None:
      raise ValueError(
        errors.message(
          f"the {jax.default_backend()} backend does not say how much memory "
          "its device has (jax.devices()[0].memory_stats()), so the step "
          "has no default budget: pass memory_budget=, in bytes."
        )
      )
    return limit

  def _planned(self, args, kwargs) -> tuple[int, step_search.Rung, StepPlan]:
    key = _signature(args, kwargs, self._statics)
    found = self._plans.get(key)
    if found is None:
      with errors.entry(_API):
        found = self._plans[key] = self._search(args, kwargs)
    return found

  def _lowered(
    self, search: int, rung: step_search.Rung, args, kwargs, trace: Optional[_Trace] = None
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
    self,
    search: int,
    rung: step_search.Rung,
    args,
    kwargs,
    options: Optional[dict[str, Any]] = None,
  ) -> step_compiles.Compiled:
    """The step at `rung` compiled (by default, with `_measuring()`'s options)."""
    return step_compiles.compiled(
      *self._lowered(search, rung, args, kwargs), self._measuring() if options is None else options
    )

  def _search(self, args, kwargs) -> tuple[int, step_search.Rung, StepPlan]:
    budget = self._budget_bytes()
    tracing.LOG.info(
      "hkb.%s: planning the step for memory_budget=%d bytes (compiling it with its "
      'remat="auto" loops run a few ways)...',
      _API,
      budget,
    )
    start = time.perf_counter()
    search = next(_SEARCHES)
    ahead = self._ahead(search, args, kwargs)
    try:
      hint_key = self._hint_key(args, kwargs, budget)
      self._start_hinted(ahead, _from_disk(_HINTS.get(hint_key)))
      trace = _Trace(step_search.Rung(step_search.PLAIN))
      plain = self._lowered(search, trace.rung, args, kwargs, trace)
      ahead.given(trace.rung, *plain)
      disk_key = self._disk_key(plain[0], budget)
      call = _Call(search, budget, trace.loops, plain, disk_key, args, kwargs)
      rung, made = self._kept(call, ahead) or self._searched(call, ahead)
    finally:
      ahead.close()
    _HINTS.put(hint_key, _to_disk(rung))
    _log_planned(made, rung, time.perf_counter() - start)
    return search, rung, made

  def _ahead(self, search: int, args, kwargs) -> step_compiles.Ahead[step_search.Rung]:
    """What compiles the step at each rung for search number `search` (`step_compiles.Ahead`)."""
    measuring, drafting = self._measuring(), self._drafting()
    return step_compiles.Ahead(
      lambda rung: self._lowered(search, rung, args, kwargs),
      lambda lowered, seconds: step_compiles.compiled(lowered, seconds, measuring),
      None
      if drafting is None
      else lambda lowered, seconds: step_compiles.drafted(lowered, seconds, drafting),
      # Where tries measure, a compile as the step runs is another.
      (lambda lowered, seconds: step_compiles.compiled(lowered, seconds, {}))
      if measuring
      else None,
    )

  @staticmethod
  def _start_hinted(
    ahead: step_compiles.Ahead[step_search.Rung], hinted: Optional[step_search.Rung]
  ) -> None:
    """The rung the last search of this function chose for these arguments' types, lowered and compiled as it runs beside plain's lowering (`_HINTS`).

    A guess, never a decision: the plan kept under the disk key (the step
    lowered plain) decides, and takes this compile where it names the same
    rung (a second process compiles the chosen step while it lowers plain);
    a search takes it where it asks for that rung as the step runs. Where
    the guess is wrong, a compile spent in a thread; where it cannot be
    lowered, nothing.
    """
    if hinted is None or hinted.kind == step_search.PLAIN:
      return  # Plain is lowered anyway; its compile waits for the disk.
    try:
      ahead.start_aside(hinted)
    except Exception as error:  # pylint: disable=broad-except
      tracing.LOG.debug("hkb.%s: the hinted %s did not lower: %s", _API, hinted.describe(), error)

  def _kept(
    self, call: _Call, ahead: step_compiles.Ahead[step_search.Rung]
  ) -> Optional[tuple[step_search.Rung, StepPlan]]:
    """The plan kept on disk for this step, compiled once as it runs and checked; None where none is kept or it does not fit."""
    kept = _from_disk(_ON_DISK.get(call.disk_key), call.loops)
    if kept is None:
      return None
    done = ahead(kept, as_runs=True)
    step_search.log_try(kept, done)
    if done.bytes is None or done.bytes > call.budget:
      return None
    tries = (step_search.as_try(kept, done),)
    return kept, self._plan_of(call.budget, done.bytes, kept, call.loops, tries, kept=True)

  def _searched(
    self, call: _Call, ahead: step_compiles.Ahead[step_search.Rung]
  ) -> tuple[step_search.Rung, StepPlan]:
    """The first rung whose compiled step fits, found down the ladder (`step_search.Search`) and kept on disk; ValueError where none fits."""
    ladder = step_search.ladder(call.loops, self._max_recompute)
    found = step_search.Search(call.budget, self._max_recompute, ladder, call.loops, ahead)
    while True:
      rung = found.run()
      if rung is None:
        raise ValueError(
          errors.message(found.refusal(self._budget is None, self._unbounded(found, call.loops)))
        )
      if not found.tried[rung].measuring:
        break
      # The choice compiled as it runs (what the step's calls then use),
      # and checked: its figure, not the measuring compile's, decides.
      found.record(rung, ahead(rung, as_runs=True))
      if found.fits(rung):
        break
    _ON_DISK.put(call.disk_key, _to_disk(rung))
    return rung, self._plan_of(
      call.budget, found.tried[rung].bytes, rung, call.loops, tuple(found.made)
    )

  def _unbounded(self, found: "step_search.Search", loops: list[step_search.TracedLoop]) -> str:
    """What the step holds with no bound on recomputation, where the call has one and that holds less."""
    least = step_search.ladder(loops, math.inf)[-1]
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
    rung: step_search.Rung,
    loops: list[step_search.TracedLoop],
    tries: tuple[StepTry, ...],
    kept: bool = False,
  ) -> StepPlan:
    assert compiled_bytes is not None
    return StepPlan(
      budget,
      compiled_bytes,
      tuple(
        step_search.plan_at(rung, loop.length, loop.policy, loop.max_recompute) for loop in loops
      ),
      tries,
      kept,
    )

  def _disk_key(self, lowered: Any, budget: int) -> Optional[str]:
    """The key of the plan kept on disk for the step `lowered` (plain) at `budget`."""
    return self._key(lowered.as_text(), budget)

  def _hint_key(self, args, kwargs, budget: int) -> Optional[str]:
    """The key of the hint (`_HINTS`) for these arguments at `budget`: the step's function by name and place, the arguments' types and shardings, no trace (None: none, a hint never fails a call)."""
    try:
      step = inspect.unwrap(self.__wrapped__)
      code = getattr(step, "__code__", None)
      where = (
        getattr(step, "__module__", None),
        getattr(step, "__qualname__", None),
        getattr(code, "co_filename", None),
        getattr(code, "co_firstlineno", None),
      )
      signature = caches.without_addresses(
        repr(("hint", where, _signature(args, kwargs, self._statics)))
      )
    except Exception as error:  # pylint: disable=broad-except
      tracing.LOG.debug("hkb.%s: no hint for this step: %s", _API, error)
      return None
    return self._key(signature, budget)

  def _key(self, program: str, budget: int) -> Optional[str]:
    device = jax.devices()[0]
    options = caches.without_addresses(repr(sorted(self._jit_kwargs.items())))
    text = repr(
      (
        _FORMAT,
        program,
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


def _log_planned(made: StepPlan, rung: step_search.Rung, seconds: float) -> None:
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


@contextlib.contextmanager
def _tracing(rung: step_search.Rung, trace: Optional[_Trace] = None) -> Iterator[None]:
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
# The modules whose code makes a choice: a change to any of them is another
# disk key, so a plan chosen by other code is never read.
_CHOOSING_CODE = (sys.modules[__name__], step_search, step_compiles, remat_schedule)
_ON_DISK = caches.OnDisk("step_budgets")
# The rung the last search chose, by the step function's name and place and
# its arguments' types (`_hint_key`): a guess a second process compiles
# while it lowers plain for the disk key (`BudgetedStep._start_hinted`).
_HINTS = caches.OnDisk("step_budget_hints")


def _to_disk(rung: step_search.Rung) -> list[int]:
  """`rung` as a file keeps it (`_from_disk`)."""
  return [rung.kind, rung.extra.numerator, rung.extra.denominator]


def _from_disk(
  value: Any, loops: Optional[list[step_search.TracedLoop]] = None
) -> Optional[step_search.Rung]:
  """A kept rung, if `value` is one (on this step's ladder, given its `loops`); else None (a miss)."""
  if not (
    isinstance(value, list)
    and len(value) == 3
    and all(type(v) is int for v in value)
    and value[2] > 0
  ):  # pylint: disable=unidiomatic-typecheck
    return None
  rung = step_search.Rung(value[0], fractions.Fraction(value[1], value[2]))
  if loops is None:
    return rung if 0 <= rung.kind <= step_search.SCHEDULE and rung.extra >= 0 else None
  return rung if step_search.on_ladder(rung, loops) else None


def _jit_options() -> list[str]:
  """The keywords `jax.jit` takes besides the function."""
  return [name for name in inspect.signature(jax.jit).parameters if name != "fun"]


@caches.memoize(maxsize=1)
def _code_digest() -> str:
  """A digest of `_CHOOSING_CODE`'s files."""
  return caches.source_digest(_CHOOSING_CODE)


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
