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
    self.assertEqual(groups["dec"], [naming.KeyPathLeaf(
        0, "['dec']['mlp']['w']", ("mlp",), "w")])
    self.assertEqual([(m.index, m.name) for m in groups["enc"]],
                     [(1, "b"), (2, "w")])
    self.assertEqual(groups[None], [naming.KeyPathLeaf(3, "['scale']", (),
                                                       "scale")])

  def test_haiku_shaped_keys_are_one_group(self):
    groups = naming.key_path_groups({"mlp/~/linear_0": {"w": 1},
                                     "mlp/~/linear_1": {"w": 1}})
    self.assertEqual([m.below for m in groups["mlp"]],
                     [("~", "linear_0"), ("~", "linear_1")])

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
    with self.assertRaisesRegex(ValueError, r"params path \['layers'\]\[0\] "
                                "needs the module name 'layers_0'"):
      with naming.module_scope("layers_0", "['layers'][0]"):
        pass

  def test_invalid_component(self):
    with self.assertRaisesRegex(ValueError, r"\['a-b'\]\['w'\].*'a-b'"):
      naming.key_path_components({"a-b": {"w": 1}})

  @parameterized.parameters(
      ("mlp", ("mlp", 0)), ("mlp_3", ("mlp", 3)), ("a_b", ("a_b", 0)),
      ("lin_0", ("lin", 0)))
  def test_split_number(self, name, expected):
    self.assertEqual(naming.split_number(name), expected)


class AllocateInlineNamesTest(absltest.TestCase):

  @hk.testing.transform_and_run
  def test_matches_haiku_allocator(self):
    # Ground truth: the names Haiku gives modules made here, after two
    # `linear`s and one `mlp` already exist in this scope.
    hk.Linear(1)
    hk.Linear(1)
    hk.nets.MLP([1])
    mapping = naming.allocate_inline_names(
        ["linear", "linear_2/~/x", "mlp/~/linear_0", "~"])
    self.assertEqual(mapping, {"linear": "linear_2",
                               "linear_2/~/x": "linear_4/~/x",
                               "mlp/~/linear_0": "mlp_1/~/linear_0",
                               "~": "~"})
    # Code after the call continues from the advanced counters.
    self.assertEqual(hk.Linear(1).module_name, "linear_5")
    self.assertEqual(hk.nets.MLP([1]).module_name, "mlp_2")

  @hk.testing.transform_and_run
  def test_inside_module_and_name_scope(self):
    class M(hk.Module):

      def __call__(self):
        with hk.name_scope("scope"):
          return naming.allocate_inline_names(["lin", "~"])

    self.assertEqual(M()(), {"lin": "m/scope/lin", "~": "m/scope"})


if __name__ == "__main__":
  absltest.main()
