"""Benchmark 3: the layer scan's remat schedules against `hk.layer_stack` + `hk.remat`.

For each row (a model, a depth, a number of tokens per step), the training
step of each variant: its compiled temporaries
(`memory_analysis().temp_size_in_bytes`, what the schedules exist for) and its
step time, both as ratios to `hk.layer_stack(N)(hk.remat(block))`. The rows:
the residual MLP block of issue 20 (d=256) at depths 16, 64 and 128, with 4096
tokens (activations dominate memory) and 64 (the parameters do), and one
transformer (`testing/transformer.py`).

`layer_scan(remat=True)` compiles to the baseline's program, so its ratios are
the A/A control: the noise floor of the step-time ratios. Beside the
schedules, Haiku's own nesting, `hk.layer_stack(G)(hk.remat(hk.layer_stack(K)(
hk.remat(block))))`, shows what two nested checkpointed scans cost when the
params are stacked `[G, K, ...]` (other shapes) and each group's params and
gradients are sliced out of them.
"""

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp

import haiku_bridge as hkb
from testing import transformer
from testing.benchmarks.lib import harness
from testing.benchmarks.lib import markdown_table
from testing.benchmarks.lib import models

BASELINE = "hk.layer_stack + hk.remat"
CONTROL = "layer_scan(remat=True) (A/A)"
NESTED = 'layer_scan(remat="nested")'
BINOMIAL = 'layer_scan(remat="binomial")'
HAIKU_NESTED = "hk.layer_stack of hk.layer_stack, both hk.remat"
VARIANTS = (BASELINE, CONTROL, NESTED, BINOMIAL, HAIKU_NESTED)
SCAN_REMAT = {CONTROL: True, NESTED: "nested", BINOMIAL: "binomial"}

MLP = "residual MLP"
TRANSFORMER = "transformer"


class Row(NamedTuple):
  model: str  # MLP or TRANSFORMER.
  depth: int
  tokens: int  # Per step: batch (times sequence length, for TRANSFORMER).


class Key(NamedTuple):
  row: Row
  variant: str


@dataclasses.dataclass(frozen=True)
class TransformerSize:
  vocab: int
  d_model: int
  heads: int
  seq: int  # Tokens per sequence; Row.tokens / seq sequences per step.


@dataclasses.dataclass(frozen=True)
class RematConfig:
  """Rows and repetitions; `FULL` fits ~10 minutes on 2 shared cores."""

  mode: str
  rows: tuple[Row, ...]
  mlp_width: int
  transformer: TransformerSize
  warmup: int
  step_repeats: int
  step_block_s: float


FULL = RematConfig(
  mode="full",
  rows=tuple(Row(MLP, depth, tokens) for tokens in (4096, 64) for depth in (16, 64, 128))
  + (Row(TRANSFORMER, 64, 1024),),
  mlp_width=256,
  transformer=TransformerSize(vocab=512, d_model=128, heads=4, seq=128),
  warmup=1,
  step_repeats=5,
  step_block_s=0.5,
)

QUICK = RematConfig(
  mode="quick",
  rows=(Row(MLP, 9, 4), Row(TRANSFORMER, 4, 16)),
  mlp_width=8,
  transformer=TransformerSize(vocab=16, d_model=8, heads=2, seq=4),
  warmup=1,
  step_repeats=2,
  step_block_s=0.001,
)


def nested_shape(depth: int) -> Optional[tuple[int, int]]:
  """`(groups, group size)` for Haiku's own nesting: the divisor pair nearest √depth."""
  size = min(
    (k for k in range(1, depth + 1) if depth % k == 0), key=lambda k: (abs(k - math.sqrt(depth)), k)
  )
  return depth // size, size


def _stack(variant: str, layer: Callable[..., Any], depth: int, name: str) -> Callable[[Any], Any]:
  """`h -> h` through `depth` layers, as `variant` runs them."""
  if variant in SCAN_REMAT:
    return lambda h: hkb.repeat_layer(layer, h, depth, name=name, remat=SCAN_REMAT[variant])
  if variant == BASELINE:
    return hk.layer_stack(depth, name=name)(hk.remat(layer))
  groups, size = nested_shape(depth)
  return hk.layer_stack(groups, name=name)(hk.remat(hk.layer_stack(size)(hk.remat(layer))))


def step_and_inputs(
  row: Row, variant: str, cfg: RematConfig
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """The jitted grad step of `variant` at `row`, and its arguments."""
  key = jax.random.PRNGKey(1)
  if row.model == MLP:
    width = cfg.mlp_width

    def block(x):
      return x + hk.nets.MLP([width, width], name="mlp")(x)

    model = hk.transform(lambda x: _stack(variant, block, row.depth, "blocks")(x))
    x = jax.random.normal(key, [row.tokens, width])
    loss = lambda p, x: jnp.mean(jnp.square(model.apply(p, None, x)))
  else:
    size = cfg.transformer
    layer = functools.partial(transformer.block, d_model=size.d_model, heads=size.heads)

    def net(tokens):
      h = hk.Embed(size.vocab, size.d_model, name="embed")(tokens)
      h = _stack(variant, layer, row.depth, "layers")(h)
      return hk.Linear(size.vocab, name="unembed")(h)

    model = hk.transform(net)
    x = jax.random.randint(key, [row.tokens // size.seq, size.seq], 0, size.vocab)
    loss = lambda p, t: (
      -jnp.mean(jax.nn.log_softmax(model.apply(p, None, t)) * jax.nn.one_hot(t, size.vocab))
    )
  params = jax.jit(model.init)(models.KEY, x)
  return jax.jit(jax.grad(loss)), (params, x)


@dataclasses.dataclass
class RematResult:
  cfg: RematConfig
  temp_bytes: dict[Key, Optional[int]]  # None: no memory_analysis.
  step: harness.Samples  # By Key; phases "step" and "step cpu".


def bench_remat(cfg: RematConfig) -> RematResult:
  keys = [Key(row, v) for row in cfg.rows for v in VARIANTS]
  compiled, args, temp_bytes = harness.compile_steps(
    "remat schedules: compiling steps", keys, lambda k: step_and_inputs(k.row, k.variant, cfg)
  )
  step = harness.interleaved(
    "remat schedules: step times",
    [
      {k: harness.step_timer(compiled[k], args[k], cfg.step_block_s) for k in keys if k.row == row}
      for row in cfg.rows
    ],
    cfg.step_repeats,
    cfg.warmup,
  )
  return RematResult(cfg, temp_bytes, step)


# What issue 20 asks of "nested" (and so of "binomial"), by row.
TARGETS = {
  Row(MLP, 64, 4096): {"temp": 0.40, "step": 1.35},
  Row(MLP, 64, 64): {"temp": 1.0},
}


def _mib(n: Optional[int]) -> str:
  return "n/a" if n is None else f"{n / 2**20:.1f}"


def temp_ratio(result: RematResult, row: Row, variant: str) -> Optional[float]:
  """`variant`'s temporaries over the baseline's; None without memory_analysis."""
  ours, theirs = (result.temp_bytes[Key(row, variant)], result.temp_bytes[Key(row, BASELINE)])
  return None if ours is None or not theirs else ours / theirs


def _ratio(value: Optional[float]) -> str:
  return "n/a" if value is None else f"{value:.3f}"


def markdown(result: RematResult) -> str:
  """The tables: temporaries, step-time ratios (wall and CPU), targets."""
  rows = result.cfg.rows
  ratios = lambda phase: {
    (row, v): harness.pair_ratios(result.step, Key(row, v), Key(row, BASELINE), phase)
    for row in rows
    for v in VARIANTS[1:]
  }
  wall, cpu = ratios("step"), ratios("step" + harness.CPU)
  head = ["model", "depth", "tokens"]
  cells = lambda row: [row.model, row.depth, row.tokens]
  lines = ["### Grad-step temporaries", ""]
  lines += markdown_table.lines(
    head + [f"{BASELINE} (MiB)"] + [f"{v} / baseline" for v in VARIANTS[1:]],
    [
      cells(row)
      + [_mib(result.temp_bytes[Key(row, BASELINE)])]
      + [_ratio(temp_ratio(result, row, v)) for v in VARIANTS[1:]]
      for row in rows
    ],
  )
  lines += [
    "",
    "### Step time / baseline: wall clock median [min–max] (process CPU time median)",
    "",
  ]
  lines += markdown_table.lines(
    head + [f"{BASELINE} (ms)"] + list(VARIANTS[1:]),
    [
      cells(row)
      + [harness.Stat.of(result.step[Key(row, BASELINE)]["step"]).ms(1)]
      + [f"{wall[row, v].ratio()} ({cpu[row, v].median:.3f})" for v in VARIANTS[1:]]
      for row in rows
    ],
  )
  lines += ["", "### Targets (issue 20), for both schedules", ""]
  targets = []
  for row, goals in TARGETS.items():
    if row not in rows:
      continue
    for variant in (NESTED, BINOMIAL):
      for measure, goal in goals.items():
        value = temp_ratio(result, row, variant) if measure == "temp" else wall[row, variant].median
        met = "n/a" if value is None else ("yes" if value <= goal else "no")
        targets.append(
          [
            ", ".join(map(str, cells(row))),
            variant,
            f"{measure} ratio",
            f"≤ {goal:.2f}",
            _ratio(value),
            met,
          ]
        )
  lines += markdown_table.lines(["row", "variant", "measure", "goal", "measured", "met"], targets)
  return "\n".join(lines) + "\n"
