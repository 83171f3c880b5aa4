"""Tests for `tracing.py`: what a plan cannot see around its loop, said where it may happen."""

import jax
from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import math
from unittest import mock

from absl.testing import absltest
import haiku as hk
import jax.numpy as jnp

import haiku_bridge as hkb
from haiku_bridge._src.remat import hlo_flops
from haiku_bridge._src.remat import plan as remat_plan
from haiku_bridge._src.remat import tracing
from testing import remat_models
from testing.plan_fixtures import CPU_SIZED
from testing.plan_fixtures import on_cpu_and_gpu

KEY = jax.random.PRNGKey(0)


class SaidTest(absltest.TestCase):
  """Each warning a plan gives of what it cannot see: once a process, and only where it may happen."""

  def setUp(self):
    super().setUp()
    # A slow plan's closing line is a WARNING too (plan_test's
    # `ProgressTest`): none here, however slow the machine.
    self.enter_context(mock.patch.object(remat_plan, "SLOW_PLAN_SECONDS", math.inf))

  def test_a_loop_under_auto_axes_says_it_is_planned_on_the_shapes_it_sees(self):
    # The gap of a data-parallel step over Auto axes (plan_test's
    # `KnownGapsTest`), said where it may happen: once a process for each
    # mesh of Auto axes over more than one device; not over Explicit axes.
    if jax.device_count() < 2:
      self.skipTest(f"needs 2 devices, jax has {jax.device_count()}.")
    w = jax.random.normal(KEY, [16, 16]) / 4
    xs = jnp.ones([8, 4, 16])

    def loss(w, xs):
      step = lambda h, x: (jnp.tanh(h @ w + x), None)
      h, _ = hkb.scan(step, jnp.zeros([4, 16]), xs, remat="auto", memory_budget=1 << 30)
      return jnp.sum(h**2)

    def trace(kind, axis):
      mesh = jax.make_mesh((2,), (axis,), axis_types=(kind,))
      with jax.set_mesh(mesh):
        jax.eval_shape(jax.grad(loss), w, xs)

    auto = jax.sharding.AxisType.Auto
    with self.assertLogs(tracing.LOG, "WARNING") as said:
      trace(auto, "said_once")
    (message,) = said.output
    self.assertIn("mesh axes of type Auto (said_once: 2)", message)
    self.assertIn("inside jax.shard_map the plan is one device's", message)
    with self.assertNoLogs(tracing.LOG, "WARNING"):
      trace(auto, "said_once")
      trace(jax.sharding.AxisType.Explicit, "explicit")

  def test_a_loop_inside_a_jax_loop_under_the_gradient_says_so(self):
    # Once for each outer loop; not where a checkpoint of the outer body
    # keeps one iteration's residuals at a time, a gradient is taken inside
    # the outer body, or a jit lies between the loop and the gradient.
    w = jnp.ones([8, 8]) / 8
    xs = jnp.ones([3, 16, 2, 8])

    def inner(w, seq):
      h, _ = hkb.scan(
        lambda h, x: (jnp.tanh(h @ w + x), None),
        jnp.zeros([2, 8]),
        seq,
        remat="auto",
        memory_budget=1 << 30,
      )
      return jnp.sum(h**2)

    def body(total, seq):
      return total + inner(w, seq), None

    def fori_body(i, total):
      return total + inner(w, xs[i])

    with self.assertLogs(tracing.LOG, "WARNING") as said:
      jax.grad(lambda w: jax.lax.scan(body, 0.0, xs)[0])(w)
      jax.eval_shape(jax.grad(lambda w: jax.lax.scan(body, 0.0, xs)[0]), w)
      jax.grad(lambda w: jax.lax.fori_loop(0, 3, fori_body, 0.0))(w)
    scan_said, fori_said = said.output
    self.assertIn("runs inside a loop of JAX's (the scan of body at ", scan_said)
    self.assertIn("Checkpoint its body (jax.checkpoint)", scan_said)
    self.assertIn("(the fori_loop of fori_body at ", fori_said)

    def checkpointed(total, seq):
      return total + inner(w, seq), None

    with self.assertNoLogs(tracing.LOG, "WARNING"):
      jax.grad(lambda w: jax.lax.scan(jax.checkpoint(checkpointed), 0.0, xs)[0])(w)
      jax.lax.scan(lambda g, seq: (g + jax.grad(inner)(w, seq), None), jnp.zeros_like(w), xs)
      jax.grad(jax.jit(lambda w: inner(w, xs[0])))(w)

  @on_cpu_and_gpu(CPU_SIZED)
  def test_a_loop_inside_a_plain_haiku_bridge_loop_is_said_unless_planned(self):
    # An RNN stack: 6 layers (`hkb.repeat_layer`), each a time scan of 64
    # steps with "auto". With the stack's remat=False its scan keeps every
    # layer's residuals of the time scan (the step compiled to 1,077,552
    # bytes, the time scan's plan 198,896); with "auto" the stack's plan
    # measures its step, the time scans inside included, and holds it
    # (binomial, 2 slots: 554,012 bytes predicted and compiled at a budget of
    # 600,000): nothing is said, where its plan is the plain loop too.
    xs = jax.random.normal(KEY, [64, 8, 32])

    def stack(outer, budget):
      def layer(h):
        core = hk.VanillaRNN(32)
        out, _ = hkb.dynamic_unroll(
          core, h, core.initial_state(8), remat="auto", memory_budget=200_000
        )
        return h + out

      return hk.transform(
        lambda xs: jnp.sum(
          hkb.repeat_layer(
            layer, xs, 6, remat=outer, **({} if budget is None else dict(memory_budget=budget))
          )
          ** 2
        )
      )

    params = stack(False, None).init(KEY, xs)

    def step(outer, budget=None):
      net = stack(outer, budget)
      with remat_models.plans_made() as made:
        compiled = (
          jax.jit(jax.value_and_grad(lambda p, xs: net.apply(p, None, xs)))
          .lower(params, xs)
          .compile()
        )
      return made, hlo_flops.held(compiled).bytes

    tracing._SAID.discard(("outer loop", "haiku_bridge"))  # pylint: disable=protected-access
    with self.assertNoLogs(tracing.LOG, "WARNING"):
      made, _ = step("auto", 1 << 40)
      self.assertIs(made[1].choice.remat, False)  # The stack's.
      made, kept = step("auto", 600_000)
    self.assertEqual(made[1].choice.remat, "binomial")
    self.assertLessEqual(kept, 600_000)
    with self.assertLogs(tracing.LOG, "WARNING") as said:
      _, kept = step(False)
    self.assertIn("inside a haiku_bridge loop with remat=False", said.output[0])
    self.assertGreater(kept, 5 * 200_000)


if __name__ == "__main__":
  absltest.main()
