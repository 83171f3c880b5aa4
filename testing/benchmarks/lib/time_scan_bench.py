"""Benchmark 4: the time scan's remat schedules against `hk.dynamic_unroll` (+ `hk.remat`).

The training step of a character LSTM (embedding, `hk.LSTM`, a softmax head;
each step's loss computed inside the step, so that what a step keeps is its
carry, not a `[T, B, vocab]` output), unrolled over T steps. For each T and
each variant: the compiled temporaries of the grad step
(`memory_analysis().temp_size_in_bytes`) and its step time, as ratios to
`hk.dynamic_unroll(hk.remat(core))`, which keeps one carry per step.

`hkb.dynamic_unroll(remat=True)` compiles to the baseline's program: its
step-time ratio is the A/A control, the noise floor. The floor of the
schedules' memory is their carries (`slots` of the schedule, each one
`(h, c)` of the LSTM) plus one step's activations; the table gives the
carries' part.
"""

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp

import haiku_bridge as hkb
from haiku_bridge._src import loop
from testing.benchmarks.lib import harness

PLAIN = "hk.dynamic_unroll"
BASELINE = "hk.dynamic_unroll + hk.remat"
CONTROL = "hkb.dynamic_unroll(remat=True) (A/A)"
NESTED = 'hkb.dynamic_unroll(remat="nested")'
BINOMIAL = 'hkb.dynamic_unroll(remat="binomial")'
VARIANTS = (BASELINE, PLAIN, CONTROL, NESTED, BINOMIAL)
SCHEDULES = {NESTED: "nested", BINOMIAL: "binomial"}
_REMAT = {CONTROL: True, **SCHEDULES}


@dataclasses.dataclass(frozen=True)
class TimeScanConfig:
  """Lengths, model size and repetitions; `FULL` fits ~10 minutes on 2 shared cores."""
  mode: str
  lengths: tuple[int, ...]
  hidden: int
  batch: int
  vocab: int
  warmup: int
  step_repeats: int
  step_block_s: float


FULL = TimeScanConfig(mode="full", lengths=(256, 1024, 4096), hidden=256,
                      batch=32, vocab=64, warmup=1, step_repeats=5,
                      step_block_s=1.0)

QUICK = TimeScanConfig(mode="quick", lengths=(8, 32), hidden=8, batch=2,
                       vocab=8, warmup=1, step_repeats=2, step_block_s=0.001)


class Key(NamedTuple):
  length: int
  variant: str


class CharCore(hk.RNNCore):
  """One character: embed it, step the LSTM, the loss of predicting the next."""

  def __init__(self, hidden: int, vocab: int):
    super().__init__(name="char_core")
    self.vocab = vocab
    self.embed = hk.Embed(vocab, hidden, name="embed")
    self.lstm = hk.LSTM(hidden, name="lstm")
    self.head = hk.Linear(vocab, name="head")

  def __call__(self, inputs, state):
    chars, targets = inputs
    h, state = self.lstm(self.embed(chars), state)
    log_p = jax.nn.log_softmax(self.head(h))
    loss = -jnp.sum(log_p * jax.nn.one_hot(targets, self.vocab), axis=-1)
    return loss, state

  def initial_state(self, batch_size: Optional[int]):
    return self.lstm.initial_state(batch_size)


def model(variant: str, cfg: TimeScanConfig) -> hk.Transformed:
  """The mean loss over `[T, B]` characters, unrolled as `variant` does."""
  def loss(chars, targets):
    core = CharCore(cfg.hidden, cfg.vocab)
    state = core.initial_state(cfg.batch)
    if variant == PLAIN:
      losses, _ = hk.dynamic_unroll(core, (chars, targets), state)
    elif variant == BASELINE:
      losses, _ = hk.dynamic_unroll(hk.remat(core), (chars, targets), state)
    else:
      losses, _ = hkb.dynamic_unroll(core, (chars, targets), state,
                                     remat=_REMAT[variant])
    return jnp.mean(losses)
  return hk.transform(loss)


def step_and_inputs(length: int, variant: str, cfg: TimeScanConfig
                    ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """The jitted grad step of `variant` for `length` steps, and its arguments."""
  chars = jax.random.randint(jax.random.PRNGKey(1), [length + 1, cfg.batch],
                             0, cfg.vocab)
  inputs = (chars[:-1], chars[1:])
  net = model(variant, cfg)
  params = jax.jit(net.init)(jax.random.PRNGKey(0), *inputs)
  return (jax.jit(jax.grad(lambda p, x, y: net.apply(p, None, x, y))),
          (params,) + inputs)


def carry_bytes(cfg: TimeScanConfig) -> int:
  """Bytes of one carry: the LSTM's `(h, c)`, float32."""
  return 2 * cfg.batch * cfg.hidden * 4


def slots(variant: str, length: int) -> int:
  """Carries the backward pass keeps: one per step, or the schedule's slots."""
  if variant in SCHEDULES:
    return loop.schedule(SCHEDULES[variant], length, None).num_slots
  return length


@dataclasses.dataclass
class TimeScanResult:
  cfg: TimeScanConfig
  temp_bytes: dict[Key, Optional[int]]  # None: no memory_analysis.
  step: harness.Samples  # By Key; phases "step" and "step cpu".


def bench_time_scan(cfg: TimeScanConfig) -> TimeScanResult:
  keys = [Key(length, v) for length in cfg.lengths for v in VARIANTS]
  compiled, args, temp_bytes = harness.compile_steps(
      "time scan: compiling steps", keys,
      lambda k: step_and_inputs(k.length, k.variant, cfg))
  step = harness.interleaved(
      "time scan: step times",
      [{k: harness.step_timer(compiled[k], args[k], cfg.step_block_s)
        for k in keys if k.length == length} for length in cfg.lengths],
      cfg.step_repeats, cfg.warmup)
  return TimeScanResult(cfg, temp_bytes, step)


# Issue 30's targets, at T = 1024, for both schedules.
TARGET_LENGTH = 1024
TARGETS = {"temp": 0.25, "step": 1.5}


def _mib(n: Optional[float]) -> str:
  if n is None:
    return "n/a"
  mib = n / 2**20
  return f"{mib:.0f}" if mib >= 100 else f"{mib:.3g}"


def temp_ratio(result: TimeScanResult, length: int,
               variant: str) -> Optional[float]:
  """`variant`'s temporaries over the baseline's; None without memory_analysis."""
  ours = result.temp_bytes[Key(length, variant)]
  theirs = result.temp_bytes[Key(length, BASELINE)]
  return None if ours is None or not theirs else ours / theirs


def _ratio(value: Optional[float]) -> str:
  return "n/a" if value is None else f"{value:.3f}"


def markdown(result: TimeScanResult) -> str:
  """The tables: temporaries, their growth, step-time ratios, targets."""
  cfg, lengths = result.cfg, result.cfg.lengths
  others = VARIANTS[1:]
  lines = [f"Model: character LSTM, hidden {cfg.hidden}, batch {cfg.batch}, "
           f"vocabulary {cfg.vocab}; one carry is "
           f"{carry_bytes(cfg) / 2**10:.3g} KiB.", "",
           "### Grad-step temporaries (MiB), and / baseline", "",
           "| T | " + " | ".join(VARIANTS) + " |",
           "|" + " --- |" * (1 + len(VARIANTS))]
  for length in lengths:
    cells = [_mib(result.temp_bytes[Key(length, BASELINE)])]
    for v in others:
      cells.append(f"{_mib(result.temp_bytes[Key(length, v)])} "
                   f"({_ratio(temp_ratio(result, length, v))})")
    lines.append(f"| {length} | " + " | ".join(cells) + " |")
  kept = (BASELINE, NESTED, BINOMIAL)
  lines += ["", "### Carries kept for the backward pass, and their MiB "
            "(the part of the floor that grows with T)", "",
            "| T | " + " | ".join(kept) + " |",
            "|" + " --- |" * (1 + len(kept))]
  for length in lengths:
    lines.append(f"| {length} | " + " | ".join(
        f"{slots(v, length)} ({_mib(slots(v, length) * carry_bytes(cfg))})"
        for v in kept) + " |")
  if len(lengths) > 1:
    first, last = lengths[0], lengths[-1]
    lines += ["", f"### Growth of the temporaries from T = {first} to T = "
              f"{last} (T × {last // first})", "",
              "| " + " | ".join(VARIANTS) + " |",
              "|" + " --- |" * len(VARIANTS)]
    growth = []
    for v in VARIANTS:
      a, b = result.temp_bytes[Key(first, v)], result.temp_bytes[Key(last, v)]
      growth.append("n/a" if not a or b is None else f"× {b / a:.1f}")
    lines.append("| " + " | ".join(growth) + " |")
  wall = {(length, v): harness.pair_ratios(result.step, Key(length, v),
                                           Key(length, BASELINE), "step")
          for length in lengths for v in others}
  cpu = {(length, v): harness.pair_ratios(
      result.step, Key(length, v), Key(length, BASELINE),
      "step" + harness.CPU) for length in lengths for v in others}
  lines += ["", "### Step time / baseline: wall clock median [min–max] "
            "(process CPU time median)", "",
            f"| T | {BASELINE} (ms) | " + " | ".join(others) + " |",
            "|" + " --- |" * (2 + len(others))]
  for length in lengths:
    base = harness.Stat.of(result.step[Key(length, BASELINE)]["step"])
    lines.append(f"| {length} | {base.ms(1)} | " + " | ".join(
        f"{wall[length, v].ratio()} ({cpu[length, v].median:.3f})"
        for v in others) + " |")
  if TARGET_LENGTH in lengths:
    lines += ["", f"### Targets (issue 30), at T = {TARGET_LENGTH}", "",
              "| variant | measure | goal | measured | met |",
              "| --- | --- | --- | --- | --- |"]
    for variant in SCHEDULES:
      for measure, goal in TARGETS.items():
        value = (temp_ratio(result, TARGET_LENGTH, variant)
                 if measure == "temp" else wall[TARGET_LENGTH, variant].median)
        met = "n/a" if value is None else ("yes" if value <= goal else "no")
        lines.append(f"| {variant} | {measure} ratio | ≤ {goal:.2f} | "
                     f"{_ratio(value)} | {met} |")
  return "\n".join(lines) + "\n"


# Hollow, larger markers under smaller ones: the A/A control's line lies on
# the baseline's, and "binomial"'s on "nested"'s where they keep as many
# carries; both of each pair stay visible.
_STYLES = {
    BASELINE: dict(color="tab:orange", marker="s", markersize=10,
                   markerfacecolor="none"),
    CONTROL: dict(color="tab:red", marker="x", markersize=6, linestyle="--"),
    PLAIN: dict(color="tab:gray", marker="^", markersize=6),
    NESTED: dict(color="tab:blue", marker="o", markersize=10,
                 markerfacecolor="none"),
    BINOMIAL: dict(color="tab:green", marker="o", markersize=4,
                   linestyle="--"),
}


def write_plot(result: TimeScanResult, path: str) -> bool:
  """Temporaries against T, log-log, one line per variant; False without matplotlib."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(7, 4.5))
  lengths = list(result.cfg.lengths)
  for variant in VARIANTS:
    values = [result.temp_bytes[Key(length, variant)] for length in lengths]
    if any(v is None for v in values):
      continue
    ax.plot(lengths, [v / 2**20 for v in values], label=variant,
            **_STYLES[variant])
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("T (time steps)")
  ax.set_ylabel("grad-step temporaries (MiB)")
  ax.set_title(f"Character LSTM (hidden {result.cfg.hidden}, batch "
               f"{result.cfg.batch}): memory against T")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True
