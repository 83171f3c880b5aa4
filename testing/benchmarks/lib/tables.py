"""The Markdown tables of a run (`tables.md`): figures only, no conclusions.

Conclusions are written by people, in RESULTS.md, from these tables.
"""

from typing import Hashable, Optional

from testing.benchmarks.lib import harness
from testing.benchmarks.lib import markdown_table
from testing.benchmarks.lib import models
from testing.benchmarks.lib import plot
from testing.benchmarks.lib import trace_profile
from testing.benchmarks.lib import trace_rows
from testing.benchmarks.lib import targets as targets_lib
from testing.benchmarks.lib.mlp_bench import EVAL_SHAPE
from testing.benchmarks.lib.mlp_bench import EVAL_SHAPE_FRESH
from testing.benchmarks.lib.mlp_bench import INIT
from testing.benchmarks.lib.mlp_bench import TIMED_VARIANTS
from testing.benchmarks.lib.mlp_bench import TraceKey
from testing.benchmarks.lib.results import Results
from testing.benchmarks.lib.stack_bench import StackKey

DASH = "—"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  return markdown_table.lines(header, rows) + [""]


def _bytes(n: Optional[int]) -> str:
  if n is None:
    return "n/a"
  if abs(n) >= 1 << 20:
    return f"{n / (1 << 20):.2f} MiB"
  if abs(n) >= 1 << 10:
    return f"{n / (1 << 10):.1f} KiB"
  return f"{n} B"


def _ms(samples: harness.Samples, key: Hashable, phase: str, digits: int = 2) -> str:
  if key not in samples:
    return DASH
  return harness.Stat.of(samples[key][phase]).ms(digits)


def _ratio(samples: harness.Samples, num: Hashable, den: Hashable, phase: str) -> str:
  if num not in samples or den not in samples:
    return DASH
  return harness.pair_ratios(samples, num, den, phase).ratio()


def _stat(stat: Optional[harness.Stat]) -> str:
  return DASH if stat is None else stat.ratio()


def run_section(res: Results) -> list[str]:
  cfg = res.cfg
  md = [
    "## Run",
    "",
    f"- Command: `{res.command}`",
    f"- Mode: {cfg.mode}",
    f"- Date: {res.date}",
    f"- Total run time: {res.run_s:.0f} s",
    f"- Repetitions kept (after {cfg.warmup} warm-up, "
    f"{cfg.compile_warmup} for compile): trace {cfg.trace_repeats}, "
    f"fresh process {cfg.fresh_process_repeats} (no warm-up), compile "
    f"{cfg.compile_repeats}, step {cfg.step_repeats} (each sample "
    f"≥ {cfg.step_block_s * 1e3:g} ms of calls); profiles "
    f"{cfg.profile_repeats} traces, {cfg.fresh_profile_repeats} in fresh "
    "processes.",
    "",
  ]
  return md + _table(["", ""], [[k, f"`{v}`"] for k, v in res.env.items()])


def targets_section(targets: list[targets_lib.Target]) -> list[str]:
  md = [
    "## Targets",
    "",
    "Wall-clock ratio (its median decides), the same ratio from process "
    "CPU time, the A/A control (two equal programs) and `hk.lift`'s "
    "ratio to inline.",
    "",
  ]
  rows = []
  for t in targets:
    result = (
      "n/a" if t.ratio is None else "PASS" if t.passed else f"**MISS** (+{t.miss_by * 100:.1f}%)"
    )
    rows.append(
      [
        t.name,
        f"≤ {t.goal:.2f}",
        _stat(t.ratio),
        _stat(t.cpu_ratio),
        _stat(t.control),
        _stat(t.lift),
        result,
      ]
    )
  md += _table(
    ["target", "goal", "measured (wall)", "CPU time", "A/A control", "hk.lift beside", "result"],
    rows,
  )
  passed = sum(t.passed for t in targets)
  return md + [f"{passed} of {len(targets)} targets met.", ""]


def _mlp_times(res: Results) -> list[str]:
  rows = []
  for r in res.mlp:
    for v in TIMED_VARIANTS:
      rows.append(
        [r.size.name, f"`{v}`", _ms(r.trace, TraceKey(v, INIT), "trace")]
        + [_ms(r.trace, TraceKey(v, row), "trace") for row in trace_rows.APPLY_ROWS]
        + [_ms(r.compile, v, "compile", 1), _ms(r.step, v, "step", 3)]
      )
  return _table(
    ["size", "variant", "init trace"]
    + [f"apply trace, {row}" for row in trace_rows.APPLY_ROWS]
    + ["compile (grad step)", "step (fwd+bwd)"],
    rows,
  )


def _mlp_ratios(res: Results) -> list[str]:
  rows = []
  for r in res.mlp:
    for v in TIMED_VARIANTS[1:]:
      rows.append(
        [r.size.name, f"`{v}`"]
        + [
          _ratio(r.trace, TraceKey(v, row), TraceKey(models.INLINE, row), "trace")
          for row in (INIT,) + trace_rows.APPLY_ROWS
        ]
        + [_ratio(r.compile, v, models.INLINE, "compile"), _ratio(r.step, v, models.INLINE, "step")]
      )
  return _table(
    ["size", "variant", "init trace"]
    + [f"apply trace, {row}" for row in trace_rows.APPLY_ROWS]
    + ["compile", "step"],
    rows,
  )


def _fresh_process(res: Results) -> list[str]:
  rows = []
  for r in res.mlp:
    for v in TIMED_VARIANTS:
      key = TraceKey(v, trace_rows.FRESH_PROCESS)
      inline = TraceKey(models.INLINE, trace_rows.FRESH_PROCESS)
      rows.append(
        [
          r.size.name,
          f"`{v}`",
          _ms(r.trace, key, "trace"),
          _ms(r.trace, key, "lower"),
          _ratio(r.trace, key, inline, "trace"),
          _ratio(r.trace, key, inline, "lower"),
        ]
      )
  return _table(
    [
      "size",
      "variant",
      "first trace (ms)",
      "its lowering (ms)",
      "trace / inline",
      "lowering / inline",
    ],
    rows,
  )


def _excess(res: Results) -> list[str]:
  rows = []
  for r in res.mlp:

    def med(key, r=r):
      return harness.median_ms(r.trace, key, "trace")

    for v in models.BRIDGED:
      rows.append(
        [r.size.name, f"`{v}`"]
        + [
          f"{med(TraceKey(v, row)) - med(TraceKey(models.INLINE, row)):+.2f}"
          for row in trace_rows.APPLY_ROWS
        ]
        + [_ms(r.trace, TraceKey(v, EVAL_SHAPE), "trace")]
      )
  return _table(
    ["size", "variant"]
    + [f"excess, {row}" for row in trace_rows.APPLY_ROWS]
    + ["eval_shape(init) alone"],
    rows,
  )


def _floor(res: Results) -> list[str]:
  """A pure function's first traces against inline + `eval_shape(init)`."""
  rows = []
  for r in res.mlp:

    def med(variant, row, r=r):
      return harness.median_ms(r.trace, TraceKey(variant, row), "trace")

    for row, shaping in (
      (trace_rows.NEW_SHAPE, EVAL_SHAPE),
      (trace_rows.NEW_MODEL, EVAL_SHAPE),
      (trace_rows.FRESH_PROCESS, EVAL_SHAPE_FRESH),
    ):
      inline = med(models.INLINE, row)
      shape = med(models.BRIDGED_PURE, shaping)
      bridged = med(models.BRIDGED_PURE, row)
      if None in (inline, shape, bridged):
        continue
      rows.append(
        [
          r.size.name,
          row,
          f"{inline:.2f}",
          f"{shape:.2f}",
          f"{bridged:.2f}",
          f"{(inline + shape) / inline:.3f}",
          f"{bridged / inline:.3f}",
          f"{bridged - inline - shape:+.2f}",
        ]
      )
  return _table(
    [
      "size",
      "row",
      "inline (ms)",
      "eval_shape(init) alone (ms)",
      f"`{models.BRIDGED_PURE}` (ms)",
      "floor / inline",
      "bridged / inline",
      "bridged − floor (ms)",
    ],
    rows,
  )


def _profiles(profiles: list[trace_profile.TraceProfile]) -> list[str]:
  if not profiles:
    return []
  counted = list(trace_profile.COUNTED_CALLS)
  md = [
    "### Profiles of the apply trace",
    "",
    f"cProfile, size {profiles[0].size}. Calls per trace (exact), ms per "
    "trace under the profiler (inflated by it: compare shares):",
    "",
  ]
  md += _table(
    ["row", "variant", "ms / trace (profiled)"] + [f"{c} / trace" for c in counted],
    [
      [p.row, f"`{p.variant}`", f"{p.total_s * 1e3:.2f}"] + [f"{p.counts[c]:.0f}" for c in counted]
      for p in profiles
    ],
  )
  packages = sorted({k for p in profiles for k in p.self_share_by_package})
  md += ["Self time by package, share of the trace:", ""]
  md += _table(
    ["row", "variant"] + packages,
    [
      [p.row, f"`{p.variant}`"]
      + [f"{p.self_share_by_package.get(k, 0.0) * 100:.0f}%" for k in packages]
      for p in profiles
    ],
  )
  for p in profiles:
    if p.variant == models.INLINE:
      continue
    md += [
      f"`{p.variant}`, {p.row}: the bridge's functions, the model "
      "function, `jax.eval_shape`, `hk.get_parameter` "
      f"({p.total_s * 1e3:.2f} ms / trace profiled):",
      "",
    ]
    md += _table(
      ["function", "calls / trace", "cumulative ms / trace", "share of trace"],
      [
        [
          f"`{row.function}`",
          f"{row.calls:.0f}",
          f"{row.cumulative_s * 1e3:.2f}",
          f"{row.share * 100:.0f}%",
        ]
        for row in p.rows
      ],
    )
  return md


def mlp_section(res: Results) -> list[str]:
  md = [
    "## 1. `call_pure` vs inline Haiku vs `hk.lift`",
    "",
    "Sizes: "
    + ", ".join(
      f"{s.name} (width {s.width}, depth {s.depth}, batch {s.batch})" for s in res.cfg.mlp_sizes
    )
    + ".",
    "",
    "### Times (ms)",
    "",
  ]
  md += _mlp_times(res)
  md += ["### Ratios to inline (wall clock)", ""]
  md += _mlp_ratios(res)
  md += ["### Fresh process: first trace and its lowering", ""]
  md += _fresh_process(res)
  md += ["### Bridged apply trace: excess over inline (ms) and `eval_shape(init)` alone", ""]
  md += _excess(res)
  md += [
    f"### `{models.BRIDGED_PURE}`: first traces against their floor",
    "",
    "The floor is inline's trace plus `eval_shape(init)` alone (in a "
    "fresh process, the first one there), which a first trace must "
    "run to know the params' structure. Medians of each column.",
    "",
  ]
  md += _floor(res)
  return md + _profiles(res.profiles)


def _stack_times(res: Results) -> list[str]:
  stack, rows = res.stack, []
  for d in res.cfg.depths:
    for remat in (False, True):
      for v in models.STACK_VARIANTS:
        k = StackKey(d, remat, v)
        base = StackKey(d, remat, models.LAYER_STACK)
        rows.append(
          [
            str(d),
            "yes" if remat else "no",
            f"`{v}`",
            _ms(stack.compile, k, "trace", 1),
            _ms(stack.compile, k, "compile", 1),
            _ms(stack.compile, k, "total", 1),
            _ms(stack.step, k, "step", 3),
            _ratio(stack.step, k, base, "step"),
            _ratio(stack.step, k, base, "step" + harness.CPU),
            _bytes(stack.temp_bytes[k]),
          ]
        )
  return _table(
    [
      "depth",
      "remat",
      "variant",
      "trace (ms)",
      "compile (ms)",
      "trace+compile (ms)",
      "step (ms)",
      "step / layer_stack",
      "same, CPU time",
      "temp memory",
    ],
    rows,
  )


def _stack_flatness(res: Results) -> list[str]:
  shallow, _ = targets_lib.flat_depths(res.cfg.depths)
  rows = []
  for remat in (False, True):
    for v in models.STACK_VARIANTS:
      rows.append(
        [f"`{v}`", "yes" if remat else "no"]
        + [
          _ratio(res.stack.compile, StackKey(d, remat, v), StackKey(shallow, remat, v), "total")
          for d in res.cfg.depths
        ]
      )
  return [f"Trace+compile time relative to depth {shallow}:", ""] + _table(
    ["variant", "remat"] + [f"depth {d}" for d in res.cfg.depths], rows
  )


def stack_section(res: Results) -> list[str]:
  cfg = res.cfg
  md = [
    "## 2. Layer scan vs `hk.layer_stack` vs unrolled loop",
    "",
    f"Layer `x + hk.nets.MLP([{cfg.stack_width}, {cfg.stack_width}])(x)`"
    f", input `[{cfg.stack_batch}, {cfg.stack_width}]`, training step.",
    "",
  ]
  return md + _stack_times(res) + _stack_flatness(res)


def markdown(res: Results) -> str:
  md = [
    "# haiku_bridge benchmark tables",
    "",
    "Written by `testing/benchmarks/benchmark.py` with `results.json`; conclusions "
    "are in `RESULTS.md`. Times: median [min–max] over the kept "
    "repetitions; ratios: median [min–max] of per-repetition pairs.",
    "",
  ]
  md += run_section(res) + targets_section(res.targets)
  md += mlp_section(res) + stack_section(res)
  md += ["## Plot", "", f"![trace+compile time vs depth, ratios, memory]({plot.FILE})"]
  return "\n".join(md) + "\n"
