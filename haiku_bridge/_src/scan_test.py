"""Tests for layer_scan: against hk.layer_stack and an unrolled Python loop."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax
from jax import test_util as jtu
import jax.numpy as jnp

from haiku_bridge._src import call_pure
from haiku_bridge._src import scan
from testing import test_utils

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), [2, 4])
DEPTH = 3
STACK = scan.NO_PER_LAYER_NAME


def block(x):
  """A layer with nested modules and a top-level parameter."""
  h = hk.nets.MLP([8, x.shape[-1]], activation=jnp.tanh)(x)
  return x + h * hk.get_parameter("gate", [], init=jnp.ones)


def dropout_block(x):
  return hk.dropout(hk.next_rng_key(), 0.3, block(x))


def counting_block(x):
  n = hk.get_state("n", [], jnp.float32, init=jnp.zeros)
  hk.set_state("n", n + jnp.sum(x))
  return block(x) + n


def loop(layer, carry, xs=None, *, num_layers=DEPTH, reverse=False):
  """The reference: layer i under name scope layer_i, keys as layer_scan draws them."""
  hk.maybe_next_rng_key()
  key = hk.maybe_next_rng_key()
  keys = None if key is None else jax.random.split(key, num_layers)
  ys = [None] * num_layers
  order = range(num_layers - 1, -1, -1) if reverse else range(num_layers)
  for i in order:
    x = None if xs is None else jax.tree.map(lambda a, i=i: a[i], xs)
    with hk.name_scope(f"layer_{i}"):
      if keys is None:
        carry, ys[i] = layer(carry, x)
      else:
        with hk.with_rng(keys[i]):
          carry, ys[i] = layer(carry, x)
  if ys[0] is None:
    return carry, None
  return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)


def as_carry_layer(f):
  return lambda c, _: (f(c), None)


class LayerStackParityTest(parameterized.TestCase):
  """Same names, layout, init values and outputs as hk.layer_stack."""

  @parameterized.named_parameters(("plain", block),
                                  ("dropout", dropout_block))
  def test_no_per_layer_inputs(self, layer):
    ours = hk.transform(lambda x: scan.repeat_layer(layer, x, DEPTH))
    theirs = hk.transform(lambda x: hk.layer_stack(DEPTH)(layer)(x))
    p_ours, p_theirs = ours.init(KEY, X), theirs.init(KEY, X)
    chex.assert_trees_all_equal(p_ours, p_theirs)
    self.assertEqual(sorted(p_ours), [f"{STACK}/mlp/~/linear_0",
                                      f"{STACK}/mlp/~/linear_1", f"{STACK}/~"])
    chex.assert_trees_all_close(ours.apply(p_theirs, KEY, X),
                                theirs.apply(p_theirs, KEY, X), rtol=1e-6)

  def test_with_per_layer_inputs_in_module(self):
    xs = jax.random.normal(KEY, [DEPTH, 4])

    def layer(c, x):
      return block(c + x), jnp.sum(c)

    class Net(hk.Module):

      def __call__(self, x, xs, ours):
        if ours:
          return scan.layer_scan(layer, x, xs)
        return hk.layer_stack(DEPTH, with_per_layer_inputs=True)(layer)(x, xs)

    ours = hk.transform(lambda x, xs: Net()(x, xs, True))
    theirs = hk.transform(lambda x, xs: Net()(x, xs, False))
    p_ours, p_theirs = ours.init(KEY, X, xs), theirs.init(KEY, X, xs)
    chex.assert_trees_all_equal(p_ours, p_theirs)
    self.assertIn(f"net/{scan.WITH_PER_LAYER_NAME}/~", p_ours)
    chex.assert_trees_all_close(ours.apply(p_theirs, None, X, xs),
                                theirs.apply(p_theirs, None, X, xs), rtol=1e-6)


  def test_getters_see_each_layers_params(self):
    seen = []

    def fake_quant(next_getter, value, context):
      seen.append((context.full_name, tuple(value.shape)))
      scale = jnp.max(jnp.abs(value)) / 7  # Per tensor: per layer, here.
      return next_getter(jnp.round(value / scale) * scale)

    def under_getter(stack):
      def f(x):
        with hk.custom_getter(fake_quant):
          return stack(x)
      return hk.transform(f)

    ours = under_getter(lambda x: scan.repeat_layer(block, x, DEPTH))
    theirs = under_getter(lambda x: hk.layer_stack(DEPTH)(block)(x))
    params = theirs.init(KEY, X)
    chex.assert_trees_all_equal(ours.init(KEY, X), params)
    seen.clear()
    out_theirs = theirs.apply(params, None, X)
    seen_theirs = list(seen)
    seen.clear()
    chex.assert_trees_all_equal(ours.apply(params, None, X), out_theirs)
    self.assertEqual(seen, seen_theirs)
    self.assertIn(("mlp/~/linear_0/w", (4, 8)), seen)

  def test_state(self):
    # Each layer's state is initialised from the carry that reaches it.
    ours = hk.transform_with_state(
        lambda x: scan.repeat_layer(counting_block, x, DEPTH))
    theirs = hk.transform_with_state(
        lambda x: hk.layer_stack(DEPTH)(counting_block)(x))
    (p_ours, s_ours), (p_theirs, s_theirs) = (ours.init(KEY, X),
                                              theirs.init(KEY, X))
    chex.assert_trees_all_equal((p_ours, s_ours), (p_theirs, s_theirs))
    loss = lambda apply: lambda p: jnp.sum(apply(p, s_theirs, None, X)[0]**2)
    chex.assert_trees_all_equal(jax.grad(loss(ours.apply))(p_theirs),
                                jax.grad(loss(theirs.apply))(p_theirs))
    chex.assert_trees_all_equal(ours.apply(p_theirs, s_theirs, None, X),
                                theirs.apply(p_theirs, s_theirs, None, X))


class UnrolledLoopTest(parameterized.TestCase):
  """Outputs and gradients equal a Python loop over the same params."""

  def _assert_matches_loop(self, layer, xs=None, *, state=False, rtol=1e-5,
                           **options):
    reverse = options.get("reverse", False)
    ours = hk.transform_with_state(
        lambda x, xs: scan.layer_scan(layer, x, xs, num_layers=DEPTH,
                                      **options))
    ref = hk.transform_with_state(
        lambda x, xs: loop(layer, x, xs, reverse=reverse))
    params, st = ours.init(KEY, X, xs)
    to_loop = lambda tree: scan.unstack_params(tree, stack=STACK if xs is None
                                               else scan.WITH_PER_LAYER_NAME,
                                               num_layers=DEPTH)
    loop_params, loop_state = to_loop(params), to_loop(st)
    # The loop creates exactly the per-layer names the mapping gives.
    ref_params, ref_state = ref.init(KEY, X, xs)
    self.assertEqual(test_utils.param_shapes(ref_params),
                     test_utils.param_shapes(loop_params))
    self.assertEqual(test_utils.param_shapes(ref_state),
                     test_utils.param_shapes(loop_state))

    def loss(apply, p, s):
      (carry, ys), new_s = apply(p, s, KEY, X, xs)
      total = jnp.sum(carry ** 2) + sum(jnp.sum(y) for y in jax.tree.leaves(ys))
      return total, (carry, ys, new_s)

    (l_ours, (c_ours, ys_ours, s_ours)), g_ours = jax.value_and_grad(
        lambda p: loss(ours.apply, p, st), has_aux=True)(params)
    (l_ref, (c_ref, ys_ref, s_ref)), g_ref = jax.value_and_grad(
        lambda p: loss(ref.apply, p, loop_state), has_aux=True)(loop_params)
    tol = dict(rtol=rtol, atol=1e-5)
    chex.assert_trees_all_close((l_ours, c_ours, ys_ours),
                                (l_ref, c_ref, ys_ref), **tol)
    chex.assert_trees_all_close(to_loop(g_ours), g_ref, **tol)
    if state:
      chex.assert_trees_all_close(to_loop(s_ours), s_ref, **tol)
      self.assertFalse(jax.tree.leaves(
          jax.tree.map(lambda a, b: bool((a == b).all()), s_ours, st))[0])

  @parameterized.product(remat=(False, True), reverse=(False, True))
  def test_plain(self, remat, reverse):
    self._assert_matches_loop(as_carry_layer(block), remat=remat,
                              reverse=reverse)

  def test_remat_policy(self):
    self._assert_matches_loop(
        as_carry_layer(block), remat=True,
        remat_policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)

  @parameterized.parameters(False, True)
  def test_state(self, reverse):
    # Each layer's state starts from the carry that reaches it (as
    # hk.layer_stack does), so it grows with depth and the loop's different
    # float summation order shows at 4e-5 relative; hk.layer_stack itself is
    # matched bit for bit in LayerStackParityTest.test_state.
    self._assert_matches_loop(as_carry_layer(counting_block), state=True,
                              reverse=reverse, rtol=1e-4)

  @parameterized.parameters(False, True)
  def test_dropout_rng_per_layer(self, remat):
    self._assert_matches_loop(as_carry_layer(dropout_block), remat=remat)

  def test_xs_and_ys(self):
    xs = {"shift": jax.random.normal(KEY, [DEPTH, 4])}
    self._assert_matches_loop(
        lambda c, x: (block(c + x["shift"]), {"norm": jnp.sum(c ** 2)}), xs,
        unroll=2)

  def test_transformed_layer(self):
    layer = hk.transform(lambda c, _: (block(c), jnp.mean(c)))
    ours = hk.transform(lambda x: scan.layer_scan(layer, x,
                                                  num_layers=DEPTH))
    ref = hk.transform(lambda x: loop(lambda c, x: (block(c), jnp.mean(c)),
                                      x))
    params = ours.init(KEY, X)
    chex.assert_trees_all_close(
        ours.apply(params, None, X),
        ref.apply(scan.unstack_params(params, stack=STACK, num_layers=DEPTH),
                  None, X), rtol=1e-6)


def dense(params, x):
  return jnp.tanh(x @ params["w"] + params["b"])


def init_dense(rng, x):
  return {"w": jax.random.normal(rng, [x.shape[-1], x.shape[-1]]) * 0.5,
          "b": jnp.zeros([x.shape[-1]])}


class PureLayerTest(parameterized.TestCase):

  def test_check_grads(self):
    f = hk.transform(lambda x: scan.repeat_layer(dense, x, DEPTH,
                                                 init=init_dense))
    params = f.init(KEY, X)
    self.assertEqual(params[f"{STACK}/~"]["w"].shape, (DEPTH, 4, 4))
    jtu.check_grads(lambda p, x: f.apply(p, None, x), (params, X), order=2,
                    modes=["rev"], atol=1e-2, rtol=1e-2)

  def test_matches_loop_over_slices(self):
    f = hk.transform(lambda x: scan.repeat_layer(dense, x, DEPTH,
                                                 init=init_dense, remat=True))
    params = f.init(KEY, X)

    def reference(p, x):
      for i in range(DEPTH):
        x = dense(jax.tree.map(lambda a, i=i: a[i], p[f"{STACK}/~"]), x)
      return jnp.sum(x ** 2)

    chex.assert_trees_all_close(
        jax.grad(lambda p: jnp.sum(f.apply(p, None, X) ** 2))(params),
        jax.grad(reference)(params, X), rtol=1e-5, atol=1e-6)

  def test_custom_vjp_layer(self):
    # A layer whose backward pass scales the weight cotangent by 0.5: the
    # scan must carry the custom rule into every layer.
    @jax.custom_vjp
    def half_grad_dense(params, x):
      return dense(params, x)

    def fwd(params, x):
      return jax.vjp(dense, params, x)

    def bwd(vjp, g):
      p_ct, x_ct = vjp(g)
      return jax.tree.map(lambda t: 0.5 * t, p_ct), x_ct

    half_grad_dense.defvjp(fwd, bwd)
    f = hk.transform(lambda x: scan.repeat_layer(half_grad_dense, x, DEPTH,
                                                 init=init_dense))
    plain = hk.transform(lambda x: scan.repeat_layer(dense, x, DEPTH,
                                                     init=init_dense))
    params = f.init(KEY, X)
    loss = lambda t: lambda p: jnp.sum(t.apply(p, None, X) ** 2)
    chex.assert_trees_all_close(
        jax.grad(loss(f))(params),
        jax.tree.map(lambda g: 0.5 * g, jax.grad(loss(plain))(params)),
        rtol=1e-5, atol=1e-7)

  def test_stacked_init_with_own_scan(self):
    def stack(params, x):
      return jax.lax.scan(lambda h, p: (dense(p, h), None), x, params)[0]

    f = hk.transform(lambda x: call_pure.call_pure(
        stack, x, init=scan.stacked_init(init_dense, DEPTH), name="stack"))
    params = f.init(KEY, X)
    self.assertEqual(params["stack"]["w"].shape, (DEPTH, 4, 4))
    # Each layer is initialised independently.
    self.assertFalse(jnp.allclose(params["stack"]["w"][0],
                                  params["stack"]["w"][1]))
    g = hk.transform(lambda x: scan.repeat_layer(dense, x, DEPTH,
                                                 init=init_dense))
    chex.assert_trees_all_close(
        f.apply(params, None, X),
        g.apply({f"{STACK}/~": params["stack"]}, None, X), rtol=1e-6)

  def test_stacked_init_in_axes(self):
    xs = jnp.arange(DEPTH, dtype=jnp.float32)
    init = scan.stacked_init(lambda rng, x: {"v": x * jnp.ones([2])}, DEPTH,
                             in_axes=(0,))
    chex.assert_trees_all_equal(init(KEY, xs)["v"],
                                jnp.repeat(xs[:, None], 2, axis=1))


class StructureTest(absltest.TestCase):

  def test_trace_does_not_grow_with_depth(self):
    def eqns(depth):
      f = hk.transform(lambda x: scan.repeat_layer(block, x, depth))
      params = f.init(KEY, X)
      return sum(test_utils.primitive_counts(
          lambda p: f.apply(p, None, X), params).values())

    self.assertEqual(eqns(4), eqns(48))


class NameMappingTest(absltest.TestCase):

  def test_round_trip(self):
    f = hk.transform(lambda x: hk.nets.MLP([4])(x) + scan.repeat_layer(
        block, x, DEPTH, name="enc"))
    params = f.init(KEY, X)
    loop_params = scan.unstack_params(params, stack="enc", num_layers=DEPTH,
                                      layer_scope="blocks/layer_{i}")
    self.assertIn("blocks/layer_2/mlp/~/linear_0", loop_params)
    self.assertIn("blocks/layer_0", loop_params)  # the layer's own "gate".
    self.assertIn("mlp/~/linear_0", loop_params)  # untouched.
    chex.assert_trees_all_equal(
        scan.stack_params(loop_params, stack="enc", num_layers=DEPTH,
                          layer_scope="blocks/layer_{i}"), params)

  def test_missing_layer(self):
    with self.assertRaisesRegex(ValueError, r"enc/lin/w is missing for layers"
                                r" \[1\]"):
      scan.stack_params({"layer_0/lin": {"w": jnp.ones([1])}}, stack="enc",
                        num_layers=2)


class ErrorsTest(parameterized.TestCase):

  def test_xs_leading_axis(self):
    f = hk.transform(lambda x: scan.layer_scan(
        lambda c, x: (block(c + x), None), x, jnp.ones([DEPTH + 1, 4]),
        num_layers=DEPTH))
    with self.assertRaisesRegex(ValueError, r"xs has shape \(4, 4\).*"
                                "num_layers=3"):
      f.init(KEY, X)

  def test_carry_mismatch(self):
    f = hk.transform(lambda x: scan.repeat_layer(
        lambda x: hk.Linear(3)(x), x, DEPTH))
    with self.assertRaisesRegex(ValueError, r"got float32\[2, 4\] and "
                                r"returned float32\[2, 3\]"):
      f.init(KEY, X)

  @parameterized.parameters((0, ValueError), (-1, ValueError),
                            (2.0, TypeError), (True, TypeError))
  def test_bad_num_layers(self, n, error):
    f = hk.transform(lambda x: scan.repeat_layer(block, x, n))
    with self.assertRaisesRegex(error, "positive int"):
      f.init(KEY, X)

  def test_no_num_layers(self):
    f = hk.transform(lambda x: scan.layer_scan(as_carry_layer(block), x))
    with self.assertRaisesRegex(ValueError, "needs `num_layers=`"):
      f.init(KEY, X)


if __name__ == "__main__":
  absltest.main()
