"""Tests for `choice.py`: the choice checked compiled, the line through the budget's schedules, and the refusals."""

import jax
from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import functools
import math
import os
import re
import sys
import threading
from unittest import mock

from absl.testing import absltest
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from haiku_bridge._src import caches
from haiku_bridge._src.remat import choice as remat_choice
from haiku_bridge._src.remat import loop as loop_lib
from haiku_bridge._src.remat import measure
from haiku_bridge._src.remat import plan_cache
from haiku_bridge._src.remat import schedule as remat_schedule
from testing import backend_tolerance
from testing import remat_models
from testing.plan_fixtures import compiled_bytes
from testing.plan_fixtures import CPU_SIZED
from testing.plan_fixtures import measuring_compiles
from testing.plan_fixtures import on_cpu_and_gpu
from testing.plan_fixtures import plan_in_a_directory_of_its_own
from testing.plan_fixtures import scan_loss
from testing.plan_fixtures import STEP_TOLERANCE
from testing.plan_fixtures import toy_step

plan_in_a_directory_of_its_own(__file__)

KEY = jax.random.PRNGKey(0)
# The planning benchmark's Conv1D stack at the tests' widths (`remat_models`).
CONV_STACK = functools.partial(remat_models.conv, 32)


class RefusalTest(absltest.TestCase):
  """A budget no plan fits is refused, naming the least budget the call takes, never one below it."""

  def test_budget_below_the_smallest_names_it(self):
    def step(h, x):
      return jnp.tanh(h + x), None

    h, xs = jnp.zeros([4, 16]), jnp.ones([64, 4, 16])
    plan = hkb.remat_plan(step, h, xs, memory_budget=1 << 30)
    # The least within the default bound (3 forward passes), which the
    # call then takes; and the least of any, which max_recompute=math.inf
    # takes, named where it is less.
    smallest = min(c.temporaries for c in plan.candidates if c.recomputed_steps <= 3 * 64)
    unbounded = min(c.temporaries for c in plan.candidates)
    if backend_tolerance.on_cpu():
      # One slot (about 32 passes) holds the least on XLA:CPU's figures.
      self.assertLess(unbounded, smallest)
    beyond = rf", {unbounded} with max_recompute=math\.inf" if unbounded < smallest else ""
    with self.assertRaisesRegex(
      ValueError,
      f"hkb.remat_plan: no remat plan for 64 steps fits "
      f"memory_budget=100 bytes: the least any needs is {smallest} bytes "
      rf"\(predicted\){beyond}\. ",
    ):
      hkb.remat_plan(step, h, xs, memory_budget=100)
    # Each least named is one its call takes, and none is less.
    for least, bound in ((smallest, None), (unbounded, math.inf)):
      self.assertLessEqual(
        hkb.remat_plan(step, h, xs, memory_budget=least, max_recompute=bound).choice.temporaries,
        least,
      )
      with self.assertRaisesRegex(ValueError, "remat plan"):
        hkb.remat_plan(step, h, xs, memory_budget=least - 1, max_recompute=bound)
    # Outside a transform, hkb.scan runs the same 64 steps, differentiated
    # in both its carry and its xs, as the plan is made.
    with self.assertRaisesRegex(
      ValueError, f"hkb.scan: no remat plan .* the least any needs is {smallest} "
    ):
      jax.eval_shape(
        jax.grad(
          lambda h, xs: jnp.sum(hkb.scan(step, h, xs, remat="auto", memory_budget=100)[0]),
          argnums=(0, 1),
        ),
        h,
        xs,
      )

  def test_a_refusal_never_names_a_least_below_its_budget(self):
    # Budgets below the least of any plan (one slot, over the default
    # bound) and up to remat=True's: each is taken, or refused naming a
    # least above it, which the call then takes; with the checks cut short
    # too.
    def step(h, x):
      return jnp.tanh(h + x), None

    h, xs = jnp.zeros([4, 16]), jnp.ones([64, 4, 16])
    plan = hkb.remat_plan(step, h, xs, memory_budget=1 << 30)
    per_step = next(c for c in plan.candidates if c.remat is True)
    unbounded = min(c.temporaries for c in plan.candidates)
    for checks in (0, remat_choice._CHECKS):
      for budget in [
        100,
        unbounded - 1,
        *np.linspace(unbounded, per_step.temporaries, 7).astype(int),
      ]:
        with (
          self.subTest(checks=checks, budget=int(budget)),
          caches.disabled(),
          mock.patch.object(remat_choice, "_CHECKS", checks),
        ):
          try:
            got = hkb.remat_plan(step, h, xs, memory_budget=int(budget))
          except ValueError as error:
            named = re.search(
              r"(?:least any needs is|least budget within "
              r"it is) ([0-9]+) bytes",
              str(error),
            )
            self.assertIsNotNone(named, str(error))
            least = int(named[1])
            self.assertGreater(least, budget, str(error))
            got = hkb.remat_plan(step, h, xs, memory_budget=least)
            budget = least
          self.assertLessEqual(got.choice.temporaries, budget)
          self.assertLessEqual(got.choice.recomputed_steps, 3 * 64)


class CheckedTest(absltest.TestCase):
  """The budget's schedules compiled: the line's second point, the choice's checks, and what a miss moves."""

  @on_cpu_and_gpu(CPU_SIZED)
  def test_a_choice_over_the_budget_compiled_is_passed_over(self):
    # Predictions 30% low for every schedule: the first choice compiles
    # over the budget, and the plan moves on until one compiles within it.
    def low(*args):
      c = real(*args)
      a, per_slot = c.scheduled
      return c._replace(
        scheduled=(a * 0.7, per_slot),
        measured=tuple((k, v) for k, v in c.measured if k[0] in (False, True)),
      )

    real = measure.coefficients
    model = CONV_STACK
    net, x = model()
    params = net.init(KEY, x)
    caches.clear_caches()
    with remat_models.plans_made() as made:
      remat_models.step_cost(model, params, x, 32, remat="auto", memory_budget=1 << 40)
    budget = int(min(c.temporaries for c in made[-1].candidates) * 1.2)
    # What the wrong coefficients measure stays in this test's directory
    # (and in memory until cleared), never in the suite's.
    with mock.patch.dict(os.environ, {"HAIKU_BRIDGE_CACHE_DIR": self.create_tempdir().full_path}):
      caches.clear_caches()
      try:
        with (
          mock.patch.object(measure, "coefficients", low),
          measuring_compiles() as compiles,
          remat_models.plans_made() as made,
        ):
          got = remat_models.step_cost(
            model, params, x, 32, remat="auto", memory_budget=budget, max_recompute=math.inf
          )
      finally:
        caches.clear_caches()
    self.assertGreater(len(compiles), 4 + 1)  # Passed one over.
    self.assertLessEqual(got.bytes, budget * (1 + STEP_TOLERANCE))
    self.assertIn(made[-1].choice.remat, ("binomial", "nested"))

  def _plan_with(self, measured, init, xs, budget):
    """`hkb.remat_plan` with `measure._measure` replaced by `measured`, nothing cached before or kept after."""
    with mock.patch.dict(os.environ, {"HAIKU_BRIDGE_CACHE_DIR": self.create_tempdir().full_path}):
      caches.clear_caches()
      try:
        with mock.patch.object(measure, "_measure", measured):
          return hkb.remat_plan(toy_step, init, xs, memory_budget=budget, max_recompute=math.inf)
      finally:
        caches.clear_caches()

  def _loose(self, length):
    """`toy_step`'s inputs for `length` steps, and its schedules' plans by slots (no budget)."""
    init, xs = jnp.zeros([4, 16]), jnp.ones([length, 4, 16])
    loose = hkb.remat_plan(toy_step, init, xs, memory_budget=1 << 30)
    return init, xs, {k.slots: k for k in loose.candidates if k.remat == "binomial"}

  @on_cpu_and_gpu(CPU_SIZED)
  def test_a_miss_at_one_slot_count_moves_only_that_plan(self):
    # XLA compiles one count of slots over the line (as near T): the plan
    # passes over that count to the next fewer slots, the others'
    # predictions untouched, rather than ruling out every schedule.
    init, xs, by_slots = self._loose(64)
    budget = by_slots[6].temporaries
    real = measure._measure

    def over_at_six(step, consts, length, remat, policy=None, **options):
      got = real(step, consts, length, remat, policy, **options)
      if getattr(remat, "num_slots", None) == 6:
        return got._replace(bytes=got.bytes + budget // 2)
      return got

    made = self._plan_with(over_at_six, init, xs, budget)
    self.assertEqual((made.choice.remat, made.choice.slots), ("binomial", 5))
    # The counts not compiled keep their predictions.
    after = {k.slots: k.temporaries for k in made.candidates if k.remat == "binomial"}
    self.assertEqual(
      {s: after[s] for s in (2, 3, 4, 7)}, {s: by_slots[s].temporaries for s in (2, 3, 4, 7)}
    )

  @on_cpu_and_gpu(CPU_SIZED)
  def test_a_second_schedule_off_the_line_moves_no_other_prediction(self):
    # The budget's schedule (6 slots) compiles 4 carries over the line of
    # one slot and a carry per slot: the line is then drawn through the
    # most slots instead, so every count not compiled keeps the prediction
    # it has with no miss, and 6 slots its compiled bytes.
    init, xs, by_slots = self._loose(64)
    budget = by_slots[6].temporaries
    miss = 4 * 4 * 16 * 4  # Four carries' bytes.
    real = measure._measure
    compiled = []

    def off_at_six(step, consts, length, remat, policy=None, **options):
      got = real(step, consts, length, remat, policy, **options)
      if getattr(remat, "num_slots", None) == 6:
        got = got._replace(bytes=got.bytes + miss, temporaries=got.temporaries + miss)
        compiled.append(got.bytes)
      return got

    lowered, real_lower = set(), measure._lower

    def lower(step, consts, length, remat, policy=None):
      lowered.add(getattr(remat, "num_slots", None))
      return real_lower(step, consts, length, remat, policy)

    with mock.patch.object(measure, "_lower", lower):
      made = self._plan_with(off_at_six, init, xs, budget)
    after = {k.slots: k.temporaries for k in made.candidates if k.remat == "binomial"}
    # 6, 62 (the most), the count re-aimed through 6's miss, the choice.
    self.assertLessEqual({6, 62, 5}, lowered)
    others = [s for s in after if s not in lowered]
    self.assertGreater(len(others), 15)
    self.assertEqual({s: after[s] for s in others}, {s: by_slots[s].temporaries for s in others})
    self.assertEqual([after[6]], compiled)
    self.assertEqual((made.choice.remat, made.choice.slots), ("binomial", 5))

  @on_cpu_and_gpu(CPU_SIZED)
  def test_after_its_checks_a_plan_takes_a_compiled_one_that_fits(self):
    # Every schedule but one slot's compiles over its prediction: each
    # check finds its choice over the budget, and after the last one the
    # plan is one slot's, compiled within the budget, not an error.
    init, xs, by_slots = self._loose(64)
    budget = by_slots[6].temporaries
    real = measure._measure
    checked = []

    def over_but_one_slot(step, consts, length, remat, policy=None, **options):
      got = real(step, consts, length, remat, policy, **options)
      slots = getattr(remat, "num_slots", 1)
      if slots > 1:
        checked.append(slots)
        return got._replace(bytes=got.bytes + budget)
      return got

    made = self._plan_with(over_but_one_slot, init, xs, budget)
    self.assertGreater(len(checked), remat_choice._CHECKS)
    self.assertEqual((made.choice.remat, made.choice.slots), ("binomial", 1))
    self.assertLessEqual(made.choice.temporaries, budget)

  @on_cpu_and_gpu(CPU_SIZED)
  def test_a_schedule_over_the_budget_gives_way_to_one_slot_fewer(self):
    # Past 16 slots the candidates are about 20% apart; where the count the
    # budget holds compiles over it, the next choice is that count less
    # one, not the next candidate down.
    init, xs, by_slots = self._loose(256)
    listed = sorted(s for s in by_slots if 30 <= s <= 50)
    low, high = listed[0], listed[1]
    self.assertGreater(high - low, 2)
    carry = 4 * 16 * 4
    holds = high - 1  # The count the budget holds, on the line.
    budget = by_slots[low].temporaries + (holds - low) * carry
    real = measure._measure

    def over_at_holds(step, consts, length, remat, policy=None, **options):
      got = real(step, consts, length, remat, policy, **options)
      if getattr(remat, "num_slots", None) == holds:
        return got._replace(bytes=got.bytes + budget // 2)
      return got

    made = self._plan_with(over_at_holds, init, xs, budget)
    self.assertEqual((made.choice.remat, made.choice.slots), ("binomial", holds - 1))
    self.assertLessEqual(made.choice.temporaries, budget)

  @on_cpu_and_gpu(CPU_SIZED)
  def test_a_budget_for_a_schedule_compiles_it_once(self):
    # Four programs: remat=False, remat=True and one slot measured, then the
    # schedule the budget chooses on the line of one slot and the carry's
    # bytes per slot, which is the line's second point and the choice's
    # check at once (a line through the most slots a candidate keeps
    # needed a fifth).
    init, xs = jnp.zeros([4, 16]), jnp.ones([256, 4, 16])
    with caches.disabled():
      loose = hkb.remat_plan(toy_step, init, xs, memory_budget=1 << 30)
      per_step = next(k for k in loose.candidates if k.remat is True)
      budget = (per_step.temporaries + loose.least_budget) // 2
      # One slot's program first: the budget's schedule is lowered as soon
      # as its figures are in, while remat=False's and True's compile.
      lowered, real_lower = [], measure._lower
      real_coefficients = plan_cache.coefficients

      def lower(step, consts, length, remat, policy=None):
        lowered.append(getattr(remat, "num_slots", remat))
        return real_lower(step, consts, length, remat, policy)

      def coefficients(*args):
        got = real_coefficients(*args)
        lowered.append("measured")
        return got

      with (
        measuring_compiles() as compiles,
        mock.patch.object(measure, "_lower", lower),
        mock.patch.object(plan_cache, "coefficients", coefficients),
      ):
        made = hkb.remat_plan(toy_step, init, xs, memory_budget=budget)
      self.assertEqual(len(compiles), 4)
      self.assertEqual(made.choice.remat, "binomial")
      self.assertGreater(made.choice.slots, 1)
      self.assertEqual(lowered, [1, None, True, made.choice.slots, "measured"])
      # Its bytes are the compiler's: the loop runs within the budget.
      self.assertLessEqual(
        compiled_bytes(jax.grad(scan_loss(toy_step, init, "auto", memory_budget=budget)), xs),
        budget * (1 + STEP_TOLERANCE),
      )

  @on_cpu_and_gpu(CPU_SIZED)
  def test_a_slot_off_the_carrys_bytes_is_aimed_again_beside_the_most(self):
    # Where a slot costs other than the carry's bytes (XLA:CPU keeps a
    # bfloat16 carry's at twice, XLA:TPU a Conv1D stack's 64 channels at
    # 3.7×), the budget's schedule placed on the carry's line is off it,
    # and holds too few slots (or too many). Then the count the budget
    # holds on the line through the two schedules compiled is compiled
    # beside the most slots a candidate keeps (T - 2, for the table), and
    # it is the choice, with no check after: three compiles in turn, not
    # four. Here the carry is taken at twice its bytes.
    init, xs = jnp.zeros([4, 16]), jnp.ones([256, 4, 16])
    most = measure.most_slots(256)
    with caches.disabled():
      loose = hkb.remat_plan(toy_step, init, xs, memory_budget=1 << 30)
      per_step = next(k for k in loose.candidates if k.remat is True)
      rough = hkb.remat_plan(
        toy_step, init, xs, memory_budget=(per_step.temporaries + loose.least_budget) // 2
      )
      # The budget half a slot over the schedule chosen there: a schedule a
      # few bytes off the line (as on jax 0.12.1) moves no aim by a slot.
      (_, fewest), (_, most_bytes) = sorted(
        (k.slots, k.compiled)
        for k in rough.candidates
        if k.remat == "binomial" and k.compiled is not None
      )
      budget = rough.choice.temporaries + (most_bytes - fewest) // (2 * rough.choice.slots - 2)
      made = hkb.remat_plan(toy_step, init, xs, memory_budget=budget)
      lowered, programs = [], {}
      most_lowered = threading.Event()
      real_lower, real_compile = measure._lower, measure._compile
      real_coefficients = plan_cache.coefficients

      def lower(step, consts, length, remat, policy=None):
        got = real_lower(step, consts, length, remat, policy)
        lowered.append(getattr(remat, "num_slots", remat))
        programs[id(got)] = len(lowered) - 1
        if lowered[-1] == most:
          most_lowered.set()
        return got

      def compile_(program):
        # The re-aimed schedule (the sixth program) compiles while the
        # most slots' is lowered.
        if programs[id(program)] == 5 and not most_lowered.wait(timeout=20):
          raise AssertionError("the re-aimed schedule compiled alone")
        return real_compile(program)

      def coefficients(*args):
        got = real_coefficients(*args)
        lowered.append("measured")
        return got

      real_guess = measure.slot_guess
      # A slot taken at twice the carry's bytes (its one f32[4, 16] leaf).
      with (
        mock.patch.object(measure, "slot_guess", lambda step: 2 * real_guess(step)),
        mock.patch.object(measure, "_lower", lower),
        mock.patch.object(measure, "_compile", compile_),
        mock.patch.object(plan_cache, "coefficients", coefficients),
      ):
        off = hkb.remat_plan(toy_step, init, xs, memory_budget=budget)
    # The same plan and compiled bytes; its prediction is the line through
    # the schedules each path compiled (4 bytes apart on jax 0.12.1).
    self.assertEqual(off.choice._replace(predicted=None), made.choice._replace(predicted=None))
    self.assertEqual(made.choice.remat, "binomial")
    second = lowered[3]
    self.assertLess(second, made.choice.slots)  # Placed at twice a slot.
    self.assertEqual(lowered, [1, None, True, second, "measured", made.choice.slots, most])


class ReadoutTest(absltest.TestCase):
  """Readout models, whose schedules' tables weigh as much as their slots, get what fits."""

  @on_cpu_and_gpu(CPU_SIZED)
  def test_five_percent_over_the_binomial_recomputes_no_more(self):
    # At 1.05× the default binomial's compiled bytes, "auto" keeps at least
    # as many slots. With the tables predicted at one slot's, the default's
    # (a column short) were over that budget: it kept 22 slots of the
    # LSTM's 23 (601 steps recomputed, 576) and 17 of the DeepRNN's 18
    # (381, 361); now 26 and 21 (573, 358), the most that compile within.
    for name, (model, length) in remat_models.READOUT_MODELS.items():
      net, x = model()
      params = jax.jit(net.init)(KEY, x)  # One compile, not one an op.
      default = remat_models.step_cost(model, params, x, length, remat="binomial")
      budget = int(1.05 * default.bytes)
      with remat_models.plans_made() as made:
        got = remat_models.step_cost(model, params, x, length, remat="auto", memory_budget=budget)
      self.assertLessEqual(got.bytes, budget, name)
      slots = loop_lib.schedule("binomial", length, None).num_slots
      recomputed = length + remat_schedule.binomial(length, slots).recomputed_steps
      self.assertLessEqual(made[-1].choice.recomputed_steps, recomputed, (name, made[-1].choice))


class RecomputeBoundTest(absltest.TestCase):
  """No plan recomputing more than `max_recompute` forward passes is chosen unasked."""

  LENGTH = 32

  def _step_and_inputs(self):
    def step(h, x):  # Wide activations, a small carry: schedules fit least.
      return jnp.tanh(h + x), jnp.sum(h**2)

    return step, jnp.zeros([2, 16]), jnp.ones([self.LENGTH, 2, 16])

  @on_cpu_and_gpu(CPU_SIZED)
  def test_every_budget_chooses_within_the_bound_or_names_the_least(self):
    step, h, xs = self._step_and_inputs()
    length = self.LENGTH
    loose = hkb.remat_plan(step, h, xs, memory_budget=1 << 30)

    def passes(candidate):
      # Ground truth: the steps the chosen schedule itself recomputes.
      if candidate.remat in loop_lib.REMAT_SCHEDULES:
        return (
          1
          + loop_lib.schedule(
            candidate.remat, length, candidate.groups, candidate.slots
          ).recomputed_steps
          / length
        )
      return 0 if candidate.remat is False else 1

    within = [c for c in loose.candidates if passes(c) <= 3]
    least = min(c.temporaries for c in within)
    refused = 0
    for budget in sorted({c.temporaries for c in loose.candidates}):
      try:
        plan = hkb.remat_plan(step, h, xs, memory_budget=budget)
      except ValueError as e:
        refused += 1
        # Below the least within the bound, and what the budget costs:
        # the fewest recomputed steps among the plans that fit.
        self.assertLess(budget, least)
        fewest = min(c.recomputed_steps for c in loose.candidates if c.temporaries <= budget)
        self.assertIn(
          f"memory_budget={budget} bytes recomputes at least "
          f"{fewest} steps, {fewest / length:.1f} forward passes",
          str(e),
        )
        self.assertIn(f"The least budget within it is {least} bytes", str(e))
        self.assertIn(f"max_recompute={math.ceil(fewest / length)} to accept", str(e))
        # Asked for, the plan is the one with the least FLOPs that fits.
        opted_in = hkb.remat_plan(
          step, h, xs, memory_budget=budget, max_recompute=math.ceil(fewest / length)
        )
        self.assertEqual(opted_in.choice.recomputed_steps, fewest)
        continue
      self.assertLessEqual(passes(plan.choice), 3, (budget, plan.choice))
      self.assertEqual(
        plan.choice,
        min(
          (c for c in plan.candidates if c.temporaries <= budget and passes(c) <= 3),
          key=lambda c: (c.recomputed_flops, c.recomputed_steps, c.temporaries),
        ),
      )
    self.assertGreater(refused, 0)  # One slot fits, 15.5 passes.
    self.assertLessEqual(hkb.remat_plan(step, h, xs, memory_budget=least).choice.temporaries, least)

  @on_cpu_and_gpu(CPU_SIZED)
  def test_the_loops_refuse_and_accept_as_told(self):
    step, h, xs = self._step_and_inputs()
    smallest = min(
      c.temporaries for c in hkb.remat_plan(step, h, xs, memory_budget=1 << 30).candidates
    )

    # Differentiated in its carry and its xs, as `hkb.remat_plan` plans.
    def grad(**options):
      return jax.eval_shape(
        jax.grad(
          lambda h, xs: jnp.sum(hkb.scan(step, h, xs, remat="auto", **options)[0]), argnums=(0, 1)
        ),
        h,
        xs,
      )

    with self.assertRaisesRegex(
      ValueError, "hkb.scan: every remat plan for 32 steps that fits .* over max_recompute=3"
    ):
      grad(memory_budget=smallest)
    with remat_models.plans_made() as made:
      grad(memory_budget=smallest, max_recompute=math.inf)
    self.assertEqual((made[-1].choice.remat, made[-1].choice.slots), ("binomial", 1))
    # max_recompute=0: nothing recomputed, so no remat or the error.
    plain = hkb.remat_plan(step, h, xs, memory_budget=1 << 30).candidates[0]
    self.assertIs(plain.remat, False)
    with self.assertRaisesRegex(
      ValueError, f"The least budget within it is {plain.temporaries} bytes"
    ):
      hkb.remat_plan(step, h, xs, memory_budget=plain.temporaries - 1, max_recompute=0)
    # max_recompute=1: remat=True's one pass is within it, where it fits.
    per_step = hkb.remat_plan(step, h, xs, memory_budget=1 << 30).candidates[1]
    self.assertIs(per_step.remat, True)
    self.assertEqual(per_step.recomputed_steps, self.LENGTH)
    self.assertLess(per_step.temporaries, plain.temporaries)
    self.assertEqual(
      hkb.remat_plan(step, h, xs, max_recompute=1, memory_budget=per_step.temporaries).choice,
      per_step,
    )


def _hand_plan() -> hkb.RematPlan:
  """A plan of 8 steps made by hand: remat=False over the budget, a policy chosen, two schedules (one over max_recompute)."""
  c = hkb.RematCandidate
  chosen = c(True, None, None, 3 << 20, 8, 160_000_000, "dots_saveable", 3 << 20)
  return hkb.RematPlan(
    8,
    3 << 20,
    (
      c(False, None, None, 4 << 20, 0, 0, None, 4 << 20),
      chosen,
      c("binomial", 4, None, 2 << 20, 20, 400_000_000, None, 5 << 19),
      c("binomial", 1, None, 1 << 19, 36, 800_000_000),
    ),
    chosen,
  )


def _matplotlib_missing() -> str:
  """Why the plot cannot be drawn here ('' where matplotlib imports)."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top,unused-import  # noqa: F401
  except ImportError as e:
    return f"matplotlib is not installed ({e})"
  return ""


class PlotTest(absltest.TestCase):
  """`RematPlan.plot`: the trade-off drawn where matplotlib is installed, an install hint where not."""

  def test_without_matplotlib_the_error_says_how_to_install_it(self):
    hidden = {"matplotlib": None, "matplotlib.pyplot": None}  # None: import fails.
    with mock.patch.dict(sys.modules, hidden):
      with self.assertRaisesRegex(
        ImportError, r"^hkb\.RematPlan\.plot: needs matplotlib.*pip install matplotlib"
      ):
        _hand_plan().plot()

  def test_draws_memory_against_recomputed_flops_the_budget_and_the_choice(self):
    missing = _matplotlib_missing()
    if missing:
      self.skipTest(missing)
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    plan = _hand_plan()
    _, given = plt.subplots()
    ax = plan.plot(given)
    self.assertIs(ax, given)
    series = {c.get_label(): c.get_offsets().tolist() for c in ax.collections}
    mib = 2**20
    # Predicted bytes for every plan, grey over max_recompute (36 > 3 * 8).
    self.assertEqual(series["predicted"], [[0, 4], [0.16, 3], [0.4, 2.5]])
    self.assertEqual(series["predicted, over max_recompute=3"], [[0.8, 0.5]])
    # The compiled bytes where known: the schedule of 4 slots compiled to 2 MiB.
    self.assertEqual(series["compiled"], [[0, 4], [0.16, 3], [0.4, 2]])
    chosen = 'chosen: remat=True, remat_policy=dots_saveable'
    self.assertEqual(series[chosen], [[0.16, 3]])
    (budget,) = [line for line in ax.get_lines() if line.get_label() == "memory_budget"]
    self.assertEqual(list(budget.get_ydata()), [plan.memory_budget / mib] * 2)
    self.assertEqual(ax.get_xscale(), "symlog")
    plt.close("all")


if __name__ == "__main__":
  absltest.main()
