"""A pipeline's placement: the stack and the batch moved from a layer scan's order to the stages'.

`Placement`: the stacked per-layer arrays, `[N, ...]`, as the stages hold them,
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

from haiku_bridge._src import caches
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
    return a.reshape(a.shape[:axis] + (-1,) + a.shape[axis + 2 :])

  def join_ys(self, ys: PyTree, whole_batch: Callable[[], PyTree]) -> PyTree:
    """`[N, M, B/M, ...]` -> `[N, B, ...]`, where a `y`'s axis 0 is the batch."""
    if self.microbatches == 1 or not jax.tree.leaves(ys):
      return jax.tree.map(lambda a: self.join(a, 1), ys)
    m = self.microbatches

    def join(path, a, whole):
      part = a.shape[2:]
      if not part or tuple(whole.shape) != (part[0] * m,) + part[1:]:
        raise ValueError(
          errors.message(
            f"the layer's y at {errors.keystr(path)} has shape "
            f"{tuple(whole.shape)} for the whole batch and {part} for a "
            f"microbatch: its axis 0 is not the batch. The pipeline runs "
            f"each layer on `pipeline.microbatches`={m} microbatches, so it "
            "returns a y as the plain stack does only where axis 0 is the "
            "batch. Return a value per example and reduce after the stack "
            "(e.g. `ys.mean(axis=1)`), or pass microbatches=1."
          )
        )
      # Typed as the whole batch's y (see `run`'s `out`).
      return typed_sharding.reshard(self.join(a, 1), (None,) + typed_sharding.spec(whole))

    return jax.tree_util.tree_map_with_path(join, ys, whole_batch())


@dataclasses.dataclass(frozen=True)
class Placement:
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
    rest = tuple(typed_sharding.entry_without(e, (self.axis,)) for e in entries[1:])
    shape = (self.stages, self.repeats, self.layers) + a.shape[1:]
    if self.explicit and self.repeats == 1 and entries == (self.axis,) + rest:
      # A layer axis stored over the stages: each holds its GPipe block.
      return jnp.reshape(a, shape, out_sharding=PartitionSpec(self.axis, None, None, *rest))
    if self.explicit and entries[0] == self.axis:
      # Stored over the stages in blocks of layers, which circular
      # interleaves: each stage sends each of its visits' layers to the
      # stage that runs them, never the whole stack.
      return self._interleaved(a, entries[1:], inverse=False)
    a = typed_sharding.reshard(a, (None,) + rest)
    a = jnp.swapaxes(a.reshape((self.repeats, self.stages, self.layers) + a.shape[1:]), 0, 1)
    if self.explicit:
      a = typed_sharding.reshard(a, (self.axis, None, None) + rest)
    return a

  def to_layers(self, a: jax.Array, like: jax.Array) -> jax.Array:
    """The inverse of `to_stages`, split as `like`."""
    entries = typed_sharding.spec(like)
    if (
      self.explicit
      and self.repeats == 1
      and entries[:1] == (self.axis,)
      and typed_sharding.spec(a)[3:] == entries[1:]
    ):
      return jnp.reshape(a, like.shape, out_sharding=PartitionSpec(*entries))
    if self.explicit and entries[:1] == (self.axis,):
      a = typed_sharding.reshard(a, (self.axis, None, None) + entries[1:])
      return self._interleaved(a, entries[1:], inverse=True)
    a = typed_sharding.without(a, (self.axis,))
    a = jnp.swapaxes(a, 0, 1).reshape(like.shape)
    return typed_sharding.reshard(a, entries)

  def _interleaved(
    self, a: jax.Array, rest: tuple[typed_sharding.MeshAxes, ...], inverse: bool
  ) -> jax.Array:
    """`[N, ...]` in blocks over the stages -> `[S, R, L, ...]` over them (`inverse`: back), by R `ppermute`s.

    Stage b stores layers [b·R·L, (b+1)·R·L): R groups of L layers; visit r
    of stage s is group g = r·S + s, stored on stage g // R as its group
    g mod R. Every stage sends R groups and receives R, so the moves split
    into R permutations of the stages (`_rounds`): in each, every stage
    sends one group of each leaf (the slot its index picks) and puts the
    one it receives where its index says, so a stage holds its own layers
    and one round's groups in flight, and sends its params once (until
    issue 43 an all-gather of each leaf's whole stack, S times the stage's
    share; then R² partial permutations, R·L layers in flight and a count
    of each op's bytes R times what moved). A group that stays on its
    stage is sent to itself (XLA copies it). Which group a stage sends and
    where it lands differ by stage: selects on the stage's index, never a
    dynamic slice, whose transpose would be a zero buffer of the stage's
    share per round. Autodiff's transpose is the inverse permutations.
    """
    named = {
      name
      for entry in rest
      if entry is not None
      for name in ((entry,) if isinstance(entry, str) else entry)
    }
    rounds = _rounds(self.stages, self.repeats)

    def move(block):
      if inverse:
        block = block[0]  # [R, L, ...], by visit.
      else:
        block = block.reshape((self.repeats, self.layers) + block.shape[1:])
      stage = jax.lax.axis_index(self.axis)

      def pick(which, cases):  # Case which[stage]: a select, as is its transpose.
        return jax.lax.select_n(jnp.asarray(which)[stage], *cases)

      # Round k: each stage sends its slot `sends[k]`, which lands in the
      # receiver's slot `lands[k]` (indexed by stage).
      sends = [visit if inverse else stored for _, stored, visit in rounds]
      lands = [stored if inverse else visit for _, stored, visit in rounds]
      slots = jax.lax.split(block, (1,) * self.repeats)  # Transpose: concat.
      received = [
        jax.lax.ppermute(
          pick(sent, slots), self.axis, [(t, b) for b, t in pairs] if inverse else pairs
        )
        for sent, (pairs, _, _) in zip(sends, rounds)
      ]
      out = jnp.concatenate(
        [
          pick([[land[s] for land in lands].index(slot) for s in range(self.stages)], received)
          for slot in range(self.repeats)
        ]
      )
      if inverse:
        return out.reshape((-1,) + out.shape[2:])
      return out[None]

    staged = PartitionSpec(self.axis, None, None, *rest)
    stored = PartitionSpec(self.axis, *rest)

    return jax.shard_map(
      move,
      in_specs=staged if inverse else stored,
      out_specs=stored if inverse else staged,
      axis_names=frozenset({self.axis} | named),
    )(a)

  def ys_to_layers(self, a: jax.Array) -> jax.Array:
    """`[S, R, M, L, ...]` -> `[N, M, ...]`."""
    a = typed_sharding.without(a, (self.axis,))
    a = jnp.moveaxis(jnp.swapaxes(a, 0, 1), 2, 3)
    entries = typed_sharding.spec(a)
    if any(e is not None for e in entries):
      # Merging the unsplit R, S, L axes: jax 0.10.2 cannot always tell the
      # result's split itself (one microbatch, its rows over `data`).
      return jnp.reshape(a, (-1,) + a.shape[3:], out_sharding=PartitionSpec(None, *entries[3:]))
    return a.reshape((-1,) + a.shape[3:])


@caches.memoize()
def _rounds(
  stages: int, repeats: int
) -> tuple[tuple[tuple[tuple[int, int], ...], tuple[int, ...], tuple[int, ...]], ...]:
  """Circular's moves from stored blocks to visits, as R permutations of the stages.

  Group g = r·S + s (visit r of stage s) is stored on stage g // R as its
  group g mod R. Each stage stores R groups and runs R, so the groups are
  the edges of an R-regular bipartite multigraph from storing to running
  stages, which splits into R perfect matchings (König): found here one
  at a time by augmenting paths. Each round is `(pairs, stored, visit)`:
  the `(from, to)` stage pairs, each stage's slot of the group it sends
  (`stored[from]`), and the visit it receives (`visit[to]`).
  """
  left = {g: (g // repeats, g % stages) for g in range(stages * repeats)}
  rounds = []
  while left:
    match: dict[int, int] = {}  # Running stage -> group.

    def augment(source: int, seen: set[int]) -> bool:
      for g, (b, s) in left.items():
        if b == source and s not in seen:
          seen.add(s)
          if s not in match or augment(left[match[s]][0], seen):
            match[s] = g
            return True
      return False

    for source in range(stages):
      found = augment(source, set())
      assert found, (stages, repeats)  # An R-regular graph has a matching.
    pairs = tuple((g // repeats, s) for s, g in sorted(match.items()))
    stored, visit = [0] * stages, [0] * stages
    for s, g in match.items():
      stored[g // repeats] = g % repeats
      visit[s] = g // stages
      del left[g]
    rounds.append((pairs, tuple(stored), tuple(visit)))
  return tuple(rounds)


def whole_batch_ys(body: Callable[..., Any], carry: PyTree, per_layer: PyTree) -> PyTree:
  """The shapes of the first layer's `y` for the whole batch, as the plain scan has them."""

  def first_layer(carry, per_layer):
    # Abstract: the whole stack replicated costs nothing here.
    first = jax.tree.map(lambda a: typed_sharding.reshard(a, (None,) * a.ndim)[0], per_layer)
    return body(carry, first)[1][0]

  return jax.eval_shape(first_layer, carry, per_layer)
