"""Tests for flax_bridge.py, against the same Flax modules run natively.

Ground truth: an NNX module called natively (outputs, `nnx.grad`, updated
`BatchStat`s) with the weights the adapter holds; Linen modules against
`hk.experimental.flax.lift` and against `module.apply`; `to_nnx` against the
Haiku function it wraps.
"""

import functools
import os
import re
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import flax.linen as nn
import haiku as hk
import haiku_bridge as hkb
from testing import migration_fixture
from testing import test_utils
import jax
import jax.numpy as jnp
import numpy as np
import optax

from haiku_bridge._src import flax_bridge
from haiku_bridge._src import foreign_storage

X = jax.random.normal(jax.random.PRNGKey(7), [6, 4])


class Block(nnx.Module):
  """Linear, BatchNorm, dropout, a list of layers: every kind of NNX variable."""

  def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs,
               dropout: float = 0.0):
    self.linear1 = nnx.Linear(din, 8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(dropout, rngs=rngs)
    self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])
    self.out = nnx.Linear(8, dout, rngs=rngs)

  def __call__(self, x):
    h = self.drop(jax.nn.relu(self.bn(self.linear1(x))))
    for layer in self.layers:
      h = jnp.tanh(layer(h))
    return self.out(h)


def block_params(m: Block, scope: str = "block") -> hk.Params:
  """`m`'s weights under the Haiku names the adapter documents, written out."""
  linear = lambda l: {"kernel": l.kernel[...], "bias": l.bias[...]}
  return {f"{scope}/linear1": linear(m.linear1),
          f"{scope}/bn": {"scale": m.bn.scale[...], "bias": m.bn.bias[...]},
          f"{scope}/layers_0": linear(m.layers[0]),
          f"{scope}/layers_1": linear(m.layers[1]),
          f"{scope}/out": linear(m.out)}


def block_state(m: Block, scope: str = "block") -> hk.State:
  return {f"{scope}/bn": {"mean": m.bn.mean[...], "var": m.bn.var[...]}}


def with_params(m: nnx.Module, params: nnx.State) -> nnx.Module:
  """A copy of `m` holding `params` (e.g. gradients) as its nnx.Params."""
  graphdef, _, rest = nnx.split(m, nnx.Param, ...)
  return nnx.merge(graphdef, params, rest)


def native_loss(m: Block, x):
  return jnp.sum(m(x) ** 2)


def adapter_net(make=lambda: functools.partial(Block, 4, 3)):
  return hk.transform_with_state(lambda x: hkb.from_flax(make())(x))


class NnxNamesTest(parameterized.TestCase):

  @parameterized.parameters("constructor", "instance", "lambda")
  def test_params_and_state_named_by_attribute_path(self, kind):
    make = {"constructor": lambda: functools.partial(Block, 4, 3),
            "instance": lambda: Block(4, 3, rngs=nnx.Rngs(0)),
            "lambda": lambda: lambda rngs: Block(4, 3, rngs=rngs)}[kind]
    params, state = adapter_net(make).init(jax.random.PRNGKey(0), X)
    self.assertEqual(jax.tree.map(jnp.shape, params), jax.tree.map(
        jnp.shape, block_params(Block(4, 3, rngs=nnx.Rngs(0)))))
    self.assertEqual(sorted(state), ["block/bn"])
    self.assertEqual(sorted(state["block/bn"]), ["mean", "var"])

  def test_name_and_scope(self):
    def f(x):
      with hk.name_scope("enc"):
        return hkb.from_flax(functools.partial(nnx.Linear, 4, 2),
                             name="proj")(x)
    params = hk.transform(f).init(jax.random.PRNGKey(0), X)
    self.assertEqual(list(params), ["enc/proj"])
    self.assertEqual(sorted(params["enc/proj"]), ["bias", "kernel"])

  def test_calling_twice_shares_weights(self):
    def f(x):
      block = hkb.from_flax(functools.partial(nnx.Linear, 4, 4))
      return block(block(x))
    params = hk.transform(f).init(jax.random.PRNGKey(0), X)
    self.assertEqual(list(params), ["linear"])

  def test_two_adapters_get_two_names(self):
    def f(x):
      return (hkb.from_flax(functools.partial(nnx.Linear, 4, 4))(x) +
              hkb.from_flax(functools.partial(nnx.Linear, 4, 4))(x))
    params = hk.transform(f).init(jax.random.PRNGKey(0), X)
    self.assertEqual(sorted(params), ["linear", "linear_1"])

  def test_init_values_come_from_haiku_rng(self):
    rng = jax.random.PRNGKey(3)
    params, _ = adapter_net().init(rng, X)
    key = next(hk.PRNGSequence(rng))
    chex.assert_trees_all_equal(params,
                                block_params(Block(4, 3, rngs=nnx.Rngs(key))))

  def test_instance_weights_are_the_initial_params(self):
    m = Block(4, 3, rngs=nnx.Rngs(5))
    params, state = adapter_net(lambda: m).init(None, X)
    chex.assert_trees_all_equal(params, block_params(m))
    chex.assert_trees_all_equal(state, block_state(m))


class NnxNativeTest(parameterized.TestCase):
  """Same outputs, gradients and state updates as the module run in NNX."""

  @parameterized.product(jit=[False, True], mode=["train", "eval"])
  def test_outputs_grads_and_state_match_native(self, jit, mode):
    m = Block(4, 3, rngs=nnx.Rngs(1))
    params, state = block_params(m), block_state(m)
    # Make the running statistics non-trivial first.
    m(X + 1.0)
    state = block_state(m)

    def make():
      block = hkb.from_flax(functools.partial(Block, 4, 3))
      return block.eval() if mode == "eval" else block

    f = hk.transform_with_state(lambda x: make()(x))
    loss = lambda p, s, x: (lambda o: (jnp.sum(o[0] ** 2), o[1]))(
        f.apply(p, s, None, x))
    grad = jax.value_and_grad(loss, has_aux=True)
    if jit:
      grad = jax.jit(grad)
    (value, new_state), grads = grad(params, state, X)

    getattr(m, mode)()
    native_value, native_grads = nnx.value_and_grad(native_loss)(m, X)
    chex.assert_trees_all_close(value, native_value, rtol=1e-5)
    chex.assert_trees_all_close(new_state, block_state(m), rtol=1e-5)
    native = with_params(m, native_grads)
    chex.assert_trees_all_close(grads, block_params(native), rtol=1e-5,
                                atol=1e-6)
    if mode == "eval":
      chex.assert_trees_all_equal(new_state, state)

  def test_dropout_draws_from_haiku_rng(self):
    make = lambda: functools.partial(Block, 4, 3, dropout=0.5)
    f = adapter_net(make)
    params, state = f.init(jax.random.PRNGKey(0), X)
    rng = jax.random.PRNGKey(11)
    y, _ = f.apply(params, state, rng, X)
    # Ground truth: the module's stream key is fold_in(hk.next_rng_key(), i).
    m = Block(4, 3, rngs=nnx.Rngs(0), dropout=0.5)
    _load(m, params, state, "block")
    stream = jax.random.wrap_key_data(
        jax.random.fold_in(next(hk.PRNGSequence(rng)), 0))
    m.drop.rngs.key[...] = stream
    m.drop.rngs.count[...] = jnp.zeros((), jnp.uint32)
    np.testing.assert_allclose(y, m(X), rtol=1e-5, atol=1e-6)
    y2, _ = f.apply(params, state, jax.random.PRNGKey(12), X)
    self.assertFalse(np.allclose(y, y2))

  def test_eval_needs_no_rng(self):
    f = hk.transform_with_state(lambda x: hkb.from_flax(functools.partial(
        Block, 4, 3, dropout=0.5)).eval()(x))
    params, state = f.init(jax.random.PRNGKey(0), X)
    y, _ = jax.jit(f.apply)(params, state, None, X)
    self.assertEqual(y.shape, (6, 3))

  def test_train_attributes_pass_through(self):
    # nnx's train(**attributes) sets them on every submodule that has them.
    f = hk.transform_with_state(lambda x: hkb.from_flax(functools.partial(
        Block, 4, 3, dropout=0.5)).train(rate=0.0)(x))
    params, state = f.init(jax.random.PRNGKey(0), X)
    y1, _ = f.apply(params, state, jax.random.PRNGKey(1), X)
    y2, _ = f.apply(params, state, jax.random.PRNGKey(2), X)
    np.testing.assert_array_equal(y1, y2)

  def test_call_arguments_pass_through(self):
    f = hk.transform(lambda x: hkb.from_flax(functools.partial(
        nnx.Dropout, 0.5))(x, deterministic=True))
    np.testing.assert_array_equal(f.apply({}, None, X), X)

  def test_apply_without_init_in_process(self):
    m = Block(4, 3, rngs=nnx.Rngs(1))
    foreign_storage.clear_cache()
    ctor = functools.partial(Block, 4, 3)  # A new constructor: not cached.
    f = hk.transform_with_state(lambda x: hkb.from_flax(ctor)(x))
    y, _ = f.apply(block_params(m), block_state(m), None, X)
    np.testing.assert_allclose(y, m(X), rtol=1e-5)


class NnxTransformsTest(parameterized.TestCase):
  """Inside layer_scan, custom_vjp, hk.vmap: against native loops and vjps."""

  def test_layer_scan_of_blocks_matches_native_loop(self):
    depth = 3
    layer = lambda h, _: (hkb.from_flax(functools.partial(Block, 4, 4))(h),
                          None)
    f = hk.transform_with_state(
        lambda x: hkb.layer_scan(layer, x, num_layers=depth, name="stack")[0])
    params, state = f.init(jax.random.PRNGKey(0), X)
    self.assertEqual(params["stack/block/linear1"]["kernel"].shape,
                     (depth, 4, 8))
    self.assertEqual(state["stack/block/bn"]["mean"].shape, (depth, 8))
    loss = lambda p, s: (lambda o: (jnp.sum(o[0] ** 2), o[1]))(
        f.apply(p, s, None, X))
    (value, new_state), grads = jax.value_and_grad(loss, has_aux=True)(
        params, state)

    layers = []
    for i in range(depth):
      m = Block(4, 4, rngs=nnx.Rngs(0))
      take = lambda tree: jax.tree.map(lambda a: a[i], tree)
      _load(m, take(params), take(state), "stack/block")
      layers.append(m)

    def native(ms):
      h = X
      for m in ms:
        h = m(h)
      return jnp.sum(h ** 2)

    native_value, native_grads = nnx.value_and_grad(native)(layers)
    chex.assert_trees_all_close(value, native_value, rtol=1e-5)
    for i, m in enumerate(layers):
      take = lambda tree: jax.tree.map(lambda a: a[i], tree)
      chex.assert_trees_all_close(take(new_state),
                                  block_state(m, "stack/block"), rtol=1e-5)
      g = with_params(m, native_grads[i])
      chex.assert_trees_all_close(take(grads), block_params(g, "stack/block"),
                                  rtol=1e-4, atol=1e-6)

  def test_custom_vjp_with_true_vjp_matches_plain_gradient(self):
    def body(x):
      return hkb.from_flax(functools.partial(nnx.Linear, 4, 3))(x)

    def bwd(vjp, g):
      return vjp(g)

    plain = hk.transform(lambda x: jnp.sin(body(x)))
    custom = hk.transform(
        lambda x: jnp.sin(hkb.custom_vjp(body, hkb.vjp_fwd, bwd)(x)))
    params = plain.init(jax.random.PRNGKey(0), X)
    self.assertEqual(jax.tree.structure(params),
                     jax.tree.structure(custom.init(jax.random.PRNGKey(0), X)))
    loss = lambda f: lambda p: jnp.sum(f.apply(p, None, X) ** 2)
    chex.assert_trees_all_close(jax.grad(loss(custom))(params),
                                jax.grad(loss(plain))(params), rtol=1e-6)

  def test_hk_vmap_matches_native_vmap(self):
    m = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    f = hk.transform(lambda x: hk.vmap(
        hkb.from_flax(m), split_rng=False)(x))
    params = f.init(None, X)
    np.testing.assert_allclose(f.apply(params, None, X),
                               jax.vmap(m)(X), rtol=1e-6)


def _load(m: Block, params: hk.Params, state: hk.State, scope: str) -> None:
  for path, value in (list(params.items()) + list(state.items())):
    node = m
    for part in path[len(scope) + 1:].split("/"):
      match = re.fullmatch(r"layers_(\d+)", part)
      node = node.layers[int(match[1])] if match else getattr(node, part)
    for name, array in value.items():
      getattr(node, name)[...] = array


class NnxErrorsTest(absltest.TestCase):

  def test_constructor_without_sizes(self):
    f = hk.transform(lambda x: hkb.from_flax(nnx.Linear)(x))
    with self.assertRaisesRegex(
        TypeError, r"from_flax\(Linear\): calling the constructor with "
        r"`rngs=` alone failed: .*in_features.*functools.partial\(nnx.Linear"):
      f.init(jax.random.PRNGKey(0), X)

  def test_not_a_module(self):
    with self.assertRaisesRegex(TypeError, r"got int"):
      hk.transform(lambda: hkb.from_flax(3)).init(None)

  def test_constructor_returning_something_else(self):
    f = hk.transform(lambda x: hkb.from_flax(lambda rngs: 3)(x))
    with self.assertRaisesRegex(TypeError, r"returned a int, not an nnx.Module"):
      f.init(jax.random.PRNGKey(0), X)

  def test_static_attribute_changed_by_the_call(self):
    class Counter(nnx.Module):

      def __init__(self, *, rngs):
        self.linear = nnx.Linear(4, 2, rngs=rngs)
        self.calls = 0

      def __call__(self, x):
        self.calls += 1
        return self.linear(x)

    f = hk.transform(lambda x: hkb.from_flax(Counter)(x))
    with self.assertRaisesRegex(
        ValueError, r"from_flax\(Counter\) changed its structure during the "
        r"call \(calls: 0 -> 1\).*nnx.Variable"):
      f.init(jax.random.PRNGKey(0), X)

  def test_param_assigned_by_the_call(self):
    class Writer(nnx.Module):

      def __init__(self, *, rngs):
        self.w = nnx.Param(jnp.ones(4))

      def __call__(self, x):
        self.w[...] = self.w[...] + 1
        return x * self.w[...]

    f = hk.transform(lambda x: hkb.from_flax(Writer)(x))
    with self.assertRaisesRegex(
        ValueError, r"from_flax\(Writer\) assigned to its nnx.Param 'w'.*"
        r"another nnx.Variable type"):
      f.init(jax.random.PRNGKey(0), X)

  def test_dropout_without_rng(self):
    f = adapter_net(lambda: functools.partial(Block, 4, 3, dropout=0.5))
    params, state = f.init(jax.random.PRNGKey(0), X)
    with self.assertRaisesRegex(
        ValueError, r"from_flax\(Block\) drew a key from its rng stream at "
        r"'drop.rngs', but the Haiku transform has no rng.*\.eval\(\)"):
      f.apply(params, state, None, X)

  def test_wrong_param_shape(self):
    f = adapter_net()
    params, state = f.init(jax.random.PRNGKey(0), X)
    params["block/out"]["kernel"] = jnp.zeros([8, 5])
    with self.assertRaisesRegex(
        ValueError, r"from_flax\(Block\): parameter 'out.kernel' \(Haiku "
        r"parameter 'block/out/kernel', expected float32\[8, 3\]\)"):
      f.apply(params, state, None, X)

  def test_missing_state(self):
    f = adapter_net()
    params, _ = f.init(jax.random.PRNGKey(0), X)
    with self.assertRaisesRegex(
        ValueError, r"state 'bn.mean' \(Haiku state 'block/bn/mean'"):
      f.apply(params, {}, None, X)

  def test_two_attributes_with_one_name(self):
    class Clash(nnx.Module):

      def __init__(self, *, rngs):
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs)])
        self.layers_0 = nnx.Linear(4, 4, rngs=rngs)

      def __call__(self, x):
        return self.layers[0](x) + self.layers_0(x)

    f = hk.transform(lambda x: hkb.from_flax(Clash)(x))
    with self.assertRaisesRegex(
        ValueError, r"from_flax\(Clash\): parameter 'layers_0.bias' and "
        r"parameter 'layers\[0\].bias' both map to the Haiku name "
        r"'layers_0/bias'. Rename"):
      f.init(jax.random.PRNGKey(0), X)


# ---------------------------------------------------------------------------
# Linen.
# ---------------------------------------------------------------------------


class LinenBlock(nn.Module):

  @nn.compact
  def __call__(self, x, train: bool = True):
    h = nn.Dense(8)(x)
    h = nn.BatchNorm(use_running_average=not train)(h)
    h = nn.Dropout(0.5, deterministic=not train)(jax.nn.relu(h))
    return nn.Dense(3)(h)


def _flat(tree: hk.Params, drop: str) -> dict:
  """Haiku dicts keyed without a prefix/infix, for comparing two naming schemes."""
  return {(k.replace(drop, "").strip("/") or "~") + "/" + n: v
          for k, entries in tree.items() for n, v in entries.items()}


class LinenTest(parameterized.TestCase):

  def test_matches_lift(self):
    """Same names (bar lift's collection level), init values, outputs, grads."""
    ours = hk.transform_with_state(
        lambda x: hkb.from_flax(LinenBlock(), name="blk")(x, train=False))
    lifted = hk.transform_with_state(lambda x: hk.experimental.flax.lift(
        LinenBlock(), name="blk")(x, train=False))
    rng = jax.random.PRNGKey(0)
    p1, s1 = ours.init(rng, X)
    p2, s2 = lifted.init(rng, X)
    self.assertEqual(sorted(p1), ["blk/BatchNorm_0", "blk/Dense_0",
                                  "blk/Dense_1"])
    self.assertEqual(sorted(s1), ["blk/BatchNorm_0"])
    chex.assert_trees_all_equal(p1, p2)
    chex.assert_trees_all_equal(_flat(s1, "blk"),
                                _flat(s2, "blk/batch_stats"))
    loss = lambda f, s: lambda p: jnp.sum(f.apply(p, s, None, X)[0] ** 2)
    chex.assert_trees_all_close(jax.grad(loss(ours, s1))(p1),
                                jax.grad(loss(lifted, s2))(p2), rtol=1e-6)

  def test_train_step_matches_linen_apply(self):
    f = hk.transform_with_state(lambda x: hkb.from_flax(LinenBlock())(x))
    params, state = f.init(jax.random.PRNGKey(0), X)
    rng = jax.random.PRNGKey(4)
    (y, new_state) = f.apply(params, state, rng, X)
    variables = {"params": {k.split("/", 1)[1]: v for k, v in params.items()},
                 "batch_stats": {k.split("/", 1)[1]: v
                                 for k, v in state.items()}}
    dropout = jax.random.fold_in(next(hk.PRNGSequence(rng)), 0)
    native, updates = LinenBlock().apply(variables, X, rngs={
        "dropout": dropout}, mutable=["batch_stats"])
    np.testing.assert_allclose(y, native, rtol=1e-6)
    chex.assert_trees_all_close(
        {k.split("/", 1)[1]: v for k, v in new_state.items()},
        updates["batch_stats"], rtol=1e-6)

  def test_missing_rng_is_explained(self):
    f = hk.transform_with_state(lambda x: hkb.from_flax(LinenBlock())(x))
    params, state = f.init(jax.random.PRNGKey(0), X)
    with self.assertRaisesRegex(
        ValueError, r"from_flax\(LinenBlock\): Dropout_0 needs PRNG for "
        r"\"dropout\".*Pass an rng to apply"):
      f.apply(params, state, None, X)

  def test_apply_without_init_in_process(self):
    f = hk.transform_with_state(
        lambda x: hkb.from_flax(LinenBlock())(x, train=False))
    params, state = f.init(jax.random.PRNGKey(0), X)
    foreign_storage.clear_cache()
    y, _ = jax.jit(f.apply)(params, state, None, X)
    self.assertEqual(y.shape, (6, 3))

  def test_collections_clash(self):
    class TwoCollections(nn.Module):

      @nn.compact
      def __call__(self, x):
        self.variable("a", "v", jnp.zeros, ())
        self.variable("b", "v", jnp.zeros, ())
        return x

    f = hk.transform_with_state(lambda x: hkb.from_flax(TwoCollections())(x))
    with self.assertRaisesRegex(
        ValueError, r"variable 'b.v' and variable 'a.v' both map to the "
        r"Haiku name 'v'"):
      f.init(jax.random.PRNGKey(0), X)


# ---------------------------------------------------------------------------
# Haiku inside NNX.
# ---------------------------------------------------------------------------


HAIKU, haiku_net = migration_fixture.HAIKU, migration_fixture.haiku_net


class ToNnxTest(parameterized.TestCase):

  def test_checkpoint_loads_as_is_same_outputs_grads_state(self):
    params, state = migration_fixture.trained_in_haiku(X)
    rngs = nnx.Rngs(dropout=5)
    model = hkb.to_nnx(HAIKU, params=params, state=state, rngs=rngs)
    self.assertEqual(jax.tree.map(jnp.shape, nnx.to_pure_dict(
        nnx.state(model, nnx.Param))["params"]),
                     jax.tree.map(jnp.shape, params))
    key = nnx.Rngs(dropout=5).dropout()  # The key the model will draw.

    def haiku_loss(p):
      y, s = HAIKU.apply(p, state, key, X)
      return jnp.mean(y ** 2), s

    (value, new_state), grads = jax.value_and_grad(haiku_loss, has_aux=True)(
        params)
    nnx_value, nnx_grads = nnx.value_and_grad(
        lambda m: jnp.mean(m(X) ** 2))(model)
    np.testing.assert_allclose(nnx_value, value, rtol=1e-6)
    chex.assert_trees_all_close(nnx.to_pure_dict(nnx_grads)["params"], grads,
                                rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(model.haiku_state(), new_state, rtol=1e-6)

  def test_back_to_haiku_after_training_in_nnx(self):
    model = hkb.to_nnx(HAIKU, X, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
      grads = nnx.grad(lambda m: jnp.mean(m(X) ** 2))(model)
      optimizer.update(model, grads)

    for _ in range(2):
      step(model, optimizer)
    params, state = model.haiku_params(), model.haiku_state()
    y, _ = HAIKU.apply(params, state, None, X, is_training=False)
    np.testing.assert_allclose(model(X, is_training=False), y, rtol=1e-6)

  def test_init_uses_params_stream(self):
    model = hkb.to_nnx(HAIKU, X, rngs=nnx.Rngs(params=3))
    params, state = HAIKU.init(nnx.Rngs(params=3).params(), X)
    chex.assert_trees_all_equal(model.haiku_params(), params)
    chex.assert_trees_all_equal(model.haiku_state(), state)

  def test_stateless_transform(self):
    f = hk.transform(lambda x: hk.Linear(2)(x))
    model = hkb.to_nnx(f, X, rngs=nnx.Rngs(0))
    params = f.init(nnx.Rngs(0).params(), X)
    np.testing.assert_allclose(model(X), f.apply(params, None, X))

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, r"needs `rngs=nnx.Rngs\(...\)`"):
      hkb.to_nnx(HAIKU, X)
    with self.assertRaisesRegex(TypeError, r"hk.transform_with_state\(f\)"):
      hkb.to_nnx(haiku_net, X, rngs=nnx.Rngs(0))
    grows = hk.transform_with_state(
        lambda x: hk.set_state("n", jnp.zeros(())) or x)
    model = hkb.to_nnx(grows, params={}, state={})
    with self.assertRaisesRegex(ValueError, r"created state '~/n' in apply"):
      model(X)


# ---------------------------------------------------------------------------
# Structure: the optimised HLO; the public API; docstrings.
# ---------------------------------------------------------------------------


class StructureTest(absltest.TestCase):

  def test_training_step_hlo_equals_native(self):
    """An NNX block through the adapter compiles to the native step's HLO."""
    m = Block(4, 3, rngs=nnx.Rngs(0))
    graphdef, native_params, rest = nnx.split(m, nnx.Param, ...)
    leaves, treedef = jax.tree.flatten(native_params)
    f = hk.transform_with_state(lambda x: hkb.from_flax(
        functools.partial(Block, 4, 3))(x))
    params, state = f.init(jax.random.PRNGKey(0), X)
    h_leaves, h_treedef = jax.tree.flatten(params)
    # Both steps take the same flat list of weights in the same order.
    order = [_hk_index(path, params)
             for path, _ in jax.tree_util.tree_flatten_with_path(
                 native_params)[0]]

    def native_step(ws, x):
      def loss(ws):
        p = jax.tree.unflatten(treedef, ws)
        return jnp.sum(nnx.merge(graphdef, p, rest, copy=True)(x) ** 2)
      return jax.grad(loss)(ws)

    def adapter_step(ws, x):
      def loss(ws):
        flat = [None] * len(ws)
        for i, j in enumerate(order):
          flat[j] = ws[i]
        p = jax.tree.unflatten(h_treedef, flat)
        return jnp.sum(f.apply(p, state, None, x)[0] ** 2)
      return jax.grad(loss)(ws)

    ws = [h_leaves[j] for j in order]
    compiled = [jax.jit(step).lower(ws, X).compile()
                for step in (native_step, adapter_step)]
    self.assertEqual(test_utils.canonical_hlo(compiled[0]),
                     test_utils.canonical_hlo(compiled[1]))

  def test_import_without_flax_and_equinox(self):
    code = (
        "import sys\n"
        "sys.modules['flax'] = None\n"
        "sys.modules['equinox'] = None\n"
        "import haiku_bridge as hkb\n"
        "from haiku_bridge import *\n"
        "for name, extra in [('from_flax', 'flax'), ('to_nnx', 'flax'),\n"
        "                    ('from_equinox', 'equinox'),\n"
        "                    ('to_equinox', 'equinox')]:\n"
        "  try:\n"
        "    getattr(hkb, name)(None)\n"
        "  except ImportError as e:\n"
        "    assert f'pip install \"haiku-bridge[{extra}]\"' in str(e), e\n"
        "    assert f'hkb.{name} needs' in str(e), e\n"
        "  else:\n"
        "    raise AssertionError(name)\n"
        "print('ok')\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", code], env=env,
                            capture_output=True, text=True, check=False)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout.strip(), "ok")

  def test_public_names(self):
    self.assertIs(hkb.from_flax, flax_bridge.from_flax)
    self.assertIs(hkb.to_nnx, flax_bridge.to_nnx)

def _hk_index(path, params) -> int:
  """Index, among the Haiku params' leaves, of the NNX param at `path`."""
  keys = [getattr(k, "key", None) for k in path
          if not isinstance(k, jax.tree_util.GetAttrKey)]
  names = []
  for key in keys:
    if isinstance(key, int):
      names[-1] = f"{names[-1]}_{key}"
    else:
      names.append(key)
  target = ("block/" + "/".join(names[:-1]), names[-1])
  flat = [(m, n) for m in sorted(params) for n in sorted(params[m])]
  return flat.index(target)


if __name__ == "__main__":
  absltest.main()
