"""The stack and the batch between a layer scan's layout and a pipeline's stages'.

`Layout`: the stacked per-layer arrays, `[N, ...]`, as the stages hold them,
`[S, R, L, ...]` (stage, pass, layer of a visit), and back, and the stages'
`ys` back in layer order. `Batch`: the batch (axis 0 of every carry leaf)
as microbatches, `[M, B/M, ...]`, and back. Under Explicit mesh axes each
reshape says where its result goes (`typed_sharding.py`).
"""

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from haiku_bridge._src import errors
from haiku_bridge._src import typed_sharding
from haiku_bridge._src.pytree import PyTree


@dataclasses.dataclass(frozen=True)
class Batch:
  """The batch (axis 0 of every carry leaf) as microbatches: m holds rows m, m + M, ..."""
  microbatches: int
  axis: str  # The stages', which every microbatch is whole on.

  def split(self, a: jax.Array) -> jax.Array:
    """`[B, ...]` -> `[M, B/M, ...]`."""
    a = typed_sharding.without(a, (self.axis,))
    m = self.microbatches
    if m == 1:
      return a[None]
    rows = a.shape[0] // m
    entries = typed_sharding.spec(a)
    if rows % typed_sharding.axis_size(entries[0]):
      # A microbatch has fewer rows than the devices the batch is split
      # over: each device holds whole microbatches.
      a = typed_sharding.reshard(a, (None,) + entries[1:])
    # A row's microbatch is its minor index: a batch split over data
    # devices stays split so, each device's rows in every microbatch.
    return jnp.swapaxes(a.reshape((rows, m) + a.shape[1:]), 0, 1)

  def join(self, a: jax.Array, axis: int = 0) -> jax.Array:
    """The inverse of `split`, of the microbatch axis `axis`."""
    if self.microbatches == 1:
      return jnp.squeeze(a, axis)
    a = jnp.moveaxis(a, axis, axis + 1)
    return a.reshape(a.shape[:axis] + (-1,) + a.shape[axis + 2:])

  def join_ys(self, ys: PyTree, whole_batch: Callable[[], PyTree]) -> PyTree:
    """`[N, M, B/M, ...]` -> `[N, B, ...]`, where a `y`'s axis 0 is the batch."""
    if self.microbatches == 1 or not jax.tree.leaves(ys):
      return jax.tree.map(lambda a: self.join(a, 1), ys)
    m = self.microbatches

    def join(path, a, whole):
      part = a.shape[2:]
      if not part or tuple(whole.shape) != (part[0] * m,) + part[1:]:
        raise ValueError(errors.message(
            f"the layer's y at {errors.keystr(path)} has shape "
            f"{tuple(whole.shape)} for the whole batch and {part} for a "
            f"microbatch: its axis 0 is not the batch. The pipeline runs "
            f"each layer on `pipeline.microbatches`={m} microbatches, so it "
            "returns a y as the plain stack does only where axis 0 is the "
            "batch. Return a value per example and reduce after the stack "
            "(e.g. `ys.mean(axis=1)`), or pass microbatches=1."))
      # Typed as the whole batch's y (see `run`'s `out`).
      return typed_sharding.reshard(self.join(a, 1),
                                    (None,) + typed_sharding.spec(whole))

    return jax.tree_util.tree_map_with_path(join, ys, whole_batch())


@dataclasses.dataclass(frozen=True)
class Layout:
  """Layer n = (r·S + s)·L + j: pass r, stage s, layer j of a visit."""
  axis: str
  stages: int
  repeats: int
  layers: int  # L, per visit.
  # Whether arrays' types say how they are split over the stages: an
  # Explicit stage axis, of more than one stage (one runs no `shard_map`).
  explicit: bool

  def to_stages(self, a: jax.Array) -> jax.Array:
    """`[N, ...]` -> `[S, R, L, ...]`, axis 0 over the stages."""
    a = typed_sharding.gradient_replicated_where_unplaced(a)
    entries = typed_sharding.spec(a)
    rest = tuple(typed_sharding.entry_without(e, (self.axis,))
                 for e in entries[1:])
    shape = (self.stages, self.repeats, self.layers) + a.shape[1:]
    if self.explicit and self.repeats == 1 and entries == (self.axis,) + rest:
      # A layer axis stored over the stages: each holds its GPipe block.
      return jnp.reshape(a, shape, out_sharding=PartitionSpec(
          self.axis, None, None, *rest))
    if self.explicit and entries[0] == self.axis and _summable(a):
      # Stored over the stages in blocks of layers, which circular
      # interleaves: each stage sends each of its visits' layers to the
      # stage that runs them, never the whole stack.
      return self._interleaved(a, entries[1:], inverse=False)
    a = typed_sharding.reshard(a, (None,) + rest)
    a = jnp.swapaxes(a.reshape((self.repeats, self.stages, self.layers)
                               + a.shape[1:]), 0, 1)
    if self.explicit:
      a = typed_sharding.reshard(a, (self.axis, None, None) + rest)
    return a

  def to_layers(self, a: jax.Array, like: jax.Array) -> jax.Array:
    """The inverse of `to_stages`, split as `like`."""
    entries = typed_sharding.spec(like)
    if (self.explicit and self.repeats == 1 and entries[:1] == (self.axis,)
        and typed_sharding.spec(a)[3:] == entries[1:]):
      return jnp.reshape(a, like.shape,
                         out_sharding=PartitionSpec(*entries))
    if self.explicit and entries[:1] == (self.axis,) and _summable(a):
      a = typed_sharding.reshard(a, (self.axis, None, None) + entries[1:])
      return self._interleaved(a, entries[1:], inverse=True)
    a = typed_sharding.without(a, (self.axis,))
    a = jnp.swapaxes(a, 0, 1).reshape(like.shape)
    return typed_sharding.reshard(a, entries)

  def _interleaved(self, a: jax.Array,
                   rest: tuple[typed_sharding.MeshAxes, ...],
                   inverse: bool) -> jax.Array:
    """`[N, ...]` in blocks over the stages -> `[S, R, L, ...]` over them (`inverse`: back), by `ppermute`.

    Stage b stores layers [b·R·L, (b+1)·R·L): R groups of L layers; visit r
    of stage s is group g = r·S + s, stored on stage g // R as its group
    g mod R. For each visit r and stored group t, one `ppermute` takes
    those groups to the stages that run them (a partial permutation: the
    other stages get zeros, which the sum over t drops), so every index is
    static and each stage holds its own layers and the groups in flight,
    never the stack (an all-gather of it: S times the stage's share of each
    leaf, until issue 43). Autodiff's transpose is the inverse permutation.
    """
    stages, repeats, layers = self.stages, self.repeats, self.layers
    named = {name for entry in rest if entry is not None
             for name in ((entry,) if isinstance(entry, str) else entry)}

    def move(block):
      if inverse:
        block = block[0]  # [R, L, ...], by visit.
      else:
        block = block.reshape((repeats, layers) + block.shape[1:])  # By group.
      moved: list[list[jax.Array]] = [[] for _ in range(repeats)]
      for visit in range(repeats):
        for group in range(repeats):
          pairs = [((visit * stages + s) // repeats, s) for s in range(stages)
                   if (visit * stages + s) % repeats == group]
          if inverse:
            pairs = [(s, b) for b, s in pairs]
            to, part = group, block[visit]
          else:
            to, part = visit, block[group]
          if pairs:
            moved[to].append(jax.lax.ppermute(part, self.axis, pairs))
      out = jnp.stack([sum(parts[1:], parts[0]) for parts in moved])
      if inverse:
        return out.reshape((-1,) + out.shape[2:])
      return out[None]

    staged = PartitionSpec(self.axis, None, None, *rest)
    stored = PartitionSpec(self.axis, *rest)

    return jax.shard_map(
        move, in_specs=staged if inverse else stored,
        out_specs=stored if inverse else staged,
        axis_names=frozenset({self.axis} | named))(a)

  def ys_to_layers(self, a: jax.Array) -> jax.Array:
    """`[S, R, M, L, ...]` -> `[N, M, ...]`."""
    a = typed_sharding.without(a, (self.axis,))
    a = jnp.moveaxis(jnp.swapaxes(a, 0, 1), 2, 3)
    entries = typed_sharding.spec(a)
    if any(e is not None for e in entries):
      # Merging the unsplit R, S, L axes: jax 0.10.2 cannot always tell the
      # result's split itself (one microbatch, its rows over `data`).
      return jnp.reshape(a, (-1,) + a.shape[3:],
                         out_sharding=PartitionSpec(None, *entries[3:]))
    return a.reshape((-1,) + a.shape[3:])


def _summable(a: jax.Array) -> bool:
  """Whether adding zeros to `a` is exact (not a PRNG key's type)."""
  return jnp.issubdtype(a.dtype, jnp.number) or a.dtype == jnp.bool_


def whole_batch_ys(body: Callable[..., Any], carry: PyTree,
                    per_layer: PyTree) -> PyTree:
  """The shapes of the first layer's `y` for the whole batch, as the plain scan has them."""
  def first_layer(carry, per_layer):
    # Abstract: the whole stack replicated costs nothing here.
    first = jax.tree.map(
        lambda a: typed_sharding.reshard(a, (None,) * a.ndim)[0], per_layer)
    return body(carry, first)[1][0]
  return jax.eval_shape(first_layer, carry, per_layer)
