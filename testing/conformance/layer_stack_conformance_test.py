"""Conformance with Haiku's own `layer_stack_test.py`: `hk.layer_stack` against the bridge.

For each case of dm-haiku 0.0.17's `haiku/_src/layer_stack_test.py`, the same
stack is built with `hk.layer_stack` and with `hkb.layer_scan` /
`hkb.repeat_layer`, and they must agree: param and state names, the stacked
shapes, initial values for the same key, outputs (rng included), new state and
gradients; where `hk.layer_stack` raises, the bridge raises too. Where Haiku
compares against an unrolled loop, the bridge's loop is the one
`hkb.unstack_params` names (layer `i` under `hk.name_scope(f"layer_{i}")`).

Sizes are tiny (CI has two cores); the cases are Haiku's, not its sizes.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from testing.conformance import common

KEY = jax.random.PRNGKey(42)
STACK = "__layer_stack_no_per_layer"
PER_LAYER_STACK = "__layer_stack_with_per_layer"
N = 4
WIDTH = 8

# Haiku cases whose construct the bridge replaces by another one, by design.
BEHAVIOUR_DIFFERENCES = {
  "test_transparent": (
    "hk.layer_stack(transparent=True, transparency_map=...) stores per-layer "
    "names in params; the bridge always stores the stacked params and maps "
    "to per-layer names with hkb.unstack_params / stack_params "
    "(`layer_scope`), which the test checks against the looped model"
  ),
  "test_layer_stack_transparent_with_custom_pytrees": (
    "as test_transparent, with a custom pytree carry"
  ),
}


def x_data(*shape, seed=0):
  return jax.random.uniform(jax.random.PRNGKey(seed), shape or (2, WIDTH))


def compare_with_layer_stack(test, ours, theirs, *args, rng=KEY, apply_rng=None, grads=True):
  """Both as `hk.transform_with_state`: same init, outputs, state, gradients.

  Returns `(params, state, out)` of `theirs` at apply, for case checks.
  """
  ours, theirs = hk.transform_with_state(ours), hk.transform_with_state(theirs)
  p_ours, s_ours = ours.init(rng, *args)
  p_theirs, s_theirs = theirs.init(rng, *args)
  common.assert_same_tree(test, p_ours, p_theirs)
  common.assert_same_tree(test, s_ours, s_theirs)
  out_ours, s2_ours = ours.apply(p_theirs, s_theirs, apply_rng, *args)
  out_theirs, s2_theirs = theirs.apply(p_theirs, s_theirs, apply_rng, *args)
  chex.assert_trees_all_close(out_ours, out_theirs, rtol=1e-5, atol=1e-6)
  common.assert_same_tree(test, s2_ours, s2_theirs, rtol=1e-5, atol=1e-6)
  if grads and p_theirs:
    loss = lambda t: (
      lambda p: sum(
        jnp.sum(jnp.square(o)) for o in jax.tree.leaves(t.apply(p, s_theirs, apply_rng, *args)[0])
      )
    )
    common.assert_same_tree(
      test, jax.grad(loss(ours))(p_theirs), jax.grad(loss(theirs))(p_theirs), rtol=1e-4, atol=1e-5
    )
  return p_theirs, s_theirs, out_theirs


def residual_fn(x):
  x += hk.Linear(WIDTH, name="linear1")(x)
  x += hk.Linear(WIDTH, name="linear2")(x)
  return x / jnp.mean(x)


def unrolled(layer, num_layers=N):
  """Layer `i` under name scope `layer_{i}`: the loop unstack_params names."""

  def loop(x):
    for i in range(num_layers):
      with hk.name_scope(f"layer_{i}"):
        x = layer(x)
    return x

  return loop


class LayerStackConformanceTest(parameterized.TestCase):
  def test_every_haiku_case_is_covered(self):
    haiku_cases = common.haiku_test_cases("layer_stack_test.py")
    ours = [name for name in dir(self) if name.startswith("test_")]
    self.assertEmpty(
      {case for case in haiku_cases if not any(name.startswith(case) for name in ours)}
    )

  @parameterized.parameters(1, 2, 4)
  def test_layer_stack(self, unroll):
    x = x_data()
    params, _, out = compare_with_layer_stack(
      self,
      lambda x: hkb.repeat_layer(residual_fn, x, N, unroll=unroll),
      lambda x: hk.layer_stack(N, unroll=unroll)(residual_fn)(x),
      x,
      grads=False,
    )
    self.assertEqual(sorted(params), [f"{STACK}/linear1", f"{STACK}/linear2"])
    self.assertEqual(params[f"{STACK}/linear1"]["w"].shape, (N, WIDTH, WIDTH))
    loop = hk.transform(unrolled(residual_fn))
    loop_params = hkb.unstack_params(params, stack=STACK, num_layers=N)
    chex.assert_trees_all_equal_shapes(loop_params, loop.init(KEY, x))
    np.testing.assert_allclose(loop.apply(loop_params, None, x), out, rtol=1e-5, atol=1e-5)

  def test_layer_stack_multi_args(self):

    def inner_fn(x, y):
      x_out = x + hk.Linear(WIDTH, name="linear1")(y)
      y_out = y + hk.Linear(WIDTH, name="linear2")(x)
      return x_out, y_out

    x, y = x_data(), x_data(seed=1)
    compare_with_layer_stack(
      self,
      lambda x, y: hkb.layer_scan(lambda c, _: (inner_fn(*c), None), (x, y), num_layers=N)[0],
      lambda x, y: hk.layer_stack(N)(inner_fn)(x, y),
      x,
      y,
    )

  def test_layer_stack_no_varargs(self):

    class VarArgsModule(hk.Module):
      def __call__(self, *args):
        return args

    class NoVarArgsModule(hk.Module):
      def __call__(self, x):
        return x

    def stacks(module_class):
      ours = lambda x: hkb.repeat_layer(module_class(), x, 1)
      theirs = lambda x: hk.layer_stack(1)(module_class())(x)
      return ours, theirs

    x = jnp.ones([5])
    compare_with_layer_stack(self, *stacks(NoVarArgsModule), x)
    ours, theirs = stacks(VarArgsModule)
    with self.assertRaisesRegex(ValueError, "should not have any `varargs`"):
      hk.transform(theirs).init(KEY, x)
    with self.assertRaises(ValueError):
      hk.transform(ours).init(KEY, x)

  def test_layer_stack_with_state(self):

    def stateful_layer(x):
      hk.set_state("hi", x)
      return x + 1

    x = jnp.ones((1,))
    _, state, _ = compare_with_layer_stack(
      self,
      lambda x: hkb.repeat_layer(stateful_layer, x, 5, name="with_state"),
      lambda x: hk.layer_stack(5, name="with_state")(stateful_layer)(x),
      x,
    )
    self.assertIn("with_state/~", state)
    f = hk.transform_with_state(lambda x: hkb.repeat_layer(stateful_layer, x, 5, name="with_state"))
    params, state = f.init(None, x)
    _, state = f.apply(params, state, None, x)
    np.testing.assert_allclose(state["with_state/~"]["hi"], np.array([[1.0, 2.0, 3.0, 4.0, 5.0]]).T)

  @parameterized.parameters(1, 2, 4)
  def test_layer_stack_grads(self, unroll):
    x = x_data()
    params, _, _ = compare_with_layer_stack(
      self,
      lambda x: hkb.repeat_layer(residual_fn, x, N, unroll=unroll),
      lambda x: hk.layer_stack(N, unroll=unroll)(residual_fn)(x),
      x,
    )
    stacked = hk.transform(lambda x: hkb.repeat_layer(residual_fn, x, N, unroll=unroll))
    loop = hk.transform(unrolled(residual_fn))
    loss = lambda f: lambda p: jnp.mean(f.apply(p, None, x))
    loop_params = hkb.unstack_params(params, stack=STACK, num_layers=N)
    common.assert_same_tree(
      self,
      hkb.unstack_params(jax.grad(loss(stacked))(params), stack=STACK, num_layers=N),
      jax.grad(loss(loop))(loop_params),
      rtol=1e-4,
      atol=1e-4,
    )

  def test_random(self):
    # Haiku skips its statistical version; the parity of draws is checkable.
    def add_random(x):
      return x + jax.random.normal(hk.next_rng_key())

    compare_with_layer_stack(
      self,
      lambda x: hkb.repeat_layer(add_random, x, 16),
      lambda x: hk.layer_stack(16)(add_random)(x),
      jnp.zeros([]),
      apply_rng=jax.random.PRNGKey(7),
    )

  def test_threading(self):
    n = 5

    def f(x, y):
      x = x + y * jax.nn.one_hot(y, len(x)) / 10
      return x, 2 * y

    def ours(x, ys):
      x, zs = hkb.layer_scan(f, x, ys)
      self.assertEqual(zs.shape, (n,))
      return x, zs

    def theirs(x, ys):
      x, zs = hk.layer_stack(n, with_per_layer_inputs=True)(f)(x, ys)
      self.assertEqual(zs.shape, (n,))
      return x, zs

    ys = np.arange(n).astype(np.float32)
    _, _, (x, zs) = compare_with_layer_stack(
      self, ours, theirs, np.zeros(n, np.float32), ys, rng=jax.random.PRNGKey(7)
    )
    np.testing.assert_allclose(x, [0, 0.1, 0.2, 0.3, 0.4], rtol=1e-6)
    np.testing.assert_array_equal(zs, 2 * ys)

  def test_nested_stacks(self):
    layer_fn = lambda x: hk.Linear(WIDTH)(x)
    x = jnp.zeros([2, WIDTH])
    params, _, _ = compare_with_layer_stack(
      self,
      lambda x: hkb.repeat_layer(lambda h: hkb.repeat_layer(layer_fn, h, 3), x, 2),
      lambda x: hk.layer_stack(2)(hk.layer_stack(3)(layer_fn))(x),
      x,
      apply_rng=jax.random.PRNGKey(1),
    )
    (p,) = params.values()
    self.assertEqual(p["w"].shape, (2, 3, WIDTH, WIDTH))
    self.assertEqual(p["b"].shape, (2, 3, WIDTH))

  def test_with_per_layer_inputs_multi_args(self):
    width, height = 4, 3

    def f(x, a, b):
      return hk.Linear(width, w_init=hk.initializers.Constant(jnp.eye(width)))(x) * a + b, None

    a, b = jnp.full([height], 2.0), jnp.ones([height])
    _, _, (out, z) = compare_with_layer_stack(
      self,
      lambda x: hkb.layer_scan(lambda c, ab: f(c, *ab), x, (a, b)),
      lambda x: hk.layer_stack(height, with_per_layer_inputs=True)(f)(x, a, b),
      jnp.zeros([5, width]),
      rng=jax.random.PRNGKey(19),
    )
    self.assertIsNone(z)
    np.testing.assert_array_equal(out, np.full([5, width], 7.0))

  def test_with_container_state(self):
    width, height = 2, 3

    def f(x):
      out = hk.Linear(width, w_init=hk.initializers.Constant(jnp.eye(width)))(x)
      return out + jnp.ones_like(out), {"raw_output": out, "output_projection": jnp.sum(out)}

    # By design, layer_scan's default name follows whether `xs` are given
    # (docs/comparison.md, "Differences ... by design"): this layer has per-layer outputs but
    # no per-layer inputs, so the name hk.layer_stack uses is passed.
    _, _, (out, z) = compare_with_layer_stack(
      self,
      lambda x: hkb.layer_scan(
        lambda c, _: f(c), x, num_layers=height, name="__layer_stack_with_per_layer"
      ),
      lambda x: hk.layer_stack(height, with_per_layer_inputs=True)(f)(x),
      jnp.zeros([2, width]),
    )
    self.assertEqual(z["raw_output"].shape, (height, 2, width))
    self.assertEqual(out.shape, (2, width))
    np.testing.assert_array_equal(np.sum(z["output_projection"]), 12.0)

  @staticmethod
  def _identity_plus_one(x):
    return hk.Linear(
      x.shape[1],
      w_init=hk.initializers.Constant(jnp.eye(x.shape[1])),
      b_init=hk.initializers.Constant(1.0),
    )(x)

  def test_reverse(self):
    height, alpha = 4, 24 ** (-1 / 4)
    x = 1 + jax.random.uniform(KEY, [3, 2])
    make = lambda reverse: (
      lambda x: hkb.repeat_layer(self._identity_plus_one, x, height, reverse=reverse),
      lambda x: hk.layer_stack(height)(self._identity_plus_one)(x, reverse=reverse),
    )
    for reverse in (False, True):
      ours, theirs = map(hk.transform, make(reverse))
      params = theirs.init(KEY, x)
      chex.assert_trees_all_equal(ours.init(KEY, x), params)
      # Layer n's weights times n * alpha, as in Haiku's test.
      scale = lambda p: (
        p * (jnp.arange(height) + 1).reshape((height,) + (1,) * (p.ndim - 1)) * alpha
      )
      params = jax.tree.map(scale, params)
      chex.assert_trees_all_close(
        ours.apply(params, None, x), theirs.apply(params, None, x), rtol=1e-6
      )

  def test_reverse_with_additional_inputs(self):
    height = 4
    extra = (jnp.arange(height) + 1) * 24 ** (-1 / 4)

    def inner_fn(x, e):
      out = hk.Linear(
        x.shape[1],
        w_init=hk.initializers.Constant(e * jnp.eye(x.shape[1])),
        b_init=hk.initializers.Constant(e),
      )(x)
      return out, out

    x = 1 + jax.random.uniform(KEY, [3, 2])
    for reverse in (False, True):
      _, _, (x_n, x_all) = compare_with_layer_stack(
        self,
        lambda x, e: hkb.layer_scan(inner_fn, x, e, reverse=reverse),
        lambda x, e: hk.layer_stack(height, with_per_layer_inputs=True)(inner_fn)(
          x, e, reverse=reverse
        ),
        x,
        extra,
      )
      self.assertEqual(x_all.shape[0], height)
      np.testing.assert_allclose(x_n, x_all[0 if reverse else -1], rtol=1e-6)

  def test_reverse_with_pass_reverse_to_layer_fn(self):
    height = 4

    def inner_fn(x, e):
      out = hk.Linear(
        x.shape[1],
        w_init=hk.initializers.Constant(e * jnp.eye(x.shape[1])),
        b_init=hk.initializers.Constant(e),
      )(x)
      return out, out

    def theirs_outer(x, e, reverse=False):
      return hk.layer_stack(height // 2, with_per_layer_inputs=True)(inner_fn)(
        x, e, reverse=reverse
      )

    def ours(reverse):
      inner = lambda c, e: hkb.layer_scan(inner_fn, c, e, reverse=reverse)
      return lambda x, e: hkb.layer_scan(inner, x, e, reverse=reverse)

    def theirs(reverse):
      return lambda x, e: hk.layer_stack(
        2, with_per_layer_inputs=True, pass_reverse_to_layer_fn=True
      )(theirs_outer)(x, e, reverse=reverse)

    extra = (jnp.arange(height).reshape([2, height // 2]) + 1) * 24 ** (-1 / 4)
    x = 1 + jax.random.uniform(KEY, [3, 2])
    for reverse in (False, True):
      _, _, (x_n, x_all) = compare_with_layer_stack(self, ours(reverse), theirs(reverse), x, extra)
      self.assertEqual(x_all.shape[:2], (2, height // 2))

  def test_parameter_reuse(self):

    def block(x):
      return jax.nn.relu(hk.Linear(x.shape[-1], with_bias=False)(x))

    class MLP(hk.Module):
      def __init__(self, ours):
        super().__init__(name="mlp")
        self._ours = ours

      def __call__(self, x):
        if self._ours:
          return hkb.repeat_layer(block, x, 5)
        return hk.layer_stack(5)(block)(x)

    def model(ours):
      def f(x):
        mlp = MLP(ours)
        return mlp(mlp(x))

      return f

    params, _, _ = compare_with_layer_stack(self, model(True), model(False), jnp.ones((2, 2)))
    self.assertEqual(sum(p.size for p in jax.tree.leaves(params)), 20)

  def _check_transparent(self, block, looped, x, layer_scope):
    """The stacked model, run on the loop's params through stack_params."""
    ours = hk.transform(lambda x: hkb.repeat_layer(block, x, 3))
    looped = hk.transform(looped)
    stacked_params = ours.init(KEY, x)
    loop_params = looped.init(KEY, x)
    as_loop = hkb.unstack_params(stacked_params, stack=STACK, num_layers=3, layer_scope=layer_scope)
    self.assertEqual(jax.tree.structure(as_loop), jax.tree.structure(loop_params))
    chex.assert_trees_all_equal_shapes(as_loop, loop_params)
    restacked = hkb.stack_params(loop_params, stack=STACK, num_layers=3, layer_scope=layer_scope)
    chex.assert_trees_all_equal(
      hkb.unstack_params(restacked, stack=STACK, num_layers=3, layer_scope=layer_scope), loop_params
    )
    return (ours.apply(restacked, KEY, x), looped.apply(loop_params, KEY, x))

  def test_transparent(self):
    # Haiku's looped model names layer i `linear_{i}`; the bridge's loop puts
    # layer i under name scope `layer_{i}` (see BEHAVIOUR_DIFFERENCES).
    block = lambda x: hk.Linear(x.shape[-1])(x)

    def looped(x):
      for i in range(3):
        with hk.name_scope(f"layer_{i}"):
          x = block(x)
      return x

    ours, loop = self._check_transparent(block, looped, jnp.ones((2, 2)), "layer_{i}")
    chex.assert_trees_all_close(ours, loop, rtol=1e-6)

  def test_layer_stack_transparent_with_custom_pytrees(self):

    @jax.tree_util.register_pytree_node_class
    class CustomParam:
      def __init__(self, param, multiplier):
        self.param = param
        self.multiplier = multiplier

      def tree_flatten(self):
        return (self.param, self.multiplier), None

      @classmethod
      def tree_unflatten(cls, aux, values):
        del aux
        return cls(*values)

    def block(x):
      return CustomParam(hk.Linear(x.param.shape[-1])(x.param * x.multiplier), x.multiplier)

    def looped(x):
      for i in range(3):
        with hk.name_scope(f"layer_{i}"):
          x = block(x)
      return x

    x = CustomParam(jnp.ones((2, 2)), jnp.float32(0.3))
    ours, loop = self._check_transparent(block, looped, x, "layer_{i}")
    chex.assert_trees_all_close(ours.param, loop.param, rtol=1e-6)
    # And as hk.layer_stack runs the same stack.
    compare_with_layer_stack(
      self, lambda x: hkb.repeat_layer(block, x, 3), lambda x: hk.layer_stack(3)(block)(x), x
    )


class GetterConformanceTest(parameterized.TestCase):
  """Custom getters around a stack see what they see around hk.layer_stack."""

  @parameterized.named_parameters(("repeat_layer", False), ("layer_scan_remat", True))
  def test_getter_sees_per_layer_params(self, remat):
    seen = {}

    def normalise(kind):
      # A per-matrix rule (weight normalisation): its result depends on
      # whether it is given one layer's matrix or the stacked ones.
      def getter(next_getter, value, context):
        seen.setdefault(kind, []).append((context.name, value.shape, value.dtype.name))
        if value.ndim >= 2:
          value = value / jnp.linalg.norm(value)
        return next_getter(value)

      return getter

    def model(kind):
      def f(x):
        with hk.custom_getter(normalise(kind)):
          if kind == "theirs":
            return hk.layer_stack(N)(residual_fn)(x)
          return hkb.layer_scan(lambda c, _: (residual_fn(c), None), x, num_layers=N, remat=remat)[
            0
          ]

      return hk.transform(f)

    x = x_data()
    ours, theirs = model("ours"), model("theirs")
    params = theirs.init(KEY, x)
    chex.assert_trees_all_equal(ours.init(KEY, x), params)
    self.assertEqual(seen["ours"], seen["theirs"])  # At init.
    seen.clear()
    out_ours = ours.apply(params, None, x)
    out_theirs = theirs.apply(params, None, x)
    self.assertEqual(seen["ours"], seen["theirs"])
    chex.assert_trees_all_close(out_ours, out_theirs, rtol=1e-5, atol=1e-6)

  def test_bfloat16_getter(self):
    cast = lambda next_getter, value, context: next_getter(value.astype(jnp.bfloat16))

    def model(ours):
      def f(x):
        with hk.custom_getter(cast):
          if ours:
            return hkb.repeat_layer(lambda h: hk.Linear(WIDTH)(h), x, N)
          return hk.layer_stack(N)(lambda h: hk.Linear(WIDTH)(h))(x)

      return f

    compare_with_layer_stack(
      self, model(True), model(False), x_data().astype(jnp.bfloat16), grads=False
    )


if __name__ == "__main__":
  absltest.main()
