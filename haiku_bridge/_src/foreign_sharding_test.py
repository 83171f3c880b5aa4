"""Tests for foreign_sharding.py and `hkb.ShardingRules.from_foreign`, on 8 CPU devices.

Ground truth: the same Flax module built natively on the same mesh (NNX with
eager sharding; Linen initialised with the shardings Flax's own functions
give, `nn.get_sharding` / `nn.logical_to_mesh_sharding`), and for a stack of
layers, the stack NNX itself builds (`nnx.vmap` with `transform_metadata`).
"""

import functools

from testing import devices

devices.use_cpu_devices(8)

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import flax.linen as nn
import haiku as hk
import haiku_bridge as hkb
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

KEY = jax.random.PRNGKey(0)
X = jnp.ones([8, 16])
LOGICAL = (("embed", None), ("mlp", "model"), ("batch", "data"))


def mesh():
  return jax.make_mesh((2, 4), ("data", "model"))


class NnxBlock(nnx.Module):
  """Declared: a kernel split by mesh axes, one by logical names, one not."""

  def __init__(self, *, rngs):
    self.up = nnx.Linear(
      16,
      32,
      rngs=rngs,
      kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model")),
    )
    self.down = nnx.Linear(
      32,
      16,
      rngs=rngs,
      kernel_init=nnx.with_partitioning(
        nnx.initializers.lecun_normal(), ("mlp", "embed"), sharding_rules=LOGICAL
      ),
    )
    self.norm = nnx.LayerNorm(16, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jax.nn.relu(self.up(self.norm(x))))


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(
      32,
      name="up",
      kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")),
    )(x)
    h = nn.Dense(
      16,
      name="down",
      kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed")),
    )(jax.nn.relu(h))
    return x + h


def assert_same_sharding(test, actual, expected, msg=None):
  test.assertTrue(
    actual.sharding.is_equivalent_to(expected.sharding, actual.ndim),
    msg=f"{msg}: {actual.sharding.spec} != {expected.sharding.spec}",
  )


def created(f, rules, m):
  """`f`'s params, created where `rules` put them."""
  shardings = hkb.param_shardings(jax.eval_shape(f.init, KEY, X), m, rules)
  return jax.jit(f.init, out_shardings=shardings)(KEY, X)


class NnxTest(absltest.TestCase):
  def test_specs_as_nnx_places_its_own_params(self):
    m = mesh()
    f = hk.transform(lambda x: hkb.from_flax(NnxBlock, name="block")(x))
    rules = hkb.ShardingRules.from_foreign(f.init, KEY, X)
    params = created(f, rules, m)
    with jax.set_mesh(m):
      native = NnxBlock(rngs=nnx.Rngs(0))  # Eager sharding: placed by NNX.
    assert_same_sharding(self, params["block/up"]["kernel"], native.up.kernel[...], "up")
    assert_same_sharding(self, params["block/down"]["kernel"], native.down.kernel[...], "down")
    self.assertEqual(
      params["block/down"]["kernel"].sharding.spec, P("model", None)
    )  # `mlp` -> `model` by its own rules.
    self.assertEqual(params["block/norm"]["scale"].sharding.spec, P())

  def test_declared_partitioning_outranks_the_rules_given(self):
    # `rules=` covers the params Flax declares nothing for; a rule that also
    # matches a declared kernel does not override what NNX itself gives it.
    m = mesh()
    f = hk.transform(lambda x: hkb.from_flax(NnxBlock, name="block")(x))
    rules = hkb.ShardingRules.from_foreign(
      f.init, KEY, X, rules=[(r"kernel$", P("data")), (r"scale$", P("model"))]
    )
    params = created(f, rules, m)
    with jax.set_mesh(m):
      native = NnxBlock(rngs=nnx.Rngs(0))
    assert_same_sharding(self, params["block/up"]["kernel"], native.up.kernel[...], "up")
    self.assertEqual(params["block/norm"]["scale"].sharding.spec, P("model"))

  def test_init_traced_before_is_traced_again(self):
    f = hk.transform(lambda x: hkb.from_flax(NnxBlock, name="block")(x))
    jax.eval_shape(f.init, KEY, X)  # jax.eval_shape caches its traces.
    for _ in range(2):
      rules = hkb.ShardingRules.from_foreign(f.init, KEY, X)
      self.assertEqual(rules.spec_for("block/up/kernel", (16, 32)), P(None, "model"))

  def test_python_arguments_stay_static_as_in_init(self):
    # Issue 27, row 5: `from_foreign(f.init, key, x, True)` traced the flag
    # (TracerBoolConversionError); `f.init(key, x, True)` takes it as it is.
    def net(x, train, depth):
      h = hkb.from_flax(NnxBlock, name="block")(x)
      for i in range(depth):
        h = hk.Linear(16, name=f"head_{i}")(h)
      return h if train else jax.lax.stop_gradient(h)

    f = hk.transform(net)
    reference = hkb.ShardingRules.from_foreign(lambda key, x: f.init(key, x, True, 2), KEY, X)
    self.assertLen(reference.rules, 2)
    for args, kwargs in (
      ((True, 2), {}),
      ((True,), {"depth": 2}),
      ((), {"train": True, "depth": np.int64(2)}),
    ):
      rules = hkb.ShardingRules.from_foreign(f.init, KEY, X, *args, **kwargs)
      self.assertEqual(rules.rules, reference.rules)
      self.assertEqual(
        jax.tree.map(jnp.shape, f.init(KEY, X, *args, **kwargs)),
        jax.tree.map(jnp.shape, f.init(KEY, X, True, 2)),
      )

  def test_older_metadata_names(self):
    class Older(nnx.Module):
      """`sharding` and `sharding_names`: Flax's older names for `out_sharding`."""

      def __init__(self, *, rngs):
        key = rngs.params()
        self.a = nnx.Param(jax.random.normal(key, (16, 8)), sharding=(None, "model"))
        self.b = nnx.Param(jax.random.normal(key, (8, 16)), sharding_names=("model", None))

      def __call__(self, x):
        return x @ self.a[...] @ self.b[...]

    m = mesh()
    f = hk.transform(lambda x: hkb.from_flax(Older, name="older")(x))
    with self.assertWarns(DeprecationWarning):
      rules = hkb.ShardingRules.from_foreign(f.init, KEY, X)
    with jax.set_mesh(m):
      native = Older(rngs=nnx.Rngs(0))
    theirs = nnx.get_partition_spec(nnx.state(native))
    self.assertEqual(rules.spec_for("older/a", (16, 8)), theirs["a"].get_value())
    self.assertEqual(rules.spec_for("older/b", (8, 16)), theirs["b"].get_value())

  def test_no_mesh_needed_to_build(self):
    # Natively, a module that declares shardings needs a mesh to be built.
    with self.assertRaisesRegex(ValueError, "mesh"):
      NnxBlock(rngs=nnx.Rngs(0))
    f = hk.transform(lambda x: hkb.from_flax(NnxBlock)(x))
    self.assertEqual(f.init(KEY, X)["nnx_block/up"]["kernel"].shape, (16, 32))

  def test_layer_scan_adds_the_layer_axis_as_nnx_vmap(self):
    m, depth = mesh(), 3
    f = hk.transform(
      lambda x: hkb.repeat_layer(
        lambda h: hkb.from_flax(NnxBlock, name="block")(h), x, depth, name="stack"
      )
    )
    rules = hkb.ShardingRules.from_foreign(f.init, KEY, X)
    params = created(f, rules, m)
    self.assertEqual(params["stack/block/up"]["kernel"].shape, (depth, 16, 32))

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def stack(rngs):
      return NnxBlock(rngs=rngs)

    with jax.set_mesh(m):
      native = stack(nnx.Rngs(0))
    assert_same_sharding(self, params["stack/block/up"]["kernel"], native.up.kernel[...], "up")
    assert_same_sharding(
      self, params["stack/block/down"]["kernel"], native.down.kernel[...], "down"
    )

  def test_declared_stack_maps_the_layer_axis(self):
    m, depth = mesh(), 2
    f = hk.transform(
      lambda x: hkb.repeat_layer(
        lambda h: hkb.from_flax(NnxBlock, name="block")(h), x, depth, name="stack"
      )
    )
    rules = hkb.ShardingRules.from_foreign(f.init, KEY, X, stacked={"stack": "data"})
    params = created(f, rules, m)

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "data"})
    def stack(rngs):
      return NnxBlock(rngs=rngs)

    with jax.set_mesh(m):
      native = stack(nnx.Rngs(0))
    # Where NNX places the stack: by its metadata (`nnx.get_named_sharding`);
    # the values it built inside the vmap were placed layer by layer.
    native_sharding = nnx.get_named_sharding(nnx.state(native), m)
    self.assertTrue(
      params["stack/block/up"]["kernel"].sharding.is_equivalent_to(
        native_sharding["up"]["kernel"].get_value(), 3
      )
    )
    self.assertEqual(params["stack/block/up"]["kernel"].sharding.spec, P("data", None, "model"))

  def test_some_stacks_declared_is_an_error(self):
    def f(x):
      inner = lambda h: hkb.repeat_layer(
        lambda g: hkb.from_flax(NnxBlock, name="block")(g), h, 2, name="inner"
      )
      return hkb.repeat_layer(inner, x, 2, name="outer")

    f = hk.transform(f)
    with self.assertRaisesRegex(
      ValueError,
      r"parameter 'outer/inner/block/(up|down)/kernel' \(shape "
      r"\(2, 2, .*\)\) lies in 2 layer stack\(s\), of which `stacked=` "
      r"declares 1",
    ):
      hkb.ShardingRules.from_foreign(f, KEY, X, stacked=["outer"])
    rules = hkb.ShardingRules.from_foreign(f, KEY, X)
    self.assertEqual(
      rules.spec_for("outer/inner/block/up/kernel", (2, 2, 16, 32)), P(None, None, None, "model")
    )


class LinenTest(parameterized.TestCase):
  @parameterized.parameters("argument", "context")
  def test_specs_as_linen_gives_them(self, how):
    m = mesh()
    module = LinenBlock()
    f = hk.transform(lambda x: hkb.from_flax(module, name="block")(x))
    if how == "argument":
      rules = hkb.ShardingRules.from_foreign(f.init, KEY, X, logical_axis_rules=LOGICAL)
    else:
      with nn.logical_axis_rules(LOGICAL):
        rules = hkb.ShardingRules.from_foreign(f.init, KEY, X)
    params = created(f, rules, m)
    # Native: the sharding Linen gives each box (physical names as they
    # are, logical ones through the rules).
    boxes = jax.eval_shape(module.init, KEY, X)["params"]
    native = {
      "up": boxes["up"]["kernel"].get_sharding(m),
      "down": nn.logical_to_mesh_sharding(boxes["down"]["kernel"].get_partition_spec(), m, LOGICAL),
    }
    for layer, sharding in native.items():
      self.assertTrue(
        params[f"block/{layer}"]["kernel"].sharding.is_equivalent_to(sharding, 2), msg=layer
      )
    self.assertEqual(params["block/down"]["kernel"].sharding.spec, P("model", None))
    self.assertEqual(params["block/up"]["bias"].sharding.spec, P())

  def test_a_box_with_its_own_rules_as_linen(self):
    # Linen unboxes a param by the rules its box carries, before the
    # current ones (`logical_axis_rules=` here).
    own = (("embed", "data"), ("mlp", None))
    module = nn.Dense(
      32,
      kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "mlp"), rules=own
      ),
    )
    f = hk.transform(lambda x: hkb.from_flax(module, name="up")(x))
    m = mesh()
    params = created(
      f, hkb.ShardingRules.from_foreign(f.init, KEY, X, logical_axis_rules=LOGICAL), m
    )
    box = jax.eval_shape(module.init, KEY, X)["params"]["kernel"]
    native = nn.logical_to_mesh_sharding(box.get_partition_spec(), m, own)
    self.assertTrue(
      params["up"]["kernel"].sharding.is_equivalent_to(native, 2),
      msg=params["up"]["kernel"].sharding.spec,
    )

  def test_a_short_spec_and_a_name_inside_another(self):
    # A spec may name fewer axes than the param has (the rest are not
    # split), and a rule names one param: `proj/kernel`, not `out_proj/...`.
    module = nn.Dense(
      16, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("model",))
    )

    def f(x):
      h = hkb.from_flax(module, name="proj")(x)
      return hkb.from_flax(nn.Dense(16), name="out_proj")(h)

    f = hk.transform(f)
    m = mesh()
    params = created(f, hkb.ShardingRules.from_foreign(f.init, KEY, X), m)
    box = jax.eval_shape(module.init, KEY, X)["params"]["kernel"]
    self.assertTrue(
      params["proj"]["kernel"].sharding.is_equivalent_to(box.get_sharding(m), 2),
      msg=params["proj"]["kernel"].sharding.spec,
    )
    self.assertTrue(params["out_proj"]["kernel"].sharding.is_fully_replicated)

  def test_user_rules_cover_the_rest(self):
    def f(x):
      h = hkb.from_flax(LinenBlock(), name="block")(x)
      return hk.Linear(16, name="head")(h)

    f = hk.transform(f)
    rules = hkb.ShardingRules.from_foreign(
      f, KEY, X, rules=[(r"head/w$", P("data", None))], logical_axis_rules=LOGICAL
    )
    params = created(f, rules, mesh())
    self.assertEqual(params["head"]["w"].sharding.spec, P("data", None))
    self.assertEqual(params["block/up"]["kernel"].sharding.spec, P(None, "model"))

  def test_nothing_declared_nothing_recorded(self):
    f = hk.transform(lambda x: hkb.from_flax(nn.Dense(4))(x))
    self.assertEqual(hkb.ShardingRules.from_foreign(f.init, KEY, X).rules, ())
    g = hk.transform(lambda x: hkb.from_flax(functools.partial(nnx.Linear, 16, 4))(x))
    self.assertEqual(hkb.ShardingRules.from_foreign(g.init, KEY, X).rules, ())


if __name__ == "__main__":
  absltest.main()
