"""Tests for guards.py: where the code runs, and the one place the library asks whether it is Haiku's init."""

import ast
import os

from absl.testing import absltest
import haiku as hk
import jax
import jax.numpy as jnp

import haiku_bridge
from haiku_bridge._src import guards

_LIBRARY = os.path.dirname(haiku_bridge.__file__)
# Haiku's two ways of saying it: its public `hk.running_init()`, and the private
# `params_frozen()` under it.
_INIT_QUESTIONS = ("running_init", "params_frozen")


def asks_if_init(source: str) -> set[str]:
  """The names of Haiku's init question that `source`'s code reads (`hk.running_init()`, an import of it), its text aside."""
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Attribute):
      found.add(node.attr)
    elif isinstance(node, ast.Name):
      found.add(node.id)
    elif isinstance(node, ast.alias):
      found.add(node.name.rsplit(".", 1)[-1])
  return found & set(_INIT_QUESTIONS)


def _asked(where):
  """`(guards.initialising(), hk.running_init())`, appended to `where`."""
  where.append((guards.initialising(), hk.running_init()))


class InitialisingTest(absltest.TestCase):
  """`guards.initialising()` against Haiku's own answer, `hk.running_init()`, where Haiku gives one."""

  def _init_and_apply(self, f):
    """What `f` recorded at init, and at apply with the params init made."""
    at_init, at_apply = [], []
    transformed = hk.transform(lambda x: f(x, at_init if not at_apply else at_apply))
    x = jnp.ones((2,))
    params = transformed.init(jax.random.PRNGKey(0), x)
    at_apply.append("apply")
    transformed.apply(params, jax.random.PRNGKey(1), x)
    return at_init, at_apply[1:]

  def test_outside_a_transform_it_is_not_init(self):
    with self.assertRaises(ValueError):  # Where Haiku has no answer.
      hk.running_init()
    self.assertFalse(guards.initialising())

  def test_init_and_apply(self):
    def f(x, where):
      _asked(where)
      return hk.Linear(2)(x)

    self.assertEqual(self._init_and_apply(f), ([(True, True)], [(False, False)]))

  def test_a_lifted_init_is_init_and_its_apply_is_not(self):
    def inner(x, where):
      _asked(where)
      return hk.Linear(2)(x)

    def f(x, where):
      transformed = hk.transform(lambda x: inner(x, where))
      params = hk.experimental.lift(transformed.init)(hk.next_rng_key(), x)
      return transformed.apply(params, None, x)

    # The outer init runs the inner init (lifted) and then the inner apply;
    # the outer apply runs the inner apply only.
    self.assertEqual(self._init_and_apply(f), ([(True, True), (False, False)], [(False, False)]))

  def test_under_remat_and_a_custom_getter_it_is_the_transform_s_own(self):
    def f(x, where):
      def body(x):
        _asked(where)
        return hk.Linear(2)(x)

      with hk.custom_getter(lambda next_getter, value, context: next_getter(value)):
        _asked(where)
        return hk.remat(body)(x)

    self.assertEqual(self._init_and_apply(f), ([(True, True)] * 2, [(False, False)] * 2))


class OnePlaceTest(absltest.TestCase):
  def test_only_guards_asks_if_init(self):
    askers, read = {}, set()
    for directory, _, files in os.walk(_LIBRARY):
      for name in files:
        if name.endswith(".py") and not name.endswith("_test.py"):
          path = os.path.join(directory, name)
          with open(path) as f:
            asked = asks_if_init(f.read())
          relative = os.path.relpath(path, _LIBRARY)
          read.add(relative)
          if asked:
            askers[relative] = asked
    self.assertEqual(askers, {os.path.join("_src", "guards.py"): {"running_init"}})
    # Guards the walk: modules that ask it through guards were read.
    for module in ("_src/time_scan.py", "_src/remat/loop.py", "_src/foreign_module.py"):
      self.assertIn(module.replace("/", os.sep), read)

  def test_the_check_sees_each_way_of_asking(self):
    for source in (
      "if hk.running_init(): pass\n",
      "import haiku\nx = haiku.running_init()\n",
      "from haiku import running_init\n",
      "from haiku._src.transform import running_init as r\n",
      "from haiku._src import base\nbase.params_frozen()\n",
    ):
      with self.subTest(source=source):
        self.assertNotEqual(asks_if_init(source), set())
    # Its text is not code: a docstring's example asks nothing.
    self.assertEqual(asks_if_init('"""split_rng=(not hk.running_init())"""\n'), set())


if __name__ == "__main__":
  absltest.main()
