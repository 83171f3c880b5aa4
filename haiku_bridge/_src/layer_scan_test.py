"""Tests for layer_scan: against hk.layer_stack and an unrolled Python loop."""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
from jax import test_util as jtu
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from haiku_bridge._src.remat import hlo_flops
from haiku_bridge._src.remat import loop as loop_lib
from haiku_bridge._src import pipeline as pipeline_lib
from haiku_bridge._src import layer_scan
from haiku_bridge._src.remat import scheduled_scan
from haiku_bridge._src import sharding
from haiku_bridge._src import unrolled_names
from testing import plan_fixtures
from testing import test_utils
from testing import transformer

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), [2, 4])
DEPTH = 3  # √3 divides nothing: "nested" runs groups of 2 and 1.
STACK = layer_scan.NO_PER_LAYER_NAME
REMAT_MODES = loop_lib.REMAT_MODES


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


def under_fake_quant(stack, seen):
  """`stack` under a custom getter that rounds each param it reads.

  The rounding is per tensor, so per layer when a layer's params are read;
  `(name, shape)` of each read goes to the list `seen`.
  """

  def fake_quant(next_getter, value, context):
    seen.append((context.full_name, tuple(value.shape)))
    scale = jnp.max(jnp.abs(value)) / 7
    return next_getter(jnp.round(value / scale) * scale)

  def f(x):
    with hk.custom_getter(fake_quant):
      return stack(x)

  return f


def as_carry_layer(f):
  return lambda c, _: (f(c), None)


class LayerStackParityTest(parameterized.TestCase):
  """Same names, stacked shapes, init values and outputs as hk.layer_stack."""

  @parameterized.named_parameters(("plain", block), ("dropout", dropout_block))
  def test_no_per_layer_inputs(self, layer):
    ours = hk.transform(lambda x: layer_scan.repeat_layer(layer, x, DEPTH))
    theirs = hk.transform(lambda x: hk.layer_stack(DEPTH)(layer)(x))
    p_ours, p_theirs = ours.init(KEY, X), theirs.init(KEY, X)
    chex.assert_trees_all_equal(p_ours, p_theirs)
    self.assertEqual(
      sorted(p_ours), [f"{STACK}/mlp/~/linear_0", f"{STACK}/mlp/~/linear_1", f"{STACK}/~"]
    )
    chex.assert_trees_all_close(
      ours.apply(p_theirs, KEY, X), theirs.apply(p_theirs, KEY, X), rtol=1e-6
    )

  def test_with_per_layer_inputs_in_module(self):
    xs = jax.random.normal(KEY, [DEPTH, 4])

    def layer(c, x):
      return block(c + x), jnp.sum(c)

    class Net(hk.Module):
      def __call__(self, x, xs, ours):
        if ours:
          return layer_scan.layer_scan(layer, x, xs)
        return hk.layer_stack(DEPTH, with_per_layer_inputs=True)(layer)(x, xs)

    ours = hk.transform(lambda x, xs: Net()(x, xs, True))
    theirs = hk.transform(lambda x, xs: Net()(x, xs, False))
    p_ours, p_theirs = ours.init(KEY, X, xs), theirs.init(KEY, X, xs)
    chex.assert_trees_all_equal(p_ours, p_theirs)
    self.assertIn(f"net/{layer_scan.WITH_PER_LAYER_NAME}/~", p_ours)
    chex.assert_trees_all_close(
      ours.apply(p_theirs, None, X, xs), theirs.apply(p_theirs, None, X, xs), rtol=1e-6
    )

  def test_getters_see_each_layers_params(self):
    seen = []
    under_getter = lambda stack: hk.transform(under_fake_quant(stack, seen))
    ours = under_getter(lambda x: layer_scan.repeat_layer(block, x, DEPTH))
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
    ours = hk.transform_with_state(lambda x: layer_scan.repeat_layer(counting_block, x, DEPTH))
    theirs = hk.transform_with_state(lambda x: hk.layer_stack(DEPTH)(counting_block)(x))
    (p_ours, s_ours), (p_theirs, s_theirs) = (ours.init(KEY, X), theirs.init(KEY, X))
    chex.assert_trees_all_equal((p_ours, s_ours), (p_theirs, s_theirs))
    loss = lambda apply: lambda p: jnp.sum(apply(p, s_theirs, None, X)[0] ** 2)
    chex.assert_trees_all_equal(
      jax.grad(loss(ours.apply))(p_theirs), jax.grad(loss(theirs.apply))(p_theirs)
    )
    chex.assert_trees_all_equal(
      ours.apply(p_theirs, s_theirs, None, X), theirs.apply(p_theirs, s_theirs, None, X)
    )


class UnrolledLoopTest(parameterized.TestCase):
  """Outputs and gradients equal a Python loop over the same params."""

  def _assert_matches_loop(self, layer, xs=None, *, state=False, rtol=1e-5, **options):
    reverse = options.get("reverse", False)
    ours = hk.transform_with_state(
      lambda x, xs: layer_scan.layer_scan(layer, x, xs, num_layers=DEPTH, **options)
    )
    ref = hk.transform_with_state(lambda x, xs: loop(layer, x, xs, reverse=reverse))
    params, st = ours.init(KEY, X, xs)
    stack = STACK if xs is None else layer_scan.WITH_PER_LAYER_NAME
    to_loop = lambda tree: unrolled_names.unstack_params(tree, stack=stack, num_layers=DEPTH)
    loop_params, loop_state = to_loop(params), to_loop(st)
    # The loop creates exactly the per-layer names the mapping gives.
    ref_params, ref_state = ref.init(KEY, X, xs)
    self.assertEqual(test_utils.param_shapes(ref_params), test_utils.param_shapes(loop_params))
    self.assertEqual(test_utils.param_shapes(ref_state), test_utils.param_shapes(loop_state))

    def loss(apply, p, s):
      (carry, ys), new_s = apply(p, s, KEY, X, xs)
      total = jnp.sum(carry**2) + sum(jnp.sum(y) for y in jax.tree.leaves(ys))
      return total, (carry, ys, new_s)

    (l_ours, (c_ours, ys_ours, s_ours)), g_ours = jax.value_and_grad(
      lambda p: loss(ours.apply, p, st), has_aux=True
    )(params)
    (l_ref, (c_ref, ys_ref, s_ref)), g_ref = jax.value_and_grad(
      lambda p: loss(ref.apply, p, loop_state), has_aux=True
    )(loop_params)
    tol = dict(rtol=rtol, atol=1e-5)
    chex.assert_trees_all_close((l_ours, c_ours, ys_ours), (l_ref, c_ref, ys_ref), **tol)
    chex.assert_trees_all_close(to_loop(g_ours), g_ref, **tol)
    if state:
      chex.assert_trees_all_close(to_loop(s_ours), s_ref, **tol)
      self.assertFalse(
        jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), s_ours, st))[0]
      )

  @parameterized.product(remat=REMAT_MODES, reverse=(False, True))
  def test_plain(self, remat, reverse):
    self._assert_matches_loop(as_carry_layer(block), remat=remat, reverse=reverse)

  def test_remat_policy(self):
    self._assert_matches_loop(
      as_carry_layer(block),
      remat=True,
      remat_policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    )

  @parameterized.product(reverse=(False, True), remat=(False, "nested"))
  def test_state(self, reverse, remat):
    # Each layer's state starts from the carry that reaches it (as
    # hk.layer_stack does), so it grows with depth and the loop's different
    # float summation order shows at 4e-5 relative; hk.layer_stack itself is
    # matched bit for bit in LayerStackParityTest.test_state.
    self._assert_matches_loop(
      as_carry_layer(counting_block), state=True, reverse=reverse, remat=remat, rtol=1e-4
    )

  @parameterized.parameters(*REMAT_MODES)
  def test_dropout_rng_per_layer(self, remat):
    self._assert_matches_loop(as_carry_layer(dropout_block), remat=remat)

  @parameterized.parameters(False, "nested", "binomial")
  def test_xs_and_ys(self, remat):
    xs = {"shift": jax.random.normal(KEY, [DEPTH, 4])}
    self._assert_matches_loop(
      lambda c, x: (block(c + x["shift"]), {"norm": jnp.sum(c**2)}), xs, unroll=2, remat=remat
    )

  def test_unroll_reaches_the_scan(self):
    # Cost only, so seen in the jaxpr: jax.lax.scan's own `unroll`.
    f = hk.transform(
      lambda x: layer_scan.layer_scan(lambda c, _: (block(c), None), x, num_layers=DEPTH, unroll=2)[
        0
      ]
    )
    jaxpr = jax.make_jaxpr(lambda p: f.apply(p, None, X))(f.init(KEY, X))
    self.assertEqual([e.params["unroll"] for e in jaxpr.eqns if e.primitive.name == "scan"], [2])

  def test_transformed_layer(self):
    layer = hk.transform(lambda c, _: (block(c), jnp.mean(c)))
    ours = hk.transform(lambda x: layer_scan.layer_scan(layer, x, num_layers=DEPTH))
    ref = hk.transform(lambda x: loop(lambda c, x: (block(c), jnp.mean(c)), x))
    params = ours.init(KEY, X)
    chex.assert_trees_all_close(
      ours.apply(params, None, X),
      ref.apply(unrolled_names.unstack_params(params, stack=STACK, num_layers=DEPTH), None, X),
      rtol=1e-6,
    )


class RematScheduleTest(parameterized.TestCase):
  """remat="nested" / "binomial": hk.layer_stack + hk.remat's values and gradients."""

  def _assert_matches_layer_stack(self, ours, theirs, *args, rng=KEY):
    """Same params and state at init; same outputs, state and gradients."""
    ours, theirs = (hk.transform_with_state(ours), hk.transform_with_state(theirs))
    params, state = theirs.init(KEY, *args)
    chex.assert_trees_all_equal(ours.init(KEY, *args), (params, state))

    def loss(apply):
      def f(p):
        out, new_state = apply(p, state, rng, *args)
        return sum(jnp.sum(o**2) for o in jax.tree.leaves(out)), (out, new_state)

      return jax.jit(jax.value_and_grad(f, has_aux=True))

    chex.assert_trees_all_close(
      loss(ours.apply)(params), loss(theirs.apply)(params), rtol=1e-6, atol=1e-6
    )

  @parameterized.parameters(
    ("nested", 3, None), ("nested", 10, 3), ("nested", 7, 1), ("binomial", 10, None)
  )
  def test_rng_per_layer(self, remat, depth, groups):
    self._assert_matches_layer_stack(
      lambda x: layer_scan.repeat_layer(dropout_block, x, depth, remat=remat, remat_groups=groups),
      lambda x: hk.layer_stack(depth)(hk.remat(dropout_block))(x),
      X,
    )

  @plan_fixtures.on_cpu_and_gpu(plan_fixtures.TOY_BYTES)
  def test_remat_groups_keep_the_carries_of_a_nested_checkpoint(self):
    # A plain stack whose carry outweighs a layer's weights, so the memory
    # a training step needs follows the carries kept. Ground truth: the
    # nested checkpoint by hand (jax.checkpoint of each group's scan of
    # jax.checkpoint of each layer), g groups of N / g layers, which keeps
    # about g + N / g carries: least near √N, more with 2 or 12 groups.
    depth, batch, width = 24, 256, 32

    def temporaries(f, *args):
      return hlo_flops.held(jax.jit(f).lower(*args).compile()).temporaries

    def ours(groups):
      net = hk.transform(
        lambda h: jnp.sum(
          layer_scan.layer_scan(
            lambda h, _: (jnp.tanh(hk.Linear(width, with_bias=False)(h)), None),
            h,
            num_layers=depth,
            remat="nested",
            remat_groups=groups,
          )[0]
          ** 2
        )
      )
      params = net.init(KEY, h)
      return temporaries(jax.grad(net.apply), params, None, h)

    def by_hand(groups):
      def loss(ws, h):
        def group(h, ws):
          layer = lambda h, w: (jnp.tanh(h @ w), None)
          return jax.lax.scan(jax.checkpoint(layer), h, ws)[0], None

        ws = ws.reshape(groups, depth // groups, width, width)
        return jnp.sum(jax.lax.scan(jax.checkpoint(group), h, ws)[0] ** 2)

      return temporaries(jax.grad(loss), jnp.ones([depth, width, width]), h)

    h = jnp.ones([batch, width])
    carry = batch * width * 4
    got = {g: (ours(g) / carry, by_hand(g) / carry) for g in (2, 4, 12)}
    for g in (2, 12):
      # Fewer carries near √N, by hand and here: 4 groups keep fewer than
      # 2 or 12 (the default, ≈√24, would keep the same for every count).
      self.assertGreater(got[g][1], got[4][1] + 2, got)
      self.assertGreater(got[g][0], got[4][0] + 2, got)
    for ours_carries, by_hand_carries in got.values():
      self.assertLessEqual(ours_carries, by_hand_carries, got)

  @parameterized.parameters(*loop_lib.REMAT_SCHEDULES)
  def test_reverse_with_state(self, remat):
    self._assert_matches_layer_stack(
      lambda x: layer_scan.repeat_layer(counting_block, x, 5, remat=remat, reverse=True),
      lambda x: hk.layer_stack(5)(hk.remat(counting_block))(x, reverse=True),
      X,
    )

  @parameterized.parameters(*loop_lib.REMAT_SCHEDULES)
  def test_xs_and_ys(self, remat):
    def layer(c, x):
      return dropout_block(c * x["gain"]), {"norm": jnp.sum(c**2)}

    xs = {"gain": 1 + jax.random.uniform(KEY, [6, 4])}
    self._assert_matches_layer_stack(
      lambda x, xs: layer_scan.layer_scan(layer, x, xs, remat=remat),
      lambda x, xs: hk.layer_stack(6, with_per_layer_inputs=True)(hk.remat(layer))(x, xs),
      X,
      xs,
    )

  @parameterized.parameters(*loop_lib.REMAT_SCHEDULES)
  def test_layer_closing_over_an_outer_param(self, remat):
    # The gradient of `scale` sums over the layers that close over it.
    def net(stack):
      def f(x):
        scale = hk.get_parameter("scale", [4], init=jnp.ones)
        return stack(lambda h: block(h) * scale, x)

      return f

    self._assert_matches_layer_stack(
      net(lambda layer, x: layer_scan.repeat_layer(layer, x, 6, remat=remat)),
      net(lambda layer, x: hk.layer_stack(6)(hk.remat(layer))(x)),
      X,
    )

  @parameterized.parameters(*loop_lib.REMAT_SCHEDULES)
  def test_getters_see_each_layers_params(self, remat):
    seen = []
    self._assert_matches_layer_stack(
      under_fake_quant(lambda x: layer_scan.repeat_layer(block, x, 5, remat=remat), seen),
      under_fake_quant(lambda x: hk.layer_stack(5)(hk.remat(block))(x), seen),
      X,
    )
    self.assertIn(("mlp/~/linear_0/w", (4, 8)), seen)
    self.assertNotIn(("mlp/~/linear_0/w", (5, 4, 8)), seen)

  @parameterized.parameters(*loop_lib.REMAT_SCHEDULES)
  def test_pure_layers_equal_remat(self, remat):
    # A pure layer and a jax.custom_vjp one: the same gradients as remat=True.
    for layer in (dense, half_grad_dense):
      grads = {}
      for mode in (True, remat):
        f = hk.transform(
          lambda x, mode=mode, layer=layer: layer_scan.repeat_layer(
            layer, x, 7, init=init_dense, remat=mode
          )
        )
        params = f.init(KEY, X)
        grads[mode] = jax.grad(lambda p, f=f: jnp.sum(f.apply(p, None, X) ** 2))(params)
      chex.assert_trees_all_close(grads[remat], grads[True], rtol=1e-6, atol=1e-6)

  @parameterized.parameters(*loop_lib.REMAT_SCHEDULES)
  def test_forward_mode_as_layer_stack_of_remat(self, remat):
    # Issue 27, row 10: jax.jvp / jacfwd / linearize raised "can't apply
    # forward-mode autodiff (jvp) to a custom_vjp function"; hk.layer_stack
    # of hk.remat gives them. Forward mode runs the remat=True scan.
    def derivatives(f, params):
      @jax.jit
      def all_of_them(params, x):
        apply = lambda p, x: f.apply(p, None, x)
        tangents = (jax.tree.map(jnp.ones_like, params), jnp.ones_like(x))
        linearized = ()
        if scheduled_scan.LINEARIZE_IS_FORWARD_MODE:
          y, linear = jax.linearize(apply, params, x)
          linearized = (y, linear(*tangents))
        return (
          jax.jvp(apply, (params, x), tangents),
          linearized,
          jax.jacfwd(apply, argnums=(0, 1))(params, x),
          jax.hessian(lambda x: jnp.sum(apply(params, x) ** 2))(x),
        )

      return all_of_them(params, X)

    ours = hk.transform(lambda x: layer_scan.repeat_layer(block, x, 4, remat=remat))
    theirs = hk.transform(lambda x: hk.layer_stack(4)(hk.remat(block))(x))
    params = theirs.init(KEY, X)
    chex.assert_trees_all_equal(ours.init(KEY, X), params)
    chex.assert_trees_all_close(
      derivatives(ours, params), derivatives(theirs, params), rtol=1e-5, atol=1e-5
    )

  def test_forward_mode_through_a_jit_inside_is_the_librarys_error(self):
    # The limit the docstring states: traced by jax.jit first, the scan
    # cannot see the forward mode applied later (jax.jvp(jax.jit(f))); the
    # error names the call, `remat` and the fix.
    f = hk.transform(lambda x: layer_scan.repeat_layer(block, x, 4, remat="nested"))
    params = f.init(KEY, X)
    apply = jax.jit(lambda p: f.apply(p, None, X))
    with self.assertRaisesRegex(
      TypeError,
      r'^hkb\.repeat_layer: `remat="nested"` runs its own '
      r"backward pass .* Put the jit outside",
    ):
      jax.jvp(apply, (params,), (params,))
    jax.jit(lambda p, t: jax.jvp(lambda p: f.apply(p, None, X), (p,), (t,)))(
      params, params
    )  # jax.jit outside: forward mode works.


class ShardedRematScheduleTest(parameterized.TestCase):
  """The schedules under sharding rules, on 8 CPU devices, against one device."""

  VOCAB, D_MODEL, HEADS, SEQ, LAYERS = 64, 32, 4, 4, 6

  def setUp(self):
    super().setUp()
    if jax.device_count() < 8:
      self.skipTest(f"needs 8 devices, jax has {jax.device_count()}.")
    if not pipeline_lib.jax_has_pipelines():
      # The tests place and run with these; the schedules do not use them.
      self.skipTest(f"jax {jax.__version__} has no jax.shard_map / set_mesh.")

  def _transformer(self, remat):
    return hk.transform(
      functools.partial(
        transformer.transformer,
        vocab=self.VOCAB,
        d_model=self.D_MODEL,
        heads=self.HEADS,
        layers=self.LAYERS,
        remat=remat,
      )
    )

  @parameterized.product(remat=loop_lib.REMAT_SCHEDULES, layer_axis=(None, "data"))
  def test_transformer_step_equals_one_device(self, remat, layer_axis):
    # The FSDP + tensor-parallel rules; with layer_axis="data", each "data"
    # group stores half of the layers instead.
    rules = transformer.RULES
    if layer_axis:
      rules = sharding.ShardingRules(
        [
          (pattern, P(*(None if e == "data" else e for e in spec))) for pattern, spec in rules.rules
        ],
        stacked={"layers": layer_axis},
      )
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    tokens = jax.random.randint(KEY, [8, self.SEQ], 0, self.VOCAB)
    f = self._transformer(remat)
    loss = lambda f: jax.value_and_grad(lambda p, t: jnp.mean(f.apply(p, None, t) ** 2))
    params = jax.device_get(jax.jit(f.init)(KEY, tokens))
    # One device, remat=True: the ground truth.
    expected = jax.jit(loss(self._transformer(True)))(params, tokens)

    shardings = sharding.param_shardings(params, mesh, rules)
    data = NamedSharding(mesh, P("data"))
    value, grads = jax.jit(
      loss(f), in_shardings=(shardings, data), out_shardings=(None, shardings)
    )(jax.device_put(params, shardings), jax.device_put(tokens, data))
    chex.assert_trees_all_close((value, grads), expected, rtol=1e-5, atol=1e-6)
    spec = grads["layers/mlp/~/linear_0"]["w"].sharding.spec
    self.assertEqual(spec, P(layer_axis, "data" if not layer_axis else None, "model"))

  @parameterized.parameters(*loop_lib.REMAT_SCHEDULES)
  def test_explicit_axes_gather_one_layer_at_a_time(self, remat):
    def layer(h):
      with hk.custom_getter(
        lambda next_getter, value, context: sharding.gather_over(next_getter(value), "data")
      ):
        return h + jnp.tanh(hk.Linear(h.shape[-1])(h))

    def step(remat):
      f = hk.transform(lambda x: layer_scan.repeat_layer(layer, x, 5, remat=remat))
      return f, jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(f.apply(p, None, x) ** 2)))

    x = jax.random.normal(KEY, [8, 16])
    f, ours = step(remat)
    params = jax.device_get(f.init(KEY, x))
    expected = step(True)[1](params, x)  # One device.
    # Explicit axes (jax.make_mesh's default from jax 0.9 only).
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rules = sharding.ShardingRules([(r"w$", P("data"))], stacked=[STACK])
    with jax.set_mesh(mesh):
      shardings = sharding.param_shardings(params, mesh, rules)
      value, grads = ours(jax.device_put(params, shardings), jax.device_put(x, P("data")))
    chex.assert_trees_all_close((value, grads), expected, rtol=1e-5, atol=1e-5)
    self.assertEqual(grads[f"{STACK}/linear"]["w"].sharding.spec, P(None, "data", None))

  @parameterized.product(remat=loop_lib.REMAT_SCHEDULES, check_vma=(True, False))
  def test_shard_map_data_parallel(self, remat, check_vma):
    f = hk.transform(lambda x: layer_scan.repeat_layer(dropout_block, x, 5, remat=remat))
    x = jax.random.normal(KEY, [16, 4])
    params = f.init(KEY, x)
    grad = jax.grad(lambda p, x: jnp.mean(f.apply(p, KEY, x) ** 2))
    # Each device's gradient over its own rows, as one device computes it.
    expected = jax.vmap(grad, in_axes=(None, 0))(params, x.reshape(8, 2, 4))
    if check_vma:
      # The params are invariant over "data": autodiff sums their gradient.
      local, out_specs = grad, P()
      expected = jax.tree.map(lambda g: jnp.sum(g, axis=0), expected)
    else:
      local = lambda p, x: jax.tree.map(lambda g: g[None], grad(p, x))
      out_specs = P("data")
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    grads = jax.jit(
      jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P("data")), out_specs=out_specs, check_vma=check_vma
      )
    )(params, x)
    chex.assert_trees_all_close(grads, expected, rtol=1e-5, atol=1e-5)


def dense(params, x):
  return jnp.tanh(x @ params["w"] + params["b"])


def init_dense(rng, x):
  return {
    "w": jax.random.normal(rng, [x.shape[-1], x.shape[-1]]) * 0.5,
    "b": jnp.zeros([x.shape[-1]]),
  }


@jax.custom_vjp
def half_grad_dense(params, x):
  """`dense`, whose backward pass halves the params' cotangent."""
  return dense(params, x)


def _half_grad_bwd(vjp, g):
  p_ct, x_ct = vjp(g)
  return jax.tree.map(lambda t: 0.5 * t, p_ct), x_ct


half_grad_dense.defvjp(lambda params, x: jax.vjp(dense, params, x), _half_grad_bwd)


class PureLayerTest(parameterized.TestCase):
  def test_check_grads(self):
    f = hk.transform(lambda x: layer_scan.repeat_layer(dense, x, DEPTH, init=init_dense))
    params = f.init(KEY, X)
    self.assertEqual(params[f"{STACK}/~"]["w"].shape, (DEPTH, 4, 4))
    jtu.check_grads(
      lambda p, x: f.apply(p, None, x), (params, X), order=2, modes=["rev"], atol=1e-2, rtol=1e-2
    )

  def test_matches_loop_over_slices(self):
    f = hk.transform(
      lambda x: layer_scan.repeat_layer(dense, x, DEPTH, init=init_dense, remat=True)
    )
    params = f.init(KEY, X)

    def reference(p, x):
      for i in range(DEPTH):
        x = dense(jax.tree.map(lambda a, i=i: a[i], p[f"{STACK}/~"]), x)
      return jnp.sum(x**2)

    chex.assert_trees_all_close(
      jax.grad(lambda p: jnp.sum(f.apply(p, None, X) ** 2))(params),
      jax.grad(reference)(params, X),
      rtol=1e-5,
      atol=1e-6,
    )

  def test_custom_vjp_layer(self):
    # The scan must carry the custom rule into every layer.
    f = hk.transform(lambda x: layer_scan.repeat_layer(half_grad_dense, x, DEPTH, init=init_dense))
    plain = hk.transform(lambda x: layer_scan.repeat_layer(dense, x, DEPTH, init=init_dense))
    params = f.init(KEY, X)
    loss = lambda t: lambda p: jnp.sum(t.apply(p, None, X) ** 2)
    chex.assert_trees_all_close(
      jax.grad(loss(f))(params),
      jax.tree.map(lambda g: 0.5 * g, jax.grad(loss(plain))(params)),
      rtol=1e-5,
      atol=1e-7,
    )


class StructureTest(parameterized.TestCase):
  @parameterized.parameters(False, "nested", "binomial")
  def test_trace_does_not_grow_with_depth(self, remat):
    def eqns(depth):
      f = hk.transform(lambda x: layer_scan.repeat_layer(block, x, depth, remat=remat))
      params = f.init(KEY, X)
      grad = jax.grad(lambda p: jnp.sum(f.apply(p, None, X)))
      return sum(test_utils.primitive_counts(grad, params).values())

    self.assertEqual(eqns(4), eqns(48))


class ErrorsTest(parameterized.TestCase):
  def test_xs_leading_axis(self):
    f = hk.transform(
      lambda x: layer_scan.layer_scan(
        lambda c, x: (block(c + x), None), x, jnp.ones([DEPTH + 1, 4]), num_layers=DEPTH
      )
    )
    with self.assertRaisesRegex(
      ValueError,
      r"xs has shape \(4, 4\).*"
      "num_layers=3",
    ):
      f.init(KEY, X)

  def test_carry_mismatch(self):
    f = hk.transform(lambda x: layer_scan.repeat_layer(lambda x: hk.Linear(3)(x), x, DEPTH))
    with self.assertRaisesRegex(
      ValueError,
      r"got float32\[2, 4\] and "
      r"returned float32\[2, 3\]",
    ):
      f.init(KEY, X)

  @parameterized.parameters((0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError))
  def test_bad_num_layers(self, n, error):
    f = hk.transform(lambda x: layer_scan.repeat_layer(block, x, n))
    with self.assertRaisesRegex(error, "positive int"):
      f.init(KEY, X)

  def test_no_num_layers(self):
    f = hk.transform(lambda x: layer_scan.layer_scan(as_carry_layer(block), x))
    with self.assertRaisesRegex(ValueError, "needs `num_layers=`"):
      f.init(KEY, X)

  def test_transformed_layer_with_init(self):
    layer = hk.transform(as_carry_layer(block))
    f = hk.transform(
      lambda x: layer_scan.layer_scan(layer, x, num_layers=DEPTH, init=lambda rng, c, x: {})
    )
    with self.assertRaisesRegex(TypeError, "brings its own init; do not pass `init=` as well"):
      f.init(KEY, X)

  def test_params_for_another_depth(self):
    f = hk.transform(lambda x, n: layer_scan.repeat_layer(block, x, n))
    with self.assertRaisesRegex(
      ValueError,
      r"a stack of 3 layers, but this "
      "call runs num_layers=4",
    ):
      f.apply(f.init(KEY, X, 3), None, X, 4)


if __name__ == "__main__":
  absltest.main()
