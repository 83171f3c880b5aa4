"""`hkb.budgeted_jit` against the same steps written with remat=False / True, compiled as users jit them."""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import contextlib
import functools
import json
import logging
import math
import os
import re
import shutil
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import equinox as eqx
from flax import nnx
import haiku as hk
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import haiku_bridge as hkb
from haiku_bridge._src import caches
from haiku_bridge._src.remat import measure
from haiku_bridge._src.remat import plan as remat_plan
from haiku_bridge._src.remat import step_budget
from haiku_bridge._src.remat import step_compiles
from haiku_bridge._src.remat import step_search
from testing import plan_fixtures
from testing import test_utils

T, B, W = 24, 4, 16  # Steps, batch, width: small, so that each compile is.
LAYERS = 19  # The layer stack that escaped a per-loop budget 9x.
KEY = jax.random.PRNGKey(0)
# Whether the search's tries compile with XLA's cheaper code generation
# (the CPU), then the choice once more as it runs.
MEASURING = bool(measure.measuring_options())
# On a host that drafts (a TPU's), remat=True compiles beside plain: where
# plain fits, a compile more, unused, or none where plain's ended before it
# began (it is cancelled then: step_compiles_test).
BESIDE = measure.draft_options() is not None
FORMS = (
  "scan",
  "dynamic_unroll",
  "repeat_layer",
  "two_loops",
  "three_loops",
  "vmap_ensemble",
  "grad_accumulation",
  "jacrev",
  "loss_of_the_carry",
  "equinox_cell",
  "nnx_linear",
)
# What escapes a loop's own budget (docs/remat.md, each a known gap of
# plan_test's but the first), held to the step's by the grid's first test.
ESCAPING = (
  "vmap_ensemble_stack",
  "mask_before_loop",
  "auto_axes",
  "loop_in_a_jax_scan",
  "per_example_vmap",
  "batch_major_jvp",
)
DEVICES = 8  # The auto_axes form's batch, split over them.


def _identity_getter(next_getter, value, context):
  del context
  return next_getter(value)


def _net(form: str, remat, getter: bool = False):
  """A Haiku loss whose loops (each `remat`) are what the step budget plans."""

  def scan(h, xs, name):
    linear = hk.Linear(W, name=name)
    core = lambda h, x: (jnp.tanh(linear(h) + x),) * 2
    return hkb.scan(core, h, xs, remat=remat)

  def body(xs):
    h = jnp.zeros([B, W])
    if form == "loss_of_the_carry":
      # ys the step neither reads nor differentiates, a loss linear in the
      # final carry.
      linear = hk.Linear(W, name="core")

      def core(h, x):
        h = jnp.tanh(linear(h) + x)
        return h, 2 * jnp.sin(h)

      h, _ = hkb.scan(core, h, xs, remat=remat)
      return jnp.sum(h)
    if form == "mask_before_loop":
      # A causal mask of the tokens the data marks, computed by the step
      # before the stack, each layer mixing the tokens under it.
      tokens = jnp.swapaxes(xs, 0, 1)  # [B, T, W]
      mask = jnp.tril(jnp.ones([T, T])) * (tokens[:, None, :, 0] > -2)
      mix = lambda h: h + jnp.tanh(hk.Linear(W)(jnp.einsum("bst,btw->bsw", mask, h) / T))
      ys = hkb.repeat_layer(mix, tokens, 6, remat=remat)
      return jnp.sum(ys**2)
    if form == "auto_axes":  # The batch as the devices split it.
      h = jnp.zeros([DEVICES * B, W])
    if form == "equinox_cell":  # An Equinox GRUCell, one example at a time.
      cell = hk.vmap(hkb.from_equinox(lambda key: eqx.nn.GRUCell(W, W, key=key)), split_rng=False)
      ys = hkb.scan(lambda h, x: (cell(x, h),) * 2, h, xs, remat=remat)[1]
      return jnp.sum(ys**2)
    if form == "nnx_linear":  # A Flax NNX Linear in each step.
      linear = hkb.from_flax(functools.partial(nnx.Linear, W, W), name="proj")
      ys = hkb.scan(lambda h, x: (jnp.tanh(linear(h) + x),) * 2, h, xs, remat=remat)[1]
      return jnp.sum(ys**2)
    if form == "dynamic_unroll":
      ys, _ = hkb.dynamic_unroll(hk.VanillaRNN(W), xs, h, remat=remat)
    elif form == "batch_major_jvp":
      batch_major = jnp.swapaxes(xs, 0, 1)
      ys, _ = hkb.dynamic_unroll(hk.VanillaRNN(W), batch_major, h, time_major=False, remat=remat)
    elif form in ("repeat_layer", "vmap_ensemble_stack"):
      ys = hkb.repeat_layer(lambda h: jnp.tanh(hk.Linear(W)(h)), xs[0], LAYERS, remat=remat)
    else:
      loops = {"two_loops": 2, "three_loops": 3}.get(form, 1)
      for i in range(loops):
        h, ys = scan(h, xs, f"core_{i}")
        xs = ys
    return jnp.sum(ys**2)

  def net(xs):
    with hk.custom_getter(_identity_getter) if getter else contextlib.nullcontext():
      return body(xs)

  return hk.without_apply_rng(hk.transform(net))


def _step(form: str, remat, getter: bool = False):
  """`(step, args)`: the gradient step of `form`, its loops run as `remat`."""
  f = _net(form, remat, getter)
  batch = DEVICES * B if form == "auto_axes" else B
  xs = jax.random.normal(jax.random.PRNGKey(1), [T, batch, W])
  params = f.init(KEY, xs)
  per_example = lambda params, xs: jax.vmap(lambda x: f.apply(params, x[:, None]), in_axes=1)(xs)
  if form in ("vmap_ensemble", "vmap_ensemble_stack"):
    # Three members' params, the data shared: a loop sees one member's.
    params = jax.vmap(lambda k: f.init(k, xs))(jax.random.split(KEY, 3))
    return jax.vmap(jax.grad(f.apply), in_axes=(0, None)), (params, xs)
  if form == "auto_axes":
    # Data parallelism over Auto axes: jit follows the batch's sharding,
    # which the loop's values do not hold.
    mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    xs = jax.device_put(xs, NamedSharding(mesh, P(None, "data")))
    return jax.grad(f.apply), (jax.device_put(params, NamedSharding(mesh, P())), xs)
  if form == "loop_in_a_jax_scan":  # The gradient around a JAX loop of the loop.

    def sequences(params, xs):
      outer = lambda total, seq: (total + f.apply(params, seq), None)
      return jax.lax.scan(outer, 0.0, xs.reshape(2, T // 2, B, W))[0]

    return jax.grad(sequences), (params, xs)
  if form == "per_example_vmap":  # A loss per example, taken inside the vmap.
    return jax.grad(lambda params, xs: jnp.sum(per_example(params, xs))), (params, xs)
  if form == "batch_major_jvp":  # Forward mode alone: no backward pass.
    return (
      lambda params, xs: jax.jvp(
        lambda p: f.apply(p, xs), (params,), (jax.tree.map(jnp.ones_like, params),)
      )
    ), (params, xs)
  if form == "grad_accumulation":  # The loop inside a JAX loop.

    def accumulated(params, xs):
      def add(i, total):
        g = jax.grad(f.apply)(params, xs * (i + 1.0))
        return jax.tree.map(jnp.add, total, g)

      zeros = jax.tree.map(jnp.zeros_like, params)
      return jax.lax.fori_loop(0, 2, add, zeros)

    return accumulated, (params, xs)
  if form == "jacrev":  # One loss per example, each differentiated.
    return jax.jacrev(per_example), (params, xs)
  return jax.grad(f.apply), (params, xs)


def _bytes(step, *args) -> int:
  """`step_bytes` of `jax.jit(step)(*args)` as a user compiles it."""
  compiled = jax.jit(step).lower(*args).compile()
  return step_compiles.step_bytes(compiled.memory_analysis(), jax.default_backend())


def _compiled_bytes(budgeted, *args) -> int:
  """`step_bytes` of the budgeted step's own lowering, compiled apart from its plan."""
  compiled = budgeted.lower(*args).compile()
  return step_compiles.step_bytes(compiled.memory_analysis(), jax.default_backend())


@contextlib.contextmanager
def counted_compiles():
  """The compiles `budgeted_jit`'s search makes while the block runs."""
  made = []
  real = step_compiles.xla_compile

  def counted(lowered, options):
    made.append(lowered)
    return real(lowered, options)

  with mock.patch.object(step_compiles, "xla_compile", counted):
    yield made
    step_compiles.unused_compiles_ended()  # Those a search left unused counted too.


@contextlib.contextmanager
def lowerings():
  """The rungs `budgeted_jit` lowers the step at while the block runs, in order (`Rung.describe`)."""
  made = []
  real = step_budget.BudgetedStep._lowered

  def recorded(self, search, rung, *args, **kwargs):
    made.append(rung.describe())
    return real(self, search, rung, *args, **kwargs)

  with mock.patch.object(step_budget.BudgetedStep, "_lowered", recorded):
    yield made


class _CacheDirectory(parameterized.TestCase):
  """Each test with its own (empty) directory of plans on disk."""

  def setUp(self):
    super().setUp()
    directory = self.create_tempdir().full_path
    patch = mock.patch.dict(os.environ, {"HAIKU_BRIDGE_CACHE_DIR": directory})
    patch.start()
    self.addCleanup(patch.stop)
    self.directory = directory


class BudgetTest(_CacheDirectory):
  def assert_values(self, ours, theirs):
    # Each entry within rounding of its leaf's largest: a gradient summed
    # over examples (per_example_vmap) cancels to entries far below it.
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(
        a, b, rtol=2e-5, atol=2e-6 * max(1.0, float(np.max(np.abs(b))))
      ),
      ours,
      theirs,
    )

  @parameterized.parameters(*FORMS, *ESCAPING)
  def test_the_step_takes_the_least_recomputation_that_fits(self, form):
    if form == "auto_axes" and jax.device_count() < DEVICES:
      self.skipTest(f"needs {DEVICES} devices, jax has {jax.device_count()}.")
    plain, args = _step(form, False)
    remat, _ = _step(form, True)
    auto, _ = _step(form, "auto")
    plain_bytes, true_bytes = _bytes(plain, *args), _bytes(remat, *args)
    # Forward mode alone keeps nothing for a backward pass: remat=True
    # saves nothing there, and every other form saves.
    self.assertEqual(true_bytes < plain_bytes, form != "batch_major_jvp")
    reference = jax.jit(plain)(*args)
    # At no budget below it can the step be planned: the refusal names
    # the least, which the call then accepts, and offers more
    # recomputation only where that holds less.
    with self.assertRaisesRegex(ValueError, r"Pass memory_budget=([0-9,]+)") as refused:
      hkb.budgeted_jit(auto, memory_budget=1)(*args)
    message = str(refused.exception)
    least = int(re.search(r"Pass memory_budget=([0-9,]+)", message)[1].replace(",", ""))
    self.assertEqual(
      "allow more recomputation" in message, "With max_recompute=math.inf" in message, message
    )
    self.assertEqual(
      "no remat plan of its loops holds less" in message, least == plain_bytes, message
    )
    cases = [(plain_bytes, False)]
    if true_bytes < plain_bytes:
      cases += [(plain_bytes - 1, True), (true_bytes, True)]
    if least < true_bytes:
      cases += [((least + true_bytes) // 2, None), (least, None)]
    else:
      # No schedule holds less than remat=True (jax.jacrev on jax 0.12,
      # forward mode alone): the refusal names remat=True's bytes, the
      # least any plan holds.
      self.assertEqual(least, true_bytes)
    for budget, want in cases:
      step = hkb.budgeted_jit(auto, memory_budget=budget)
      with self.subTest(budget=budget):
        self.assert_values(step(*args), reference)
        plan = step.plan(*args)
        self.assertLessEqual(plan.bytes, budget)
        # The step as it runs, compiled apart: the plan's own figure.
        self.assertEqual(_compiled_bytes(step, *args), plan.bytes)
        self.assertTrue(plan.loops)
        if want is None:
          self.assertTrue(all(loop.remat == "binomial" for loop in plan.loops))
        else:
          self.assertEqual({loop.remat for loop in plan.loops}, {want})
          # Exactly the step a user writes with that remat.
          self.assertEqual(plan.bytes, plain_bytes if want is False else true_bytes)

  @parameterized.parameters(*FORMS)
  def test_an_identity_getter_changes_no_plan(self, form):
    plain, args = _step(form, False)
    budget = _bytes(_step(form, True)[0], *args) - 1  # A schedule, if any fits.
    try:
      hkb.budgeted_jit(_step(form, "auto")[0], memory_budget=budget)(*args)
    except ValueError:  # None holds less than remat=True (jacrev, jax 0.12).
      budget += 1
    plans, values = [], []
    for getter in (False, True):
      auto, getter_args = _step(form, "auto", getter)
      jax.tree.map(np.testing.assert_array_equal, getter_args, args)
      step = hkb.budgeted_jit(auto, memory_budget=budget)
      values.append(step(*args))
      plans.append(step.plan(*args))
    self.assertEqual(plans[0].loops, plans[1].loops)
    self.assertEqual(plans[0].bytes, plans[1].bytes)
    self.assert_values(values[1], values[0])
    self.assert_values(values[0], jax.jit(plain)(*args))


class DraftGridTest(parameterized.TestCase):
  # Drafts (a TPU's: `measure.draft_options`, forced here with XLA's least
  # effort) only aim: the forms whose carries the line counts apart (two
  # loops, a vmapped ensemble's, a jacobian's per-example rows) take the
  # plan the search takes without them.
  @parameterized.parameters("two_loops", "vmap_ensemble", "jacrev")
  def test_drafts_change_no_plan(self, form):
    auto, args = _step(form, "auto")
    budget = _bytes(_step(form, True)[0], *args) - 1  # A schedule, where any fits.
    plans = []
    for options in (None, {"optimization_level": 9}):
      # Each a search: no plan on disk (drafts are not in its key: they only aim).
      with (
        mock.patch.object(measure, "draft_options", lambda: options),
        mock.patch.dict(os.environ, {"HAIKU_BRIDGE_CACHE_DIR": ""}),
      ):
        try:
          plans.append(hkb.budgeted_jit(auto, memory_budget=budget).plan(*args))
        except ValueError as refused:  # None holds less than remat=True (jacrev, jax 0.12).
          plans.append(str(refused))
    if isinstance(plans[0], str):
      self.assertEqual(plans[1], plans[0])
      return
    self.assertEqual((plans[1].loops, plans[1].bytes), (plans[0].loops, plans[0].bytes))
    self.assertEqual([t for t in plans[0].tries if t.draft], [])
    self.assertLen([t for t in plans[1].tries if t.draft], 3)


class SearchTest(_CacheDirectory):
  def test_compiles_made_and_kept(self):
    plain, args = _step("scan", False)
    auto, _ = _step("scan", "auto")
    wider = (args[0], jnp.concatenate([args[1]] * 2, axis=0))
    plain_bytes = _bytes(plain, *wider)
    # Plain fits: its compile (as it runs) is the one that runs.
    step = hkb.budgeted_jit(auto, memory_budget=plain_bytes)
    with counted_compiles() as made:
      step(*args)
      step(*args)
      step.plan(*args)
      step.lower(*args)
    self.assertBetween(len(made), 1 + MEASURING, 1 + MEASURING + BESIDE)
    self.assertEqual(
      [(t.rung, t.measuring) for t in step.plan(*args).tries],
      [("remat=False", True)] * MEASURING + [("remat=False", False)],
    )
    # Another signature is planned anew.
    with counted_compiles() as made:
      step(*wider)
    self.assertBetween(len(made), 1 + MEASURING, 1 + MEASURING + BESIDE)
    self.assertEqual(step.plan(*wider).loops[0].length, 2 * T)

  def test_a_typed_key_in_the_carry(self):
    # Its bytes are its key data's (np.dtype of a key type raised before).
    def loss(w, xs, remat="auto"):
      def step(carry, x):
        key, h = carry
        key, sub = jax.random.split(key)
        h = jnp.tanh(h @ w + x + 0.01 * jax.random.normal(sub, h.shape))
        return (key, h), h

      return jnp.sum(
        hkb.scan(step, (jax.random.key(0), jnp.zeros([B, W])), xs, remat=remat)[1] ** 2
      )

    w, xs = jnp.eye(W) * 0.5, jnp.ones([T, B, W])
    step = hkb.budgeted_jit(jax.grad(loss), memory_budget=10**9)
    np.testing.assert_allclose(
      step(w, xs), jax.jit(jax.grad(functools.partial(loss, remat=False)))(w, xs), rtol=1e-6
    )
    self.assertEqual(step.plan(w, xs).loops, (step_search.StepLoop(T, False),))

  def test_a_mesh_or_a_setting_jit_traces_under_is_planned_apart(self):
    auto, args = _step("scan", "auto")
    step = hkb.budgeted_jit(auto, memory_budget=10**9)
    with counted_compiles() as made:
      step(*args)
      # A precision other than the one set (JAX_DEFAULT_MATMUL_PRECISION may be).
      other = "default" if jax.config.jax_default_matmul_precision == "highest" else "highest"
      with jax.default_matmul_precision(other):
        step(*args)
      with jax.set_mesh(jax.make_mesh((1,), ("data",))):
        step(*args)
    self.assertBetween(len(made), 3 * (1 + MEASURING), 3 * (1 + MEASURING + BESIDE))

  def test_a_compile_out_of_device_memory_is_a_plan_over_the_budget(self):
    plain, args = _step("scan", False)
    auto, _ = _step("scan", "auto")
    plain_bytes = _bytes(plain, *args)
    true_bytes = _bytes(_step("scan", True)[0], *args)
    device = (plain_bytes + true_bytes) // 2  # remat=False does not fit.
    real = step_compiles.xla_compile

    def on_the_device(lowered, options):
      compiled = real(lowered, options)
      if step_compiles.step_bytes(compiled.memory_analysis(), jax.default_backend()) > device:
        raise jax.errors.JaxRuntimeError(
          "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of "
          "memory in memory space hbm."
        )
      return compiled

    with (
      mock.patch.object(step_compiles, "xla_compile", on_the_device),
      mock.patch.object(step_compiles, "device_memory", lambda: 10**9),
    ):
      step = hkb.budgeted_jit(auto)  # The device's memory.
      step(*args)
      plan = step.plan(*args)
      self.assertEqual(plan.memory_budget, 10**9)
      self.assertEqual(
        [(t.rung, t.bytes, t.measuring) for t in plan.tries],
        [("remat=False", None, MEASURING), ("remat=True", true_bytes, MEASURING)]
        + [("remat=True", true_bytes, False)] * MEASURING,
      )
      self.assertEqual({loop.remat for loop in plan.loops}, {True})
      # Nothing fits the device: refused, in its words.
      with mock.patch.object(step_compiles, "device_memory", lambda: 1000):
        device = 1000
        with self.assertRaisesRegex(
          ValueError,
          r"hkb.budgeted_jit: the step does not fit "
          r"memory_budget=1,000 bytes \(the device's memory\): it runs out "
          r"of device memory compiling \(RESOURCE_EXHAUSTED\) even at its "
          r"least, with every remat=\"auto\" loop at remat=\"binomial\"",
        ):
          hkb.budgeted_jit(auto)(*args)

  def test_another_compile_error_is_raised(self):
    auto, args = _step("scan", "auto")

    def broken(lowered, options):
      del lowered, options
      raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    with (
      mock.patch.object(step_compiles, "xla_compile", broken),
      self.assertRaisesRegex(jax.errors.JaxRuntimeError, "INTERNAL"),
    ):
      hkb.budgeted_jit(auto, memory_budget=10**9)(*args)

  def test_the_cpu_has_no_default_budget(self):
    auto, args = _step("scan", "auto")
    if step_compiles.device_memory() is not None:
      self.skipTest("the backend reports its memory")
    with self.assertRaisesRegex(
      ValueError, "hkb.budgeted_jit: the cpu backend does not say how much memory its device has"
    ):
      hkb.budgeted_jit(auto)(*args)

  @plan_fixtures.on_cpu_and_gpu(plan_fixtures.CPU_SIZED)
  def test_max_recompute_bounds_the_plans(self):
    auto, args = _step("scan", "auto")
    true_bytes = _bytes(_step("scan", True)[0], *args)
    # remat=True recomputes one pass: no schedule within it.
    with self.assertRaisesRegex(
      ValueError,
      f"at its least .*at remat=True. Pass "
      f"memory_budget={true_bytes:,} or more, or allow more recomputation "
      r"\(max_recompute=, now 1\)",
    ):
      hkb.budgeted_jit(auto, memory_budget=true_bytes - 1, max_recompute=1)(*args)
    # The refusal says what no bound would take, and that bound takes it.
    try:
      hkb.budgeted_jit(auto, memory_budget=1)(*args)
    except ValueError as error:
      message = str(error)
    self.assertRegex(
      message,
      r"Pass memory_budget=[0-9,]+ or more, or allow "
      r"more recomputation \(max_recompute=, now 3\).* With "
      r"max_recompute=math.inf, at its least \(remat=\"binomial"
      r"\", at most [0-9.]+ forward passes recomputed\), it "
      r"holds ([0-9,]+) bytes.$",
    )
    unbounded = int(re.search(r"it holds ([0-9,]+) bytes.$", message)[1].replace(",", ""))
    least = int(re.search(r"Pass memory_budget=([0-9,]+)", message)[1].replace(",", ""))
    self.assertLess(unbounded, least)
    plan = hkb.budgeted_jit(auto, memory_budget=unbounded, max_recompute=math.inf).plan(*args)
    self.assertEqual(plan.bytes, unbounded)
    self.assertEqual(plan.loops[0].slots, 1)

    # A loop's own max_recompute bounds that loop further.
    def net(xs):
      linear = hk.Linear(W)
      return jnp.sum(
        hkb.scan(
          lambda h, x: (jnp.tanh(linear(h) + x),) * 2,
          jnp.zeros([B, W]),
          xs,
          remat="auto",
          max_recompute=1,
        )[1]
        ** 2
      )

    own = hk.without_apply_rng(hk.transform(net))
    with self.assertRaisesRegex(ValueError, "at its least"):
      hkb.budgeted_jit(jax.grad(own.apply), memory_budget=true_bytes - 1)(
        own.init(KEY, args[1]), args[1]
      )

  def test_a_step_with_no_loop_to_plan(self):
    f = hk.without_apply_rng(hk.transform(lambda x: jnp.sum(jnp.tanh(hk.Linear(W)(x)) ** 2)))
    x = jnp.ones([B, W])
    params = f.init(KEY, x)
    step = jax.grad(f.apply)
    need = _bytes(step, params, x)
    budgeted = hkb.budgeted_jit(step, memory_budget=need)
    self.assert_trees(budgeted(params, x), jax.jit(step)(params, x))
    self.assertEqual(budgeted.plan(params, x).loops, ())
    self.assertEqual(budgeted.plan(params, x).bytes, need)
    with self.assertRaisesRegex(
      ValueError,
      f"the step does not fit memory_budget={need - 1:,} bytes:"
      f" it holds {need:,} bytes at its least .* it runs no loop with "
      "remat=\"auto\"",
    ):
      hkb.budgeted_jit(step, memory_budget=need - 1)(params, x)

  def assert_trees(self, ours, theirs):
    jax.tree.map(np.testing.assert_allclose, ours, theirs)

  def test_a_loop_with_its_own_budget_plans_itself_inside(self):
    f = hk.without_apply_rng(
      hk.transform(
        lambda xs: jnp.sum(
          hkb.scan(
            lambda h, x: (jnp.tanh(h + x),) * 2,
            jnp.zeros([B, W]),
            xs,
            remat="auto",
            memory_budget=10**9,
          )[1]
          ** 2
        )
      )
    )
    xs = jnp.ones([T, B, W])
    step = hkb.budgeted_jit(jax.grad(lambda xs: f.apply({}, xs)), memory_budget=10**9)
    step(xs)
    self.assertEqual(step.plan(xs).loops, ())  # Not the step's to plan.
    self.assertLessEqual(step.plan(xs).bytes, 10**9)

  def test_donated_and_static_arguments_as_jax_jit_takes_them(self):
    auto, (params, xs) = _step("scan", "auto")
    plain, _ = _step("scan", False)

    def sgd(params, xs, scale):
      return jax.tree.map(lambda p, g: p - scale * g, params, auto(params, xs))

    kept = hkb.budgeted_jit(sgd, memory_budget=10**9, static_argnums=2)
    donated = hkb.budgeted_jit(sgd, memory_budget=10**9, donate_argnums=0, static_argnames="scale")
    want = jax.tree.map(lambda p, g: p - 0.5 * g, params, jax.jit(plain)(params, xs))
    self.assert_trees(kept(params, xs, 0.5), want)
    copy = jax.tree.map(jnp.copy, params)
    self.assert_trees(donated(copy, xs, scale=0.5), want)
    # Each the step a user jits with those options (on the CPU, XLA keeps
    # a donated buffer's update in a temporary: no fewer bytes).
    for step, call, options in (
      (kept, ((params, xs, 0.5), {}), {"static_argnums": 2}),
      (donated, ((params, xs), {"scale": 0.5}), {"donate_argnums": 0, "static_argnames": "scale"}),
    ):
      plain_sgd = functools.partial(_sgd_of, plain)
      compiled = jax.jit(plain_sgd, **options).lower(*call[0], **call[1]).compile()
      self.assertEqual(
        step.plan(*call[0], **call[1]).bytes,
        step_compiles.step_bytes(compiled.memory_analysis(), jax.default_backend()),
      )
      self.assertEqual(
        step.lower(*call[0], **call[1]).compile().memory_analysis().alias_size_in_bytes,
        compiled.memory_analysis().alias_size_in_bytes,
      )
    self.assertGreater(
      donated.lower(params, xs, scale=0.5).compile().memory_analysis().alias_size_in_bytes, 0
    )

  def test_a_remat_policy_is_a_rung_between(self):
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

    def net(remat, **policy_option):
      return hk.without_apply_rng(
        hk.transform(
          lambda xs: jnp.sum(
            hkb.scan(_PolicyCore(), jnp.zeros([B, W]), xs, remat=remat, **policy_option)[1] ** 2
          )
        )
      )

    xs = jax.random.normal(jax.random.PRNGKey(1), [T, B, W])
    params = net(False).init(KEY, xs)
    sizes = {
      name: _bytes(jax.grad(net(remat, **options).apply), params, xs)
      for name, remat, options in (
        ("plain", False, {}),
        ("policy", True, {"remat_policy": policy}),
        ("true", True, {}),
      )
    }
    self.assertLess(sizes["true"], sizes["policy"])
    self.assertLess(sizes["policy"], sizes["plain"])
    step = hkb.budgeted_jit(
      jax.grad(net("auto", remat_policy=policy).apply), memory_budget=sizes["policy"]
    )
    plan = step.plan(params, xs)
    self.assertEqual(plan.loops, (step_search.StepLoop(T, True, policy=True),))
    self.assertEqual(plan.bytes, sizes["policy"])


def _sgd_of(grad, params, xs, scale):
  return jax.tree.map(lambda p, g: p - scale * g, params, grad(params, xs))


class LadderTest(_CacheDirectory):
  # Drafts on one form: their plumbing is the same for every form.
  @parameterized.parameters(("scan", False), ("two_loops", False), ("scan", True))
  def test_the_search_finds_the_first_plan_that_fits(self, form, drafts):
    # Every rung compiled, against the search's few compiles; with drafts
    # (as on a TPU: `measure.draft_options`), XLA's least effort.
    options = {"optimization_level": 9} if drafts else None
    patch = mock.patch.object(measure, "draft_options", lambda: options)
    patch.start()
    self.addCleanup(patch.stop)
    auto, args = _step(form, "auto")
    every = step_budget.BudgetedStep(auto, None, 3.0, {})
    trace = step_budget._Trace(step_search.Rung(step_search.REMAT))
    every._lowered(-1, trace.rung, args, {}, trace)
    ladder = step_search.ladder(trace.loops, 3.0)
    sizes = [every._compiled(-1, rung, args, {}).bytes for rung in ladder]
    self.assertGreater(len(ladder), 8)
    for budget in sorted(set(sizes))[::3]:
      first = next(i for i, b in enumerate(sizes) if b <= budget)
      want = tuple(
        step_search.plan_at(ladder[first], loop.length, loop.policy, loop.max_recompute)
        for loop in trace.loops
      )
      traces = []
      traced = lambda *a: traces.append(1) or auto(*a)
      with self.subTest(budget=budget), counted_compiles() as made:
        plan = hkb.budgeted_jit(traced, memory_budget=budget).plan(*args)
        self.assertEqual(plan.loops, want)
        self.assertEqual(plan.bytes, sizes[first])
        drafted = [t for t in plan.tries if t.draft]
        if not drafts:
          # Plain, remat=True, the least rung and the one the schedules'
          # line aims at (a slot, a carry): each traced and compiled once,
          # and the choice compiled as it runs.
          self.assertEqual(drafted, [])
          self.assertLessEqual(len(traces), 4)
          self.assertLessEqual(len(made), 4 + MEASURING)
          if 1 < first < len(ladder) - 1:  # An aim: compiled as it runs, once.
            chosen = [t for t in plan.tries if t.rung == ladder[first].describe()]
            self.assertEqual([t.measuring for t in chosen], [False])
        elif plan.loops[0].remat == "binomial":
          # Three drafts, then the rung before their aim (and the line's).
          self.assertLen(drafted, 3)
          self.assertIn(", draft)", str(plan))
          self.assertLessEqual(len(traces), 8)
          self.assertLessEqual(len(made), 8 + MEASURING)
    # A step jitted with options of its own is compiled with those alone.
    self.assertIsNone(
      step_budget.BudgetedStep(auto, None, 3.0, {"compiler_options": {}})._drafting()
    )


class MeshTest(_CacheDirectory):
  def test_a_data_parallel_step_on_the_default_mesh(self):
    # jax.make_mesh's default axis types (Explicit on jax 0.10), the batch
    # split over 8 devices, params as init returns them: the budget and the
    # figures are one device's, those of the step a user jits there.
    if jax.device_count() < 8:
      self.skipTest(f"needs 8 devices, jax has {jax.device_count()}.")
    mesh = jax.make_mesh((8,), ("data",))

    def net(remat):
      def loss(xs):
        linear = hk.Linear(W)
        core = lambda h, x: (jnp.tanh(linear(h) + x),) * 2
        h = jnp.zeros_like(xs[0])  # Sharded as a step of xs is.
        return jnp.sum(hkb.scan(core, h, xs, remat=remat)[1] ** 2)

      return hk.without_apply_rng(hk.transform(loss))

    xs = jax.random.normal(jax.random.PRNGKey(1), [T, 8 * B, W])
    params = net(False).init(KEY, xs)
    with jax.set_mesh(mesh):
      xs = jax.device_put(xs, P(None, "data"))
      sizes = {remat: _bytes(jax.grad(net(remat).apply), params, xs) for remat in (False, True)}
      step = hkb.budgeted_jit(jax.grad(net("auto").apply), memory_budget=sizes[True])
      grads = step(params, xs)
      plan = step.plan(params, xs)
      reference = jax.jit(jax.grad(net(False).apply))(params, xs)
    self.assertEqual(plan.loops, (step_search.StepLoop(T, True),))
    self.assertEqual(plan.bytes, sizes[True])
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), grads, reference
    )
    # One device's bytes: less than the unsharded step's.
    self.assertLess(sizes[True], _bytes(jax.grad(net(True).apply), params, jax.device_get(xs)))


class StepBytesTest(absltest.TestCase):
  def test_each_buffer_once(self):
    auto, (params, xs) = _step("scan", "auto")
    step = hkb.budgeted_jit(
      lambda params, xs: jax.tree.map(lambda p, g: p - g, params, auto(params, xs)),
      memory_budget=10**9,
      donate_argnums=0,
    )
    analysis = step.lower(params, xs).compile().memory_analysis()
    self.assertGreater(analysis.alias_size_in_bytes, 0)
    each_once = (
      analysis.argument_size_in_bytes
      + analysis.output_size_in_bytes
      - analysis.alias_size_in_bytes
      + analysis.temp_size_in_bytes
      + analysis.generated_code_size_in_bytes
    )
    if jax.default_backend() == "tpu":  # Its peak: the buffers live at once, each once (below).
      each_once = max(
        each_once, analysis.peak_memory_in_bytes + analysis.generated_code_size_in_bytes
      )
    self.assertEqual(step.plan(params, xs).bytes, each_once)


class _PolicyCore(hk.Module):
  """A step whose matrix product a policy can keep: tanh(h @ w + x)."""

  def __call__(self, h, x):
    w = hk.get_parameter("w", [W, 4 * W], init=hk.initializers.RandomNormal(0.3))
    v = hk.get_parameter("v", [4 * W, W], init=hk.initializers.RandomNormal(0.3))
    h = jnp.tanh(jnp.sin(jnp.cos(h @ w)) @ v + x)
    return h, h


class OutsideTest(parameterized.TestCase):
  def test_an_unbudgeted_loop_runs_plain_and_refuses_a_gradient(self):
    auto, (params, xs) = _step("repeat_layer", "auto")
    f, plain = _net("repeat_layer", "auto"), _net("repeat_layer", False)
    self.assertEqual(jax.tree.map(jnp.shape, params), jax.tree.map(jnp.shape, plain.init(KEY, xs)))
    jax.tree.map(np.testing.assert_array_equal, params, plain.init(KEY, xs))
    # Inference computes what the plain loop does.
    np.testing.assert_allclose(jax.jit(f.apply)(params, xs), plain.apply(params, xs), rtol=1e-6)
    for differentiated in (auto, jax.grad(jax.jit(f.apply))):
      with self.assertRaisesRegex(
        ValueError,
        "hkb.repeat_layer: `remat=\"auto\"` needs "
        "`memory_budget=`.* or the training step jitted with "
        "hkb.budgeted_jit",
      ):
        differentiated(params, xs)


class ProgressTest(_CacheDirectory):
  """The lines that start and end a step's plan, as a loop's plan has them: INFO, the end at WARNING (shown by default) when slow."""

  def _search(self, budgeted, args):
    """`budgeted(*args)`'s lines on the `haiku_bridge.remat` logger at INFO and above."""
    with self.assertLogs("haiku_bridge.remat", "INFO") as logs:
      budgeted(*args)
    return logs.records

  def test_a_search_says_when_it_starts_and_when_it_ends(self):
    plain, args = _step("scan", False)
    auto, _ = _step("scan", "auto")
    budget = _bytes(plain, *args)  # Plain fits.
    with (
      mock.patch.object(remat_plan, "SLOW_PLAN_SECONDS", math.inf),
      mock.patch.object(caches, "_enabled", True),
    ):
      budgeted = hkb.budgeted_jit(auto, memory_budget=budget)
      records = self._search(budgeted, args)
      again = self._search(hkb.budgeted_jit(auto, memory_budget=budget), args)
    plan = budgeted.plan(*args)
    for lines, kept in ((records, ""), (again, ", the plan read from disk")):
      start, end = lines[0], lines[-1]
      self.assertEqual((start.levelno, end.levelno), (logging.INFO, logging.INFO))
      self.assertEqual(
        start.getMessage(),
        f"hkb.budgeted_jit: planning the step for memory_budget={budget} bytes (compiling it "
        'with its remat="auto" loops run a few ways)...',
      )
      self.assertRegex(
        end.getMessage(),
        r'^hkb\.budgeted_jit: planned the step in \d+\.\d s: chose remat=False for its 1 remat="auto" '
        f"loop, {plan.bytes} bytes for memory_budget={budget} bytes, "
        f"{len(plan.tries) if not kept else 1} compiles?{kept} "
        rf"\(step\.plan\(\*args\) lists each\)\. The plan is kept on disk \({re.escape(self.directory)}\)",
      )
    # Between them, each compile, then the plan.
    self.assertEqual(records[-2].getMessage(), f"hkb.budgeted_jit: {plan}")

  def test_a_slow_search_ends_at_warning_which_default_logging_shows(self):
    auto, args = _step("scan", "auto")
    with (
      mock.patch.object(remat_plan, "SLOW_PLAN_SECONDS", 0.0),
      caches.disabled(),
      self.assertLogs("haiku_bridge.remat", "WARNING") as logs,
    ):
      hkb.budgeted_jit(auto, memory_budget=1 << 30)(*args)
    (end,) = logs.records
    self.assertGreaterEqual(end.levelno, logging.lastResort.level)
    self.assertIn("hkb.budgeted_jit: planned the step in ", end.getMessage())
    self.assertIn("Nothing is kept on disk", end.getMessage())


class DiskTest(_CacheDirectory):
  def test_plans_persist_across_processes_and_a_bad_file_is_a_miss(self):
    env = {"HAIKU_BRIDGE_CACHE_DIR": self.directory, "HAIKU_BRIDGE_CACHES": "1"}
    # Budgets below remat=True's bytes, as each child's backend compiles it
    # (a child of a TPU's test process runs on the CPU: one process holds the chip).
    runs = []
    for getter, below in (("0", "1"), ("0", "1"), ("1", "1"), ("0", "2")):
      child = test_utils.run_in_fresh_process(__file__, "_print_plan", getter, below, env=env)
      self.assertEqual(child.returncode, 0, child.stderr[-3000:])
      runs.append(json.loads(child.stdout.strip().splitlines()[-1]))
    cold, warm, getter, other_budget = runs
    self.assertGreaterEqual(cold["compiles"], 3)
    self.assertEqual((len(cold["tries"]), cold["kept"]), (cold["compiles"], False))
    # The next process compiles the chosen step once, beside plain's
    # lowering (the last search's choice its hint); so with an identity
    # getter (the same program); another budget is planned anew.
    self.assertEqual((warm["compiles"], len(warm["tries"]), warm["kept"]), (1, 1, True))
    self.assertEqual((getter["compiles"], getter["kept"]), (1, True))
    self.assertEqual(warm["lowered"], [warm["tries"][0][0], "remat=False"])
    self.assertEqual(cold["lowered"][0], "remat=False")
    self.assertFalse(other_budget["kept"])
    for run in (warm, getter):
      self.assertEqual((run["loops"], run["bytes"]), (cold["loops"], cold["bytes"]))
    # A file of the right shape with a string for a number is a miss; one
    # naming a plan over the budget (remat=False) is checked compiled and
    # passed over.
    folder = os.path.join(self.directory, "step_budgets")
    for kept in ([3, "1", 2], [0, 0, 1]):
      for name in os.listdir(folder):
        with open(os.path.join(folder, name), "w") as f:
          json.dump(kept, f)
      child = test_utils.run_in_fresh_process(__file__, "_print_plan", "0", "1", env=env)
      self.assertEqual(child.returncode, 0, child.stderr[-3000:])
      again = json.loads(child.stdout.strip().splitlines()[-1])
      self.assertEqual(
        (again["loops"], again["bytes"], again["kept"]), (cold["loops"], cold["bytes"], False)
      )
    # Cleared with the other caches.
    with mock.patch.object(caches, "_enabled", True):
      hkb.clear_caches()
    self.assertEqual(os.listdir(self.directory), [])  # The plans and the hints.


class HintTest(_CacheDirectory):
  """The rung the last search chose, compiled beside plain's lowering (`step_budget._HINTS`): a guess that decides nothing."""

  def setUp(self):
    super().setUp()
    self.auto, self.args = _step("two_loops", "auto")
    self.budget = _bytes(_step("two_loops", True)[0], *self.args)

  def plan(self):
    """The plan of a new budgeted step, the compiles made and the rungs lowered."""
    with counted_compiles() as made, lowerings() as lowered:
      plan = hkb.budgeted_jit(self.auto, memory_budget=self.budget).plan(*self.args)
    return plan, len(made), lowered

  def hint(self, value) -> None:
    """The hint file's value, for the one hint this step's test has."""
    folder = os.path.join(self.directory, "step_budget_hints")
    (name,) = os.listdir(folder)
    with open(os.path.join(folder, name), "w") as f:
      json.dump(value, f)

  def test_a_hint_changes_no_plan_and_a_kept_plan_compiles_beside_plain(self):
    self.budget -= 1  # A schedule, its aims compiled as the step runs (on the CPU).
    try:
      cold, cold_compiles, cold_lowered = self.plan()
    except ValueError:  # remat=True the least (a TPU's at these sizes): its choice.
      self.budget += 1
      cold, cold_compiles, cold_lowered = self.plan()
    self.assertEqual(cold_lowered[0], "remat=False")
    plans = os.path.join(self.directory, "step_budgets")
    (name,) = os.listdir(os.path.join(self.directory, "step_budget_hints"))
    with open(os.path.join(self.directory, "step_budget_hints", name)) as f:
      chosen = json.load(f)
    choice = step_budget._from_disk(chosen).describe()
    self.assertEqual(choice, cold.tries[-1].rung)
    as_runs = {t.rung for t in cold.tries if not (t.measuring or t.draft)}
    self.assertIn(choice, as_runs)
    tried = lambda plan: [(t.rung, t.bytes, t.measuring, t.draft) for t in plan.tries]
    remat, plain = [step_search.REMAT, 0, 1], [step_search.PLAIN, 0, 1]
    hints = {"chosen": chosen, "remat=True": remat, "plain": plain, "off the ladder": [3, 1, 7]}
    hints.update({"a string": [3, "1", 2], "no kind": [9, 0, 1]})
    for label, value in hints.items():
      hinted = step_budget._from_disk(value)
      with self.subTest(label, kept=False):
        # No plan kept: the search runs as it would without the hint, and
        # takes the hinted compile where it asks for that rung as it runs.
        shutil.rmtree(plans)
        self.hint(value)
        searched, compiles, lowered = self.plan()
        self.assertEqual(tried(searched), tried(cold))
        self.assertEqual((searched.loops, searched.bytes), (cold.loops, cold.bytes))
        aside = hinted is not None and hinted.kind != step_search.PLAIN
        self.assertEqual(lowered[0], hinted.describe() if aside else "remat=False")
        if not BESIDE:  # Beside a TPU's, compiles left unused are counted by timing.
          spent = aside and hinted.describe() not in as_runs
          self.assertEqual(compiles, cold_compiles + spent)
      with self.subTest(label, kept=True):
        # The plan kept: compiled once (beside plain's lowering where the
        # hint names it), one more where the hint is another rung.
        self.hint(value)
        warm, compiles, lowered = self.plan()
        self.assertTrue(warm.kept)
        self.assertEqual((warm.loops, warm.bytes), (cold.loops, cold.bytes))
        if not aside:
          self.assertEqual(lowered, ["remat=False", choice])
        elif hinted.describe() == choice:
          self.assertEqual(lowered, [choice, "remat=False"])
        else:
          self.assertEqual(lowered, [hinted.describe(), "remat=False", choice])
        if not BESIDE:
          self.assertEqual(compiles, 1 + (aside and hinted.describe() != choice))


class DiskKeyTest(absltest.TestCase):
  def test_the_key_changes_with_everything_the_choice_depends_on(self):
    auto, args = _step("scan", "auto")
    lowered = jax.jit(_step("scan", False)[0]).lower(*args)
    step = lambda **options: step_budget.BudgetedStep(
      auto, 10**6, options.pop("max_recompute", 3.0), options
    )
    here = step()._disk_key(lowered, 10**6)
    self.assertEqual(step()._disk_key(lowered, 10**6), here)
    self.assertNotEqual(step()._disk_key(lowered, 10**6 + 1), here)
    self.assertNotEqual(step(max_recompute=4.0)._disk_key(lowered, 10**6), here)
    self.assertNotEqual(step(donate_argnums=0)._disk_key(lowered, 10**6), here)
    other = jax.jit(_step("scan", True)[0]).lower(*args)
    self.assertNotEqual(step()._disk_key(other, 10**6), here)
    for name, patch in test_utils.environment_patches() + [
      (
        "installed",
        mock.patch.object(step_budget.versions, "installed", lambda: {"dm-haiku": "0"}),
      ),
      ("code", mock.patch.object(step_budget, "_code_digest", lambda: "0" * 64)),
    ]:
      with self.subTest(name), patch:
        self.assertNotEqual(step()._disk_key(lowered, 10**6), here)

  def test_the_hint_key_reads_no_trace_and_never_fails_a_call(self):
    auto, args = _step("scan", "auto")
    hint = lambda step, args, budget=10**6: step_budget.BudgetedStep(
      step, budget, 3.0, {}
    )._hint_key(args, {}, budget)
    here = hint(auto, args)
    self.assertEqual(hint(auto, args), here)
    self.assertNotEqual(hint(auto, args, 10**6 + 1), here)
    self.assertNotEqual(hint(auto, (args[0], jnp.concatenate([args[1]] * 2))), here)
    self.assertNotEqual(hint(lambda params, xs: auto(params, xs), args), here)

    class Unprintable:  # A static argument jit hashes, whose repr fails.
      def __repr__(self):
        raise RuntimeError("no repr")

    with self.assertLogs("haiku_bridge.remat", "DEBUG") as logs:
      budgeted = hkb.budgeted_jit(lambda p, x, s: auto(p, x), memory_budget=10**9, static_argnums=2)
      self.assertEqual(budgeted.plan(*args, Unprintable()).loops[0].remat, False)
    self.assertIn("no hint for this step: no repr", "\n".join(logs.output))

  def test_the_code_digest_reads_every_module_that_chooses(self):
    self.assertEqual(
      {m.__name__.rsplit(".", 1)[1] for m in step_budget._CHOOSING_CODE},
      {"step_budget", "step_search", "step_compiles", "schedule"},
    )
    test_utils.assert_digest_follows_code(
      self, step_budget._code_digest, step_budget._CHOOSING_CODE
    )


def _print_plan(getter: str, below: str) -> None:
  """In a fresh process: the plan of the two-loop step at `below` bytes under remat=True's, and the compiles made."""
  auto, args = _step("two_loops", "auto", getter == "1")
  budget = _bytes(_step("two_loops", True)[0], *args) - int(below)
  with counted_compiles() as made, lowerings() as lowered:
    plan = hkb.budgeted_jit(auto, memory_budget=budget).plan(*args)
  print(
    json.dumps(
      {
        "lowered": lowered,
        "compiles": len(made),
        "tries": plan.tries,
        "loops": plan.loops,
        "bytes": plan.bytes,
        "kept": plan.kept,
      }
    )
  )


if __name__ == "__main__":
  absltest.main()
