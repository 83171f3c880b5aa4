"""`hkb.pipeline_cost`: a pipeline's shape, memory and bytes per collective, before it runs.

The shape against the timetable the stages run from and the placement they run on; the bytes against
the cost model written out by hand for one case of each schedule. `pipeline_cost_test` holds the
model to compiled steps' collectives (testing/pipeline_cost.py).
"""

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax
import jax.numpy as jnp

import haiku_bridge as hkb
from haiku_bridge._src import pipeline as pipeline_lib

WIDTH, BATCH, LAYERS = 16, 32, 8
# One layer's params: a Linear(16), float32.
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4


def stack_params(layers: int = LAYERS):
  def block(h):
    return h + jnp.tanh(hk.Linear(WIDTH)(h))

  f = hk.transform(lambda x: hkb.repeat_layer(block, x, layers, name="layers"))
  return jax.eval_shape(f.init, jax.random.PRNGKey(0), jnp.ones([BATCH, WIDTH]))


def carry():
  return jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32)


def mesh(stages: int = 4, data: int = 2):
  return jax.sharding.AbstractMesh((stages, data), ("stage", "data"))


class PipelineCostTest(parameterized.TestCase):
  @parameterized.parameters(
    ("gpipe", None, 4), ("circular", None, 4), ("circular", 1, 8), ("circular", 2, 2)
  )
  def test_shape_is_the_timetable_the_stages_run(self, schedule, repeats, m):
    pipe = hkb.Pipeline("stage", m, schedule, repeats)
    cost = hkb.pipeline_cost(pipe, mesh(), stack_params(), carry())
    passes = pipe.num_repeats(LAYERS, 4)
    timetable = pipeline_lib.timetable(4, m, passes)
    self.assertEqual((cost.stages, cost.repeats, cost.microbatches), (4, passes, m))
    self.assertEqual(cost.layers_per_stage, LAYERS // 4)
    self.assertEqual(cost.layers_per_visit, LAYERS // (4 * passes))
    self.assertEqual(cost.steps, timetable.num_ticks)
    self.assertEqual(cost.bubble, timetable.bubble)

  def test_gpipe_bytes_by_hand(self):
    cost = hkb.pipeline_cost(hkb.Pipeline("stage", 4), mesh(), stack_params(), carry())
    stage_params = LAYERS * LAYER_BYTES / 4
    a = BATCH * WIDTH * 4 / (4 * 2)  # One microbatch's rows on one of 2 data devices.
    self.assertEqual(cost.param_bytes, LAYERS * LAYER_BYTES)  # As init returns them: whole.
    self.assertEqual(cost.microbatch_bytes, a)
    self.assertEqual(
      cost.collectives,
      {
        "collective-permute": 2 * (4 + 4 - 1) * a,
        "all-reduce data": stage_params,
        "all-reduce stage": 4 * a,
        "all-gather": 4 * stage_params,
        "reduce-scatter": 0,
        "all-to-all": 0,
      },
    )

  def test_circular_stored_over_the_stages_by_hand(self):
    cost = hkb.pipeline_cost(
      hkb.Pipeline("stage", 8, "circular"), mesh(), stack_params(), carry(), stored_over_stages=True
    )
    stage_params = LAYERS * LAYER_BYTES / 4
    a = BATCH * WIDTH * 4 / (8 * 2)
    steps = (2 - 1) * 8 + 8 + 4 - 1  # R = 8 layers / 4 stages = 2 passes.
    self.assertEqual(cost.param_bytes, stage_params)
    self.assertEqual(cost.collectives["collective-permute"], 2 * steps * a + 2 * stage_params)
    self.assertEqual(cost.collectives["all-gather"], 0)

  def test_one_stage_sends_nothing_and_one_data_device_reduces_nothing(self):
    one_stage = hkb.pipeline_cost(hkb.Pipeline("stage", 4), mesh(1, 8), stack_params(), carry())
    self.assertEqual(one_stage.collectives["collective-permute"], 0)
    self.assertEqual(one_stage.collectives["all-gather"], 0)
    self.assertGreater(one_stage.collectives["all-reduce data"], 0)
    no_data = hkb.pipeline_cost(hkb.Pipeline("stage", 4), mesh(8, 1), stack_params(), carry())
    self.assertEqual(no_data.collectives["all-reduce data"], 0)

  def test_data_axes_name_the_batch_split(self):
    # A model axis does not split the batch: the microbatch is larger on each device.
    model_mesh = jax.sharding.AbstractMesh((2, 2, 2), ("stage", "data", "model"))
    every_axis = hkb.pipeline_cost(hkb.Pipeline("stage", 4), model_mesh, stack_params(), carry())
    data_only = hkb.pipeline_cost(
      hkb.Pipeline("stage", 4), model_mesh, stack_params(), carry(), data_axes=("data",)
    )
    self.assertEqual(data_only.microbatch_bytes, 2 * every_axis.microbatch_bytes)

  def test_a_real_mesh_and_arrays_as_init_returns_them(self):
    f = hk.transform(
      lambda x: hkb.repeat_layer(
        lambda h: h + jnp.tanh(hk.Linear(WIDTH)(h)), x, LAYERS, name="layers"
      )
    )
    x = jnp.ones([BATCH, WIDTH])
    params = f.init(jax.random.PRNGKey(0), x)
    real = hkb.pipeline_cost(
      hkb.Pipeline("stage", 4), jax.make_mesh((4, 2), ("stage", "data")), params, x
    )
    self.assertEqual(
      real, hkb.pipeline_cost(hkb.Pipeline("stage", 4), mesh(), stack_params(), carry())
    )

  def test_str_names_every_figure(self):
    text = str(hkb.pipeline_cost(hkb.Pipeline("stage", 4), mesh(), stack_params(), carry()))
    for name in (
      "stages × passes",
      "bubble",
      "42.9%",
      "stack params per device",
      "collective-permute per step",
      "all-gather per step",
    ):
      self.assertIn(name, text)
    self.assertNotIn("all-to-all", text)  # Zero rows are left out.


class ErrorsTest(parameterized.TestCase):
  def test_a_mesh_without_the_stage_axis(self):
    with self.assertRaisesRegex(ValueError, r"`pipeline.axis` is 'stage', but the mesh has axes"):
      hkb.pipeline_cost(
        hkb.Pipeline("stage", 4),
        jax.sharding.AbstractMesh((8,), ("data",)),
        stack_params(),
        carry(),
      )

  def test_layers_that_do_not_split_into_the_stages(self):
    with self.assertRaisesRegex(ValueError, r"`num_layers` is 6, which does not split"):
      hkb.pipeline_cost(hkb.Pipeline("stage", 4), mesh(), stack_params(6), carry())

  def test_a_batch_the_microbatches_do_not_divide(self):
    with self.assertRaisesRegex(ValueError, r"3 does not divide 32"):
      hkb.pipeline_cost(hkb.Pipeline("stage", 3), mesh(), stack_params(), carry())

  def test_stack_params_of_two_lengths(self):
    params = dict(stack_params(), other={"w": jax.ShapeDtypeStruct((3, 2), jnp.float32)})
    with self.assertRaisesRegex(ValueError, r"leaves of different lengths on axis 0 \(8 at"):
      hkb.pipeline_cost(hkb.Pipeline("stage", 4), mesh(), params, carry())

  def test_no_stack_params(self):
    with self.assertRaisesRegex(ValueError, r"`stack_params` holds no array"):
      hkb.pipeline_cost(hkb.Pipeline("stage", 4), mesh(), {}, carry())

  def test_data_axes_not_of_the_mesh(self):
    with self.assertRaisesRegex(ValueError, r"data_axes"):
      hkb.pipeline_cost(
        hkb.Pipeline("stage", 4), mesh(), stack_params(), carry(), data_axes=("stage",)
      )

  def test_stored_over_stages_not_a_bool(self):
    with self.assertRaisesRegex(TypeError, r"stored_over_stages"):
      hkb.pipeline_cost(
        hkb.Pipeline("stage", 4), mesh(), stack_params(), carry(), stored_over_stages="stage"
      )

  def test_not_a_pipeline(self):
    with self.assertRaisesRegex(TypeError, r"pipeline"):
      hkb.pipeline_cost(None, mesh(), stack_params(), carry())


if __name__ == "__main__":
  absltest.main()
