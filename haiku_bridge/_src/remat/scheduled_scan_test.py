"""Tests for scheduled_scan: against jax.lax.scan, plain and with jax.checkpoint."""

import collections
import functools
import re

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import jaxpr_walk
from haiku_bridge._src.remat import hlo_flops
from haiku_bridge._src.remat import schedule as remat_schedule
from haiku_bridge._src.remat import scheduled_scan
from testing import test_utils

WIDTH = 4
SCHEDULES = {
  "nested": remat_schedule.nested,
  "nested_2_groups": functools.partial(remat_schedule.nested, groups=2),
  "binomial_2_slots": functools.partial(remat_schedule.binomial, slots=2),
}


def step(carry, x):
  """A carry of a float array and an int counter; a y of two leaves."""
  h, count = carry
  new_h = jnp.tanh(h @ x["w"] + x["b"]) * x["scale"]
  return (new_h, count + 1), {"norm": jnp.sum(h**2), "count": count}


def inputs(length):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(length), 3)
  xs = {
    "w": jax.random.normal(k1, [length, WIDTH, WIDTH]),
    "b": jax.random.normal(k2, [length, WIDTH]) * 0.1,
    "scale": 1 + jnp.arange(length, dtype=jnp.float32) / 10,
  }
  return (jax.random.normal(k3, [2, WIDTH]), jnp.int32(0)), xs


def assert_close(ours, theirs):
  """Each leaf within 5e-5 of its largest entry, and 1e-6: a float32 chain's accuracy.

  Two programs computing these chains in float32 differ by up to 1e-5 of
  a leaf's largest entry, each as far from a float64 run of either, by
  how XLA:CPU's code adds up on the host (an AMD EPYC's, 2026-12-07);
  a wrong schedule is off by the entries themselves.
  """
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(
      a, b, rtol=0, atol=5e-5 * float(np.max(np.abs(b))) + 1e-6
    ),
    ours,
    theirs,
  )


def scheduled(schedule):
  """`scheduled_scan.scan` with `jax.lax.scan`'s signature."""
  return functools.partial(scheduled_scan.scan, schedule=schedule)


def checkpointed(f, *args, **kwargs):
  """The ground truth: `jax.checkpoint` on the body, one carry per step."""
  return lax.scan(jax.checkpoint(f), *args, **kwargs)


def loss(scan, f=step, **options):
  """A scalar of the last carry and every y: `loss(carry, xs)`."""

  def total(carry, xs):
    (h, count), ys = scan(f, carry, xs, **options)
    return jnp.sum(h**2) + jnp.sum(jnp.sin(ys["norm"])) + count.astype(jnp.float32)

  return total


def value_and_grads(scan, carry, xs, **options):
  return without_int_cotangents(
    jax.jit(jax.value_and_grad(loss(scan, **options), argnums=(0, 1), allow_int=True))(carry, xs)
  )


def without_int_cotangents(tree):
  """`tree` with its float0 leaves (cotangents of ints) dropped."""
  return jax.tree.map(lambda x: None if x.dtype == jax.dtypes.float0 else x, tree)


class ScheduledScanTest(parameterized.TestCase):
  @parameterized.product(schedule=list(SCHEDULES), length=[1, 3, 8], reverse=[False, True])
  def test_values_and_gradients_equal_checkpointed_scan(self, schedule, length, reverse):
    carry, xs = inputs(length)
    scan = scheduled(SCHEDULES[schedule](length))
    options = dict(length=length, reverse=reverse)
    chex.assert_trees_all_equal(
      jax.jit(lambda c, xs: scan(step, c, xs, **options))(carry, xs),
      lax.scan(step, carry, xs, **options),
    )
    assert_close(
      value_and_grads(scan, carry, xs, **options),
      value_and_grads(checkpointed, carry, xs, **options),
    )

  def test_advances_of_many_steps(self):
    # With one slot, or few, the backward sweep runs several steps from one
    # carry per action (the table holds a row per action, not per step).
    carry, xs = inputs(12)
    for slots, reverse in ((1, False), (2, True)):
      schedule = remat_schedule.binomial(12, slots)
      self.assertGreater(max(a.length for a in schedule.actions), 2)
      options = dict(length=12, reverse=reverse)
      assert_close(
        value_and_grads(scheduled(schedule), carry, xs, **options),
        value_and_grads(checkpointed, carry, xs, **options),
      )

  def test_unroll(self):
    carry, xs = inputs(7)
    scan = scheduled(remat_schedule.nested(7))
    assert_close(
      value_and_grads(scan, carry, xs, length=7, unroll=3),
      value_and_grads(checkpointed, carry, xs, length=7),
    )
    # Both sweeps run unrolled, as the forward pass does.
    grad = jax.grad(loss(scan, length=7, unroll=3), argnums=(0, 1), allow_int=True)
    unrolls = [
      eqn.params["unroll"]
      for eqn in jaxpr_walk.equations(jax.make_jaxpr(grad)(carry, xs))
      if eqn.primitive.name == "scan"
    ]
    self.assertGreaterEqual(len(unrolls), 2)  # The forward and backward sweeps.
    self.assertEqual(set(unrolls), {3})

  def test_closed_over_values_get_their_summed_cotangents(self):
    carry, xs = inputs(6)
    scan = scheduled(remat_schedule.nested(6))

    def grads(scan):
      def f(shift, gain, xs):
        def closing_step(c, x):  # Closes over two differentiated values.
          (h, count), y = step(c, x)
          return (h * gain + shift, count), y

        return loss(scan, closing_step, length=6)(carry, xs)

      return jax.grad(f, argnums=(0, 1, 2))(jnp.float32(0.3), jnp.ones([WIDTH]) * 0.9, xs)

    assert_close(grads(scan), grads(checkpointed))

  def test_cotangent_of_the_carry_or_of_the_ys_alone(self):
    # The other output's cotangent is a symbolic zero.
    carry, xs = inputs(5)
    scan = scheduled(remat_schedule.nested(5))
    for pick in (lambda out: jnp.sum(out[0][0]), lambda out: jnp.sum(out[1]["norm"])):
      f = lambda scan, xs: pick(scan(step, carry, xs, length=5))
      assert_close(
        jax.grad(functools.partial(f, scan))(xs), jax.grad(functools.partial(f, lax.scan))(xs)
      )

  def test_gradient_of_the_carry_only(self):
    # xs unperturbed: no cotangent buffer for them.
    carry, xs = inputs(5)
    scan = scheduled(remat_schedule.binomial(5, 2))
    grads = lambda scan: without_int_cotangents(
      jax.grad(lambda c: loss(scan, length=5)(c, xs), allow_int=True)(carry)
    )
    assert_close(grads(scan), grads(lax.scan))

  def test_grad_of_grad(self):
    carry, xs = inputs(4)
    scan = scheduled(remat_schedule.nested(4))

    def second(scan):
      def f(scale):
        g = jax.grad(lambda xs: loss(scan, length=4)(carry, xs))(dict(xs, scale=scale))
        return jnp.sum(g["w"] ** 2)

      return jax.grad(f)(xs["scale"])

    assert_close(second(scan), second(lax.scan))

  def test_vmap(self):
    carry, xs = inputs(5)
    scan = scheduled(remat_schedule.nested(5))
    batched = lambda scan: jax.vmap(
      jax.grad(loss(scan, length=5), argnums=1), in_axes=((0, None), None)
    )
    hs = jnp.stack([carry[0], -carry[0]])
    assert_close(batched(scan)((hs, carry[1]), xs), batched(lax.scan)((hs, carry[1]), xs))

  def test_forward_mode_equals_checkpointed_scan(self):
    # Forward mode keeps nothing for a backward pass: it runs the
    # checkpointed scan. Issue 27, row 10: it raised "can't apply
    # forward-mode autodiff (jvp) to a custom_vjp function".
    carry, xs = inputs(4)
    tangent = jax.tree.map(lambda x: jnp.full_like(x, 0.5), xs)

    def derivatives(scan):
      @jax.jit  # Each transform inside: the scan sees its trace.
      def all_of_them(xs, tangent):
        f = lambda xs: loss(scan, length=4)(carry, xs)
        linearized = ()
        if scheduled_scan.LINEARIZE_IS_FORWARD_MODE:
          y, linear = jax.linearize(f, xs)
          linearized = (y, linear(tangent), jax.linear_transpose(linear, xs)(1.0))
        return (
          jax.jvp(f, (xs,), (tangent,)),
          jax.jacfwd(f)(xs),
          linearized,
          jax.hessian(f)(xs)["scale"]["scale"],
          jax.vmap(lambda t: jax.jvp(f, (xs,), (t,))[1])(
            jax.tree.map(lambda x: jnp.stack([x, -x]), tangent)
          ),
        )

      return all_of_them(xs, tangent)

    assert_close(derivatives(scheduled(remat_schedule.nested(4))), derivatives(checkpointed))

  def test_linearize_before_jax_0_9_is_jaxs_error(self):
    # The limit scheduled_scan states: before jax 0.9 a linearize trace does
    # not say whether it is for a VJP, so the schedule runs, and JAX refuses
    # to apply its custom_vjp forward.
    if scheduled_scan.LINEARIZE_IS_FORWARD_MODE:
      self.skipTest("jax.linearize runs the checkpointed scan from jax 0.9.")
    carry, xs = inputs(4)
    f = lambda xs: loss(scheduled(remat_schedule.nested(4)), length=4)(carry, xs)
    with self.assertRaisesRegex(TypeError, "forward-mode.*custom_vjp"):
      _, linear = jax.linearize(f, xs)
      linear(xs)

  def test_reverse_mode_runs_the_schedule_forward_mode_does_not(self):
    # The schedule's backward sweep picks each action with a lax.cond;
    # jax.checkpoint's backward pass has none.
    carry, xs = inputs(6)
    scan = scheduled(remat_schedule.nested(6))
    f = lambda xs: loss(scan, length=6)(carry, xs)
    ones = jax.tree.map(jnp.ones_like, xs)
    for mode, derivative in (
      ("grad", jax.grad(f)),
      ("jit_grad", jax.jit(jax.grad(f))),
      ("vjp", lambda xs: jax.vjp(f, xs)[1](1.0)),
      ("hessian", lambda xs: jax.hessian(f)(xs)["scale"]),
      ("vmap_grad", jax.vmap(jax.grad(f))),
      ("jvp", lambda xs: jax.jvp(f, (xs,), (ones,))),
      ("jacfwd", jax.jacfwd(f)),
      ("linearize", lambda xs: jax.linearize(f, xs)[1](ones)),
    ):
      batched = jax.tree.map(lambda x: x[None], xs)
      counts = test_utils.primitive_counts(derivative, batched if mode == "vmap_grad" else xs)
      self.assertEqual(
        counts["cond"] > 0,
        mode in ("grad", "jit_grad", "vjp", "hessian", "vmap_grad"),
        (mode, counts),
      )

  def test_schedule_for_another_length(self):
    carry, xs = inputs(3)
    with self.assertRaisesRegex(ValueError, "schedule is for 4 steps"):
      scheduled_scan.scan(step, carry, xs, length=3, schedule=remat_schedule.nested(4))


def int32_constant_bytes(hlo_text):
  """Bytes of the int32 constants of more than one element in compiled HLO."""
  sizes = [
    int(np.prod([int(d) for d in dims.split(",")]))
    for dims in re.findall(r"= s32\[([0-9,]+)\]\S* constant\(", hlo_text)
  ]
  return sum(4 * n for n in sizes if n > 1)


class ConstantsTest(absltest.TestCase):
  def test_the_program_holds_the_schedule_in_linear_bytes(self):
    # One slot over 2048 steps recomputes 2 M steps; the program holds the
    # schedule's table_bytes of constants (about 88 KB), not a row per step
    # it runs (32 MB).
    length = 2048
    schedule = remat_schedule.binomial(length, 1)
    self.assertEqual(schedule.recomputed_steps, (length - 1) * (length - 2) // 2)
    f = lambda h, xs: jnp.sum(
      scheduled_scan.scan(
        lambda h, x: (jnp.tanh(h * x), None), h, xs, length=length, schedule=schedule
      )[0]
    )
    compiled = jax.jit(jax.grad(f)).lower(jnp.ones([4]), jnp.ones([length, 4])).compile()
    # Compiled in (jax 0.10), or passed as arguments of their own (jax
    # 0.12, tables over its jax_embedded_constants_max_bytes).
    self.assertEqual(
      int32_constant_bytes(compiled.as_text())
      + hlo_flops.lifted_bytes(compiled, compiled.memory_analysis()),
      schedule.table_bytes,
    )
    self.assertLess(schedule.table_bytes, 44 * length)

  def test_the_program_holds_the_tables_xla_keeps(self):
    # From 19 slots over 200 steps every ADVANCE runs one step, and the
    # lengths' column is one value: table_bytes counts what the program
    # holds on both sides (8,420 and 8,400 bytes before, the 19 slots' 22%
    # over; remat="auto" weighs these bytes).
    length = 200
    f = lambda schedule: jax.grad(
      lambda h, xs: jnp.sum(
        scheduled_scan.scan(
          lambda h, x: (jnp.tanh(h * x), None), h, xs, length=length, schedule=schedule
        )[0]
      )
    )
    args = jnp.ones([4]), jnp.ones([length, 4])
    for slots in (18, 19):
      schedule = remat_schedule.binomial(length, slots)
      # Given to XLA: a column of one value as that value, not an array
      # (jax 0.12 passes an array over 1,024 bytes as an argument, which
      # XLA cannot fold: 8,400 bytes held there).
      given = jax.make_jaxpr(f(schedule))(*args).consts
      self.assertEqual(
        sum(np.asarray(c).nbytes for c in given if np.ndim(c)), schedule.table_bytes, slots
      )
      compiled = jax.jit(f(schedule)).lower(*args).compile()
      self.assertEqual(
        int32_constant_bytes(compiled.as_text())
        + hlo_flops.lifted_bytes(compiled, compiled.memory_analysis()),
        schedule.table_bytes,
        slots,
      )
    self.assertEqual(remat_schedule.one_step_advances(length), 19)


class ForwardSweepTest(absltest.TestCase):
  def test_writes_each_carry_without_reading_or_selecting_a_slot(self):
    # The forward sweep writes every carry, the unkept ones to the register's
    # slot: no per-step read of a slot and no select between a carry and a
    # slot, which XLA compiles slower (issue 42). Only scalar index
    # arithmetic selects.
    schedule = remat_schedule.binomial(8, 2)
    self.assertIn(remat_schedule.NOWHERE, schedule.forward_stores)
    f = lambda xs: jnp.sum(
      scheduled_scan.scan(
        lambda h, x: (jnp.tanh(h * x), None), jnp.ones([4]), xs, length=8, schedule=schedule
      )[0]
    )
    forward = jax.make_jaxpr(lambda xs: jax.vjp(f, xs)[0])(jnp.ones([8, 4]))
    shapes = collections.Counter(
      (eqn.primitive.name, eqn.outvars[0].aval.shape)
      for eqn in jaxpr_walk.equations(forward)
      if eqn.primitive.name in ("select_n", "dynamic_slice")
    )
    self.assertEqual([k for k in shapes if k[1] != ()], [], shapes)


class TracingTest(absltest.TestCase):
  def test_the_step_is_one_function_and_the_helpers_none(self):
    # The step is one jit, bound at each of its places (the primal scan,
    # the forward sweep, an advance, the backward step), traced and
    # differentiated once and lowered as one function. The slot and table
    # reads bind lax's primitives: `lax.dynamic_index_in_dim`, `jnp.where`
    # and their kin are `jax.jit`s, which a fresh process traces once per
    # shape and lowers as functions of their own (issue 42). So the
    # program lowers to one function more than jax.checkpoint's.
    length = 8
    carry, xs = inputs(length)

    def program(scan):
      grad = jax.grad(loss(scan, length=length), argnums=(0, 1), allow_int=True)
      jits = [  # The jit equations' names, at any depth.
        eqn.params["name"]
        for eqn in jaxpr_walk.equations(jax.make_jaxpr(grad)(carry, xs))
        if eqn.primitive.name in ("jit", "pjit")
      ]
      functions = jax.jit(grad).lower(carry, xs).as_text().count("func.func")
      return jits, functions

    jits, functions = program(checkpointed)
    self.assertEqual(jits, [])
    for schedule in (remat_schedule.nested(length), remat_schedule.binomial(length, 2)):
      ours, our_functions = program(scheduled(schedule))
      # The step's, and the parts of it jax's differentiation splits off.
      self.assertNotEqual(ours, [])
      self.assertEqual(set(ours), {"jaxpr_as_fun"}, schedule.num_slots)
      self.assertLessEqual(our_functions, functions + 1, schedule.num_slots)

  def test_slots_and_layers_are_indexed_with_no_negative_wrap(self):
    # Every index is in range, so none is wrapped as `lax.dynamic_slice`
    # wraps negative ones (a compare with 0 and a select per index): the
    # wrap made XLA:CPU compile the conv stack's scheduled step 1.26x
    # `remat=True`'s instead of 1.11x (issue 42). Outside the step's own
    # jit, the program compares with `eq` only.
    length = 8
    carry, xs = inputs(length)
    compared = []

    def visit(jaxpr):
      for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("jit", "pjit"):
          continue  # The step, whose comparisons are the user's.
        if eqn.primitive.name in ("lt", "le", "gt", "ge"):
          compared.append(eqn.primitive.name)
        for sub in jaxpr_walk.sub_jaxprs(eqn.params):
          visit(sub)

    for schedule in (remat_schedule.nested(length), remat_schedule.binomial(length, 2)):
      grad = jax.grad(loss(scheduled(schedule), length=length), argnums=(0, 1), allow_int=True)
      visit(jax.make_jaxpr(grad)(carry, xs).jaxpr)
      self.assertEqual(compared, [], schedule.num_slots)


class MemoryTest(absltest.TestCase):
  """Compiled temporaries of a grad step, against jax.checkpoint's."""

  def _temp_bytes(self, scan, length, tokens, width=64):
    xs = {
      "w": jnp.zeros([length, width, width]),
      "b": jnp.zeros([length, width]),
      "scale": jnp.ones([length]),
    }
    carry = (jnp.ones([tokens, width]), jnp.int32(0))
    step_fn = jax.jit(jax.grad(loss(scan, length=length), argnums=1))
    analysis = step_fn.lower(carry, xs).compile().memory_analysis()
    if analysis is None:
      self.skipTest("no memory_analysis on this backend")
    return hlo_flops.temporaries(analysis, jax.default_backend())

  def test_fewer_carries_and_no_copy_of_the_params(self):
    # Activation-dominated (256 tokens): fewer carries, less memory. Param-
    # dominated (4 tokens): the stacked params' cotangents are written in
    # place, so nothing grows with the params either.
    for tokens in (256, 4):
      theirs = self._temp_bytes(checkpointed, 36, tokens)
      for schedule in (remat_schedule.nested(36), remat_schedule.binomial(36, 8)):
        self.assertLess(
          self._temp_bytes(scheduled(schedule), 36, tokens), theirs, (tokens, schedule.num_slots)
        )


if __name__ == "__main__":
  absltest.main()
