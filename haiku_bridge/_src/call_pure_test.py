"""Tests for call_pure: each behaviour against inline Haiku or a reference."""

import dataclasses
from typing import NamedTuple

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax
from jax import test_util as jtu
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from testing import backend_tolerance
from testing import test_utils

Outer = test_utils.Outer

KEY = jax.random.PRNGKey(42)
X = jax.random.normal(jax.random.PRNGKey(1), [3, 4])


# A dense layer written in plain JAX: the pure function most tests bridge.
def dense(params, x):
  return jnp.tanh(x @ params["w"] + params["b"])


def init_dense(rng, x, features=5):
  return {"w": jax.random.normal(rng, [x.shape[-1], features]) * 0.5, "b": jnp.zeros([features])}


def mlp_fn(x):
  return hk.nets.MLP([5, 3])(x)


def assert_same_model(test, bridged, inline, *args, rng=KEY, state=False):
  """Same params (names and values), outputs and state, at init and apply."""
  if state:
    bridged, inline = (hk.transform_with_state(bridged), hk.transform_with_state(inline))
    p_b, s_b = bridged.init(rng, *args)
    p_i, s_i = inline.init(rng, *args)
    chex.assert_trees_all_equal(s_b, s_i)
    out_b, s_b2 = bridged.apply(p_b, s_b, rng, *args)
    out_i, s_i2 = inline.apply(p_i, s_i, rng, *args)
    chex.assert_trees_all_equal(s_b2, s_i2)
  else:
    bridged, inline = hk.transform(bridged), hk.transform(inline)
    p_b, p_i = bridged.init(rng, *args), inline.init(rng, *args)
    out_b, out_i = bridged.apply(p_b, rng, *args), inline.apply(p_i, rng, *args)
  test.assertEqual(list(p_b), list(p_i))
  chex.assert_trees_all_equal(p_b, p_i)
  chex.assert_trees_all_close(out_b, out_i, rtol=1e-6, atol=1e-6)
  return p_b


class InlineRuleTest(parameterized.TestCase):
  """A transformed `fn` behaves exactly like its Haiku function inline."""

  def test_top_level(self):
    inner = hk.transform(mlp_fn)
    assert_same_model(self, lambda x: hkb.call_pure(inner, x), mlp_fn, X)

  def test_repeated_calls_in_module_are_numbered_like_inline(self):
    inner = hk.transform(mlp_fn)

    def bridged(x):
      body = lambda x: hkb.call_pure(inner, x) + hkb.call_pure(inner, x) + mlp_fn(x)
      return Outer(body, name="net")(x)

    def inline(x):
      return Outer(lambda x: mlp_fn(x) + mlp_fn(x) + mlp_fn(x), name="net")(x)

    params = assert_same_model(self, bridged, inline, X)
    self.assertIn("net/mlp_2/~/linear_1", params)

  def test_bridged_after_inline_gets_next_number(self):
    inner = hk.transform(lambda x: hk.Linear(3)(x) + hk.Linear(3)(x))
    bridged = lambda x: hk.Linear(3)(x) + hkb.call_pure(inner, x)
    inline = lambda x: hk.Linear(3)(x) + hk.Linear(3)(x) + hk.Linear(3)(x)
    params = assert_same_model(self, bridged, inline, X)
    self.assertEqual(sorted(params), ["linear", "linear_1", "linear_2"])

  def test_modules_created_out_of_order(self):
    def f(x):
      a, b = hk.Linear(2, name="lin"), hk.Linear(2, name="lin")
      return a(b(x))  # `lin_1` makes its params before `lin`.

    inner = hk.transform(f)
    bridged = lambda x: Outer(lambda x: f(x) + hkb.call_pure(inner, x))(x)
    inline = lambda x: Outer(lambda x: f(x) + f(x))(x)
    assert_same_model(self, bridged, inline, X)

  def test_top_level_params_of_inner_go_to_caller_scope(self):
    def f(x):
      return x * hk.get_parameter("scale", [], init=jnp.ones)

    inner = hk.transform(f)
    params = assert_same_model(
      self, lambda x: Outer(lambda x: hkb.call_pure(inner, x))(x), lambda x: Outer(f)(x), X
    )
    self.assertEqual(list(params), ["outer"])

  def test_name_scope(self):
    inner = hk.transform(mlp_fn)

    def inline(x):
      with hk.name_scope("enc"):
        return mlp_fn(x)

    params = assert_same_model(self, lambda x: hkb.call_pure(inner, x, name="enc"), inline, X)
    self.assertEqual(sorted(params), ["enc/mlp/~/linear_0", "enc/mlp/~/linear_1"])

  def test_state_is_read_and_written_like_inline(self):
    def counter(x):
      n = hk.get_state("n", [], jnp.int32, init=jnp.zeros)
      hk.set_state("n", n + 1)
      ema = hk.ExponentialMovingAverage(0.9)(x)
      return x * n + ema + hk.Linear(4)(x)

    inner = hk.transform_with_state(counter)

    def bridged(x):
      y = Outer(lambda x: hkb.call_pure(inner, x))(x)
      # The caller sees the state the inner function left behind.
      return y, hk.get_state("n", [], jnp.int32, init=jnp.zeros)

    def inline(x):
      return Outer(counter)(x), hk.get_state("n", [], jnp.int32, init=jnp.zeros)

    assert_same_model(self, bridged, inline, X, state=True)

  def test_dropout_uses_the_same_keys_as_inline(self):
    def f(x):
      x = hk.Linear(8)(x)
      return hk.dropout(hk.next_rng_key(), 0.5, x) + jax.random.normal(hk.next_rng_key(), x.shape)

    inner = hk.transform(f)
    # After the call the caller's sequence continues where inline code's does.
    after = lambda: jax.random.uniform(hk.next_rng_key(), [2])
    assert_same_model(
      self, lambda x: (hkb.call_pure(inner, x), after()), lambda x: (f(x), after()), X
    )

  def test_no_rng_needed_and_none_given(self):
    inner = hk.without_apply_rng(hk.transform(mlp_fn))
    f = hk.without_apply_rng(hk.transform(lambda x: hkb.call_pure(inner, x)))
    params = f.init(KEY, X)
    chex.assert_trees_all_close(f.apply(params, X), hk.transform(mlp_fn).apply(params, None, X))

  def test_nested_call_pure(self):
    leaf = hk.transform(mlp_fn)
    middle = hk.transform(lambda x: Outer(lambda x: hkb.call_pure(leaf, x), name="mid")(x))
    assert_same_model(
      self,
      lambda x: Outer(lambda x: hkb.call_pure(middle, x))(x),
      lambda x: Outer(lambda x: Outer(mlp_fn, name="mid")(x))(x),
      X,
    )

  def test_interceptors_apply_once(self):
    def bf16_getter(next_getter, value, context):
      del context
      return next_getter(value.astype(jnp.bfloat16))

    calls = []

    def counting_creator(next_creator, shape, dtype, init, context):
      calls.append(context.full_name)
      return next_creator(shape, dtype, jnp.ones)

    inner = hk.transform(mlp_fn)

    def run(body):
      def f(x):
        with hk.custom_getter(bf16_getter), hk.custom_creator(counting_creator):
          return body(x)

      return hk.transform(f)

    bridged, inline = run(lambda x: hkb.call_pure(inner, x)), run(mlp_fn)
    p_b = bridged.init(KEY, X)
    n_bridged = len(calls)
    p_i = inline.init(KEY, X)
    self.assertEqual(n_bridged, len(calls) - n_bridged)
    self.assertEqual(sorted(calls[:n_bridged]), sorted(calls[n_bridged:]))
    chex.assert_trees_all_equal(p_b, p_i)
    out_b, out_i = bridged.apply(p_b, None, X), inline.apply(p_i, None, X)
    self.assertEqual(out_b.dtype, out_i.dtype)
    chex.assert_trees_all_equal(out_b, out_i)

  def test_init_output_sees_custom_getter(self):
    def doubling_getter(next_getter, value, context):
      del context
      return next_getter(2 * value)

    inner = hk.transform(lambda x: hk.Linear(2)(x))

    def make(body):
      def f(x):
        with hk.custom_getter(doubling_getter):
          return body(x)

      return f

    out = {}
    for label, body in (
      ("bridged", lambda x: hkb.call_pure(inner, x)),
      ("inline", lambda x: hk.Linear(2)(x)),
    ):
      f = make(lambda x, body=body: out.setdefault(label, body(x)))
      hk.transform(f).init(KEY, X)
    chex.assert_trees_all_close(out["bridged"], out["inline"])

  def test_init_given_as_transformed(self):
    inner = hk.transform(mlp_fn)
    seen = []

    def pure(params, x):
      seen.append(sorted(params))
      return inner.apply(params, None, x)

    params = assert_same_model(
      self,
      lambda x: Outer(lambda x: hkb.call_pure(pure, x, init=inner))(x),
      lambda x: Outer(mlp_fn)(x),
      X,
    )
    # `pure` receives the inner function's own names, not the outer ones.
    self.assertEqual(seen[-1], ["mlp/~/linear_0", "mlp/~/linear_1"])
    self.assertIn("outer/mlp/~/linear_0", params)

  def test_init_given_as_transformed_takes_its_names(self):
    # An inline module after the call is numbered on, at apply as at init.
    inner = hk.transform(mlp_fn)
    pure = lambda params, x: inner.apply(params, None, x)
    assert_same_model(
      self, lambda x: mlp_fn(hkb.call_pure(pure, x, init=inner)), lambda x: mlp_fn(mlp_fn(x)), X
    )

  def test_init_given_as_transformed_getters_see_each_param_once(self):
    seen = []

    def getter(next_getter, value, context):
      seen.append(context.full_name)
      return next_getter(value)

    inner = hk.transform(mlp_fn)
    names = []
    # Not through `inner.apply`: Haiku's getters are in force in a nested
    # transform too.
    for body in (lambda x: hkb.get_relevant_parameters(inner, x), mlp_fn):
      del seen[:]

      def with_getter(x, body=body):
        with hk.custom_getter(getter):
          return body(x)

      hk.transform(with_getter).init(KEY, X)
      names.append(sorted(seen))
    self.assertEqual(names[0], names[1])

  def test_nested_getters_stay_nested_around_a_bridged_call(self):
    # Was: at apply the bridge put the getters back inside out, so the rest
    # of the scope composed them in reverse and leaving it failed Haiku's
    # own assertion.
    plus_one = lambda nxt, v, ctx: nxt(v + 1)
    double = lambda nxt, v, ctx: nxt(2 * v)
    inner = hk.transform(mlp_fn)

    def model(bridge, x):
      with hk.custom_getter(plus_one), hk.custom_getter(double):
        y = (
          hkb.call_pure(lambda p, x: dense(p["mlp/~/linear_0"], x), x, init=inner)
          if bridge
          else mlp_fn(x)
        )
        return y, hk.get_parameter("w", [], init=jnp.ones)

    read = []
    for bridge in (True, False):
      f = hk.transform(lambda x, bridge=bridge: model(bridge, x))
      params = f.init(KEY, X)
      read.append(float(f.apply(params, None, X)[1]))
    self.assertEqual(read[0], read[1])  # As inline Haiku composes them.
    self.assertEqual(read[1], 2.0 * (1.0 + 1.0))  # `plus_one` reads first.

  def test_init_may_be_fn_itself(self):
    inner = hk.transform(mlp_fn)
    assert_same_model(self, lambda x: hkb.call_pure(inner, x, init=inner), mlp_fn, X)


class Pair(NamedTuple):
  first: jax.Array
  second: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
  kernel: jax.Array
  bias: jax.Array


class KeyPathRuleTest(parameterized.TestCase):
  """Any other pytree is named by its key path under the current scope."""

  @parameterized.named_parameters(
    ("dict", lambda: {"w": jnp.ones([2]), "b": jnp.zeros([])}, {"~": ["b", "w"]}),
    ("nested_dict", lambda: {"enc": {"w": jnp.ones([2])}}, {"enc": ["w"]}),
    (
      "list_of_dicts",
      lambda: {"layers": [{"w": jnp.ones([1])}, {"w": jnp.ones([2])}]},
      {"layers_0": ["w"], "layers_1": ["w"]},
    ),
    ("leading_index", lambda: [jnp.ones([1]), (jnp.ones([2]),)], {"~": ["layer_0", "layer_1_0"]}),
    ("namedtuple", lambda: Pair(jnp.ones([1]), jnp.ones([2])), {"~": ["first", "second"]}),
    (
      "dataclass",
      lambda: {"proj": Weights(jnp.ones([2, 2]), jnp.ones([2]))},
      {"proj": ["bias", "kernel"]},
    ),
    ("none_subtree", lambda: {"w": jnp.ones([1]), "unused": None}, {"~": ["w"]}),
    ("bare_array", lambda: jnp.ones([3]), {"~": ["params"]}),
  )
  def test_names(self, make, expected):
    def f():
      params = hkb.call_pure(lambda p: p, init=lambda rng: make())
      return params

    transformed = hk.transform(f)
    params = transformed.init(KEY)
    self.assertEqual({k: sorted(v) for k, v in params.items()}, expected)
    # Apply rebuilds the very same pytree from the stored leaves.
    chex.assert_trees_all_equal(transformed.apply(params, None), make())

  def test_same_place_as_hk_linear(self):
    def init_linear(rng, x):
      return {"linear": {"w": jax.random.normal(rng, [x.shape[-1], 3]), "b": jnp.zeros([3])}}

    def bridged(x):
      return Outer(
        lambda x: hkb.call_pure(
          lambda p, x: x @ p["linear"]["w"] + p["linear"]["b"], x, init=init_linear
        )
      )(x)

    inline = lambda x: Outer(lambda x: hk.Linear(3)(x))(x)
    p_b = hk.transform(bridged).init(KEY, X)
    p_i = hk.transform(inline).init(KEY, X)
    self.assertEqual(test_utils.param_shapes(p_b), test_utils.param_shapes(p_i))
    # The inline model runs on the bridged model's params, and vice versa.
    chex.assert_trees_all_close(
      hk.transform(bridged).apply(p_i, None, X), hk.transform(inline).apply(p_i, None, X)
    )

  def test_name_adds_scope_inside_module(self):
    f = hk.transform(
      lambda x: Outer(lambda x: hkb.call_pure(dense, x, init=init_dense, name="proj"))(x)
    )
    self.assertEqual(sorted(f.init(KEY, X)), ["outer/proj"])

  def test_same_name_twice_is_numbered_like_name_scope(self):
    def bridged(x):
      a = hkb.call_pure(dense, x, init=init_dense, name="enc")
      return a + hkb.call_pure(dense, x, init=init_dense, name="enc")

    def name_scopes(x):
      outs = []
      for _ in range(2):
        with hk.name_scope("enc"):
          outs.append(hk.get_parameter("w", [4, 5], init=jnp.zeros))
      return outs

    self.assertEqual(
      sorted(hk.transform(bridged).init(KEY, X)), sorted(hk.transform(name_scopes).init(KEY, X))
    )

  def test_random_trees_round_trip(self):
    rng = np.random.default_rng(0)
    for _ in range(20):
      tree = _random_tree(rng, depth=3)

      def f(tree=tree):
        return hkb.call_pure(lambda p: p, init=lambda key: tree)

      transformed = hk.transform(f)
      params = transformed.init(KEY)
      self.assertLen(jax.tree.leaves(params), len(jax.tree.leaves(tree)))
      chex.assert_trees_all_equal(transformed.apply(params, None), tree)

  def test_module_called_twice_shares_weights(self):
    # Calling one module twice reuses its weights in Haiku; so must bridged
    # code inside it (this is sharing by module reuse, not a name collision).
    def f(x):
      block = Outer(
        lambda x: hkb.call_pure(dense, x, init=lambda rng, x: init_dense(rng, x, features=4))
      )
      return block(block(x))

    transformed = hk.transform(f)
    params = transformed.init(KEY, X)
    expected = dense(params["outer"], dense(params["outer"], X))
    chex.assert_trees_all_close(transformed.apply(params, None, X), expected)

  def test_get_relevant_parameters_shares_explicitly(self):
    def f(x1, x2):
      params = hkb.get_relevant_parameters(init_dense, x1, name="shared")
      return dense(params, x1) + dense(params, x2), params

    transformed = hk.transform(f)
    params = transformed.init(KEY, X, 2 * X)
    out, seen = transformed.apply(params, None, X, 2 * X)
    chex.assert_trees_all_equal(seen, params["shared"])
    chex.assert_trees_all_close(out, dense(params["shared"], X) + dense(params["shared"], 2 * X))

  def test_interceptors_apply(self):
    def bf16_getter(next_getter, value, context):
      del context
      return next_getter(value.astype(jnp.bfloat16))

    def zeros_creator(next_creator, shape, dtype, init, context):
      del init, context
      return next_creator(shape, dtype, jnp.zeros)

    def f(x):
      with hk.custom_creator(zeros_creator), hk.custom_getter(bf16_getter):
        return hkb.call_pure(lambda p, x: p, x, init=init_dense)

    transformed = hk.transform(f)
    params = transformed.init(KEY, X)
    chex.assert_trees_all_equal(params["~"]["w"], jnp.zeros([4, 5]))
    seen = transformed.apply(params, None, X)
    self.assertEqual(jax.tree.map(lambda p: p.dtype, seen), {"w": jnp.bfloat16, "b": jnp.bfloat16})

  def test_init_not_run_at_apply(self):
    calls = []

    def init(rng, x):
      calls.append(type(x))
      return init_dense(rng, x)

    f = hk.transform(lambda x: hkb.call_pure(dense, x, init=init))
    params = f.init(KEY, X)
    self.assertLen(calls, 1)
    jaxpr = jax.make_jaxpr(lambda p: f.apply(p, None, X))(params)
    # `init` may be traced for shapes, but no op of it reaches the jaxpr.
    self.assertNotIn("random_bits", str(jaxpr))
    self.assertNotIn("threefry2x32", str(jaxpr))

  def test_keyword_arguments_reach_fn_and_init(self):
    scaled = lambda params, x, features, scale: dense(params, x) * scale
    init = lambda rng, x, features, scale: init_dense(rng, x, features)
    f = hk.transform(lambda x: hkb.call_pure(scaled, x, init=init, features=7, scale=3.0))
    params = f.init(KEY, X)
    # Inline code drawing one key from Haiku's sequence for the same init.
    expected = hk.transform(lambda x: init_dense(hk.next_rng_key(), x, 7)).apply({}, KEY, X)
    chex.assert_trees_all_equal(params["~"], expected)
    chex.assert_trees_all_close(f.apply(params, None, X), 3.0 * dense(expected, X), rtol=1e-6)


def _random_tree(rng, depth):
  kind = rng.integers(0, 4) if depth else 3
  if kind == 0:
    return {f"k{i}": _random_tree(rng, depth - 1) for i in range(rng.integers(1, 4))}
  if kind == 1:
    return [_random_tree(rng, depth - 1) for _ in range(rng.integers(1, 3))]
  if kind == 2:
    return Pair(_random_tree(rng, depth - 1), _random_tree(rng, depth - 1))
  shape = tuple(rng.integers(1, 3, size=rng.integers(0, 3)))
  return jnp.asarray(rng.normal(size=shape), jnp.float32)


class ExplicitTransformsTest(parameterized.TestCase):
  """The point of the bridge: JAX transforms over a function of the weights."""

  def test_custom_vjp_routes_cotangent_pieces(self):
    # The motivating case. The forward stores a jax.vjp closure in its
    # residuals; the backward splits the output cotangent into two pieces,
    # vmaps the stored vjp over them, and gives each weight the cotangent of
    # one piece only: "w1" learns from the first half of the features, "w2"
    # from the second half.
    def inner(params, x):
      h = jnp.tanh(x @ params["w1"])
      return jnp.concatenate([h, h @ params["w2"]], axis=-1)

    def init_inner(rng, x):
      k1, k2 = jax.random.split(rng)
      return {"w1": jax.random.normal(k1, [x.shape[-1], 3]), "w2": jax.random.normal(k2, [3, 3])}

    @jax.custom_vjp
    def routed(params, x):
      return inner(params, x)

    def fwd(params, x):
      y, vjp = jax.vjp(inner, params, x)
      return y, vjp

    def bwd(vjp, g):
      pieces = jnp.stack([g.at[..., 3:].set(0), g.at[..., :3].set(0)])
      p_cts, x_cts = jax.vmap(vjp)(pieces)
      params_ct = {"w1": p_cts["w1"][0], "w2": p_cts["w2"][1]}
      return params_ct, x_cts.sum(0)

    routed.defvjp(fwd, bwd)

    class Deep(hk.Module):
      def __call__(self, x):
        a = hkb.call_pure(routed, x, init=init_inner, name="a")
        b = hkb.call_pure(routed, x, init=init_inner, name="b")
        return a * b

    net = hk.transform(
      lambda x: Outer(lambda x: Outer(lambda x: Deep()(x), name="middle")(x), name="top")(x)
    )
    params = net.init(KEY, X)
    self.assertEqual(sorted(params), ["top/middle/deep/a", "top/middle/deep/b"])
    loss = lambda p: jnp.sum(net.apply(p, None, X) ** 2)
    grads = jax.grad(loss)(params)

    # Reference: the same routing from the true per-piece vjps, by hand.
    pa = params["top/middle/deep/a"]
    pb = params["top/middle/deep/b"]
    ya, yb = inner(pa, X), inner(pb, X)
    g = 2 * ya * yb
    ga, gb = g * yb, g * ya
    for p, gy, key in ((pa, ga, "a"), (pb, gb, "b")):
      _, vjp = jax.vjp(lambda p: inner(p, X), p)
      (from_first,) = vjp(gy.at[..., 3:].set(0))
      (from_second,) = vjp(gy.at[..., :3].set(0))
      chex.assert_trees_all_close(
        grads[f"top/middle/deep/{key}"],
        {"w1": from_first["w1"], "w2": from_second["w2"]},
        rtol=1e-5,
        atol=1e-5,
      )
    # And the routing really changed something.
    true_grads = jax.grad(
      lambda p: jnp.sum((inner(p["top/middle/deep/a"], X) * inner(p["top/middle/deep/b"], X)) ** 2)
    )(params)
    self.assertFalse(
      np.allclose(grads["top/middle/deep/a"]["w1"], true_grads["top/middle/deep/a"]["w1"])
    )

  def test_custom_vjp_true_gradient_matches_inline(self):
    @jax.custom_vjp
    def f(params, x):
      return dense(params, x)

    def fwd(params, x):
      return jax.vjp(dense, params, x)

    def bwd(vjp, g):
      return vjp(g)

    f.defvjp(fwd, bwd)
    self._assert_grads_match_dense(f)

  def test_custom_jvp(self):
    @jax.custom_jvp
    def f(params, x):
      return dense(params, x)

    @f.defjvp
    def f_jvp(primals, tangents):
      return jax.jvp(dense, primals, tangents)

    self._assert_grads_match_dense(f)
    transformed = hk.transform(lambda x: hkb.call_pure(f, x, init=init_dense))
    params = transformed.init(KEY, X)
    jtu.check_grads(
      lambda p, x: transformed.apply(p, None, x),
      (params, X),
      order=2,
      modes=["fwd", "rev"],
      atol=1e-2,
      rtol=1e-2,
    )

  def test_checkpoint_with_policy(self):
    f = jax.checkpoint(dense, policy=jax.checkpoint_policies.nothing_saveable)
    transformed = self._assert_grads_match_dense(f)
    params = transformed.init(KEY, X)
    counts = test_utils.primitive_counts(
      jax.grad(lambda p: jnp.sum(transformed.apply(p, None, X))), params
    )
    self.assertIn("remat2", counts)  # jax.checkpoint's primitive.

  def _assert_grads_match_dense(self, fn):
    bridged = hk.transform(lambda x: hkb.call_pure(fn, x, init=init_dense))
    params = bridged.init(KEY, X)
    loss = lambda p, x: jnp.sum(bridged.apply(p, None, x) ** 2)
    reference = lambda p, x: jnp.sum(dense(p["~"], x) ** 2)
    chex.assert_trees_all_close(
      jax.grad(loss, argnums=(0, 1))(params, X),
      jax.grad(reference, argnums=(0, 1))(params, X),
      rtol=1e-5,
      atol=1e-6,
    )
    return bridged

  def test_scan_over_stacked_params(self):
    depth = 4

    def init_stack(rng, x):
      return jax.vmap(lambda k: init_dense(k, x, features=x.shape[-1]))(
        jax.random.split(rng, depth)
      )

    def stack(params, x):
      return jax.lax.scan(lambda h, p: (dense(p, h), None), x, params)[0]

    transformed = hk.transform(lambda x: hkb.call_pure(stack, x, init=init_stack))
    params = transformed.init(KEY, X)
    self.assertEqual(params["~"]["w"].shape, (depth, 4, 4))

    def unrolled(p, x):
      for i in range(depth):
        x = dense(jax.tree.map(lambda a, i=i: a[i], p["~"]), x)
      return x

    loss = lambda f: lambda p: jnp.sum(f(p) ** 2)
    chex.assert_trees_all_close(
      jax.value_and_grad(loss(lambda p: transformed.apply(p, None, X)))(params),
      jax.value_and_grad(loss(lambda p: unrolled(p, X)))(params),
      rtol=1e-5,
      atol=1e-5,
    )

  def test_vmap_inside_fn_per_example_grads(self):
    def per_example_grads(params, x):
      grad = jax.grad(lambda p, xi: jnp.sum(dense(p, xi[None])))
      return jax.vmap(grad, in_axes=(None, 0))(params, x)

    transformed = hk.transform(lambda x: hkb.call_pure(per_example_grads, x, init=init_dense))
    params = transformed.init(KEY, X)
    got = transformed.apply(params, None, X)
    for i in range(X.shape[0]):
      want = jax.grad(lambda p: jnp.sum(dense(p, X[i : i + 1])))(params["~"])
      chex.assert_trees_all_close(
        jax.tree.map(lambda a, i=i: a[i], got), want, rtol=1e-5, atol=1e-6
      )


class HaikuContextsTest(parameterized.TestCase):
  """Works wherever Haiku code works, matching the inline network."""

  def _bridged_and_inline(self):
    inner = hk.transform(mlp_fn)
    return (lambda x: Outer(lambda x: hkb.call_pure(inner, x))(x), lambda x: Outer(mlp_fn)(x))

  # Each wrapper gets a module factory: Haiku modules used in an `hk.scan`
  # body are made outside it (a module made in the body is named anew when
  # the body is traced again), for bridged and inline code alike.
  @parameterized.named_parameters(
    ("hk_vmap", lambda make: lambda x: hk.vmap(make(), split_rng=False)(x)),
    ("hk_remat", lambda make: lambda x: hk.remat(make())(x)),
    (
      "hk_scan",
      lambda make: lambda x: (lambda m: hk.scan(lambda c, xi: (c, m(xi)), 0, x)[1])(make()),
    ),
    (
      "running_init_branch",
      lambda make: lambda x: make()(x) if hk.running_init() else make()(x) * 2,
    ),
  )
  def test_haiku_wrapper(self, wrap):
    inner = hk.transform(mlp_fn)
    bridged = wrap(lambda: Outer(lambda x: hkb.call_pure(inner, x)))
    inline = wrap(lambda: Outer(mlp_fn))
    xs = jnp.stack([X, 2 * X])
    assert_same_model(self, bridged, inline, xs)

  def test_pytree_fn_in_hk_vmap_and_hk_scan(self):
    def body(x):
      return hkb.call_pure(dense, x, init=init_dense)

    def reference(params, xs):
      return jax.vmap(lambda x: dense(params["~"], x))(xs)

    xs = jnp.stack([X, 2 * X])
    for f in (
      hk.transform(lambda xs: hk.vmap(body, split_rng=False)(xs)),
      hk.transform(lambda xs: hk.scan(lambda c, x: (c, body(x)), 0, xs)[1]),
    ):
      params = f.init(KEY, xs)
      chex.assert_trees_all_close(f.apply(params, None, xs), reference(params, xs), rtol=1e-6)

  def test_multi_transform(self):
    inner = hk.transform(mlp_fn)

    def bridged():
      encode = lambda x: hkb.call_pure(inner, x, name="enc")
      decode = lambda x: hkb.call_pure(dense, x, init=init_dense, name="dec")
      return lambda x: decode(encode(x)), (encode, decode)

    def inline():
      def encode(x):
        with hk.name_scope("enc"):
          return mlp_fn(x)

      return lambda x: encode(x), (encode,)

    multi = hk.multi_transform(bridged)
    params = multi.init(KEY, X)
    enc, dec = multi.apply
    reference = hk.multi_transform(inline)
    ref_params = reference.init(KEY, X)
    enc_params = {k: v for k, v in params.items() if k.startswith("enc")}
    chex.assert_trees_all_equal(enc_params, ref_params)
    encoded = enc(params, None, X)
    chex.assert_trees_all_close(encoded, reference.apply[0](ref_params, None, X))
    chex.assert_trees_all_close(dec(params, None, encoded), dense(params["dec"], encoded))

  def test_jit_grad_vmap_of_outer_apply(self):
    bridged, inline = self._bridged_and_inline()
    b, i = hk.transform(bridged), hk.transform(inline)
    params = b.init(KEY, X)
    loss = lambda t: lambda p, x: jnp.sum(t.apply(p, None, x) ** 2)
    chex.assert_trees_all_close(
      jax.jit(jax.grad(loss(b)))(params, X), jax.grad(loss(i))(params, X), rtol=1e-5
    )
    xs = jnp.stack([X, 2 * X])
    chex.assert_trees_all_close(
      jax.vmap(b.apply, in_axes=(None, None, 0))(params, None, xs),
      jax.vmap(i.apply, in_axes=(None, None, 0))(params, None, xs),
      rtol=1e-6,
    )

  def test_jitted_init(self):
    bridged, inline = self._bridged_and_inline()
    backend_tolerance.assert_same(
      jax.jit(hk.transform(bridged).init)(KEY, X), jax.jit(hk.transform(inline).init)(KEY, X)
    )


class ZeroOverheadTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("transformed", True),
    ("pytree", False),
  )
  def test_apply_jaxpr_has_the_primitives_of_inline(self, transformed):
    if transformed:
      inner = hk.transform(lambda x: hk.dropout(hk.next_rng_key(), 0.1, mlp_fn(x)))
      bridged = lambda x: Outer(lambda x: hkb.call_pure(inner, x))(x)
      inline = lambda x: Outer(lambda x: hk.dropout(hk.next_rng_key(), 0.1, mlp_fn(x)))(x)
    else:
      bridged = lambda x: hkb.call_pure(dense, x, init=init_dense, name="linear")
      inline = lambda x: jnp.tanh(hk.Linear(5)(x))
    b, i = hk.transform(bridged), hk.transform(inline)
    params = b.init(KEY, X)
    self.assertEqual(
      test_utils.primitive_counts(lambda p: b.apply(p, KEY, X), params),
      test_utils.primitive_counts(lambda p: i.apply(p, KEY, X), params),
    )


class InlineDivergencesTest(parameterized.TestCase):
  """Cases where the first version differed from inline code (issue 11)."""

  @parameterized.parameters(False, True)
  def test_closure_over_an_outer_module_runs_as_inline(self, getter):
    def body(outside):
      return lambda x: outside(x) + hk.Linear(4, name="inner")(x)

    def bridged(x):
      outside = hk.Linear(4, name="inner")
      return hkb.call_pure(hk.transform(body(outside)), x)

    def inline(x):
      return body(hk.Linear(4, name="inner"))(x)

    params = assert_same_model(
      self, _maybe_getter(bridged, getter), _maybe_getter(inline, getter), X
    )
    self.assertEqual(sorted(params), ["inner", "inner_1"])

  @parameterized.parameters(False, True)
  def test_key_path_bundle_never_shares_an_inline_modules_name(self, getter):
    def init_linear(rng, x):
      return {"linear": {"w": jax.random.normal(rng, [x.shape[-1], 4]), "b": jnp.zeros([4])}}

    pure = lambda p, x: x @ p["linear"]["w"] + p["linear"]["b"]

    def inline_first(x):
      return hk.Linear(4)(x) + hkb.call_pure(pure, x, init=init_linear)

    def bridged_first(x):
      return hkb.call_pure(pure, x, init=init_linear) + hk.Linear(4)(x)

    for f in (inline_first, bridged_first):
      f = hk.transform(_maybe_getter(lambda x, f=f: Outer(f)(x), getter))
      params = f.init(KEY, X)
      self.assertEqual(sorted(params), ["outer/linear", "outer/linear_1"])
      # Two sets of weights at init and at apply: each gets its own gradient.
      grads = jax.grad(lambda p: jnp.sum(f.apply(p, None, X)))(params)
      for bundle in params:
        self.assertGreater(float(jnp.abs(grads[bundle]["w"]).sum()), 0)
      # The bridged leaf reads its own bundle at apply too.
      zeroed = dict(
        params, **{"outer/linear_1": jax.tree.map(jnp.zeros_like, params["outer/linear_1"])}
      )
      self.assertFalse(jnp.allclose(f.apply(zeroed, None, X), f.apply(params, None, X)))

  def test_init_of_a_transform_is_bridged_as_the_transform(self):
    transformed = hk.transform(mlp_fn)

    def bridged(x):
      params = hkb.get_relevant_parameters(transformed.init, x)
      return transformed.apply(params, None, x)

    assert_same_model(self, bridged, mlp_fn, X)

  def test_init_of_a_stateful_transform_is_refused(self):
    stateful = hk.transform_with_state(lambda x: x + hk.get_state("n", [], init=jnp.zeros))
    f = hk.transform_with_state(lambda x: hkb.get_relevant_parameters(stateful.init, x))
    with self.assertRaisesRegex(ValueError, "Haiku function with state"):
      f.init(KEY, X)

  def test_init_must_not_create_haiku_params(self):
    def init(rng, x):
      del rng, x
      hk.get_parameter("w", [], init=jnp.ones)
      return {"w": 2 * jnp.ones([])}

    f = hk.transform(lambda x: hkb.call_pure(lambda p, x: p, x, init=init))
    with self.assertRaisesRegex(
      ValueError,
      r"created Haiku parameters or state itself "
      r"\(\['~/w'\]\)",
    ):
      f.init(KEY, X)


def _maybe_getter(f, getter):
  if not getter:
    return f

  def with_getter(*args):
    with hk.custom_getter(lambda nxt, v, ctx: nxt(v), state=True):
      return f(*args)

  return with_getter


class ErrorsTest(parameterized.TestCase):
  def test_outside_transform(self):
    with self.assertRaisesRegex(ValueError, "inside a Haiku transform"):
      hkb.call_pure(dense, X, init=init_dense)
    with self.assertRaisesRegex(ValueError, "inside a Haiku transform"):
      hkb.get_relevant_parameters(init_dense, X)

  def test_missing_init(self):
    f = hk.transform(lambda x: hkb.call_pure(dense, x))
    with self.assertRaisesRegex(TypeError, "needs `init=`"):
      f.init(KEY, X)

  def _params(self):
    f = hk.transform(
      lambda x: Outer(lambda x: hkb.call_pure(dense, x, init=init_dense, name="proj"))(x)
    )
    return f, f.init(KEY, X)

  def test_wrong_shape_at_apply(self):
    f, params = self._params()
    params["outer/proj"]["w"] = jnp.zeros([4, 6])
    with self.assertRaisesRegex(
      ValueError,
      r"parameter 'outer/proj/w' \(params path \['w'\]\) has shape "
      r"\[4, 6\] .*needs \[4, 5\]",
    ):
      f.apply(params, None, X)

  def test_shard_sized_param_gets_a_shard_map_hint(self):
    f, params = self._params()
    params["outer/proj"]["w"] = jnp.zeros([4, 1])
    with self.assertRaisesRegex(ValueError, r"\[4, 1\].*shard_map"):
      f.apply(params, None, X)
    params["outer/proj"]["w"] = jnp.zeros([4, 6])
    with self.assertRaises(ValueError) as raised:
      f.apply(params, None, X)
    self.assertNotIn("shard_map", str(raised.exception))

  def test_stored_dtype_is_used_as_inline(self):
    # Inline Haiku checks a stored param's shape, never its dtype: params cast
    # for inference (here float16) reach the function as they are.
    f, params = self._params()
    params["outer/proj"]["b"] = params["outer/proj"]["b"].astype(jnp.float16)
    chex.assert_trees_all_equal(f.apply(params, None, X), dense(params["outer/proj"], X))

  def test_missing_at_apply(self):
    f, params = self._params()
    del params["outer/proj"]["b"]
    with self.assertRaisesRegex(
      ValueError,
      r"'outer/proj/b' \(params path \['b'\]\) is "
      "missing at apply",
    ):
      f.apply(params, None, X)

  def test_missing_state_at_apply_is_made_as_inline(self):
    # Inline, state with an init that is missing at apply is made afresh.
    inner_fn = lambda: hk.get_state("n", [], init=jnp.ones)
    f = hk.transform_with_state(lambda: hkb.call_pure(hk.transform_with_state(inner_fn)))
    inline = hk.transform_with_state(inner_fn)
    chex.assert_trees_all_equal(f.apply({}, {}, KEY), inline.apply({}, {}, KEY))

  def test_non_array_leaf(self):
    f = hk.transform(
      lambda x: hkb.call_pure(dense, x, init=lambda rng, x: {"w": 1.0, "b": jnp.zeros([])})
    )
    with self.assertRaisesRegex(TypeError, r"float at params path \['w'\]"):
      f.init(KEY, X)

  def test_two_calls_collide(self):
    def f(x):
      return hkb.call_pure(dense, x, init=init_dense) + hkb.call_pure(dense, x, init=init_dense)

    with self.assertRaisesRegex(
      ValueError, "'~/b'.*already used by another bridged call.*distinct `name=`"
    ):
      hk.transform(f).init(KEY, X)

  def test_leaves_collide_within_one_call(self):
    f = hk.transform(
      lambda: hkb.call_pure(
        lambda p: p, init=lambda rng: {"w_0": jnp.ones([]), "w": [jnp.ones([])]}
      )
    )
    with self.assertRaisesRegex(ValueError, r"\['w'\]\[0\].*\['w_0'\].*'~/w_0'"):
      f.init(KEY)

  def test_invalid_module_component(self):
    f = hk.transform(
      lambda: hkb.call_pure(lambda p: p, init=lambda rng: {"my layer": {"w": jnp.ones([])}})
    )
    with self.assertRaisesRegex(
      ValueError,
      r"\['my layer'\]\['w'\].*'my layer'"
      ".*not a valid Python identifier",
    ):
      f.init(KEY)

  @parameterized.named_parameters(
    ("lax_scan", lambda body, xs: jax.lax.scan(lambda c, x: (c, body(x)), 0, xs)[1]),
    ("jax_vmap", lambda body, xs: jax.vmap(body)(xs)),
    ("jax_checkpoint", lambda body, xs: jax.checkpoint(body)(xs)),
  )
  def test_init_inside_raw_jax_transform(self, wrap):
    for body in (
      lambda x: hkb.call_pure(dense, x, init=init_dense),
      lambda x: hkb.call_pure(hk.transform(mlp_fn), x),
    ):
      f = hk.transform(lambda xs, body=body: wrap(body, xs))
      with self.assertRaisesRegex(ValueError, "raw JAX transform.*hk.scan"):
        f.init(KEY, jnp.stack([X, X]))

  def test_fn_not_callable(self):
    f = hk.transform(lambda x: hkb.call_pure(3, x, init=init_dense))
    with self.assertRaisesRegex(
      TypeError,
      r"hkb.call_pure: `fn` must be a "
      "function.*got a int",
    ):
      f.init(KEY, X)
    self.assertEqual(hk.transform(lambda x: 0).init(KEY, X), {})

  def test_slash_in_a_param_name(self):
    init = lambda rng: {"a/b": jnp.ones([]), "a": {"b": jnp.ones([])}}
    f = hk.transform(lambda: hkb.call_pure(lambda p: p, init=init))
    with self.assertRaisesRegex(
      ValueError,
      r"\['a/b'\] gives the parameter "
      "name 'a/b', which contains '/'",
    ):
      f.init(KEY)

  def test_init_without_rng(self):
    f = hk.transform(lambda x: hkb.call_pure(dense, x, init=init_dense))
    with self.assertRaisesRegex(
      ValueError,
      r"hkb.call_pure: `init` failed "
      r"when called with rng=None.*f.init\(jax",
    ):
      f.init(None, X)
    # An init that needs no key works without one, as inline code does.
    zeros = lambda rng, x: {"w": jnp.zeros([x.shape[-1]])}
    g = hk.transform(lambda x: hkb.call_pure(lambda p, x: x * p["w"], x, init=zeros))
    self.assertEqual(g.init(None, X)["~"]["w"].shape, (4,))

  def test_multi_transform(self):
    multi = hk.multi_transform(lambda: (lambda x: x, (lambda x: x,)))
    for call in (
      lambda x: hkb.call_pure(multi, x),
      lambda x: hkb.call_pure(dense, x, init=multi),
      lambda x: hkb.get_relevant_parameters(multi, x),
    ):
      with self.assertRaisesRegex(TypeError, "hk.multi_transform result"):
        hk.transform(call).init(KEY, X)

  def test_transformed_fn_and_init(self):
    inner = hk.transform(mlp_fn)
    f = hk.transform(lambda x: hkb.call_pure(inner, x, init=hk.transform(mlp_fn)))
    with self.assertRaisesRegex(TypeError, "brings its own init"):
      f.init(KEY, X)

  def test_stateful_init_for_pure_fn(self):
    inner = hk.transform_with_state(lambda x: x * hk.get_state("n", [], init=jnp.ones))
    f = hk.transform_with_state(lambda x: hkb.call_pure(lambda p, x: x, x, init=inner))
    with self.assertRaisesRegex(ValueError, "Haiku function with state"):
      f.init(KEY, X)


if __name__ == "__main__":
  absltest.main()
