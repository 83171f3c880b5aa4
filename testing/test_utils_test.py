"""Tests for the shared test helpers: primitive counts see nested jaxprs (jaxpr_walk_test: on every jax); one fresh process serves many calls; beside a TPU a fresh process runs on the CPU."""

import os
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp

from testing import test_utils


def _record(path, value):
  """Run in a `FreshProcess`: appends to `path` this process's id and `value`."""
  print("a line the call printed")
  if value == "raise":
    raise ValueError("asked to raise")
  with open(path, "a") as f:
    f.write(f"{os.getpid()} {value}\n")


def _print_platforms(path=None):
  """Run in a fresh process: the JAX_PLATFORMS it was given, and the backend it runs on (to `path`, if given)."""
  line = f"{os.environ.get('JAX_PLATFORMS')!r} {jax.default_backend()}"
  if path is None:
    print(line)
  else:
    with open(path, "w") as f:
      f.write(line)


def nested(x):
  return jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x)


class PrimitiveCountsTest(absltest.TestCase):
  def test_counts_inside_nested_jaxprs(self):
    counts = test_utils.primitive_counts(nested, jnp.ones([3]))
    self.assertEqual((counts["cond"], counts["sin"], counts["cos"]), (1, 1, 1))


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


class FreshProcessPlatformTest(parameterized.TestCase):
  @parameterized.named_parameters(
    # The parent holds a TPU: the child cannot open it, and runs on the CPU.
    ("beside_a_tpu", "tpu", {}, "'cpu' cpu"),
    # The caller's env decides over that.
    ("beside_a_tpu_the_caller_decides", "tpu", {"JAX_PLATFORMS": ""}, "'' cpu"),
    # Elsewhere the child gets this process's environment as it is.
    ("beside_a_cpu", "cpu", {}, "None cpu"),
  )
  def test_the_platforms_a_child_gets(self, backend, env, printed):
    with mock.patch.dict(os.environ), mock.patch.object(jax, "default_backend", lambda: backend):
      os.environ.pop("JAX_PLATFORMS", None)
      child = test_utils.run_in_fresh_process(__file__, "_print_platforms", env=env)
      server = test_utils.FreshProcess(__file__, "_print_platforms", env=env)
    self.assertEqual(child.returncode, 0, child.stderr[-3000:])
    self.assertEqual(child.stdout.strip(), printed)
    path = os.path.join(self.create_tempdir().full_path, "platforms.txt")
    try:
      self.assertIsNone(server.call(path))
    finally:
      server.close()
    with open(path) as f:
      self.assertEqual(f.read(), printed)

  @parameterized.parameters("tpu", "cpu")
  def test_what_a_child_is_compared_with_is_computed_on_its_backend(self, backend):
    with (
      mock.patch.object(jax, "default_backend", lambda: backend),
      mock.patch.object(jax, "default_device", wraps=jax.default_device) as chosen,
      test_utils.on_the_fresh_process_backend(),
    ):
      on = jax.numpy.ones(2).devices()
    if backend == "tpu":  # Beside a TPU, the child runs on the CPU.
      chosen.assert_called_once_with(jax.devices("cpu")[0])
      self.assertEqual(on, {jax.devices("cpu")[0]})
    else:
      chosen.assert_not_called()


if __name__ == "__main__":
  absltest.main()
