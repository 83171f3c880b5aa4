"""Function fingerprints: a hashable key for a function and what it reads.

The bridge's caches (caches.py) keep what tracing a function told them, keyed
on `function_key(fn, *args)`: `fingerprint(fn)`, the function's code,
closure, defaults and the globals it reads (following the functions it
reaches), and `signature(*args)`, the exact signature of its arguments (full
shapes, dtypes, weak types, and the values of non-array arguments). Equal
keys, equal behaviour; where a key cannot be made, it is None and nothing is
cached.

>>> from haiku_bridge._src import fingerprint
>>> make = lambda width: (lambda x: x * width)
>>> fingerprint.fingerprint(make(2)) == fingerprint.fingerprint(make(2))
True
>>> fingerprint.fingerprint(make(2)) == fingerprint.fingerprint(make(3))
False
"""

import dataclasses
import functools
import os
import reprlib
import sys
import sysconfig
import types
from typing import Any, Hashable, Optional

import jax
import numpy as np

from haiku_bridge._src import caches
from haiku_bridge._src import pytree


def _leaf_signature(leaf: Any) -> Hashable:
  if pytree.is_python_value(leaf):
    return ("value", type(leaf), leaf)  # A size or a flag.
  if isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
    dtype = (
      str(leaf.dtype)
      if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended)
      else np.dtype(leaf.dtype).str
    )
    return ("array", tuple(leaf.shape), dtype, bool(getattr(leaf, "weak_type", False)))
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
  """`(fingerprint(fn), signature(*trees))`, or None if either cannot be made."""
  sig = signature(*trees)
  if sig is None:
    return None
  try:
    key = (fingerprint(fn), sig)
  except _Unkeyable:
    return None
  return key if caches.hashable(key) else None


class _Unkeyable(Exception):
  """A value a key cannot be made of (mutable, unhashable, too large)."""


# How deep `fingerprint` follows functions called by functions.
_DEPTH = 4
# Arrays up to this many elements are keyed by value.
_MAX_ARRAY_SIZE = 1024


def fingerprint(fn: Any) -> Hashable:
  """A hashable stand-in for `fn` and everything it reads when called.

  Equal fingerprints, equal behaviour: a function's code, the contents of
  its closure cells, its defaults and the current values of the globals its
  code names (and, for a module of yours, `config.WIDTH`, of the attributes
  it names), following functions it reaches that way (and
  `functools.partial`s, bound methods, dataclasses, and your classes: their
  own methods and class values) four levels deep. So a lambda or partial
  made afresh at each call, with the same code and values, has the same
  fingerprint. Code and classes of Python and of installed packages are
  keyed by identity: they do not change while the process runs.
  A value that is not hashable by value (a list, a dict, a set) is keyed
  by its contents; one that cannot be keyed at all makes `function_key`
  give None.
  Beyond four levels, and for objects that hash by identity, a value is
  keyed by identity: code that changes what such an object holds between
  calls (an attribute of a config object read by a helper of a helper) needs
  `hkb.clear_caches()`, as `jax.jit`'s cache does.
  """
  return _freeze(fn, _DEPTH)


def _freeze(x: Any, depth: int) -> Hashable:
  if x is None or isinstance(
    x, (bool, int, float, complex, str, bytes, np.generic, types.ModuleType)
  ):
    return (type(x), x) if not isinstance(x, types.ModuleType) else x
  if isinstance(x, (tuple, list)):
    return (type(x), tuple(_freeze(v, depth) for v in x))
  if isinstance(x, (set, frozenset)):
    # By contents, in no order (a set of names iterates in an order each
    # process draws): a frozenset of its elements' keys.
    return (type(x), frozenset(_freeze(v, depth) for v in x))
  if isinstance(x, dict):
    try:
      items = sorted(x.items(), key=lambda kv: repr(kv[0]))
    except TypeError:
      raise _Unkeyable from None
    return (dict, tuple((_freeze(k, depth), _freeze(v, depth)) for k, v in items))
  if isinstance(x, (np.ndarray, jax.Array)):
    if isinstance(x, jax.core.Tracer) or x.size > _MAX_ARRAY_SIZE:
      raise _Unkeyable
    return (_leaf_signature(x), np.asarray(x).tobytes())
  if depth <= 0:
    return _by_identity(x)
  if isinstance(x, types.FunctionType):
    return _freeze_function(x, depth - 1)
  if isinstance(x, functools.partial):
    return (
      functools.partial,
      _freeze(x.func, depth - 1),
      _freeze(x.args, depth - 1),
      _freeze(x.keywords, depth - 1),
    )
  if isinstance(x, types.MethodType):
    return (types.MethodType, _freeze(x.__func__, depth - 1), _freeze(x.__self__, depth - 1))
  if isinstance(x, type):
    return _freeze_class(x, depth - 1)
  if dataclasses.is_dataclass(x):
    return (
      _freeze_class(type(x), depth - 1),
      tuple(_freeze(getattr(x, field.name), depth - 1) for field in dataclasses.fields(x)),
    )
  return _by_identity(x)


def _freeze_class(cls: type, depth: int) -> Hashable:
  """A class and what its own code reads (its methods, its class values).

  A class of an installed package or of Python itself is keyed by identity:
  its code does not change while the process runs. Any other class (yours)
  is keyed by the functions and values defined in it and in its own bases
  (not Python's or a library's), as a function is: a model class whose
  `__init__` reads a global config is keyed by that config.
  """
  if depth < 0 or _installed(cls.__module__):
    return cls
  members = []
  for klass in cls.__mro__:
    if _installed(klass.__module__):
      continue
    for name, value in vars(klass).items():
      if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
      elif isinstance(value, property):
        value = (value.fget, value.fset, value.fdel)
      if (
        name.startswith("__") and name.endswith("__") and not isinstance(value, types.FunctionType)
      ):
        continue  # Python's own entries: the class keys them.
      if _made_by_dataclasses(value):
        continue  # A dataclass's `__repr__`: its fields key it.
      members.append((klass.__qualname__, name, value))
  return (cls, _freeze(tuple(members), depth))


# Where `@dataclass` writes the code of the methods it wraps (`__repr__`,
# whose closure holds a set, unkeyable: every dataclass was).
_DATACLASS_FILES = frozenset(m.__file__ for m in (dataclasses, reprlib))


def _made_by_dataclasses(value: Any) -> bool:
  code = getattr(value, "__code__", None)
  return code is not None and code.co_filename in _DATACLASS_FILES


_INSTALL_ROOTS = tuple(
  sorted(
    {
      os.path.realpath(path)
      for name, path in sysconfig.get_paths().items()
      if name in ("stdlib", "platstdlib", "purelib", "platlib")
    }
  )
)


@caches.memoize(maxsize=None)
def _installed(module_name: str) -> bool:
  """Whether a module is Python's or an installed package's (fixed code)."""
  if module_name in sys.builtin_module_names:
    return True
  path = getattr(sys.modules.get(module_name), "__file__", None)
  if path is None:
    return False  # `__main__` of a notebook, a class made on the fly.
  path = os.path.realpath(path)
  return any(path.startswith(root + os.sep) for root in _INSTALL_ROOTS)


def _by_identity(x: Any) -> Hashable:
  try:
    hash(x)
  except TypeError:
    raise _Unkeyable from None
  return x


def _freeze_function(fn: types.FunctionType, depth: int) -> Hashable:
  cells = []
  for cell in fn.__closure__ or ():
    try:
      cells.append(cell.cell_contents)
    except ValueError:  # An empty cell: a name not bound yet.
      cells.append(_EMPTY_CELL)
  names = _global_names(fn.__code__)
  values = []
  for name in names:
    value = fn.__globals__.get(name, _UNBOUND)
    if isinstance(value, types.ModuleType) and not _installed(value.__name__):
      # Your module (`config.WIDTH`): the attributes the code names.
      attributes = vars(value)
      value = (value, tuple((a, attributes[a]) for a in names if a in attributes))
    values.append(value)
  global_values = tuple(values)
  return (
    fn.__code__,
    _freeze(tuple(cells), depth),
    _freeze(fn.__defaults__, depth),
    _freeze(fn.__kwdefaults__, depth),
    _freeze(global_values, depth),
  )


_EMPTY_CELL = object()
_UNBOUND = object()


@caches.memoize(maxsize=4096)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
  """Names that `code` (and the code nested in it) may read as globals."""
  names = list(code.co_names)
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      names.extend(_global_names(const))
  return tuple(dict.fromkeys(names))
