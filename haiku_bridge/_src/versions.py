"""The jax and dm-haiku releases haiku_bridge is tested with, and a warning past them.

`pyproject.toml` sets lower bounds only (the oldest tested releases: a newer jax installs beside
haiku_bridge), and importing haiku_bridge warns once (`UntestedVersionWarning`) if the installed
jax or dm-haiku is newer than the tested set: it should work, but nobody ran the tests there. What would not work is caught
on import as well: `haiku_internals.py` checks that the private Haiku names it reads are still
there, and raises `errors.unsupported_haiku` if they are not. `testing/versions_test.py` checks
these ranges against the pairs of `testing/version_matrix.sh`.

>>> from haiku_bridge._src import versions
>>> versions.release("0.10.2"), versions.release("0.11.0.dev20260101")
((0, 10, 2), (0, 11, 0))
>>> versions.untested({"jax": "0.10.3", "dm-haiku": "0.0.17"})
['jax 0.10.3']
"""

import re
import warnings
from typing import Mapping, Optional

import haiku as hk
import jax

# (oldest, newest) tested release of each: the range the pairs of testing/version_matrix.sh span.
TESTED = {"jax": ("0.6.0", "0.10.2"), "dm-haiku": ("0.0.14", "0.0.17")}


class UntestedVersionWarning(UserWarning):
  """The installed jax or dm-haiku is newer than haiku_bridge was tested with.

  Issued once, when haiku_bridge is imported: the release should work, but the tests have not
  run on it. It is said at the line that first imports haiku_bridge (yours, or that of the
  package that imports it), not inside haiku_bridge. As it comes from the import itself, a filter
  set up before the import matches it by its message, which starts with "haiku_bridge is tested
  with", e.g. `warnings.filterwarnings("ignore", message="haiku_bridge is tested with")`; after
  the import, warnings recorded around it can be told apart by this class.

  >>> issubclass(hkb.UntestedVersionWarning, UserWarning)
  True
  """


def release(version: str) -> tuple[int, ...]:
  """The numeric release of a version string: `0.11.0.dev2026` -> (0, 11, 0)."""
  match = re.match(r"\d+(?:\.\d+)*", version)
  return tuple(int(part) for part in match[0].split(".")) if match else ()


def installed() -> dict[str, str]:
  """The versions of jax and dm-haiku this process runs."""
  return {"jax": jax.__version__, "dm-haiku": hk.__version__}


def untested(versions: Mapping[str, str]) -> list[str]:
  """`"jax 0.10.3"` for each of `versions` newer than the newest tested release."""
  return [
    f"{name} {version}"
    for name, version in versions.items()
    if release(version) > release(TESTED[name][1])
  ]


def tested_range() -> str:
  """`jax 0.6.0 to 0.10.2 and dm-haiku 0.0.14 to 0.0.17`."""
  return " and ".join(f"{name} {low} to {high}" for name, (low, high) in TESTED.items())


def warn_if_untested(versions: Optional[Mapping[str, str]] = None, *, stacklevel: int = 1) -> None:
  """Warns (`UntestedVersionWarning`) if jax or dm-haiku is newer than the tested set.

  Said where the caller says (`stacklevel`, as `warnings.warn` counts it from the caller: 1 the
  caller, 2 the code that called it); haiku_bridge's `__init__` passes 2, the user's import.
  """
  newer = untested(installed() if versions is None else versions)
  if newer:
    warnings.warn(
      f"haiku_bridge is tested with {tested_range()}; this is {' and '.join(newer)}, which "
      "should work but is untested. If something fails, install a tested release (e.g. "
      f"pip install \"jax<={TESTED['jax'][1]}\" \"dm-haiku<={TESTED['dm-haiku'][1]}\") and "
      "report it.",
      UntestedVersionWarning,
      stacklevel=stacklevel + 1,
    )
