"""Every cache of the bridge, and the one function that clears them all.

A cache here holds what tracing a function told the bridge (the structure of
what `init` returns, which params a Haiku function reads). Each is keyed on
everything its value depends on: the function, and the exact signature of
its arguments (full shapes, dtypes, weak types, and the values of non-array
arguments). A value that depends on more (the stored params' shapes) is
checked against that on every hit. Clearing changes no result, only time.
"""

import collections
import threading
from typing import Any, Callable, Hashable, Optional

import jax
import numpy as np

_MAX_ENTRIES = 512


class Cache:
  """A bounded, thread-safe LRU map; `clear_caches()` empties every one."""

  def __init__(self, name: str, max_entries: int = _MAX_ENTRIES):
    self.name = name
    self._entries: collections.OrderedDict = collections.OrderedDict()
    self._max_entries = max_entries
    self._lock = threading.Lock()
    register(self.clear)

  def get(self, key: Optional[Hashable]) -> Any:
    """The value kept under `key`; None if none, or if `key` is unhashable."""
    if key is None or not _hashable(key):
      return None
    with self._lock:
      value = self._entries.get(key)
      if value is not None:
        self._entries.move_to_end(key)
      return value

  def put(self, key: Optional[Hashable], value: Any) -> None:
    """Keeps `value` under `key`; an unhashable key keeps nothing."""
    if key is None or not _hashable(key):
      return
    with self._lock:
      self._entries[key] = value
      if len(self._entries) > self._max_entries:
        self._entries.popitem(last=False)

  def get_or_compute(self, key: Optional[Hashable],
                     compute: Callable[[], Any]) -> Any:
    value = self.get(key)
    if value is None:
      value = compute()
      self.put(key, value)
    return value

  def clear(self) -> None:
    with self._lock:
      self._entries.clear()

  def __len__(self) -> int:
    return len(self._entries)


def _hashable(key: Any) -> bool:
  try:
    hash(key)
  except TypeError:
    return False
  return True


_CLEARERS: list[Callable[[], None]] = []


def register(clear: Callable[[], None]) -> None:
  """Adds a cache kept elsewhere (e.g. a `functools.lru_cache`'s `cache_clear`)."""
  _CLEARERS.append(clear)


def clear_caches() -> None:
  """Empties every cache of haiku_bridge.

  Only ever needed to measure a cold start or to free memory: a cache never
  changes a result.

  >>> hkb.clear_caches()
  """
  for clear in _CLEARERS:
    clear()


def _leaf_signature(leaf: Any) -> Hashable:
  if isinstance(leaf, (jax.Array, np.ndarray, np.generic,
                       jax.ShapeDtypeStruct)):
    dtype = (str(leaf.dtype)
             if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended)
             else np.dtype(leaf.dtype).str)
    return ("array", tuple(leaf.shape), dtype,
            bool(getattr(leaf, "weak_type", False)))
  hash(leaf)  # Python values (ints, flags, ...) may decide shapes: keep them.
  return ("value", type(leaf), leaf)


def signature(*trees: Any) -> Optional[Hashable]:
  """A hashable key for `trees` up to array values, or None if unhashable."""
  leaves, treedef = jax.tree.flatten(trees)
  try:
    return (treedef, tuple(_leaf_signature(leaf) for leaf in leaves))
  except TypeError:
    return None


def function_key(fn: Any, *trees: Any) -> Optional[Hashable]:
  """`(fn, signature(*trees))`, or None if either cannot be hashed."""
  sig = signature(*trees)
  if sig is None:
    return None
  try:
    hash(fn)
  except TypeError:
    return None
  return (fn, sig)
