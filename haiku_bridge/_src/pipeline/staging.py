"""A pipeline checked against the mesh, the stack and the batch, and laid out once: its `Staging`.

`layer_scan` stages its pipeline at init under a mesh and at apply
(`staging_for`); the stages run from the staging (`stage_program.run`). The checks
name what does not fit, and the fix: a mesh without the stage axis, a jax
that cannot run the stages on Explicit axes, a stack that does not split
into the stages (and passes), a batch that does not split into the
microbatches.
"""

import dataclasses
from typing import Optional

import jax
import numpy as np

from haiku_bridge._src import errors
from haiku_bridge._src.pipeline import config
from haiku_bridge._src.pipeline import placement as placement_lib
from haiku_bridge._src.pipeline import timetables
from haiku_bridge._src import typed_sharding
from haiku_bridge._src.pytree import PyTree


@dataclasses.dataclass(frozen=True)
class Staging:
  """How a stack runs as a pipeline: its placement on the stages, its microbatches, their timetable."""

  placement: placement_lib.Placement
  batch: placement_lib.Batch
  timetable: timetables.Timetable


def staging_for(
  pipeline: config.Pipeline, carry: PyTree, num_layers: int, *, require_mesh: bool
) -> Optional[Staging]:
  """The pipeline checked against the mesh, the stack and the batch, and laid out.

  Without a mesh, returns None, or with `require_mesh` raises.
  """
  names, sizes = _mesh_axes()
  if pipeline.axis not in names:
    if not names and not require_mesh:
      return None
    where = f"the mesh has axes {names}" if names else "no mesh is set"
    raise ValueError(
      errors.message(
        f"`pipeline.axis` is {pipeline.axis!r}, but {where}. Run the step "
        f"under `jax.set_mesh(mesh)`, with a mesh that has an axis "
        f"{pipeline.axis!r} for the stages (e.g. jax.make_mesh((4, 2), "
        f"({pipeline.axis!r}, 'data')))."
      )
    )
  stages = sizes[names.index(pipeline.axis)]
  explicit = [name for name in names if typed_sharding.is_explicit(name)]
  if stages > 1 and explicit and not config.jax_runs_stages_on_explicit_axes():
    raise NotImplementedError(
      errors.message(
        f"the mesh's axes {tuple(explicit)} are Explicit, and jax "
        f"{jax.__version__} cannot run a pipeline's stages (a jax.shard_map "
        f"manual over {pipeline.axis!r}) on a mesh with Explicit axes: it "
        "refuses the shard_map's specs (\"Tuple subset of PartitionSpec "
        "cannot contain Manual mixed with ... Explicit\"). Upgrade to jax "
        "0.9 or newer, or make the mesh's axes Auto "
        "(jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * "
        "len(names)))."
      )
    )
  repeats = pipeline.num_repeats(num_layers, stages)
  if num_layers % (stages * repeats):
    split = (
      f"{stages} stages"
      if repeats == 1
      else f"{stages} stages × {repeats} passes (`pipeline.repeats`)"
    )
    raise ValueError(
      errors.message(
        f"`num_layers` is {num_layers}, which does not split into {split}: "
        f"the pipeline runs {stages * repeats} equal groups of layers, and "
        f"{stages * repeats} does not divide {num_layers}. Pass a number of "
        f"layers that {stages * repeats} divides"
        + (
          ", or other `repeats`."
          if repeats > 1
          else f", or a mesh axis {pipeline.axis!r} of a size that divides it."
        )
      )
    )
  microbatches = pipeline.microbatches
  # With one microbatch, the whole carry is it, scalars too.
  for path, leaf in jax.tree_util.tree_leaves_with_path(carry if microbatches > 1 else ()):
    shape = np.shape(leaf)
    if not shape:
      raise ValueError(
        errors.message(
          f"the carry at {errors.keystr(path)} is a scalar, with no batch "
          f"axis: the pipeline splits axis 0 of every carry leaf (the batch) "
          f"into `pipeline.microbatches`={microbatches} microbatches. Give "
          "that leaf a batch axis (a value per example), or pass "
          "microbatches=1."
        )
      )
    if shape[0] % microbatches:
      raise ValueError(
        errors.message(
          f"the carry at {errors.keystr(path)} has shape {shape}; the "
          f"pipeline splits axis 0 of every carry leaf (the batch) into "
          f"`pipeline.microbatches`={microbatches} microbatches, and "
          f"{microbatches} does not divide {shape[0]}. Pass a batch that "
          f"{microbatches} divides, or other `microbatches`."
        )
      )
  placement = placement_lib.Placement(
    pipeline.axis,
    stages,
    repeats,
    num_layers // (stages * repeats),
    stages > 1 and typed_sharding.is_explicit(pipeline.axis),
  )
  return Staging(
    placement,
    placement_lib.Batch(microbatches, pipeline.axis),
    timetables.timetable(stages, microbatches, repeats),
  )


def _mesh_axes() -> tuple[tuple[str, ...], tuple[int, ...]]:
  """The names and sizes of the axes of the mesh set by `jax.set_mesh`."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return (), ()
  return tuple(mesh.axis_names), tuple(mesh.axis_sizes)
