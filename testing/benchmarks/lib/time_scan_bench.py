"""Benchmark 4: the time scan's remat schedules beside Haiku's, Equinox's and the two-level recipe.

The training step of a character language model (`hk.Embed`, `hk.LSTM`, a
softmax head over the vocabulary), unrolled over T steps, written three ways
(`FORMS`):

* "loss after the unroll" (the usual way): `ys, _ = unroll(lstm, embed(chars),
  state)`, then `hk.BatchApply(hk.Linear(V))(ys)` and the cross-entropy. The
  backward pass must keep the `[T, B, H]` outputs, their cotangent and the
  head's `[T, B, V]` softmax, whatever the schedule: that is this form's floor.
* "loss in the step": the embedding, head and loss inside the core, so that a
  step hands on only its carry.
* `readout=`: the usual model converted by a few lines
  (`hkb.dynamic_unroll(lambda c, s: lstm(embed(c), s), chars, state,
  readout=..., readout_inputs=targets)`): the head and loss run in the
  checkpointed step; its ratio is to the usual form's per-step remat.

For each T, form and variant: the compiled temporaries of the grad step
(`memory_analysis().temp_size_in_bytes`), lower + compile time and step time,
as ratios to `hk.dynamic_unroll(hk.remat(core))` of the same form (one carry
per step). `hkb.dynamic_unroll(remat=True)` compiles to the baseline's
program: its step-time ratio is the A/A control, the noise floor. Beside
ours: Equinox's checkpointed scan (`equinox.internal.scan(...,
kind="checkpointed")`, online treeverse, its default ≈√(2T) checkpoints) and
the two-level `jax.checkpoint` recipe (a scan over ≈√T groups, each a
checkpointed scan of its steps) and Flax's `nn.remat_scan` (the same two
levels; the loss in the step only), all of the same pure step.
"""

import dataclasses
import math
import time
from typing import Any, Callable, NamedTuple, Optional

import equinox.internal as eqxi
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp

import haiku_bridge as hkb
from haiku_bridge._src.remat import loop
from testing.benchmarks.lib import harness
from testing.benchmarks.lib import markdown_table
from testing.benchmarks.lib import svg

PLAIN = "hk.dynamic_unroll"
BASELINE = "hk.dynamic_unroll + hk.remat"
CONTROL = "hkb.dynamic_unroll(remat=True) (A/A)"
NESTED = 'hkb.dynamic_unroll(remat="nested")'
BINOMIAL = 'hkb.dynamic_unroll(remat="binomial")'
EQUINOX = 'equinox.internal.scan(kind="checkpointed")'
TWO_LEVEL = "two-level jax.checkpoint"
FLAX = "flax.linen.remat_scan"
VARIANTS = (BASELINE, PLAIN, CONTROL, NESTED, BINOMIAL, EQUINOX, TWO_LEVEL, FLAX)
SCHEDULES = {NESTED: "nested", BINOMIAL: "binomial"}
_REMAT = {CONTROL: True, **SCHEDULES}

AFTER = "loss after the unroll"
IN_STEP = "loss in the step"
READOUT = "readout="
FORMS = (AFTER, IN_STEP, READOUT)
# The variants each form runs; `readout=` is ours alone, against AFTER's
# baseline. Flax's remat_scan scans a carry alone (no per-step inputs or
# outputs): the loss in the step only, the step's index and the loss summed
# in the carry.
FORM_VARIANTS = {AFTER: VARIANTS[:-1], IN_STEP: VARIANTS, READOUT: (NESTED, BINOMIAL)}
_BASELINE_FORM = {AFTER: AFTER, IN_STEP: IN_STEP, READOUT: AFTER}


@dataclasses.dataclass(frozen=True)
class TimeScanConfig:
  """Lengths, model size and repetitions."""

  mode: str
  lengths: tuple[int, ...]
  hidden: int
  batch: int
  vocab: int
  warmup: int
  step_repeats: int
  step_block_s: float


FULL = TimeScanConfig(
  mode="full",
  lengths=(256, 1024, 4096),
  hidden=256,
  batch=32,
  vocab=256,
  warmup=1,
  step_repeats=3,
  step_block_s=1.0,
)

QUICK = TimeScanConfig(
  mode="quick",
  lengths=(8,),
  hidden=8,
  batch=2,
  vocab=8,
  warmup=1,
  step_repeats=2,
  step_block_s=0.001,
)


class Key(NamedTuple):
  length: int
  form: str
  variant: str


def _xent(logits, targets, vocab):
  return -jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(targets, vocab), axis=-1)


def model(variant: str, cfg: TimeScanConfig, form: str = IN_STEP) -> hk.Transformed:
  """The mean loss over `[T, B]` characters, in `form`, unrolled as `variant` does.

  Every form and variant makes the same params ("embed", "lstm", "head").
  """

  def loss(chars, targets):
    embed = hk.Embed(cfg.vocab, cfg.hidden, name="embed")
    lstm = hk.LSTM(cfg.hidden, name="lstm")
    head = hk.Linear(cfg.vocab, name="head")
    state = lstm.initial_state(cfg.batch)
    xent = lambda logits, t: _xent(logits, t, cfg.vocab)

    def unroll(core, xs, **options):
      if variant == PLAIN:
        return hk.dynamic_unroll(core, xs, state)
      if variant == BASELINE:
        return hk.dynamic_unroll(hk.remat(core), xs, state)
      return hkb.dynamic_unroll(core, xs, state, remat=_REMAT[variant], **options)

    if form == AFTER:
      ys, _ = unroll(lstm, embed(chars))
      return jnp.mean(xent(hk.BatchApply(head)(ys), targets))
    if form == IN_STEP:

      def core(inputs, state):
        c, t = inputs
        h, state = lstm(embed(c), state)
        return xent(head(h), t), state

      losses, _ = unroll(core, (chars, targets))
    else:
      losses, _ = unroll(
        lambda c, s: lstm(embed(c), s),
        chars,
        readout=lambda y, t: xent(head(y), t),
        readout_inputs=targets,
      )
    return jnp.mean(losses)

  return hk.transform(loss)


def _group_size(length: int) -> int:
  """The smallest divisor of `length` not below √length: the recipe's group."""
  size = max(1, math.isqrt(length))
  while length % size:
    size += 1
  return size


class _FlaxStep(nn.Module):
  """One step of `flax.linen.remat_scan`: `fn(carry) -> carry`."""

  fn: Callable[[Any], Any]

  def __call__(self, carry):
    return self.fn(carry)


def _flax_loss(step, state, chars, targets):
  """The mean of `step`'s per-step losses, scanned by Flax's remat_scan."""

  def fn(carry):
    s, t, total = carry
    s, losses = step(s, (chars[t], targets[t]))
    return s, t + 1, total + jnp.sum(losses)

  length = chars.shape[0]
  size = _group_size(length)
  stack = nn.remat_scan(_FlaxStep, lengths=(length // size, size))(fn)
  _, _, total = stack.apply({}, (state, jnp.int32(0), jnp.float32(0)))
  return total / chars.size


def pure_loss(form: str, variant: str, cfg: TimeScanConfig) -> Callable[..., jax.Array]:
  """`loss(params, chars, targets)` of `model`'s params, scanned by Equinox or the recipe."""
  lstm = hk.without_apply_rng(hk.transform(lambda x, s: hk.LSTM(cfg.hidden, name="lstm")(x, s)))

  def scan(step, carry, xs, length):
    if variant == EQUINOX:
      return eqxi.scan(step, carry, xs, kind="checkpointed")
    size = _group_size(length)
    groups = jax.tree.map(lambda a: a.reshape((-1, size) + a.shape[1:]), xs)
    group = jax.checkpoint(lambda c, xg: jax.lax.scan(step, c, xg))
    carry, ys = jax.lax.scan(group, carry, groups)
    return carry, jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), ys)

  def loss(params, chars, targets):
    embed = params["embed"]["embeddings"]
    core = {"lstm/linear": params["lstm/linear"]}
    head = lambda h: h @ params["head"]["w"] + params["head"]["b"]
    state = hk.LSTMState(jnp.zeros([cfg.batch, cfg.hidden]), jnp.zeros([cfg.batch, cfg.hidden]))
    length = chars.shape[0]
    if form == AFTER:

      def step(s, x):
        h, s = lstm.apply(core, x, s)
        return s, h

      _, ys = scan(step, state, embed[chars], length)
      return jnp.mean(_xent(head(ys), targets, cfg.vocab))

    def step(s, inputs):
      c, t = inputs
      h, s = lstm.apply(core, embed[c], s)
      return s, _xent(head(h), t, cfg.vocab)

    if variant == FLAX:
      return _flax_loss(step, state, chars, targets)
    _, losses = scan(step, state, (chars, targets), length)
    return jnp.mean(losses)

  return loss


def step_and_inputs(
  length: int, form: str, variant: str, cfg: TimeScanConfig
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """The jitted grad step of `variant` in `form` for `length` steps, and its arguments."""
  chars = jax.random.randint(jax.random.PRNGKey(1), [length + 1, cfg.batch], 0, cfg.vocab)
  inputs = (chars[:-1], chars[1:])
  params = jax.jit(model(PLAIN, cfg, AFTER).init)(jax.random.PRNGKey(0), *inputs)
  if variant in (EQUINOX, TWO_LEVEL, FLAX):
    loss = pure_loss(form, variant, cfg)
  else:
    net = model(variant, cfg, form)
    loss = lambda p, x, y: net.apply(p, None, x, y)
  return jax.jit(jax.grad(loss)), (params,) + inputs


def carry_bytes(cfg: TimeScanConfig) -> int:
  """Bytes of one carry: the LSTM's `(h, c)`, float32."""
  return 2 * cfg.batch * cfg.hidden * 4


def after_floor_bytes(length: int, cfg: TimeScanConfig) -> int:
  """What the usual form keeps whatever the schedule: the outputs and their cotangent.

  `[T, B, H]` twice, float32 (the embedded inputs and the head's `[T, B, V]`
  softmax come on top).
  """
  return 2 * length * cfg.batch * cfg.hidden * 4


def slots(variant: str, length: int) -> Optional[int]:
  """Carries the backward pass keeps: one per step, the schedule's slots, Equinox's checkpoints."""
  if variant in SCHEDULES:
    return loop.schedule(SCHEDULES[variant], length, None).num_slots
  if variant == EQUINOX:  # Its default: the fewest with (c+1)(c+2)/2 > T.
    return math.floor(-1.5 + math.sqrt(2 * length + 0.25)) + 1
  if variant in (TWO_LEVEL, FLAX):
    return length // _group_size(length) + _group_size(length)
  return length


@dataclasses.dataclass
class TimeScanResult:
  cfg: TimeScanConfig
  temp_bytes: dict[Key, Optional[int]]  # None: no memory_analysis.
  compile_s: dict[Key, float]  # Lower + compile, seconds.
  step: harness.Samples  # By Key; phases "step" and "step cpu".


def keys(cfg: TimeScanConfig) -> list[Key]:
  return [
    Key(length, form, v) for length in cfg.lengths for form in FORMS for v in FORM_VARIANTS[form]
  ]


def bench_time_scan(cfg: TimeScanConfig) -> TimeScanResult:
  compiled, args, temp_bytes, compile_s = {}, {}, {}, {}
  for key in harness.with_progress("time scan: compiling steps", keys(cfg)):
    step, args[key] = step_and_inputs(*key, cfg)
    start = time.perf_counter()
    compiled[key] = step.lower(*args[key]).compile()
    compile_s[key] = time.perf_counter() - start
    analysis = compiled[key].memory_analysis()
    temp_bytes[key] = None if analysis is None else analysis.temp_size_in_bytes
  step = harness.interleaved(
    "time scan: step times",
    [
      {
        k: harness.step_timer(compiled[k], args[k], cfg.step_block_s)
        for k in compiled
        if (k.length, k.form) == (length, form)
      }
      for length in cfg.lengths
      for form in FORMS
    ],
    cfg.step_repeats,
    cfg.warmup,
  )
  return TimeScanResult(cfg, temp_bytes, compile_s, step)


def _baseline(key: Key) -> Key:
  return Key(key.length, _BASELINE_FORM[key.form], BASELINE)


def temp_ratio(result: TimeScanResult, key: Key) -> Optional[float]:
  """`key`'s temporaries over its baseline's; None without memory_analysis."""
  ours, theirs = result.temp_bytes[key], result.temp_bytes[_baseline(key)]
  return None if ours is None or not theirs else ours / theirs


def step_ratio(result: TimeScanResult, key: Key, den: Key) -> harness.Stat:
  """Step time of `key` over `den`'s, sample by sample (same repetition)."""
  if key.form != den.form:  # Timed in another group: medians.
    num = harness.Stat.of(result.step[key]["step"]).median
    return harness.Stat(num / harness.Stat.of(result.step[den]["step"]).median, math.nan, math.nan)
  return harness.pair_ratios(result.step, key, den, "step")


def _mib(n: Optional[float]) -> str:
  if n is None:
    return "n/a"
  mib = n / 2**20
  return f"{mib:.0f}" if mib >= 100 else f"{mib:.3g}"


def _ratio(value: Optional[float]) -> str:
  return "n/a" if value is None else f"{value:.3f}"


def _stat(stat: harness.Stat) -> str:
  if math.isnan(stat.lo):
    return f"{stat.median:.3f}"
  return stat.ratio()


def markdown(result: TimeScanResult) -> str:
  """The tables: temporaries, carries and floors, step time, compile time."""
  cfg, lengths = result.cfg, result.cfg.lengths
  lines = [
    f"Model: character LM (`hk.Embed`, `hk.LSTM({cfg.hidden})`, "
    f"softmax head over {cfg.vocab}), batch {cfg.batch}; one carry is "
    f"{carry_bytes(cfg) / 2**10:.3g} KiB."
  ]
  for form in FORMS:
    variants = FORM_VARIANTS[form]
    base = f"{BASELINE} of the loss after the unroll" if form == READOUT else BASELINE
    lines += [
      "",
      f"### Grad-step temporaries (MiB), and / {base}: {form}",
      "",
    ]
    lines += markdown_table.lines(
      ["T"] + list(variants),
      [
        [length]
        + [
          f"{_mib(result.temp_bytes[Key(length, form, v)])} "
          f"({_ratio(temp_ratio(result, Key(length, form, v)))})"
          for v in variants
        ]
        for length in lengths
      ],
    )
  kept = (BASELINE, NESTED, BINOMIAL, EQUINOX, TWO_LEVEL, FLAX)
  lines += [
    "",
    "### Carries kept for the backward pass (Equinox: its "
    "checkpoints; the recipe and Flax: groups + one group's steps), "
    "and their "
    "MiB; the floor of the loss after the unroll",
    "",
  ]
  lines += markdown_table.lines(
    ["T", *kept, "outputs + cotangent (after)"],
    [
      [length]
      + [f"{slots(v, length)} ({_mib(slots(v, length) * carry_bytes(cfg))})" for v in kept]
      + [_mib(after_floor_bytes(length, cfg))]
      for length in lengths
    ],
  )
  for form in FORMS:
    variants = [v for v in FORM_VARIANTS[form] if v != BASELINE]
    lines += [
      "",
      f"### Step time / {BASELINE}: {form}; wall clock median [min–max]",
      "",
    ]
    rows = []
    for length in lengths:
      den = _baseline(Key(length, form, BASELINE))
      rows.append(
        [length, harness.Stat.of(result.step[den]["step"]).ms(1)]
        + [_stat(step_ratio(result, Key(length, form, v), den)) for v in variants]
      )
    lines += markdown_table.lines(["T", f"{BASELINE} (ms)", *variants], rows)
  lines += [
    "",
    "### Binomial against Equinox's checkpointed scan: temporaries and step time, ours / theirs",
    "",
  ]
  rows = []
  for length in lengths:
    for form in (AFTER, IN_STEP):
      ours, theirs = Key(length, form, BINOMIAL), Key(length, form, EQUINOX)
      a, b = result.temp_bytes[ours], result.temp_bytes[theirs]
      rows.append(
        [
          length,
          form,
          _ratio(None if a is None or not b else a / b),
          _stat(step_ratio(result, ours, theirs)),
        ]
      )
  lines += markdown_table.lines(["T", "form", "temporaries", "step time"], rows)
  lines += ["", "### Lower + compile time (s)", ""]
  lines += markdown_table.lines(
    ["T", "form", *VARIANTS],
    [
      [length, form]
      + [
        f"{result.compile_s[Key(length, form, v)]:.2f}"
        if Key(length, form, v) in result.compile_s
        else "—"
        for v in VARIANTS
      ]
      for length in lengths
      for form in FORMS
    ],
  )
  return "\n".join(lines) + "\n"


# (stroke, dash, marker) of each variant's line. Large hollow rings for the
# baseline and "nested", a dashed line for "binomial": their lines often lie
# on others' (the same memory), and all must stay visible.
_STYLES = {
  BASELINE: ("#ff7f0e", "", "ring"),
  CONTROL: ("#d62728", "6,3", "circle"),
  PLAIN: ("#7f7f7f", "", "square"),
  NESTED: ("#1f77b4", "", "ring"),
  BINOMIAL: ("#2ca02c", "6,3", "circle"),
  EQUINOX: ("#9467bd", "", "diamond"),
  TWO_LEVEL: ("#8c564b", "", "square"),
  FLAX: ("#bcbd22", "", "diamond"),
}
_READOUT_STYLE = ("#000000", "", "square")
_PANEL_W, _PANEL_H, _MARGIN = 420, 280, 64
MIB = 2**20


def memory_svg(result: TimeScanResult) -> str:
  """Grad-step temporaries (MiB) against T, log-log, a panel per form, as an SVG document.

  The loss after the unroll (with `readout=` and "binomial" beside it) and the
  loss in the step; a line per variant whose every length compiled, each
  point's `<title>` naming its form, variant, T and MiB.
  """
  lengths = list(result.cfg.lengths)
  lines = {}  # (form, label) -> (style, MiB per length).
  for form in (AFTER, IN_STEP):
    for variant in FORM_VARIANTS[form]:
      lines[form, variant] = (_STYLES[variant], [Key(n, form, variant) for n in lengths])
  lines[AFTER, 'readout=, remat="binomial"'] = (
    _READOUT_STYLE,
    [Key(n, READOUT, BINOMIAL) for n in lengths],
  )
  drawn = {
    k: (style, [result.temp_bytes[key] / MIB for key in keys])
    for k, (style, keys) in lines.items()
    if all(result.temp_bytes[key] is not None for key in keys)
  }
  values = [v for _, mib in drawn.values() for v in mib]
  legend_rows = max(sum(f == form for f, _ in drawn) for form in (AFTER, IN_STEP))
  parts = svg.open_document(
    2 * (_PANEL_W + 2 * _MARGIN),
    _PANEL_H + 2 * _MARGIN + 56 + 16 * legend_rows,
    f"Character LM (hidden {result.cfg.hidden}, batch {result.cfg.batch}, vocabulary "
    f"{result.cfg.vocab}): grad-step temporaries against T",
  )
  for i, form in enumerate((AFTER, IN_STEP)):
    panel = svg.Panel(
      _MARGIN + i * (_PANEL_W + 2 * _MARGIN),
      _MARGIN,
      _PANEL_W,
      _PANEL_H,
      lengths[0],
      lengths[-1],
      10 ** math.ceil(math.log10(1.1 * max(values))),
      x_log=True,
      y_low=10 ** math.floor(math.log10(0.9 * min(values))),
      y_log=True,
    )
    parts += svg.frame(
      panel,
      form,
      0,
      [(n, str(n)) for n in lengths],
      "T (time steps, log)",
      "grad-step temporaries (MiB, log)",
      "g",
    )
    legend = []
    for (f, label), ((color, dash, kind), mib) in drawn.items():
      if f != form:
        continue
      legend.append((color, dash, kind, label))
      parts.append(svg.polyline(panel, list(zip(lengths, mib)), color, label, dash))
      parts.extend(
        svg.marker(kind, panel.x(n), panel.y(v), color, f"{form}: {label}, T={n}: {v:.3f} MiB")
        for n, v in zip(lengths, mib)
      )
    parts += svg.legend(panel.left, panel.top + panel.height + 56, legend)
  return svg.close_document(parts)
