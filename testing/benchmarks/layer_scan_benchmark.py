"""The layer scan against the unrolled step: step time, compiled temporaries, compile time (issue 64).

    python -m testing.benchmarks.layer_scan_benchmark --layers=8,24 --out=/tmp/ls   # a TPU
    python -m testing.benchmarks.layer_scan_benchmark --small                          # a CPU check
    python -m testing.benchmarks.layer_scan_benchmark --cpu --layers=8,24 --out=/tmp/lc # the CPU's
    python -m testing.benchmarks.layer_scan_benchmark --profile --dump --out=/tmp/ls   # and where time goes

The training step (value and grad of a next-token loss) of the pre-norm
transformer LM of `testing/transformer.block` (d_model 1024, 8 heads, seq
1024, batch 8, bfloat16; `--small`: toy sizes; `--cpu`: `CPU_SIZE`), its
blocks run as each form of `--forms` says, compiled and run side by side in
one process:

* `inline`: a Python loop of blocks (the unrolled program);
* `hk.layer_stack`: Haiku's layer scan;
* `repeat_layer`: `hkb.repeat_layer` as a user calls it;
* `repeat_layer unroll`: the same with `unroll=True` (the scan unrolled by XLA);
* `repeat_layer save dots+reductions`, `repeat_layer recompute casts+masks`:
  `remat=True` with a checkpoint policy of this file (below), candidates for
  what the scan stores for its backward loop.
* any form's name followed by ` softmax_custom_jvp`: that form with
  `jax.softmax_custom_jvp(True)`, whose softmax keeps its output alone for
  the backward pass (jax 0.10's default keeps exp's output and the quotient,
  two seq x seq arrays a layer, which a scan stores in its stacks; from jax
  0.12 the custom JVP is the default, `jax_softmax_custom_jvp`).
* any scan form's name followed by ` forwarded`: that form with its scan
  `testing/benchmarks/lib/forwarded_scan.scan` (every `jax.lax.scan` the step
  traces), which writes each saved matmul output into its stack as it is
  made and reads it back from there; by ` forwarded reads per use`: the
  same, its backward loop slicing a saved value for each operation reading
  it; by ` forwarded every`: that, with every saved value written as it is
  made, not only matmuls'.

Per form and depth: compiled temporaries
(`memory_analysis().temp_size_in_bytes`), compile time, step time (median of
interleaved repetitions), the ratio of each to inline's, and the gradient's
largest difference to `hk.layer_stack`'s (today's values; inline's where
`hk.layer_stack` is not among the forms; relative to the largest entry; every
form runs on the same params). With `--profile`, each form's device time per
step (on the CPU, its ops' time on the host's threads) by kind of op
(`_KINDS`: matmuls fused with a store into a layer-stacked buffer or a read
from one, other such stores and reads, other matmuls, copies, the rest), from
a profile's trace joined to the compiled HLO; with `--dump` too, each form's
optimised HLO and its device time per op, to read an op's fusion against its
time (`<form>_<layers>.hlo.txt`, `.ops.json`). Writes `layer_scan.json` and
`layer_scan.md` under `--out` after each depth, printing each line as it is
measured.
"""

import collections
import functools
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time
from typing import Any, Callable, Optional
from unittest import mock

from absl import app
from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from testing.benchmarks import accelerator_figures as af
from testing.benchmarks.lib import forwarded_scan
from testing.benchmarks.lib import markdown_table

# --out, --small and --repeats are accelerator_figures' flags.
_OUT, _SMALL, _REPEATS = af._OUT, af._SMALL, af._REPEATS  # pylint: disable=protected-access
_LAYERS = flags.DEFINE_list("layers", ["8"], "Depths to measure.")
_PROFILE = flags.DEFINE_bool(
  "profile", False, "Also: each form's device time by kind of HLO op, from a profile (a TPU)."
)
_DUMP = flags.DEFINE_bool(
  "dump",
  False,
  "With --profile: also each form's optimised HLO (`<form>.hlo.txt`) and device time per op "
  "(`<form>.ops.json`, ms per step) under --out.",
)
_CPU = flags.DEFINE_bool(
  "cpu", False, "The LM at a size for a 2-core CPU (`CPU_SIZE`), not the accelerator's."
)
_FORMS = flags.DEFINE_list(
  "forms", ["inline", "hk.layer_stack", "repeat_layer"], "Forms to measure (see the docstring)."
)

# Primitives whose outputs XLA recomputes inside its fusions for free: a policy
# that saves everything but these stores what an unrolled program would.
_CHEAP = frozenset(
  {
    "convert_element_type",
    "gt",
    "ge",
    "lt",
    "le",
    "eq",
    "ne",
    "select_n",
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
    "transpose",
    "neg",
    "mul",
    "add",
    "sub",
    "max",
    "min",
    "integer_pow",
    "square",
    "rsqrt",
    "sqrt",
    "div",
    "exp",
    "log",
    "tanh",
    "logistic",
    "abs",
    "sign",
    "stop_gradient",
    "copy",
    "copy_p",
  }
)


def _save_dots_and_reductions(prim, *_, **__) -> bool:
  return prim.name in ("dot_general", "reduce_sum", "reduce_max", "reduce_min", "argmax")


def _recompute_casts_and_masks(prim, *_, **__) -> bool:
  return prim.name not in _CHEAP


FORMS: dict[str, dict[str, Any] | None] = {
  "inline": None,
  "hk.layer_stack": None,
  "repeat_layer": {},
  "repeat_layer unroll": dict(unroll=True),
  "repeat_layer save dots+reductions": dict(remat=True, remat_policy=_save_dots_and_reductions),
  "repeat_layer recompute casts+masks": dict(remat=True, remat_policy=_recompute_casts_and_masks),
  "repeat_layer dots_saveable": dict(
    remat=True, remat_policy=jax.checkpoint_policies.dots_saveable
  ),
  "repeat_layer dots_with_no_batch_dims_saveable": dict(
    remat=True, remat_policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  ),
}


# A form's name ending so: the same form with `jax.nn.softmax`'s custom JVP
# (`jax.softmax_custom_jvp`), whose backward keeps the softmax's output alone
# (jax's default differentiates exp, sum and divide, and keeps two
# seq x seq arrays a layer).
SOFTMAX_CUSTOM_JVP = " softmax_custom_jvp"
# A scan form's name ending so: its scan `forwarded_scan.scan` (the longer
# endings: its backward loop slicing a saved value for each reader; and
# every saved value, not only matmuls', written as it is made).
FORWARDED = " forwarded"
FORWARDED_SCANS = {
  " forwarded every": functools.partial(forwarded_scan.scan, reads_per_use=True, every=True),
  " forwarded reads per use": functools.partial(forwarded_scan.scan, reads_per_use=True),
  FORWARDED: forwarded_scan.scan,
}
# Each ending: the context the form before it is traced in.
ENDINGS: dict[str, Callable[[], Any]] = {
  SOFTMAX_CUSTOM_JVP: lambda: jax.softmax_custom_jvp(True),
  **{
    ending: functools.partial(mock.patch.object, jax.lax, "scan", scan)
    for ending, scan in FORWARDED_SCANS.items()
  },
}


def _base(form: str) -> str:
  """`form` without its endings (`ENDINGS`)."""
  ending = next((e for e in ENDINGS if form.endswith(e)), None)
  return form if ending is None else _base(form.removesuffix(ending))


# `--cpu`: the LM's shapes where a 2-core CPU takes a second or so a step.
CPU_SIZE = dict(vocab=256, d_model=256, heads=4, seq=256, batch=4)


def size(small: bool, layers: int, cpu: bool = False) -> dict[str, int]:
  """The accelerator check's LM shapes (`af.lm_size`; `cpu`: `CPU_SIZE`), `layers` deep."""
  return dict(CPU_SIZE if cpu else af.lm_size(small, None), layers=layers)


def loss_fn(form: str, *, vocab: int, d_model: int, heads: int, layers: int, **_) -> Callable:
  """`loss(tokens)` inside a transform: the accelerator check's LM, its blocks as `form` says."""
  model = dict(vocab=vocab, d_model=d_model, heads=heads, layers=layers)
  for ending, context in ENDINGS.items():
    if form.endswith(ending):
      net = loss_fn(form.removesuffix(ending), **model)

      def in_context(*args, net=net, context=context):
        with context():
          return net(*args)

      return in_context
  if form in ("inline", "hk.layer_stack"):
    return af._lm_loss(form, **model)  # pylint: disable=protected-access
  return af._lm_loss("hkb.repeat_layer", repeat_options=FORMS[form], **model)  # pylint: disable=protected-access


def _layer_key(key: str) -> str:
  """A param's name without its layer's scope: `layer_3/mlp/...`, `layers/~/mlp/...` -> `mlp/...`."""
  head, _, rest = key.partition("/")
  if head.startswith("layer_"):
    return rest
  if head == "layers":
    return rest.removeprefix("~/")
  return key


def _flat_grads(form: str, grads: Any, layers: int) -> dict[str, np.ndarray]:
  """Gradients by name without the layers' scope, inline's per-layer params stacked as a scan's."""
  flat = {}
  for module, leaves in grads.items():
    for name, g in leaves.items():
      index = int(module.split("/")[0][len("layer_") :]) if module.startswith("layer_") else 0
      flat.setdefault(_layer_key(f"{module}/{name}"), {})[index] = np.asarray(g, np.float32)
  if _base(form) == "inline":  # Stacked as a scan's, in the layers' order.
    return {k: np.stack([v[i] for i in sorted(v)]) if len(v) > 1 else v[0] for k, v in flat.items()}
  return {k: v[0] for k, v in flat.items()}


def _reference(forms) -> str:
  """The form whose gradients the others' are compared with: `hk.layer_stack` (today's), else inline."""
  forms = list(forms)
  return (
    "hk.layer_stack" if "hk.layer_stack" in forms else "inline" if "inline" in forms else forms[0]
  )


def _grad_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
  """The largest |a - b| over every leaf, relative to the largest |b| (a key bias's is ~0)."""
  scale = max(float(np.max(np.abs(v))) for v in b.values())
  return max(float(np.max(np.abs(a[k] - b[k]))) for k in b) / scale


# What a fused computation does, by the ops in it, first match wins (each
# group of a kind must be in it): a matmul that stores its output into (or
# reads its input from) the layer-stacked buffers a scan's loops keep, other
# stores into and reads from them, other matmuls, copies, and the rest
# (elementwise, reductions).
_MATMUL, _STORE, _READ = {"convolution", "dot"}, {"dynamic-update-slice"}, {"dynamic-slice"}
_KINDS = (
  ("matmuls storing to stacks", (_MATMUL, _STORE)),
  ("matmuls reading stacks", (_MATMUL, _READ)),
  ("stacked stores", (_STORE,)),
  ("stacked reads", (_READ,)),
  ("matmuls", (_MATMUL,)),
  ("copies", ({"copy", "copy-start", "copy-done", "transpose"},)),
)


def _op_kinds(hlo: str) -> dict[str, str]:
  """Each instruction of an optimised HLO module -> its kind (`_KINDS`, else "other")."""
  bodies, ops, current = collections.defaultdict(set), {}, None
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      current = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
      continue
    m = re.match(r"\s+(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][\w\-]*)\(", line)
    if m and current:
      name, op = m.groups()
      bodies[current].add(op)
      calls = re.search(r"calls=(%[\w.\-]+)", line)
      ops[name] = (op, calls.group(1) if calls else None)
  kinds = {}
  for name, (op, calls) in ops.items():
    inside = bodies.get(calls, set()) | {op}
    kinds[name] = (
      "loop"
      if op == "while"
      else next((kind for kind, groups in _KINDS if all(inside & g for g in groups)), "other")
    )
  return kinds


def by_kind(hlo: str, per_op: dict[str, float]) -> dict[str, float]:
  """`per_op`'s milliseconds summed by kind of op (`_op_kinds` of `hlo`); a loop's own left out (its body's ops are counted)."""
  kinds = _op_kinds(hlo)
  totals: collections.Counter[str] = collections.Counter()
  for name, ms in per_op.items():
    kind = kinds.get(name, "other")
    if kind != "loop":
      totals[kind] += ms
  return dict(totals)


def device_time_by_op(compiled: Any, args: tuple[Any, ...], steps: int = 3) -> dict[str, float]:
  """Milliseconds per step on the device of each op (by its HLO name), from a profile's trace.

  On the CPU, where the trace has no device, each op's thunk as the host
  threads ran it (events named as the compiled program's instructions).
  """
  jax.block_until_ready(compiled(*args))
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder):
      for _ in range(steps):
        jax.block_until_ready(compiled(*args))
    (path,) = glob.glob(f"{folder}/plugins/profile/*/*.trace.json.gz")
    with gzip.open(path) as f:
      events = json.load(f)["traceEvents"]
  meta = {
    (e["pid"], e.get("tid")): e["args"]["name"]
    for e in events
    if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name")
  }
  on_cpu = jax.default_backend() == "cpu"
  instructions = set(_op_kinds(compiled.as_text())) if on_cpu else set()
  totals: collections.Counter[str] = collections.Counter()
  for e in events:
    if e.get("ph") != "X":
      continue
    on_device = "/device:" in meta.get((e.get("pid"), None), "")
    if on_cpu and e["name"] in instructions:
      totals[e["name"]] += e["dur"] / 1e3 / steps
    elif on_device and meta.get((e["pid"], e["tid"])) == "XLA Ops":
      totals[e["name"]] += e["dur"] / 1e3 / steps
  return dict(totals)


def measure(
  layers: int,
  forms: list[str],
  small: bool,
  repeats: int,
  profile: bool = False,
  dump: Optional[str] = None,
  cpu: bool = False,
) -> dict[str, Any]:
  """Each form's step at `layers` deep (see the module's docstring); `dump`: a folder for `--dump`'s files."""
  shape = size(small, layers, cpu)
  af.say(f"Transformer LM training step, {shape}, bfloat16:")
  tokens = jax.random.randint(
    jax.random.PRNGKey(1), [shape["batch"], shape["seq"] + 1], 0, shape["vocab"]
  )
  # Every form runs on the same values: hk.layer_stack's, unstacked for inline.
  init = lambda form: jax.jit(hk.transform(loss_fn(form, **shape)).init)(
    jax.random.PRNGKey(0), tokens
  )
  stacked = {
    _layer_key(f"{m}/{n}"): v for m, d in init("hk.layer_stack").items() for n, v in d.items()
  }

  def same_values(form):
    def value(module, name):
      v = stacked[_layer_key(f"{module}/{name}")]
      return v[int(module.split("/")[0][len("layer_") :])] if module.startswith("layer_") else v

    return {m: {n: value(m, n).astype(jnp.bfloat16) for n in d} for m, d in init(form).items()}

  steps, rows, grads = {}, {}, {}
  for form in forms:
    f = hk.transform(loss_fn(form, **shape))
    params = same_values(form)
    step = jax.jit(jax.value_and_grad(lambda p, t, f=f: f.apply(p, None, t)))
    start = time.perf_counter()
    try:
      compiled = step.lower(params, tokens).compile()
    except Exception as e:  # pylint: disable=broad-except  # Out of memory: a figure too.
      af.say(f"  {form}: did not compile: {str(e).splitlines()[0][:200]}")
      rows[form] = {"error": str(e).splitlines()[0][:200]}
      continue
    seconds = time.perf_counter() - start
    temp = compiled.memory_analysis().temp_size_in_bytes
    loss, g = compiled(params, tokens)
    grads[form] = _flat_grads(form, g, layers)
    rows[form] = {"compile_s": seconds, "temp_bytes": temp, "loss": float(loss)}
    af.say(
      f"  {form}: compiled in {seconds:.1f} s, temporaries {temp / 2**20:.0f} MiB, loss {float(loss):.6f}"
    )
    steps[form] = (compiled, (params, tokens))
  samples = af._interleaved(steps, repeats)  # pylint: disable=protected-access
  base = "inline" if "inline" in steps else next(iter(steps))
  today = _reference(steps)
  for form in steps:
    r = rows[form]
    r["step_ms"] = statistics.median(samples[form]) * 1e3
    r["time_over_inline"] = af._ratios(samples, form, base)  # pylint: disable=protected-access
    r["temp_over_inline"] = r["temp_bytes"] / max(rows[base]["temp_bytes"], 1)
    r["grad_difference"] = _grad_difference(grads[form], grads[today])
    if profile:
      compiled, args = steps[form]
      per_op = device_time_by_op(compiled, args)
      r["device_ms_by_kind"] = by_kind(compiled.as_text(), per_op)
      af.say(f"  {form}: device time by kind (ms per step): {r['device_ms_by_kind']}")
      if dump is not None:
        stem = os.path.join(dump, f"{re.sub(r'[^A-Za-z0-9_.-]', '_', form)}_{layers}")
        with open(f"{stem}.hlo.txt", "w") as f:
          f.write(compiled.as_text())
        with open(f"{stem}.ops.json", "w") as f:
          json.dump(per_op, f, indent=0)
  return {"size": shape, "rows": rows}


def markdown(figures: dict[str, Any]) -> str:
  """The figures as Markdown: per depth, a row per form, then (profiled) device time by kind."""
  env = figures["environment"]
  # The compiler's flags where the run set any (XLA:TPU's are LIBTPU_INIT_ARGS).
  flags = "".join(f", {k}={env[k]!r}" for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS") if env.get(k))
  lines = [
    f"{env['date']}, {env['device']} ({env['backend']}), jax {env['jax']}, "
    f"dm-haiku {env['dm-haiku']}{flags}."
  ]
  for depth in figures["depths"]:
    reference = _reference(f for f, r in depth["rows"].items() if "error" not in r)
    header = [
      "form", "step (ms)", "/ inline (median [min–max])", "temporaries (MiB)", "/ inline",
      "compile (s)", f"grads vs {reference}",
    ]  # fmt: skip
    rows = []
    for form, r in depth["rows"].items():
      if "error" in r:
        rows.append([form, "did not compile: " + r["error"].replace("|", "/")] + [""] * 5)
        continue
      t = r["time_over_inline"]
      rows.append([
        form, f"{r['step_ms']:.2f}", f"{t['median']:.3f} [{t['min']:.3f}–{t['max']:.3f}]",
        f"{r['temp_bytes'] / 2**20:.0f}", f"{r['temp_over_inline']:.3f}",
        f"{r['compile_s']:.1f}", f"{r['grad_difference']:.1e}",
      ])  # fmt: skip
    lines += ["", f"{depth['size']}:", ""] + markdown_table.lines(header, rows, align="lrlrrrr")
    profiled = {
      f: r["device_ms_by_kind"] for f, r in depth["rows"].items() if r.get("device_ms_by_kind")
    }
    if profiled:
      # The kinds any form ran (a run before the matmuls storing to stacks
      # were told apart has none of them), in `_KINDS`' order.
      kinds = [k for k, _ in _KINDS if any(k in t for t in profiled.values())] + ["other"]
      rows = [
        [form] + [f"{t.get(k, 0.0):.2f}" for k in kinds] + [f"{sum(t.values()):.2f}"]
        for form, t in profiled.items()
      ]
      threads = (
        "; on the CPU, summed over the threads that ran them" if env["backend"] == "cpu" else ""
      )
      lines += [
        "",
        f"Device time per step by kind of op (ms, from a profile of 3 steps{threads}):",
        "",
      ]
      lines += markdown_table.lines(
        ["form"] + kinds + ["total"], rows, "l" + "r" * (len(kinds) + 1)
      )
  return "\n".join(lines)


def main(argv):
  del argv
  os.makedirs(_OUT.value, exist_ok=True)
  figures = {"environment": af.environment(), "depths": []}
  af.say(f"{figures['environment']}")
  for layers in _LAYERS.value:
    figures["depths"].append(
      measure(
        int(layers),
        _FORMS.value,
        _SMALL.value,
        _REPEATS.value,
        _PROFILE.value,
        _OUT.value if _DUMP.value else None,
        _CPU.value,
      )
    )
    with open(os.path.join(_OUT.value, "layer_scan.json"), "w") as f:
      json.dump(figures, f, indent=1)
    with open(os.path.join(_OUT.value, "layer_scan.md"), "w") as f:
      f.write(markdown(figures) + "\n")
    af.say(markdown(figures))


if __name__ == "__main__":
  app.run(main)
