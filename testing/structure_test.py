"""The structural facts behind the benchmark's timings (load cannot move them).

A bridged model compiles to inline Haiku's program, and the layer scan to
`hk.layer_stack`'s, so their step times can differ only by noise; the layer
scan's jaxpr does not grow with depth, so neither does its trace time; the
layer scan's remat schedules ("nested", "binomial") need a fraction of the
temporaries of `hk.layer_stack` + `hk.remat`, and never more. Each
fact is checked warm (right after `init`, caches filled) and, for the bridge,
cold (new model objects after `hkb.clear_caches()`, where the library has it).
Ground truth is inline Haiku and `hk.layer_stack`, compiled in the same test.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp

from testing import test_utils
from testing.benchmarks.lib import models

SIZE = models.MlpSize("test", width=32, depth=3, batch=8)
STACK_WIDTH, STACK_BATCH = 16, 4


def _mlp(variant: str, cold: bool):
  """A model, its params and an input; `cold`: new objects, caches cleared."""
  x = jax.random.normal(jax.random.PRNGKey(1), [SIZE.batch, SIZE.width])
  model = models.mlp_model(SIZE, variant)
  params = model.init(models.KEY, x)
  if cold:
    models.clear_caches()
    model = models.mlp_model(SIZE, variant)
  return model, params, x


def _compiled_step(model, params, x) -> jax.stages.Compiled:
  return jax.jit(models.grad_step(model)).lower(params, x).compile()


COLD_AND_WARM = [dict(variant=v, cold=cold) for v in models.BRIDGED for cold in (False, True)]


class BridgedMlpTest(parameterized.TestCase):
  @parameterized.parameters(COLD_AND_WARM)
  def test_step_optimised_hlo_equals_inline(self, variant, cold):
    inline = _compiled_step(*_mlp(models.INLINE, cold=False))
    bridged = _compiled_step(*_mlp(variant, cold))
    self.assertEqual(test_utils.canonical_hlo(bridged), test_utils.canonical_hlo(inline))

  @parameterized.parameters(COLD_AND_WARM)
  def test_apply_and_step_primitive_counts_equal_inline(self, variant, cold):
    inline_model, inline_params, x = _mlp(models.INLINE, cold=False)
    model, params, _ = _mlp(variant, cold)
    for fn in (models.apply_without_rng, models.grad_step):
      self.assertEqual(
        test_utils.primitive_counts(fn(model), params, x),
        test_utils.primitive_counts(fn(inline_model), inline_params, x),
        fn.__name__,
      )


def _stack(variant: str, depth: int, remat: bool):
  x = jax.random.normal(jax.random.PRNGKey(1), [STACK_BATCH, STACK_WIDTH])
  model = models.stack_model(variant, depth, remat, STACK_WIDTH)
  return models.grad_step(model), model.init(models.KEY, x), x


class LayerScanTest(parameterized.TestCase):
  @parameterized.parameters(False, True)
  def test_step_equation_count_is_independent_of_depth(self, remat):
    counts = {}
    for depth in (1, 4, 16):
      step, params, x = _stack(models.SCAN, depth, remat)
      counts[depth] = sum(test_utils.primitive_counts(step, params, x).values())
    self.assertLen(set(counts.values()), 1, counts)

  @parameterized.parameters(False, True)
  def test_step_optimised_hlo_equals_layer_stack(self, remat):
    step, params, x = _stack(models.SCAN, 4, remat)
    ours = jax.jit(step).lower(params, x).compile()
    step, params, x = _stack(models.LAYER_STACK, 4, remat)
    theirs = jax.jit(step).lower(params, x).compile()
    self.assertEqual(test_utils.canonical_hlo(ours), test_utils.canonical_hlo(theirs))

  def test_remat_temp_memory_at_most_layer_stack(self):
    temp = {}
    for variant in (models.SCAN, models.LAYER_STACK):
      step, params, x = _stack(variant, 8, remat=True)
      analysis = jax.jit(step).lower(params, x).compile().memory_analysis()
      if analysis is None:
        self.skipTest("no memory_analysis on this backend")
      temp[variant] = analysis.temp_size_in_bytes
    self.assertLessEqual(temp[models.SCAN], temp[models.LAYER_STACK])


def _temp_bytes(variant: str, remat, depth: int, tokens: int, width: int) -> int:
  """Compiled temporaries of the stack's grad step (no run: shapes only)."""
  model = models.stack_model(variant, depth, remat, width)
  x = jax.ShapeDtypeStruct((tokens, width), jnp.float32)
  params = jax.eval_shape(model.init, models.KEY, x)
  analysis = jax.jit(models.grad_step(model)).lower(params, x).compile().memory_analysis()
  if analysis is None:
    raise absltest.SkipTest("no memory_analysis on this backend")
  return analysis.temp_size_in_bytes


class RematScheduleMemoryTest(parameterized.TestCase):
  """The memory the schedules exist for, at the benchmark's depth 64.

  Width 64 instead of the benchmark's 256 (less to compile); the relation is
  the same at both (0.31× at width 256 with 4096 tokens, `RESULTS.md`).
  """

  WIDTH = 64

  def _ratio(self, remat, depth, tokens):
    ours = _temp_bytes(models.SCAN, remat, depth, tokens, self.WIDTH)
    theirs = _temp_bytes(models.LAYER_STACK, True, depth, tokens, self.WIDTH)
    return ours / theirs

  @parameterized.parameters("nested", "binomial")
  def test_activations_dominate(self, remat):
    # 4096 tokens: ≈2√64 carries instead of 64. Measured 0.305× ("nested")
    # and 0.232× ("binomial") on jax 0.10.2 and 0.12.1, at width 64 as at the
    # benchmark's 256; a step that keeps more carries (0.438× was reported
    # for "nested" in issue 61) fails here.
    self.assertLessEqual(self._ratio(remat, 64, 4096), 0.39)

  @parameterized.parameters("nested", "binomial")
  def test_parameters_dominate(self, remat):
    # 64 tokens: no copy of the stacked params or of their gradients.
    self.assertLessEqual(self._ratio(remat, 64, 64), 1.0)

  def test_binomial_keeps_fewer_carries_than_nested_at_depth_128(self):
    self.assertLess(self._ratio("binomial", 128, 4096), self._ratio("nested", 128, 4096))


if __name__ == "__main__":
  absltest.main()
