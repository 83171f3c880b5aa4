"""What a pipelined stack costs each device, before it runs: `hkb.pipeline_cost`.

The pipeline's shape comes from the same checks that lay it out when it runs
(`staging.staging_for`, under the mesh given): S stages, R passes, L layers
per visit, M microbatches, the timetable's T steps and its bubble. What one
training step (the loss after the stack, `jax.value_and_grad`) moves per
device, by collective kind, is the cost model below, with P the stack's
params on one stage (the stack's bytes over S) and a one microbatch's
boundary activations on one device (the carry's bytes over M·D, D the
devices the batch is split over):

- `collective-permute`: 2·T·a: at each step of the timetable each stage
  sends one microbatch's activations on and their cotangent back; the
  bubble's steps send too (`ppermute` needs every stage at each step). For
  circular with params stored over the stages, 2·P more: each stage sends
  its stored layers once to the stages whose visits run them, and their
  gradient back.
- `all-reduce data`: P, the stage's gradient summed over the data devices
  once per step (none with one data device). A loss averaged over the
  batch adds its own scalar.
- `all-reduce stage`: M·a: the stack's output, from the last stage to the
  others.
- `all-gather`: S·P with params as `init` returns them (the gradient comes
  back whole on every device, as the plain stack's); none for params
  stored over the stages.
- `reduce-scatter`, `all-to-all`: none.

`testing/pipeline_cost.py` holds these figures to a compiled step's
collectives (`pipeline_cost_test`: GPipe and circular, both placements,
Explicit and Auto axes).
"""

import dataclasses
import math
from typing import Optional, Sequence, Union

import jax
import numpy as np

from haiku_bridge._src import errors
from haiku_bridge._src import pytree
from haiku_bridge._src.pipeline import config
from haiku_bridge._src.pipeline import staging as staging_lib
from haiku_bridge._src.pytree import PyTree

# The collective kinds of a pipelined step, in the order `PipelineCost` prints them.
COLLECTIVES = (
  "collective-permute",
  "all-reduce data",
  "all-reduce stage",
  "all-gather",
  "reduce-scatter",
  "all-to-all",
)


@dataclasses.dataclass(frozen=True)
class PipelineCost:
  """A pipelined stack's shape, and what one training step costs each device.

  `print(cost)` shows it as a table. Bytes are per device and step, from the
  cost model (`hkb.pipeline_cost`).

  Attributes:
    stages: S, the devices along the pipeline's mesh axis.
    repeats: R, the passes each microbatch makes over the stages.
    layers_per_stage: the layers each stage holds (N/S).
    layers_per_visit: the layers a stage runs at each visit (N/(S·R)).
    microbatches: M.
    steps: the timetable's steps (its ticks): M+S-1 for GPipe,
      (R-1)·max(M, S)+M+S-1 for circular.
    bubble: the idle share of the stages' steps.
    param_bytes: the stack's params one device holds (and its gradient):
      a stage's layers where stored over the stages, all of them as `init`
      returns them.
    microbatch_bytes: one microbatch's boundary activations (the carry) on
      one device: what each send of the timetable moves.
    collectives: bytes by collective kind (`COLLECTIVES`).
  """

  stages: int
  repeats: int
  layers_per_stage: int
  layers_per_visit: int
  microbatches: int
  steps: int
  bubble: float
  param_bytes: int
  microbatch_bytes: float
  collectives: dict[str, float]

  def __str__(self) -> str:
    rows = [
      ("stages × passes", f"{self.stages} × {self.repeats}"),
      ("layers per stage (per visit)", f"{self.layers_per_stage} ({self.layers_per_visit})"),
      ("microbatches", f"{self.microbatches}"),
      ("timetable steps", f"{self.steps}"),
      ("bubble", f"{self.bubble:.1%}"),
      ("stack params per device", _bytes(self.param_bytes)),
      ("a microbatch's activations per device", _bytes(self.microbatch_bytes)),
    ] + [
      (f"{kind} per step", _bytes(self.collectives[kind]))
      for kind in COLLECTIVES
      if self.collectives[kind]
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def pipeline_cost(
  pipeline: config.Pipeline,
  mesh: Union[jax.sharding.Mesh, jax.sharding.AbstractMesh],
  stack_params: PyTree,
  carry: PyTree,
  *,
  stored_over_stages: bool = False,
  data_axes: Optional[Sequence[str]] = None,
) -> PipelineCost:
  """A pipelined stack's stages, bubble, memory and bytes per collective, before it runs.

  Example: 8 layers on 4 stages, 2 devices each for the batch.

  >>> def block(h):
  ...   return h + jnp.tanh(hk.Linear(16)(h))
  >>> pipe = hkb.Pipeline("stage", microbatches=4)
  >>> f = hk.transform(lambda x: hkb.repeat_layer(block, x, 8, name="layers",
  ...                                             pipeline=pipe))
  >>> x = jnp.ones([32, 16])
  >>> params = jax.eval_shape(f.init, jax.random.PRNGKey(0), x)
  >>> mesh = jax.sharding.AbstractMesh((4, 2), ("stage", "data"))
  >>> cost = hkb.pipeline_cost(pipe, mesh, params, x)
  >>> cost.layers_per_stage, cost.steps, round(cost.bubble, 3)
  (2, 7, 0.429)
  >>> cost.collectives["collective-permute"]  # 2 · 7 steps · 4 rows of 16.
  3584.0

  Args:
    pipeline: the stack's `hkb.Pipeline`.
    mesh: the mesh the step runs under (`jax.set_mesh`), a `Mesh` or an
      `AbstractMesh`, with the axis `pipeline.axis`.
    stack_params: the stack's params, as `init` returns them (arrays or
      `jax.ShapeDtypeStruct`s, e.g. from `jax.eval_shape(f.init, ...)`):
      every leaf stacked over the layers on axis 0.
    carry: the stack's input (arrays or `jax.ShapeDtypeStruct`s), the batch
      on axis 0 of every leaf.
    stored_over_stages: whether the stack's layer axis is stored over
      `pipeline.axis` (`ShardingRules(stacked={stack: axis})` and
      `jax.device_put`); by default params are as `init` returns them.
    data_axes: the mesh axes the batch is split over; by default every
      axis but `pipeline.axis`.

  Returns:
    A `PipelineCost`.
  """
  with errors.entry("pipeline_cost"):
    config.check_pipeline(pipeline)
    if pipeline is None:
      raise TypeError(
        errors.bad_argument(
          "pipeline", pipeline, "an hkb.Pipeline, e.g. hkb.Pipeline(\"stage\", microbatches=4)"
        )
      )
    stored_over_stages = errors.check_bool("stored_over_stages", stored_over_stages)
    axes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    num_layers = _num_layers(stack_params)
    if data_axes is None:
      data_axes = [name for name in axes if name != pipeline.axis]
    for name in data_axes:
      if name not in axes or name == pipeline.axis:
        raise ValueError(
          errors.message(
            f"`data_axes` names {name!r}, which is not an axis of the mesh {tuple(axes)} other "
            f"than the stages' {pipeline.axis!r}. Pass the axes the batch is split over, e.g. "
            f"{tuple(a for a in axes if a != pipeline.axis)}."
          )
        )
    abstract = (
      mesh.abstract_mesh if isinstance(mesh, jax.sharding.Mesh) else mesh
    )  # Shapes only: no device is touched.
    with jax.sharding.use_abstract_mesh(abstract):
      staging = staging_lib.staging_for(pipeline, carry, num_layers, require_mesh=True)
  assert staging is not None  # require_mesh: a mesh is set.
  placement, timetable = staging.placement, staging.timetable
  stages, microbatches = placement.stages, pipeline.microbatches
  data = math.prod(axes[name] for name in data_axes)
  stage_params = pytree.nbytes(stack_params) / stages
  a = pytree.nbytes(carry) / (microbatches * data)
  collectives = dict.fromkeys(COLLECTIVES, 0.0)
  if stages > 1:  # One stage runs the timetable as a loop: nothing is sent.
    collectives["collective-permute"] = 2 * timetable.num_ticks * a + (
      2 * stage_params if pipeline.schedule == "circular" and stored_over_stages else 0
    )
  collectives["all-reduce data"] = stage_params if data > 1 else 0
  collectives["all-reduce stage"] = microbatches * a if stages > 1 else 0
  collectives["all-gather"] = 0 if stored_over_stages or stages == 1 else stages * stage_params
  return PipelineCost(
    stages=stages,
    repeats=placement.repeats,
    layers_per_stage=placement.repeats * placement.layers,
    layers_per_visit=placement.layers,
    microbatches=microbatches,
    steps=timetable.num_ticks,
    bubble=timetable.bubble,
    param_bytes=int(stage_params if stored_over_stages else stage_params * stages),
    microbatch_bytes=a,
    collectives=collectives,
  )


def _num_layers(stack_params: PyTree) -> int:
  """The layers of a stack's params: axis 0 of every leaf, which must agree."""
  leaves = jax.tree_util.tree_leaves_with_path(stack_params)
  if not leaves:
    raise ValueError(
      errors.message(
        "`stack_params` holds no array: pass the stack's params as init "
        "returns them (every leaf stacked over the layers on axis 0)."
      )
    )
  counts: dict[int, str] = {}
  for path, leaf in leaves:
    shape = np.shape(leaf)
    if not shape:
      raise ValueError(
        errors.message(
          f"`stack_params` at {errors.keystr(path)} is a scalar: a stack's "
          "params are stacked over the layers on axis 0. Pass only the "
          "stack's params (e.g. the entries of its name)."
        )
      )
    counts.setdefault(shape[0], errors.keystr(path))
  if len(counts) > 1:
    found = ", ".join(f"{n} at {where}" for n, where in counts.items())
    raise ValueError(
      errors.message(
        f"`stack_params` has leaves of different lengths on axis 0 ({found}): "
        "a stack's params are stacked over its layers, each leaf as long as "
        "the stack. Pass only one stack's params."
      )
    )
  return next(iter(counts))


def _bytes(n: float) -> str:
  """`n` bytes, in the largest unit that keeps it at least 1."""
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if n >= size:
      return f"{n / size:,.2f} {unit}"
  return f"{n:,.0f} B"
