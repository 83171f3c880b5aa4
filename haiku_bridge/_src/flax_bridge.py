"""Flax modules inside Haiku (`from_flax`), and Haiku functions as NNX modules (`to_nnx`).

`from_flax` wraps a Flax NNX module (an instance, or a constructor taking
`rngs`) or a Flax Linen module as a Haiku module. Its parameters become Haiku
parameters and its mutable variables Haiku state, named by the module's own
attribute paths under the Haiku scope (`block/linear1/kernel`: no `value`, no
`params` level); its rng streams draw from Haiku's rng.

`to_nnx` goes the other way, for migrating off Haiku: an `hk.transform(_with_state)`
becomes an `nnx.Module` whose `nnx.Param`s keep Haiku's names, so that a Haiku
checkpoint loads into it as it is.

Flax is an optional dependency (`pip install "haiku-bridge[flax]"`): this module
imports it, and `haiku_bridge` imports this module only when one of its names
is first used.
"""

from typing import Any, Callable, NamedTuple, Optional, Sequence

import flax.errors
import flax.linen as nn
from flax import nnx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import foreign_storage
from haiku_bridge._src.pytree import PyTree
from haiku_bridge._src.foreign_storage import Group

NnxConstructor = Callable[..., nnx.Module]

# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


def from_flax(
    module: nnx.Module | NnxConstructor | nn.Module,
    *,
    name: Optional[str] = None,
    rng_streams: Sequence[str] = ("dropout",),
) -> hk.Module:
  """A Flax NNX or Linen module as a Haiku module.

  Create it inside a Haiku transform, as any Haiku module, and call it like
  the Flax module. Calling it twice shares its weights.

  >>> class Block(nnx.Module):
  ...   def __init__(self, din, dout, *, rngs):
  ...     self.linear1 = nnx.Linear(din, 8, rngs=rngs)
  ...     self.bn = nnx.BatchNorm(8, rngs=rngs)
  ...     self.linear2 = nnx.Linear(8, dout, rngs=rngs)
  ...   def __call__(self, x):
  ...     return self.linear2(jax.nn.relu(self.bn(self.linear1(x))))
  >>> f = hk.transform_with_state(
  ...     lambda x: hkb.from_flax(lambda rngs: Block(4, 2, rngs=rngs))(x))
  >>> params, state = f.init(jax.random.PRNGKey(0), jnp.ones([3, 4]))
  >>> sorted(params), sorted(state)
  (['block/bn', 'block/linear1', 'block/linear2'], ['block/bn'])
  >>> sorted(params["block/bn"]), sorted(state["block/bn"])
  (['bias', 'scale'], ['mean', 'var'])
  >>> y, state = f.apply(params, state, None, jnp.ones([3, 4]))

  A Linen module is used as it is (Linen infers input sizes at init):

  >>> import flax.linen as nn
  >>> f = hk.transform(lambda x: hkb.from_flax(nn.Dense(3), name="proj")(x))
  >>> jax.tree.map(jnp.shape, f.init(jax.random.PRNGKey(0), jnp.ones([2, 4])))
  {'proj': {'bias': (3,), 'kernel': (4, 3)}}

  Args:
    module: an `nnx.Module` instance (its current weights are the initial
      params); a constructor `module(rngs=...)` returning one (called at init
      with `nnx.Rngs` seeded from Haiku's rng sequence, e.g.
      `functools.partial(nnx.Linear, 4, 8)`); or a Linen `nn.Module`.
    name: the Haiku module name; default: the Flax class name in snake case.
    rng_streams: Linen only: the rng streams (besides `params`) that the
      module draws from at apply, each fed from Haiku's rng.

  Returns:
    A Haiku module, `NnxModule` or `LinenModule`. NNX: `nnx.Param`s become
    Haiku params; rng state (`nnx.Rngs` streams held by the module) is fed
    from `hk.next_rng_key()` on each call; every other `nnx.Variable` (e.g.
    `BatchStat`) is Haiku state. Linen: the `params` collection becomes Haiku
    params, every other collection Haiku state (the collection name is not
    part of the Haiku name).

  Raises:
    TypeError: for something that is neither an NNX module, a constructor
      nor a Linen module.
  """
  if isinstance(module, nn.Module):
    return LinenModule(module, rng_streams=rng_streams, name=name)
  if isinstance(module, nnx.Module) or callable(module):
    return NnxModule(module, name=name)
  raise TypeError(
      f"hkb.from_flax takes an nnx.Module, a constructor `f(rngs=...)` that "
      f"returns one, or a Linen nn.Module; got {type(module).__name__}.")


def to_nnx(
    f: hk.Transformed | hk.TransformedWithState,
    *args: Any,
    rngs: Optional[nnx.Rngs] = None,
    params: Optional[hk.Params] = None,
    state: Optional[hk.State] = None,
    rng_stream: str = "dropout",
    **kwargs: Any,
) -> "HaikuModule":
  """A Haiku function as an `nnx.Module`, with Haiku's parameter names.

  The module's `params` attribute holds one `nnx.Param` per Haiku parameter,
  at `params[module_name][param_name]` exactly as in Haiku's params dict, and
  its `state` attribute one `HaikuState` variable per Haiku state entry. A
  Haiku checkpoint loads into it as it is, and `haiku_params()` /
  `haiku_state()` give Haiku's dicts back.

  >>> f = hk.transform(lambda x: hk.nets.MLP([8, 2])(x))
  >>> model = hkb.to_nnx(f, jnp.ones([1, 4]), rngs=nnx.Rngs(0))
  >>> sorted(model.haiku_params())
  ['mlp/~/linear_0', 'mlp/~/linear_1']
  >>> y = model(jnp.ones([3, 4]))
  >>> grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones([3, 4]))))(model)

  Args:
    f: the output of `hk.transform` or `hk.transform_with_state` (not of
      `hk.without_apply_rng`).
    *args: example inputs for `f.init`, when `params` is not given.
    rngs: `nnx.Rngs`. At construction, its `params` stream seeds `f.init`
      (when `params` is not given); on each call, its `rng_stream` stream gives
      `f.apply` its rng. Without `rngs`, `f.apply` gets `rng=None`.
    params: Haiku params (e.g. a checkpoint) instead of running `f.init`.
    state: Haiku state, with `params`; default: empty.
    rng_stream: the `rngs` stream that `f.apply`'s rng is drawn from.
    **kwargs: keyword inputs for `f.init`.

  Returns:
    A `HaikuModule`: calling it runs `f.apply` and writes the new Haiku state
    into its `HaikuState` variables.

  Raises:
    ValueError: without `params` and without `rngs` to initialise them.
  """
  transformed = _with_state(f, "to_nnx")
  if params is None:
    if rngs is None:
      raise ValueError(
          "hkb.to_nnx needs `rngs=nnx.Rngs(...)` to run f.init, or `params=` "
          "(e.g. a Haiku checkpoint) to use as they are.")
    params, state = transformed.init(rngs.params(), *args, **kwargs)
  return HaikuModule(transformed, params, state or {}, rngs=rngs,
                     rng_stream=rng_stream)


# ---------------------------------------------------------------------------
# NNX inside Haiku.
# ---------------------------------------------------------------------------


class NnxLayout(NamedTuple):
  """An NNX module taken apart: its graph and its variables, by kind."""
  graphdef: Any
  params: Group
  rng_keys: Group
  rng_counts: Group
  state: Group
  class_name: str


_FILTERS = (nnx.Param, nnx.RngKey, nnx.RngCount, ...)


def _split_nnx(module: nnx.Module) -> tuple[NnxLayout, list[list[Any]]]:
  graphdef, *states = nnx.split(module, *_FILTERS)
  groups, values = zip(*(foreign_storage.flatten_group(s) for s in states))
  return NnxLayout(graphdef, *groups, type(module).__name__), list(values)


def _construct_nnx(constructor: NnxConstructor, key: jax.Array,
                   what: str) -> nnx.Module:
  try:
    module = constructor(rngs=nnx.Rngs(key))
  except TypeError as e:
    raise TypeError(
        f"{what}: calling the constructor with `rngs=` alone failed: {e}. An "
        "NNX module takes its input sizes when it is constructed, so pass a "
        "constructor with them bound, e.g. `functools.partial(nnx.Linear, 4, "
        "8)` or `lambda rngs: nnx.Linear(4, 8, rngs=rngs)`.") from e
  if not isinstance(module, nnx.Module):
    raise TypeError(f"{what}: the constructor returned a "
                    f"{type(module).__name__}, not an nnx.Module.")
  return module


def _abstract_nnx_layout(constructor: NnxConstructor, what: str) -> NnxLayout:
  """The layout of what `constructor` builds, without building it (cached)."""
  layout = foreign_storage.cache_get(("nnx", constructor))
  if layout is None:
    layout = _split_nnx(nnx.eval_shape(
        lambda: _construct_nnx(constructor, jax.random.PRNGKey(0), what)))[0]
    foreign_storage.cache_put(("nnx", constructor), layout)
  return layout


class NnxModule(foreign_storage.ScopeModule):
  """A Flax NNX module inside a Haiku transform (see `from_flax`)."""

  def __init__(self, module: nnx.Module | NnxConstructor,
               name: Optional[str] = None):
    self._instance = module if isinstance(module, nnx.Module) else None
    self._constructor = None if self._instance is not None else module
    self._class_name = (_class_name(module) or _abstract_nnx_layout(
        module, "hkb.from_flax").class_name)
    super().__init__(name=name or foreign_storage.snake_case(self._class_name))
    self._what = f"hkb.from_flax({self._class_name})"
    self._mode: Optional[tuple[str, dict[str, Any]]] = None

  def train(self, **attributes: Any) -> "NnxModule":
    """Runs the module in training mode (`nnx.Module.train`) on each call."""
    self._mode = ("train", attributes)
    return self

  def eval(self, **attributes: Any) -> "NnxModule":
    """Runs the module in evaluation mode (`nnx.Module.eval`) on each call."""
    self._mode = ("eval", attributes)
    return self

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    layout, values = self._layout()
    foreign_storage.check_names(self._what, (layout.params, layout.state),
                                ("parameter", "variable"))
    storage = foreign_storage.Storage(self, self._what)
    params = storage.params(layout.params, values and values[0])
    old_state = storage.state(layout.state, values and values[3])
    key = hk.maybe_next_rng_key() if layout.rng_keys.names else None
    counts = [np.zeros(s.shape, s.dtype) for s in layout.rng_counts.specs]
    module = nnx.merge(
        layout.graphdef, layout.params.unflatten(params),
        layout.rng_keys.unflatten(_stream_keys(key, layout.rng_keys, values)),
        layout.rng_counts.unflatten(counts), layout.state.unflatten(old_state))
    if self._mode is not None:
      getattr(module, self._mode[0])(**self._mode[1])
    graphdef = nnx.graphdef(module)
    out = module(*args, **kwargs)
    new_graphdef, *new = nnx.split(module, *_FILTERS)
    if new_graphdef != graphdef:
      raise ValueError(self._static_change(graphdef, layout, module))
    new_params, _, new_counts, new_state = (jax.tree.leaves(s) for s in new)
    self._check_params_kept(layout.params, params, new_params)
    if key is None:
      self._check_no_rng_drawn(layout.rng_counts, new_counts)
    storage.set_state(layout.state, old_state, new_state)
    return out

  # How the module is built: at init for real, at apply only its layout.

  def _layout(self) -> tuple[NnxLayout, Optional[list[list[Any]]]]:
    if self._instance is not None:
      return _split_nnx(self._instance)
    if hk.running_init():
      layout, values = _split_nnx(_construct_nnx(
          self._constructor, hk.next_rng_key(), self._what))
      foreign_storage.cache_put(("nnx", self._constructor), layout)
      return layout, values
    return _abstract_nnx_layout(self._constructor, self._what), None

  # Checks after the call, each with what to do.

  def _static_change(self, graphdef, layout: NnxLayout, module) -> str:
    before = nnx.merge(graphdef, *(
        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype)
                     if not jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key)
                     else jax.random.key(0), g.unflatten(g.specs))
        for g in (layout.params, layout.rng_keys, layout.rng_counts,
                  layout.state)))
    old, new = _static_attributes(before), _static_attributes(module)
    changes = [f"{p}: {old.get(p, '(absent)')!r} -> {new.get(p, '(absent)')!r}"
               for p in sorted(set(old) | set(new)) if old.get(p) != new.get(p)]
    return (
        f"{self._what} changed its structure during the call ("
        + "; ".join(changes[:5]) + "). Haiku keeps only arrays between "
        "calls, as params and state, so a change to a Python attribute or a "
        "new nnx.Variable would be lost. Keep values that change in "
        "nnx.Variables created in __init__ (e.g. nnx.BatchStat or your own "
        "nnx.Variable subclass): they become Haiku state.")

  def _check_params_kept(self, group: Group, old, new) -> None:
    for path, before, after in zip(group.paths, old, new):
      if after is not before:
        raise ValueError(
            f"{self._what} assigned to its nnx.Param '{path}' during the "
            "call. Haiku params are read-only in apply: hold values that the "
            "call updates in another nnx.Variable type (it becomes Haiku "
            "state).")

  def _check_no_rng_drawn(self, group: Group, counts) -> None:
    for path, count in zip(group.paths, counts):
      if not isinstance(count, np.ndarray) or count.any():
        raise ValueError(
            f"{self._what} drew a key from its rng stream at "
            f"'{path.rsplit('.', 1)[0]}', but the "
            "Haiku transform has no rng here. Pass an rng to apply "
            "(f.apply(params, state, rng, ...)), or run the module in "
            "evaluation mode (`.eval()` on the adapter, or its own "
            "`deterministic=True`).")


def _stream_keys(key: Optional[jax.Array], group: Group,
                 values: Optional[list[list[Any]]]) -> list[Any]:
  """Keys for the module's rng streams: stream `i` gets `fold_in(key, i)`."""
  keys = []
  for i, spec in enumerate(group.specs):
    if key is None:
      if values is not None:  # An instance, or init: its own keys.
        keys.append(values[1][i])
        continue
      stream = jax.random.key(0)
    else:
      stream = jax.random.fold_in(key, i)
      if not jax.dtypes.issubdtype(stream.dtype, jax.dtypes.prng_key):
        stream = jax.random.wrap_key_data(stream)
    keys.append(jax.random.split(stream, spec.shape) if spec.shape else stream)
  return keys


def _static_attributes(module: nnx.Module) -> dict[str, Any]:
  """`path -> value` of every attribute that is not array data."""
  out = {}
  for path, value in nnx.iter_graph(module):
    if any(str(p).startswith("_pytree__") for p in path):
      continue
    label = ".".join(str(p) for p in path)
    if isinstance(value, nnx.Variable):
      out[label] = f"<{type(value).__name__}>"
    elif not isinstance(value, (nnx.Module, jax.Array, np.ndarray)):
      try:
        hash(value)
      except TypeError:
        continue
      out[label] = value
  return out


# ---------------------------------------------------------------------------
# Linen inside Haiku.
# ---------------------------------------------------------------------------


class LinenLayout(NamedTuple):
  params: Group
  state: Group  # Every other collection, collection name first.


def _split_linen(variables: PyTree) -> tuple[LinenLayout, list[list[Any]]]:
  variables = dict(variables)
  params, param_values = foreign_storage.flatten_group(variables.pop("params", {}))
  state, state_values = foreign_storage.flatten_group(variables, drop_first=True)
  return LinenLayout(params, state), [param_values, state_values]


def _signature(args: Any) -> Any:
  leaves, treedef = jax.tree.flatten(args)
  return treedef, tuple(
      (tuple(np.shape(x)), str(x.dtype)) if hasattr(x, "dtype") else x
      for x in leaves)


def _class_name(constructor: Any) -> Optional[str]:
  """The class a constructor builds, when it says so without being called."""
  if isinstance(constructor, nnx.Module):
    return type(constructor).__name__
  target = getattr(constructor, "func", constructor)  # functools.partial
  if isinstance(target, type):
    return target.__name__
  return None


class LinenModule(foreign_storage.ScopeModule):
  """A Flax Linen module inside a Haiku transform (see `from_flax`)."""

  def __init__(self, module: nn.Module, rng_streams: Sequence[str] = (
      "dropout",), name: Optional[str] = None):
    self._module = module
    self._class_name = type(module).__name__
    super().__init__(name=name or foreign_storage.snake_case(self._class_name))
    self._what = f"hkb.from_flax({self._class_name})"
    self._streams = tuple(rng_streams)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    layout, values = self._layout(args, kwargs)
    foreign_storage.check_names(self._what, layout, ("parameter", "variable"))
    storage = foreign_storage.Storage(self, self._what)
    params = storage.params(layout.params, values and values[0])
    old_state = storage.state(layout.state, values and values[1])
    variables = {"params": layout.params.unflatten(params),
                 **layout.state.unflatten(old_state)}
    rngs = dict(kwargs.pop("rngs", None) or {})
    key = hk.maybe_next_rng_key() if self._streams else None
    if key is not None:
      rngs = {**{s: jax.random.fold_in(key, i)
                 for i, s in enumerate(self._streams)}, **rngs}
    mutable = [c for c in variables if c != "params"]
    try:
      result = self._module.apply(variables, *args, rngs=rngs or None,
                                  mutable=mutable or False, **kwargs)
    except flax.errors.InvalidRngError as e:
      raise ValueError(self._rng_message(e)) from e
    if not mutable:
      return result
    out, updates = result
    new_state = jax.tree.leaves({c: updates[c] for c in mutable})
    storage.set_state(layout.state, old_state, new_state)
    return out

  def _layout(self, args, kwargs) -> tuple[LinenLayout, Optional[list[list[Any]]]]:
    cache_key = ("linen", self._module, self._streams,
                 _signature((args, {k: v for k, v in kwargs.items()
                                    if k != "rngs"})))
    if hk.running_init():
      layout, values = _split_linen(self._init(hk.next_rng_key(), args, kwargs))
      foreign_storage.cache_put(cache_key, layout)
      return layout, values
    layout = foreign_storage.cache_get(cache_key)
    if layout is None:
      layout = _split_linen(jax.eval_shape(
          lambda k: self._init(k, args, kwargs), jax.random.PRNGKey(0)))[0]
      foreign_storage.cache_put(cache_key, layout)
    return layout, None

  def _init(self, key, args, kwargs) -> PyTree:
    kwargs = dict(kwargs)
    rngs = {"params": key, **{s: jax.random.fold_in(key, i + 1)
                              for i, s in enumerate(self._streams)},
            **(kwargs.pop("rngs", None) or {})}
    try:
      return self._module.init(rngs, *args, **kwargs)
    except flax.errors.InvalidRngError as e:
      raise ValueError(self._rng_message(e)) from e

  def _rng_message(self, e: Exception) -> str:
    return (f"{self._what}: {e}. Streams fed from Haiku's rng: "
            f"{list(self._streams)}. Pass an rng to apply "
            "(f.apply(params, state, rng, ...)) and name every stream the "
            "module draws from in `rng_streams=`, or call it with "
            "`deterministic=True`.")


# ---------------------------------------------------------------------------
# Haiku inside NNX.
# ---------------------------------------------------------------------------


class HaikuState(nnx.Variable):
  """One Haiku state entry inside a `HaikuModule` (from `to_nnx`)."""


class HaikuModule(nnx.Module):
  """A Haiku function as an NNX module, its parameters under Haiku's names."""

  def __init__(self, transformed: hk.TransformedWithState, params: hk.Params,
               state: hk.State, *, rngs: Optional[nnx.Rngs] = None,
               rng_stream: str = "dropout"):
    self.transformed = transformed
    self.params = nnx.data({m: {n: nnx.Param(jnp.asarray(v))
                                for n, v in entries.items()}
                            for m, entries in params.items()})
    self.state = nnx.data({m: {n: HaikuState(jnp.asarray(v))
                               for n, v in entries.items()}
                           for m, entries in state.items()})
    self.rngs = rngs
    self.rng_stream = rng_stream

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    rng = None if self.rngs is None else self.rngs[self.rng_stream]()
    out, new_state = self.transformed.apply(
        self.haiku_params(), self.haiku_state(), rng, *args, **kwargs)
    for module, entries in new_state.items():
      for name, value in entries.items():
        if name not in self.state.get(module, {}):
          raise ValueError(
              f"hkb.to_nnx: the Haiku function created state "
              f"'{module}/{name}' in apply, which the module does not hold. "
              "Create it at init (hk.get_state with init=) and build the "
              "module from the state init gives.")
        self.state[module][name][...] = value
    return out

  def haiku_params(self) -> hk.Params:
    """The params as Haiku's dict, `{module_name: {param_name: array}}`."""
    return {m: {n: v[...] for n, v in entries.items()}
            for m, entries in self.params.items()}

  def haiku_state(self) -> hk.State:
    """The state as Haiku's dict, `{module_name: {state_name: array}}`."""
    return {m: {n: v[...] for n, v in entries.items()}
            for m, entries in self.state.items()}


def _with_state(f: Any, api: str) -> hk.TransformedWithState:
  if isinstance(f, hk.TransformedWithState):
    return f
  if isinstance(f, hk.Transformed):
    return hk.with_empty_state(f)
  raise TypeError(
      f"hkb.{api} takes the output of hk.transform or hk.transform_with_state; "
      f"got {type(f).__name__}. Wrap the Haiku function first: "
      f"hkb.{api}(hk.transform_with_state(f), ...).")
