"""Tests for hkb.scan / hkb.dynamic_unroll: against hk.scan, hk.dynamic_unroll and hk.remat.

Ground truth: Haiku's own `hk.dynamic_unroll` / `hk.scan` of the same core
(for `remat=False`), and of `hk.remat` of the core (for `remat=True`,
`"nested"` and `"binomial"`): the same params and state at init, the same
outputs, final state, Haiku state and gradients at apply. Each test compiles
one function that runs every mode and its references, and checks them all.
"""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import functools
import inspect

from absl.testing import absltest
from absl.testing import parameterized
import chex
import equinox.internal as eqxi
import haiku as hk
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import haiku_bridge as hkb
from haiku_bridge._src.remat import hlo_flops
from haiku_bridge._src.remat import loop
from haiku_bridge._src import time_scan
from testing import backend_tolerance
from testing import clipped_models
from testing import plan_fixtures
from testing import test_utils

KEY = jax.random.PRNGKey(0)
RNG = jax.random.PRNGKey(7)  # Apply's rng: the custom core's dropout.
BATCH, HIDDEN, FEATURES = 2, 4, 3
MODES = loop.REMAT_MODES


class CountingDropoutCore(hk.RNNCore):
  """A core with Haiku state (an int and a float) and dropout."""

  def __call__(self, x, h):
    steps = hk.get_state("steps", [], jnp.int32, init=jnp.zeros)
    total = hk.get_state("total", [HIDDEN], init=jnp.zeros)
    h = jnp.tanh(
      hk.Linear(HIDDEN, name="in")(x) + hk.Linear(HIDDEN, with_bias=False, name="rec")(h)
    )
    h = hk.dropout(hk.next_rng_key(), 0.25, h)
    hk.set_state("steps", steps + 1)
    hk.set_state("total", total + jnp.mean(h, axis=0))
    return h * (1 + steps.astype(h.dtype) / 8), h

  def initial_state(self, batch_size):
    return jnp.zeros([batch_size, HIDDEN])


def make_core(name):
  """`(core, inputs of T steps)` for one of the cores under test."""
  cores = {
    "lstm": lambda: hk.LSTM(HIDDEN),
    "gru": lambda: hk.GRU(HIDDEN),
    "deep_rnn": lambda: hk.DeepRNN([hk.LSTM(HIDDEN), jax.nn.relu, hk.GRU(HIDDEN)]),
    "reset_core": lambda: hk.ResetCore(hk.LSTM(HIDDEN)),
    "counting_dropout": CountingDropoutCore,
  }
  return cores[name]()


def make_inputs(name, steps, time_major=True):
  x = jax.random.normal(jax.random.PRNGKey(steps), [steps, BATCH, FEATURES])
  if name == "reset_core":
    x = (x, jax.random.bernoulli(jax.random.PRNGKey(1), 0.2, [steps, BATCH]))
  if not time_major:
    x = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), x)
  return x


def unroll(name, mode, **options):
  """The core `name` unrolled by hkb (a mode) or by Haiku ("hk", "hk_remat")."""

  def f(inputs):
    core = make_core(name)
    state = core.initial_state(BATCH)
    if mode == "hk":
      return hk.dynamic_unroll(core, inputs, state, **options)
    if mode == "hk_remat":
      return hk.dynamic_unroll(hk.remat(core), inputs, state, **options)
    return hkb.dynamic_unroll(core, inputs, state, remat=mode, **options)

  return hk.transform_with_state(f)


def loss_and_grads(f, params, state, inputs):
  """`(loss, (outputs, last state, Haiku state)), grads` of `f.apply`."""

  def loss(p):
    (outputs, last), new_state = f.apply(p, state, RNG, inputs)
    total = sum(jnp.sum(jnp.sin(o)) for o in jax.tree.leaves(outputs))
    total += sum(jnp.sum(s**2) for s in jax.tree.leaves(last))
    return total, (outputs, last, new_state)

  return jax.value_and_grad(loss, has_aux=True)(params)


def reference_for(mode):
  return "hk" if mode is False else "hk_remat"


def run_all(transforms, params, state, inputs):
  """`loss_and_grads` of each transform, in one compiled function."""
  return jax.jit(lambda p, s, x: [loss_and_grads(f, p, s, x) for f in transforms])(
    params, state, inputs
  )


class DynamicUnrollTest(parameterized.TestCase):
  """Every core, every length: hk.dynamic_unroll's (of hk.remat's) values and gradients."""

  def _assert_matches_haiku(self, name, steps, modes=MODES, **options):
    inputs = make_inputs(name, steps, options.get("time_major", True))
    reference = unroll(name, "hk", **options)
    params, state = reference.init(KEY, inputs)
    # Init runs the loop forward only, the same in every mode.
    chex.assert_trees_all_equal(
      unroll(name, modes[-1], **options).init(KEY, inputs), (params, state)
    )
    references = ("hk", "hk_remat")
    results = run_all(
      [unroll(name, m, **options) for m in references + tuple(modes)], params, state, inputs
    )
    expected = dict(zip(references, results[:2]))
    for mode, got in zip(modes, results[2:]):
      with self.subTest(remat=mode):
        chex.assert_trees_all_close(
          got, expected[reference_for(mode)], **backend_tolerance.values()
        )

  @parameterized.product(
    name=("lstm", "gru", "deep_rnn", "reset_core", "counting_dropout"), steps=(1, 2, 3, 7, 64)
  )
  def test_cores(self, name, steps):
    self._assert_matches_haiku(name, steps)

  @parameterized.parameters("lstm", "counting_dropout")
  def test_thousand_steps(self, name):
    self._assert_matches_haiku(name, 1000, modes=("nested", "binomial"))

  @parameterized.parameters(("lstm", 7), ("counting_dropout", 64))
  def test_reverse(self, name, steps):
    self._assert_matches_haiku(name, steps, reverse=True)

  def test_batch_major_all_states(self):
    self._assert_matches_haiku("deep_rnn", 7, time_major=False, return_all_states=True, unroll=2)

  def test_init_in_every_mode(self):
    inputs = make_inputs("counting_dropout", 7)
    expected = unroll("counting_dropout", "hk").init(KEY, inputs)
    for mode in MODES:
      chex.assert_trees_all_equal(unroll("counting_dropout", mode).init(KEY, inputs), expected)

  @parameterized.parameters(*MODES)
  def test_shared_weights_gradient_is_one_buffer(self, mode):
    # Every step reads the LSTM's weight: its gradient is one buffer that
    # each step adds to, never a stack of per-step (or per-slot) copies.
    steps = 7
    inputs = make_inputs("lstm", steps)
    f = unroll("lstm", mode)
    params, state = f.init(KEY, inputs)
    w = params["lstm/linear"]["w"]
    shapes = test_utils.value_shapes(lambda p: loss_and_grads(f, p, state, inputs), params)
    self.assertIn(w.shape, shapes)
    stacked = {s for s in shapes if s[1:] == w.shape}
    self.assertEqual(stacked, set())

  @plan_fixtures.on_cpu_and_gpu(plan_fixtures.TOY_BYTES)
  def test_memory_below_per_step_remat_and_equinox(self):
    # What the schedules are for: a training step over 256 steps keeps ≈2√T
    # carries (nested: 30; binomial: 21, the fewest for one more forward
    # pass), not 256. Ground truths: hk.dynamic_unroll of hk.remat(core), one
    # carry per step (remat=True compiles to its program: the same
    # temporaries), and Equinox's checkpointed scan (online treeverse) of the
    # same step. Each step's output is reduced in the step, so carries
    # dominate memory. `remat_groups` changes only memory: more groups keep
    # more carries, in both schedules.
    hidden, batch, steps = 32, 8, 256
    xs = jax.random.normal(KEY, [steps, batch, 2])

    def temporaries(mode, **options):
      def f(xs):
        lstm = hk.LSTM(hidden)

        def core(x, state):
          out, state = lstm(x, state)
          return jnp.sum(out**2, axis=-1), state

        state = lstm.initial_state(batch)
        if mode == "hk_remat":
          ys, _ = hk.dynamic_unroll(hk.remat(core), xs, state)
        else:
          ys, _ = hkb.dynamic_unroll(core, xs, state, remat=mode, **options)
        return jnp.mean(ys)

      f = hk.transform(f)
      return compiled_temporaries(self, jax.grad(f.apply), f.init(KEY, xs), None, xs)

    def equinox_temporaries():
      lstm = hk.without_apply_rng(hk.transform(lambda x, state: hk.LSTM(hidden)(x, state)))
      state = hk.LSTMState(jnp.zeros([batch, hidden]), jnp.zeros([batch, hidden]))

      def loss(params, xs):
        def step(state, x):
          out, state = lstm.apply(params, x, state)
          return state, jnp.sum(out**2, axis=-1)

        return jnp.mean(eqxi.scan(step, state, xs, kind="checkpointed")[1])

      return compiled_temporaries(self, jax.grad(loss), lstm.init(KEY, xs[0], state), xs)

    baseline = temporaries("hk_remat")
    self.assertEqual(temporaries(True), baseline)
    nested, binomial = temporaries("nested"), temporaries("binomial")
    self.assertLess(nested, baseline / 3)
    self.assertLess(binomial, nested)
    self.assertLessEqual(binomial, equinox_temporaries())
    # 8 groups of 32: 38 slots, not 30; "binomial" recomputing no more
    # steps than 64 groups of 4 do (189): 66 slots, not 21.
    self.assertGreater(temporaries("nested", remat_groups=8), nested)
    self.assertGreater(temporaries("binomial", remat_groups=64), binomial)

  def test_vmap_and_grad_of_grad(self):
    # Per-example gradients (jax.vmap), and a Hessian-vector product.
    inputs = make_inputs("lstm", 7)
    batch = jax.tree.map(lambda a: jnp.stack([a, -a, 2 * a]), inputs)
    transforms = [unroll("lstm", m) for m in ("hk", "hk_remat") + MODES]
    params, state = transforms[0].init(KEY, inputs)
    tangent = jax.tree.map(jnp.ones_like, params)

    def checks(f):
      grad = lambda p, x: loss_and_grads(f, p, state, x)[1]
      per_example = jax.vmap(grad, in_axes=(None, 0))(params, batch)
      hvp = jax.grad(
        lambda p: sum(
          jnp.vdot(g, t) for g, t in zip(jax.tree.leaves(grad(p, inputs)), jax.tree.leaves(tangent))
        )
      )(params)
      return per_example, hvp

    results = jax.jit(lambda: [checks(f) for f in transforms])()
    for mode, got in zip(MODES, results[2:]):
      with self.subTest(remat=mode):
        chex.assert_trees_all_close(
          got, results[0 if mode is False else 1], **backend_tolerance.second_order()
        )


VOCAB = 11


def char_lm(mode, form, time_major=True):
  """A character LM: `mean xent`; "usual": the head over the stacked outputs.

  "readout": the same model converted to `readout=` (the embedding in the
  core, the head and loss per step), by hkb.dynamic_unroll in `mode`.
  """

  def xent(logits, targets):
    return -jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(targets, VOCAB), axis=-1)

  def f(chars, targets):
    embed = hk.Embed(VOCAB, HIDDEN)
    lstm = hk.LSTM(HIDDEN)
    state = lstm.initial_state(BATCH)
    options = dict(time_major=time_major)
    if form == "usual":
      unroll = (
        hk.dynamic_unroll if mode == "hk" else functools.partial(hkb.dynamic_unroll, remat=mode)
      )
      ys, _ = unroll(lstm, embed(chars), state, **options)
      logits = hk.BatchApply(hk.Linear(VOCAB))(ys)
      return jnp.mean(xent(logits, targets))
    head = hk.Linear(VOCAB)
    losses, _ = hkb.dynamic_unroll(
      lambda c, s: lstm(embed(c), s),
      chars,
      state,
      remat=mode,
      readout=lambda y, t: xent(head(y), t),
      readout_inputs=targets,
      **options,
    )
    return jnp.mean(losses)

  return hk.transform(f)


def char_data(steps, batch=BATCH, vocab=VOCAB):
  chars = jax.random.randint(jax.random.PRNGKey(3), [steps + 1, batch], 0, vocab)
  return chars[:-1], chars[1:]


class ReadoutTest(parameterized.TestCase):
  """`readout=`: the head and loss in the step; Haiku's params, loss and gradients."""

  @parameterized.parameters(True, False)
  def test_char_lm_as_written_the_usual_way(self, time_major):
    data = char_data(9)
    if not time_major:
      data = jax.tree.map(lambda a: a.T, data)
    usual = char_lm("hk", "usual", time_major)
    params = usual.init(KEY, *data)
    # The converted model makes the same params, under the same names.
    chex.assert_trees_all_equal(char_lm("binomial", "readout", time_major).init(KEY, *data), params)
    ours = [char_lm(m, "readout", time_major) for m in MODES]
    results = jax.jit(
      lambda p: [jax.value_and_grad(f.apply)(p, None, *data) for f in [usual] + ours]
    )(params)
    for mode, got in zip(MODES, results[1:]):
      with self.subTest(remat=mode):
        chex.assert_trees_all_close(got, results[0], **backend_tolerance.values())

  def test_without_readout_inputs_and_with_all_states(self):
    # readout(output) alone; the per-step results replace the outputs.
    xs = make_inputs("lstm", 5)

    def f(mode):
      def g(xs):
        lstm = hk.LSTM(HIDDEN)
        head = hk.Linear(1)
        state = lstm.initial_state(BATCH)
        if mode == "hk":
          ys, states = hk.dynamic_unroll(lstm, xs, state, return_all_states=True)
          return hk.BatchApply(head)(ys), states
        return hkb.dynamic_unroll(lstm, xs, state, remat=mode, return_all_states=True, readout=head)

      return hk.transform(g)

    params = f("hk").init(KEY, xs)
    expected = f("hk").apply(params, None, xs)
    chex.assert_trees_all_close(
      f("nested").apply(params, None, xs), expected, **backend_tolerance.values()
    )

  @parameterized.parameters(True, False)
  def test_a_dropout_core_gets_the_usual_forms_params_and_values(self, time_major):
    # The core draws a key per step at init (dropout); the head's params
    # draw theirs after the unroll in the usual form, and so here. The
    # readout's result is one value per step: `[T]` time- or batch-major.
    xs = make_inputs("counting_dropout", 6, time_major)
    targets = jax.random.randint(KEY, [6, BATCH], 0, VOCAB)
    targets = targets if time_major else targets.T

    def net(mode):
      def f(xs, targets):
        core, head = CountingDropoutCore(), hk.Linear(VOCAB)
        xent = lambda y, t: (
          -jnp.sum(jax.nn.log_softmax(head(y)) * jax.nn.one_hot(t, VOCAB), axis=-1)
        )
        state = core.initial_state(BATCH)
        if mode == "hk":
          ys, _ = hk.dynamic_unroll(core, xs, state, time_major=time_major)
          return jnp.sum(xent(ys, targets), axis=1 if time_major else 0)
        losses, _ = hkb.dynamic_unroll(
          core,
          xs,
          state,
          time_major=time_major,
          remat=mode,
          readout=lambda y, t: jnp.sum(xent(y, t)),
          readout_inputs=targets,
        )
        return losses

      return hk.transform_with_state(f)

    usual = net("hk")
    params, state = usual.init(KEY, xs, targets)
    backend_tolerance.assert_same(net("binomial").init(KEY, xs, targets), (params, state))

    def value_and_grad(f):
      def loss(p):
        per_step, new_state = f.apply(p, state, RNG, xs, targets)
        return jnp.sum(jnp.sin(per_step)), (per_step, new_state)

      return jax.value_and_grad(loss, has_aux=True)(params)

    results = jax.jit(lambda: [value_and_grad(f) for f in (usual, net(False), net("binomial"))])()
    self.assertEqual(results[0][0][1][0].shape, (6,))
    for got in results[1:]:
      chex.assert_trees_all_close(got, results[0], **backend_tolerance.values())

  def test_memory_below_the_floor_of_the_usual_form(self):
    # The usual form keeps the [T, B, H] outputs and the [T, B, V] logits
    # (and their cotangents) whatever the schedule; `readout=` keeps the
    # schedule's carries. Ground truth: the usual form with per-step remat
    # (hk.remat of the core), compiled here.
    steps, batch, vocab = 256, 8, 64
    data = char_data(steps, batch, vocab)

    def temporaries(f):
      return compiled_temporaries(self, jax.grad(f.apply), f.init(KEY, *data), None, *data)

    def model(form, mode):
      def f(chars, targets):
        embed, lstm = hk.Embed(vocab, 32), hk.LSTM(32)
        state = lstm.initial_state(batch)
        xent = lambda logits, t: (
          -jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(t, vocab), axis=-1)
        )
        if form == "usual":
          ys, _ = hk.dynamic_unroll(hk.remat(lstm), embed(chars), state)
          return jnp.mean(xent(hk.BatchApply(hk.Linear(vocab))(ys), targets))
        head = hk.Linear(vocab)
        losses, _ = hkb.dynamic_unroll(
          lambda c, s: lstm(embed(c), s),
          chars,
          state,
          remat=mode,
          readout=lambda y, t: xent(head(y), t),
          readout_inputs=targets,
        )
        return jnp.mean(losses)

      return hk.transform(f)

    baseline = temporaries(model("usual", True))
    for mode in loop.REMAT_SCHEDULES:
      with self.subTest(remat=mode):
        self.assertLess(temporaries(model("readout", mode)), 0.15 * baseline)


def compiled_temporaries(test, f, *args):
  """The compiled temporaries of `jax.jit(f)(*args)`, in bytes."""
  analysis = jax.jit(f).lower(*args).compile().memory_analysis()
  if analysis is None:
    test.skipTest("this backend has no memory_analysis")
  return hlo_flops.temporaries(analysis, jax.default_backend())


def stateful_step(linear):
  """A step with Haiku state and dropout, xs and ys as dicts."""

  def f(carry, x):
    n = hk.get_state("n", [], init=jnp.zeros)
    hk.set_state("n", n + jnp.sum(carry))
    h = jnp.tanh(linear(x["in"]) + carry) * x["gain"][:, None]
    h = hk.dropout(hk.next_rng_key(), 0.5, h)
    return h, {"mean": jnp.mean(h, axis=-1), "n": n}

  return f


def kept_at_init(out):
  """`out`, kept in the state at init, so that init's outputs are compared."""
  for i, leaf in enumerate(jax.tree.leaves(out)):
    hk.get_state(f"out_at_init_{i}", leaf.shape, leaf.dtype, init=lambda *_, leaf=leaf: leaf)
  return out


class ScanTest(parameterized.TestCase):
  """hkb.scan against hk.scan: state, rng, xs and ys, lengths, params made at init."""

  def _assert_matches_haiku(self, body, xs, rng=RNG, modes=MODES, **options):
    """`body(scan)`, run with `hkb.scan` in each mode, against `hk.scan`'s."""

    def net(scan, remat=None):
      if remat is not None:
        scan = lambda *a, **k: hkb.scan(*a, remat=remat, **k)
      return hk.transform_with_state(lambda xs: body(scan, xs, **options))

    references = [net(hk.scan), net(lambda f, *a, **k: hk.scan(hk.remat(f), *a, **k))]
    params, state = references[0].init(KEY, xs)
    ours = [net(None, m) for m in modes]
    # Jitted, as the reference (op-by-op and jitted initialisers may differ
    # in the last bit on a GPU: testing/backend_tolerance.py).
    inits = jax.jit(lambda: [f.init(KEY, xs) for f in references[:1] + ours])()
    for init in inits[1:]:
      backend_tolerance.assert_same(init, inits[0])

    def run(f):
      def loss(p):
        out, new_state = f.apply(p, state, rng, xs)
        return sum(jnp.sum(jnp.sin(o)) for o in jax.tree.leaves(out)), (out, new_state)

      return jax.value_and_grad(loss, has_aux=True)(params)

    results = jax.jit(lambda: [run(f) for f in references + ours])()
    for mode, got in zip(modes, results[2:]):
      with self.subTest(remat=mode):
        chex.assert_trees_all_close(
          got, results[0 if mode is False else 1], **backend_tolerance.values()
        )

  @parameterized.parameters((1, False), (2, True), (3, False), (3, True), (7, False), (7, True))
  def test_state_dropout_xs_and_ys(self, steps, reverse):
    xs = {
      "in": jax.random.normal(KEY, [steps, BATCH, FEATURES]),
      "gain": 1 + jnp.arange(steps * BATCH, dtype=jnp.float32).reshape(steps, BATCH) / 8,
    }

    def body(scan, xs, reverse):
      step = stateful_step(hk.Linear(HIDDEN))
      return kept_at_init(scan(step, jnp.zeros([BATCH, HIDDEN]), xs, reverse=reverse))

    self._assert_matches_haiku(body, xs, reverse=reverse)

  def test_typed_rng_key(self):
    xs = {"in": jax.random.normal(KEY, [5, BATCH, FEATURES]), "gain": jnp.ones([5, BATCH])}

    def body(scan, xs):
      step = stateful_step(hk.Linear(HIDDEN))
      return scan(step, jnp.zeros([BATCH, HIDDEN]), xs)

    self._assert_matches_haiku(body, xs, rng=jax.random.key(3))

  def test_params_made_by_the_first_step(self):
    # The step itself creates its params (no module made outside): at init
    # its first step, run outside the loop, makes them; the others share.
    def body(scan, xs):
      def step(h, x):
        w = hk.get_parameter("w", [FEATURES, HIDDEN], init=hk.initializers.RandomNormal())
        return jnp.tanh(x @ w + h), jnp.sum(h)

      return scan(step, jnp.zeros([BATCH, HIDDEN]), xs)

    self._assert_matches_haiku(body, jax.random.normal(KEY, [6, BATCH, FEATURES]))

  def test_module_made_in_every_step_is_refused_as_by_haiku(self):
    # A module made inside the step gets a new name at each trace: hk.scan
    # asserts that the second step made no params, and so does hkb.scan,
    # naming them.
    def net(scan):
      return hk.transform(
        lambda xs: scan(
          lambda h, x: (hk.Linear(HIDDEN)(x) + h, None), jnp.zeros([BATCH, HIDDEN]), xs
        )
      )

    xs = jnp.ones([3, BATCH, FEATURES])
    with self.assertRaisesRegex(
      AssertionError,
      r"\('linear_1', 'b'\), "
      r"\('linear_1', 'w'\)",
    ):
      net(hk.scan).init(KEY, xs)
    for mode in MODES:
      with self.assertRaisesRegex(
        AssertionError,
        r"^hkb.scan: a step created params \['linear_1/b', "
        r"'linear_1/w'\], which the first step did not\.",
      ):
        net(lambda *a, mode=mode: hkb.scan(*a, remat=mode)).init(KEY, xs)

  @parameterized.parameters(*MODES)
  def test_no_steps(self, mode):
    # Init runs the step once on zeros for the params (as hk.scan does);
    # both return the carry and no ys.
    def body(scan, xs):
      return scan(lambda h, x: (h, hk.Linear(2)(x)), jnp.ones([BATCH]), xs)

    xs = jnp.ones([0, BATCH, FEATURES])
    states = []
    for scan in (hk.scan, lambda *a: hkb.scan(*a, remat=mode)):
      transform_ = hk.transform_with_state(lambda xs, scan=scan: kept_at_init(body(scan, xs)))
      params, state = transform_.init(KEY, xs)
      states.append(state)  # Init's outputs.
      self.assertEqual(jax.tree.map(jnp.shape, params), {"linear": {"w": (FEATURES, 2), "b": (2,)}})
      (h, ys), _ = transform_.apply(params, state, None, xs)
      chex.assert_trees_all_equal((h, ys.shape), (jnp.ones([BATCH]), (0, BATCH, 2)))
    chex.assert_trees_all_equal(states[1], states[0])

  def test_length_without_xs(self):
    def body(scan, xs):
      del xs
      linear = hk.Linear(HIDDEN)
      return scan(
        lambda h, _: (jnp.tanh(linear(h)), jnp.sum(h)),
        jnp.ones([BATCH, HIDDEN]),
        None,
        length=9,
        unroll=3,
      )

    self._assert_matches_haiku(body, jnp.zeros([]))


class OutsideTransformTest(parameterized.TestCase):
  """Outside a transform: jax.lax.scan's values and gradients, with the schedule."""

  @parameterized.parameters(*MODES)
  def test_scan_and_dynamic_unroll(self, mode):
    w = jax.random.normal(KEY, [HIDDEN, HIDDEN]) / 2
    xs = jax.random.normal(RNG, [9, BATCH, HIDDEN])
    step = lambda w: lambda h, x: (jnp.tanh(h @ w + x),) * 2
    core = lambda w: lambda x, h: step(w)(h, x)
    h0 = jnp.zeros([BATCH, HIDDEN])

    def losses(w):
      ours = hkb.scan(step(w), h0, xs, reverse=True, remat=mode)
      theirs = jax.lax.scan(step(w), h0, xs, reverse=True)
      ours_unrolled = hkb.dynamic_unroll(core(w), xs, h0, remat=mode)
      theirs_unrolled = hk.dynamic_unroll(core(w), xs, h0)
      return [
        jnp.sum(jnp.sin(jnp.concatenate([a[0][None], a[1]])))
        for a in (ours, theirs, ours_unrolled[::-1], theirs_unrolled[::-1])
      ]

    values = jax.jit(
      lambda w: [jax.value_and_grad(lambda w, i=i: losses(w)[i])(w) for i in range(4)]
    )(w)
    chex.assert_trees_all_close(values[0], values[1], **backend_tolerance.values())
    chex.assert_trees_all_close(values[2], values[3], **backend_tolerance.values())


class CompositionTest(parameterized.TestCase):
  """Inside hkb.custom_vjp and hkb.layer_scan, and under jax.jit with a sharded batch."""

  def test_inside_custom_vjp_gradient_clipping(self):
    # The core's weights learn from a clipped gradient (clipped_models.py):
    # the true gradient of hk.dynamic_unroll, clipped by hand.
    def lstm(xs, unroll_fn):
      core = hk.LSTM(HIDDEN)
      return unroll_fn(core, xs, core.initial_state(BATCH))[0]

    def net(unroll_fn, clip):
      def f(xs):
        block = lambda xs: lstm(xs, unroll_fn)
        if clip:
          block = clipped_models.clipped(block)
        return jnp.sum(jnp.sin(hk.Linear(2, name="head")(block(xs))))

      return hk.transform(f)

    xs = make_inputs("lstm", 64)
    plain = net(hk.dynamic_unroll, clip=False)
    params = plain.init(KEY, xs)
    expected = jax.grad(plain.apply)(params, None, xs)
    expected["lstm/linear"] = clipped_models.clip(expected["lstm/linear"])
    for mode in loop.REMAT_SCHEDULES:
      ours = net(lambda *a, mode=mode: hkb.dynamic_unroll(*a, remat=mode), clip=True)
      chex.assert_trees_all_equal(ours.init(KEY, xs), params)
      chex.assert_trees_all_close(
        jax.jit(jax.grad(ours.apply))(params, None, xs), expected, **backend_tolerance.values()
      )

  def test_forward_mode_through_jit(self):
    # jax.jacfwd(jax.jit(f)) hides forward mode from a schedule's scan: the
    # library's error names `remat` and the fix, and the fix (the jit
    # outside, or remat=True) gives hk.dynamic_unroll's Jacobian.
    xs = make_inputs("lstm", 5)
    reference = unroll("lstm", "hk")
    params, state = reference.init(KEY, xs)

    def jacobian(mode, jit_inside):
      f = lambda p: jnp.sum(unroll("lstm", mode).apply(p, state, RNG, xs)[0][0])
      return jax.jacfwd(jax.jit(f)) if jit_inside else jax.jit(jax.jacfwd(f))

    for mode in loop.REMAT_SCHEDULES:
      with self.subTest(remat=mode):
        with self.assertRaisesRegex(
          TypeError,
          rf'^hkb\.dynamic_unroll: `remat="{mode}"` runs its own '
          r"backward pass .* Put the jit outside \(jax\.jit\(jax\.jacfwd",
        ):
          jacobian(mode, jit_inside=True)(params)
    expected = jacobian("hk", jit_inside=False)(params)
    for mode, jit_inside in (("nested", False), ("binomial", False), (True, True)):
      with self.subTest(remat=mode, jit_inside=jit_inside):
        chex.assert_trees_all_close(
          jacobian(mode, jit_inside)(params), expected, **backend_tolerance.values()
        )

  def test_reverse_mode_through_checkpoint(self):
    # jax.checkpoint / hk.remat linearize their body through a JVP: reverse
    # mode all the same, so a schedule runs (no forward-mode error) and the
    # gradient is hk.dynamic_unroll's, with and without a jit between.
    xs = make_inputs("lstm", 5)
    reference = unroll("lstm", "hk")
    params, state = reference.init(KEY, xs)

    def loss(mode):
      return lambda p: jnp.sum(unroll("lstm", mode).apply(p, state, RNG, xs)[0][0])

    expected = jax.grad(loss("hk"))(params)
    for mode in loop.REMAT_SCHEDULES:
      for wrap in (jax.checkpoint, lambda f: jax.jit(jax.checkpoint(f))):
        with self.subTest(remat=mode):
          chex.assert_trees_all_close(
            jax.grad(wrap(loss(mode)))(params), expected, **backend_tolerance.values()
          )

  def test_scan_remat_policy(self):
    # remat=True with a policy: the values of hk.scan, and the policy used
    # (saving every activation keeps more than saving none).
    xs = jax.random.normal(KEY, [32, BATCH, FEATURES])

    def net(**options):
      def f(xs):
        lstm = hk.LSTM(HIDDEN)
        step = lambda state, x: lstm(x, state)[::-1]
        _, ys = hkb.scan(step, lstm.initial_state(BATCH), xs, **options)
        return jnp.sum(jnp.sin(ys))

      return hk.transform(f)

    params = net().init(KEY, xs)
    saving = dict(remat=True, remat_policy=jax.checkpoint_policies.everything_saveable)
    chex.assert_trees_all_close(
      jax.grad(net(**saving).apply)(params, None, xs),
      jax.grad(net().apply)(params, None, xs),
      **backend_tolerance.values(),
    )
    self.assertGreater(
      compiled_temporaries(self, jax.grad(net(**saving).apply), params, None, xs),
      compiled_temporaries(self, jax.grad(net(remat=True).apply), params, None, xs),
    )

  def test_dynamic_unroll_remat_policy_keeps_what_hk_remat_keeps(self):
    # What a policy saves shows in memory only. Ground truth: Haiku's
    # hk.dynamic_unroll of hk.remat(core, policy=...), compiled: the same
    # temporaries under each policy, and the policies differ from each other.
    xs = jax.random.normal(KEY, [32, 16, FEATURES])

    def net(form, policy):
      def f(xs):
        lstm = hk.LSTM(32)
        state = lstm.initial_state(16)
        if form == "hk":
          ys, _ = hk.dynamic_unroll(hk.remat(lstm, policy=policy), xs, state)
        else:
          ys, _ = hkb.dynamic_unroll(lstm, xs, state, remat=True, remat_policy=policy)
        return jnp.sum(jnp.sin(ys))

      return hk.transform(f)

    params = net("hk", None).init(KEY, xs)
    got = {}
    for policy in (
      None,
      jax.checkpoint_policies.dots_saveable,
      jax.checkpoint_policies.everything_saveable,
    ):
      got[policy] = [
        compiled_temporaries(self, jax.grad(net(form, policy).apply), params, None, xs)
        for form in ("hk", "ours")
      ]
      self.assertEqual(got[policy][1], got[policy][0], policy)
    self.assertLen({hk_bytes for hk_bytes, _ in got.values()}, 3)

  def test_inside_layer_scan(self):
    # A stack of 3 LSTM layers, each unrolled over 16 steps with a
    # schedule, scanned over layers with one: hk.layer_stack of
    # hk.dynamic_unroll's values, names and gradients.
    def layer(unroll_fn):
      def f(seq):
        core = hk.LSTM(HIDDEN)
        return seq + unroll_fn(core, seq, core.initial_state(BATCH))[0]

      return f

    def net(stack, unroll_fn):
      return hk.transform(lambda seq: jnp.sum(jnp.sin(stack(layer(unroll_fn), seq))))

    seq = jax.random.normal(KEY, [16, BATCH, HIDDEN])
    theirs = net(lambda layer, x: hk.layer_stack(3)(hk.remat(layer))(x), hk.dynamic_unroll)
    params = theirs.init(KEY, seq)
    ours = net(
      lambda layer, x: hkb.repeat_layer(layer, x, 3, remat="nested"),
      lambda *a: hkb.dynamic_unroll(*a, remat="binomial"),
    )
    chex.assert_trees_all_equal(ours.init(KEY, seq), params)
    got, expected = jax.jit(
      lambda p: [jax.value_and_grad(f.apply)(p, None, seq) for f in (ours, theirs)]
    )(params)
    chex.assert_trees_all_close(got, expected, **backend_tolerance.values())

  @parameterized.parameters(*loop.REMAT_SCHEDULES)
  def test_jit_with_sharded_batch(self, mode):
    if jax.device_count() < 8:
      self.skipTest(f"needs 8 devices, jax has {jax.device_count()}.")
    batch = 16
    xs = jax.random.normal(KEY, [32, batch, FEATURES])

    def net(unroll_fn):
      def f(xs):
        core = hk.DeepRNN([hk.LSTM(HIDDEN), jax.nn.relu, hk.GRU(HIDDEN)])
        ys, _ = unroll_fn(core, xs, core.initial_state(batch))
        return jnp.mean(jnp.sin(ys))

      return hk.transform(f)

    theirs = net(hk.dynamic_unroll)
    params = theirs.init(KEY, xs)
    expected = jax.jit(jax.value_and_grad(theirs.apply))(params, None, xs)
    ours = net(lambda *a: hkb.dynamic_unroll(*a, remat=mode))
    # Auto axes: under Explicit ones hk.LSTM's own unroll is refused by JAX
    # (its weight gradient contracts the sharded batch with no out_sharding).
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    data = NamedSharding(mesh, P(None, "data"))  # Time major: batch axis 1.
    value, grads = jax.jit(jax.value_and_grad(ours.apply))(params, None, jax.device_put(xs, data))
    chex.assert_trees_all_close((value, grads), expected, **backend_tolerance.values())


class ArgumentsTest(parameterized.TestCase):
  """Each argument checked on entry, the message naming the call and the argument."""

  def _refused(self, error, api, pattern, fn):
    with self.assertRaisesRegex(error, rf"^hkb\.{api}: {pattern}"):
      hk.transform(fn).init(KEY)

  @parameterized.named_parameters(
    ("f", TypeError, "`f` must be a function", dict(f=None)),
    (
      "length_type",
      TypeError,
      "`length` must be None or a non-negative int; got a float 2.0",
      dict(length=2.0),
    ),
    (
      "length_negative",
      ValueError,
      "`length` must be None or a non-negative int; got an int -1",
      dict(length=-1),
    ),
    ("reverse", TypeError, "`reverse` must be a bool; got None", dict(reverse=None)),
    ("unroll", ValueError, "`unroll` must be a bool or a non-negative int", dict(unroll=-2)),
    (
      "remat",
      TypeError,
      r"`remat` must be False, True, \"nested\", "
      r"\"binomial\" or \"auto\"; got an int 4",
      dict(remat=4),
    ),
    ("remat_groups", ValueError, r"`remat_groups` needs `remat=\"nested\"`", dict(remat_groups=3)),
    (
      "xs_leaf",
      TypeError,
      r"xs\['b'\] is a float 1.0; every leaf of xs "
      "must be an array with a leading time axis",
      dict(xs={"a": jnp.ones([3]), "b": 1.0}),
    ),
    (
      "xs_lengths",
      ValueError,
      r"xs\['b'\] has shape \(2,\), but every "
      r"leaf of xs needs a leading time axis of 3 steps \(as xs\['a'\] "
      r"has\)\.",
      dict(xs={"a": jnp.ones([3]), "b": jnp.ones([2])}),
    ),
    (
      "length_and_xs",
      ValueError,
      r"xs has shape \(3,\), but every leaf "
      r"of xs needs a leading time axis of 4 steps\.",
      dict(length=4),
    ),
    (
      "no_xs",
      ValueError,
      "xs holds no arrays, so the number of steps is unknown: pass `length=`",
      dict(xs=None),
    ),
    (
      "unknown_keyword",
      TypeError,
      "got an unexpected keyword argument "
      r"'remat_group' \(did you mean 'remat_groups'\?\); its arguments are "
      "f, init, xs, length, reverse, unroll, remat, remat_groups, "
      r"remat_policy, memory_budget, max_recompute\.$",
      dict(remat_group=2),
    ),
    (
      "remat_policy",
      ValueError,
      "`remat_policy` needs `remat=True`",
      dict(remat="nested", remat_policy=jax.checkpoint_policies.nothing_saveable),
    ),
  )
  def test_scan(self, error, pattern, kwargs):
    args = dict(f=lambda c, x: (c, x), init=jnp.zeros([]), xs=jnp.ones([3]))
    args.update(kwargs)
    self._refused(error, "scan", pattern, lambda: hkb.scan(**args))

  @parameterized.named_parameters(
    ("core", TypeError, "`core` must be an RNN core", dict(core="lstm")),
    ("time_major", TypeError, "`time_major` must be a bool; got an int 0", dict(time_major=0)),
    (
      "return_all_states",
      TypeError,
      "`return_all_states` must be a bool",
      dict(return_all_states="yes"),
    ),
    ("remat", ValueError, r"`remat` must be .*; got a str 'sqrt'", dict(remat="sqrt")),
    (
      "batch_major",
      ValueError,
      r"input_sequence is an array float32\[3\]; "
      r"with time_major=False every leaf needs a batch axis and a time "
      r"axis, \[B, T, \.\.\.\]\.",
      dict(time_major=False),
    ),
    (
      "no_inputs",
      ValueError,
      "input_sequence holds no arrays, so the "
      "number of steps is unknown: pass inputs with a time axis",
      dict(input_sequence={}),
    ),
    (
      "unknown_keyword",
      TypeError,
      "got an unexpected keyword argument 'head'; its arguments are core, ",
      dict(head=len),
    ),
    ("readout", TypeError, "`readout` must be a function of each step's output", dict(readout=3)),
    (
      "readout_inputs_alone",
      ValueError,
      "`readout_inputs` are the per-step inputs of `readout`: pass `readout=` too",
      dict(readout_inputs=jnp.ones([3])),
    ),
    (
      "readout_inputs_length",
      ValueError,
      r"readout_inputs has shape "
      r"\(2,\), but every leaf of readout_inputs needs a leading time axis "
      "of 3 steps.",
      dict(readout=lambda y, t: y, readout_inputs=jnp.ones([2])),
    ),
  )
  def test_dynamic_unroll(self, error, pattern, kwargs):
    args = dict(core=lambda x, s: (x, s), input_sequence=jnp.ones([3]), initial_state=jnp.zeros([]))
    args.update(kwargs)
    self._refused(error, "dynamic_unroll", pattern, lambda: hkb.dynamic_unroll(**args))

  def test_checked_before_any_step_runs(self):
    calls = []
    with self.assertRaisesRegex(TypeError, "`remat`"):
      hk.transform(
        lambda: hkb.scan(lambda c, x: calls.append(x) or (c, x), 0.0, jnp.ones([3]), remat=2)
      ).init(KEY)
    self.assertEqual(calls, [])

  def test_signatures_are_haikus(self):
    # Haiku's positional arguments, in Haiku's order, under Haiku's names.
    # Our options after them, keyword only.
    for ours, theirs, options in (
      (
        hkb.scan,
        hk.scan,
        ["remat", "remat_groups", "remat_policy", "memory_budget", "max_recompute"],
      ),
      (
        hkb.dynamic_unroll,
        hk.dynamic_unroll,
        [
          "remat",
          "remat_groups",
          "remat_policy",
          "readout",
          "readout_inputs",
          "memory_budget",
          "max_recompute",
        ],
      ),
    ):
      theirs_params = list(inspect.signature(theirs).parameters.values())
      ours_params = list(inspect.signature(ours).parameters.values())
      self.assertEqual(
        [(p.name, p.default) for p in ours_params[: len(theirs_params)]],
        [(p.name, p.default) for p in theirs_params],
      )
      self.assertEqual(
        [(p.name, p.kind) for p in ours_params[len(theirs_params) :]],
        [(name, inspect.Parameter.KEYWORD_ONLY) for name in options],
      )
    self.assertIs(time_scan.scan, hkb.scan)


if __name__ == "__main__":
  absltest.main()
