"""Benchmark 2: the layer scan against `hk.layer_stack` and an unrolled loop.

On the training step of a residual MLP stack, depth by depth, with and without
remat: trace + compile time, step time and compiled temporary memory, with an
A/A control (a second `hk.layer_stack` model) beside the step times.
"""

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax

from testing.benchmarks.lib import harness
from testing.benchmarks.lib import models
from testing.benchmarks.lib.config import Config


class StackKey(NamedTuple):
  depth: int
  remat: bool
  variant: str  # One of models.STACK_VARIANTS, or LAYER_STACK_COPY.


@dataclasses.dataclass
class StackResult:
  compile: harness.Samples  # By StackKey; phases "trace", "compile", "total".
  step: harness.Samples  # By StackKey; phase "step".
  temp_bytes: dict[StackKey, Optional[int]]  # None: no memory_analysis.


def temp_bytes(compiled: jax.stages.Compiled) -> Optional[int]:
  analysis = compiled.memory_analysis()
  return None if analysis is None else analysis.temp_size_in_bytes


def bench_stack(cfg: Config) -> StackResult:
  x = jax.random.normal(jax.random.PRNGKey(1), [cfg.stack_batch, cfg.stack_width])
  settings = [(d, r) for d in cfg.depths for r in (False, True)]
  keys = [
    StackKey(d, r, v)
    for d, r in settings
    for v in models.STACK_VARIANTS + (models.LAYER_STACK_COPY,)
  ]
  steps, params = {}, {}
  for k in harness.with_progress("layer stacks: building models", keys):
    variant = models.LAYER_STACK if k.variant == models.LAYER_STACK_COPY else k.variant
    model = models.stack_model(variant, k.depth, k.remat, cfg.stack_width)
    steps[k] = models.grad_step(model)
    params[k] = model.init(models.KEY, x)

  compile_samples = harness.interleaved(
    "layer stacks: trace + compile times",
    [
      {
        StackKey(d, r, v): functools.partial(
          harness.trace_and_compile_time, steps[StackKey(d, r, v)], params[StackKey(d, r, v)], x
        )
        for v in models.STACK_VARIANTS
      }
      for d, r in settings
    ],
    cfg.compile_repeats,
    cfg.compile_warmup,
  )

  compiled = {
    k: jax.jit(steps[k]).lower(params[k], x).compile()
    for k in harness.with_progress("layer stacks: compiling steps", keys)
  }
  step = harness.interleaved(
    "layer stacks: step times",
    [
      {
        k: harness.step_timer(compiled[k], (params[k], x), cfg.step_block_s)
        for k in keys
        if (k.depth, k.remat) == setting
      }
      for setting in settings
    ],
    cfg.step_repeats,
    cfg.warmup,
  )
  return StackResult(
    compile=compile_samples, step=step, temp_bytes={k: temp_bytes(c) for k, c in compiled.items()}
  )
