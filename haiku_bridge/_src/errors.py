"""Error messages that name the public call they come from: the one error path.

Each public entry point says once who it is (`with errors.entry("layer_scan")`);
every message raised below it starts with that name, `hkb.layer_scan: ...`,
however deep the check that raises it. Arguments are checked on entry with the
`check_*` functions below, which all say the same three things: the
argument's name, what it got, what to pass:

    hkb.stacked_init: `in_axes` must be a sequence with one entry per
    positional argument of `init` (an int axis, or None); got an int 0.
"""

import contextlib
import contextvars
import difflib
from typing import Any, Iterable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

_API: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
  "haiku_bridge_api", default=None
)


@contextlib.contextmanager
def entry(api: str, *, outer_wins: bool = False) -> Iterator[None]:
  """Names the public call that the code inside runs for.

  The innermost entry names messages, unless `outer_wins`: then an entry
  already open keeps its name (for public names that other public functions
  also call, such as `ShardingRules` from `param_shardings`).

  Args:
    api: the public name, as after `hkb.`.
    outer_wins: keep the name of an entry already open.

  Yields:
    Nothing.
  """
  if outer_wins and _API.get() is not None:
    yield
    return
  token = _API.set(api)
  try:
    yield
  finally:
    _API.reset(token)


def current() -> Optional[str]:
  """The public call the code runs for now, if any."""
  return _API.get()


def message(text: str) -> str:
  """`text`, prefixed with the public call: `hkb.call_pure: text`.

  The call is the innermost `entry` open: every public entry point opens one,
  and so does code that runs after its call returned (a custom rule's
  backward pass, a method of a module an adapter made). No site writes its
  own prefix. Outside any entry (a bug: no public call to name) it names
  none, `hkb: text`, rather than guess one.
  """
  api = _API.get()
  return f"hkb.{api}: {text}" if api is not None else f"hkb: {text}"


def named(error: Exception, text: str) -> Exception:
  """`error` said again as `message(text)`, of its own type where it can be.

  For an exception the user's code raised inside a bridged call: the same
  type (an `except` around the call still catches it), a message naming the
  call. An error the bridge already named is returned as it is.
  """
  if str(error).startswith("hkb."):
    return error
  try:
    return type(error)(message(text))
  except Exception:  # pylint: disable=broad-except
    error.add_note(message(text))
    return error


class UnsupportedHaikuError(ImportError):
  """The installed dm-haiku moved a Haiku internal that haiku_bridge reads.

  Raised by `import haiku_bridge` (haiku_internals.py checks every private Haiku name, frame
  field and layer-stack name it reads), naming what moved and the dm-haiku releases that work,
  rather than running Haiku code differently from inline. An `ImportError`, so code that treats
  haiku_bridge as optional catches it as such.

  >>> issubclass(hkb.UnsupportedHaikuError, ImportError)
  True
  """


def unsupported_haiku(
  version: str, supported: str, changed: Iterable[str]
) -> UnsupportedHaikuError:
  """The error of importing haiku_bridge with a dm-haiku whose internals moved."""
  return UnsupportedHaikuError(
    f"haiku_bridge cannot run on dm-haiku {version}: this release changed Haiku internals "
    f"that haiku_bridge reads ({'; '.join(changed)}), so the bridge could not run Haiku code "
    f"exactly as inline. haiku_bridge supports dm-haiku {supported}: install one of those "
    f"(pip install \"dm-haiku<={supported.split()[-1]}\"), or a haiku_bridge release that "
    "supports this dm-haiku."
  )


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


def _a(noun: str) -> str:
  # A "u" that reads "you" takes "a": a uint8, a UserDict; "un-" takes "an".
  start = noun[:3].lower()
  vowel = start[:1] in ("a", "e", "i", "o") or (start[:2] == "un" and start != "uni")
  return f"{'an' if vowel else 'a'} {noun}"


def got(x: Any) -> str:
  """What an argument holds, for messages: `None`, `an int 3`, `a Mesh`."""
  if x is None or isinstance(x, (bool, np.bool_)):
    return repr(x)
  if isinstance(x, (int, float, str, np.integer, np.floating)):
    text = repr(x) if isinstance(x, str) else str(x)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{_a(type(x).__name__)} {text}"
  if isinstance(x, (tuple, list)) or hasattr(x, "shape"):
    return describe(x)
  return _a(type(x).__name__)


def bad_argument(name: str, value: Any, wants: str, hint: str = "") -> str:
  """`hkb.<api>: `name` must be <wants>; got <value>.<hint>`."""
  return message(f"`{name}` must be {wants}; got {got(value)}." + (f" {hint}" if hint else ""))


def check_callable(name: str, value: Any, wants: str, hint: str = "") -> None:
  """A TypeError unless `value` is callable; `wants` says what to pass."""
  if not callable(value):
    raise TypeError(bad_argument(name, value, wants, hint))


def check_str(name: str, value: Any, wants: str, *, optional: bool = False, hint: str = "") -> None:
  """A TypeError unless `value` is a non-empty string (or None, if optional)."""
  if optional and value is None:
    return
  if not isinstance(value, str) or not value:
    raise TypeError(bad_argument(name, value, wants, hint))


def check_keywords(given: Iterable[str], accepted: Sequence[str]) -> None:
  """A TypeError for the first keyword in `given` not in `accepted`.

  Python's own message names no call and lists nothing; ours names the
  nearest accepted name, if one is close, and lists them all:
  `hkb.scan: got an unexpected keyword argument 'remat_group' (did you mean
  'remat_groups'?); its arguments are f, init, ...`.
  """
  unknown = sorted(set(given) - set(accepted))
  if unknown:
    near = difflib.get_close_matches(unknown[0], accepted, n=1)
    raise TypeError(
      message(
        f"got an unexpected keyword argument {unknown[0]!r}"
        + (f" (did you mean {near[0]!r}?)" if near else "")
        + f"; its arguments are {', '.join(accepted)}."
      )
    )


def is_int(x: Any) -> bool:
  """An int or NumPy integer, never a bool."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_bool(name: str, value: Any) -> bool:
  """`value` as a bool (NumPy's too); a TypeError for anything else."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(bad_argument(name, value, "a bool"))
  return bool(value)


def check_positive_int(name: str, value: Any) -> int:
  """`value` as an int; a TypeError for a non-int, a ValueError below 1."""
  if not is_int(value):
    raise TypeError(bad_argument(name, value, "a positive int"))
  if value <= 0:
    raise ValueError(bad_argument(name, value, "a positive int"))
  return int(value)


def check_int_sequence(name: str, value: Any, wants: str) -> tuple[int, ...]:
  """`value` as a tuple of non-negative ints; a TypeError or ValueError else."""
  if (
    isinstance(value, (str, bytes))
    or not isinstance(value, Iterable)
    or not all(is_int(i) for i in value)
  ):
    raise TypeError(bad_argument(name, value, wants))
  value = tuple(int(i) for i in value)
  if any(i < 0 for i in value):
    raise ValueError(bad_argument(name, value, wants))
  return value


def looks_like_a_shard(shape: tuple[int, ...], full: tuple[int, ...]) -> bool:
  """Whether `shape` could be one device's block of an array of `full` shape."""
  return (
    len(shape) == len(full) and shape != full and all(s and f % s == 0 for s, f in zip(shape, full))
  )


SHARD_HINT = (
  " If apply runs inside jax.shard_map, it sees per-device shards "
  "of the params: put the shard_map inside the pure function "
  "instead, or use jax.jit with shardings."
)
