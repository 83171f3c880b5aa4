"""Tests for the loop under the scans: jax.lax.scan's values and gradients in every remat mode."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import errors
from haiku_bridge._src.remat import loop
from testing import test_utils

STEPS = 7  # √7 divides nothing: "nested" runs groups of 3, 3 and 1.
W = jax.random.normal(jax.random.PRNGKey(0), [4, 4]) / 2
XS = jax.random.normal(jax.random.PRNGKey(1), [STEPS, 2, 4])
H = jnp.ones([2, 4])


def step(w):
  """A step closing over the shared weight `w`, as a time scan's does."""
  def f(h, x):
    h = jnp.tanh(h @ w + x)
    return h, jnp.sum(h ** 2, axis=-1)
  return f


def loss(run, reverse=False):
  def f(w, h, xs):
    h, ys = run(step(w), h, xs, STEPS, reverse)
    return jnp.sum(h ** 2) + jnp.sum(jnp.sin(ys))
  return f


def lax_scan(body, carry, xs, length, reverse):
  return jax.lax.scan(body, carry, xs, length=length, reverse=reverse)


class LoopTest(parameterized.TestCase):

  @parameterized.product(remat=loop.REMAT_MODES, reverse=(False, True))
  def test_values_and_gradients_of_lax_scan(self, remat, reverse):
    ours = loop.Loop(remat=remat, unroll=2)
    grad = lambda run: jax.jit(jax.value_and_grad(loss(run, reverse),
                                                  argnums=(0, 1, 2)))
    chex.assert_trees_all_close(grad(ours)(W, H, XS),
                                grad(lax_scan)(W, H, XS), rtol=1e-5,
                                atol=1e-6)

  @parameterized.parameters(*loop.REMAT_MODES)
  def test_shared_weight_gradient_is_one_buffer(self, remat):
    # The gradient of `w`, which every step closes over, is summed in one
    # buffer: no value of the backward pass holds a copy of `w` per step.
    shapes = test_utils.value_shapes(jax.grad(loss(loop.Loop(remat=remat))),
                                     W, H, XS)
    self.assertIn(W.shape, shapes)
    self.assertNotIn((STEPS,) + W.shape, shapes)

  @parameterized.parameters(*loop.REMAT_SCHEDULES)
  def test_groups(self, remat):
    ours = loop.Loop(remat=remat, groups=2)
    chex.assert_trees_all_close(jax.grad(loss(ours))(W, H, XS),
                                jax.grad(loss(lax_scan))(W, H, XS),
                                rtol=1e-5, atol=1e-6)

  def test_policy(self):
    ours = loop.Loop(remat=True,
                     policy=jax.checkpoint_policies.nothing_saveable)
    chex.assert_trees_all_close(jax.grad(loss(ours))(W, H, XS),
                                jax.grad(loss(lax_scan))(W, H, XS),
                                rtol=1e-5, atol=1e-6)

  @parameterized.parameters(*loop.REMAT_MODES)
  def test_no_steps(self, remat):
    h, ys = loop.Loop(remat=remat)(step(W), H, XS[:0], 0)
    chex.assert_trees_all_equal((h, ys), (H, jnp.zeros([0, 2])))


class OptionsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("unknown", dict(remat="sqrt"), ValueError,
       r"`remat` must be False, True, \"nested\", \"binomial\" or \"auto\"; got a "
       "str 'sqrt'"),
      ("int", dict(remat=4), TypeError,
       r"`remat` must be .*e\.g\. remat=\"nested\", remat_groups=4\."),
      ("policy", dict(remat="nested",
                      remat_policy=jax.checkpoint_policies.everything_saveable),
       ValueError, r"`remat_policy` needs `remat=True`"),
      ("policy_type", dict(remat=True, remat_policy="dots"), TypeError,
       "`remat_policy` must be None or a jax.checkpoint_policies policy"),
      ("groups_without_schedule", dict(remat=True, remat_groups=2),
       ValueError, r"`remat_groups` needs `remat=\"nested\"`"),
      ("bad_groups", dict(remat="nested", remat_groups=0), ValueError,
       "`remat_groups` must be a positive int"),
      ("unroll", dict(unroll=-1), ValueError,
       "`unroll` must be a bool or a non-negative int"),
      ("unroll_type", dict(unroll=1.5), TypeError,
       "`unroll` must be a bool or a non-negative int"))
  def test_refused_naming_the_call(self, options, error, message):
    with errors.entry("some_scan"):
      with self.assertRaisesRegex(error, "^hkb.some_scan: " + message):
        loop.from_options(**options)

  def test_numpy_values(self):
    self.assertEqual(
        loop.from_options(remat=np.bool_(True), unroll=np.int64(2)),
        loop.Loop(remat=True, unroll=2))
    self.assertEqual(
        loop.from_options(remat="binomial", remat_groups=np.int32(3),
                          unroll=np.bool_(True)),
        loop.Loop(remat="binomial", groups=3, unroll=True))

  def test_schedules(self):
    # remat_groups sets how many groups "nested" runs: here 4, 4 and 2 steps.
    self.assertEqual(loop.schedule("nested", 10, 3),
                     loop.remat_schedule.nested(10, 3))
    # With remat_groups, "binomial" recomputes no more than that "nested".
    nested = loop.schedule("nested", 128, 4)
    binomial = loop.schedule("binomial", 128, 4)
    self.assertLessEqual(binomial.recomputed_steps, nested.recomputed_steps)
    self.assertLessEqual(binomial.num_slots, nested.num_slots)
    # Without remat_groups, the fewest slots for at most one more forward
    # pass (schedule_test checks those against Griewank's bound).
    self.assertEqual(
        loop.schedule("binomial", 100, None),
        loop.remat_schedule.binomial(
            100, loop.remat_schedule.fewest_binomial_slots(100, 99)))

if __name__ == "__main__":
  absltest.main()
