"""Tests for custom_vjp / custom_jvp over Haiku functions.

Ground truth is always independent of the code under test: the same network
written inline (when the rule is the true derivative), a reference written
with `lax.stop_gradient` or `hk.custom_getter`, or `jax.test_util.check_grads`.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax
from jax import test_util as jtu
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import call_pure
from haiku_bridge._src import custom_grad
from haiku_bridge._src import layer_scan
from testing import backend_tolerance
from testing import test_utils

Outer = test_utils.Outer

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), [3, 4])
TOL = dict(rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Inner functions and rules.
# ---------------------------------------------------------------------------


def mlp(x):
  return hk.nets.MLP([6, 4], activation=jnp.tanh)(x)


class StatefulBlock(hk.Module):
  """Reads and writes state and draws a dropout key: all that must thread."""

  def __call__(self, x):
    count = hk.get_state("count", [], jnp.float32, init=jnp.zeros)
    hk.set_state("count", count + 1.0)
    h = hk.dropout(hk.next_rng_key(), 0.5, hk.Linear(6, name="layer1")(x))
    return hk.Linear(4, name="layer2")(jnp.tanh(h)) * (1.0 + count)


def stateful_dropout_mlp(x):
  return StatefulBlock()(x)


def true_bwd(vjp_fn, g):
  return vjp_fn(g)


def fwd_by_hand(f_pure, params, x):
  # The closure from jax.vjp is a pytree: a valid residual.
  return jax.vjp(f_pure, params, x)


def fwd_remat(f_pure, params, x):
  # f_pure is a pytree too (its state and rng): bwd reruns it.
  return f_pure(params, x), (f_pure, params, x)


def bwd_remat(residuals, g):
  f_pure, params, x = residuals
  return jax.vjp(f_pure, params, x)[1](g)


TRUE_RULES = (
  ("vjp_fwd", custom_grad.vjp_fwd, true_bwd),
  ("jax_vjp_by_hand", fwd_by_hand, true_bwd),
  ("rerun_in_bwd", fwd_remat, bwd_remat),
)


def true_jvp(f_pure, primals, tangents):
  return jax.jvp(f_pure, primals, tangents)


def deep(body):
  """`body` two modules deep, with an inline layer before it."""
  return lambda x: Outer(
    lambda x: Outer(lambda x: body(hk.Linear(4, name="embed")(x)), name="encoder")(x), name="net"
  )(x)


def grads_and_state(transformed, params, state, rng=KEY, x=X, jit=False):
  """Loss, new state and params gradient of sum(out**2)."""

  def loss(p):
    out, new_state = transformed.apply(p, state, rng, x)
    return jnp.sum(out**2), new_state

  fn = jax.value_and_grad(loss, has_aux=True)
  (value, new_state), grads = (jax.jit(fn) if jit else fn)(params)
  return value, new_state, grads


def assert_same_as_inline(test, bridged, inline, *, rng=KEY, x=X):
  """Same names, init values, outputs, new state and gradients as inline."""
  bridged = hk.transform_with_state(bridged)
  inline = hk.transform_with_state(inline)
  p_b, s_b = bridged.init(rng, x)
  p_i, s_i = inline.init(rng, x)
  test.assertEqual(list(p_b), list(p_i))
  chex.assert_trees_all_equal(p_b, p_i)
  chex.assert_trees_all_equal(s_b, s_i)
  # The bridged one under jax.jit; the reference op by op (faster on CPU).
  got = grads_and_state(bridged, p_i, s_i, rng, x, jit=True)
  want = grads_and_state(inline, p_i, s_i, rng, x)
  chex.assert_trees_all_close(got, want, **TOL)
  return p_i, s_i


class CustomVjpTest(parameterized.TestCase):
  """`custom_vjp` with the true backward pass equals the inline network."""

  @parameterized.named_parameters(*TRUE_RULES)
  def test_true_rule_matches_inline(self, fwd, bwd):
    # Deep in modules, two call sites (two sets of weights, numbered as
    # inline), state, and dropout. The state is updated once, by the forward
    # pass; the backward pass uses the forward's dropout mask (the gradient
    # equals inline's, taken with that mask held fixed); and the caller's
    # next key is inline's, so the dropout after the blocks matches too.
    block = custom_grad.custom_vjp(stateful_dropout_mlp, fwd, bwd)
    after = lambda y: hk.dropout(hk.next_rng_key(), 0.5, y)
    body = lambda f: deep(lambda x: after(f(x) * f(x)))
    params, state = assert_same_as_inline(self, body(block), body(stateful_dropout_mlp))
    self.assertIn("net/encoder/stateful_block_1/layer2", params)
    bridged = hk.transform_with_state(body(block))
    _, new_state, _ = grads_and_state(bridged, params, state)
    for block_name in ("stateful_block", "stateful_block_1"):
      self.assertEqual(float(new_state[f"net/encoder/{block_name}"]["count"]), 1.0)
    # Dropout is really on: another key gives another output.
    out_a = bridged.apply(params, state, KEY, X)[0]
    out_b = bridged.apply(params, state, jax.random.PRNGKey(7), X)[0]
    self.assertFalse(jnp.allclose(out_a, out_b))

  def test_check_grads(self):
    block = custom_grad.custom_vjp(stateful_dropout_mlp, custom_grad.vjp_fwd, true_bwd)
    f = hk.transform_with_state(deep(block))
    params, state = f.init(KEY, X)
    # Jitted: check_grads evaluates it many times.
    jtu.check_grads(
      jax.jit(lambda p, x: f.apply(p, state, KEY, x)[0]),
      (params, X),
      order=1,
      modes=["rev"],
      atol=1e-2,
      rtol=1e-2,
    )

  def test_vjp_fwd_adds_no_work(self):
    # Ground truth for the cost: the same custom_vjp written by hand with
    # call_pure and jax.custom_vjp. Same primitives in the gradient's jaxpr:
    # no second forward pass, no extra plumbing ops.
    inner = hk.transform(mlp)

    @jax.custom_vjp
    def by_hand(params, x):
      return inner.apply(params, None, x)

    by_hand.defvjp(lambda p, x: jax.vjp(lambda p, x: inner.apply(p, None, x), p, x), true_bwd)
    ours = hk.transform(deep(custom_grad.custom_vjp(mlp, custom_grad.vjp_fwd, true_bwd)))
    theirs = hk.transform(deep(lambda x: call_pure.call_pure(by_hand, x, init=inner)))
    params = ours.init(KEY, X)
    loss = lambda f: jax.grad(lambda p: jnp.sum(f.apply(p, None, X)))
    self.assertEqual(
      test_utils.primitive_counts(loss(ours), params),
      test_utils.primitive_counts(loss(theirs), params),
    )

  @parameterized.named_parameters(
    ("draws_a_key", KEY, lambda x: hk.dropout(hk.next_rng_key(), 0.5, hk.Linear(4)(x))),
    (
      "writes_state_it_never_reads",
      None,
      lambda x: (hk.set_state("last", jnp.sum(x)), hk.Linear(4)(x))[1],
    ),
  )
  def test_rule_with_its_own_out_runs_f_for_rng_and_state(self, rng, f):
    # `out` is not f_pure's own, and `f` reads no state: the bridge runs `f`
    # once more for the rng and state after the block, so the key drawn
    # after it and the new state are inline's.
    fwd = lambda f_pure, p, x: (f_pure(p, x) + 0.0, None)
    block = custom_grad.custom_vjp(f, fwd, lambda _, g: (None, None))
    body = lambda f: lambda x: (f(x), hk.maybe_next_rng_key())
    ours, inline = (hk.transform_with_state(body(g)) for g in (block, f))
    params, state = inline.init(KEY, X)
    # Under jax.vjp, so that the block runs its fwd rule; on another input
    # than init's, so that the state changes.
    got = jax.vjp(lambda p: ours.apply(p, state, rng, 2 * X), params)[0]
    chex.assert_trees_all_close(got, inline.apply(params, state, rng, 2 * X), **TOL)

  def test_rule_running_f_on_other_params_takes_state_of_the_block_params(self):
    # A fwd whose `out` is f_pure's on perturbed params (weight noise):
    # that run is not the block's; its new state is inline `f`'s on the
    # block's own params, which the bridge runs once more for it.
    def f(x):
      y = hk.Linear(4)(x)
      hk.set_state("total", jnp.sum(y))
      return y

    fwd = lambda f_pure, p, x: (f_pure(jax.tree.map(lambda w: 2 * w, p), x), None)
    block = custom_grad.custom_vjp(f, fwd, lambda _, g: (None, None))
    ours, inline = (hk.transform_with_state(g) for g in (block, f))
    params, state = inline.init(KEY, X)
    _, new_state = jax.vjp(lambda p: ours.apply(p, state, None, X), params)[0]
    chex.assert_trees_all_close(new_state, inline.apply(params, state, None, X)[1], **TOL)

  def test_rule_returning_f_pures_out_runs_f_once(self):
    # As documented: a fwd that returns f_pure's output on its primals runs
    # `f` no more than it does; any other `out` costs one more run (for the
    # block's new state).
    runs = []

    def f(x):
      runs.append(None)
      return stateful_dropout_mlp(x)

    def count(fwd):
      net = hk.transform_with_state(custom_grad.custom_vjp(f, fwd, bwd_remat))
      params, state = net.init(KEY, X)
      del runs[:]
      jax.vjp(lambda p: net.apply(p, state, KEY, X), params)
      return len(runs)

    copy = lambda f_pure, p, x: (f_pure(p, x) + 0.0, (f_pure, p, x))
    self.assertEqual(count(copy), count(fwd_remat) + 1)
    # vjp_fwd's out is f_pure's own too, and it hands the run's new state
    # over: no run more. (Each count also holds the block's shape-only
    # probe of `f`, which adds nothing to the computation.)
    self.assertEqual(count(custom_grad.vjp_fwd), count(fwd_remat))

  def test_cotangents_come_back_in_the_primals_dtypes(self):
    # As jax.grad gives them: bwd's bfloat16 cotangents of float32 params
    # are float32 gradients.
    to_bf16 = lambda vjp_fn, g: jax.tree.map(lambda c: c.astype(jnp.bfloat16), vjp_fn(g))
    grads = grad_of(custom_grad.custom_vjp(mlp, custom_grad.vjp_fwd, to_bf16))
    true_grads = grad_of(mlp)
    self.assertEqual(
      jax.tree.map(lambda g: g.dtype, grads), jax.tree.map(lambda g: g.dtype, true_grads)
    )
    chex.assert_trees_all_close(grads, true_grads, rtol=2e-2, atol=2e-2)

  def test_bwd_rerunning_f_sees_the_getters_of_the_call(self):
    # bwd runs after the block's call returned, outside the custom_getter
    # scope around it; a rerun of `f` there reads its params as inline.
    double = lambda next_getter, value, context: next_getter(2.0 * value)

    def body(f):
      def with_getter(x):
        with hk.custom_getter(double):
          return f(x)

      return with_getter

    block = custom_grad.custom_vjp(stateful_dropout_mlp, fwd_remat, bwd_remat)
    assert_same_as_inline(self, body(block), body(stateful_dropout_mlp))

  def test_scaled_weight_gradient(self):
    # The block's weights learn at half speed; the input cotangent stays
    # exact, so the layer before the block keeps its true gradient.
    def half(vjp_fn, g):
      params_ct, x_ct = vjp_fn(g)
      return jax.tree.map(lambda c: 0.5 * c, params_ct), x_ct

    bridged = hk.transform(deep(custom_grad.custom_vjp(mlp, custom_grad.vjp_fwd, half)))
    inline = hk.transform(deep(mlp))
    params = inline.init(KEY, X)
    loss = lambda f: jax.grad(lambda p: jnp.sum(f.apply(p, None, X) ** 2))
    got, want = loss(bridged)(params), loss(inline)(params)
    for name in want:
      scale = 0.5 if "/mlp/" in name else 1.0
      chex.assert_trees_all_close(
        got[name], jax.tree.map(lambda w, s=scale: s * w, want[name]), **TOL
      )

  def test_each_argument_gets_its_own_cotangent(self):
    # Two differentiable arguments of one shape, the true rule: each
    # argument's gradient is jax.grad's of the same function inline.
    f = lambda x, y: mlp(x) * jnp.sin(y)
    block = custom_grad.custom_vjp(f, custom_grad.vjp_fwd, true_bwd)
    grads = [
      jax.grad(lambda p, x, y, g=g: jnp.sum(g.apply(p, None, x, y)), argnums=(1, 2))
      for g in map(hk.transform, (block, f))
    ]
    params = hk.transform(f).init(KEY, X, X)
    chex.assert_trees_all_close(grads[0](params, X, 2 * X), grads[1](params, X, 2 * X), **TOL)

  def test_nondiff_argnums_stay_python_values(self):
    def f(x, flag, power):
      # Python control flow: fails if either is traced.
      assert isinstance(flag, bool) and isinstance(power, int), (flag, power)
      y = hk.Linear(4)(x)
      return y**power if flag else -y

    seen = []

    def fwd(f_pure, params, x, flag, power):
      seen.append((flag, power))
      return jax.vjp(lambda p, x: f_pure(p, x, flag, power), params, x)

    for fwd_rule in (fwd, custom_grad.vjp_fwd):
      block = custom_grad.custom_vjp(f, fwd_rule, true_bwd, nondiff_argnums=(1, 2))
      for flag in (True, False):
        assert_same_as_inline(
          self, deep(lambda x: block(x, flag, 3)), deep(lambda x: f(x, flag, 3))
        )
    self.assertEqual(seen, [(True, 3), (False, 3)])

  def test_under_hk_vmap(self):
    block = custom_grad.custom_vjp(stateful_dropout_mlp, custom_grad.vjp_fwd, true_bwd)
    # One rng for the batch (split_rng=False): the same mask per example.
    vmapped = lambda f: lambda x: hk.vmap(f, split_rng=False)(x)
    assert_same_as_inline(self, deep(vmapped(block)), deep(vmapped(stateful_dropout_mlp)))

  def test_inside_layer_scan_with_remat(self):
    block = custom_grad.custom_vjp(stateful_dropout_mlp, custom_grad.vjp_fwd, true_bwd)
    stack = lambda f: (
      lambda x: layer_scan.layer_scan(lambda c, _: (c + f(c), None), x, num_layers=3, remat=True)[0]
    )
    assert_same_as_inline(self, deep(stack(block)), deep(stack(stateful_dropout_mlp)))


# ---------------------------------------------------------------------------
# Routing: the motivating case, against a stop_gradient reference.
# ---------------------------------------------------------------------------

WIDTH = 4
MASKS = {"a": jnp.arange(WIDTH) < WIDTH // 2, "b": jnp.arange(WIDTH) >= WIDTH // 2}
ROUTE = {"layer1": "a", "layer2": "b"}


class TwoLayers(hk.Module):
  """The routed block's forward pass: layer1 then layer2."""

  def __call__(self, x):
    h = jnp.tanh(hk.Linear(6, name="layer1")(x))
    return hk.Linear(WIDTH, name="layer2")(h)


def two_layers(x):
  return TwoLayers(name="block")(x)


routed_bwd = custom_grad.route_cotangents(
  lambda g: {piece: jnp.where(mask, g, 0.0) for piece, mask in MASKS.items()},
  lambda cts: (
    {f"block/{layer}": cts[piece][0][f"block/{layer}"] for layer, piece in ROUTE.items()},
    cts["a"][1] + cts["b"][1],
  ),
)
routed = custom_grad.custom_vjp(two_layers, custom_grad.vjp_fwd, routed_bwd)


def reference_routed(x):
  """The same routing by `lax.stop_gradient`, with no vjp and no vmap.

  The value is `sum_p mask_p * block(x)` = `block(x)`. In the term of piece
  p, a custom getter stops the gradient of the layers routed elsewhere, so
  JAX's own gradient of that term reaches only piece p's layers (and x).
  """
  block = TwoLayers(name="block")  # One module called twice: shared weights.
  y = 0.0
  for piece, mask in MASKS.items():

    def getter(next_getter, value, context, piece=piece):
      value = next_getter(value)
      layer = context.module_name.rsplit("/", 1)[-1]
      return value if ROUTE[layer] == piece else jax.lax.stop_gradient(value)

    with hk.custom_getter(getter):
      y = y + jnp.where(mask, block(x), 0.0)
  return y


class RouteCotangentsTest(parameterized.TestCase):
  def _assert_routed(self, wrap):
    ours = hk.transform(deep(wrap(lambda x: routed(x) * routed(x))))
    reference = hk.transform(deep(wrap(lambda x: reference_routed(x) * reference_routed(x))))
    plain = hk.transform(deep(wrap(lambda x: two_layers(x) * two_layers(x))))
    params = ours.init(KEY, X)
    chex.assert_trees_all_equal(params, plain.init(KEY, X))
    loss = lambda f: jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(f.apply(p, None, X)))))
    got = loss(ours)(params)
    chex.assert_trees_all_close(got, loss(reference)(params), **TOL)
    # The routing changed the routed weights, and only them.
    true = loss(plain)(params)
    for name in true:
      changed = not jnp.allclose(got[name]["w"], true[name]["w"], **TOL)
      self.assertEqual(changed, "/block" in name, name)

  def test_deep_in_modules_two_call_sites(self):
    self._assert_routed(lambda f: f)

  def test_under_hk_vmap(self):
    self._assert_routed(lambda f: lambda x: hk.vmap(f, split_rng=False)(x))

  def test_inside_layer_scan(self):
    self._assert_routed(
      lambda f: (
        lambda x: layer_scan.layer_scan(lambda c, _: (jnp.tanh(f(c)), None), x, num_layers=2)[0]
      )
    )


# ---------------------------------------------------------------------------
# custom_jvp.
# ---------------------------------------------------------------------------


class CustomJvpTest(parameterized.TestCase):
  def test_true_jvp_matches_inline(self):
    block = custom_grad.custom_jvp(stateful_dropout_mlp, true_jvp)
    params, state = assert_same_as_inline(self, deep(block), deep(stateful_dropout_mlp))
    # Forward mode too, against inline.
    outs = [
      jax.jvp(
        lambda p, f=f: f.apply(p, state, KEY, X)[0],
        (params,),
        (jax.tree.map(jnp.ones_like, params),),
      )
      for f in (
        hk.transform_with_state(deep(block)),
        hk.transform_with_state(deep(stateful_dropout_mlp)),
      )
    ]
    chex.assert_trees_all_close(outs[0], outs[1], **TOL)

  def test_integer_output_has_float0_tangents(self):
    # jax.jvp gives an integer output a float0 tangent: the rule may too.
    f = lambda x: (mlp(x), jnp.argmax(x, axis=-1))
    body = lambda f: lambda x: (lambda y, i: y * i[:, None])(*f(x))
    assert_same_as_inline(self, body(custom_grad.custom_jvp(f, true_jvp)), body(f))

  def test_check_grads_both_modes(self):
    block = custom_grad.custom_jvp(mlp, true_jvp)
    f = hk.transform(deep(block))
    params = f.init(KEY, X)
    jtu.check_grads(
      lambda p, x: f.apply(p, None, x),
      (params, X),
      order=2,
      modes=["fwd", "rev"],
      **backend_tolerance.numerical(),
    )

  def test_straight_through_matches_stop_gradient_reference(self):
    def quantized(x):
      return jnp.round(hk.Linear(4)(x) * 4.0)

    smooth = hk.transform(lambda x: hk.Linear(4)(x) * 4.0)

    def straight_through(f_pure, primals, tangents):
      # params carry the inner's names, so a surrogate from the same
      # modules takes them as they are.
      surrogate = lambda p, x: smooth.apply(p, None, x)
      return f_pure(*primals), jax.jvp(surrogate, primals, tangents)[1]

    def reference(x):
      y = hk.Linear(4)(x) * 4.0
      return y + jax.lax.stop_gradient(jnp.round(y) - y)

    block = custom_grad.custom_jvp(quantized, straight_through)
    ours, ref = (hk.transform(deep(f)) for f in (block, reference))
    params = ref.init(KEY, X)
    chex.assert_trees_all_equal(ours.init(KEY, X), params)
    loss = lambda f: jax.grad(lambda p: jnp.sum(f.apply(p, None, X) ** 2))
    chex.assert_trees_all_close(loss(ours)(params), loss(ref)(params), **TOL)

  def test_nondiff_tangent_is_none(self):
    def f(x, power):
      assert isinstance(power, int), power
      return hk.Linear(4)(x) ** power

    def jvp(f_pure, primals, tangents):
      self.assertIsNone(tangents[2])
      (params, x, power), (dp, dx, _) = primals, tangents
      return jax.jvp(lambda p, x: f_pure(p, x, power), (params, x), (dp, dx))

    block = custom_grad.custom_jvp(f, jvp, nondiff_argnums=(1,))
    assert_same_as_inline(self, deep(lambda x: block(x, 3)), deep(lambda x: f(x, 3)))

  def test_inside_layer_scan_and_hk_vmap(self):
    block = custom_grad.custom_jvp(stateful_dropout_mlp, true_jvp)
    wrap = lambda f: (
      lambda x: layer_scan.layer_scan(
        lambda c, _: (c + hk.vmap(f, split_rng=False)(c), None), x, num_layers=2
      )[0]
    )
    assert_same_as_inline(self, deep(wrap(block)), deep(wrap(stateful_dropout_mlp)))


# ---------------------------------------------------------------------------
# Misuse: errors that say what was expected.
# ---------------------------------------------------------------------------


def grad_of(block, *args):
  f = hk.transform(lambda x: block(x, *args))
  params = f.init(KEY, X)
  return jax.grad(lambda p: jnp.sum(f.apply(p, None, X)))(params)


def tagged(x):
  """An output with static leaves beside the array: a tag, a count, a size."""
  return stateful_dropout_mlp(x), "tag", 3, {"size": np.int64(2)}


def tagged_jvp(f_pure, primals, tangents):
  out = f_pure(*primals)
  out_dot = jax.jvp(lambda *a: f_pure(*a)[0], primals, tangents)[1]
  return out, (out_dot, None, None, {"size": None})


class StaticOutputTest(parameterized.TestCase):
  """Issue 27, row 11: non-array output leaves pass through, as inline.

  A Python value returned beside the arrays (fine inline) was accepted at
  init and refused at apply. It now comes back as it is, its cotangent or
  tangent None, and the arrays' derivative is inline's.
  """

  @parameterized.named_parameters(
    ("vjp", lambda: custom_grad.custom_vjp(tagged, custom_grad.vjp_fwd, true_bwd)),
    ("jvp", lambda: custom_grad.custom_jvp(tagged, tagged_jvp)),
  )
  def test_static_leaves_as_inline(self, make):
    block = make()
    assert_same_as_inline(self, deep(lambda x: block(x)[0]), deep(lambda x: tagged(x)[0]))
    ours = hk.transform_with_state(deep(block))
    theirs = hk.transform_with_state(deep(tagged))
    params, state = theirs.init(KEY, X)
    (out, *static), _ = ours.apply(params, state, KEY, X)
    (expected, *expected_static), _ = theirs.apply(params, state, KEY, X)
    self.assertEqual(static, expected_static)
    self.assertEqual([type(s) for s in static], [type(s) for s in expected_static])
    self.assertIs(type(static[2]["size"]), np.int64)
    chex.assert_trees_all_close(out, expected, **TOL)

  def test_bwd_gets_none_at_static_leaves(self):
    seen = []

    def bwd(vjp_fn, g):
      seen.append(jax.tree.map(jnp.shape, g))
      return vjp_fn(g)

    block = custom_grad.custom_vjp(tagged, custom_grad.vjp_fwd, bwd)
    f = hk.transform_with_state(lambda x: block(x)[0])
    params, state = f.init(KEY, X)
    jax.grad(lambda p: jnp.sum(f.apply(p, state, KEY, X)[0]))(params)
    self.assertEqual(seen, [((3, 4), None, None, {"size": None})])

  def test_vjp_fn_takes_a_cotangent_with_the_static_values(self):
    # vjp_fwd's closure takes a cotangent shaped like `out` with anything at
    # its static leaves, the static values themselves too.
    f = lambda x: (mlp(x), "tag", 3)
    bwd = lambda vjp_fn, g: vjp_fn((g[0], "tag", 3))
    block = custom_grad.custom_vjp(f, custom_grad.vjp_fwd, bwd)
    chex.assert_trees_all_close(grad_of(lambda x: block(x)[0]), grad_of(lambda x: f(x)[0]), **TOL)

  def test_forward_mode_through_the_jvp_block(self):
    block = custom_grad.custom_jvp(tagged, tagged_jvp)
    fs = [hk.transform_with_state(lambda x, f=f: f(x)[0]) for f in (block, tagged)]
    params, state = fs[1].init(KEY, X)
    tangent = jax.tree.map(jnp.ones_like, params)
    got, want = [
      jax.jvp(lambda p, f=f: f.apply(p, state, KEY, X)[0], (params,), (tangent,)) for f in fs
    ]
    chex.assert_trees_all_close(got, want, **TOL)


class ErrorsTest(parameterized.TestCase):
  def test_bwd_wrong_length(self):
    block = custom_grad.custom_vjp(mlp, custom_grad.vjp_fwd, lambda vjp_fn, g: vjp_fn(g)[0])
    with self.assertRaisesRegex(ValueError, r"bwd must return \(params_ct, \*args_cts\)"):
      grad_of(block)

  def test_bwd_counting_nondiff_args(self):
    block = custom_grad.custom_vjp(
      lambda x, flag: mlp(x),
      custom_grad.vjp_fwd,
      lambda vjp_fn, g: (*vjp_fn(g), None),
      nondiff_argnums=(1,),
    )
    with self.assertRaisesRegex(ValueError, r"nondiff_argnums \[1\] get none"):
      grad_of(block, True)

  def test_bwd_wrong_params_structure(self):
    def bwd(vjp_fn, g):
      params_ct, x_ct = vjp_fn(g)
      return {"w": params_ct["mlp/~/linear_0"]["w"]}, x_ct

    block = custom_grad.custom_vjp(mlp, custom_grad.vjp_fwd, bwd)
    with self.assertRaisesRegex(ValueError, "cotangent for params must have the structure"):
      grad_of(block)

  def test_bwd_wrong_shape_names_path(self):
    def bwd(vjp_fn, g):
      params_ct, x_ct = vjp_fn(g)
      return params_ct, x_ct.T

    block = custom_grad.custom_vjp(mlp, custom_grad.vjp_fwd, bwd)
    with self.assertRaisesRegex(
      ValueError,
      r"cotangent for args\[0\] at <root> has shape "
      r"\[4, 3\], but args\[0\] there is "
      r"float32\[3, 4\]",
    ):
      grad_of(block)

  def test_bwd_array_for_a_subtree_of_params(self):
    def bwd(vjp_fn, g):
      params_ct, x_ct = vjp_fn(g)
      return {**params_ct, "mlp/~/linear_1": jnp.zeros([4])}, x_ct

    block = custom_grad.custom_vjp(mlp, custom_grad.vjp_fwd, bwd)
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.custom_vjp: bwd's cotangent "
      r"for params has an array at "
      r"\['mlp/~/linear_1'\], where params has a "
      r"subtree PyTreeDef\(\{'b': \*, 'w': \*\}\)",
    ):
      grad_of(block)

  def test_bwd_none_means_zero(self):
    def bwd(vjp_fn, g):
      params_ct, _ = vjp_fn(g)
      return {"mlp/~/linear_0": params_ct["mlp/~/linear_0"], "mlp/~/linear_1": None}, None

    grads = grad_of(custom_grad.custom_vjp(mlp, custom_grad.vjp_fwd, bwd))
    chex.assert_trees_all_equal(
      grads["mlp/~/linear_1"], jax.tree.map(jnp.zeros_like, grads["mlp/~/linear_1"])
    )

  def test_fwd_not_a_pair(self):
    block = custom_grad.custom_vjp(mlp, lambda f_pure, p, x: f_pure(p, x), true_bwd)
    with self.assertRaisesRegex(TypeError, r"fwd must return a pair"):
      grad_of(block)

  def test_jvp_not_a_pair(self):
    block = custom_grad.custom_jvp(
      mlp, lambda f_pure, primals, tangents: jax.jvp(f_pure, primals, tangents)[1]
    )
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.custom_jvp: jvp must return "
      r"a pair \(out, out_dot\); got ",
    ):
      grad_of(block)

  def test_fwd_wrong_output(self):
    block = custom_grad.custom_vjp(mlp, lambda f_pure, p, x: (f_pure(p, x)[0], None), true_bwd)
    with self.assertRaisesRegex(
      ValueError,
      r"fwd's out at <root> is "
      r"float32\[4\], but f's output there is "
      r"float32\[3, 4\]",
    ):
      grad_of(block)

  def test_fwd_output_not_an_array(self):
    block = custom_grad.custom_vjp(mlp, lambda f_pure, p, x: ("out", None), true_bwd)
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.custom_vjp: fwd's out at "
      r"<root> is a str 'out', but f's output there "
      r"is float32\[3, 4\]",
    ):
      grad_of(block)

  def test_jvp_wrong_output(self):
    def jvp(f_pure, primals, tangents):
      out, out_dot = jax.jvp(f_pure, primals, tangents)
      return out[0], out_dot

    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.custom_jvp: jvp's out at "
      r"<root> is float32\[4\], but f's output "
      r"there is float32\[3, 4\]",
    ):
      grad_of(custom_grad.custom_jvp(mlp, jvp))

  def test_fwd_another_static_output(self):
    block = custom_grad.custom_vjp(
      lambda x: (mlp(x), "tag"),
      lambda f_pure, p, x: ((f_pure(p, x)[0], "other"), None),
      lambda r, g: (None, None),
    )
    with self.assertRaisesRegex(
      ValueError,
      r"fwd's out at \[1\] is a str "
      r"'other', but f's output there is a str "
      r"'tag'",
    ):
      grad_of(lambda x: block(x)[0])
    # An equal value of another type is another output too.
    block = custom_grad.custom_vjp(
      lambda x: (mlp(x), 3),
      lambda f_pure, p, x: ((f_pure(p, x)[0], 3.0), None),
      lambda r, g: (None, None),
    )
    with self.assertRaisesRegex(
      ValueError,
      r"fwd's out at \[1\] is .*3\.0.*"
      r"f's output there is .*3",
    ):
      grad_of(lambda x: block(x)[0])

  def test_jvp_wrong_tangent(self):
    def jvp(f_pure, primals, tangents):
      out, out_dot = jax.jvp(f_pure, primals, tangents)
      return out, out_dot.astype(jnp.float16)

    with self.assertRaisesRegex(
      ValueError,
      r"jvp's out_dot at <root> is "
      r"float16\[3, 4\], but f's output there is "
      r"float32\[3, 4\]",
    ):
      grad_of(custom_grad.custom_jvp(mlp, jvp))

  def test_split_wrong_piece(self):
    bwd = custom_grad.route_cotangents(lambda g: {"a": g[0]}, lambda cts: cts["a"])
    block = custom_grad.custom_vjp(mlp, custom_grad.vjp_fwd, bwd)
    with self.assertRaisesRegex(
      ValueError, "piece 'a' at <root> is float32\\[4\\].*shaped like the whole output cotangent"
    ):
      grad_of(block)

  def test_split_returns_no_piece(self):
    bwd = custom_grad.route_cotangents(lambda g: {}, lambda cts: cts)
    block = custom_grad.custom_vjp(mlp, custom_grad.vjp_fwd, bwd)
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.route_cotangents: split must "
      r"return a non-empty dict \{name: piece\}; "
      r"got an empty dict\.",
    ):
      grad_of(block)

  def test_keyword_arguments(self):
    block = custom_grad.custom_vjp(
      lambda x, scale=1.0: mlp(x) * scale, custom_grad.vjp_fwd, true_bwd
    )
    with self.assertRaisesRegex(TypeError, "positional arguments only"):
      hk.transform(lambda x: block(x, scale=2.0)).init(KEY, X)

  def test_traced_nondiff_argument(self):
    block = custom_grad.custom_vjp(
      lambda x, s: mlp(x) * s, custom_grad.vjp_fwd, true_bwd, nondiff_argnums=(1,)
    )
    f = hk.transform(lambda x, s: block(x, s))
    with self.assertRaisesRegex(TypeError, "holds a traced array"):
      jax.jit(f.init)(KEY, X, 2.0)

  def test_non_array_argument_needs_nondiff(self):
    block = custom_grad.custom_vjp(
      lambda x, act: getattr(jax.nn, act)(mlp(x)), custom_grad.vjp_fwd, true_bwd
    )
    with self.assertRaisesRegex(
      TypeError, "argument 1 holds a str at <root>.*Put its position in nondiff_argnums"
    ):
      hk.transform(lambda x: block(x, "relu")).init(KEY, X)

  def test_nondiff_position_out_of_range(self):
    block = custom_grad.custom_vjp(mlp, custom_grad.vjp_fwd, true_bwd, nondiff_argnums=(1,))
    with self.assertRaisesRegex(ValueError, "called with 1 positional"):
      hk.transform(block).init(KEY, X)

  def test_outside_transform(self):
    block = custom_grad.custom_vjp(mlp, custom_grad.vjp_fwd, true_bwd)
    with self.assertRaisesRegex(ValueError, "inside a Haiku transform"):
      block(X)


if __name__ == "__main__":
  absltest.main()
