"""Equinox models inside Haiku (`from_equinox`), and Haiku functions as Equinox modules (`to_equinox`).

`from_equinox` wraps an Equinox model (an instance, or a constructor taking
`key`) as a Haiku module: its arrays become Haiku parameters named by their
field paths (`layers[0].weight` -> `mlp/layers_0/weight`), its `eqx.nn.State`
becomes Haiku state, both stored as `call_pure` stores its params
(`foreign_module.py`), and its `key=` draws from Haiku's rng.

`to_equinox` goes the other way, for migrating off Haiku: an
`hk.transform(_with_state)` becomes an `eqx.Module` holding Haiku's params dict
as it is, and Haiku state as Equinox state.

Equinox is an optional dependency (`pip install ".[equinox]"`):
this module imports it, and `haiku_bridge` imports this module only when one
of its names is first used.
"""

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator, NamedTuple, Optional

import equinox as eqx
import haiku as hk
import jax

from haiku_bridge._src import errors
from haiku_bridge._src import foreign_module
from haiku_bridge._src import pytree
from haiku_bridge._src.foreign_module import Variables
from haiku_bridge._src.pytree import PyTree

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

  >>> import equinox as eqx
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

  >>> import equinox as eqx
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
  with errors.entry("from_equinox"):
    if not isinstance(model, eqx.Module) and not callable(model):
      raise TypeError(
        errors.bad_argument(
          "model", model, "an eqx.Module or a constructor `f(key=...)` that returns one"
        )
      )
    if state is not None:
      if not isinstance(model, eqx.Module):
        raise TypeError(
          errors.message(
            "`state=` goes with a model instance; a constructor's state "
            "comes from eqx.nn.make_with_state at init."
          )
        )
      if not isinstance(state, eqx.nn.State):
        raise TypeError(
          errors.bad_argument(
            "state",
            state,
            "None or the model's eqx.nn.State",
            "Pass the "
            "state that eqx.nn.make_with_state made with the model: `model, "
            "state = eqx.nn.make_with_state(Model)(...)`, then "
            "hkb.from_equinox(model, state=state).",
          )
        )
    foreign_module.check_name(name)
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

  >>> import equinox as eqx
  >>> f = hk.transform(lambda x: hk.nets.MLP([8, 2])(x))
  >>> model = hkb.to_equinox(f, jnp.ones([1, 4]), key=jax.random.PRNGKey(0))
  >>> sorted(model.params)
  ['mlp/~/linear_0', 'mlp/~/linear_1']
  >>> y = model(jnp.ones([3, 4]))
  >>> grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones([3, 4]))))(model)

  Args:
    f: the output of `hk.transform` or `hk.transform_with_state` (of
      `hk.without_apply_rng` too: its apply then gets no rng).
    *args: example inputs for `f.init`, when `params` is not given.
    key: the key for `f.init`, when `params` is not given.
    params: Haiku params (e.g. a checkpoint) instead of running `f.init`.
      With example `args` too, their names and shapes are checked against
      an abstract `f.init` of them at construction.
    state: Haiku state, with `params` (e.g. from the same checkpoint);
      default: empty.
    **kwargs: keyword inputs for `f.init`.

  Returns:
    A `HaikuModel`. Its `key=` is `f.apply`'s rng.

  Raises:
    ValueError: without `params` and without `key` to initialise them.
  """
  with errors.entry("to_equinox"):
    transformed = foreign_module.with_state(f)
    if key is not None and not pytree.is_key(key):
      raise TypeError(
        errors.bad_argument(
          "key", key, "None or a JAX random key", "e.g. key=jax.random.PRNGKey(0)."
        )
      )
    foreign_module.check_given(transformed, params, state, args, kwargs)
    if params is None and key is None:
      raise ValueError(
        errors.message(
          "needs `key=` to run f.init, or `params=` (e.g. a Haiku checkpoint) to use as they are."
        )
      )
  if params is None:
    params, state = transformed.init(key, *args, **kwargs)
  return HaikuModel(transformed, params, state or {})


# ---------------------------------------------------------------------------
# Equinox inside Haiku.
# ---------------------------------------------------------------------------


def _is_index(x: Any) -> bool:
  return isinstance(x, eqx.nn.StateIndex)


def _is_param(x: Any) -> bool:
  return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


class EquinoxSkeleton(NamedTuple):
  """An Equinox model taken apart: the rest of the model, params and state.

  `state` names each state leaf by the path of its `StateIndex` in the model;
  `state_positions[i]` is where leaf `i` of `state` sits in the flattened
  `eqx.nn.State` (`state_treedef`).
  """

  static: PyTree
  params: Variables
  state: Variables
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


class EquinoxValues(NamedTuple):
  params: list[Any]
  state: list[Any]


def _split_equinox(
  built: tuple[eqx.Module, eqx.nn.State],
) -> tuple[EquinoxSkeleton, EquinoxValues]:
  model, state = built
  params, static = eqx.partition(model, _is_param, is_leaf=_is_index)
  params_kind, param_values = foreign_module.flatten(params, attributes=True)
  state_leaves, state_treedef = jax.tree.flatten(state)
  positions = jax.tree.unflatten(state_treedef, range(len(state_leaves)))

  def by_index(lookup):
    return jax.tree.map(lambda x: lookup.get(x) if _is_index(x) else None, model, is_leaf=_is_index)

  state_kind, state_values = foreign_module.flatten(by_index(state), attributes=True)
  skeleton = EquinoxSkeleton(
    static, params_kind, state_kind, state_treedef, tuple(jax.tree.leaves(by_index(positions)))
  )
  return skeleton, EquinoxValues(param_values, state_values)


def _takes(fn: Callable[..., Any], argument: str) -> bool:
  try:
    parameters = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False
  return argument in parameters or any(
    p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
  )


def _construct(
  constructor: EquinoxConstructor,
  key: jax.Array,
) -> tuple[eqx.Module, eqx.nn.State]:
  return foreign_module.constructed(
    lambda: eqx.nn.make_with_state(constructor)(key=key),
    keyword="key",
    example="`functools.partial(eqx.nn.Linear, 4, 8)` or `lambda key: "
    "eqx.nn.Linear(4, 8, key=key)`",
    expected=eqx.Module,
    expected_name="eqx.Module",
    module_of=lambda built: built[0],
  )


def _recipe(constructor: EquinoxConstructor) -> foreign_module.Recipe:
  return foreign_module.Recipe(
    construct=functools.partial(_construct, constructor),
    construct_abstract=lambda: eqx.filter_eval_shape(
      _construct, constructor, jax.random.PRNGKey(0)
    ),
    split=_split_equinox,
    cache_key=foreign_module.skeleton_key("equinox", constructor),
  )


class EquinoxModule(foreign_module.ForeignModule):
  """An Equinox model inside a Haiku transform (see `from_equinox`)."""

  def __init__(
    self,
    model: eqx.Module | EquinoxConstructor,
    *,
    state: Optional[eqx.nn.State] = None,
    name: Optional[str] = None,
  ):
    self._instance = model if isinstance(model, eqx.Module) else None
    self._instance_state = state
    # Without an instance, `model` is a constructor.
    self._recipe = (
      _recipe(model)  # type: ignore[arg-type]
      if self._instance is None
      else foreign_module.Recipe(None, None, _split_equinox, None)
    )
    class_name = foreign_module.class_name(model, eqx.Module)
    if class_name is None:
      with errors.entry("from_equinox"):
        class_name = type(foreign_module.abstract_skeleton(self._recipe).static).__name__
    super().__init__(class_name, "from_equinox", name)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    with errors.entry(self._api):
      instance = None if self._instance is None else (self._instance, self._own_state())
      skeleton, values = foreign_module.built(instance, self._recipe)
      params = foreign_module.params(skeleton.params, values and values.params)
      old_state = foreign_module.state(skeleton.state, values and values.state)
      model = eqx.combine(skeleton.params.unflatten(params), skeleton.static, is_leaf=_is_index)
      if "inference" in kwargs and not _takes(model.__call__, "inference"):
        model = eqx.nn.inference_mode(model, value=kwargs.pop("inference"))
      if "key" not in kwargs and _takes(model.__call__, "key"):
        kwargs["key"] = hk.maybe_next_rng_key()
      with _explain_missing_key(kwargs):
        if not skeleton.state.names:
          return model(*args, **kwargs)
        result = model(*args, skeleton.make_state(old_state), **kwargs)
      if not (
        isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], eqx.nn.State)
      ):
        raise TypeError(
          errors.message(
            "the model has state, so it is called as `model(*args, state, "
            "**kwargs)` and must return `(out, state)`; it returned "
            f"{errors.describe(result)}. Return the state that "
            "`state.set(...)` gives."
          )
        )
      out, new_state = result
      if jax.tree.structure(new_state) != skeleton.state_treedef:
        raise ValueError(
          errors.message(
            "the model returned a state of another structure than it was "
            f"given ({jax.tree.structure(new_state)} instead of "
            f"{skeleton.state_treedef}). Haiku state keeps its structure from "
            "init: update each eqx.nn.StateIndex with `state.set`, keeping "
            "its shapes and dtypes."
          )
        )
      foreign_module.write_state(skeleton.state, old_state, skeleton.state_leaves(new_state))
      return out

  def _own_state(self) -> eqx.nn.State:
    if self._instance_state is not None:
      return self._instance_state
    try:
      return eqx.nn.State(self._instance)
    except ValueError as e:
      raise ValueError(
        errors.message(
          "the model's initial state is not in it (it was made by "
          "eqx.nn.make_with_state). Pass its state too: "
          "hkb.from_equinox(model, state=state)."
        )
      ) from e


@contextlib.contextmanager
def _explain_missing_key(kwargs: dict[str, Any]) -> Iterator[None]:
  try:
    yield
  except RuntimeError as e:
    if "key" not in kwargs or kwargs["key"] is not None:
      raise
    raise RuntimeError(
      errors.message(
        f"{e} It was called with key=None: the Haiku transform has no rng "
        "here. Pass an rng to apply (f.apply(params, state, rng, ...)), or "
        "call it with inference=True."
      )
    ) from e


# ---------------------------------------------------------------------------
# Haiku inside Equinox.
# ---------------------------------------------------------------------------


class HaikuModel(eqx.Module):
  """A Haiku function as an Equinox module (see `to_equinox`)."""

  params: hk.Params
  state_index: Optional[eqx.nn.StateIndex]
  transformed: hk.TransformedWithState = eqx.field(static=True)

  def __init__(self, transformed: hk.TransformedWithState, params: hk.Params, state: hk.State):
    self.transformed = transformed
    self.params = jax.tree.map(jax.numpy.asarray, params)
    self.state_index = (
      eqx.nn.StateIndex(jax.tree.map(jax.numpy.asarray, state)) if jax.tree.leaves(state) else None
    )

  def __call__(self, *args: Any, key: Optional[jax.Array] = None, **kwargs: Any) -> Any:
    if self.state_index is None:
      return self.transformed.apply(self.params, {}, key, *args, **kwargs)[0]
    if not args or not isinstance(args[-1], eqx.nn.State):
      with errors.entry("to_equinox"):  # The model `to_equinox` made, called.
        raise TypeError(
          errors.message(
            "this model has Haiku state, so it is called as "
            "`model(*args, state, key=None) -> (out, state)`, with "
            "`state = eqx.nn.State(model)` to begin with."
          )
        )
    *args, state = args  # type: ignore[assignment]  # A list from here on.
    out, new = self.transformed.apply(
      self.params, state.get(self.state_index), key, *args, **kwargs
    )
    return out, state.set(self.state_index, new)

  def haiku_state(self, state: eqx.nn.State) -> hk.State:
    """The Haiku state dict held in `state` (`{}` for a model without one)."""
    return {} if self.state_index is None else state.get(self.state_index)
