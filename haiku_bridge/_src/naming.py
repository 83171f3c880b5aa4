"""Where each leaf of an explicit params pytree lives in a Haiku transform.

Two rules, both decided here and nowhere else:

* **Key-path rule** (any pytree). Each leaf's key path becomes a Haiku name: the
  last entry is the parameter name, the entries before it are module scopes
  below the current one. Dict keys and attribute/field names are used as they
  are; a sequence index joins the entry before it (`"layers", 0` becomes
  `layers_0`; an index with nothing before it becomes `layer_0`). So
  `{"linear": {"w": ..., "b": ...}}` called inside module `net` is stored
  exactly where `hk.Linear(name="linear")` would store its weights:
  `net/linear/w` and `net/linear/b`. The first module entry is a module name
  that Haiku's allocator gives, so it never lands on a module that already
  holds it (`linear_1` after an `hk.Linear`, as a second `hk.Linear` would).

* **Inline rule** (a Haiku function). Its modules get the names that running
  it inline at this point gives them, because it runs inline: two bridged
  calls of one MLP give `mlp` then `mlp_1`, and a bridged call after an
  inline `mlp` gives `mlp_1`. Where its params are handed over as a pytree,
  they carry the function's own names, those `hk.transform(f)` gives
  (`own_bundle`): `mlp`, however Haiku numbered it here.
"""

import contextlib
import re
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Optional

import haiku as hk
import jax

from haiku_bridge._src import errors

TOP_LEVEL = "~"  # Haiku's bundle for parameters created outside any module.
_NUMBERED = re.compile(r"^(.*)_(\d+)$")


def _entry(key: Any) -> str | int:
  if isinstance(key, jax.tree_util.DictKey):
    return str(key.key)
  if isinstance(key, jax.tree_util.GetAttrKey):
    return key.name
  if isinstance(key, jax.tree_util.SequenceKey):
    return key.idx
  if isinstance(key, jax.tree_util.FlattenedIndexKey):
    return key.key
  raise TypeError(f"Unsupported pytree key {key!r}.")


def path_components(path: tuple[Any, ...]) -> tuple[str, ...]:
  """The Haiku name components of a pytree key path (see the module doc)."""
  parts: list[str] = []
  for entry in map(_entry, path):
    if isinstance(entry, int):
      if parts:
        parts[-1] = f"{parts[-1]}_{entry}"
      else:
        parts.append(f"layer_{entry}")
    else:
      parts.append(entry)
  return tuple(parts)


def join_bundle(scope: str, components: Iterable[str]) -> str:
  """`scope/a/b`, where the top-level scope `~` adds no prefix."""
  components = tuple(components)
  if not components:
    return scope
  rest = "/".join(components)
  return rest if scope == TOP_LEVEL else f"{scope}/{rest}"


def _check_component(component: str, keypath: str) -> None:
  body = component[1:] if component.startswith("~") else component
  if body and not body.isidentifier():
    raise ValueError(
      errors.message(
        f"params path {keypath} gives the Haiku module name component "
        f"{component!r}, which is not a valid Python identifier. Rename that "
        "dict key or field (Haiku module names are identifiers joined by '/')."
      )
    )


def key_path_components(tree: Any) -> list[tuple[str, tuple[str, ...]]]:
  """`(keypath, components)` for each leaf of `tree`, in `jax.tree.leaves` order.

  The components are checked to be valid module names; a bare array gets the
  single component `params`.
  """
  out = []
  for path, _ in jax.tree_util.tree_leaves_with_path(tree):
    components = path_components(path)
    keypath = jax.tree_util.keystr(path) or "<root>"
    if not components:
      components = ("params",)  # A bare array: one parameter named "params".
    for component in components[:-1]:
      for part in component.split("/"):
        _check_component(part, keypath)
    if "/" in components[-1]:
      raise ValueError(
        errors.message(
          f"params path {keypath} gives the parameter name "
          f"{components[-1]!r}, which contains '/'. Haiku names a parameter "
          "by one identifier: nest the dict instead ({'a': {'b': ...}} for "
          "'a/b')."
        )
      )
    out.append((keypath, components))
  return out


class KeyPathLeaf(NamedTuple):
  """One leaf of a params pytree, by the key-path rule."""

  # Its position in `jax.tree.leaves` (the field hides `tuple.index`).
  index: int  # type: ignore[assignment]
  keypath: str  # For messages: `['enc']['w']`.
  below: tuple[str, ...]  # Module components below the first one.
  name: str  # The parameter name.


def key_path_groups(tree: Any) -> dict[Optional[str], list[KeyPathLeaf]]:
  """The leaves of `tree` grouped by their first module component.

  In order of first appearance; leaves with no module component (stored in
  the current module itself) are under None.
  """
  groups: dict[Optional[str], list[KeyPathLeaf]] = {}
  for index, (keypath, components) in enumerate(key_path_components(tree)):
    modules = "/".join(components[:-1]).split("/") if components[:-1] else []
    top = modules[0] if modules else None
    groups.setdefault(top, []).append(
      KeyPathLeaf(index, keypath, tuple(modules[1:]), components[-1])
    )
  return groups


@contextlib.contextmanager
def module_scope(top: Optional[str], keypath: str) -> Iterator[None]:
  """Enters module name `top`, which Haiku's allocator gives here.

  So a first module component never lands on a module that already took
  that name in this module call (`linear` becomes `linear_1`, as a second
  `hk.Linear` would), and code after the call sees the name taken. None
  stays in the current module; Haiku's own method scopes (`~...`) are never
  numbered.
  """
  if top is None:
    yield
    return
  if top.startswith("~"):
    scope = hk.name_scope(hk.force_name(join_bundle(hk.experimental.current_name(), (top,))))
  else:
    try:
      scope = hk.name_scope(top)
    except ValueError as e:
      raise ValueError(
        errors.message(
          f"params path {keypath} needs the module name {top!r} in this "
          f"scope, which a module already holds ({e}). Rename that key, or "
          "pass `name=` to give the bridged call its own scope."
        )
      ) from None
  with scope:
    yield


def split_number(name: str) -> tuple[str, int]:
  """`"mlp_2"` -> `("mlp", 2)`; `"mlp"` -> `("mlp", 0)`, as Haiku numbers them."""
  match = _NUMBERED.match(name)
  if match is None:
    return name, 0
  return match.group(1), int(match.group(2))


def own_bundle(bundle: str, scope: str, counters: Mapping[str, int]) -> str:
  """`bundle`, as a function run inline at `scope` named it, in its own transform.

  Haiku numbers a module on from those of its name already made in the same
  module call: a function's first `linear` is `linear_1` after the caller's
  `linear`, and `linear` in a transform of its own. So the top module of a
  bundle under `scope` is numbered down by the caller's count before the
  call (`counters`, by full base name), and the scope's own bundle is the
  function's top level (`~`). A bundle that a lift writes straight into the
  scope (`hk.transparent_lift`) keeps its name: inline, it may not meet a
  module of the caller's (Haiku raises), so that count is zero. A module the
  function names with an explicit number (`name="linear_3"`) is numbered
  down all the same: Haiku's names do not tell it from a counted one.

  Args:
    bundle: a bundle the function read, as the caller stores it.
    scope: the module name at the call (`hk.experimental.current_name()`).
    counters: how many modules of each (full) base name the scope had made
      before the call.

  Returns:
    The bundle's name in `hk.transform(f)`.
  """
  if bundle == scope:
    return TOP_LEVEL
  prefix = "" if scope == TOP_LEVEL else scope + "/"
  if not bundle.startswith(prefix):
    return bundle
  top, _, rest = bundle[len(prefix) :].partition("/")
  base, number = split_number(top)
  k = number - counters.get(prefix + base, 0)
  if k >= 0:
    top = base if k == 0 else f"{base}_{k}"
  return f"{top}/{rest}" if rest else top
