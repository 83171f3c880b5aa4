"""Tests for `remat="auto"`: predictions against compiled memory, the choice against the manual plans."""

import jax
from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import contextlib
import functools
import gc
import logging
import math
import os
import re
from typing import Any, Callable
import unittest
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax.numpy as jnp
import jaxlib
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import haiku_bridge as hkb
from haiku_bridge._src import caches
from haiku_bridge._src import versions
from haiku_bridge._src.remat import hlo_flops
from haiku_bridge._src.remat import choice as remat_choice
from haiku_bridge._src.remat import loop as loop_lib
from haiku_bridge._src.remat import measure
from haiku_bridge._src.remat import plan as remat_plan
from haiku_bridge._src.remat import plan_cache
from haiku_bridge._src.remat import schedule as remat_schedule
from testing import backend_tolerance
from testing import remat_models
from testing import test_utils
from testing.plan_fixtures import compiled_bytes
from testing.plan_fixtures import CPU_SIZED
from testing.plan_fixtures import measuring_compiles
from testing.plan_fixtures import on_cpu_and_gpu
from testing.plan_fixtures import plan_in_a_directory_of_its_own
from testing.plan_fixtures import scan_loss
from testing.plan_fixtures import STEP_TOLERANCE
from testing.plan_fixtures import TOY_BYTES
from testing.plan_fixtures import toy_step

plan_in_a_directory_of_its_own(__file__)

KEY = jax.random.PRNGKey(0)
WIDE = 128  # A layer wide enough that its state outweighs XLA's small buffers.
# Small widths: the grid compiles a few dozen training steps.
MODELS = remat_models.models(
  lstm_lengths=(256, 1024, 4096),
  mlp_depths=(16, 64),
  transformer_depths=(16, 64),
  conv_depths=(32,),
)


def cost(model, params, x, length, **remat) -> remat_models.StepCost:
  """Compiled temporaries and FLOPs of a training step of `model` run with `remat`."""
  return remat_models.step_cost(model, params, x, length, **remat)


def recomputed(remat, length, groups=None):
  """Steps a manual plan recomputes: what each `remat=` runs again."""
  if remat is False:
    return 0
  if remat is True:
    return length
  return length + loop_lib.schedule(remat, length, groups).recomputed_steps


class PredictionTest(parameterized.TestCase):
  @parameterized.named_parameters(*MODELS.items())
  @on_cpu_and_gpu(TOY_BYTES)
  def test_predicted_memory_and_the_choice_under_four_budgets(self, model):
    net, x = model()
    params = net.init(KEY, x)
    length = (
      x.shape[0] if "lstm" in self._testMethodName else int(jax.tree.leaves(params)[0].shape[0])
    )
    with remat_models.plans_made() as made:
      cost(model, params, x, length, remat="auto", memory_budget=1 << 40)
    plan = made[-1]
    self.assertEqual(plan.length, length)

    # The manual plans, compiled: each one's memory and FLOPs, and its
    # prediction.
    manual = [(False, None), (True, None), ("nested", None), ("binomial", None), ("nested", 2)]
    compiled = {}
    for remat, groups in manual:
      compiled[remat, groups] = cost(
        model,
        params,
        x,
        length,
        remat=remat,
        **({} if groups is None else {"remat_groups": groups}),
      )
    by_kind = {(c.remat, c.groups): c for c in plan.candidates}
    for remat in (False, True):
      predicted = by_kind[remat, None].temporaries
      got = compiled[remat, None].bytes
      self.assertLess(abs(predicted / got - 1), 0.10, (remat, predicted, got))
    # Per-step remat's recomputation: its FLOPs less no remat's, compiled.
    recomputed_flops = compiled[True, None].flops - compiled[False, None].flops
    self.assertLess(
      abs(by_kind[True, None].recomputed_flops / recomputed_flops - 1), 0.10, recomputed_flops
    )

    smallest = plan.least_budget
    # "tight" is below every manual plan (their least keeps ≈√T carries);
    # "least_manual" is the least budget a manual plan fits (compiled), so
    # that the comparison with the manual plans below runs near the least.
    least_manual = min(c.bytes for c in compiled.values())
    budgets = {
      "loose": by_kind[False, None].temporaries * 1.01,
      "middle": (by_kind[True, None].temporaries + smallest) / 2,
      "tight": smallest * 1.01,
      "least_manual": max(least_manual, smallest) * 1.01,
    }
    for name, budget in budgets.items():
      budget = int(budget)
      with remat_models.plans_made() as made:
        # Any recomputation: the tight budget needs a schedule of few slots.
        got = cost(
          model, params, x, length, remat="auto", memory_budget=budget, max_recompute=math.inf
        )
      choice = made[-1].choice
      # Predicted against compiled, for the plan chosen; then the budget.
      self.assertLess(abs(choice.temporaries / got.bytes - 1), 0.10, (name, choice, got))
      self.assertLessEqual(got.bytes, budget * 1.05, (name, choice))
      # No manual plan that fits (compiled) recomputes less, nor runs
      # fewer FLOPs (compiled, every loop by its trip count).
      fitting = {kind: c for kind, c in compiled.items() if c.bytes <= budget}
      if name != "tight":
        # The comparison runs: a manual plan fits (at "least_manual", one).
        self.assertTrue(fitting, (name, budget, compiled))
      if fitting:
        least = min(recomputed(remat, length, groups) for remat, groups in fitting)
        # A known gap on jaxlib 0.11 (not on the pinned 0.10.2): there XLA
        # compiles the loss-in-step LSTM's own loop about 5% under the
        # measured line (T = 1024, the loop's binomial: 73,312 bytes of
        # temporaries where 0.10.2 compiles 77,536 and the line predicts
        # the same on both), so at the least manual budget the plan keeps
        # fewer slots than the manual binomial and recomputes more: 2,212
        # steps against its 2,038 (T = 1024), 9,363 against 8,103 (4096).
        bound = (
          1.2
          if "loss_in_step" in self._testMethodName
          and name == "least_manual"
          and versions.release(jaxlib.__version__) >= (0, 11)
          else 1.05
        )
        self.assertLessEqual(choice.recomputed_steps, bound * least, (name, choice, compiled))
        self.assertLessEqual(
          got.flops, bound * min(c.flops for c in fitting.values()), (name, choice, got, compiled)
        )
      if name == "tight" and "loss_after" not in self._testMethodName:
        # Where the outputs do not dominate, the tight budget needs a
        # schedule.
        self.assertIn(choice.remat, ("binomial", "nested"))


def unroll(scan, length=64):
  """An LSTM through `scan` (a dynamic_unroll), its loss of every output."""

  def f(xs):
    core = hk.LSTM(8)
    ys, state = scan(core, xs, core.initial_state(2))
    return jnp.sum(ys**2) + jnp.sum(state.cell)

  return hk.transform(f), jax.random.normal(KEY, [length, 2, 4])


def stack(run):
  def f(x):
    return jnp.sum(run(lambda h: jnp.tanh(hk.Linear(8)(h)), x) ** 2)

  return hk.transform(f), jax.random.normal(KEY, [64, 8])


def value_and_grads(net, x):
  params = net.init(KEY, x)
  return jax.value_and_grad(lambda p: net.apply(p, None, x))(params)


def _under_identity_getter(f):
  """`f`, run under an identity `hk.custom_getter`."""

  def run(*args, **kwargs):
    with hk.custom_getter(_identity_getter):
      return f(*args, **kwargs)

  return run


def _identity_getter(next_getter, value, context):
  del context
  return next_getter(value)


def _deterministic_plan() -> remat_plan.RematPlan:
  """A plan made from nothing cached, with a policy: measured, then chosen."""
  with caches.disabled():
    return hkb.remat_plan(
      toy_step,
      jnp.zeros([4, 16]),
      jnp.ones([256, 4, 16]),
      memory_budget=100_000,
      remat_policy=jax.checkpoint_policies.dots_saveable,
    )


def _plans_made_here() -> list[remat_plan.RematPlan]:
  """The plans of a pure step (with a policy), of a Haiku stack (with an identity getter), of a loop under `jax.vmap`, of one sharded over Explicit axes, of a Haiku scan (through the getter) under a meta-gradient and a Hessian-vector product, and of a step closing over an array."""

  def with_getter(f, x):
    with hk.custom_getter(_identity_getter):
      return hkb.repeat_layer(f, x, 12, remat="auto", memory_budget=15_000, max_recompute=math.inf)

  pure = [
    hkb.remat_plan(
      toy_step,
      jnp.zeros([4, 16]),
      jnp.ones([256, 4, 16]),
      memory_budget=100_000,
      remat_policy=policy,
    )
    for policy in (jax.checkpoint_policies.dots_saveable, _NAMED_POLICY)
  ]

  def scanned(h, xs):
    # A step of its own: jax's trace caches, which another test's loop of
    # `toy_step` at these shapes may have filled, do not skip its planning.
    step = lambda h, x: toy_step(h, x)
    return jnp.sum(hkb.scan(step, h, xs, remat="auto", memory_budget=1 << 40)[1])

  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  with remat_models.plans_made() as made:
    value_and_grads(*stack(with_getter))
    # Under jax.vmap: the batch's program.
    jax.eval_shape(
      jax.grad(lambda xs: jax.vmap(scanned)(jnp.zeros([4, 4, 16]), xs).sum()),
      jnp.ones([4, 64, 4, 16]),
    )
    # Sharded over Explicit axes: one device's share.
    with jax.set_mesh(mesh):
      jax.jit(jax.grad(scanned, argnums=1)).lower(
        jax.device_put(jnp.zeros([8, 16]), NamedSharding(mesh, P("data"))),
        jax.device_put(jnp.ones([64, 8, 16]), NamedSharding(mesh, P(None, "data"))),
      )
    # Derivatives of the gradient: each its own measurements.
    _, net, x = next(m for m in _loop_models() if m[0] == "scan")
    params, state = net.init(KEY, x, 1 << 40)
    forms = _derivative_forms(net, state, getter=True)
    for form in ("meta-gradient", "hvp"):
      jax.eval_shape(forms[form](1 << 40), params, x)
    # An array the step closes over, compiled in (`BudgetTest`).
    table = jnp.arange(16 * 16, dtype=jnp.float32).reshape(16, 16) / 256
    jax.eval_shape(
      jax.grad(
        lambda h, xs: jnp.sum(
          hkb.scan(lambda h, x: toy_step(h @ table, x), h, xs, remat="auto", memory_budget=1 << 40)[
            1
          ]
        )
      ),
      jnp.zeros([4, 16]),
      jnp.ones([64, 4, 16]),
    )
  return pure + made


# A policy object holding a set of names (which Python orders by their
# hashes, another order in each process unless PYTHONHASHSEED fixes it).
_NAMED_POLICY = jax.checkpoint_policies.save_only_these_names(*"abcdefghij")


def _print_plans() -> None:
  """In a fresh process: the compiles made, then the plans, as `repr` writes them."""
  with measuring_compiles() as compiles:
    plans = _plans_made_here()
  print(len(compiles))
  print(repr(plans))


class AutoTest(parameterized.TestCase):
  def assert_equal_values(self, ours, theirs):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), ours, theirs)

  @on_cpu_and_gpu(CPU_SIZED)
  def test_dynamic_unroll_and_scan_equal_haiku_at_every_budget(self):
    reference = value_and_grads(*unroll(hk.dynamic_unroll))
    loose = unroll(lambda *a: hkb.dynamic_unroll(*a, remat="auto", memory_budget=1 << 40))
    with remat_models.plans_made() as made:
      self.assert_equal_values(value_and_grads(*loose), reference)
    plan = made[-1]
    self.assertIs(plan.choice.remat, False)
    smallest = min(c.temporaries for c in plan.candidates)
    for budget in (plan.choice.temporaries - 1, smallest):
      with remat_models.plans_made() as made:
        self.assert_equal_values(
          value_and_grads(
            *unroll(
              lambda *a, b=budget: hkb.dynamic_unroll(
                *a, remat="auto", memory_budget=b, max_recompute=math.inf
              )
            )
          ),
          reference,
        )
      self.assertIsNot(made[-1].choice.remat, False)

      def through_scan(core, xs, state, b=budget):
        state, ys = hkb.scan(
          lambda s, x: core(x, s)[::-1],
          state,
          xs,
          remat="auto",
          memory_budget=b,
          max_recompute=math.inf,
        )
        return ys, state

      self.assert_equal_values(value_and_grads(*unroll(through_scan)), reference)
    self.assertEqual(made[-1].choice.remat, "binomial")

  @on_cpu_and_gpu(CPU_SIZED)
  def test_layer_scan_and_repeat_layer_equal_the_plain_stack(self):
    plain = value_and_grads(*stack(lambda f, x: hkb.repeat_layer(f, x, 12)))
    with remat_models.plans_made() as made:
      loose = value_and_grads(
        *stack(lambda f, x: hkb.repeat_layer(f, x, 12, remat="auto", memory_budget=1 << 40))
      )
    self.assert_equal_values(loose, plain)
    smallest = min(c.temporaries for c in made[-1].candidates)
    with remat_models.plans_made() as made:
      tight = value_and_grads(
        *stack(
          lambda f, x: hkb.repeat_layer(
            f, x, 12, remat="auto", memory_budget=smallest, max_recompute=math.inf
          )
        )
      )
      scanned = value_and_grads(
        *stack(
          lambda f, x: hkb.layer_scan(
            lambda h, _: (f(h), None),
            x,
            num_layers=12,
            remat="auto",
            memory_budget=smallest,
            max_recompute=math.inf,
          )[0]
        )
      )
    # Planned at apply (not at init), by each.
    self.assertEqual({p.choice.remat for p in made}, {"binomial"})
    self.assert_equal_values(tight, plain)
    self.assert_equal_values(scanned, plain)

  def test_init_makes_no_plan_and_the_same_params(self):
    # Init runs no backward pass: nothing to plan for.
    auto = dict(remat="auto", memory_budget=1 << 40)
    for ours, theirs in (
      (unroll(lambda *a: hkb.dynamic_unroll(*a, **auto)), unroll(hk.dynamic_unroll)),
      (
        stack(lambda f, x: hkb.repeat_layer(f, x, 12, **auto)),
        stack(lambda f, x: hkb.repeat_layer(f, x, 12)),
      ),
    ):
      with remat_models.plans_made() as made:
        params = ours[0].init(KEY, ours[1])
      self.assertEqual(made, [])
      self.assert_equal_values(params, theirs[0].init(KEY, theirs[1]))

  @on_cpu_and_gpu(CPU_SIZED)
  def test_plan_is_deterministic_and_measured_once_per_step_shape(self):
    caches.clear_caches()
    h = jnp.zeros([4, 16])
    with measuring_compiles() as measured:
      first = hkb.remat_plan(toy_step, h, jnp.ones([256, 4, 16]), memory_budget=100_000)
      # remat=False, remat=True, two binomial schedules; then the choice,
      # compiled unless it is one of those.
      self.assertIn(len(measured), range(4, 4 + remat_choice._CHECKS + 1))
      compiles = len(measured)
      # The same budget: nothing compiled (when caches are on).
      again = hkb.remat_plan(toy_step, h, jnp.ones([256, 4, 16]), memory_budget=100_000)
      self.assertEqual(len(measured), compiles if caches.enabled() else 2 * compiles)
      self.assertEqual(again, first)
      # Another length or shape is measured.
      before = len(measured)
      hkb.remat_plan(toy_step, h, jnp.ones([512, 4, 16]), memory_budget=1 << 30)
      hkb.remat_plan(toy_step, jnp.zeros([8, 16]), jnp.ones([256, 8, 16]), memory_budget=1 << 30)
      self.assertEqual(len(measured), before + 8)
      with caches.disabled():
        self.assertEqual(
          hkb.remat_plan(toy_step, h, jnp.ones([256, 4, 16]), memory_budget=100_000), first
        )
      # A policy is measured too (1 more compile, then the checks of its
      # choice), never taken from the plan without it.
      caches.clear_caches()
      before = len(measured)
      policy = jax.checkpoint_policies.dots_saveable
      with_policy = hkb.remat_plan(
        toy_step, h, jnp.ones([256, 4, 16]), memory_budget=100_000, remat_policy=policy
      )
      self.assertIn(
        len(measured) - before, range(5, 5 + remat_choice._CHECKS + 1)
      )  # And its checks.
      self.assertEqual(
        [c.policy for c in with_policy.candidates if c.policy is not None],
        [measure.policy_name(policy)],
      )
      # The same measurements of the plans without it (a schedule's figures
      # move with each plan's own checks).
      self.assertEqual(
        {c for c in first.candidates if c.slots is None},
        {c for c in with_policy.candidates if c.policy is None and c.slots is None},
      )
    for plan in (first, with_policy):
      self.assertEqual(
        [c.recomputed_flops for c in plan.candidates],
        sorted(c.recomputed_flops for c in plan.candidates),
      )
    self.assertLessEqual(first.choice.temporaries, 100_000)

  def test_plans_persist_across_processes(self):
    # Cold: a fresh process, its cache directory empty, measures; warm: the
    # next one compiles nothing for its plans; both make this process's
    # plans with nothing cached, an identity custom getter included.
    with caches.disabled():
      here = repr(_plans_made_here())
    directory = self.create_tempdir().full_path
    env = {"HAIKU_BRIDGE_CACHE_DIR": directory, "HAIKU_BRIDGE_CACHES": "1"}
    runs = []
    # Two orders of a set's strings (`_NAMED_POLICY`): one plan on disk.
    for seed in ("1", "2"):
      child = test_utils.run_in_fresh_process(
        __file__, "_print_plans", env={**env, "PYTHONHASHSEED": seed}
      )
      self.assertEqual(child.returncode, 0, child.stderr[-3000:])
      runs.append(child.stdout.strip().splitlines()[-2:])
    (cold_compiles, cold), (warm_compiles, warm) = runs
    self.assertGreaterEqual(int(cold_compiles), 3 * 4 + 1)
    if plan_cache._stable_name(_NAMED_POLICY) is None:
      # jax 0.12's `save_only_these_names` is a closure again, whose name
      # means nothing across processes: its plan is measured in each, the
      # others read from disk.
      self.assertBetween(int(warm_compiles), 1, int(cold_compiles) // 2)
    else:
      self.assertEqual(int(warm_compiles), 0)
    self.assertEqual(cold, here)
    self.assertEqual(warm, here)
    # Where they are, and what clears them.
    self.assertNotEqual(os.listdir(os.path.join(directory, "remat_plans")), [])
    with (
      mock.patch.dict(os.environ, {"HAIKU_BRIDGE_CACHE_DIR": directory}),
      mock.patch.object(caches, "_enabled", True),
    ):
      hkb.clear_caches()
    self.assertFalse(os.path.exists(os.path.join(directory, "remat_plans")))

  @on_cpu_and_gpu(CPU_SIZED)
  def test_identity_custom_getter_changes_nothing(self):
    def run(f, x):
      return hkb.repeat_layer(f, x, 12, remat="auto", memory_budget=budget, max_recompute=math.inf)

    def with_getter(f, x):
      with hk.custom_getter(_identity_getter):
        return run(f, x)

    with remat_models.plans_made() as made:
      value_and_grads(
        *stack(lambda f, x: hkb.repeat_layer(f, x, 12, remat="auto", memory_budget=1 << 40))
      )
    budget = min(c.temporaries for c in made[-1].candidates)
    with remat_models.plans_made() as plain_plans:
      plain = value_and_grads(*stack(run))
    with remat_models.plans_made() as getter_plans:
      got = value_and_grads(*stack(with_getter))
    self.assertEqual(getter_plans, plain_plans)
    self.assertNotIn(plain_plans[-1].choice.remat, (False, True))
    self.assert_equal_values(got, plain)

  @on_cpu_and_gpu(CPU_SIZED)
  def test_a_policy_is_a_candidate_measured_and_chosen_where_it_fits(self):
    # A residual MLP: the policy keeps each layer's dot outputs, not its
    # activations; it recomputes the elementwise ops only.
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    model = MODELS["mlp_depth_16"]
    net, x = model()
    params = net.init(KEY, x)
    with remat_models.plans_made() as made:
      cost(model, params, x, 16, remat="auto", remat_policy=policy, memory_budget=1 << 40)
    by_kind = {(c.remat, c.policy): c for c in made[-1].candidates if c.slots is None}
    plain, per_step = by_kind[False, None], by_kind[True, None]
    saving = by_kind[True, measure.policy_name(policy)]
    self.assertLess(per_step.temporaries, saving.temporaries)
    self.assertLess(saving.temporaries, plain.temporaries)
    self.assertLess(0, saving.recomputed_flops)
    self.assertLess(saving.recomputed_flops, per_step.recomputed_flops / 4)

    # Predicted against compiled: memory, and recomputed FLOPs.
    compiled = {
      kind: cost(model, params, x, 16, remat=kind[0], remat_policy=policy if kind[1] else None)
      for kind in ((False, None), (True, None), (True, "p"))
    }
    for kind, candidate in (((True, "p"), saving), ((True, None), per_step)):
      got = compiled[kind]
      self.assertLess(abs(candidate.temporaries / got.temporaries - 1), 0.10, (candidate, got))
      recomputed = got.flops - compiled[False, None].flops
      self.assertLess(
        abs(candidate.recomputed_flops / recomputed - 1), 0.10, (candidate, recomputed)
      )

    # Where it fits and no remat does not, it is the choice: the same
    # program as the manual one, and remat=False's values and gradients.
    budget = int(saving.temporaries * 1.01)
    with remat_models.plans_made() as made:
      got = cost(model, params, x, 16, remat="auto", remat_policy=policy, memory_budget=budget)
    self.assertEqual(made[-1].choice, saving)
    self.assertEqual(got, compiled[True, "p"])
    self.assertLessEqual(got.temporaries, budget * 1.05)
    self.assertLess(got.flops, compiled[True, None].flops)
    auto, _ = model(remat="auto", remat_policy=policy, memory_budget=budget)
    reference, _ = model()
    self.assert_equal_values(value_and_grads(auto, x), value_and_grads(reference, x))

    # Where remat=True fits and the policy does not, remat=True runs as it
    # was measured: without the policy.
    budget = (per_step.temporaries + saving.temporaries) // 2
    with remat_models.plans_made() as made:
      got = cost(model, params, x, 16, remat="auto", remat_policy=policy, memory_budget=budget)
    self.assertEqual(made[-1].choice, per_step)
    self.assertEqual(got, compiled[True, None])

  def test_a_refusal_waits_for_a_differentiation_where_none_is_seen(self):
    # Where the loop sees no derivative around it, it may be inference,
    # which keeps nothing for a backward pass (a budget tuned for training
    # refused an eval step of a larger batch), or a gradient it cannot see
    # (outside a jax.jit or jax.checkpoint around it): it runs plain, and
    # the refusal is raised where its outputs are differentiated.
    w = jax.random.normal(KEY, [32, 32]) / 6
    xs = jnp.ones([64, 8, 32]) * 0.1

    def loss(w, xs, **remat):
      step = lambda h, x: (jnp.tanh(h @ w + x), h)
      return jnp.sum(hkb.scan(step, jnp.zeros([8, 32]), xs, **remat)[1] ** 2)

    refused = functools.partial(loss, remat="auto", memory_budget=4096)
    with self.assertRaisesRegex(
      ValueError, "^hkb.scan: no remat plan for 64 steps fits memory_budget=4096 bytes"
    ) as seen:
      jax.eval_shape(jax.grad(refused), w, xs)
    chex.assert_trees_all_close(jax.jit(refused)(w, xs), jax.jit(loss)(w, xs))
    self.assertEqual(jax.vmap(refused, (None, 0))(w, xs[None]).shape, (1,))
    for name, differentiated in (
      ("grad of a jit", jax.grad(jax.jit(refused))),
      ("grad of a checkpoint", jax.grad(jax.checkpoint(refused))),
      ("jacfwd of a jit", jax.jacfwd(jax.jit(refused))),
    ):
      with self.subTest(name), self.assertRaises(ValueError) as deferred:
        jax.eval_shape(differentiated, w, xs)
      # The same words, but the least budget of a loop whose data are
      # measured differentiated (it sees no gradient to say otherwise).
      least = r"\d+ bytes \(predicted\)(, \d+ with max_recompute=math\.inf)?"
      self.assertEqual(
        re.sub(least, "", str(deferred.exception)), re.sub(least, "", str(seen.exception))
      )
    # A loop no tangent reaches (its weights under stop_gradient) is not
    # differentiated: nothing to refuse.
    self.assertEqual(
      jax.grad(lambda s: s * jax.jit(refused)(jax.lax.stop_gradient(w), xs))(1.0).shape, ()
    )

    # A Haiku model's eval step, a batch 8 times its training batch, at a
    # budget that fits the training step's least plan and not the eval
    # batch's (on XLA:CPU, the least plans: 137,604 and 1,076,612 bytes).
    def gru(budget):
      return hk.transform(
        lambda xs: hkb.dynamic_unroll(
          hk.GRU(32),
          xs,
          jnp.zeros([xs.shape[1], 32]),
          remat="auto",
          memory_budget=budget,
          max_recompute=math.inf,
        )[0]
      )

    params = gru(1).init(KEY, xs)
    train = lambda net, xs: jax.grad(lambda p: jnp.sum(net.apply(p, None, xs)))
    least = plan_where_run(train(gru(1 << 40), xs), params).least_budget
    big = jnp.ones([64, 64, 32])
    self.assertGreater(plan_where_run(train(gru(1 << 40), big), params).least_budget, 2 * least)
    net = gru(2 * least)
    jax.eval_shape(train(net, xs), params)  # The training step fits.
    self.assertEqual(jax.jit(net.apply)(params, None, big).shape, (64, 64, 32))

  @parameterized.parameters(
    (dict(memory_budget=1000), ValueError, "`memory_budget` needs"),
    (dict(remat="auto", memory_budget=-1), ValueError, "positive int"),
    (dict(remat="auto", memory_budget="1GB"), TypeError, "positive int"),
    (
      dict(remat="auto", memory_budget=1000, remat_policy="dots"),
      TypeError,
      "`remat_policy` must be None or a jax.checkpoint_policies",
    ),
  )
  def test_options_refused(self, options, error, text):
    net = hk.transform(lambda x: hkb.repeat_layer(lambda h: hk.Linear(8)(h), x, 4, **options))
    with self.assertRaisesRegex(error, text):
      net.init(KEY, jnp.ones([2, 8]))


def plan_where_run(f, *args) -> hkb.RematPlan:
  """The plan the loop in `f` makes (`remat="auto"`) when `f(*args)` is traced: under the gradient `f` takes, which tells it what is data."""
  with remat_models.plans_made() as made:
    jax.eval_shape(f, *args)
  return made[-1]


def plan_under_gradient(plan_of, params) -> hkb.RematPlan:
  """`plan_of(params)` (a `hkb.remat_plan` call) made under `jax.grad` of `params`, as a loop there plans: what it closes over besides `params` is data."""
  plans = []

  def loss(p):
    plans.append(plan_of(p))
    return 0.0

  jax.eval_shape(jax.grad(loss), params)
  return plans[0]


class BudgetTest(parameterized.TestCase):
  """The budget held by the compiled program, on carries of every kind."""

  @parameterized.parameters("conv_depth_32", "mlp_depth_64")
  @on_cpu_and_gpu(TOY_BYTES)
  def test_the_whole_step_compiles_within_the_budget(self, name):
    model = MODELS[name]
    net, x = model()
    params = net.init(KEY, x)
    depth = int(jax.tree.leaves(params)[0].shape[0])
    with remat_models.plans_made() as made:
      cost(model, params, x, depth, remat="auto", memory_budget=1 << 40)
    least = min(c.temporaries for c in made[-1].candidates)
    for budget in (int(least * 1.01), int(least * 1.1)):
      got = cost(
        model, params, x, depth, remat="auto", memory_budget=budget, max_recompute=math.inf
      )
      self.assertLessEqual(got.bytes, budget * (1 + STEP_TOLERANCE), (name, budget, got))

  def test_planning_runs_no_cyclic_collection(self):
    # Planning's objects are freed by reference counting: the collector
    # would find nothing, at the cost of full collections. Off while a plan
    # is made (here started by every 100 allocations), then as it was.
    init, xs = jnp.zeros([4, 16]), jnp.ones([64, 4, 16])
    measuring, collections = [False], []
    real = plan_cache.coefficients

    def counted(phase, info):
      del info
      if phase == "start" and measuring[0]:
        collections[-1] += 1

    def coefficients(*args):
      measuring[0] = True
      try:
        return real(*args)
      finally:
        measuring[0] = False

    def plan():
      collections.append(0)
      remat_plan.plan(toy_step, init, xs, 64, 1 << 30)
      return gc.isenabled()

    gc_was = gc.isenabled(), gc.get_threshold()
    gc.callbacks.append(counted)
    try:
      with caches.disabled(), mock.patch.object(plan_cache, "coefficients", coefficients):
        gc.enable()
        gc.set_threshold(100)
        enabled = plan()
        gc.disable()
        disabled = not plan()
    finally:
      gc.callbacks.remove(counted)
      gc.set_threshold(*gc_was[1])
      if gc_was[0]:
        gc.enable()
    self.assertEqual(collections, [0, 0])
    self.assertTrue(enabled)  # As the caller left it.
    self.assertTrue(disabled)

  def test_schedule_tables_count_against_the_budget(self):
    # 1024 steps: a schedule of one slot holds a table of half a million
    # actions, far more than the carries it saves.
    init, xs = jnp.zeros([4, 16]), jnp.ones([1024, 4, 16])
    plan = hkb.remat_plan(toy_step, init, xs, memory_budget=1 << 30)
    budget = int(min(c.temporaries for c in plan.candidates) * 1.01)
    got = compiled_bytes(
      scan_loss(toy_step, init, "auto", memory_budget=budget, max_recompute=math.inf), xs
    )
    self.assertLessEqual(got, budget * (1 + STEP_TOLERANCE))

  @on_cpu_and_gpu(TOY_BYTES)
  def test_a_typed_key_in_the_carry(self):
    def step(carry, x):
      h, key = carry
      key, sub = jax.random.split(key)
      h = jnp.tanh(h + x) * jax.random.bernoulli(sub, 0.9, h.shape)
      return (h, key), jnp.sum(h**2)

    init, xs = (jnp.zeros([4, 16]), jax.random.key(0)), jnp.ones([64, 4, 16])
    plan = plan_where_run(
      jax.value_and_grad(scan_loss(step, init, "auto", memory_budget=1 << 30)), xs
    )
    budget = min(c.temporaries for c in plan.candidates)
    auto = scan_loss(step, init, "auto", memory_budget=budget, max_recompute=math.inf)
    self.assert_equal_values(
      jax.value_and_grad(auto)(xs), jax.value_and_grad(scan_loss(step, init, False))(xs)
    )
    self.assertLessEqual(
      compiled_bytes(jax.value_and_grad(auto), xs), budget * (1 + STEP_TOLERANCE)
    )

  def assert_each_step_within(self, loss, *args):
    """`jax.value_and_grad(loss)(*args, remat="auto", memory_budget=b)` compiled within b, at the least budget and at the loosest plan's."""
    train = lambda budget: jax.value_and_grad(
      functools.partial(loss, remat="auto", memory_budget=budget, max_recompute=math.inf),
      argnums=tuple(range(len(args))),
    )
    plan = plan_where_run(train(1 << 40), *args)
    for budget in (plan.least_budget, plan.choice.temporaries):
      self.assertLessEqual(
        compiled_bytes(train(budget), *args), budget * (1 + STEP_TOLERANCE), budget
      )

  @on_cpu_and_gpu(TOY_BYTES)
  def test_a_step_returning_its_loss_within_the_budget(self):
    # A training step returns the loss's value with the gradients. With it,
    # XLA:CPU keeps one more copy of the ys at some sizes (here 9 KB of
    # them, 48 steps: the step compiled to 1.43× a budget measured on the
    # gradient alone, at every plan).
    def step(w):
      def f(h, x):
        h = jnp.tanh(jnp.concatenate([x, h], -1) @ w)
        return h, h

      return f

    def loss(w, xs, **options):
      carry, ys = hkb.scan(step(w), init, xs, **options)
      return jnp.sum(jnp.square(carry)) + jnp.sum(jnp.square(ys))

    w, init = jax.random.normal(KEY, [21, 16]) / 4, jnp.zeros([3, 16])
    xs = jnp.ones([48, 3, 5])
    self.assert_each_step_within(loss, w, xs)

  @on_cpu_and_gpu(TOY_BYTES)
  def test_an_unrolled_loop_is_planned_unrolled(self):
    # `unroll=2` keeps other buffers than the rolled loop: a schedule of one
    # slot measured rolled compiled to 2.0× its prediction unrolled.
    def step(w):
      return lambda h, x: (jnp.tanh(h @ w + x), None)

    def loss(w, xs, **options):
      carry, _ = hkb.scan(step(w), init, xs, unroll=2, **options)
      return jnp.sum(jnp.square(carry))

    w, init = jax.random.normal(KEY, [16, 16]) / 4, jnp.zeros([4, 16])
    xs = jnp.ones([16, 4, 16])
    rolled = hkb.remat_plan(hkb.scan, step(w), init, xs, memory_budget=1 << 30)
    plan = hkb.remat_plan(hkb.scan, step(w), init, xs, unroll=2, memory_budget=1 << 30)
    # Measured apart, in one process (the caches keyed on the unroll).
    self.assertLess(rolled.least_budget, plan.least_budget)
    self.assert_each_step_within(loss, w, xs)

  @on_cpu_and_gpu(TOY_BYTES)
  def test_a_batch_major_unroll_counts_its_own_copies(self):
    # `time_major=False` swaps the inputs to time-major (and the outputs
    # back) around the loop: copies of the loop's own making, without which
    # this GRU compiled to 2.25× its least budget.
    def net(plan=False, time_major=False, **remat):
      def f(xs):
        core = hk.GRU(16)
        unroll = (core, xs, core.initial_state(4))
        options = dict(time_major=time_major, readout=lambda y: jnp.sum(y**2))
        if plan:
          return hkb.remat_plan(hkb.dynamic_unroll, *unroll, memory_budget=1 << 30, **options)
        return jnp.sum(hkb.dynamic_unroll(*unroll, **options, **remat)[0])

      return hk.transform(f)

    xs = jax.random.normal(KEY, [4, 64, 16])
    params = net().init(KEY, xs)
    time_major = net(plan=True, time_major=True).apply(params, None, jnp.swapaxes(xs, 0, 1))
    plan = net(plan=True).apply(params, None, xs)
    # Measured apart, in one process (the caches keyed on the copies).
    self.assertLess(time_major.least_budget, plan.least_budget)
    loss = lambda p, xs, **remat: net(**remat).apply(p, None, xs)
    self.assert_each_step_within(loss, params, xs)

  def test_layer_state_is_planned_as_a_training_step_keeps_it(self):
    # A layer's Haiku state (hk.get_state/set_state, BatchNorm's averages)
    # is aux in a training step, not differentiated; planned as outputs
    # with cotangents, this stack's plans were predicted over what they
    # compile to (1.155× at the least, 1.06× at remat=True).
    def block(h):
      m = hk.get_state("m", h.shape[1:], jnp.float32, init=jnp.zeros)
      hk.set_state("m", 0.9 * m + 0.1 * jnp.mean(h, 0))
      return jnp.tanh(hk.Linear(WIDE)(h) + m)

    def net(**remat):
      return hk.transform_with_state(lambda x: hkb.repeat_layer(block, x, 16, **remat))

    x = jnp.ones([64, WIDE])
    params, state = net().init(KEY, x)
    loss = lambda p, s, x, **remat: jnp.sum(jnp.square(net(**remat).apply(p, s, None, x)[0]))
    plan = plan_where_run(
      jax.value_and_grad(functools.partial(loss, remat="auto", memory_budget=1 << 30)),
      params,
      state,
      x,
    )
    by_kind = {k.remat: k.temporaries for k in plan.candidates if k.slots in (None, 1)}
    for budget in (by_kind[True], by_kind["binomial"]):
      with remat_models.plans_made() as made:
        got = compiled_bytes(
          jax.value_and_grad(
            functools.partial(loss, remat="auto", memory_budget=budget, max_recompute=math.inf)
          ),
          params,
          state,
          x,
        )
      predicted = made[-1].choice.temporaries
      self.assertLess(abs(predicted / got - 1), 0.10, (budget, made[-1].choice, got))

  def test_a_loop_with_nothing_to_differentiate_plans_nothing(self):
    def step(count, x):
      return count + x, count * 2

    init, xs = jnp.zeros([4], jnp.int32), jnp.ones([64, 4], jnp.int32)
    plan = hkb.remat_plan(step, init, xs, memory_budget=1 << 30)
    self.assertEqual([(c.remat, c.recomputed_steps) for c in plan.candidates], [(False, 0)])
    self.assertEqual(plan.choice, plan.candidates[0])
    self.assert_equal_values(
      hkb.scan(step, init, xs, remat="auto", memory_budget=1 << 30), jax.lax.scan(step, init, xs)
    )

  @on_cpu_and_gpu(TOY_BYTES)
  def test_every_loop_counts_an_array_its_step_closes_over(self):
    # The grid of the above: each loop of the bridge over a Haiku step that
    # reads a table (64 KiB) by an index of its carry, at its least
    # plan's budget, with and without an identity custom getter: the whole
    # compiled step within it.
    table = jnp.asarray(
      np.linspace(-1, 1, 64 * 256, dtype=np.float32).reshape(64, 256)
    )  # Not traced here.

    def step(h, x, lin=None):
      # A time scan's steps share one module, a layer scan's make their own.
      i = jnp.argmax(h[0, :4])  # An index only the run knows.
      return jnp.tanh((lin or hk.Linear(8))(h) + x + table[i, :8]), None

    def time_scan(loop):
      def run(x, o):
        lin = hk.Linear(8)
        return loop(lambda h, x: step(h, x, lin), x, o)

      return run

    loops = {
      "scan": time_scan(lambda f, x, o: hkb.scan(f, x[0], x, **o)[0]),
      "dynamic_unroll": time_scan(
        lambda f, x, o: hkb.dynamic_unroll(lambda x, h: (h, f(h, x)[0]), x, x[0], **o)[1]
      ),
      "layer_scan": lambda x, o: hkb.layer_scan(step, x[0], x, **o)[0],
      "repeat_layer": lambda x, o: hkb.repeat_layer(lambda h: step(h, 0.0)[0], x[0], 12, **o),
    }
    # The inputs are the step's argument, as a batch is: closed over, jax
    # 0.12 would pass them as an argument of its own (over 1 KiB), which
    # `compiled_bytes` counts with the constants and no loop plans for
    # (12,288 bytes over the least budget, 73,412).
    x = jnp.ones([12, 32, 8]) * 0.1
    for name, loop in loops.items():
      net = hk.transform(
        lambda x, budget, getter, loop=loop: jnp.sum(
          (_under_identity_getter(loop) if getter else loop)(
            x, dict(remat="auto", memory_budget=budget, max_recompute=math.inf)
          )
          ** 2
        )
      )
      params = net.init(KEY, x, 1 << 40, False)
      for getter in (False, True):
        train = lambda budget, getter=getter: jax.value_and_grad(
          lambda p, x: net.apply(p, None, x, budget, getter)
        )
        with self.subTest(f"{name} getter={getter}"):
          least = plan_where_run(train(1 << 40), params, x).least_budget
          self.assertLessEqual(
            compiled_bytes(train(least), params, x), least * (1 + STEP_TOLERANCE)
          )

  @on_cpu_and_gpu(TOY_BYTES)
  def test_an_array_the_step_closes_over_is_compiled_in_as_the_step_has_it(self):
    # A numpy table the step closes over (an embedding, a mask) is a
    # constant of the jitted training step, which XLA copies into each loop
    # that reads it: the forward sweep, and a backward pass that recomputes.
    # Measured as an argument, as params are, the plan missed those copies:
    # a tanh RNN over token embeddings of a 32 KiB table, with a fori_loop
    # in the step: remat=True predicted at 46,784 bytes, compiled 112,056;
    # the least plan's step 4.45x its budget. The same table passed in
    # (traced) is an argument in both, and planned apart.
    table = jax.random.normal(KEY, [256, 32]) * 0.1  # Not traced here.
    w = jax.random.normal(jax.random.PRNGKey(1), [32, 32]) / 6
    tokens = jax.random.randint(KEY, [64, 4], 0, 256)

    def loss(w, tokens, table=table, **remat):
      def step(h, t):
        h = jax.lax.fori_loop(0, 2, lambda _, h: jnp.tanh(h @ w), h + table[t])
        return h, jnp.sum(h)

      h, ys = hkb.scan(step, jnp.zeros([4, 32]), tokens, **remat)
      return jnp.sum(ys**2) + jnp.sum(h**2)

    for name, f, args in (
      ("closed over", loss, (w, tokens)),
      ("passed in", lambda w, tokens, table, **r: loss(w, tokens, table, **r), (w, tokens, table)),
    ):
      step = lambda **remat: jax.value_and_grad(functools.partial(f, **remat))
      with self.subTest(name):
        plan = plan_where_run(
          step(remat="auto", memory_budget=1 << 40, max_recompute=math.inf), *args
        )
        for candidate in plan.candidates:
          if candidate.remat in (False, True):
            got = compiled_bytes(step(remat=candidate.remat), *args)
            self.assertLess(abs(candidate.temporaries / got - 1), 0.02, (candidate, got))
        # The least plan, as the loop runs it: a schedule of one slot on
        # jaxlib 0.10.2; `remat=True` on 0.12, where a schedule's copies of
        # the table (its forward sweep, its advance, its backward loop)
        # outweigh the carries it saves.
        got = compiled_bytes(
          step(remat="auto", memory_budget=(plan.least_budget), max_recompute=math.inf), *args
        )
        self.assertLessEqual(got, plan.least_budget * (1 + STEP_TOLERANCE))

    # Run eagerly (no jit around it), the loop's consts are its operands:
    # `hkb.remat_plan` called so measures the table as an argument, as
    # under a jit where it is traced, not as one closing over it.
    def plan(w, table):
      step = lambda h, t: (jnp.tanh(h @ w + table[t]), jnp.sum(h))
      return hkb.remat_plan(step, jnp.zeros([4, 32]), tokens, memory_budget=1 << 40)

    made = []
    jax.eval_shape(lambda w, table: made.append(plan(w, table)), w, table)
    jax.eval_shape(lambda w: made.append(plan(w, table)), w)
    traced, closed_over = made
    self.assertEqual(plan(w, table), traced)
    self.assertGreater(closed_over.least_budget, traced.least_budget)

  def test_a_bfloat16_carry_within_the_budget(self):
    # Its budgets kept and its values as the plain loop's. (XLA:CPU keeps
    # this carry's slots at its bytes, jaxlib 0.10.2 and 0.12.1: a slot's
    # bytes assumed, not measured, pass here; measure_test's
    # `test_schedules_not_compiled_are_predicted_with_their_tables_and_slots`
    # fails then.)
    def step(h, x):
      h = jnp.tanh(h @ jnp.eye(64, dtype=jnp.bfloat16) + x)
      return h, jnp.sum(h.astype(jnp.float32) ** 2)

    init = jnp.zeros([8, 64], jnp.bfloat16)
    xs = jnp.ones([1024, 8, 64], jnp.bfloat16)
    plan = hkb.remat_plan(step, init, xs, memory_budget=1 << 30)
    per_step = next(c for c in plan.candidates if c.remat is True)
    least = min(c.temporaries for c in plan.candidates)
    for budget in ((per_step.temporaries + least) // 2, int(least * 1.1)):
      loss = scan_loss(step, init, "auto", memory_budget=budget, max_recompute=math.inf)
      self.assertLessEqual(
        compiled_bytes(jax.grad(loss), xs), budget * (1 + STEP_TOLERANCE), budget
      )
    self.assert_equal_values(jax.grad(loss)(xs), jax.grad(scan_loss(step, init, False))(xs))

  def assert_equal_values(self, ours, theirs):
    # bfloat16 recomputed in another order: a few of its steps apart (on a
    # TPU 3.3%: 155 against 150).
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(
        np.asarray(a, np.float32),
        np.asarray(b, np.float32),
        rtol=2e-2 if backend_tolerance.on_cpu() else 5e-2,
        atol=1e-5,
      ),
      ours,
      theirs,
    )


def _loop_models():
  """Each loop of the bridge over a small Haiku step: `(name, net, x)`.

  `net(x, budget, plan=False, getter=False)` runs a loss of the loop with
  `remat="auto"`, or with `plan`, returns `hkb.remat_plan` of the same loop
  and arguments; with `getter`, under an identity `hk.custom_getter`. Each
  step counts its runs in Haiku state ("n"), which a loop that ran would
  change.
  """

  def counted(h):
    hk.set_state("n", hk.get_state("n", [], jnp.int32, init=jnp.zeros) + 1)
    return h

  # Each calls `loop(name, *args, **kwargs)`: the loop, or its plan.
  def scan(loop, x):
    lin = hk.Linear(8)
    return loop(hkb.scan, lambda h, x: (counted(jnp.tanh(lin(h) + x)), jnp.sum(h)), x[0], x)

  def dynamic_unroll(loop, x):
    # Batch major, through a functools.partial of the loop.
    lin = hk.Linear(8)
    return loop(
      functools.partial(hkb.dynamic_unroll, time_major=False),
      lambda x, h: (h, counted(jnp.tanh(lin(h) + x))),
      jnp.swapaxes(x, 0, 1),
      x[0],
    )

  def layer_scan(loop, x):
    return loop(
      hkb.layer_scan, lambda h, x: (counted(jnp.tanh(hk.Linear(8)(h) + x)), None), x[0], x
    )

  def repeat_layer(loop, x):
    return loop(
      hkb.repeat_layer, lambda h: counted(jnp.tanh(hk.Linear(8)(h))), x[0], 12, name="stack"
    )

  for model, length in ((scan, 64), (dynamic_unroll, 64), (layer_scan, 12), (repeat_layer, 12)):

    def net(x, budget, plan=False, getter=False, model=model):
      if getter:
        with hk.custom_getter(_identity_getter):
          return net(x, budget, plan)
      # Any recomputation: the least budget's plan is a schedule of one slot.
      if plan:
        return model(
          lambda loop, *a, **k: hkb.remat_plan(
            loop, *a, memory_budget=budget, max_recompute=math.inf, **k
          ),
          x,
        )
      out = model(
        lambda loop, *a, **k: loop(
          *a, remat="auto", memory_budget=budget, max_recompute=math.inf, **k
        ),
        x,
      )
      return sum(jnp.sum(o**2) for o in jax.tree.leaves(out))

    # A batch of 32: with 12 layers, a schedule's tables cost less than the
    # carries it saves.
    yield model.__name__, hk.transform_with_state(net), jnp.ones([length, 32, 8])


class VmapTest(parameterized.TestCase):
  """A loop inside `jax.vmap` is planned for the batch's program, as the step compiles it."""

  W = jax.random.normal(KEY, [32, 32]) / 6

  @staticmethod
  def per_example(w, xs, **options):
    step = lambda h, x: (jnp.tanh(h @ w + x), jnp.sum(h**2))
    return jnp.sum(hkb.scan(step, jnp.zeros([32]), xs, **options)[1])

  def _check(self, step, *args):
    """`step(**remat)`'s plan at 1 and 1.5 times its least: within the budget and the prediction; remat=False's values."""
    least = plan_where_run(step(remat="auto", memory_budget=1 << 40), *args).least_budget
    for budget in (least, int(least * 1.5)):
      with remat_models.plans_made() as made:
        auto = step(remat="auto", memory_budget=budget, max_recompute=math.inf)
        got = compiled_bytes(auto, *args)
      choice = made[-1].choice
      self.assertLessEqual(got, budget * (1 + STEP_TOLERANCE), (budget, choice))
      self.assertLessEqual(abs(choice.temporaries - got), 0.10 * got, (choice, got))
    chex.assert_trees_all_close(
      jax.jit(auto)(*args), jax.jit(step(remat=False))(*args), rtol=1e-4, atol=1e-5
    )

  @parameterized.named_parameters(
    (
      "of_the_batch",
      lambda loss: jax.value_and_grad(lambda w, xs: jnp.sum(jax.vmap(loss, (None, 0))(w, xs))),
    ),
    ("per_example", lambda loss: jax.vmap(jax.value_and_grad(loss), (None, 0))),
  )
  def test_a_vmapped_loop_keeps_the_budget(self, differentiate):
    # Planned on one example's shapes, the vmapped step of 16 examples
    # compiled to 35x the budget (remat=False 20x, remat=True 31x one
    # example's). Both orders: the gradient of the batch's loss (one for
    # the weights) and a gradient per example (`jax.vmap(jax.grad)`).
    xs = jnp.ones([16, 128, 32]) * 0.1
    step = lambda **remat: differentiate(functools.partial(self.per_example, **remat))
    self._check(step, self.W, xs)

  @on_cpu_and_gpu(TOY_BYTES)
  def test_nested_vmaps_with_the_batch_elsewhere(self):
    # Two vmaps, the inner one over the xs' second axis, the weights
    # batched by the outer one only.
    ws, xs = jnp.stack([self.W] * 3), jnp.ones([3, 64, 4, 32]) * 0.1

    def step(**remat):
      loss = functools.partial(self.per_example, **remat)
      batched = jax.vmap(jax.vmap(loss, (None, 1)), (0, 0))
      return jax.value_and_grad(lambda ws, xs: jnp.sum(batched(ws, xs)))

    self._check(step, ws, xs)

  @parameterized.named_parameters(("plain", False), ("identity_getter", True))
  def test_a_haiku_stack_under_hk_vmap(self, getter):
    # The Haiku form: a layer stack of one example, mapped by `hk.vmap`
    # over 16, its params shared (not batched); with and without an
    # identity custom getter around it.
    def block(h):
      return h + jnp.tanh(hk.Linear(32)(h))

    x = jnp.ones([16, 2, 32])
    params = hk.transform(lambda x: hkb.repeat_layer(block, x, 24)).init(KEY, x[0])

    def step(**remat):
      def f(x):
        with hk.custom_getter(_identity_getter) if getter else contextlib.nullcontext():
          return jnp.sum(
            hk.vmap(lambda x: hkb.repeat_layer(block, x, 24, **remat), split_rng=False)(x) ** 2
          )

      net = hk.transform(f)
      return jax.value_and_grad(lambda p, x: net.apply(p, None, x))

    self._check(step, params, x)

  def test_outputs_a_vmap_moves_are_counted_and_a_per_example_loss_kept(self):
    # A GRU of one example under `hk.vmap` over the xs' second axis (time
    # major): the loop makes its outputs time first, and where the vmap
    # returns them to a loss outside it, the step moves them batch first,
    # a copy (64 KiB here) the plan counts. Where the loss is taken inside
    # the vmap, per example, there is no copy, and the plan, which cannot
    # see where the loss is, over-predicts by it: on the safe side. Planned
    # as a per-example loss instead, the first form compiled to 1.32× the
    # plan (remat=True 263,384 against 199,000).
    def step(inside, **remat):
      def f(xs):
        core = hk.GRU(32)

        def one(xs):
          ys, _ = hkb.dynamic_unroll(core, xs, core.initial_state(None), **remat)
          return jnp.sum(ys**2) if inside else ys

        out = hk.vmap(one, in_axes=1, split_rng=False)(xs)
        return jnp.sum(out if inside else out**2)

      net = hk.transform(f)
      return jax.value_and_grad(lambda p, xs: net.apply(p, None, xs))

    xs = jax.random.normal(KEY, [64, 8, 32])
    params = hk.transform(lambda xs: hk.GRU(32)(xs[0], jnp.zeros([8, 32]))).init(KEY, xs)
    for inside in (False, True):
      with self.subTest(inside=inside), caches.disabled():
        plan = plan_where_run(step(inside, remat="auto", memory_budget=1 << 40), params, xs)
        for k in plan.candidates:
          if k.remat in (False, True):
            got = compiled_bytes(step(inside, remat=k.remat), params, xs)
            if inside:
              self.assertBetween(k.temporaries - got, 0, 70_000)
            else:
              self.assertLess(abs(k.temporaries / got - 1), 0.02, (k, got))

  @on_cpu_and_gpu(TOY_BYTES)
  def test_a_plan_for_one_example_is_not_the_batchs(self):
    # The same loop, planned for one example and then inside jax.vmap with
    # the same budget: each its own figures (the caches keep them apart).
    xs = jnp.ones([16, 128, 32]) * 0.1
    with remat_models.plans_made() as made:
      jax.jit(
        jax.value_and_grad(functools.partial(self.per_example, remat="auto", memory_budget=1 << 40))
      ).trace(self.W, xs[0])
      jax.jit(
        jax.value_and_grad(
          lambda w, xs: jnp.sum(
            jax.vmap(
              functools.partial(self.per_example, remat="auto", memory_budget=1 << 40), (None, 0)
            )(w, xs)
          )
        )
      ).trace(self.W, xs)
    one, batch = made
    self.assertGreater(batch.least_budget, 8 * one.least_budget)


class ShardMapTest(parameterized.TestCase):
  """A loop inside `jax.shard_map`, or in a `jax.jit` step sharded over Explicit axes, is planned on one device's share, under the mesh, as its program compiles."""

  W = jax.random.normal(KEY, [64, 32]) / 4
  XS = jax.random.normal(KEY, [128, 64, 32])

  def setUp(self):
    super().setUp()
    if jax.device_count() < 8:
      self.skipTest(f"needs 8 devices, jax has {jax.device_count()}.")

  @staticmethod
  def step(w):
    def f(c, x):
      c = jnp.tanh(jnp.concatenate([x, c], -1) @ w)
      return c, c

    return f

  def one_device(self, budget):
    """The plan of one device's 8 rows, made where it is called, under a gradient of the weights (the xs data)."""
    return plan_under_gradient(
      lambda w: hkb.remat_plan(
        self.step(w),
        jnp.zeros([8, 32]),
        self.XS[:, :8],
        memory_budget=budget,
        max_recompute=math.inf,
      ),
      self.W,
    )

  def assert_held(self, train, args, expected, budget):
    """`train(remat="auto", ...)` at `budget`: remat=False's values, its plan and compiled step within the budget (the plan and one device's temporaries)."""
    auto = train(remat="auto", memory_budget=budget, max_recompute=math.inf)
    with remat_models.plans_made() as made:
      got = auto(*args)
      compiled = auto.lower(*args).compile()
    chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)
    kept = hlo_flops.held(compiled).temporaries
    self.assertLess(abs(kept / made[-1].choice.temporaries - 1), 0.1)
    self.assertLessEqual(kept, budget * 1.05)
    return made[-1], kept

  @parameterized.parameters(jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit)
  def test_planned_per_device_within_the_budget(self, axis_type):
    # A data-parallel tanh RNN over 128 steps, 64 rows over 8 devices, the
    # loss summed over them: the plan is one device's (8 rows) under the
    # mesh, and the compiled step (one device's) holds it, at the loosest
    # budget and the least; values are remat=False's.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))

    def train(**remat):
      def local(w, xs):
        c, ys = hkb.scan(self.step(w), jnp.zeros_like(xs[0]), xs, **remat)
        return jax.lax.psum(jnp.sum(c**2) + jnp.sum(ys**2), "data")

      return jax.jit(
        jax.value_and_grad(
          jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, "data")), out_specs=P())
        )
      )

    with jax.set_mesh(mesh):
      least = self.one_device(1 << 40).least_budget
      args = (
        jax.device_put(self.W, NamedSharding(mesh, P())),
        jax.device_put(self.XS, NamedSharding(mesh, P(None, "data"))),
      )
      expected = train(remat=False)(*args)
      for budget in (1 << 40, least):
        plan, _ = self.assert_held(train, args, expected, budget)
        self.assertEqual(plan, self.one_device(budget))

  @parameterized.parameters(
    "repeat_layer", "repeat_layer, custom getter", "scan", "dynamic_unroll, batch-major"
  )
  def test_a_jit_step_sharded_over_explicit_axes_is_planned_per_device(self, form):
    # A data-parallel training step in `jax.jit` (no shard_map), the batch
    # sharded over 8 devices of Explicit axes (`jax.make_mesh`'s default):
    # each value's type holds its sharding, and the loop is planned on one
    # device's share, as the step's `memory_analysis()` is. Before, it was
    # planned on the whole batch compiled on one device (16 tanh layers of
    # 128, batch 64: remat=False predicted 1,770,176 bytes, compiled
    # 333,120 a device). At the loosest budget and the least; values are
    # remat=False's.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    if form.startswith("repeat_layer"):

      def make(**remat):
        def net(x):
          with contextlib.ExitStack() as stack:
            if form.endswith("custom getter"):
              stack.enter_context(hk.custom_getter(_identity_getter))
            return hkb.repeat_layer(lambda h: h + jnp.tanh(hk.Linear(WIDE)(h)), x, 16, **remat)

        return hk.transform(net)

      x = jax.random.normal(KEY, [64, WIDE])
      params = make(remat=False).init(KEY, x)
      spec = P("data")
      loss = lambda net: lambda p, x: jnp.sum(net.apply(p, None, x) ** 2)
    elif form.startswith("dynamic_unroll"):

      def make(**remat):
        def net(xs):
          core = hk.VanillaRNN(32)
          # The state sharded as the batch is (a scan's carry keeps its type).
          state = jax.sharding.reshard(core.initial_state(64), P("data"))
          ys, _ = hkb.dynamic_unroll(core, xs, state, time_major=False, **remat)
          return ys

        return hk.transform(net)

      x = jax.random.normal(KEY, [64, 32, 16])  # Batch-major: [B, T, F].
      with jax.set_mesh(mesh):  # Where the state's sharding is named.
        params = make(remat=False).init(KEY, x)
      spec = P("data")
      loss = lambda net: lambda p, x: jnp.sum(net.apply(p, None, x) ** 2)
    else:

      def make(**remat):
        return remat

      x, params, spec = self.XS, self.W, P(None, "data")

      def loss(remat):
        def f(w, xs):
          c, ys = hkb.scan(self.step(w), jnp.zeros_like(xs[0]), xs, **remat)
          return jnp.sum(c**2) + jnp.sum(ys**2)

        return f

    def train(**remat):
      return jax.jit(jax.value_and_grad(loss(make(**remat))))

    with jax.set_mesh(mesh):
      args = (
        jax.device_put(params, NamedSharding(mesh, P())),
        jax.device_put(x, NamedSharding(mesh, spec)),
      )
      expected = train(remat=False)(*args)
      plain = hlo_flops.held(train(remat=False).lower(*args).compile())
      loose, kept = self.assert_held(train, args, expected, 1 << 40)
      self.assertIs(loose.choice.remat, False)
      self.assertEqual(kept, plain.temporaries)
      self.assert_held(train, args, expected, loose.least_budget)

  def test_a_plan_is_keyed_on_the_mesh_it_is_made_under(self):
    # XLA compiles the measuring programs to other temporaries under a mesh
    # (remat=False here: 788,616 bytes outside one, 668,872 under 8
    # devices); the plan made first, outside or under the mesh, was the
    # other's too. Cold and warm, in both orders.
    mesh = jax.make_mesh((8,), ("data",))

    def under_mesh():
      with jax.set_mesh(mesh):
        return self.one_device(1 << 40)

    hkb.clear_caches()
    cold_outside = self.one_device(1 << 40)
    hkb.clear_caches()
    cold_under = under_mesh()
    self.assertNotEqual(cold_under, cold_outside)
    self.assertEqual(self.one_device(1 << 40), cold_outside)  # Warm, under's.
    hkb.clear_caches()
    self.one_device(1 << 40)
    self.assertEqual(under_mesh(), cold_under)  # Warm, outside's.


def _rnn_weight_and_xs() -> tuple[jax.Array, jax.Array]:
  """A 32x32 weight and 64 steps of a batch of 8: `_rnn_loss`'s arguments."""
  return (jax.random.normal(KEY, [32, 32]) / 6, jax.random.normal(KEY, [64, 8, 32]))


def _rnn_loss(w, xs, **remat):
  """A tanh RNN of `w`'s width over `xs`, a batch of a quarter of it, `remat` its scan's options."""
  h, _ = hkb.scan(
    lambda h, x: (jnp.tanh(h @ w + x), None),
    jnp.zeros([w.shape[0] // 4, w.shape[0]]),
    xs[:, : w.shape[0] // 4, : w.shape[0]],
    **remat,
  )
  return jnp.sum(h**2)


def _derivative_forms(net, state, getter=False) -> dict[str, Callable[[int], Any]]:
  """A `_loop_models` net's loss of the params differentiated three ways, by budget: `program(budget)(params, x)`."""
  loss = lambda budget: lambda p, x: net.apply(p, state, None, x, budget, getter=getter)[0]
  total = lambda tree: sum(jnp.sum(leaf) for leaf in jax.tree.leaves(tree))
  return {
    "meta-gradient": lambda budget: jax.grad(lambda p, x: total(jax.grad(loss(budget))(p, x))),
    "hvp": lambda budget: lambda p, x: jax.jvp(lambda p: jax.grad(loss(budget))(p, x), (p,), (p,)),
    "jvp": lambda budget: lambda p, x: jax.jvp(lambda p: loss(budget)(p, x), (p,), (p,)),
  }


class DifferentiatedTest(absltest.TestCase):
  """A loop the gradient around it is taken of nothing of keeps nothing for a backward pass."""

  @on_cpu_and_gpu(CPU_SIZED)
  def test_a_loop_of_data_under_a_gradient_plans_no_backward_pass(self):
    # The step closes over stop_gradient(w) and scans data: the gradient
    # around the loop is taken of nothing it reads, so the step keeps
    # nothing for a backward pass. Measured as if differentiated, its plain
    # loop was predicted at 531,728 bytes and a budget of 4 KiB refused
    # (least 20,656), where the whole step compiles to 2,664.
    w = jax.random.normal(KEY, [32, 32]) / 6
    xs = jnp.ones([256, 4, 32]) * 0.1

    def loss(w, xs, **remat):
      frozen = jax.lax.stop_gradient(w)
      step = lambda h, x: (jnp.tanh(h @ frozen + x), jnp.sum(h**2))
      features = hkb.scan(step, jnp.zeros([4, 32]), xs, **remat)[1]
      return jnp.sum(features) + jnp.sum(w**2)

    step = lambda **remat: jax.value_and_grad(functools.partial(loss, **remat))
    budget = 4096
    # The same loop planned as a training step of its own first (no
    # gradient seen around it): its plan is not this one's.
    alone = hkb.remat_plan(
      lambda h, x: (jnp.tanh(h @ w + x), jnp.sum(h**2)),
      jnp.zeros([4, 32]),
      xs,
      memory_budget=1 << 30,
    )
    self.assertGreater(alone.least_budget, budget)
    with remat_models.plans_made() as made:
      got = compiled_bytes(step(remat="auto", memory_budget=budget), w, xs)
    self.assertEqual([(k.remat, k.slots) for k in made[-1].candidates], [(False, None)])
    self.assertLessEqual(got, budget)
    chex.assert_trees_all_close(
      jax.jit(step(remat="auto", memory_budget=budget))(w, xs),
      jax.jit(step(remat=False))(w, xs),
      rtol=1e-6,
    )

  def test_a_jit_between_the_gradient_and_the_loop_plans_a_backward_pass(self):
    # jax.grad(jax.jit(f)): inside the jit the loop's values are the jit's
    # tracers, whatever the gradient outside is taken of; it is taken of
    # the weights here, and the plan measures the backward pass.
    w = jax.random.normal(KEY, [32, 32]) / 6
    xs = jnp.ones([64, 4, 32]) * 0.1

    def loss(w, xs):
      step = lambda h, x: (jnp.tanh(h @ w + x), jnp.sum(h**2))
      return jnp.sum(hkb.scan(step, jnp.zeros([4, 32]), xs, remat="auto", memory_budget=1 << 30)[1])

    with remat_models.plans_made() as made:
      jax.value_and_grad(jax.jit(loss))(w, xs)
    self.assertIn(True, [k.remat for k in made[-1].candidates])

  def test_a_callback_of_data_in_the_step_is_not_differentiated(self):
    # `jax.pure_callback` has no derivative: the user's step runs it on
    # the data xs, never differentiated; measured with the xs
    # differentiated, planning failed ("Pure callbacks do not support
    # JVP"), as it did while finding what the step differentiates.
    w = jax.random.normal(KEY, [16, 16]) / 4
    xs = jnp.ones([32, 4, 16])

    def loss(w, xs, **remat):
      def step(h, x):
        x = jax.pure_callback(
          lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x
        )
        h = jnp.tanh(h @ w + x)
        return h, jnp.sum(h**2)

      return jnp.sum(hkb.scan(step, jnp.zeros([4, 16]), xs, **remat)[1])

    auto = functools.partial(loss, remat="auto", memory_budget=1 << 30)
    chex.assert_trees_all_close(
      jax.jit(jax.value_and_grad(auto))(w, xs),
      jax.jit(jax.value_and_grad(functools.partial(loss, remat=False)))(w, xs),
      rtol=1e-6,
    )

  def test_data_xs_get_no_cotangent_in_the_measurements(self):
    # A step `m = tanh(m * w + x)` over a 256x256 carry, `w` (closed over)
    # the carry's size, 16 steps of data xs. Measured with the xs
    # differentiated (as a layer scan's params), the least plan (binomial,
    # 1 slot) was predicted at 1,575,204 bytes and the training step,
    # which takes no gradient of the xs, compiles to 1,835,712 (1.166x):
    # one buffer of w's (and the carry's) 262,144 bytes more. The loop
    # reads from the gradient's tracers which inputs it is taken of.
    w = jax.random.normal(KEY, [256, 256]) / 2
    xs = jax.random.normal(KEY, [16, 256])

    def loss(w, xs, budget):
      step = lambda m, x: (jnp.tanh(m * w + x[None, :]), None)
      m, _ = hkb.scan(
        step, jnp.zeros([256, 256]), xs, remat="auto", memory_budget=budget, max_recompute=math.inf
      )
      return jnp.sum(m**2)

    least = plan_where_run(
      jax.value_and_grad(functools.partial(loss, budget=1 << 40)), w, xs
    ).least_budget
    compiled = jax.jit(jax.value_and_grad(loss), static_argnums=2).lower(w, xs, least).compile()
    self.assertLessEqual(hlo_flops.held(compiled).temporaries, least * 1.05)

  @on_cpu_and_gpu(TOY_BYTES)
  def test_a_loss_of_the_final_carry_alone_plans_exactly_with_no_ys(self):
    # `KnownGapsTest`'s encoder, a tanh RNN whose loss reads only the final
    # carry: with ys (`2 sin(h)`) the loss never reads, the plan counts them
    # and their cotangents (the least plan predicted at 536,548 bytes, the
    # step compiled to 49,856), and a budget of 100,000 is refused, saying
    # what to do; its step returning no ys, as the error says, that budget
    # is kept and the plans are the compiled step's (measured: remat=False
    # predicted 1,091,832 bytes, compiled 1,091,768).
    t, b, h = 128, 8, 64
    w = jax.random.normal(KEY, [2 * h, h]) * 0.2
    xs = jax.random.normal(KEY, [t, b, h])

    def loss(w, xs, budget, ys):
      def step(c, x):
        c = jnp.tanh(jnp.concatenate([x, c], -1) @ w)
        return c, jnp.sin(c) * 2.0 if ys else None

      last, _ = hkb.scan(
        step, jnp.zeros([b, h]), xs, remat="auto", memory_budget=budget, max_recompute=math.inf
      )
      return jnp.sum(last**2)

    train = jax.jit(jax.value_and_grad(loss), static_argnums=(2, 3))
    with self.assertRaisesRegex(ValueError, "where it reads only the final carry, return none"):
      train.lower(w, xs, 100_000, True)
    for budget in (1 << 40, 100_000):
      with remat_models.plans_made() as made:
        compiled = train.lower(w, xs, budget, False).compile()
      kept = hlo_flops.held(compiled).temporaries
      self.assertLessEqual(kept, budget)
      self.assertLess(abs(kept / made[-1].choice.temporaries - 1), 0.1, (budget, made[-1].choice))

  @on_cpu_and_gpu(CPU_SIZED)
  def test_a_gradient_of_the_gradient_is_planned_as_it_runs(self):
    # `jax.grad` of a loss of `jax.grad` (a meta-gradient) differentiates
    # the loop's backward pass, which then keeps for the outer one what a
    # schedule recomputes: a tanh RNN over 64 steps compiled to 1,679,960
    # bytes with binomial, 804,528 with remat=False, 414,152 with
    # remat=True, where the plan of one backward pass predicted 24,892 to
    # 203,968 (86-4,083× over the budget). The plan measures the
    # second-order program, with no schedule among its candidates.
    w, xs = _rnn_weight_and_xs()
    loss = _rnn_loss

    def meta(**remat):  # A loss of the gradient, differentiated.
      return jax.grad(lambda w, xs: jnp.sum(jax.grad(functools.partial(loss, **remat))(w, xs)))

    plain = {r: compiled_bytes(meta(remat=r), w, xs) for r in (False, True)}
    self.assertGreater(
      compiled_bytes(meta(remat="binomial"), w, xs), plain[False]
    )  # No schedule is worth measuring.
    expected = meta(remat=False)(w, xs)
    with caches.disabled():
      loose = plan_where_run(meta(remat="auto", memory_budget=1 << 30), w, xs)
      self.assertEqual({k.remat for k in loose.candidates}, {False, True})
      self.assertIn("recomputed, for a gradient of a gradient.\n", str(loose))
      for k in loose.candidates:  # Each as the second-order step compiles.
        self.assertLess(abs(k.temporaries / plain[k.remat] - 1), 0.02, k)
      for budget, remat in ((1 << 30, False), ((plain[False] + plain[True]) // 2, True)):
        step = meta(remat="auto", memory_budget=budget)
        self.assertIs(plan_where_run(step, w, xs).choice.remat, remat)
        self.assertLessEqual(compiled_bytes(step, w, xs), budget * (1 + STEP_TOLERANCE))
        np.testing.assert_allclose(step(w, xs), expected, atol=1e-4)
      with self.assertRaisesRegex(ValueError, "gradient of a gradient"):
        jax.eval_shape(meta(remat="auto", memory_budget=plain[True] // 2), w, xs)
    # Kept apart from the first-order plan of the same loop: the caches
    # are keyed on the derivatives, in memory and on disk (memory emptied,
    # the files kept: a new process).
    with (
      mock.patch.dict(os.environ, {"HAIKU_BRIDGE_CACHE_DIR": self.create_tempdir().full_path}),
      mock.patch.object(caches, "_enabled", True),
    ):
      caches.clear_caches()
      try:
        first = plan_where_run(
          jax.grad(functools.partial(loss, remat="auto", memory_budget=1 << 30)), w, xs
        )
        second = plan_where_run(meta(remat="auto", memory_budget=1 << 30), w, xs)
        plan_cache._COEFFICIENTS.clear()
        plan_cache._COMPILED.clear()
        with measuring_compiles() as compiles:
          from_disk = plan_where_run(meta(remat="auto", memory_budget=1 << 30), w, xs)
      finally:
        caches.clear_caches()
    self.assertEqual(compiles, [])  # Read from disk.
    self.assertIn("binomial", {k.remat for k in first.candidates})
    self.assertEqual(second, loose)
    self.assertEqual(from_disk, loose)

  @on_cpu_and_gpu(CPU_SIZED)
  def test_every_loop_keeps_its_budget_under_every_derivative(self):
    # The grid: each loop of the bridge over a Haiku step, its loss
    # differentiated as a meta-gradient (reverse over reverse), a
    # Hessian-vector product (forward over reverse) and a JVP (forward),
    # with respect to the params, the data an argument: at the budget
    # between the least plan and remat=True's, the whole step within it,
    # the values the loose plan's; under an identity custom getter, the
    # same plan. (A batch-major dynamic_unroll under a JVP alone:
    # `KnownGapsTest`.)
    for name, net, x in _loop_models():
      params, state = net.init(KEY, x, 1 << 40)
      through_getter = _derivative_forms(net, state, getter=True)
      for form, program in _derivative_forms(net, state).items():
        if (name, form) == ("dynamic_unroll", "jvp"):
          continue
        with self.subTest(f"{name} {form}"), caches.disabled():
          loose = plan_where_run(program(1 << 40), params, x)
          self.assertEqual(plan_where_run(through_getter[form](1 << 40), params, x), loose)
          per_step = next(k for k in loose.candidates if k.remat is True)
          budget = (per_step.temporaries + loose.least_budget) // 2
          self.assertLessEqual(
            compiled_bytes(program(budget), params, x), budget * (1 + STEP_TOLERANCE)
          )
          jax.tree.map(
            functools.partial(np.testing.assert_allclose, rtol=1e-3, atol=1e-5),
            jax.jit(program(budget))(params, x),
            jax.jit(program(1 << 40))(params, x),
          )

  def test_every_loop_defers_its_refusal_to_a_differentiation(self):
    # The grid of the deferred refusal: each loop of the bridge over a
    # Haiku step, at a budget no plan fits, with and without an identity
    # custom getter: a gradient it sees refuses at once, in its own name;
    # its eval step under jax.jit runs as the plain loop does (the same
    # loss and Haiku state); a gradient it cannot see (outside the jit)
    # refuses in the same words when it reaches the loop.
    for name, net, x in _loop_models():
      params, state = net.init(KEY, x, 1 << 40)
      for getter in (False, True):

        def loss(p, budget, getter=getter):
          return net.apply(p, state, None, x, budget, getter=getter)

        words = f"^hkb.{name}: no remat plan for {x.shape[0]} steps fits "
        with self.subTest(f"{name} getter={getter}"), caches.disabled():
          with self.assertRaisesRegex(ValueError, words):
            jax.eval_shape(jax.grad(lambda p: loss(p, 1)[0]), params)
          chex.assert_trees_all_close(
            jax.jit(lambda p: loss(p, 1))(params), jax.jit(lambda p: loss(p, 1 << 40))(params)
          )
          with self.assertRaisesRegex(ValueError, words):
            jax.eval_shape(jax.grad(jax.jit(lambda p: loss(p, 1)[0])), params)

  def test_a_refusal_inside_a_custom_vjp_block(self):
    # A loop inside `hkb.custom_vjp`, at a budget no plan fits: its eval
    # step runs plain; with `hkb.vjp_fwd` its fwd differentiates the loop
    # (keeping jax.vjp's residuals), which the loop sees and refuses; a
    # backward pass of the user's own that never differentiates the loop
    # (here: the weights' cotangents are zero) runs, as nothing of the
    # plan's would.
    def core(xs):
      return hkb.dynamic_unroll(hk.GRU(16), xs, jnp.zeros([4, 16]), remat="auto", memory_budget=1)[
        0
      ]

    def zero_bwd(params, g):
      del g
      return jax.tree.map(jnp.zeros_like, params), None

    inline = hk.transform(
      lambda xs: jnp.sum(hkb.dynamic_unroll(hk.GRU(16), xs, jnp.zeros([4, 16]))[0] ** 2)
    )
    xs = jnp.ones([32, 4, 16]) * 0.1
    params = inline.init(KEY, xs)
    for name, fwd, bwd in (
      ("vjp_fwd", hkb.vjp_fwd, lambda vjp_fn, g: vjp_fn(g)),
      ("own backward", lambda f_pure, p, xs: (f_pure(p, xs), p), zero_bwd),
    ):
      net = hk.transform(lambda xs: jnp.sum(hkb.custom_vjp(core, fwd, bwd)(xs) ** 2))
      with self.subTest(name), caches.disabled():
        self.assertEqual(net.init(KEY, xs).keys(), params.keys())
        chex.assert_trees_all_close(
          jax.jit(net.apply)(params, None, xs), jax.jit(inline.apply)(params, None, xs)
        )
        gradient = jax.grad(lambda p: net.apply(p, None, xs))
        if name == "vjp_fwd":
          with self.assertRaisesRegex(
            ValueError, "^hkb.dynamic_unroll: no remat plan for 32 steps"
          ):
            jax.eval_shape(gradient, params)
        else:
          self.assertEqual(
            jax.tree.map(jnp.any, gradient(params)), jax.tree.map(lambda _: False, params)
          )

  @on_cpu_and_gpu(CPU_SIZED)
  def test_a_forward_derivative_of_the_loop_is_planned_as_it_runs(self):
    # `jax.jvp` of a loss through the loop keeps nothing for a backward
    # pass: a tanh RNN over 64 steps compiled to 4,136 bytes with every
    # plan, where the plan of a gradient predicted 13,724 to 203,968 and
    # took a schedule of one slot at a budget of 13,724; a gradient of that
    # (`jax.grad` of a JVP) keeps the tangents' residuals: remat=False
    # 479,492, remat=True 150,724, where a gradient of a gradient's plan
    # predicted 808,560 and 415,176 and refused budgets between. A
    # schedule runs as remat=True in forward mode: not a candidate.
    w, xs = _rnn_weight_and_xs()

    def jvp(**remat):
      return lambda w, xs: jax.jvp(lambda w: _rnn_loss(w, xs, **remat), (w,), (w,))[1]

    def grad_of_jvp(**remat):
      return jax.grad(jvp(**remat))

    for name, program, said in (
      ("jvp", jvp, "a JVP"),
      ("grad of jvp", grad_of_jvp, "a gradient of a JVP"),
    ):
      with self.subTest(name), caches.disabled():
        plain = {r: compiled_bytes(program(remat=r), w, xs) for r in (False, True)}
        loose = plan_where_run(program(remat="auto", memory_budget=1 << 30), w, xs)
        self.assertEqual({k.remat for k in loose.candidates}, {False, True})
        self.assertIn(f", for {said}.\n", str(loose))
        for k in loose.candidates:
          self.assertLess(abs(k.temporaries / plain[k.remat] - 1), 0.02, k)
        budget = loose.least_budget
        step = program(remat="auto", memory_budget=budget)
        self.assertLessEqual(compiled_bytes(step, w, xs), budget * (1 + STEP_TOLERANCE))
        np.testing.assert_allclose(
          jax.jit(step)(w, xs), jax.jit(program(remat=False))(w, xs), rtol=1e-5, atol=1e-5
        )

  @on_cpu_and_gpu(CPU_SIZED)
  def test_a_hessian_vector_product_is_planned_as_it_runs(self):
    # `jax.jvp` of `jax.grad` (forward over reverse) runs the loop's
    # backward pass with a tangent beside every buffer: planned as one
    # backward pass, a tanh RNN over 64 steps compiled to 2.00× its budget
    # at the middle plan and 2.21× at the least. `jax.hessian` (jacfwd of
    # jacrev) takes one JVP per element of the params at once, under a
    # vmap of the tangents alone: 33× the plan of one backward pass; 8
    # gradients at once under a vmap of the cotangents alone, 2.1-4.7×.
    # The plan measures the program with those derivatives.
    w, xs = _rnn_weight_and_xs()
    loss = _rnn_loss

    def hvp(**remat):
      return lambda w, xs: jax.jvp(
        lambda w: jax.grad(functools.partial(loss, **remat))(w, xs), (w,), (w,)
      )

    def hessian(**remat):
      return jax.hessian(functools.partial(loss, **remat))

    def weighted(**remat):
      # The gradients of 8 weightings of the loss at once: the loop's
      # values unbatched, its cotangents batched (as `jax.jacrev` batches
      # them, but where the loop can see it: `KnownGapsTest`).
      return lambda w, xs: jax.vmap(lambda s: jax.grad(lambda w: s * loss(w, xs, **remat))(w))(
        jnp.arange(1.0, 9.0)
      )

    for name, program, arg, said in (
      ("hvp", hvp, w, "a JVP of a gradient"),
      ("hessian", hessian, w[:8, :8], "64 JVPs at once of a gradient"),
      ("weighted", weighted, w, "8 gradients at once"),
    ):
      with self.subTest(name), caches.disabled():
        loose = plan_where_run(
          program(remat="auto", memory_budget=1 << 30, max_recompute=math.inf), arg, xs
        )
        self.assertIn(f", for {said}.\n", str(loose))
        self.assertIn("binomial", {k.remat for k in loose.candidates})
        plain = compiled_bytes(program(remat=False), arg, xs)
        self.assertLess(abs(loose.choice.temporaries / plain - 1), 0.02)
        per_step = next(k for k in loose.candidates if k.remat is True)
        budgets = [(per_step.temporaries + loose.least_budget) // 2]
        if name != "hessian":
          # jax.hessian's own step keeps 8 KB more at the least (its
          # output's assembly, outside the loop): 1.064× there.
          budgets.append(loose.least_budget)
        expected = jax.jit(program(remat=False))(arg, xs)
        for budget in budgets:
          step = program(remat="auto", memory_budget=budget, max_recompute=math.inf)
          self.assertEqual(plan_where_run(step, arg, xs).choice.remat, "binomial")
          self.assertLessEqual(compiled_bytes(step, arg, xs), budget * (1 + STEP_TOLERANCE))
          jax.tree.map(
            functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-4),
            jax.jit(step)(arg, xs),
            expected,
          )


class KnownGapsTest(absltest.TestCase):
  """Promises of issue 42 that `remat="auto"` does not keep yet, each on a model the grid lacks."""

  @on_cpu_and_gpu(
    "a gap of XLA:CPU's: on a TPU v5e the step compiled to "
    "1.000 of the budget (RESULTS.md, 'The TPU again')"
  )
  @unittest.expectedFailure
  def test_a_batch_major_unroll_under_a_jvp_alone_keeps_its_budget(self):
    # Known gap: `hkb.dynamic_unroll(time_major=False)` under `jax.jvp` of
    # its loss (forward mode alone): remat=False predicted at 201,792
    # bytes, the step compiled to 264,256 (time major, both 136,256; under
    # a gradient the batch-major plan is over, 395,464 against 328,968).
    name, net, x = [m for m in _loop_models() if m[0] == "dynamic_unroll"][0]
    params, state = net.init(KEY, x, 1 << 40)
    program = _derivative_forms(net, state)["jvp"]
    with caches.disabled():
      budget = plan_where_run(program(1 << 40), params, x).least_budget
      self.assertLessEqual(
        compiled_bytes(program(budget), params, x), budget * (1 + STEP_TOLERANCE), name
      )

  @unittest.expectedFailure
  @on_cpu_and_gpu(TOY_BYTES)
  def test_a_jacobian_by_jacrev_keeps_its_budget(self):
    # Known gap: `jax.jacrev` linearizes the loss first, the loop planned
    # then, and only afterwards vmaps the backward pass over the rows of
    # the Jacobian: the loop cannot see that vmap when it is planned. A
    # tanh RNN's per-example losses (8 rows): the step compiled to 2.1×
    # the budget at the middle plan, 4.7× at the least, as 8 weightings of
    # the loss at once do where the loop can see the vmap and plans for
    # it (`DifferentiatedTest`).
    w, xs = _rnn_weight_and_xs()

    def losses(w, xs, **remat):
      h, _ = hkb.scan(lambda h, x: (jnp.tanh(h @ w + x), None), jnp.zeros([8, 32]), xs, **remat)
      return jnp.sum(h**2, axis=1)

    def jacobian(**remat):
      return jax.jacrev(functools.partial(losses, **remat))

    with caches.disabled():
      least = plan_where_run(jacobian(remat="auto", memory_budget=1 << 30), w, xs).least_budget
      self.assertLessEqual(
        compiled_bytes(jacobian(remat="auto", memory_budget=least, max_recompute=math.inf), w, xs),
        least * (1 + STEP_TOLERANCE),
      )

  @unittest.expectedFailure
  def test_outputs_the_step_does_not_differentiate_are_not_counted(self):
    # Known gap: the plan counts every output of the loop with its cotangent
    # (docs/remat.md), but a step whose loss reads only the final carry (an
    # encoder's last state) never builds the ys' cotangents, and XLA drops
    # what only they need. A tanh RNN over 128 steps, batch 8, width 64,
    # `ys = 2 sin(h)` unused: remat=False predicted 1,839,312 bytes, compiled
    # 1,091,768; the least plan (binomial, 1 slot) 536,492 against 55,452, so
    # a budget of 100,000 is refused ("the least any needs is 536492") that
    # the schedule keeps (notes: wild2's a3.py; the same with the ys
    # returned as `has_aux`).
    t, b, h = 128, 8, 64
    w = jax.random.normal(KEY, [2 * h, h]) * 0.2
    xs = jax.random.normal(KEY, [t, b, h])

    def step(w):
      def f(c, x):
        c = jnp.tanh(jnp.concatenate([x, c], -1) @ w)
        return c, jnp.sin(c) * 2.0

      return f

    def loss(w, xs, budget):
      last, _ = hkb.scan(
        step(w), jnp.zeros([b, h]), xs, remat="auto", memory_budget=budget, max_recompute=math.inf
      )
      return jnp.sum(last**2)

    # The least where the loop runs (`w` closed over, compiled in as the
    # jitted step has it): the budget is taken, and the gap is in the
    # figures below, not a refusal before them.
    least = plan_where_run(
      jax.value_and_grad(lambda w, xs: loss(w, xs, 1 << 40)), w, xs
    ).least_budget
    with remat_models.plans_made() as made:
      compiled = jax.jit(jax.value_and_grad(loss), static_argnums=2).lower(w, xs, least).compile()
    choice = made[-1].choice
    kept = hlo_flops.held(compiled).temporaries
    self.assertLess(abs(kept / choice.temporaries - 1), 0.1)

  @on_cpu_and_gpu(TOY_BYTES)
  @unittest.expectedFailure
  def test_a_loss_linear_in_the_final_carry_keeps_the_least_budget(self):
    # Known gap: the plan measures a loss of the squares of the loop's
    # outputs; where the loss is linear in the final carry (`jnp.sum(h)`),
    # its cotangent is a constant, and XLA:CPU's one-slot schedule then
    # keeps one carry more. A tanh RNN over 64 steps, batch 8, width 32:
    # the least plan (binomial, 1 slot) predicted 14,052 bytes, compiled
    # 15,068 (1.072); at the middle budget 0.993. A loss in the step
    # (`jnp.sum(ys)` of `ys = jnp.sum(h ** 2)`) is exact: 14,056 and 14,048.
    w = jax.random.normal(KEY, [32, 32]) / 6
    xs = jax.random.normal(KEY, [64, 8, 32]) * 0.1

    def loss(w, xs, **remat):
      step = lambda h, x: (jnp.tanh(h @ w + x), jnp.sum(h))
      h, ys = hkb.scan(step, jnp.zeros([8, 32]), xs, **remat)
      return jnp.sum(ys) + jnp.sum(h)

    step = lambda **remat: jax.value_and_grad(functools.partial(loss, **remat))
    with caches.disabled():
      least = plan_where_run(
        step(remat="auto", memory_budget=1 << 40, max_recompute=math.inf), w, xs
      ).least_budget
      self.assertLessEqual(
        compiled_bytes(step(remat="auto", memory_budget=least, max_recompute=math.inf), w, xs),
        least * (1 + STEP_TOLERANCE),
      )

  @unittest.expectedFailure
  def test_a_data_parallel_step_over_auto_axes_is_planned_per_device(self):
    # Known gap: a loop in a `jax.jit` step whose batch is sharded over
    # Auto mesh axes cannot see the sharding (its values' types do not hold
    # it), so it is planned on the whole batch, compiled unsharded on one
    # device; `memory_analysis()` of the sharded step is one device's. 16
    # tanh layers of 128, batch 64 over 8 devices: remat=False predicted
    # 1,770,176 bytes, compiled 333,120 a device (0.19); the least plan
    # 296,740 against 154,020. A budget of one device's memory buys
    # recomputation it does not need. Over Explicit axes (`ShardMapTest`)
    # and inside `jax.shard_map` the loop is planned per device.
    if jax.device_count() < 8:
      self.skipTest(f"needs 8 devices, jax has {jax.device_count()}.")
    net = hk.transform(
      lambda x: hkb.repeat_layer(
        lambda h: h + jnp.tanh(hk.Linear(WIDE)(h)), x, 16, remat="auto", memory_budget=1 << 40
      )
    )
    x = jax.random.normal(KEY, [64, WIDE])
    params = net.init(KEY, x)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
      step = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(net.apply(p, None, x) ** 2)))
      with remat_models.plans_made() as made:
        compiled = step.lower(
          jax.device_put(params, NamedSharding(mesh, P())),
          jax.device_put(x, NamedSharding(mesh, P("data"))),
        ).compile()
    (plan,) = made
    self.assertIs(plan.choice.remat, False)
    per_device = hlo_flops.held(compiled).temporaries
    self.assertLess(abs(per_device / plan.choice.temporaries - 1), 0.1)

  @unittest.expectedFailure
  def test_a_loop_inside_a_jax_loop_under_the_gradient_keeps_its_budget(self):
    # Known gap: a loop inside a `jax.lax.scan` the gradient is taken
    # around runs once an iteration, and the outer scan keeps every
    # iteration's residuals of it for its backward pass: the step holds
    # about the outer length times the plan's bytes. A tanh RNN over 4
    # sequences of 64 steps: the least plan (binomial, 1 slot) 13,668
    # bytes, the step compiled to 95,900 (7.0×); the middle plan's 41,388
    # to 238,308 (5.5×). The loop cannot see the outer length; it says so
    # (`tracing_test`).
    w = jax.random.normal(KEY, [32, 32]) / 6
    xs = jax.random.normal(KEY, [4, 64, 8, 32])

    def loss(w, xs, budget):
      def outer(total, seq):
        h, _ = hkb.scan(
          lambda h, x: (jnp.tanh(h @ w + x), None),
          jnp.zeros([8, 32]),
          seq,
          remat="auto",
          memory_budget=budget,
          max_recompute=math.inf,
        )
        return total + jnp.sum(h**2), None

      return jax.lax.scan(outer, 0.0, xs)[0]

    least = plan_where_run(
      jax.value_and_grad(functools.partial(loss, budget=1 << 40)), w, xs
    ).least_budget
    compiled = jax.jit(jax.value_and_grad(loss), static_argnums=2).lower(w, xs, least).compile()
    self.assertLessEqual(hlo_flops.held(compiled).bytes, least * 1.05)


class ProgressTest(absltest.TestCase):
  """The lines that start and end each plan: INFO, and the end at WARNING (shown by default) when slow."""

  def _plan(self):
    with caches.disabled():
      return hkb.remat_plan(
        toy_step, jnp.zeros([4, 16]), jnp.ones([64, 4, 16]), memory_budget=1 << 30
      )

  def test_a_plan_says_when_it_starts_and_when_it_ends(self):
    with (
      mock.patch.object(remat_plan, "SLOW_PLAN_SECONDS", math.inf),
      self.assertLogs("haiku_bridge.remat", "INFO") as logs,
    ):
      plan = self._plan()
    start, end = logs.records
    self.assertEqual((start.levelno, end.levelno), (logging.INFO, logging.INFO))
    self.assertIn(
      'remat="auto": planning 64 steps for memory_budget=1073741824 bytes', start.getMessage()
    )
    self.assertRegex(
      end.getMessage(),
      r'^remat="auto": planned 64 steps in \d+\.\d s: chose remat=False, '
      f"{plan.choice.temporaries} bytes for memory_budget=1073741824 bytes",
    )
    self.assertIn("Nothing is kept on disk", end.getMessage())

  def test_a_slow_plan_ends_at_warning_which_default_logging_shows(self):
    with (
      mock.patch.object(remat_plan, "SLOW_PLAN_SECONDS", 0.0),
      self.assertLogs("haiku_bridge.remat", "WARNING") as logs,
    ):
      self._plan()
    (end,) = logs.records
    self.assertGreaterEqual(end.levelno, logging.lastResort.level)
    self.assertIn('remat="auto": planned 64 steps in ', end.getMessage())

  def test_the_end_line_says_where_the_measurements_are_kept(self):
    directory = self.create_tempdir().full_path
    with (
      mock.patch.dict(os.environ, {"HAIKU_BRIDGE_CACHE_DIR": directory}),
      mock.patch.object(remat_plan, "SLOW_PLAN_SECONDS", 0.0),
      self.assertLogs("haiku_bridge.remat", "WARNING") as logs,
    ):
      hkb.remat_plan(toy_step, jnp.zeros([4, 16]), jnp.ones([64, 4, 16]), memory_budget=1 << 30)
    self.assertIn(f"kept on disk ({directory})", logs.records[-1].getMessage())


class VisibleTest(parameterized.TestCase):
  """The plan of a Haiku loop, before it runs; the plan each loop logs; the table."""

  def test_least_budget_and_the_table_read_every_candidate(self):
    # The last candidate (the most recomputed) is not the least memory, and
    # one fits the budget to the byte: neither is over it.
    c = hkb.RematCandidate
    per_step = c(True, None, None, 1 << 19, 8, 100)
    plan = hkb.RematPlan(
      8,
      3 << 20,
      (c(False, None, None, 4 << 20, 0, 0), per_step, c("binomial", 2, None, 3 << 20, 20, 900)),
      per_step,
    )
    self.assertEqual(plan.least_budget, 1 << 19)
    marks = [row.rsplit("|", 2)[1].strip() for row in plan.table().splitlines()[2:]]
    self.assertEqual(marks, ["over the budget", "**chosen**", ""])

  @on_cpu_and_gpu(TOY_BYTES)
  def test_remat_plan_of_each_loop_is_the_plan_the_loop_logs_and_runs(self):
    for name, net, x in _loop_models():
      with self.subTest(name):
        params, state = net.init(KEY, x, 1 << 40)
        # The loop did not run: its steps never touched the state.
        _, new_state = net.apply(params, state, None, x, 1 << 40, plan=True)
        jax.tree.map(np.testing.assert_array_equal, new_state, state)

        # Where the loop runs: under the gradient of the params, which tells
        # the plan what is data (`x`).
        planned = lambda budget: plan_under_gradient(
          lambda p: net.apply(p, state, None, x, budget, plan=True)[0], params
        )
        loose = planned(1 << 40)
        self.assertIs(loose.choice.remat, False)
        budget = loose.least_budget
        tight = planned(budget)
        # The least: a schedule of one slot (137,532 bytes of temporaries
        # for dynamic_unroll), but for dynamic_unroll under jaxlib 0.11's
        # XLA remat=False or True, 100 bytes apart (0.2521 and 0.2522 MiB
        # with the loss's value measured; 197,776 for True under 0.10.2).
        least = (
          (False, True)
          if name == "dynamic_unroll" and (versions.release(jaxlib.__version__) >= (0, 11))
          else ("binomial", "nested")
        )
        self.assertIn(tight.choice.remat, least)
        # Checked compiled: the choice holds the budget (the least
        # candidate's figure may move either way once compiled).
        self.assertLessEqual(tight.choice.temporaries, budget)
        with remat_models.plans_made() as made:
          jax.eval_shape(jax.grad(lambda p: net.apply(p, state, None, x, budget)[0]), params)
        self.assertEqual(made, [tight])
        with self.assertRaisesRegex(ValueError, f"the least any needs is {budget} bytes"):
          planned(budget - 1)

  def test_remat_plans_collects_each_loops_plan_as_remat_plan_makes_it(self):
    # Two loops in one training step (a layer stack, then a time scan over
    # its output), traced under the gradient of the params only: the
    # plans collected are those `hkb.remat_plan` makes of each loop there,
    # in order; nested blocks both collect; none after the block.
    def block(h):
      return h + jnp.tanh(hk.Linear(16)(h))

    def net(x, plan=None):
      loops = (
        functools.partial(hkb.repeat_layer, block, x, 8),
        lambda h: functools.partial(
          hkb.scan, lambda c, y: (jnp.tanh(c + y), jnp.sum(c)), jnp.zeros([16]), h
        ),
      )
      if plan == 0:
        return hkb.remat_plan(loops[0], memory_budget=1 << 30)
      h = loops[0](remat="auto", memory_budget=1 << 30)
      if plan == 1:
        return hkb.remat_plan(loops[1](h), memory_budget=1 << 30)
      return jnp.sum(loops[1](h)(remat="auto", memory_budget=1 << 30)[1])

    net = hk.transform(net)
    x = jax.random.normal(KEY, [32, 16])
    params = net.init(KEY, x)
    expected = [
      plan_under_gradient(lambda p, i=i: net.apply(p, None, x, plan=i), params) for i in (0, 1)
    ]
    with hkb.remat_plans() as outer:
      with hkb.remat_plans() as inner:
        jax.eval_shape(jax.grad(lambda p: net.apply(p, None, x)), params)
      jax.eval_shape(jax.grad(lambda p: net.apply(p, None, x)), params)
    jax.eval_shape(jax.grad(lambda p: net.apply(p, None, x)), params)
    self.assertEqual(inner, expected)
    self.assertEqual(outer, expected * 2)

  def test_a_loop_logs_its_plan_at_info(self):
    net = hk.transform(
      lambda x: hkb.repeat_layer(
        lambda h: jnp.tanh(hk.Linear(8)(h)), x, 12, remat="auto", memory_budget=1 << 40
      )
    )
    x = jnp.ones([2, 8])
    params = net.init(KEY, x)
    with self.assertLogs("haiku_bridge.remat", "INFO") as logs:
      jax.eval_shape(jax.grad(lambda p: jnp.sum(net.apply(p, None, x))), params)
    # Beside the lines that start and end planning (`ProgressTest`).
    (record,) = [r for r in logs.records if r.args and isinstance(r.args[0], hkb.RematPlan)]
    (plan,) = record.args
    self.assertIsInstance(plan, hkb.RematPlan)
    self.assertEqual((plan.length, plan.choice.remat), (12, False))
    self.assertIn("remat=\"auto\" for 12 steps chose remat=False:", record.getMessage())
    self.assertIn(plan.table(), record.getMessage())

  @on_cpu_and_gpu(CPU_SIZED)
  def test_table_in_mib_and_gflop_the_choice_marked(self):
    plan = _deterministic_plan()
    rows = [row.split(" | ") for row in plan.table(full=True).splitlines()[2:]]
    self.assertLen(rows, len(plan.candidates))
    chosen = [row for row in rows if row[-1] == "**chosen** |"]
    self.assertLen(chosen, 1)
    (row,) = chosen
    self.assertAlmostEqual(
      float(row[4]), plan.choice.temporaries / 2**20, delta=plan.choice.temporaries / 2**20 * 1e-3
    )
    self.assertAlmostEqual(
      float(row[6]) * 1e9, plan.choice.recomputed_flops, delta=plan.choice.recomputed_flops * 1e-3
    )
    self.assertEqual(plan.least_budget, min(c.temporaries for c in plan.candidates))

  @on_cpu_and_gpu(CPU_SIZED)
  def test_table_predicts_every_schedule_on_one_line_and_shows_compiles_apart(self):
    # The README's plan. The binomial rows' "predicted" column is the
    # model's line a + c·s + k and each schedule's tables for every row,
    # the chosen one too (its compiled bytes, off that line, only in the
    # "compiled" column); the compiled column holds exactly the programs
    # compiled while planning.
    with caches.disabled(), measuring_compiles() as compiled:
      plan = hkb.remat_plan(
        toy_step, jnp.zeros([4, 16]), jnp.ones([1024, 4, 16]), memory_budget=200_000
      )
    self.assertEqual(plan.choice.remat, "binomial")
    rows = [row.split(" | ") for row in plan.table(full=True).splitlines()[2:]]
    binomial = [(int(r[1]), float(r[3])) for r in rows if r[0] == "| binomial"]
    self.assertIn(plan.choice.slots, dict(binomial))
    slots, mib = np.array(
      [(s, m - remat_schedule.binomial_table_bytes(1024, s) / 2**20) for s, m in binomial]
    ).T
    line = np.polyval(np.polyfit(slots, mib, 1), slots)
    np.testing.assert_allclose(mib, line, rtol=2e-3)  # The table's 4 digits.
    shown = {(r[0].strip("| "), r[1]): r[4] for r in rows}
    for k in plan.candidates:
      cell = shown[(str(k.remat), "" if k.slots is None else str(k.slots))]
      if k.compiled is None:
        self.assertEqual(cell, "")
      else:
        self.assertAlmostEqual(float(cell), k.compiled / 2**20, delta=k.compiled / 2**20 * 1e-3)
    # Each plan compiled is a row's compiled figure (remat=False, True, one
    # slot and the choice at least), and no row shows a compile not made.
    self.assertGreaterEqual(len([k for k in plan.candidates if k.compiled is not None]), 4)
    self.assertLessEqual(len([k for k in plan.candidates if k.compiled is not None]), len(compiled))

  def test_table_marks_rows_over_max_recompute(self):
    c = hkb.RematCandidate
    chosen = c("binomial", 4, None, 2 << 20, 20, 200)
    plan = hkb.RematPlan(
      8,
      3 << 20,
      (c(False, None, None, 4 << 20, 0, 0), chosen, c("binomial", 1, None, 1 << 19, 36, 900)),
      chosen,
      max_recompute=5,  # 36 steps: 4.5 passes.
    )
    marks = [row.rsplit("|", 2)[1].strip() for row in plan.table().splitlines()[2:]]
    self.assertEqual(marks, ["over the budget", "**chosen**", ""])
    bound = plan._replace(max_recompute=3)
    marks = [row.rsplit("|", 2)[1].strip() for row in bound.table().splitlines()[2:]]
    self.assertEqual(marks, ["over the budget", "**chosen**", "over max_recompute=3"])

  @on_cpu_and_gpu(CPU_SIZED)
  def test_plans_carry_their_max_recompute_into_the_table(self):
    args = (jnp.zeros([4, 16]), jnp.ones([64, 4, 16]))
    for bound in (3, math.inf):
      plan = hkb.remat_plan(toy_step, *args, memory_budget=1 << 30, max_recompute=bound)
      self.assertEqual(plan.max_recompute, bound)
      over = [k for k in plan.candidates if k.recomputed_steps > 3 * 64]
      self.assertNotEmpty(over)
      text = plan.table(full=True)
      self.assertEqual(text.count("over max_recompute=3"), len(over) if bound == 3 else 0)

  def test_compact_table_shows_the_choice_its_neighbours_and_the_ends(self):
    # 40 schedules: the default table shows at most 12 rows, those that
    # say what the choice costs, and how many it leaves out.
    c = hkb.RematCandidate
    length = 64
    plain = c(False, None, None, 100 << 20, 0, 0, None, 100 << 20)
    per_step = c(True, None, None, 50 << 20, length, 640, None, 50 << 20)
    schedules = [
      c("binomial", s, None, (s + 1) << 16, length + 4 * (40 - s), 10 * (length + 4 * (40 - s)))
      for s in range(40, 0, -1)
    ]
    choice = schedules[10]  # 30 slots.
    plan = hkb.RematPlan(length, choice.temporaries, (plain, per_step, *schedules), choice)
    lines = plan.table().splitlines()
    rows = [row for row in lines[2:] if row.startswith("|")]
    self.assertLessEqual(len(rows), remat_choice.COMPACT_ROWS)
    shown = [row.split(" | ")[1] for row in rows]
    least_within = next(k for k in reversed(schedules) if not plan.over_bound(k))
    self.assertEqual([row.split(" | ")[0].strip("| ") for row in rows[:2]], ["False", "True"])
    for slots in ("31", "30", "29", str(least_within.slots), "1"):
      self.assertIn(slots, shown)
    self.assertEqual(
      lines[-1], f"{len(rows)} of 42 candidates: `table(full=True)` lists every one."
    )
    self.assertLen(plan.table(full=True).splitlines(), 2 + 42)
    self.assertEqual(plan.table(), plan.table(full=False))


if __name__ == "__main__":
  absltest.main()
