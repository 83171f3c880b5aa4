"""The structural facts behind the benchmark's timings (load cannot move them).

A bridged model compiles to inline Haiku's program, and the layer scan to
`hk.layer_stack`'s, so their step times can differ only by noise; the layer
scan's jaxpr does not grow with depth, so neither does its trace time. Each
fact is checked warm (right after `init`, caches filled) and, for the bridge,
cold (new model objects after `hkb.clear_caches()`, where the library has it).
Ground truth is inline Haiku and `hk.layer_stack`, compiled in the same test.
"""


from absl.testing import absltest
from absl.testing import parameterized
import jax

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


COLD_AND_WARM = [dict(variant=v, cold=cold)
                 for v in models.BRIDGED for cold in (False, True)]


class BridgedMlpTest(parameterized.TestCase):

  @parameterized.parameters(COLD_AND_WARM)
  def test_step_optimised_hlo_equals_inline(self, variant, cold):
    inline = _compiled_step(*_mlp(models.INLINE, cold=False))
    bridged = _compiled_step(*_mlp(variant, cold))
    self.assertEqual(test_utils.canonical_hlo(bridged),
                     test_utils.canonical_hlo(inline))

  @parameterized.parameters(COLD_AND_WARM)
  def test_apply_and_step_primitive_counts_equal_inline(self, variant, cold):
    inline_model, inline_params, x = _mlp(models.INLINE, cold=False)
    model, params, _ = _mlp(variant, cold)
    for fn in (models.apply_without_rng, models.grad_step):
      self.assertEqual(
          test_utils.primitive_counts(fn(model), params, x),
          test_utils.primitive_counts(fn(inline_model), inline_params, x),
          fn.__name__)


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
      counts[depth] = sum(test_utils.primitive_counts(step, params, x)
                          .values())
    self.assertLen(set(counts.values()), 1, counts)

  @parameterized.parameters(False, True)
  def test_step_optimised_hlo_equals_layer_stack(self, remat):
    step, params, x = _stack(models.SCAN, 4, remat)
    ours = jax.jit(step).lower(params, x).compile()
    step, params, x = _stack(models.LAYER_STACK, 4, remat)
    theirs = jax.jit(step).lower(params, x).compile()
    self.assertEqual(test_utils.canonical_hlo(ours),
                     test_utils.canonical_hlo(theirs))

  def test_remat_temp_memory_at_most_layer_stack(self):
    temp = {}
    for variant in (models.SCAN, models.LAYER_STACK):
      step, params, x = _stack(variant, 8, remat=True)
      analysis = jax.jit(step).lower(params, x).compile().memory_analysis()
      if analysis is None:
        self.skipTest("no memory_analysis on this backend")
      temp[variant] = analysis.temp_size_in_bytes
    self.assertLessEqual(temp[models.SCAN], temp[models.LAYER_STACK])


if __name__ == "__main__":
  absltest.main()
