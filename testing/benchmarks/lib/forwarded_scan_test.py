"""forwarded_scan: jax.lax.scan's values and gradients, its matmuls' saved values written as they are made."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from testing.benchmarks.lib import forwarded_scan

L, B, D = 5, 4, 8


def _step(scale):
  def step(c, p):
    w1, w2 = p
    h = jnp.tanh(c @ w1) * scale  # Closes over `scale`: a const of the step.
    a = jax.nn.softmax(h @ h.T)
    return c + (a @ h) @ w2, jnp.sum(h * h, axis=1)

  return step


def _inputs():
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  ws = (jax.random.normal(k[0], (L, D, D)) * 0.3, jax.random.normal(k[1], (L, D, D)) * 0.3)
  return ws, jax.random.normal(k[2], (B, D)), jnp.float32(1.5)


class ForwardedScanTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("saved_by_jax", None, False),
    ("dots_saveable", jax.checkpoint_policies.dots_saveable, False),
    ("saved_by_jax_reads_per_use", None, True),
    ("dots_saveable_reads_per_use", jax.checkpoint_policies.dots_saveable, True),
    ("every_saved_value", None, True, True),
  )
  def test_values_and_gradients_are_jax_lax_scans(self, policy, reads_per_use, every=False):
    def loss(scan, ws, x, scale):
      step = _step(scale)
      if policy is not None:
        step = jax.checkpoint(step, policy=policy)
      c, ys = scan(step, x, ws)
      return jnp.sum(c**2) + jnp.sum(jnp.sin(ys))

    args = _inputs()
    grad = lambda scan: jax.jit(jax.value_and_grad(lambda *a: loss(scan, *a), argnums=(0, 1, 2)))
    forwarded = functools.partial(forwarded_scan.scan, reads_per_use=reads_per_use, every=every)
    want, got = grad(jax.lax.scan)(*args), grad(forwarded)(*args)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5), got, want)

  def test_matmul_outputs_saved_are_written_then_read_back(self):
    # Under dots_saveable the step saves three matmul outputs (h before its
    # tanh, the logits and the attention's output; the last matmul's is not
    # needed): each goes through its stack, one optimization barrier each
    # in the forward loop beside jax.checkpoint's own in the backward one.
    ws, x, scale = _inputs()
    step = jax.checkpoint(_step(scale), policy=jax.checkpoint_policies.dots_saveable)
    barriers = lambda scan: (
      jax.jit(jax.grad(lambda ws, x: jnp.sum(scan(step, x, ws)[0])))
      .lower(ws, x)
      .as_text()
      .count("stablehlo.optimization_barrier")
    )
    self.assertEqual(barriers(forwarded_scan.scan), barriers(jax.lax.scan) + 3)

  def test_every_saved_value_is_written_then_read_back(self):
    # jax's own residuals of the step (no policy): three matmul outputs
    # among them, and the values computed from them (the tanh, the softmax's
    # exp and sums): more go through their stacks with `every`.
    ws, x, scale = _inputs()

    def barriers(every):
      scan = functools.partial(forwarded_scan.scan, every=every)
      loss = lambda ws, x: jnp.sum(scan(_step(scale), x, ws)[0])
      return str(jax.make_jaxpr(jax.grad(loss))(ws, x)).count("optimization_barrier")

    self.assertGreater(barriers(True), barriers(False) + 2)

  def test_reads_per_use_slice_a_saved_value_for_each_reader(self):
    # Six saved values a step under dots_saveable (the carry, the two
    # params, three matmul outputs): the backward loop slices each once, or,
    # with reads_per_use, once per operation reading it, each slice through
    # a barrier of its own: more slices than saved values.
    ws, x, scale = _inputs()
    step = jax.checkpoint(_step(scale), policy=jax.checkpoint_policies.dots_saveable)

    def barriers(reads_per_use):
      scan = functools.partial(forwarded_scan.scan, reads_per_use=reads_per_use)
      loss = lambda ws, x: jnp.sum(scan(step, x, ws)[0])
      return str(jax.make_jaxpr(jax.grad(loss))(ws, x)).count("optimization_barrier")

    self.assertGreater(barriers(True) - barriers(False), 6)

  def test_reverse_and_unroll_are_jax_lax_scan(self):
    ws, x, scale = _inputs()
    for kwargs in (dict(reverse=True), dict(unroll=2)):
      with self.subTest(**kwargs):
        scan = lambda ws, x: forwarded_scan.scan(_step(scale), x, ws, **kwargs)
        self.assertNotIn("optimization_barrier", jax.jit(scan).lower(ws, x).as_text())


if __name__ == "__main__":
  absltest.main()
