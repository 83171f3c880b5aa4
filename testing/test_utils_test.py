"""Tests for the shared test helpers: primitive counts see nested jaxprs on every jax."""

import types
from unittest import mock

from absl.testing import absltest
import jax
import jax.extend.core as jax_core
import jax.numpy as jnp

from testing import test_utils


def nested(x):
  return jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x)


class PrimitiveCountsTest(absltest.TestCase):

  def test_counts_inside_nested_jaxprs(self):
    counts = test_utils.primitive_counts(nested, jnp.ones([3]))
    self.assertEqual((counts["cond"], counts["sin"], counts["cos"]), (1, 1, 1))

  def test_fallback_without_jaxprs_in_params(self):
    # jax before 0.10 has no jax.extend.core.jaxprs_in_params.
    old_jax = types.SimpleNamespace(Jaxpr=jax_core.Jaxpr, ClosedJaxpr=jax_core.ClosedJaxpr)
    with mock.patch.object(test_utils, "jax_core", old_jax):
      counts = test_utils.primitive_counts(nested, jnp.ones([3]))
    self.assertEqual(counts, test_utils.primitive_counts(nested, jnp.ones([3])))
    self.assertEqual(counts["sin"], 1)


if __name__ == "__main__":
  absltest.main()
