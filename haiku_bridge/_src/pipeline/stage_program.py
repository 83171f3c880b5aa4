"""The stage program: what each stage of a pipeline runs inside its `shard_map`, and running it.

`run` runs a layer scan as a pipeline from its `staging.Staging`: the
stack and the batch laid out for the stages (`placement`), a
`jax.shard_map` manual over the stage axis (and over the batch's axes where
the layer is row-wise, `_rows_apart`; the mesh's other axes Auto inside it),
and in it `_StageProgram`, which runs every step of the timetable: the
stage's visit through the stack's own loop (`loop.Loop`, with its remat),
activations passed on with `jax.lax.ppermute`.
"""

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
from jax import lax
from jax.extend import core as jax_core
import jax.numpy as jnp
from jax.sharding import PartitionSpec
import numpy as np

from haiku_bridge._src import errors
from haiku_bridge._src import jaxpr_walk
from haiku_bridge._src import modes
from haiku_bridge._src import remat as remat_lib
from haiku_bridge._src.pipeline import placement as placement_lib
from haiku_bridge._src.pipeline import row_wise
from haiku_bridge._src.pipeline import timetables
from haiku_bridge._src.pipeline import staging as staging_lib
from haiku_bridge._src import typed_sharding
from haiku_bridge._src.pytree import PyTree


def run(
  staging: staging_lib.Staging,
  body: Callable[..., Any],
  carry: PyTree,
  per_layer: PyTree,
  *,
  loop: remat_lib.Loop,
  reverse: bool = False,
  planned_body: Optional[Callable[..., Any]] = None,
) -> tuple[PyTree, PyTree]:
  """`layer_scan`'s loop as a pipeline: `(carry, (ys, state))`, as its scan returns them.

  Args:
    staging: the pipeline, checked and laid out (`staging.staging_for`).
    body: `body(carry, (params, state, key, x)) -> (carry, (y, state))`, one
      layer.
    carry: the first layer's input; axis 0 of every leaf is the batch.
    per_layer: `(params, state, keys, xs)`, each leaf `[num_layers, ...]`
      (keys may be None).
    loop: the stack's loop (`loop.Loop`, its remat), which each stage runs
      over the layers of one visit.
    reverse: run the layers last to first.
    planned_body: what `remat="auto"` plans on, if not `body`
      (`remat_lib.resolved`).

  Returns:
    `(carry, (ys, state))`, as the plain scan returns them: the last layer's
    carry, the `y`s as `[num_layers, batch, ...]`, the state after every
    microbatch.
  """
  placement, batch = staging.placement, staging.batch
  stages, axis = placement.stages, placement.axis
  if reverse:
    per_layer = jax.tree.map(lambda a: jnp.flip(a, 0), per_layer)
  state = per_layer[1]
  staged = jax.tree.map(placement.to_stages, per_layer)
  micro = jax.tree.map(batch.split, carry)
  if loop.remat == modes.REMAT_AUTO:
    loop = stage_loop(loop, planned_body or body, micro, staged, placement.layers)
  program = _StageProgram(body, loop, placement, staging.timetable, batch.microbatches)
  if stages == 1:
    # One stage passes nothing on: the timetable runs as a loop, in place,
    # over arrays typed by the mesh as a `shard_map` would type them (an
    # argument jit got from one device has no mesh in its type).
    staged, micro = typed_sharding.on_mesh((staged, micro))
    out, ys, new_state = program(staged, micro, [])
  else:
    apart = _rows_apart(body, micro, staged, axis)

    def run_stages(
      program: _StageProgram, closed_over: list[jax.Array], check_vma: bool
    ) -> tuple[PyTree, PyTree, PyTree]:
      return _run_on_stages(program, staged, micro, closed_over, axis, apart, check_vma)

    # The layer on one microbatch (a device's rows of one, where each device
    # runs its own) and one layer, traced once with no mesh (None: it needs
    # the mesh to trace, and runs in the stages as it is).
    layer = _layer_jaxpr(body, micro, staged, 1 if apart is None else apart.parts)
    closure = _closure_converted(layer)
    if closure is not None:
      # A layer that closes over an array typed by Explicit mesh axes (an
      # outer param, `jax.device_put` on the mesh), which jax refuses to
      # close over in a `shard_map` (jax-ml/jax#29162): the stages run the
      # layer as a jaxpr, those arrays passed in as arguments.
      converted, closed_over = closure
      closed_over = [typed_sharding.reshard(a, (None,) * np.ndim(a)) for a in closed_over]
      try:
        out, ys, new_state = run_stages(
          dataclasses.replace(program, body=converted), closed_over, False
        )
      except (TypeError, ValueError, NotImplementedError) as e:
        raise NotImplementedError(
          errors.message(
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
            "+ value.shape)), or pass the params to jit as init returns "
            "them, without a jax.device_put on the mesh. (Auto axes do not "
            "help: there jax fails in the backward pass instead.)"
          )
        ) from e
    else:
      # A layer that runs a loop of its own from a constant state
      # (`core.initial_state(batch)`): only the loop's body makes its carry
      # varying over the stages, which jax refuses where it checks varying
      # types. Unchecked, the stages run it as the plain stack does; and so
      # where each device runs the stages on its own rows.
      check_vma = apart is None and (layer is None or not _loops_from_a_constant(layer[0].jaxpr))
      out, ys, new_state = run_stages(program, [], check_vma)
  ys = batch.join_ys(
    jax.tree.map(placement.ys_to_layers, ys),
    lambda: placement_lib.whole_batch_ys(body, carry, per_layer),
  )
  new_state = jax.tree.map(placement.to_layers, new_state, state)
  if reverse:
    ys, new_state = jax.tree.map(lambda a: jnp.flip(a, 0), (ys, new_state))
  # Typed as the plain stack's: a microbatch too small to split over `data`
  # is whole on every device, the batch it came from is not.
  out = jax.tree.map(
    lambda a, c: typed_sharding.reshard(batch.join(a), typed_sharding.spec(c)), out, carry
  )
  return out, (ys, new_state)


def _run_on_stages(
  program: "_StageProgram",
  staged: PyTree,
  micro: PyTree,
  closed_over: list[jax.Array],
  axis: str,
  apart: Optional["_RowsApart"],
  check_vma: bool,
) -> tuple[PyTree, PyTree, PyTree]:
  """`program(staged, micro, closed_over)` in a `jax.shard_map` manual over `axis`.

  With `apart`, manual over the batch's axes too: each device runs the
  stages on its own rows, and the gradients of what every device holds
  whole (the params) are summed over those axes once, by `jax.shard_map`'s
  transpose, after the timetable.
  """
  over_stages = PartitionSpec(axis)
  inputs = (staged, micro, closed_over)
  program = dataclasses.replace(program, unchecked=not check_vma)
  stage_map: Callable[..., Any]
  if apart is None:
    stage_map = jax.shard_map(
      program,
      in_specs=(over_stages, PartitionSpec(), PartitionSpec()),
      out_specs=(PartitionSpec(), over_stages, over_stages),
      axis_names=frozenset({axis}),
      check_vma=check_vma,
    )
    return _on_auto_axes(stage_map, axis, staged, micro, closed_over)
  rows = apart.entry
  micro_specs = jax.tree.map(lambda _: PartitionSpec(None, rows), micro)
  ys_specs = jax.tree.map(
    lambda dim: PartitionSpec(axis, None, None, None, rows) if dim == 0 else over_stages,
    apart.ys,
    is_leaf=_is_none,
  )
  # Unchecked, `jax.shard_map`'s transpose sums each input's gradient over
  # the mesh axes its spec leaves out as it leaves the stages (and,
  # transposed again, each output's), which XLA:CPU cannot do in bfloat16
  # (jaxlib 0.10.2 aborts): all go in and out 32 bits wide.
  widened = _Widened(program, inputs)
  stage_map = jax.shard_map(
    widened,
    in_specs=(over_stages, micro_specs, PartitionSpec()),
    out_specs=(micro_specs, ys_specs, over_stages),
    axis_names=frozenset({axis, *apart.axes}),
    check_vma=check_vma,
  )
  staged, micro, closed_over = _wide(inputs)
  return widened.narrow(_on_auto_axes(stage_map, axis, staged, micro, closed_over, apart.axes))


def stage_loop(
  loop: remat_lib.Loop, body: Callable[..., Any], micro: PyTree, staged: PyTree, layers: int
) -> remat_lib.Loop:
  """The loop every stage runs for `remat="auto"`: planned once, for one visit.

  `memory_budget` is per stage: what one visit's loop (`layers` layers)
  holds on one microbatch, as `remat_plan` counts a loop's (not the
  stage's params, nor what the timetable keeps across visits and
  microbatches). The plan is made here,
  outside the stages' `shard_map`, on one microbatch's carry and one
  visit's layers, unsharded (as `remat_plan` plans every step), so every
  stage and every visit runs the same one, and `_kept_by` sees it.
  """
  # Shapes only: a slice of arrays split over the stages (Explicit axes)
  # would be refused.
  carry = _parts(micro, 1)  # One microbatch.
  visit = _parts(staged, 2)  # One visit's layers.
  return remat_lib.resolved(loop, body, carry, visit, layers)


def _parts(tree: PyTree, axes: int) -> PyTree:
  """The type of one part of each leaf: its shape after the first `axes` axes."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[axes:], a.dtype), tree)


class _RowsApart(NamedTuple):
  """The stages run by hand over the data axes too: each device on its rows of every microbatch."""

  axes: tuple[str, ...]  # The mesh axes the microbatches' rows are split over.
  ys: PyTree  # Each `y`'s row dimension (0, or None: it has no rows).

  @property
  def parts(self) -> int:
    """How many parts the rows are split in."""
    return typed_sharding.axis_size(self.axes)

  @property
  def entry(self) -> typed_sharding.MeshAxes:
    """The split of the rows, as a PartitionSpec entry."""
    return self.axes[0] if len(self.axes) == 1 else self.axes


def _rows_apart(
  body: Callable[..., Any], micro: PyTree, staged: PyTree, axis: str
) -> Optional[_RowsApart]:
  """How the stages run each data device's rows on their own, where they can; else None.

  Where the layer is row-wise (`row_wise.row_dims`), the stages' `shard_map`
  is manual over the axes the microbatches' rows are split over as well as
  the stage axis: each device then sums the gradients of the stage's params
  over its microbatches, and `jax.shard_map`'s transpose reduces them over
  those axes once, after the timetable. Left to the partitioner (those axes
  Auto inside the stages), the gradient of the params is reduced where it
  is made, once per layer per step: XLA keeps no sum unreduced across a loop,
  and jax 0.10.2 types a sum unreduced only over Explicit axes of a
  `shard_map` manual over every axis. The rows' axes are those named by the
  microbatches' types (Explicit axes); on Auto axes, where types name none,
  every other mesh axis, where their devices divide the rows.
  """
  mesh = jax.sharding.get_abstract_mesh()
  leaves = jax.tree.leaves(micro)
  if not leaves or any(np.ndim(a) < 2 for a in leaves):
    return None
  if jax.sharding.AxisType.Explicit in tuple(mesh.axis_types):
    entries = {typed_sharding.spec(a)[1] for a in leaves}
    if len(entries) != 1 or None in entries:
      return None
    (entry,) = entries
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
  else:
    axes = tuple(name for name in mesh.axis_names if name != axis)
  parts = typed_sharding.axis_size(axes) if axes else 1
  if parts == 1 or any(np.shape(a)[1] % parts for a in leaves):
    return None
  carry = _parts(micro, 1)  # One microbatch's.
  scanned = _parts(staged, 3)  # One layer's.
  dims = row_wise.row_dims(body, (carry, scanned), (_rows_of(carry, parts), scanned), parts)
  if dims is None:
    return None
  out, (ys, _) = dims
  # The carry comes back with the microbatch's rows (its type is the
  # carry's); each y has them first or not at all; the state has none (its
  # type is the state's).
  if any(dim not in (0, None) for dim in jax.tree.leaves(ys, is_leaf=_is_none)) or any(
    dim != 0 for dim in jax.tree.leaves(out, is_leaf=_is_none)
  ):
    return None
  return _RowsApart(axes, ys)


def _rows_of(carry: PyTree, parts: int) -> PyTree:
  """The type of a device's rows of `carry` (shapes), its rows split in `parts`."""
  if parts == 1:  # Whole (a scalar leaf too, with one microbatch).
    return carry
  return jax.tree.map(
    lambda a: jax.ShapeDtypeStruct((a.shape[0] // parts,) + a.shape[1:], a.dtype), carry
  )


def _is_none(a: Any) -> bool:
  return a is None


def _on_auto_axes(
  stage_map: Callable[..., Any],
  axis: str,
  staged: PyTree,
  micro: PyTree,
  closed_over: list[jax.Array],
  batch_axes: tuple[str, ...] = (),
) -> tuple[PyTree, PyTree, PyTree]:
  """`stage_map(staged, micro, closed_over)`, the mesh's other Explicit axes Auto inside it.

  jax lowers a `shard_map` manual over some axes of a mesh whose axes are
  all Explicit with its inputs and outputs replicated over the others
  (jax 0.10.2: an all-gather of every input and output split over `data`,
  the residuals of the backward pass included). With those axes Auto for
  the `shard_map`, the partitioner keeps each split as it is, as under an
  Auto mesh; outside, the results are typed again: `out` split as `micro`,
  the state as `staged`'s, a `y` with the microbatch's rows on axis 4 split
  as they are. `batch_axes`, manual in the stages too (`_rows_apart`), stay
  Explicit, and `staged` and `closed_over` come in whole over them.
  """
  mesh = jax.sharding.get_abstract_mesh()
  explicit = jax.sharding.AxisType.Explicit
  others = tuple(
    name
    for name, kind in zip(mesh.axis_names, mesh.axis_types)
    if kind == explicit and name not in (axis, *batch_axes)
  )
  if batch_axes:
    # Manual inside: what they do not split is whole on each of their devices.
    staged, closed_over = jax.tree.map(
      lambda a: typed_sharding.without(a, batch_axes), (staged, closed_over)
    )
  if not others:
    return stage_map(staged, micro, closed_over)
  leaves, tree = jax.tree.flatten((staged, micro, closed_over))
  specs = [typed_sharding.spec(a) for a in leaves]
  with jax.sharding.use_abstract_mesh(
    mesh.update_axis_types({name: jax.sharding.AxisType.Auto for name in others})
  ):
    # Always resharded, so that each type names the mesh of the context.
    args = tree.unflatten(
      [
        jax.sharding.reshard(
          a, PartitionSpec(*(typed_sharding.entry_without(e, others) for e in entries))
        )
        for a, entries in zip(leaves, specs)
      ]
    )
    out, ys, new_state = stage_map(*args)
  # Each leaf split as its counterpart among the inputs.
  micro_specs = [typed_sharding.spec(a) for a in jax.tree.leaves(micro)]
  state_specs = [typed_sharding.spec(a) for a in jax.tree.leaves(staged[1])]

  def typed(a, entries):
    return jax.sharding.reshard(a, PartitionSpec(*entries))

  out = jax.tree.unflatten(
    jax.tree.structure(out),
    [typed(a, entries) for a, entries in zip(jax.tree.leaves(out), micro_specs)],
  )
  new_state = jax.tree.unflatten(
    jax.tree.structure(new_state),
    [typed(a, entries) for a, entries in zip(jax.tree.leaves(new_state), state_specs)],
  )
  rows = [(np.shape(a)[1], entries[1]) for a, entries in zip(jax.tree.leaves(micro), micro_specs)]

  def y_spec(y):
    entries = (axis,) + (None,) * (y.ndim - 1)
    for size, entry in rows:
      if y.ndim > 4 and y.shape[4] == size:
        return entries[:4] + (entry,) + entries[5:]
    return entries

  ys = jax.tree.map(lambda y: typed(y, y_spec(y)), ys)
  return out, ys, new_state


def _layer_jaxpr(
  body: Callable[..., Any], micro: PyTree, staged: PyTree, parts: int
) -> Optional[tuple[Any, Any]]:
  """`body` on one microbatch's rows split in `parts` and one layer, traced with no mesh: `(closed jaxpr, output shapes)`.

  None for a layer that needs the mesh to trace (its own sharding
  annotations).
  """
  carry = _rows_of(_parts(micro, 1), parts)  # A device's rows of one.
  scanned = _parts(staged, 3)  # One layer's.
  try:
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
      return jax.make_jaxpr(body, return_shape=True)(carry, scanned)
  except Exception:  # pylint: disable=broad-except
    return None


def _loops_from_a_constant(jaxpr: Any) -> bool:
  """Whether a loop in the layer's `jaxpr` starts a carry from values its inputs do not reach.

  In a stage every input of the layer (the microbatch, the stage's
  params) varies over the stage axis, and so does every value computed
  from one; a value computed from constants alone does not. A loop (scan
  or while) whose carry starts from such a value while the rest of its
  inputs vary may make that carry varying in its body, which jax refuses
  where it checks varying types. Read off the jaxpr, conservatively: a
  loop inside another construct (a jit, a checkpoint, a cond, a custom
  derivative) counts as one from a constant wherever the construct's
  inputs cannot be matched one to one with its jaxpr's.
  """

  def visit(jaxpr, varying_in) -> bool:
    varying = {v for v, var in zip(jaxpr.invars, varying_in) if var}
    for eqn in jaxpr.eqns:
      ins = [isinstance(v, jax_core.Var) and v in varying for v in eqn.invars]
      loop = _loop_parts(eqn)
      if loop is not None:
        carry, sub, sub_in = loop
        if any(ins) and not all(ins[i] for i in carry):
          return True
        if visit(sub, [ins[i] for i in sub_in]):
          return True
      else:
        for sub in jaxpr_walk.sub_jaxprs(eqn.params):
          if len(sub.invars) == len(ins):
            sub_varying = ins
          elif len(sub.invars) == len(ins) - 1:  # A cond's branch.
            sub_varying = ins[1:]
          else:
            return _has_a_loop(sub)
          if visit(sub, sub_varying):
            return True
      if any(ins):
        varying.update(eqn.outvars)
    return False

  return visit(jaxpr, [True] * len(jaxpr.invars))


def _loop_parts(eqn: Any) -> Optional[tuple[range, Any, list[int]]]:
  """A loop equation's carry inputs, its body, and which inputs its body takes (None: not a loop)."""
  params = eqn.params
  if eqn.primitive.name == "scan":
    consts, carry = row_wise.scan_counts(params)
    return (range(consts, consts + carry), params["jaxpr"].jaxpr, list(range(len(eqn.invars))))
  if eqn.primitive.name == "while":
    cond, body = params["cond_nconsts"], params["body_nconsts"]
    return (
      range(cond + body, len(eqn.invars)),
      params["body_jaxpr"].jaxpr,
      list(range(cond, len(eqn.invars))),
    )
  return None


def _has_a_loop(jaxpr: Any) -> bool:
  return any(_loop_parts(eqn) is not None for eqn in jaxpr_walk.equations(jaxpr))


def _closure_converted(
  layer: Optional[tuple[Any, Any]],
) -> Optional[tuple[Callable[..., Any], list[Any]]]:
  """The layer as a function of the arrays it closes over too, and those arrays.

  `layer` is `_layer_jaxpr`'s. None where it closes over no array whose
  type names Explicit mesh axes, or was not traced (the stages run it as
  it is). A stage evaluates the traced jaxpr, whose closed-over arrays are
  arguments. It is traced with no mesh set, on types that name none: each operation of a
  jaxpr runs again under the mesh it was traced under, and the stage's own
  (its axis Manual, the others Auto) cannot be set outside the
  `shard_map`. So the stages run it with varying types unchecked
  (`check_vma=False`); `jax.shard_map`'s transpose still sums each
  closed-over array's gradient over the stages.
  """
  explicit = jax.sharding.AxisType.Explicit
  if layer is None or explicit not in tuple(jax.sharding.get_abstract_mesh().axis_types):
    return None
  closed, shapes = layer

  def typed_explicit(a: Any) -> bool:
    mesh = jax.typeof(a).sharding.mesh
    return not mesh.empty and explicit in tuple(mesh.axis_types)

  if not any(typed_explicit(a) for a in closed.consts):
    return None
  outputs = jax.tree.structure(shapes)

  def converted(carry, scanned, *closed_over):
    return jax.tree.unflatten(
      outputs, jax.core.eval_jaxpr(closed.jaxpr, closed_over, *jax.tree.leaves((carry, scanned)))
    )

  return converted, list(closed.consts)


@dataclasses.dataclass(frozen=True)
class _StageProgram:
  """What each stage runs (inside the `shard_map`): every step of the timetable."""

  body: Callable[..., Any]
  loop: remat_lib.Loop
  placement: placement_lib.Placement
  timetable: timetables.Timetable
  microbatches: int
  # Run with jax's check of varying types off (`jax.shard_map`'s
  # `check_vma=False`), where the transpose of a `psum` is a `psum`.
  unchecked: bool = False

  def __call__(self, staged, micro, closed_over):
    params, state, keys, xs = jax.tree.map(lambda a: a[0], staged)
    stages, repeats = self.placement.stages, self.placement.repeats
    axis = self.placement.axis
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
      body = _hoisted(
        body,
        _varying(_index(micro, 0), axis),
        jax.tree.map(lambda a: a[0, 0], (params, state, keys, xs)),
      )
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
      visit_keys = (
        None
        if keys is None
        else jax.vmap(lambda k: jax.random.fold_in(k, m))(read_pass(keys, repeat))
      )
      visit = (read_pass(params, repeat), visit_state, visit_keys, read_pass(xs, repeat))
      return self.loop(body, x_in, visit, self.placement.layers)

    if repeats > 1:
      run_visit = jax.checkpoint(
        run_visit, prevent_cse=False, policy=_pass_recomputed((params, xs), _kept_by(self.loop))
      )

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
        returned = _put(returned, came_back_micro, received, came_back & (stage == 0))
        first = _where(repeat == 0, first, _index(returned, m))
      x_in = _where(stage == 0, first, received)
      out, (y, new_state) = run_visit(params, keys, xs, _index(state, repeat), repeat, m, x_in)
      state = _put(state, repeat, new_state, active)
      return (out, returned, state), (out, y)

    loop = (_index(micro, 0), micro, state)
    if passing:
      loop = _varying(loop, axis)
    tables = (t.active, t.repeat, t.microbatch, arrived, arrived_micro)
    (_, _, state), (outs, ys) = lax.scan(step, loop, tuple(jnp.asarray(a) for a in tables))
    m, period = self.microbatches, t.period
    # Each microbatch's output: the last stage's, at its last pass (steps
    # ·P + S - 1 + m).
    last = (repeats - 1) * period + stages - 1
    out = jax.tree.map(lambda a: a[last : last + m], outs)
    if passing:
      out = jax.tree.map(lambda a: _from_stage(a, stage, stages - 1, axis, self.unchecked), out)

    # This stage's ys: at pass r of microbatch m, step r·P + m + stage.
    def visits(a):
      length = (repeats - 1) * period + m
      if passing:
        a = lax.dynamic_slice_in_dim(a, stage, length)
      return jnp.stack([a[r * period : r * period + m] for r in range(repeats)])[None]

    return out, jax.tree.map(visits, ys), jax.tree.map(lambda a: a[None], state)


def _kept_by(loop: remat_lib.Loop) -> Callable[..., bool]:
  """The `jax.checkpoint` policy that keeps what `loop` keeps of a visit.

  Inside `jax.checkpoint`, the outer policy decides for the loop's own
  `jax.checkpoint` too, so it is the loop's: none with `remat=True` (or its
  `remat_policy`), all otherwise (a remat schedule keeps its own few).
  `remat="auto"` is planned before (`stage_loop`): `loop` is its plan.
  """
  assert loop.remat != modes.REMAT_AUTO, (
    "an unplanned remat=\"auto\" loop in a stage: `run` replaces it by "
    "`stage_loop`'s plan, a remat_plan candidate (False, True, \"nested\" "
    "or \"binomial\"), before any stage runs"
  )
  if loop.remat is True:
    return loop.policy or jax.checkpoint_policies.nothing_saveable
  return jax.checkpoint_policies.everything_saveable


def _pass_recomputed(stacked: PyTree, policy: Callable[..., bool]) -> Callable[..., bool]:
  """`policy`, except that one pass's slice of `stacked` is recomputed, never kept.

  A policy sees primitives and their operands' types, not values: the slice
  is the `dynamic_slice` (and its squeeze) of an operand typed as a leaf of
  `stacked`, `[R, L, ...]`.
  """
  shapes = {(a.shape, a.dtype) for a in jax.tree.leaves(stacked)}
  shapes |= {((1,) + shape[1:], dtype) for shape, dtype in shapes}

  def saveable(prim, *avals, **params):
    if (
      prim in (lax.dynamic_slice_p, lax.squeeze_p, lax.reshape_p)
      and (avals[0].shape, avals[0].dtype) in shapes
    ):
      return False
    return policy(prim, *avals, **params)

  return saveable


def _index(tree: PyTree, i) -> PyTree:
  return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _put(tree: PyTree, i, values: PyTree, when) -> PyTree:
  """Each buffer of `tree` with slot `i` set to `values` where `when`."""

  def put(buffer, value):
    old = lax.dynamic_index_in_dim(buffer, i, keepdims=False)
    return lax.dynamic_update_index_in_dim(
      buffer, jnp.where(when, value, old).astype(buffer.dtype), i, 0
    )

  return jax.tree.map(put, tree, values)


def _where(condition, x: PyTree, y: PyTree) -> PyTree:
  return jax.tree.map(lambda a, b: jnp.where(condition, a, b), x, y)


def _from_stage(a: jax.Array, stage, source: int, axis: str, unchecked: bool = False) -> jax.Array:
  """`a` as held by stage `source`, on every stage (an invariant value).

  A sum over the stages of `a` at the source and zeros elsewhere: adding
  zeros is exact, so every stage gets the source's values bit for bit. The
  sum runs in 32 bits at least (XLA:CPU cannot all-reduce bfloat16).
  `unchecked`: its gradient goes back to the source without a collective
  (autodiff's would sum it over the stages again).
  """
  dtype = a.dtype
  a = a.astype(jnp.int32) if dtype == jnp.bool_ else _wide(a)
  if unchecked and jnp.issubdtype(a.dtype, jnp.floating):
    a = _summed_from(a, stage, source, axis)
  else:
    a = lax.psum(jnp.where(stage == source, a, jnp.zeros_like(a)), axis)
  return a.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _summed_from(a: jax.Array, stage: Any, source: int, axis: str) -> Any:
  return lax.psum(jnp.where(stage == source, a, jnp.zeros_like(a)), axis)


def _summed_from_fwd(a, stage, source, axis):
  return _summed_from(a, stage, source, axis), stage


def _summed_from_bwd(source, axis, stage, ct):
  # Unchecked, `jax.shard_map`'s transpose hands each stage the output's
  # cotangent over the stages (it is invariant over them): the source's
  # is that times their number.
  stages = lax.psum(1, axis)
  return jnp.where(stage == source, ct * stages, jnp.zeros_like(ct)), None


_summed_from.defvjp(_summed_from_fwd, _summed_from_bwd)


def _wide(tree: PyTree) -> PyTree:
  """`tree`, its floating leaves narrower than 32 bits (which XLA:CPU cannot all-reduce) as float32."""

  def wide(a):
    if jnp.issubdtype(a.dtype, jnp.floating) and jnp.finfo(a.dtype).bits < 32:
      return a.astype(jnp.float32)
    return a

  return jax.tree.map(wide, tree)


class _Widened:
  """`program`, called and returning with its floating arrays at least 32 bits wide.

  Its arguments are cast back to the dtypes of `inputs` inside; `narrow`
  casts its results back to the dtypes it made them in (known once traced).
  """

  def __init__(self, program: Callable[..., Any], inputs: PyTree):
    self._program, self._inputs = program, inputs
    self._dtypes: Optional[PyTree] = None

  def __call__(self, *args: Any) -> Any:
    outputs = self._program(*jax.tree.map(lambda a, like: a.astype(like.dtype), args, self._inputs))
    self._dtypes = jax.tree.map(lambda a: a.dtype, outputs)
    return _wide(outputs)

  def narrow(self, outputs: PyTree) -> PyTree:
    assert self._dtypes is not None, "narrow before the program was traced"
    return jax.tree.map(lambda a, dtype: a.astype(dtype), outputs, self._dtypes)


def _hoisted(body: Callable[..., Any], carry: PyTree, scanned: PyTree) -> Callable[..., Any]:
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
    varying: Any = getattr(
      getattr(aval, "manual_axis_type", None), "varying", getattr(aval, "vma", frozenset())
    )
    if axis in varying:
      return a
    if hasattr(lax, "pcast"):
      return lax.pcast(a, axis, to="varying")
    return lax.pvary(a, axis)  # type: ignore[attr-defined]  # jax < 0.10

  return jax.tree.map(cast, tree)
