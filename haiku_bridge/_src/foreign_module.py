"""What the Flax and Equinox adapters share: a foreign module as a Haiku module.

A foreign module's variables of one kind (params, state) are flattened into
a `Variables` record, each leaf named by its attribute path below the
adapter's scope, by the key-path rule of `naming.py` (`layers[0].kernel` ->
`block/layers_0/kernel`). `ForeignModule`, the Haiku module both adapters
derive from, names itself after the foreign class (`BatchNorm` ->
`batch_norm`), builds the foreign module at init (or lays it out at apply,
without building it: cached in `caches.py`), and stores its leaves through
`storage.PARAMS` / `storage.STATE` exactly as `call_pure` stores a pure
function's params: names claimed, values created at init through any custom
creator (which may cast them, e.g. to bfloat16), read and checked at apply
through any custom getter, state written back after the call, and errors
worded by `storage.py` under the adapter's name (`hkb.from_flax(Block): ...`).

Free of Flax and Equinox: each adapter brings only what is foreign.
"""

import inspect
import re
from typing import Any, Callable, Hashable, Mapping, NamedTuple, Optional, Sequence

import haiku as hk
import jax

from haiku_bridge._src import caches
from haiku_bridge._src import fingerprint
from haiku_bridge._src import errors
from haiku_bridge._src import foreign_sharding
from haiku_bridge._src import guards
from haiku_bridge._src import naming
from haiku_bridge._src import pytree
from haiku_bridge._src import storage
from haiku_bridge._src.pytree import PyTree

Names = tuple[str, ...]

_SKELETONS = caches.Cache("skeletons of foreign modules")


def snake_case(class_name: str) -> str:
  """`BatchNorm` -> `batch_norm`, `MLPBlock` -> `mlp_block`: Haiku's module style."""
  name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", class_name)
  return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def class_name(obj: Any, instance_type: type) -> Optional[str]:
  """The class `obj` is or builds, when it says so without being called.

  An instance of `instance_type`, a class, or a `functools.partial` of a
  class; None for any other constructor (a lambda must be called to know).
  """
  if isinstance(obj, instance_type):
    return type(obj).__name__
  target = getattr(obj, "func", obj)  # functools.partial
  return target.__name__ if isinstance(target, type) else None


# ---------------------------------------------------------------------------
# Variables: one kind of a foreign module's leaves, flattened and named.
# ---------------------------------------------------------------------------


class Variables(NamedTuple):
  """One kind of variable (params, state, ...) of a foreign module, flattened.

  Attributes:
    treedef: the structure to rebuild the foreign variables from leaves.
    names: per leaf, its Haiku name components below the adapter's scope:
      `("layers_0", "kernel")` is parameter `kernel` of `<scope>/layers_0`.
    paths: per leaf, its path in the foreign module (`layers[0].kernel`),
      for messages.
    specs: per leaf, its shape and dtype.
  """

  treedef: Any
  names: tuple[Names, ...]
  paths: tuple[str, ...]
  specs: tuple[jax.ShapeDtypeStruct, ...]

  def unflatten(self, leaves: Sequence[Any]) -> PyTree:
    return jax.tree.unflatten(self.treedef, list(leaves))

  def leaves(self, scope: str) -> list[storage.Leaf]:
    """Where each leaf lives in Haiku when the adapter's scope is `scope`."""
    return [
      storage.Leaf(path, naming.join_bundle(scope, names[:-1]), names[-1])
      for names, path in zip(self.names, self.paths)
    ]


def _key(entry: Any, attributes: bool) -> Optional[str | int]:
  """A key path entry as a name (str) or an index (int); None to leave out."""
  if isinstance(entry, jax.tree_util.GetAttrKey):
    return entry.name if attributes else None
  key = getattr(entry, "key", getattr(entry, "idx", None))
  return key if isinstance(key, int) else str(key)


def attribute_path(keys: Sequence[str | int]) -> str:
  """Keys as Python writes an attribute path: `layers[0].kernel`."""
  return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys).lstrip(".") or "<root>"


def _names_and_path(
  path: Sequence[Any], attributes: bool, drop_first: bool, prefix: Names
) -> tuple[Names, str]:
  keys = [k for k in (_key(e, attributes) for e in path) if k is not None]
  named = keys[1:] if drop_first else keys
  as_entries = tuple(
    jax.tree_util.SequenceKey(k) if isinstance(k, int) else jax.tree_util.DictKey(k) for k in named
  )
  return prefix + naming.path_components(as_entries), attribute_path(keys)


def flatten(
  tree: PyTree,
  *,
  attributes: bool = False,
  drop_first: bool = False,
  prefix: Names = (),
  is_leaf: Optional[Callable[[Any], bool]] = None,
) -> tuple[Variables, list[Any]]:
  """`tree` as a `Variables` record and its leaves.

  Args:
    tree: the variables of one kind.
    attributes: keep attribute names (`GetAttrKey`, Equinox fields) in
      names; Flax puts attribute paths in dict keys and ends a leaf's path
      with the variable's own `.value`, which is no part of the name.
    drop_first: leave the first key out of names (a Linen collection name;
      messages keep it).
    prefix: name components before each leaf's own (a Haiku collection).
    is_leaf: as for `jax.tree_util.tree_flatten_with_path`.
  """
  with_path, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf)
  names, paths = [], []
  for path, _ in with_path:
    leaf_names, leaf_path = _names_and_path(path, attributes, drop_first, prefix)
    names.append(leaf_names)
    paths.append(leaf_path)
  leaves = [v for _, v in with_path]
  specs = tuple(pytree.spec(v) for v in leaves)
  return Variables(treedef, tuple(names), tuple(paths), specs), leaves


# ---------------------------------------------------------------------------
# Storage: through storage.py, as call_pure stores a pure function's params.
# ---------------------------------------------------------------------------


def params(
  variables: Variables, values: Optional[Sequence[Any]], partition: Optional[Sequence[Any]] = None
) -> list[Any]:
  """The params, created from `values` at init, read at apply.

  `partition` holds each leaf's declared `PartitionSpec` (or None), which
  `hkb.ShardingRules.from_foreign` records at init.
  """
  leaves = variables.leaves(hk.experimental.current_name())
  storage.PARAMS.claim(leaves)
  if guards.initialising():
    assert values is not None, "values are built at init"
    with foreign_sharding.recording(leaves, partition):
      return storage.PARAMS.create(leaves, values)
  return storage.PARAMS.read(leaves, [s.shape for s in variables.specs])


def state(variables: Variables, values: Optional[Sequence[Any]]) -> list[Any]:
  """The current state, created from `values` at init, read at apply."""
  leaves = variables.leaves(hk.experimental.current_name())
  storage.STATE.claim(leaves)
  if guards.initialising():
    assert values is not None, "values are built at init"
    return storage.STATE.create(leaves, values, values)
  return storage.STATE.read(leaves, [s.shape for s in variables.specs])


def write_state(variables: Variables, old: Sequence[Any], new: Sequence[Any]) -> None:
  """Sets each state leaf whose value the call replaced."""
  storage.STATE.write(variables.leaves(hk.experimental.current_name()), old, new)


def outputs(variables: Variables, values: Sequence[Any]) -> None:
  """Stores values the call made (intermediates) as state, replacing any."""
  leaves = variables.leaves(hk.experimental.current_name())
  storage.STATE.claim(leaves)
  if guards.initialising():
    storage.STATE.create(leaves, values, values)
  else:
    storage.STATE.write(leaves, [None] * len(leaves), values)


# ---------------------------------------------------------------------------
# The Haiku module.
# ---------------------------------------------------------------------------


class Built(NamedTuple):
  """A foreign module's skeleton, and its values where it was really built.

  The skeleton is the module without its values: what its params and state
  are named and shaped, and how to put it back together (each adapter's
  `...Skeleton` record); apply needs only it, so it is cached.
  """

  skeleton: Any
  values: Optional[Any]  # The leaves, by kind; None where only laid out.


class Recipe(NamedTuple):
  """How an adapter builds its foreign module and takes it apart.

  Attributes:
    construct: `construct(key)` builds the module from a Haiku rng key (None
      for an adapter of an instance).
    construct_abstract: builds it abstractly (`jax.eval_shape`-style), for
      its skeleton alone (None for an instance).
    split: `split(module) -> (skeleton, values)`.
    cache_key: what the skeleton depends on (the constructor), or None.
  """

  construct: Optional[Callable[[jax.Array], Any]]
  construct_abstract: Optional[Callable[[], Any]]
  split: Callable[[Any], tuple[Any, Any]]
  cache_key: Optional[Hashable]


def built(instance: Any, recipe: Recipe) -> Built:
  """The skeleton, with values for an `instance` (if given) or at init.

  An instance is taken apart as it is; a constructor is built at init with
  a key from Haiku's rng sequence, and at apply only laid out.
  """
  if instance is not None:
    return Built(*recipe.split(instance))
  if guards.initialising():
    guards.require_haiku_trace()
    assert recipe.construct is not None, "a recipe without an instance builds"
    skeleton, values = recipe.split(recipe.construct(hk.next_rng_key()))
    _SKELETONS.put(recipe.cache_key, skeleton)
    return Built(skeleton, values)
  return Built(abstract_skeleton(recipe), None)


def abstract_skeleton(recipe: Recipe) -> Any:
  """The skeleton of what the recipe builds, without building it (cached)."""
  construct = recipe.construct_abstract
  assert construct is not None, "an instance is laid out as it is"
  return _SKELETONS.get_or_compute(recipe.cache_key, lambda: recipe.split(construct())[0])


def cached_skeleton(key: Optional[Hashable], compute: Callable[[], Any]) -> Any:
  """A skeleton cached under `key` (`hkb.clear_caches()` clears it)."""
  return _SKELETONS.get_or_compute(key, compute)


def remember_skeleton(key: Optional[Hashable], skeleton: Any) -> None:
  _SKELETONS.put(key, skeleton)


def skeleton_key(kind: str, code: Any, *values: Any) -> Optional[Hashable]:
  """A cache key for the skeleton of what `code` builds from `values`.

  Keyed as `call_pure` keys the structure of its init's params
  (`fingerprint.function_key`): `code` (the constructor, or the Linen module and
  its method) by its fingerprint: its code, closure, defaults, the globals
  it reads, a partial's arguments, a class's own methods; `values` (the
  call's arguments, stream names) by signature; with the PRNG
  implementation (the abstract build draws its keys from it) and the x64
  flag. None (nothing cached) where no key can be made.
  """
  return fingerprint.function_key(
    (kind, code),
    values,
    pytree.default_key_spec(),
    bool(jax.config.jax_enable_x64),  # type: ignore[attr-defined, unused-ignore]
  )


class ForeignModule(hk.Module):
  """The Haiku module of a foreign module: named after the foreign class."""

  AUTO_REPR = False  # Haiku would take the repr of every argument (a State).

  def __init__(self, foreign_class: str, api: str, name: Optional[str]):
    super().__init__(name=name or snake_case(foreign_class))
    self._api = f"{api}({foreign_class})"  # Messages: `hkb.from_flax(Block): `.


def constructed(
  build: Callable[[], Any],
  *,
  keyword: str,
  example: str,
  expected: type,
  expected_name: str,
  module_of: Callable[[Any], Any] = lambda built: built,
) -> Any:
  """`build()`, a constructor called with its key alone, with clear errors.

  Args:
    build: calls the user's constructor with `keyword=` its key.
    keyword: the constructor's key argument, for the message (`rngs`).
    example: a constructor with its sizes bound, for the message.
    expected: the type the constructor must return.
    expected_name: that type as users write it (`nnx.Module`).
    module_of: the module in what `build` returns.
  """
  try:
    built_ = build()
  except TypeError as e:
    raise TypeError(
      errors.message(
        f"calling the constructor with `{keyword}=` alone failed: {e}. The "
        "module takes its input sizes when it is constructed, so pass a "
        f"constructor with them bound, e.g. {example}."
      )
    ) from e
  module = module_of(built_)
  if not isinstance(module, expected):
    raise TypeError(
      errors.message(f"the constructor returned a {type(module).__name__}, not an {expected_name}.")
    )
  return built_


def with_state(f: Any) -> hk.TransformedWithState:
  """`f` as an `hk.TransformedWithState` whose apply takes an rng.

  For `to_nnx` and `to_equinox`, which call `apply(params, state, rng,
  *args)`. The apply of `hk.without_apply_rng(...)` takes no rng: it gets
  none, as its own caller gives none.
  """
  if not isinstance(f, (hk.Transformed, hk.TransformedWithState)):
    raise TypeError(
      errors.bad_argument(
        "f",
        f,
        "the output of hk.transform or hk.transform_with_state",
        f"Wrap the Haiku function first: hkb.{errors.current()}(hk.transform_with_state(f), ...).",
      )
    )
  with_state_ = f if isinstance(f, hk.TransformedWithState) else hk.with_empty_state(f)
  # Haiku names apply's leading parameters: (params, [state,] rng, ...).
  rng_position = 2 if isinstance(f, hk.TransformedWithState) else 1
  if _parameter_name(f.apply, rng_position) in (None, "rng"):
    return with_state_
  return hk.TransformedWithState(
    init=with_state_.init,
    apply=lambda params, state, rng, *args, **kwargs: with_state_.apply(
      params, state, *args, **kwargs
    ),
  )


def _parameter_name(fn: Callable[..., Any], position: int) -> Optional[str]:
  """The name of `fn`'s positional parameter at `position`; None if unknown."""
  try:
    parameters = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):
    return None
  if position >= len(parameters) or parameters[position].kind not in (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
  ):
    return None
  return parameters[position].name


def check_name(name: Any) -> None:
  """`name=` of an adapter: None or a module name."""
  errors.check_str("name", name, "None or a Haiku module name (a string)", optional=True)


def check_given(
  transformed: hk.TransformedWithState,
  params: Any,
  state: Any,
  args: Sequence[Any],
  kwargs: dict[str, Any],
) -> None:
  """`params=` and `state=` of `to_nnx` / `to_equinox`: what `f.init` makes.

  Each a Haiku dict `{module: {name: array}}`; state only with params (init
  makes both otherwise). With example inputs beside them, also compared by
  name and shape with an abstract `f.init(key, *args)`, so a checkpoint of
  another model is refused at construction, naming the entry; without
  inputs there is nothing to compare with until the first call.
  """
  if state is not None and params is None:
    raise ValueError(
      errors.message(
        "`state` goes with `params=`: without params, f.init runs and makes "
        "both. Pass the params too (e.g. from the same checkpoint), or "
        "leave state out."
      )
    )
  for argument, given in (("params", params), ("state", state)):
    if given is not None and (
      not isinstance(given, Mapping)
      or not all(isinstance(entries, Mapping) for entries in given.values())
    ):
      raise TypeError(
        errors.bad_argument(
          argument,
          given,
          f"Haiku's {argument} dict {{module: {{name: "
          f"array}}}}, as f.init returns it (e.g. a Haiku checkpoint)",
        )
      )
  if params is None or (not args and not kwargs):
    return
  wants = jax.eval_shape(transformed.init, pytree.default_key_spec(), *args, **kwargs)
  _compare("params", params, wants[0])
  if state is None and wants[1]:
    raise ValueError(
      errors.message(
        f"f has state ({sorted(wants[1])[:4]}), and `params=` came without "
        "`state=`. Pass the state that f.init made with the params (e.g. "
        "from the same checkpoint)."
      )
    )
  _compare("state", {} if state is None else state, wants[1])


def _compare(argument: str, given: Mapping[str, Any], want: Mapping[str, Any]) -> None:
  """`given` against what f.init makes: the same names, the same shapes."""
  given = {f"{b}/{n}": v for b, entries in given.items() for n, v in entries.items()}
  wanted = {f"{b}/{n}": v for b, entries in want.items() for n, v in entries.items()}
  if set(given) != set(wanted):
    raise ValueError(
      errors.message(
        f"`{argument}` must be the {argument} f.init makes for these inputs; "
        f"they lack {sorted(set(wanted) - set(given))[:4]} and have "
        f"{sorted(set(given) - set(wanted))[:4]} besides."
      )
    )
  for path, spec in wanted.items():
    shape = tuple(jax.numpy.shape(given[path]))
    if shape != tuple(spec.shape):
      raise ValueError(
        errors.message(
          f"`{argument}` must be the {argument} f.init makes for these "
          f"inputs; '{path}' has shape {list(shape)}, but f needs "
          f"{list(spec.shape)} for these inputs."
        )
      )
