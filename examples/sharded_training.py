r"""Sharded training of a Haiku model: a custom-VJP block and a scanned stack.

The scenario. A small regression network: an embedding, then an MLP block
with a hand-written backward pass (a `jax.custom_vjp` that keeps only the
pre-activation and recomputes the rest, to save memory), then a stack of
residual layers run under `jax.lax.scan`, then a readout. It trains on a 2-D
`(data, model)` mesh of 8 devices: the batch is split over `data`, and both
MLPs are split Megatron-style over `model` (first weight by columns, second
by rows), so each device holds a quarter of the hidden units.

Haiku alone has two gaps here: a custom VJP needs its weights as arguments,
and so does a scan over layers. The bridge fills both: `hkb.call_pure` runs
the custom-VJP block with its weights explicit, and `repeat_layer` scans the
stack with stacked weights. Both are ordinary Haiku params, named by path
(`custom_mlp/w1`, `blocks/up/w`, ...), so one table of rules says where every
weight goes, with the stacked ones written per layer:

    RULES = ShardingRules([(r"custom_mlp/w1$", P(None, "model")), ...],
                          stacked=["blocks"])

`param_shardings` turns the rules and `jax.eval_shape(init)` into
`NamedSharding`s: the `out_shardings` of the jitted init (each weight is
created on its devices) and the `in_shardings` / `out_shardings` of the
jitted SGD step (weights stay where they are, step after step).

Both kinds of mesh axes work: `--axis_type=explicit` (what `jax.make_mesh`
gives by default) makes the shardings part of the types, so the two matmuls
that contract a split dimension name their output's sharding
(`out_sharding=`); with `--axis_type=auto` they are hints to XLA.

Run it from a checkout, with haiku_bridge and what the examples import
installed (`pip install ".[examples]"`, once; on a CPU, the 8 devices are
simulated by XLA):

    python examples/sharded_training.py

(from any other directory, with the file's path), or with Bazel:

    bazel run //examples:sharded_training

As N processes (`jax.distributed`, one per host; here two on localhost, each
with 4 of the 8 CPU devices), run one command per process:

    python examples/sharded_training.py --num_processes=2 \
        --process_id=0 --coordinator_address=localhost:12355 &
    python examples/sharded_training.py --num_processes=2 \
        --process_id=1 --coordinator_address=localhost:12355

Each process feeds its own rows of the batch
(`jax.make_array_from_process_local_data`) and holds only its devices'
shards of the params; the losses and the trained params are those of the
one-process run.
"""

from typing import Any, Iterator, Optional

from absl import app
from absl import flags
import haiku as hk
import haiku_bridge as hkb
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

# As a module (`python -m examples.sharded_training`, the tests, Bazel's library) or as a
# file (`python examples/sharded_training.py`: the file's folder is first on sys.path,
# and "examples" may name dm-haiku's own examples, which its wheel installs).
if __package__:
  from examples import jax_logging
  from examples import processes
else:
  import jax_logging  # pylint: disable=g-import-not-at-top
  import processes  # pylint: disable=g-import-not-at-top


_NUM_STEPS = flags.DEFINE_integer("num_steps", 100, "SGD steps to run.")
_AXIS_TYPE = flags.DEFINE_enum(
  "axis_type",
  "auto",
  ["auto", "explicit"],
  "Mesh axis type: shardings as hints to XLA, or part of the types.",
)

Params = Any
Batch = tuple[jax.Array, jax.Array]

IN_FEATURES = 16
WIDTH = 32
HIDDEN = 128
OUT_FEATURES = 8
NUM_LAYERS = 3
BATCH_SIZE = 64
LEARNING_RATE = 0.05
MESH_SHAPE = {"data": 2, "model": 4}
NUM_DEVICES = 8

# Where each weight goes. Patterns are searched in the full Haiku path; the
# stack's weights (`blocks/...`, with a leading layer axis) are written per
# layer. What no rule names (the embedding, the readout, `b2`) is replicated.
RULES = hkb.ShardingRules(
  [
    (r"custom_mlp/w1$", P(None, "model")),  # Column split...
    (r"custom_mlp/b1$", P("model")),
    (r"custom_mlp/w2$", P("model", None)),  # ...then row split.
    (r"blocks/up/w$", P(None, "model")),
    (r"blocks/up/b$", P("model")),
    (r"blocks/down/w$", P("model", None)),
  ],
  stacked=["blocks"],
)

# ---------------------------------------------------------------------------
# The custom-VJP block: a pure function of explicit weights.
# ---------------------------------------------------------------------------


def init_mlp_block(rng: jax.Array, x: jax.Array) -> Params:
  k1, k2 = jax.random.split(rng)
  width = x.shape[-1]
  return {
    "w1": jax.random.normal(k1, [width, HIDDEN]) / np.sqrt(width),
    "b1": jnp.zeros([HIDDEN]),
    "w2": jax.random.normal(k2, [HIDDEN, width]) / np.sqrt(HIDDEN),
    "b2": jnp.zeros([width]),
  }


def plain_mlp_block(params: Params, x: jax.Array) -> jax.Array:
  """The block's forward pass; its autodiff gradient is the reference."""
  h = jax.nn.gelu(x @ params["w1"] + params["b1"])
  return x + matmul(h, params["w2"], like=x) + params["b2"]


def matmul(
  a: jax.Array,
  b: jax.Array,
  like: jax.Array,
  contract: tuple[tuple[int, ...], tuple[int, ...]] = ((-1,), (0,)),
) -> jax.Array:
  """`a` times `b`, sharded as `like` (for Explicit axes; else no-op).

  Under Explicit mesh axes, a product over a dimension split over a mesh
  axis must name its output's sharding; `like`'s own is the answer. With
  Auto axes, or no mesh, `like`'s type names no mesh axis and this is a
  plain product.
  """
  return jax.lax.dot_general(
    a,
    b,
    ((tuple(d % a.ndim for d in contract[0]), tuple(d % b.ndim for d in contract[1])), ((), ())),
    out_sharding=jax.typeof(like).sharding,
  )


@jax.custom_vjp
def mlp_block(params: Params, x: jax.Array) -> jax.Array:
  return plain_mlp_block(params, x)


def _mlp_block_fwd(params, x):
  pre = x @ params["w1"] + params["b1"]
  out = x + matmul(jax.nn.gelu(pre), params["w2"], like=x) + params["b2"]
  # Keep the pre-activation only; gelu(pre) is recomputed in the backward.
  return out, (params, x, pre)


def _mlp_block_bwd(residuals, g):
  params, x, pre = residuals
  h, gelu_vjp = jax.vjp(jax.nn.gelu, pre)
  (d_pre,) = gelu_vjp(g @ params["w2"].T)
  batch_dims = tuple(range(x.ndim - 1))
  over_batch = (batch_dims, batch_dims)
  grads = {
    "w1": matmul(x, d_pre, like=params["w1"], contract=over_batch),
    "b1": d_pre.sum(batch_dims),
    "w2": matmul(h, g, like=params["w2"], contract=over_batch),
    "b2": g.sum(batch_dims),
  }
  return grads, g + matmul(d_pre, params["w1"], like=x, contract=((-1,), (1,)))


mlp_block.defvjp(_mlp_block_fwd, _mlp_block_bwd)

# ---------------------------------------------------------------------------
# The network.
# ---------------------------------------------------------------------------


class RowSplitLinear(hk.Module):
  """`hk.Linear` for a layer whose input features may be split ("model").

  Its matmul contracts the split dimension, so under Explicit axes it names
  its output's sharding (its input's batch sharding, via `matmul`).
  """

  def __init__(self, output_size: int, w_scale: float, name: Optional[str] = None):
    super().__init__(name=name)
    self._output_size = output_size
    self._w_scale = w_scale

  def __call__(self, x: jax.Array, like: jax.Array) -> jax.Array:
    w = hk.get_parameter(
      "w", [x.shape[-1], self._output_size], init=hk.initializers.VarianceScaling(self._w_scale)
    )
    b = hk.get_parameter("b", [self._output_size], init=jnp.zeros)
    return matmul(x, w, like=like) + b


def residual_layer(h: jax.Array) -> jax.Array:
  up = hk.Linear(HIDDEN, name="up")
  down = RowSplitLinear(WIDTH, w_scale=0.1, name="down")
  return h + down(jax.nn.gelu(up(h)), like=h)


def readout(h: jax.Array) -> jax.Array:
  return hk.Linear(OUT_FEATURES, name="readout")(h)


def _clipped_readout_bwd(vjp_fn, g):
  # The true backward pass, with the error signal clipped to [-1, 1]: a
  # bad batch cannot blow up the step.
  return vjp_fn(jnp.clip(g, -1.0, 1.0))


# `hkb.custom_vjp` over a Haiku function: its params are `readout/w` and
# `readout/b`, as inline; `bwd` gets their cotangents to shape.
CLIPPED_READOUT = hkb.custom_vjp(readout, hkb.vjp_fwd, _clipped_readout_bwd)


def network(x: jax.Array, block=mlp_block, head=CLIPPED_READOUT) -> jax.Array:
  h = hk.Linear(WIDTH, name="embed")(x)
  h = hkb.call_pure(block, h, init=init_mlp_block, name="custom_mlp")
  h = hkb.repeat_layer(residual_layer, h, NUM_LAYERS, name="blocks")
  return head(h)


def make_loss(block=mlp_block, head=CLIPPED_READOUT) -> hk.Transformed:
  def loss(batch: Batch) -> jax.Array:
    x, y = batch
    return jnp.mean((network(x, block, head) - y) ** 2)

  return hk.transform(loss)


LOSS = make_loss()

# ---------------------------------------------------------------------------
# Data, mesh, sharded init and step.
# ---------------------------------------------------------------------------


def batches(seed: int = 0) -> Iterator[Batch]:
  """Synthetic regression: a fixed random teacher network, fresh inputs."""
  k_teacher, k_data = jax.random.split(jax.random.PRNGKey(seed))
  w1 = jax.random.normal(k_teacher, [IN_FEATURES, OUT_FEATURES])
  while True:
    k_data, k = jax.random.split(k_data)
    x = jax.random.normal(k, [BATCH_SIZE, IN_FEATURES])
    yield x, jnp.tanh(x @ w1 / np.sqrt(IN_FEATURES))


def make_mesh(axis_type: AxisType = AxisType.Auto) -> Mesh:
  """The (data, model) mesh over all devices, of all processes."""
  processes.require_devices(NUM_DEVICES)
  return jax.make_mesh(
    tuple(MESH_SHAPE.values()), tuple(MESH_SHAPE), axis_types=(axis_type,) * len(MESH_SHAPE)
  )


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P("data"))


def init_params(mesh: Mesh, seed: int = 0) -> tuple[Params, Params]:
  """Params created already sharded; returns `(params, shardings)`."""
  key, batch = jax.random.PRNGKey(seed), next(batches(seed))
  shardings = hkb.param_shardings(jax.eval_shape(LOSS.init, key, batch), mesh, RULES)
  params = jax.jit(LOSS.init, out_shardings=shardings)(key, batch)
  return params, shardings


def make_train_step(mesh: Mesh, shardings: Params):
  """A jitted SGD step that takes and returns params sharded by the rules."""

  def step(params, batch):
    loss, grads = jax.value_and_grad(LOSS.apply)(params, None, batch)
    params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return params, loss

  data = batch_sharding(mesh)
  return jax.jit(
    step,
    in_shardings=(shardings, (data, data)),
    out_shardings=(shardings, NamedSharding(mesh, P())),
    donate_argnums=0,
  )


def train(
  num_steps: int, seed: int = 0, log_every: int = 0, axis_type: AxisType = AxisType.Auto
) -> tuple[np.ndarray, Params]:
  """Trains for `num_steps`; returns the losses and the final params."""
  mesh = make_mesh(axis_type)
  with jax.set_mesh(mesh):
    params, shardings = init_params(mesh, seed)
    step = make_train_step(mesh, shardings)
    losses = []
    for i, batch in zip(range(num_steps), batches(seed + 1)):
      params, loss = step(params, processes.global_batch(batch, batch_sharding(mesh)))
      losses.append(float(loss))  # Replicated: every process has it.
      if log_every and (i % log_every == 0 or i == num_steps - 1):
        print(f"step {i:4d}  loss {losses[-1]:.5f}")
  return np.array(losses), params


def main(argv):
  del argv  # Unused.
  jax_logging.quiet()  # jax's INFO lines (the backends it could not start) left out.
  processes.start(NUM_DEVICES)
  axis_type = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[_AXIS_TYPE.value]
  mesh = make_mesh(axis_type)
  print(
    f"process {jax.process_index()} of {jax.process_count()}: "
    f"{jax.local_device_count()} of {jax.device_count()} devices; mesh "
    f"{dict(mesh.shape)}, {_AXIS_TYPE.value} axes"
  )
  losses, params = train(_NUM_STEPS.value, log_every=10, axis_type=axis_type)
  print(f"\nloss {losses[0]:.5f} -> {losses[-1]:.5f}\n")
  print(hkb.explain_shardings(params, RULES, mesh=mesh))
  print("\nthis process's shards of the trained params:")
  for bundle, entries in params.items():
    for name, value in entries.items():
      shapes = {tuple(s.data.shape) for s in value.addressable_shards}
      print(
        f"  {bundle + '/' + name:16s} {str(value.sharding.spec):22s} "
        f"{len(value.addressable_shards)} shards of {shapes.pop()}"
      )
  processes.save_results(losses, params)


if __name__ == "__main__":
  app.run(main)
