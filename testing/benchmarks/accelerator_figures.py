"""The figures `testing/accelerator_check.sh` records on an accelerator: the bridge at parity, the time scan's memory.

    python -m testing.benchmarks.accelerator_figures --out=/tmp/acc   # any backend; --small on a CPU

Two measurements, each of compiled programs run side by side in one process,
each line printed as it is measured:

* **Bridge parity**: the training step (value and grad of a next-token loss)
  of a pre-norm transformer LM (`testing/transformer.block`), written five
  ways: inline Haiku (a Python loop of blocks), the same network as
  `hkb.call_pure(hk.transform(net))` inside an outer transform, every block
  under `hkb.custom_vjp(block, hkb.vjp_fwd, identity bwd)`, `hk.layer_stack`,
  and `hkb.repeat_layer`. Step time in ms (median of interleaved
  repetitions) and ratios: the bridged forms to inline, `repeat_layer` to
  `hk.layer_stack`. Full size: d 1024, seq 1024, batch 8, params and
  activations bfloat16 (the loss in float32), 8 layers or as many as half
  the device's memory holds (`lm_size`).
* **Time scan memory and time**: the char LSTM of
  `testing/benchmarks/lib/time_scan_bench.py` (full size: H 1024, B 32,
  T 2048 or the longest power of two half the device's memory holds),
  `readout=` with `remat="binomial"` against the usual form's per-step remat
  (`hk.dynamic_unroll(hk.remat(core))`) and against Equinox's checkpointed
  scan of the same step: compiled temporaries (`memory_analysis`) and step
  time.

Writes `figures.json` and `figures.md` under `--out` after each measurement
(a run stopped at a time limit keeps what it measured), with the date, the
device, its memory, jax and jaxlib versions, and prints the Markdown.
"""

import datetime
import functools
import json
import os
import statistics
import time
from typing import Any, Callable

from absl import app
from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp

import haiku_bridge as hkb
from haiku_bridge._src.remat import hlo_flops
from testing import transformer
from testing.benchmarks.lib import markdown_table
from testing.benchmarks.lib import time_scan_bench as tsb

_OUT = flags.DEFINE_string("out", "/tmp/haiku_bridge_accelerator", "Output folder.")
_SMALL = flags.DEFINE_bool("small", False, "Small shapes (a CPU check).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repetitions per form.")

# The largest sizes, those of the H200's figures (RESULTS.md, "On a GPU"); a
# device with less memory gets fewer layers and a shorter sequence.
MAX_LAYERS = 8
MAX_LENGTH = 2048


def say(line: str) -> None:
  """Prints a line at once: a run watched live, or stopped at a limit, shows what was measured."""
  print(line, flush=True)


def device_bytes() -> int | None:
  """The memory of the first device, where its backend reports it (`bytes_limit`)."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except  # Backends without it raise.
    return None
  return (stats or {}).get("bytes_limit")


def lm_size(small: bool, memory: int | None) -> dict[str, int]:
  """The transformer LM's shapes: `MAX_LAYERS` layers, or as many as half of `memory` holds.

  A layer's bytes in the training step (bfloat16), on the high side: the
  attention logits and probabilities the backward pass keeps (2 × batch ×
  heads × seq²), 16 activations of batch × seq × d (the layer norms' inputs,
  q, k, v, the attention's output, the MLP's 4d hidden before and after its
  nonlinearity), and its 12 d² params three times (params, gradients, an
  update's temporary).
  """
  if small:
    return dict(vocab=64, d_model=32, heads=2, layers=2, seq=16, batch=2)
  size = dict(vocab=1024, d_model=1024, heads=8, layers=MAX_LAYERS, seq=1024, batch=8)
  if memory:
    b, h, s, d = size["batch"], size["heads"], size["seq"], size["d_model"]
    per_layer = 2 * (2 * b * h * s * s + 16 * b * s * d + 36 * d * d)
    size["layers"] = max(1, min(MAX_LAYERS, memory // 2 // per_layer))
  return size


def lstm_length(small: bool, memory: int | None, hidden: int, batch: int, vocab: int) -> int:
  """The char LSTM's steps: `MAX_LENGTH`, or the longest power of two half of `memory` holds.

  The usual form's step holds per time step four float32 arrays of
  batch × (hidden + vocab) (the outputs and their cotangent, the logits and
  their softmax): 1.6 GiB at `MAX_LENGTH` (1603 MiB on the H200).
  """
  if small:
    return 64
  length = MAX_LENGTH
  if memory:
    while length > 64 and 16 * length * batch * (hidden + vocab) > memory // 2:
      length //= 2
  return length


LM_FORMS = (
  "inline",
  "hkb.call_pure(hk.transform)",
  "hkb.custom_vjp per block",
  "hk.layer_stack",
  "hkb.repeat_layer",
)


def _lm_loss(
  form: str,
  *,
  vocab: int,
  d_model: int,
  heads: int,
  layers: int,
  repeat_options: dict[str, Any] | None = None,
):
  """`loss(tokens)` inside a transform, the blocks run as `form` says.

  `repeat_options`: `hkb.repeat_layer`'s keyword arguments (remat, unroll...)
  where `form` is "hkb.repeat_layer".
  """
  block = functools.partial(transformer.block, d_model=d_model, heads=heads)

  def body(h):
    if form == "hk.layer_stack":
      return hk.layer_stack(layers, name="layers")(block)(h)
    if form == "hkb.repeat_layer":
      return hkb.repeat_layer(block, h, layers, name="layers", **(repeat_options or {}))
    run = block
    if form == "hkb.custom_vjp per block":
      run = hkb.custom_vjp(block, hkb.vjp_fwd, lambda vjp_fn, g: vjp_fn(g))
    for i in range(layers):
      with hk.name_scope(f"layer_{i}"):
        h = run(h)
    return h

  def net(tokens):
    h = hk.Embed(vocab, d_model, name="embed")(tokens[:, :-1])
    h = body(h)
    logits = hk.Linear(vocab, name="unembed")(h).astype(jnp.float32)
    labels = jax.nn.one_hot(tokens[:, 1:], vocab)
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, -1))

  if form == "hkb.call_pure(hk.transform)":
    inner = hk.transform(net)
    return lambda tokens: hkb.call_pure(inner, tokens)
  return net


def _time(step: Callable[..., Any], args: tuple[Any, ...]) -> float:
  """Seconds of one call of a compiled step (enough calls for ~0.2 s, averaged)."""
  jax.block_until_ready(step(*args))
  start = time.perf_counter()
  jax.block_until_ready(step(*args))
  calls = max(1, int(0.2 / max(time.perf_counter() - start, 1e-6)))
  start = time.perf_counter()
  out = None
  for _ in range(calls):
    out = step(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls


def _interleaved(
  steps: dict[str, tuple[Any, tuple[Any, ...]]], repeats: int
) -> dict[str, list[float]]:
  """Step times of every entry, one of each per repetition, each repetition printed."""
  samples = {k: [] for k in steps}
  for rep in range(repeats):
    for k, (step, args) in steps.items():
      samples[k].append(_time(step, args))
    say(
      f"  repetition {rep + 1}/{repeats}: "
      + ", ".join(f"{k} {v[-1] * 1e3:.2f} ms" for k, v in samples.items())
    )
  return samples


def _ratios(samples: dict[str, list[float]], num: str, den: str) -> dict[str, float]:
  """Median, min and max of per-repetition ratios `num / den`."""
  r = [a / b for a, b in zip(samples[num], samples[den])]
  return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def _compiled(name: str, step: Any, args: tuple[Any, ...]) -> Any:
  """`step` compiled for `args`, its compile time printed."""
  start = time.perf_counter()
  compiled = step.lower(*args).compile()
  say(f"  compiled {name} in {time.perf_counter() - start:.1f} s")
  return compiled


def bridge_parity(small: bool, repeats: int, memory: int | None) -> dict[str, Any]:
  """Step times of the transformer LM in every form of `LM_FORMS`, ratios to inline."""
  size = lm_size(small, memory)
  say(f"Transformer LM training step, {size}, bfloat16:")
  dtype = jnp.bfloat16
  tokens = jax.random.randint(
    jax.random.PRNGKey(1), [size["batch"], size["seq"] + 1], 0, size["vocab"]
  )
  model = dict((k, size[k]) for k in ("vocab", "d_model", "heads", "layers"))
  steps = {}
  for form in LM_FORMS:
    f = hk.transform(_lm_loss(form, **model))
    params = jax.tree.map(lambda p: p.astype(dtype), jax.jit(f.init)(jax.random.PRNGKey(0), tokens))
    step = jax.jit(jax.value_and_grad(lambda p, t, f=f: f.apply(p, None, t)))
    steps[form] = (_compiled(form, step, (params, tokens)), (params, tokens))
  # Every form computes the same loss (recorded: a broken form is no figure).
  losses = {k: float(s(*a)[0]) for k, (s, a) in steps.items()}
  say(f"  losses: {losses}")
  samples = _interleaved(steps, repeats)
  out = {
    "size": size,
    "dtype": "bfloat16",
    "losses": losses,
    "step_ms": {k: statistics.median(v) * 1e3 for k, v in samples.items()},
    "ratios": {k: _ratios(samples, k, "inline") for k in LM_FORMS[1:3]},
  }
  out["ratios"]["hkb.repeat_layer / hk.layer_stack"] = _ratios(
    samples, "hkb.repeat_layer", "hk.layer_stack"
  )
  return out


def time_scan(small: bool, repeats: int, memory: int | None) -> dict[str, Any]:
  """The char LSTM: temporaries and step times of `readout=` + binomial and its peers."""
  hidden, batch, vocab = (16, 2, 16) if small else (1024, 32, 256)
  length = lstm_length(small, memory, hidden, batch, vocab)
  cfg = tsb.TimeScanConfig(
    mode="accelerator",
    lengths=(length,),
    hidden=hidden,
    batch=batch,
    vocab=vocab,
    warmup=1,
    step_repeats=repeats,
    step_block_s=0.2,
  )
  say(f"Char LSTM training step, hidden {hidden}, batch {batch}, vocab {vocab}, length {length}:")
  keys = {
    "usual form, per-step remat": (tsb.AFTER, tsb.BASELINE),
    "readout= + binomial": (tsb.READOUT, tsb.BINOMIAL),
    "loss in the step, binomial": (tsb.IN_STEP, tsb.BINOMIAL),
    "loss in the step, Equinox checkpointed": (tsb.IN_STEP, tsb.EQUINOX),
  }
  steps, temp = {}, {}
  for name, (form, variant) in keys.items():
    step, args = tsb.step_and_inputs(length, form, variant, cfg)
    compiled = _compiled(name, step, args)
    analysis = compiled.memory_analysis()
    temp[name] = (
      None if analysis is None else hlo_flops.temporaries(analysis, jax.default_backend())
    )
    say(
      f"  {name}: temporaries " + ("n/a" if temp[name] is None else f"{temp[name] / 2**20:.2f} MiB")
    )
    steps[name] = (compiled, args)
  samples = _interleaved(steps, repeats)
  ro, eqx = "readout= + binomial", "loss in the step, Equinox checkpointed"
  return {
    "config": {"hidden": cfg.hidden, "batch": cfg.batch, "vocab": cfg.vocab, "length": length},
    "temp_bytes": temp,
    "step_ms": {k: statistics.median(v) * 1e3 for k, v in samples.items()},
    "readout_temp_over_per_step_remat": temp[ro] / temp["usual form, per-step remat"]
    if temp[ro] and temp["usual form, per-step remat"]
    else None,
    "readout_temp_over_equinox": temp[ro] / temp[eqx] if temp[ro] and temp[eqx] else None,
    "readout_time_over_equinox": _ratios(samples, ro, eqx),
  }


def environment() -> dict[str, Any]:
  device = jax.devices()[0]
  return {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
    "backend": jax.default_backend(),
    "device": getattr(device, "device_kind", str(device)),
    "device_bytes": device_bytes(),
    "jax": jax.__version__,
    "jaxlib": jax.lib.__version__,
    "dm-haiku": hk.__version__,
    "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
    "LIBTPU_INIT_ARGS": os.environ.get("LIBTPU_INIT_ARGS", ""),
  }


def _times(value: float | None) -> str:
  return "n/a" if value is None else f"{value:.3f}×"


def markdown(figures: dict[str, Any]) -> str:
  """The figures as Markdown tables (those measured: a run may stop between them)."""
  env = figures["environment"]
  memory = "" if not env["device_bytes"] else f", {env['device_bytes'] / 2**30:.1f} GiB"
  lines = [
    f"{env['date']}, {env['device']} ({env['backend']}{memory}), "
    f"jax {env['jax']}, jaxlib {env['jaxlib']}, dm-haiku {env['dm-haiku']}."
  ]
  lm = figures.get("bridge_parity")
  if lm:
    lines += [
      "",
      f"Transformer LM training step, {lm['size']}, {lm['dtype']}:",
      "",
    ]
    rows = []
    for form in LM_FORMS:
      r, of = lm["ratios"].get(form), " of inline"
      if form == "hkb.repeat_layer":
        r, of = lm["ratios"]["hkb.repeat_layer / hk.layer_stack"], " of hk.layer_stack"
      ratio = "" if r is None else (f"{r['median']:.3f} [{r['min']:.3f}–{r['max']:.3f}]{of}")
      rows.append([form, f"{lm['step_ms'][form]:.2f}", ratio])
    lines += markdown_table.lines(
      ["form", "step (ms)", "ratio (median [min–max])"], rows, align="lrl"
    )
  ts = figures.get("time_scan")
  if ts:
    lines += [
      "",
      f"Char LSTM training step, {ts['config']}:",
      "",
    ]
    lines += markdown_table.lines(
      ["variant", "temporaries (MiB)", "step (ms)"],
      [
        [k, "n/a" if b is None else f"{b / 2**20:.2f}", f"{ts['step_ms'][k]:.2f}"]
        for k, b in ts["temp_bytes"].items()
      ],
      align="lrr",
    )
    t = ts["readout_time_over_equinox"]
    lines += [
      "",
      f"readout= + binomial: {_times(ts['readout_temp_over_per_step_remat'])} "
      f"per-step remat's temporaries, {_times(ts['readout_temp_over_equinox'])} "
      f"Equinox's, at {t['median']:.3f} [{t['min']:.3f}–{t['max']:.3f}]× "
      "its step time.",
    ]
  return "\n".join(lines)


def main(argv):
  del argv
  os.makedirs(_OUT.value, exist_ok=True)
  figures = {"environment": environment()}
  memory = figures["environment"]["device_bytes"]
  say(f"{figures['environment']}")
  for name, measure in (("bridge_parity", bridge_parity), ("time_scan", time_scan)):
    figures[name] = measure(_SMALL.value, _REPEATS.value, memory)
    text = markdown(figures)
    with open(os.path.join(_OUT.value, "figures.json"), "w") as f:
      json.dump(figures, f, indent=1)
    with open(os.path.join(_OUT.value, "figures.md"), "w") as f:
      f.write(text + "\n")
  say(text)


if __name__ == "__main__":
  app.run(main)
