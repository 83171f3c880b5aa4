r"""A small transformer trained with its block stack as a pipeline, and data parallelism.

The scenario. A decoder of 8 pre-norm blocks (causal self-attention, then an
MLP), scanned with `hkb.repeat_layer`, learns to continue arithmetic
sequences (each row counts up by its own step, modulo the vocabulary). It
trains with SGD (momentum) on a `(stage=4, data=2)` mesh of 8 devices:

* the blocks run as 4 pipeline stages, 2 blocks each
  (`pipeline=hkb.Pipeline("stage", microbatches=4)`), and each device holds
  its stage's blocks only: `ShardingRules([], stacked={"blocks": "stage"})`
  splits the stack's layer axis over `stage`;
* the batch is split over `data`, as in plain data-parallel training.

The params are those of the same model without `pipeline=`: the same names,
shapes and initial values, so a checkpoint moves between the two untouched;
the losses and trained params are the unpipelined model's, up to float
rounding (pipelined_transformer_test.py checks both).

Run it from a checkout, with haiku_bridge and what the examples import
installed (`pip install ".[examples]"`, once; on a CPU, the 8 devices are
simulated by XLA):

    python examples/pipelined_transformer.py --schedule=circular

(from any other directory, with the file's path), or with Bazel:

    bazel run //examples:pipelined_transformer

As 2 processes (`jax.distributed`, each with 4 of the 8 devices: stages 0-1
on one, 2-3 on the other, so activations cross between processes), run one
command per process:

    python examples/pipelined_transformer.py --num_processes=2 \
        --process_id=0 --coordinator_address=localhost:12355 &
    python examples/pipelined_transformer.py --num_processes=2 \
        --process_id=1 --coordinator_address=localhost:12355
"""

import functools
from typing import Any, Iterator

from absl import app
from absl import flags
import haiku as hk
import haiku_bridge as hkb
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

# As a module (`python -m examples.pipelined_transformer`, the tests, Bazel's library) or as a
# file (`python examples/pipelined_transformer.py`: the file's folder is first on sys.path,
# and "examples" may name dm-haiku's own examples, which its wheel installs).
if __package__:
  from examples import jax_logging
  from examples import processes
else:
  import jax_logging  # pylint: disable=g-import-not-at-top
  import processes  # pylint: disable=g-import-not-at-top

_NUM_STEPS = flags.DEFINE_integer("num_steps", 40, "SGD steps to run.")
_SCHEDULE = flags.DEFINE_enum("schedule", "gpipe", ["gpipe", "circular"], "The pipeline schedule.")
_MICROBATCHES = flags.DEFINE_integer("microbatches", 4, "Microbatches per batch.")

Params = Any

VOCAB = 16
SEQ = 8
D_MODEL = 32
HEADS = 4
NUM_LAYERS = 8
BATCH_SIZE = 32
LEARNING_RATE = 0.1
MESH_SHAPE = {"stage": 4, "data": 2}
NUM_DEVICES = 8
# Each device keeps its stage's blocks; the rest (embedding, readout) is
# small and replicated.
RULES = hkb.ShardingRules([], stacked={"blocks": "stage"})


def block(h: jax.Array) -> jax.Array:
  """One pre-norm block: causal self-attention, then an MLP, each residual."""
  x = hk.LayerNorm(-1, True, True, name="ln_1")(h)
  causal = jnp.tril(jnp.ones([1, 1, SEQ, SEQ], bool))
  h = h + hk.MultiHeadAttention(
    HEADS, D_MODEL // HEADS, w_init=hk.initializers.VarianceScaling(), name="attention"
  )(x, x, x, mask=causal)
  x = hk.LayerNorm(-1, True, True, name="ln_2")(h)
  return h + hk.nets.MLP([4 * D_MODEL, D_MODEL], name="mlp")(x)


def make_loss(pipeline: hkb.Pipeline | None) -> hk.Transformed:
  """Next-token cross-entropy; the blocks pipelined when `pipeline` is set."""

  def loss(tokens: jax.Array) -> jax.Array:
    # A one-hot matmul embeds: a plain product, whatever splits the batch.
    h = hk.Linear(D_MODEL, with_bias=False, name="embed")(jax.nn.one_hot(tokens, VOCAB))
    h = h + hk.get_parameter("position", [SEQ, D_MODEL], init=hk.initializers.TruncatedNormal(0.02))
    h = hkb.repeat_layer(block, h, NUM_LAYERS, name="blocks", pipeline=pipeline)
    logits = hk.Linear(VOCAB, name="readout")(hk.LayerNorm(-1, True, True, name="ln_f")(h))
    targets = jax.nn.one_hot(tokens[:, 1:], VOCAB)
    log_p = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.sum(log_p * targets, axis=-1))

  return hk.transform(loss)


def batches(seed: int = 0) -> Iterator[np.ndarray]:
  """Rows `start, start + step, start + 2·step, ...` modulo the vocabulary."""
  rng = np.random.default_rng(seed)
  while True:
    start = rng.integers(0, VOCAB, [BATCH_SIZE, 1])
    step = rng.integers(1, 4, [BATCH_SIZE, 1])
    yield ((start + step * np.arange(SEQ)) % VOCAB).astype(np.int32)


def make_mesh() -> Mesh:
  """The (stage, data) mesh over all devices, of all processes.

  `jax.make_mesh`'s default axis types: Explicit from jax 0.9 on, where each
  array's type says how it is split.
  """
  processes.require_devices(NUM_DEVICES)
  return jax.make_mesh(tuple(MESH_SHAPE.values()), tuple(MESH_SHAPE))


def train(
  num_steps: int, pipeline: hkb.Pipeline | None, seed: int = 0, log_every: int = 0
) -> tuple[np.ndarray, Params]:
  """Trains for `num_steps` under the mesh; returns the losses and params."""
  loss_fn = make_loss(pipeline)
  # Not Adam: the key bias gets a zero gradient (softmax ignores it), whose
  # rounding noise Adam would scale up to full steps.
  optimizer = optax.sgd(LEARNING_RATE, momentum=0.9)
  mesh = make_mesh()
  data = NamedSharding(mesh, P("data"))

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn.apply)(params, None, tokens)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  with jax.set_mesh(mesh):
    tokens = next(batches(seed))
    # Without a pipeline (the test's reference) the blocks stay whole on
    # every device: a scan over a layer axis split over "stage" would need
    # its layers gathered at each step.
    shardings = hkb.param_shardings(
      jax.eval_shape(loss_fn.init, jax.random.PRNGKey(seed), tokens),
      mesh,
      RULES if pipeline is not None else hkb.ShardingRules([]),
    )
    # Created on their devices: each stage's blocks on that stage only.
    params = jax.jit(loss_fn.init, out_shardings=shardings)(jax.random.PRNGKey(seed), tokens)
    opt_state = optimizer.init(params)
    losses = []
    for i, tokens in zip(range(num_steps), batches(seed + 1)):
      params, opt_state, loss = step(params, opt_state, processes.global_batch(tokens, data))
      losses.append(float(loss))  # Replicated: every process has it.
      if log_every and (i % log_every == 0 or i == num_steps - 1):
        print(f"step {i:4d}  loss {losses[-1]:.4f}")
  return np.array(losses), params


def main(argv):
  del argv  # Unused.
  jax_logging.quiet()  # jax's INFO lines (the backends it could not start) left out.
  processes.start(NUM_DEVICES)
  pipeline = hkb.Pipeline("stage", _MICROBATCHES.value, _SCHEDULE.value)
  print(
    f"process {jax.process_index()} of {jax.process_count()}: "
    f"{jax.local_device_count()} of {jax.device_count()} devices; mesh "
    f"{MESH_SHAPE}; {NUM_LAYERS} blocks as {MESH_SHAPE['stage']} stages, "
    f"{_SCHEDULE.value} schedule, {_MICROBATCHES.value} microbatches"
  )
  losses, params = train(_NUM_STEPS.value, pipeline, log_every=10)
  print(f"\nloss {losses[0]:.4f} -> {losses[-1]:.4f}")
  w = params["blocks/mlp/~/linear_0"]["w"]
  print(
    f"blocks/mlp/~/linear_0/w {w.shape}: {w.sharding.spec}, this "
    f"process holds {len(w.addressable_shards)} shards of "
    f"{w.addressable_shards[0].data.shape}"
  )
  processes.save_results(losses, params)


if __name__ == "__main__":
  app.run(main)
