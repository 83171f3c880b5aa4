"""Tests for `row_wise`: its verdicts against the functions' values, row block by row block.

Ground truth: a function is row-wise where its value on the whole batch is
its values on each block of rows, put together (`by_blocks`). Every
function `row_dims` accepts is checked so; the ones it refuses compute
something else on a block of rows (shown on values too), or are outside
what it reads (a `jax.custom_vjp`'s backward rule).
"""

from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src.pipeline import row_wise

PARTS = 4
ROWS = 8
X = jax.random.normal(jax.random.PRNGKey(0), [ROWS, 3, 4])
W = jax.random.normal(jax.random.PRNGKey(1), [4, 4])


def shapes(tree, rows):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct((rows,) + a.shape[1:], a.dtype), tree)


def by_blocks(fn, x):
  """`fn` on each of `PARTS` blocks of rows of `x`, its outputs put together on axis 0."""
  parts = [fn(part) for part in jnp.split(x, PARTS)]
  return jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


def linear_block(x):
  h = hk.LayerNorm(-1, True, True)(x)
  return x + hk.Linear(4)(jax.nn.gelu(h))


LINEAR = hk.without_apply_rng(hk.transform(linear_block))
LINEAR_PARAMS = LINEAR.init(jax.random.PRNGKey(2), X)


@jax.custom_vjp
def scaled(x):
  return 2 * x


scaled.defvjp(lambda x: (2 * x, None), lambda _, g: (2 * g,))


ROW_WISE = {
  "dense": lambda x: jnp.tanh(x @ W) + x,
  "relu_softmax": lambda x: jax.nn.softmax(jax.nn.relu(x), -1),
  "attention": lambda x: (
    jax.nn.softmax(jnp.einsum("btd,bsd->bts", x, x) + jnp.tril(jnp.ones((3, 3))), -1) @ x
  ),
  "time_scan": lambda x: lax.scan(
    lambda c, t: (jnp.tanh(c @ W + t), c), jnp.zeros((x.shape[0], 4)), jnp.swapaxes(x, 0, 1)
  )[0],
  "remat": lambda x: jax.checkpoint(lambda y: jnp.sin(y) @ W)(x),
  "reshape_rows_first": lambda x: (x.reshape(-1, 4) @ W).reshape(x.shape),
  "haiku_layer": lambda x: LINEAR.apply(LINEAR_PARAMS, x),
}

MIXING = {
  "batch_mean": lambda x: x - x.mean(0),
  # Reductions over the rows with no literal of the batch size beside them
  # (a mean divides by one, which alone would tell the traces apart).
  "batch_sum": lambda x: x - x.sum(0),
  "batch_max": lambda x: x - x.max(0),
  "argmax_over_rows": lambda x: x + jnp.argmax(x, 0),
  # A loop whose trip count is the batch size, its body elementwise: only
  # the count tells the traces apart (a scan's length, a while's bound).
  "fori_loop_over_rows": lambda x: lax.fori_loop(0, x.shape[0], lambda i, c: c * 0.5, x),
  "while_loop_over_rows": lambda x: lax.while_loop(
    lambda c: c[0] < x.shape[0], lambda c: (c[0] + 1, c[1] * 0.5), (0, x)
  )[1],
  "batch_size": lambda x: x / x.shape[0],
  "row_index": lambda x: x + jnp.arange(x.shape[0])[:, None, None],
  "dropout": lambda x: x * jax.random.bernoulli(jax.random.PRNGKey(0), 0.5, x.shape),
  "scan_over_rows": lambda x: lax.scan(lambda c, r: (c + r, c), x[0], x)[1],
  "first_rows": lambda x: jnp.concatenate([x[:1]] * x.shape[0]),
  "cumsum_rows": lambda x: jnp.cumsum(x, 0),
  "rows_times_rows": lambda x: jnp.einsum("bij,cij->bc", x, x)[:, :, None],
  "reshape_rows_inner": lambda x: (
    jnp.swapaxes(x, 0, 1).reshape(3 * x.shape[0], 4)[: x.shape[0] * 3].reshape(x.shape)
  ),
  "batch_size_in_a_constant": lambda x: x * jnp.asarray(np.full([4], 1 / x.shape[0], np.float32)),
  "op_branch_on_batch_size": lambda x: jnp.sin(x) if len(x) == ROWS else x,
  "op_chosen_by_batch_size": lambda x: (jnp.sin if len(x) == ROWS else jnp.cos)(x),
  "concatenate_rows": lambda x: jnp.concatenate([x, x]),
  "batch_size_plus_one_rows": lambda x: jnp.zeros((len(x) + 1, 3, 4)),
  "flip_chosen_by_batch_size": lambda x: x @ jnp.flip(W, 0 if len(x) == ROWS else 1),
  "dynamic_slice_of_rows": lambda x: x + lax.dynamic_slice_in_dim(x, 0, 1),
  "batch_mean_in_a_cond": lambda x: lax.cond(
    jnp.isfinite(W[0, 0]), lambda y: y - y.mean(0), lambda y: -y, x
  ),
  "batch_mean_in_a_while": lambda x: lax.while_loop(
    lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] - c[1].mean(0)), (0, x)
  )[1],
  "scan_over_rows_from_zeros": lambda x: lax.scan(
    lambda c, r: (c + r, c + r), jnp.zeros(x.shape[1:]), x
  )[1],
}


class RowDimsTest(parameterized.TestCase):
  @parameterized.named_parameters(*ROW_WISE.items())
  def test_row_wise_functions_accepted_and_they_are(self, fn):
    dims = row_wise.row_dims(fn, (shapes(X, ROWS),), (shapes(X, ROWS // PARTS),), PARTS)
    self.assertEqual(dims, 0)
    np.testing.assert_allclose(fn(X), by_blocks(fn, X), rtol=1e-5, atol=1e-5)

  @parameterized.named_parameters(*MIXING.items())
  def test_mixing_functions_refused_and_they_do_mix(self, fn):
    dims = row_wise.row_dims(fn, (shapes(X, ROWS),), (shapes(X, ROWS // PARTS),), PARTS)
    self.assertIsNone(dims)
    whole, blocks = fn(X), by_blocks(fn, X)
    self.assertFalse(whole.shape == blocks.shape and np.allclose(whole, blocks, atol=1e-5))

  def test_custom_vjp_refused(self):
    # Its backward rule is a Python function the jaxpr does not show.
    self.assertIsNone(
      row_wise.row_dims(scaled, (shapes(X, ROWS),), (shapes(X, ROWS // PARTS),), PARTS)
    )

  def test_outputs_without_rows(self):
    # A layer's carry, a y per example and a y that holds no rows (a
    # state-like value of the params alone).
    def layer(x, w):
      return x @ w, (jnp.sum(x, -1), jnp.sum(w))

    dims = row_wise.row_dims(layer, (shapes(X, ROWS), W), (shapes(X, ROWS // PARTS), W), PARTS)
    self.assertEqual(dims, (0, (0, None)))

  def test_a_layer_that_needs_the_mesh_to_trace(self):
    def layer(x):
      return jax.sharding.reshard(x, jax.sharding.PartitionSpec("data"))

    self.assertIsNone(
      row_wise.row_dims(layer, (shapes(X, ROWS),), (shapes(X, ROWS // PARTS),), PARTS)
    )


class ScanCountsTest(absltest.TestCase):
  def test_consts_and_carry_of_a_traced_scan(self):
    # Two closed-over arrays, a carry of three and xs of two, as the scan's
    # inputs are ordered: (consts, carry, xs), in every jax release.
    def f(c, d, carry, xs):
      def body(h, x):
        a, b, n = h
        return (a * c + x[0], b * d, n + 1), a + x[1]

      return lax.scan(body, carry, xs)

    (eqn,) = jax.make_jaxpr(f)(1.0, 2.0, (0.0, 0.0, 0), (jnp.ones(3), jnp.ones(3))).eqns
    self.assertEqual(row_wise.scan_counts(eqn.params), (2, 3))
    self.assertLen(eqn.invars, 2 + 3 + 2)


if __name__ == "__main__":
  absltest.main()
