"""Benchmark 1: `call_pure` against the same MLP inline in Haiku and `hk.lift`.

Python trace time of `init` and of `apply` (four rows: `trace_rows`), compile
time and jitted step time (forward + backward), at each model size, with an
A/A control (a second inline model) timed beside the rest.
"""

import dataclasses
import functools
import itertools
import tempfile
from typing import Any, Callable, Iterator, NamedTuple

import jax
import numpy as np

from testing.benchmarks.lib import fresh_process
from testing.benchmarks.lib import harness
from testing.benchmarks.lib import models
from testing.benchmarks.lib import trace_rows
from testing.benchmarks.lib.config import Config

INIT = "init"  # Trace of `init`, next to the APPLY_ROWS of `apply`.
EVAL_SHAPE = "eval_shape(init) alone"  # What the bridge may run at apply.
# The same, the first in a new process (beside the FRESH_PROCESS row).
EVAL_SHAPE_FRESH = "eval_shape(init) alone, fresh process"
TIMED_VARIANTS = models.MLP_VARIANTS + (models.INLINE_COPY,)


class TraceKey(NamedTuple):
  variant: str  # One of TIMED_VARIANTS.
  row: str  # INIT, EVAL_SHAPE or one of trace_rows.APPLY_ROWS.


@dataclasses.dataclass
class MlpResult:
  """Everything measured for one model size."""

  size: models.MlpSize
  # By TraceKey; phase "trace", and for FRESH_PROCESS also "lower".
  trace: harness.Samples
  compile: harness.Samples  # By variant; phase "compile".
  step: harness.Samples  # By variant (and INLINE_COPY); phase "step".


def _retrace(apply: Callable[..., Any], params: Any, x: jax.Array) -> harness.Phases:
  """A timed trace of `apply` right after an untimed one at the same inputs.

  A re-trace follows a trace of the same model at the same shapes, so it
  finds the bridge's caches as that trace left them. Interleaved with the
  new-model rows, which clear those caches, the timed trace alone would
  have been a cold one (until 2026-12-01 the pure-function row was: every
  sample computed `eval_shape(init)`).
  """
  jax.jit(lambda *args: apply(*args)).trace(params, None, x)
  return harness.trace_time(apply, params, None, x)


def _new_model_trace(
  size: models.MlpSize, variant: str, params: Any, x: jax.Array
) -> harness.Phases:
  models.clear_caches()
  return harness.trace_time(models.mlp_model(size, variant).apply, params, None, x)


def _new_shape_trace(
  apply: Callable[..., Any], params: Any, width: int, batches: Iterator[int]
) -> harness.Phases:
  # A NumPy input: a jnp array of a new shape would run (and compile) an op
  # inside the timed region, charged to whichever variant meets it first.
  return harness.trace_time(apply, params, None, np.zeros([next(batches), width], np.float32))


def _in_process_traces(size: models.MlpSize, cfg: Config, x: jax.Array) -> harness.Samples:
  """INIT, EVAL_SHAPE and the in-process APPLY_ROWS, side by side."""
  # The A/A copy is a separately built inline model.
  transformed = {v: models.mlp_model(size, v) for v in TIMED_VARIANTS}
  params = {v: f.init(models.KEY, x) for v, f in transformed.items()}
  group: dict[TraceKey, harness.Measurement] = {}
  for v in models.MLP_VARIANTS:
    group[TraceKey(v, INIT)] = functools.partial(
      harness.trace_time, transformed[v].init, models.KEY, x
    )
  for i, (v, f) in enumerate(transformed.items()):
    group[TraceKey(v, trace_rows.RETRACE)] = functools.partial(_retrace, f.apply, params[v], x)
    # Batch sizes no variant has met: JAX caches keyed on shapes would
    # otherwise charge a shared new shape to whichever variant ran first.
    group[TraceKey(v, trace_rows.NEW_SHAPE)] = functools.partial(
      _new_shape_trace,
      f.apply,
      params[v],
      size.width,
      itertools.count(size.batch + 1 + i, len(transformed)),
    )
    group[TraceKey(v, trace_rows.NEW_MODEL)] = functools.partial(
      _new_model_trace, size, v, params[v], x
    )
  fresh = models.mlp_models(size)
  for v, init in (
    (models.BRIDGED_TRANSFORMED, fresh.inner_init),
    (models.BRIDGED_PURE, fresh.pure_init),
  ):
    group[TraceKey(v, EVAL_SHAPE)] = functools.partial(harness.eval_shape_time, init, models.KEY, x)
  return harness.interleaved(f"trace times ({size.name})", [group], cfg.trace_repeats, cfg.warmup)


def _fresh_process_traces(size: models.MlpSize, cfg: Config, x: jax.Array) -> harness.Samples:
  params = {v: models.mlp_model(size, v).init(models.KEY, x) for v in TIMED_VARIANTS}
  with tempfile.TemporaryDirectory() as directory:
    paths = fresh_process.write_params(size, params, directory)
    children = {
      TraceKey(v, trace_rows.FRESH_PROCESS): dict(variant=v, params_path=path)
      for v, path in paths.items()
    }
    children[TraceKey(models.BRIDGED_PURE, EVAL_SHAPE_FRESH)] = dict(
      variant=models.BRIDGED_PURE, params_path=paths[models.BRIDGED_PURE], eval_shape_init=True
    )
    # No warm-up: each sample is a new process, and the rotation spreads
    # whatever the first one pays (disk cache) over the variants.
    return fresh_process.samples(size, children, cfg.fresh_process_repeats, warmup=0)


def example_input(size: models.MlpSize) -> jax.Array:
  return jax.random.normal(jax.random.PRNGKey(1), [size.batch, size.width])


def bench_mlp(size: models.MlpSize, cfg: Config) -> MlpResult:
  x = example_input(size)
  trace = _in_process_traces(size, cfg, x)
  trace.update(_fresh_process_traces(size, cfg, x))

  transformed = {v: models.mlp_model(size, v) for v in TIMED_VARIANTS}
  params = {v: f.init(models.KEY, x) for v, f in transformed.items()}
  steps = {v: models.grad_step(f) for v, f in transformed.items()}
  compile_samples = harness.interleaved(
    f"compile times ({size.name})",
    [
      {
        v: harness.only_phases(
          functools.partial(harness.trace_and_compile_time, steps[v], params[v], x), "compile"
        )
        for v in models.MLP_VARIANTS
      }
    ],
    cfg.compile_repeats,
    cfg.compile_warmup,
  )

  compiled = {v: jax.jit(steps[v]).lower(params[v], x).compile() for v in TIMED_VARIANTS}
  step = harness.interleaved(
    f"step times ({size.name})",
    [
      {v: harness.step_timer(compiled[v], (params[v], x), cfg.step_block_s) for v in TIMED_VARIANTS}
    ],
    cfg.step_repeats,
    cfg.warmup,
  )
  return MlpResult(size=size, trace=trace, compile=compile_samples, step=step)
