"""Custom gradients for Haiku functions: `custom_vjp`, `custom_jvp`.

Haiku has no module-level custom derivative: a `jax.custom_vjp` backward pass
must return cotangents for the weights, so the weights must be arguments,
while Haiku hides them behind `hk.get_parameter`. Here the user writes the
forward pass as an ordinary Haiku function `f(*args)` and gets, in `fwd` and
`bwd` (or `jvp`), its parameters as an explicit pytree:

    block = hkb.custom_vjp(f, hkb.vjp_fwd, bwd)
    y = block(x)            # anywhere inside a Haiku transform

How it works (`inline.py`). At init `f` runs inline, so its parameters,
state, rng draws and output are exactly inline code's. At apply `f` runs as a
pure function of `(params, state, rng_state, args)`, in a copy of the
caller's Haiku frame as it was at the call (as `hk.remat` runs its body), and
that function is wrapped in `jax.custom_vjp` (or `jax.custom_jvp`). State and
rng are arguments of that function, never closed over, so the backward pass
replays the same dropout mask; the new state and the caller's next rng state
are extra outputs whose cotangents are dropped, so they are updated by the
forward pass only and `bwd` never sees them.

The user's rules see the inner function as `f_pure(params, *args) -> out`,
with state and rng already bound. `params` is Haiku-shaped with the inner's
own names (`{"mlp/~/linear_0": {"w": ..., "b": ...}}`).
"""

from collections.abc import Mapping
import functools
from typing import Any, Callable, NamedTuple, Sequence

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import errors
from haiku_bridge._src import guards
from haiku_bridge._src import haiku_internals
from haiku_bridge._src import inline
from haiku_bridge._src import pytree
from haiku_bridge._src.pytree import PyTree

PureFn = Callable[..., Any]
FwdFn = Callable[..., tuple[Any, Any]]
BwdFn = Callable[[Any, Any], Sequence[Any]]
JvpFn = Callable[[PureFn, tuple[Any, ...], tuple[Any, ...]], tuple[Any, Any]]


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


def custom_vjp(
  f: Callable[..., Any] | hk.Transformed | hk.TransformedWithState,
  fwd: FwdFn,
  bwd: BwdFn,
  *,
  nondiff_argnums: Sequence[int] = (),
) -> Callable[..., Any]:
  """A Haiku function with a custom backward pass over its own weights.

  Example: a block whose weights learn from half the error they would get.

  >>> def mlp(x):
  ...   return hk.nets.MLP([8, 4])(x)
  >>> def half(vjp_fn, g):
  ...   params_ct, x_ct = vjp_fn(g)
  ...   return jax.tree.map(lambda c: 0.5 * c, params_ct), x_ct
  >>> block = hkb.custom_vjp(mlp, hkb.vjp_fwd, half)
  >>> net = hk.transform(lambda x: block(x))  # params named as inline mlp's
  >>> x = jnp.ones([2, 3])
  >>> params = net.init(jax.random.PRNGKey(0), x)
  >>> loss = lambda f: lambda p: f.apply(p, None, x).sum()
  >>> grads = jax.grad(loss(net))(params)
  >>> true_grads = jax.grad(loss(hk.transform(mlp)))(params)
  >>> jax.tree.all(jax.tree.map(lambda g, t: np.allclose(g, 0.5 * t),
  ...                           grads, true_grads))
  True

  Args:
    f: a Haiku function `f(*args) -> out` (or its `hk.transform*`). It may
      create modules, read and write state and draw rng keys; its parameters
      and state are named exactly as calling `f` inline would name them.
      `out`'s array leaves are differentiated; any other leaf (a tag, a
      Python number) comes back as it is, as inline.
    fwd: `fwd(f_pure, params, *args) -> (out, residuals)`. `f_pure(params,
      *args) -> out` is `f` as a pure function of its params (Haiku-shaped,
      the inner's names), with state and rng bound; `args` are the block's
      arguments as given, non-differentiable ones included. `hkb.vjp_fwd`
      stores a `jax.vjp` closure as the residuals. A `fwd` that returns
      `f_pure(params, *args)`'s output runs `f` once in the program, as
      inline code does; for any other `out` the bridge runs `f` once more
      for the block's new state. (The bridge also traces `f` once for its
      output's shapes, which puts nothing in the program: a Python side
      effect of `f` may happen once more than inline.)
    bwd: `bwd(residuals, out_cotangent) -> (params_ct, *args_cts)`, where
      `out_cotangent` is shaped like `out`, None at its non-array leaves: one
      cotangent for `params` and one per differentiable argument (positions
      not in `nondiff_argnums`), each with the structure and shapes of what
      it is the cotangent of, or None for zero (as `jax.custom_vjp`).
    nondiff_argnums: positions of arguments that are not differentiated and
      reach `f`, `fwd` and `f_pure` untraced: Python flags, ints, callables.

  Returns:
    `block(*args)`, callable inside a Haiku transform wherever `f` could be
    called: deep in modules, in `hk.vmap`, in a `layer_scan` layer, under
    `jax.jit`. At init it runs `f` as inline code would.
  """
  with errors.entry("custom_vjp"):
    nondiff_argnums = _check_block_args(f, nondiff_argnums)
    if fwd is route_cotangents or bwd is vjp_fwd:
      raise TypeError(
        errors.message(
          "the arguments are `(f, fwd, bwd)`: hkb.vjp_fwd is a `fwd`, and "
          "hkb.route_cotangents(split, combine) builds a `bwd`, e.g. "
          "hkb.custom_vjp(f, hkb.vjp_fwd, hkb.route_cotangents(split, "
          "combine))."
        )
      )
    errors.check_callable(
      "fwd", fwd, "a function `fwd(f_pure, params, *args) -> (out, residuals)`, e.g. hkb.vjp_fwd"
    )
    if bwd is route_cotangents:
      raise TypeError(
        errors.message(
          "`bwd` is hkb.route_cotangents itself; call it to build the bwd: "
          "hkb.route_cotangents(split, combine)."
        )
      )
    errors.check_callable(
      "bwd",
      bwd,
      "a function `bwd(residuals, out_cotangent) -> "
      "(params_ct, *args_cts)`, e.g. hkb.route_cotangents(split, combine)",
    )
  return _CustomVJP(f, fwd, bwd, nondiff_argnums)


def custom_jvp(
  f: Callable[..., Any] | hk.Transformed | hk.TransformedWithState,
  jvp: JvpFn,
  *,
  nondiff_argnums: Sequence[int] = (),
) -> Callable[..., Any]:
  """A Haiku function with a custom forward-mode derivative over its weights.

  Reverse mode (`jax.grad`) comes from transposing `jvp`, as for
  `jax.custom_jvp`, so `jvp` must be linear in the tangents. Example: a
  straight-through estimator, whose derivative is that of the unrounded
  layer. `params` uses the inner's names, so a surrogate built from the same
  modules takes them as they are.

  >>> def quantized(x):
  ...   return jnp.round(hk.Linear(4)(x))
  >>> smooth = hk.transform(lambda x: hk.Linear(4)(x))
  >>> def straight_through(f_pure, primals, tangents):
  ...   surrogate = lambda p, x: smooth.apply(p, None, x)
  ...   return f_pure(*primals), jax.jvp(surrogate, primals, tangents)[1]
  >>> block = hkb.custom_jvp(quantized, straight_through)
  >>> net = hk.transform(lambda x: block(x))
  >>> x = jnp.ones([2, 3])
  >>> params = net.init(jax.random.PRNGKey(0), x)
  >>> grads = jax.grad(lambda p: net.apply(p, None, x).sum())(params)
  >>> grads["linear"]["w"]  # the unrounded layer's: x summed over the batch
  Array([[2., 2., 2., 2.],
         [2., 2., 2., 2.],
         [2., 2., 2., 2.]], dtype=float32)

  Args:
    f: a Haiku function `f(*args) -> out` (or its `hk.transform*`), as for
      `custom_vjp`.
    jvp: `jvp(f_pure, primals, tangents) -> (out, out_dot)`, with `primals =
      (params, *args)` (all arguments, as given) and `tangents = (params_dot,
      *args_dot)` aligned with them, None at `nondiff_argnums` positions.
      `out_dot` has the structure, shapes and dtypes of `out`, with None at
      its non-array leaves (which come back as they are, as inline). If `out` is
      the output of `f_pure(*primals)` called in the rule, that run gives
      the block's new state too; otherwise the bridge runs `f` once more in
      the rule for it (and to check `out`).
    nondiff_argnums: positions of arguments that are not differentiated and
      reach `f`, `jvp` and `f_pure` untraced.

  Returns:
    `block(*args)`, callable inside a Haiku transform.
  """
  with errors.entry("custom_jvp"):
    nondiff_argnums = _check_block_args(f, nondiff_argnums)
    errors.check_callable(
      "jvp", jvp, "a function `jvp(f_pure, primals, tangents) -> (out, out_dot)`"
    )
  return _CustomJVP(f, jvp, nondiff_argnums)


def vjp_fwd(f_pure: PureFn, params: PyTree, *args: Any) -> tuple[Any, Any]:
  """A `fwd` for `custom_vjp` whose residuals are the `jax.vjp` closure.

  `vjp_fn(out_cotangent) -> (params_ct, *args_cts)` has exactly the output
  `bwd` must return (non-differentiable arguments are held fixed, never
  traced), so `bwd = lambda vjp_fn, g: vjp_fn(g)` is the true gradient, and
  any other `bwd` starts from it. The closure holds the forward's
  activations, so the backward pass does not recompute them. Unlike
  `jax.vjp(f_pure, ...)` written by hand, this also hands the block's new
  Haiku state over without a second forward pass. Example: the true gradient.

  >>> def mlp(x):
  ...   return hk.nets.MLP([8, 4])(x)
  >>> block = hkb.custom_vjp(mlp, hkb.vjp_fwd, lambda vjp_fn, g: vjp_fn(g))
  >>> net = hk.transform(lambda x: block(x))
  >>> x = jnp.ones([2, 3])
  >>> params = net.init(jax.random.PRNGKey(0), x)
  >>> loss = lambda f: lambda p: f.apply(p, None, x).sum()
  >>> grads = jax.grad(loss(net))(params)
  >>> true_grads = jax.grad(loss(hk.transform(mlp)))(params)
  >>> jax.tree.all(jax.tree.map(np.allclose, grads, true_grads))
  True

  Args:
    f_pure: the pure function `custom_vjp` passes to `fwd`.
    params: its params.
    *args: its arguments.

  Returns:
    `(out, vjp_fn)`.
  """
  with errors.entry("vjp_fwd"):
    errors.check_callable(
      "f_pure",
      f_pure,
      "the pure function `f_pure(params, *args)` that hkb.custom_vjp passes to `fwd`",
      "Pass hkb.vjp_fwd itself as `fwd`; the block calls it.",
    )
  nondiff = getattr(f_pure, "nondiff_argnums", ())
  diff = [i for i in range(len(args)) if i not in nondiff]
  with_aux = (
    f_pure.with_aux if isinstance(f_pure, _PureFunction) else lambda p, *a: (f_pure(p, *a), None)
  )

  outputs = []

  def diff_only(p, *diff_args):
    out, aux = with_aux(p, *_merge(args, diff, diff_args))
    arrays, output = _Output.of(out)  # Static leaves pass by jax.vjp.
    outputs.append(output)
    return arrays, aux

  arrays, vjp_fn, aux = jax.vjp(diff_only, params, *[args[i] for i in diff], has_aux=True)
  out = outputs[0].rebuild(arrays)
  # Takes a cotangent shaped like `out` (None, or anything, at its static
  # leaves); a pytree whose leaves are the vjp closure's, as residuals.
  vjp_fn = jax.tree_util.Partial(functools.partial(_vjp_of_output, outputs[0]), vjp_fn)
  if isinstance(f_pure, _PureFunction):
    # `has_aux` returns `aux` outside jax.vjp's trace: the block's new state
    # and rng, handed to the library with the residuals.
    return out, _ResidualsWithAux(vjp_fn, aux)
  return out, vjp_fn


def _vjp_of_output(output: "_Output", vjp_fn, out_ct):
  return vjp_fn(output.arrays_of(out_ct))


def route_cotangents(
  split: Callable[[Any], Mapping[str, Any]],
  combine: Callable[[dict[str, tuple[Any, ...]]], Sequence[Any]],
) -> BwdFn:
  """A `bwd` for `custom_vjp` + `vjp_fwd` that routes cotangent pieces.

  The backward pass splits the output cotangent into named, full-shaped
  pieces, runs the stored `jax.vjp` closure on all of them in one `jax.vmap`,
  and lets `combine` assemble the result from each piece's cotangents. The
  cotangents are linear in the output cotangent, so when the pieces sum to it,
  summing a cotangent over the pieces gives the true one. Example: the first
  half of the features teaches `layer1`, the second half `layer2`; the input
  gets the true cotangent.

  >>> def mlp(x):
  ...   h = jax.nn.relu(hk.Linear(32, name="layer1")(x))
  ...   return hk.Linear(16, name="layer2")(h)
  >>> route = {"layer1": "a", "layer2": "b"}
  >>> bwd = hkb.route_cotangents(
  ...     lambda g: {"a": g.at[..., 8:].set(0), "b": g.at[..., :8].set(0)},
  ...     lambda cts: ({m: cts[p][0][m] for m, p in route.items()},
  ...                  cts["a"][1] + cts["b"][1]))
  >>> block = hkb.custom_vjp(mlp, hkb.vjp_fwd, bwd)
  >>> net = hk.transform(lambda x: block(x))
  >>> x = jnp.ones([2, 4])
  >>> params = net.init(jax.random.PRNGKey(0), x)
  >>> loss = lambda f: lambda p, x: f.apply(p, None, x).sum()
  >>> grads, x_grad = jax.grad(loss(net), argnums=(0, 1))(params, x)
  >>> bool((grads["layer2"]["w"][:, :8] == 0).all())  # layer2 sees only "b"
  True
  >>> true_x_grad = jax.grad(loss(hk.transform(mlp)), argnums=1)(params, x)
  >>> np.allclose(x_grad, true_x_grad)
  True

  Args:
    split: `split(out_cotangent) -> {name: piece}`, each piece with the
      structure and shapes of the output cotangent.
    combine: `combine({name: (params_ct, *args_cts)}) -> (params_ct,
      *args_cts)`, given each piece's cotangents as the vjp closure returns
      them.

  Returns:
    `bwd(vjp_fn, out_cotangent)`, for residuals made by `hkb.vjp_fwd` (or any
    `fwd` whose residuals are a `jax.vjp` closure).
  """
  with errors.entry("route_cotangents"):
    errors.check_callable("split", split, "a function `split(out_cotangent) -> {name: piece}`")
    errors.check_callable(
      "combine",
      combine,
      "a function `combine({name: (params_ct, *args_cts)}) -> (params_ct, *args_cts)`",
    )

  def bwd(vjp_fn, out_ct):
    pieces = split(out_ct)
    with errors.entry("route_cotangents"):  # The backward pass: no entry open.
      _check_pieces(pieces, out_ct)
    names = list(pieces)
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *[pieces[name] for name in names])
    # One vmapped backward pass for all pieces, reusing the forward's
    # activations held by the closure.
    cts = jax.vmap(vjp_fn)(stacked)
    return combine({name: jax.tree.map(lambda c, i=i: c[i], cts) for i, name in enumerate(names)})

  return bwd


def _check_block_args(f: Any, nondiff_argnums: Any) -> tuple[int, ...]:
  """`f` and `nondiff_argnums` of `custom_vjp` / `custom_jvp`, on entry."""
  if not (callable(f) or isinstance(f, (hk.Transformed, hk.TransformedWithState))):
    raise TypeError(
      errors.bad_argument("f", f, "a Haiku function `f(*args) -> out` or its hk.transform")
    )
  if errors.is_int(nondiff_argnums):
    raise TypeError(
      errors.bad_argument(
        "nondiff_argnums",
        nondiff_argnums,
        "a sequence of argument positions",
        f"Write nondiff_argnums=({nondiff_argnums},).",
      )
    )
  return errors.check_int_sequence(
    "nondiff_argnums",
    nondiff_argnums,
    "a sequence of argument positions (non-negative ints), e.g. (1,)",
  )


# ---------------------------------------------------------------------------
# The inner function as the user's rules see it.
# ---------------------------------------------------------------------------


class _Aux(NamedTuple):
  """What a run hands back besides its output: new state, next rng state."""

  state: Any
  rng_state: Any


class _ResidualsWithAux(NamedTuple):
  """Residuals from `vjp_fwd`, carrying the run's `_Aux` to the library."""

  residuals: Any
  aux: _Aux


class _Output(NamedTuple):
  """`f`'s output, split into what JAX differentiates and what it passes by.

  Array leaves are the custom derivative's outputs. Every other leaf (a
  string tag, a Python number, a NumPy integer) is a static output, returned
  as it is, as inline code returns it; its cotangent or tangent is None.
  """

  treedef: Any  # Of the whole output.
  is_array: tuple[bool, ...]  # Per leaf.
  statics: tuple[Any, ...]  # The static leaves, in order.

  @classmethod
  def of(cls, out: PyTree) -> tuple[list[Any], "_Output"]:
    """`out`'s array leaves, and the record to rebuild it from them."""
    leaves, treedef = jax.tree.flatten(out)
    is_array = tuple(_is_array(leaf) for leaf in leaves)
    return (
      [x for x, a in zip(leaves, is_array) if a],
      cls(treedef, is_array, tuple(x for x, a in zip(leaves, is_array) if not a)),
    )

  def rebuild(self, arrays: Sequence[Any], static: Any = ...) -> PyTree:
    """The output from its arrays: statics in place (or `static`, e.g. None)."""
    array_iter, statics = iter(arrays), iter(self.statics)
    return self.treedef.unflatten(
      [
        next(array_iter) if a else (next(statics) if static is ... else static)
        for a in self.is_array
      ]
    )

  def tangent_treedef(self) -> Any:
    """The structure of a cotangent or tangent: None at each static leaf."""
    return jax.tree.structure(self.rebuild([0] * sum(self.is_array), None))

  def arrays_of(self, tree: PyTree) -> list[Any]:
    """The array leaves of `tree`, shaped like the output or like a tangent."""
    if jax.tree.structure(tree) == self.treedef:
      return [x for x, a in zip(jax.tree.leaves(tree), self.is_array) if a]
    return jax.tree.leaves(tree)


def _is_array(x: Any) -> bool:
  """What a custom derivative differentiates: arrays (NumPy float ones too)."""
  return isinstance(x, jax.Array) or (
    isinstance(x, (np.ndarray, np.generic)) and not pytree.is_python_value(x)
  )


@jax.tree_util.register_pytree_node_class
class _PureFunction:
  """`f_pure(params, *args) -> out`: the inner function, state and rng bound.

  A pytree whose leaves are the bound state and rng, so `fwd` may store it
  in the residuals and `bwd` rerun it: the same state and key, the same mask.
  `with_aux` also returns the run's `_Aux`; the library's own `vjp_fwd` hands
  that over with the residuals, so no second run is needed. Called on the
  rule's own primals (`primals`, the very objects), it keeps that run's
  `(out, aux)` as `seen`, for the same reason.
  """

  def __init__(self, apply, state, rng_state, nondiff_argnums, primals=None):
    self._apply = apply
    self._state = state
    self._rng_state = rng_state
    self.nondiff_argnums = tuple(nondiff_argnums)
    self._primals = primals
    self.seen = None

  def tree_flatten(self):
    return (self._state, self._rng_state), (self._apply, self.nondiff_argnums)

  @classmethod
  def tree_unflatten(cls, static, children):
    # mypy cannot count the arguments of a star-unpacked tuple.
    return cls(static[0], *children, static[1])  # type: ignore[call-arg]

  def __call__(self, params: PyTree, *args: Any) -> Any:
    return self.with_aux(params, *args)[0]

  def with_aux(self, params: PyTree, *args: Any) -> tuple[Any, _Aux]:
    """`(out, aux)` of one run."""
    out, new_state, final_rng = self._apply(params, self._state, self._rng_state, args, {})
    result = out, _Aux(new_state, final_rng)
    if (
      self.seen is None
      and self._primals is not None
      and _same_leaves((params, *args), self._primals)
    ):
      self.seen = result
    return result

  def unchanged_aux(self) -> _Aux:
    return _Aux(self._state, self._rng_state)


# ---------------------------------------------------------------------------
# The blocks.
# ---------------------------------------------------------------------------


class _CustomBlock:
  """What the VJP and JVP blocks share: binding `f` and its arguments."""

  _api = "custom_vjp"

  def __init__(self, f, nondiff_argnums):
    with errors.entry(self._api):
      inner = inline.haiku_function(f)
    functools.update_wrapper(self, inner, updated=())
    self._inline = inline.of(inner)
    # Checked on entry (`_check_block_args`): ints, none negative.
    self._nondiff = tuple(sorted(set(nondiff_argnums)))

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    with errors.entry(self._api):
      if kwargs:
        raise TypeError(
          errors.message(
            f"blocks take positional arguments only (got {sorted(kwargs)}): "
            "pass them by position, with Python flags in nondiff_argnums, or "
            "bind them into `f` with functools.partial."
          )
        )
      guards.require_transform()
      self._check_args(args)
      if guards.initialising():
        # Init runs `f` inline: no derivative is taken of init.
        return self._inline.run_at_init(args, {})
      call = self._inline.call(args, {})
      rng_state = hk.maybe_get_rng_sequence_state()
      out, new_state, final_rng = self._run(call, rng_state, args)
      if rng_state is not None:
        hk.replace_rng_sequence_state(final_rng)
      haiku_internals.write_state(new_state)
      return out

  def _check_args(self, args) -> None:
    for i in self._diff_positions(args):
      for path, leaf in jax.tree_util.tree_leaves_with_path(args[i]):
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, float, int, complex)):
          raise TypeError(
            errors.message(
              f"argument {i} holds a {type(leaf).__name__} at "
              f"{errors.keystr(path)}, which JAX cannot differentiate. Put "
              "its position in nondiff_argnums."
            )
          )
    for i in self._nondiff:
      if i >= len(args):
        raise ValueError(
          errors.message(
            f"nondiff_argnums has {i}, but the block was called with "
            f"{len(args)} positional arguments."
          )
        )
      if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(args[i])):
        raise TypeError(
          errors.message(
            f"argument {i} is in nondiff_argnums but holds a traced array. "
            "nondiff_argnums are for Python values (flags, ints, callables) "
            "that stay untraced; pass arrays as ordinary arguments and give "
            "them a None cotangent."
          )
        )

  def _diff_positions(self, args) -> list[int]:
    return [i for i in range(len(args)) if i not in self._nondiff]

  def _run(self, call, rng_state, args):
    """`f` at this call, wrapped in the custom rule, on its stored params."""
    diff = self._diff_positions(args)
    stateless = not call.bindings.state
    # The output's static leaves, as the run that JAX traced (`run`, or the
    # rule) returned them: the custom derivative carries only its arrays.
    outputs = []

    def run(params, state, rng_state, diff_args):
      out, new_state, final_rng = call.run(
        params, state, rng_state, _merge(args, diff, diff_args), {}
      )
      return record(out)[0], _Aux(new_state, final_rng)

    def record(out):
      arrays, output = _Output.of(out)
      outputs.append(output)
      return arrays, output

    def run_of(f_pure, params, full, rule_out):
      """`(output, specs, aux)` of the rule's run of `f`: its own, or one more.

      `specs` are the shapes and dtypes of its array leaves. A rule that
      returns the output of `f_pure` called on its primals as given has run
      `f` at its own level: that run's new state is taken, and `f` runs no
      more often than the rule runs it.
      """
      seen = f_pure.seen
      if seen is not None and _same_leaves(seen[0], rule_out):
        out, aux = seen
      elif stateless and rng_state is None:
        return (*_out_spec(f_pure, params, full, diff), f_pure.unchanged_aux())
      else:
        out, aux = f_pure.with_aux(params, *full)
      arrays, output = _Output.of(out)
      return output, pytree.specs(arrays), aux

    pure = lambda state, rng_state, primals: _PureFunction(
      call.run, state, rng_state, self._nondiff, primals
    )
    core = self._custom(run, run_of, pure, record, call.params, args, diff)
    arrays, aux = core(call.params, call.state, rng_state, tuple(args[i] for i in diff))
    return outputs[0].rebuild(arrays), aux.state, aux.rng_state

  def _custom(self, run, run_of, pure, record, params, args, diff):
    """`run` wrapped in the custom derivative.

    `run` returns the output's arrays (`record(out)` splits them from its
    static leaves, and keeps those for the block's result); so must the
    rules.
    """
    raise NotImplementedError


class _CustomVJP(_CustomBlock):
  """`block(*args)` of `custom_vjp`."""

  _api = "custom_vjp"

  def __init__(self, f, fwd, bwd, nondiff_argnums):
    super().__init__(f, nondiff_argnums)
    self._fwd, self._bwd = fwd, bwd

  def _custom(self, run, run_of, pure, record, params, args, diff):
    # Structure and shapes only: the backward pass must not close over
    # tracers of the forward.
    expected = (pytree.specs(params),) + tuple(pytree.specs(args[i]) for i in diff)
    core = jax.custom_vjp(run)
    outputs = []  # The output's record, for bwd's cotangent.

    def fwd_rule(params, state, rng_state, diff_args):
      with errors.entry(self._api):
        return fwd(params, state, rng_state, diff_args)

    def fwd(params, state, rng_state, diff_args):
      full = _merge(args, diff, diff_args)
      f_pure = pure(state, rng_state, (params, *full))
      result = self._fwd(f_pure, params, *full)
      if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise TypeError(
          errors.message(f"fwd must return a pair (out, residuals); got {errors.describe(result)}.")
        )
      out, residuals = result
      if isinstance(residuals, _ResidualsWithAux):
        # `vjp_fwd`: `out` is f_pure's own, and the run's new state with it.
        residuals, aux = residuals
      else:
        output, specs, aux = run_of(f_pure, params, full, out)
        _check_like("fwd's out", out, output, specs, "fwd")
      arrays, output = record(out)
      outputs.append(output)
      return (arrays, aux), residuals

    def bwd_rule(residuals, cotangents):
      # The backward pass runs after the block's call returned: its own entry.
      with errors.entry(self._api):
        out_ct, _ = cotangents  # State and rng are not differentiated.
        # Shaped like the output, None at its static leaves.
        out_ct = outputs[-1].rebuild(out_ct, None)
        cts = _check_bwd(self._bwd(residuals, out_ct), expected, diff, self._nondiff)
      return cts[0], None, None, tuple(cts[1:])

    core.defvjp(fwd_rule, bwd_rule)
    return core


class _CustomJVP(_CustomBlock):
  """`block(*args)` of `custom_jvp`."""

  _api = "custom_jvp"

  def __init__(self, f, jvp, nondiff_argnums):
    super().__init__(f, nondiff_argnums)
    self._jvp = jvp

  def _custom(self, run, run_of, pure, record, params, args, diff):
    core = jax.custom_jvp(run)

    def jvp_rule(primals, tangents):
      # JAX may run the rule after the block's call returned: its own entry.
      with errors.entry(self._api):
        return jvp(primals, tangents)

    def jvp(primals, tangents):
      params, state, rng_state, diff_args = primals
      params_dot, _, _, diff_dots = tangents  # State and rng: not differentiated.
      full = _merge(args, diff, diff_args)
      full_dots = _merge([None] * len(args), diff, diff_dots)
      f_pure = pure(state, rng_state, (params, *full))
      result = self._jvp(f_pure, (params, *full), (params_dot, *full_dots))
      if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise TypeError(
          errors.message(f"jvp must return a pair (out, out_dot); got {errors.describe(result)}.")
        )
      out, out_dot = result
      output, specs, aux = run_of(f_pure, params, full, out)
      _check_like("jvp's out", out, output, specs, "jvp")
      _check_like("jvp's out_dot", out_dot, output, specs, "jvp", tangent=True)
      return ((record(out)[0], aux), (jax.tree.leaves(out_dot), jax.tree.map(_zero_tangent, aux)))

    core.defjvp(jvp_rule)
    return core


def _out_spec(
  f_pure: _PureFunction, params, args, diff
) -> tuple[_Output, list[jax.ShapeDtypeStruct]]:
  """The output record of `f_pure(params, *args)` and its arrays' specs."""
  outputs = []

  def arrays(p, d):
    # Non-differentiable arguments stay closed over: never traced.
    arrays, output = _Output.of(f_pure(p, *_merge(args, diff, d)))
    outputs.append(output)
    return arrays

  specs = jax.eval_shape(arrays, params, [args[i] for i in diff])
  return outputs[0], pytree.specs(specs)


# ---------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------


def _same_leaves(a: PyTree, b: PyTree) -> bool:
  """Whether two trees hold the very same leaf objects."""
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _merge(args: Sequence[Any], positions: Sequence[int], values: Sequence[Any]) -> tuple[Any, ...]:
  """`args` with `args[positions[k]]` replaced by `values[k]`."""
  merged = list(args)
  for i, value in zip(positions, values):
    merged[i] = value
  return tuple(merged)


def _zero_tangent(x):
  if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(np.shape(x), jax.dtypes.float0)


def _check_like(
  what: str, tree, output: _Output, specs, rule: str, tangent: bool = False, hint: str = ""
):
  """Checks `tree` against f's output: its structure, its arrays' shapes.

  A tangent (`tangent`) has None at the output's static leaves; an output
  has the same static values there.
  """
  want_def = output.tangent_treedef() if tangent else output.treedef
  got_def = jax.tree.structure(tree)
  if got_def != want_def:
    raise ValueError(
      errors.message(
        f"{what} must have the structure of f's output, {want_def}; got "
        f"{got_def}. Check what {rule} returns.{hint}"
      )
    )
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  if not tangent:
    statics = [(p, x) for (p, x), a in zip(leaves, output.is_array) if not a]
    for (path, got), want in zip(statics, output.statics):
      if type(got) is not type(want) or not _equal(got, want):
        raise ValueError(
          errors.message(
            f"{what} at {errors.keystr(path)} is {errors.got(got)}, but f's "
            f"output there is {errors.got(want)}. Check what {rule} "
            f"returns.{hint}"
          )
        )
    leaves = [leaf for leaf, a in zip(leaves, output.is_array) if a]
  for (path, got), want in zip(leaves, specs):
    if not (_is_array(got) or isinstance(got, (bool, int, float, complex))):
      raise ValueError(
        errors.message(
          f"{what} at {errors.keystr(path)} is {errors.got(got)}, but f's "
          f"output there is {errors.type_str(want)}. Check what {rule} "
          f"returns.{hint}"
        )
      )
    got = jax.ShapeDtypeStruct(np.shape(got), jnp.result_type(got))
    dtype_ok = got.dtype == want.dtype
    if tangent and not jnp.issubdtype(want.dtype, jnp.inexact):
      dtype_ok = True  # Integer outputs have float0 tangents.
    if got.shape != want.shape or not dtype_ok:
      raise ValueError(
        errors.message(
          f"{what} at {errors.keystr(path)} is {errors.type_str(got)}, but "
          f"f's output there is {errors.type_str(want)}. Check what {rule} "
          f"returns.{hint}"
        )
      )


def _equal(a: Any, b: Any) -> bool:
  try:
    return bool(a is b or a == b)
  except Exception:  # pylint: disable=broad-except
    return False


def _check_bwd(result, expected, diff, nondiff):
  """The user's bwd output, checked and normalised for JAX.

  Checked here rather than by JAX because JAX's message would name the
  wrapper's arguments (state, rng) that the user never sees.
  """
  n = len(expected)
  wants = (
    f"(params_ct, *args_cts): {n} cotangents, one for params and one "
    f"per differentiable argument (positions {list(diff)})"
  )
  if nondiff:
    wants += f"; nondiff_argnums {list(nondiff)} get none"
  if not isinstance(result, (tuple, list)) or len(result) != n:
    raise ValueError(errors.message(f"bwd must return {wants}. Got {errors.describe(result)}."))
  names = ["params"] + [f"args[{i}]" for i in diff]
  out = []
  for name, ct, spec in zip(names, result, expected):
    out.append(_check_cotangent(name, ct, spec, wants))
  return out


def _check_cotangent(name, ct, spec, wants):
  """One cotangent of bwd: None (zero), or shaped like `spec`."""
  is_none = lambda x: x is None
  try:
    # `ct` first, with None as a leaf: None may stand for a whole subtree.
    jax.tree.map(lambda c, s: None, ct, spec, is_leaf=is_none)
  except (ValueError, TypeError):
    raise ValueError(
      errors.message(
        f"bwd's cotangent for {name} must have the structure "
        f"of {name}, {jax.tree.structure(spec)}; got "
        f"{jax.tree.structure(ct)}. bwd must return {wants}."
      )
    ) from None

  def fix(path, c, s):
    where = jax.tree_util.keystr(path) or "<root>"
    if c is None:
      return None
    if not isinstance(s, jax.ShapeDtypeStruct):
      raise ValueError(
        errors.message(
          f"bwd's cotangent for {name} has an array at "
          f"{where}, where {name} has a subtree {jax.tree.structure(s)}."
        )
      )
    if not jnp.issubdtype(s.dtype, jnp.inexact):
      return None  # The cotangent of an integer input is always zero.
    if np.shape(c) != s.shape:
      raise ValueError(
        errors.message(
          f"bwd's cotangent for {name} at {where} has shape "
          f"{list(np.shape(c))}, but {name} there is {errors.type_str(s)}."
        )
      )
    # What jax.grad would give: the cotangent in the primal's dtype.
    return jnp.asarray(c, s.dtype)

  return jax.tree_util.tree_map_with_path(fix, ct, spec, is_leaf=is_none)


def _check_pieces(pieces, out_ct) -> None:
  if not isinstance(pieces, Mapping) or not pieces:
    got = "an empty dict" if isinstance(pieces, Mapping) else errors.describe(pieces)
    raise TypeError(
      errors.message(f"split must return a non-empty dict {{name: piece}}; got {got}.")
    )
  arrays, output = _Output.of(out_ct)
  for name, piece in pieces.items():
    _check_like(
      f"piece {name!r}",
      piece,
      output,
      pytree.specs(arrays),
      "split",
      tangent=True,
      hint=" Each piece must be shaped like the whole output cotangent (zero outside its part).",
    )
