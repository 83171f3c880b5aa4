"""`jax.lax.scan` whose backward pass keeps only the carries a remat schedule names.

`scan(f, init, xs, length=n, schedule=...)` returns what `jax.lax.scan(f, init,
xs)` returns. Under reverse-mode autodiff its forward sweep keeps the carries
`schedule.forward_stores` names, and its backward sweep follows
`schedule.actions` (`schedule.py`): it recomputes carries from kept
ones, and backpropagates each step once, last to first, recomputing that
step's own intermediates as `jax.checkpoint` on the body would. So it stores
a schedule's few carries instead of one per step. The backward loop runs one
iteration per step it recomputes or backpropagates, and reads what to do from
a table of one row per action (an ADVANCE of many steps is one row), which
the program holds as `Schedule.table_bytes` of constants (a column of one
value as that value): O(N) however much the schedule recomputes.

What it never copies: each step reads its slice of `xs` (the stacked
parameters) by index, and writes the cotangent of that slice in place into
one stacked buffer, the gradient itself. No group of parameters or of their
gradients is gathered anywhere, so where the parameters dominate memory it
needs no more than `jax.checkpoint` does.

`f` is traced once, to a jaxpr, when `scan` is called, and every pass runs
that jaxpr, as one `jax.jit` (differentiated once, lowered once, inlined by
XLA): what `f` sees when traced (Haiku's custom getters, its frame) is
what each recomputation does, whenever the backward pass is traced. Values
`f` closes over become inputs of the `jax.custom_vjp`; their cotangents are
summed over the steps. Reverse over reverse is defined, and so is forward
over reverse (`jax.hessian`).

Forward mode keeps nothing for a backward pass, so a schedule has nothing to
save there: under `jax.jvp` / `jax.jacfwd` / `jax.linearize` (when the
forward-mode trace is the innermost autodiff around the call, as when they
wrap the function that calls the scan) it runs `jax.lax.scan` with
`jax.checkpoint` on the step, which any transform differentiates. A
`jax.custom_vjp` cannot be differentiated in forward mode, and JAX says
which mode it runs in only to the code it traces: through a boundary that
traces first and differentiates later (`jax.jvp(jax.jit(f))`, a scan's
body), the scan cannot tell. Forward mode then fails: with
`forward_mode_error` (the caller's words) where JAX traces the forward rule
for that JVP, as it does the first time.
"""

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
from jax import lax
from jax.custom_derivatives import SymbolicZero
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src.remat import schedule as remat_schedule
from haiku_bridge._src.remat import tracing
from haiku_bridge._src.pytree import PyTree


def scan(
  f: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
  init: PyTree,
  xs: PyTree,
  *,
  length: int,
  schedule: remat_schedule.Schedule,
  reverse: bool = False,
  unroll: int | bool = 1,
  forward_mode_error: Optional[str] = None,
) -> tuple[PyTree, PyTree]:
  """`jax.lax.scan(f, init, xs, length, reverse, unroll)`, reversed by `schedule`.

  >>> from haiku_bridge._src.remat import schedule as remat_schedule
  >>> from haiku_bridge._src.remat import scheduled_scan
  >>> def step(h, w):
  ...   return jnp.tanh(h @ w), jnp.sum(h)
  >>> ws = jax.random.normal(jax.random.PRNGKey(0), [10, 4, 4]) / 2
  >>> h = jnp.ones([2, 4])
  >>> schedule = remat_schedule.nested(10)  # Groups of 4, 4 and 2 steps.
  >>> def loss(scan):
  ...   return lambda ws: jnp.sum(scan(step, h, ws)[0] ** 2)
  >>> ours = jax.grad(loss(lambda f, h, ws: scheduled_scan.scan(
  ...     f, h, ws, length=10, schedule=schedule)))
  >>> theirs = jax.grad(loss(jax.lax.scan))
  >>> bool(jnp.allclose(ours(ws), theirs(ws), atol=1e-6))
  True

  Args:
    f: `f(carry, x) -> (carry, y)`, as for `jax.lax.scan`.
    init: the first carry.
    xs: per-step inputs, each leaf with a leading axis of size `length`.
    length: the number of steps, `schedule.num_steps`.
    schedule: which carries to keep (`remat_schedule.nested`, `binomial`).
    reverse: run the steps from last to first, as `jax.lax.scan` does.
    unroll: passed to the `jax.lax.scan`s of both sweeps.
    forward_mode_error: the message of the TypeError raised where forward
      mode reaches the custom backward pass through a `jax.jit` (JAX's own
      error when None).

  Returns:
    `(carry, ys)`, as `jax.lax.scan` returns them.
  """
  if schedule.num_steps != length:
    raise ValueError(f"the schedule is for {schedule.num_steps} steps, the scan has {length}.")
  if _in_forward_mode():
    return lax.scan(jax.checkpoint(f), init, xs, length=length, reverse=reverse, unroll=unroll)
  carry, carry_tree = jax.tree.flatten(init)
  # A weakly typed carry (a Python number) takes a type of its own, as the
  # carries the step returns have one.
  carry = [jnp.asarray(c, jnp.result_type(c)) if jax.typeof(c).weak_type else c for c in carry]
  x_leaves, x_tree = jax.tree.flatten(xs)
  y_trees = []

  def flat_step(carry_leaves, x):
    new_carry, y = f(carry_tree.unflatten(carry_leaves), x_tree.unflatten(x))
    new_leaves, new_tree = jax.tree.flatten(new_carry)
    if new_tree != carry_tree:
      raise TypeError(f"the step returned a carry of structure {new_tree}; it got {carry_tree}.")
    y_leaves, y_tree = jax.tree.flatten(y)
    y_trees.append(y_tree)
    return new_leaves, y_leaves

  closed = jax.make_jaxpr(flat_step)(
    [jax.typeof(c) for c in carry],
    [tracing.mapped_aval(length, 0, jax.typeof(x)) for x in x_leaves],
  )
  step = _Step(closed.jaxpr, len(carry))
  run = _checkpointed_scan(step, schedule, reverse, unroll, forward_mode_error)
  new_carry, ys = run(list(closed.consts), carry, x_leaves)
  return carry_tree.unflatten(new_carry), y_trees[0].unflatten(ys)


# Whether `jax.linearize` is seen as forward mode: jax 0.9 and newer (measured:
# 0.6.0, 0.7.2 and 0.8.1 raise, 0.9.2 and 0.10.2 run it).
LINEARIZE_IS_FORWARD_MODE = tuple(int(part) for part in jax.__version__.split(".")[:2]) >= (0, 9)


def _in_forward_mode() -> bool:
  """Whether the innermost autodiff around this call is forward mode.

  `jax.jvp` / `jax.jacfwd` trace with a JVP trace, `jax.linearize` with a
  linearize trace that is not for a VJP (`jax.vjp`, `jax.grad`); transforms
  that do not differentiate (`jax.vmap`) are looked through. A trace that
  stages code to differentiate later (`jax.jit`, a scan's body) hides what
  is around it: then reverse mode is assumed, as it is what a schedule is
  for. Before direct linearization (jax < 0.7, or
  `jax_use_direct_linearize=False`), reverse mode traced JVPs too, over a
  partial-evaluation trace: those are reverse mode. Linearize traces say
  whether they are for a VJP from jax 0.9; before, `jax.linearize` is taken
  for reverse mode, and JAX refuses it (`LINEARIZE_IS_FORWARD_MODE`).
  """
  return tracing.derivative_kind(tracing.innermost_derivative()) == "forward"


class _Step:
  """The traced step as a function of (consts, carry, x), all flat lists."""

  def __init__(self, jaxpr: tracing.Jaxpr, num_carry: int):
    self.jaxpr = jaxpr
    self.num_carry = num_carry
    self.carry_is_float = [tracing.is_float(v.aval) for v in jaxpr.outvars[:num_carry]]
    self.y_is_float = [tracing.is_float(v.aval) for v in jaxpr.outvars[num_carry:]]

    # One `jax.jit` of the jaxpr (its consts as its first inputs): each of
    # the step's places in the program (the primal scan, the forward sweep,
    # an advance, the backward step) binds it as one equation, traced,
    # differentiated and lowered once; XLA inlines it.
    self._call = jax.jit(tracing.as_function(tracing.consts_as_inputs(jaxpr)))

  def __call__(self, consts, carry, x):
    out = self._call(*consts, *carry, *x)
    return out[: self.num_carry], out[self.num_carry :]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Perturbed:
  """Which consts and xs the forward rule saw perturbed: static, in residuals."""

  consts: tuple[bool, ...]
  xs: tuple[bool, ...]


class _SlotMoves(NamedTuple):
  """A schedule with its register as one more slot, every move static.

  Slot `register` (the last) stands for the register. Each backward action
  reads its carry from one slot and an ADVANCE of one step writes its
  result to one: the slot the schedule keeps it in, else the register's. A
  later read of "the register" reads wherever the last ADVANCE wrote, so a
  carry is copied once when written and once when read, never moved
  between slots. An ADVANCE of several steps reads its first carry from
  `read`, runs its later steps on the register's slot, and writes its last
  result to `written`.
  """

  num_slots: int
  # [steps]: the slot the forward sweep writes the carry entering t to:
  # the schedule's, else the register's (scratch).
  forward_writes: np.ndarray
  # [actions, 5]: kind, first step, steps, slot read, slot written (a
  # BACKPROP writes the carry it read back where it read it).
  actions: np.ndarray
  num_steps_run: int  # The backward sweep's steps: each action's length.


def _slot_moves(schedule: remat_schedule.Schedule) -> _SlotMoves:
  register = schedule.num_slots
  # The forward sweep writes every carry, one the schedule does not keep to
  # the register's slot: no select and no read per step, which XLA compiles
  # faster than writing an unkept slot back unchanged. Written in step
  # order, the register's slot ends holding the carry entering the last
  # step unless a slot keeps it; where one does, the backward sweep writes
  # the register's slot before it reads it. So the kept slots hold what the
  # schedule keeps there, and no buffer grows.
  stores = [register if s == remat_schedule.NOWHERE else s for s in schedule.forward_stores]
  holder = stores[schedule.num_steps - 1]
  actions = []
  for a in schedule.actions:
    load = holder if a.load == remat_schedule.REGISTER else a.load
    target = load
    if a.kind == remat_schedule.ADVANCE:
      target = a.store if a.store != remat_schedule.NOWHERE else register
      holder = target
    actions.append((a.kind, a.step, a.length, load, target))
  table = np.asarray(actions, np.int32).reshape(-1, 5)
  return _SlotMoves(register + 1, np.asarray(stores, np.int32), table, int(table[:, 2].sum()))


def _checkpointed_scan(
  step: _Step,
  schedule: remat_schedule.Schedule,
  reverse: bool,
  unroll: int | bool,
  forward_mode_error: Optional[str] = None,
) -> Callable[..., Any]:
  """`run(consts, carry, xs) -> (carry, ys)`, a `jax.custom_vjp` over flat lists."""
  length = schedule.num_steps
  moves = _slot_moves(schedule)

  @jax.custom_vjp
  def run(consts, carry, xs):
    return lax.scan(
      lambda c, x: step(consts, c, x), carry, xs, length=length, reverse=reverse, unroll=unroll
    )

  def forward(consts, carry, xs):
    if forward_mode_error is not None and tracing.traced_for_forward_mode():
      raise TypeError(forward_mode_error)
    consts, perturbed_consts = _values(consts)
    carry, _ = _values(carry)
    xs, perturbed_xs = _values(xs)
    slots = [_slot_buffer(c, moves.num_slots) for c in carry]

    def body(state, inputs):
      c, slots = state
      x, store = inputs
      # Every carry is written (`_slot_moves`): no select, no read.
      slots = [_put(b, v, store) for b, v in zip(slots, c)]
      new_c, y = step(consts, c, x)
      return (new_c, slots), y

    stores = moves.forward_writes
    (carry, slots), ys = lax.scan(
      body,
      (carry, slots),
      (xs, stores[::-1] if reverse else stores),
      length=length,
      reverse=reverse,
      unroll=unroll,
    )
    residuals = (consts, xs, slots, _Perturbed(tuple(perturbed_consts), tuple(perturbed_xs)))
    return (carry, ys), residuals

  def backward(residuals, cotangents):
    consts, xs, slots, perturbed = residuals
    ct_carry, ct_ys = cotangents
    ct_carry = [
      jnp.zeros_like(s[0]) if isinstance(ct, SymbolicZero) else ct for ct, s in zip(ct_carry, slots)
    ]
    ct_ys = [None if isinstance(ct, SymbolicZero) else ct for ct in ct_ys]
    diff_consts = [i for i, p in enumerate(perturbed.consts) if p]
    diff_xs = [i for i, p in enumerate(perturbed.xs) if p]
    diff_carry = [i for i, f in enumerate(step.carry_is_float) if f]
    diff_ys = [i for i, f in enumerate(step.y_is_float) if f]

    def backprop(c, x, ct_c, ct_y):
      """Cotangents of the differentiated consts, carry and x of one step."""

      def f(d_consts, d_carry, d_x):
        new_c, y = step(
          _with(consts, diff_consts, d_consts),
          _with(c, diff_carry, d_carry),
          _with(x, diff_xs, d_x),
        )
        return [new_c[i] for i in diff_carry], [y[i] for i in diff_ys]

      (_, y), vjp = jax.vjp(
        f, [consts[i] for i in diff_consts], [c[i] for i in diff_carry], [x[i] for i in diff_xs]
      )
      ct_y = [
        jnp.zeros_like(v) if ct is None else ct for v, ct in zip(y, [ct_y[i] for i in diff_ys])
      ]
      return vjp((ct_c, ct_y))

    def body(state, _):
      slots, ct_c, ct_xs, ct_consts, row, done = state
      # The action's `done`-th step: the table holds one row per action,
      # not one per step, and is read here, as the loop runs.
      kind, first, steps, load, target = [
        column if np.ndim(column) == 0 else _get(column, row) for column in table
      ]
      # The int32 bookkeeping in lax: jnp's operators promote types and
      # dispatch through a jit per call: a fifth of the Python calls that
      # tracing this body outside the cond made.
      t = lax.add(first, done)
      next_done = lax.add(done, np.int32(1))
      last = lax.eq(next_done, steps)
      register = np.int32(moves.num_slots - 1)
      c = [_get(s, lax.select(lax.eq(done, np.int32(0)), load, register)) for s in slots]
      # Steps are numbered in the order the forward sweep runs them; the
      # layer (index into xs and ys) of step t.
      i = lax.sub(np.int32(length - 1), t) if reverse else t
      x = lambda: [_get(v, i) for v in xs]  # Read in each branch.

      # The cotangent buffers go through the cond, so that the BACKPROP
      # branch writes them in place.
      def advance(ct_c, ct_xs, ct_consts):
        return step(consts, c, x())[0], ct_c, ct_xs, ct_consts

      def back(ct_c, ct_xs, ct_consts):
        ct_y = [None if ct is None else _get(ct, i) for ct in ct_ys]
        d_consts, d_carry, d_x = backprop(c, x(), ct_c, ct_y)
        ct_xs = [_put(buf, d, i) for buf, d in zip(ct_xs, d_x)]
        ct_consts = [a + d for a, d in zip(ct_consts, d_consts)]
        return c, d_carry, ct_xs, ct_consts

      new_c, ct_c, ct_xs, ct_consts = lax.cond(
        lax.eq(kind, np.int32(remat_schedule.BACKPROP)), back, advance, ct_c, ct_xs, ct_consts
      )
      # A BACKPROP writes the carry it read back where it read it.
      slots = [_put(s, v, lax.select(last, target, register)) for s, v in zip(slots, new_c)]
      return (
        slots,
        ct_c,
        ct_xs,
        ct_consts,
        lax.add(row, lax.convert_element_type(last, np.int32)),
        lax.select(last, np.int32(0), next_done),
      ), None

    # A column of one value (the lengths, where every ADVANCE runs one
    # step) is that value: no array for XLA to fold, or for jax 0.12 to
    # pass as an argument of its own, which XLA cannot fold
    # (`Schedule.table_bytes`).
    table: list[Any] = [
      np.int32(column[0]) if (column == column[0]).all() else jnp.asarray(column)
      for column in moves.actions.T
    ]
    state = (
      slots,
      [ct_carry[i] for i in diff_carry],
      [jnp.zeros_like(xs[i]) for i in diff_xs],
      [jnp.zeros_like(consts[i]) for i in diff_consts],
      jnp.int32(0),
      jnp.int32(0),
    )
    (_, ct_c, ct_xs, ct_consts, _, _), _ = lax.scan(
      body, state, None, length=moves.num_steps_run, unroll=unroll
    )
    return (
      _scatter(len(consts), diff_consts, ct_consts),
      _scatter(len(step.carry_is_float), diff_carry, ct_c),
      _scatter(len(xs), diff_xs, ct_xs),
    )

  run.defvjp(forward, backward, symbolic_zeros=True)
  return run


def _values(primals):
  return ([p.value for p in primals], [p.perturbed for p in primals])


def _slot_buffer(carry: jax.Array, num_slots: int) -> jax.Array:
  # jnp's zeros_like, which keeps the carry's sharding (an Explicit mesh
  # types it; lax.full would not).
  return jnp.broadcast_to(jnp.zeros_like(carry)[None], (num_slots,) + jnp.shape(carry))


# The helpers below bind lax's primitives: `lax.dynamic_index_in_dim`,
# `jnp.where` and their kin are `jax.jit`s, which a fresh process traces once
# per shape and lowers as functions of their own.


def _get(stacked: jax.Array, index) -> jax.Array:
  return lax.squeeze(
    lax.dynamic_slice_in_dim(stacked, _index(index), 1, allow_negative_indices=False), (0,)
  )


def _put(slots: jax.Array, value: jax.Array, slot) -> jax.Array:
  return lax.dynamic_update_slice_in_dim(
    slots, lax.expand_dims(value, (0,)), _index(slot), 0, allow_negative_indices=False
  )


def _index(index) -> jax.Array:
  """`index` as int32, unwrapped: no index here is negative.

  `lax.dynamic_slice`'s wrap of negative indices (a compare and a select
  per index) cost XLA:CPU a fifth of the scheduled loop's compile time
  (the conv stack of the planning benchmark, measured side by side).
  """
  return lax.convert_element_type(index, np.int32)


def _with(values: list[Any], indices: list[int], new: list[Any]) -> list[Any]:
  out = list(values)
  for i, v in zip(indices, new):
    out[i] = v
  return out


def _scatter(size: int, indices: list[int], values: list[Any]) -> list[Any]:
  """A list of `size` cotangents: `values` at `indices`, None (zero) elsewhere."""
  return _with([None] * size, indices, values)
