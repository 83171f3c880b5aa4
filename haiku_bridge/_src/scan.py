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
import re
from typing import Any, Callable, Optional, Sequence

import haiku as hk
import jax

from haiku_bridge._src import call_pure as call_pure_lib
from haiku_bridge._src import haiku_internals

PyTree = Any
InitFn = Callable[..., PyTree]

# The names hk.layer_stack gives its stack when not given one.
NO_PER_LAYER_NAME = "__layer_stack_no_per_layer"
WITH_PER_LAYER_NAME = "__layer_stack_with_per_layer"


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

  Usable as the `init` of `call_pure`, for a `jax.lax.scan` body of your own:

  >>> def stack(params, x):
  ...   return jax.lax.scan(lambda h, p: (dense(p, h), None), x, params)[0]
  >>> y = hkb.call_pure(stack, x, init=hkb.stacked_init(init_dense, 8))

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
  _check_num_layers(num_layers)
  return _StackedInit(init, num_layers,
                      None if in_axes is None else tuple(in_axes))


@dataclasses.dataclass(frozen=True)
class _StackedInit:
  """`stacked_init`'s result: equal for equal inputs, so shape caches hit."""
  init: InitFn
  num_layers: int
  in_axes: Optional[tuple[Optional[int], ...]]

  def __call__(self, rng, *args, **kwargs):
    axes = self.in_axes if self.in_axes is not None else (None,) * len(args)
    keys = layer_keys(rng, self.num_layers)
    one_layer = lambda key, *a: self.init(key, *a, **kwargs)
    return jax.vmap(one_layer, in_axes=(None if keys is None else 0,) + axes,
                    axis_size=self.num_layers)(keys, *args)


def layer_scan(
    layer: Callable[..., Any] | hk.Transformed | hk.TransformedWithState,
    carry: PyTree,
    xs: PyTree = None,
    *,
    num_layers: Optional[int] = None,
    init: Optional[InitFn] = None,
    name: Optional[str] = None,
    remat: bool = False,
    remat_policy: Optional[Callable[..., bool]] = None,
    unroll: int | bool = 1,
    reverse: bool = False,
) -> tuple[PyTree, PyTree]:
  """Runs a stack of layers with `jax.lax.scan`, each with its own weights.

  The layer follows `jax.lax.scan`'s convention, `layer(carry, x) -> (carry,
  y)`, where `x` is the layer's slice of `xs` (None without `xs`) and the `y`s
  come back stacked. Example, 12 residual blocks traced once:

  >>> def block(h, _):
  ...   return h + hk.nets.MLP([64, h.shape[-1]])(h), None
  >>> h, _ = hkb.layer_scan(block, h, num_layers=12, remat=True)

  Args:
    layer: a Haiku function or `hk.Transformed(WithState)` called as
      `layer(carry, x)`; or, with `init=`, a pure function
      `layer(params, carry, x) -> (carry, y)`. Haiku state is stacked per
      layer and written back after the scan; each layer gets its own rng.
    carry: the input of the first layer.
    xs: optional per-layer inputs, each leaf with a leading axis of size
      `num_layers`.
    num_layers: the number of layers; taken from `xs` when not given.
    init: for a pure `layer`, `init(rng, carry, x) -> params` of one layer.
    name: the name scope of the stacked params (default: `hk.layer_stack`'s).
    remat: recompute each layer's activations in the backward pass
      (`jax.checkpoint` on the scan body), trading compute for memory.
    remat_policy: a `jax.checkpoint_policies` policy, with `remat=True`.
    unroll: passed to `jax.lax.scan`.
    reverse: run the layers from last to first (as `jax.lax.scan`).

  Returns:
    `(carry, ys)`: the last layer's carry, and the per-layer `y`s stacked.
  """
  call_pure_lib.require_transform("layer_scan")
  num_layers = _num_layers(num_layers, xs)
  per_layer_axes = (None, None if xs is None else 0)
  if name is None:
    name = NO_PER_LAYER_NAME if xs is None else WITH_PER_LAYER_NAME
  if remat_policy is not None and not remat:
    raise ValueError("hkb.layer_scan: `remat_policy` needs `remat=True`.")

  with hk.name_scope(name):
    if init is not None:
      params = call_pure_lib.bind_tree(
          stacked_init(init, num_layers, per_layer_axes), (carry, xs), {},
          api="layer_scan")
      state = None
      run_layer = lambda p, s, key, c, x: (layer(p, c, x), s)
    else:
      transformed = _haiku_layer(haiku_internals.original_fn(layer) or layer)
      if not hk.running_init():
        # hk.layer_stack draws its init key at apply too; drawing it here as
        # well keeps the dropout keys of the two identical.
        hk.maybe_next_rng_key()
      params, state = call_pure_lib.bind_tree(
          _without_interceptors(
              stacked_init(transformed.init, num_layers, per_layer_axes)),
          (carry, xs), {}, api="layer_scan",
          draw_key=hk.maybe_next_rng_key, with_state=True)
      run_layer = _without_interceptors(transformed.apply)

    key = hk.maybe_next_rng_key()
    keys = None if key is None else jax.random.split(key, num_layers)

    def body(c, scanned):
      p, s, k, x = scanned
      (new_c, y), new_s = run_layer(p, s, k, c, x)
      _check_carry(c, new_c)
      return new_c, (y, new_s)

    if remat:
      body = jax.checkpoint(body, policy=remat_policy)
    carry, (ys, new_state) = jax.lax.scan(
        body, carry, (params, None if state is None else state.tree, keys, xs),
        length=num_layers, unroll=unroll, reverse=reverse)
    if state is not None:
      state.store(new_state)
  return carry, ys


def repeat_layer(layer: Callable[..., Any], x: PyTree, num_layers: int,
                 *, init: Optional[InitFn] = None, **options: Any) -> PyTree:
  """`layer` applied `num_layers` times with separate weights: `layer_scan` for `x -> x` layers.

  >>> y = hkb.repeat_layer(lambda h: h + hk.nets.MLP([64, 16])(h), x, 12)

  Args:
    layer: a Haiku function `layer(x) -> x`, or with `init=`, a pure
      `layer(params, x) -> x`.
    x: the input.
    num_layers: the number of layers.
    init: for a pure `layer`, `init(rng, x) -> params` of one layer.
    **options: `name`, `remat`, `remat_policy`, `unroll`, `reverse`, as for
      `layer_scan`.

  Returns:
    The last layer's output.
  """
  if init is None:
    f = haiku_internals.original_fn(layer) or layer
    return layer_scan(_CarryLayer(f), x, num_layers=num_layers, **options)[0]
  return layer_scan(_CarryLayer(layer), x, num_layers=num_layers,
                    init=_CarryInit(init), **options)[0]


# `repeat_layer`'s adapters are dataclasses rather than lambdas, so that calls
# with one layer are equal and hit the caches of its transform and shapes.


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
class _without_interceptors:  # pylint: disable=invalid-name
  """`f`, a nested Haiku transform, run without the caller's interceptors.

  The caller's custom getters and creators already ran once, on the stacked
  params, where `call_pure` reads them. (A dataclass, equal for equal `f`, so
  that shape caches hit.)
  """
  f: Callable[..., Any]

  def __call__(self, *args, **kwargs):
    with haiku_internals.interceptors_suspended():
      return self.f(*args, **kwargs)


@functools.lru_cache(maxsize=256)
def _haiku_layer(f: Callable[..., Any]) -> hk.TransformedWithState:
  return hk.transform_with_state(f)


def _check_num_layers(num_layers: Any) -> None:
  if not isinstance(num_layers, int) or num_layers <= 0:
    raise ValueError(
        f"num_layers must be a positive int; got {num_layers!r}.")


def _num_layers(num_layers: Optional[int], xs: PyTree) -> int:
  leaves = jax.tree_util.tree_leaves_with_path(xs)
  if num_layers is None:
    if not leaves:
      raise ValueError(
          "hkb.layer_scan needs `num_layers=` when there are no `xs`.")
    num_layers = leaves[0][1].shape[0] if leaves[0][1].ndim else 0
  _check_num_layers(num_layers)
  for path, leaf in leaves:
    if not leaf.ndim or leaf.shape[0] != num_layers:
      raise ValueError(
          f"hkb.layer_scan: xs{jax.tree_util.keystr(path)} has shape "
          f"{tuple(leaf.shape)}, but every leaf of xs needs a leading layer "
          f"axis of size num_layers={num_layers}.")
  return num_layers


def _check_carry(before: PyTree, after: PyTree) -> None:
  describe = lambda t: jax.tree.map(lambda x: f"{x.dtype}{list(x.shape)}", t)
  if jax.tree.structure(before) != jax.tree.structure(after) or any(
      (a.shape, a.dtype) != (b.shape, b.dtype)
      for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))):
    raise ValueError(
        "hkb.layer_scan: a layer must return a carry like the one it gets, "
        "since the next layer takes it; the layer got "
        f"{describe(before)} and returned {describe(after)}. Return per-layer "
        "outputs as `y` in `(carry, y)`.")


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
  layer's own top-level params (`<stack>/~`) go to `layer_i` itself.

  >>> loop_params = hkb.unstack_params(params, num_layers=4,
  ...                                  stack="net/__layer_stack_no_per_layer",
  ...                                  layer_scope="net/layer_{i}")

  Args:
    params: params holding a stack under `stack`; others are kept as they are.
    stack: the stack's full bundle prefix, e.g. `"net/encoder"`.
    num_layers: the number of layers.
    layer_scope: the full name scope of layer `i` in the loop, with `{i}`.

  Returns:
    The params with the stack split into per-layer bundles.
  """
  out = {}
  for bundle, entries in params.items():
    inner = _inner_bundle(stack, bundle)
    if inner is None:
      out[bundle] = dict(entries)
      continue
    for i in range(num_layers):
      loop = out.setdefault(_loop_bundle(layer_scope, i, inner), {})
      for key, value in entries.items():
        if value.shape[:1] != (num_layers,):
          raise ValueError(
              f"hkb.unstack_params: {bundle}/{key} has shape "
              f"{tuple(value.shape)}, not a leading layer axis of "
              f"{num_layers}.")
        loop[key] = value[i]
  return out


def stack_params(params: PyTree, *, stack: str, num_layers: int,
                 layer_scope: str = "layer_{i}") -> PyTree:
  """The inverse of `unstack_params`: loop params to a layer scan's."""
  pattern = re.compile("^" + re.escape(layer_scope).replace(
      re.escape("{i}"), r"(?P<i>\d+)") + r"(?:/(?P<inner>.+))?$")
  per_layer: dict[str, dict[str, list[Any]]] = {}
  out = {}
  for bundle, entries in params.items():
    match = pattern.match(bundle)
    if match is None or int(match["i"]) >= num_layers:
      out[bundle] = dict(entries)
      continue
    inner = match["inner"] or "~"
    stacked_bundle = f"{stack}/{inner}"
    for key, value in entries.items():
      slots = per_layer.setdefault(stacked_bundle, {}).setdefault(
          key, [None] * num_layers)
      slots[int(match["i"])] = value
  for bundle, entries in per_layer.items():
    for key, values in entries.items():
      missing = [i for i, v in enumerate(values) if v is None]
      if missing:
        raise ValueError(
            f"hkb.stack_params: {bundle}/{key} is missing for layers "
            f"{missing} (looked for {layer_scope!r} bundles).")
      out.setdefault(bundle, {})[key] = jax.numpy.stack(values)
  return out


def _inner_bundle(stack: str, bundle: str) -> Optional[str]:
  if bundle.startswith(stack + "/"):
    return bundle[len(stack) + 1:]
  return None
