"""Shapes of an init function's output at apply time, traced once per signature.

At apply the bridge needs the structure, shapes and dtypes of what `init`
returns, never its values: `jax.eval_shape` gives them without leaving an op
in the jaxpr, but it traces `init` in full, which for a Haiku function costs
about as much as tracing the model itself. The answer depends only on `init`
and on the shapes of array arguments (and the values of the others), so it is
kept in a small LRU cache under that signature. Arguments that cannot be
hashed skip the cache.
"""

import collections
import threading
from typing import Any, Callable, Hashable, Optional

import jax
import numpy as np

_MAX_ENTRIES = 512


class _LruCache:

  def __init__(self, max_entries: int):
    self._entries: collections.OrderedDict = collections.OrderedDict()
    self._max_entries = max_entries
    self._lock = threading.Lock()

  def get(self, key: Hashable) -> Any:
    with self._lock:
      value = self._entries.get(key)
      if value is not None:
        self._entries.move_to_end(key)
      return value

  def put(self, key: Hashable, value: Any) -> None:
    with self._lock:
      self._entries[key] = value
      if len(self._entries) > self._max_entries:
        self._entries.popitem(last=False)

  def clear(self) -> None:
    with self._lock:
      self._entries.clear()


_cache = _LruCache(_MAX_ENTRIES)


def _leaf_signature(leaf: Any, exact: bool) -> Hashable:
  if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
    dtype = (str(leaf.dtype)
             if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended)
             else np.dtype(leaf.dtype).str)
    shape = tuple(leaf.shape) if exact else len(leaf.shape)
    return ("array", shape, dtype, bool(getattr(leaf, "weak_type", False)))
  hash(leaf)  # Python values (ints, flags, ...) may decide shapes: keep them.
  return ("value", type(leaf), leaf)


def signature(args: tuple[Any, ...], kwargs: dict[str, Any],
              key_spec: jax.ShapeDtypeStruct, *,
              exact: bool = True) -> Optional[Hashable]:
  """A hashable key for `(args, kwargs)` up to array values, or None.

  With `exact=False`, arrays count by rank and dtype only: the key of a
  "structure" that holds for any batch size, say.
  """
  leaves, treedef = jax.tree.flatten((args, kwargs))
  try:
    return (exact, treedef,
            tuple(_leaf_signature(leaf, exact) for leaf in leaves),
            tuple(key_spec.shape), str(key_spec.dtype))
  except TypeError:
    return None


def _cache_key(init, key_spec, args, kwargs, exact) -> Optional[Hashable]:
  sig = signature(args, kwargs, key_spec, exact=exact)
  if sig is None:
    return None
  try:
    hash(init)
  except TypeError:
    return None
  return (init, sig)


def _store(init, key_spec, args, kwargs, shapes) -> None:
  for exact in (True, False):
    key = _cache_key(init, key_spec, args, kwargs, exact)
    if key is not None:
      _cache.put(key, shapes)


def abstract_init(init: Callable[..., Any], key_spec: jax.ShapeDtypeStruct,
                  args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
  """`jax.eval_shape` of `init(key, *args, **kwargs)`, cached by signature."""
  key = _cache_key(init, key_spec, args, kwargs, exact=True)
  cached = None if key is None else _cache.get(key)
  if cached is not None:
    return cached
  shapes = jax.eval_shape(lambda k: init(k, *args, **kwargs), key_spec)
  _store(init, key_spec, args, kwargs, shapes)
  return shapes


def cached(init: Callable[..., Any], key_spec: jax.ShapeDtypeStruct,
           args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
  """What `abstract_init` would return, if it is cached; else None."""
  key = _cache_key(init, key_spec, args, kwargs, exact=True)
  return None if key is None else _cache.get(key)


def structure(init: Callable[..., Any], key_spec: jax.ShapeDtypeStruct,
              args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
  """Shapes `init` gave for arguments of the same ranks and dtypes, or None.

  The tree structure and dtypes are what `init` gives here too; the shapes
  may be those of other dims (another batch size). For callers that can
  check shapes where they are used, so a new batch size traces no `init`.
  """
  key = _cache_key(init, key_spec, args, kwargs, exact=False)
  return None if key is None else _cache.get(key)


def remember(init: Callable[..., Any], key_spec: jax.ShapeDtypeStruct,
             args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
  """Records what `init` returned at init, so apply at the same signature skips tracing it.

  The usual workflow runs `init` and then traces `apply` on inputs of the same
  shapes in one process; the real init has already shown the shapes.
  """
  _store(init, key_spec, args, kwargs, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), output))


def clear_cache() -> None:
  _cache.clear()
