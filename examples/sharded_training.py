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

Run it with

    bazel run //examples:sharded_training

or, without Bazel, from the repository root (on a CPU, the 8 devices are
simulated by XLA):

    PYTHONPATH=. python3 examples/sharded_training.py
"""

import os

# Eight CPU devices, if jax is not started yet; read when it starts a backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS",
                                                                  ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
from typing import Any, Iterator

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


_NUM_STEPS = flags.DEFINE_integer("num_steps", 100, "SGD steps to run.")

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
    stacked=["blocks"])

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
  return x + h @ params["w2"] + params["b2"]


@jax.custom_vjp
def mlp_block(params: Params, x: jax.Array) -> jax.Array:
  return plain_mlp_block(params, x)


def _mlp_block_fwd(params, x):
  pre = x @ params["w1"] + params["b1"]
  out = x + jax.nn.gelu(pre) @ params["w2"] + params["b2"]
  # Keep the pre-activation only; gelu(pre) is recomputed in the backward.
  return out, (params, x, pre)


def _mlp_block_bwd(residuals, g):
  params, x, pre = residuals
  h, gelu_vjp = jax.vjp(jax.nn.gelu, pre)
  (d_pre,) = gelu_vjp(g @ params["w2"].T)
  batch_dims = tuple(range(x.ndim - 1))
  grads = {
      "w1": jnp.tensordot(x, d_pre, axes=(batch_dims, batch_dims)),
      "b1": d_pre.sum(batch_dims),
      "w2": jnp.tensordot(h, g, axes=(batch_dims, batch_dims)),
      "b2": g.sum(batch_dims),
  }
  return grads, g + d_pre @ params["w1"].T


mlp_block.defvjp(_mlp_block_fwd, _mlp_block_bwd)

# ---------------------------------------------------------------------------
# The network.
# ---------------------------------------------------------------------------


def residual_layer(h: jax.Array) -> jax.Array:
  up = hk.Linear(HIDDEN, name="up")
  down = hk.Linear(WIDTH, name="down", w_init=hk.initializers.VarianceScaling(
      0.1))
  return h + down(jax.nn.gelu(up(h)))


def network(x: jax.Array, block=mlp_block) -> jax.Array:
  h = hk.Linear(WIDTH, name="embed")(x)
  h = hkb.call_pure(block, h, init=init_mlp_block, name="custom_mlp")
  h = hkb.repeat_layer(residual_layer, h, NUM_LAYERS, name="blocks")
  return hk.Linear(OUT_FEATURES, name="readout")(h)


def make_loss(block=mlp_block) -> hk.Transformed:
  def loss(batch: Batch) -> jax.Array:
    x, y = batch
    return jnp.mean((network(x, block) - y) ** 2)
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


def make_mesh() -> Mesh:
  shape = tuple(MESH_SHAPE.values())
  count = int(np.prod(shape))
  if jax.device_count() < count:
    raise RuntimeError(
        f"This example needs {count} devices; jax has {jax.device_count()}. On "
        "a CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=8 before "
        "jax starts.")
  devices = np.array(jax.devices()[:count]).reshape(shape)
  return Mesh(devices, tuple(MESH_SHAPE),
              axis_types=(AxisType.Auto,) * len(shape))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P("data"))


def init_params(mesh: Mesh, seed: int = 0) -> tuple[Params, Params]:
  """Params created already sharded; returns `(params, shardings)`."""
  key, batch = jax.random.PRNGKey(seed), next(batches(seed))
  shardings = hkb.param_shardings(jax.eval_shape(LOSS.init, key, batch),
                                       mesh, RULES)
  params = jax.jit(LOSS.init, out_shardings=shardings)(key, batch)
  return params, shardings


def make_train_step(mesh: Mesh, shardings: Params):
  """A jitted SGD step that takes and returns params sharded by the rules."""

  def step(params, batch):
    loss, grads = jax.value_and_grad(LOSS.apply)(params, None, batch)
    params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return params, loss

  data = batch_sharding(mesh)
  return jax.jit(step, in_shardings=(shardings, (data, data)),
                 out_shardings=(shardings, None), donate_argnums=0)


def train(num_steps: int, seed: int = 0,
          log_every: int = 0) -> tuple[np.ndarray, Params]:
  """Trains for `num_steps`; returns the losses and the final params."""
  mesh = make_mesh()
  params, shardings = init_params(mesh, seed)
  step = make_train_step(mesh, shardings)
  data = batch_sharding(mesh)
  losses = []
  for i, batch in zip(range(num_steps), batches(seed + 1)):
    params, loss = step(params, jax.device_put(batch, data))
    losses.append(float(loss))
    if log_every and (i % log_every == 0 or i == num_steps - 1):
      print(f"step {i:4d}  loss {losses[-1]:.5f}")
  return np.array(losses), params


def main(argv):
  del argv  # Unused.
  mesh = make_mesh()
  print(f"mesh: {dict(mesh.shape)}")
  losses, params = train(_NUM_STEPS.value, log_every=10)
  print(f"\nloss {losses[0]:.5f} -> {losses[-1]:.5f}\n")
  print(hkb.explain_shardings(params, RULES, mesh=mesh))
  print("\nactual shardings of the trained params:")
  for bundle, entries in params.items():
    for name, value in entries.items():
      print(f"  {bundle + '/' + name:16s} {value.sharding.spec}")


if __name__ == "__main__":
  app.run(main)
