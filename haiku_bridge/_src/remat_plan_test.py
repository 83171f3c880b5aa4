"""Tests for `remat="auto"`: predictions against compiled memory, the choice against the manual plans."""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from haiku_bridge._src import caches
from haiku_bridge._src import loop as loop_lib
from haiku_bridge._src import remat_plan
from testing import remat_models
from testing import test_utils

KEY = jax.random.PRNGKey(0)
# Small widths: the grid compiles a few dozen training steps.
MODELS = remat_models.models(lstm_lengths=(256, 1024, 4096),
                             mlp_depths=(16, 64), transformer_depths=(16, 64))


def temporaries(model, params, x, **remat):
  """Compiled temporaries of a training step of `model` run with `remat`."""
  net, _ = model(**remat)
  step = jax.value_and_grad(lambda p, x: net.apply(p, None, x))
  return jax.jit(step).lower(params, x).compile().memory_analysis(
      ).temp_size_in_bytes


def recomputed(remat, length, groups=None):
  """Steps a manual plan recomputes: what each `remat=` runs again."""
  if remat is False:
    return 0
  if remat is True:
    return length
  return length + loop_lib.schedule(remat, length, groups).recomputed_steps


class PredictionTest(parameterized.TestCase):

  @parameterized.named_parameters(*MODELS.items())
  def test_predicted_memory_and_the_choice_under_three_budgets(self, model):
    net, x = model()
    params = net.init(KEY, x)
    length = x.shape[0] if "lstm" in self._testMethodName else int(
        jax.tree.leaves(params)[0].shape[0])
    with remat_models.plans_made() as made:
      temporaries(model, params, x, remat="auto", memory_budget=1 << 40)
    plan = made[-1]
    self.assertEqual(plan.length, length)

    # The manual plans, compiled: each one's memory, and its prediction.
    manual = [(False, None), (True, None), ("nested", None),
              ("binomial", None), ("nested", 2)]
    compiled = {}
    for remat, groups in manual:
      compiled[remat, groups] = temporaries(
          model, params, x, remat=remat,
          **({} if groups is None else {"remat_groups": groups}))
    by_kind = {(c.remat, c.groups): c for c in plan.candidates}
    for remat in (False, True):
      predicted = by_kind[remat, None].temporaries
      self.assertLess(abs(predicted / compiled[remat, None] - 1), 0.10,
                      (remat, predicted, compiled[remat, None]))

    smallest = min(c.temporaries for c in plan.candidates)
    budgets = {"loose": by_kind[False, None].temporaries * 1.01,
               "middle": (by_kind[True, None].temporaries + smallest) / 2,
               "tight": smallest * 1.01}
    for name, budget in budgets.items():
      budget = int(budget)
      with remat_models.plans_made() as made:
        got = temporaries(model, params, x, remat="auto",
                          memory_budget=budget)
      choice = made[-1].choice
      # Predicted against compiled, for the plan chosen; then the budget.
      self.assertLess(abs(choice.temporaries / got - 1), 0.10,
                      (name, choice, got))
      self.assertLessEqual(got, budget * 1.05, (name, choice))
      # No manual plan that fits (compiled) recomputes less.
      fitting = [recomputed(remat, length, groups)
                 for (remat, groups), memory in compiled.items()
                 if memory <= budget]
      if fitting:
        self.assertLessEqual(choice.recomputed_steps, 1.05 * min(fitting),
                             (name, choice, compiled))
    if "loss_after" not in self._testMethodName:
      # Where the outputs do not dominate, the tight budget needs a schedule.
      self.assertIn(made[-1].choice.remat, ("binomial", "nested"))


def unroll(scan, length=16):
  """An LSTM through `scan` (a dynamic_unroll), its loss of every output."""
  def f(xs):
    core = hk.LSTM(8)
    ys, state = scan(core, xs, core.initial_state(2))
    return jnp.sum(ys ** 2) + jnp.sum(state.cell)
  return hk.transform(f), jax.random.normal(KEY, [length, 2, 4])


def stack(run):
  def f(x):
    return jnp.sum(run(lambda h: jnp.tanh(hk.Linear(8)(h)), x) ** 2)
  return hk.transform(f), jax.random.normal(KEY, [2, 8])


def value_and_grads(net, x):
  params = net.init(KEY, x)
  return jax.value_and_grad(lambda p: net.apply(p, None, x))(params)


def _deterministic_plan() -> remat_plan.Plan:
  """A plan made from nothing cached: measured, then chosen."""
  def step(h, x):
    h = jnp.tanh(h @ jnp.eye(16) + x)
    return h, jnp.sum(h ** 2)
  with caches.disabled():
    return hkb.remat_plan(step, jnp.zeros([4, 16]), jnp.ones([256, 4, 16]),
                          memory_budget=100_000)


def _print_plan() -> None:
  """In a fresh process: the plan, as `repr` writes it."""
  print(repr(_deterministic_plan()))


class AutoTest(parameterized.TestCase):

  def assert_equal_values(self, ours, theirs):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                         atol=1e-6),
                 ours, theirs)

  def test_dynamic_unroll_and_scan_equal_haiku_at_every_budget(self):
    reference = value_and_grads(*unroll(hk.dynamic_unroll))
    loose = unroll(lambda *a: hkb.dynamic_unroll(
        *a, remat="auto", memory_budget=1 << 40))
    with remat_models.plans_made() as made:
      self.assert_equal_values(value_and_grads(*loose), reference)
    plan = made[-1]
    self.assertIs(plan.choice.remat, False)
    smallest = min(c.temporaries for c in plan.candidates)
    for budget in (plan.choice.temporaries - 1, smallest):
      with remat_models.plans_made() as made:
        self.assert_equal_values(value_and_grads(*unroll(
            lambda *a, b=budget: hkb.dynamic_unroll(
                *a, remat="auto", memory_budget=b))), reference)
      self.assertIsNot(made[-1].choice.remat, False)

      def through_scan(core, xs, state, b=budget):
        state, ys = hkb.scan(lambda s, x: core(x, s)[::-1], state, xs,
                             remat="auto", memory_budget=b)
        return ys, state
      self.assert_equal_values(value_and_grads(*unroll(through_scan)),
                               reference)
    self.assertEqual(made[-1].choice.remat, "binomial")

  def test_layer_scan_and_repeat_layer_equal_the_plain_stack(self):
    plain = value_and_grads(*stack(
        lambda f, x: hkb.repeat_layer(f, x, 12)))
    with remat_models.plans_made() as made:
      loose = value_and_grads(*stack(lambda f, x: hkb.repeat_layer(
          f, x, 12, remat="auto", memory_budget=1 << 40)))
    self.assert_equal_values(loose, plain)
    smallest = min(c.temporaries for c in made[-1].candidates)
    with remat_models.plans_made() as made:
      tight = value_and_grads(*stack(lambda f, x: hkb.repeat_layer(
          f, x, 12, remat="auto", memory_budget=smallest)))
      scanned = value_and_grads(*stack(lambda f, x: hkb.layer_scan(
          lambda h, _: (f(h), None), x, num_layers=12, remat="auto",
          memory_budget=smallest)[0]))
    # Planned at init and at apply, by each.
    self.assertEqual({p.choice.remat for p in made}, {"binomial"})
    self.assert_equal_values(tight, plain)
    self.assert_equal_values(scanned, plain)

  def test_plan_is_deterministic_and_measured_once_per_step_shape(self):
    def step(h, x):
      h = jnp.tanh(h @ jnp.eye(16) + x)
      return h, jnp.sum(h ** 2)

    h = jnp.zeros([4, 16])
    with mock.patch.object(remat_plan, "_measure",
                           wraps=remat_plan._measure) as measure:
      first = hkb.remat_plan(step, h, jnp.ones([256, 4, 16]),
                             memory_budget=100_000)
      compiles = measure.call_count
      self.assertEqual(compiles, 6)
      # Another budget, or another length of 128 steps or more: the same
      # measurements (when caches are on).
      again = hkb.remat_plan(step, h, jnp.ones([256, 4, 16]),
                             memory_budget=100_000)
      hkb.remat_plan(step, h, jnp.ones([512, 4, 16]), memory_budget=1 << 30)
      self.assertEqual(measure.call_count,
                       compiles if caches.enabled() else 3 * compiles)
      self.assertEqual(again, first)
      # Another shape is measured.
      hkb.remat_plan(step, jnp.zeros([8, 16]), jnp.ones([256, 8, 16]),
                     memory_budget=1 << 30)
      self.assertEqual(measure.call_count,
                       (2 if caches.enabled() else 4) * compiles)
      with caches.disabled():
        self.assertEqual(hkb.remat_plan(step, h, jnp.ones([256, 4, 16]),
                                        memory_budget=100_000), first)
    self.assertEqual(
        [c.recomputed_steps for c in first.candidates],
        sorted(c.recomputed_steps for c in first.candidates))
    self.assertLessEqual(first.choice.temporaries, 100_000)

  def test_plan_in_a_fresh_process_is_this_ones(self):
    # The restore-a-checkpoint path: nothing cached, the same plan.
    here = repr(_deterministic_plan())
    child = test_utils.run_in_fresh_process(__file__, "_print_plan")
    self.assertEqual(child.returncode, 0, child.stderr[-3000:])
    self.assertEqual(child.stdout.strip().splitlines()[-1], here)

  def test_identity_custom_getter_changes_nothing(self):
    def getter(next_getter, value, context):
      del context
      return next_getter(value)

    def run(f, x):
      return hkb.repeat_layer(f, x, 12, remat="auto", memory_budget=budget)

    def with_getter(f, x):
      with hk.custom_getter(getter):
        return run(f, x)

    with remat_models.plans_made() as made:
      value_and_grads(*stack(lambda f, x: hkb.repeat_layer(
          f, x, 12, remat="auto", memory_budget=1 << 40)))
    budget = min(c.temporaries for c in made[-1].candidates)
    with remat_models.plans_made() as plain_plans:
      plain = value_and_grads(*stack(run))
    with remat_models.plans_made() as getter_plans:
      got = value_and_grads(*stack(with_getter))
    self.assertEqual(getter_plans, plain_plans)
    self.assertNotIn(plain_plans[-1].choice.remat, (False, True))
    self.assert_equal_values(got, plain)

  def test_budget_below_the_smallest_names_it(self):
    def step(h, x):
      return jnp.tanh(h + x), None

    h, xs = jnp.zeros([4, 16]), jnp.ones([64, 4, 16])
    plan = hkb.remat_plan(step, h, xs, memory_budget=1 << 30)
    smallest = min(c.temporaries for c in plan.candidates)
    with self.assertRaisesRegex(
        ValueError, f"hkb.remat_plan: no remat plan for 64 steps fits "
        f"memory_budget=100 bytes: the least any needs is {smallest} "):
      hkb.remat_plan(step, h, xs, memory_budget=100)
    # Outside a transform, hkb.scan runs the same 64 steps.
    with self.assertRaisesRegex(ValueError, f"hkb.scan: no remat plan .* "
                                f"the least any needs is {smallest} "):
      hkb.scan(step, h, xs, remat="auto", memory_budget=100)

  @parameterized.parameters(
      (dict(remat="auto"), ValueError, "needs `memory_budget=`"),
      (dict(memory_budget=1000), ValueError, "`memory_budget` needs"),
      (dict(remat="auto", memory_budget=-1), ValueError, "positive int"),
      (dict(remat="auto", memory_budget="1GB"), TypeError, "positive int"),
      (dict(remat="auto", memory_budget=1000, remat_policy=(
          jax.checkpoint_policies.nothing_saveable)), ValueError,
       "`remat_policy` needs `remat=True`"),
  )
  def test_options_refused(self, options, error, text):
    net = hk.transform(lambda x: hkb.repeat_layer(
        lambda h: hk.Linear(8)(h), x, 4, **options))
    with self.assertRaisesRegex(error, text):
      net.init(KEY, jnp.ones([2, 8]))


if __name__ == "__main__":
  absltest.main()
