"""Equinox models inside Haiku (`from_equinox`), and Haiku functions as Equinox modules (`to_equinox`).

`from_equinox` wraps an Equinox model (an instance, or a constructor taking
`key`) as a Haiku module: its arrays become Haiku parameters named by their
field paths (`layers[0].weight` -> `mlp/layers_0/weight`), its `eqx.nn.State`
becomes Haiku state, and its `key=` draws from Haiku's rng.

`to_equinox` goes the other way, for migrating off Haiku: an
`hk.transform(_with_state)` becomes an `eqx.Module` holding Haiku's params dict
as it is, and Haiku state as Equinox state.

Equinox is an optional dependency (`pip install "haiku-bridge[equinox]"`):
this module imports it, and `haiku_bridge` imports this module only when one
of its names is first used.
"""

import contextlib
import inspect
from typing import Any, Callable, Iterator, NamedTuple, Optional

import equinox as eqx
import haiku as hk
import jax

from haiku_bridge._src import foreign_storage
from haiku_bridge._src.pytree import PyTree
from haiku_bridge._src.foreign_storage import Group

EquinoxConstructor = Callable[..., eqx.Module]

# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


def from_equinox(
    model: eqx.Module | EquinoxConstructor,
    *,
    state: Optional[eqx.nn.State] = None,
    name: Optional[str] = None,
) -> "EquinoxModule":
  """An Equinox model as a Haiku module.

  Create it inside a Haiku transform, as any Haiku module, and call it like
  the model. Calling it twice shares its weights.

  >>> mlp = lambda key: eqx.nn.MLP(4, 2, width_size=8, depth=1, key=key)
  >>> f = hk.transform(lambda x: hk.vmap(   # Equinox models see one example.
  ...     hkb.from_equinox(mlp), split_rng=(not hk.running_init()))(x))
  >>> params = f.init(jax.random.PRNGKey(0), jnp.ones([3, 4]))
  >>> sorted(params)
  ['mlp/layers_0', 'mlp/layers_1']
  >>> jax.tree.map(jnp.shape, params["mlp/layers_0"])
  {'bias': (8,), 'weight': (8, 4)}

  A stateful model (`eqx.nn.BatchNorm`, `eqx.nn.StateIndex`) is called as
  `model(*args, state, **kwargs) -> (out, state)`; the adapter keeps that
  state as Haiku state, so it is called without it:

  >>> bn = lambda key: eqx.nn.BatchNorm(4, "batch", mode="batch")
  >>> f = hk.transform_with_state(lambda x: hk.vmap(
  ...     hkb.from_equinox(bn), split_rng=False, axis_name="batch")(x))
  >>> params, state = f.init(jax.random.PRNGKey(0), jnp.ones([3, 4]))
  >>> sorted(state["batch_norm"])
  ['batch_counter', 'batch_state_index_0', 'batch_state_index_1']

  Args:
    model: an `eqx.Module` (its current arrays are the initial params), or a
      constructor `model(key=...)` returning one, called at init with a key
      from Haiku's rng sequence (e.g. `functools.partial(eqx.nn.Linear, 4, 8)`).
    state: for a stateful model instance, its `eqx.nn.State` (from
      `eqx.nn.make_with_state`); default: `eqx.nn.State(model)`.
    name: the Haiku module name; default: the model's class name in snake
      case.

  Returns:
    A Haiku module. Each call passes `key=hk.maybe_next_rng_key()` when the
    model takes a `key` and the call does not give one; `inference=` goes to
    the model when it takes it, and otherwise switches the model with
    `eqx.nn.inference_mode`.
  """
  if not isinstance(model, eqx.Module) and not callable(model):
    raise TypeError(
        "hkb.from_equinox takes an eqx.Module or a constructor `f(key=...)` "
        f"that returns one; got {type(model).__name__}.")
  if state is not None and not isinstance(model, eqx.Module):
    raise TypeError(
        "hkb.from_equinox: `state=` goes with a model instance; a "
        "constructor's state comes from eqx.nn.make_with_state at init.")
  return EquinoxModule(model, state=state, name=name)


def to_equinox(
    f: hk.Transformed | hk.TransformedWithState,
    *args: Any,
    key: Optional[jax.Array] = None,
    params: Optional[hk.Params] = None,
    state: Optional[hk.State] = None,
    **kwargs: Any,
) -> "HaikuModel":
  """A Haiku function as an `eqx.Module`, holding Haiku's params dict as it is.

  `model.params` is Haiku's params dict, so a Haiku checkpoint loads into it
  as it is, and it trains with `eqx.filter_grad`. Haiku state becomes Equinox
  state: a model with state is called as `model(*args, state, key=None) ->
  (out, state)`, with `state = eqx.nn.State(model)` to begin with.

  >>> f = hk.transform(lambda x: hk.nets.MLP([8, 2])(x))
  >>> model = hkb.to_equinox(f, jnp.ones([1, 4]), key=jax.random.PRNGKey(0))
  >>> sorted(model.params)
  ['mlp/~/linear_0', 'mlp/~/linear_1']
  >>> y = model(jnp.ones([3, 4]))
  >>> grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones([3, 4]))))(model)

  Args:
    f: the output of `hk.transform` or `hk.transform_with_state` (not of
      `hk.without_apply_rng`).
    *args: example inputs for `f.init`, when `params` is not given.
    key: the key for `f.init`, when `params` is not given.
    params: Haiku params (e.g. a checkpoint) instead of running `f.init`.
    state: Haiku state, with `params`; default: empty.
    **kwargs: keyword inputs for `f.init`.

  Returns:
    A `HaikuModel`. Its `key=` is `f.apply`'s rng.

  Raises:
    ValueError: without `params` and without `key` to initialise them.
  """
  transformed = _with_state(f)
  if params is None:
    if key is None:
      raise ValueError(
          "hkb.to_equinox needs `key=` to run f.init, or `params=` (e.g. a "
          "Haiku checkpoint) to use as they are.")
    params, state = transformed.init(key, *args, **kwargs)
  return HaikuModel(transformed, params, state or {})


# ---------------------------------------------------------------------------
# Equinox inside Haiku.
# ---------------------------------------------------------------------------


def _is_index(x: Any) -> bool:
  return isinstance(x, eqx.nn.StateIndex)


def _is_param(x: Any) -> bool:
  return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


class EquinoxLayout(NamedTuple):
  """An Equinox model taken apart: the rest of the model, params and state.

  `state` names each state leaf by the path of its `StateIndex` in the model;
  `state_positions[i]` is where leaf `i` of `state` sits in the flattened
  `eqx.nn.State` (`state_treedef`).
  """
  static: PyTree
  params: Group
  state: Group
  state_treedef: Any
  state_positions: tuple[int, ...]

  def make_state(self, leaves: list[Any]) -> eqx.nn.State:
    ordered = [None] * len(leaves)
    for position, leaf in zip(self.state_positions, leaves):
      ordered[position] = leaf
    return jax.tree.unflatten(self.state_treedef, ordered)

  def state_leaves(self, state: eqx.nn.State) -> list[Any]:
    leaves = jax.tree.leaves(state)
    return [leaves[p] for p in self.state_positions]


def _split_equinox(model: eqx.Module, state: eqx.nn.State,
                   ) -> tuple[EquinoxLayout, list[list[Any]]]:
  params, static = eqx.partition(model, _is_param, is_leaf=_is_index)
  params_group, param_values = foreign_storage.flatten_group(
      params, attributes=True)
  state_leaves, state_treedef = jax.tree.flatten(state)
  positions = jax.tree.unflatten(state_treedef, range(len(state_leaves)))

  def by_index(lookup):
    return jax.tree.map(lambda x: lookup.get(x) if _is_index(x) else None,
                        model, is_leaf=_is_index)

  state_group, state_values = foreign_storage.flatten_group(
      by_index(state), attributes=True)
  layout = EquinoxLayout(static, params_group, state_group, state_treedef,
                         tuple(jax.tree.leaves(by_index(positions))))
  return layout, [param_values, state_values]


def _takes(fn: Callable[..., Any], argument: str) -> bool:
  try:
    parameters = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False
  return argument in parameters or any(
      p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


class EquinoxModule(foreign_storage.ScopeModule):
  """An Equinox model inside a Haiku transform (see `from_equinox`)."""

  def __init__(self, model: eqx.Module | EquinoxConstructor, *,
               state: Optional[eqx.nn.State] = None,
               name: Optional[str] = None):
    self._instance = model if isinstance(model, eqx.Module) else None
    self._constructor = None if self._instance is not None else model
    self._instance_state = state
    self._class_name = (_class_name(model) or
                        type(_abstract_layout(model).static).__name__)
    super().__init__(name=name or foreign_storage.snake_case(self._class_name))
    self._what = f"hkb.from_equinox({self._class_name})"

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    layout, values = self._layout()
    foreign_storage.check_names(self._what, (layout.params, layout.state),
                                ("parameter", "state"))
    storage = foreign_storage.Storage(self, self._what)
    params = storage.params(layout.params, values and values[0])
    old_state = storage.state(layout.state, values and values[1])
    model = eqx.combine(layout.params.unflatten(params), layout.static,
                        is_leaf=_is_index)
    if "inference" in kwargs and not _takes(model.__call__, "inference"):
      model = eqx.nn.inference_mode(model, value=kwargs.pop("inference"))
    if "key" not in kwargs and _takes(model.__call__, "key"):
      kwargs["key"] = hk.maybe_next_rng_key()
    with self._explain_missing_key(kwargs):
      if not layout.state.names:
        return model(*args, **kwargs)
      result = model(*args, layout.make_state(old_state), **kwargs)
    if not (isinstance(result, tuple) and len(result) == 2 and
            isinstance(result[1], eqx.nn.State)):
      raise TypeError(
          f"{self._what} has state, so it is called as `model(*args, state, "
          "**kwargs)` and must return `(out, state)`; it returned "
          f"{type(result).__name__}. Return the state that "
          "`state.set(...)` gives.")
    out, new_state = result
    if jax.tree.structure(new_state) != layout.state_treedef:
      raise ValueError(
          f"{self._what} returned a state of another structure than it was "
          f"given ({jax.tree.structure(new_state)} instead of "
          f"{layout.state_treedef}). Haiku state keeps its structure from "
          "init: update each eqx.nn.StateIndex with `state.set`, keeping "
          "its shapes and dtypes.")
    storage.set_state(layout.state, old_state, layout.state_leaves(new_state))
    return out

  def _layout(self) -> tuple[EquinoxLayout, Optional[list[list[Any]]]]:
    if self._instance is not None:
      return _split_equinox(self._instance, self._own_state())
    if hk.running_init():
      layout, values = _split_equinox(*_construct(
          self._constructor, hk.next_rng_key(), self._what))
      foreign_storage.cache_put(("equinox", self._constructor), layout)
      return layout, values
    return _abstract_layout(self._constructor, self._what), None

  @contextlib.contextmanager
  def _explain_missing_key(self, kwargs: dict[str, Any]) -> Iterator[None]:
    try:
      yield
    except RuntimeError as e:
      if "key" not in kwargs or kwargs["key"] is not None:
        raise
      raise RuntimeError(
          f"{self._what}: {e} It was called with key=None: the Haiku "
          "transform has no rng here. Pass an rng to apply "
          "(f.apply(params, state, rng, ...)), or call it with "
          "inference=True.") from e

  def _own_state(self) -> eqx.nn.State:
    if self._instance_state is not None:
      return self._instance_state
    try:
      return eqx.nn.State(self._instance)
    except ValueError as e:
      raise ValueError(
          f"{self._what}: the model's initial state is not in it (it was "
          "made by eqx.nn.make_with_state). Pass its state too: "
          "hkb.from_equinox(model, state=state).") from e



def _construct(constructor: EquinoxConstructor, key: jax.Array,
               what: str) -> tuple[eqx.Module, eqx.nn.State]:
  try:
    model, state = eqx.nn.make_with_state(constructor)(key=key)
  except TypeError as e:
    raise TypeError(
        f"{what}: calling the constructor with `key=` alone failed: {e}. An "
        "Equinox model takes its input sizes when it is constructed, so pass "
        "a constructor with them bound, e.g. `functools.partial("
        "eqx.nn.Linear, 4, 8)` or `lambda key: eqx.nn.Linear(4, 8, "
        "key=key)`.") from e
  if not isinstance(model, eqx.Module):
    raise TypeError(f"{what}: the constructor returned a "
                    f"{type(model).__name__}, not an eqx.Module.")
  return model, state


def _abstract_layout(constructor: EquinoxConstructor,
                     what: str = "hkb.from_equinox") -> EquinoxLayout:
  """The layout of what `constructor` builds, without building it (cached)."""
  layout = foreign_storage.cache_get(("equinox", constructor))
  if layout is None:
    layout = _split_equinox(*eqx.filter_eval_shape(
        _construct, constructor, jax.random.PRNGKey(0), what))[0]
    foreign_storage.cache_put(("equinox", constructor), layout)
  return layout


def _class_name(model: Any) -> Optional[str]:
  """The class a constructor builds, when it says so without being called."""
  if isinstance(model, eqx.Module):
    return type(model).__name__
  target = getattr(model, "func", model)  # functools.partial
  return target.__name__ if isinstance(target, type) else None


# ---------------------------------------------------------------------------
# Haiku inside Equinox.
# ---------------------------------------------------------------------------


class HaikuModel(eqx.Module):
  """A Haiku function as an Equinox module (see `to_equinox`)."""

  params: hk.Params
  state_index: Optional[eqx.nn.StateIndex]
  transformed: hk.TransformedWithState = eqx.field(static=True)

  def __init__(self, transformed: hk.TransformedWithState, params: hk.Params,
               state: hk.State):
    self.transformed = transformed
    self.params = jax.tree.map(jax.numpy.asarray, params)
    self.state_index = (eqx.nn.StateIndex(jax.tree.map(jax.numpy.asarray, state))
                        if jax.tree.leaves(state) else None)

  def __call__(self, *args: Any, key: Optional[jax.Array] = None,
               **kwargs: Any) -> Any:
    if self.state_index is None:
      return self.transformed.apply(self.params, {}, key, *args, **kwargs)[0]
    if not args or not isinstance(args[-1], eqx.nn.State):
      raise TypeError(
          "hkb.to_equinox: this model has Haiku state, so it is called as "
          "`model(*args, state, key=None) -> (out, state)`, with "
          "`state = eqx.nn.State(model)` to begin with.")
    *args, state = args
    out, new = self.transformed.apply(
        self.params, state.get(self.state_index), key, *args, **kwargs)
    return out, state.set(self.state_index, new)

  def haiku_state(self, state: eqx.nn.State) -> hk.State:
    """The Haiku state dict held in `state` (`{}` for a model without one)."""
    return {} if self.state_index is None else state.get(self.state_index)


def _with_state(f: Any) -> hk.TransformedWithState:
  if isinstance(f, hk.TransformedWithState):
    return f
  if isinstance(f, hk.Transformed):
    return hk.with_empty_state(f)
  raise TypeError(
      "hkb.to_equinox takes the output of hk.transform or "
      f"hk.transform_with_state; got {type(f).__name__}. Wrap the Haiku "
      "function first: hkb.to_equinox(hk.transform_with_state(f), ...).")
