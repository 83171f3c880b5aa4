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
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import flax.linen as nn
import haiku as hk
import haiku_bridge as hkb
from testing import skeleton_cache
from testing import migration_fixture
from testing import test_utils
import jax
import jax.numpy as jnp
import numpy as np
import optax

from haiku_bridge._src import flax_bridge
from haiku_bridge._src import caches

# Made on the CPU: a fresh process (on the CPU beside a TPU) makes the same values.
with test_utils.on_the_fresh_process_backend():
  X = jax.random.normal(jax.random.PRNGKey(7), [6, 4])


class Block(nnx.Module):
  """Linear, BatchNorm, dropout, a list of layers: every kind of NNX variable."""

  def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs, dropout: float = 0.0):
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
  linear = lambda lin: {"kernel": lin.kernel[...], "bias": lin.bias[...]}
  return {
    f"{scope}/linear1": linear(m.linear1),
    f"{scope}/bn": {"scale": m.bn.scale[...], "bias": m.bn.bias[...]},
    f"{scope}/layers_0": linear(m.layers[0]),
    f"{scope}/layers_1": linear(m.layers[1]),
    f"{scope}/out": linear(m.out),
  }


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
    make = {
      "constructor": lambda: functools.partial(Block, 4, 3),
      "instance": lambda: Block(4, 3, rngs=nnx.Rngs(0)),
      "lambda": lambda: lambda rngs: Block(4, 3, rngs=rngs),
    }[kind]
    params, state = adapter_net(make).init(jax.random.PRNGKey(0), X)
    self.assertEqual(
      jax.tree.map(jnp.shape, params),
      jax.tree.map(jnp.shape, block_params(Block(4, 3, rngs=nnx.Rngs(0)))),
    )
    self.assertEqual(sorted(state), ["block/bn"])
    self.assertEqual(sorted(state["block/bn"]), ["mean", "var"])

  def test_name_and_scope(self):
    def f(x):
      with hk.name_scope("enc"):
        return hkb.from_flax(functools.partial(nnx.Linear, 4, 2), name="proj")(x)

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
      return hkb.from_flax(functools.partial(nnx.Linear, 4, 4))(x) + hkb.from_flax(
        functools.partial(nnx.Linear, 4, 4)
      )(x)

    params = hk.transform(f).init(jax.random.PRNGKey(0), X)
    self.assertEqual(sorted(params), ["linear", "linear_1"])

  def test_init_values_come_from_haiku_rng(self):
    rng = jax.random.PRNGKey(3)
    params, _ = adapter_net().init(rng, X)
    key = next(hk.PRNGSequence(rng))
    chex.assert_trees_all_equal(params, block_params(Block(4, 3, rngs=nnx.Rngs(key))))

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
    loss = lambda p, s, x: (lambda o: (jnp.sum(o[0] ** 2), o[1]))(f.apply(p, s, None, x))
    grad = jax.value_and_grad(loss, has_aux=True)
    if jit:
      grad = jax.jit(grad)
    (value, new_state), grads = grad(params, state, X)

    getattr(m, mode)()
    native_value, native_grads = nnx.value_and_grad(native_loss)(m, X)
    chex.assert_trees_all_close(value, native_value, rtol=1e-5)
    chex.assert_trees_all_close(new_state, block_state(m), rtol=1e-5)
    native = with_params(m, native_grads)
    chex.assert_trees_all_close(grads, block_params(native), rtol=1e-5, atol=1e-6)
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
    stream = jax.random.wrap_key_data(jax.random.fold_in(next(hk.PRNGSequence(rng)), 0))
    m.drop.rngs.key[...] = stream
    m.drop.rngs.count[...] = jnp.zeros((), jnp.uint32)
    np.testing.assert_allclose(y, m(X), rtol=1e-5, atol=1e-6)
    y2, _ = f.apply(params, state, jax.random.PRNGKey(12), X)
    self.assertFalse(np.allclose(y, y2))

  def test_eval_needs_no_rng(self):
    f = hk.transform_with_state(
      lambda x: hkb.from_flax(functools.partial(Block, 4, 3, dropout=0.5)).eval()(x)
    )
    params, state = f.init(jax.random.PRNGKey(0), X)
    y, _ = jax.jit(f.apply)(params, state, None, X)
    self.assertEqual(y.shape, (6, 3))

  def test_train_attributes_pass_through(self):
    # nnx's train(**attributes) sets them on every submodule that has them.
    f = hk.transform_with_state(
      lambda x: hkb.from_flax(functools.partial(Block, 4, 3, dropout=0.5)).train(rate=0.0)(x)
    )
    params, state = f.init(jax.random.PRNGKey(0), X)
    y1, _ = f.apply(params, state, jax.random.PRNGKey(1), X)
    y2, _ = f.apply(params, state, jax.random.PRNGKey(2), X)
    np.testing.assert_array_equal(y1, y2)

  def test_call_arguments_pass_through(self):
    f = hk.transform(
      lambda x: hkb.from_flax(functools.partial(nnx.Dropout, 0.5))(x, deterministic=True)
    )
    np.testing.assert_array_equal(f.apply({}, None, X), X)

  def test_apply_without_init_in_process(self):
    m = Block(4, 3, rngs=nnx.Rngs(1))
    caches.clear_caches()
    ctor = functools.partial(Block, 4, 3)  # A new constructor: not cached.
    f = hk.transform_with_state(lambda x: hkb.from_flax(ctor)(x))
    y, _ = f.apply(block_params(m), block_state(m), None, X)
    np.testing.assert_allclose(y, m(X), rtol=1e-5)


class NnxTransformsTest(parameterized.TestCase):
  """Inside layer_scan, custom_vjp, hk.vmap: against native loops and vjps."""

  def test_layer_scan_of_blocks_matches_native_loop(self):
    depth = 3
    layer = lambda h, _: (hkb.from_flax(functools.partial(Block, 4, 4))(h), None)
    f = hk.transform_with_state(
      lambda x: hkb.layer_scan(layer, x, num_layers=depth, name="stack")[0]
    )
    params, state = f.init(jax.random.PRNGKey(0), X)
    self.assertEqual(params["stack/block/linear1"]["kernel"].shape, (depth, 4, 8))
    self.assertEqual(state["stack/block/bn"]["mean"].shape, (depth, 8))
    loss = lambda p, s: (lambda o: (jnp.sum(o[0] ** 2), o[1]))(f.apply(p, s, None, X))
    (value, new_state), grads = jax.value_and_grad(loss, has_aux=True)(params, state)

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
      return jnp.sum(h**2)

    native_value, native_grads = nnx.value_and_grad(native)(layers)
    chex.assert_trees_all_close(value, native_value, rtol=1e-5)
    for i, m in enumerate(layers):
      take = lambda tree: jax.tree.map(lambda a: a[i], tree)
      chex.assert_trees_all_close(take(new_state), block_state(m, "stack/block"), rtol=1e-5)
      g = with_params(m, native_grads[i])
      # atol: a block's out/bias feeds the next block's BatchNorm, which subtracts the batch mean,
      # so its gradient is zero but for rounding, ~1e-6 apart on jax 0.8.1 + Flax 0.12.6.
      chex.assert_trees_all_close(take(grads), block_params(g, "stack/block"), rtol=1e-4, atol=1e-5)

  def test_custom_vjp_with_true_vjp_matches_plain_gradient(self):
    def body(x):
      return hkb.from_flax(functools.partial(nnx.Linear, 4, 3))(x)

    def bwd(vjp, g):
      return vjp(g)

    plain = hk.transform(lambda x: jnp.sin(body(x)))
    custom = hk.transform(lambda x: jnp.sin(hkb.custom_vjp(body, hkb.vjp_fwd, bwd)(x)))
    params = plain.init(jax.random.PRNGKey(0), X)
    self.assertEqual(
      jax.tree.structure(params), jax.tree.structure(custom.init(jax.random.PRNGKey(0), X))
    )
    loss = lambda f: lambda p: jnp.sum(f.apply(p, None, X) ** 2)
    chex.assert_trees_all_close(
      jax.grad(loss(custom))(params), jax.grad(loss(plain))(params), rtol=1e-6
    )

  def test_hk_vmap_matches_native_vmap(self):
    m = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    f = hk.transform(lambda x: hk.vmap(hkb.from_flax(m), split_rng=False)(x))
    params = f.init(None, X)
    np.testing.assert_allclose(f.apply(params, None, X), jax.vmap(m)(X), rtol=1e-6)


def _load(m: Block, params: hk.Params, state: hk.State, scope: str) -> None:
  for path, value in list(params.items()) + list(state.items()):
    node = m
    for part in path[len(scope) + 1 :].split("/"):
      match = re.fullmatch(r"layers_(\d+)", part)
      node = node.layers[int(match[1])] if match else getattr(node, part)
    for name, array in value.items():
      getattr(node, name)[...] = array


class NnxErrorsTest(absltest.TestCase):
  def test_constructor_without_sizes(self):
    f = hk.transform(lambda x: hkb.from_flax(nnx.Linear)(x))
    with self.assertRaisesRegex(
      TypeError,
      r"from_flax\(Linear\): calling the constructor with "
      r"`rngs=` alone failed: .*in_features.*functools.partial\(nnx.Linear",
    ):
      f.init(jax.random.PRNGKey(0), X)

  def test_not_a_module(self):
    with self.assertRaisesRegex(TypeError, r"^hkb.from_flax: `module` must be .*got an int 3\."):
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
      ValueError,
      r"hkb.from_flax\(Counter\): the module changed its "
      r"structure during the call \(calls: 0 -> 1\).*nnx.Variable",
    ):
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
      ValueError,
      r"hkb.from_flax\(Writer\): the module assigned to its "
      r"nnx.Param 'w'.*another nnx.Variable type",
    ):
      f.init(jax.random.PRNGKey(0), X)

  def test_dropout_without_rng(self):
    f = adapter_net(lambda: functools.partial(Block, 4, 3, dropout=0.5))
    params, state = f.init(jax.random.PRNGKey(0), X)
    with self.assertRaisesRegex(
      ValueError,
      r"hkb.from_flax\(Block\): the module drew a key from its "
      r"rng stream at 'drop.rngs', but the Haiku transform has no rng.*"
      r"\.eval\(\)",
    ):
      f.apply(params, state, None, X)

  def test_wrong_param_shape_is_worded_as_call_pure(self):
    f = adapter_net()
    params, state = f.init(jax.random.PRNGKey(0), X)
    params["block/out"]["kernel"] = jnp.zeros([8, 5])
    with self.assertRaises(ValueError) as ours:
      f.apply(params, state, None, X)
    # Ground truth: call_pure with the same params tree, leaf and shapes.
    pure = hk.transform(
      lambda x: hkb.call_pure(
        lambda p, x: x, x, name="block", init=lambda rng, x: {"out": {"kernel": jnp.zeros([8, 3])}}
      )
    )
    with self.assertRaises(ValueError) as theirs:
      pure.apply({"block/out": {"kernel": jnp.zeros([8, 5])}}, None, X)
    self.assertEqual(
      str(ours.exception),
      str(theirs.exception)
      .replace("hkb.call_pure", "hkb.from_flax(Block)")
      .replace("['out']['kernel']", "out.kernel"),
    )

  def test_missing_state_is_worded_as_call_pure(self):
    f = adapter_net()
    params, _ = f.init(jax.random.PRNGKey(0), X)
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.from_flax\(Block\): state 'block/bn/mean' \(params "
      r"path bn.mean\) is missing at apply. It is created by init",
    ):
      f.apply(params, {}, None, X)

  def test_two_attributes_with_one_name_as_call_pure(self):
    class Clash(nnx.Module):
      def __init__(self, *, rngs):
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs)])
        self.layers_0 = nnx.Linear(4, 4, rngs=rngs)

      def __call__(self, x):
        return self.layers[0](x) + self.layers_0(x)

    f = hk.transform(lambda x: hkb.from_flax(Clash)(x))
    with self.assertRaises(ValueError) as ours:
      f.init(jax.random.PRNGKey(0), X)
    # Ground truth: call_pure of a tree whose two paths meet the same way.
    tree = lambda rng, x: {"layers": [{"bias": jnp.zeros(4)}], "layers_0": {"bias": jnp.zeros(4)}}
    pure = hk.transform(lambda x: hkb.call_pure(lambda p, x: x, x, init=tree, name="clash"))
    with self.assertRaises(ValueError) as theirs:
      pure.init(jax.random.PRNGKey(0), X)
    self.assertIn("both map to the Haiku parameter 'clash/layers_0/bias'", str(theirs.exception))
    self.assertEqual(
      str(ours.exception),
      str(theirs.exception)
      .replace("hkb.call_pure", "hkb.from_flax(Clash)")
      .replace("['layers'][0]['bias']", "layers[0].bias")
      .replace("['layers_0']['bias']", "layers_0.bias"),
    )


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
  return {
    (k.replace(drop, "").strip("/") or "~") + "/" + n: v
    for k, entries in tree.items()
    for n, v in entries.items()
  }


class LinenTest(parameterized.TestCase):
  def test_matches_lift(self):
    """Same names (bar lift's collection level), init values, outputs, grads."""
    ours = hk.transform_with_state(
      lambda x: hkb.from_flax(LinenBlock(), name="blk")(x, train=False)
    )
    lifted = hk.transform_with_state(
      lambda x: hk.experimental.flax.lift(LinenBlock(), name="blk")(x, train=False)
    )
    rng = jax.random.PRNGKey(0)
    p1, s1 = ours.init(rng, X)
    p2, s2 = lifted.init(rng, X)
    self.assertEqual(sorted(p1), ["blk/BatchNorm_0", "blk/Dense_0", "blk/Dense_1"])
    self.assertEqual(sorted(s1), ["blk/BatchNorm_0"])
    chex.assert_trees_all_equal(p1, p2)
    chex.assert_trees_all_equal(_flat(s1, "blk"), _flat(s2, "blk/batch_stats"))
    loss = lambda f, s: lambda p: jnp.sum(f.apply(p, s, None, X)[0] ** 2)
    chex.assert_trees_all_close(
      jax.grad(loss(ours, s1))(p1), jax.grad(loss(lifted, s2))(p2), rtol=1e-6
    )

  def test_train_step_matches_linen_apply(self):
    f = hk.transform_with_state(lambda x: hkb.from_flax(LinenBlock())(x))
    params, state = f.init(jax.random.PRNGKey(0), X)
    rng = jax.random.PRNGKey(4)
    (y, new_state) = f.apply(params, state, rng, X)
    variables = {
      "params": {k.split("/", 1)[1]: v for k, v in params.items()},
      "batch_stats": {k.split("/", 1)[1]: v for k, v in state.items()},
    }
    dropout = jax.random.fold_in(next(hk.PRNGSequence(rng)), 0)
    native, updates = LinenBlock().apply(
      variables, X, rngs={"dropout": dropout}, mutable=["batch_stats"]
    )
    np.testing.assert_allclose(y, native, rtol=1e-6)
    chex.assert_trees_all_close(
      {k.split("/", 1)[1]: v for k, v in new_state.items()}, updates["batch_stats"], rtol=1e-6
    )

  def test_missing_rng_is_explained(self):
    f = hk.transform_with_state(lambda x: hkb.from_flax(LinenBlock())(x))
    params, state = f.init(jax.random.PRNGKey(0), X)
    with self.assertRaisesRegex(
      ValueError,
      r"hkb.from_flax\(LinenBlock\): Dropout_0 needs PRNG for "
      r"\"dropout\".*Pass an rng to init and apply",
    ):
      f.apply(params, state, None, X)

  def test_apply_without_init_in_process(self):
    f = hk.transform_with_state(lambda x: hkb.from_flax(LinenBlock())(x, train=False))
    params, state = f.init(jax.random.PRNGKey(0), X)
    caches.clear_caches()
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
      ValueError,
      r"hkb.from_flax\(TwoCollections\): params paths a.v and b.v "
      r"both map to the Haiku state 'two_collections/v'. Rename one",
    ):
      f.init(jax.random.PRNGKey(0), X)


# ---------------------------------------------------------------------------
# The rows of issue 18, each against the peer or native run.
# ---------------------------------------------------------------------------


class TwoDrops(nnx.Module):
  """One rng stream drawn twice in one call."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.drop(x), self.drop(x)


class ParamsRng(nn.Module):
  """Returns a key from the `params` stream, at init and apply alike."""

  @nn.compact
  def __call__(self):
    return self.make_rng("params")


class DenseParamsRng(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(x), self.make_rng("params")


class LinenStreams(nn.Module):
  """Draws from streams `a` and `b`: keeps init's keys, returns apply's."""

  @nn.compact
  def __call__(self):
    for stream in ("a", "b"):
      self.variable("keys", stream, functools.partial(self.make_rng, stream))
    return self.make_rng("a"), self.make_rng("b")


class NnxStreams(nnx.Module):
  """Holds two rng streams of its own and draws a key from each."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.rngs = nnx.Rngs(a=rngs(), b=rngs())

  def __call__(self):
    return self.rngs.a(), self.rngs.b()


class StackedDrops(nnx.Module):
  """Three dropout layers built by nnx.vmap: one stream, keys of shape [3]."""

  def __init__(self, *, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap
    def make(rngs):
      return nnx.Dropout(0.5, rngs=rngs)

    self.drops = make(rngs)

  def __call__(self, x):
    return nnx.vmap(lambda drop, x: drop(x), in_axes=(0, None))(self.drops, x)


class StreamsTest(absltest.TestCase):
  """Each stream its own key from Haiku's rng, a key the call gives kept."""

  def test_linen_streams_as_linen_apply(self):
    module = LinenStreams()
    f = hk.transform_with_state(
      lambda **kwargs: hkb.from_flax(module, name="m", rng_streams=("a", "b"))(**kwargs)
    )
    params, state = f.init(jax.random.PRNGKey(0))
    self.assertFalse(np.array_equal(state["m"]["a"], state["m"]["b"]))
    rng, own = jax.random.PRNGKey(3), jax.random.PRNGKey(9)
    key = next(hk.PRNGSequence(rng))
    # Stream i is fed fold_in(hk.next_rng_key(), i); a call's rngs= win.
    fed = {"a": jax.random.fold_in(key, 0), "b": jax.random.fold_in(key, 1)}
    for given in ({}, {"b": own}):
      got, _ = f.apply(params, state, rng, rngs=given)
      native = module.apply({"keys": state["m"]}, rngs={**fed, **given})
      chex.assert_trees_all_equal(got, native)

  def test_a_stack_of_streams_as_native(self):
    f = hk.transform(lambda x: hkb.from_flax(StackedDrops)(x))
    rng = jax.random.PRNGKey(3)
    masks = f.apply(f.init(jax.random.PRNGKey(0), X), rng, X)
    self.assertFalse(np.array_equal(masks[0], masks[1]))  # A key per layer.
    m = StackedDrops(rngs=nnx.Rngs(0))
    key = jax.random.wrap_key_data(jax.random.fold_in(next(hk.PRNGSequence(rng)), 0))
    m.drops.rngs.key[...] = jax.random.split(key, 3)
    m.drops.rngs.count[...] = jnp.zeros([3], jnp.uint32)
    np.testing.assert_array_equal(masks, m(X))

  def test_nnx_streams_as_native(self):
    f = hk.transform(lambda: hkb.from_flax(NnxStreams)())
    params = f.init(jax.random.PRNGKey(0))
    rng = jax.random.PRNGKey(3)
    got = f.apply(params, rng)
    self.assertFalse(np.array_equal(*(jax.random.key_data(k) for k in got)))
    m = NnxStreams(rngs=nnx.Rngs(0))
    key = next(hk.PRNGSequence(rng))
    for i, stream in enumerate((m.rngs.a, m.rngs.b)):  # As the adapter's
      stream.key[...] = jax.random.wrap_key_data(jax.random.fold_in(key, i))
      stream.count[...] = jnp.zeros((), jnp.uint32)
    native = m()
    self.assertEqual([k.dtype for k in got], [k.dtype for k in native])
    chex.assert_trees_all_equal(
      *(tuple(jax.random.key_data(k) for k in keys) for keys in (got, native))
    )


class BridgeDraws(nnx.bridge.Module):
  """An nnx.bridge.Module: a param, and a key from its `default` stream."""

  @nnx.bridge.compact
  def __call__(self, x):
    w = self.param("w", nnx.initializers.ones, (x.shape[-1],))
    return x * w, self.make_rng()


class IssueRowsTest(parameterized.TestCase):
  @parameterized.parameters(False, True)
  def test_one_stream_twice_under_jit_gives_native_masks(self, jit):
    f = hk.transform(lambda x: hkb.from_flax(TwoDrops)(x))
    params = f.init(jax.random.PRNGKey(0), X)
    rng = jax.random.PRNGKey(3)
    a, b = (jax.jit(f.apply) if jit else f.apply)(params, rng, X)
    # Native NNX, its stream keyed as the adapter documents, under nnx.jit.
    m = TwoDrops(rngs=nnx.Rngs(0))
    m.drop.rngs.key[...] = jax.random.wrap_key_data(
      jax.random.fold_in(next(hk.PRNGSequence(rng)), 0)
    )
    m.drop.rngs.count[...] = jnp.zeros((), jnp.uint32)
    native_a, native_b = (nnx.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x)))(m, X)
    self.assertFalse(np.array_equal(native_a, native_b))
    np.testing.assert_array_equal(a, native_a)
    np.testing.assert_array_equal(b, native_b)

  @parameterized.parameters("nnx", "linen")
  def test_bfloat16_creator_as_call_pure(self, kind):
    def creator(next_creator, shape, dtype, init, context):
      del dtype, context
      return next_creator(shape, jnp.bfloat16, init)

    if kind == "nnx":
      adapter = lambda: hkb.from_flax(functools.partial(nnx.Linear, 4, 3), name="proj")

      def pure_init(rng, x):
        m = nnx.Linear(4, 3, rngs=nnx.Rngs(rng))
        return {"kernel": m.kernel[...], "bias": m.bias[...]}
    else:
      adapter = lambda: hkb.from_flax(nn.Dense(3), name="proj")
      pure_init = lambda rng, x: nn.Dense(3).init(rng, x)["params"]

    def run(bridged):
      def f(x):
        with hk.custom_creator(creator):
          return bridged(x)

      return hk.transform(f).init(jax.random.PRNGKey(0), X)

    ours = run(lambda x: adapter()(x))
    theirs = run(lambda x: hkb.call_pure(lambda p, x: x, x, init=pure_init, name="proj"))
    inline = run(lambda x: hk.Linear(3, name="proj")(x))
    self.assertEqual(jax.tree.map(lambda a: a.dtype, ours), jax.tree.map(lambda a: a.dtype, theirs))
    self.assertEqual(ours["proj"]["kernel"].dtype, jnp.bfloat16)
    self.assertEqual(inline["proj"]["w"].dtype, jnp.bfloat16)
    chex.assert_trees_all_equal(ours, theirs)

  def test_linen_put_variable_with_a_python_int_as_lift(self):
    class Cache(nn.Module):
      @nn.compact
      def __call__(self):
        if self.is_initializing():
          self.put_variable("cache", "x", 0)
        x = self.get_variable("cache", "x")
        self.put_variable("cache", "x", x + 1)
        return x

    ours = hk.transform_with_state(lambda: hkb.from_flax(Cache(), name="c")())
    lifted = hk.transform_with_state(lambda: hk.experimental.flax.lift(Cache(), name="c")())
    rng = jax.random.PRNGKey(0)  # lift's init needs one, if unused.
    (_, s1), (_, s2) = ours.init(rng), lifted.init(rng)
    chex.assert_trees_all_equal(_flat(s1, "c"), _flat(s2, "c/cache"))
    for _ in range(3):
      (y1, s1), (y2, s2) = ours.apply({}, s1, None), lifted.apply({}, s2, None)
      self.assertEqual(int(y1), int(y2))
      chex.assert_trees_all_equal(_flat(s1, "c"), _flat(s2, "c/cache"))
    self.assertEqual(int(s1["c"]["x"]), 4)  # init's call, then three.

  def test_a_bare_key_as_rngs_as_linen_apply(self):
    module = DenseParamsRng()
    key = jax.random.PRNGKey(42)
    f = hk.transform(lambda x: hkb.from_flax(module)(x, rngs=key))
    params = f.init(None, X)  # Linen's init takes a bare key as `params`.
    self.assertEqual(
      jax.tree.map(jnp.shape, params),
      jax.tree.map(
        jnp.shape, {"dense_params_rng/Dense_0": module.init(key, X)["params"]["Dense_0"]}
      ),
    )
    out, drawn = f.apply(params, None, X)
    variables = {"params": {"Dense_0": params["dense_params_rng/Dense_0"]}}
    native_out, native_drawn = module.apply(variables, X, rngs=key)
    np.testing.assert_array_equal(out, native_out)
    np.testing.assert_array_equal(drawn, native_drawn)

  def test_a_bare_key_as_rngs_of_a_bridge_module_as_its_apply(self):
    module, key = BridgeDraws(), jax.random.PRNGKey(42)
    f = hk.transform(lambda x: hkb.from_flax(module)(x, rngs=key))
    params = f.init(None, X)
    native_params = module.init(key, X)["params"]
    self.assertEqual(
      jax.tree.map(jnp.shape, params), {"bridge_draws": jax.tree.map(jnp.shape, native_params)}
    )
    out, drawn = f.apply(params, None, X)
    native_out, native_drawn = module.apply({"params": params["bridge_draws"]}, X, rngs=key)
    np.testing.assert_array_equal(out, native_out)
    np.testing.assert_array_equal(jax.random.key_data(drawn), jax.random.key_data(native_drawn))

  def test_params_key_under_init_without_rng_as_lift(self):
    key = jax.random.PRNGKey(42)
    ours = hk.transform(
      lambda x: hkb.from_flax(DenseParamsRng(), name="m")(x, rngs={"params": key})
    )
    lifted = hk.transform(
      lambda x: hk.experimental.flax.lift(DenseParamsRng(), name="m")(x, rngs={"params": key})
    )
    p1, p2 = ours.init(None, X), lifted.init(None, X)
    chex.assert_trees_all_equal(p1, p2)  # Linen's names under `m`: the same.
    chex.assert_trees_all_equal(ours.apply(p1, None, X), lifted.apply(p2, None, X))


# ---------------------------------------------------------------------------
# method=: NNX (name or function) and Linen, e.g. a tied embedding.
# ---------------------------------------------------------------------------


class MethodTest(parameterized.TestCase):
  @parameterized.parameters("name", "function", "bound")
  def test_nnx_tied_embedding_calls_attend(self, how):
    embed = nnx.Embed(10, 4, rngs=nnx.Rngs(0))
    method = {"name": "attend", "function": nnx.Embed.attend, "bound": embed.attend}[how]
    tokens = jnp.array([1, 2, 7])

    def lm(tokens):
      e = hkb.from_flax(functools.partial(nnx.Embed, 10, 4))
      return e(e(tokens), method=method)

    f = hk.transform(lm)
    params = f.init(jax.random.PRNGKey(0), tokens)
    self.assertEqual(list(params), ["embed"])
    embed.embedding[...] = params["embed"]["embedding"]
    np.testing.assert_allclose(
      f.apply(params, None, tokens), embed.attend(embed(tokens)), rtol=1e-6
    )
    grads = jax.grad(lambda p: jnp.sum(f.apply(p, None, tokens) ** 2))(params)
    native = nnx.grad(lambda m: jnp.sum(m.attend(m(tokens)) ** 2))(embed)
    np.testing.assert_allclose(grads["embed"]["embedding"], native["embedding"][...], rtol=1e-5)

  def test_nnx_default_method(self):
    f = hk.transform(
      lambda h: hkb.from_flax(functools.partial(nnx.Embed, 10, 4), method="attend")(h)
    )
    h = jax.random.normal(jax.random.PRNGKey(1), [3, 4])
    params = f.init(jax.random.PRNGKey(0), h)
    embed = nnx.Embed(10, 4, rngs=nnx.Rngs(0))
    embed.embedding[...] = params["embed"]["embedding"]
    np.testing.assert_allclose(f.apply(params, None, h), embed.attend(h), rtol=1e-6)

  @parameterized.parameters("attend", nn.Embed.attend)
  def test_linen_method_as_linen_apply(self, method):
    tokens = jnp.array([1, 2, 7])
    module = nn.Embed(10, 4)

    def lm(tokens):
      e = hkb.from_flax(module)
      return e(e(tokens), method=method)

    f = hk.transform(lm)
    params = f.init(jax.random.PRNGKey(0), tokens)
    variables = {"params": params["embed"]}
    native = module.apply(variables, module.apply(variables, tokens), method=method)
    np.testing.assert_allclose(f.apply(params, None, tokens), native, rtol=1e-6)

  def test_unknown_method_names_the_module_and_its_methods(self):
    # A name it lacks, or one of its attributes that is no method.
    for name in ("atend", "features"):
      f = hk.transform(
        lambda t, name=name: hkb.from_flax(functools.partial(nnx.Embed, 10, 4))(t, method=name)
      )
      with self.assertRaisesRegex(
        AttributeError,
        rf"hkb.from_flax\(Embed\): `method='{name}'` is not "
        r"a method of Embed \(its methods: .*attend.*\)",
      ):
        f.init(jax.random.PRNGKey(0), jnp.array([1]))


# ---------------------------------------------------------------------------
# Intermediates: returned as Haiku state under the name given.
# ---------------------------------------------------------------------------


class SowingNnx(nnx.Module):
  def __init__(self, *, rngs):
    self.linear = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    h = self.linear(x)
    self.linear.sow(nnx.Intermediate, "h", h)
    self.sow(nnx.Intermediate, "mean", jnp.mean(h))
    return jnp.tanh(h)


class SowingLinen(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(3)(x)
    self.sow("intermediates", "h", h)
    return jnp.tanh(h)


class IntermediatesTest(parameterized.TestCase):
  def test_nnx_sown_values_as_state_as_native(self):
    f = hk.transform_with_state(
      lambda x: hkb.from_flax(SowingNnx, intermediates="intermediates")(x)
    )
    params, state = f.init(jax.random.PRNGKey(0), X)
    m = SowingNnx(rngs=nnx.Rngs(0))
    m.linear.kernel[...] = params["sowing_nnx/linear"]["kernel"]
    m.linear.bias[...] = params["sowing_nnx/linear"]["bias"]
    for x in (X, 2 * X):  # Each call returns its own; none accumulate.
      y, state = jax.jit(f.apply)(params, state, None, x)
      native_y, sown = nnx.capture(m, nnx.Intermediate)(x)
      np.testing.assert_allclose(y, native_y, rtol=1e-6)
      np.testing.assert_allclose(
        state["sowing_nnx/intermediates/linear"]["h_0"],
        jax.tree.leaves(sown["linear"]["h"])[0],
        rtol=1e-6,
      )
      np.testing.assert_allclose(
        state["sowing_nnx/intermediates"]["mean_0"], jax.tree.leaves(sown["mean"])[0], rtol=1e-6
      )

  def test_nnx_sown_values_without_a_route_raise(self):
    f = hk.transform(lambda x: hkb.from_flax(SowingNnx)(x))
    with self.assertRaisesRegex(
      ValueError,
      r"hkb.from_flax\(SowingNnx\): the call sowed "
      r"nnx.Intermediate values \(linear.h\[0\], mean\[0\]\).*"
      r"intermediates=\"intermediates\"",
    ):
      f.init(jax.random.PRNGKey(0), X)

  def test_linen_sown_values_as_state_as_linen_apply(self):
    module = SowingLinen()
    f = hk.transform_with_state(lambda x: hkb.from_flax(module, intermediates="sown")(x))
    params, state = f.init(jax.random.PRNGKey(0), X)
    self.assertEqual(sorted(state), ["sowing_linen/sown"])
    variables = {"params": {"Dense_0": params["sowing_linen/Dense_0"]}}
    for x in (X, 2 * X):
      y, state = f.apply(params, state, None, x)
      native_y, updates = module.apply(variables, x, mutable=["intermediates"])
      np.testing.assert_allclose(y, native_y, rtol=1e-6)
      np.testing.assert_allclose(
        state["sowing_linen/sown"]["h_0"], updates["intermediates"]["h"][0], rtol=1e-6
      )

  def test_linen_without_a_route_drops_as_linen_apply(self):
    f = hk.transform_with_state(lambda x: hkb.from_flax(SowingLinen())(x))
    params, state = f.init(jax.random.PRNGKey(0), X)
    self.assertEmpty(state)
    self.assertEmpty(f.apply(params, state, None, X)[1])


# ---------------------------------------------------------------------------
# One storage path: the adapters store as call_pure and inline code do.
# ---------------------------------------------------------------------------


class StoragePathTest(parameterized.TestCase):
  @parameterized.parameters("nnx", "linen")
  def test_getters_see_each_param_once_as_call_pure(self, kind):
    seen = []

    def getter(next_getter, value, context):
      seen.append((context.full_name, value.shape))
      return next_getter(value)

    if kind == "nnx":
      adapter = lambda x: hkb.from_flax(functools.partial(nnx.Linear, 4, 3), name="proj")(x)
      pure_init = lambda rng, x: {"kernel": jnp.zeros([4, 3]), "bias": jnp.zeros([3])}
    else:
      adapter = lambda x: hkb.from_flax(nn.Dense(3), name="proj")(x)
      pure_init = lambda rng, x: nn.Dense(3).init(rng, x)["params"]

    def run(bridged):
      def f(x):
        with hk.custom_getter(getter):
          return bridged(x)

      f = hk.transform(f)
      params = f.init(jax.random.PRNGKey(0), X)
      seen.clear()
      f.apply(params, None, X)
      return sorted(seen)

    theirs = run(lambda x: hkb.call_pure(lambda p, x: x, x, init=pure_init, name="proj"))
    self.assertEqual(run(adapter), theirs)
    self.assertLen(theirs, 2)

  def test_setters_see_only_the_state_the_call_changes_as_inline(self):
    def set_at_apply(net):
      seen = []

      def setter(next_setter, value, context):
        seen.append(context.full_name)
        return next_setter(value)

      def f(x):
        with hk.custom_setter(setter):
          return net(x)

      f = hk.transform_with_state(f)
      params, state = f.init(jax.random.PRNGKey(0), X)
      seen.clear()
      f.apply(params, state, None, X)
      return sorted(seen)

    block = lambda: hkb.from_flax(functools.partial(Block, 4, 3))
    # Inline Haiku's BatchNorm sets its state in training alone.
    inline = lambda train: lambda x: hk.BatchNorm(True, True, 0.9)(x, train or hk.running_init())
    self.assertEqual(set_at_apply(inline(False)), [])
    self.assertNotEqual(set_at_apply(inline(True)), [])
    self.assertEqual(set_at_apply(lambda x: block().eval()(x)), [])
    self.assertEqual(set_at_apply(lambda x: block()(x)), ["block/bn/mean", "block/bn/var"])

  def test_module_names_allocated_as_inline(self):
    def names(first, second):
      return sorted(
        hk.transform(lambda x: second(first(x))).init(jax.random.PRNGKey(0), jnp.ones([2, 4]))
      )

    adapter = lambda x: hkb.from_flax(functools.partial(nnx.Linear, 4, 4))(x)
    inline = lambda x: hk.Linear(4)(x)
    self.assertEqual(names(adapter, inline), names(inline, inline))
    self.assertEqual(names(inline, adapter), names(inline, inline))
    self.assertEqual(names(adapter, adapter), ["linear", "linear_1"])


# ---------------------------------------------------------------------------
# The cached skeleton: keyed on all it depends on.
# ---------------------------------------------------------------------------


class ConfiguredBlock(nnx.Module):
  def __init__(self, din: int, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(din, skeleton_cache.CONFIG["width"], rngs=rngs)

  def __call__(self, x):
    return self.linear(x)


class ConfiguredDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(skeleton_cache.CONFIG["width"])(x)


# What each case passes to from_flax, one object for every call (as the
# issue's `make`): a function, a class, a Linen module.
CONFIGURED = {
  "nnx_function": lambda rngs: nnx.Linear(4, skeleton_cache.CONFIG["width"], rngs=rngs),
  "nnx_class": functools.partial(ConfiguredBlock, 4),
  "linen_class": ConfiguredDense(),
}


def configured_net(kind: str, getter: bool = False) -> hk.Transformed:
  def net(x):
    with skeleton_cache.identity_getter(getter):
      return hkb.from_flax(CONFIGURED[kind])(x)

  return hk.transform(net)


def native_configured(kind: str, params: hk.Params, x: jax.Array):
  """The same layer run by Flax itself, holding `params`."""
  (weights,) = params.values()
  kernel, bias = weights["kernel"], weights["bias"]
  if kind == "linen_class":
    return ConfiguredDense().apply({"params": {"Dense_0": {"kernel": kernel, "bias": bias}}}, x)
  linear = nnx.Linear(*kernel.shape, rngs=nnx.Rngs(0))
  linear.kernel[...], linear.bias[...] = kernel, bias
  return linear(x)


class SkeletonCacheTest(skeleton_cache.SkeletonCacheCases):
  """The skeleton apply takes without building the module: `skeleton_cache.py`."""

  KINDS, X, FILE = tuple(CONFIGURED), X, __file__
  net = staticmethod(configured_net)
  native = staticmethod(native_configured)


def child_configured_apply(path: str) -> None:
  skeleton_cache.child_apply(path, configured_net, tuple(CONFIGURED), X)


class _TwoHeads(nn.Module):
  """Each method makes its own params (Linen builds submodules lazily)."""

  def setup(self):
    self.narrow, self.wide = nn.Dense(3), nn.Dense(5)

  def __call__(self, x):
    return self.narrow(x)

  def widened(self, x):
    return self.wide(x)


class _Counted(nn.Module):
  """A counter only where a `noise` rng is given: the skeleton follows the rngs."""

  @nn.compact
  def __call__(self, x):
    if self.has_rng("noise"):
      seen = self.variable("counts", "seen", lambda: jnp.zeros((), jnp.int32))
      seen.value += 1
    return nn.Dense(3)(x)


_DENSE, _TWO_HEADS, _COUNTED = nn.Dense(3), _TwoHeads(), _Counted()


class LinenSkeletonKeyTest(absltest.TestCase):
  """One Linen module's calls that differ in arguments, method, rng streams or rngs keep their own skeletons."""

  def test_each_call_runs_as_with_no_cache(self):
    x4, x5 = X, jnp.ones([6, 5])
    calls = {
      "width 4": lambda x: hkb.from_flax(_DENSE)(x),
      "width 5": lambda x: hkb.from_flax(_DENSE)(x),
      "__call__": lambda x: hkb.from_flax(_TWO_HEADS)(x),
      "widened": lambda x: hkb.from_flax(_TWO_HEADS, method="widened")(x),
      "a noise stream": lambda x: hkb.from_flax(_COUNTED, rng_streams=("noise",))(x),
      "no stream": lambda x: hkb.from_flax(_COUNTED, rng_streams=())(x),
      "noise per call": lambda x: hkb.from_flax(_COUNTED, rng_streams=())(
        x, rngs={"noise": hk.next_rng_key()}
      ),
    }
    inputs = {name: x5 if name == "width 5" else x4 for name in calls}
    nets = {name: hk.transform_with_state(f) for name, f in calls.items()}
    rng = jax.random.PRNGKey(3)

    def run(name, params, state):
      return nets[name].apply(params, state, rng, inputs[name])

    with caches.disabled():
      cold = {name: run(name, *net.init(rng, inputs[name])) for name, net in nets.items()}
    with mock.patch.object(caches, "_enabled", True):
      caches.clear_caches()
      initialized = {name: net.init(rng, inputs[name]) for name, net in nets.items()}
      warm = {name: run(name, *initialized[name]) for name in nets}
    # The counter's state where a noise rng is given, and only there.
    self.assertEqual(
      {
        name: "seen" in str(cold[name][1])
        for name in ("a noise stream", "no stream", "noise per call")
      },
      {"a noise stream": True, "no stream": False, "noise per call": True},
    )
    for name in calls:
      chex.assert_trees_all_equal(warm[name], cold[name])


# ---------------------------------------------------------------------------
# Haiku inside NNX.
# ---------------------------------------------------------------------------


HAIKU, haiku_net = migration_fixture.HAIKU, migration_fixture.haiku_net


class ToNnxTest(parameterized.TestCase):
  def test_checkpoint_loads_as_is_same_outputs_grads_state(self):
    params, state = migration_fixture.trained_in_haiku(X)
    rngs = nnx.Rngs(dropout=5)
    model = hkb.to_nnx(HAIKU, params=params, state=state, rngs=rngs)
    self.assertEqual(
      jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(model, nnx.Param))["params"]),
      jax.tree.map(jnp.shape, params),
    )
    key = nnx.Rngs(dropout=5).dropout()  # The key the model will draw.

    def haiku_loss(p):
      y, s = HAIKU.apply(p, state, key, X)
      return jnp.mean(y**2), s

    (value, new_state), grads = jax.value_and_grad(haiku_loss, has_aux=True)(params)
    nnx_value, nnx_grads = nnx.value_and_grad(lambda m: jnp.mean(m(X) ** 2))(model)
    np.testing.assert_allclose(nnx_value, value, rtol=1e-6)
    chex.assert_trees_all_close(nnx.to_pure_dict(nnx_grads)["params"], grads, rtol=1e-5, atol=1e-7)
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

  def test_apply_rng_from_the_named_stream(self):
    f = hk.transform(lambda x: x + jax.random.normal(hk.next_rng_key(), x.shape))
    model = hkb.to_nnx(f, X, rngs=nnx.Rngs(0, noise=5), rng_stream="noise")
    key = nnx.Rngs(0, noise=5).noise()  # The key the model will draw.
    np.testing.assert_array_equal(model(X), f.apply({}, key, X))

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
    grows = hk.transform_with_state(lambda x: hk.set_state("n", jnp.zeros(())) or x)
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
    f = hk.transform_with_state(lambda x: hkb.from_flax(functools.partial(Block, 4, 3))(x))
    params, state = f.init(jax.random.PRNGKey(0), X)
    h_leaves, h_treedef = jax.tree.flatten(params)
    # Both steps take the same flat list of weights in the same order.
    order = [
      _hk_index(path, params) for path, _ in jax.tree_util.tree_flatten_with_path(native_params)[0]
    ]

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
    compiled = [jax.jit(step).lower(ws, X).compile() for step in (native_step, adapter_step)]
    self.assertEqual(test_utils.canonical_hlo(compiled[0]), test_utils.canonical_hlo(compiled[1]))

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
      "    assert f'pip install {extra} (or' in str(e), e\n"
      "    assert f'pip install \".[{extra}]\"' in str(e), e\n"
      "    assert f'hkb.{name}: needs' in str(e), e\n"
      "  else:\n"
      "    raise AssertionError(name)\n"
      "print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # The checkout first, PYTHONPATH kept after it: dm-haiku may be found there alone.
    path = [root] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), JAX_PLATFORMS="cpu")
    result = subprocess.run(
      [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout.strip(), "ok")

  def test_public_names(self):
    self.assertIs(hkb.from_flax, flax_bridge.from_flax)
    self.assertIs(hkb.to_nnx, flax_bridge.to_nnx)


def _hk_index(path, params) -> int:
  """Index, among the Haiku params' leaves, of the NNX param at `path`."""
  keys = [getattr(k, "key", None) for k in path if not isinstance(k, jax.tree_util.GetAttrKey)]
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
