"""Tests for equinox_bridge.py, against the same Equinox models run natively.

Ground truth: the model called natively with the weights the adapter holds
(outputs, `eqx.filter_grad`, the `eqx.nn.State` it returns); `to_equinox`
against the Haiku function it wraps.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import equinox as eqx
import haiku as hk
import haiku_bridge as hkb
from testing import skeleton_cache
from testing import migration_fixture
from testing import test_utils
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import equinox_bridge
from haiku_bridge._src import caches

# Made on the CPU: a fresh process (on the CPU beside a TPU) makes the same values.
with test_utils.on_the_fresh_process_backend():
  X = jax.random.normal(jax.random.PRNGKey(7), [6, 4])


class Net(eqx.Module):
  """Linear, batch norm, dropout, a tuple of layers: each kind of leaf."""

  lin: eqx.nn.Linear
  bn: eqx.nn.BatchNorm
  drop: eqx.nn.Dropout
  layers: tuple[eqx.nn.Linear, ...]

  def __init__(self, din: int = 4, dout: int = 3, *, key, dropout: float = 0.0):
    k1, k2, k3 = jax.random.split(key, 3)
    self.lin = eqx.nn.Linear(din, 8, key=k1)
    self.bn = eqx.nn.BatchNorm(8, "batch", mode="batch")
    self.drop = eqx.nn.Dropout(dropout)
    self.layers = (eqx.nn.Linear(8, 8, key=k2), eqx.nn.Linear(8, dout, key=k3))

  def __call__(self, x, state, *, key=None):
    h, state = self.bn(jax.nn.relu(self.lin(x)), state)
    h = self.drop(h, key=key)
    return self.layers[1](jnp.tanh(self.layers[0](h))), state


def net_params(m: Net, scope: str = "net") -> hk.Params:
  """`m`'s weights under the Haiku names the adapter documents, written out."""
  linear = lambda lin: {"weight": lin.weight, "bias": lin.bias}
  return {
    f"{scope}/lin": linear(m.lin),
    f"{scope}/bn": {"weight": m.bn.weight, "bias": m.bn.bias},
    f"{scope}/layers_0": linear(m.layers[0]),
    f"{scope}/layers_1": linear(m.layers[1]),
  }


def net_state(m: Net, state: eqx.nn.State, scope: str = "net") -> hk.State:
  mean, var = state.get(m.bn.batch_state_index)
  return {
    f"{scope}/bn": {
      "batch_counter": state.get(m.bn.batch_counter),
      "batch_state_index_0": mean,
      "batch_state_index_1": var,
    }
  }


def load(m: Net, params: hk.Params, scope: str = "net") -> Net:
  """`m` holding Haiku `params` (inverse of `net_params`)."""
  flat = {(k, n): v for k, e in params.items() for n, v in e.items()}
  where = lambda m: [
    m.lin.weight,
    m.lin.bias,
    m.bn.weight,
    m.bn.bias,
    m.layers[0].weight,
    m.layers[0].bias,
    m.layers[1].weight,
    m.layers[1].bias,
  ]
  names = [
    ("lin", "weight"),
    ("lin", "bias"),
    ("bn", "weight"),
    ("bn", "bias"),
    ("layers_0", "weight"),
    ("layers_0", "bias"),
    ("layers_1", "weight"),
    ("layers_1", "bias"),
  ]
  return eqx.tree_at(where, m, [flat[(f"{scope}/{a}", b)] for a, b in names])


def batched(make):
  """A Haiku net running an Equinox model per example, as Equinox does."""
  return hk.transform_with_state(lambda x: hk.vmap(make(), split_rng=False, axis_name="batch")(x))


def native_batched(m, state, x, key=None):
  return jax.vmap(
    lambda x, s: m(x, s, key=key), in_axes=(0, None), out_axes=(0, None), axis_name="batch"
  )(x, state)


class NamesTest(parameterized.TestCase):
  @parameterized.parameters("constructor", "instance", "lambda")
  def test_params_and_state_named_by_field_path(self, kind):
    native, native_state = eqx.nn.make_with_state(Net)(key=jax.random.PRNGKey(0))
    make = {
      "constructor": lambda: hkb.from_equinox(Net),
      "instance": lambda: hkb.from_equinox(native, state=native_state),
      "lambda": lambda: hkb.from_equinox(lambda key: Net(key=key)),
    }[kind]
    params, state = batched(make).init(jax.random.PRNGKey(0), X)
    self.assertEqual(jax.tree.map(jnp.shape, params), jax.tree.map(jnp.shape, net_params(native)))
    self.assertEqual(
      jax.tree.map(jnp.shape, state), jax.tree.map(jnp.shape, net_state(native, native_state))
    )

  def test_init_values_come_from_haiku_rng(self):
    rng = jax.random.PRNGKey(3)
    params, state = batched(lambda: hkb.from_equinox(Net)).init(rng, X)
    m, s = eqx.nn.make_with_state(Net)(key=next(hk.PRNGSequence(rng)))
    chex.assert_trees_all_equal(params, net_params(m))
    chex.assert_trees_all_equal(state, net_state(m, s))

  def test_calling_twice_shares_weights(self):
    def f(x):
      lin = hkb.from_equinox(functools.partial(eqx.nn.Linear, 4, 4))
      return hk.vmap(lambda x: lin(lin(x)), split_rng=False)(x)

    self.assertEqual(list(hk.transform(f).init(jax.random.PRNGKey(0), X)), ["linear"])


class NativeTest(parameterized.TestCase):
  @parameterized.parameters(False, True)
  def test_outputs_grads_and_state_match_native(self, jit):
    m, s = eqx.nn.make_with_state(Net)(key=jax.random.PRNGKey(1))
    f = batched(lambda: hkb.from_equinox(Net))
    params, state = net_params(m), net_state(m, s)

    def loss(p, st):
      y, st = f.apply(p, st, None, X)
      return jnp.sum(y**2), st

    grad = jax.value_and_grad(loss, has_aux=True)
    if jit:
      grad = jax.jit(grad)
    (value, new_state), grads = grad(params, state)

    def native_loss(m):
      y, st = native_batched(m, s, X)
      return jnp.sum(y**2), st

    (native_value, native_state), native_grads = eqx.filter_value_and_grad(
      native_loss, has_aux=True
    )(m)
    np.testing.assert_allclose(value, native_value, rtol=1e-5)
    chex.assert_trees_all_close(grads, net_params(native_grads), rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(new_state, net_state(m, native_state), rtol=1e-6)

  def test_dropout_key_is_haiku_rng(self):
    f = batched(lambda: hkb.from_equinox(functools.partial(Net, dropout=0.5)))
    params, state = f.init(jax.random.PRNGKey(0), X)
    rng = jax.random.PRNGKey(9)
    y, _ = f.apply(params, state, rng, X)
    m, s = eqx.nn.make_with_state(functools.partial(Net, dropout=0.5))(key=jax.random.PRNGKey(0))
    native, _ = native_batched(load(m, params), s, X, key=next(hk.PRNGSequence(rng)))
    np.testing.assert_allclose(y, native, rtol=1e-6)

  def test_inference_switches_the_model(self):
    f = batched(
      lambda: functools.partial(
        hkb.from_equinox(functools.partial(Net, dropout=0.5)), inference=True
      )
    )
    params, state = f.init(jax.random.PRNGKey(0), X)
    y, _ = jax.jit(f.apply)(params, state, None, X)
    m, s = eqx.nn.make_with_state(functools.partial(Net, dropout=0.5))(key=jax.random.PRNGKey(0))
    native, _ = native_batched(eqx.nn.inference_mode(load(m, params)), s, X)
    np.testing.assert_allclose(y, native, rtol=1e-6)

  def test_inference_passed_when_the_model_takes_it(self):
    f = hk.transform(lambda x: hkb.from_equinox(eqx.nn.Dropout(0.5))(x, inference=True))
    np.testing.assert_array_equal(f.apply({}, None, X), X)

  def test_key_and_inference_through_keyword_arguments_as_native(self):
    # A model taking `**kwargs` takes `key` and `inference` too; a key the
    # call gives is used as it is.
    class Noisy(eqx.Module):
      def __call__(self, x, **kwargs):
        noise = jax.random.normal(kwargs["key"], x.shape)
        return x if kwargs.get("inference") else x + noise

    model, rng, own = Noisy(), jax.random.PRNGKey(2), jax.random.PRNGKey(5)
    run = lambda **kwargs: hk.transform(lambda x: hkb.from_equinox(model)(x, **kwargs)).apply(
      {}, rng, X
    )
    haiku_key = next(hk.PRNGSequence(rng))
    np.testing.assert_array_equal(run(), model(X, key=haiku_key))
    np.testing.assert_array_equal(run(key=own), model(X, key=own))
    np.testing.assert_array_equal(run(inference=True), X)

  def test_apply_without_init_in_process(self):
    m, s = eqx.nn.make_with_state(Net)(key=jax.random.PRNGKey(1))
    caches.clear_caches()
    make = lambda: hkb.from_equinox(functools.partial(Net, 4, 3))
    y, _ = batched(make).apply(net_params(m), net_state(m, s), None, X)
    np.testing.assert_allclose(y, native_batched(m, s, X)[0], rtol=1e-6)


class IssueRowsTest(absltest.TestCase):
  def test_instance_with_its_state_constructs_and_matches_native(self):
    bn = eqx.nn.BatchNorm(4, "batch", mode="batch")
    state = eqx.nn.State(bn)
    f = batched(lambda: hkb.from_equinox(bn, state=state))
    params, hk_state = f.init(None, X)
    y, hk_state = f.apply(params, hk_state, None, X)
    native, native_state = native_batched(bn, state, X)
    np.testing.assert_allclose(y, native, rtol=1e-6)
    mean, var = native_state.get(bn.batch_state_index)
    np.testing.assert_allclose(hk_state["batch_norm"]["batch_state_index_0"], mean, rtol=1e-6)
    np.testing.assert_allclose(hk_state["batch_norm"]["batch_state_index_1"], var, rtol=1e-6)

  def test_bfloat16_creator_as_call_pure(self):
    def creator(next_creator, shape, dtype, init, context):
      del dtype, context
      return next_creator(shape, jnp.bfloat16, init)

    def pure_init(rng, x):
      m = eqx.nn.Linear(4, 3, key=rng)
      return {"weight": m.weight, "bias": m.bias}

    def run(bridged):
      def f(x):
        with hk.custom_creator(creator):
          return bridged(x)

      return hk.transform(f).init(jax.random.PRNGKey(0), X[0])

    ours = run(lambda x: hkb.from_equinox(functools.partial(eqx.nn.Linear, 4, 3))(x))
    theirs = run(lambda x: hkb.call_pure(lambda p, x: x, x, init=pure_init, name="linear"))
    self.assertEqual(ours["linear"]["weight"].dtype, jnp.bfloat16)
    chex.assert_trees_all_equal(ours, theirs)


class TransformsTest(absltest.TestCase):
  def test_layer_scan_matches_native_loop(self):
    depth = 3
    mlp = functools.partial(eqx.nn.MLP, 4, 4, 8, 1)
    layer = lambda h, _: (hk.vmap(hkb.from_equinox(mlp), split_rng=False)(h), None)
    f = hk.transform(lambda x: hkb.layer_scan(layer, x, num_layers=depth, name="stack")[0])
    params = f.init(jax.random.PRNGKey(0), X)
    self.assertEqual(params["stack/mlp/layers_0"]["weight"].shape, (depth, 8, 4))
    loss = lambda p: jnp.sum(f.apply(p, None, X) ** 2)
    value, grads = jax.value_and_grad(loss)(params)

    template = mlp(key=jax.random.PRNGKey(0))
    where = lambda m: [m.layers[0].weight, m.layers[0].bias, m.layers[1].weight, m.layers[1].bias]
    leaves = lambda p, i: [
      p[f"stack/mlp/layers_{j}"][n][i] for j in (0, 1) for n in ("weight", "bias")
    ]
    models = [eqx.tree_at(where, template, leaves(params, i)) for i in range(depth)]

    def native(models):
      h = X
      for m in models:
        h = jax.vmap(m)(h)
      return jnp.sum(h**2)

    native_value, native_grads = eqx.filter_value_and_grad(native)(models)
    np.testing.assert_allclose(value, native_value, rtol=1e-5)
    for i, g in enumerate(native_grads):
      chex.assert_trees_all_close(leaves(grads, i), where(g), rtol=1e-4, atol=1e-6)

  def test_custom_vjp_with_true_vjp_matches_plain_gradient(self):
    def body(x):
      return hkb.from_equinox(functools.partial(eqx.nn.Linear, 4, 3))(x)

    plain = hk.transform(lambda x: jnp.sin(body(x)))
    custom = hk.transform(
      lambda x: jnp.sin(hkb.custom_vjp(body, hkb.vjp_fwd, lambda vjp, g: vjp(g))(x))
    )
    x = X[0]
    params = plain.init(jax.random.PRNGKey(0), x)
    loss = lambda f: lambda p: jnp.sum(f.apply(p, None, x) ** 2)
    chex.assert_trees_all_close(
      jax.grad(loss(custom))(params), jax.grad(loss(plain))(params), rtol=1e-6
    )


class _OneStateIndex(eqx.Module):
  """A model holding one state entry; the tests give it a `__call__`."""

  index: eqx.nn.StateIndex

  def __init__(self, key):
    del key
    self.index = eqx.nn.StateIndex(jnp.zeros(()))


class ErrorsTest(absltest.TestCase):
  def test_constructor_without_sizes(self):
    f = hk.transform(lambda x: hkb.from_equinox(eqx.nn.Linear)(x))
    with self.assertRaisesRegex(
      TypeError,
      r"from_equinox\(Linear\): calling the constructor with "
      r"`key=` alone failed: .*functools.partial\(eqx.nn.Linear",
    ):
      f.init(jax.random.PRNGKey(0), X[0])

  def test_not_a_model(self):
    with self.assertRaisesRegex(TypeError, r"^hkb.from_equinox: `model` must be .*got an int 3\."):
      hk.transform(lambda: hkb.from_equinox(3)).init(None)
    with self.assertRaisesRegex(TypeError, r"`state=` goes with a model"):
      hk.transform(lambda: hkb.from_equinox(Net, state=eqx.nn.State(()))).init(None)

  def test_dropout_without_rng(self):
    f = batched(lambda: hkb.from_equinox(functools.partial(Net, dropout=0.5)))
    params, state = f.init(jax.random.PRNGKey(0), X)
    with self.assertRaisesRegex(
      RuntimeError,
      r"from_equinox\(Net\): Dropout requires a key.*no rng "
      r"here.*inference=True",
    ):
      f.apply(params, state, None, X)

  def test_state_made_by_make_with_state_must_be_given(self):
    m, _ = eqx.nn.make_with_state(Net)(key=jax.random.PRNGKey(0))
    f = batched(lambda: hkb.from_equinox(m))
    with self.assertRaisesRegex(
      ValueError,
      r"from_equinox\(Net\): .*hkb.from_equinox\(model, "
      r"state=state\)",
    ):
      f.init(None, X)

  def test_stateful_model_must_return_state(self):
    class Forgets(_OneStateIndex):
      def __call__(self, x, state):
        return x

    f = hk.transform_with_state(lambda x: hkb.from_equinox(Forgets)(x))
    with self.assertRaisesRegex(
      TypeError,
      r"hkb.from_equinox\(Forgets\): the model has state.*must "
      r"return `\(out, state\)`; it returned an array float32\[6, 4\]",
    ):
      f.init(jax.random.PRNGKey(0), X)

  def test_state_of_another_structure_is_refused(self):
    class Restructures(_OneStateIndex):
      def __call__(self, x, state):
        return x, eqx.nn.State(eqx.nn.StateIndex(jnp.zeros(())))

    f = hk.transform_with_state(lambda x: hkb.from_equinox(Restructures)(x))
    with self.assertRaisesRegex(
      ValueError,
      r"hkb.from_equinox\(Restructures\): the model returned a "
      r"state of another structure than it was given .*state.set",
    ):
      f.init(jax.random.PRNGKey(0), X)

  def test_wrong_param_shape_is_worded_as_call_pure(self):
    f = batched(lambda: hkb.from_equinox(Net))
    params, state = f.init(jax.random.PRNGKey(0), X)
    params["net/lin"]["weight"] = jnp.zeros([8, 5])
    with self.assertRaises(ValueError) as ours:
      f.apply(params, state, None, X)
    pure = hk.transform(
      lambda x: hkb.call_pure(
        lambda p, x: x, x, name="net", init=lambda rng, x: {"lin": {"weight": jnp.zeros([8, 4])}}
      )
    )
    with self.assertRaises(ValueError) as theirs:
      pure.apply({"net/lin": {"weight": jnp.zeros([8, 5])}}, None, X)
    self.assertEqual(
      str(ours.exception),
      str(theirs.exception)
      .replace("hkb.call_pure", "hkb.from_equinox(Net)")
      .replace("['lin']['weight']", "lin.weight"),
    )


# ---------------------------------------------------------------------------
# The cached skeleton: keyed on all it depends on.
# ---------------------------------------------------------------------------


class ConfiguredModel(eqx.Module):
  linear: eqx.nn.Linear

  def __init__(self, *, key):
    self.linear = eqx.nn.Linear(4, skeleton_cache.CONFIG["width"], key=key)

  def __call__(self, x):
    return self.linear(x)


# What each case passes to from_equinox, one object for every call: a
# function, a class.
CONFIGURED = {
  "function": lambda key: eqx.nn.Linear(4, skeleton_cache.CONFIG["width"], key=key),
  "class": ConfiguredModel,
}


def configured_net(kind: str, getter: bool = False) -> hk.Transformed:
  def net(x):
    with skeleton_cache.identity_getter(getter):
      return hkb.from_equinox(CONFIGURED[kind])(x)

  return hk.transform(net)


def native_configured(kind: str, params: hk.Params, x: jax.Array):
  """The same layer run by Equinox itself, holding `params`."""
  del kind  # A Linear in each case.
  (weights,) = params.values()
  linear = eqx.nn.Linear(4, weights["bias"].shape[0], key=jax.random.PRNGKey(0))
  linear = eqx.tree_at(
    lambda lin: (lin.weight, lin.bias), linear, (weights["weight"], weights["bias"])
  )
  return linear(x)


class SkeletonCacheTest(skeleton_cache.SkeletonCacheCases):
  """The skeleton apply takes without building the model: `skeleton_cache.py`."""

  KINDS, X, FILE = tuple(CONFIGURED), X[0], __file__
  net = staticmethod(configured_net)
  native = staticmethod(native_configured)


def child_configured_apply(path: str) -> None:
  skeleton_cache.child_apply(path, configured_net, tuple(CONFIGURED), X[0])


# ---------------------------------------------------------------------------
# Haiku inside Equinox.
# ---------------------------------------------------------------------------


HAIKU, haiku_net = migration_fixture.HAIKU, migration_fixture.haiku_net


class ToEquinoxTest(absltest.TestCase):
  def test_checkpoint_loads_as_is_same_outputs_grads_state(self):
    params, state = migration_fixture.trained_in_haiku(X)

    model = hkb.to_equinox(HAIKU, params=params, state=state)
    chex.assert_trees_all_equal(model.params, params)
    eqx_state = eqx.nn.State(model)
    key = jax.random.PRNGKey(5)

    def loss(model):
      y, s = model(X, eqx_state, key=key)
      return jnp.mean(y**2), s

    (value, new_eqx_state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
    (ref_value, ref_state), ref_grads = jax.value_and_grad(
      lambda p: (lambda o: (jnp.mean(o[0] ** 2), o[1]))(HAIKU.apply(p, state, key, X)), has_aux=True
    )(params)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    chex.assert_trees_all_close(grads.params, ref_grads, rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(model.haiku_state(new_eqx_state), ref_state, rtol=1e-6)

  def test_init_and_back_to_haiku(self):
    key = jax.random.PRNGKey(2)
    model = hkb.to_equinox(HAIKU, X, key=key)
    params, state = HAIKU.init(key, X)
    chex.assert_trees_all_equal(model.params, params)
    s = eqx.nn.State(model)
    chex.assert_trees_all_equal(model.haiku_state(s), state)
    y, _ = model(X, s, is_training=False)
    np.testing.assert_allclose(y, HAIKU.apply(model.params, state, None, X, is_training=False)[0])

  def test_stateless(self):
    f = hk.transform(lambda x: hk.Linear(2)(x))
    model = hkb.to_equinox(f, X, key=jax.random.PRNGKey(0))
    np.testing.assert_allclose(eqx.filter_jit(model)(X), f.apply(model.params, None, X))
    self.assertEqual(model.haiku_state(eqx.nn.State(model)), {})

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, r"needs `key=` to run f.init"):
      hkb.to_equinox(HAIKU, X)
    with self.assertRaisesRegex(TypeError, r"hk.transform_with_state\(f\)"):
      hkb.to_equinox(haiku_net, X, key=jax.random.PRNGKey(0))
    model = hkb.to_equinox(HAIKU, X, key=jax.random.PRNGKey(0))
    with self.assertRaisesRegex(
      TypeError,
      r"called as `model\(\*args, state, "
      r"key=None\)",
    ):
      model(X)


# ---------------------------------------------------------------------------
# Structure.
# ---------------------------------------------------------------------------


class StructureTest(absltest.TestCase):
  def test_training_step_hlo_equals_native(self):
    mlp = functools.partial(eqx.nn.MLP, 4, 3, 16, 2)
    model = mlp(key=jax.random.PRNGKey(0))
    params_part, static = eqx.partition(model, eqx.is_array)
    leaves, treedef = jax.tree.flatten(params_part)
    f = hk.transform(lambda x: hk.vmap(hkb.from_equinox(mlp), split_rng=False)(x))
    params = f.init(jax.random.PRNGKey(0), X)
    names = [
      (f"mlp/layers_{i}", n) for i in range(3) for n in ("weight", "bias")
    ]  # The native leaves' order.

    def native_step(ws, x):
      loss = lambda ws: jnp.sum(
        jax.vmap(eqx.combine(jax.tree.unflatten(treedef, ws), static))(x) ** 2
      )
      return jax.grad(loss)(ws)

    def adapter_step(ws, x):
      def loss(ws):
        p = {}
        for (m, n), w in zip(names, ws):
          p.setdefault(m, {})[n] = w
        return jnp.sum(f.apply(p, None, x) ** 2)

      return jax.grad(loss)(ws)

    ws = [params[m][n] for m, n in names]
    hlo = [
      test_utils.canonical_hlo(jax.jit(step).lower(ws, X).compile())
      for step in (native_step, adapter_step)
    ]
    self.assertEqual(hlo[0], hlo[1])

  def test_public_names(self):
    self.assertIs(hkb.from_equinox, equinox_bridge.from_equinox)
    self.assertIs(hkb.to_equinox, equinox_bridge.to_equinox)


if __name__ == "__main__":
  absltest.main()
