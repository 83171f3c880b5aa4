"""Tests for the shared test helpers: primitive counts see nested jaxprs on every jax; one fresh process serves many calls."""

import os
import types
from unittest import mock

from absl.testing import absltest
import jax
import jax.extend.core as jax_core
import jax.numpy as jnp

from testing import test_utils


def _record(path, value):
  """Run in a `FreshProcess`: appends to `path` this process's id and `value`."""
  print("a line the call printed")
  if value == "raise":
    raise ValueError("asked to raise")
  with open(path, "a") as f:
    f.write(f"{os.getpid()} {value}\n")


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


class FreshProcessTest(absltest.TestCase):

  def test_many_calls_in_one_new_process(self):
    path = os.path.join(self.create_tempdir().full_path, "calls.txt")
    child = test_utils.FreshProcess(__file__, "_record")
    try:
      self.assertIsNone(child.call(path, "first"))
      error = child.call(path, "raise")
      self.assertIsNone(child.call(path, "second"))  # The child lives on.
    finally:
      child.close()
    self.assertIn("ValueError: asked to raise", error)
    with open(path) as f:
      pids, values = zip(*(line.split() for line in f))
    self.assertEqual(values, ("first", "second"))
    self.assertLen(set(pids), 1)
    self.assertNotEqual(pids[0], str(os.getpid()))


if __name__ == "__main__":
  absltest.main()
