"""Tests for foreign_module.py: the adapters' shared names, records and skeletons.

Ground truth: `call_pure`'s key-path rule for the same trees (what
`naming.py` documents) and Haiku's own module naming.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import haiku_bridge as hkb
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import errors
from haiku_bridge._src import foreign_module


class NamesTest(parameterized.TestCase):
  @parameterized.parameters(
    ("BatchNorm", "batch_norm"),
    ("MLPBlock", "mlp_block"),
    ("Linear", "linear"),
    ("GRUCell", "gru_cell"),
    ("Conv2d", "conv2d"),
  )
  def test_snake_case_as_haiku_names_its_modules(self, class_name, expected):
    self.assertEqual(foreign_module.snake_case(class_name), expected)
    module = type(class_name, (hk.Module,), {"__call__": lambda self: None})
    name = hk.transform(lambda: module().module_name).apply({}, None)
    self.assertEqual(name, expected)

  def test_class_name(self):
    class Thing:
      pass

    self.assertEqual(foreign_module.class_name(Thing(), Thing), "Thing")
    self.assertEqual(foreign_module.class_name(Thing, Thing), "Thing")
    self.assertEqual(foreign_module.class_name(functools.partial(Thing), Thing), "Thing")
    self.assertIsNone(foreign_module.class_name(lambda: Thing(), Thing))

  def test_names_follow_call_pures_key_path_rule(self):
    tree = {
      "layers": [{"w": jnp.zeros([2])}, {"w": jnp.zeros([3])}],
      "out": {"kernel": jnp.zeros([4]), "bias": jnp.zeros([1])},
      "scale": jnp.zeros([5]),
    }
    variables, leaves = foreign_module.flatten(tree)

    def stored(bind):
      with hk.name_scope("m"):
        bind()

    def ours():
      foreign_module.params(variables, leaves)

    def theirs():
      hkb.get_relevant_parameters(lambda rng: tree)

    names = lambda f: jax.tree.map(
      jnp.shape, hk.transform(lambda: stored(f)).init(jax.random.PRNGKey(0))
    )
    self.assertEqual(names(ours), names(theirs))
    self.assertEqual(
      variables.paths, ("layers[0].w", "layers[1].w", "out.bias", "out.kernel", "scale")
    )

  def test_attribute_keys_kept_or_left_out(self):
    class Box:
      pass

    jax.tree_util.register_pytree_with_keys(
      Box,
      lambda b: (((jax.tree_util.GetAttrKey("value"), b.value),), None),
      lambda _, children: _box(children[0]),
    )

    def _box(value):
      b = Box()
      b.value = value
      return b

    tree = {"a": _box(jnp.zeros([2]))}
    self.assertEqual(foreign_module.flatten(tree)[0].names, (("a",),))
    self.assertEqual(foreign_module.flatten(tree, attributes=True)[0].names, (("a", "value"),))
    dropped = foreign_module.flatten(
      {"col": {"x": jnp.zeros(())}}, drop_first=True, prefix=("sown",)
    )[0]
    self.assertEqual(dropped.names, (("sown", "x"),))
    self.assertEqual(dropped.paths, ("col.x",))  # Messages keep it.

  def test_python_scalars_get_their_canonical_spec(self):
    variables, _ = foreign_module.flatten({"n": 0, "x": 1.5})
    self.assertEqual(
      [(s.shape, s.dtype) for s in variables.specs], [((), jnp.int32), ((), jnp.float32)]
    )


class ForeignModuleTest(absltest.TestCase):
  def test_any_argument_is_accepted_at_construction(self):
    class Unprintable:
      def __repr__(self):
        raise TypeError("no repr")

    class Adapter(foreign_module.ForeignModule):
      def __init__(self, thing, name=None):
        super().__init__("Thing", "from_thing", name)
        self.thing = thing

      def __call__(self):
        return self.module_name

    self.assertEqual(hk.transform(lambda: Adapter(Unprintable())()).apply({}, None), "thing")

  def test_skeletons_are_cleared_with_every_cache(self):
    calls = []

    def construct_abstract():
      calls.append(1)
      return "built"

    recipe = foreign_module.Recipe(
      None,
      construct_abstract,
      lambda built: (built.upper(), None),
      foreign_module.skeleton_key("t", object()),
    )
    for _ in range(2):
      self.assertEqual(foreign_module.abstract_skeleton(recipe), "BUILT")
    self.assertLen(calls, 1)
    hkb.clear_caches()
    foreign_module.abstract_skeleton(recipe)
    self.assertLen(calls, 2)

  def test_apply_after_init_in_process_builds_nothing_again(self):
    abstract_builds = []

    def construct_abstract():
      abstract_builds.append(1)
      return "built"

    recipe = foreign_module.Recipe(
      lambda key: "built",
      construct_abstract,
      lambda built: (built.upper(), [built]),
      foreign_module.skeleton_key("t", object()),
    )
    f = hk.transform(lambda: foreign_module.built(None, recipe))
    f.init(jax.random.PRNGKey(0))
    self.assertEqual(f.apply({}, None), ("BUILT", None))
    self.assertEqual(abstract_builds, [])  # Init's skeleton, remembered.

  def test_given_params_are_checked_against_keyword_inputs(self):
    # By name and shape, against what f.init makes of hk.Linear(2) on [1, 4].
    f = hk.transform_with_state(lambda x: hk.Linear(2)(x))
    params = {"linear": {"w": jnp.zeros([3, 2]), "b": jnp.zeros([2])}}
    with self.assertRaisesRegex(
      ValueError,
      r"'linear/w' has shape \[3, 2\], "
      r"but f needs \[4, 2\] for these inputs",
    ):
      foreign_module.check_given(f, params, None, (), {"x": jnp.ones([1, 4])})
    other = {"linear": {"w": jnp.zeros([4, 2])}, "head": {"w": jnp.zeros([2])}}
    with self.assertRaisesRegex(
      ValueError,
      r"they lack \['linear/b'\] and "
      r"have \['head/w'\] besides",
    ):
      foreign_module.check_given(f, other, None, (), {"x": jnp.ones([1, 4])})

  def test_a_skeleton_key_changes_with_what_the_build_depends_on(self):
    # The abstract build draws its keys from the PRNG implementation (an
    # NNX module's rng state is key data of its shape), makes float64
    # arrays under x64, and is the adapter's own (`kind`).
    code = lambda rngs: None
    key = lambda kind="t", value=1: foreign_module.skeleton_key(kind, code, value)
    same = key()
    self.assertIsNotNone(same)
    self.assertEqual(key(), same)
    changed = {"kind": key(kind="u"), "value": key(value=2)}
    with jax.default_prng_impl("rbg"):
      changed["PRNG implementation"] = key()
    with jax.enable_x64(True):
      changed["x64"] = key()
    for what, other in changed.items():
      self.assertNotIn(other, (same, None), what)
    self.assertLen(set(changed.values()), len(changed))

  def test_with_state(self):
    f = hk.transform(lambda: hk.get_parameter("w", [], init=jnp.zeros))
    self.assertIsInstance(foreign_module.with_state(f), hk.TransformedWithState)
    with errors.entry("to_x"):
      with self.assertRaisesRegex(
        TypeError,
        r"^hkb.to_x: `f` must be the "
        r"output of hk.transform.*got a function\. "
        r".*hkb.to_x\(hk.transform_with_state\(f\)",
      ):
        foreign_module.with_state(lambda: None)

  def test_with_state_of_without_apply_rng_as_its_apply(self):
    # Called as apply(params, state, rng, x): the rng is not passed on, as
    # the apply of hk.without_apply_rng takes none.
    net = lambda x: hk.Linear(2)(x) * 3
    x = jnp.ones([1, 3])
    plain = hk.without_apply_rng(hk.transform(net))
    stateful = hk.without_apply_rng(hk.transform_with_state(net))
    params = plain.init(jax.random.PRNGKey(0), x)
    expected = plain.apply(params, x)
    np.testing.assert_array_equal(stateful.apply(params, {}, x)[0], expected)
    for f in (plain, stateful, hk.with_empty_state(plain)):
      ours = foreign_module.with_state(f)
      for rng in (jax.random.PRNGKey(1), None):
        np.testing.assert_array_equal(ours.apply(params, {}, rng, x)[0], expected)

  def test_with_state_of_an_apply_without_named_parameters(self):
    # An apply whose parameters have no names (`*args`) gets the rng, as
    # hk.transform's apply does.
    f = hk.transform(lambda x: x + jax.random.normal(hk.next_rng_key(), x.shape))
    unnamed = hk.Transformed(f.init, lambda *args: f.apply(*args))
    rng, x = jax.random.PRNGKey(1), jnp.ones([2])
    np.testing.assert_array_equal(
      foreign_module.with_state(unnamed).apply({}, {}, rng, x)[0], f.apply({}, rng, x)
    )


if __name__ == "__main__":
  absltest.main()
