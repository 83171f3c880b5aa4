"""`remat="auto"`: the plan with the least recomputation whose memory fits a budget.

A scan's backward pass can keep every step's activations (`remat=False`),
one carry per step (`remat=True`), what a `remat_policy` saves of each step
(`remat=True` with the policy the user gives), or a schedule's few carries
(`"nested"`, `"binomial"`: `schedule.py`), each trading recomputed
FLOPs for memory. Which one fits depends on things a user cannot see: how
the step's activations compare with its carry, the length, where the loss
sits. `plan` predicts, for every candidate, the bytes a training step of
the loop needs and the FLOPs it recomputes, chooses, and checks the choice
compiled.

What the budget counts (README, "Choosing remat for one loop"): the loop's part of a
training step, compiled as `_measure` builds it (the value and gradient of
a loss of the loop's outputs with respect to what it closes over and its per-step
inputs, at the loop's own length T): XLA's temporaries (what the backward
pass keeps, the outputs and their cotangents, the carry's cotangent, the
working memory) and the constants compiled into the program (a schedule's
tables, arrays the step closes over). Not the params or their gradients,
nor the rest of the step.

The model, at the loop's own length T:

    remat=False, remat=True, remat=True under a policy:  compiled, exactly
    binomial with s slots:  a + c·s + k   (nested: s = its slots)

where k is its tables' constants (a row per action, about 2·T - s of
them: `Schedule.table_bytes`; one slot's, the most). a and c come from
two compiled schedules: one slot's, compiled with remat=False and
remat=True (so the least plan's bytes are compiled), and a second one
(`_sloped`): the schedule the budget chooses on the line through one
slot's bytes with the carry's bytes per slot, which is then also the
choice's check; where it lies off that line (XLA keeps a slot at other
than the carry's bytes, as XLA:CPU a bfloat16 carry's at twice and
XLA:TPU a carry padded to its tiles), or where the budget chooses no
schedule of several slots, the most slots a candidate keeps (T - 2:
`_most_slots`), so that a slot's cost is measured, never assumed, and
beside it the count the budget holds on the line through the two
schedules compiled, the likely choice (`_reaimed`). So a budget that a
schedule fits costs four compiles (five with a policy), where the carry's
bytes are a slot's, six where they are not, three in turn;
all at T, so that what XLA does only for long loops (or short ones:
unrolling, double buffering) is in every figure; with XLA's cheaper code
generation (`measuring_options`), which leaves buffers as they are, each
program lowered while the last compiles in a thread, as many compiling at
once as there are cores (`_Compiles`): one slot's first, so that the
budget's second schedule lowers as soon as its figures are in, while
remat=False's and remat=True's compile.

Predictions steer; the compiled program decides. The choice, unless it
was one of the programs measured, is compiled too, and when it is over the
budget the next candidate is chosen, the compiled bytes replacing that
plan's prediction only (at most `_CHECKS` compiles; then the first compiled plan that
fits, or an error). Compiled for their bytes only, those and the line's
second point are not read for FLOPs.

Recomputed FLOPs come from the same compiles, counted with every loop by
its trip count (`hlo_flops.py`): r, one step's recomputation under
`jax.checkpoint` (what its backward pass needs), is the FLOPs of
`remat=True` less those of `remat=False`, over T, and likewise under the
policy; f, one advance of a schedule (a whole step's forward, for the
carry), is the cheaper branch of the schedule's conditional in its
compile. `remat=True` recomputes T·r, the policy its own part of each
step, a schedule T·r and f for each step it advances to rebuild carries
(`remat_schedule.binomial_cost`, `Schedule.recomputed_steps`); `False`
none. The choice is the candidate with the least recomputed FLOPs whose
bytes fit (then the fewest recomputed steps, then the least memory), among
those that recompute at most `max_recompute` forward passes of the loop
(`MAX_RECOMPUTE`, 3, by default: see `choose`).

The measurements are cached in memory and on disk (`caches.OnDisk`, under
`caches.directory()`; `hkb.clear_caches()` deletes them), keyed on the
step's jaxpr (its text: every shape, dtype and operation), the policy, T,
the loop's `unroll` (every program is measured unrolled as the loop runs),
the mesh it is planned under (`_mesh_context`), the backend and device,
the jax, jaxlib and haiku_bridge versions, the
measuring code, XLA's flags; the choice follows from them and the budget,
so it is the same for the same shapes, policy and budget, in any process.
The step is planned on the shapes the loop sees, compiled for one
device: inside `jax.vmap` those are one example's (the prediction is per
example), and a sharded step is planned unsharded. A loop with nothing to
differentiate (no float reaches a float output) has one plan: the plain
loop.

What users see: `remat_plan` (public) returns the `RematPlan` of a JAX step,
or of one of the bridge's loops (`plannable`) with its arguments, which it
runs until the loop has made its plan (`Planned` carries it out, the loop
not run); every plan a loop makes passes `loop_plan`, which logs it at
INFO on the `haiku_bridge.remat` logger.
"""

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import gc
import hashlib
import math
import operator
import os
import re
import sys
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence, TypeVar

import haiku as hk
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from haiku_bridge._src import caches
from haiku_bridge._src import errors
from haiku_bridge._src import guards
from haiku_bridge._src.remat import hlo_flops
from haiku_bridge._src import hlo_text
from haiku_bridge._src import modes
from haiku_bridge._src import pytree
from haiku_bridge._src import versions
from haiku_bridge._src.remat import schedule as remat_schedule
from haiku_bridge._src.remat import scheduled_scan
from haiku_bridge._src.remat import tracing
from haiku_bridge._src.pytree import PyTree

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
    temporaries: bytes of a training step of the loop that the budget
      counts (XLA's temporaries and the constants compiled in): compiled
      where the plan compiled it, else predicted.
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
            f"recomputed{_planned_for(self.derivatives)}.\n{self.table()}")


def _planned_for(derivatives: tuple[tuple[str, int], ...]) -> str:
  """What `RematPlan.__str__` says of the derivatives a plan is for, other than one gradient.

  >>> from haiku_bridge._src.remat import plan as remat_plan
  >>> remat_plan._planned_for((("reverse", 1), ("forward", 64)))
  ', for 64 JVPs at once of a gradient'
  >>> remat_plan._planned_for((("reverse", 1),))
  ''
  """
  if derivatives == (("reverse", 1),):
    return ""
  words = {"reverse": ("a gradient", "gradients"), "forward": ("a JVP", "JVPs")}
  return ", for " + " of ".join(
      words[mode][0] if at_once == 1 else f"{at_once} {words[mode][1]} at once"
      for mode, at_once in reversed(derivatives))


def _readable(x: float) -> str:
  """`x` to 4 significant digits, without an exponent: 0.1907, 1235, 12350."""
  return np.format_float_positional(x, precision=4, unique=True,
                                    fractional=False, trim="-")


def _mib(num_bytes: float) -> str:
  return _readable(num_bytes / 2**20)


Key = tuple[Any, ...]  # A plan's identity: (remat, slots, groups, policy).


class Coefficients(NamedTuple):
  """What the model predicts from, measured at the loop's own length (module docstring).

  Bytes are a compiled program's temporaries plus the constants it holds.
  """
  length: int  # T, the steps every figure is measured at.
  plain: int  # remat=False, compiled.
  per_step: Optional[int]  # remat=True, compiled; None: nothing to differentiate.
  scheduled: Optional[tuple[float, float]]  # A schedule with s slots: a + c·s temporaries.
  constants: tuple[float, float]  # A schedule's tables: (k, 0), bytes.
  step_flops: float  # r: one step's recomputation under jax.checkpoint.
  advance_flops: float  # f: one advance of a schedule.
  # With a policy: its name, its bytes and one step's recomputation under it.
  policy: Optional[tuple[str, int, float]] = None
  # The plans compiled at T, by `key`: their bytes, which override a prediction.
  measured: tuple[tuple[Key, int], ...] = ()


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
  the model's params, under the training step's gradient): the plan is the
  one the loop makes with `remat="auto"` there, by the same path, and the
  loop does not run. The gradient tells the plan which inputs are data
  (here the `xs`, which get no cotangent); outside any gradient every float
  input that reaches an output is measured differentiated, as in a
  training step of the loop's own, and the plan may differ from the loop's:

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
  >>> plans = []  # Kept from under the gradient.
  >>> def loss(params):
  ...   plans.append(net.apply(params, None, xs, plan=True))
  ...   return 0.0
  >>> _ = jax.eval_shape(jax.grad(loss), params)
  >>> plans[0].length, plans[0].choice.remat
  (1024, 'binomial')

  Args:
    f: `f(carry, x) -> (carry, y)`, a JAX function, planned as
      `jax.lax.scan` runs it; or one of the bridge's loops (`hkb.scan`,
      `hkb.dynamic_unroll`, `hkb.layer_scan`, `hkb.repeat_layer`, or a
      `functools.partial` of one), planned as it runs with `remat="auto"`.
    *args: for a function `f`: `init` (the first carry) and `xs` (per-step
      inputs, each leaf with a leading axis of `length` steps); for a
      loop, its positional arguments.
    memory_budget: the bytes the loop's part of a training step may take,
      held by the compiled loop: its temporaries (what its backward pass
      keeps, its outputs and their cotangents, the carry's cotangent, its
      working memory) and the constants it compiles in (a schedule's
      tables, arrays the step closes over); not the params or their
      gradients, nor the rest of the step.
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


def refusal(message: str) -> ValueError:
  """The error where no plan fits `memory_budget` (or none that fits recomputes within `max_recompute`): a ValueError that `loop.resolved` may defer to a differentiation (`is_refusal`, `deferrable`)."""
  error = ValueError(message)
  error.remat_refusal = True  # type: ignore[attr-defined]
  return error


def is_refusal(error: BaseException) -> bool:
  """Whether `error` is a loop's refusal of its budget (`refusal`)."""
  return getattr(error, "remat_refusal", False)


def deferrable() -> bool:
  """Whether a loop planned now may defer its refusal (`refusal`) to a differentiation: no derivative is seen around it, and no `remat_plan` call asks for its plan."""
  return (not _WANTED.get() and
          tracing.innermost_derivative() is None)


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
# The lists of the `remat_plans()` blocks this runs in, outermost first.
_RECORDING: contextvars.ContextVar[tuple[list[RematPlan], ...]] = (
    contextvars.ContextVar("remat_plan.recording", default=()))


@contextlib.contextmanager
def remat_plans() -> Iterator[list[RematPlan]]:
  """The plans `remat="auto"` makes while the block runs: a list, each loop's plan added as the loop is traced.

  Trace your training step in the block, as it runs (`jax.eval_shape`
  runs nothing), and the list holds the exact plan each loop makes there,
  under your gradient, which tells the plans what is data:

  >>> def loss(w, xs):
  ...   step = lambda h, x: (jnp.tanh(h @ w + x), jnp.sum(h ** 2))
  ...   _, ys = hkb.scan(step, jnp.zeros([4, 16]), xs, remat="auto",
  ...                    memory_budget=100_000)
  ...   return jnp.sum(ys)
  >>> w, xs = jnp.eye(16), jnp.ones([512, 4, 16])
  >>> with hkb.remat_plans() as plans:
  ...   _ = jax.eval_shape(jax.grad(loss), w, xs)
  >>> [(p.length, p.choice.remat) for p in plans]
  [(512, 'binomial')]

  A loop plans when it is traced: a step JAX has traced before (a
  `jax.jit` function called again with the same shapes) plans nothing. A
  `remat_plans()` block inside another adds to both lists.
  """
  plans: list[RematPlan] = []
  token = _RECORDING.set(_RECORDING.get() + (plans,))
  try:
    yield plans
  finally:
    _RECORDING.reset(token)


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
              max_recompute: float = MAX_RECOMPUTE,
              unroll: int | bool = 1,
              batch_major: bool = False) -> RematPlan:
  """The plan a loop's `remat="auto"` runs (`loop.resolved`), logged.

  Every plan a loop makes passes here: it is logged at INFO on the
  `haiku_bridge.remat` logger (`str(plan)`: the choice and the table), and
  under `remat_plan(loop, ...)` it goes to that call instead of running.
  """
  # A loop inside this one's step plans for itself, unasked.
  token = _WANTED.set(False)
  try:
    made = plan(f, init, xs, length, memory_budget, policy, max_recompute,
                unroll, batch_major)
  finally:
    _WANTED.reset(token)
  tracing.LOG.info("%s", made)
  for plans in _RECORDING.get():
    plans.append(made)
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
         max_recompute: float = MAX_RECOMPUTE,
         unroll: int | bool = 1, batch_major: bool = False) -> RematPlan:
  """`remat_plan` of checked arguments (the loop's `remat="auto"`).

  The prediction steers, the compiled program decides: the choice is
  compiled at `length` steps (the loop's gradient, as it is measured) and,
  when its temporaries and constants are over the budget, the next
  candidate is chosen, the compiled bytes replacing that plan's prediction.
  Every program is measured with the loop's `unroll` (`jax.lax.scan`'s):
  an unrolled loop keeps other buffers (a residual stack of 16 layers,
  unroll=2: 5.4× the bytes of one slot's schedule rolled); with
  `batch_major`, with the copies of the inputs and outputs its caller makes
  (`hkb.dynamic_unroll(time_major=False)`: a batch-major GRU over 512 steps
  compiled to 2.1× one slot's schedule without them).
  """
  with _no_cyclic_gc():
    return _plan(f, init, xs, length, memory_budget, policy, max_recompute,
                 unroll, batch_major)


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
  """Python's cyclic garbage collector off while a plan is made, then as it was.

  Tracing, lowering and reading the measuring programs allocate hundreds of
  thousands of objects, which reference counting frees; the collector,
  started by their number, found nothing there to free (10 objects in a
  full collection), and one full collection of the process's objects cost
  0.08 s on the GRU and 0.2 s on the 24-block transformer of the planning
  benchmark, a tenth of a `remat=True` step's compile. With it off, the
  collections skipped are not owed later: the counts that start a full one
  grow only with the collections run.
  """
  was_enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was_enabled:
      gc.enable()


def _plan(f, init, xs, length: int, memory_budget: int, policy,
          max_recompute: float, unroll: int | bool = 1,
          batch_major: bool = False) -> RematPlan:
  step, consts = tracing.trace(f, init, xs, length, unroll, batch_major)
  here: dict[Key, _Figures] = {}  # The plans this call compiled.

  def second(one: _Measured) -> None:
    # Lowered and compiled while the other measurements compile.
    slots = _second_point(length, memory_budget, one.temporaries,
                          one.constants, _slot_guess(step))
    if slots is not None:
      _compiled(step, consts, length, ("binomial", slots, None, None),
                policy, here)

  c = _sloped(coefficients(step, consts, length, policy, second), step,
              consts, memory_budget, policy, here)
  try:
    return _checked_choice(c, step, consts, memory_budget, policy,
                           max_recompute, here)._replace(
                               derivatives=step.derivatives)
  except ValueError as e:
    if not tracing.no_schedules(step):
      raise
    raise refusal(
        f"{e} Differentiated again in reverse mode (a gradient of a "
        "gradient), or forward, the plans are remat=False, remat=True and "
        "the policy: a schedule keeps more than remat=False there, or runs "
        "as remat=True.") from None


def _checked_choice(c: Coefficients, step: tracing.Traced, consts,
                    memory_budget: int, policy, max_recompute: float,
                    here: dict[Key, "_Figures"]) -> RematPlan:
  """The plan `c` chooses for `memory_budget`, compiled to check it (`plan`)."""
  length = c.length
  for _ in range(_CHECKS):
    chosen = choose(c, length, memory_budget, max_recompute)
    if key(chosen.choice) in dict(c.measured):
      return chosen
    c = _checked(c, step, consts, chosen.choice, policy, here)
  # Still unchecked: the first that was compiled, fits and is affordable.
  chosen = choose(c, length, memory_budget, max_recompute)
  measured = dict(c.measured)
  compiled = [k for k in chosen.candidates if key(k) in measured]
  within = [k for k in compiled
            if k.recomputed_steps <= max_recompute * length]
  for k in within:
    if k.temporaries <= memory_budget:
      return chosen._replace(choice=k)
  # Every compiled plan within the bound is over the budget: the least of
  # those is what the call takes (never a plan that fits but recomputes
  # more than the bound, which the call would refuse again).
  raise _over_budget(length, memory_budget,
                     min(k.temporaries for k in within),
                     min(k.temporaries for k in compiled))


def key(k: RematCandidate) -> Key:
  """A candidate's plan, without its costs: (remat, slots, groups, policy)."""
  return (k.remat, k.slots, k.groups, k.policy)


def choose(c: Coefficients, length: int, memory_budget: int,
           max_recompute: float = MAX_RECOMPUTE) -> RematPlan:
  """The plan the coefficients predict for `length` steps and the budget.

  Never one that recomputes more than `max_recompute` forward passes of the
  loop: where every plan that fits the budget does, the error says what the
  budget costs and the least budget within `max_recompute`.
  """
  candidates = _candidates(c, length)
  # Binomial with the most slots the budget holds: the fewest recomputed
  # steps of any schedule that fits. Each slot costs the same, and the
  # tables shrink as slots are added: from the most the slots alone
  # allow, down to the first that fits with its tables.
  if c.scheduled is not None:
    a, per_slot = c.scheduled
    k0, k1 = c.constants
    most = min(_most_slots(length),
               int((memory_budget - a - k0 - k1 * length) //
                   max(per_slot, 1.0)))
    for slots in range(most, max(0, most - _SLOT_SEARCH), -1):
      fits = _binomial(c, length, slots)
      if fits.temporaries <= memory_budget:
        if fits not in candidates:
          candidates.append(fits)
        break
  candidates.sort(key=lambda k: (k.recomputed_flops, k.recomputed_steps,
                                 k.temporaries))
  fitting = [k for k in candidates if k.temporaries <= memory_budget]
  if not fitting:
    raise _over_budget(length, memory_budget,
                       _least_within(c, candidates, length, max_recompute),
                       min(k.temporaries for k in candidates))
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
  least = _least_within(c, candidates, length, max_recompute)
  raise refusal(errors.message(
      f"every remat plan for {length} steps that fits memory_budget="
      f"{memory_budget} bytes recomputes at least {fewest} steps, "
      f"{fewest / length:.1f} forward passes of the loop (remat=True "
      f"recomputes 1), over max_recompute={max_recompute:g}. The least "
      f"budget within it is {least} bytes (predicted): raise memory_budget "
      f"to that, or pass max_recompute={math.ceil(fewest / length)} to "
      "accept the recomputation."))


def _least_within(c: Coefficients, candidates: list[RematCandidate],
                  length: int, max_recompute: float) -> int:
  """The least bytes of a plan recomputing at most `max_recompute` forward passes: the least budget a call with that bound takes."""
  within = [k for k in candidates
            if k.recomputed_steps <= max_recompute * length]
  spare = max_recompute * length - length  # A schedule's advances.
  if c.scheduled is not None and spare >= 0:
    # The fewest slots within the bound: a schedule's least memory there.
    within.append(_binomial(c, length, remat_schedule.fewest_binomial_slots(
        length, int(min(spare, length * length)))))
  return min(k.temporaries for k in within)  # remat=False is always within.


# The counts of slots below the most the slots alone allow that `choose`
# tries, at most.
_SLOT_SEARCH = 64


def _most_slots(length: int) -> int:
  """The most slots a schedule keeps among the candidates: all the carries but two.

  Up to T - 2 slots, XLA's temporaries grow by a slot's bytes, to the byte
  (measured: the planning benchmark's Conv1D stack, 24-block transformer
  and GRU over 2048 steps, 1 to T - 2 slots). At T - 1 the schedule keeps
  every carry and compiles off that line (1.76×, 1.33× and 1.017× its
  prediction there), over `remat=True`'s bytes, which recompute no more.
  """
  return max(1, length - 2)


def _over_budget(length: int, memory_budget: int, least: int,
                 unbounded: int) -> ValueError:
  """The refusal of a budget below `least`, the least within `max_recompute` (`unbounded`: with none)."""
  beyond = (f", {unbounded} with max_recompute=math.inf" if unbounded < least
            else "")
  return refusal(errors.message(
      f"no remat plan for {length} steps fits memory_budget="
      f"{memory_budget} bytes: the least any needs is {least} bytes "
      f"(predicted){beyond}. Raise the budget, or shorten the scan. The budget "
      "counts the step's per-step outputs and their cotangents, read by "
      "the loss or not: where it reads only the final carry, return none."))


def _bytes(c: Coefficients, plan: Key, predicted: float) -> int:
  """A plan's bytes: compiled where it was, else predicted."""
  return dict(c.measured).get(plan, int(round(predicted)))


def _scheduled(c: Coefficients, length: int, slots: int, plan: Key,
               recomputed_steps: int) -> int:
  """A schedule's bytes: its slots' temporaries, and its tables' constants."""
  assert c.scheduled is not None, "a loop with schedules measured them"
  a, per_slot = c.scheduled
  k0, k1 = c.constants
  return _bytes(c, plan, a + per_slot * slots + k0 + k1 * recomputed_steps)


def _recomputing(c: Coefficients, remat, slots, groups, length: int,
                 advances: int, temporaries: Optional[int] = None
                 ) -> RematCandidate:
  """A candidate that recomputes each step where it backpropagates it, and advances."""
  if temporaries is None:
    temporaries = _scheduled(c, length, slots, (remat, slots, groups, None),
                             length + advances)
  return RematCandidate(remat, slots, groups, temporaries, length + advances,
                   int(round(length * c.step_flops +
                             advances * c.advance_flops)))


def _binomial(c: Coefficients, length: int, slots: int) -> RematCandidate:
  # Each step is run again once where it is backpropagated (as
  # jax.checkpoint does), besides the schedule's advances.
  return _recomputing(c, "binomial", slots, None, length,
                      remat_schedule.binomial_cost(length, slots))


def _candidates(c: Coefficients, length: int) -> list[RematCandidate]:
  """No remat, remat=True, a few groupings of "nested", binomial by slots."""
  out = [RematCandidate(False, None, None, _bytes(c, (False, None, None, None),
                                             c.plain), 0, 0)]
  if c.per_step is None:  # Nothing to differentiate: nothing to keep.
    return out
  out.append(_recomputing(c, True, None, None, length, 0,
                          _bytes(c, (True, None, None, None), c.per_step)))
  if c.policy is not None:
    name, temporaries, flops = c.policy
    out.append(RematCandidate(True, None, None,
                         _bytes(c, (True, None, None, name), temporaries),
                         length, int(round(length * flops)), name))
  if c.scheduled is None:  # One step: no schedule keeps fewer carries.
    return out
  # Every count of slots up to 16, then about 20% apart: the budget's own
  # count is added by `choose`.
  slots = 1
  while slots <= _most_slots(length):
    out.append(_binomial(c, length, slots))
    slots = slots + 1 if slots < 16 else int(slots * 1.2)
  # A few groupings of "nested", for the record: binomial recomputes no
  # more with as many slots.
  for groups in sorted({2, max(1, math.isqrt(length)), length // 4} - {0, 1}):
    if groups < length:
      slots, recomputed_steps = _nested(length, groups)
      out.append(_recomputing(c, "nested", slots, groups, length,
                              recomputed_steps))
  return out


@caches.memoize(maxsize=256)
def _nested(length: int, groups: int) -> tuple[int, int]:
  """The slots and recomputed steps of "nested" with `groups` groups (its schedule built once)."""
  nested = remat_schedule.nested(length, groups)
  return nested.num_slots, nested.recomputed_steps


def _derived(derivative: Callable[..., Any], kind: str, at_once: int,
             argnums: tuple[int, ...], of_the_loss: bool
             ) -> Callable[..., Any]:
  """`derivative` (leaves -> the loss where `of_the_loss`, else a value and gradients) differentiated as `kind` says, `at_once` times under one vmap: leaves -> a value and gradients.

  "reverse": the value and gradient of its outputs' sum (the loss; a loss
  of the gradient); "forward": its JVP along the leaves themselves, each
  output beside its tangent (both outputs, as a Hessian-vector product
  returns a gradient and its product). `at_once` derivatives are taken as
  `jax.vmap` takes a Jacobian's: one primal pass, the cotangents (or
  tangents) batched, by a batched scale of them.
  """
  def reverse(scale, *leaves):
    return jax.value_and_grad(
        lambda *leaves: _total(derivative(*leaves), scale),
        argnums=argnums)(*leaves)

  def forward(scale, *leaves):
    tangents = tuple(leaves if scale is None else
                     ((scale * l).astype(l.dtype) for l in leaves))
    out, d_out = jax.jvp(derivative, leaves, tangents)
    if of_the_loss:  # No gradients.
      return (out, d_out), []
    (value, grads), (d_value, d_grads) = out, d_out
    return (value, d_value), [(g, d) for g, d in zip(grads, d_grads)]

  one = reverse if kind == "reverse" else forward
  if at_once == 1:
    return functools.partial(one, None)

  def batched(*leaves):
    grads = 0 if of_the_loss else len(leaves)
    out_axes = 0 if kind == "reverse" else ((None, 0), [(None, 0)] * grads)
    return jax.vmap(lambda scale: one(scale, *leaves),
                    out_axes=out_axes)(jnp.ones([at_once], jnp.float32))
  return batched


def _total(tree: PyTree, scale: Optional[jax.Array] = None) -> jax.Array:
  """The sum of every element of `tree`'s leaves in float32 (a float32 scalar as it is), times `scale`."""
  parts = [leaf if leaf.ndim == 0 and leaf.dtype == jnp.float32
           else jnp.sum(leaf.astype(jnp.float32))
           for leaf in jax.tree.leaves(tree)]
  total = (functools.reduce(operator.add, parts) if parts
           else jnp.zeros([], jnp.float32))
  return total if scale is None else scale * total


def _batched(step: tracing.Traced, shapes: tuple[list[Any], ...]
             ) -> tuple[list[Any], ...]:
  """`shapes` (consts, carry, xs of one example) with the batch's dimensions of `step.vmaps`."""
  for size, _, *dims in step.vmaps:
    shapes = tuple(
        [s if d is None else jax.ShapeDtypeStruct(
            s.shape[:d] + (size,) + s.shape[d:], s.dtype)
         for s, d in zip(group, group_dims)]
        for group, group_dims in zip(shapes, dims))
  return shapes


_COEFFICIENTS = caches.Cache("remat_plan.coefficients")
# Across processes: the coefficients and the plans compiled, as JSON, under
# caches.directory() (`hkb.clear_caches()` deletes them).
_ON_DISK = caches.OnDisk("remat_plans")
# The figures of a plan compiled for a budget (its choice's check, its line's
# second point), by the coefficients' key and the plan's.
_COMPILED = caches.Cache("remat_plan.compiled")
# Bumped when what a file holds changes meaning.
_FORMAT = 3


def coefficients(step: tracing.Traced, consts: tuple[Any, ...], length: int,
                 policy: Optional[Callable[..., bool]] = None,
                 then: Optional[Callable[["_Measured"], None]] = None
                 ) -> Coefficients:
  """The model's coefficients for `step` over `length` steps, measured by 3 compiles (4 with a policy).

  Each compiles the loop's gradient at `length` steps, with XLA's cheaper
  code generation (`measuring_options`): remat=False, remat=True, and the
  binomial schedule with one slot; a slot is taken at the carry's bytes
  until a budget's `_sloped` compiles a second schedule. Cached in this
  process and on disk, keyed on everything the figures depend on. Where
  they are measured, `then` is called with one slot's figures as soon as
  they are in, while the others compile (`_plan` compiles the budget's
  second schedule there).
  """
  memo = _memo_key(step, consts, length, policy)
  found = _COEFFICIENTS.get(memo)
  if found is not None:
    return found
  disk = _disk_key(step, consts, length, policy)
  found = _from_json(_ON_DISK.get(disk))
  if found is None:
    found = _coefficients(step, consts, length, policy, then)
    _ON_DISK.put(disk, _to_json(found))
  _COEFFICIENTS.put(memo, found)
  return found


def _coefficients(step: tracing.Traced, consts, length: int, policy,
                  then=None) -> Coefficients:
  if not tracing.differentiable(step):
    # Nothing reaches a float output from a float input: no backward pass
    # keeps anything, and every plan is the plain loop.
    plain = _measure(step, consts, length, None)
    return Coefficients(length, plain.bytes, None, None, (0.0, 0.0), 0.0,
                        0.0, None, (((False, None, None, None),
                                     plain.bytes),))
  # The least plan, binomial with one slot (a schedule of O(T) actions),
  # compiled beside remat=False and remat=True: the line a + c·s starts
  # there, and a slot's bytes are first taken as the carry's, until a
  # second schedule is compiled (`_sloped`).
  one_slot = ([remat_schedule.binomial(length, 1)]
              if length > 1 and not tracing.no_schedules(step) else [])
  with _Compiles(step, consts, length, _compile_threads()) as compiles:
    # One slot's first, so that `then` can start while the rest compile:
    # it needs that program's bytes only.
    schedules = [compiles.submit(s) for s in one_slot]
    others = [compiles.submit(remat, p) for remat, p in
              [(None, None), (True, None)] +
              ([] if policy is None else [(True, policy)])]
    if then is not None and schedules:
      then(schedules[0].bytes())
    plain, per_step, *rest = [m.result() for m in others + schedules]

  def recomputed(k: _Measured) -> float:
    # XLA may find nothing to recompute; never a gain. Fewer FLOPs than
    # remat=False's is no plan's doing: said, then counted as none.
    if k.flops < plain.flops:
      tracing.LOG.warning(
          "remat=\"auto\": remat=True%s over %d steps compiled to %d FLOPs, "
          "fewer than remat=False's %d (counted as recomputing nothing; the "
          "FLOP count of this %s program may be off: please report it).",
          "" if k is per_step else ", under the policy,", length, k.flops,
          plain.flops, jax.default_backend())
    return max(0.0, (k.flops - plain.flops) / length)

  r = recomputed(per_step)
  measured: list[tuple[Key, int]] = [
      ((False, None, None, None), plain.bytes),
      ((True, None, None, None), per_step.bytes)]
  with_policy = None
  if policy is not None:
    k = rest.pop(0)
    with_policy = (policy_name(policy), k.bytes, recomputed(k))
    measured.append(((True, None, None, with_policy[0]), k.bytes))
  scheduled, constants, advance = None, (0.0, 0.0), r
  if one_slot:
    k = rest[0]
    measured.append((("binomial", 1, None, None), k.bytes))
    if k.advance_flops is not None:
      advance = float(k.advance_flops)
    guess = _slot_guess(step)
    scheduled = (k.temporaries - guess, guess)
    # A schedule's tables: a row per action, about 2·T - s of them
    # (`Schedule.table_bytes`), the most with one slot: its tables' bytes
    # bound every schedule's.
    constants = (float(k.constants), 0.0)
  return Coefficients(length, plain.bytes, per_step.bytes, scheduled,
                      constants, r, advance, with_policy, tuple(measured))


# Plans compiled to check a choice, at most: then the last choice stands.
_CHECKS = 4
# How far (a fraction of its bytes) a schedule compiled for the budget may
# lie from the line of one slot and the carry's bytes per slot, and still
# be taken as on it (`_sloped`).
_ON_THE_LINE = 0.01


def _sloped(c: Coefficients, step: tracing.Traced, consts, memory_budget: int,
            policy, here: dict[Key, "_Figures"]) -> Coefficients:
  """`c` with its schedules' line through two compiled schedules.

  The first is one slot's (`coefficients`). The second is the most slots
  the budget holds on the line of one slot's bytes and the carry's bytes
  per slot (`_second_point`), compiled: where a schedule is chosen, it is
  then the choice's check too. Where it lies off that line (within
  `_ON_THE_LINE`: XLA keeps a slot at other than the carry's bytes, as a
  bfloat16 carry's at twice or XLA:TPU a carry's padded to its tiles, or
  compiles that count of slots off the line, as near T), or where the
  budget holds fewer than two slots, the line runs through the most slots
  a candidate keeps (`_most_slots`) instead, so that every schedule's
  prediction lies between two compiles and one count's miss moves no
  other's; and, compiled beside it, the most slots the budget holds on the
  line through the two schedules compiled (`_reaimed`), the likely choice,
  so that it needs no check after.
  """
  if c.scheduled is None:
    return c
  a, guess = c.scheduled
  one = a + guess  # One slot's temporaries, compiled.
  most = _most_slots(c.length)
  slots = _second_point(c.length, memory_budget, one, c.constants[0], guess)
  if slots is None:
    return c
  got = _compiled(step, consts, c.length, ("binomial", slots, None, None),
                  policy, here)
  c = c._replace(measured=c.measured + ((("binomial", slots, None, None),
                                         got.bytes),))
  if slots != most and abs(got.temporaries - (a + guess * slots)) > (
      _ON_THE_LINE * got.temporaries):
    aimed = _reaimed(c.length, memory_budget, one, c.constants[0],
                     (slots, got.temporaries))
    plans = [("binomial", s, None, None) for s in dict.fromkeys(
        [aimed, most]) if s not in (1, slots)]
    figures = _compiled_all(step, consts, c.length, plans, policy, here)
    c = c._replace(measured=c.measured + tuple(
        (plan, f.bytes) for plan, f in zip(plans, figures)))
    slots = most
    got = _compiled(step, consts, c.length, ("binomial", most, None, None),
                    policy, here)
  per_slot = (got.temporaries - one) / (slots - 1)
  return c._replace(scheduled=(one - per_slot, per_slot))


def _second_point(length: int, memory_budget: int, one: float,
                  constants: float, guess: float) -> Optional[int]:
  """The second schedule `_sloped` compiles: the most slots `memory_budget` holds on the first line.

  That line: one slot's temporaries `one`, `guess` bytes more per slot,
  one slot's tables' `constants` (the most). At most `_most_slots`; where
  the budget holds fewer than two, `_most_slots`; None for a loop of fewer
  than four steps (one slot is the most a schedule keeps).
  """
  most = _most_slots(length)
  if most < 2:
    return None
  fits = int((memory_budget - constants - one) // max(guess, 1.0)) + 1
  return min(most, fits) if fits >= 2 else most


def _reaimed(length: int, memory_budget: int, one: float, constants: float,
             second: tuple[int, float]) -> int:
  """The most slots `memory_budget` holds on the line through one slot's temporaries `one` and the `second` schedule's (slots, temporaries).

  Where a slot's bytes are not the carry's, the second schedule, placed on
  the carry's line, is not the count the budget holds: this one, placed
  on the line of a slot's bytes as compiled, is (to within the line's
  curve).

  >>> from haiku_bridge._src.remat import plan as remat_plan
  >>> remat_plan._reaimed(64, 1000, 100, 0, (11, 400.0))  # 30 bytes a slot.
  31
  """
  slots, temporaries = second
  per_slot = (temporaries - one) / (slots - 1)
  return _second_point(length, memory_budget, one, constants, per_slot) or 1


def _slot_guess(step: tracing.Traced) -> float:
  """A slot's bytes before a second schedule is compiled: the carry's (the batch's, under `jax.vmap`), with its tangent under each forward derivative."""
  _, carry, _ = _batched(step, ([], list(step.carry), []))
  return float(pytree.nbytes(carry)) * math.prod(
      1 + at_once for kind, at_once in step.derivatives if kind == "forward")


def _checked(c: Coefficients, step: tracing.Traced, consts, choice: RematCandidate,
             policy, here: dict[Key, "_Figures"]) -> Coefficients:
  """`c` with `choice` compiled: its bytes replace its prediction, no other's."""
  got = _compiled(step, consts, c.length, key(choice), policy, here)
  return c._replace(measured=c.measured + ((key(choice), got.bytes),))


class _Figures(NamedTuple):
  """A plan compiled for a budget: its bytes (temporaries + constants), and its temporaries."""
  bytes: int
  temporaries: int


def _compiled(step: tracing.Traced, consts, length: int, plan: Key, policy,
              here: dict[Key, _Figures]) -> _Figures:
  """A plan's figures, compiled at `length` steps (the loop's gradient, as it is measured).

  For one budget's choice (or its line's second point): what one budget's
  compiles found replaces only that plan's prediction, and is kept, in
  memory and on disk, as a measurement is, by the coefficients' key and
  the plan's; and in `here`, the plans one call of `plan` compiled, with
  caches on or off.
  """
  return _compiled_all(step, consts, length, [plan], policy, here)[0]


def _compiled_all(step: tracing.Traced, consts, length: int, plans: Sequence[Key],
                  policy, here: dict[Key, _Figures]) -> list[_Figures]:
  """`_compiled` of each of `plans`: those not kept are compiled side by side (`_Compiles`), one alone."""
  memo = _memo_key(step, consts, length, policy)
  disk = _disk_key(step, consts, length, policy)

  def on_disk(plan: Key) -> Optional[str]:
    return None if disk is None else hashlib.sha256(
        repr((disk, plan)).encode()).hexdigest()

  def kept(plan: Key) -> Optional[_Figures]:
    got = here.get(plan) or _COMPILED.get((memo, plan))
    if got is None:
      try:
        got = _Figures(**(_ON_DISK.get(on_disk(plan)) or {}))
      except TypeError:  # Nothing there, or something else.
        got = None
      if got is not None and not all(
          type(v) is int for v in got):  # pylint: disable=unidiomatic-typecheck
        got = None  # A file of the right shape, not of numbers.
    return got

  def run(plan: Key) -> tuple[Any, Any]:
    """What `_measure` takes for `plan`: its schedule (or True) and policy."""
    remat, slots, groups, name = plan
    schedule: Any = True  # remat=True: measured with the coefficients.
    if remat == "binomial":
      schedule = remat_schedule.binomial(length, slots)
    elif remat == "nested":
      schedule = remat_schedule.nested(length, groups)
    return schedule, policy if name is not None else None

  found: dict[Key, _Figures] = {}
  for plan in plans:
    got = kept(plan)
    if got is not None:
      found[plan] = got
  missing = [plan for plan in plans if plan not in found]
  if len(missing) <= 1:
    measured = [_measure(step, consts, length, *run(plan), flops=False)
                for plan in missing]
  else:
    with _Compiles(step, consts, length, _compile_threads()) as compiles:
      jobs = [compiles.submit(*run(plan)) for plan in missing]
      measured = [job.bytes() for job in jobs]
  for plan, k in zip(missing, measured):
    found[plan] = _Figures(k.bytes, k.temporaries)
    _ON_DISK.put(on_disk(plan), found[plan]._asdict())
  for plan in plans:
    _COMPILED.put((memo, plan), found[plan])
    here[plan] = found[plan]
  return [found[plan] for plan in plans]


def policy_name(policy: Callable[..., bool]) -> str:
  """How a `RematCandidate` names a policy: a function's name, else its repr.

  A policy object's sets of names are written sorted: Python orders a
  set's strings by their hashes, which differ from process to process
  (`save_only_these_names("a", "b")`), and the name keys its figures on
  disk.

  >>> from haiku_bridge._src.remat import plan as remat_plan
  >>> remat_plan.policy_name(jax.checkpoint_policies.nothing_saveable)
  'nothing_saveable'
  """
  name = getattr(policy, "__name__", None)
  if name:
    return name
  if dataclasses.is_dataclass(policy) and not isinstance(policy, type):
    fields = ", ".join(f"{f.name}={_sorted_repr(getattr(policy, f.name))}"
                       for f in dataclasses.fields(policy) if f.repr)
    return f"{type(policy).__name__}({fields})"
  return repr(policy)


def _sorted_repr(value: Any) -> str:
  """`repr(value)`, a set's (or frozenset's) members in sorted order."""
  if isinstance(value, (set, frozenset)):
    members = ", ".join(sorted(map(repr, value)))
    return f"{type(value).__name__}({{{members}}})" if value else repr(value)
  return repr(value)


def _memo_key(step: tracing.Traced, consts, length: int, policy) -> Key:
  return (step.text, consts, _compiled_in(step), step.carry, step.x, policy,
          length, step.unroll, step.batch_major, step.vmaps, step.wrt,
          step.derivatives, tracing.mesh_context(), jax.default_backend())


def _compiled_in(step: tracing.Traced) -> tuple[bool, ...]:
  """Of each const, whether the programs compile it in (`tracing.Traced.known`): a key's part, where the value is not."""
  return tuple(v is not None for v in step.known)


# What the figures depend on besides the step: the code that measures them.
_MEASURING_CODE = (remat_schedule, scheduled_scan, hlo_flops, hlo_text)


def _disk_key(step: tracing.Traced, consts, length: int, policy) -> Optional[str]:
  """The coefficients' key across processes; None where a policy has no stable name.

  Everything the figures depend on: the step's jaxpr (every shape, dtype
  and operation; function addresses left out), what it takes (and which
  of the arrays it closes over are compiled in as constants), the policy,
  the length, the unroll, the vmaps around the loop, which of its inputs
  a gradient is taken of, the mesh it is planned under, the backend and device,
  the jax, jaxlib and haiku_bridge versions and the measuring code, XLA's
  flags, the compile options.
  """
  name = _stable_name(policy)
  if name is None:
    return None
  device = jax.devices()[0]
  jaxpr = re.sub(r" at 0x[0-9a-f]+", "", step.text)
  text = repr((_FORMAT, jaxpr, [(c.shape, str(c.dtype)) for c in consts],
               _compiled_in(step),
               [(c.shape, str(c.dtype)) for c in step.carry + step.x],
               name, length, step.unroll, step.batch_major, step.vmaps,
               step.wrt, step.derivatives, tracing.mesh_context(),
               jax.default_backend(),
               device.device_kind,
               getattr(device.client, "platform_version", ""),
               jax.__version__, jaxlib.__version__, _version(),
               _code_digest(), os.environ.get("XLA_FLAGS", ""),
               sorted(measuring_options().items()),
               str(jax.dtypes.canonicalize_dtype(np.int64))))  # x64 or not.
  return hashlib.sha256(text.encode()).hexdigest()


@caches.memoize(maxsize=1)
def _code_digest() -> str:
  code = hashlib.sha256()
  for module in _MEASURING_CODE + (sys.modules[__name__],):
    with open(str(module.__file__), "rb") as f:
      code.update(f.read())
  return code.hexdigest()


def _stable_name(policy) -> Optional[str]:
  """A policy's name that means the same in every process; None if it has none.

  jax's named policies, and policy objects whose repr shows their fields
  (`DotsSaveable(only_if_no_batch_dims=False)`, jax 0.10's
  `save_only_these_names`); not a closure (that policy's before) or a
  function of the user's, whose name does not say what it does.
  """
  if policy is None:
    return ""
  name = getattr(policy, "__name__", None)
  if name is not None:
    return name if getattr(jax.checkpoint_policies, name,
                           None) is policy else None
  text = policy_name(policy)
  if type(policy).__repr__ is object.__repr__ or " at 0x" in text:
    return None
  return text


def _version() -> str:
  # The package's version, without importing the package from inside it.
  return getattr(sys.modules.get("haiku_bridge"), "__version__", "")


def _to_json(c: Coefficients) -> dict[str, Any]:
  return {"format": _FORMAT, **c._asdict(),
          "measured": [[list(k), v] for k, v in c.measured]}


def _from_json(value: Optional[dict[str, Any]]) -> Optional[Coefficients]:
  """The coefficients a file held; None if it holds anything else."""
  if not value or value.get("format") != _FORMAT:
    return None
  try:
    value = {k: v for k, v in value.items() if k != "format"}
    tuples = ("scheduled", "constants", "policy")
    found = Coefficients(**{
        **value, **{k: None if value[k] is None else tuple(value[k])
                    for k in tuples},
        "measured": tuple((tuple(k), v) for k, v in value["measured"])})
  except (KeyError, TypeError, ValueError):
    return None
  return found if _well_typed(found) else None


def _well_typed(c: Coefficients) -> bool:
  """Whether every figure of `c` is a number where one is (a file's strings are not)."""
  def numbers(*values, whole=False):
    return all(isinstance(v, int if whole else (int, float)) and
               not isinstance(v, bool) for v in values)

  return (numbers(c.length, c.plain, whole=True) and
          (c.per_step is None or numbers(c.per_step, whole=True)) and
          (c.scheduled is None or (len(c.scheduled) == 2 and
                                   numbers(*c.scheduled))) and
          len(c.constants) == 2 and numbers(*c.constants) and
          numbers(c.step_flops, c.advance_flops) and
          (c.policy is None or (len(c.policy) == 3 and
                                isinstance(c.policy[0], str) and
                                numbers(c.policy[1], whole=True) and
                                numbers(c.policy[2]))) and
          all(numbers(v, whole=True) for _, v in c.measured))


def measuring_options() -> dict[str, Any]:
  """XLA options for the measuring compiles: cheaper code, the same buffers.

  On CPU, LLVM without optimisation and XLA's older fusion emitters:
  compiles about 10× faster, and neither changes the buffer assignment
  that the memory analysis reads (plan_test checks the figures
  against a compile with XLA's defaults); and the code generated in one
  piece, not split for LLVM threads, which at that level costs more CPU
  time (about a third of a compile) than it saves (the measurements
  compile side by side instead: `_Compiles`). Elsewhere, the defaults.
  jaxlib 0.11's XLA:CPU has no older emitters (nor the option: a compile
  given it fails), so there only the other two.
  """
  if jax.default_backend() != "cpu":
    return {}
  options: dict[str, Any] = {"xla_backend_optimization_level": 0,
                             "xla_cpu_parallel_codegen_split_count": 1}
  if OLDER_FUSION_EMITTERS:
    options["xla_cpu_use_fusion_emitters"] = False
  return options


# Whether XLA:CPU has its older fusion emitters, and the option that picks
# them: before jaxlib 0.11.
OLDER_FUSION_EMITTERS = versions.release(jaxlib.__version__) < (0, 11)


class _Measured(NamedTuple):
  bytes: int  # temporaries + constants.
  temporaries: int
  constants: int  # Bytes of the program's array constants (a schedule's tables).
  flops: int
  advance_flops: Optional[int]  # With a schedule.


def _measure(step: tracing.Traced, consts, length: int, remat, policy=None, *,
             flops: bool = True) -> _Measured:
  """Compiled bytes and FLOPs of the VJP of `length` steps, run as `remat` says.

  One program, compiled here (`_Compiles` compiles several side by side);
  `flops=False`: bytes only (FLOPs 0).
  """
  return _read(_compile(_lower(step, consts, length, remat, policy)), remat,
               flops)


class _Compiles:
  """Measuring programs, lowered here and compiled in `threads` threads.

  Each program is traced and lowered by `submit`, one after another
  (Python, under the GIL), and compiled in a thread (XLA compiles without
  the GIL): the next program lowers while the last compiles, and the
  compiles run side by side on the cores the lowering leaves
  (`_compile_threads`). Each figure is its own program's, so the figures
  are those of compiling them one by one (plan_test checks it). Each
  thread runs in the caller's context (`contextvars`): an error there
  names the public call as one here would. With no thread, `submit`
  compiles before it returns.
  """

  def __init__(self, step: tracing.Traced, consts, length: int, threads: int):
    self._args = step, consts, length
    self._pool = (concurrent.futures.ThreadPoolExecutor(
        threads, thread_name_prefix="remat_plan") if threads else None)

  def __enter__(self) -> "_Compiles":
    return self

  def __exit__(self, *exc_info) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True)

  def submit(self, remat, policy=None) -> "_Measurement":
    """The figures of the program `remat` (under `policy`) runs, to come."""
    lowered = _lower(*self._args, remat, policy)
    if self._pool is not None:
      return _Measurement(self._pool.submit(
          contextvars.copy_context().run, _bytes_of, lowered), remat)
    done: concurrent.futures.Future[tuple[_Measured, str]] = (
        concurrent.futures.Future())
    done.set_result(_bytes_of(lowered))
    return _Measurement(done, remat)


def _bytes_of(lowered) -> tuple[_Measured, str]:
  """A measuring program compiled, its bytes and its HLO text: a compiling thread's work."""
  return _bytes_read(_compile(lowered))


class _Measurement:
  """A measuring program's figures to come (`_Compiles.submit`).

  Its bytes as soon as it is compiled; its FLOPs counted by the thread
  that asks for them (`result`). A count walks the program in Python,
  under the GIL: in a compiling thread it held up the lowering on the
  caller's thread and the compiles queued behind it (one slot's count
  took 30-60 ms there, cold, on the planning benchmark's conv stack).
  """

  def __init__(self, job: "concurrent.futures.Future[tuple[_Measured, str]]",
               remat):
    self._job, self._remat = job, remat

  def bytes(self) -> _Measured:
    """The program's bytes (FLOPs 0, no advance)."""
    return self._job.result()[0]

  def result(self) -> _Measured:
    """Bytes and FLOPs (an error of the compiling thread is raised here)."""
    return _counted(*self._job.result(), self._remat)


def _compile_threads() -> int:
  """Threads that compile measurements at once: a core each but the one the caller lowers on, one at least.

  (One per core was 2.4% slower cold on the planning benchmark's
  transformer, 2 cores: the lowering, under the GIL, shared its core.)
  """
  return max(1, (os.cpu_count() or 1) - 1)


def _lower(step: tracing.Traced, consts, length: int, remat, policy=None):
  """The program `_measure` compiles, lowered: the VJP of `length` steps run as `remat` says.

  `remat`: None (plain scan), True (checkpointed step, under `policy`), or
  a `remat_schedule.Schedule`. A loop with nothing to differentiate is
  compiled forward only.
  """
  # A schedule's program runs the step as one jit, as `scheduled_scan` runs
  # the loop's own; remat=False's and True's as the loop's scan and
  # `jax.checkpoint` run it, equation by equation (a jit would change their
  # programs: a policy's `saveable` sees no equation inside it, and jaxlib
  # 0.11's XLA keeps a checkpointed jit's carries otherwise).
  call = (tracing.as_function(step.jaxpr) if remat is None or remat is True
          else step.call)

  def body(consts, carry, x):
    out = call(*consts, *carry, *x)
    return out[:len(step.carry)], out[len(step.carry):]

  def scan(consts, carry, xs):
    f = lambda c, x: body(consts, c, x)
    if remat is None:
      return jax.lax.scan(f, carry, xs, length=length, unroll=step.unroll)
    if remat is True:
      return jax.lax.scan(jax.checkpoint(f, policy=policy), carry, xs,
                          length=length, unroll=step.unroll)
    return scheduled_scan.scan(f, carry, xs, length=length, schedule=remat,
                               unroll=step.unroll)

  def run(consts, carry, xs):
    if not step.batch_major:
      return scan(consts, carry, xs)
    # The loop's own copies: its inputs made time-major, its outputs made
    # batch-major again (`hkb.dynamic_unroll(time_major=False)`).
    carry, ys = scan(consts, carry, pytree.swap_batch_time(xs))
    return carry, pytree.swap_batch_time(ys)

  def vmapped(program, vmaps):
    for size, _, *dims in vmaps:  # Innermost first.
      program = jax.vmap(program, in_axes=tuple(list(d) for d in dims),
                         axis_size=size)
    return program

  # The loop's vmaps (`Traced.vmaps`): those the gradient is taken around run the
  # loop, the others the training step.
  of_the_batch = [v for v in step.vmaps if v[1]]
  per_example = [v for v in step.vmaps if not v[1]]

  def train(consts, carry, xs):
    # A loss of the outputs, as a training step has one: the ys are made
    # and kept for it, and their cotangent made from them (a loss in the
    # step returns small ys, and this costs little).
    args, taken = (consts, carry, xs), step.wrt

    def loss(*leaves):
      # Of the batch's outputs, outside the vmaps, where a loss of the
      # outputs a vmap returns takes them: moved to the vmap's axis first,
      # a copy a loss taken inside the vmap, per example, does not make
      # (which the plan cannot see): that one is over-predicted by it.
      out = _on_leaves(vmapped(run, of_the_batch), args, taken)(*leaves)
      return sum(jnp.sum(jnp.square(o.astype(jnp.float32))) for o in out)
    leaves = [a for a, t in zip(jax.tree.leaves(args), taken) if t]
    argnums = tuple(range(len(leaves)))
    # The loss's value is an output too, as a training step (value_and_grad)
    # returns it: with it, XLA:CPU keeps one more copy of the outputs at
    # some sizes (ys of about 2.5-16 KB: 1.43× a GRU's temporaries at 48
    # steps), which a gradient alone does not.
    derivative = loss
    for i, (kind, at_once) in enumerate(step.derivatives):  # Outward.
      derivative = _derived(derivative, kind, at_once, argnums, i == 0)
    value, grads = derivative(*leaves)
    # The gradients of the weights (consts, xs) are the step's outputs, as
    # a training step returns them; the carry's feeds what came before the
    # loop (or nothing), so it is a temporary, as there.
    first = sum(taken[:len(consts)])
    end = first + sum(taken[len(consts):len(consts) + len(carry)])
    return (value, list(grads[:first]) + list(grads[end:]),
            _total(grads[first:end]))

  def stack(x):
    """A step's slice `x` stacked `length` times, on its time axis."""
    at = 1 if step.batch_major and x.shape else 0
    spec = tracing.spec_over(x, x.sharding.mesh) if x.sharding else ()
    sharding = x.sharding and jax.sharding.NamedSharding(
        x.sharding.mesh, jax.sharding.PartitionSpec(*spec[:at], None,
                                                    *spec[at:]))
    return jax.ShapeDtypeStruct(x.shape[:at] + (length,) + x.shape[at:],
                                x.dtype, sharding=sharding)

  stacked = [stack(x) for x in step.x]
  program = (vmapped(train, per_example) if tracing.differentiable(step)
             else vmapped(run, step.vmaps))
  consts, carry, xs = _batched(step, (list(consts), list(step.carry),
                                      stacked))

  def closing_over_known(traced, carry, xs):
    # The consts that are no tracer compiled in, as the user's program has
    # them (`tracing.Traced.known`); the rest arguments.
    it = iter(traced)
    return program([next(it) if v is None else v for v in step.known],
                   carry, xs)
  return jax.jit(closing_over_known).lower(
      [c for c, v in zip(consts, step.known, strict=True) if v is None],
      carry, xs)


def _compile(lowered):
  """A measurement's program compiled, with `measuring_options`: every measuring compile passes here."""
  return lowered.compile(measuring_options())


def _read(compiled, remat, flops: bool = True) -> _Measured:
  """A compiled measurement's figures.

  The FLOPs count every loop by its trip count (only `remat=True`'s and
  `None`'s are used), and a conditional of the step (`jax.lax.cond`) by
  its dearest branch, which the run may take at every step: what a plan
  recomputes, bounded from above; a schedule's conditional, which its
  backward sweep runs once per action (more often than any in the step),
  gives an advance's FLOPs: its cheaper branch. With `flops=False` (a plan compiled
  for its bytes only) nothing is counted: FLOPs 0, no advance.
  """
  figures, text = _bytes_read(compiled)
  return _counted(figures, text, remat) if flops else figures


def _bytes_read(compiled) -> tuple[_Measured, str]:
  """A compiled measurement's bytes (FLOPs 0, no advance), and its HLO text."""
  text = compiled.as_text()
  held = hlo_flops.held(compiled, text)
  return _Measured(held.bytes, held.temporaries, held.constants, 0,
                   None), text


def _counted(figures: _Measured, text: str, remat) -> _Measured:
  """`figures` with the FLOPs of the compiled program `text` (`_read`)."""
  count = hlo_flops.count(text, dearest=True)
  schedule = max(count.conditionals, key=lambda c: c.executions,
                 default=None)
  return figures._replace(
      flops=count.flops,
      advance_flops=(None if remat in (None, True) or schedule is None
                     else min(schedule.branches)))


def _floats(tree):
  return [leaf for leaf in jax.tree.leaves(tree) if tracing.is_float(leaf)]


def _on_leaves(fn, args, taken: Sequence[bool]):
  """`fn(*args)`'s float leaves, as a function of the leaves of `args` that `taken` marks only."""
  leaves, tree = jax.tree.flatten(args)

  def g(*chosen):
    it = iter(chosen)
    full = [next(it) if t else leaf for leaf, t in zip(leaves, taken)]
    return _floats(fn(*tree.unflatten(full)))
  return g
