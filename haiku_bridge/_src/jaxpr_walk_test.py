"""Tests for jaxpr_walk.py: the walk finds the equations inside each kind of jaxpr an equation holds."""

import collections
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax import lax
import jax.numpy as jnp

from haiku_bridge._src import jaxpr_walk


@jax.custom_vjp
def _sqrt(x):
  return jnp.sqrt(x)


_sqrt.defvjp(lambda x: (_sqrt(x), x), lambda x, g: (g,))


@jax.custom_jvp
def _abs(x):
  return jnp.abs(x)


_abs.defjvp(lambda primals, tangents: (_abs(primals[0]), tangents[0]))


# Of each kind of jaxpr an equation holds, a function running one, and the
# primitives inside it, listed by hand: each is found only by walking into it.
_INSIDE = {
  "scan": (lambda x: lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=2)[0], ["sin"]),
  "cond": (lambda x: lax.cond(x > 0, jnp.cos, jnp.tan, x), ["cos", "tan"]),
  "while": (lambda x: lax.while_loop(lambda c: c < 3.0, jnp.exp, x), ["lt", "exp"]),
  "jit": (jax.jit(jnp.log), ["log"]),
  "custom_vjp": (_sqrt, ["sqrt"]),
  "custom_jvp": (_abs, ["abs"]),
  "checkpoint": (jax.checkpoint(jnp.floor), ["floor"]),
  # At depth: a cond in a scan in a jit.
  "nested": (
    jax.jit(
      lambda x: lax.scan(
        lambda c, _: (lax.cond(c > 0, jnp.negative, jnp.sign, c), None), x, None, length=2
      )[0]
    ),
    ["scan", "gt", "convert_element_type", "cond", "neg", "sign"],
  ),
}


def _names(eqns):
  return collections.Counter(eqn.primitive.name for eqn in eqns)


class EquationsTest(parameterized.TestCase):
  @parameterized.product(
    kind=list(_INSIDE),
    # jax's own reading (jax >= 0.10), and the library's on older releases.
    jaxprs_in_params=["jax", "without"],
  )
  def test_finds_the_equations_inside(self, kind, jaxprs_in_params):
    f, inside = _INSIDE[kind]
    closed = jax.make_jaxpr(f)(1.0)
    with mock.patch.object(
      jaxpr_walk,
      "_JAXPRS_IN_PARAMS",
      jaxpr_walk._JAXPRS_IN_PARAMS if jaxprs_in_params == "jax" else None,
    ):
      walked = _names(jaxpr_walk.equations(closed))
      self.assertEqual(walked, _names(jaxpr_walk.equations(closed.jaxpr)))  # Open or closed.
    top = _names(closed.eqns)
    self.assertEqual(walked - top, collections.Counter(inside))
    self.assertEqual(walked & top, top)  # Every equation of the top level too.

  def test_sub_jaxprs_is_one_level_down(self):
    f, _ = _INSIDE["nested"]
    (jit,) = jax.make_jaxpr(f)(1.0).eqns
    (body,) = jaxpr_walk.sub_jaxprs(jit.params)
    self.assertEqual([eqn.primitive.name for eqn in body.eqns], ["scan"])

  def test_jax_reads_params_as_the_fallback_does(self):
    # (Before jax 0.10 both are the fallback.)
    for kind, (f, _) in _INSIDE.items():
      for eqn in jaxpr_walk.equations(jax.make_jaxpr(f)(1.0)):
        with self.subTest(kind=kind, primitive=eqn.primitive.name):
          ours = list(jaxpr_walk.sub_jaxprs(eqn.params))
          with mock.patch.object(jaxpr_walk, "_JAXPRS_IN_PARAMS", None):
            fallback = list(jaxpr_walk.sub_jaxprs(eqn.params))
          self.assertEqual([id(j) for j in ours], [id(j) for j in fallback])


if __name__ == "__main__":
  absltest.main()
