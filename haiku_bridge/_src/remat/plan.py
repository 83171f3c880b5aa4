"""`remat="auto"`: the plan with the least recomputation whose memory fits a budget, and its public API (`hkb.remat_plan`, `hkb.remat_plans`, `RematPlan`, `RematCandidate`).

A scan's backward pass can keep every step's activations (`remat=False`),
one carry per step (`remat=True`), what a `remat_policy` saves of each step
(`remat=True` with the policy the user gives), or a schedule's few carries
(`"nested"`, `"binomial"`: `schedule.py`), each trading recomputed
FLOPs for memory. Which one fits depends on things a user cannot see: how
the step's activations compare with its carry, the length, where the loss
sits. `plan` predicts, for every candidate, the bytes a training step of
the loop needs and the FLOPs it recomputes, chooses, and checks the choice
compiled, each job in a module of its own:

* `tracing.py`: the loop's step traced, and what surrounds the loop (the
  derivatives, vmaps and mesh it runs under; which inputs are data);
* `measure.py`: the loop's training step compiled for a few plans and read,
  and every candidate's bytes and recomputed FLOPs predicted from them;
* `plan_cache.py`: those measurements kept, in memory and on disk, under
  keys of everything they depend on;
* `choice.py`: the candidate chosen for the budget and checked compiled,
  or the refusal that names the least budget.

What the budget counts: `remat_plan`'s `memory_budget`. The plan is made
for the loop as it runs: under the vmaps, derivatives and mesh around it;
a loop with nothing to differentiate (no float reaches a float output) has
one plan, the plain loop. The same shapes, policy and budget make the same
plan in any process.

What users see: `remat_plan` (public) returns the `RematPlan` of a JAX step,
or of one of the bridge's loops (`plannable`) with its arguments, which it
runs until the loop has made its plan (`Planned` carries it out, the loop
not run); every plan a loop makes passes `loop_plan`, which logs it at
INFO on the `haiku_bridge.remat` logger, and `remat_plans` collects.
"""

import contextlib
import contextvars
import functools
import gc
import logging
import time
from typing import Any, Callable, Iterator, Optional, TypeVar

import jax
import numpy as np

from haiku_bridge._src import caches
from haiku_bridge._src import errors
from haiku_bridge._src import guards
from haiku_bridge._src.remat import choice
from haiku_bridge._src.remat import tracing
from haiku_bridge._src.pytree import PyTree

# The public names of a plan, each defined with its job (a candidate's cost:
# measure.py; the plan chosen: choice.py), imported from here
# (`remat/__init__.py`).
from haiku_bridge._src.remat.choice import RematPlan
from haiku_bridge._src.remat.measure import RematCandidate  # noqa: F401  # pylint: disable=unused-import


def remat_plan(
  f: Callable[..., Any],
  *args: Any,
  memory_budget: int,
  remat_policy: Optional[Callable[..., bool]] = None,
  max_recompute: Optional[float] = None,
  **options: Any,
) -> RematPlan:
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
      gradients, nor the rest of the step, which come on top. The loops'
      `memory_budget=` counts the same (docs/remat.md, "What the budget
      counts"); `hkb.budgeted_jit` budgets a whole step.
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
    errors.check_callable(
      "f",
      f,
      "a function `f(carry, x) -> (carry, y)`, "
      "or one of the bridge's loops (hkb.dynamic_unroll, "
      "...)",
    )
    memory_budget = check_budget(memory_budget)
    max_recompute = check_max_recompute(max_recompute)
    if remat_policy is not None:
      errors.check_callable(
        "remat_policy", remat_policy, "None or a jax.checkpoint_policies policy"
      )
    if _loop_of(f) is not None:
      return _plan_of_loop(f, args, options, memory_budget, remat_policy, max_recompute)
    try:
      init, xs, length = _scan_arguments(*args, **options)
    except TypeError:
      raise TypeError(
        errors.message(
          "for a function `f`, takes `(f, init, xs, *, memory_budget, "
          f"length=None, remat_policy=None, max_recompute=None)`; got {len(args)} positional "
          f"arguments after `f` and the keywords {sorted(options)}. For a "
          "Haiku layer, core or step, pass its loop first: e.g. "
          "hkb.remat_plan(hkb.dynamic_unroll, core, xs, state, "
          "memory_budget=...)."
        )
      ) from None
    leaves = jax.tree_util.tree_leaves_with_path(xs)
    if length is None:
      if not leaves or not np.ndim(leaves[0][1]):
        raise ValueError(
          errors.message(
            "xs holds no arrays with a leading time axis, so the number of "
            "steps is unknown: pass `length=`."
          )
        )
      length = int(np.shape(leaves[0][1])[0])
    length = errors.check_positive_int("length", length)
    for path, leaf in leaves:
      if not np.ndim(leaf) or np.shape(leaf)[0] != length:
        raise ValueError(
          errors.message(
            f"xs{jax.tree_util.keystr(path)} has shape {np.shape(leaf)}, but "
            f"every leaf of xs needs a leading axis of {length} steps."
          )
        )
    return plan(f, init, xs, length, memory_budget, remat_policy, max_recompute)


def _scan_arguments(
  init: PyTree, xs: PyTree, *, length: Optional[int] = None
) -> tuple[Any, Any, Any]:
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


def deferrable() -> bool:
  """Whether a loop planned now may defer its refusal (`refusal`) to a differentiation: no derivative is seen around it, and no `remat_plan` call asks for its plan."""
  return not _WANTED.get() and tracing.innermost_derivative() is None


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
_RECORDING: contextvars.ContextVar[tuple[list[RematPlan], ...]] = contextvars.ContextVar(
  "remat_plan.recording", default=()
)


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


def _plan_of_loop(
  loop: Callable[..., Any],
  args: tuple[Any, ...],
  options: dict[str, Any],
  memory_budget: int,
  policy: Optional[Callable[..., bool]],
  max_recompute: float,
) -> RematPlan:
  """The plan `loop(*args, remat="auto", **options)` makes, the loop not run."""
  name = getattr(_loop_of(loop), "__name__", "the loop")
  if "remat" in options:
    raise ValueError(
      errors.message(
        f"plans hkb.{name} with `remat=\"auto\"`: pass the loop's arguments "
        f"without `remat=` (got remat={options['remat']!r})."
      )
    )
  if guards.initialising():
    raise ValueError(
      errors.message(
        f"plans hkb.{name} at apply, where its params exist: at init "
        "(hk.transform(f).init) a loop runs no backward pass and plans "
        "nothing. Call it in a function you apply with the model's params."
      )
    )
  token = _WANTED.set(True)
  try:
    loop(
      *args,
      remat="auto",
      memory_budget=memory_budget,
      remat_policy=policy,
      max_recompute=max_recompute,
      **options,
    )
  except Planned as planned:
    return planned.plan
  finally:
    _WANTED.reset(token)
  raise ValueError(errors.message(f"hkb.{name} made no plan: it ran no loop with steps to plan."))


def loop_plan(
  f: Callable[..., Any],
  init: PyTree,
  xs: PyTree,
  length: int,
  memory_budget: int,
  policy: Optional[Callable[..., bool]] = None,
  max_recompute: float = choice.MAX_RECOMPUTE,
  unroll: int | bool = 1,
  batch_major: bool = False,
) -> RematPlan:
  """The plan a loop's `remat="auto"` runs (`loop.resolved`), logged.

  Every plan a loop makes passes here: it is logged at INFO on the
  `haiku_bridge.remat` logger (`str(plan)`: the choice and the table), and
  under `remat_plan(loop, ...)` it goes to that call instead of running.
  """
  # A loop inside this one's step plans for itself, unasked.
  token = _WANTED.set(False)
  try:
    made = plan(f, init, xs, length, memory_budget, policy, max_recompute, unroll, batch_major)
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
      errors.bad_argument("memory_budget", memory_budget, "a positive int, in bytes")
    )
  return int(memory_budget)


def check_max_recompute(max_recompute: Any) -> float:
  """`max_recompute`, a number ≥ 0 of forward passes; None: `choice.MAX_RECOMPUTE`."""
  if max_recompute is None:
    return choice.MAX_RECOMPUTE
  number = isinstance(max_recompute, (int, float, np.integer, np.floating)) and not isinstance(
    max_recompute, (bool, np.bool_)
  )
  if not number or not max_recompute >= 0:
    raise (ValueError if number else TypeError)(
      errors.bad_argument(
        "max_recompute",
        max_recompute,
        "a number ≥ 0: the forward passes of the loop its backward pass may "
        "run again (remat=True runs 1; math.inf allows any)",
      )
    )
  return float(max_recompute)


def plan(
  f: Callable[..., Any],
  init: PyTree,
  xs: PyTree,
  length: int,
  memory_budget: int,
  policy: Optional[Callable[..., bool]] = None,
  max_recompute: float = choice.MAX_RECOMPUTE,
  unroll: int | bool = 1,
  batch_major: bool = False,
) -> RematPlan:
  """`remat_plan` of checked arguments (the loop's `remat="auto"`).

  The prediction steers, the compiled program decides: the choice is
  compiled at `length` steps (the loop's gradient, as it is measured) and,
  when its temporaries and constants are over the budget, the next
  candidate is chosen, the compiled bytes replacing that plan's prediction.
  A line at INFO on the `haiku_bridge.remat` logger says when planning
  starts, and one when it ends: at WARNING, which default logging shows,
  where it took `SLOW_PLAN_SECONDS` or more.
  Every program is measured with the loop's `unroll` (`jax.lax.scan`'s):
  an unrolled loop keeps other buffers (a residual stack of 16 layers,
  unroll=2: 5.4× the bytes of one slot's schedule rolled); with
  `batch_major`, with the copies of the inputs and outputs its caller makes
  (`hkb.dynamic_unroll(time_major=False)`: a batch-major GRU over 512 steps
  compiled to 2.1× one slot's schedule without them).
  """
  tracing.LOG.info(
    'remat="auto": planning %d steps for memory_budget=%d bytes (compiling the loop\'s '
    "training step for a few plans)...",
    length,
    memory_budget,
  )
  start = time.perf_counter()
  with _no_cyclic_gc():
    step, consts = tracing.trace(f, init, xs, length, unroll, batch_major)
    made = choice.checked_plan(step, consts, length, memory_budget, policy, max_recompute)
  _log_planned(made, time.perf_counter() - start)
  return made


# Planning slower than this, seconds, says so at WARNING, which Python's
# default logging shows: a user who waits sees why.
SLOW_PLAN_SECONDS = 2.0


def _log_planned(made: RematPlan, seconds: float) -> None:
  """The line that ends a plan (`plan`): at INFO, or at WARNING when it took `SLOW_PLAN_SECONDS` or more."""
  tracing.LOG.log(
    end_level(seconds),
    'remat="auto": planned %d steps in %.1f s: chose %s, %d bytes for memory_budget=%d '
    "bytes (str(plan) or hkb.remat_plans() for the table). %s",
    made.length,
    seconds,
    made.choice.describe(),
    made.choice.temporaries,
    made.memory_budget,
    where_kept("What it measured", "this loop"),
  )


def end_level(seconds: float) -> int:
  """The level of a line that ends planning after `seconds`: INFO, or WARNING (which Python's default logging shows) from `SLOW_PLAN_SECONDS` on."""
  return logging.WARNING if seconds >= SLOW_PLAN_SECONDS else logging.INFO


def where_kept(what: str, planned: str) -> str:
  """The end line's sentence on where `what` is kept, so that a process planning `planned` again reads it (or that nothing is kept)."""
  kept = caches.directory()
  if kept:
    return f"{what} is kept on disk ({kept}): a process that plans {planned} again reads it."
  return (
    "Nothing is kept on disk (caches off, or HAIKU_BRIDGE_CACHE_DIR set empty): "
    "each process measures again."
  )


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
