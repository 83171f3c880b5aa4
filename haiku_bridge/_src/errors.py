"""Error messages that name the public call they come from.

Each public entry point says once who it is (`with errors.entry("layer_scan")`);
every message raised below it starts with that name, `hkb.layer_scan: ...`,
however deep the check that raises it.
"""

import contextlib
import contextvars
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

_API = contextvars.ContextVar("haiku_bridge_api", default="call_pure")


@contextlib.contextmanager
def entry(api: str) -> Iterator[None]:
  """Names the public call that the code inside runs for."""
  token = _API.set(api)
  try:
    yield
  finally:
    _API.reset(token)


def api() -> str:
  return _API.get()


def message(text: str) -> str:
  """`text`, prefixed with the public call: `hkb.call_pure: text`."""
  return f"hkb.{_API.get()}: {text}"


def type_str(x: Any) -> str:
  """`float32[4, 3]`, for an array or a `jax.ShapeDtypeStruct`."""
  return f"{jnp.dtype(x.dtype).name}{list(np.shape(x))}"


def keystr(path: tuple[Any, ...]) -> str:
  """A pytree key path as users write it, `['w'][0]`; `<root>` for none."""
  return jax.tree_util.keystr(path) or "<root>"


def describe(x: Any) -> str:
  """`a tuple of length 3`, `an array float32[2, 4]`, `a dict`: for messages."""
  if isinstance(x, (tuple, list)):
    return f"a {type(x).__name__} of length {len(x)}"
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"an array {type_str(x)}"
  return f"a {type(x).__name__}"


def looks_like_a_shard(shape: tuple[int, ...], full: tuple[int, ...]) -> bool:
  """Whether `shape` could be one device's block of an array of `full` shape."""
  return (len(shape) == len(full) and shape != full and
          all(s and f % s == 0 for s, f in zip(shape, full)))


SHARD_HINT = (" If apply runs inside jax.shard_map, it sees per-device shards "
              "of the params: put the shard_map inside the pure function "
              "instead, or use jax.jit with shardings.")
