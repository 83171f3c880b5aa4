"""Where a plan's measurements are kept: in memory and on disk, under keys of everything they depend on.

`coefficients` is `measure.coefficients` kept, and `compiled` the figures
of the plans a budget compiles (its line's second point, its choice's
checks), each read back where it was kept: in this process
(`caches.Cache`) and across processes, as small JSON files under
`caches.directory()` (`caches.OnDisk`; `hkb.clear_caches()` deletes both).
A file that cannot be read, or holds anything but the numbers it should,
is a miss: measured again.

The keys hold everything the figures depend on: the step's jaxpr (its
text: every shape, dtype and operation), which of the arrays it closes over
are compiled in, the policy, T, the loop's unroll and its copies of its
inputs and outputs, the vmaps and derivatives around it and which of its
inputs a gradient is taken of (`tracing.py`), the mesh it is planned under,
the backend and device, the jax, jaxlib and haiku_bridge versions, a digest
of the code that measures them (`_MEASURING_CODE`), XLA's flags and the
measuring compiles' options. The choice follows from the figures and the
budget (`choice.py`), so it is the same for the same shapes, policy and
budget, in any process; it is not kept.
"""

import hashlib
import os
import sys
from typing import Any, Callable, Optional, Sequence

import jax
import jaxlib
import numpy as np

from haiku_bridge._src import caches
from haiku_bridge._src import hlo_text
from haiku_bridge._src.remat import hlo_flops
from haiku_bridge._src.remat import measure
from haiku_bridge._src.remat import schedule as remat_schedule
from haiku_bridge._src.remat import scheduled_scan
from haiku_bridge._src.remat import tracing

_COEFFICIENTS = caches.Cache("remat_plan.coefficients")
# Across processes: the coefficients and the plans compiled, as JSON, under
# caches.directory() (`hkb.clear_caches()` deletes them).
_ON_DISK = caches.OnDisk("remat_plans")
# The figures of a plan compiled for a budget (its choice's check, its line's
# second point), by the coefficients' key and the plan's.
_COMPILED = caches.Cache("remat_plan.compiled")
# Bumped when what a file holds changes meaning.
_FORMAT = 3


def coefficients(
  step: tracing.Traced,
  consts: tuple[Any, ...],
  length: int,
  policy: Optional[Callable[..., bool]] = None,
  then: Optional[Callable[[measure.Measured], None]] = None,
) -> measure.Coefficients:
  """`measure.coefficients`: the model's coefficients for `step` over `length` steps, kept in this process and on disk.

  Where they are measured, `then` is called with one slot's figures as
  soon as they are in, while the others compile (`choice.py` compiles the
  budget's second schedule there).
  """
  memo = _memo_key(step, consts, length, policy)
  found = _COEFFICIENTS.get(memo)
  if found is not None:
    return found
  disk = _disk_key(step, consts, length, policy)
  found = _from_json(_ON_DISK.get(disk))
  if found is None:
    found = measure.coefficients(step, consts, length, policy, then)
    _ON_DISK.put(disk, _to_json(found))
  _COEFFICIENTS.put(memo, found)
  return found


def compiled(
  step: tracing.Traced,
  consts,
  length: int,
  plans: Sequence[measure.Key],
  policy,
  here: dict[measure.Key, measure.Figures],
) -> list[measure.Figures]:
  """The figures of each of `plans`, compiled at `length` steps (the loop's gradient, as it is measured): kept, or compiled and kept (`measure.compile_plans`).

  For one budget (its choice's checks, its line's second point): what one
  budget's compiles found replaces only that plan's prediction, and is
  kept, in memory and on disk, as a measurement is, by the coefficients'
  key and the plan's; and in `here`, the plans one call of `plan` compiled,
  with caches on or off.
  """
  memo = _memo_key(step, consts, length, policy)
  disk = _disk_key(step, consts, length, policy)

  def on_disk(plan: measure.Key) -> Optional[str]:
    return None if disk is None else hashlib.sha256(repr((disk, plan)).encode()).hexdigest()

  def kept(plan: measure.Key) -> Optional[measure.Figures]:
    got = here.get(plan) or _COMPILED.get((memo, plan))
    if got is None:
      try:
        got = measure.Figures(**(_ON_DISK.get(on_disk(plan)) or {}))
      except TypeError:  # Nothing there, or something else.
        got = None
      if got is not None and not all(type(v) is int for v in got):  # pylint: disable=unidiomatic-typecheck
        got = None  # A file of the right shape, not of numbers.
    return got

  found: dict[measure.Key, measure.Figures] = {}
  for plan in plans:
    got = kept(plan)
    if got is not None:
      found[plan] = got
  missing = [plan for plan in plans if plan not in found]
  for plan, got in zip(missing, measure.compile_plans(step, consts, length, missing, policy)):
    found[plan] = got
    _ON_DISK.put(on_disk(plan), got._asdict())
  for plan in plans:
    _COMPILED.put((memo, plan), found[plan])
    here[plan] = found[plan]
  return [found[plan] for plan in plans]


def _memo_key(step: tracing.Traced, consts, length: int, policy) -> measure.Key:
  return (
    step.text,
    consts,
    _compiled_in(step),
    step.carry,
    step.x,
    policy,
    length,
    *_surroundings(step),
  )


def _surroundings(step: tracing.Traced) -> tuple[Any, ...]:
  """The parts of both keys that say how the loop runs and what surrounds it, in one place."""
  return (
    step.unroll,
    step.batch_major,
    step.vmaps,
    step.wrt,
    step.derivatives,
    tracing.mesh_context(),
    jax.default_backend(),
  )


def _compiled_in(step: tracing.Traced) -> tuple[bool, ...]:
  """Of each const, whether the programs compile it in (`tracing.Traced.known`): a key's part, where the value is not."""
  return tuple(v is not None for v in step.known)


# What the figures depend on besides the step: the code that measures them,
# and this module's (its keys, what its files hold). The choice
# (`choice.py`) makes none of them: its code is not in their keys.
_MEASURING_CODE = (
  remat_schedule,
  scheduled_scan,
  hlo_flops,
  hlo_text,
  tracing,
  measure,
  sys.modules[__name__],
)


def _disk_key(step: tracing.Traced, consts, length: int, policy) -> Optional[str]:
  """The coefficients' key across processes; None where a policy has no stable name.

  Everything the figures depend on: the step's jaxpr (every shape, dtype
  and operation; function addresses left out), what it takes (and which
  of the arrays it closes over are compiled in as constants), the policy,
  the length, the unroll, the vmaps around the loop, which of its inputs
  a gradient is taken of, the mesh it is planned under, the backend and device,
  the jax, jaxlib and haiku_bridge versions and the measuring code, XLA's
  flags, the compile options.
  """
  name = _stable_name(policy)
  if name is None:
    return None
  device = jax.devices()[0]
  jaxpr = caches.without_addresses(step.text)
  text = repr(
    (
      _FORMAT,
      jaxpr,
      [(c.shape, str(c.dtype)) for c in consts],
      _compiled_in(step),
      [(c.shape, str(c.dtype)) for c in step.carry + step.x],
      name,
      length,
      *_surroundings(step),
      device.device_kind,
      getattr(device.client, "platform_version", ""),
      jax.__version__,
      jaxlib.__version__,
      _version(),
      _code_digest(),
      os.environ.get("XLA_FLAGS", ""),
      sorted(measure.measuring_options().items()),
      str(jax.dtypes.canonicalize_dtype(np.int64)),
    )
  )  # x64 or not.
  return hashlib.sha256(text.encode()).hexdigest()


@caches.memoize(maxsize=1)
def _code_digest() -> str:
  """A digest of the source of `_MEASURING_CODE`, each module's file as it is."""
  return caches.source_digest(_MEASURING_CODE)


def _stable_name(policy) -> Optional[str]:
  """A policy's name that means the same in every process; None if it has none.

  jax's named policies, and policy objects whose repr shows their fields
  (`DotsSaveable(only_if_no_batch_dims=False)`, jax 0.10's
  `save_only_these_names`); not a closure (that policy's before) or a
  function of the user's, whose name does not say what it does.
  """
  if policy is None:
    return ""
  name = getattr(policy, "__name__", None)
  if name is not None:
    return name if getattr(jax.checkpoint_policies, name, None) is policy else None
  text = measure.policy_name(policy)
  if type(policy).__repr__ is object.__repr__ or " at 0x" in text:
    return None
  return text


def _version() -> str:
  # The package's version, without importing the package from inside it.
  return getattr(sys.modules.get("haiku_bridge"), "__version__", "")


def _to_json(c: measure.Coefficients) -> dict[str, Any]:
  return {"format": _FORMAT, **c._asdict(), "measured": [[list(k), v] for k, v in c.measured]}


def _from_json(value: Optional[dict[str, Any]]) -> Optional[measure.Coefficients]:
  """The coefficients a file held; None if it holds anything else."""
  if not value or value.get("format") != _FORMAT:
    return None
  try:
    value = {k: v for k, v in value.items() if k != "format"}
    tuples = ("scheduled", "constants", "policy")
    found = measure.Coefficients(
      **{
        **value,
        **{k: None if value[k] is None else tuple(value[k]) for k in tuples},
        "measured": tuple((tuple(k), v) for k, v in value["measured"]),
      }
    )
  except (KeyError, TypeError, ValueError):
    return None
  return found if _well_typed(found) else None


def _well_typed(c: measure.Coefficients) -> bool:
  """Whether every figure of `c` is a number where one is (a file's strings are not)."""

  def numbers(*values, whole=False):
    return all(
      isinstance(v, int if whole else (int, float)) and not isinstance(v, bool) for v in values
    )

  return (
    numbers(c.length, c.plain, whole=True)
    and (c.per_step is None or numbers(c.per_step, whole=True))
    and (c.scheduled is None or (len(c.scheduled) == 2 and numbers(*c.scheduled)))
    and len(c.constants) == 2
    and numbers(*c.constants)
    and numbers(c.step_flops, c.advance_flops)
    and (
      c.policy is None
      or (
        len(c.policy) == 3
        and isinstance(c.policy[0], str)
        and numbers(c.policy[1], whole=True)
        and numbers(c.policy[2])
      )
    )
    and all(numbers(v, whole=True) for _, v in c.measured)
  )
