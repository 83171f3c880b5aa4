"""Whether a function computes each row of its batch from that row alone, read off two traces of it.

A pipeline's stages may run a layer on each data device's rows of a
microbatch by hand (`stages`), which gives the same result as the
whole microbatch only where the layer is row-wise: every row of every
output that has rows is computed from the same row of the inputs that have
rows, and nothing depends on how many rows there are. `row_dims` checks
that on the layer's jaxprs at two batch sizes, the whole microbatch's and a
device's: a dimension whose size differs between the two is a row
dimension, and every operation must leave rows apart (no reduction,
contraction, cumulative op, slice or pad over one; no rows drawn from
random bits or counted by an `iota`), with the same literals and constants
in both. What it cannot see into it refuses: a `jax.custom_vjp`'s backward
rule, and any primitive not listed here that touches rows. A
`jax.custom_jvp`'s rule is taken to treat rows as its function does.
"""

from typing import Any, Callable, Optional, Sequence

import jax
from jax import extend
import numpy as np

from haiku_bridge._src import jaxpr_walk
from haiku_bridge._src.pytree import PyTree

_ELEMENTWISE = frozenset(
  """
    abs acos acosh add and asin asinh atan atan2 atanh bitcast_convert_type
    cbrt ceil clamp complex conj convert_element_type copy copy_p cos cosh
    digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag
    integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg
    nextafter not optimization_barrier or population_count pow real
    reduce_precision rem round rsqrt select_n shift_left
    shift_right_arithmetic shift_right_logical sign sin sinh sqrt square
    stop_gradient sub tan tanh xor
""".split()
)
_REDUCTIONS = frozenset(
  """
    argmax argmin reduce_and reduce_max reduce_min reduce_or reduce_prod
    reduce_sum reduce_xor
""".split()
)
_CUMULATIVE = frozenset("cumlogsumexp cummax cummin cumprod cumsum".split())
# Primitives that apply their jaxpr to their operands, one for one.
_CALLS = {
  "pjit": "jaxpr",
  "jit": "jaxpr",
  "closed_call": "call_jaxpr",
  "core_call": "call_jaxpr",
  "remat2": "jaxpr",
  "checkpoint": "jaxpr",
  "custom_jvp_call": "call_jaxpr",
}


class _NotRowWise(Exception):
  pass


def row_dims(
  fn: Callable[..., Any], args: PyTree, local_args: PyTree, parts: int
) -> Optional[PyTree]:
  """The row dimension of each output of `fn`, where `fn` is row-wise; else None.

  Args:
    fn: the function, of `args`.
    args: its arguments (shapes), the whole batch.
    local_args: the same, with each row dimension `parts` times smaller.
    parts: how many devices the rows are split over.

  Returns:
    For each output leaf of `fn`, the dimension that holds its rows (None
    where it has none: it is then the same on every device), or None where
    `fn` is not row-wise or cannot be traced without a mesh.
  """
  try:
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
      whole, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
      local = jax.make_jaxpr(fn)(*local_args)
  except Exception:  # pylint: disable=broad-except
    # A layer that needs the mesh to trace: not one this can read.
    return None
  try:
    _same_consts(local.consts, whole.consts)
    dims = _walk(local.jaxpr, whole.jaxpr, parts)
  except _NotRowWise:
    return None
  return jax.tree.unflatten(jax.tree.structure(shapes), dims)


def _same_consts(local: Sequence[Any], whole: Sequence[Any]) -> None:
  if len(local) != len(whole):
    raise _NotRowWise()
  for a, b in zip(local, whole):
    if a is b:  # One array closed over (a tracer of the enclosing jit too).
      continue
    if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer) or (not _equal(a, b)):
      raise _NotRowWise()


def _equal(a: Any, b: Any) -> bool:
  """Whether two constants are equal, NaN to NaN."""
  a, b = np.asarray(a), np.asarray(b)
  return a.shape == b.shape and bool(
    np.array_equal(a, b, equal_nan=np.issubdtype(a.dtype, np.inexact))
  )


def _dim(local: Any, whole: Any, parts: int) -> Optional[int]:
  """The row dimension of a value, from its type in the two traces."""
  local_shape = getattr(local.aval, "shape", ())
  whole_shape = getattr(whole.aval, "shape", ())
  if len(local_shape) != len(whole_shape):
    raise _NotRowWise()
  differ = [i for i, (a, b) in enumerate(zip(local_shape, whole_shape)) if a != b]
  if not differ:
    return None
  if len(differ) > 1 or whole_shape[differ[0]] != parts * local_shape[differ[0]]:
    raise _NotRowWise()
  return differ[0]


def _walk(local: Any, whole: Any, parts: int) -> list[Optional[int]]:
  """Checks each equation of the paired jaxprs; the row dimension of each output."""
  if len(local.eqns) != len(whole.eqns):
    raise _NotRowWise()
  for lv, wv in zip(local.constvars, whole.constvars):
    _dim(lv, wv, parts)
  for eqn, twin in zip(local.eqns, whole.eqns):
    if eqn.primitive.name != twin.primitive.name:
      raise _NotRowWise()
    ins: list[Optional[int]] = []
    for lv, wv in zip(eqn.invars, twin.invars):
      if isinstance(lv, extend.core.Literal):
        if not isinstance(wv, extend.core.Literal) or not _equal(lv.val, wv.val):
          raise _NotRowWise()
        ins.append(None)
      else:
        ins.append(_dim(lv, wv, parts))
    outs = [_dim(lv, wv, parts) for lv, wv in zip(eqn.outvars, twin.outvars)]
    _check(eqn, twin, ins, outs, parts)
  return [
    None if isinstance(lv, extend.core.Literal) else _dim(lv, wv, parts)
    for lv, wv in zip(local.outvars, whole.outvars)
  ]


def _check(
  eqn: Any, twin: Any, ins: list[Optional[int]], outs: list[Optional[int]], parts: int
) -> None:
  """Raises `_NotRowWise` unless `eqn` keeps rows apart."""
  name, params = eqn.primitive.name, eqn.params
  walked = name in _CALLS or name in ("scan", "while", "cond")
  if all(d is None for d in ins + outs):
    # Touches no rows: the same computation in both traces (a jaxpr inside
    # one not walked here could hide a difference), or refused.
    if not _same_params(params, twin.params) or (
      not walked and any(_holds_jaxpr(v) for v in params.values())
    ):
      raise _NotRowWise()
    if not walked:
      return
  if name in _ELEMENTWISE:
    if any(d is not None and d != o for d in ins for o in outs):
      raise _NotRowWise()
  elif name == "broadcast_in_dim":
    if ins[0] is not None and params["broadcast_dimensions"][ins[0]] != outs[0]:
      raise _NotRowWise()
  elif name == "reshape":
    (i,), (o,) = ins[:1], outs
    shape_in = eqn.invars[0].aval.shape
    shape_out = eqn.outvars[0].aval.shape
    if i is None or o is None or (np.prod(shape_in[:i]) != np.prod(shape_out[:o])):
      raise _NotRowWise()
  elif name == "transpose":
    if list(params["permutation"]).index(ins[0]) != outs[0]:
      raise _NotRowWise()
  elif name == "squeeze":
    if ins[0] in params["dimensions"]:
      raise _NotRowWise()
  elif name in _REDUCTIONS:
    if ins[0] in params["axes"]:
      raise _NotRowWise()
  elif name in _CUMULATIVE:
    if ins[0] == params["axis"]:
      raise _NotRowWise()
  elif name == "dot_general":
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lhs, rhs = ins
    if lhs in lc or rhs in rc:
      raise _NotRowWise()
    if lhs is not None and rhs is not None and (lhs not in lb or rb[list(lb).index(lhs)] != rhs):
      raise _NotRowWise()
  elif name == "slice":
    i = ins[0]
    assert i is not None  # Its output has rows only where its operand does.
    strides = params["strides"] or (1,) * len(params["start_indices"])
    if (
      params["start_indices"][i] != 0
      or strides[i] != 1
      or params["limit_indices"][i] != eqn.invars[0].aval.shape[i]
    ):
      raise _NotRowWise()
  elif name == "dynamic_slice":
    i = ins[0]
    if (
      any(d is not None for d in ins[1:]) or params["slice_sizes"][i] != eqn.invars[0].aval.shape[i]
    ):
      raise _NotRowWise()
  elif name == "dynamic_update_slice":
    operand, update = eqn.invars[:2]
    if (
      ins[0] != ins[1]
      or any(d is not None for d in ins[2:])
      or operand.aval.shape[ins[0]] != update.aval.shape[ins[1]]
    ):
      raise _NotRowWise()
  elif name == "concatenate":
    if params["dimension"] in ins:
      raise _NotRowWise()
  elif name == "pad":
    if tuple(params["padding_config"][ins[0]]) != (0, 0, 0):
      raise _NotRowWise()
  elif name in _CALLS:
    _walk_closed(params[_CALLS[name]], twin.params[_CALLS[name]], parts)
  elif name == "scan":
    xs = ins[sum(scan_counts(params)) :]
    if 0 in xs or params["length"] != twin.params["length"]:
      raise _NotRowWise()
    _walk_closed(params["jaxpr"], twin.params["jaxpr"], parts)
  elif name == "while":
    _walk_closed(params["cond_jaxpr"], twin.params["cond_jaxpr"], parts)
    _walk_closed(params["body_jaxpr"], twin.params["body_jaxpr"], parts)
  elif name == "cond":
    if ins[0] is not None:
      raise _NotRowWise()
    for branch, other in zip(params["branches"], twin.params["branches"]):
      _walk_closed(branch, other, parts)
  else:
    raise _NotRowWise()


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
  """`(consts, carry)`: how many of a `scan` equation's inputs are each (its xs follow).

  jax 0.11 writes them as `ft_in`, the flat tree of the inputs' three
  groups, where earlier releases have `num_consts` and `num_carry`.
  """
  if "ft_in" in params:
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts.vals)), len(list(carry.vals))
  return params["num_consts"], params["num_carry"]


def _walk_closed(local: Any, whole: Any, parts: int) -> None:
  if hasattr(local, "consts"):
    _same_consts(local.consts, whole.consts)
    local, whole = local.jaxpr, whole.jaxpr
  _walk(local, whole, parts)


def _same_params(a: dict[str, Any], b: dict[str, Any]) -> bool:
  """Whether two equations' params are equal, their jaxprs (walked) and rules aside."""
  if a.keys() != b.keys():
    return False
  for key in a:
    x, y = a[key], b[key]
    if callable(x) or _holds_jaxpr(x):
      continue
    try:
      equal = bool(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y)
    except Exception:  # pylint: disable=broad-except
      equal = x is y
    if not equal:
      return False
  return True


def _holds_jaxpr(x: Any) -> bool:
  """Whether a param's value holds a jaxpr (`jaxpr_walk.sub_jaxprs` would walk into it)."""
  return any(True for _ in jaxpr_walk.sub_jaxprs({"value": x}))
