"""`call_pure`: run an explicit-params JAX function inside a Haiku transform.

Inside `hk.transform`, parameters are implicit: modules fetch them with
`hk.get_parameter`. `call_pure(fn, *args, init=init_fn)` makes them explicit for
one call: at init it runs `init_fn(rng, *args)` and stores every leaf of the
returned pytree as a Haiku parameter; at apply it reads those leaves back
(`init_fn` is only traced for shapes, it leaves nothing in the jaxpr) and calls
`fn(params, *args)`. Because `fn` is a plain function of its weights, any JAX
transform can wrap it: `jax.custom_vjp`, `jax.checkpoint`, `jax.lax.scan`,
`jax.vmap`.

Where each leaf is stored is decided by `naming.py`.
"""

import collections
import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import abstract_init
from haiku_bridge._src import haiku_internals
from haiku_bridge._src import naming

PyTree = Any
InitFn = Callable[..., PyTree]
Transformed = hk.Transformed | hk.TransformedWithState


def call_pure(
    fn: Callable[..., Any] | Transformed,
    *args: Any,
    init: InitFn | Transformed | None = None,
    name: Optional[str] = None,
    **kwargs: Any,
) -> Any:
  """Calls `fn(params, *args, **kwargs)` with params owned by the transform.

  Example: a linear layer written in plain JAX, used in a Haiku network.

  >>> def linear(params, x):
  ...   return x @ params["w"] + params["b"]
  >>> def init_linear(rng, x):
  ...   return {"w": jax.random.normal(rng, (x.shape[-1], 3)), "b": jnp.zeros(3)}
  >>> f = hk.transform(lambda x: hkb.call_pure(linear, x, init=init_linear,
  ...                                          name="proj"))
  >>> params = f.init(jax.random.PRNGKey(0), jnp.ones([2, 4]))
  >>> jax.tree.map(jnp.shape, params)
  {'proj': {'b': (3,), 'w': (4, 3)}}

  Args:
    fn: a pure function `fn(params, *args, **kwargs)`, or an `hk.Transformed`
      / `hk.TransformedWithState`. A transformed `fn` runs as if its Haiku
      function were called inline here: the same parameter and state names,
      the same initial values for the same rng, the same outputs; its state is
      read and written through Haiku state and its rng comes from the
      caller's sequence.
    *args: positional arguments for `fn` and `init`.
    init: `init(rng, *args, **kwargs) -> params`, any pytree of arrays (dicts,
      lists, tuples, NamedTuples, registered dataclasses; `None` for an empty
      subtree). Called once at init with a key from Haiku's rng sequence;
      never run at apply. May be an `hk.Transformed`, whose params are then
      named as inline code would name them. Optional when `fn` is transformed.
    name: an extra name scope for the parameters (as `hk.name_scope(name)`).
    **kwargs: keyword arguments for `fn` and `init`.

  Returns:
    What `fn` returns.

  Raises:
    ValueError: outside a transform; at init inside a raw JAX transform (use
      Haiku's wrapper, e.g. `hk.scan`); at apply for a parameter that is
      missing or whose shape or dtype differs from what `init` gives; for two
      leaves or two calls that map to the same parameter name.
    TypeError: when `init` returns a leaf that is not an array.
  """
  require_transform("call_pure")
  with _name_scope(name):
    if haiku_internals.is_transformed(fn):
      if init is not None and init is not fn:
        raise TypeError(
            "hkb.call_pure: `fn` is an hk.Transformed, which brings its own "
            "init; do not pass `init=` as well.")
      return _InlineFunction.of(fn).call(args, kwargs)
    if init is None:
      raise TypeError(
          "hkb.call_pure needs `init=`: a function `init(rng, *args, **kwargs)` "
          "that returns the params pytree of "
          f"{getattr(fn, '__name__', fn)!r}.")
    params = _params_for(init, args, kwargs, api="call_pure")
  return fn(params, *args, **kwargs)


def get_relevant_parameters(
    init: InitFn | Transformed,
    *args: Any,
    name: Optional[str] = None,
    **kwargs: Any,
) -> PyTree:
  """Returns the explicit params that `call_pure` would pass, without a call.

  Created at init and read at apply under the same naming rules as
  `call_pure(fn, *args, init=init, name=name)`; `call_pure` is this plus the
  call. Use it to share one set of weights between several pure calls:

  >>> def f(x1, x2):
  ...   params = hkb.get_relevant_parameters(init_linear, x1, name="shared")
  ...   return linear(params, x1) + linear(params, x2)

  Args:
    init: `init(rng, *args, **kwargs) -> params`, or an `hk.Transformed`.
    *args: positional arguments for `init`.
    name: an extra name scope for the parameters.
    **kwargs: keyword arguments for `init`.

  Returns:
    The params pytree, with the structure `init` returns.
  """
  require_transform("get_relevant_parameters")
  with _name_scope(name):
    return _params_for(init, args, kwargs, api="get_relevant_parameters")


def _params_for(init, args, kwargs, *, api: str) -> PyTree:
  if haiku_internals.is_transformed(init):
    params, state = _InlineFunction.of(init).bind(args, kwargs, api=api)
    if jax.tree.leaves(state):
      raise ValueError(
          f"hkb.{api}: `init` is a Haiku function with state "
          f"({sorted(state)}); a pure `fn` cannot update it. Pass the "
          "hk.TransformedWithState as `fn` itself.")
    return params
  return bind_tree(init, args, kwargs, api=api)


# ---------------------------------------------------------------------------
# Checks with messages that say what to do next.
# ---------------------------------------------------------------------------


def require_transform(api: str) -> None:
  try:
    hk.running_init()
  except ValueError:
    raise ValueError(
        f"hkb.{api} must be called inside a Haiku transform (a function passed "
        "to hk.transform / hk.transform_with_state, e.g. from a module's "
        "__call__). Outside Haiku there is nothing to bridge: call the pure "
        "function with its params directly.") from None


def _require_haiku_trace(api: str) -> None:
  if haiku_internals.inside_raw_jax_transform():
    raise ValueError(
        f"hkb.{api} ran at init inside a raw JAX transform (the body of "
        "jax.lax.scan / jax.vmap / jax.checkpoint / jax.lax.cond, ...), where "
        "Haiku cannot create parameters. Use Haiku's wrapper instead (hk.scan, "
        "hk.vmap, hk.remat, hk.cond), or call hkb.get_relevant_parameters "
        "outside the JAX transform and pass the params into it.")


def _check_array_leaves(tree: PyTree, api: str) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
      raise TypeError(
          f"hkb.{api}: init returned a {type(leaf).__name__} at params path "
          f"{jax.tree_util.keystr(path) or '<root>'} ({leaf!r:.60}); every leaf "
          "must be an array. Wrap it with jnp.asarray, or use None for an "
          "empty subtree.")


def _check_unique(kind: str, slots: Sequence[naming.Slot],
                  paths: Sequence[str], api: str) -> None:
  seen = {}
  for slot, path in zip(slots, paths):
    if slot in seen:
      raise ValueError(
          f"hkb.{api}: params paths {seen[slot]} and {path} both map to the "
          f"Haiku {kind} {slot.full_name!r}. Rename one of them.")
    seen[slot] = path
  for slot, path in zip(slots, paths):
    if not haiku_internals.claim_name(f"{kind}:{slot.full_name}"):
      raise ValueError(
          f"hkb.{api}: {kind} {slot.full_name!r} (params path {path}) is "
          "already used by another bridged call in this scope. Pass a "
          "distinct `name=` to each call to give it its own weights; to share "
          "weights, call hkb.get_relevant_parameters once and pass the params "
          "to each pure call.")


def _check_stored(kind: str, slot: naming.Slot, path: str, stored: Any,
                  spec: Any, api: str, check_shape: bool = True) -> None:
  if stored is None:
    raise ValueError(
        f"hkb.{api}: {kind} {slot.full_name!r} (params path {path}) is missing "
        f"at apply. It is created by init: pass apply the {kind}s that init "
        "returned for the same code path (a model saved before this call "
        "was added needs re-initialising or converting).")
  shape, dtype = tuple(stored.shape), stored.dtype
  if (check_shape and shape != tuple(spec.shape)) or dtype != spec.dtype:
    hint = ""
    if _looks_like_a_shard(shape, tuple(spec.shape)):
      hint = (" If apply runs inside jax.shard_map, it sees per-device shards "
              "of the params: put the shard_map inside the pure function "
              "instead, or use jax.jit with shardings.")
    raise ValueError(
        f"hkb.{api}: {kind} {slot.full_name!r} (params path {path}) is "
        f"{dtype.name}{list(shape)} in what apply was given, but init gives "
        f"{jnp.dtype(spec.dtype).name}{list(spec.shape)} for these inputs."
        + hint)


def _looks_like_a_shard(shape: tuple[int, ...],
                        full: tuple[int, ...]) -> bool:
  return (len(shape) == len(full) and shape != full and
          all(s and f % s == 0 for s, f in zip(shape, full)))


# ---------------------------------------------------------------------------
# Reading and writing leaves through Haiku.
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _name_scope(name: Optional[str]) -> Iterator[None]:
  if name is None:
    yield
  else:
    with hk.name_scope(name):
      yield


def _in_bundle(bundle: str) -> contextlib.AbstractContextManager[None]:
  if bundle == hk.experimental.current_name():
    return contextlib.nullcontext()
  return hk.name_scope(hk.force_name(bundle))


def _by_bundle(slots: Sequence[naming.Slot]) -> dict[str, list[int]]:
  """Leaf indices grouped by bundle, bundles in order of first appearance."""
  groups = collections.defaultdict(list)
  for i, slot in enumerate(slots):
    groups[slot.bundle].append(i)
  return groups


def _checked_stored(kind: str, slots, paths, specs, api: str,
                    check_shape: bool = True) -> list[Any]:
  """The stored values at apply, each checked against what init gives."""
  read = (haiku_internals.stored_param if kind == "parameter"
          else haiku_internals.stored_state)
  stored = [read(slot.bundle, slot.name) for slot in slots]
  for slot, path, value, spec in zip(slots, paths, stored, specs):
    _check_stored(kind, slot, path, value, spec, api, check_shape)
  return stored


def _fetch_params(slots, paths, specs, values, api: str,
                  check_shape: bool = True) -> list[Any]:
  """Creates (values given, at init) or reads (at apply) one param per slot.

  `check_shape=False` (at apply) leaves shapes to the consumer, which checks
  each against what it asks for: the nested apply of an inline function.
  """
  if values is None:
    stored = _checked_stored("parameter", slots, paths, specs, api,
                             check_shape)
    if not haiku_internals.getters_active("parameter"):
      # hk.get_parameter would return these very values; skipping it saves a
      # name-scope module per bundle, most of the bridge's cost at trace time.
      return stored
  leaves = [None] * len(slots)
  for bundle, indices in _by_bundle(slots).items():
    with _in_bundle(bundle):
      for i in indices:
        slot, spec = slots[i], specs[i]
        initializer = (None if values is None
                       else functools.partial(_constant, values[i]))
        # Unchecked shapes are the stored ones (the consumer checks them).
        shape = spec.shape if check_shape else stored[i].shape
        leaves[i] = hk.get_parameter(slot.name, shape, spec.dtype,
                                     init=initializer)
  return leaves


def _fetch_state(slots, paths, specs, values, api: str) -> list[Any]:
  """As `_fetch_params`, for Haiku state; `values` are (initial, current)."""
  if values is None:
    stored = _checked_stored("state", slots, paths, specs, api)
    if not haiku_internals.getters_active("state"):
      return stored  # What hk.get_state would return (see _fetch_params).
  leaves = [None] * len(slots)
  for bundle, indices in _by_bundle(slots).items():
    with _in_bundle(bundle):
      for i in indices:
        slot, spec = slots[i], specs[i]
        if values is None:
          leaves[i] = hk.get_state(slot.name)
        else:
          initial, current = values[i]
          leaves[i] = hk.get_state(slot.name, spec.shape, spec.dtype,
                                   init=functools.partial(_constant, initial))
          if current is not initial:
            hk.set_state(slot.name, current)
            leaves[i] = current
  return leaves


def _store_state(slots, old, new) -> None:
  for bundle, indices in _by_bundle(slots).items():
    with _in_bundle(bundle):
      for i in indices:
        if new[i] is not old[i]:
          hk.set_state(slots[i].name, new[i])


def _constant(value, shape, dtype):
  del shape, dtype  # Checked by hk.get_parameter against the value itself.
  return value


def _rng_key_spec() -> jax.ShapeDtypeStruct:
  rng_state = hk.maybe_get_rng_sequence_state()
  if rng_state is None:
    return jax.ShapeDtypeStruct((2,), jnp.uint32)
  key = rng_state[0]
  return jax.ShapeDtypeStruct(key.shape, key.dtype)


def _spec(leaf: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)


def _paths(tree: PyTree) -> list[str]:
  return [jax.tree_util.keystr(p) or "<root>"
          for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


# ---------------------------------------------------------------------------
# Any pytree: the key-path rule.
# ---------------------------------------------------------------------------


class BoundState(NamedTuple):
  """Haiku state bound to a pytree: read when bound, written back by `store`."""
  tree: PyTree
  slots: list[naming.Slot]
  leaves: list[Any]

  def store(self, new_tree: PyTree) -> None:
    """Writes the leaves of `new_tree` (same structure) that changed."""
    _store_state(self.slots, self.leaves, jax.tree.leaves(new_tree))


def bind_tree(init: InitFn, args, kwargs, *, api: str,
              draw_key: Callable[[], Any] = hk.next_rng_key,
              with_state: bool = False):
  """Binds the pytree `init` returns to Haiku params (and state), key-path rule.

  Args:
    init: `init(key, *args, **kwargs)` returning params, or `(params, state)`
      when `with_state`. Run once at init with `draw_key()`; at apply only
      traced for shapes.
    args: positional arguments for `init`.
    kwargs: keyword arguments for `init`.
    api: the public name to put in error messages.
    draw_key: how to draw `init`'s key at init time.
    with_state: whether `init` also returns state.

  Returns:
    The params pytree, or `(params, BoundState)` when `with_state`.
  """
  if hk.running_init():
    _require_haiku_trace(api)
    key_spec = _rng_key_spec()
    tree = init(draw_key(), *args, **kwargs)
    _check_array_leaves(tree, api)
    abstract_init.remember(init, key_spec, args, kwargs, tree)
    concrete = True
  else:
    tree = abstract_init.abstract_init(init, _rng_key_spec(), args, kwargs)
    concrete = False
  params_tree, state_tree = tree if with_state else (tree, None)
  scope = hk.experimental.current_name()
  params = jax.tree.structure(params_tree).unflatten(
      _bind_leaves("parameter", params_tree, scope, concrete, api)[1])
  if not with_state:
    return params
  slots, leaves = _bind_leaves("state", state_tree, scope, concrete, api)
  state = jax.tree.structure(state_tree).unflatten(leaves)
  return params, BoundState(state, slots, leaves)


def _bind_leaves(kind: str, tree: PyTree, scope: str, concrete: bool,
                 api: str):
  values = jax.tree.leaves(tree)
  specs = [_spec(v) for v in values]
  slots = naming.key_path_slots(tree, scope)
  paths = _paths(tree)
  _check_unique(kind, slots, paths, api)
  if kind == "parameter":
    leaves = _fetch_params(slots, paths, specs, values if concrete else None,
                           api)
  else:
    leaves = _fetch_state(slots, paths, specs,
                          [(v, v) for v in values] if concrete else None, api)
  return slots, leaves


# ---------------------------------------------------------------------------
# An hk.Transformed: the inline rule.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Run:
  """What one run of the inner function leaves behind, besides its outputs."""
  out: Any = None
  rng_state: Any = None
  state: Any = None
  # Only shapes are wanted (at apply, under jax.eval_shape): skip initializers.
  shapes_only: bool = False


def _zeros_creator(next_creator, shape, dtype, init, context):
  """Creates zeros instead of running the initializer: one op, same shape."""
  del next_creator, init, context
  return jnp.zeros(shape, dtype)


class _InlineFunction:
  """An inner Haiku function, run in its own transform but as if inline.

  The inner function runs in a nested `hk.transform_with_state` whose rng
  sequence starts where the caller's is and whose end state is handed back,
  so the inner draws exactly the keys inline code would draw, and the caller
  goes on from where inline code would leave it. Outputs, the final rng state
  and the current state are captured as the nested transform runs (no JAX
  transform stands between it and the bridge, so this is safe).
  """

  def __init__(self, f: Callable[..., Any]):

    def threaded(rng_state, run: _Run, *args, **kwargs):
      if rng_state is not None:
        hk.replace_rng_sequence_state(rng_state)
      with (hk.custom_creator(_zeros_creator, params=True, state=True)
            if run.shapes_only else contextlib.nullcontext()):
        run.out = f(*args, **kwargs)
      run.rng_state = hk.maybe_get_rng_sequence_state()
      if hk.running_init():  # Only init hands the current state over.
        run.state = hk.get_current_state()
      return run.out

    self._transformed = hk.transform_with_state(threaded)

  @staticmethod
  def of(transformed: Transformed) -> "_InlineFunction":
    # Keyed by the Haiku function, not the transform object: code that calls
    # `hk.transform(f)` afresh at each trace still hits the shape caches.
    return _inline_function_for(
        haiku_internals.original_fn(transformed) or transformed)

  def _init(self, rng_state, args, kwargs, shapes_only=False):
    run = _Run(shapes_only=shapes_only)
    key = None if rng_state is None else rng_state[0]
    with haiku_internals.interceptors_suspended():
      params, state = self._transformed.init(key, rng_state, run, *args,
                                             **kwargs)
    return params, state, run

  def _apply(self, params, state, rng_state, args, kwargs):
    run = _Run()
    key = None if rng_state is None else rng_state[0]
    with haiku_internals.interceptors_suspended():
      out, new_state = self._transformed.apply(params, state, key, rng_state,
                                               run, *args, **kwargs)
    return out, new_state, run.rng_state

  def _init_shapes(self, key, *args, **kwargs):
    # Initializers (random ops, mostly) would only be traced to be dropped.
    return self._init((key, ()), args, kwargs, shapes_only=True)[:2]

  def _abstract(self, args, kwargs, key_spec: jax.ShapeDtypeStruct):
    return abstract_init.abstract_init(self._init_shapes, key_spec, args,
                                       kwargs)

  def _bind(self, args, kwargs, api: str,
            shapes_checked_inside: bool = False) -> "_Bound":
    """Binds the inner function's params and state in the caller's transform.

    With `shapes_checked_inside`, the caller runs the nested apply on the
    params, where every `hk.get_parameter` checks its param's shape: then a
    structure cached for other dims (a new batch size) serves, and the shape
    pass over `init` is skipped. Only for stateless functions: Haiku checks
    no state shapes.
    """
    rng_state = hk.maybe_get_rng_sequence_state()
    key_spec = _rng_key_spec()
    shapes_checked = True
    if hk.running_init():
      _require_haiku_trace(api)
      inner_params, inner_state, run = self._init(rng_state, args, kwargs)
      abstract_init.remember(self._init_shapes, key_spec, args, kwargs,
                             (inner_params, inner_state))
      if rng_state is not None:
        hk.replace_rng_sequence_state(run.rng_state)
      param_values = _dict_leaves(inner_params)
      state_values = [(v, run.state[b][n]) for b, entries in inner_state.items()
                      for n, v in entries.items()]
    else:
      run = param_values = state_values = None
      shapes = abstract_init.cached(self._init_shapes, key_spec, args, kwargs)
      if shapes is None and shapes_checked_inside:
        shapes = abstract_init.structure(self._init_shapes, key_spec, args,
                                         kwargs)
        if shapes is not None and jax.tree.leaves(shapes[1]):
          shapes = None  # State: take the exact shapes.
        shapes_checked = shapes is None
      inner_params, inner_state = shapes or self._abstract(args, kwargs,
                                                           key_spec)

    mapping = naming.allocate_inline_names(
        list(inner_params) + list(inner_state))
    p_slots, p_paths, p_specs = _inline_slots(inner_params, mapping)
    s_slots, s_paths, s_specs = _inline_slots(inner_state, mapping)
    _check_unique("parameter", p_slots, p_paths, api)
    _check_unique("state", s_slots, s_paths, api)
    p_leaves = _fetch_params(p_slots, p_paths, p_specs, param_values, api,
                             shapes_checked)
    s_leaves = _fetch_state(s_slots, s_paths, s_specs, state_values, api)
    return _Bound(params=_rebuild(inner_params, p_leaves),
                  state=_rebuild(inner_state, s_leaves),
                  param_slots=p_slots, param_paths=p_paths,
                  param_leaves=p_leaves, param_values=param_values,
                  state_slots=s_slots, state_leaves=s_leaves, run=run,
                  shapes_checked=shapes_checked)

  def bind(self, args, kwargs, api: str):
    bound = self._bind(args, kwargs, api)
    return bound.params, bound.state

  def call(self, args, kwargs, *, api: str = "call_pure",
           apply_with: Optional[Callable[..., Any]] = None):
    """Runs the inner function here, as if inline.

    Args:
      args: positional arguments of the inner function.
      kwargs: keyword arguments of the inner function.
      api: the public name to put in error messages.
      apply_with: when given, runs in place of the nested apply as
        `apply_with(apply, params, state, rng_state, args, kwargs)` and
        returns what `apply` returns, `(out, new_state, final_rng_state)`;
        custom_grad.py wraps `apply` in a custom derivative this way.

    Returns:
      What the inner function returns.
    """
    rng_state = hk.maybe_get_rng_sequence_state()
    bound = self._bind(args, kwargs, api, shapes_checked_inside=True)
    run = bound.run
    if run is not None and all(
        a is b for a, b in zip(bound.param_leaves, bound.param_values)):
      # Init, and no custom getter changed a value: the nested init already
      # computed exactly what inline code returns at init.
      return run.out
    apply = apply_with or (lambda apply, *rest: apply(*rest))
    try:
      out, new_state, final_rng = apply(self._apply, bound.params,
                                        bound.state, rng_state, args, kwargs)
    except Exception as error:  # pylint: disable=broad-except
      if not bound.shapes_checked:
        # Haiku's own shape check may have fired, naming the inner path:
        # the exact shapes give the bridge's error, naming both.
        mismatch = self._shape_mismatch(bound, args, kwargs, api)
        if mismatch is not None:
          raise mismatch from error
      raise
    if run is None and rng_state is not None:
      hk.replace_rng_sequence_state(final_rng)
    _store_state(bound.state_slots, bound.state_leaves,
                 [new_state[b][n] for b, entries in bound.state.items()
                  for n in entries])
    return out

  def _shape_mismatch(self, bound: "_Bound", args, kwargs,
                      api: str) -> Optional[ValueError]:
    """The bridge's error for a stored param whose shape init would not give."""
    try:
      exact_params, _ = self._abstract(args, kwargs, _rng_key_spec())
    except Exception:  # pylint: disable=broad-except
      return None  # The inner function fails here anyway: keep its error.
    exact = {f"{b}/{n}": _spec(v) for b, entries in exact_params.items()
             for n, v in entries.items()}
    known = [i for i, path in enumerate(bound.param_paths) if path in exact]
    try:
      _checked_stored("parameter", [bound.param_slots[i] for i in known],
                      [bound.param_paths[i] for i in known],
                      [exact[bound.param_paths[i]] for i in known], api)
    except ValueError as mismatch:
      return mismatch
    return None


@dataclasses.dataclass
class _Bound:
  """An inner function's params and state, bound in the caller's transform."""
  params: PyTree
  state: PyTree
  param_slots: list[naming.Slot]
  param_paths: list[str]
  param_leaves: list[Any]
  param_values: Optional[list[Any]]  # At init: what the nested init made.
  state_slots: list[naming.Slot]
  state_leaves: list[Any]
  run: Optional[_Run]  # At init: the nested init's run.
  shapes_checked: bool  # Whether param shapes were checked against init's.


@functools.lru_cache(maxsize=256)
def _inline_function_for(f: Callable[..., Any]) -> _InlineFunction:
  if haiku_internals.is_transformed(f):
    raise TypeError(
        f"hkb: cannot find the Haiku function behind {f!r}; pass the result "
        "of hk.transform / hk.transform_with_state.")
  return _InlineFunction(f)


def _inline_slots(inner: PyTree, mapping: dict[str, str]):
  """Slots, paths and specs of a `{bundle: {name: leaf}}` dict.

  In the dict's own order, which at init is the order the inner function
  created them in, so the caller's params dict lists them as inline code
  would.
  """
  slots, paths, specs = [], [], []
  for bundle, entries in inner.items():
    for name, leaf in entries.items():
      slots.append(naming.Slot(mapping[bundle], name))
      paths.append(f"{bundle}/{name}")
      specs.append(_spec(leaf))
  return slots, paths, specs


def _dict_leaves(inner: PyTree) -> list[Any]:
  """The leaves of a `{bundle: {name: leaf}}` dict, in the dict's order."""
  return [leaf for entries in inner.values() for leaf in entries.values()]


def _rebuild(inner: PyTree, leaves: Sequence[Any]) -> PyTree:
  """`inner` with its leaves (given in the dict's order) replaced."""
  leaves = iter(leaves)
  return {bundle: {name: next(leaves) for name in entries}
          for bundle, entries in inner.items()}
