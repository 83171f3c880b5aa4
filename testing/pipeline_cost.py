"""What a pipelined training step moves per device, by collective, measured from its compiled HLO and in theory.

The step is a user's (docs/sharding.md, "What a pipelined step costs a
device"): residual MLP blocks under `repeat_layer(..., pipeline=...)`, the
loss after the stack, `jax.value_and_grad` of apply, on a (stage=S,
data=D) mesh, the batch over `"data"`, the params as `init` returns them
(placement `"init"`) or stored over the stages (`"stage"`:
`ShardingRules(stacked={"layers": "stage"})`, `jax.device_put`).

`measured` reads the compiled step's collectives (`hlo_collectives`: each
op's bytes per device times the trip counts of the loops around it) into
`ROWS`; `theory` is the library's cost model (`hkb.pipeline_cost`, whose
docstring says what each should move, per device and step) plus the loss's
float32 mean over `"data"`. `pipeline_cost_test` holds the one to the other.
"""

import dataclasses
from typing import Any, Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import haiku_bridge as hkb
from testing import hlo_collectives

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
  device_mesh: jax.sharding.Mesh
  params: Any  # The stack's, as init returns them: `jax.ShapeDtypeStruct`s.
  carry: jax.ShapeDtypeStruct  # The stack's input.
  pipeline: hkb.Pipeline
  placement: str  # One of PLACEMENTS.

  @property
  def param_bytes(self) -> int:
    """The stack's params' bytes, whole."""
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self.params))

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
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
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
    compiled,
    dict(zip(names, mesh_shape)),
    mesh,
    shapes,
    jax.ShapeDtypeStruct(x.shape, x.dtype),
    pipeline,
    placement,
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
  """What the step should move per device, by row of `ROWS`: the library's cost model and the loss."""
  cost = hkb.pipeline_cost(
    step.pipeline,
    step.device_mesh,
    step.params,
    step.carry,
    stored_over_stages=step.placement == "stage",
    data_axes=("data",),
  )
  out = {row: cost.collectives[row] for row in ROWS}
  out["all-reduce data"] += LOSS_BYTES
  return out


def ratio(measured_bytes: float, theory_bytes: float) -> Optional[float]:
  """Measured over theory; None where theory is 0 (then any byte is too many)."""
  return measured_bytes / theory_bytes if theory_bytes else None
