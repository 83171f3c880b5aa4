"""A Perceiver-style model written in Haiku's own style, its latent tower pipelined.

The model (after Jaegle et al., "Perceiver IO") uses Haiku's modules as
dm-haiku's examples do: `hk.Embed`, `hk.MultiHeadAttention` for the
cross-attention of a learned latent array into the inputs and for the
self-attention blocks over the latents, `hk.LayerNorm`, `hk.nets.MLP`.
Only the tower of self-attention blocks is a `hkb.repeat_layer`, pipelined
over the mesh's "stage" axis. Trained three steps of momentum SGD (one batch) on
`jax.make_mesh`'s default mesh (Explicit axes from jax 0.9 on), batch split
over "data", params as init returns them: the losses, first gradients and
trained params equal the same model trained without `pipeline=` on one
device. On jax 0.9 Explicit axes cannot train this model even without a
pipeline (its classifier's weight gradient contracts the data-split batch:
"Contracting dimensions are sharded"), so there the mesh has Auto axes.
"""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import haiku_bridge as hkb
from haiku_bridge._src import pipeline as pipeline_lib

VOCAB, SEQ, BATCH, CLASSES = 16, 6, 8, 4
D_MODEL, LATENTS, HEADS, TOWER = 16, 4, 2, 8
STEPS = 3


class Perceiver(hk.Module):
  """Cross-attends a latent array to the inputs, then self-attends it `TOWER` times."""

  def __init__(self, pipeline=None, name=None):
    super().__init__(name=name)
    self.pipeline = pipeline

  def __call__(self, tokens):
    # One-hot lookup: a matmul, which keeps the batch split under Explicit
    # axes (a gather of rows would need its output sharding named).
    inputs = hk.Embed(VOCAB, D_MODEL, lookup_style="ONE_HOT")(tokens)
    inputs = inputs + hk.get_parameter(
      "position", [SEQ, D_MODEL], init=hk.initializers.TruncatedNormal(0.02)
    )
    latents = hk.get_parameter(
      "latents", [LATENTS, D_MODEL], init=hk.initializers.TruncatedNormal(0.02)
    )
    # Each example's latents: the input's batch axis, split as it is.
    latents = latents + jnp.zeros_like(inputs[:, :1, :1])
    cross = hk.MultiHeadAttention(
      HEADS, D_MODEL // HEADS, w_init=hk.initializers.VarianceScaling(), name="cross_attention"
    )
    h = latents + cross(hk.LayerNorm(-1, True, True)(latents), inputs, inputs)
    h = hkb.repeat_layer(self_attention_block, h, TOWER, name="tower", pipeline=self.pipeline)
    h = hk.LayerNorm(-1, True, True, name="final_norm")(h)
    return hk.Linear(CLASSES, name="classifier")(jnp.mean(h, axis=1))


def self_attention_block(h):
  """Pre-norm self-attention and MLP over the latents, as Perceiver's."""
  a = hk.LayerNorm(-1, True, True)(h)
  h = h + hk.MultiHeadAttention(HEADS, D_MODEL // HEADS, w_init=hk.initializers.VarianceScaling())(
    a, a, a
  )
  m = hk.LayerNorm(-1, True, True)(h)
  return h + hk.nets.MLP([2 * D_MODEL, D_MODEL], activation=jax.nn.gelu)(m)


def loss_fn(pipeline=None) -> hk.Transformed:
  def loss(tokens, labels):
    logits = Perceiver(pipeline)(tokens)
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(labels, CLASSES), -1))

  return hk.transform(loss)


def batch():
  tokens = jax.random.randint(jax.random.PRNGKey(10), [BATCH, SEQ], 0, VOCAB)
  labels = jnp.sum(tokens, axis=1) % CLASSES  # Learnable from the tokens.
  return tokens, labels


def train(f, params, put_batch=lambda a: a):
  """`STEPS` steps of SGD with momentum 0.9 on one batch: losses, first gradients, params."""

  def step(params, velocity, tokens, labels):
    loss, grads = jax.value_and_grad(f.apply)(params, None, tokens, labels)
    velocity = jax.tree.map(lambda v, g: 0.9 * v + g, velocity, grads)
    params = jax.tree.map(lambda p, v: p - 0.02 * v, params, velocity)
    return params, velocity, loss, grads

  step = jax.jit(step)
  velocity = jax.tree.map(jnp.zeros_like, params)
  losses, first = [], None
  tokens, labels = map(put_batch, batch())
  for _ in range(STEPS):
    params, velocity, loss, grads = step(params, velocity, tokens, labels)
    losses.append(loss)
    first = grads if first is None else first
  return jax.device_get((jnp.stack(losses), first, params))


def make_mesh(shape, names):
  """`jax.make_mesh`'s default mesh, or Auto axes where jax 0.9 needs them."""
  if tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 10):
    return jax.make_mesh(shape, names)
  return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


@absltest.skipUnless(
  pipeline_lib.jax_has_pipelines(), "pipelines need jax.shard_map and jax.set_mesh."
)
class PerceiverPipelineTest(parameterized.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    if jax.device_count() < 8:
      raise absltest.SkipTest(f"needs 8 devices, jax has {jax.device_count()}.")
    plain = loss_fn()
    cls.params = jax.device_get(plain.init(jax.random.PRNGKey(0), *batch()))
    cls.expected = train(plain, cls.params)  # One device.

  @parameterized.parameters(("gpipe", 4, 4, None), ("circular", 2, 4, 2))
  def test_trains_as_one_device(self, schedule, stages, microbatches, repeats):
    pipe = hkb.Pipeline("stage", microbatches, schedule, repeats)
    f = loss_fn(pipe)
    # The same params, pipelined or not.
    jax.tree.map(
      np.testing.assert_array_equal, f.init(jax.random.PRNGKey(0), *batch()), self.params
    )
    mesh = make_mesh((stages, 8 // stages), ("stage", "data"))
    with jax.set_mesh(mesh):
      got = train(f, self.params, lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))))

    def check(path, g, e):
      e = np.asarray(e)
      np.testing.assert_allclose(
        g,
        e,
        rtol=1e-4,
        atol=max(1e-6, 1e-4 * float(np.max(np.abs(e)))),
        err_msg=jax.tree_util.keystr(path),
      )

    jax.tree_util.tree_map_with_path(check, got, self.expected)
    # It learns: the loss on the batch falls.
    self.assertLess(got[0][-1], got[0][0])


if __name__ == "__main__":
  absltest.main()
