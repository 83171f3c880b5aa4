"""The choice of `remat="auto"`: the candidate with the least recomputation whose bytes fit the budget, checked compiled, or the refusal that names the least budget.

`choose` takes every candidate the model predicts (`measure.candidates`)
and the binomial schedule with the most slots the budget holds, and picks
the one with the least recomputed FLOPs whose bytes fit (then the fewest
recomputed steps, then the least memory), among those that recompute at
most `max_recompute` forward passes of the loop (`MAX_RECOMPUTE`, 3, by
default): a `RematPlan`.

The budget's schedules are compiled, not assumed (`checked_plan`). The
model's line a + c·s, through one slot's compiled bytes, takes its slope
from a second schedule (`_sloped`): the schedule the budget chooses on the
line through one slot's bytes with the carry's bytes per slot, which is
then also the choice's check; where it lies off that line (XLA keeps a
slot at other than the carry's bytes, as XLA:CPU a bfloat16 carry's at
twice and XLA:TPU a carry padded to its tiles), or where the budget chooses
no schedule of several slots, the most slots a candidate keeps (T - 2:
`measure.most_slots`), so that a slot's cost is measured, never assumed,
and beside it the count the budget holds on the line through the two
schedules compiled, the likely choice (`_reaimed`). So a budget that a
schedule fits costs four compiles (five with a policy), where the carry's
bytes are a slot's, six where they are not, three in turn; one slot's
first, so that the budget's second schedule lowers as soon as its figures
are in, while remat=False's and remat=True's compile.

Predictions steer; the compiled program decides. The choice, unless it was
one of the programs measured, is compiled too, and when it is over the
budget the next candidate is chosen, the compiled bytes replacing that
plan's prediction only (at most `_CHECKS` compiles; then the first
compiled plan that fits, or an error). Compiled for their bytes only,
those and the line's second point are not read for FLOPs. A budget no plan
fits is refused (`refusal`), naming the least budget the call takes (and
the least with `max_recompute=math.inf`), never one below the budget.
"""

import math
from typing import NamedTuple, Optional

import numpy as np

from haiku_bridge._src import errors
from haiku_bridge._src.remat import measure
from haiku_bridge._src.remat import plan_cache
from haiku_bridge._src.remat import schedule as remat_schedule
from haiku_bridge._src.remat import tracing
from haiku_bridge._src.remat.measure import RematCandidate

# The most forward passes of the loop a plan may recompute unless the caller
# allows more (`max_recompute=`): remat=True's one and two more. A training
# step runs about three passes' worth (the backward pass about two), so
# this keeps a plan's step within about twice no remat's compute. Binomial
# schedules within it keep about (6·T)^(1/3) slots (44 at 16384 steps,
# where one pass fewer takes 179); with fewer, the recomputation grows
# fast (one slot: about T/2 passes).
MAX_RECOMPUTE = 3.0


class RematPlan(NamedTuple):
  """The plan `remat="auto"` makes for a loop: the candidates, and the one chosen.

  `hkb.remat_plan` returns it; every loop run with `remat="auto"` logs the
  one it makes, when it is traced, at INFO on the `haiku_bridge.remat`
  logger (`str()` of it: the choice, then the table).

  Attributes:
    length: the number of steps.
    memory_budget: the budget, bytes.
    candidates: every candidate (`RematCandidate`), ordered by recomputed
      FLOPs, then steps, then memory.
    choice: the candidate with the least recomputed FLOPs whose predicted
      temporaries fit the budget (the fewest recomputed steps, then the
      least memory, among those).
    derivatives: the derivatives the plan is for, innermost first, as the
      loop saw them around it, each `(mode, at_once)`: the loop's own
      (`"reverse"`, a gradient; `"forward"`, a JVP), then each taken of
      it (a gradient of a gradient, a Hessian-vector product), with how
      many are taken at once under a `jax.vmap` (`jax.hessian`'s JVPs).
  """

  length: int
  memory_budget: int
  candidates: tuple[RematCandidate, ...]
  choice: RematCandidate
  derivatives: tuple[tuple[str, int], ...] = (("reverse", 1),)

  @property
  def least_budget(self) -> int:
    """The least `memory_budget` any candidate fits: its predicted temporaries, bytes."""
    return min(k.temporaries for k in self.candidates)

  def table(self) -> str:
    """The candidates as a Markdown table, in MiB and GFLOP, the choice marked.

    >>> c = hkb.RematCandidate
    >>> print(hkb.RematPlan(8, 3 << 20, (
    ...     c(False, None, None, 4 << 20, 0, 0),
    ...     c(True, None, None, 3 << 20, 8, 160_000_000, "dots_saveable"),
    ...     c(True, None, None, 1 << 19, 8, 800_000_000)),
    ...     c(True, None, None, 3 << 20, 8, 160_000_000, "dots_saveable")
    ...     ).table())
    | remat | slots | groups | temporaries (MiB) | recomputed steps | recomputed GFLOP | |
    | --- | --- | --- | --- | --- | --- | --- |
    | False |  |  | 4 | 0 | 0 | over the budget |
    | True, policy dots_saveable |  |  | 3 | 8 | 0.16 | **chosen** |
    | True |  |  | 0.5 | 8 | 0.8 |  |
    """
    rows = [
      "| remat | slots | groups | temporaries (MiB) | recomputed steps | recomputed GFLOP | |",
      "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k in self.candidates:
      note = (
        "**chosen**"
        if k == self.choice
        else "over the budget"
        if k.temporaries > self.memory_budget
        else ""
      )
      remat = f"{k.remat}" + ("" if k.policy is None else f", policy {k.policy}")
      rows.append(
        f"| {remat} | {'' if k.slots is None else k.slots} | "
        f"{'' if k.groups is None else k.groups} | "
        f"{_mib(k.temporaries)} | {k.recomputed_steps} | "
        f"{_readable(k.recomputed_flops / 1e9)} | {note} |"
      )
    return "\n".join(rows)

  def __str__(self) -> str:
    """What `remat="auto"` chose and why, then `table()`."""
    return (
      f'remat="auto" for {self.length} steps chose '
      f"{self.choice.describe()}: {_mib(self.choice.temporaries)} MiB "
      "of training-step temporaries (predicted), within memory_budget="
      f"{self.memory_budget} bytes ({_mib(self.memory_budget)} MiB; the "
      f"least any plan needs: {self.least_budget} bytes, "
      f"{_mib(self.least_budget)} MiB), "
      f"{self.choice.recomputed_steps} steps and "
      f"{_readable(self.choice.recomputed_flops / 1e9)} GFLOP "
      f"recomputed{_planned_for(self.derivatives)}.\n{self.table()}"
    )


def _planned_for(derivatives: tuple[tuple[str, int], ...]) -> str:
  """What `RematPlan.__str__` says of the derivatives a plan is for, other than one gradient.

  >>> from haiku_bridge._src.remat import choice
  >>> choice._planned_for((("reverse", 1), ("forward", 64)))
  ', for 64 JVPs at once of a gradient'
  >>> choice._planned_for((("reverse", 1),))
  ''
  """
  if derivatives == (("reverse", 1),):
    return ""
  words = {"reverse": ("a gradient", "gradients"), "forward": ("a JVP", "JVPs")}
  return ", for " + " of ".join(
    words[mode][0] if at_once == 1 else f"{at_once} {words[mode][1]} at once"
    for mode, at_once in reversed(derivatives)
  )


def _readable(x: float) -> str:
  """`x` to 4 significant digits, without an exponent: 0.1907, 1235, 12350."""
  return np.format_float_positional(x, precision=4, unique=True, fractional=False, trim="-")


def _mib(num_bytes: float) -> str:
  return _readable(num_bytes / 2**20)


def refusal(message: str) -> ValueError:
  """The error where no plan fits `memory_budget` (or none that fits recomputes within `max_recompute`): a ValueError that `loop.resolved` may defer to a differentiation (`is_refusal`, `plan.deferrable`)."""
  error = ValueError(message)
  error.remat_refusal = True  # type: ignore[attr-defined]
  return error


def is_refusal(error: BaseException) -> bool:
  """Whether `error` is a loop's refusal of its budget (`refusal`)."""
  return getattr(error, "remat_refusal", False)


def checked_plan(
  step: tracing.Traced, consts, length: int, memory_budget: int, policy, max_recompute: float
) -> RematPlan:
  """The plan of the traced `step` over `length` steps for `memory_budget`: measured (or kept), chosen, and checked compiled."""
  here: dict[measure.Key, measure.Figures] = {}  # The plans this call compiled.

  def second(one: measure.Measured) -> None:
    # Lowered and compiled while the other measurements compile.
    slots = _second_point(
      length, memory_budget, one.temporaries, one.constants, measure.slot_guess(step)
    )
    if slots is not None:
      _compiled(step, consts, length, ("binomial", slots, None, None), policy, here)

  c = _sloped(
    plan_cache.coefficients(step, consts, length, policy, second),
    step,
    consts,
    memory_budget,
    policy,
    here,
  )
  try:
    return _checked_choice(c, step, consts, memory_budget, policy, max_recompute, here)._replace(
      derivatives=step.derivatives
    )
  except ValueError as e:
    if not tracing.no_schedules(step):
      raise
    raise refusal(
      f"{e} Differentiated again in reverse mode (a gradient of a "
      "gradient), or forward, the plans are remat=False, remat=True and "
      "the policy: a schedule keeps more than remat=False there, or runs "
      "as remat=True."
    ) from None


def _checked_choice(
  c: measure.Coefficients,
  step: tracing.Traced,
  consts,
  memory_budget: int,
  policy,
  max_recompute: float,
  here: dict[measure.Key, measure.Figures],
) -> RematPlan:
  """The plan `c` chooses for `memory_budget`, compiled to check it (`checked_plan`)."""
  length = c.length
  for _ in range(_CHECKS):
    chosen = choose(c, length, memory_budget, max_recompute)
    if measure.key(chosen.choice) in dict(c.measured):
      return chosen
    c = _checked(c, step, consts, chosen.choice, policy, here)
  # Still unchecked: the first that was compiled, fits and is affordable.
  chosen = choose(c, length, memory_budget, max_recompute)
  measured = dict(c.measured)
  compiled = [k for k in chosen.candidates if measure.key(k) in measured]
  within = [k for k in compiled if k.recomputed_steps <= max_recompute * length]
  for k in within:
    if k.temporaries <= memory_budget:
      return chosen._replace(choice=k)
  # Every compiled plan within the bound is over the budget: the least of
  # those is what the call takes (never a plan that fits but recomputes
  # more than the bound, which the call would refuse again).
  raise _over_budget(
    length, memory_budget, min(k.temporaries for k in within), min(k.temporaries for k in compiled)
  )


def choose(
  c: measure.Coefficients, length: int, memory_budget: int, max_recompute: float = MAX_RECOMPUTE
) -> RematPlan:
  """The plan the coefficients predict for `length` steps and the budget.

  Never one that recomputes more than `max_recompute` forward passes of the
  loop: where every plan that fits the budget does, the error says what the
  budget costs and the least budget within `max_recompute`.
  """
  candidates = measure.candidates(c, length)
  # Binomial with the most slots the budget holds: the fewest recomputed
  # steps of any schedule that fits. Each slot costs the same, and the
  # tables shrink as slots are added: from the most the slots alone
  # allow, down to the first that fits with its tables.
  if c.scheduled is not None:
    a, per_slot = c.scheduled
    k0, k1 = c.constants
    most = min(
      measure.most_slots(length), int((memory_budget - a - k0 - k1 * length) // max(per_slot, 1.0))
    )
    for slots in range(most, max(0, most - _SLOT_SEARCH), -1):
      fits = measure.binomial(c, length, slots)
      if fits.temporaries <= memory_budget:
        if fits not in candidates:
          candidates.append(fits)
        break
  candidates.sort(key=lambda k: (k.recomputed_flops, k.recomputed_steps, k.temporaries))
  fitting = [k for k in candidates if k.temporaries <= memory_budget]
  if not fitting:
    raise _over_budget(
      length,
      memory_budget,
      _least_within(c, candidates, length, max_recompute),
      min(k.temporaries for k in candidates),
    )
  affordable = [k for k in fitting if k.recomputed_steps <= max_recompute * length]
  if not affordable:
    _raise_over_recompute(c, candidates, fitting, length, memory_budget, max_recompute)
  return RematPlan(length, memory_budget, tuple(candidates), affordable[0])


def _raise_over_recompute(
  c: measure.Coefficients,
  candidates: list[RematCandidate],
  fitting: list[RematCandidate],
  length: int,
  memory_budget: int,
  max_recompute: float,
) -> None:
  """The error where every plan that fits recomputes over `max_recompute`."""
  fewest = min(k.recomputed_steps for k in fitting)
  least = _least_within(c, candidates, length, max_recompute)
  raise refusal(
    errors.message(
      f"every remat plan for {length} steps that fits memory_budget="
      f"{memory_budget} bytes recomputes at least {fewest} steps, "
      f"{fewest / length:.1f} forward passes of the loop (remat=True "
      f"recomputes 1), over max_recompute={max_recompute:g}. The least "
      f"budget within it is {least} bytes (predicted): raise memory_budget "
      f"to that, or pass max_recompute={math.ceil(fewest / length)} to "
      "accept the recomputation."
    )
  )


def _least_within(
  c: measure.Coefficients, candidates: list[RematCandidate], length: int, max_recompute: float
) -> int:
  """The least bytes of a plan recomputing at most `max_recompute` forward passes: the least budget a call with that bound takes."""
  within = [k for k in candidates if k.recomputed_steps <= max_recompute * length]
  spare = max_recompute * length - length  # A schedule's advances.
  if c.scheduled is not None and spare >= 0:
    # The fewest slots within the bound: a schedule's least memory there.
    within.append(
      measure.binomial(
        c, length, remat_schedule.fewest_binomial_slots(length, int(min(spare, length * length)))
      )
    )
  return min(k.temporaries for k in within)  # remat=False is always within.


# The counts of slots below the most the slots alone allow that `choose`
# tries, at most.
_SLOT_SEARCH = 64


def _over_budget(length: int, memory_budget: int, least: int, unbounded: int) -> ValueError:
  """The refusal of a budget below `least`, the least within `max_recompute` (`unbounded`: with none)."""
  beyond = f", {unbounded} with max_recompute=math.inf" if unbounded < least else ""
  return refusal(
    errors.message(
      f"no remat plan for {length} steps fits memory_budget="
      f"{memory_budget} bytes: the least any needs is {least} bytes "
      f"(predicted){beyond}. Raise the budget, or shorten the scan. The budget "
      "counts the step's per-step outputs and their cotangents, read by "
      "the loss or not: where it reads only the final carry, return none."
    )
  )


# Plans compiled to check a choice, at most: then the last choice stands.
_CHECKS = 4
# How far (a fraction of its bytes) a schedule compiled for the budget may
# lie from the line of one slot and the carry's bytes per slot, and still
# be taken as on it (`_sloped`).
_ON_THE_LINE = 0.01


def _sloped(
  c: measure.Coefficients,
  step: tracing.Traced,
  consts,
  memory_budget: int,
  policy,
  here: dict[measure.Key, measure.Figures],
) -> measure.Coefficients:
  """`c` with its schedules' line through two compiled schedules.

  The first is one slot's (`coefficients`). The second is the most slots
  the budget holds on the line of one slot's bytes and the carry's bytes
  per slot (`_second_point`), compiled: where a schedule is chosen, it is
  then the choice's check too. Where it lies off that line (within
  `_ON_THE_LINE`: XLA keeps a slot at other than the carry's bytes, as a
  bfloat16 carry's at twice or XLA:TPU a carry's padded to its tiles, or
  compiles that count of slots off the line, as near T), or where the
  budget holds fewer than two slots, the line runs through the most slots
  a candidate keeps (`measure.most_slots`) instead, so that every schedule's
  prediction lies between two compiles and one count's miss moves no
  other's; and, compiled beside it, the most slots the budget holds on the
  line through the two schedules compiled (`_reaimed`), the likely choice,
  so that it needs no check after.
  """
  if c.scheduled is None:
    return c
  a, guess = c.scheduled
  one = a + guess  # One slot's temporaries, compiled.
  most = measure.most_slots(c.length)
  slots = _second_point(c.length, memory_budget, one, c.constants[0], guess)
  if slots is None:
    return c
  got = _compiled(step, consts, c.length, ("binomial", slots, None, None), policy, here)
  c = c._replace(measured=c.measured + ((("binomial", slots, None, None), got.bytes),))
  if slots != most and abs(got.temporaries - (a + guess * slots)) > (
    _ON_THE_LINE * got.temporaries
  ):
    aimed = _reaimed(c.length, memory_budget, one, c.constants[0], (slots, got.temporaries))
    plans = [
      ("binomial", s, None, None) for s in dict.fromkeys([aimed, most]) if s not in (1, slots)
    ]
    figures = plan_cache.compiled(step, consts, c.length, plans, policy, here)
    c = c._replace(measured=c.measured + tuple((plan, f.bytes) for plan, f in zip(plans, figures)))
    slots = most
    got = _compiled(step, consts, c.length, ("binomial", most, None, None), policy, here)
  per_slot = (got.temporaries - one) / (slots - 1)
  return c._replace(scheduled=(one - per_slot, per_slot))


def _second_point(
  length: int, memory_budget: int, one: float, constants: float, guess: float
) -> Optional[int]:
  """The second schedule `_sloped` compiles: the most slots `memory_budget` holds on the first line.

  That line: one slot's temporaries `one`, `guess` bytes more per slot,
  one slot's tables' `constants` (the most). At most `measure.most_slots`; where
  the budget holds fewer than two, `measure.most_slots`; None for a loop of fewer
  than four steps (one slot is the most a schedule keeps).
  """
  most = measure.most_slots(length)
  if most < 2:
    return None
  fits = int((memory_budget - constants - one) // max(guess, 1.0)) + 1
  return min(most, fits) if fits >= 2 else most


def _reaimed(
  length: int, memory_budget: int, one: float, constants: float, second: tuple[int, float]
) -> int:
  """The most slots `memory_budget` holds on the line through one slot's temporaries `one` and the `second` schedule's (slots, temporaries).

  Where a slot's bytes are not the carry's, the second schedule, placed on
  the carry's line, is not the count the budget holds: this one, placed
  on the line of a slot's bytes as compiled, is (to within the line's
  curve).

  >>> from haiku_bridge._src.remat import choice
  >>> choice._reaimed(64, 1000, 100, 0, (11, 400.0))  # 30 bytes a slot.
  31
  """
  slots, temporaries = second
  per_slot = (temporaries - one) / (slots - 1)
  return _second_point(length, memory_budget, one, constants, per_slot) or 1


def _checked(
  c: measure.Coefficients,
  step: tracing.Traced,
  consts,
  choice: RematCandidate,
  policy,
  here: dict[measure.Key, measure.Figures],
) -> measure.Coefficients:
  """`c` with `choice` compiled: its bytes replace its prediction, no other's."""
  got = _compiled(step, consts, c.length, measure.key(choice), policy, here)
  return c._replace(measured=c.measured + ((measure.key(choice), got.bytes),))


def _compiled(
  step: tracing.Traced,
  consts,
  length: int,
  plan: measure.Key,
  policy,
  here: dict[measure.Key, measure.Figures],
) -> measure.Figures:
  """A plan's figures, compiled at `length` steps, or kept (`plan_cache.compiled`)."""
  return plan_cache.compiled(step, consts, length, [plan], policy, here)[0]
