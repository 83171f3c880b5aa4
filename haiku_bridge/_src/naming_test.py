"""Tests for naming: the key-path rule and the inline allocation rule."""

from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax

from haiku_bridge._src import naming


class KeyPathTest(parameterized.TestCase):
  @parameterized.parameters(
    ({"a": {"b": 0}}, ("a", "b")),
    ({"layers": [0, 0]}, ("layers_1",)),
    ([[0]], ("layer_0_0",)),
    ({"a": [{"w": 0}]}, ("a_0", "w")),
  )
  def test_components(self, tree, expected):
    path = jax.tree_util.tree_leaves_with_path(tree)[-1][0]
    self.assertEqual(naming.path_components(path), expected)

  @parameterized.parameters(
    ("~", ("a", "b"), "a/b"),
    ("net", ("a",), "net/a"),
    ("net", (), "net"),
    ("~", (), "~"),
  )
  def test_join_bundle(self, scope, components, expected):
    self.assertEqual(naming.join_bundle(scope, components), expected)

  def test_groups(self):
    tree = {"enc": {"w": 1, "b": 2}, "scale": 3, "dec": {"mlp": {"w": 4}}}
    groups = naming.key_path_groups(tree)
    self.assertEqual(list(groups), ["dec", "enc", None])  # Leaves order.
    self.assertEqual(groups["dec"], [naming.KeyPathLeaf(0, "['dec']['mlp']['w']", ("mlp",), "w")])
    self.assertEqual([(m.index, m.name) for m in groups["enc"]], [(1, "b"), (2, "w")])
    self.assertEqual(groups[None], [naming.KeyPathLeaf(3, "['scale']", (), "scale")])

  def test_haiku_shaped_keys_are_one_group(self):
    groups = naming.key_path_groups({"mlp/~/linear_0": {"w": 1}, "mlp/~/linear_1": {"w": 1}})
    self.assertEqual([m.below for m in groups["mlp"]], [("~", "linear_0"), ("~", "linear_1")])

  @hk.testing.transform_and_run
  def test_module_scope_is_allocated_like_a_module(self):
    # Ground truth: Haiku's own numbering of a second module `linear`.
    hk.Linear(1)
    with naming.module_scope("linear", "['linear']['w']"):
      inside = hk.experimental.current_name()
    self.assertEqual(inside, "linear_1")
    self.assertEqual(hk.Linear(1).module_name, "linear_2")
    with naming.module_scope(None, "['w']"):
      self.assertEqual(hk.experimental.current_name(), "~")

  @hk.testing.transform_and_run
  def test_module_scope_explicit_number_taken(self):
    hk.Linear(1, name="layers_0")
    with self.assertRaisesRegex(
      ValueError,
      r"params path \['layers'\]\[0\] "
      "needs the module name 'layers_0'",
    ):
      with naming.module_scope("layers_0", "['layers'][0]"):
        pass

  @hk.testing.transform_and_run
  def test_module_scope_of_a_method_scope_is_never_numbered(self):
    # Ground truth: Haiku's own method scope, entered twice in one call.
    class Module(hk.Module):
      def encode(self):
        return hk.Linear(1).module_name.rpartition("/")[0]

      def __call__(self):
        haiku = [self.encode(), self.encode()]
        ours = []
        for _ in range(2):
          with naming.module_scope("~encode", "['~encode']['w']"):
            ours.append(hk.experimental.current_name())
        return haiku, ours

    haiku, ours = Module()()
    self.assertEqual(haiku, ["module/~encode"] * 2)
    self.assertEqual(ours, haiku)

  def test_invalid_component(self):
    with self.assertRaisesRegex(ValueError, r"\['a-b'\]\['w'\].*'a-b'"):
      naming.key_path_components({"a-b": {"w": 1}})

  @parameterized.parameters(
    ("mlp", ("mlp", 0)), ("mlp_3", ("mlp", 3)), ("a_b", ("a_b", 0)), ("lin_0", ("lin", 0))
  )
  def test_split_number(self, name, expected):
    self.assertEqual(naming.split_number(name), expected)


class OwnBundleTest(parameterized.TestCase):
  @parameterized.parameters("top", "module")
  def test_matches_haiku_allocator(self, where):
    # Ground truth: the names Haiku gives the same modules made here (after
    # two `linear`s and one `mlp`) and in a transform of their own.
    def made_by_f():
      return [hk.Linear(1).module_name, hk.nets.MLP([1]).module_name, hk.Linear(1).module_name]

    def here():
      hk.Linear(1)
      hk.Linear(1)
      hk.nets.MLP([1])
      scope = hk.experimental.current_name()
      counters = {}
      for name in ("linear", "mlp"):
        full = name if scope == naming.TOP_LEVEL else f"{scope}/{name}"
        counters[full] = {"linear": 2, "mlp": 1}[name]
      return scope, [naming.own_bundle(f"{n}/~/x", scope, counters) for n in made_by_f()] + [
        naming.own_bundle(scope, scope, counters)
      ]

    if where == "top":
      scope, got = hk.transform(here).apply({}, None)
    else:
      scope, got = hk.transform(
        lambda: type("M", (hk.Module,), {"__call__": lambda self: here()})(name="m")()
      ).apply({}, None)
    own = hk.transform(made_by_f).apply({}, None)
    self.assertEqual(got, [f"{n}/~/x" for n in own] + ["~"])

  def test_names_it_did_not_make_stay(self):
    # A bundle that a lift wrote straight into the scope (transparent_lift).
    self.assertEqual(naming.own_bundle("m/layer1", "m", {"m/linear": 1}), "layer1")
    self.assertEqual(naming.own_bundle("other/w", "m", {}), "other/w")


if __name__ == "__main__":
  absltest.main()
