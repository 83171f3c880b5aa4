"""`hkb.budgeted_jit` on a transformer LM's training step: plan, compiled bytes, step time, cold cost.

    python -m testing.benchmarks.step_budget_figures --out=/tmp/sb          # an accelerator
    python -m testing.benchmarks.step_budget_figures --out=/tmp/sb --small  # a CPU check

The step: value and gradient of a next-token loss of the pre-norm
transformer of `testing/transformer.py` (its blocks under
`hkb.repeat_layer`, params and activations bfloat16, the loss float32),
then an Adam update (optax), params and optimizer state donated. For each
size (`SIZES`), side by side in one process:

* `remat=False` and `remat=True` jitted as a user writes them: compiled
  bytes (`step_compiles.step_bytes`), or "does not fit" where XLA's compiler
  runs out of device memory; cold compile time; step time where it fits.
* `remat="auto"` under `hkb.budgeted_jit` at each budget of the size (None:
  the device's memory): the plan, its compiled bytes, the first call's time
  (the search's compiles included) against `remat=True`'s compile, and the
  step time.
* `remat=False` at growing batches (`SWEEP`): the figure `budgeted_jit`
  reads against whether the device's compiler takes the step, and runs it.

`--phase=warm` runs the budgeted steps only, with the plans a first run
kept on disk (`HAIKU_BRIDGE_CACHE_DIR`): the second process's cost. Each
compile starts from jax's caches and the bridge's in-memory ones cleared;
jax's persistent compilation cache is off unless the environment turns it
on. A compile's time (a plain step's, a budgeted step's first call) is the
median of `--cold_repeats` (an accelerator's compile times vary: the same
24-layer step compiled in 7.9-10.1 s in one run on a TPU v5e); the cold
phase's repeats but its last keep no plan on disk, so that each searches
and the last leaves its plan for `--phase=warm`.
Writes `<phase>.json` under `--out` and prints each figure as it is made, then
`step_budget.md`: the tables (`markdown`) of the phases whose JSON is there.
"""

import contextlib
import datetime
import json
import os
import re
import statistics
import time
from typing import Any, Optional
from unittest import mock

from absl import app
from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp
import optax

import haiku_bridge as hkb
from haiku_bridge._src.remat import step_compiles
from testing import transformer
from testing.benchmarks.lib import markdown_table

_OUT = flags.DEFINE_string("out", "/tmp/haiku_bridge_step_budget", "Output folder.")
_SMALL = flags.DEFINE_bool("small", False, "Small shapes (a CPU check).")
_PHASE = flags.DEFINE_enum(
  "phase",
  "cold",
  ["cold", "warm"],
  "cold: every form; warm: the budgeted steps again, their plans read from disk.",
)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repetitions per step.")
_SWEEP = flags.DEFINE_bool("sweep", True, "With --phase=cold: remat=False at growing batches too.")
_COLD_REPEATS = flags.DEFINE_integer(
  "cold_repeats", 3, "Compiles timed per figure of compile time (their median is the figure)."
)

_GIB = 2**30
# (name, model and batch, budgets: None is the device's memory).
SIZES = (
  (
    "seq 2048, batch 8",
    dict(vocab=1024, d_model=1024, heads=8, layers=24, seq=2048, batch=8),
    (None, int(7.73e9), int(5.6e9)),
  ),
  (
    "seq 1024, batch 4",
    dict(vocab=1024, d_model=1024, heads=8, layers=24, seq=1024, batch=4),
    (None, int(11.78e9)),
  ),
)
# Plain (remat=False) steps of growing batch, each compiled and, where it
# compiles, run: the figure against what the device takes.
SWEEP = (dict(vocab=1024, d_model=1024, heads=8, layers=24, seq=1024), (4, 5, 6, 7, 8))
SMALL_SWEEP = (dict(vocab=64, d_model=32, heads=2, layers=6, seq=32), (2, 4))
SMALL_SIZES = (
  (
    "small",
    dict(vocab=64, d_model=32, heads=2, layers=6, seq=32, batch=2),
    (1_100_000, 1_500_000, 3_000_000),
  ),
)


def _model(size: dict[str, int], remat: Any):
  """`init` and the donated training step `(params, opt_state, tokens) -> (params, opt_state, loss)`."""
  model = dict((k, size[k]) for k in ("vocab", "d_model", "heads", "layers"))

  def loss(tokens):
    logits = transformer.transformer(tokens[:, :-1], remat=remat, **model)
    labels = jax.nn.one_hot(tokens[:, 1:], size["vocab"])
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits.astype(jnp.float32)) * labels, -1))

  f = hk.without_apply_rng(hk.transform(loss))
  optimizer = optax.adam(1e-3)

  def step(params, opt_state, tokens):
    value, grads = jax.value_and_grad(f.apply)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  def init(tokens):
    params = jax.tree.map(
      lambda p: p.astype(jnp.bfloat16), jax.jit(f.init)(jax.random.PRNGKey(0), tokens)
    )
    return params, optimizer.init(params)

  return init, step


def _inputs(size: dict[str, int]):
  return jax.random.randint(
    jax.random.PRNGKey(1), [size["batch"], size["seq"] + 1], 0, size["vocab"]
  )


def _time(run, state, tokens, repeats: int) -> float:
  """Median ms of one step, the donated state handed on."""
  params, opt_state = state
  params, opt_state, loss = run(params, opt_state, tokens)
  jax.block_until_ready(loss)
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    params, opt_state, loss = run(params, opt_state, tokens)
    jax.block_until_ready(loss)
    samples.append((time.perf_counter() - start) * 1e3)
  return statistics.median(samples)


def _say(record: dict[str, Any], **figures: Any) -> None:
  record.update(figures)
  print(json.dumps(figures), flush=True)


def _nothing_on_disk():
  """The bridge keeping nothing on disk while it is entered (`HAIKU_BRIDGE_CACHE_DIR` empty)."""
  return mock.patch.dict(os.environ, {"HAIKU_BRIDGE_CACHE_DIR": ""})


def _settled() -> float:
  """Seconds until the compiles a search left unused end (`budgeted_jit` lets them finish in its threads): no figure after shares the host with them."""
  start = time.perf_counter()
  step_compiles.unused_compiles_ended()
  return time.perf_counter() - start


def _cleared() -> None:
  """jax's caches and the bridge's in-memory ones emptied, the plans' files kept: a cold compile."""
  _settled()
  with _nothing_on_disk():
    hkb.clear_caches()
  jax.clear_caches()


def plain(size: dict[str, int], remat: bool, repeats: int, cold_repeats: int = 1) -> dict[str, Any]:
  """`remat=False` or `remat=True`, jitted as a user writes it; its compile timed `cold_repeats` times."""
  init, step = _model(size, remat)
  tokens = _inputs(size)
  out: dict[str, Any] = {"remat": remat}
  state = init(tokens)
  samples = []
  for _ in range(cold_repeats):
    _cleared()
    start = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(*state, tokens)
    try:
      compiled = lowered.compile()
    except Exception as error:  # pylint: disable=broad-except
      if not step_compiles.out_of_memory(error):
        raise
      # One refusal says it: the compile times of a step that fits are the figure.
      refused = str(error).splitlines()[0][:300]
      _say(out, fits=False, error=refused, compile_s=time.perf_counter() - start)
      return out
    samples.append(time.perf_counter() - start)
  analysis = compiled.memory_analysis()
  _say(
    out,
    fits=True,
    compile_s=statistics.median(samples),
    compile_samples=samples,
    bytes=step_compiles.step_bytes(analysis, jax.default_backend()),
    analysis={k: getattr(analysis, k) for k in dir(analysis) if k.endswith("_in_bytes")},
  )
  _say(out, step_ms=_time(compiled, state, tokens, repeats))
  return out


def budgeted(
  size: dict[str, int],
  budget: Optional[int],
  repeats: int,
  cold_repeats: int = 1,
  cold: bool = True,
) -> dict[str, Any]:
  """`remat="auto"` under `hkb.budgeted_jit(step, memory_budget=budget)`; its first call timed `cold_repeats` times.

  `cold`: every call but the last keeps no plan on disk (each searches); else
  (`--phase=warm`) each reads the plan the cold phase kept.
  """
  init, step = _model(size, "auto")
  tokens = _inputs(size)
  out: dict[str, Any] = {"memory_budget": budget}
  state = init(tokens)
  samples, plans, unused = [], [], []
  for repeat in range(cold_repeats):
    _cleared()
    run = hkb.budgeted_jit(step, memory_budget=budget, donate_argnums=(0, 1))
    keep = not cold or repeat == cold_repeats - 1
    start = time.perf_counter()
    with contextlib.nullcontext() if keep else _nothing_on_disk():
      try:
        plan = run.plan(*state, tokens)
      except ValueError as error:
        _say(out, refused=str(error), first_s=time.perf_counter() - start)
        return out
    samples.append(time.perf_counter() - start)
    plans.append((plan.loops, plan.bytes))
    unused.append(_settled())
  _say(
    out,
    first_s=statistics.median(samples),
    first_samples=samples,
    # After each first call, how long its unused compiles ran on.
    unused_s=unused,
    # Whether every repeat chose the same (it is the compiled step's choice).
    same_plans=len(set(map(repr, plans))) == 1,
    bytes=plan.bytes,
    budget=plan.memory_budget,
    kept=plan.kept,
    loops=[loop._asdict() for loop in plan.loops],
    tries=[t._asdict() for t in plan.tries],
  )
  _say(out, step_ms=_time(run, state, tokens, repeats))
  return out


def environment() -> dict[str, Any]:
  device = jax.devices()[0]
  return {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
    "backend": jax.default_backend(),
    "device": getattr(device, "device_kind", str(device)),
    "device_memory": step_compiles.device_memory(),
    "jax": jax.__version__,
    "jaxlib": jax.lib.__version__,
    "dm-haiku": hk.__version__,
  }


def _out_of_memory(error: str) -> str:
  """XLA's refusal in a few words: `RESOURCE_EXHAUSTED, 42.04G of temporaries over 15.75G`."""
  found = re.search(r"HLO temporaries \(([^)]+)\) exceeds available \w+ \(([^)]+)\)", error)
  return f"RESOURCE_EXHAUSTED, {found[1]} of temporaries over {found[2]}" if found else error[:80]


def _plan(record: dict[str, Any]) -> str:
  """The plan of a budgeted step: each loop's remat, a schedule's slots."""
  loops = []
  for loop in record["loops"]:
    remat = loop["remat"]
    loops.append(f"{remat}, {loop['slots']} slots" if loop["slots"] else f"`remat={remat}`")
  differed = " (not every repeat's)" if record.get("same_plans") is False else ""
  return "; ".join(loops) + differed


def _compiles(record: dict[str, Any]) -> str:
  """The first call's compiles (its drafts apart), and those out of memory with their time."""
  tries = [t for t in record["tries"] if not t.get("draft")]
  drafts = len(record["tries"]) - len(tries)
  failed = [
    f"{t['rung']} out of memory in {t['seconds']:.1f} s" for t in tries if t["bytes"] is None
  ]
  return (
    f"{len(tries)}"
    + (f" and {drafts} draft{'s' * (drafts > 1)}" if drafts else "")
    + (f" ({'; '.join(failed)})" if failed else "")
  )


def markdown(cold: dict[str, Any], warm: Optional[dict[str, Any]] = None) -> str:
  """The figures as Markdown: per size, the plain steps and each budget; then the batch sweep.

  `warm`: the same sizes' second process (`--phase=warm`), its first call beside the cold one.
  """
  env = cold["environment"]
  memory = env["device_memory"]
  lines = [
    f"{env['date']}, {env['device']} ({env['backend']}"
    + (f", {memory:,} bytes" if memory else "")
    + f"), jax {env['jax']}, dm-haiku {env['dm-haiku']}.",
    "",
  ]
  header = [
    "size", "form", "budget (bytes)", "plan", "compiles", "bytes", "/ budget", "step (ms)",
    "first call (s)", "/ remat=True's compile", "second process (s)", "/ remat=True's compile",
  ]  # fmt: skip
  rows = []
  for name, size in cold["sizes"].items():
    by_remat = {r["remat"]: r for r in size["plain"]}
    true_s = by_remat[True]["compile_s"] if by_remat.get(True, {}).get("fits") else None
    for r in size["plain"]:
      form = f"`remat={r['remat']}`"
      if not r["fits"]:
        refused = f"does not compile: {_out_of_memory(r['error'])} ({r['compile_s']:.1f} s)"
        rows.append([name, form, "", "", "", refused, "", ""] + [""] * 4)
        continue
      ratio = "1" if r["remat"] is True else ""
      rows.append([
        name, form, "", "", "", f"{r['bytes']:,}", "", f"{r['step_ms']:.1f}",
        f"{r['compile_s']:.2f} (compile)", ratio, "", "",
      ])  # fmt: skip
    second = {}
    if warm is not None and name in warm["sizes"]:
      second = {r["memory_budget"]: r for r in warm["sizes"][name]["budgeted"]}
    for r in size["budgeted"]:
      budget = "the device's" if r["memory_budget"] is None else f"{r['memory_budget']:,}"
      if "refused" in r:
        rows.append([name, "`budgeted_jit`", budget, "refused"] + [""] * 8)
        continue
      over = lambda s: f"{s / true_s:.2f}" if true_s else ""
      w = second.get(r["memory_budget"], {})
      rows.append([
        name, "`budgeted_jit`", budget, _plan(r), _compiles(r), f"{r['bytes']:,}",
        f"{r['bytes'] / r['budget']:.3f}", f"{r['step_ms']:.1f}", f"{r['first_s']:.2f}",
        over(r["first_s"]), f"{w['first_s']:.2f}" if "first_s" in w else "",
        over(w["first_s"]) if "first_s" in w else "",
      ])  # fmt: skip
  lines += markdown_table.lines(header, rows, "lllllrrrrrrr")
  repeats = [
    f"{phase} {figures['cold_repeats']}"
    for phase, figures in (("cold", cold), ("second process", warm))
    if figures is not None and "cold_repeats" in figures
  ]
  if repeats:
    lines += ["", f"Compile times: the median of each figure's compiles ({', '.join(repeats)})."]
  if cold.get("sweep"):
    model = f" of {cold['sweep_model']}" if "sweep_model" in cold else ""
    lines += ["", f"`remat=False` by batch{model}:", ""]
    rows = []
    for r in cold["sweep"]:
      if not r["fits"]:
        rows.append([r["batch"], "(not compiled)", "", f"no: {_out_of_memory(r['error'])}", ""])
        continue
      a = r["analysis"]
      peak = a["peak_memory_in_bytes"] + a["generated_code_size_in_bytes"]
      rows.append([r["batch"], f"{r['bytes']:,}", f"{peak:,}", "yes", f"{r['step_ms']:.1f}"])
    header = ["batch", "bytes (the figure)", "XLA's peak + code", "compiles and runs", "step (ms)"]
    lines += markdown_table.lines(header, rows, "rrrlr")
  return "\n".join(lines)


def _write_tables(out: str) -> None:
  """`step_budget.md` under `out`, from the phases' JSON there."""
  read = {}
  for phase in ("cold", "warm"):
    path = os.path.join(out, f"{phase}.json")
    if os.path.exists(path):
      with open(path) as f:
        read[phase] = json.load(f)
  if "cold" in read:
    with open(os.path.join(out, "step_budget.md"), "w") as f:
      f.write(markdown(read["cold"], read.get("warm")) + "\n")


def main(argv):
  del argv
  figures: dict[str, Any] = {
    "environment": environment(),
    "phase": _PHASE.value,
    "cold_repeats": _COLD_REPEATS.value,
    "sizes": {},
  }
  print(json.dumps(figures["environment"]), flush=True)
  for name, size, budgets in SMALL_SIZES if _SMALL.value else SIZES:
    print(f"# {name}: {size}", flush=True)
    rows = figures["sizes"][name] = {"size": size, "plain": [], "budgeted": []}
    if _PHASE.value == "cold":
      for remat in (False, True):
        rows["plain"].append(plain(size, remat, _REPEATS.value, _COLD_REPEATS.value))
    for budget in budgets:
      rows["budgeted"].append(
        budgeted(size, budget, _REPEATS.value, _COLD_REPEATS.value, cold=_PHASE.value == "cold")
      )
  if _PHASE.value == "cold" and _SWEEP.value:
    model, batches = SMALL_SWEEP if _SMALL.value else SWEEP
    print(f"# remat=False by batch: {model}", flush=True)
    figures["sweep_model"] = model
    figures["sweep"] = [
      dict(batch=batch, **plain(dict(model, batch=batch), False, 2)) for batch in batches
    ]
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, f"{_PHASE.value}.json"), "w") as f:
    json.dump(figures, f, indent=1)
  _write_tables(_OUT.value)


if __name__ == "__main__":
  app.run(main)
