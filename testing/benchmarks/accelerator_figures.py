"""The figures `testing/gpu_check.sh` records on an accelerator: the bridge at parity, the time scan's memory.

    python -m testing.benchmarks.gpu_figures --out=/tmp/gpu   # any backend; --small on a CPU

Two measurements, each of compiled programs run side by side in one process:

* **Bridge parity**: the training step (value and grad of a next-token loss)
  of a pre-norm transformer LM (`testing/transformer.block`), written five
  ways: inline Haiku (a Python loop of blocks), the same network as
  `hkb.call_pure(hk.transform(net))` inside an outer transform, every block
  under `hkb.custom_vjp(block, hkb.vjp_fwd, identity bwd)`, `hk.layer_stack`,
  and `hkb.repeat_layer`. Step time in ms (median of interleaved
  repetitions) and ratios: the bridged forms to inline, `repeat_layer` to
  `hk.layer_stack`. Full size: d 1024, 8 layers, seq 1024, batch 8, params
  and activations bfloat16 (the loss in float32).
* **Time scan memory and time**: the char LSTM of
  `testing/benchmarks/lib/time_scan_bench.py` (full size: H 1024, B 32,
  T 2048), `readout=` with `remat="binomial"` against the usual form's
  per-step remat (`hk.dynamic_unroll(hk.remat(core))`) and against
  Equinox's checkpointed scan of the same step: compiled temporaries
  (`memory_analysis`) and step time.

Writes `figures.json` and `figures.md` under `--out`, with the date, the
device, jax and jaxlib versions, and prints the Markdown.
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
from testing.benchmarks.lib import time_scan_bench as tsb

_OUT = flags.DEFINE_string("out", "/tmp/haiku_bridge_gpu", "Output folder.")
_SMALL = flags.DEFINE_bool("small", False, "Small shapes (a CPU check).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repetitions per form.")

LM_FORMS = ("inline", "hkb.call_pure(hk.transform)", "hkb.custom_vjp per block",
            "hk.layer_stack", "hkb.repeat_layer")


def _lm_loss(form: str, *, vocab: int, d_model: int, heads: int, layers: int):
  """`loss(tokens)` inside a transform, the blocks run as `form` says."""
  block = functools.partial(transformer.block, d_model=d_model, heads=heads)

  def body(h):
    if form == "hk.layer_stack":
      return hk.layer_stack(layers, name="layers")(block)(h)
    if form == "hkb.repeat_layer":
      return hkb.repeat_layer(block, h, layers, name="layers")
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


def _interleaved(steps: dict[str, tuple[Any, tuple[Any, ...]]],
                 repeats: int) -> dict[str, list[float]]:
  samples = {k: [] for k in steps}
  for _ in range(repeats):
    for k, (step, args) in steps.items():
      samples[k].append(_time(step, args))
  return samples


def _ratios(samples: dict[str, list[float]], num: str, den: str) -> dict[str, float]:
  """Median, min and max of per-repetition ratios `num / den`."""
  r = [a / b for a, b in zip(samples[num], samples[den])]
  return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def bridge_parity(small: bool, repeats: int) -> dict[str, Any]:
  """Step times of the transformer LM in every form of `LM_FORMS`, ratios to inline."""
  size = (dict(vocab=64, d_model=32, heads=2, layers=2, seq=16, batch=2)
          if small else
          dict(vocab=1024, d_model=1024, heads=8, layers=8, seq=1024, batch=8))
  dtype = jnp.bfloat16
  tokens = jax.random.randint(jax.random.PRNGKey(1),
                              [size["batch"], size["seq"] + 1], 0, size["vocab"])
  model = dict((k, size[k]) for k in ("vocab", "d_model", "heads", "layers"))
  steps = {}
  for form in LM_FORMS:
    f = hk.transform(_lm_loss(form, **model))
    params = jax.tree.map(lambda p: p.astype(dtype),
                          jax.jit(f.init)(jax.random.PRNGKey(0), tokens))
    step = jax.jit(jax.value_and_grad(lambda p, t, f=f: f.apply(p, None, t)))
    steps[form] = (step.lower(params, tokens).compile(), (params, tokens))
  # Every form computes the same loss (recorded: a broken form is no figure).
  losses = {k: float(s(*a)[0]) for k, (s, a) in steps.items()}
  samples = _interleaved(steps, repeats)
  out = {"size": size, "dtype": "bfloat16", "losses": losses,
         "step_ms": {k: statistics.median(v) * 1e3 for k, v in samples.items()},
         "ratios": {k: _ratios(samples, k, "inline") for k in LM_FORMS[1:3]}}
  out["ratios"]["hkb.repeat_layer / hk.layer_stack"] = _ratios(
      samples, "hkb.repeat_layer", "hk.layer_stack")
  return out


def time_scan(small: bool, repeats: int) -> dict[str, Any]:
  """The char LSTM: temporaries and step times of `readout=` + binomial and its peers."""
  cfg = tsb.TimeScanConfig(
      mode="gpu", lengths=(64,) if small else (2048,),
      hidden=16 if small else 1024, batch=2 if small else 32,
      vocab=16 if small else 256, warmup=1, step_repeats=repeats,
      step_block_s=0.2)
  length = cfg.lengths[0]
  keys = {"usual form, per-step remat": (tsb.AFTER, tsb.BASELINE),
          "readout= + binomial": (tsb.READOUT, tsb.BINOMIAL),
          "loss in the step, binomial": (tsb.IN_STEP, tsb.BINOMIAL),
          "loss in the step, Equinox checkpointed": (tsb.IN_STEP, tsb.EQUINOX)}
  steps, temp = {}, {}
  for name, (form, variant) in keys.items():
    step, args = tsb.step_and_inputs(length, form, variant, cfg)
    compiled = step.lower(*args).compile()
    analysis = compiled.memory_analysis()
    temp[name] = None if analysis is None else hlo_flops.temporaries(
        analysis, jax.default_backend())
    steps[name] = (compiled, args)
  samples = _interleaved(steps, repeats)
  ro, eqx = "readout= + binomial", "loss in the step, Equinox checkpointed"
  return {"config": {"hidden": cfg.hidden, "batch": cfg.batch,
                     "vocab": cfg.vocab, "length": length},
          "temp_bytes": temp,
          "step_ms": {k: statistics.median(v) * 1e3 for k, v in samples.items()},
          "readout_temp_over_per_step_remat":
              temp[ro] / temp["usual form, per-step remat"]
              if temp[ro] and temp["usual form, per-step remat"] else None,
          "readout_temp_over_equinox":
              temp[ro] / temp[eqx] if temp[ro] and temp[eqx] else None,
          "readout_time_over_equinox": _ratios(samples, ro, eqx)}


def environment() -> dict[str, str]:
  device = jax.devices()[0]
  return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
              timespec="minutes"),
          "backend": jax.default_backend(),
          "device": getattr(device, "device_kind", str(device)),
          "jax": jax.__version__, "jaxlib": jax.lib.__version__,
          "dm-haiku": hk.__version__, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}


def markdown(figures: dict[str, Any]) -> str:
  env, lm, ts = figures["environment"], figures["bridge_parity"], figures["time_scan"]
  lines = [f"{env['date']}, {env['device']} ({env['backend']}), jax {env['jax']}, "
           f"jaxlib {env['jaxlib']}, dm-haiku {env['dm-haiku']}.", "",
           f"Transformer LM training step, {lm['size']}, {lm['dtype']}:", "",
           "| form | step (ms) | ratio (median [min–max]) |", "| --- | ---: | --- |"]
  names = {"hkb.call_pure(hk.transform)": "hkb.call_pure(hk.transform)",
           "hkb.custom_vjp per block": "hkb.custom_vjp per block"}
  for form in LM_FORMS:
    r = lm["ratios"].get(names.get(form, ""), None)
    if form == "hkb.repeat_layer":
      r = lm["ratios"]["hkb.repeat_layer / hk.layer_stack"]
    ratio = "" if r is None else (
        f"{r['median']:.3f} [{r['min']:.3f}–{r['max']:.3f}]"
        + (" of hk.layer_stack" if form == "hkb.repeat_layer" else " of inline"))
    lines.append(f"| {form} | {lm['step_ms'][form]:.2f} | {ratio} |")
  lines += ["", f"Char LSTM training step, {ts['config']}:", "",
            "| variant | temporaries (MiB) | step (ms) |", "| --- | ---: | ---: |"]
  for k, b in ts["temp_bytes"].items():
    mib = "n/a" if b is None else f"{b / 2**20:.2f}"
    lines.append(f"| {k} | {mib} | {ts['step_ms'][k]:.2f} |")
  t = ts["readout_time_over_equinox"]
  lines += ["", f"readout= + binomial: {ts['readout_temp_over_per_step_remat']} × "
            f"per-step remat's temporaries, {ts['readout_temp_over_equinox']} × "
            f"Equinox's, at {t['median']:.3f} [{t['min']:.3f}–{t['max']:.3f}] × "
            "its step time."]
  return "\n".join(lines)


def main(argv):
  del argv
  figures = {"environment": environment(),
             "bridge_parity": bridge_parity(_SMALL.value, _REPEATS.value),
             "time_scan": time_scan(_SMALL.value, _REPEATS.value)}
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, "figures.json"), "w") as f:
    json.dump(figures, f, indent=1)
  text = markdown(figures)
  with open(os.path.join(_OUT.value, "figures.md"), "w") as f:
    f.write(text + "\n")
  print(text)


if __name__ == "__main__":
  app.run(main)
