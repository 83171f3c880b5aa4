"""A scan whose matmul residuals are written into their stacks as they are made (issue 64's experiment).

In reverse mode `jax.lax.scan` keeps each saved value of a step in a
buffer stacked over the steps, written after the forward pass used it. On
a TPU v5e a matmul whose output is both saved and read by the next op
(the attention logits, read by the softmax's row max) writes a temporary,
and a separate fusion copies it into the stack: 409 µs a layer for the
logits of the accelerator check's LM (RESULTS.md, issue 64). Here each
saved value a `dot_general` makes is written into its stack as it is
made, and the step's later ops read it back from the stack (an
`optimization_barrier` keeps XLA from forwarding the value past the
write), so the matmul's one consumer is the stack. Saved values that are
the step's own inputs from `xs` (a layer's params) are sliced again in the
backward loop, not stored.

`scan` is `jax.lax.scan`'s forward and reverse mode (a `jax.custom_vjp`:
no forward mode), with `reverse=False` and `unroll=1` (anything else is
`jax.lax.scan` itself). What is saved is what `jax.vjp` of the step keeps:
under `jax.checkpoint(step, policy=...)`, what the policy saves. A
benchmark form, not the library's: `layer_scan_benchmark`'s forms ending
in ` forwarded` run `hkb.repeat_layer` on it.
"""

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
from jax import lax
from jax.extend import core as jex_core
import jax.numpy as jnp

_LAX_SCAN = jax.lax.scan
_same = lambda value: value
# Equations that call a jaxpr: evaluated inline, so that the matmuls inside
# are seen (a forward pass's custom_jvp calls evaluate their primal jaxpr).
_CALLS = ("pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "custom_jvp_call")


def _called(eqn) -> Any:
  """`(jaxpr, consts)` an equation calls, or None."""
  if eqn.primitive.name not in _CALLS:
    return None
  for key in ("jaxpr", "call_jaxpr"):
    if key in eqn.params:
      called = eqn.params[key]
      return (called.jaxpr, called.consts) if hasattr(called, "jaxpr") else (called, ())
  return None


class _PerUse:
  """An argument of `_evaluate` made anew for each equation that reads it."""

  def __init__(self, make: Callable[[], Any]):
    self.make = make


def _evaluate(
  jaxpr, consts, args, on_matmul: Callable[[Any], Any], matmuls=None, every: bool = False
) -> list[Any]:
  """`jaxpr` evaluated on `args`, calls inline; each matmul's output passed through `on_matmul`.

  With `every`, each operation's outputs.

  So is a `reduce_precision` of one: how `jax.checkpoint` marks what its
  policy saves. An argument given as `_PerUse` is made for each equation
  that reads it (through calls too).
  """
  matmuls = set() if matmuls is None else matmuls  # ids of matmuls' outputs.
  env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
  held = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
  read = lambda v: (lambda value: value.make() if isinstance(value, _PerUse) else value)(held(v))
  for eqn in jaxpr.eqns:
    called = _called(eqn)
    if called is not None:
      outs = _evaluate(*called, [held(v) for v in eqn.invars], on_matmul, matmuls, every)
    else:
      values = [read(v) for v in eqn.invars]
      outs = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
      outs = outs if eqn.primitive.multiple_results else [outs]
      name = eqn.primitive.name
      if every:
        outs = [on_matmul(out) for out in outs]
      elif name == "dot_general" or (name == "reduce_precision" and id(values[0]) in matmuls):
        outs = [on_matmul(outs[0])]
        matmuls.add(id(outs[0]))
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


class _Step(NamedTuple):
  """One step of the scan as traced: what it computes and saves, and how the loops store it."""

  closed: Any  # (carry, xs, consts) -> (outputs' leaves, residuals), a ClosedJaxpr.
  n_out: int  # The carry's and ys' leaves, first among its outputs.
  out: Any  # The treedef of (carry, y).
  pullback: Any  # The treedef of jax.vjp's pullback, its leaves the residuals.
  written: tuple[Optional[int], ...]  # Per value `_evaluate` passes on, in order: its residual.
  inputs: tuple[Optional[int], ...]  # Per residual: the leaf of (xs, consts) it is, if one.
  every: bool
  pulled: Any  # With reads_per_use: the pullback, (residuals, cotangents) -> input cotangents.
  grads: Any  # The treedef of (carry, x, consts).


def scan(
  f, init, xs, length=None, reverse=False, unroll=1, reads_per_use=False, every=False, **kwargs
):
  """`jax.lax.scan(f, init, xs)`, its matmuls' saved values written into their stacks as they are made.

  `every`: every saved value the step computes, not only matmuls'.
  `reads_per_use`: the backward loop slices a saved value out of its stack
  for each operation that reads it (each slice of its own barrier over the
  stack, so that XLA neither merges them nor copies a slice out once for
  all its readers), where jax's pullback reads one slice.
  """
  if reverse or unroll not in (1, False) or kwargs:
    return _LAX_SCAN(f, init, xs, length=length, reverse=reverse, unroll=unroll, **kwargs)
  steps = length if length is not None else jax.tree.leaves(xs)[0].shape[0]
  x0 = jax.tree.map(lambda a: a[0], xs)
  step, consts = jax.closure_convert(f, init, x0)
  found: dict[str, Any] = {}

  def with_residuals(c, x, k):
    out, pullback = jax.vjp(lambda c, x, k: step(c, x, *k), c, x, k)
    residuals, found["pullback"] = jax.tree.flatten(pullback)
    found["out"] = jax.tree.structure(out)
    return jax.tree.leaves(out), residuals

  closed = jax.make_jaxpr(with_residuals)(init, x0, list(consts))
  n_out = found["out"].num_leaves
  written, inputs = [], []

  def probe(*flat):
    made = []
    values = _evaluate(
      closed.jaxpr, closed.consts, flat, lambda v: made.append(v) or v, every=every
    )
    residuals = {id(r): k for k, r in enumerate(values[n_out:])}
    written.extend(residuals.get(id(v)) for v in made)
    index = {id(a): i for i, a in enumerate(flat)}
    inputs.extend(index.get(id(r)) for r in values[n_out:])
    return values

  jax.make_jaxpr(probe)(*jax.tree.leaves((init, x0, list(consts))))
  n_c = len(jax.tree.leaves(init))
  pulled = None
  if reads_per_use:  # The pullback as a jaxpr of (residuals, the output's cotangents).
    structs = lambda avals: [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    pull = lambda residuals, cts: jax.tree.leaves(
      jax.tree.unflatten(found["pullback"], residuals)(jax.tree.unflatten(found["out"], cts))
    )
    pulled = jax.make_jaxpr(pull)(
      structs(closed.out_avals[n_out:]), structs(closed.out_avals[:n_out])
    )
  traced = _Step(
    closed,
    n_out,
    found["out"],
    found["pullback"],
    tuple(written),
    # A residual that is one of xs's leaves or a const: taken again in the backward loop.
    tuple(None if i is None or i < n_c else i - n_c for i in inputs),
    every,
    pulled,
    jax.tree.structure((init, x0, list(consts))),
  )
  return _scan(traced, steps, init, xs, list(consts))


def _scan(traced: _Step, steps: int, init, xs, consts):
  """The scan as a `jax.custom_vjp`: a forward loop storing what the step saves, and a backward loop."""
  closed, n_out, inputs = traced.closed, traced.n_out, traced.inputs
  res_avals = closed.out_avals[n_out:]
  n_x = len(jax.tree.leaves(xs))

  def forward(init, xs, consts):
    flat_c = jax.tree.leaves(init)
    n_c = len(flat_c)
    stacks = [
      jnp.zeros((steps, *a.shape), a.dtype) if inputs[k] is None else jnp.zeros((), a.dtype)
      for k, a in enumerate(res_avals)
    ]
    ys = [jnp.zeros((steps, *a.shape), a.dtype) for a in closed.out_avals[n_c:n_out]]

    def body(i, state):
      flat_c, stacks, ys = state
      stacks = list(stacks)
      x = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), xs)
      run = iter(traced.written)
      stored = set()

      def write_then_read(value):
        k = next(run)
        if k is None:
          return value
        stacks[k] = lax.optimization_barrier(
          lax.dynamic_update_index_in_dim(stacks[k], value, i, 0)
        )
        stored.add(k)
        return lax.dynamic_index_in_dim(stacks[k], i, keepdims=False)

      flat = flat_c + jax.tree.leaves(x) + jax.tree.leaves(consts)
      values = _evaluate(closed.jaxpr, closed.consts, flat, write_then_read, every=traced.every)
      for k, r in enumerate(values[n_out:]):
        if k not in stored and inputs[k] is None:
          stacks[k] = lax.dynamic_update_index_in_dim(stacks[k], r, i, 0)
      ys = [lax.dynamic_update_index_in_dim(s, y, i, 0) for s, y in zip(ys, values[n_c:n_out])]
      return values[:n_c], stacks, ys

    flat_c, stacks, ys = lax.fori_loop(0, steps, body, (flat_c, stacks, ys))
    return jax.tree.unflatten(traced.out, flat_c + ys), stacks

  @jax.custom_vjp
  def run(init, xs, consts):
    return forward(init, xs, consts)[0]

  def run_fwd(init, xs, consts):
    out, stacks = forward(init, xs, consts)
    return out, (stacks, xs, consts)

  def run_bwd(saved, cotangent):
    stacks, xs, consts = saved
    ct_carry, ct_ys = cotangent
    flat_x, flat_k = jax.tree.leaves(xs), jax.tree.leaves(consts)

    def residual(k, i, barrier=False):
      if inputs[k] is not None and inputs[k] >= n_x:
        return flat_k[inputs[k] - n_x]
      stack = stacks[k] if inputs[k] is None else flat_x[inputs[k]]
      stack = lax.optimization_barrier(stack) if barrier else stack
      return lax.dynamic_index_in_dim(stack, i, keepdims=False)

    def body(j, state):
      ct_carry, ct_consts, ct_xs = state
      i = steps - 1 - j
      ct_y = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), ct_ys)
      if traced.pulled is not None:
        pulled = traced.pulled
        reads = [_PerUse(functools.partial(residual, k, i, True)) for k in range(len(stacks))]
        flat = _evaluate(
          pulled.jaxpr, pulled.consts, reads + jax.tree.leaves((ct_carry, ct_y)), _same
        )
        ct_carry, ct_x, ct_k = jax.tree.unflatten(traced.grads, flat)
      else:
        pullback = jax.tree.unflatten(traced.pullback, [residual(k, i) for k in range(len(stacks))])
        ct_carry, ct_x, ct_k = pullback((ct_carry, ct_y))
      ct_xs = jax.tree.map(lambda s, d: lax.dynamic_update_index_in_dim(s, d, i, 0), ct_xs, ct_x)
      return ct_carry, jax.tree.map(jnp.add, ct_consts, ct_k), ct_xs

    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
    ct_init, ct_consts, ct_xs = lax.fori_loop(0, steps, body, (ct_carry, zeros(consts), zeros(xs)))
    return ct_init, ct_xs, ct_consts

  run.defvjp(run_fwd, run_bwd)
  return run(init, xs, consts)
