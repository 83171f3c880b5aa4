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
training step, compiled as `measure.py` builds it (the value and gradient of
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
`measure.most_slots`), so that a slot's cost is measured, never assumed, and
beside it the count the budget holds on the line through the two
schedules compiled, the likely choice (`_reaimed`). So a budget that a
schedule fits costs four compiles (five with a policy), where the carry's
bytes are a slot's, six where they are not, three in turn;
all at T, so that what XLA does only for long loops (or short ones:
unrolling, double buffering) is in every figure; with XLA's cheaper code
generation (`measuring_options`), which leaves buffers as they are, each
program lowered while the last compiles in a thread, as many compiling at
once as there are cores (`measure.py`): one slot's first, so that the
budget's second schedule lowers as soon as its figures are in, while
remat=False's and remat=True's compile.

Predictions steer; the compiled program decides. The choice, unless it
was one of the programs measured, is compiled too, and when it is over the
budget the next candidate is chosen, the compiled bytes replacing that
plan's prediction only (at most `_CHECKS` compiles; then the first compiled plan that
fits, or an error). Compiled for their bytes only, those and the line's
second point are not read for FLOPs.

Recomputed FLOPs come from the same compiles, counted with every loop by
its trip count (`measure.py`). The choice is the candidate with the least recomputed FLOPs whose
bytes fit (then the fewest recomputed steps, then the least memory), among
those that recompute at most `max_recompute` forward passes of the loop
(`MAX_RECOMPUTE`, 3, by default: see `choose`).

The measurements are kept in memory and on disk (`plan_cache.py`), keyed
on everything they depend on; the choice follows from them and the budget,
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

import contextlib
import contextvars
import functools
import gc
import math
from typing import Any, Callable, Iterator, NamedTuple, Optional, TypeVar

import haiku as hk
import jax
import numpy as np

from haiku_bridge._src import errors
from haiku_bridge._src import guards
from haiku_bridge._src.remat import measure
from haiku_bridge._src.remat import plan_cache
from haiku_bridge._src.remat import schedule as remat_schedule
from haiku_bridge._src.remat import tracing
from haiku_bridge._src.pytree import PyTree
# The public names defined with their job, imported from here (`remat/__init__.py`).
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
  here: dict[measure.Key, measure.Figures] = {}  # The plans this call compiled.

  def second(one: measure.Measured) -> None:
    # Lowered and compiled while the other measurements compile.
    slots = _second_point(length, memory_budget, one.temporaries,
                          one.constants, measure.slot_guess(step))
    if slots is not None:
      _compiled(step, consts, length, ("binomial", slots, None, None),
                policy, here)

  c = _sloped(plan_cache.coefficients(step, consts, length, policy, second), step,
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


def _checked_choice(c: measure.Coefficients, step: tracing.Traced, consts,
                    memory_budget: int, policy, max_recompute: float,
                    here: dict[measure.Key, measure.Figures]) -> RematPlan:
  """The plan `c` chooses for `memory_budget`, compiled to check it (`plan`)."""
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


def choose(c: measure.Coefficients, length: int, memory_budget: int,
           max_recompute: float = MAX_RECOMPUTE) -> RematPlan:
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
    most = min(measure.most_slots(length),
               int((memory_budget - a - k0 - k1 * length) //
                   max(per_slot, 1.0)))
    for slots in range(most, max(0, most - _SLOT_SEARCH), -1):
      fits = measure.binomial(c, length, slots)
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


def _raise_over_recompute(c: measure.Coefficients, candidates: list[RematCandidate],
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


def _least_within(c: measure.Coefficients, candidates: list[RematCandidate],
                  length: int, max_recompute: float) -> int:
  """The least bytes of a plan recomputing at most `max_recompute` forward passes: the least budget a call with that bound takes."""
  within = [k for k in candidates
            if k.recomputed_steps <= max_recompute * length]
  spare = max_recompute * length - length  # A schedule's advances.
  if c.scheduled is not None and spare >= 0:
    # The fewest slots within the bound: a schedule's least memory there.
    within.append(measure.binomial(c, length, remat_schedule.fewest_binomial_slots(
        length, int(min(spare, length * length)))))
  return min(k.temporaries for k in within)  # remat=False is always within.


# The counts of slots below the most the slots alone allow that `choose`
# tries, at most.
_SLOT_SEARCH = 64


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


# Plans compiled to check a choice, at most: then the last choice stands.
_CHECKS = 4
# How far (a fraction of its bytes) a schedule compiled for the budget may
# lie from the line of one slot and the carry's bytes per slot, and still
# be taken as on it (`_sloped`).
_ON_THE_LINE = 0.01


def _sloped(c: measure.Coefficients, step: tracing.Traced, consts, memory_budget: int,
            policy, here: dict[measure.Key, measure.Figures]) -> measure.Coefficients:
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
  most = measure.most_slots(c.length)
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
    figures = plan_cache.compiled(step, consts, c.length, plans, policy, here)
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
  most = measure.most_slots(length)
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


def _checked(c: measure.Coefficients, step: tracing.Traced, consts, choice: RematCandidate,
             policy, here: dict[measure.Key, measure.Figures]) -> measure.Coefficients:
  """`c` with `choice` compiled: its bytes replace its prediction, no other's."""
  got = _compiled(step, consts, c.length, measure.key(choice), policy, here)
  return c._replace(measured=c.measured + ((measure.key(choice), got.bytes),))


def _compiled(step: tracing.Traced, consts, length: int, plan: measure.Key, policy,
              here: dict[measure.Key, measure.Figures]) -> measure.Figures:
  """A plan's figures, compiled at `length` steps, or kept (`plan_cache.compiled`)."""
  return plan_cache.compiled(step, consts, length, [plan], policy, here)[0]
