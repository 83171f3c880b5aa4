"""Tests for `from haiku_bridge import hk`."""

from absl.testing import absltest
import haiku
import jax
import jax.numpy as jnp

import haiku_bridge
from haiku_bridge import hk


class HkNamespaceTest(absltest.TestCase):
  def test_adds_bridge_names(self):
    self.assertIs(hk.call_pure, haiku_bridge.call_pure)
    self.assertIs(hk.get_relevant_parameters, haiku_bridge.get_relevant_parameters)
    self.assertIn("call_pure", dir(hk))
    # Its own name, where it is found: not the installed `haiku` it reads through to.
    self.assertEqual(hk.__name__, "haiku_bridge.hk")
    self.assertIs(getattr(haiku_bridge, hk.__name__.rpartition(".")[2]), hk)

  def test_installed_haiku_is_untouched(self):
    self.assertFalse(hasattr(haiku, "call_pure"))
    self.assertFalse(hasattr(haiku, "get_relevant_parameters"))

  def test_everything_else_is_haiku(self):
    for name in dir(haiku):
      if not name.startswith("__"):
        self.assertIs(getattr(hk, name), getattr(haiku, name), name)

  def test_unknown_name(self):
    with self.assertRaises(AttributeError):
      _ = hk.no_such_thing

  def test_usable_as_haiku(self):
    def f(x):
      return hk.call_pure(
        lambda p, x: x * p["scale"], x, init=lambda rng, x: {"scale": jnp.ones([])}
      ) + (hk.Linear(2)(x))

    params = hk.transform(f).init(jax.random.PRNGKey(0), jnp.ones([1, 2]))
    self.assertEqual(sorted(params), ["linear", "~"])


if __name__ == "__main__":
  absltest.main()
