"""What a pipelined training step moves per device, by collective, measured from its compiled HLO and in theory.

The step is a user's (docs/sharding.md, "What a pipelined step costs a
device"): residual MLP blocks under `repeat_layer(..., pipeline=...)`, the
loss after the stack, `jax.value_and_grad` of apply, on a (stage=S,
data=D) mesh, the batch over `"data"`, the params as `init` returns them
(placement `"init"`) or stored over the stages (`"stage"`:
`ShardingRules(stacked={"layers": "stage"})`, `jax.device_put`).

`measured` reads the compiled step's collectives (`hlo_collectives`: each
op's bytes per device times the trip counts of the loops around it) into
`ROWS`; `theory` says what each should move, per device and step, with P
the stage's params (the stack's bytes over S), a one microbatch's boundary
activations on one device (B/(M·D) rows), T the timetable's steps (M+S-1
for GPipe, (R-1)·max(M, S)+M+S-1 for circular's R passes):

- `collective-permute`: 2·T·a: at each step of the timetable each stage
  sends one microbatch's activations on and their cotangent back; the
  bubble's steps send too (`ppermute` needs every stage at each step), so
  this is (M+S-1)/M of one send per microbatch and pass. For circular
  with params stored over the stages, 2·P more: each stage sends its
  stored layers once to the stages whose visits run them, in R full
  permutations of the stages of P/R each, and the gradient back the same
  way (a group that stays on its stage is sent to itself: an all-to-all
  would count its own chunk too; not every R and S has equal chunks).
- `all-reduce data`: P + 4: the stage's gradient summed over the data
  devices once per step, and the loss's float32 mean.
- `all-reduce stage`: M·a: the stack's output, from the last stage to the
  others (every all-reduce not over `"data"` alone counts here).
- `all-gather`: S·P with params as init returns them (the gradient comes
  back whole on every device, as the plain stack's); none for `"stage"`.
- `all-to-all`: none.
- `reduce-scatter`: none.
"""

import dataclasses
from typing import Any, Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import haiku_bridge as hkb
from haiku_bridge._src import hlo_collectives
from haiku_bridge._src import pipeline as pipeline_lib

LAYERS = 8
ROWS = (
  "all-gather",
  "all-reduce data",
  "all-reduce stage",
  "collective-permute",
  "reduce-scatter",
  "all-to-all",
)
PLACEMENTS = ("init", "stage")
LOSS_BYTES = 4  # The loss's mean over "data": one float32.


def residual_mlp(h: jax.Array) -> jax.Array:
  """A residual MLP block: two Linears, so the params dominate its memory."""
  width = h.shape[-1]
  return h + hk.Linear(width)(jnp.tanh(hk.Linear(width)(h)))


@dataclasses.dataclass(frozen=True)
class Step:
  """A compiled step, and what it is."""

  compiled: Any  # jax.stages.Compiled
  mesh: dict[str, int]  # Axis sizes, in the mesh's order.
  param_bytes: int  # The stack's, whole.
  pipeline: hkb.Pipeline
  placement: str  # One of PLACEMENTS.
  batch: int
  width: int

  @property
  def stage_param_bytes(self) -> float:
    return self.param_bytes / self.mesh["stage"]


def compiled_step(
  mesh_shape: tuple[int, int],
  axis_type: Optional[AxisType],
  width: int,
  pipeline: hkb.Pipeline,
  *,
  placement: str = "init",
  batch: int = 32,
  layer: Callable[[jax.Array], jax.Array] = residual_mlp,
  **options: Any,
) -> Step:
  """The compiled `value_and_grad` step on a (stage, data) mesh of `mesh_shape`.

  `axis_type` None is `jax.make_mesh`'s default (Explicit axes); `options`
  go to `repeat_layer` (`remat=`, `remat_policy=`).
  """

  def loss(x):
    h = hkb.repeat_layer(layer, x, LAYERS, name="layers", pipeline=pipeline, **options)
    return jnp.mean(h**2)

  f = hk.transform(loss)
  x = jnp.ones([batch, width])
  params = f.init(jax.random.PRNGKey(0), x)
  names = ("stage", "data")
  if axis_type is None:
    mesh = jax.make_mesh(mesh_shape, names)
  else:
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(axis_type,) * 2)
  param_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
  with jax.set_mesh(mesh):
    if placement == "stage":
      params = jax.device_put(
        params,
        hkb.param_shardings(params, mesh, hkb.ShardingRules([], stacked={"layers": "stage"})),
      )
    else:
      assert placement == "init", placement
    compiled = (
      jax.jit(jax.value_and_grad(f.apply))
      .lower(params, None, jax.device_put(x, P("data")))
      .compile()
    )
  return Step(
    compiled, dict(zip(names, mesh_shape)), param_bytes, pipeline, placement, batch, width
  )


def measured(step: Step) -> dict[str, int]:
  """The bytes per device of one step, by row of `ROWS`."""
  total = dict.fromkeys(ROWS, 0)
  for c in hlo_collectives.collectives(step.compiled.as_text()):
    row = c.kind
    if c.kind == "all-reduce":
      over_data = hlo_collectives.mesh_axes(c, step.mesh) == ("data",)
      row = "all-reduce data" if over_data else "all-reduce stage"
    total[row] += c.bytes_per_step
  return total


def theory(step: Step) -> dict[str, float]:
  """What the step should move per device, by row of `ROWS` (the module docstring's)."""
  stages, data = step.mesh["stage"], step.mesh["data"]
  m = step.pipeline.microbatches
  repeats = step.pipeline.num_repeats(LAYERS, stages)
  steps = pipeline_lib.timetable(stages, m, repeats).num_steps
  stage_params = step.stage_param_bytes
  # One microbatch's float32 rows on a device.
  microbatch = step.batch // m // data * step.width * 4
  circular_stored = step.pipeline.schedule == "circular" and step.placement == "stage"
  return {
    "all-gather": stages * stage_params if step.placement == "init" else 0,
    "all-reduce data": stage_params + LOSS_BYTES,
    "all-reduce stage": m * microbatch,
    "collective-permute": 2 * steps * microbatch + (2 * stage_params if circular_stored else 0),
    "reduce-scatter": 0,
    "all-to-all": 0,
  }


def ratio(measured_bytes: float, theory_bytes: float) -> Optional[float]:
  """Measured over theory; None where theory is 0 (then any byte is too many)."""
  return measured_bytes / theory_bytes if theory_bytes else None
