"""Explicit leaves stored as Haiku parameters and state.

A `Leaf` says where one leaf of an explicit pytree lives in the transform: a
Haiku bundle (module name) and a name, plus its path in the user's terms for
messages. `PARAMS` and `STATE` store leaves: they claim the names (two leaves
or two bridged calls never share one silently), create them at init, read and
check them at apply, and (state) write new values back. All reads and writes
go through `hk.get_parameter` / `hk.get_state` / `hk.set_state`, so custom
creators, getters and setters see each leaf once, where inline code would meet
it, with and without interceptors alike.
"""

import collections
import contextlib
import functools
from typing import Any, NamedTuple, Optional, Sequence

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import errors
from haiku_bridge._src import haiku_internals


class Leaf(NamedTuple):
  """One explicit leaf: its path for messages, and its Haiku bundle and name."""

  path: str
  bundle: str
  name: str

  @property
  def full_name(self) -> str:
    return f"{self.bundle}/{self.name}"


def in_bundle(bundle: str) -> contextlib.AbstractContextManager[None]:
  """Makes `bundle` the current module name (it is already allocated)."""
  if bundle == hk.experimental.current_name():
    return contextlib.nullcontext()
  return hk.name_scope(hk.force_name(bundle))


def by_bundle(leaves: Sequence[Leaf]) -> dict[str, list[int]]:
  """Leaf indices grouped by bundle, bundles in order of first appearance."""
  groups = collections.defaultdict(list)
  for i, leaf in enumerate(leaves):
    groups[leaf.bundle].append(i)
  return groups


def canonical(value: Any) -> jax.Array:
  """`value` as the bridge stores it: a JAX array of JAX's dtype for it.

  (`jnp.asarray`: without x64 a float64 NumPy array becomes float32, as any
  JAX operation on it would make it. Haiku itself keeps what an initializer
  returns as it is, a NumPy array included.)
  """
  return jnp.asarray(value)


def _constant(value, shape, dtype):
  del shape  # hk.get_parameter checks it against the value itself.
  # A custom creator may ask for another dtype (e.g. bfloat16 params).
  return value if jnp.dtype(dtype) == value.dtype else value.astype(dtype)


class _Collection:
  """What params and state share: names, claims and apply-time checks."""

  kind = ""

  def claim(self, leaves: Sequence[Leaf]) -> None:
    """Claims each leaf's name for this module call, or raises."""
    seen: dict[str, str] = {}
    for leaf in leaves:
      if leaf.full_name in seen:
        raise ValueError(
          errors.message(
            f"params paths {seen[leaf.full_name]} and {leaf.path} both map to "
            f"the Haiku {self.kind} {leaf.full_name!r}. Rename one of them."
          )
        )
      seen[leaf.full_name] = leaf.path
    for leaf in leaves:
      if not haiku_internals.claim_name(f"{self.kind}:{leaf.full_name}"):
        raise ValueError(
          errors.message(
            f"{self.kind} {leaf.full_name!r} (params path {leaf.path}) is "
            "already used by another bridged call in this module call. Give "
            "each call its own weights with a distinct `name=`; to share "
            "weights, call hkb.get_relevant_parameters once and pass the "
            "params to each pure call."
          )
        )

  def _stored(self, leaf: Leaf) -> Optional[Any]:
    raise NotImplementedError

  def checked_stored(
    self, leaves: Sequence[Leaf], shapes: Optional[Sequence[Any]] = None
  ) -> list[Any]:
    """The stored values at apply, each present and of the expected shape."""
    values = []
    for i, leaf in enumerate(leaves):
      value = self._stored(leaf)
      if value is None:
        raise ValueError(
          errors.message(
            f"{self.kind} {leaf.full_name!r} (params path {leaf.path}) is "
            f"missing at apply. It is created by init: pass apply the "
            f"{self.kind}s that init returned for the same code path (a "
            "model saved before this call was added needs re-initialising "
            "or converting)."
          )
        )
      if shapes is not None and tuple(np.shape(value)) != tuple(shapes[i]):
        shape, want = tuple(np.shape(value)), tuple(shapes[i])
        raise ValueError(
          errors.message(
            f"{self.kind} {leaf.full_name!r} (params path {leaf.path}) has "
            f"shape {list(shape)} in what apply was given, but this call "
            f"needs {list(want)} for these inputs."
            + (errors.SHARD_HINT if errors.looks_like_a_shard(shape, want) else "")
          )
        )
      values.append(value)
    return values


class ParamCollection(_Collection):
  """Leaves stored as Haiku parameters."""

  kind = "parameter"

  def _stored(self, leaf):
    return haiku_internals.stored_param(leaf.bundle, leaf.name)

  def create(self, leaves: Sequence[Leaf], values: Sequence[Any]) -> list[Any]:
    """At init: stores `values` (custom creators may change them)."""
    out: list[Any] = [None] * len(leaves)
    for bundle, indices in by_bundle(leaves).items():
      with in_bundle(bundle):
        for i in indices:
          value = canonical(values[i])
          out[i] = hk.get_parameter(
            leaves[i].name, value.shape, value.dtype, init=functools.partial(_constant, value)
          )
    return out

  def read(self, leaves: Sequence[Leaf], shapes: Optional[Sequence[Any]] = None) -> list[Any]:
    """At apply: the stored values, through any custom getter."""
    stored = self.checked_stored(leaves, shapes)
    out: list[Any] = [None] * len(leaves)
    for bundle, indices in by_bundle(leaves).items():
      with in_bundle(bundle):
        for i in indices:
          out[i] = hk.get_parameter(leaves[i].name, stored[i].shape, stored[i].dtype)
    return out


class StateCollection(_Collection):
  """Leaves stored as Haiku state."""

  kind = "state"

  def _stored(self, leaf):
    return haiku_internals.stored_state(leaf.bundle, leaf.name)

  def create(
    self, leaves: Sequence[Leaf], initial: Sequence[Any], current: Sequence[Any]
  ) -> list[Any]:
    """At init: stores the initial values, then the current ones if newer."""
    out: list[Any] = [None] * len(leaves)
    for bundle, indices in by_bundle(leaves).items():
      with in_bundle(bundle):
        for i in indices:
          value = canonical(initial[i])
          out[i] = hk.get_state(
            leaves[i].name, value.shape, value.dtype, init=functools.partial(_constant, value)
          )
          if current[i] is not initial[i]:
            hk.set_state(leaves[i].name, current[i])
            out[i] = current[i]
    return out

  def read(self, leaves: Sequence[Leaf], shapes: Optional[Sequence[Any]] = None) -> list[Any]:
    """At apply: the current values, through any custom state getter."""
    self.checked_stored(leaves, shapes)
    out: list[Any] = [None] * len(leaves)
    for bundle, indices in by_bundle(leaves).items():
      with in_bundle(bundle):
        for i in indices:
          out[i] = hk.get_state(leaves[i].name)
    return out

  def write(self, leaves: Sequence[Leaf], old: Sequence[Any], new: Sequence[Any]) -> None:
    """Sets each leaf whose value changed (`new[i] is not old[i]`)."""
    for bundle, indices in by_bundle(leaves).items():
      with in_bundle(bundle):
        for i in indices:
          if new[i] is not old[i]:
            hk.set_state(leaves[i].name, new[i])


PARAMS = ParamCollection()
STATE = StateCollection()
