"""Pipeline parallelism for a layer scan: its layers as stages over a mesh axis, its batch in microbatches.

`layer_scan(..., pipeline=Pipeline(axis="stage", microbatches=M))` hands its
scan here at apply (init runs the plain scan, so the params are the plain
scan's: the same names, shapes and initial values). Under a mesh whose axis
`"stage"` has S devices, the N stacked layers run as S stages inside
`jax.shard_map` over that axis alone (the other axes, `data`, `model`, stay
with `jax.jit`), the batch split into M microbatches, activations passed from
stage to stage with `jax.lax.ppermute`. A stage runs the layers of each
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

`schedule(...)` is the timetable that both run from: which stage runs which
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
on a mesh with Explicit axes: `check` refuses it there, naming the fix. Nor
does a `shard_map` close over an array typed by Explicit axes (an outer
param, `jax.device_put` on the mesh): a layer that does runs in the stages
as a jaxpr traced once, those arrays passed in (`_closure_converted`).
"""

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
import numpy as np

from haiku_bridge._src import errors
from haiku_bridge._src import loop as loop_lib
from haiku_bridge._src import modes
from haiku_bridge._src import typed_sharding
from haiku_bridge._src import versions
from haiku_bridge._src.pytree import PyTree

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
      errors.check_str("axis", self.axis, "the name of the mesh axis whose "
                       "devices are the stages, e.g. \"stage\"")
      object.__setattr__(self, "microbatches", errors.check_positive_int(
          "microbatches", self.microbatches))
      if self.schedule not in SCHEDULES:
        error = ValueError if isinstance(self.schedule, str) else TypeError
        raise error(errors.bad_argument(
            "schedule", self.schedule, "\"gpipe\" or \"circular\""))
      if self.repeats is not None:
        object.__setattr__(self, "repeats", errors.check_positive_int(
            "repeats", self.repeats))
        if self.schedule == "gpipe" and self.repeats != 1:
          raise ValueError(errors.bad_argument(
              "repeats", self.repeats, "None or 1 with schedule=\"gpipe\"",
              "For several passes over the stages, pass "
              "schedule=\"circular\"."))
      # Last: a wrong argument is named first, on any jax.
      if not jax_has_pipelines():
        raise NotImplementedError(errors.message(
            "a pipeline runs its stages with jax.shard_map under "
            "jax.set_mesh, which jax " + jax.__version__ + " does not have. "
            "Upgrade to jax 0.7 or newer, or train without pipeline=."))

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
    raise TypeError(errors.bad_argument(
        "pipeline", pipeline, "None or an hkb.Pipeline, e.g. "
        "hkb.Pipeline(\"stage\", microbatches=4)"))
  return pipeline


class Schedule(NamedTuple):
  """The timetable: at each step, each stage runs one visit of a microbatch, or idles.

  A microbatch visits the stages 0, 1, ..., S-1 in turn, `repeats` times
  (passes). Visits are numbered in periods of P = max(M, S) steps, visit
  `k = r·P + m` being pass r of microbatch m, and stage s runs visit k at
  step k + s. So pass r + 1 of a microbatch reaches stage 0 no earlier than
  pass r leaves stage S - 1. An idle slot (k < 0, r ≥ repeats, m ≥ M) still
  computes, on a real microbatch, and its result is masked out: it is the
  bubble.

  Attributes:
    active: `[steps, stages]` bool, whether the stage runs a visit.
    repeat: `[steps, stages]`, the pass of that visit (clipped where idle).
    microbatch: `[steps, stages]`, its microbatch (clipped where idle).
    period: P, the steps between two passes of a microbatch at one stage.
  """
  active: np.ndarray
  repeat: np.ndarray
  microbatch: np.ndarray
  period: int

  @property
  def num_steps(self) -> int:
    return self.active.shape[0]

  @property
  def bubble(self) -> float:
    """Idle stage-steps over all stage-steps."""
    return float(1 - self.active.mean())

  def step_of(self, stage: Any, repeat: Any, microbatch: Any) -> Any:
    """The step at which `stage` runs pass `repeat` of `microbatch` (ints or arrays)."""
    return repeat * self.period + microbatch + stage


def schedule(num_stages: int, microbatches: int, repeats: int = 1) -> Schedule:
  """The timetable of `num_stages` stages, `microbatches` microbatches, `repeats` passes.

  >>> from haiku_bridge._src import pipeline
  >>> gpipe = pipeline.schedule(4, 8)
  >>> gpipe.num_steps, round(gpipe.bubble, 4), round(3 / (8 + 3), 4)
  (11, 0.2727, 0.2727)
  >>> circular = pipeline.schedule(4, 8, repeats=2)
  >>> circular.num_steps, round(circular.bubble, 4), round(3 / (2 * 8 + 3), 4)
  (19, 0.1579, 0.1579)
  >>> circular.active.astype(int)[:10].T  # Stage 0 starts pass 1 at step 8.
  array([[1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
         [0, 1, 1, 1, 1, 1, 1, 1, 1, 1],
         [0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
         [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
  """
  period = max(microbatches, num_stages)
  steps = (repeats - 1) * period + microbatches + num_stages - 1
  visit = np.arange(steps)[:, None] - np.arange(num_stages)[None, :]
  repeat, micro = np.divmod(np.maximum(visit, 0), period)
  active = (visit >= 0) & (repeat < repeats) & (micro < microbatches)
  return Schedule(active, np.minimum(repeat, repeats - 1),
                  np.minimum(micro, microbatches - 1), period)


# ---------------------------------------------------------------------------
# Running a layer scan as a pipeline.
# ---------------------------------------------------------------------------


def check(pipeline: Pipeline, carry: PyTree, num_layers: int, *,
          require_mesh: bool) -> Optional[int]:
  """The pipeline against the mesh, the stack and the batch; its stage count.

  Without a mesh, returns None, or with `require_mesh` raises.
  """
  names, sizes = _mesh_axes()
  if pipeline.axis not in names:
    if not names and not require_mesh:
      return None
    where = (f"the mesh has axes {names}" if names else "no mesh is set")
    raise ValueError(errors.message(
        f"`pipeline.axis` is {pipeline.axis!r}, but {where}. Run the step "
        f"under `jax.set_mesh(mesh)`, with a mesh that has an axis "
        f"{pipeline.axis!r} for the stages (e.g. jax.make_mesh((4, 2), "
        f"({pipeline.axis!r}, 'data')))."))
  stages = sizes[names.index(pipeline.axis)]
  explicit = [name for name in names if typed_sharding.is_explicit(name)]
  if stages > 1 and explicit and not jax_runs_stages_on_explicit_axes():
    raise NotImplementedError(errors.message(
        f"the mesh's axes {tuple(explicit)} are Explicit, and jax "
        f"{jax.__version__} cannot run a pipeline's stages (a jax.shard_map "
        f"manual over {pipeline.axis!r}) on a mesh with Explicit axes: it "
        "refuses the shard_map's specs (\"Tuple subset of PartitionSpec "
        "cannot contain Manual mixed with ... Explicit\"). Upgrade to jax "
        "0.9 or newer, or make the mesh's axes Auto "
        "(jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * "
        "len(names)))."))
  repeats = pipeline.num_repeats(num_layers, stages)
  if num_layers % (stages * repeats):
    split = (f"{stages} stages" if repeats == 1 else
             f"{stages} stages × {repeats} passes (`pipeline.repeats`)")
    raise ValueError(errors.message(
        f"`num_layers` is {num_layers}, which does not split into {split}: "
        f"the pipeline runs {stages * repeats} equal groups of layers, and "
        f"{stages * repeats} does not divide {num_layers}. Pass a number of "
        f"layers that {stages * repeats} divides"
        + (", or other `repeats`." if repeats > 1 else
           f", or a mesh axis {pipeline.axis!r} of a size that divides it.")))
  microbatches = pipeline.microbatches
  if microbatches == 1:
    return stages  # The whole carry is the one microbatch, scalars too.
  for path, leaf in jax.tree_util.tree_leaves_with_path(carry):
    shape = np.shape(leaf)
    if not shape:
      raise ValueError(errors.message(
          f"the carry at {errors.keystr(path)} is a scalar, with no batch "
          f"axis: the pipeline splits axis 0 of every carry leaf (the batch) "
          f"into `pipeline.microbatches`={microbatches} microbatches. Give "
          "that leaf a batch axis (a value per example), or pass "
          "microbatches=1."))
    if shape[0] % microbatches:
      raise ValueError(errors.message(
          f"the carry at {errors.keystr(path)} has shape {shape}; the "
          f"pipeline splits axis 0 of every carry leaf (the batch) into "
          f"`pipeline.microbatches`={microbatches} microbatches, and "
          f"{microbatches} does not divide {shape[0]}. Pass a batch that "
          f"{microbatches} divides, or other `microbatches`."))
  return stages


def run(pipeline: Pipeline, stages: int, body: Callable[..., Any],
        carry: PyTree, per_layer: PyTree, *, num_layers: int,
        loop: loop_lib.Loop, reverse: bool = False) -> tuple[PyTree, PyTree]:
  """`layer_scan`'s loop as a pipeline: `(carry, (ys, state))`, as its scan returns them.

  Args:
    pipeline: the pipeline.
    stages: the stages, as `check` found them (which checks the rest).
    body: `body(carry, (params, state, key, x)) -> (carry, (y, state))`, one
      layer.
    carry: the first layer's input; axis 0 of every leaf is the batch.
    per_layer: `(params, state, keys, xs)`, each leaf `[num_layers, ...]`
      (keys may be None).
    num_layers: N.
    loop: the stack's loop (`loop.Loop`, its remat), which each stage runs
      over the layers of one visit.
    reverse: run the layers last to first.

  Returns:
    `(carry, (ys, state))`, as the plain scan returns them: the last layer's
    carry, the `y`s as `[num_layers, batch, ...]`, the state after every
    microbatch.
  """
  repeats = pipeline.num_repeats(num_layers, stages)
  layout = _Layout(pipeline.axis, stages, repeats,
                   num_layers // (stages * repeats),
                   stages > 1 and typed_sharding.is_explicit(pipeline.axis))
  batch = _Batch(pipeline.microbatches, pipeline.axis)
  if reverse:
    per_layer = jax.tree.map(lambda a: jnp.flip(a, 0), per_layer)
  state = per_layer[1]
  program = _StageProgram(body, loop, layout,
                          schedule(stages, pipeline.microbatches, repeats),
                          pipeline.microbatches)
  staged = jax.tree.map(layout.to_stages, per_layer)
  micro = jax.tree.map(batch.split, carry)
  if stages == 1:
    # One stage passes nothing on: the timetable runs as a loop, in place,
    # over arrays typed by the mesh as a `shard_map` would type them (an
    # argument jit got from one device has no mesh in its type).
    staged, micro = typed_sharding.on_mesh((staged, micro))
    out, ys, new_state = program(staged, micro, [])
  else:
    over_stages = PartitionSpec(pipeline.axis)

    def run_stages(program: _StageProgram, closed_over: list[jax.Array],
                   check_vma: bool) -> tuple[PyTree, PyTree, PyTree]:
      stage_map = jax.shard_map(
          program, in_specs=(over_stages, PartitionSpec(), PartitionSpec()),
          out_specs=(PartitionSpec(), over_stages, over_stages),
          axis_names=frozenset({pipeline.axis}), check_vma=check_vma)
      return _on_auto_axes(stage_map, pipeline.axis, staged, micro,
                           closed_over)

    closure = _closure_converted(body, micro, staged)
    if closure is not None:
      # A layer that closes over an array typed by Explicit mesh axes (an
      # outer param, `jax.device_put` on the mesh), which jax refuses to
      # close over in a `shard_map` (jax-ml/jax#29162): the stages run the
      # layer as a jaxpr, those arrays passed in as arguments.
      converted, closed_over = closure
      closed_over = [typed_sharding.reshard(a, (None,) * np.ndim(a))
                     for a in closed_over]
      try:
        out, ys, new_state = run_stages(
            dataclasses.replace(program, body=converted), closed_over, False)
      except (TypeError, ValueError, NotImplementedError) as e:
        raise NotImplementedError(errors.message(
            "the layer closes over arrays made outside the stack and typed "
            "by the mesh's Explicit axes (e.g. an hk.get_parameter of the "
            "enclosing module, with the params jax.device_put on the mesh). "
            f"jax {jax.__version__} cannot close over those in the "
            "jax.shard_map that runs the stages (jax-ml/jax#29162), so the "
            "stages run the layer as a jaxpr with them as arguments, and "
            "this layer's jaxpr keeps their types inside (it passes them "
            "into a jax.lax.scan, cond or jit of its own): "
            f"{type(e).__name__}. Pass them to the layers as inputs "
            "(layer_scan's `xs`, e.g. jnp.broadcast_to(value, (num_layers,) "
            "+ value.shape)), make the mesh's axes Auto (jax.make_mesh("
            "shape, names, axis_types=(AxisType.Auto,) * len(names))), or "
            "pass the params to jit without a jax.device_put on the "
            "mesh.")) from e
    else:
      try:
        out, ys, new_state = run_stages(program, [], True)
      except TypeError as e:
        # A layer that runs a scan of its own from a constant state
        # (`core.initial_state(batch)`): only the scan's body makes its
        # carry varying over the stages, which jax refuses where it checks
        # varying types. Unchecked, the stages run it as the plain stack
        # does.
        if not _is_varying_carry_error(e):
          raise
        out, ys, new_state = run_stages(program, [], False)
  ys = batch.join_ys(jax.tree.map(layout.ys_to_layers, ys),
                     lambda: _whole_batch_ys(body, carry, per_layer))
  new_state = jax.tree.map(layout.to_layers, new_state, state)
  if reverse:
    ys, new_state = jax.tree.map(lambda a: jnp.flip(a, 0), (ys, new_state))
  return jax.tree.map(batch.join, out), (ys, new_state)


def _on_auto_axes(stage_map: Callable[..., Any], axis: str, staged: PyTree,
                  micro: PyTree, closed_over: list[jax.Array]
                  ) -> tuple[PyTree, PyTree, PyTree]:
  """`stage_map(staged, micro, closed_over)`, the mesh's other Explicit axes Auto inside it.

  jax lowers a `shard_map` manual over some axes of a mesh whose axes are
  all Explicit with its inputs and outputs replicated over the others
  (jax 0.10.2: an all-gather of every input and output split over `data`,
  the residuals of the backward pass included). With those axes Auto for
  the `shard_map`, the partitioner keeps each split as it is, as under an
  Auto mesh; outside, the results are typed again: `out` split as `micro`,
  the state as `staged`'s, a `y` with the microbatch's rows on axis 4 split
  as they are.
  """
  mesh = jax.sharding.get_abstract_mesh()
  explicit = jax.sharding.AxisType.Explicit
  others = tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                 if kind == explicit and name != axis)
  if not others:
    return stage_map(staged, micro, closed_over)
  leaves, tree = jax.tree.flatten((staged, micro, closed_over))
  specs = [typed_sharding.spec(a) for a in leaves]
  with jax.sharding.use_abstract_mesh(mesh.update_axis_types(
      {name: jax.sharding.AxisType.Auto for name in others})):
    # Always resharded, so that each type names the mesh of the context.
    args = tree.unflatten([
        jax.sharding.reshard(a, PartitionSpec(*(
            typed_sharding.entry_without(e, others) for e in entries)))
        for a, entries in zip(leaves, specs)])
    out, ys, new_state = stage_map(*args)
  # Each leaf split as its counterpart among the inputs.
  micro_specs = [typed_sharding.spec(a) for a in jax.tree.leaves(micro)]
  state_specs = [typed_sharding.spec(a) for a in jax.tree.leaves(staged[1])]
  def typed(a, entries):
    return jax.sharding.reshard(a, PartitionSpec(*entries))

  out = jax.tree.unflatten(jax.tree.structure(out), [
      typed(a, entries)
      for a, entries in zip(jax.tree.leaves(out), micro_specs)])
  new_state = jax.tree.unflatten(jax.tree.structure(new_state), [
      typed(a, entries)
      for a, entries in zip(jax.tree.leaves(new_state), state_specs)])
  rows = [(np.shape(a)[1], entries[1]) for a, entries in zip(
      jax.tree.leaves(micro), micro_specs)]

  def y_spec(y):
    entries = (axis,) + (None,) * (y.ndim - 1)
    for size, entry in rows:
      if y.ndim > 4 and y.shape[4] == size:
        return entries[:4] + (entry,) + entries[5:]
    return entries

  ys = jax.tree.map(lambda y: typed(y, y_spec(y)), ys)
  return out, ys, new_state


def _is_varying_carry_error(error: TypeError) -> bool:
  """Whether jax refused a loop whose carry its body made varying over an axis."""
  text = str(error)
  return "carry input and carry output must have equal types" in text and (
      "pcast" in text or "pvary" in text)


def _closure_converted(body: Callable[..., Any], micro: PyTree, staged: PyTree
                       ) -> Optional[tuple[Callable[..., Any], list[Any]]]:
  """`body` as a function of the arrays it closes over too, and those arrays.

  None where it closes over no array whose type names Explicit mesh axes
  (the stages run it as it is). `body` is traced once, here, to a jaxpr
  whose closed-over arrays are arguments; a stage evaluates that jaxpr. It
  is traced with no mesh set, on types that name none: each operation of a
  jaxpr runs again under the mesh it was traced under, and the stage's own
  (its axis Manual, the others Auto) cannot be set outside the
  `shard_map`. So the stages run it with varying types unchecked
  (`check_vma=False`); `jax.shard_map`'s transpose still sums each
  closed-over array's gradient over the stages.
  """
  explicit = jax.sharding.AxisType.Explicit
  if explicit not in tuple(jax.sharding.get_abstract_mesh().axis_types):
    return None

  def part(a: jax.Array, axes: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape[axes:], a.dtype)

  carry = jax.tree.map(lambda a: part(a, 1), micro)  # One microbatch's.
  scanned = jax.tree.map(lambda a: part(a, 3), staged)  # One layer's.
  try:
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
      closed, shapes = jax.make_jaxpr(body, return_shape=True)(carry,
                                                               scanned)
  except Exception:  # pylint: disable=broad-except
    # A layer that needs the mesh to trace (its own sharding
    # annotations): the stages run it as it is, as they did before.
    return None

  def typed_explicit(a: Any) -> bool:
    mesh = jax.typeof(a).sharding.mesh
    return not mesh.empty and explicit in tuple(mesh.axis_types)

  if not any(typed_explicit(a) for a in closed.consts):
    return None
  outputs = jax.tree.structure(shapes)

  def converted(carry, scanned, *closed_over):
    return jax.tree.unflatten(outputs, jax.core.eval_jaxpr(
        closed.jaxpr, closed_over, *jax.tree.leaves((carry, scanned))))
  return converted, list(closed.consts)


def _whole_batch_ys(body: Callable[..., Any], carry: PyTree,
                    per_layer: PyTree) -> PyTree:
  """The shapes of the first layer's `y` for the whole batch, as the plain scan has them."""
  def first_layer(carry, per_layer):
    # Abstract: the whole stack replicated costs nothing here.
    first = jax.tree.map(
        lambda a: typed_sharding.reshard(a, (None,) * a.ndim)[0], per_layer)
    return body(carry, first)[1][0]
  return jax.eval_shape(first_layer, carry, per_layer)


@dataclasses.dataclass(frozen=True)
class _Batch:
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
      return self.join(a, 1)

    return jax.tree_util.tree_map_with_path(join, ys, whole_batch())


@dataclasses.dataclass(frozen=True)
class _Layout:
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
    entries = typed_sharding.spec(a)
    rest = tuple(typed_sharding.entry_without(e, (self.axis,))
                 for e in entries[1:])
    shape = (self.stages, self.repeats, self.layers) + a.shape[1:]
    if self.explicit and self.repeats == 1 and entries == (self.axis,) + rest:
      # A layer axis stored over the stages: each holds its GPipe block.
      return jnp.reshape(a, shape, out_sharding=PartitionSpec(
          self.axis, None, None, *rest))
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
    a = typed_sharding.without(a, (self.axis,))
    a = jnp.swapaxes(a, 0, 1).reshape(like.shape)
    return typed_sharding.reshard(a, entries)

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


@dataclasses.dataclass(frozen=True)
class _StageProgram:
  """What each stage runs (inside the `shard_map`): every step of the timetable."""
  body: Callable[..., Any]
  loop: loop_lib.Loop
  layout: _Layout
  timetable: Schedule
  microbatches: int

  def __call__(self, staged, micro, closed_over):
    params, state, keys, xs = jax.tree.map(lambda a: a[0], staged)
    stages, repeats = self.layout.stages, self.layout.repeats
    axis = self.layout.axis
    passing = stages > 1  # Stages pass activations over the mesh axis.
    stage = lax.axis_index(axis) if passing else 0
    t = self.timetable
    # What reaches stage 0 at step i left stage S - 1 at step i - 1.
    arrived = np.concatenate([[False], t.active[:-1, -1]])
    arrived_micro = np.concatenate([[0], t.microbatch[:-1, -1]])
    to_next = [(s, (s + 1) % stages) for s in range(stages)]
    # `closed_over`: the arrays `body` takes last, where it is
    # `_closure_converted` (else none).
    body = lambda carry, scanned: self.body(carry, scanned, *closed_over)
    if passing:
      body = _hoisted(body, _varying(_index(micro, 0), axis),
                      jax.tree.map(lambda a: a[0, 0],
                                   (params, state, keys, xs)))
    # What a visit reads of the stage's params (and keys, xs) must not be a
    # value of the step: the backward pass would keep a copy of it per step
    # (the stage's params times the steps). With one pass the visit reads
    # them whole, a constant of the loop, kept once. With several, the pass
    # read is a value of the step, so the visit runs under `jax.checkpoint`
    # whose policy recomputes that slice in the backward pass and keeps the
    # rest as the stack's loop would.
    if repeats == 1:
      params, keys, xs = jax.tree.map(lambda a: a[0], (params, keys, xs))
      read_pass = lambda tree, repeat: tree
    else:
      read_pass = _index

    def run_visit(params, keys, xs, visit_state, repeat, m, x_in):
      visit_keys = None if keys is None else jax.vmap(
          lambda k: jax.random.fold_in(k, m))(read_pass(keys, repeat))
      visit = (read_pass(params, repeat), visit_state, visit_keys,
               read_pass(xs, repeat))
      return self.loop(body, x_in, visit, self.layout.layers)

    if repeats > 1:
      run_visit = jax.checkpoint(
          run_visit, prevent_cse=False,
          policy=_pass_recomputed((params, xs), _kept_by(self.loop)))

    def step(loop, table):
      previous, returned, state = loop
      active, repeat, m, came_back, came_back_micro = table
      if passing:
        active, repeat, m = active[stage], repeat[stage], m[stage]
        received = lax.ppermute(previous, axis, to_next)
      else:
        active, repeat, m, received = active[0], repeat[0], m[0], previous
      first = _index(micro, m)
      if repeats > 1:
        # Stage 0 keeps each microbatch that comes back from the last stage
        # until its next pass (P - S steps later).
        returned = _put(returned, came_back_micro, received,
                        came_back & (stage == 0))
        first = _where(repeat == 0, first, _index(returned, m))
      x_in = _where(stage == 0, first, received)
      out, (y, new_state) = run_visit(params, keys, xs, _index(state, repeat),
                                      repeat, m, x_in)
      state = _put(state, repeat, new_state, active)
      return (out, returned, state), (out, y)

    loop = (_index(micro, 0), micro, state)
    if passing:
      loop = _varying(loop, axis)
    tables = (t.active, t.repeat, t.microbatch, arrived, arrived_micro)
    (_, _, state), (outs, ys) = lax.scan(
        step, loop, tuple(jnp.asarray(a) for a in tables))
    m, period = self.microbatches, t.period
    # Each microbatch's output: the last stage's, at its last pass (steps
    # ·P + S - 1 + m).
    last = (repeats - 1) * period + stages - 1
    out = jax.tree.map(lambda a: a[last:last + m], outs)
    if passing:
      out = jax.tree.map(
          lambda a: _from_stage(a, stage, stages - 1, axis), out)

    # This stage's ys: at pass r of microbatch m, step r·P + m + stage.
    def visits(a):
      length = (repeats - 1) * period + m
      if passing:
        a = lax.dynamic_slice_in_dim(a, stage, length)
      return jnp.stack([a[r * period:r * period + m]
                        for r in range(repeats)])[None]

    return out, jax.tree.map(visits, ys), jax.tree.map(lambda a: a[None],
                                                       state)


def _kept_by(loop: loop_lib.Loop) -> Callable[..., bool]:
  """The `jax.checkpoint` policy that keeps what `loop` keeps of a visit.

  Inside `jax.checkpoint`, the outer policy decides for the loop's own
  `jax.checkpoint` too, so it is the loop's: none with `remat=True` (or its
  `remat_policy`), all otherwise (a remat schedule keeps its own few).
  """
  if loop.remat is True:
    return loop.policy or jax.checkpoint_policies.nothing_saveable
  return jax.checkpoint_policies.everything_saveable


def _pass_recomputed(stacked: PyTree, policy: Callable[..., bool]
                     ) -> Callable[..., bool]:
  """`policy`, except that one pass's slice of `stacked` is recomputed, never kept.

  A policy sees primitives and their operands' types, not values: the slice
  is the `dynamic_slice` (and its squeeze) of an operand typed as a leaf of
  `stacked`, `[R, L, ...]`.
  """
  shapes = {(a.shape, a.dtype) for a in jax.tree.leaves(stacked)}
  shapes |= {((1,) + shape[1:], dtype) for shape, dtype in shapes}

  def saveable(prim, *avals, **params):
    if (prim in (lax.dynamic_slice_p, lax.squeeze_p, lax.reshape_p) and
        (avals[0].shape, avals[0].dtype) in shapes):
      return False
    return policy(prim, *avals, **params)
  return saveable


def _mesh_axes() -> tuple[tuple[str, ...], tuple[int, ...]]:
  """The names and sizes of the axes of the mesh set by `jax.set_mesh`."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return (), ()
  return tuple(mesh.axis_names), tuple(mesh.axis_sizes)


def _index(tree: PyTree, i) -> PyTree:
  return jax.tree.map(
      lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _put(tree: PyTree, i, values: PyTree, when) -> PyTree:
  """Each buffer of `tree` with slot `i` set to `values` where `when`."""
  def put(buffer, value):
    old = lax.dynamic_index_in_dim(buffer, i, keepdims=False)
    return lax.dynamic_update_index_in_dim(
        buffer, jnp.where(when, value, old).astype(buffer.dtype), i, 0)
  return jax.tree.map(put, tree, values)


def _where(condition, x: PyTree, y: PyTree) -> PyTree:
  return jax.tree.map(lambda a, b: jnp.where(condition, a, b), x, y)


def _from_stage(a: jax.Array, stage, source: int, axis: str) -> jax.Array:
  """`a` as held by stage `source`, on every stage (an invariant value).

  A sum over the stages of `a` at the source and zeros elsewhere: adding
  zeros is exact, so every stage gets the source's values bit for bit. The
  sum runs in 32 bits at least (XLA:CPU cannot all-reduce bfloat16).
  """
  dtype = a.dtype
  if dtype == jnp.bool_:
    wide = jnp.int32
  elif jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
    wide = jnp.float32
  else:
    wide = dtype
  a = a.astype(wide)
  a = lax.psum(jnp.where(stage == source, a, jnp.zeros_like(a)), axis)
  return a.astype(dtype)


def _hoisted(body: Callable[..., Any], carry: PyTree,
             scanned: PyTree) -> Callable[..., Any]:
  """`body`, the arrays it closes over passed in as copies made inside the stage.

  A layer may close over values from outside the `shard_map` (an outer
  param it scales by). Autodiff would make their cotangents inside it with
  the outer mesh's sharding, which the manual stage axis contradicts; a copy
  made here has this stage's type (its cotangent leaves through the copy,
  summed over the stages as it crosses the `shard_map`).
  """
  converted, consts = jax.closure_convert(body, carry, scanned)
  consts = [jnp.copy(c) for c in consts]
  return lambda carry, scanned: converted(carry, scanned, *consts)


def _varying(tree: PyTree, axis: str) -> PyTree:
  """`tree` typed as varying over `axis`, as the loop's carry becomes."""
  def cast(a):
    aval = jax.typeof(a)
    # jax >= 0.10 keeps the varying axes in `manual_axis_type`, before in `vma`.
    varying: Any = getattr(getattr(aval, "manual_axis_type", None), "varying",
                           getattr(aval, "vma", frozenset()))
    if axis in varying:
      return a
    if hasattr(lax, "pcast"):
      return lax.pcast(a, axis, to="varying")
    return lax.pvary(a, axis)  # type: ignore[attr-defined]  # jax < 0.10
  return jax.tree.map(cast, tree)
