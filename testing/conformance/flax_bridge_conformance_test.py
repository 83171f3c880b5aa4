"""Conformance with Flax's own bridge tests (`tests/nnx/bridge/`): Flax's bridges against `from_flax`.

Flax's bridge runs Linen modules in NNX (`bridge.ToNNX`), NNX modules in
Linen (`bridge.ToLinen`, `to_linen`) and NNX modules with Linen's API
(`bridge.Module`). Each of its cases is run here through Flax (the peer) and,
with the same weights and keys, through `hkb.from_flax` inside Haiku (which
takes Linen modules, NNX modules and `nnx.bridge.Module`s); outputs, state
updates, names and shardings must agree, up to the differences listed below
with their reasons. Cases that test Flax's own machinery, with nothing for an
adapter to run, are listed too; a case neither ported nor listed fails
`test_every_flax_case_is_covered` (the cases: `peer_cases.FLAX_BRIDGE`).
"""

import functools

from testing import devices

devices.use_cpu_devices(8)

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl.testing import absltest
import chex
from flax import nnx
from flax.nnx import bridge
import flax.errors
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from testing.conformance import peer_cases

KEY = jax.random.PRNGKey(0)

NOT_APPLICABLE = {
  "test_update": "nnx.update of a bridge.Module's state: Flax's own state "
  "API; an adapter holds no state (Haiku passes it in)",
  "test_module_stack": "Flax's internal module context (MODULE_CONTEXT)",
  "test_compact_parent_none": "bridge.Module's parent and scope bookkeeping",
  "test_name": "bridge.Module's `name` attribute",
  "test_nnx_to_linen_metadata_transform": "empty upstream (a TODO)",
  "test_linen_nnx_linen": "empty upstream (a TODO)",
}
BY_DESIGN = {
  "collections": (
    "names: Flax keeps Linen collection names (`params`, `batch_stats`, "
    "`LoRAParam`, ...); in Haiku a module's params are params and every "
    "other variable is state, both named by the path alone"
  ),
  "rng streams": (
    "rng: Flax's bridges carry each module's own `nnx.Rngs` as variables; "
    "the adapter keys every stream from Haiku's rng on each call, so the "
    "Rngs' keys are no part of Haiku's params or state; with the same "
    "keys passed in (`rngs=`), outputs are the same"
  ),
}


def haiku_params(variables, name):
  """A Linen `params` collection as the adapter names it, under `name`."""
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]:
    keys = [p.key for p in path if hasattr(p, "key")]
    bundle = "/".join([name] + [str(k) for k in keys[:-1]])
    flat.setdefault(bundle, {})[keys[-1]] = leaf
  return flat


def nnx_params(module, name, kind=nnx.Param):
  """An NNX module's variables of `kind` as the adapter names them."""
  return haiku_params(nnx.to_pure_dict(nnx.state(module, kind)), name)


def run(module, *args, name="m", params=None, state=None, rng=None, intermediates=None, **kwargs):
  """`hkb.from_flax(module)(*args, **kwargs)` in Haiku: `(out, params, state)`.

  Initialised with `KEY`, then applied with `params` / `state` if given
  (else init's) and `rng`.
  """
  f = hk.transform_with_state(
    lambda *a: hkb.from_flax(module, name=name, intermediates=intermediates)(*a, **kwargs)
  )
  p, s = f.init(KEY, *args)
  p = p if params is None else params
  s = s if state is None else {**s, **state}
  out, s = f.apply(p, s, rng, *args)
  return out, p, s


# Module test fixtures: bridge.Modules, as in Flax's cases.
class BridgeLinear(bridge.Module):
  dout: int

  @bridge.compact
  def __call__(self, x):
    w = self.param("w", nnx.initializers.uniform(), (x.shape[-1], self.dout))
    b = self.param("b", nn.initializers.zeros_init(), (self.dout,))
    return x @ w + b[None]


class BridgeFoo(bridge.Module):
  dout: int

  @bridge.compact
  def __call__(self, x):
    self.linear = BridgeLinear(self.dout)
    return self.linear(x)


class NnxLayer(nnx.Module):
  """Linear, dropout and a count kept in an nnx.Intermediate made in __init__."""

  def __init__(self, dim, dropout, rngs):
    self.linear = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
    self.dropout = nnx.Dropout(dropout, deterministic=False, rngs=rngs)
    self.count = nnx.Intermediate(jnp.array([0.0]))

  def __call__(self, x):
    module = bridge.current_module()
    if module is None or not module.is_initializing():
      self.count[...] += 1
    return self.dropout(self.linear(x))


class BridgeNnxMlp(bridge.Module):
  @bridge.compact
  def __call__(self, x):
    x = bridge.nnx_in_bridge_mdl(lambda r: NnxLayer(8, 0.3, rngs=r))(x)
    return bridge.nnx_in_bridge_mdl(lambda r: NnxLayer(8, 0.3, rngs=r), name="another")(x)


class LinenLayer(nn.Module):
  dim: int
  dropout_rate: float

  def setup(self):
    self.linear = nn.Dense(self.dim, use_bias=False)
    self.dropout = nn.Dropout(self.dropout_rate, deterministic=False)

  def __call__(self, x):
    if not self.is_initializing():
      self.sow("intermediates", "count", 1, init_fn=lambda: 0, reduce_fn=lambda a, b: a + b)
    return self.dropout(self.linear(x))


class BridgeLinenMlp(bridge.Module):
  @bridge.compact
  def __call__(self, x):
    x = bridge.linen_in_bridge_mdl(LinenLayer(8, 0.3))(x)
    return bridge.linen_in_bridge_mdl(LinenLayer(8, 0.3), name="another")(x)


class BridgeDense(bridge.Module):
  dout: int

  @bridge.compact
  def __call__(self, x):
    return x @ self.param("w", nn.initializers.normal(), (x.shape[-1], self.dout))


class ModuleTest(absltest.TestCase):
  """`module_test.py`: bridge.Module (Linen's API on NNX) through the adapter."""

  def test_every_flax_case_is_covered(self):
    self.assertEmpty(
      peer_cases.uncovered(peer_cases.FLAX_BRIDGE, (ModuleTest, WrappersTest), NOT_APPLICABLE)
    )
    self.assertIn(peer_cases.check_against_sources("flax", peer_cases.FLAX_BRIDGE), (None, ""))

  def test_compact_basic(self):
    foo, x = BridgeFoo(5), jnp.ones((3, 2))
    variables = foo.init(0, x)
    params = haiku_params(variables["params"], "m")
    out, _, _ = run(BridgeFoo(5), x, params=params)
    self.assertEqual(
      jax.tree.map(jnp.shape, run(BridgeFoo(5), x)[1]), jax.tree.map(jnp.shape, params)
    )
    np.testing.assert_allclose(out, foo.apply(variables, x), rtol=1e-6)

  def test_mutable_state(self):
    class FooLinen(nn.Module):
      @nn.compact
      def __call__(self):
        count = self.variable("counts", "count", lambda: jnp.zeros((), jnp.int32))
        count.value += 1

    class FooNnx(bridge.Module):
      @bridge.compact
      def __call__(self):
        count = self.variable("counts", "count", lambda: jnp.zeros((), jnp.int32))
        count[...] += 1

    for module in (FooLinen(), FooNnx()):
      initial = module.init({})
      _, updated = module.apply(initial, mutable="counts")
      f = hk.transform_with_state(lambda: hkb.from_flax(module, name="m")())
      params, state = f.init(KEY)
      _, state = f.apply(params, {"m": dict(initial["counts"])}, None)
      self.assertEqual(state, {"m": dict(updated["counts"])})

  def test_dense_port(self):
    class Dense(bridge.Module):
      features: int

      @bridge.compact
      def __call__(self, inputs):
        kernel = self.param(
          "kernel", nnx.initializers.lecun_normal(), (inputs.shape[-1], self.features)
        )
        bias = self.param("bias", nnx.initializers.zeros_init(), (self.features,))
        return inputs @ kernel + bias

    m, x, y = Dense(3), jnp.ones((1, 10, 2)), jnp.ones((1, 10, 3))
    variables = m.init(0, x)
    f = hk.transform(lambda x: hkb.from_flax(Dense(3), name="m")(x))
    params = haiku_params(variables["params"], "m")
    np.testing.assert_allclose(f.apply(params, None, x), m.apply(variables, x), rtol=1e-6)

    def step(loss):
      return lambda p: jax.tree.map(lambda p, g: p - 0.01 * g, p, jax.grad(loss)(p))

    theirs = jax.jit(step(lambda p: jnp.mean((y - m.apply({"params": p}, x)) ** 2)))(
      variables["params"]
    )
    ours = jax.jit(step(lambda p: jnp.mean((y - f.apply(p, None, x)) ** 2)))(params)
    chex.assert_trees_all_close(ours, haiku_params(theirs, "m"), rtol=1e-6)

  def test_metadata(self):
    class Linear(bridge.Module):
      dout: int

      @bridge.compact
      def __call__(self, x):
        w = self.param(
          "w",
          bridge.with_partitioning(nnx.initializers.uniform(), ("in", "out")),
          (x.shape[-1], self.dout),
        )
        b = self.param("b", nnx.initializers.zeros_init(), (self.dout,))
        return x @ w + b[None]

    x = jnp.ones((4, 2))
    mesh = jax.make_mesh((2, 4), ("in", "out"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
      variables = Linear(8).init(0, x)
    theirs = nn.get_partition_spec(variables)["params"]
    f = hk.transform(lambda x: hkb.from_flax(Linear(8), name="m")(x))
    rules = hkb.ShardingRules.from_foreign(f.init, KEY, x)
    self.assertEqual(rules.spec_for("m/w", (2, 8)), theirs["w"])
    self.assertEqual(rules.spec_for("m/b", (8,)), theirs["b"])

  def test_pure_nnx_submodule(self):
    model, x = BridgeNnxMlp(), jax.random.normal(jax.random.key(0), (4, 8))
    variables = model.init(jax.random.key(1), x)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    rngs = {"params": k1, "dropout": k2}
    theirs, updates = model.apply(variables, x, rngs=rngs, mutable=True)
    state = haiku_params(variables["intermediates"], "m")
    out, _, new_state = run(
      BridgeNnxMlp(), x, rngs=rngs, params=haiku_params(variables["params"], "m"), state=state
    )
    np.testing.assert_array_equal(out, theirs)
    chex.assert_trees_all_equal(new_state, haiku_params(updates["intermediates"], "m"))
    other, _, _ = run(
      BridgeNnxMlp(),
      x,
      rngs={"params": k1, "dropout": k3},
      params=haiku_params(variables["params"], "m"),
      state=state,
    )
    self.assertFalse(np.array_equal(out, other))

  def test_pure_nnx_submodule_modified_rng(self):
    class FooStack(nnx.Module):
      def __init__(self, in_dim, key):
        self.rngs = nnx.Rngs(jax.random.split(key, in_dim))

      def __call__(self, x):
        @nnx.vmap
        def weights(r):
          return jax.random.normal(r.default(), (2,))

        return x @ weights(self.rngs)

    class Foo(bridge.Module):
      @bridge.compact
      def __call__(self, x):
        return bridge.nnx_in_bridge_mdl(lambda r: FooStack(4, r.default()))(x)

    x = jnp.ones((1, 4))
    variables = Foo().init(jax.random.key(1), x)
    theirs = Foo().apply(variables, x, rngs=jax.random.key(1))
    out, _, _ = run(
      Foo(),
      x,
      rngs=jax.random.key(1),
      params=haiku_params(variables.get("params", {}), "m"),
      state=haiku_params({k: v for k, v in variables.items() if k != "params"}, "m"),
    )
    np.testing.assert_array_equal(out, theirs)

  def test_linen_submodule(self):
    model, x = BridgeLinenMlp(), jax.random.normal(jax.random.key(0), (4, 8))
    variables = model.init(jax.random.key(1), x)
    k1, k2, _ = jax.random.split(jax.random.key(0), 3)
    rngs = {"params": k1, "dropout": k2}
    theirs, updates = model.apply(variables, x, rngs=rngs, mutable=True)
    out, _, state = run(
      BridgeLinenMlp(),
      x,
      rngs=rngs,
      intermediates="intermediates",
      params=haiku_params(variables["params"], "m"),
    )
    np.testing.assert_array_equal(out, theirs)
    self.assertEqual(
      int(state["m/intermediates/LinenLayer_0"]["count"]),
      int(updates["intermediates"]["LinenLayer_0"]["count"]),
    )

  def test_transforms(self):
    class Mlp(bridge.Module):
      dim: int
      num_layers: int

      def setup(self):
        @nnx.compat.split_rngs(splits=self.num_layers)
        @nnx.compat.vmap(
          in_axes=(nnx.StateAxes({nnx.RngState: 0, ...: None}),),
          axis_size=self.num_layers,
          transform_metadata={nnx.PARTITION_NAME: None},
        )
        def create_block(parent):
          parent.block = BridgeDense(self.dim)

        create_block(self)

      def __call__(self, x):
        @nnx.compat.split_rngs(splits=self.num_layers)
        @nnx.compat.scan(
          in_axes=(0, nnx.Carry), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: None}
        )
        def forward(model, x):
          return model(x)

        return forward(self.block, x)

    model, x = Mlp(dim=8, num_layers=2), jnp.ones((4, 8))
    variables = model.init(jax.random.key(0), x)
    out, params, _ = run(Mlp(dim=8, num_layers=2), x, params=haiku_params(variables["params"], "m"))
    w = params["m/block"]["w"]
    np.testing.assert_allclose(out, x @ w[0] @ w[1], rtol=1e-5)
    np.testing.assert_allclose(out, model.apply(variables, x), rtol=1e-6)

  def test_shared_modules(self):
    class Bottom(bridge.Module):
      def setup(self):
        self.layer = BridgeDense(4)

      def __call__(self, x):
        return self.layer(x)

    class Top(bridge.Module):
      def setup(self):
        self.zzz = Bottom()
        self.set_attr_priority("zzz", bridge.AttrPriority.HIGH)
        self.aaa = self.zzz
        self.dense = self.aaa.layer

      def forward(self, x):
        return self.aaa(x)

      def __call__(self, x):
        return nnx.compat.remat(self.__class__.forward)(self, x)

    model = nnx.graph.merge(*nnx.graph.split(Top()))
    x = jnp.ones((4, 32))
    variables = model.init(jax.random.key(0), x)
    out, params, _ = run(model, x, params=haiku_params(variables["params"], "m"))
    self.assertEqual(sorted(params), ["m/zzz/layer"])  # Shared: stored once.
    np.testing.assert_allclose(out, model.apply(variables, x), rtol=1e-6)

  def test_linen_layer_naming(self):
    class Dense(bridge.Module):
      dout: int

      @bridge.compact
      def __call__(self, x):
        return x @ self.param("w", lambda _: jnp.ones((x.shape[-1], self.dout)))

    class Mlp(bridge.Module):
      nlayers: int

      def setup(self):
        self.layers = [Dense(4, name=f"layer_{i}") for i in range(self.nlayers)]

      def __call__(self, x):
        for layer in self.layers:
          x = layer(x)
        return x

    x = jnp.ones((2, 4))
    theirs = Mlp(nlayers=3).init(jax.random.key(0), x)["params"]
    _, params, _ = run(Mlp(nlayers=3), x)
    self.assertEqual(sorted(params), [f"m/{name}" for name in sorted(theirs)])


@nnx.register_variable_name("Count", overwrite=True)
class Count(nnx.Variable):
  pass


class Counter(nnx.Module):
  """A count in a Variable type of its own (its own Linen collection)."""

  def __init__(self, rngs=None):
    del rngs  # Unused.
    self.count = Count(jnp.array(0))

  def __call__(self):
    self.count[...] += 1


class WrappersTest(absltest.TestCase):
  """`wrappers_test.py`: ToNNX / ToLinen against the adapter, same weights."""

  def test_functional(self):
    functional = bridge.functional(nnx.Linear)(32, 64)
    state = functional.init(rngs=nnx.Rngs(0))
    x = jnp.ones((1, 32))
    theirs, _ = functional.apply(state)(x)
    out, _, _ = run(
      functools.partial(nnx.Linear, 32, 64), x, params=haiku_params(nnx.to_pure_dict(state), "m")
    )
    np.testing.assert_allclose(out, theirs, rtol=1e-6)

  def test_linen_to_nnx(self):
    linen_module, x = nn.Dense(features=64), jnp.ones((1, 32))
    model = bridge.ToNNX(linen_module, rngs=nnx.Rngs(0)).lazy_init(x)
    params = {"m": {"kernel": model.kernel[...], "bias": model.bias[...]}}
    out, _, _ = run(linen_module, x, params=params)
    np.testing.assert_array_equal(out, model(x))

  def test_linen_to_nnx_submodule(self):
    class NnxOuter(nnx.Module):
      def __init__(self, dout, *, rngs):
        self.nn_dense1 = bridge.ToNNX(nn.Dense(dout, use_bias=False), rngs=rngs)
        self.b = nnx.Param(jax.random.uniform(rngs.params(), (1, dout)))
        self.batchnorm = bridge.ToNNX(nn.BatchNorm(use_running_average=True), rngs=rngs)
        self.rngs = rngs

      def __call__(self, x):
        return self.batchnorm(self.nn_dense1(x) + self.b)

    x = jax.random.normal(jax.random.key(0), (2, 4))
    model = bridge.lazy_init(NnxOuter(3, rngs=nnx.Rngs(0)), x)
    theirs = model(x)
    # A constructor that builds it lazily, as Flax's case does.
    make = lambda rngs: bridge.lazy_init(NnxOuter(3, rngs=rngs), x)
    # BY_DESIGN["rng streams"]: ToNNX draws from its Rngs on each call; the
    # adapter keys them from Haiku's rng.
    out, params, state = run(
      make,
      x,
      params=nnx_params(model, "m"),
      state=nnx_params(model, "m", nnx.BatchStat),
      rng=jax.random.PRNGKey(1),
    )
    self.assertEqual(sorted(params), ["m", "m/batchnorm", "m/nn_dense1"])
    self.assertEqual(sorted(state), ["m/batchnorm"])
    np.testing.assert_allclose(out, theirs, rtol=1e-6)

  def test_linen_to_nnx_noncall_method(self):
    class Foo(nn.Module):
      @nn.compact
      def __call__(self, x):
        b = self.param("b", nn.zeros_init(), (1, 3))
        return self.dot(x) + b

      @nn.compact
      def dot(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (4, 3))
        return x @ w

    x = jax.random.normal(jax.random.key(0), (2, 4))
    model = bridge.ToNNX(Foo(), rngs=nnx.Rngs(0))
    bridge.lazy_init(model.dot, x)
    params = {"m": {"w": nnx.state(model)["w"][...]}}
    out, _, _ = run(Foo(), x, method="dot", params=params)
    np.testing.assert_allclose(out, model.dot(x), rtol=1e-6)
    # Only `dot`'s params exist: `__call__` fails in both.
    with self.assertRaises(flax.errors.ScopeParamNotFoundError):
      model(x)
    f = hk.transform(lambda x: hkb.from_flax(Foo(), name="m")(x))
    with self.assertRaisesRegex(ValueError, r"parameter 'm/b' .* is missing at apply"):
      f.apply(params, None, x)

  def test_linen_to_nnx_mutable(self):
    class Foo(nn.Module):
      def setup(self):
        self.count = self.variable("counter", "count", lambda: jnp.zeros((), jnp.int32))

      def __call__(self, x):
        if not self.is_initializing():
          self.count.value += 1
        return x

    x = jnp.zeros(())
    model = bridge.ToNNX(Foo(), rngs=nnx.Rngs(0)).lazy_init(x)
    self.assertEqual(nnx.state(model)["count"][...], 0)
    model(x, mutable=True)
    _, _, state = run(Foo(), x, state={"m": {"count": jnp.zeros((), jnp.int32)}})
    self.assertEqual(state["m"]["count"], nnx.state(model)["count"][...])

  def test_linen_to_nnx_transform(self):
    class NnxOuter(nnx.Module):
      def __init__(self, dout, rngs):
        self.inner = nnx.bridge.ToNNX(nn.Dense(dout), rngs=rngs)
        self.rngs = rngs

      def __call__(self, x):
        @nnx.split_rngs(splits=5)
        @nnx.vmap(in_axes=(0, None), axis_size=5)
        def vmap_fn(inner, x):
          return inner(x)

        return vmap_fn(self.inner, x)

    x = jax.random.normal(jax.random.key(0), (2, 4))
    model = NnxOuter(3, rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(model, x)
    theirs = model(x)
    # The adapter's stack of 5: `layer_scan` over the same Dense.
    f = hk.transform(
      lambda x: hkb.layer_scan(
        lambda c, _: (c, hkb.from_flax(nn.Dense(3), name="inner")(x)),
        (),
        num_layers=5,
        name="stack",
      )[1]
    )
    params = f.init(KEY, x)
    self.assertEqual(params["stack/inner"]["kernel"].shape, (5, 4, 3))
    self.assertEqual(params["stack/inner"]["bias"].shape, (5, 3))
    params = {"stack/inner": {"kernel": model.inner.kernel[...], "bias": model.inner.bias[...]}}
    np.testing.assert_allclose(f.apply(params, None, x), theirs, rtol=1e-6)

  def test_linen_to_nnx_metadata(self):
    linen_module = nn.Dense(
      features=64,
      kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("in", "out")),
      bias_init=nn.with_logical_partitioning(
        nn.initializers.zeros_init(), ("out-alias",), rules=(("out-alias", "out"),)
      ),
    )
    x = jnp.ones((1, 32))
    mesh = jax.make_mesh((2, 4), ("in", "out"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    @nnx.jit
    def create_sharded_nnx_module(x):
      model = bridge.lazy_init(bridge.ToNNX(linen_module, rngs=nnx.Rngs(0)), x)
      state = nnx.state(model)
      nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
      return model

    with jax.set_mesh(mesh):
      theirs = create_sharded_nnx_module(x)
    f = hk.transform(lambda x: hkb.from_flax(linen_module, name="m")(x))
    rules = hkb.ShardingRules.from_foreign(f.init, KEY, x)
    shardings = hkb.param_shardings(jax.eval_shape(f.init, KEY, x), mesh, rules)
    params = jax.jit(f.init, out_shardings=shardings)(KEY, x)
    for name in ("kernel", "bias"):
      value = getattr(theirs, name)[...]
      self.assertTrue(
        params["m"][name].sharding.is_equivalent_to(value.sharding, value.ndim), msg=name
      )
    self.assertEqual(params["m"]["bias"].sharding.spec, jax.P("out"))

  def test_linen_to_nnx_state_structure_consistency(self):
    class LinenInner(nn.Module):
      dout: int

      @nn.compact
      def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], self.dout))
        return nn.Dropout(rate=0.5, deterministic=False)(x @ w)

    class LinenMiddle(nn.Module):
      dout: int

      @nn.compact
      def __call__(self, x):
        b = self.variable("bias", "b", nn.initializers.zeros_init(), None, (1, self.dout))
        return LinenInner(self.dout, name="dot")(x) + b.value

    @nnx.register_variable_name("bias", overwrite=True)
    class Bias(nnx.Variable):
      pass

    class NnxMiddle(nnx.Module):
      def __init__(self, dout, *, rngs):
        self.dot = bridge.ToNNX(LinenInner(dout), rngs=rngs)
        self.b = Bias(nnx.initializers.zeros_init()(rngs.params(), (1, dout)))

      def __call__(self, x):
        return self.dot(x) + self.b

    x = jax.random.normal(jax.random.key(42), (2, 4))
    from_top = hk.transform_with_state(lambda x: hkb.from_flax(LinenMiddle(dout=3), name="m")(x))
    from_middle = hk.transform_with_state(
      lambda x: hkb.from_flax(
        lambda rngs: bridge.lazy_init(NnxMiddle(dout=3, rngs=rngs), x), name="m"
      )(x)
    )
    top, middle = from_top.init(KEY, x), from_middle.init(KEY, x)
    # Flax's assertion: the same structure, rng state aside (BY_DESIGN: the
    # adapter keeps no rng state at all).
    self.assertEqual(jax.tree.structure(top), jax.tree.structure(middle))

  def test_adding_new_attributes(self):
    class LinenModule(nn.Module):
      @nn.compact
      def __call__(self):
        if self.is_initializing() and self.is_mutable_collection("cache"):
          self.put_variable("cache", "x", 0)
        return self.get_variable("cache", "x")

    module = nnx.bridge.ToNNX(LinenModule()).lazy_init()
    self.assertEqual(module(mutable=["cache"]), 0)
    self.assertEqual(module(), 0)
    f = hk.transform_with_state(lambda: hkb.from_flax(LinenModule())())
    params, state = f.init(KEY)
    for _ in range(2):
      out, state = f.apply(params, state, None)
      self.assertEqual(out, 0)

  def test_nnx_to_linen(self):
    model, x = bridge.to_linen(nnx.Linear, 32, out_features=64), jnp.ones((1, 32))
    theirs, variables = model.init_with_output(jax.random.key(0), x)
    out, _, _ = run(
      functools.partial(nnx.Linear, 32, out_features=64),
      x,
      params=haiku_params(variables["params"], "m"),
    )
    np.testing.assert_allclose(out, theirs, rtol=1e-6)

  def test_nnx_to_linen_multiple_rngs(self):
    class NnxInner(nnx.Module):
      def __init__(self, din, dout, rngs):
        self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (din, dout)))
        self.dropout = nnx.Dropout(rate=0.5, deterministic=False, rngs=rngs)

      def __call__(self, x):
        return self.dropout(x @ self.w[...])

    x = jax.random.normal(jax.random.key(0), (2, 4))
    f = hk.transform(lambda x: hkb.from_flax(functools.partial(NnxInner, 4, 3))(x))
    params = f.init(KEY, x)
    y1 = f.apply(params, jax.random.PRNGKey(1), x)
    y2 = f.apply(params, jax.random.PRNGKey(2), x)
    self.assertFalse(jnp.allclose(y1, y2))  # Dropout keys differ, as Flax's.
    # The same key, the same mask, as NNX draws it from that stream.
    m = NnxInner(4, 3, rngs=nnx.Rngs(0))
    m.w[...] = params["nnx_inner"]["w"]
    m.dropout.rngs.key[...] = jax.random.wrap_key_data(
      jax.random.fold_in(next(hk.PRNGSequence(jax.random.PRNGKey(1))), 0)
    )
    m.dropout.rngs.count[...] = jnp.zeros((), jnp.uint32)
    np.testing.assert_array_equal(y1, m(x))

  def test_nnx_to_linen_multiple_collections(self):
    class NnxInner(nnx.Module):
      def __init__(self, din, dout, rngs):
        self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (din, dout)))
        self.bn = nnx.BatchNorm(dout, use_running_average=False, rngs=rngs)
        self.lora = nnx.LoRA(din, 3, dout, rngs=rngs)

      def __call__(self, x):
        return self.bn(x @ self.w[...]) + self.lora(x)

    x = jax.random.normal(jax.random.key(0), (2, 4))
    model = bridge.to_linen(NnxInner, 4, 3)
    variables = model.init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, x)
    self.assertSameElements(variables.keys(), ["LoRAParam", "params", "batch_stats"])
    theirs, updates = model.apply(variables, x, mutable=["batch_stats"])
    # BY_DESIGN["collections"]: LoRAParam (an nnx.Param) and params are Haiku
    # params, batch_stats Haiku state.
    params = {**haiku_params(variables["params"], "m")}
    for bundle, entries in haiku_params(variables["LoRAParam"], "m").items():
      params.setdefault(bundle, {}).update(entries)
    out, _, state = run(
      functools.partial(NnxInner, 4, 3),
      x,
      params=params,
      state=haiku_params(variables["batch_stats"], "m"),
    )
    np.testing.assert_allclose(out, theirs, rtol=1e-6)
    chex.assert_trees_all_close(state, haiku_params(updates["batch_stats"], "m"), rtol=1e-6)

  def test_nnx_to_linen_mutable(self):
    model = bridge.ToLinen(Counter, skip_rng=True)
    variables = model.init(jax.random.key(0))
    _, updates = model.apply(variables, mutable="Count")
    _, _, state = run(Counter, state={"m": {"count": variables["Count"]["count"]}})
    self.assertEqual(state["m"]["count"], updates["Count"]["count"])

  def _embedding_method(self, linen_method):
    embed = lambda: hkb.from_flax(functools.partial(nnx.Embed, 2, 3), name="embedding")
    x, z = jnp.ones((1,), dtype=jnp.int32), jnp.ones((1, 3))

    def f(x, z):
      e = embed()
      return e(x), e(z, method="attend")  # One module: one table.

    f = hk.transform(f)
    params = f.init(KEY, x, z)
    self.assertEqual(params["embedding"]["embedding"].shape, (2, 3))
    theirs = linen_method(params["embedding"]["embedding"], z)
    _, attended = f.apply(params, None, x, z)
    np.testing.assert_allclose(attended, theirs, rtol=1e-6)

  def test_to_linen_method_call(self):
    class Foo(nn.Module):
      def setup(self):
        self.embedding = nnx.bridge.to_linen(nnx.Embed, 2, 3)

      def __call__(self, x):
        return self.embedding(x)

      def attend(self, x):
        return self.embedding.attend(x)

    self._embedding_method(
      lambda table, z: Foo().apply(
        {"params": {"embedding": {"embedding": table}}}, z, method="attend"
      )
    )

  def test_to_linen_nnx_method_arg(self):
    module = nnx.bridge.to_linen(nnx.Embed, 2, 3)
    self._embedding_method(
      lambda table, z: module.apply({"params": {"embedding": table}}, z, nnx_method="attend")
    )

  def test_nnx_to_linen_mutated_static_data(self):
    class StaticCounter(Counter):
      def __call__(self):
        super().__call__()
        self.count_nonzero = nnx.Intermediate(jnp.array(1))

    model = bridge.ToLinen(StaticCounter, skip_rng=True)
    variables = model.init(jax.random.key(0))
    _, updates = model.apply(variables, mutable=["Count", "intermediates"])
    # The intermediate set as an attribute: the adapter refuses it (the
    # module's structure changes), naming `intermediates=`; sown through
    # `sow` it is returned (flax_bridge_test.IntermediatesTest).
    f = hk.transform_with_state(lambda: hkb.from_flax(StaticCounter, name="m")())
    with self.assertRaisesRegex(
      ValueError,
      r"sowed nnx.Intermediate values "
      r"\(count_nonzero\).*intermediates=",
    ):
      f.init(KEY)

    class SowingCounter(Counter):
      def __call__(self):
        super().__call__()
        self.sow(nnx.Intermediate, "count_nonzero", jnp.array(1))

    _, _, state = run(
      SowingCounter,
      intermediates="intermediates",
      state={"m": {"count": variables["Count"]["count"]}},
    )
    self.assertEqual(state["m"]["count"], updates["Count"]["count"])
    self.assertEqual(
      state["m/intermediates"]["count_nonzero_0"], updates["intermediates"]["count_nonzero"]
    )

  def test_nnx_to_linen_transforms(self):
    class LinenOuter(nn.Module):
      dout: int

      @nn.compact
      def __call__(self, x):
        inner = nn.vmap(bridge.ToLinen, variable_axes={"params": 0}, split_rngs={"params": True})(
          nnx.Linear, args=(x.shape[-1], self.dout)
        )
        return inner(x)

    x = jax.random.normal(jax.random.key(0), (2, 4))
    theirs, variables = LinenOuter(dout=3).init_with_output(jax.random.key(1), x)
    kernel = variables["params"]["VmapToLinen_0"]["kernel"]
    # The adapter's vmap over params: a layer scan over the rows of x.
    f = hk.transform(
      lambda x: hkb.layer_scan(
        lambda c, xi: (c, hkb.from_flax(functools.partial(nnx.Linear, 4, 3), name="linear")(xi)),
        (),
        x,
        name="stack",
      )[1]
    )
    params = f.init(KEY, x)
    self.assertEqual(params["stack/linear"]["kernel"].shape, (2, 4, 3))
    params = {
      "stack/linear": {"kernel": kernel, "bias": variables["params"]["VmapToLinen_0"]["bias"]}
    }
    np.testing.assert_allclose(f.apply(params, None, x), theirs, rtol=1e-6)

  def test_nnx_to_linen_metadata(self):
    model = bridge.to_linen(
      nnx.Linear,
      32,
      64,
      kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("in", "out")),
    )
    x = jnp.ones((1, 32))
    mesh = jax.make_mesh((2, 4), ("in", "out"))
    with jax.set_mesh(mesh):
      _, variables = model.init_with_output(jax.random.key(0), x)
      theirs = nn.get_partition_spec(variables)["params"]["kernel"]
    f = hk.transform(
      lambda x: hkb.from_flax(
        functools.partial(
          nnx.Linear,
          32,
          64,
          kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("in", "out")),
        ),
        name="m",
      )(x)
    )
    rules = hkb.ShardingRules.from_foreign(f.init, KEY, x)
    self.assertEqual(rules.spec_for("m/kernel", (32, 64)), theirs)

  def test_nnx_to_linen_pytree_structure_consistency(self):
    class NnxInner(nnx.Module):
      def __init__(self, din, dout, *, rngs):
        self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (din, dout)))
        self.dropout = nnx.Dropout(rate=0.5, deterministic=False, rngs=rngs)

      def __call__(self, x):
        return self.dropout(x @ self.w)

    @nnx.register_variable_name("bias", overwrite=True)
    class Bias(nnx.Variable):
      pass

    class NnxMiddle(nnx.Module):
      def __init__(self, din, dout, *, rngs):
        self.dot = NnxInner(din, dout, rngs=rngs)
        self.b = Bias(nnx.initializers.zeros_init()(rngs.params(), (1, dout)))

      def __call__(self, x):
        return self.dot(x) + self.b

    class LinenMiddle(nn.Module):
      dout: int

      @nn.compact
      def __call__(self, x):
        dot = bridge.to_linen(NnxInner, x.shape[-1], self.dout, name="dot")
        b = self.variable("bias", "b", nn.initializers.zeros_init(), None, (1, self.dout))
        return dot(x) + b.value

    x = jax.random.normal(jax.random.key(42), (2, 4))
    from_top = hk.transform_with_state(
      lambda x: hkb.from_flax(functools.partial(NnxMiddle, 4, 3), name="m")(x)
    ).init(KEY, x)
    from_middle = hk.transform_with_state(
      lambda x: hkb.from_flax(LinenMiddle(dout=3), name="m")(x)
    ).init(KEY, x)

    def weights(tree):  # Flax's assertion leaves the rng state out.
      params, state = tree
      return params, {b: {n: v for n, v in e.items()} for b, e in state.items() if "rngs" not in b}

    self.assertEqual(
      jax.tree.structure(weights(from_top)), jax.tree.structure(weights(from_middle))
    )

  def test_nnx_linen_nnx(self):
    class NnxInner(nnx.Module):
      def __init__(self, din, dout, dropout_rate, rngs):
        self.w = nnx.Param(
          nnx.with_partitioning(nnx.initializers.lecun_normal(), sharding=("in", "out"))(
            rngs.params(), (din, dout)
          )
        )
        self.dropout = nnx.Dropout(rate=dropout_rate, deterministic=False, rngs=rngs)

      def __call__(self, x):
        return self.dropout(x @ self.w)

    class LinenMiddle(nn.Module):
      dout: int
      dropout_rate: float

      @nn.compact
      def __call__(self, x):
        dot = bridge.to_linen(NnxInner, x.shape[-1], self.dout, self.dropout_rate, name="dot")
        b = self.param(
          "b",
          nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("out-alias",), rules=(("out-alias", "out"),)
          ),
          (2, self.dout),
        )
        return dot(x) + b

    class NnxOuter(nnx.Module):
      def __init__(self, dout, dropout_rate, *, rngs, x):
        self.inner = bridge.ToNNX(LinenMiddle(dout, dropout_rate), rngs=rngs)
        self.rngs = rngs
        bridge.lazy_init(self, x)

      def __call__(self, x):
        return self.inner(x)

    x = jax.random.normal(jax.random.key(0), (2, 4))
    mesh = jax.make_mesh((4, 2), ("in", "out"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    # The adapter's constructor gets `nnx.Rngs(key)` (a `default` stream);
    # this model wants a `dropout` stream too, as Flax's case gives it.
    make = lambda rate: (
      lambda rngs: NnxOuter(6, rate, rngs=nnx.Rngs(default=rngs(), dropout=rngs()), x=x)
    )
    # Dropout: different Haiku keys, different masks; the same, the same.
    f = hk.transform_with_state(lambda x: hkb.from_flax(make(0.5), name="m")(x))
    params, state = f.init(KEY, x)
    y1, _ = f.apply(params, state, jax.random.PRNGKey(1), x)
    y2, _ = f.apply(params, state, jax.random.PRNGKey(2), x)
    self.assertFalse(jnp.allclose(y1, y2))
    np.testing.assert_array_equal(y1, f.apply(params, state, jax.random.PRNGKey(1), x)[0])
    # Without dropout: Flax's value, x @ w + b.
    out, params, _ = run(make(0.0), x, rng=jax.random.PRNGKey(3))
    np.testing.assert_allclose(
      out, x @ params["m/inner/dot"]["w"] + params["m/inner"]["b"], rtol=1e-5
    )
    # The metadata is kept: the param specs Flax gives them.
    g = hk.transform_with_state(lambda x: hkb.from_flax(make(0.0), name="m")(x))
    with jax.set_mesh(mesh):
      native = NnxOuter(6, 0.0, rngs=nnx.Rngs(default=1, dropout=2), x=x)
    rules = hkb.ShardingRules.from_foreign(g.init, KEY, x)
    theirs = nnx.get_partition_spec(nnx.state(native))
    self.assertEqual(
      rules.spec_for("m/inner/dot/w", (4, 6)), theirs["inner"]["dot"]["w"].get_value()
    )
    self.assertEqual(rules.spec_for("m/inner/b", (2, 6)), theirs["inner"]["b"].get_value())


if __name__ == "__main__":
  absltest.main()
