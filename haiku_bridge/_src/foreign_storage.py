"""Where a foreign module's variables live in Haiku: names, params and state.

Shared by the Flax and Equinox adapters (`flax_bridge.py`,
`equinox_bridge.py`), and free of both libraries. A foreign module's variables
are flattened into `Group`s (one per kind: params, state, ...), each leaf named
by its attribute path (`layers[0].kernel` -> `layers_0/kernel`). `Storage`
reads and writes them with Haiku's public `hk.get_parameter` / `hk.get_state`
/ `hk.set_state`, one `ScopeModule` per level of the path, so that a
submodule's params and state share one Haiku name (`block/bn` holds `scale`
and `mean`) and state can be written after the foreign call.
"""

import re
from typing import Any, Iterable, NamedTuple, Optional, Sequence

import haiku as hk
import jax
import numpy as np

from haiku_bridge._src import caches
from haiku_bridge._src import errors
from haiku_bridge._src.pytree import PyTree

Names = tuple[str, ...]

# ---------------------------------------------------------------------------
# Names: an attribute path as a Haiku module path.
# ---------------------------------------------------------------------------


def snake_case(class_name: str) -> str:
  """`BatchNorm` -> `batch_norm`, `MLPBlock` -> `mlp_block`: Haiku's module style."""
  name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", class_name)
  return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def _keys(path: Sequence[Any], attributes: bool) -> list[Any]:
  """The keys of a key path; attribute names (`GetAttrKey`) only if `attributes`.

  Flax NNX states put an attribute path in dict keys and end each leaf's path
  with the Variable's `.value`, which is no part of the name; Equinox modules
  are pytrees whose fields are `GetAttrKey`s.
  """
  keys = []
  for entry in path:
    if isinstance(entry, jax.tree_util.GetAttrKey):
      if attributes:
        keys.append(entry.name)
    else:
      keys.append(getattr(entry, "key", getattr(entry, "idx", None)))
  return keys


def _names(path: Sequence[Any], attributes: bool) -> Names:
  """A key path as names: keys as they are, an index joined to the key before it."""
  names: list[str] = []
  for key in _keys(path, attributes):
    if isinstance(key, int):
      names.append(f"{names.pop()}_{key}" if names else f"layer_{key}")
    else:
      names.append(str(key))
  return tuple(names)


def _attribute_path(path: Sequence[Any], attributes: bool) -> str:
  """A key path as Python would write it: `layers[0].kernel`."""
  out = ""
  for key in _keys(path, attributes):
    out += f"[{key}]" if isinstance(key, int) else f".{key}"
  return out.lstrip(".")


class Group(NamedTuple):
  """One kind of variable (params, state, ...) of a foreign module, flattened.

  `names[i]` is where leaf `i` of `treedef` lives in Haiku, relative to the
  adapter's scope; `paths[i]` is its path in the foreign structure (for
  messages).
  """
  treedef: Any
  names: tuple[Names, ...]
  paths: tuple[str, ...]
  specs: tuple[jax.ShapeDtypeStruct, ...]

  def unflatten(self, leaves: Iterable[Any]) -> PyTree:
    return jax.tree.unflatten(self.treedef, list(leaves))


def flatten_group(tree: PyTree, *, drop_first: bool = False,
                  attributes: bool = False) -> tuple[Group, list[Any]]:
  """`tree` as a Group and its leaves.

  Args:
    tree: the variables of one kind.
    drop_first: leave the first key out of names (a Linen collection name).
    attributes: keep attribute names (`GetAttrKey`) in names.
  """
  with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  names = tuple(_names(p[1:] if drop_first else p, attributes)
                for p, _ in with_path)
  paths = tuple(_attribute_path(p, attributes) for p, _ in with_path)
  leaves = [v for _, v in with_path]
  specs = tuple(jax.ShapeDtypeStruct(tuple(getattr(v, "shape", np.shape(v))),
                                     v.dtype) for v in leaves)
  return Group(treedef, names, paths, specs), leaves


def check_names(what: str, groups: Sequence[Group], kinds: Sequence[str]) -> None:
  """Each Haiku name is used once, and never both as a leaf and as a scope."""
  owner: dict[Names, str] = {}
  for group, kind in zip(groups, kinds):
    for names, path in zip(group.names, group.paths):
      if names in owner:
        raise ValueError(
            f"{what}: {kind} '{path}' and {owner[names]} both map to the "
            f"Haiku name '{'/'.join(names)}'. Rename one of them in the "
            "module.")
      owner[names] = f"{kind} '{path}'"
  for names, who in owner.items():
    for i in range(1, len(names)):
      if names[:i] in owner:
        raise ValueError(
            f"{what}: {owner[names[:i]]} and {who} both map to the Haiku "
            f"name '{'/'.join(names[:i])}' (one as a value, one as a module "
            "scope). Rename one of them in the module.")


# ---------------------------------------------------------------------------
# Haiku storage: each attribute path is a Haiku (sub)module, so a submodule's
# params and state share one name (`block/bn` holds `scale` and `mean`), and
# its state can be written after the foreign call under the same name.
# ---------------------------------------------------------------------------


class ScopeModule(hk.Module):
  """One level of a foreign module's attribute path, as a Haiku module.

  An adapter is the root. Calling a scope module with a name gives the next
  level, created inside this module's scope (once per call, see `Storage`),
  so params and state under one path share one Haiku name and state can be
  written after the foreign call.
  """

  def __call__(self, name: str) -> "ScopeModule":
    return ScopeModule(name=name)

  def get_param(self, name: str, spec: jax.ShapeDtypeStruct, value: Any) -> Any:
    return hk.get_parameter(name, spec.shape, spec.dtype,
                            init=None if value is None else _const(value))

  def get_state(self, name: str, spec: jax.ShapeDtypeStruct, value: Any) -> Any:
    return hk.get_state(name, spec.shape, spec.dtype,
                        init=None if value is None else _const(value))

  def set_state(self, name: str, value: Any) -> None:
    hk.set_state(name, value)


def _const(value):
  return lambda shape, dtype: value


class Storage:
  """Reads and writes a foreign module's leaves as Haiku params and state.

  Leaf `names` `(a, b, w)` is `w` in the `ScopeModule` `root/a/b`.
  """

  def __init__(self, root: ScopeModule, what: str):
    # Created inside `root.__call__`, so a `ScopeModule` made here is its child.
    self._root = root
    self._what = what
    self._scopes: dict[Names, ScopeModule] = {(): root}

  def _scope(self, names: Names) -> ScopeModule:
    prefix = names[:-1]
    if prefix not in self._scopes:
      parent = self._scope(prefix)
      self._scopes[prefix] = (ScopeModule(name=prefix[-1]) if not prefix[:-1]
                              else parent(prefix[-1]))
    return self._scopes[prefix]

  def params(self, group: Group, values: Optional[list[Any]]) -> list[Any]:
    return [self._read("parameter", group, i, values) for i in range(
        len(group.names))]

  def state(self, group: Group, values: Optional[list[Any]]) -> list[Any]:
    return [self._read("state", group, i, values) for i in range(
        len(group.names))]

  def set_state(self, group: Group, old: Sequence[Any], new: Sequence[Any]) -> None:
    for names, before, after in zip(group.names, old, new):
      if after is not before:
        self._scope(names).set_state(names[-1], after)

  def _read(self, kind: str, group: Group, i: int, values) -> Any:
    names, spec = group.names[i], group.specs[i]
    value = None if values is None else values[i]
    scope = self._scope(names)
    try:
      if kind == "parameter":
        return scope.get_param(names[-1], spec, value)
      return scope.get_state(names[-1], spec, value)
    except ValueError as e:
      full = "/".join((hk.experimental.current_name(),) + names)
      raise ValueError(
          f"{self._what}: {kind} '{group.paths[i]}' (Haiku {kind} "
          f"'{full}', expected {errors.type_str(spec)}): {e} Pass the "
          "params and state that `init` gave for this module, with the same "
          "input shapes.") from e



# ---------------------------------------------------------------------------
# Layouts of constructors and inits (keyed by the adapter), so that apply
# traces a constructor once per process. Cleared by `clear_cache()`.
# ---------------------------------------------------------------------------

_LAYOUTS = caches.Cache("layouts of foreign modules")


def cache_get(key: Any) -> Any:
  return _LAYOUTS.get(key)


def cache_put(key: Any, layout: Any) -> None:
  _LAYOUTS.put(key, layout)


def clear_cache() -> None:
  """Forgets the cached layouts of constructors and Linen inits."""
  _LAYOUTS.clear()
