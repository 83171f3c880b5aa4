"""What every scan checks of its body and its steps, in the scan's words."""

from absl.testing import absltest
import jax.numpy as jnp

from haiku_bridge._src.remat import step_checks

WORDS = step_checks.StepWords(
  body="`f`", pair="(carry, y)", carry="carry", step="step", subject="it"
)
TIME = step_checks.StepAxis(
  "length", 0, "an array with a leading time axis", "no {name} to count steps from: pass length="
)
LAYERS = step_checks.StepAxis("num_layers", 1, "an array", "no {name}: pass num_layers=")


class StepOutputTest(absltest.TestCase):
  def test_a_pair_with_a_carry_like_the_one_given_passes(self):
    carry = {"h": jnp.zeros([2, 3])}
    out = ({"h": jnp.ones([2, 3])}, jnp.ones([4]))
    self.assertIs(step_checks.check_step_output(out, carry, WORDS), out)

  def test_not_a_pair_is_named_with_what_it_was(self):
    with self.assertRaisesRegex(
      ValueError,
      r"`f` must return a pair "
      r"\(carry, y\); it returned a list",
    ):
      step_checks.check_step_output([jnp.ones(2)], jnp.ones(2), WORDS)

  def test_a_changed_carry_says_both(self):
    with self.assertRaisesRegex(
      ValueError,
      r"must return a carry like the one it gets, since the "
      r"next step takes it; it got float32\[2\] and returned int32\[2\]",
    ):
      step_checks.check_step_output((jnp.ones(2, jnp.int32), None), jnp.ones(2), WORDS)

  def test_a_weak_typed_carry_is_like_its_promoted_type(self):
    self.assertIsNone(step_checks.carry_change(jnp.float32(1), 1.0))
    self.assertIsNotNone(step_checks.carry_change(jnp.ones(2), jnp.ones(3)))

  def test_a_checked_body_checks_each_call(self):
    body = step_checks.CheckedBody(lambda c, x: (c + x, c), WORDS)
    self.assertEqual(body, step_checks.CheckedBody(body.f, WORDS))
    carry, y = body(jnp.ones(2), jnp.ones(2))
    self.assertEqual(carry.shape, (2,))
    broken = step_checks.CheckedBody(lambda c, x: c, WORDS)
    with self.assertRaisesRegex(ValueError, "must return a pair"):
      broken(jnp.ones(2), jnp.ones(2))


class NumStepsTest(absltest.TestCase):
  def test_the_count_is_given_or_read_off_the_leading_axis(self):
    xs = {"a": jnp.ones([5, 2]), "b": jnp.ones([5])}
    self.assertEqual(step_checks.num_steps(None, xs, TIME), 5)
    self.assertEqual(step_checks.num_steps(5, xs, TIME), 5)
    self.assertEqual(step_checks.num_steps(3, None, TIME), 3)

  def test_a_leaf_of_another_length_is_named_by_its_path(self):
    with self.assertRaisesRegex(
      ValueError,
      r"xs\['b'\] has shape \(4,\), but every leaf of xs needs "
      r"a leading time axis of 5 steps \(as xs\['a'\] has\)\.",
    ):
      step_checks.num_steps(None, {"a": jnp.ones([5]), "b": jnp.ones([4])}, TIME)

  def test_no_leaves_and_no_count_says_what_to_pass(self):
    with self.assertRaisesRegex(ValueError, "no xs to count steps from"):
      step_checks.num_steps(None, None, TIME)

  def test_a_layer_count_must_be_positive(self):
    with self.assertRaisesRegex(ValueError, "num_layers"):
      step_checks.num_steps(0, None, LAYERS)
    with self.assertRaisesRegex(TypeError, "length"):
      step_checks.num_steps(2.5, None, TIME)


if __name__ == "__main__":
  absltest.main()
