"""`remat="auto"`: the plan with the least recomputation whose memory fits a budget.

A scan's backward pass can keep every step's activations (`remat=False`),
one carry per step (`remat=True`), what a `remat_policy` saves of each step
(`remat=True` with the policy the user gives), or a schedule's few carries
(`"nested"`, `"binomial"`: `remat_schedule.py`), each trading recomputed
FLOPs for memory. Which one fits depends on things a user cannot see: how
the step's activations compare with its carry, the length, where the loss
sits. `plan` predicts, for every candidate, the temporaries a training step
of the loop needs and the FLOPs it recomputes, and chooses.

The model (README, "Choosing remat"): the loop's training-step
temporaries (what its backward pass keeps, its outputs and their
cotangents, its working memory; not the params, nor the rest of the step)
grow linearly with the steps and with the slots a schedule keeps:

    remat=False:            a₀ + b₀·T
    remat=True:             a₁ + b₁·T
    remat=True, policy p:   a₃ + b₃·T
    binomial with s slots:  a₂ + b₂·T + c₂·s   (nested: s = its slots)

The coefficients are measured, not guessed: XLA keeps, fuses and
rematerialises a step's residuals its own way, so a₀, b₀, a₁, b₁, a₂ and
b₂ come from compiling the gradient of the loop itself (a loss of its
outputs, as a training step has) at two lengths, L and L/2 with
L = min(T, 128): 6 compiles of a short loop, whatever T is (8 with a
policy). c₂ is the carry's bytes: a schedule's slots are stacked carries.

Recomputed FLOPs come from the same compiles, counted with every loop by
its trip count (`hlo_flops.py`): r, one step's recomputation under
`jax.checkpoint` (what its backward pass needs), is the FLOPs per step of
`remat=True` less those of `remat=False` (the slopes between L/2 and L),
and likewise under the policy; f, one advance of a schedule (a whole
step's forward, for the carry), is the cheaper branch of the schedule's
conditional in its compile. `remat=True` recomputes T·r, the policy its
own part of each step, a schedule T·r and f for each step it advances to
rebuild carries (`remat_schedule.binomial_cost`,
`Schedule.recomputed_steps`); `False` none. The choice is the candidate
with the least recomputed FLOPs whose temporaries fit (then the fewest
recomputed steps, then the least memory), among those that recompute at
most `max_recompute` forward passes of the loop (`MAX_RECOMPUTE`, 3, by
default: see `choose`).

The coefficients are cached on the step's jaxpr (its text: every shape,
dtype and operation), the policy, L and the backend; the choice follows
from them, the length and the budget, so it is the same for the same
shapes, policy and budget.
The step is planned on the shapes the loop sees, compiled for one
device: inside `jax.vmap` those are one example's (the prediction is per
example), and a sharded step is planned unsharded.

What users see: `remat_plan` (public) returns the `RematPlan` of a JAX step,
or of one of the bridge's loops (`plannable`) with its arguments, which it
runs until the loop has made its plan (`Planned` carries it out, the loop
not run); every plan a loop makes passes `loop_plan`, which logs it at
INFO on the `haiku_bridge.remat` logger.
"""

import contextlib
import contextvars
import functools
import logging
import math
from typing import Any, Callable, ContextManager, NamedTuple, Optional, TypeVar

import haiku as hk
import jax
from jax._src import config as jax_config  # pylint: disable=g-bad-import-order
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import caches
from haiku_bridge._src import errors
from haiku_bridge._src import guards
from haiku_bridge._src import hlo_flops
from haiku_bridge._src import modes
from haiku_bridge._src import remat_schedule
from haiku_bridge._src import scheduled_scan
from haiku_bridge._src.pytree import PyTree

# The longest length the coefficients are measured at, and the slots a
# schedule is measured with. XLA places a loop's small stacked buffers
# differently from its large ones (measured: an LSTM step's per-step
# temporaries are 1536 bytes up to 32 steps, 2048 from 64 on), so the
# slope is measured where it holds for long loops.
_LONGEST = 128
_SLOTS = 2

# The most forward passes of the loop a plan may recompute unless the caller
# allows more (`max_recompute=`): remat=True's one and two more. A training
# step runs about three passes' worth (the backward pass about two), so
# this keeps a plan's step within about twice no remat's compute. Binomial
# schedules within it keep about (6·T)^(1/3) slots (44 at 16384 steps,
# where one pass fewer takes 179); with fewer, the recomputation grows
# fast (one slot: about T/2 passes).
MAX_RECOMPUTE = 3.0


class RematCandidate(NamedTuple):
  """One way to run a loop, with its predicted cost: a row of `RematPlan`.

  Attributes:
    remat: `False`, `True`, `"nested"` or `"binomial"`, as `remat=` takes it.
    slots: the carries a schedule keeps (None without one).
    groups: `remat_groups` of `"nested"` (None otherwise).
    temporaries: predicted bytes of temporaries of a training step of the
      loop (what the backward pass keeps, and its working memory).
    recomputed_steps: the steps whose forward the backward pass runs
      again (in whole or, under a policy, in part): T for `remat=True`, T
      and the advances that rebuild carries for a schedule.
    recomputed_flops: predicted FLOPs of that recomputation.
    policy: with `remat=True`, the `remat_policy` it runs under, by
      `policy_name` (None: no policy).
  """
  remat: modes.RematMode
  slots: Optional[int]
  groups: Optional[int]
  temporaries: int
  recomputed_steps: int
  recomputed_flops: int
  policy: Optional[str] = None

  def describe(self) -> str:
    """The candidate as one phrase: `remat="binomial", 12 slots`."""
    remat = (f'remat="{self.remat}"' if isinstance(self.remat, str)
             else f"remat={self.remat}")
    return remat + "".join(
        f", {text}" for value, text in (
            (self.slots, f"{self.slots} slots"),
            (self.groups, f"remat_groups={self.groups}"),
            (self.policy, f"remat_policy={self.policy}")) if value is not None)


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
  """
  length: int
  memory_budget: int
  candidates: tuple[RematCandidate, ...]
  choice: RematCandidate

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
    rows = ["| remat | slots | groups | temporaries (MiB) | recomputed steps "
            "| recomputed GFLOP | |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for k in self.candidates:
      note = ("**chosen**" if k == self.choice else "over the budget"
              if k.temporaries > self.memory_budget else "")
      remat = f"{k.remat}" + ("" if k.policy is None else
                              f", policy {k.policy}")
      rows.append(f"| {remat} | {'' if k.slots is None else k.slots} | "
                  f"{'' if k.groups is None else k.groups} | "
                  f"{_mib(k.temporaries)} | {k.recomputed_steps} | "
                  f"{_readable(k.recomputed_flops / 1e9)} | {note} |")
    return "\n".join(rows)

  def __str__(self) -> str:
    """What `remat="auto"` chose and why, then `table()`."""
    return (f'remat="auto" for {self.length} steps chose '
            f"{self.choice.describe()}: {_mib(self.choice.temporaries)} MiB "
            "of training-step temporaries (predicted), within memory_budget="
            f"{self.memory_budget} bytes ({_mib(self.memory_budget)} MiB; the "
            f"least any plan needs: {self.least_budget} bytes, "
            f"{_mib(self.least_budget)} MiB), "
            f"{self.choice.recomputed_steps} steps and "
            f"{_readable(self.choice.recomputed_flops / 1e9)} GFLOP "
            f"recomputed.\n{self.table()}")


# The names these classes had before they were public (`remat_plan.Plan`,
# `remat_plan.Candidate`), for code written against them.
Plan = RematPlan
Candidate = RematCandidate


def _readable(x: float) -> str:
  """`x` to 4 significant digits, without an exponent: 0.1907, 1235, 12350."""
  return np.format_float_positional(x, precision=4, unique=True,
                                    fractional=False, trim="-")


def _mib(num_bytes: float) -> str:
  return _readable(num_bytes / 2**20)


class Coefficients(NamedTuple):
  """The model's measured coefficients (see the module docstring)."""
  plain: tuple[float, float]  # a₀, b₀ (bytes).
  per_step: tuple[float, float]  # a₁, b₁.
  scheduled: tuple[float, float, float]  # a₂, b₂, c₂.
  step_flops: float  # r: one step's recomputation under jax.checkpoint.
  advance_flops: float  # f: one advance of a schedule.
  # With a policy: its name, a₃, b₃ and one step's recomputation under it.
  policy: Optional[tuple[str, float, float, float]] = None


def remat_plan(f: Callable[..., Any], *args: Any, memory_budget: int,
               remat_policy: Optional[Callable[..., bool]] = None,
               max_recompute: Optional[float] = None,
               **options: Any) -> RematPlan:
  """The plan `remat="auto"` makes: for `jax.lax.scan(f, init, xs)`, or for a loop of the bridge.

  The candidates (no remat, per-step remat, per-step remat under
  `remat_policy` if given, nested with a few numbers of groups, binomial
  with numbers of slots from 1 to the most the budget holds) with their
  predicted training-step temporaries and recomputed steps and FLOPs, and
  the choice: the least recomputed FLOPs whose prediction fits
  `memory_budget`. A step over 512 steps, under a budget that per-step
  remat does not fit:

  >>> def step(h, x):
  ...   h = jnp.tanh(h @ jnp.eye(16) + x)
  ...   return h, jnp.sum(h ** 2)
  >>> xs = jnp.ones([512, 4, 16])
  >>> plan = hkb.remat_plan(step, jnp.zeros([4, 16]), xs,
  ...                       memory_budget=100_000)
  >>> [(c.remat, c.recomputed_steps) for c in plan.candidates[:2]]
  [(False, 0), (True, 512)]
  >>> plan.choice.remat, plan.choice.temporaries <= 100_000
  ('binomial', True)
  >>> plan.choice.recomputed_steps < 2 * 512  # Less than one more pass.
  True
  >>> plan.least_budget <= plan.choice.temporaries  # Bytes.
  True

  A Haiku layer, core or step: pass its loop (`hkb.layer_scan`,
  `hkb.repeat_layer`, `hkb.scan` or `hkb.dynamic_unroll`) and the loop's
  arguments, where the loop would run (at apply, inside the transform, with
  the model's params): the plan is the one the loop makes with
  `remat="auto"` there, by the same path, and the loop does not run:

  >>> def net(xs, plan=False):
  ...   lstm = hk.LSTM(32)
  ...   unroll = (lstm, xs, lstm.initial_state(4))
  ...   if plan:
  ...     return hkb.remat_plan(hkb.dynamic_unroll, *unroll,
  ...                           memory_budget=1_500_000)
  ...   ys, _ = hkb.dynamic_unroll(*unroll, remat="auto",
  ...                              memory_budget=1_500_000)
  ...   return jnp.sum(ys ** 2)
  >>> net = hk.transform(net)
  >>> xs = jnp.ones([1024, 4, 8])
  >>> params = net.init(jax.random.PRNGKey(0), xs)
  >>> plan = net.apply(params, None, xs, plan=True)
  >>> plan.length, plan.choice.remat
  (1024, 'binomial')

  Args:
    f: `f(carry, x) -> (carry, y)`, a JAX function, planned as
      `jax.lax.scan` runs it; or one of the bridge's loops (`hkb.scan`,
      `hkb.dynamic_unroll`, `hkb.layer_scan`, `hkb.repeat_layer`, or a
      `functools.partial` of one), planned as it runs with `remat="auto"`.
    *args: for a function `f`: `init` (the first carry) and `xs` (per-step
      inputs, each leaf with a leading axis of `length` steps); for a
      loop, its positional arguments.
    memory_budget: bytes the loop's training-step temporaries may take.
    remat_policy: a `jax.checkpoint_policies` policy: per-step remat under
      it is a candidate too (as `remat="auto", remat_policy=` weighs it).
    max_recompute: the most forward passes of the loop the backward pass
      may run again (recomputed steps over `length`; `remat=True` runs 1):
      a plan over it is never chosen. None: 3 (remat=True's pass and two
      more); `math.inf` allows any.
    **options: for a function `f`: `length`, the number of steps (taken
      from `xs` when not given); for a loop, its keyword arguments other
      than `remat` (e.g. `num_layers=`, `time_major=`, `readout=`).

  Returns:
    A `RematPlan`.

  Raises:
    ValueError: if no candidate fits `memory_budget`, naming the least any
      candidate needs; or if every one that fits recomputes more than
      `max_recompute` allows, naming what it recomputes and the least
      budget within `max_recompute`; for a loop, at init (where loops plan
      nothing), or if the loop plans nothing (no steps).
  """
  with errors.entry("remat_plan"):
    errors.check_callable("f", f, "a function `f(carry, x) -> (carry, y)`, "
                          "or one of the bridge's loops (hkb.dynamic_unroll, "
                          "...)")
    memory_budget = check_budget(memory_budget)
    max_recompute = check_max_recompute(max_recompute)
    if remat_policy is not None:
      errors.check_callable("remat_policy", remat_policy,
                            "None or a jax.checkpoint_policies policy")
    if _loop_of(f) is not None:
      return _plan_of_loop(f, args, options, memory_budget, remat_policy,
                           max_recompute)
    try:
      init, xs, length = _scan_arguments(*args, **options)
    except TypeError:
      raise TypeError(errors.message(
          "for a function `f`, takes `(f, init, xs, *, memory_budget, "
          f"length=None, remat_policy=None, max_recompute=None)`; got {len(args)} positional "
          f"arguments after `f` and the keywords {sorted(options)}. For a "
          "Haiku layer, core or step, pass its loop first: e.g. "
          "hkb.remat_plan(hkb.dynamic_unroll, core, xs, state, "
          "memory_budget=...).")) from None
    leaves = jax.tree_util.tree_leaves_with_path(xs)
    if length is None:
      if not leaves or not np.ndim(leaves[0][1]):
        raise ValueError(errors.message(
            "xs holds no arrays with a leading time axis, so the number of "
            "steps is unknown: pass `length=`."))
      length = int(np.shape(leaves[0][1])[0])
    length = errors.check_positive_int("length", length)
    for path, leaf in leaves:
      if not np.ndim(leaf) or np.shape(leaf)[0] != length:
        raise ValueError(errors.message(
            f"xs{jax.tree_util.keystr(path)} has shape {np.shape(leaf)}, but "
            f"every leaf of xs needs a leading axis of {length} steps."))
    return plan(f, init, xs, length, memory_budget, remat_policy,
                max_recompute)


def _scan_arguments(init: PyTree, xs: PyTree, *,
                    length: Optional[int] = None) -> tuple[Any, Any, Any]:
  return init, xs, length


# The bridge's public loops, which take `remat="auto"` (`plannable`).
_LOOPS: set[Callable[..., Any]] = set()

_F = TypeVar("_F", bound=Callable[..., Any])


def plannable(loop: _F) -> _F:
  """Marks a public loop that takes `remat="auto"`: `remat_plan(loop, ...)` plans it."""
  _LOOPS.add(loop)
  return loop


def _loop_of(f: Any) -> Optional[Callable[..., Any]]:
  """The bridge's loop `f` is, or is a `functools.partial` of; else None."""
  while isinstance(f, functools.partial):
    f = f.func
  return f if f in _LOOPS else None


class Planned(Exception):
  """Carries a loop's plan out of the loop, before it runs, to `remat_plan(loop, ...)`.

  A loop that holds something it must close (Haiku's lift updater) closes
  it when this passes.
  """

  def __init__(self, made: RematPlan):
    super().__init__("a remat plan, on its way to hkb.remat_plan")
    self.plan = made


# Whether `remat_plan(loop, ...)` is waiting for the loop's plan.
_WANTED = contextvars.ContextVar("remat_plan.wanted", default=False)
# Where each plan a loop makes is logged, at INFO.
LOG = logging.getLogger("haiku_bridge.remat")


def _plan_of_loop(loop: Callable[..., Any], args: tuple[Any, ...],
                  options: dict[str, Any], memory_budget: int,
                  policy: Optional[Callable[..., bool]],
                  max_recompute: float) -> RematPlan:
  """The plan `loop(*args, remat="auto", **options)` makes, the loop not run."""
  name = getattr(_loop_of(loop), "__name__", "the loop")
  if "remat" in options:
    raise ValueError(errors.message(
        f"plans hkb.{name} with `remat=\"auto\"`: pass the loop's arguments "
        f"without `remat=` (got remat={options['remat']!r})."))
  if guards.inside_transform() and hk.running_init():
    raise ValueError(errors.message(
        f"plans hkb.{name} at apply, where its params exist: at init "
        "(hk.transform(f).init) a loop runs no backward pass and plans "
        "nothing. Call it in a function you apply with the model's params."))
  token = _WANTED.set(True)
  try:
    loop(*args, remat="auto", memory_budget=memory_budget,
         remat_policy=policy, max_recompute=max_recompute, **options)
  except Planned as planned:
    return planned.plan
  finally:
    _WANTED.reset(token)
  raise ValueError(errors.message(
      f"hkb.{name} made no plan: it ran no loop with steps to plan."))


def loop_plan(f: Callable[..., Any], init: PyTree, xs: PyTree, length: int,
              memory_budget: int,
              policy: Optional[Callable[..., bool]] = None,
              max_recompute: float = MAX_RECOMPUTE) -> RematPlan:
  """The plan a loop's `remat="auto"` runs (`Loop.planned`), logged.

  Every plan a loop makes passes here: it is logged at INFO on the
  `haiku_bridge.remat` logger (`str(plan)`: the choice and the table), and
  under `remat_plan(loop, ...)` it goes to that call instead of running.
  """
  # A loop inside this one's step plans for itself, unasked.
  token = _WANTED.set(False)
  try:
    made = plan(f, init, xs, length, memory_budget, policy, max_recompute)
  finally:
    _WANTED.reset(token)
  LOG.info("%s", made)
  if _WANTED.get():
    raise Planned(made)
  return made


def check_budget(memory_budget: Any) -> int:
  """`memory_budget`, a positive int of bytes."""
  if not errors.is_int(memory_budget) or memory_budget <= 0:
    raise (ValueError if errors.is_int(memory_budget) else TypeError)(
        errors.bad_argument("memory_budget", memory_budget,
                            "a positive int, in bytes"))
  return int(memory_budget)


def check_max_recompute(max_recompute: Any) -> float:
  """`max_recompute`, a number ≥ 0 of forward passes; None: `MAX_RECOMPUTE`."""
  if max_recompute is None:
    return MAX_RECOMPUTE
  number = (isinstance(max_recompute, (int, float, np.integer, np.floating))
            and not isinstance(max_recompute, (bool, np.bool_)))
  if not number or not max_recompute >= 0:
    raise (ValueError if number else TypeError)(errors.bad_argument(
        "max_recompute", max_recompute,
        "a number ≥ 0: the forward passes of the loop its backward pass may "
        "run again (remat=True runs 1; math.inf allows any)"))
  return float(max_recompute)


def plan(f: Callable[..., Any], init: PyTree, xs: PyTree, length: int,
         memory_budget: int, policy: Optional[Callable[..., bool]] = None,
         max_recompute: float = MAX_RECOMPUTE) -> RematPlan:
  """`remat_plan` of checked arguments (the loop's `remat="auto"`)."""
  step, consts = _trace(f, init, xs, length)
  return choose(coefficients(step, consts, length, policy), length,
                memory_budget, max_recompute)


def choose(c: Coefficients, length: int, memory_budget: int,
           max_recompute: float = MAX_RECOMPUTE) -> RematPlan:
  """The plan the coefficients predict for `length` steps and the budget.

  Never one that recomputes more than `max_recompute` forward passes of the
  loop: where every plan that fits the budget does, the error says what the
  budget costs and the least budget within `max_recompute`.
  """
  candidates = _candidates(c, length)
  # Binomial with the most slots the budget holds: the fewest recomputed
  # steps of any schedule that fits (each slot costs the same).
  a, b, per_slot = c.scheduled
  most = int((memory_budget - a - b * length) // max(per_slot, 1.0))
  if 1 <= most < length and not any(
      k.remat == "binomial" and k.slots == most for k in candidates):
    candidates.append(_binomial(c, length, most))
  candidates.sort(key=lambda k: (k.recomputed_flops, k.recomputed_steps,
                                 k.temporaries))
  fitting = [k for k in candidates if k.temporaries <= memory_budget]
  if not fitting:
    least = min(k.temporaries for k in candidates)
    raise ValueError(errors.message(
        f"no remat plan for {length} steps fits memory_budget="
        f"{memory_budget} bytes: the least any needs is {least} bytes "
        "(predicted). Raise the budget, or shorten the scan."))
  affordable = [k for k in fitting
                if k.recomputed_steps <= max_recompute * length]
  if not affordable:
    _raise_over_recompute(c, candidates, fitting, length, memory_budget,
                          max_recompute)
  return RematPlan(length, memory_budget, tuple(candidates), affordable[0])


def _raise_over_recompute(c: Coefficients, candidates: list[RematCandidate],
                          fitting: list[RematCandidate], length: int,
                          memory_budget: int, max_recompute: float) -> None:
  """The error where every plan that fits recomputes over `max_recompute`."""
  fewest = min(k.recomputed_steps for k in fitting)
  within = [k for k in candidates
            if k.recomputed_steps <= max_recompute * length]
  spare = int(max_recompute * length) - length  # A schedule's advances.
  if spare >= 0:
    # The fewest slots within the bound: a schedule's least memory there.
    within.append(_binomial(c, length, remat_schedule.fewest_binomial_slots(
        length, spare)))
  least = min(k.temporaries for k in within)  # remat=False is always within.
  raise ValueError(errors.message(
      f"every remat plan for {length} steps that fits memory_budget="
      f"{memory_budget} bytes recomputes at least {fewest} steps, "
      f"{fewest / length:.1f} forward passes of the loop (remat=True "
      f"recomputes 1), over max_recompute={max_recompute:g}. The least "
      f"budget within it is {least} bytes (predicted): raise memory_budget "
      f"to that, or pass max_recompute={math.ceil(fewest / length)} to "
      "accept the recomputation."))


def _scheduled(c: Coefficients, length: int, slots: int) -> int:
  a, b, per_slot = c.scheduled
  return int(round(a + b * length + per_slot * slots))


def _recomputing(c: Coefficients, remat, slots, groups, temporaries,
                 length: int, advances: int) -> RematCandidate:
  """A candidate that recomputes each step where it backpropagates it, and advances."""
  return RematCandidate(remat, slots, groups, temporaries, length + advances,
                        int(round(length * c.step_flops +
                                  advances * c.advance_flops)))


def _binomial(c: Coefficients, length: int, slots: int) -> RematCandidate:
  # Each step is run again once where it is backpropagated (as
  # jax.checkpoint does), besides the schedule's advances.
  return _recomputing(c, "binomial", slots, None,
                      _scheduled(c, length, slots), length,
                      remat_schedule.binomial_cost(length, slots))


def _candidates(c: Coefficients, length: int) -> list[RematCandidate]:
  """No remat, remat=True, a few groupings of "nested", binomial by slots."""
  def linear(ab):
    return int(round(ab[0] + ab[1] * length))

  out = [RematCandidate(False, None, None, linear(c.plain), 0, 0),
         _recomputing(c, True, None, None, linear(c.per_step), length, 0)]
  if c.policy is not None:
    name, a, b, flops = c.policy
    out.append(RematCandidate(True, None, None, linear((a, b)), length,
                              int(round(length * flops)), name))
  # Every count of slots up to 16, then about 20% apart: the budget's own
  # count is added by `choose`.
  slots = 1
  while slots < length:
    out.append(_binomial(c, length, slots))
    slots = slots + 1 if slots < 16 else int(slots * 1.2)
  # A few groupings of "nested", for the record: binomial recomputes no
  # more with as many slots.
  for groups in sorted({2, max(1, math.isqrt(length)), length // 4} - {0, 1}):
    if groups < length:
      nested = remat_schedule.nested(length, groups)
      out.append(_recomputing(c, "nested", nested.num_slots, groups,
                              _scheduled(c, length, nested.num_slots),
                              length, nested.recomputed_steps))
  return out


class _Traced(NamedTuple):
  """The step as a jaxpr of (consts, carry, x), with the avals it takes."""
  jaxpr: jax_core.ClosedJaxpr  # Consts abstracted into inputs.
  num_consts: int
  carry: tuple[jax.ShapeDtypeStruct, ...]
  x: tuple[jax.ShapeDtypeStruct, ...]  # One step's slice.


def _trace(f, init, xs, length) -> tuple[_Traced, tuple[Any, ...]]:
  """`f` traced once on one step's shapes; what it closes over, abstracted."""
  carry, carry_tree = jax.tree.flatten(init)
  x_leaves, x_tree = jax.tree.flatten(xs)

  def flat(carry_leaves, x):
    new_carry, y = f(carry_tree.unflatten(carry_leaves), x_tree.unflatten(x))
    return jax.tree.leaves(new_carry), jax.tree.leaves(y)

  def struct(a):
    a = jax.typeof(a)
    return jax.ShapeDtypeStruct(a.shape, a.dtype)

  carry_avals = tuple(struct(c) for c in carry)
  x_avals = tuple(jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x))
                  for x in x_leaves)
  with _varying_types_unchecked():
    closed = jax.make_jaxpr(flat)(list(carry_avals), list(x_avals))
  consts = tuple(struct(c) for c in closed.consts)
  # The consts become the jaxpr's first inputs: no tracer of the caller's
  # trace reaches the compiles below.
  jaxpr = jax_core.ClosedJaxpr(
      _consts_as_inputs(closed.jaxpr), ())
  return _Traced(jaxpr, len(consts), carry_avals, x_avals), consts


def _varying_types_unchecked() -> ContextManager[Any]:
  """Where jax types no value as varying over a manual mesh axis.

  A loop inside `jax.shard_map` (a time scan in a pipeline's stage) is
  planned on one device's step, compiled on its own (`_measure`). Traced in
  the shard_map's context, the step's values would be typed as varying over
  its manual axes, the carry cast to match (`pvary`), and those compiles
  refuse the mix ("dot_general requires varying manual axes to match"). So
  the step is traced as `jax.shard_map(..., check_vma=False)` traces a body,
  by jax's own switch for it, which jax keeps internal (jax >= 0.7; before,
  no value was typed so).
  """
  check = getattr(jax_config, "_check_vma", None)
  return contextlib.nullcontext() if check is None else check(False)


def _consts_as_inputs(jaxpr):
  return jaxpr.replace(constvars=[], invars=jaxpr.constvars + jaxpr.invars)


_COEFFICIENTS = caches.Cache("remat_plan.coefficients")


class _Fit(NamedTuple):
  """One way to run the loop, measured: temporaries `a + b·T` (bytes), FLOPs per step."""
  temporaries: tuple[float, float]
  flops_per_step: float  # b of the FLOPs.
  advance_flops: Optional[int]  # A schedule's: one advance.


def coefficients(step: _Traced, consts: tuple[Any, ...], length: int,
                 policy: Optional[Callable[..., bool]] = None
                 ) -> Coefficients:
  """The model's coefficients for `step`, measured by 6 short compiles (8 with a policy)."""
  long = min(length, _LONGEST)
  short = max(1, long // 2)
  key = (str(step.jaxpr), consts, step.carry, step.x, policy, long,
         jax.default_backend())
  found = _COEFFICIENTS.get(key)
  if found is not None:
    return found

  def fit(remat, policy=None) -> _Fit:
    low = _measure(step, consts, short, remat, policy)
    if long == short:
      # One length: the FLOPs per step are the whole loop's, over its steps.
      return _Fit((float(low.temporaries), 0.0), low.flops / short,
                  low.advance_flops)
    high = _measure(step, consts, long, remat, policy)
    b = (high.temporaries - low.temporaries) / (long - short)
    return _Fit((low.temporaries - b * short, b),
                (high.flops - low.flops) / (long - short), high.advance_flops)

  def recomputed(k: _Fit) -> float:
    # XLA may find nothing to recompute; never a gain.
    return max(0.0, k.flops_per_step - plain.flops_per_step)

  carry_bytes = sum(math.prod(c.shape) * np.dtype(c.dtype).itemsize
                    for c in step.carry)
  plain, per_step = fit(None), fit(True)
  (a, b), _, advance = fit(_SLOTS)
  slots = min(_SLOTS, short)
  with_policy = None
  if policy is not None:
    k = fit(True, policy)
    with_policy = (policy_name(policy), *k.temporaries, recomputed(k))
  r = recomputed(per_step)
  found = Coefficients(plain.temporaries, per_step.temporaries,
                       (a - carry_bytes * slots, b, float(carry_bytes)), r,
                       r if advance is None else float(advance), with_policy)
  _COEFFICIENTS.put(key, found)
  return found


def policy_name(policy: Callable[..., bool]) -> str:
  """How a `RematCandidate` names a policy: a function's name, else its repr.

  >>> from haiku_bridge._src import remat_plan
  >>> remat_plan.policy_name(jax.checkpoint_policies.nothing_saveable)
  'nothing_saveable'
  """
  return getattr(policy, "__name__", None) or repr(policy)


class _Measured(NamedTuple):
  temporaries: int
  flops: int
  advance_flops: Optional[int]  # With a schedule.


def _measure(step: _Traced, consts, length: int, remat,
             policy=None) -> _Measured:
  """Compiled temporaries and FLOPs of the VJP of `length` steps, run as `remat` says.

  `remat`: None (plain scan), True (checkpointed step, under `policy`), or
  a number of binomial slots. The FLOPs count every loop by its trip
  count (only `remat=True`'s and `None`'s are used); a schedule's
  conditional, which its backward sweep runs once per action (more often
  than any in the step), gives an advance's FLOPs: its cheaper branch.
  """
  def body(consts, carry, x):
    out = jax_core.jaxpr_as_fun(step.jaxpr)(*consts, *carry, *x)
    return out[:len(step.carry)], out[len(step.carry):]

  def run(consts, carry, xs):
    f = lambda c, x: body(consts, c, x)
    if remat is None:
      return jax.lax.scan(f, carry, xs, length=length)
    if remat is True:
      return jax.lax.scan(jax.checkpoint(f, policy=policy), carry, xs,
                          length=length)
    return scheduled_scan.scan(
        f, carry, xs, length=length,
        schedule=remat_schedule.binomial(length, min(remat, length)))

  def train(consts, carry, xs):
    # A loss of the outputs, as a training step has one: the ys are made
    # and kept for it, and their cotangent made from them (a loss in the
    # step returns small ys, and this costs little).
    def loss(*floats):
      out = _on_floats(run, (consts, carry, xs))(*floats)
      return sum(jnp.sum(jnp.square(o.astype(jnp.float32))) for o in out)
    floats = _floats((consts, carry, xs))
    return jax.grad(loss, argnums=tuple(range(len(floats))))(*floats)

  stacked = [jax.ShapeDtypeStruct((length,) + x.shape, x.dtype)
             for x in step.x]
  compiled = jax.jit(train).lower(list(consts), list(step.carry),
                                  stacked).compile()
  analysis, text = compiled.memory_analysis(), compiled.as_text()
  if analysis is None or text is None:
    raise ValueError(errors.message(
        f"remat=\"auto\" needs XLA's memory analysis and compiled HLO, "
        f"which the {jax.default_backend()} backend does not give."))
  count = hlo_flops.count(text)
  schedule = max(count.conditionals, key=lambda c: c.executions,
                 default=None)
  return _Measured(analysis.temp_size_in_bytes, count.flops,
                   None if remat in (None, True) or schedule is None
                   else min(schedule.branches))


def _is_float(a) -> bool:
  return jnp.issubdtype(a.dtype, jnp.inexact)


def _floats(tree):
  return [leaf for leaf in jax.tree.leaves(tree) if _is_float(leaf)]


def _on_floats(fn, args):
  """`fn(*args)` as a function of the float leaves of `args` only."""
  leaves, tree = jax.tree.flatten(args)

  def g(*floats):
    it = iter(floats)
    full = [next(it) if _is_float(leaf) else leaf for leaf in leaves]
    return _floats(fn(*tree.unflatten(full)))
  return g

