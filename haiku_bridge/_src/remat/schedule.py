"""Remat schedules: which carries a scan's backward pass keeps, and what it recomputes.

Reversing a scan of N steps needs the carry entering each step, last to
first. `jax.checkpoint` on the scan body stores all N of them, so memory grows
linearly with depth. A schedule stores a few carries in numbered *slots* and
recomputes the others from them:

* `nested(n, groups)`: the steps in groups (≈√N of ≈√N steps; the last group
  may be shorter). The forward sweep keeps each group's first carry; the
  backward sweep recomputes one group at a time, keeping its carries. About
  2√N carries; each step's carry is recomputed at most once.
* `binomial(n, slots)`: treeverse / revolve (Griewank 1992): with a fixed
  number of slots, the split points that recompute the fewest steps, from
  Griewank's closed-form cost (the binomial bound).

A schedule is plain data: the slot each carry of the forward sweep goes to,
then the backward sweep's actions in order, each a run of advances (from one
carry, through consecutive steps) or one backpropagated step. Reversing N
steps cuts them N - 1 times, and each cut is one run, so a schedule holds at
most 2N actions however many steps it recomputes (with one slot, N²/2): it
is built in O(N) time and memory, and compiled in as `table_bytes` of
constants. `simulate` replays it on step numbers and checks that every step
is backpropagated once, last to first, from its own carry.
`scheduled_scan.scan` runs it.
"""

import bisect
import dataclasses
import math
from typing import Callable, NamedTuple, Optional

import numpy as np


# What an action does.
ADVANCE = 0  # Run steps from a carry; the last result goes to the register.
BACKPROP = 1  # Backpropagate through one step, from the carry entering it.

# Action.load: read the carry from the register (the last ADVANCE's result).
REGISTER = -1
# Action.store / Schedule.forward_stores: keep the carry in no slot.
NOWHERE = -1


class Action(NamedTuple):
  """One action of the backward sweep.

  An ADVANCE runs `length` steps, `step` to `step + length - 1`, the first
  from the carry in `load`, each later one from the result before it (the
  register); `store` keeps the last one's result too. A BACKPROP
  backpropagates through `step` (its `length` is 1).
  """

  kind: int  # ADVANCE or BACKPROP.
  step: int  # Which step, 0 being the first the forward sweep runs.
  load: int  # The slot holding the carry entering `step`, or REGISTER.
  store: int  # ADVANCE only: a slot that keeps the result too, or NOWHERE.
  length: int = 1  # ADVANCE only: how many steps it runs.


@dataclasses.dataclass(frozen=True)
class Schedule:
  """How to reverse `num_steps` steps keeping at most `num_slots` carries.

  The forward sweep runs every step, keeping the carry entering step `t` in
  slot `forward_stores[t]` (or nowhere); when it ends, the register holds the
  carry entering the last step. The backward sweep then runs `actions`:
  fewer than 2·`num_steps` of them (each cut of the steps is one ADVANCE,
  each step one BACKPROP), however many steps they recompute.
  """

  num_steps: int
  num_slots: int
  forward_stores: tuple[int, ...]
  actions: tuple[Action, ...]

  @property
  def recomputed_steps(self) -> int:
    """Steps the backward sweep runs again to rebuild carries."""
    return sum(a.length for a in self.actions if a.kind == ADVANCE)

  @property
  def table_bytes(self) -> int:
    """Bytes of the schedule as a program's constants (`scheduled_scan.scan`).

    One int32 per step (`forward_stores`) and one per action in each of
    five columns (kind, step, length, the slots read and written), fewer
    than 44·`num_steps` bytes in all; but a column of one value is held as
    that value: the lengths where every ADVANCE runs one step (binomial
    with C(s + 2, 2) ≥ N: `binomial_table_bytes`), and the kinds too where
    there is no ADVANCE (every carry kept, where XLA:CPU may fold more:
    to 800 of these 3,200 bytes at 200 steps with 199 slots).
    """
    advances = [a.length for a in self.actions if a.kind == ADVANCE]
    columns = 5 - (max(advances, default=1) == 1) - (not advances)
    return 4 * (self.num_steps + columns * len(self.actions))

  def one_step_actions(self) -> tuple[Action, ...]:
    """`actions` with each ADVANCE of several steps split into one per step.

    As long as the steps recomputed and backpropagated (quadratic in the
    steps with one slot): for reading and checking small schedules.
    """
    out = []
    for a in self.actions:
      if a.kind == BACKPROP or a.length == 1:
        out.append(a)
        continue
      out.append(Action(ADVANCE, a.step, a.load, NOWHERE))
      out.extend(
        Action(ADVANCE, t, REGISTER, NOWHERE) for t in range(a.step + 1, a.step + a.length - 1)
      )
      out.append(Action(ADVANCE, a.step + a.length - 1, REGISTER, a.store))
    return tuple(out)


# split(first, end, free_slots) -> where to cut the steps [first, end): the
# carry entering the cut is kept (in a slot, or in the register when only one
# step follows it), the steps after the cut are reversed first, then those
# before it. first < cut < end.
SplitRule = Callable[[int, int, float], int]


def nested(num_steps: int, groups: Optional[int] = None) -> Schedule:
  """Two levels: `groups` groups of consecutive steps, each group's steps.

  The forward sweep keeps the carry entering each group; the backward sweep
  takes the groups last to first, recomputes one group's carries from its
  first and keeps them all. Groups hold ⌈num_steps / groups⌉ steps, the last
  one what remains. By default ≈√num_steps groups, which keeps the fewest
  carries (about 2√num_steps).
  """
  num_steps = _positive("num_steps", num_steps)
  if groups is None:
    size = math.isqrt(num_steps - 1) + 1 if num_steps > 1 else 1  # ⌈√n⌉.
  else:
    size = -(-num_steps // _positive("groups", groups))

  def split(first, end, free):
    del free  # Unbounded: a slot per group, and per step of one group.
    return first + size if end - first > size else first + 1

  return _schedule(num_steps, split, math.inf)


def binomial(num_steps: int, slots: int) -> Schedule:
  """Treeverse with `slots` slots: the fewest recomputed steps for that memory.

  The carry entering the first step takes one slot, so `slots=1` recomputes
  every carry from it (quadratic); with more slots, each split point is the
  first that minimises Griewank's closed-form cost (`binomial_cost`), found
  from the binomial bound in O(log N) binomials: the schedule is built in
  about O(N log N) time and holds at most 2N actions, whatever the slots.

  1000 steps with 10 slots, replayed, against Griewank's bound: r is the
  fewest advances of any one step with C(10 + r, r) ≥ 1000, and reversing
  costs r·1000 − C(10 + r, 11) advances, the forward sweep's 999 included:

  >>> import math
  >>> from haiku_bridge._src.remat import schedule as remat_schedule
  >>> schedule = remat_schedule.binomial(1000, slots=10)
  >>> remat_schedule.simulate(schedule)  # Raises if a step got a wrong carry.
  >>> schedule.num_slots, schedule.recomputed_steps
  (10, 2637)
  >>> r = 4
  >>> math.comb(10 + r - 1, r - 1) < 1000 <= math.comb(10 + r, r)
  True
  >>> r * 1000 - math.comb(10 + r, 11) - 999
  2637
  """
  num_steps = _positive("num_steps", num_steps)
  free = _positive("slots", slots) - 1

  def split(first, end, free):
    return first + _best_cut(end - first, int(free))

  return _schedule(num_steps, split, free)


def binomial_cost(num_steps: int, slots: int) -> int:
  """`binomial(num_steps, slots).recomputed_steps`, in closed form."""
  num_steps = _positive("num_steps", num_steps)
  # The closed form counts the first sweep's num_steps - 1 advances too.
  return _advances(num_steps, _positive("slots", slots)) - (num_steps - 1)


def binomial_table_bytes(num_steps: int, slots: int) -> int:
  """`binomial(num_steps, slots).table_bytes`, in closed form (a plan predicts every count of slots).

  A BACKPROP per step and an ADVANCE per cut but the s - 1 the forward
  sweep makes, 2·N - 1 - s actions (N with N - 1 slots or more: every
  carry kept, no ADVANCE); every ADVANCE runs one step where each step
  runs at most twice, C(s + 2, 2) ≥ N (Griewank's bound, r ≤ 2), and the
  lengths' column is then folded.

  >>> from haiku_bridge._src.remat import schedule as remat_schedule
  >>> [remat_schedule.binomial_table_bytes(1000, s) for s in (43, 44)]
  [43120, 35280]
  >>> remat_schedule.binomial(1000, 44).table_bytes
  35280
  """
  num_steps = _positive("num_steps", num_steps)
  kept = min(_positive("slots", slots), num_steps - 1)  # Past N - 1, as many.
  no_advance = kept == num_steps - 1
  columns = 5 - (no_advance or kept >= one_step_advances(num_steps)) - no_advance
  return 4 * (num_steps + columns * (2 * num_steps - 1 - kept))


def one_step_advances(num_steps: int) -> int:
  """The fewest slots with which every ADVANCE of `binomial(num_steps, slots)` runs one step.

  Where each step runs at most twice (once in the forward sweep):
  Griewank's bound C(s + 2, 2) ≥ N. From there on a binomial schedule's
  tables lose their lengths' column (`binomial_table_bytes`).

  >>> from haiku_bridge._src.remat import schedule as remat_schedule
  >>> remat_schedule.one_step_advances(1000)
  44
  >>> {a.length for a in remat_schedule.binomial(1000, 44).actions}
  {1}
  """
  return _fewest(lambda s: _reach(s, 2) >= _positive("num_steps", num_steps))


def fewest_binomial_slots(num_steps: int, max_recomputed: int) -> int:
  """The fewest slots whose binomial schedule recomputes ≤ `max_recomputed` steps.

  The cost falls as slots are added (`num_steps` slots recompute nothing), so
  the answer is found by bisection. What `remat="binomial"` keeps for 1024
  steps (at most one more forward pass), where `nested(1024)` keeps 62:

  >>> from haiku_bridge._src.remat import schedule as remat_schedule
  >>> remat_schedule.fewest_binomial_slots(1024, max_recomputed=1023)
  43
  >>> [remat_schedule.binomial_cost(1024, slots) for slots in (43, 42)]
  [1014, 1059]
  """
  num_steps = _positive("num_steps", num_steps)
  within = lambda slots: binomial_cost(num_steps, slots) <= max_recomputed
  return 1 + bisect.bisect_left(range(1, num_steps), True, key=within)


def _reach(snapshots: int, repetitions: int) -> int:
  """C(snapshots + r, r): the most steps reversible advancing each ≤ r times.

  Griewank's binomial bound (β(s, r) in his notation).
  """
  return math.comb(snapshots + repetitions, repetitions)


def _fewest(ok: Callable[[int], bool]) -> int:
  """The least k ≥ 1 with `ok(k)`, for `ok` false then true as k grows."""
  high = 1
  while not ok(high):
    high *= 2
  low = high // 2 + 1
  return low + bisect.bisect_left(range(low, high), True, key=ok)


def _repetitions(num_steps: int, snapshots: int) -> int:
  """r: the fewest times any step runs, C(snapshots + r, r) ≥ num_steps.

  Griewank's binomial bound: with s snapshots and each step advanced at most r
  times, at most C(s + r, s) steps can be reversed. Found in O(log r)
  binomials, however few the snapshots.
  """
  if num_steps <= 1:
    return 0
  if snapshots == 1:
    return num_steps - 1
  return _fewest(lambda r: _reach(snapshots, r) >= num_steps)


def _advances(num_steps: int, snapshots: int) -> int:
  """Fewest advances that reverse `num_steps` steps with `snapshots` carries kept.

  One snapshot holds the carry entering the first step. Griewank (1992):
  r·n − C(s + r, s + 1), r = `_repetitions(n, s)`; it counts the n − 1
  advances of the first sweep too. Piecewise linear and convex in n: going
  from n − 1 to n steps adds exactly `_repetitions(n, s)` advances.
  """
  if num_steps <= 1:
    return 0
  r = _repetitions(num_steps, snapshots)
  return r * num_steps - math.comb(snapshots + r, snapshots + 1)


def _best_cut(size: int, free: int) -> int:
  """Where to cut `size` steps with `free` free slots: the fewest advances.

  Cutting at c costs c advances, then reversing the size − c steps after the
  cut with `free` snapshots (one slot fewer, and the cut's), then the c
  before it with free + 1: cost(c) = c + A(size − c, free) + A(c, free + 1),
  A = `_advances`. Its forward difference is 1 − r(size − c, free) +
  r(c + 1, free + 1) (r = `_repetitions`), rising with c, and the cut is
  the least c where it is ≥ 0 (else the last, size − 1). Where r(c + 1,
  free + 1) = k, that is c ≥ size − C(free + k + 1, k + 1), and those c
  run from C(free + k, k − 1) to C(free + 1 + k, k) − 1: the least k whose
  run reaches that far gives the cut, in O(log k) binomials.
  """
  if free == 0:
    return size - 1  # Only the register: the step before the last.
  before, after = free + 1, free  # Snapshots either side of the cut.

  def reaches(k):
    return size - _reach(after, k + 1) <= _reach(before, k) - 1

  k = _fewest(reaches)
  return min(max(_reach(before, k - 1), size - _reach(after, k + 1)), size - 1)


@dataclasses.dataclass
class _Span:
  """Steps [first, end) still to reverse, from the carry in `slot`."""

  first: int
  end: int
  slot: int
  free: float  # Slots free for the steps after a cut.


def _schedule(num_steps: int, split: SplitRule, free: float) -> Schedule:
  """The schedule that reverses all steps by `split`, the first carry in slot 0.

  Reversing the steps after a cut nests inside reversing those before it, as
  deep as slots are in use at once (up to `num_steps` of them), so the nesting
  is an explicit stack of `_Span`s rather than Python's call stack.
  """
  actions: list[Action] = []
  num_slots = 1
  # Spans end last in, first out, so the slots in use are always 0..k-1 for
  # k spans on the stack: a span's slot is its place on the stack.
  spans = [_Span(0, num_steps, 0, free)]
  while spans:
    span = spans[-1]  # The carry entering `span.first` is in `span.slot`.
    if span.end - span.first > 1:
      cut = split(span.first, span.end, span.free)
      assert span.first < cut < span.end, (span, cut)
      keep = len(spans) if span.end - cut > 1 else NOWHERE
      actions.append(Action(ADVANCE, span.first, span.slot, keep, cut - span.first))
      if keep == NOWHERE:
        actions.append(Action(BACKPROP, cut, REGISTER, NOWHERE))
      else:  # The steps after the cut first, then (below) those before it.
        spans.append(_Span(cut, span.end, keep, span.free - 1))
        num_slots = max(num_slots, len(spans))
      span.end = cut
    else:
      actions.append(Action(BACKPROP, span.first, span.slot, NOWHERE))
      spans.pop()

  # The actions up to the first BACKPROP advance through steps 0..n-2: the
  # forward sweep runs them anyway, so it keeps what they would keep.
  lead = next(i for i, a in enumerate(actions) if a.kind == BACKPROP)
  assert sum(a.length for a in actions[:lead]) == num_steps - 1 and all(
    a.step == b.step + b.length for a, b in zip(actions[1:lead], actions[:lead])
  ), actions[: lead + 1]
  forward_stores = [NOWHERE] * num_steps
  forward_stores[0] = 0
  for a in actions[:lead]:
    if a.store != NOWHERE:
      forward_stores[a.step + a.length] = a.store
  return Schedule(num_steps, num_slots, tuple(forward_stores), tuple(actions[lead:]))


def simulate(schedule: Schedule) -> None:
  """Runs `schedule` on step numbers; raises if a step would get a wrong carry.

  Checks that the backward sweep backpropagates every step exactly once,
  last to first, each from the carry entering it, and that every slot it
  names exists and holds that carry. Takes time in the actions, not in the
  steps they run.
  """
  slots: dict[int, int] = {}  # slot -> the step whose entering carry it holds.
  for t, slot in enumerate(schedule.forward_stores):
    if slot != NOWHERE:
      _check_slot(schedule, slot)
      slots[slot] = t
  register = schedule.num_steps - 1
  due = schedule.num_steps - 1
  for i, a in enumerate(schedule.actions):
    carry = register if a.load == REGISTER else slots.get(a.load)
    if carry != a.step:
      raise ValueError(f"action {i} {a}: step {a.step} would get the carry entering step {carry}.")
    if a.kind == ADVANCE:
      if not 1 <= a.length <= schedule.num_steps - a.step:
        raise ValueError(
          f"action {i} {a}: advances {a.length} steps from step {a.step} of {schedule.num_steps}."
        )
      register = a.step + a.length
      if a.store != NOWHERE:
        _check_slot(schedule, a.store)
        slots[a.store] = register
    elif a.kind != BACKPROP or a.length != 1:
      raise ValueError(f"action {i} {a}: neither an ADVANCE nor a BACKPROP of one step.")
    elif a.step != due:
      raise ValueError(f"action {i} {a}: step {a.step} backpropagated where step {due} is due.")
    else:
      due -= 1
  if due != -1:
    raise ValueError(f"steps 0..{due} are never backpropagated.")


def _check_slot(schedule: Schedule, slot: int) -> None:
  if not 0 <= slot < schedule.num_slots:
    raise ValueError(f"slot {slot} outside 0..{schedule.num_slots - 1}.")


def _positive(name: str, value: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(f"{name} must be a positive int; got {value!r}.")
  return int(value)
