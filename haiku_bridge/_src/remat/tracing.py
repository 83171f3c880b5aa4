"""The loop's step as JAX traces it, and what the trace shows around the loop: the only module of remat/ that reads JAX's internals.

`trace` traces a loop's step once, on one step's shapes, to a jaxpr of
(consts, carry, x) (`Traced`), and reads from JAX's tracers what surrounds
the loop: the derivatives taken of it, innermost first
(`innermost_derivative`, `derivative_kind`), which of its inputs a gradient
is taken of (data gets no cotangent), the `jax.vmap`s around it, the mesh of
Explicit axes its values are sharded over, and which arrays it closes over a
`jax.jit` compiles in. The measuring programs (`measure.py`) are built from
it, and the caches' keys (`plan_cache.py`) read it.

JAX keeps these facts in `jax._src` (its tracers, `jvp_jaxpr`, `dce_jaxpr`,
the switch of varying manual axes), `jax.extend.core` and `jax.interpreters`
(jaxprs, the trace stack): every read of them in remat/ is here, each
written against the jax releases the library supports, so that a release
that moves one changes this module alone. `py` asks here
which derivative it runs under.

What a plan cannot see is said here too, at WARNING on the
`haiku_bridge.remat` logger (`LOG`), once a process: a loop inside a JAX
loop that a gradient is taken around, and a loop under Auto mesh axes.
"""

import contextlib
import contextvars
import functools
import logging
import sys
import types
from typing import Any, Callable, ContextManager, Iterator, NamedTuple, Optional, Sequence

import jax
from jax._src import config as jax_config  # pylint: disable=g-bad-import-order
from jax._src.interpreters import batching as jax_batching  # pylint: disable=g-bad-import-order
from jax._src.interpreters import ad as jax_ad  # pylint: disable=g-bad-import-order
from jax._src.interpreters import partial_eval as jax_pe  # pylint: disable=g-bad-import-order
from jax.extend import core as jax_core
import jax.numpy as jnp

from haiku_bridge._src import versions

# The remat machinery's logger, "haiku_bridge.remat": each plan a loop makes
# at INFO (`plan.loop_plan`), each compile of `hkb.budgeted_jit`, and what a
# plan cannot see at WARNING.
LOG = logging.getLogger("haiku_bridge.remat")

# A jaxpr (jax.extend.core's types, for the annotations of the modules that
# take one from here).
Jaxpr = jax_core.Jaxpr
ClosedJaxpr = jax_core.ClosedJaxpr

# The aval of one step's slice of a scanned array. In jax.extend.core from jax
# 0.9 on; only in jax.core before (jax 0.6-0.8), and no longer there in 0.10.
# (`getattr` with a constant name: jax.core lacks it on the jax that never reads it.)
mapped_aval = getattr(jax_core, "mapped_aval", None) or getattr(jax.core, "mapped_aval")  # noqa: B009
# The trace the code runs under (jax.extend.core from jax 0.9; jax.core before).
current_trace = getattr(jax_core, "find_top_trace", None) or getattr(jax.core, "find_top_trace")  # noqa: B009


def innermost_derivative() -> Any:
  """The innermost trace taking a derivative around this call (`derivative_kind`), through vmaps; None where none is seen.

  A trace that stages code to differentiate later (`jax.jit`, a scan's
  body) hides what is around it: its values are its own tracers, whatever
  the derivative outside it is taken of.
  """
  for trace in outward(current_trace(())):
    if derivative_kind(trace) is not None:
      return trace
    if type(trace).__name__ != "BatchTrace":
      return None
  return None


def outward(trace: Any) -> Iterator[Any]:
  """`trace`, then each trace it runs in (its `parent_trace`), innermost first."""
  while trace is not None:
    yield trace
    trace = getattr(trace, "parent_trace", None)


def derivative_kind(trace: Any) -> Optional[str]:
  """ "forward" or "reverse", the mode of the derivative `trace` takes; None for a trace that takes none.

  A JVP trace is forward mode, but over a partial-evaluation trace (reverse
  mode before direct linearization); a linearize trace is reverse mode,
  but where it is not for a VJP (`jax.linearize`, from jax 0.9).
  """
  if isinstance(trace, jax_ad.JVPTrace):
    return (
      "reverse"
      if type(getattr(trace, "parent_trace", None)).__name__ == "JaxprTrace"
      else "forward"
    )
  if type(trace).__name__ == "LinearizeTrace":
    return "forward" if getattr(trace, "is_vjp", True) is False else "reverse"
  return None


def consts_as_inputs(jaxpr: Jaxpr) -> ClosedJaxpr:
  """`jaxpr` with its consts as its first inputs, closed over no value."""
  return jax_core.ClosedJaxpr(
    jaxpr.replace(constvars=[], invars=jaxpr.constvars + jaxpr.invars), ()
  )


def as_function(jaxpr: ClosedJaxpr) -> Callable[..., Any]:
  """`jaxpr` as a function of its inputs, each equation bound as it is written (jax's `jaxpr_as_fun`)."""
  return jax_core.jaxpr_as_fun(jaxpr)


def traced_for_forward_mode() -> bool:
  """Whether JAX traces a custom_vjp's forward rule for a JVP (forward mode).

  A JVP trace's `process_custom_vjp_call` runs the forward rule and then
  refuses to go on; a linearize trace (reverse mode), or a JVP trace over a
  partial-evaluation trace (reverse mode before direct linearization), runs
  it for a VJP. The rule is traced under the parent trace, so only the
  callers' frames say which. A JVP trace is reverse mode too where a
  linearize or partial-evaluation trace called it: `jax.checkpoint` (and
  `hk.remat`) linearizes its body through a JVP (`jax.grad(jax.checkpoint(f))`).
  When unsure this says no, and forward mode gets JAX's own error.
  """
  frame: Optional[types.FrameType]
  frame = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None and frame.f_code.co_name != "process_custom_vjp_call":
    frame = frame.f_back
  if frame is None:
    return False
  trace = frame.f_locals.get("self")
  if not isinstance(trace, jax_ad.JVPTrace):
    return False
  if type(getattr(trace, "parent_trace", None)).__name__ == "JaxprTrace":
    return False
  while frame is not None:
    caller = type(frame.f_locals.get("self")).__name__
    if caller in ("LinearizeTrace", "JaxprTrace"):
      return False
    frame = frame.f_back
  return True


class Traced(NamedTuple):
  """The step as a jaxpr of (consts, carry, x), with the avals it takes."""

  jaxpr: ClosedJaxpr  # Consts abstracted into inputs.
  num_consts: int
  carry: tuple[jax.ShapeDtypeStruct, ...]
  x: tuple[jax.ShapeDtypeStruct, ...]  # One step's slice.
  # The jaxpr as printed, once: the caches' keys (`plan_cache.py`).
  text: str
  # The jaxpr as one `jax.jit`, a schedule's step in `measure.py`'s programs: bound as one
  # equation at each of the step's places (the sweeps, an advance, the
  # backward step), as `scheduled_scan` binds the loop's own step, it is
  # traced and differentiated once for every schedule measured, and
  # lowered once per program. XLA inlines it.
  call: Callable[..., Any]
  # `jax.lax.scan`'s unroll, as the loop runs: every measuring program's.
  unroll: int | bool = 1
  # Whether the loop's caller swaps its inputs and outputs between
  # batch-major and time-major around it (`hkb.dynamic_unroll` with
  # `time_major=False`): copies of the inputs and outputs, measured too.
  batch_major: bool = False
  # The `jax.vmap`s the loop runs under, innermost first (`_vmaps`): each
  # one's size, whether the gradient is taken outside it (of the batch's
  # loss) or inside (one per example), and the batch dimension of every
  # const, carry and xs leaf there (None: not batched by it). The loop's
  # program is theirs: every measuring program runs under them, on the
  # batch's shapes.
  vmaps: tuple[tuple[Any, ...], ...] = ()
  # Of each input of `jaxpr` (consts, carry, x), whether the measuring
  # programs differentiate it, as the user's step does: a float input
  # that reaches an output other than through `jax.lax.stop_gradient`
  # (`_reaching`; a layer scan's Haiku state does not), and that the
  # gradient around the loop is taken of (`_wrt`): not data (a batch of
  # inputs, weights under `jax.lax.stop_gradient` outside the step). Where
  # no gradient is seen around the loop (`hkb.remat_plan` called outside
  # one), every input that reaches an output, as in a training step of the
  # loop's own. Where none is, nothing is kept for a backward pass, and the
  # loop is measured forward only.
  wrt: tuple[bool, ...] = ()
  # The derivatives the loop runs under, innermost first, each with how
  # many are taken at once under a vmap (`_derivatives`): its gradient
  # ("reverse"; a Jacobian's rows by `jax.jacrev` at once), then any of
  # that: "reverse" (a gradient of the gradient, a meta-gradient),
  # "forward" (a Hessian-vector product; `jax.hessian`'s columns at once).
  # The measuring programs take them too (`no_schedules`: where none is
  # a candidate).
  derivatives: tuple[tuple[str, int], ...] = (("reverse", 1),)
  # Of each const, its value where it is no tracer (an array the step closes
  # over, as a numpy mask or table) and the loop is staged: a `jax.jit`
  # around the loop compiles it into the program as a constant, and XLA
  # copies it into each loop that reads it (the forward sweep, and a
  # backward pass that recomputes), so the measuring programs close over it
  # too (`_compiled_constants`); None for a traced value, which they take
  # as an argument, as the loop takes params. Which are known is part of
  # the caches' keys (`plan_cache.py`), their values not: the bytes depend
  # on the shapes alone.
  known: tuple[Any, ...] = ()


def trace(
  f, init, xs, length, unroll: int | bool = 1, batch_major: bool = False
) -> tuple[Traced, tuple[Any, ...]]:
  """`f` traced once on one step's shapes; what it closes over, abstracted."""
  carry, carry_tree = jax.tree.flatten(init)
  x_leaves, x_tree = jax.tree.flatten(xs)

  def flat(carry_leaves, x):
    new_carry, y = f(carry_tree.unflatten(carry_leaves), x_tree.unflatten(x))
    return jax.tree.leaves(new_carry), jax.tree.leaves(y)

  # Around the loop, not its step's trace.
  gradient = innermost_derivative()
  if gradient is None:
    _say_outer_loop()
  # A step sharded over Explicit mesh axes is measured as it runs: one
  # device's share (`_explicit_mesh`); not under a vmap (its `_vmaps` are
  # read once the step is traced, with what it closes over).
  batched = any(_batch_dims(v) for v in list(carry) + list(x_leaves))
  mesh = None if batched else _explicit_mesh(carry, x_leaves)
  if mesh is None:
    _say_auto_axes()

  def struct(shape, dtype, spec):
    return jax.ShapeDtypeStruct(
      shape,
      dtype,
      sharding=None
      if mesh is None
      else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)),
    )

  def leaf(a, sliced=False):
    a, spec = jax.typeof(a), spec_over(a, mesh)
    return struct(a.shape[1:], a.dtype, spec[1:]) if sliced else struct(a.shape, a.dtype, spec)

  carry_avals = tuple(leaf(c) for c in carry)
  x_avals = tuple(leaf(x, sliced=True) for x in x_leaves)
  with _varying_types_unchecked():
    closed = jax.make_jaxpr(flat)(list(carry_avals), list(x_avals))
  consts = tuple(leaf(c) for c in closed.consts)
  # The consts become the jaxpr's first inputs: no tracer of the caller's
  # trace reaches the compiles below.
  jaxpr = consts_as_inputs(closed.jaxpr)
  taken = _wrt(gradient, list(closed.consts) + carry + x_leaves) or (True,) * len(jaxpr.in_avals)
  wrt = _reaching(jaxpr, [is_float(a) and t for a, t in zip(jaxpr.in_avals, taken)])
  return Traced(
    jaxpr,
    len(consts),
    carry_avals,
    x_avals,
    str(jaxpr),
    jax.jit(as_function(jaxpr)),
    unroll,
    batch_major,
    _vmaps(gradient, closed.consts, carry, x_leaves),
    wrt,
    _derivatives(
      gradient, [t for v in list(closed.consts) + carry + x_leaves for t in _batch_dims(v)]
    ),
    _compiled_constants(closed.consts),
  ), consts


def _compiled_constants(consts: Sequence[Any]) -> tuple[Any, ...]:
  """`Traced.known`: each const that is no tracer where the loop is staged (in a `jax.jit`, `jax.eval_shape`), else None.

  Staged, JAX compiles such an array into the program as a constant; run
  eagerly, the loop's consts are its operands, as traced values are.
  """
  staged = any(type(t).__name__ == "DynamicJaxprTrace" for t in outward(current_trace(())))
  return tuple(c if staged and not isinstance(c, jax.core.Tracer) else None for c in consts)


def _reaching(jaxpr: ClosedJaxpr, taken: Sequence[bool]) -> tuple[bool, ...]:
  """Of each input of `jaxpr`, whether `taken` marks it (a float the gradient is taken of) and an output's derivative depends on it: it reaches an output other than through `jax.lax.stop_gradient`.

  Read from the step's JVP in the inputs `taken` marks (the others, data,
  get none, as in the user's step: a `jax.pure_callback` of data is not
  differentiated), pruned of what no output's tangent uses (jax's own
  `jvp_jaxpr` and `dce_jaxpr`, jax._src as jax 0.10 and 0.11 keep them;
  jax 0.11's takes the open jaxpr): an input whose tangent is left unused
  gets only zeros for a cotangent.
  """
  jvp: Any
  if versions.release(jax.__version__) >= (0, 11):
    jvp, out_tangents = jax_ad.jvp_jaxpr(jaxpr.jaxpr, taken, False)
  else:
    jvp, out_tangents = jax_ad.jvp_jaxpr(jaxpr, taken, False)
    jvp = jvp.jaxpr
  _, used = jax_pe.dce_jaxpr(jvp, [False] * len(jaxpr.out_avals) + [True] * sum(out_tangents))
  tangents = iter(used[len(taken) :])
  return tuple(bool(t and next(tangents)) for t in taken)


def spec_over(value, mesh) -> tuple[Any, ...]:
  """`value`'s `PartitionSpec` over `mesh`, an entry per dimension (None: not sharded; all None off `mesh`)."""
  aval = jax.typeof(value)
  sharding = getattr(aval, "sharding", None)
  spec = (
    tuple(getattr(sharding, "spec", ()))
    if mesh is not None and getattr(sharding, "mesh", None) == mesh
    else ()
  )
  return spec + (None,) * (aval.ndim - len(spec))


def _explicit_mesh(carry: Sequence[Any], xs: Sequence[Any]) -> Any:
  """The mesh of Explicit axes the loop's values are sharded over; None where none is.

  In a `jax.jit` step under `jax.set_mesh` of Explicit axes, a value's type
  holds its sharding (`x: f32[64@data, 128]`), and the step's
  `memory_analysis()` is one device's: measured with the same shardings,
  the planning programs are one device's too. Under Auto axes the loop
  cannot see how the step is sharded (`KnownGapsTest`), and xs sharded on
  their time axis are planned unsharded (a step's slice has no spec there).
  """
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  mesh = get() if get is not None else None
  if (
    mesh is None
    or getattr(mesh, "empty", True)
    or not all("Explicit" in str(kind) for kind in mesh.axis_types)
  ):
    return None
  if any(spec_over(x, mesh)[:1] != (None,) for x in xs):
    return None
  sharded = any(any(spec_over(v, mesh)) for v in list(carry) + list(xs))
  return mesh if sharded else None


def _vmaps(gradient: Any, *groups: Sequence[Any]) -> tuple[tuple[Any, ...], ...]:
  """The `jax.vmap`s around the values of `groups`, innermost first: `(size, of_the_batch, dims of each group)`.

  Inside `jax.vmap` a value is one example's, and the loop's program is the
  batch's: each value of the batch is a `BatchTracer` of that vmap's trace,
  its `batch_dim` where the batch lies in the value it wraps (the next
  vmap's tracer out, or the batch's array). A vmap's place among the traces
  is its depth in their nesting; `of_the_batch`: whether the gradient is
  taken around it (`jax.grad` of a loss of `jax.vmap`, or no gradient
  seen: taken later, of what the loop is inside), rather than inside it
  (`jax.vmap(jax.grad(...))`, a gradient per example); `gradient`: the
  innermost autodiff trace around the loop (`innermost_derivative`). Read from
  JAX's own tracers (jax._src, as jax 0.10 and 0.11 keep them).
  """
  chains = [[_batch_dims(v) for v in group] for group in groups]
  traces = {id(t): t for group in chains for chain in group for t in chain}
  innermost_first = sorted(traces.values(), key=_depth, reverse=True)
  return tuple(
    (int(t.axis_data.size), gradient is None or _depth(t) > _depth(gradient))
    + tuple(tuple(chain.get(t) for chain in group) for group in chains)
    for t in innermost_first
  )


# What stages the body of a loop of JAX's (`DebugInfo.traced_for`): a loop
# traced there runs once an iteration; and what keeps nothing of it (a
# checkpoint recomputes its inside in the backward pass).
_LOOP_BODIES = ("scan", "fori_loop", "while_body")
_CHECKPOINTS = ("checkpoint / remat", "remat")
# What each warning `_warn_once` gave was of, in this process.
_SAID: set[Any] = set()


def _warn_once(about: Any, message: str, *args: Any) -> None:
  """`LOG.warning(message, *args)`, once a process for each `about`."""
  if about in _SAID:
    return
  _SAID.add(about)
  LOG.warning(message, *args)


# The bodies of haiku_bridge's plain loops being traced, innermost last:
# each one's trace and whether `remat="auto"` planned its loop (`in_body`).
_LOOP_BODIES_HERE: contextvars.ContextVar[tuple[tuple[Any, bool], ...]] = contextvars.ContextVar(
  "haiku_bridge_loop_bodies", default=()
)


def in_body(body: Callable[..., Any], planned: bool) -> Callable[..., Any]:
  """`body` as a haiku_bridge loop's plain `jax.lax.scan` traces it: a loop inside knows whose body it runs in.

  `planned`: whether `remat="auto"` chose the plain loop, whose plan then
  measured what the loops inside keep (`_say_outer_loop` says nothing).
  """

  @functools.wraps(body)
  def traced(carry, x):
    here = _LOOP_BODIES_HERE.get()
    token = _LOOP_BODIES_HERE.set(here + ((current_trace(()), planned),))
    try:
      return body(carry, x)
    finally:
      _LOOP_BODIES_HERE.reset(token)

  return traced


def _say_outer_loop() -> None:
  """Warns, once a process for each outer loop, that the loop runs inside a JAX loop the gradient is taken around.

  That loop (`jax.lax.scan`, `fori_loop`, `while_loop`, traced for its
  body before it is differentiated) keeps each of its iterations'
  residuals for its backward pass, this loop's among them: the step holds
  up to its length times this plan's bytes (4 sequences of a tanh RNN
  over 64 steps: 5.5× the budget at the middle plan, 7.0× at the least;
  `KnownGapsTest`). A checkpoint between (`jax.checkpoint` of the outer
  body) keeps one iteration's at a time, and a gradient inside the outer
  body (accumulated per microbatch) is this loop's own: neither is said.
  """
  ours = {id(t): planned for t, planned in _LOOP_BODIES_HERE.get()}
  body = None
  for trace in outward(current_trace(())):
    if derivative_kind(trace) is not None:
      break
    info = getattr(getattr(trace, "frame", None), "debug_info", None)
    traced_for = getattr(info, "traced_for", "")
    if traced_for in _CHECKPOINTS:
      return
    if body is None and id(trace) in ours:
      if ours[id(trace)]:  # An "auto" loop's plan counted this one.
        return
      body = "haiku_bridge"
    elif body is None and traced_for in _LOOP_BODIES:
      body = f"{traced_for} of {getattr(info, 'func_src_info', None) or '?'}"
  else:
    return  # No gradient around the loop.
  if body is None:
    return
  outer, remedy = (
    (
      "a haiku_bridge loop with remat=False (hkb.scan, layer_scan, repeat_layer, dynamic_unroll)",
      "Give that loop remat=True, a schedule, or \"auto\", whose plan counts this loop inside it",
    )
    if body == "haiku_bridge"
    else (
      f"a loop of JAX's (the {body})",
      "Checkpoint its body (jax.checkpoint) to keep one iteration's at a "
      "time, or take the gradient inside it",
    )
  )
  _warn_once(
    ("outer loop", body),
    "remat=\"auto\": this loop runs inside %s that a gradient is taken "
    "around: that loop keeps every iteration's residuals of this one for "
    "its backward pass, up to its length times this plan's "
    "memory_budget. %s.",
    outer,
    remedy,
  )


def _derivatives(gradient: Any, batching: Sequence[Any]) -> tuple[tuple[str, int], ...]:
  """The derivatives the loop runs under, innermost first: ("reverse" or "forward", how many at once).

  The first is `gradient`, the innermost around the loop (where none is
  seen, a training step's: reverse); then each taken of it, outward. The
  measuring programs take the same (`measure.py`). What each changes, on a
  tanh RNN over 64 steps whose first-order plans hold 24,892 to 203,968
  bytes:
  - the loop's derivative forward (`jax.jvp`, `jax.jacfwd` of a loss):
    nothing kept for a backward pass, 4,136 bytes with every plan; under
    a gradient of it, what its tangents need (remat=True 150,724);
  - a reverse one of it (`jax.grad` of a loss of `jax.grad`, a
    meta-gradient): the loop's backward pass keeps for the outer one what
    a schedule recomputes (binomial 1,679,960, nested 1,531,248,
    remat=False 804,528, remat=True 414,152);
  - a forward one of it (`jax.jvp` of `jax.grad`, a Hessian-vector
    product): every buffer with its tangent, about twice each plan's
    (binomial of 29 slots: 86,696 against 41,384);
  - a vmap around one of them that batches none of the loop's values
    (`batching`: the vmaps that do) batches its tangents or cotangents,
    "at once": `jax.hessian` takes a JVP per element of the params, 8
    weightings of a loss their gradients (2.1-4.7× the budget of one).
  """
  if gradient is None:
    return (("reverse", 1),)
  out: list[list[Any]] = [[derivative_kind(gradient), 1]]
  batched = {id(t) for t in batching}
  for t in outward(getattr(gradient, "parent_trace", None)):
    kind = derivative_kind(t)
    if kind is not None:
      out.append([kind, 1])
    elif isinstance(t, jax_batching.BatchTrace) and id(t) not in batched:
      out[-1][1] *= int(t.axis_data.size)
  return tuple((kind, at_once) for kind, at_once in out)


def no_schedules(step: "Traced") -> bool:
  """Whether no schedule is a candidate: where the loop's derivative is forward (a schedule runs as remat=True there) or differentiated again in reverse mode (a gradient of a gradient: a schedule keeps more than remat=False)."""
  return step.derivatives[0][0] == "forward" or "reverse" in dict(step.derivatives[1:])


def _wrt(gradient: Any, values: Sequence[Any]) -> Optional[tuple[bool, ...]]:
  """Of each of `values`, whether `gradient` (the innermost around the loop, `innermost_derivative`) is taken of it; None where no gradient is seen.

  A value the gradient is taken of is a tracer of that autodiff trace
  (under `jax.vmap`, inside the vmap's tracers; outside a vmap the
  gradient is taken in, around them) with a tangent that is not zero;
  data (a batch of inputs, a constant) is not. A shape standing in for a
  value (a pipeline's stages plan on one microbatch's shapes) says
  nothing, and is taken as differentiated. Read from JAX's own tracers
  (jax._src, as jax 0.10 and 0.11 keep them).
  """
  if gradient is None:
    return None

  def taken(value) -> bool:
    while True:
      if isinstance(value, (jax_ad.JVPTracer, jax_ad.LinearizeTracer)):
        if value._trace is gradient:  # pylint: disable=protected-access
          return not isinstance(value.tangent, jax_ad.Zero)
        value = value.primal
      elif isinstance(value, jax_batching.BatchTracer):
        value = value.val
      else:
        return isinstance(value, jax.ShapeDtypeStruct)

  return tuple(taken(v) for v in values)


def _batch_dims(value: Any) -> dict[Any, Optional[int]]:
  """The vmap traces batching `value`, each with the dimension it batches."""
  dims: dict[Any, Optional[int]] = {}
  while isinstance(value, jax_batching.BatchTracer):
    dim = value.batch_dim
    dims[value._trace] = (  # pylint: disable=protected-access
      None if dim is None else int(dim)
    )
    value = value.val
  return dims


def _depth(trace: Any) -> int:
  """How many traces `trace` runs in."""
  return sum(1 for _ in outward(trace)) - 1


def _varying_types_unchecked() -> ContextManager[Any]:
  """Where jax types no value as varying over a manual mesh axis.

  A loop inside `jax.shard_map` (a time scan in a pipeline's stage) is
  planned on one device's step, compiled on its own (`measure.py`). Traced in
  the shard_map's context, the step's values would be typed as varying over
  its manual axes, the carry cast to match (`pvary`), and those compiles
  refuse the mix ("dot_general requires varying manual axes to match"). So
  the step is traced as `jax.shard_map(..., check_vma=False)` traces a body,
  by jax's own switch for it, which jax keeps internal (jax >= 0.7; before,
  no value was typed so).
  """
  check = getattr(jax_config, "_check_vma", None)
  return contextlib.nullcontext() if check is None else check(False)


def _say_auto_axes() -> None:
  """Warns, once a process for each mesh, that a loop under Auto axes is planned on the shapes it sees.

  There a `jax.jit` step may shard the loop's values (a data-parallel
  batch) without their types saying so: the plan is then the whole
  batch's, on one device, and a budget of one device's memory recomputes
  more than it needs (`KnownGapsTest`).
  """
  axes = tuple((name, size) for name, size, kind in mesh_context() if "Auto" in kind and size > 1)
  if not axes:
    return
  _warn_once(
    ("Auto axes", axes),
    "remat=\"auto\": a loop traced under mesh axes of type Auto (%s) is "
    "planned on the shapes it sees, as one device holding them would run "
    "it: the loop cannot see how your step shards its values there, and "
    "where it does (a batch over those axes), a budget of one device's "
    "memory recomputes more than it needs. Under Explicit axes "
    "(jax.make_mesh's default) or inside jax.shard_map the plan is one "
    "device's.",
    ", ".join(f"{name}: {size}" for name, size in axes),
  )


def mesh_context() -> tuple[tuple[str, int, str], ...]:
  """The mesh the measuring programs compile under (`jax.set_mesh`, a `shard_map`'s): each axis's name, size and type; () where none.

  XLA compiles the same program to other temporaries under a mesh (remat=False
  of a tanh RNN over 128 steps of 8 rows: 788,616 bytes outside one, 668,872
  under 8 devices, Auto or Explicit), so the figures are keyed on it.
  """
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  mesh = get() if get is not None else None
  if mesh is None or getattr(mesh, "empty", True):
    return ()
  return tuple(
    (str(name), int(size), str(kind))
    for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
  )


def differentiable(step: Traced) -> bool:
  """Whether the measuring programs differentiate an input (`Traced.wrt`) and a float output: a gradient to take."""
  return any(step.wrt) and any(is_float(a) for a in step.jaxpr.out_avals)


def is_float(a) -> bool:
  """Whether `a` (an array, an aval) holds floats (or complex numbers): what a derivative reaches."""
  return jnp.issubdtype(a.dtype, jnp.inexact)
