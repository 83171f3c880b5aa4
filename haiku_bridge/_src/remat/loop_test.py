"""Tests for the loop under the scans: jax.lax.scan's values and gradients in every remat mode."""

import dataclasses
import functools
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import errors
from haiku_bridge._src.remat import loop
from haiku_bridge._src.remat import measure
from haiku_bridge._src.remat import plan as remat_plan
from testing import test_utils

STEPS = 7  # √7 divides nothing: "nested" runs groups of 3, 3 and 1.
W = jax.random.normal(jax.random.PRNGKey(0), [4, 4]) / 2
XS = jax.random.normal(jax.random.PRNGKey(1), [STEPS, 2, 4])
H = jnp.ones([2, 4])


def step(w):
  """A step closing over the shared weight `w`, as a time scan's does."""

  def f(h, x):
    h = jnp.tanh(h @ w + x)
    return h, jnp.sum(h**2, axis=-1)

  return f


def loss(run, reverse=False):
  def f(w, h, xs):
    h, ys = run(step(w), h, xs, STEPS, reverse)
    return jnp.sum(h**2) + jnp.sum(jnp.sin(ys))

  return f


def lax_scan(body, carry, xs, length, reverse):
  return jax.lax.scan(body, carry, xs, length=length, reverse=reverse)


class LoopTest(parameterized.TestCase):
  @parameterized.product(remat=loop.REMAT_MODES, reverse=(False, True))
  def test_values_and_gradients_of_lax_scan(self, remat, reverse):
    ours = loop.Loop(remat=remat, unroll=2)
    grad = lambda run: jax.jit(jax.value_and_grad(loss(run, reverse), argnums=(0, 1, 2)))
    chex.assert_trees_all_close(
      grad(ours)(W, H, XS), grad(lax_scan)(W, H, XS), rtol=1e-5, atol=1e-6
    )

  @parameterized.parameters(*loop.REMAT_MODES)
  def test_shared_weight_gradient_is_one_buffer(self, remat):
    # The gradient of `w`, which every step closes over, is summed in one
    # buffer: no value of the backward pass holds a copy of `w` per step.
    shapes = test_utils.value_shapes(jax.grad(loss(loop.Loop(remat=remat))), W, H, XS)
    self.assertIn(W.shape, shapes)
    self.assertNotIn((STEPS,) + W.shape, shapes)

  @parameterized.parameters(*loop.REMAT_SCHEDULES)
  def test_groups(self, remat):
    ours = loop.Loop(remat=remat, groups=2)
    chex.assert_trees_all_close(
      jax.grad(loss(ours))(W, H, XS), jax.grad(loss(lax_scan))(W, H, XS), rtol=1e-5, atol=1e-6
    )

  def test_policy(self):
    ours = loop.Loop(remat=True, policy=jax.checkpoint_policies.nothing_saveable)
    chex.assert_trees_all_close(
      jax.grad(loss(ours))(W, H, XS), jax.grad(loss(lax_scan))(W, H, XS), rtol=1e-5, atol=1e-6
    )

  @parameterized.parameters(*loop.REMAT_MODES)
  def test_no_steps(self, remat):
    h, ys = loop.Loop(remat=remat)(step(W), H, XS[:0], 0)
    chex.assert_trees_all_equal((h, ys), (H, jnp.zeros([0, 2])))


class ResolvedTest(absltest.TestCase):
  """`resolved`: a plan for `remat="auto"` only where a backward pass of this loop follows."""

  AUTO = loop.Loop(remat="auto", memory_budget=1 << 20, unroll=2)

  def resolve(self, run):
    """`run()`'s result, and the lengths `remat_plan.loop_plan` was asked to plan."""
    asked = []

    def loop_plan(f, init, xs, length, *args):
      del f, init, xs, args
      asked.append(length)
      # A stand-in: this test is about when a plan is made, not which.
      return mock.Mock(choice=remat_plan.RematCandidate("binomial", 3, None, 0, 0, 0))

    with mock.patch.object(remat_plan, "loop_plan", loop_plan):
      return run(), asked

  def resolved(self, **kwargs):
    return loop.resolved(self.AUTO, step(W), H, XS, STEPS, **kwargs)

  def in_transform(self, init: bool):
    got = []
    f = hk.transform(lambda: got.append(self.resolved()))
    if init:
      f.init(None)
    else:
      f.apply({}, None)
    return got[0]

  def test_plans_outside_a_transform_and_at_apply(self):
    for run in (self.resolved, lambda: self.in_transform(init=False)):
      resolved, asked = self.resolve(run)
      self.assertEqual(asked, [STEPS])
      self.assertEqual(resolved, loop.Loop("binomial", unroll=2, slots=3, planned=True))

  def test_the_loop_runs_each_choice_as_planned(self):
    # Whatever the plan chose, the loop runs that: its slots, its groups,
    # the policy only where the choice runs under it.
    policy = jax.checkpoint_policies.dots_saveable
    auto = loop.Loop(remat="auto", policy=policy, memory_budget=1 << 20, unroll=2)
    candidate = lambda remat, slots=None, groups=None, policy=None: remat_plan.RematCandidate(
      remat, slots, groups, 0, 0, 0, policy
    )
    for choice, runs in (
      (candidate("binomial", slots=3), loop.Loop("binomial", unroll=2, slots=3)),
      (candidate("nested", slots=5, groups=4), loop.Loop("nested", groups=4, unroll=2)),
      (candidate(True, policy=measure.policy_name(policy)), loop.Loop(True, policy, unroll=2)),
      (candidate(True), loop.Loop(True, unroll=2)),
      (candidate(False), loop.Loop(False, unroll=2)),
    ):
      with mock.patch.object(
        remat_plan, "loop_plan", lambda *_, choice=choice: mock.Mock(choice=choice)
      ):
        self.assertEqual(
          loop.resolved(auto, step(W), H, XS, STEPS),
          dataclasses.replace(runs, planned=True),
          choice,
        )

  def test_plain_at_init_for_a_whole_pipelined_stack_and_without_steps(self):
    for run in (
      lambda: self.in_transform(init=True),
      lambda: self.resolved(whole_pipelined_stack=True),
    ):
      resolved, asked = self.resolve(run)
      self.assertEqual(asked, [])
      self.assertEqual(resolved, loop.Loop(unroll=2))
    resolved, asked = self.resolve(lambda: loop.resolved(self.AUTO, step(W), H, XS[:0], 0))
    self.assertEqual((resolved, asked), (loop.Loop(unroll=2), []))

  def test_other_modes_run_as_they_are(self):
    for remat in loop.REMAT_MODES:
      ours = loop.Loop(remat=remat, unroll=2)
      resolved, asked = self.resolve(functools.partial(loop.resolved, ours, step(W), H, XS, STEPS))
      self.assertIs(resolved, ours)
      self.assertEqual(asked, [])

  def test_a_loop_called_with_auto_runs_its_plan(self):
    # Values only: the stand-in plan ("binomial", 3 slots) runs as planned.
    ours, asked = self.resolve(lambda: jax.grad(loss(self.AUTO))(W, H, XS))
    self.assertEqual(asked, [STEPS])
    chex.assert_trees_all_close(ours, jax.grad(loss(lax_scan))(W, H, XS), rtol=1e-5, atol=1e-6)


class OptionsTest(parameterized.TestCase):
  @parameterized.named_parameters(
    (
      "unknown",
      dict(remat="sqrt"),
      ValueError,
      r"`remat` must be False, True, \"nested\", \"binomial\" or \"auto\"; got a "
      "str 'sqrt'",
    ),
    (
      "int",
      dict(remat=4),
      TypeError,
      r"`remat` must be .*e\.g\. remat=\"nested\", remat_groups=4\.",
    ),
    (
      "policy",
      dict(remat="nested", remat_policy=jax.checkpoint_policies.everything_saveable),
      ValueError,
      r"`remat_policy` needs `remat=True`",
    ),
    (
      "policy_type",
      dict(remat=True, remat_policy="dots"),
      TypeError,
      "`remat_policy` must be None or a jax.checkpoint_policies policy",
    ),
    (
      "groups_without_schedule",
      dict(remat=True, remat_groups=2),
      ValueError,
      r"`remat_groups` needs `remat=\"nested\"`",
    ),
    (
      "bad_groups",
      dict(remat="nested", remat_groups=0),
      ValueError,
      "`remat_groups` must be a positive int",
    ),
    ("unroll", dict(unroll=-1), ValueError, "`unroll` must be a bool or a non-negative int"),
    ("unroll_type", dict(unroll=1.5), TypeError, "`unroll` must be a bool or a non-negative int"),
  )
  def test_refused_naming_the_call(self, options, error, message):
    with errors.entry("some_scan"):
      with self.assertRaisesRegex(error, "^hkb.some_scan: " + message):
        loop.from_options(**options)

  def test_numpy_values(self):
    self.assertEqual(
      loop.from_options(remat=np.bool_(True), unroll=np.int64(2)), loop.Loop(remat=True, unroll=2)
    )
    self.assertEqual(
      loop.from_options(remat="binomial", remat_groups=np.int32(3), unroll=np.bool_(True)),
      loop.Loop(remat="binomial", groups=3, unroll=True),
    )

  def test_schedules(self):
    # remat_groups sets how many groups "nested" runs: here 4, 4 and 2 steps.
    self.assertEqual(loop.schedule("nested", 10, 3), loop.remat_schedule.nested(10, 3))
    # With remat_groups, "binomial" recomputes no more than that "nested".
    nested = loop.schedule("nested", 128, 4)
    binomial = loop.schedule("binomial", 128, 4)
    self.assertLessEqual(binomial.recomputed_steps, nested.recomputed_steps)
    self.assertLessEqual(binomial.num_slots, nested.num_slots)
    # Without remat_groups, the fewest slots for at most one more forward
    # pass (schedule_test checks those against Griewank's bound).
    self.assertEqual(
      loop.schedule("binomial", 100, None),
      loop.remat_schedule.binomial(100, loop.remat_schedule.fewest_binomial_slots(100, 99)),
    )
    # Built and counted: within T - 1 recomputed steps, and one slot fewer
    # is not (9 and 65 steps: one slot fewer recomputes exactly T).
    for length in (9, 65, 100):
      got = loop.schedule("binomial", length, None)
      fewer = loop.remat_schedule.binomial(length, got.num_slots - 1)
      self.assertLessEqual(got.recomputed_steps, length - 1, length)
      self.assertGreater(fewer.recomputed_steps, length - 1, length)


if __name__ == "__main__":
  absltest.main()
