"""Flax modules inside Haiku (`from_flax`), and Haiku functions as NNX modules (`to_nnx`).

`from_flax` wraps a Flax NNX module (an instance, or a constructor taking
`rngs`) or a Flax Linen module as a Haiku module. Its parameters become Haiku
parameters and its mutable variables Haiku state, named by the module's own
attribute paths under the Haiku scope (`block/linear1/kernel`: no `value`, no
`params` level), stored as `call_pure` stores its params
(`foreign_module.py`); its rng streams draw from Haiku's rng; its declared
partitioning is kept for `hkb.ShardingRules.from_foreign`.

`to_nnx` goes the other way, for migrating off Haiku: an `hk.transform(_with_state)`
becomes an `nnx.Module` whose `nnx.Param`s keep Haiku's names, so that a Haiku
checkpoint loads into it as it is.

Flax is an optional dependency (`pip install ".[flax]"`): this module
imports it, and `haiku_bridge` imports this module only when one of its names
is first used.
"""

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Sequence

import flax.errors
import flax.linen as nn
from flax import nnx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from haiku_bridge._src import errors
from haiku_bridge._src import foreign_module
from haiku_bridge._src import foreign_sharding
from haiku_bridge._src import guards
from haiku_bridge._src import pytree
from haiku_bridge._src.foreign_module import Variables
from haiku_bridge._src.pytree import PyTree

NnxConstructor = Callable[..., nnx.Module]
# A method of the foreign module: its name, or a function taking the module.
Method = str | Callable[..., Any]
# `from_flax`'s Linen rng streams (besides `params`) by default.
_DEFAULT_STREAMS = ("dropout",)

# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


def from_flax(
  module: nnx.Module | NnxConstructor | nn.Module,
  *,
  name: Optional[str] = None,
  method: Optional[Method] = None,
  rng_streams: Sequence[str] = _DEFAULT_STREAMS,
  intermediates: Optional[str] = None,
) -> "NnxModule | LinenModule":
  """A Flax NNX or Linen module as a Haiku module.

  Create it inside a Haiku transform, as any Haiku module, and call it like
  the Flax module. Calling it twice shares its weights.

  >>> from flax import nnx
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

  Another method than `__call__`, per call (`method=` as Linen's `apply`
  takes it): an embedding whose `attend` shares its table.

  >>> import functools
  >>> def lm(tokens):
  ...   embed = hkb.from_flax(functools.partial(nnx.Embed, 10, 4))
  ...   return embed(embed(tokens), method="attend")  # Tied weights.
  >>> f = hk.transform(lm)
  >>> params = f.init(jax.random.PRNGKey(0), jnp.array([1, 2]))
  >>> list(params), f.apply(params, None, jnp.array([1, 2])).shape
  (['embed'], (2, 10))

  Args:
    module: an `nnx.Module` instance (its current weights are the initial
      params); a constructor `module(rngs=...)` returning one (called at init
      with `nnx.Rngs` seeded from Haiku's rng sequence, e.g.
      `functools.partial(nnx.Linear, 4, 8)`); or a Linen `nn.Module` (or
      an `nnx.bridge.Module`, which Flax runs as Linen runs its modules).
    name: the Haiku module name; default: the Flax class name in snake case.
    method: the method each call runs, unless the call names another with
      `method=`: a method name (`"attend"`) or a function taking the module
      first (`nnx.Embed.attend`); default `__call__`.
    rng_streams: Linen only: the rng streams (besides `params`) that the
      module draws from, each fed from Haiku's rng.
    intermediates: where sown values go (Linen `self.sow(...)`, NNX
      `self.sow(nnx.Intermediate, ...)`): a Haiku name below the adapter
      (e.g. `"intermediates"`), under which each call returns them as Haiku
      state (`state["block/intermediates/..."]`); default None: Linen drops
      them (as its own `apply` does), and NNX raises, naming this option.

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
  with errors.entry("from_flax"):
    linen = isinstance(module, (nn.Module, nnx.bridge.Module))
    if not (linen or isinstance(module, nnx.Module) or callable(module)):
      raise TypeError(
        errors.bad_argument(
          "module",
          module,
          "an nnx.Module, a constructor `f(rngs=...)` that returns one, or a Linen nn.Module",
        )
      )
    foreign_module.check_name(name)
    _check_method(method)
    rng_streams = _check_rng_streams(rng_streams, linen)
    errors.check_str(
      "intermediates",
      intermediates,
      "None or a Haiku name below the adapter (a string), e.g. \"intermediates\"",
      optional=True,
    )
  if linen:
    assert isinstance(module, (nn.Module, nnx.bridge.Module))
    return LinenModule(
      module, method=method, rng_streams=rng_streams, intermediates=intermediates, name=name
    )
  return NnxModule(module, method=method, intermediates=intermediates, name=name)


def _check_method(method: Any) -> None:
  """`method=`: None, a method name, or a function taking the module first."""
  if method is not None and not callable(method) and not (isinstance(method, str) and method):
    raise TypeError(
      errors.bad_argument(
        "method",
        method,
        "None, a method name (a string such as \"attend\"), or a function taking the module first",
      )
    )


def _check_rng_streams(rng_streams: Any, linen: bool) -> tuple[str, ...]:
  """`rng_streams=`: Linen stream names; an NNX module brings its own."""
  if (
    isinstance(rng_streams, (str, bytes))
    or not isinstance(rng_streams, Sequence)
    or not all(isinstance(s, str) and s for s in rng_streams)
  ):
    raise TypeError(
      errors.bad_argument(
        "rng_streams",
        rng_streams,
        "a sequence of Linen rng stream names",
        f"For one stream, write rng_streams=({rng_streams!r},)."
        if isinstance(rng_streams, str)
        else "",
      )
    )
  rng_streams = tuple(rng_streams)
  if not linen and rng_streams != _DEFAULT_STREAMS:
    raise ValueError(
      errors.message(
        f"`rng_streams` is {rng_streams}, but it names the streams of a "
        "Linen module: an NNX module holds its streams in the nnx.Rngs it "
        "is built with, and each is fed from Haiku's rng already. Leave "
        "rng_streams out."
      )
    )
  return rng_streams


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

  >>> from flax import nnx
  >>> f = hk.transform(lambda x: hk.nets.MLP([8, 2])(x))
  >>> model = hkb.to_nnx(f, jnp.ones([1, 4]), rngs=nnx.Rngs(0))
  >>> sorted(model.haiku_params())
  ['mlp/~/linear_0', 'mlp/~/linear_1']
  >>> y = model(jnp.ones([3, 4]))
  >>> grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones([3, 4]))))(model)

  Args:
    f: the output of `hk.transform` or `hk.transform_with_state` (of
      `hk.without_apply_rng` too: its apply then gets no rng).
    *args: example inputs for `f.init`, when `params` is not given.
    rngs: `nnx.Rngs`. At construction, its `params` stream seeds `f.init`
      (when `params` is not given); on each call, its `rng_stream` stream gives
      `f.apply` its rng. Without `rngs`, `f.apply` gets `rng=None`.
    params: Haiku params (e.g. a checkpoint) instead of running `f.init`.
      With example `args` too, their names and shapes are checked against
      an abstract `f.init` of them at construction.
    state: Haiku state, with `params` (e.g. from the same checkpoint);
      default: empty.
    rng_stream: the `rngs` stream that `f.apply`'s rng is drawn from.
    **kwargs: keyword inputs for `f.init`.

  Returns:
    A `HaikuModule`: calling it runs `f.apply` and writes the new Haiku state
    into its `HaikuState` variables.

  Raises:
    ValueError: without `params` and without `rngs` to initialise them.
  """
  with errors.entry("to_nnx"):
    transformed = foreign_module.with_state(f)
    if rngs is not None and not isinstance(rngs, nnx.Rngs):
      raise TypeError(
        errors.bad_argument("rngs", rngs, "None or an nnx.Rngs", "e.g. rngs=nnx.Rngs(0).")
      )
    errors.check_str("rng_stream", rng_stream, "the name of an nnx.Rngs stream (a string)")
    foreign_module.check_given(transformed, params, state, args, kwargs)
    if params is None and rngs is None:
      raise ValueError(
        errors.message(
          "needs `rngs=nnx.Rngs(...)` to run f.init, or `params=` (e.g. a "
          "Haiku checkpoint) to use as they are."
        )
      )
  if params is None:
    assert rngs is not None, "checked above"
    params, state = transformed.init(rngs.params(), *args, **kwargs)
  return HaikuModule(transformed, params, state or {}, rngs=rngs, rng_stream=rng_stream)


# ---------------------------------------------------------------------------
# NNX inside Haiku.
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _running(api: str) -> Iterator[None]:
  """Runs an adapter's call: messages name `api`; no eager sharding.

  Haiku places the params (`hkb.ShardingRules.from_foreign` carries the
  partitioning the module declares), so NNX variables, made when a module is
  built or merged (a bridge.Module makes them on each call), need no mesh.
  """
  with errors.entry(api), nnx.use_eager_sharding(False):
    yield


_FILTERS = (nnx.Param, nnx.RngKey, nnx.RngCount, ...)


class NnxSkeleton(NamedTuple):
  """An NNX module taken apart: its graph and its variables, by kind."""

  graphdef: Any
  params: Variables
  rng_keys: Variables
  rng_counts: Variables
  state: Variables
  class_name: str


class NnxValues(NamedTuple):
  """The leaves of a built NNX module, by kind, and its declared partitioning."""

  params: list[Any]
  rng_keys: list[Any]
  rng_counts: list[Any]
  state: list[Any]
  param_specs: Optional[list[Optional[PartitionSpec]]]


def _split_nnx(module: nnx.Module) -> tuple[NnxSkeleton, NnxValues]:
  graphdef, *states = nnx.split(module, *_FILTERS)
  kinds, values = zip(*(foreign_module.flatten(s) for s in states))
  # mypy cannot count the arguments of a star-unpacked tuple.
  skeleton = NnxSkeleton(
    graphdef,
    *kinds,  # type: ignore[call-arg]
    type(module).__name__,
  )
  specs = _nnx_specs(states[0]) if foreign_sharding.active() is not None else None
  return skeleton, NnxValues(*values, specs)  # type: ignore[call-arg]


def _nnx_specs(params: nnx.State) -> list[Optional[PartitionSpec]]:
  """Per param leaf: the spec NNX gives its `out_sharding` metadata, or None."""
  recorder = foreign_sharding.active()
  assert recorder is not None, "called while recording"
  rules = recorder.logical_axis_rules
  specs = []
  with _logical_axis_rules(rules):
    for variable in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
      declared = variable.get_metadata().get("out_sharding")
      spec = nnx.spmd.get_var_pspec(variable) if declared else None
      specs.extend([spec] * len(jax.tree.leaves(variable)))
  return specs


def _logical_axis_rules(rules: Optional[Sequence[tuple[str, Any]]]):
  if rules is None:
    return contextlib.nullcontext()
  return nn.logical_axis_rules(rules)


def _construct_nnx(constructor: NnxConstructor, key: jax.Array) -> nnx.Module:
  with nnx.use_eager_sharding(False):  # See `_running`.
    return foreign_module.constructed(
      lambda: constructor(rngs=nnx.Rngs(key)),
      keyword="rngs",
      example="`functools.partial(nnx.Linear, 4, 8)` or `lambda rngs: nnx.Linear(4, 8, rngs=rngs)`",
      expected=nnx.Module,
      expected_name="nnx.Module",
    )


def _nnx_recipe(constructor: NnxConstructor) -> foreign_module.Recipe:
  return foreign_module.Recipe(
    construct=functools.partial(_construct_nnx, constructor),
    construct_abstract=lambda: nnx.eval_shape(
      lambda: _construct_nnx(constructor, jax.random.PRNGKey(0))
    ),
    split=_split_nnx,
    cache_key=foreign_module.skeleton_key("nnx", constructor),
  )


class NnxModule(foreign_module.ForeignModule):
  """A Flax NNX module inside a Haiku transform (see `from_flax`)."""

  def __init__(
    self,
    module: nnx.Module | NnxConstructor,
    *,
    method: Optional[Method] = None,
    intermediates: Optional[str] = None,
    name: Optional[str] = None,
  ):
    self._instance = module if isinstance(module, nnx.Module) else None
    self._recipe = (
      _nnx_recipe(module)
      if self._instance is None
      else foreign_module.Recipe(None, None, _split_nnx, None)
    )
    class_name = foreign_module.class_name(module, nnx.Module)
    if class_name is None:
      with errors.entry("from_flax"):
        class_name = foreign_module.abstract_skeleton(self._recipe).class_name
    super().__init__(class_name, "from_flax", name)
    self._method = method
    self._intermediates = intermediates
    self._mode: Optional[tuple[str, dict[str, Any]]] = None

  def train(self, **attributes: Any) -> "NnxModule":
    """Runs the module in training mode (`nnx.Module.train`) on each call."""
    self._mode = ("train", attributes)
    return self

  def eval(self, **attributes: Any) -> "NnxModule":
    """Runs the module in evaluation mode (`nnx.Module.eval`) on each call."""
    self._mode = ("eval", attributes)
    return self

  def __call__(self, *args: Any, method: Optional[Method] = None, **kwargs: Any) -> Any:
    """Calls the module's `method` (default: `from_flax`'s, or `__call__`)."""
    with _running(self._api):
      _check_method(method)
      skeleton, values = foreign_module.built(self._instance, self._recipe)
      params = foreign_module.params(
        skeleton.params, values and values.params, values and values.param_specs
      )
      old_state = foreign_module.state(skeleton.state, values and values.state)
      key = hk.maybe_next_rng_key() if skeleton.rng_keys.names else None
      counts = [jnp.zeros(s.shape, s.dtype) for s in skeleton.rng_counts.specs]
      module = nnx.merge(
        skeleton.graphdef,
        skeleton.params.unflatten(params),
        skeleton.rng_keys.unflatten(_stream_keys(key, skeleton.rng_keys, values)),
        skeleton.rng_counts.unflatten(counts),
        skeleton.state.unflatten(old_state),
      )
      if self._mode is not None:
        getattr(module, self._mode[0])(**self._mode[1])
      graphdef = nnx.graphdef(module)
      call = functools.partial(_call, method=method or self._method)
      if self._intermediates is None:
        out, sown = call(module, *args, **kwargs), None
      else:
        out, sown = nnx.capture(call, nnx.Intermediate)(module, *args, **kwargs)
      new_graphdef, *new = nnx.split(module, *_FILTERS)
      if new_graphdef != graphdef:
        _check_nothing_sown(module, skeleton)
        raise ValueError(errors.message(_static_change(graphdef, skeleton, module)))
      new_params, _, new_counts, new_state = (jax.tree.leaves(s) for s in new)
      _check_params_kept(skeleton.params, params, new_params)
      if key is None:
        _check_no_rng_drawn(skeleton.rng_counts, counts, new_counts)
      foreign_module.write_state(skeleton.state, old_state, new_state)
      if sown is not None:
        # Values are sown only with `intermediates=` given.
        foreign_module.outputs(*foreign_module.flatten(sown, prefix=(self._intermediates,)))  # type: ignore[arg-type]
      return out


def _check_nothing_sown(module: nnx.Module, skeleton: NnxSkeleton) -> None:
  """Raises if the call sowed values as new attributes (outside a capture)."""
  held = set(skeleton.state.paths)
  sown = nnx.state(
    module,
    lambda path, value: (
      isinstance(value, nnx.Intermediate) and foreign_module.attribute_path(path) not in held
    ),
  )
  if jax.tree.leaves(sown):
    raise ValueError(
      errors.message(
        "the call sowed nnx.Intermediate values ("
        + ", ".join(foreign_module.flatten(sown)[0].paths)
        + "). Haiku keeps only params and state between calls: pass "
        "`intermediates=\"intermediates\"` to hkb.from_flax to get them "
        "back as Haiku state under that name."
      )
    )


def _call(module: nnx.Module, *args: Any, method: Optional[Method], **kwargs: Any) -> Any:
  return _bound_method(module, method)(*args, **kwargs)


def _bound_method(module: Any, method: Optional[Method]) -> Callable[..., Any]:
  """`method` of `module`: a name, a function taking it first, or None."""
  if method is None:
    return module
  if isinstance(method, str):
    bound = getattr(module, method, None)
    if not callable(bound):
      public = sorted(
        n
        for n, v in inspect.getmembers(type(module))
        if inspect.isfunction(v) and not n.startswith("_")
      )
      raise AttributeError(
        errors.message(
          f"`method={method!r}` is not a method of {type(module).__name__} "
          f"(its methods: {', '.join(public)}). Pass a method name, or a "
          f"function taking the module first, e.g. "
          f"`{type(module).__name__}.{public[0] if public else 'method'}`."
        )
      )
    return bound
  if callable(method):
    return functools.partial(getattr(method, "__func__", method), module)
  raise TypeError(
    errors.message(
      f"`method=` is {errors.describe(method)}; pass a method name or a "
      "function taking the module first."
    )
  )


def _static_change(graphdef, skeleton: NnxSkeleton, module) -> str:
  before = nnx.merge(
    graphdef,
    *(
      jax.tree.map(
        lambda s: (
          jnp.zeros(s.shape, s.dtype)
          if not jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key)
          else jax.random.key(0)
        ),
        v.unflatten(v.specs),
      )
      for v in (skeleton.params, skeleton.rng_keys, skeleton.rng_counts, skeleton.state)
    ),
  )
  old, new = _static_attributes(before), _static_attributes(module)
  changes = [
    f"{p}: {old.get(p, '(absent)')!r} -> {new.get(p, '(absent)')!r}"
    for p in sorted(set(old) | set(new))
    if old.get(p) != new.get(p)
  ]
  return (
    "the module changed its structure during the call ("
    + "; ".join(changes[:5])
    + "). Haiku keeps only arrays between "
    "calls, as params and state, so a change to a Python attribute or a "
    "new nnx.Variable would be lost. Keep values that change in "
    "nnx.Variables created in __init__ (e.g. nnx.BatchStat or your own "
    "nnx.Variable subclass): they become Haiku state."
  )


def _check_params_kept(variables: Variables, old, new) -> None:
  for path, before, after in zip(variables.paths, old, new):
    if after is not before:
      raise ValueError(
        errors.message(
          f"the module assigned to its nnx.Param '{path}' during the call. "
          "Haiku params are read-only in apply: hold values that the call "
          "updates in another nnx.Variable type (it becomes Haiku state)."
        )
      )


def _check_no_rng_drawn(variables: Variables, old, new) -> None:
  for path, before, after in zip(variables.paths, old, new):
    if after is not before:
      raise ValueError(
        errors.message(
          f"the module drew a key from its rng stream at "
          f"'{path.rsplit('.', 1)[0]}', but the Haiku transform has no rng "
          "here. Pass an rng to apply (f.apply(params, state, rng, ...)), or "
          "run the module in evaluation mode (`.eval()` on the adapter, or "
          "its own `deterministic=True`)."
        )
      )


def _stream_keys(
  key: Optional[jax.Array], variables: Variables, values: Optional[NnxValues]
) -> list[Any]:
  """Keys for the module's rng streams: stream `i` gets `fold_in(key, i)`."""
  keys = []
  for i, spec in enumerate(variables.specs):
    if key is None:
      if values is not None:  # An instance, or init: its own keys.
        keys.append(values.rng_keys[i])
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


class LinenSkeleton(NamedTuple):
  """A Linen module's variables taken apart: params, state, its collections."""

  params: Variables
  state: Variables  # Every other collection, the collection name left out.
  collections: tuple[str, ...]  # The state's collections.


class LinenValues(NamedTuple):
  params: list[Any]
  state: list[Any]
  param_specs: Optional[list[Optional[PartitionSpec]]]


def _is_box(x: Any) -> bool:
  return isinstance(x, nn.meta.AxisMetadata)


def _split_linen(variables: PyTree) -> tuple[LinenSkeleton, LinenValues]:
  variables = dict(variables)
  boxed = variables.pop("params", {})
  params, param_values = foreign_module.flatten(boxed)
  state, state_values = foreign_module.flatten(variables, drop_first=True)
  specs = _linen_specs(boxed) if foreign_sharding.active() is not None else None
  skeleton = LinenSkeleton(params, state, tuple(variables))
  return skeleton, LinenValues(param_values, state_values, specs)


def _linen_specs(params: PyTree) -> list[Optional[PartitionSpec]]:
  """Per param leaf: the mesh axes its Linen box declares, or None."""
  recorder = foreign_sharding.active()
  assert recorder is not None, "called while recording"
  rules = recorder.logical_axis_rules
  specs = []
  with _logical_axis_rules(rules):
    for leaf in jax.tree.leaves(params, is_leaf=_is_box):
      if isinstance(leaf, nn.LogicallyPartitioned):
        # As Linen unboxes it: its own rules, else the current ones.
        spec = nn.logical_to_mesh_axes(leaf.names, leaf.rules)
      elif isinstance(leaf, nn.Partitioned):
        spec = leaf.get_partition_spec()
      else:
        spec = None
      specs.extend([spec] * len(jax.tree.leaves(leaf)))
  return specs


def _as_rng_dict(rngs: Any, bare_key_stream: str) -> dict[str, Any]:
  """`rngs=` as Linen's `init` / `apply` take it: a dict, or one key.

  One key feeds `bare_key_stream`: Linen's `params`, a bridge.Module's
  `default` (as each library reads a bare key).
  """
  if rngs is None:
    return {}
  if isinstance(rngs, Mapping) and all(
    isinstance(s, str) and pytree.is_key(k) for s, k in rngs.items()
  ):
    return dict(rngs)
  if pytree.is_key(rngs):
    return {bare_key_stream: rngs}
  raise TypeError(
    errors.bad_argument(
      "rngs",
      rngs,
      "None, a JAX random key, or a dict {stream name: key}, as Linen's apply takes them",
      "e.g. rngs={\"dropout\": key}.",
    )
  )


class LinenModule(foreign_module.ForeignModule):
  """A Flax Linen module inside a Haiku transform (see `from_flax`)."""

  def __init__(
    self,
    module: nn.Module | nnx.bridge.Module,
    *,
    method: Optional[Method] = None,
    rng_streams: Sequence[str] = ("dropout",),
    intermediates: Optional[str] = None,
    name: Optional[str] = None,
  ):
    super().__init__(type(module).__name__, "from_flax", name)
    self._module = module
    self._method = method
    self._streams = tuple(rng_streams)
    self._intermediates = intermediates

  def __call__(
    self, *args: Any, method: Optional[Method] = None, rngs: Any = None, **kwargs: Any
  ) -> Any:
    """Applies the module's `method` (default: `from_flax`'s, or `__call__`)."""
    with _running(self._api):
      if "mutable" in kwargs:
        raise TypeError(
          errors.message(
            "`mutable=` is the adapter's: every collection but `params` is "
            "Haiku state and always mutable, and sown values are returned "
            "with `intermediates=` (see hkb.from_flax)."
          )
        )
      _check_method(method)
      method = method or self._method
      rngs = _as_rng_dict(
        rngs, "default" if isinstance(self._module, nnx.bridge.Module) else "params"
      )
      skeleton, values = self._built(args, kwargs, rngs, method)
      params = foreign_module.params(
        skeleton.params, values and values.params, values and values.param_specs
      )
      old_state = foreign_module.state(skeleton.state, values and values.state)
      variables = {
        "params": skeleton.params.unflatten(params),
        **skeleton.state.unflatten(old_state),
      }
      key = hk.maybe_next_rng_key() if self._streams else None
      if key is not None:
        rngs = {**{s: jax.random.fold_in(key, i) for i, s in enumerate(self._streams)}, **rngs}
      mutable = True if self._intermediates is not None else list(skeleton.collections) or False
      try:
        result = self._module.apply(
          variables,
          *args,
          rngs=rngs or None,
          mutable=mutable,
          method=method or "__call__",
          **kwargs,
        )
      except flax.errors.InvalidRngError as e:
        raise ValueError(self._rng_message(e)) from e
      if mutable is False:
        return result
      out, updates = result
      new_state = jax.tree.leaves({c: updates[c] for c in skeleton.collections})
      foreign_module.write_state(skeleton.state, old_state, new_state)
      sown = {c: v for c, v in updates.items() if c != "params" and c not in skeleton.collections}
      if sown:
        # Values are sown only with `intermediates=` given.
        foreign_module.outputs(
          *foreign_module.flatten(sown, drop_first=True, prefix=(self._intermediates,))  # type: ignore[arg-type]
        )
      return out

  def _built(self, args, kwargs, rngs, method) -> foreign_module.Built:
    """The skeleton of `init`'s variables, with their values at init."""
    key = foreign_module.skeleton_key(
      "linen", (self._module, method), self._streams, sorted(rngs), args, kwargs
    )
    if guards.initialising():
      guards.require_haiku_trace()
      if "params" not in rngs:
        rngs = {"params": hk.maybe_next_rng_key(), **rngs}
      skeleton, values = _split_linen(self._init(rngs, args, kwargs, method))
      foreign_module.remember_skeleton(key, skeleton)
      return foreign_module.Built(skeleton, values)
    return foreign_module.Built(
      foreign_module.cached_skeleton(
        key,
        lambda: _split_linen(
          jax.eval_shape(
            lambda k: self._init({"params": k, **rngs}, args, kwargs, method), jax.random.PRNGKey(0)
          )
        )[0],
      ),
      None,
    )

  def _init(self, rngs, args, kwargs, method) -> PyTree:
    key = rngs.get("params")
    if key is not None:
      rngs = {**{s: jax.random.fold_in(key, i + 1) for i, s in enumerate(self._streams)}, **rngs}
    rngs = {s: k for s, k in rngs.items() if k is not None}
    try:
      return self._module.init(rngs, *args, method=method or "__call__", **kwargs)
    except flax.errors.InvalidRngError as e:
      raise ValueError(self._rng_message(e)) from e

  def _rng_message(self, e: Exception) -> str:
    return errors.message(
      f"{e}. Streams fed from Haiku's rng: {list(self._streams)}. Pass an "
      "rng to init and apply (f.apply(params, state, rng, ...)) and name "
      "every stream the module draws from in `rng_streams=` (or pass "
      "`rngs=` to the call), or call it with `deterministic=True`."
    )


# ---------------------------------------------------------------------------
# Haiku inside NNX.
# ---------------------------------------------------------------------------


class HaikuState(nnx.Variable):
  """One Haiku state entry inside a `HaikuModule` (from `to_nnx`)."""


class HaikuModule(nnx.Module):
  """A Haiku function as an NNX module, its parameters under Haiku's names."""

  def __init__(
    self,
    transformed: hk.TransformedWithState,
    params: hk.Params,
    state: hk.State,
    *,
    rngs: Optional[nnx.Rngs] = None,
    rng_stream: str = "dropout",
  ):
    self.transformed = transformed
    self.params = nnx.data(
      {
        m: {n: nnx.Param(jnp.asarray(v)) for n, v in entries.items()}
        for m, entries in params.items()
      }
    )
    self.state = nnx.data(
      {
        m: {n: HaikuState(jnp.asarray(v)) for n, v in entries.items()}
        for m, entries in state.items()
      }
    )
    self.rngs = rngs
    self.rng_stream = rng_stream

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    rng = None if self.rngs is None else self.rngs[self.rng_stream]()
    out, new_state = self.transformed.apply(
      self.haiku_params(), self.haiku_state(), rng, *args, **kwargs
    )
    # Haiku annotates the state `apply` returns with an alias mypy cannot read.
    for module, entries in new_state.items():  # type: ignore[attr-defined]
      for name, value in entries.items():
        if name not in self.state.get(module, {}):
          with errors.entry("to_nnx"):  # The module `to_nnx` made, called.
            raise ValueError(
              errors.message(
                f"the Haiku function created state "
                f"'{module}/{name}' in apply, which the module does not hold. "
                "Create it at init (hk.get_state with init=) and build the "
                "module from the state init gives."
              )
            )
        self.state[module][name][...] = value
    return out

  def haiku_params(self) -> hk.Params:
    """The params as Haiku's dict, `{module_name: {param_name: array}}`."""
    return {m: {n: v[...] for n, v in entries.items()} for m, entries in self.params.items()}

  def haiku_state(self) -> hk.State:
    """The state as Haiku's dict, `{module_name: {state_name: array}}`."""
    return {m: {n: v[...] for n, v in entries.items()} for m, entries in self.state.items()}
