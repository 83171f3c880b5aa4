"""The ladder of plans for a budgeted step's `remat="auto"` loops, and the search down it for the first whose compiled step fits.

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
compiled schedules (`Search._aim`). A step whose plain form fits costs one
compile, one that needs `remat=True` two, one on a schedule three to seven
(four where a slot holds a whole count of carries, as XLA:CPU compiles
them). Where the tries measure (the CPU's cheaper compiles,
`measure.measuring_options`), a rung aimed at between two compiled ones,
the choice as a rule, compiles as the step runs: measured and made at once
(`Search.fits(..., as_runs=True)`). On a TPU the search drafts
(`measure.draft_options`: XLA at its least effort, a third of the cost,
its bytes off by a constant along the schedules): there `remat=True` compiles beside plain (where plain fits, it
finishes in its thread, unused, or is cancelled where plain's compile
ended before it began), and three drafts beside `remat=True`: of
`remat=True`, a middle schedule and the last rung. Where `remat=True` does
not fit, the line through the two schedules' drafts, less the offset read
at `remat=True`, aims, and the rung before the aim compiles as it runs;
the line through that compile at the drafts' slope (the schedules' own)
then decides that no rung before it fits, where it says so by a quarter of
a slot's bytes or more, or aims the next compile
(`Search._on_drafted_slope`): on a schedule, three compiles and three
drafts where the aim is a rung late. A draft's bytes never decide alone.
How each rung compiles (measuring, drafts, threads) is
`step_compiles.py`'s; what the step runs and keeps is `step_budget.py`'s.
"""

import bisect
import fractions
import math
from typing import Callable, NamedTuple, Optional

from haiku_bridge._src import modes
from haiku_bridge._src.remat import schedule as remat_schedule
from haiku_bridge._src.remat import step_compiles
from haiku_bridge._src.remat import tracing
from haiku_bridge._src.remat.step_compiles import Compiled
from haiku_bridge._src.remat.step_compiles import StepTry

# A rung's kinds, in the ladder's order: remat=False, remat=True under the
# loop's remat_policy, remat=True, a binomial schedule.
PLAIN, POLICY, REMAT, SCHEDULE = range(4)
# Compiles of the step beyond remat=True's and the least rung's, on the
# schedules' side of the ladder.
MORE_TRIES = 4


class Rung(NamedTuple):
  """A step on the search's ladder: what every `remat="auto"` loop runs there.

  `kind`: `PLAIN` (remat=False), `POLICY` (remat=True under the loop's
  `remat_policy`; plain without one), `REMAT` (remat=True), `SCHEDULE` (a
  binomial schedule recomputing at most `extra` forward passes more than
  `remat=True`; `extra` > 0, a fraction).
  """

  kind: int
  extra: fractions.Fraction = fractions.Fraction(0)

  def describe(self) -> str:
    if self.kind == SCHEDULE:
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


class TracedLoop(NamedTuple):
  """A `remat="auto"` loop as a trace of the step saw it: what the ladder and the schedules' line are built from."""

  length: int
  policy: bool
  max_recompute: float
  carry_bytes: int


def plan_at(rung: Rung, length: int, policy: bool, max_recompute: float) -> StepLoop:
  """The plan of a loop at `rung`, within its own `max_recompute`."""
  if rung.kind == PLAIN or (max_recompute < 1 and not (rung.kind >= POLICY and policy)):
    return StepLoop(length, False)
  if rung.kind == POLICY or max_recompute < 1:
    return StepLoop(length, policy, policy=policy)
  extra = (
    rung.extra
    if max_recompute == math.inf
    else min(rung.extra, fractions.Fraction(max_recompute) - 1)
  )
  if rung.kind == REMAT or extra <= 0 or length < 3:
    return StepLoop(length, True)
  slots = remat_schedule.fewest_binomial_slots(length, math.floor(extra * length))
  if slots > length - 2:
    return StepLoop(length, True)
  return StepLoop(length, "binomial", slots)


def ladder(loops: list[TracedLoop], max_recompute: float) -> list[Rung]:
  """Every rung that changes some loop's plan, in order of recomputation."""
  rungs = [Rung(PLAIN)]
  if any(loop.policy for loop in loops):
    rungs.append(Rung(POLICY))
  rungs.append(Rung(REMAT))
  extras = set()
  for loop in set(loops):
    most = min(max_recompute, loop.max_recompute) - 1
    # The most steps a schedule of the loop may recompute beyond remat=True's,
    # a whole count (exact: a ladder of ~T rungs read in integers, not fractions).
    limit = math.inf if most == math.inf else math.floor(fractions.Fraction(most) * loop.length)
    for slots in range(loop.length - 2, 0, -1):
      steps = remat_schedule.binomial_cost(loop.length, slots)
      if steps > limit:
        break
      if steps:
        extras.add(fractions.Fraction(steps, loop.length))
  # In order by value as a float first (rounding keeps order), exactly where two round alike.
  ordered = sorted(extras, key=lambda extra: (extra.numerator / extra.denominator, extra))
  return rungs + [Rung(SCHEDULE, extra) for extra in ordered]


def on_ladder(rung: Rung, loops: list[TracedLoop]) -> bool:
  """Whether `rung` is on `ladder(loops, math.inf)`, found without building it (a loop of T steps has about T rungs): a plan read from disk is checked so."""
  if rung.kind in (PLAIN, REMAT):
    return rung.extra == 0
  if rung.kind == POLICY:
    return rung.extra == 0 and any(loop.policy for loop in loops)
  if rung.kind != SCHEDULE:
    return False
  for loop in set(loops):
    if loop.length < 3:  # No schedule: remat=True keeps as few carries.
      continue
    steps = rung.extra * loop.length  # Steps recomputed beyond remat=True's.
    slots = remat_schedule.fewest_binomial_slots(loop.length, math.floor(steps))
    # A schedule of the ladder keeps at most T - 2 slots (T - 1: none recomputed).
    if slots <= loop.length - 2 and remat_schedule.binomial_cost(loop.length, slots) == steps:
      return True
  return False


def carries_kept(rung: Rung, loops: list[TracedLoop]) -> int:
  """Bytes of the carries the loops keep for the backward pass at `rung` (the line's abscissa); they never grow down the ladder."""
  kept = 0
  for loop in loops:
    plan = plan_at(rung, loop.length, loop.policy, loop.max_recompute)
    kept += loop.carry_bytes * (plan.slots if plan.slots is not None else loop.length)
  return kept


class Search:
  """The first rung of `ladder` whose compiled step fits `budget`."""

  def __init__(
    self,
    budget: int,
    max_recompute: float,
    ladder: list[Rung],
    loops: list[TracedLoop],
    compile_at: Callable[[Rung], Compiled] | step_compiles.Compiler[Rung],
  ):
    self.budget = budget
    self.max_recompute = max_recompute
    self.ladder = ladder
    self.loops = loops
    self.compile_at = (
      compile_at
      if isinstance(compile_at, step_compiles.Compiler)
      else step_compiles.OneByOne(compile_at)
    )
    self.tried: dict[Rung, Compiled] = {}  # The last compile of each rung.
    self.made: list[StepTry] = []  # Every compile, in order.
    self._index = {rung: i for i, rung in enumerate(ladder)}
    self._kept: dict[int, int] = {}  # carries_kept of the rungs read, by index.

  def record(self, rung: Rung, done: Compiled) -> None:
    """`done`, a compile of the step at `rung`: kept, and logged."""
    self.tried[rung] = done
    self.made.append(as_try(rung, done))
    log_try(rung, done)

  def fits(self, rung: Rung, as_runs: bool = False) -> bool:
    """Whether `rung`'s compiled step fits, compiled if not yet (with `as_runs`, as the step runs)."""
    if rung not in self.tried:
      self.record(rung, self.compile_at(rung, as_runs))
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
      (done.bytes, self._index[rung], rung)
      for rung, done in self.tried.items()
      if done.bytes is not None and rung in self._index
    ]
    return min(fitted)[2] if fitted else self.least()

  def _next(self, rung: Rung, then: Optional[Rung] = None) -> None:
    """`rung` is compiled next; `then` lowered meanwhile, where it is likely asked for after."""
    if rung not in self.tried:
      self.compile_at.start(rung)
      if then is not None and then not in self.tried:
        self.compile_at.lower(then)

  def run(self) -> Optional[Rung]:
    true = self._index[Rung(REMAT)] if self.loops else 0
    schedules = self.ladder[true + 1 :]
    drafting = self.compile_at.drafting and len(schedules) >= 3
    self._next(self.ladder[0], self.ladder[true] if self.loops else None)
    if drafting:  # remat=True beside plain: where plain fits, unused (or cancelled).
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
    for _ in range(MORE_TRIES):
      between = self._aim(over, fits)
      if between is None:
        break
      # An aim is the choice as a rule: compiled as the step runs, it is
      # measured and made at once (one compile, not two, where it is).
      if self.fits(self.ladder[between], as_runs=True):
        fits = between
      else:
        over = between
    return self.ladder[fits]

  def _draft(self, rung: Rung) -> Optional[int]:
    """The bytes of `rung`'s draft (None: none), the draft logged and listed."""
    drafted = self.compile_at.draft(rung)
    self.made.append(as_try(rung, drafted))
    log_try(rung, drafted)
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
    x_middle, x_least = (self._x(self._index[rung]) for rung in drafts[1:])
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
    x_first = self._x(first)
    if fits is None:
      return self._first_on_line(over, len(self.ladder) - 1, x_first, b_first, slope)
    if fits - over < 2:
      return first
    x_before = self._x(fits - 1)
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
    x_fits = self._x(fits)
    b_fits = self.tried[self.ladder[fits]].bytes
    assert b_fits is not None
    second = self._second_schedule(over, fits, x_fits)
    if second is not None:
      slopes = [(second[1] - b_fits) / (second[0] - x_fits)]
    else:
      b_over = self.tried[self.ladder[over]].bytes
      x_over = self._x(over)
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
      if rung.kind != SCHEDULE or done.bytes is None or rung not in self._index:
        continue
      index = self._index[rung]
      x = self._x(index)
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
    """The first rung between `over` and `fits` (neither) whose bytes on the line through (`x_fits`, `b_fits`) at `slope` are within the budget (or `budget`).

    The carries kept never grow down the ladder (`carries_kept`), so the
    line's bytes move one way along it: the first rung within is found by
    bisection, a few rungs read of a ladder of thousands (a loop of T steps
    has about T rungs).
    """
    budget = self.budget if budget is None else budget
    within = lambda i: b_fits + slope * (self._x(i) - x_fits) <= budget
    if over + 1 >= fits:
      return None
    if slope < 0:  # The line rises down the ladder: only its first rung can be within.
      return over + 1 if within(over + 1) else None
    first = over + 1 + bisect.bisect_left(range(over + 1, fits), True, key=within)
    return first if first < fits else None

  def _x(self, index: int) -> int:
    """`carries_kept` of the ladder's rung at `index`: the line's abscissa."""
    if index not in self._kept:
      self._kept[index] = carries_kept(self.ladder[index], self.loops)
    return self._kept[index]

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
      if least.kind == PLAIN and not unbounded:
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


def as_try(rung: Rung, done: Compiled) -> StepTry:
  """`done`, a compile at `rung`, as `StepPlan.tries` lists it."""
  return StepTry(rung.describe(), done.bytes, done.seconds, done.measuring, done.draft)


def log_try(rung: Rung, done: Compiled) -> None:
  """`done`'s line on the `haiku_bridge.remat` logger, at INFO."""
  tracing.LOG.info("hkb.%s: compiled %s", step_compiles.API, as_try(rung, done))
