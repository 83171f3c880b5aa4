"""Scan over a stack of layers with explicit, stacked parameters.

A deep network repeats one block N times. Written as a Python loop, tracing
and compiling grow with N. `layer_scan` runs the block under `jax.lax.scan`
over parameters stacked along a leading layer axis, so they are traced once.
Because the bridge makes the parameters explicit, the layer may be any Haiku
function (or `hk.Transformed`) or any explicit-params function with its init
(a `jax.custom_vjp`, foreign code), and the scan may be rematerialised.

Names and layout are those of `hk.layer_stack` for the same layer (params
under `<scope>/<name>/<inner module>`, each with a leading layer axis), and
keys are drawn as `hk.layer_stack` draws them, so checkpoints and outputs move
between the two. `unstack_params` / `stack_params` convert to and from the
per-layer names of an unrolled loop.
"""

import dataclasses
import functools
import inspect
import re
import string
from typing import Any, Callable, Mapping, Optional, Sequence

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import caches
from haiku_bridge._src import call_pure as call_pure_lib
from haiku_bridge._src import errors
from haiku_bridge._src import guards
from haiku_bridge._src import haiku_internals
from haiku_bridge._src import inline
from haiku_bridge._src import pipeline as pipeline_lib
from haiku_bridge._src import remat_schedule
from haiku_bridge._src import scheduled_scan
from haiku_bridge._src.pytree import PyTree
from haiku_bridge._src.pytree import InitFn


# The names hk.layer_stack gives its stack when not given one.
NO_PER_LAYER_NAME = haiku_internals.LAYER_STACK_NAMES[False]
WITH_PER_LAYER_NAME = haiku_internals.LAYER_STACK_NAMES[True]

# `remat=` values that keep fewer carries than layers (remat_schedule.py).
REMAT_SCHEDULES = ("nested", "binomial")


def layer_keys(rng: Optional[jax.Array], num_layers: int) -> Optional[jax.Array]:
  """`num_layers` independent init keys from one key, as `hk.layer_stack` makes them."""
  if rng is None:
    return None

  def step(key, _):
    key, next_key, _ = jax.random.split(key, 3)
    return next_key, key

  return jax.lax.scan(step, rng, None, length=num_layers)[1]


def stacked_init(init: InitFn, num_layers: int,
                 in_axes: Optional[Sequence[Optional[int]]] = None) -> InitFn:
  """Stacks `num_layers` independent inits of `init` along a new leading axis.

  Usable as the `init` of `call_pure`, for a `jax.lax.scan` body of your own.
  Example: 8 dense layers in plain JAX, scanned, their weights Haiku params:

  >>> def dense(p, h):
  ...   return jnp.tanh(h @ p["w"] + p["b"])
  >>> def init_dense(rng, h):
  ...   return {"w": jax.random.normal(rng, [16, 16]) / 4, "b": jnp.zeros([16])}
  >>> def stack(params, x):
  ...   return jax.lax.scan(lambda h, p: (dense(p, h), None), x, params)[0]
  >>> net = hk.transform(
  ...     lambda x: hkb.call_pure(stack, x, name="stack",
  ...                             init=hkb.stacked_init(init_dense, 8)))
  >>> params = net.init(jax.random.PRNGKey(0), jnp.ones([2, 16]))
  >>> jax.tree.map(jnp.shape, params)
  {'stack': {'b': (8, 16), 'w': (8, 16, 16)}}
  >>> net.apply(params, None, jnp.ones([2, 16])).shape
  (2, 16)

  Args:
    init: `init(rng, *args, **kwargs) -> params` for one layer.
    num_layers: how many layers.
    in_axes: for each positional argument, the axis holding per-layer values,
      or None to give every layer the whole argument (the default for all).

  Returns:
    `init_stack(rng, *args, **kwargs)`: params whose every leaf has a leading
    axis of size `num_layers`; layer `i` is `init(key_i, ...)` with its own key.
    With `rng=None`, each layer's `init` gets None.
  """
  with errors.entry("stacked_init"):
    errors.check_callable(
        "init", init, "a function `init(rng, *args, **kwargs) -> params` "
        "for one layer")
    num_layers = _check_num_layers(num_layers)
    return _StackedInit(init, num_layers, _check_in_axes(in_axes))


_IN_AXES = ("None, or a sequence with one entry per positional argument of "
            "`init`: the axis of its per-layer values (an int), or None to "
            "give every layer all of it")


def _check_in_axes(in_axes: Any) -> Optional[tuple[Optional[int], ...]]:
  if in_axes is None:
    return None
  if (isinstance(in_axes, (str, bytes)) or
      not isinstance(in_axes, Sequence) or
      not all(a is None or errors.is_int(a) for a in in_axes)):
    raise TypeError(errors.bad_argument(
        "in_axes", in_axes, _IN_AXES,
        f"For one argument split on axis {in_axes!r}, write "
        f"in_axes=({in_axes!r},)." if errors.is_int(in_axes) else ""))
  return tuple(None if a is None else int(a) for a in in_axes)


@dataclasses.dataclass(frozen=True)
class _StackedInit:
  """`stacked_init`'s result: equal for equal inputs, so shape caches hit."""
  init: InitFn
  num_layers: int
  in_axes: Optional[tuple[Optional[int], ...]]

  def __call__(self, rng, *args, **kwargs):
    axes = self.in_axes if self.in_axes is not None else (None,) * len(args)
    with errors.entry("stacked_init"):
      self._check_args(axes, args)
    keys = layer_keys(rng, self.num_layers)
    one_layer = lambda key, *a: self.init(key, *a, **kwargs)
    return jax.vmap(one_layer, in_axes=(None if keys is None else 0,) + axes,
                    axis_size=self.num_layers)(keys, *args)

  def _check_args(self, axes, args) -> None:
    """`in_axes` against the arguments the init is called with."""
    if len(axes) != len(args):
      raise ValueError(errors.message(
          f"`in_axes` has {len(axes)} entries, {axes}, but the stacked init "
          f"was called with {len(args)} positional arguments after the rng; "
          "give one entry per argument (None to give every layer all of "
          "it)."))
    for i, (axis, arg) in enumerate(zip(axes, args)):
      if axis is None:
        continue
      for path, leaf in jax.tree_util.tree_leaves_with_path(arg):
        shape = np.shape(leaf)
        in_range = -len(shape) <= axis < len(shape)
        if not in_range or shape[axis] != self.num_layers:
          raise ValueError(errors.message(
              f"`in_axes[{i}]` is {axis}, so argument {i} holds per-layer "
              f"values on axis {axis}; but at {errors.keystr(path)} it has "
              f"shape {shape}, where that axis should have size "
              f"num_layers={self.num_layers}."))


def layer_scan(
    layer: Callable[..., Any] | hk.Transformed | hk.TransformedWithState,
    carry: PyTree,
    xs: PyTree = None,
    *,
    num_layers: Optional[int] = None,
    init: Optional[InitFn] = None,
    name: Optional[str] = None,
    remat: bool | str = False,
    remat_policy: Optional[Callable[..., bool]] = None,
    remat_groups: Optional[int] = None,
    unroll: int | bool = 1,
    reverse: bool = False,
    pipeline: Optional[pipeline_lib.Pipeline] = None,
) -> tuple[PyTree, PyTree]:
  """Runs a stack of layers with `jax.lax.scan`, each with its own weights.

  The layer follows `jax.lax.scan`'s convention, `layer(carry, x) -> (carry,
  y)`, where `x` is the layer's slice of `xs` (None without `xs`) and the `y`s
  come back stacked. Example, 12 residual blocks traced once:

  >>> def block(h, _):
  ...   return h + hk.nets.MLP([64, h.shape[-1]])(h), None
  >>> def net(h):
  ...   return hkb.layer_scan(block, h, num_layers=12, remat=True)[0]
  >>> net = hk.transform(net)
  >>> params = net.init(jax.random.PRNGKey(0), jnp.ones([2, 16]))
  >>> params["__layer_stack_no_per_layer/mlp/~/linear_0"]["w"].shape
  (12, 16, 64)

  With `remat="nested"`, a training step keeps ≈2√N carries instead of one
  per layer, for the same params, outputs and gradients as `remat=True`:

  >>> nested = hk.transform(lambda h: hkb.layer_scan(
  ...     block, h, num_layers=12, remat="nested")[0])
  >>> def grads(f):
  ...   x = jnp.ones([2, 16])
  ...   return jax.grad(lambda p: jnp.sum(f.apply(p, None, x) ** 2))(params)
  >>> jax.tree.all(jax.tree.map(jnp.allclose, grads(nested), grads(net)))
  True

  It runs as `hk.layer_stack` runs the same layer: the same names, stacked
  layout, initial values for the same key (each layer's init sees the carry
  the layer before it returns), rng keys, state, and what custom getters and
  creators see (each layer's own params). At apply nothing is initialised:
  eval-mode flags, new shapes and a process where init never ran all work.

  Args:
    layer: a Haiku function or `hk.Transformed(WithState)` called as
      `layer(carry, x)`; or, with `init=`, a pure function
      `layer(params, carry, x) -> (carry, y)`, which runs as the Haiku layer
      `hkb.call_pure(layer, carry, x, init=init)`. Haiku state is stacked per
      layer and written back after the scan; each layer gets its own rng.
    carry: the input of the first layer.
    xs: optional per-layer inputs, each leaf with a leading axis of size
      `num_layers`.
    num_layers: the number of layers; taken from `xs` when not given.
    init: for a pure `layer`, `init(rng, carry, x) -> params` of one layer.
    name: the name of the stack's module (default: `hk.layer_stack`'s),
      numbered as Haiku numbers modules when used again.
    remat: what the backward pass keeps and recomputes, trading compute for
      memory: `False`, `True`, `"nested"` or `"binomial"`. `True`:
      recompute each layer's activations from its carry, keeping one carry
      per layer (`jax.checkpoint` on the scan body, as `hk.layer_stack` of
      `hk.remat(layer)`). `"nested"`: keep ≈2√N carries
      for N layers: the layers in ≈√N groups, the backward pass recomputes
      one group's carries at a time from the group's first one, then each
      layer's activations (one more forward pass in all). `"binomial"`:
      recompute as many layers as `"nested"` does, keeping the fewest
      carries that allows (treeverse). The schedules give the same values
      and derivatives as `True`. They shape reverse-mode autodiff
      (`jax.grad`, `jax.vjp`); forward mode (`jax.jvp`, `jax.jacfwd`,
      `jax.linearize`) keeps nothing to schedule and runs as `True`, when
      it is applied to the function that calls the scan (not through a
      `jax.jit` inside it: there JAX raises that a custom_vjp has no
      forward mode; see `scheduled_scan.py`).
    remat_policy: a `jax.checkpoint_policies` policy, with `remat=True`.
    remat_groups: with `remat="nested"`, the number of groups, a positive
      int (default ≈√N; the last group takes what remains); with
      `"binomial"`, recompute as many layers as `"nested"` with that many
      groups.
    unroll: passed to `jax.lax.scan`: a bool or a non-negative int.
    reverse: run the layers from last to first (as `jax.lax.scan`).
    pipeline: an `hkb.Pipeline`: at apply, run the layers as pipeline
      stages over a mesh axis, the batch in microbatches (init runs the
      plain scan: the params are the same). The remat options apply to each
      stage's layers. With more than one microbatch, each `y` must have the
      batch on axis 0; see `hkb.Pipeline`.

  Returns:
    `(carry, ys)`: the last layer's carry, and the per-layer `y`s stacked.
  """
  # Called by repeat_layer, messages name repeat_layer.
  with errors.entry("layer_scan",
                    outer_wins=errors.current() == "repeat_layer"):
    guards.require_transform()
    _check_layer_args(layer, init, name, "(carry, x) -> (carry, y)")
    num_layers = _num_layers(num_layers, xs)
    remat, remat_groups, pipeline = _check_options(
        remat, remat_policy, remat_groups, unroll, reverse, pipeline)
    if name is None:
      name = NO_PER_LAYER_NAME if xs is None else WITH_PER_LAYER_NAME
    layer_init, layer_apply = _transformed_layer(_haiku_layer(layer, init,
                                                              carry, xs))

    def init_one(state, x):
      carry, key = state
      if key is None:
        key, next_key, apply_key = None, None, None
      else:
        key, next_key, apply_key = jax.random.split(key, 3)
      params, layer_state = layer_init(key, carry, x)
      # The next layer's init sees the carry this layer returns.
      (carry, _), layer_state = layer_apply(params, layer_state, apply_key,
                                            carry, x)
      return (carry, next_key), (params, layer_state)

    def init_stack(carry, xs, key):
      return jax.lax.scan(init_one, (carry, key), xs, length=num_layers)[1]

    lifted, updater = hk.lift_with_state(init_stack, allow_reuse=True,
                                         name=name)
    params, state = lifted(carry, xs, hk.maybe_next_rng_key())
    _check_depth(name, params, num_layers)
    key = hk.maybe_next_rng_key()
    keys = None if key is None else jax.random.split(key, num_layers)

    def body(carry, scanned):
      params, state, key, x = scanned
      (carry, y), state = layer_apply(params, state, key, carry, x)
      return carry, (y, state)

    scanned = (params, state, keys, xs)
    scan = _LayerLoop(remat, remat_policy, remat_groups, unroll)
    stages = None
    if pipeline is not None:
      # Init runs the plain scan (the same params), and so does a bridge
      # that runs this only to find the params it reads, where no mesh is
      # set (a bridged function's init): neither needs a mesh.
      stages = pipeline_lib.check(
          pipeline, carry, num_layers,
          require_mesh=not (hk.running_init() or inline.planning()))
    if pipeline is not None and stages is not None and not hk.running_init():
      carry, (ys, state) = pipeline_lib.run(
          pipeline, stages, body, carry, scanned, num_layers=num_layers,
          scan=scan, reverse=reverse)
    else:
      carry, (ys, state) = scan(body, carry, scanned, num_layers, reverse)
    updater.update(state)
  return carry, ys


@dataclasses.dataclass(frozen=True)
class _LayerLoop:
  """The scan over layers, with `layer_scan`'s remat; the pipeline runs it per stage."""
  remat: bool | str
  policy: Optional[Callable[..., bool]]
  groups: Optional[int]
  unroll: int | bool

  def __call__(self, body, carry, scanned, length, reverse=False):
    if self.remat in REMAT_SCHEDULES:
      return scheduled_scan.scan(
          body, carry, scanned, length=length,
          schedule=_remat_schedule(self.remat, length, self.groups),
          unroll=self.unroll, reverse=reverse)
    if self.remat:
      body = jax.checkpoint(body, policy=self.policy)
    return jax.lax.scan(body, carry, scanned, length=length,
                        unroll=self.unroll, reverse=reverse)


def repeat_layer(layer: Callable[..., Any], x: PyTree, num_layers: int,
                 *, init: Optional[InitFn] = None, **options: Any) -> PyTree:
  """`layer` applied `num_layers` times with separate weights: `layer_scan` for `x -> x` layers.

  >>> def net(x):
  ...   return hkb.repeat_layer(lambda h: h + hk.nets.MLP([64, 16])(h), x, 12)
  >>> net = hk.transform(net)
  >>> params = net.init(jax.random.PRNGKey(0), jnp.ones([2, 16]))
  >>> net.apply(params, None, jnp.ones([2, 16])).shape
  (2, 16)

  Args:
    layer: a Haiku function `layer(x) -> x`, or with `init=`, a pure
      `layer(params, x) -> x`.
    x: the input.
    num_layers: the number of layers.
    init: for a pure `layer`, `init(rng, x) -> params` of one layer.
    **options: `name`, `remat`, `remat_policy`, `remat_groups`, `unroll`,
      `reverse`, `pipeline`, as for `layer_scan`.

  Returns:
    The last layer's output.
  """
  with errors.entry("repeat_layer"):
    num_layers = _check_num_layers(num_layers)
    _check_repeat_options(options)
    _check_layer_args(layer, init, options.get("name"), "x -> x")
    f = inline.haiku_function(layer) if init is None else layer
    _check_layer_signature(f, init, (x,))
    return layer_scan(
        _CarryLayer(f), x, num_layers=num_layers,
        init=None if init is None else _CarryInit(init), **options)[0]


# `layer_scan`'s options that `repeat_layer` passes on, with their defaults.
_REPEAT_OPTIONS = {"name": None, "remat": False, "remat_policy": None,
                   "remat_groups": None, "unroll": 1, "reverse": False,
                   "pipeline": None}


def _check_repeat_options(options: dict[str, Any]) -> None:
  """`repeat_layer`'s `**options`: known names, each value checked."""
  if "xs" in options:
    raise TypeError(errors.message(
        "takes no `xs`: its layers map x -> x, with no per-layer inputs. "
        "For per-layer inputs use hkb.layer_scan(layer, carry, xs), whose "
        "layer is `layer(carry, x) -> (carry, y)`."))
  unknown = sorted(set(options) - set(_REPEAT_OPTIONS))
  if unknown:
    raise TypeError(errors.message(
        f"got an unexpected keyword argument {unknown[0]!r}; its options "
        f"are {', '.join(_REPEAT_OPTIONS)} (as for hkb.layer_scan)."))
  given = dict(_REPEAT_OPTIONS, **options)
  del given["name"]  # Checked with the layer.
  _check_options(**given)


# `repeat_layer`'s adapters are dataclasses rather than lambdas, so that calls
# with one layer are equal and hit the caches of its transform.


@dataclasses.dataclass(frozen=True)
class _CarryLayer:
  """`x -> x` as `(carry, x) -> (carry, None)`, with or without leading params."""
  f: Callable[..., Any]

  def __call__(self, *args):
    *params, carry, _ = args
    return self.f(*params, carry), None


@dataclasses.dataclass(frozen=True)
class _CarryInit:
  """`init(rng, x)` as `init(rng, carry, x)`."""
  init: InitFn

  def __call__(self, rng, carry, _):
    return self.init(rng, carry)


@dataclasses.dataclass(frozen=True)
class _PureLayer:
  """A pure `layer(params, carry, x)` with its init, as a Haiku layer."""
  layer: Callable[..., Any]
  init: InitFn

  def __call__(self, carry, x):
    params = call_pure_lib.get_relevant_parameters(self.init, carry, x)
    return self.layer(params, carry, x)


@dataclasses.dataclass(frozen=True)
class _CheckedLayer:
  """A Haiku layer whose output is checked: a pair, with a carry like its input."""
  f: Callable[..., Any]

  def __call__(self, carry, x):
    with errors.entry("layer_scan"):
      out = self.f(carry, x)
      if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(errors.message(
            f"a layer must return a pair (carry, y); it returned "
            f"{errors.describe(out)}. Return `(new_carry, None)` for a layer "
            "without per-layer outputs, or use hkb.repeat_layer for `x -> x` "
            "layers."))
      _check_carry(carry, out[0])
    return out


def _check_layer_args(layer: Any, init: Any, name: Any,
                      signature: str) -> None:
  """`layer`, `init` and `name` of `layer_scan` / `repeat_layer`."""
  if not (callable(layer) or haiku_internals.is_transformed(layer)):
    raise TypeError(errors.bad_argument(
        "layer", layer, f"a Haiku function `{signature}` (or its "
        "hk.transform), or with `init=`, a pure layer taking its params "
        "first"))
  if init is not None:
    errors.check_callable(
        "init", init, "None or, for a pure layer, a function `init(rng, "
        "...)` returning one layer's params")
  errors.check_str("name", name, "a module name (a string) or None",
                   optional=True)


def _haiku_layer(layer, init, carry, xs) -> Callable[..., Any]:
  if init is not None:
    if haiku_internals.is_transformed(layer):
      raise TypeError(errors.message(
          "`layer` is an hk.Transformed, which brings its own init; do not "
          "pass `init=` as well."))
    return _PureLayer(layer, init)
  f = inline.haiku_function(layer)
  _check_layer_signature(f, init, (carry, None if xs is None else xs))
  return f


def _check_layer_signature(f, init, args) -> None:
  """A pure layer (one more leading argument) given without `init=`."""
  if init is not None:
    return
  try:
    signature = inspect.signature(f)
  except (TypeError, ValueError):
    return
  try:
    signature.bind(*args)
  except TypeError:
    try:
      signature.bind(None, *args)
    except TypeError:
      return
    raise TypeError(errors.message(
        f"{getattr(f, '__name__', f)!r} takes {len(args) + 1} arguments, one "
        f"more than a Haiku layer's {len(args)}: a pure layer "
        "`layer(params, ...)` needs `init=`, a function `init(rng, ...)` "
        "returning one layer's params.")) from None


@functools.lru_cache(maxsize=256)
def _transformed_layer(f: Callable[..., Any]) -> hk.TransformedWithState:
  return hk.transform_with_state(_CheckedLayer(f))


caches.register(_transformed_layer.cache_clear)


_REMAT = "False, True, \"nested\" or \"binomial\""


def _check_options(remat: Any, remat_policy: Any, remat_groups: Any,
                   unroll: Any, reverse: Any, pipeline: Any,
                   ) -> tuple[bool | str, Optional[int],
                              Optional[pipeline_lib.Pipeline]]:
  """The scan's options, checked: `(remat, remat_groups, pipeline)`."""
  remat = _remat_mode(remat, remat_policy, remat_groups)
  if remat_groups is not None:
    remat_groups = errors.check_positive_int("remat_groups", remat_groups)
  if not (isinstance(unroll, (bool, np.bool_)) or
          (errors.is_int(unroll) and unroll >= 0)):
    raise (ValueError if errors.is_int(unroll) else TypeError)(
        errors.bad_argument("unroll", unroll, "a bool or a non-negative "
                            "int, as for jax.lax.scan"))
  if not isinstance(reverse, (bool, np.bool_)):
    raise TypeError(errors.bad_argument("reverse", reverse, "a bool"))
  return remat, remat_groups, pipeline_lib.check_pipeline(pipeline)


def _remat_mode(remat: Any, policy: Any, groups: Any) -> bool | str:
  """`remat` checked: False, True, or one of REMAT_SCHEDULES."""
  if isinstance(remat, (bool, np.bool_)):
    remat = bool(remat)
  elif not isinstance(remat, str) or remat not in REMAT_SCHEDULES:
    # An int or float may be meant as a number of groups.
    example = (remat if errors.is_int(remat) and remat > 0 else 4)
    raise (ValueError if isinstance(remat, str) else TypeError)(
        errors.bad_argument(
            "remat", remat, _REMAT, "A schedule's number of groups goes in "
            f"`remat_groups=`: e.g. remat=\"nested\", remat_groups={example}."))
  if policy is not None:
    errors.check_callable("remat_policy", policy, "None or a "
                          "jax.checkpoint_policies policy")
    if remat is not True:
      raise ValueError(errors.message(
          "`remat_policy` needs `remat=True`: it says which activations the "
          "forward pass keeps for the backward pass, and the nested and "
          "binomial schedules keep none, only carries."))
  if groups is not None and remat not in REMAT_SCHEDULES:
    raise ValueError(errors.message(
        "`remat_groups` needs `remat=\"nested\"` or `\"binomial\"`."))
  return remat


@functools.lru_cache(maxsize=256)
def _remat_schedule(remat: str, num_layers: int,
                    groups: Optional[int]) -> remat_schedule.Schedule:
  nested = remat_schedule.nested(num_layers, groups)
  if remat == "nested":
    return nested
  # Treeverse with the fewest slots that recompute no more than `nested`.
  slots = remat_schedule.fewest_binomial_slots(num_layers,
                                               nested.recomputed_steps)
  return remat_schedule.binomial(num_layers, slots)


caches.register(_remat_schedule.cache_clear)


def _check_num_layers(num_layers: Any) -> int:
  return errors.check_positive_int("num_layers", num_layers)


def _num_layers(num_layers: Optional[int], xs: PyTree) -> int:
  leaves = jax.tree_util.tree_leaves_with_path(xs)
  for path, leaf in leaves:
    if not hasattr(leaf, "shape"):
      hint = (f" For {leaf} layers without per-layer inputs, pass "
              f"num_layers={leaf}." if errors.is_int(leaf) else "")
      raise TypeError(errors.message(
          f"xs{jax.tree_util.keystr(path)} is {errors.got(leaf)}; every leaf "
          "of xs must be an array of per-layer inputs, with a leading layer "
          f"axis.{hint}"))
  if num_layers is None:
    if not leaves:
      raise ValueError(errors.message(
          "needs `num_layers=` when there are no `xs`."))
    first = np.shape(leaves[0][1])
    num_layers = first[0] if first else None
  if num_layers is not None:
    num_layers = _check_num_layers(num_layers)
  size = ("(of size num_layers)" if num_layers is None else
          f"of size num_layers={num_layers}")
  for path, leaf in leaves:
    if not np.ndim(leaf) or leaf.shape[0] != num_layers:
      raise ValueError(errors.message(
          f"xs{jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)}, "
          f"but every leaf of xs needs a leading layer axis {size}."))
  assert num_layers is not None, "found above, or a leaf of xs was refused"
  return num_layers


def _check_depth(stack: str, params: PyTree, num_layers: int) -> None:
  """At apply, stacked params made for another number of layers."""
  for bundle, entries in params.items():
    for name, value in entries.items():
      depth = value.shape[0] if value.ndim else None
      if depth != num_layers:
        raise ValueError(errors.message(
            f"parameter '{stack}/{bundle}/{name}' has shape "
            f"{list(value.shape)}, a stack of {depth} layers, but this call "
            f"runs num_layers={num_layers}. Pass the number of layers the "
            "params were made with, or convert them (hkb.unstack_params / "
            "hkb.stack_params)."))


def _check_carry(before: PyTree, after: PyTree) -> None:
  describe = lambda t: jax.tree.map(errors.type_str, t)
  if jax.tree.structure(before) != jax.tree.structure(after) or any(
      (np.shape(a), jnp.result_type(a)) != (np.shape(b), jnp.result_type(b))
      for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))):
    raise ValueError(errors.message(
        "a layer must return a carry like the one it gets, since the next "
        f"layer takes it; the layer got {describe(before)} and returned "
        f"{describe(after)}. Return per-layer outputs as `y` in `(carry, "
        "y)`."))


# ---------------------------------------------------------------------------
# To and from the names of an unrolled loop.
# ---------------------------------------------------------------------------


def _loop_bundle(layer_scope: str, i: int, inner: str) -> str:
  scope = layer_scope.format(i=i)
  return scope if inner == "~" else f"{scope}/{inner}"


def unstack_params(params: PyTree, *, stack: str, num_layers: int,
                   layer_scope: str = "layer_{i}") -> PyTree:
  """Stacked params (a layer scan's) to the per-layer names of a loop.

  For a loop that runs layer `i` under `hk.name_scope(f"layer_{i}")`, stack
  bundle `<stack>/linear` becomes `layer_0/linear`, `layer_1/linear`, ...; the
  layer's own top-level params (`<stack>/~`) go to `layer_i` itself. Example:
  a scanned stack's params, run by the same 4 layers written as a loop:

  >>> def scanned(x):
  ...   with hk.name_scope("net"):
  ...     return hkb.repeat_layer(lambda h: jnp.tanh(hk.Linear(16)(h)), x, 4)
  >>> def looped(x):
  ...   with hk.name_scope("net"):
  ...     for i in range(4):
  ...       with hk.name_scope(f"layer_{i}"):
  ...         x = jnp.tanh(hk.Linear(16)(x))
  ...   return x
  >>> scanned, looped = hk.transform(scanned), hk.transform(looped)
  >>> x = jnp.ones([2, 16])
  >>> params = scanned.init(jax.random.PRNGKey(0), x)
  >>> sorted(params)
  ['net/__layer_stack_no_per_layer/linear']
  >>> loop_params = hkb.unstack_params(params, num_layers=4,
  ...                                  stack="net/__layer_stack_no_per_layer",
  ...                                  layer_scope="net/layer_{i}")
  >>> sorted(loop_params)
  ['net/layer_0/linear', 'net/layer_1/linear', 'net/layer_2/linear',
   'net/layer_3/linear']
  >>> np.allclose(looped.apply(loop_params, None, x),
  ...             scanned.apply(params, None, x), atol=1e-6)
  True

  Args:
    params: params holding a stack under `stack`; others are kept as they are.
    stack: the stack's full bundle prefix, e.g. `"net/encoder"`.
    num_layers: the number of layers.
    layer_scope: the full name scope of layer `i` in the loop, with `{i}`.

  Returns:
    The params with the stack split into per-layer bundles.
  """
  with errors.entry("unstack_params"):
    num_layers = _check_conversion(params, stack, num_layers, layer_scope)
    out = {bundle: dict(entries) for bundle, entries in params.items()
           if _inner_bundle(stack, bundle) is None}
    stacked = {bundle: entries for bundle, entries in params.items()
               if bundle not in out}
    if params and not stacked:
      raise ValueError(errors.message(
          f"no params under stack {stack!r}. Its bundles start with "
          f"'{stack}/'; the params have {sorted(params)[:8]}."))
    for bundle, entries in stacked.items():
      inner = _inner_bundle(stack, bundle)
      assert inner is not None, "a stacked bundle has a bundle inside"
      for key, value in entries.items():
        if value.shape[:1] != (num_layers,):
          raise ValueError(errors.message(
              f"{bundle}/{key} has shape {tuple(value.shape)}, not a leading "
              f"layer axis of {num_layers}."))
      for i in range(num_layers):
        loop_bundle = _loop_bundle(layer_scope, i, inner)
        if loop_bundle in params:
          raise ValueError(errors.message(
              f"layer {i} of {bundle!r} goes to {loop_bundle!r} by "
              f"layer_scope {layer_scope!r}, but the params already have a "
              f"bundle {loop_bundle!r}. Pass the loop's own layer_scope."))
        loop = out.setdefault(loop_bundle, {})
        for key, value in entries.items():
          loop[key] = value[i]
  return out


def stack_params(params: PyTree, *, stack: str, num_layers: int,
                 layer_scope: str = "layer_{i}") -> PyTree:
  """The inverse of `unstack_params`: loop params to a layer scan's.

  Example: a loop's checkpoint, run by the same 3 layers under `repeat_layer`
  (at top level, so `layer_scope` is the default `"layer_{i}"`):

  >>> def looped(x):
  ...   for i in range(3):
  ...     with hk.name_scope(f"layer_{i}"):
  ...       x = jnp.tanh(hk.Linear(16)(x))
  ...   return x
  >>> looped = hk.transform(looped)
  >>> scanned = hk.transform(
  ...     lambda x: hkb.repeat_layer(lambda h: jnp.tanh(hk.Linear(16)(h)), x, 3))
  >>> x = jnp.ones([2, 16])
  >>> loop_params = looped.init(jax.random.PRNGKey(0), x)
  >>> params = hkb.stack_params(loop_params, num_layers=3,
  ...                           stack="__layer_stack_no_per_layer")
  >>> jax.tree.map(jnp.shape, params)
  {'__layer_stack_no_per_layer/linear': {'b': (3, 16), 'w': (3, 16, 16)}}
  >>> np.allclose(scanned.apply(params, None, x),
  ...             looped.apply(loop_params, None, x), atol=1e-6)
  True
  """
  with errors.entry("stack_params"):
    num_layers = _check_conversion(params, stack, num_layers, layer_scope)
    pattern = re.compile("^" + re.escape(layer_scope).replace(
        re.escape("{i}"), r"(?P<i>\d+)") + r"(?:/(?P<inner>.+))?$")
    per_layer: dict[str, dict[str, list[Any]]] = {}
    out = {}
    for bundle, entries in params.items():
      match = pattern.match(bundle)
      if match is None:
        out[bundle] = dict(entries)
        continue
      if int(match["i"]) >= num_layers:
        raise ValueError(errors.message(
            f"{bundle!r} is layer {match['i']} by {layer_scope!r}, but "
            f"num_layers={num_layers}. Pass the number of layers the loop "
            "has."))
      stacked_bundle = f"{stack}/{match['inner'] or '~'}"
      for key, value in entries.items():
        slots = per_layer.setdefault(stacked_bundle, {}).setdefault(
            key, [None] * num_layers)
        slots[int(match["i"])] = value
    if params and not per_layer:
      raise ValueError(errors.message(
          f"no bundle is a layer by layer_scope {layer_scope!r} (layer 0 "
          f"would be {layer_scope.format(i=0)!r} or start with "
          f"'{layer_scope.format(i=0)}/'); the params have "
          f"{sorted(params)[:8]}. Pass the full name scope of layer i in the "
          "loop."))
    for bundle, entries in per_layer.items():
      if bundle in out:
        raise ValueError(errors.message(
            f"the layers stack into {bundle!r}, but the params already have "
            f"a bundle {bundle!r}. Pass another `stack`."))
      for key, values in entries.items():
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
          raise ValueError(errors.message(
              f"{bundle}/{key} is missing for layers {missing} (looked for "
              f"{layer_scope!r} bundles)."))
        shapes = [tuple(np.shape(v)) for v in values]
        if len(set(shapes)) > 1:
          i = next(i for i, shape in enumerate(shapes) if shape != shapes[0])
          raise ValueError(errors.message(
              f"{bundle}/{key} has shape {shapes[0]} in layer 0 but "
              f"{shapes[i]} in layer {i}; only layers of one shape stack."))
        out.setdefault(bundle, {})[key] = jnp.stack(values)
  return out


def _check_conversion(params: Any, stack: Any, num_layers: Any,
                      layer_scope: Any) -> int:
  """The arguments of `unstack_params` / `stack_params`; returns num_layers."""
  _check_params_dict(params)
  errors.check_str(
      "stack", stack, "the stack's full bundle prefix, a string such as "
      "'net/__layer_stack_no_per_layer' (no trailing '/')")
  if stack.endswith("/"):
    raise ValueError(errors.bad_argument(
        "stack", stack, "the stack's full bundle prefix, without a trailing "
        "'/'"))
  errors.check_str("layer_scope", layer_scope,
                   "a string such as 'layer_{i}' or 'net/block_{i}'")
  try:
    fields = [field for _, field, _, _ in string.Formatter().parse(layer_scope)
              if field is not None]
  except ValueError:
    fields = None
  if fields != ["i"]:
    raise ValueError(errors.bad_argument(
        "layer_scope", layer_scope, "the full name scope of layer i in the "
        "loop, with `{i}` once where the layer's number goes, e.g. "
        "'layer_{i}' or 'net/block_{i}'", "Without `{i}` every layer would "
        "get one name."))
  return _check_num_layers(num_layers)


def _check_params_dict(params: Any) -> None:
  wants = "a Haiku params dict {bundle: {name: array}}, as `f.init` returns"
  if not isinstance(params, Mapping):
    raise TypeError(errors.bad_argument("params", params, wants))
  for bundle, entries in params.items():
    if not isinstance(bundle, str) or not isinstance(entries, Mapping):
      raise TypeError(errors.message(
          f"`params` must be {wants}; at {bundle!r} it holds "
          f"{errors.got(entries)}."))
    for name, value in entries.items():
      if not isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(errors.message(
            f"`params` must be {wants}; at {bundle}/{name} it holds "
            f"{errors.got(value)}."))


def _inner_bundle(stack: str, bundle: str) -> Optional[str]:
  if bundle.startswith(stack + "/"):
    return bundle[len(stack) + 1:]
  return None
