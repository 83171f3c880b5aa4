"""What a pipelined training step costs a device: compiled memory and collectives.

Ground truth is the cost model of docs/sharding.md (its bytes per step in
testing/pipeline_cost.py), read off the compiled step
(`jax.jit(...).lower(...).compile()`): its memory analysis and its
optimised HLO (`hlo_collectives`). The step is a user's: the loss after
the pipelined stack, `jax.value_and_grad` of apply, params as init returns
them (replicated) or stored over the stages, under `jax.make_mesh`'s
default (Explicit) axes or Auto axes.
"""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import functools
import unittest

from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
from jax.sharding import AxisType

import haiku_bridge as hkb
from testing import pipeline_cost

LAYERS = pipeline_cost.LAYERS
BATCH = 32
block = pipeline_cost.residual_mlp


def one_leaf_block(h):
  """A block of one Linear's weights and bias: its largest leaf is most of it."""
  return h + hk.Linear(h.shape[-1])(h)


def compiled_step(mesh_shape, axis_type, width, pipeline, remat=False, layer=block, **options):
  """The compiled `value_and_grad` step and the stack's param bytes."""
  step = pipeline_cost.compiled_step(
    mesh_shape, axis_type, width, pipeline, batch=BATCH, remat=remat, layer=layer, **options
  )
  return step.compiled, step.param_bytes


AXES = (("explicit", None), ("auto", AxisType.Auto))


class MemoryTest(parameterized.TestCase):
  """Per device: the stage's params once, one gradient for them, flat in M."""

  @parameterized.product(axes=AXES, schedule=("gpipe", "circular"), remat=(False, True))
  def test_temporaries_flat_in_microbatches(self, axes, schedule, remat):
    _, axis_type = axes
    stages = 4
    temp = {}
    for m in (4, 16):
      compiled, param_bytes = compiled_step(
        (stages, 2), axis_type, 64, hkb.Pipeline("stage", m, schedule), remat
      )
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
      (stages, 2), None, width, hkb.Pipeline("stage", 16, "circular"), layer=one_leaf_block
    )
    temp = compiled.memory_analysis().temp_size_in_bytes
    stage_params = param_bytes / stages
    gathered = LAYERS * width * width * 4  # The stack's weights, float32.
    self.assertLessEqual(
      temp, max(3 * stage_params, gathered + 1.1 * stage_params), (temp, gathered, stage_params)
    )

  def test_circular_with_params_stored_over_the_stages(self):
    # Params stored over "stage" (`stacked={"layers": "stage"}`, as
    # docs/sharding.md shows), in blocks of layers that circular runs
    # interleaved: each stage sends its blocks' layers to the stages that
    # run them, in R permutations of the stages. Until issue 43, on
    # Explicit axes each leaf's whole stack was all-gathered onto every
    # device (8 times the stage's params of all-gathers; temporaries 4.57x
    # at S=4, M=16); then R^2 partial permutations, all in flight at once
    # (3.31x at S=4, M=1; 3.02x at S=2, M=1).
    width = 256
    found = {}
    for name, stages, m in (
      ("explicit", 4, 16),
      ("explicit", 4, 1),
      ("explicit", 2, 1),
      ("auto", 4, 16),
    ):
      step = pipeline_cost.compiled_step(
        (stages, 8 // stages),
        dict(AXES)[name],
        width,
        hkb.Pipeline("stage", m, "circular"),
        placement="stage",
        batch=BATCH,
      )
      found[name, stages, m] = (
        step.compiled.memory_analysis().temp_size_in_bytes / step.stage_param_bytes,
        pipeline_cost.measured(step)["all-gather"],
      )
    for (name, stages, m), (temp, _) in found.items():
      if name == "explicit":
        self.assertLessEqual(temp, 3, (stages, m, found))
    self.assertLessEqual(found["explicit", 4, 16][1], found["auto", 4, 16][1], found)


class RematPolicyTest(parameterized.TestCase):
  """`remat_policy` changes only what a stage keeps: its compiled temporaries."""

  @parameterized.parameters("gpipe", "circular")
  def test_a_policy_that_keeps_more_holds_more(self, schedule):
    # Keeping nothing but each layer's input < keeping the matmuls' outputs
    # too < keeping everything (the tanh's as well), per microbatch in
    # flight: the orders of what each policy keeps.
    pipe = hkb.Pipeline("stage", 4, schedule)
    policies = jax.checkpoint_policies
    temp = [
      compiled_step((2, 4), None, 16, pipe, remat=True, remat_policy=policy)[0]
      .memory_analysis()
      .temp_size_in_bytes
      for policy in (
        policies.nothing_saveable,
        policies.dots_saveable,
        policies.everything_saveable,
      )
    ]
    self.assertLess(temp[0], temp[1], temp)
    self.assertLess(temp[1], temp[2], temp)


# The bytes test's steps: stage=2 x data=4, M=4, width 16, compiled once each.
BYTES_MESH, BYTES_M, BYTES_WIDTH = (2, 4), 4, 16
# Band of measured over theory: a regression either way leaves it. The
# gradient's reduction has issue 43's bound, 1.1x.
BAND, GRADIENT_BAND = (0.95, 1.05), (0.95, 1.1)
# Tested apart: the gradient's reduction over `data`, once per step (issue
# 43, in its own band), and circular with params stored over the stages on
# Auto axes (not at theory: the partitioner's all-to-all and the gradient
# gathered whole, docs/sharding.md; expected to fail).
GRADIENT_ROW = "all-reduce data"
CIRCULAR_STORED_AUTO = ("circular", "stage", "auto")


@functools.cache
def bytes_per_step(schedule, placement, axes):
  """`(measured, theory)` bytes per device of one step, by row of `pipeline_cost.ROWS`."""
  step = pipeline_cost.compiled_step(
    BYTES_MESH,
    dict(AXES)[axes],
    BYTES_WIDTH,
    hkb.Pipeline("stage", BYTES_M, schedule),
    placement=placement,
    batch=BATCH,
  )
  return pipeline_cost.measured(step), pipeline_cost.theory(step)


def off_theory(cases, rows, band=BAND):
  """`[(case, row, measured, theory)]` where measured is outside `band` of theory."""
  low, high = band
  found = []
  for case in cases:
    measured, theory = bytes_per_step(*case)
    for row in rows:
      if not low * theory[row] <= measured[row] <= high * theory[row]:
        found.append((case, row, measured[row], theory[row]))
  return found


CASES = [
  (schedule, placement, axes)
  for schedule in ("gpipe", "circular")
  for placement in pipeline_cost.PLACEMENTS
  for axes, _ in AXES
]


class BytesPerStepTest(parameterized.TestCase):
  """Bytes each collective kind moves per device and step, against theory.

  Theory is testing/pipeline_cost.py's (docs/sharding.md): the boundary
  activations and their cotangents at every step of the timetable, the
  stack's output from the last stage, the gradient whole on every device
  for params as init returns them, the stage's gradient reduced over
  `data` once. Measured from the compiled HLO, every op by the trip counts
  of the loops around it.
  """

  @parameterized.parameters(*CASES)
  def test_at_theory(self, schedule, placement, axes):
    if (schedule, placement, axes) == CIRCULAR_STORED_AUTO:
      self.skipTest("Expected off theory: test_circular_stored_on_auto_axes_at_theory.")
    rows = [row for row in pipeline_cost.ROWS if row != GRADIENT_ROW]
    self.assertEmpty(off_theory([(schedule, placement, axes)], rows))

  def test_explicit_axes_move_what_auto_axes_move(self):
    # Before issue 34, 7 all-gathers over `data` on Explicit axes (gpipe),
    # none on Auto: the shard_map's inputs, outputs and residuals whole.
    for schedule, placement, _ in CASES:
      if schedule == "circular" and placement == "stage":
        continue  # Auto's partitioner moves more: below.
      self.assertEqual(
        bytes_per_step(schedule, placement, "explicit")[0],
        bytes_per_step(schedule, placement, "auto")[0],
        (schedule, placement),
      )

  def test_gradient_reduced_over_data_once_per_step(self):
    # Each device sums the gradient of the stage's params over its
    # microbatches and it is reduced over `data` once, after the timetable
    # (issue 43). Until then XLA reduced each layer's gradient where it was
    # made, inside the backward loops: (M+S-1)x one reduction for GPipe
    # (5.0x here), 4.25x for circular (R=4).
    self.assertEmpty(off_theory(CASES, [GRADIENT_ROW], GRADIENT_BAND))

  def test_gradient_reduced_once_at_more_microbatches(self):
    # Flat in M: at M=16 it was 17x (GPipe) and 16.25x (circular).
    cases = [(schedule, "init", axes) for schedule in ("gpipe", "circular") for axes, _ in AXES]
    wrong = []
    for schedule, placement, axes in cases:
      step = pipeline_cost.compiled_step(
        BYTES_MESH,
        dict(AXES)[axes],
        BYTES_WIDTH,
        hkb.Pipeline("stage", 16, schedule),
        placement=placement,
        batch=64,
      )  # One row per data device in a microbatch.
      measured = pipeline_cost.measured(step)[GRADIENT_ROW]
      theory = pipeline_cost.theory(step)[GRADIENT_ROW]
      if not GRADIENT_BAND[0] * theory <= measured <= GRADIENT_BAND[1] * theory:
        wrong.append((schedule, axes, measured, theory))
    self.assertEmpty(wrong)

  def test_circular_sends_params_stored_over_stages_once(self):
    # Each stage sends its stored layers once, to the stages whose visits
    # run them (R permutations of the stages, P/R each), and the gradient
    # back: 2P of collective-permutes beside the boundary activations, no
    # all-gather or all-to-all. Until issue 43 an all-gather of each leaf's
    # whole stack (S·P, twice); then R^2 partial permutations, each counted
    # on every device: 2·R·P.
    self.assertEmpty(off_theory([("circular", "stage", "explicit")], pipeline_cost.ROWS))

  @unittest.expectedFailure
  def test_circular_stored_on_auto_axes_at_theory(self):
    # Auto axes' types do not say the params are stored over the stages,
    # so the stages read them through the partitioner: an all-to-all of P
    # (the layers in; no collective-permute) and the gradient gathered
    # whole (S·P) where theory has the same 2P of permutes as Explicit.
    self.assertEmpty(off_theory([CIRCULAR_STORED_AUTO], pipeline_cost.ROWS))


if __name__ == "__main__":
  absltest.main()
