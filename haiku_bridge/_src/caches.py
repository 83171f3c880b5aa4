"""Every cache of the bridge, and the one function that clears them all.

A cache here holds what tracing a function told the bridge (the structure of
what `init` returns). Each is keyed on everything its value depends on: the
function and the exact signature of its arguments, as `fingerprint.py` makes
the key (`fingerprint.function_key`); the caller adds what else it depends
on (the PRNG implementation, x64). Where a key cannot be made, nothing is
cached. Clearing changes no result, only time, and
`HAIKU_BRIDGE_CACHES=0` in the environment turns every cache off (the test
suite runs both ways): the `Cache`s and the memos of `memoize`, all in one
registry. (One exception, a constant of jax's: `pytree.key_spec_of`.)

One kind of value outlives the process: what `remat="auto"` measured of a
loop (`remat/plan_cache.py`), as small JSON files under `directory()`:
`$HAIKU_BRIDGE_CACHE_DIR` if set (empty: nothing on disk), else
`$XDG_CACHE_HOME/haiku_bridge`, else `~/.cache/haiku_bridge`.
`clear_caches()` deletes them too, and `HAIKU_BRIDGE_CACHES=0` turns them off.
"""

import collections
import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import types
from typing import Any, Callable, Hashable, Iterator, Optional, Sequence

from haiku_bridge._src import pytree

_MAX_ENTRIES = 512
_enabled = os.environ.get("HAIKU_BRIDGE_CACHES", "1") != "0"


def enabled() -> bool:
  """Whether caches keep anything (`HAIKU_BRIDGE_CACHES=0` turns them off)."""
  return _enabled


@contextlib.contextmanager
def disabled() -> Iterator[None]:
  """Turns every cache off for a while (and empties them): for tests."""
  global _enabled
  saved, _enabled = _enabled, False
  clear_caches()
  try:
    yield
  finally:
    _enabled = saved


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
    if not _enabled or key is None or not hashable(key):
      return None
    with self._lock:
      value = self._entries.get(key)
      if value is not None:
        self._entries.move_to_end(key)
      return value

  def put(self, key: Optional[Hashable], value: Any) -> None:
    """Keeps `value` under `key`; an unhashable key keeps nothing."""
    if not _enabled or key is None or not hashable(key):
      return
    with self._lock:
      self._entries[key] = value
      if len(self._entries) > self._max_entries:
        self._entries.popitem(last=False)

  def get_or_compute(self, key: Optional[Hashable], compute: Callable[[], Any]) -> Any:
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


def hashable(key: Any) -> bool:
  """Whether `key` can key a dict (a tuple holding a list cannot)."""
  try:
    hash(key)
  except TypeError:
    return False
  return True


_CLEARERS: list[Callable[[], None]] = []


def register(clear: Callable[[], None]) -> None:
  """Adds a cache kept elsewhere (e.g. a `functools.lru_cache`'s `cache_clear`)."""
  _CLEARERS.append(clear)


def memoize(maxsize: Optional[int] = 256) -> Callable[[Callable], Callable]:
  """`functools.lru_cache` for a function of hashable arguments, in the registry.

  `clear_caches()` empties it, and it keeps nothing while caches are off
  (`disabled()`, `HAIKU_BRIDGE_CACHES=0`), like every `Cache`.
  """

  def wrap(fn: Callable) -> Callable:
    cached = functools.lru_cache(maxsize=maxsize)(fn)
    register(cached.cache_clear)

    @functools.wraps(fn)
    def memoized(*args):
      return cached(*args) if _enabled else fn(*args)

    memoized.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    memoized.cache_info = cached.cache_info  # type: ignore[attr-defined]
    return memoized

  return wrap


def directory() -> Optional[str]:
  """Where caches that outlive the process keep their files; None: nowhere.

  `$HAIKU_BRIDGE_CACHE_DIR` if set (set and empty: nowhere), else
  `$XDG_CACHE_HOME/haiku_bridge`, else `~/.cache/haiku_bridge`; nowhere while
  caches are off.
  """
  if not _enabled:
    return None
  named = os.environ.get("HAIKU_BRIDGE_CACHE_DIR")
  if named is not None:
    return named or None
  home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(home, "haiku_bridge")


def without_addresses(text: str) -> str:
  """`text` without the addresses a repr names (" at 0x7f..."), which differ from process to process: for an `OnDisk` key.

  >>> from haiku_bridge._src import caches
  >>> caches.without_addresses("<function f at 0x7f00ab12>")
  '<function f>'
  """
  return re.sub(r" at 0x[0-9a-f]+", "", text)


def source_digest(modules: Sequence[types.ModuleType]) -> str:
  """A digest of `modules`' files as they are: what an `OnDisk` key holds of the code that made its value."""
  code = hashlib.sha256()
  for module in modules:
    with open(str(module.__file__), "rb") as f:
      code.update(f.read())
  return code.hexdigest()


class OnDisk:
  """JSON values under `directory()/name`, one file per key (a hex digest).

  Nothing it does can fail a call: a file that cannot be read or written is
  a miss. Writes are atomic (a file is renamed into place), so processes
  may share the directory.
  """

  def __init__(self, name: str):
    self.name = name
    register(self.clear)

  def _path(self, key: Optional[str]) -> Optional[str]:
    root = directory()
    if root is None or key is None:
      return None
    return os.path.join(root, self.name, key + ".json")

  def get(self, key: Optional[str]) -> Any:
    """The value kept under `key`; None if none (or unreadable)."""
    path = self._path(key)
    if path is None:
      return None
    try:
      with open(path) as f:
        return json.load(f)
    except (OSError, ValueError):
      return None

  def put(self, key: Optional[str], value: Any) -> None:
    """Keeps `value` (JSON) under `key`, if the directory can be written."""
    path = self._path(key)
    if path is None:
      return
    try:
      text = json.dumps(value)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with tempfile.NamedTemporaryFile(
        "w", dir=os.path.dirname(path), suffix=".tmp", delete=False
      ) as f:
        f.write(text)
      os.replace(f.name, path)
    except (OSError, TypeError, ValueError):  # Unwritable, or not JSON.
      pass

  def clear(self) -> None:
    root = directory()
    if root is not None:
      shutil.rmtree(os.path.join(root, self.name), ignore_errors=True)


def clear_caches() -> None:
  """Empties every cache of haiku_bridge, the files of `remat="auto"`'s plans too.

  Only ever needed to measure a cold start or to free memory: a cache never
  changes a result. The plans' files are under `$HAIKU_BRIDGE_CACHE_DIR`
  (default `~/.cache/haiku_bridge`; README, "Choosing remat for one loop").

  >>> hkb.clear_caches()
  """
  for clear in _CLEARERS:
    clear()


# `pytree` cannot import this module: its one memo, the key shape of a PRNG
# implementation (a constant of jax's, keyed on the implementation's name), is
# registered here, and stays on when caches are off.
register(pytree.key_spec_of.cache_clear)
