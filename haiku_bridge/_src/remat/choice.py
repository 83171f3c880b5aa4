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
from typing import Any, NamedTuple, Optional

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
# The most rows `RematPlan.table()` shows unless asked for every one.
COMPACT_ROWS = 12


class RematPlan(NamedTuple):
  """The plan `remat="auto"` makes for a loop: the candidates, and the one chosen.

  `hkb.remat_plan` returns it; every loop run with `remat="auto"` logs the
  one it makes, when it is traced, at INFO on the `haiku_bridge.remat`
  logger (`str()` of it: the choice, then the compact `table()`); `plot()`
  draws it where matplotlib is installed.

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
    max_recompute: the most forward passes of the loop a plan chosen may
      recompute (`hkb.remat_plan`'s `max_recompute`).
  """

  length: int
  memory_budget: int
  candidates: tuple[RematCandidate, ...]
  choice: RematCandidate
  derivatives: tuple[tuple[str, int], ...] = (("reverse", 1),)
  max_recompute: float = MAX_RECOMPUTE

  @property
  def least_budget(self) -> int:
    """The least `memory_budget` any candidate fits: its predicted temporaries, bytes."""
    return min(k.temporaries for k in self.candidates)

  def over_bound(self, candidate: RematCandidate) -> bool:
    """Whether `candidate` recomputes more than `max_recompute` forward passes: never chosen.

    >>> c = hkb.RematCandidate("binomial", 1, None, 1 << 10, 36, 0)
    >>> hkb.RematPlan(8, 1 << 20, (c,), c, max_recompute=3).over_bound(c)
    True
    """
    return candidate.recomputed_steps > self.max_recompute * self.length

  def table(self, full: bool = False) -> str:
    """The candidates as a Markdown table, in MiB and GFLOP, the choice marked.

    One kind of figure per column: "predicted" is the model's bytes for
    every plan (remat=False, remat=True and a policy are predicted by their
    own compiles), "compiled" the bytes of the plans compiled while
    planning (the choice's check among them), which the choice weighs
    where they are known. The last column marks the choice, a plan whose
    bytes are over the budget, and one that recomputes more than
    `max_recompute` forward passes of the loop (never chosen).

    >>> c = hkb.RematCandidate
    >>> print(hkb.RematPlan(8, 3 << 20, (
    ...     c(False, None, None, 4 << 20, 0, 0, None, 4 << 20),
    ...     c(True, None, None, 3 << 20, 8, 160_000_000, "dots_saveable", 3 << 20),
    ...     c("binomial", 2, None, 1 << 19, 30, 800_000_000)),
    ...     c(True, None, None, 3 << 20, 8, 160_000_000, "dots_saveable", 3 << 20)
    ...     ).table())
    | remat | slots | groups | predicted (MiB) | compiled (MiB) | recomputed steps | recomputed GFLOP | |
    | --- | --- | --- | --- | --- | --- | --- | --- |
    | False |  |  | 4 | 4 | 0 | 0 | over the budget |
    | True, policy dots_saveable |  |  | 3 | 3 | 8 | 0.16 | **chosen** |
    | binomial | 2 |  | 0.5 |  | 30 | 0.8 | over max_recompute=3 |

    Args:
      full: every candidate. By default, at most `COMPACT_ROWS`: remat=False,
        remat=True (and under the policy), the choice and the candidates
        either side of it, the least memory within `max_recompute` and
        over it, and the plans compiled, in the full table's order, then a
        line saying how many are left out.

    Returns:
      The table, one row per line.
    """
    shown = self.candidates if full else self._compact()
    rows = [
      "| remat | slots | groups | predicted (MiB) | compiled (MiB) | recomputed steps "
      "| recomputed GFLOP | |",
      "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k in shown:
      remat = f"{k.remat}" + ("" if k.policy is None else f", policy {k.policy}")
      predicted = k.temporaries if k.predicted is None else k.predicted
      compiled = "" if k.compiled is None else _mib(k.compiled)
      rows.append(
        f"| {remat} | {'' if k.slots is None else k.slots} | "
        f"{'' if k.groups is None else k.groups} | {_mib(predicted)} | {compiled} | "
        f"{k.recomputed_steps} | {_readable(k.recomputed_flops / 1e9)} | {self._mark(k)} |"
      )
    if len(shown) < len(self.candidates):
      rows.append(
        f"\n{len(shown)} of {len(self.candidates)} candidates: `table(full=True)` lists every one."
      )
    return "\n".join(rows)

  def plot(self, ax: Any = None) -> Any:
    """The trade-off drawn with matplotlib: each candidate's memory against its recomputed FLOPs.

    Every candidate at its predicted bytes (grey where it recomputes over
    `max_recompute`, never chosen), the plans compiled while planning at
    their compiled bytes, `memory_budget` as a dashed line and the choice
    as a star. The FLOPs axis is logarithmic above the least recomputation
    (linear below it, down to remat=False's none). matplotlib is optional:
    `pip install matplotlib`.

    >>> c = hkb.RematCandidate
    >>> plan = hkb.RematPlan(8, 3 << 20, (
    ...     c(False, None, None, 4 << 20, 0, 0, None, 4 << 20),
    ...     c(True, None, None, 3 << 20, 8, 160_000_000, None, 3 << 20)),
    ...     c(True, None, None, 3 << 20, 8, 160_000_000, None, 3 << 20))
    >>> try:
    ...   ax = plan.plot()  # A new figure; or plan.plot(ax) to draw on yours.
    ... except ImportError as e:  # matplotlib is not installed.
    ...   print("pip install matplotlib" in str(e))
    ... else:
    ...   print(ax.get_ylabel().startswith("temporaries"))
    True

    Args:
      ax: the matplotlib Axes to draw on; None: a new figure's.

    Returns:
      The Axes drawn on.

    Raises:
      ImportError: where matplotlib is not installed, saying how to install it.
    """
    with errors.entry("RematPlan.plot"):
      try:
        import matplotlib  # pylint: disable=g-import-not-at-top  # Optional.
      except ImportError as e:
        raise ImportError(
          errors.message(
            f"needs matplotlib, which could not be imported ({e}). Install it with: "
            "pip install matplotlib (`table()` shows the same figures as text)"
          )
        ) from e
      if ax is None:
        import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

        _, ax = plt.subplots()
      del matplotlib  # Imported for the error only.
    gflop = lambda ks: [k.recomputed_flops / 1e9 for k in ks]
    mib = lambda values: [v / 2**20 for v in values]
    within = [k for k in self.candidates if not self.over_bound(k)]
    over = [k for k in self.candidates if self.over_bound(k)]
    predicted = lambda ks: mib(k.temporaries if k.predicted is None else k.predicted for k in ks)
    ax.scatter(gflop(within), predicted(within), s=16, color="C0", label="predicted")
    if over:
      ax.scatter(
        gflop(over),
        predicted(over),
        s=16,
        color="0.7",
        label=f"predicted, over max_recompute={self.max_recompute:g}",
      )
    compiled = [k for k in self.candidates if k.compiled is not None]
    ax.scatter(
      gflop(compiled),
      mib(k.temporaries for k in compiled),
      s=40,
      facecolors="none",
      edgecolors="C1",
      label="compiled",
    )
    ax.axhline(self.memory_budget / 2**20, color="C3", linestyle="--", label="memory_budget")
    ax.scatter(
      gflop([self.choice]),
      mib([self.choice.temporaries]),
      s=160,
      marker="*",
      color="C2",
      zorder=3,
      label=f"chosen: {self.choice.describe()}",
    )
    least = min((k.recomputed_flops for k in self.candidates if k.recomputed_flops), default=0)
    if least:
      ax.set_xscale("symlog", linthresh=least / 1e9)
    ax.set_xlabel("recomputed GFLOP per training step")
    ax.set_ylabel("temporaries of the loop's training step (MiB)")
    ax.set_title(f'remat="auto" for {self.length} steps')
    ax.legend(fontsize="small")
    return ax

  def _mark(self, k: RematCandidate) -> str:
    """A row's last cell in `table()`."""
    if k == self.choice:
      return "**chosen**"
    return ", ".join(
      text
      for over, text in (
        (k.temporaries > self.memory_budget, "over the budget"),
        (self.over_bound(k), f"over max_recompute={self.max_recompute:g}"),
      )
      if over
    )

  def _compact(self) -> tuple[RematCandidate, ...]:
    """The rows `table()` shows by default, in the candidates' order."""
    ks = self.candidates
    i = ks.index(self.choice) if self.choice in ks else 0
    least = min(range(len(ks)), key=lambda j: ks[j].temporaries)
    within = [j for j, k in enumerate(ks) if not self.over_bound(k)]
    least_within = min(within, key=lambda j: ks[j].temporaries, default=least)
    first = {i - 1, i, i + 1, least, least_within} | {
      j for j, k in enumerate(ks) if k.remat in (False, True)
    }
    compiled = [j for j, k in enumerate(ks) if k.compiled is not None and j not in first]
    rows = sorted(j for j in first if 0 <= j < len(ks))
    rows = sorted(rows + compiled[: max(0, COMPACT_ROWS - len(rows))])
    return tuple(ks[j] for j in rows)

  def __str__(self) -> str:
    """What `remat="auto"` chose and why, then `table()`."""
    return (
      f'remat="auto" for {self.length} steps chose '
      f"{self.choice.describe()}: {_mib(self.choice.temporaries)} MiB "
      "of training-step temporaries "
      f"({'predicted' if self.choice.compiled is None else 'compiled'}), within memory_budget="
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
    guess = measure.slot_guess(step)
    slots = _second_point(
      length,
      memory_budget,
      one.temporaries - guess,
      guess,
      measure.besides_tables(one.constants, length),
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
  # steps of any schedule that fits. From the most predicted to fit, down
  # to the first that fits where a count was compiled over its prediction.
  if c.scheduled is not None:
    most = _most_slots_within(length, memory_budget, *c.scheduled, c.constants[0])
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
  return RematPlan(
    length, memory_budget, tuple(candidates), affordable[0], max_recompute=max_recompute
  )


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
  slots = _second_point(c.length, memory_budget, a, guess, c.constants[0])
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
  length: int, memory_budget: int, a: float, per_slot: float, others: float
) -> Optional[int]:
  """The second schedule `_sloped` compiles: the most slots `memory_budget` holds on the first line.

  That line: temporaries `a` and `per_slot` bytes a slot (one slot's
  compiled, and the carry's bytes), each schedule's tables and the other
  constants `others` (`_most_slots_within`). Where the budget holds fewer
  than two, `measure.most_slots`; None for a loop of fewer than four steps
  (one slot is the most a schedule keeps).
  """
  most = measure.most_slots(length)
  if most < 2:
    return None
  fits = _most_slots_within(length, memory_budget, a, per_slot, others)
  return fits if fits >= 2 else most


def _most_slots_within(
  length: int, memory_budget: int, a: float, per_slot: float, others: float
) -> int:
  """The most slots, up to `measure.most_slots`, of a binomial schedule predicted within `memory_budget`; 0 where none is.

  Predicted as `measure.schedule_bytes` does: a + per_slot·s, the other
  constants `others` and the schedule's tables. The tables lose a row per
  slot added, and their lengths' column from
  `schedule.one_step_advances` on, so the bytes are linear in s on either
  side of that count but may fall across it (a 1000-step LSTM of 768-byte
  carries: 98,972 bytes compiled with 43 slots, 91,900 with 44): each
  side is searched apart, the upper first.

  >>> from haiku_bridge._src.remat import choice
  >>> choice._most_slots_within(1000, 40_000, 0.0, 100.0, 0.0)  # The tables: 35,280 with 44.
  47
  """
  most = measure.most_slots(length)
  fold = remat_schedule.one_step_advances(length)

  def fits(slots: int) -> bool:
    tables = remat_schedule.binomial_table_bytes(length, slots)
    return round(a + per_slot * slots + others + tables) <= memory_budget

  for low, high in ((fold, most), (1, min(most, fold - 1))):
    if low > high or not (fits(low) or fits(high)):
      continue  # Linear: neither end fits, nor anything between.
    if fits(high):
      return high
    while low < high:  # fits(low), not fits(high): the last that fits.
      mid = (low + high + 1) // 2
      low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low
  return 0


def _reaimed(
  length: int, memory_budget: int, one: float, others: float, second: tuple[int, float]
) -> int:
  """The most slots `memory_budget` holds on the line through one slot's temporaries `one` and the `second` schedule's (slots, temporaries), with each schedule's tables and the other constants `others`.

  Where a slot's bytes are not the carry's, the second schedule, placed on
  the carry's line, is not the count the budget holds: this one, placed
  on the line of a slot's bytes as compiled, is (to within the line's
  curve).

  >>> from haiku_bridge._src.remat import choice
  >>> choice._reaimed(64, 3000, 100, 0, (11, 400.0))  # 30 bytes a slot, 2,288 - 16·s of tables.
  45
  """
  slots, temporaries = second
  per_slot = (temporaries - one) / (slots - 1)
  return _second_point(length, memory_budget, one - per_slot, per_slot, others) or 1


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
