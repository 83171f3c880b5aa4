"""The public config of pipeline parallelism for a layer scan (`Pipeline`): its layers as stages over a mesh axis, its batch in microbatches.

`layer_scan(..., pipeline=Pipeline(axis="stage", microbatches=M))` hands its
scan here at apply (init runs the plain scan, so the params are the plain
scan's: the same names, shapes and initial values). Under a mesh whose axis
`"stage"` has S devices, the N stacked layers run as S stages inside
`jax.shard_map` over that axis (and, for a layer that treats each row on its
own, over the axes the batch is split over, so that the gradient is reduced
over them once per step; the other axes, `model`, stay with `jax.jit`), the
batch split into M microbatches, activations passed from stage to stage with
`jax.lax.ppermute`. A stage runs the layers of each
visit through the stack's own loop (`loop.Loop`, with its remat):

* `schedule="gpipe"`: stage s holds layers [s·N/S, (s+1)·N/S), which a
  layer axis stored over `"stage"` (`ShardingRules(stacked={stack:
  "stage"})`) already puts on it; each microbatch passes the stages once.
  Of the M + S - 1 steps each stage is idle S - 1: a bubble of
  (S-1)/(M+S-1).
* `schedule="circular"`: each microbatch passes the stages `repeats` (R)
  times, N/(S·R) layers per visit: stage s holds the layers of visits s,
  S+s, 2S+s, ... (in model order, these are not one block, so a layer axis
  stored over `"stage"` is permuted between the stages at each step). A step
  is a visit, 1/R of a GPipe step, and the bubble is (S-1)/(R·M+S-1) for
  M ≥ S.

`timetables.timetable(...)` is what both run from: which stage runs which
visit of which microbatch at each step.

Semantics of what goes per microbatch:

* Microbatch m holds the rows m, m+M, m+2M, ... of every carry leaf (axis 0),
  so that each is split over a data axis as the batch is.
* State (BatchNorm-style, one per layer) goes through the microbatches in
  order: microbatch m of layer i reads the state microbatch m-1 left.
* The rng key of layer i (the plain scan's) is folded with the microbatch:
  microbatch m of layer i draws from `jax.random.fold_in(key_i, m)`.
* `xs` are per layer: every microbatch of layer i gets `xs[i]` whole.
* `ys` come back as the plain scan's, `[num_layers, batch, ...]`, each
  microbatch's rows where they were in the batch. With more than one
  microbatch this needs every `y` to have the batch on axis 0 (a value per
  example); a `y` that reduces over the batch is refused.
* With one stage nothing is passed: the timetable runs as a loop, no
  `shard_map`; with one microbatch the carry may hold scalars.

Under Explicit mesh axes (`jax.make_mesh`'s default) every reshape here says
where its result goes (`typed_sharding.py`): a layer axis stored over the
stages stays there (GPipe), a batch split over `data` stays split in each
microbatch where the microbatch is large enough, and is whole on every
device where it is not. jax 0.7 and 0.8 cannot lower the stages' `shard_map`
on a mesh with Explicit axes: `staging.staging_for` refuses it there,
naming the fix. Nor does a `shard_map` close over an array typed by
Explicit axes (an outer param, `jax.device_put` on the mesh): a layer that
does runs in the stages as a jaxpr traced once, those arrays passed in.

This file is the public face: the config. The rest of the package, a file
a job, is entered through `__init__.py`, which names them.
"""

import dataclasses
from typing import Any, Optional

import jax

from haiku_bridge._src import errors
from haiku_bridge._src import modes
from haiku_bridge._src import versions

SCHEDULES = modes.PIPELINE_SCHEDULES


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """How `layer_scan` / `repeat_layer` run their stack as a pipeline.

  Pass it as `pipeline=` and run apply under `jax.set_mesh(mesh)`, a mesh
  with the axis `axis`. The params are the plain scan's: init with or
  without it, train either way, and move checkpoints between them. Example:
  8 layers on 4 stages, 2 devices each for data parallelism:

  >>> from jax.sharding import AxisType, PartitionSpec as P
  >>> # Needs 8 devices (on a CPU: jax.config.update("jax_num_cpu_devices", 8)).
  >>> def block(h):
  ...   return h + jnp.tanh(hk.Linear(16)(h))
  >>> pipe = hkb.Pipeline("stage", microbatches=4)
  >>> pipelined = hk.transform(
  ...     lambda x: hkb.repeat_layer(block, x, 8, pipeline=pipe))
  >>> plain = hk.transform(lambda x: hkb.repeat_layer(block, x, 8))
  >>> x = jax.random.normal(jax.random.PRNGKey(1), [16, 16])
  >>> params = plain.init(jax.random.PRNGKey(0), x)
  >>> mesh = jax.make_mesh((4, 2), ("stage", "data"),
  ...                      axis_types=(AxisType.Explicit,) * 2)
  >>> with jax.set_mesh(mesh):
  ...   y = jax.jit(pipelined.apply)(params, None,
  ...                                jax.device_put(x, P("data")))
  >>> bool(jnp.allclose(y, plain.apply(params, None, x), atol=1e-5))
  True

  Attributes:
    axis: the mesh axis whose devices are the stages.
    microbatches: how many parts the batch (axis 0 of every carry leaf) is
      split into; microbatch m holds rows m, m + M, m + 2M, ...
    schedule: `"gpipe"` (stage s runs the s-th block of N/S layers, each
      microbatch passes once) or `"circular"` (each microbatch passes the
      stages `repeats` times, N/(S·repeats) layers per pass).
    repeats: with `"circular"`, the passes (default: N/S, one layer per
      stage per pass); with `"gpipe"`, None or 1.
  """

  axis: str = "stage"
  microbatches: int = 1
  schedule: modes.PipelineSchedule = "gpipe"
  repeats: Optional[int] = None

  def __post_init__(self):
    with errors.entry("Pipeline"):
      errors.check_str(
        "axis", self.axis, "the name of the mesh axis whose devices are the stages, e.g. \"stage\""
      )
      object.__setattr__(
        self, "microbatches", errors.check_positive_int("microbatches", self.microbatches)
      )
      if self.schedule not in SCHEDULES:
        error = ValueError if isinstance(self.schedule, str) else TypeError
        raise error(errors.bad_argument("schedule", self.schedule, "\"gpipe\" or \"circular\""))
      if self.repeats is not None:
        object.__setattr__(self, "repeats", errors.check_positive_int("repeats", self.repeats))
        if self.schedule == "gpipe" and self.repeats != 1:
          raise ValueError(
            errors.bad_argument(
              "repeats",
              self.repeats,
              "None or 1 with schedule=\"gpipe\"",
              "For several passes over the stages, pass schedule=\"circular\".",
            )
          )
      # Last: a wrong argument is named first, on any jax.
      if not jax_has_pipelines():
        raise NotImplementedError(
          errors.message(
            "a pipeline runs its stages with jax.shard_map under "
            "jax.set_mesh, which jax " + jax.__version__ + " does not have. "
            "Upgrade to jax 0.7 or newer, or train without pipeline=."
          )
        )

  def num_repeats(self, num_layers: int, num_stages: int) -> int:
    """The passes over the stages for a stack of `num_layers` on `num_stages`."""
    if self.repeats is not None:
      return self.repeats
    if self.schedule == "gpipe":
      return 1
    return max(num_layers // num_stages, 1)


def jax_has_pipelines() -> bool:
  """Whether this jax has what a pipeline runs with (jax 0.7 on)."""
  return hasattr(jax, "shard_map") and hasattr(jax, "set_mesh")


def jax_runs_stages_on_explicit_axes() -> bool:
  """Whether this jax runs a `shard_map` manual over one axis of a mesh with Explicit axes (jax 0.9 on)."""
  return versions.release(jax.__version__) >= (0, 9)


def check_pipeline(pipeline: Any) -> Optional[Pipeline]:
  """`layer_scan`'s `pipeline=`: None or a `Pipeline`."""
  if pipeline is not None and not isinstance(pipeline, Pipeline):
    raise TypeError(
      errors.bad_argument(
        "pipeline",
        pipeline,
        "None or an hkb.Pipeline, e.g. hkb.Pipeline(\"stage\", microbatches=4)",
      )
    )
  return pipeline
