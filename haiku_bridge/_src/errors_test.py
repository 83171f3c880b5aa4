"""Tests for errors: the public call's name on every message, through one path."""

import ast
import os
import re

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import errors

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A string that starts as a message prefix would: `"hkb.to_nnx: ..."`, `f"hkb.{api}: ..."`.
_OWN_PREFIX = re.compile(r"""^[rbfRBF]*(["']{1,3})hkb(\.[\w.{}()]+)?:""")


def own_prefixes(source: str) -> list[str]:
  """The string literals of `source` that write a message prefix themselves."""
  found = {}  # By position: an f-string's parts report the f-string's.
  for node in ast.walk(ast.parse(source)):
    first = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
    if isinstance(first, ast.Constant) and str(first.value).startswith("hkb"):
      segment = ast.get_source_segment(source, node) or ""
      if _OWN_PREFIX.match(segment):
        found.setdefault((node.lineno, node.col_offset), segment.splitlines()[0])
  return [found[position] for position in sorted(found)]


def library_sources() -> dict[str, str]:
  """`{path: source}` of every module of the library, its tests left out."""
  sources = {}
  for directory, _, files in os.walk(_PACKAGE):
    for name in files:
      if name.endswith(".py") and not name.endswith("_test.py"):
        path = os.path.join(directory, name)
        with open(path) as f:
          sources[os.path.relpath(path, _PACKAGE)] = f.read()
  return sources


class ErrorsTest(absltest.TestCase):
  def test_innermost_entry_names_the_message(self):
    with errors.entry("layer_scan"):
      self.assertEqual(errors.message("x"), "hkb.layer_scan: x")
      with errors.entry("custom_vjp"):
        self.assertEqual(errors.message("y"), "hkb.custom_vjp: y")
      self.assertEqual(errors.message("z"), "hkb.layer_scan: z")

  def test_outer_wins_keeps_an_open_entry(self):
    with errors.entry("ShardingRules", outer_wins=True):
      self.assertEqual(errors.message("x"), "hkb.ShardingRules: x")
    with errors.entry("param_shardings"):
      with errors.entry("ShardingRules", outer_wins=True):
        self.assertEqual(errors.message("x"), "hkb.param_shardings: x")

  def test_entry_restored_after_an_error(self):
    with self.assertRaises(ValueError):
      with errors.entry("repeat_layer"):
        raise ValueError()
    self.assertEqual(errors.message("x"), "hkb: x")

  def test_outside_an_entry_no_call_is_guessed(self):
    self.assertIsNone(errors.current())
    self.assertEqual(errors.message("x"), "hkb: x")

  def test_check_keywords(self):
    # The first unknown name in sorted order (as each call's test expects), the nearest
    # accepted name when one is close, every accepted name.
    with errors.entry("scan"):
      errors.check_keywords({"remat_groups": 2}, ("a", "remat_groups"))  # Accepted: no error.
      with self.assertRaisesRegex(
        TypeError,
        r"^hkb.scan: got an unexpected keyword argument 'remat_group' \(did you "
        r"mean 'remat_groups'\?\); its arguments are a, remat_groups\.$",
      ):
        errors.check_keywords({"zz": 3, "remat_group": 2}, ("a", "remat_groups"))
      with self.assertRaisesRegex(TypeError, r"argument 'zz'; its arguments are a\.$"):
        errors.check_keywords({"zz": 3}, ("a",))

  def test_no_site_writes_its_own_prefix(self):
    sources = library_sources()
    self.assertIn(os.path.join("_src", "custom_grad.py"), sources)
    found = {
      path: own_prefixes(source)
      for path, source in sources.items()
      if path != os.path.join("_src", "errors.py")
    }
    self.assertEqual({path: strings for path, strings in found.items() if strings}, {})

  def test_own_prefixes_finds_them(self):
    source = (
      'a = "hkb.to_nnx: x"\nb = f"hkb.{api}: y"\nc = (f"hkb.custom_vjp: bwd "\n  "z")\n'
      'd = "use hkb.scan(f)"\ne = f"hkb.{errors.current()}(f)"\n'
    )
    self.assertEqual(
      own_prefixes(source), ['"hkb.to_nnx: x"', 'f"hkb.{api}: y"', 'f"hkb.custom_vjp: bwd "']
    )

  def test_formatting(self):
    self.assertEqual(errors.type_str(jnp.zeros([4, 3], jnp.bfloat16)), "bfloat16[4, 3]")
    self.assertEqual(errors.type_str(jax.ShapeDtypeStruct((), jnp.int32)), "int32[]")
    path = jax.tree_util.tree_leaves_with_path({"w": [0]})[0][0]
    self.assertEqual(errors.keystr(path), "['w'][0]")
    self.assertEqual(errors.keystr(()), "<root>")

  def test_describe(self):
    self.assertEqual(errors.describe((1, 2)), "a tuple of length 2")
    self.assertEqual(errors.describe(jnp.zeros([2], jnp.int32)), "an array int32[2]")
    self.assertEqual(errors.describe({}), "a dict")

  def test_got_uses_the_right_article(self):
    self.assertEqual(errors.got(object()), "an object")
    self.assertEqual(errors.got(np.int32(1)), "an int32 1")
    self.assertEqual(errors.got([1]), "a list of length 1")
    # By sound: "u" reads "you" in a uint8, not in an Unset.
    self.assertEqual(errors.got(np.uint8(3)), "a uint8 3")
    self.assertEqual(errors.got(type("Unset", (), {})()), "an Unset")
    self.assertEqual(errors.got(type("Union", (), {})()), "a Union")

  def test_named_says_the_error_again_naming_the_call(self):
    with errors.entry("call_pure"):
      renamed = errors.named(KeyError("k"), "the function raised")
      self.assertIsInstance(renamed, KeyError)
      self.assertEqual(renamed.args, ("hkb.call_pure: the function raised",))
      # Already named by the bridge: the same error, unchanged.
      named = ValueError("hkb.scan: bad")
      self.assertIs(errors.named(named, "again"), named)
      self.assertEqual(str(named), "hkb.scan: bad")
      # A type that cannot be made from one message: the same error, the
      # message added as a note.
      odd = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
      self.assertIs(errors.named(odd, "the function raised"), odd)
      self.assertEqual(odd.__notes__, ["hkb.call_pure: the function raised"])

  def test_got_shows_small_values(self):
    self.assertEqual(errors.got(None), "None")
    self.assertEqual(errors.got(True), "True")
    self.assertEqual(errors.got(3), "an int 3")
    self.assertEqual(errors.got("s"), "a str 's'")
    self.assertEqual(errors.got("x" * 100), "a str '" + "x" * 56 + "...")
    self.assertEqual(errors.got(jnp.zeros([2])), "an array float32[2]")

  def test_bad_argument_names_argument_value_and_what_to_pass(self):
    with errors.entry("stacked_init"):
      self.assertEqual(
        errors.bad_argument("in_axes", 0, "a tuple", "Try (0,)."),
        "hkb.stacked_init: `in_axes` must be a tuple; got an int 0. Try (0,).",
      )

  def test_check_callable(self):
    errors.check_callable("f", len, "a function")
    with errors.entry("custom_vjp"):
      with self.assertRaisesRegex(
        TypeError, r"^hkb.custom_vjp: `fwd` must be a function; got None\.$"
      ):
        errors.check_callable("fwd", None, "a function")

  def test_check_str(self):
    errors.check_str("name", "a", "a name")
    errors.check_str("name", None, "a name", optional=True)
    for bad in (None, "", 3):
      with self.assertRaisesRegex(TypeError, "`name` must be a name"):
        errors.check_str("name", bad, "a name")

  def test_check_positive_int(self):
    self.assertEqual(errors.check_positive_int("n", np.int64(3)), 3)
    self.assertIs(type(errors.check_positive_int("n", np.int64(3))), int)
    for bad, error in (
      (0, ValueError),
      (-2, ValueError),
      (True, TypeError),
      (2.0, TypeError),
      ("2", TypeError),
      (None, TypeError),
    ):
      with self.assertRaisesRegex(error, "`n` must be a positive int"):
        errors.check_positive_int("n", bad)

  def test_check_int_sequence(self):
    self.assertEqual(errors.check_int_sequence("a", [np.int32(1), 0], "ints"), (1, 0))
    # Bytes iterate as ints, yet are no sequence of axes.
    for bad, error in (
      (1, TypeError),
      ("01", TypeError),
      (b"\x00", TypeError),
      ([True], TypeError),
      ([1.0], TypeError),
      ([-1], ValueError),
    ):
      with self.assertRaisesRegex(error, "`a` must be ints"):
        errors.check_int_sequence("a", bad, "ints")

  def test_looks_like_a_shard(self):
    self.assertTrue(errors.looks_like_a_shard((4, 1), (4, 8)))
    self.assertFalse(errors.looks_like_a_shard((4, 6), (4, 8)))
    self.assertFalse(errors.looks_like_a_shard((4, 8), (4, 8)))


if __name__ == "__main__":
  absltest.main()
