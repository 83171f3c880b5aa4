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

  @hk.testing.transform_and_run
  def test_slots(self):
    tree = {"enc": {"w": 1, "b": 2}, "scale": 3}
    with hk.name_scope("net"):
      slots = naming.allocate_key_path(tree)
    self.assertEqual(slots, [("['enc']['b']", naming.Slot("net/enc", "b")),
                             ("['enc']['w']", naming.Slot("net/enc", "w")),
                             ("['scale']", naming.Slot("net", "scale"))])

  @hk.testing.transform_and_run
  def test_first_component_is_allocated_like_a_module(self):
    # Ground truth: Haiku's own numbering of a second module `linear`.
    hk.Linear(1)
    (_, slot), = naming.allocate_key_path({"linear": {"w": 1}})
    self.assertEqual(slot, naming.Slot("linear_1", "w"))
    self.assertEqual(hk.Linear(1).module_name, "linear_2")

  @hk.testing.transform_and_run
  def test_haiku_shaped_keys_are_accepted(self):
    tree = {"mlp/~/linear_0": {"w": 1}, "mlp/~/linear_1": {"w": 1}}
    self.assertEqual([slot for _, slot in naming.allocate_key_path(tree)],
                     [naming.Slot("mlp/~/linear_0", "w"),
                      naming.Slot("mlp/~/linear_1", "w")])

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
