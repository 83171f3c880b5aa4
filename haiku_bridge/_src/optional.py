"""The adapters for optional libraries, imported on first use.

`import haiku_bridge` must work without Flax or Equinox installed, so
`hkb.from_flax` and its siblings are looked up lazily, through the package's
module `__getattr__`. Without the library, the name is a function that raises
an ImportError naming the extra to install.
"""

import importlib
from typing import Any, Callable

from haiku_bridge._src import errors

# Public name -> (module that defines it, pip extra that installs its library).
ADAPTERS = {
  "from_flax": ("haiku_bridge._src.flax_bridge", "flax"),
  "to_nnx": ("haiku_bridge._src.flax_bridge", "flax"),
  "from_equinox": ("haiku_bridge._src.equinox_bridge", "equinox"),
  "to_equinox": ("haiku_bridge._src.equinox_bridge", "equinox"),
}


_LOADED: dict[str, Any] = {}


def module_getattr(name: str) -> Any:
  """`haiku_bridge.__getattr__`: imports an adapter the first time it is used."""
  if name not in ADAPTERS:
    raise AttributeError(f"module 'haiku_bridge' has no attribute {name!r}")
  if name not in _LOADED:
    module, extra = ADAPTERS[name]
    try:
      _LOADED[name] = getattr(importlib.import_module(module), name)
    except ImportError as e:
      _LOADED[name] = _needs_extra(name, extra, e)
  return _LOADED[name]


def _needs_extra(name: str, extra: str, error: ImportError) -> Callable[..., Any]:
  def missing(*args, **kwargs):
    del args, kwargs  # Unused.
    with errors.entry(name):
      raise ImportError(
        errors.message(
          f"needs the optional dependency {extra!r}, which could not "
          f"be imported ({error}). Install it with: pip install {extra} (or, "
          f"from a checkout of haiku_bridge, pip install \".[{extra}]\")"
        )
      ) from error

  missing.__name__ = name
  return missing
