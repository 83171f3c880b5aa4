"""Shardings that are part of an array's type: reading them, and moving arrays between them.

Under a mesh with Explicit axes (`jax.make_mesh`'s default from jax 0.9 on),
an array's type says how it is split (`f32[8@data, 16]`), and JAX refuses an
operation whose result's split it cannot tell without communication. So code
that reshapes arrays it does not own (the pipeline's microbatches and stages)
first reshards them to a sharding where the reshape is local, with
`jax.sharding.reshard`, whose transpose is a reshard back: every step stays
valid under autodiff, to any order. Under Auto axes (or with no mesh) the
type holds no split: the helpers here change nothing, and the partitioner
places the data.
"""

from typing import Any, Optional, Sequence

import jax
from jax.sharding import PartitionSpec

# jax.sharding.reshard is jax >= 0.7; jax 0.6 has it under jax.experimental.
if hasattr(jax.sharding, "reshard"):
  _reshard = jax.sharding.reshard
else:  # jax 0.6
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental import shard  # type: ignore[attr-defined]

  _reshard = shard.reshard

# What one dimension of a PartitionSpec holds: no mesh axis, one, or several.
MeshAxes = Optional[str | tuple[str, ...]]


def entry_without(entry: MeshAxes, axes: tuple[str, ...]) -> MeshAxes:
  """One entry of a PartitionSpec with the mesh `axes` taken out."""
  if entry is None or entry is PartitionSpec.UNCONSTRAINED:
    return entry
  kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a not in axes)
  if not kept:
    return None
  return kept[0] if len(kept) == 1 else kept


def _named(a: Any) -> Any:
  """`a`'s sharding where its type names a mesh, else None."""
  sharding = getattr(jax.typeof(a), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty:
    return None
  return sharding


def spec(a: Any) -> tuple[MeshAxes, ...]:
  """The split of each axis of `a` that its type names (all None without one)."""
  sharding = _named(a)
  if sharding is None:
    return (None,) * a.ndim
  entries = tuple(sharding.spec)
  return entries + (None,) * (a.ndim - len(entries))


def is_explicit(axis: str) -> bool:
  """Whether the mesh set by `jax.set_mesh` has `axis`, of type Explicit."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or axis not in mesh.axis_names:
    return False
  explicit = jax.sharding.AxisType.Explicit
  return mesh.axis_types[mesh.axis_names.index(axis)] == explicit


def axis_size(entry: MeshAxes) -> int:
  """How many parts a spec entry splits an axis into, in the current mesh."""
  if entry is None:
    return 1
  mesh = jax.sharding.get_abstract_mesh()
  size = 1
  for name in (entry,) if isinstance(entry, str) else entry:
    size *= mesh.axis_sizes[mesh.axis_names.index(name)]
  return size


def reshard(a: jax.Array, entries: Sequence[MeshAxes]) -> jax.Array:
  """`a` split as `entries` say, where that differs from its type's split."""
  if tuple(entries) == spec(a):
    return a
  return _reshard(a, PartitionSpec(*entries))


def without(a: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """`a` with `axes` taken out of its type's split, on every dimension."""
  return reshard(a, tuple(entry_without(e, axes) for e in spec(a)))


def gradient_replicated_where_unplaced(a: jax.Array) -> jax.Array:
  """`a`, its gradient held whole on every device, where its type names no mesh.

  An argument jit got from outside any mesh (params as `init` returns
  them) has no split in its type, so the partitioner places it and its
  gradient as the program around it suggests: a stack reshaped into the
  stages' placement suggests its layer axis over them, where the plain
  stack's gradient comes back whole on every device. The tangent (and so,
  transposed, the gradient) is constrained to that; `a` itself is left to
  the partitioner (it may hand each stage only its layers). An array whose
  type names a mesh, and one with no gradient (keys, integers), is as it is.
  """
  if (
    _named(a) is not None
    or jax.sharding.get_abstract_mesh().empty
    or not jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)
  ):
    return a
  return _tangent_replicated(a)


@jax.custom_jvp
def _tangent_replicated(a: jax.Array) -> jax.Array:
  return a


@_tangent_replicated.defjvp
def _tangent_replicated_jvp(primals, tangents):
  (a,), (t,) = primals, tangents
  mesh = jax.sharding.get_abstract_mesh()
  if jax.sharding.AxisType.Explicit in tuple(mesh.axis_types):
    # Typed on the mesh: its transpose's result (the gradient) is too.
    return a, _reshard(t, PartitionSpec())
  return a, jax.lax.with_sharding_constraint(t, PartitionSpec())


def on_mesh(tree: Any) -> Any:
  """`tree`, each array with no mesh in its type put on the Explicit mesh set.

  Inside `jax.jit`, an argument committed to no mesh has a type without one;
  mixed with arrays typed by the mesh (in a loop's carry, an update in
  place) it is refused. Replicated over the mesh, it has the mesh's type.
  """
  mesh = jax.sharding.get_abstract_mesh()
  explicit = jax.sharding.AxisType.Explicit
  if mesh.empty or explicit not in tuple(mesh.axis_types):
    return tree

  return jax.tree.map(lambda a: _reshard(a, PartitionSpec()) if _named(a) is None else a, tree)
