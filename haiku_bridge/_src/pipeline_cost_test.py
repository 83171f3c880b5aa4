"""What a pipelined training step costs a device: compiled memory and collectives.

Ground truth is the cost model of docs/pipelines.md, read off the compiled
step (`jax.jit(...).lower(...).compile()`): its memory analysis and its
optimised HLO. The step is a user's: the loss after the pipelined stack,
`jax.value_and_grad` of apply, params as init returns them (replicated),
under `jax.make_mesh`'s default (Explicit) axes or Auto axes.
"""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import haiku_bridge as hkb
from testing import hlo_collectives

LAYERS = 8
BATCH = 32


def block(h):
  """A residual MLP block: two Linears, so the params dominate its memory."""
  width = h.shape[-1]
  return h + hk.Linear(width)(jnp.tanh(hk.Linear(width)(h)))


def one_leaf_block(h):
  """A block of one Linear's weights and bias: its largest leaf is most of it."""
  return h + hk.Linear(h.shape[-1])(h)


def compiled_step(mesh_shape, axis_type, width, pipeline, remat=False,
                  layer=block, batch=BATCH, rules=None, **options):
  """The compiled `value_and_grad` step and the stack's param bytes.

  Params as init returns them, or with `rules` placed on the mesh by
  `hkb.param_shardings` (and their gradients placed so).
  """
  def loss(x):
    h = hkb.repeat_layer(layer, x, LAYERS, name="layers", pipeline=pipeline,
                         remat=remat, **options)
    return jnp.mean(h ** 2)

  f = hk.transform(loss)
  x = jnp.ones([batch, width])
  params = f.init(jax.random.PRNGKey(0), x)
  names = ("stage", "data")
  if axis_type is None:  # jax.make_mesh's default: Explicit axes.
    mesh = jax.make_mesh(mesh_shape, names)
  else:
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(axis_type,) * 2)
  param_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
  with jax.set_mesh(mesh):
    x = jax.device_put(x, P("data"))
    step = jax.value_and_grad(f.apply)
    if rules is None:
      step = jax.jit(step)
    else:
      shardings = hkb.param_shardings(params, mesh, rules)
      params = jax.device_put(params, shardings)
      step = jax.jit(step, out_shardings=(None, shardings))
    compiled = step.lower(params, None, x).compile()
  return compiled, param_bytes


AXES = (("explicit", None), ("auto", AxisType.Auto))


class MemoryTest(parameterized.TestCase):
  """Per device: the stage's params once, one gradient for them, flat in M."""

  @parameterized.product(axes=AXES, schedule=("gpipe", "circular"),
                         remat=(False, True))
  def test_temporaries_flat_in_microbatches(self, axes, schedule, remat):
    _, axis_type = axes
    stages = 4
    temp = {}
    for m in (4, 16):
      compiled, param_bytes = compiled_step(
          (stages, 2), axis_type, 64, hkb.Pipeline("stage", m, schedule),
          remat)
      temp[m] = compiled.memory_analysis().temp_size_in_bytes
    stage_params = param_bytes / stages
    # Before issue 34, each step of the timetable kept its own copy of the
    # stage's params for the backward pass: 22x at M=16, 2.2x M=4's.
    self.assertLessEqual(temp[16], 3 * stage_params, (temp, stage_params))
    self.assertLessEqual(temp[16], 1.25 * temp[4], temp)


  def test_circular_gathers_one_leaf_of_the_stack_at_a_time(self):
    # With params as init returns them, circular gathers each gradient
    # leaf's whole stack over the stages and copies it into layer order: a
    # buffer of the largest leaf's stack (docs/sharding.md), S times the
    # stage's params for a block of one leaf, beside which the rest of the
    # step fits in the stage's params: since issue 43 the gradient reduced
    # over `data` as it leaves the stages, live while it is gathered
    # (133432 bytes before, 164152 after).
    stages, width = 4, 64
    compiled, param_bytes = compiled_step(
        (stages, 2), None, width, hkb.Pipeline("stage", 16, "circular"),
        layer=one_leaf_block)
    temp = compiled.memory_analysis().temp_size_in_bytes
    stage_params = param_bytes / stages
    gathered = LAYERS * width * width * 4  # The stack's weights, float32.
    self.assertLessEqual(temp, max(3 * stage_params,
                                   gathered + 1.1 * stage_params),
                         (temp, gathered, stage_params))


  def test_circular_with_params_stored_over_the_stages(self):
    # Params stored over "stage" (`stacked={"layers": "stage"}`, as
    # docs/sharding.md shows), in blocks of layers that circular runs
    # interleaved: each stage sends its blocks' layers to the stages that
    # run them, as the partitioner does on Auto axes. Until issue 43, on
    # Explicit axes each leaf's whole stack was all-gathered onto every
    # device (8 times the stage's params of all-gathers; temporaries 4.57x).
    stages, width = 4, 256
    found = {}
    for name, axis_type in AXES:
      compiled, param_bytes = compiled_step(
          (stages, 2), axis_type, width, hkb.Pipeline("stage", 16, "circular"),
          rules=hkb.ShardingRules([], stacked={"layers": "stage"}))
      found[name] = (compiled.memory_analysis().temp_size_in_bytes,
                     hlo_collectives.bytes_per_step(compiled, "all-gather"))
    stage_params = param_bytes / stages
    self.assertLessEqual(found["explicit"][0], 3 * stage_params,
                         (found, stage_params))
    self.assertLessEqual(found["explicit"][1], found["auto"][1], found)


class RematPolicyTest(parameterized.TestCase):
  """`remat_policy` changes only what a stage keeps: its compiled temporaries."""

  @parameterized.parameters("gpipe", "circular")
  def test_a_policy_that_keeps_more_holds_more(self, schedule):
    # Keeping nothing but each layer's input < keeping the matmuls' outputs
    # too < keeping everything (the tanh's as well), per microbatch in
    # flight: the orders of what each policy keeps.
    pipe = hkb.Pipeline("stage", 4, schedule)
    policies = jax.checkpoint_policies
    temp = [compiled_step((2, 4), None, 16, pipe, remat=True,
                          remat_policy=policy)[0].memory_analysis(
                          ).temp_size_in_bytes
            for policy in (policies.nothing_saveable, policies.dots_saveable,
                           policies.everything_saveable)]
    self.assertLess(temp[0], temp[1], temp)
    self.assertLess(temp[1], temp[2], temp)


class CollectivesTest(parameterized.TestCase):
  """Explicit axes (jax's default mesh) communicate as Auto axes do."""

  @parameterized.parameters("gpipe", "circular")
  def test_explicit_axes_add_no_collectives(self, schedule):
    stages, data, m, width = 2, 4, 4, 16
    pipe = hkb.Pipeline("stage", m, schedule)
    found = {
        name: hlo_collectives.collectives(
            compiled_step((stages, data), axis_type, width, pipe)[0])
        for name, axis_type in AXES}
    explicit, auto = found["explicit"], found["auto"]
    # Before issue 34, 7 all-gathers over `data` on Explicit axes (gpipe),
    # none on Auto: the shard_map's inputs, outputs and residuals whole.
    for op in explicit:
      self.assertLen(explicit[op], len(auto[op]), (op, explicit, auto))
    if schedule == "gpipe":
      self.assertEmpty(explicit["all-gather"])
    # The boundary activations: forward, and their cotangents back; each
    # one microbatch's rows on this data device.
    rows = BATCH // m // data
    self.assertEqual(explicit["collective-permute"],
                     [[(rows, width)]] * 2)

  @parameterized.product(axes=AXES, schedule=("gpipe", "circular"))
  def test_gradient_reduced_over_data_once_per_step(self, axes, schedule):
    # Theory, and plain data parallelism: each device's gradient of the
    # stage's params summed over its microbatches, then all-reduced over
    # `data` once. Until issue 43 XLA reduced each layer's gradient where it
    # was made, inside the backward loops: M+S-1 times (GPipe; 5x at M=4,
    # 17x at M=16) or ·max(M, S)+M+S-1 times one layer's reduction
    # per visit (circular; 4.25x, 16.25x).
    _, axis_type = axes
    stages, data, width = 2, 4, 16
    mesh = jax.make_mesh((stages, data), ("stage", "data"))
    for m in (4, 16):
      compiled, param_bytes = compiled_step(
          (stages, data), axis_type, width, hkb.Pipeline("stage", m, schedule),
          batch=4 * m)  # One row per data device in a microbatch.
      reduced = hlo_collectives.bytes_per_step(
          compiled, "all-reduce", hlo_collectives.mesh_groups(mesh, "data"))
      stage_params = param_bytes / stages
      self.assertBetween(reduced / stage_params, 1.0, 1.1, (m, reduced))

if __name__ == "__main__":
  absltest.main()
