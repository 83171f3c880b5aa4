r"""Benchmark of the layer scan as a pipeline (issue 21): memory per device, bubble, step time.

A transformer block stack (`testing/transformer.py`'s blocks) trained under
`layer_scan(pipeline=hkb.Pipeline(...))` on a `(stage=S, data=8/S)` mesh of
8 CPU devices, beside the same stack data-parallel over all 8 (`data=8`, no
pipeline). For each S, schedule and microbatch count M it reports:

* param bytes per device: the stack's, with its layer axis over `stage`
  (1/S of the data-parallel run's, which keeps every layer everywhere);
* peak temporaries per device of the jitted grad step (XLA's memory
  analysis of the compiled step);
* the bubble: idle stage-steps counted from the schedule the pipeline runs
  (`pipeline.schedule`), against GPipe's (S-1)/(M+S-1);
* step time over the data-parallel step time, median [min–max] of ratios
  paired within a repetition (every compiled step runs once per
  repetition, in an order rotated each time: `harness.interleaved`), with
  the process-CPU-time median beside it. The 8 devices are simulated by XLA
  on this machine's CPU cores, so the stages share cores and ppermute is a
  memory copy: the ratio says what the schedule costs in compute (idle
  slots still compute, masked), not what a pipeline over a real
  interconnect gains. Timings never fail the program.

Then the cost table (issues 34 and 43; no step is run): a residual MLP
stack whose params dominate, compiled as a user writes it (the loss after
the stack; params as init returns them, or stored over the stages) on
Explicit and Auto axes, for each (S, schedule, M): per-device temporaries
against the bound of docs/sharding.md (3x the stage's params), and the
bytes each collective kind moves per device and step, measured from the
optimised HLO against theory (testing/pipeline_cost.py). `--cost_only`
prints it alone. `--plot=PATH` also draws its temporaries against M (an
SVG, written here without a plotting library): a panel per S, a line per
schedule and axis type, the bound dashed.

    bazel run //testing/benchmarks:pipeline_benchmark              # ~4 minutes
    bazel run //testing/benchmarks:pipeline_benchmark -- --cost_only  # ~1 minute
    bazel run //testing/benchmarks:pipeline_benchmark -- --quick   # smoke run
    bazel run //testing/benchmarks:pipeline_benchmark -- --cost_only \
        --plot=$PWD/testing/benchmarks/results/pipeline_memory.svg

or, without Bazel, from the repository root:

    PYTHONPATH=. python3 testing/benchmarks/pipeline_benchmark.py [--quick]
"""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import functools
import math
import sys
import time
from typing import Any, Callable, Optional

from absl import app
from absl import flags
import haiku as hk
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import haiku_bridge as hkb
from haiku_bridge._src import pipeline as pipeline_lib
from testing import pipeline_cost
from testing import transformer
from testing.benchmarks.lib import environment
from testing.benchmarks.lib import harness
from testing.benchmarks.lib import markdown_table
from testing.benchmarks.lib import svg

_QUICK = flags.DEFINE_bool("quick", False, "Smoke mode: a tiny stack, one timed step.")
_COST_ONLY = flags.DEFINE_bool(
  "cost_only",
  False,
  "Only the cost table (compiled memory and "
  "collectives of the residual MLP stack): no step is run.",
)
_PLOT = flags.DEFINE_string(
  "plot", "", "Where to write the cost table's temporaries against M, an SVG; empty: no plot."
)


@dataclasses.dataclass(frozen=True)
class Config:
  mode: str
  layers: int
  d_model: int
  seq: int
  batch: int
  stages: tuple[int, ...]
  microbatches: tuple[str, ...]  # Multiples of S: "1", "S", "2S", "4S".
  repeats: int  # Step-time samples of each step, side by side.
  step_block_s: float  # Each sample times calls for about this long.


FULL = Config(
  "full",
  layers=8,
  d_model=32,
  seq=16,
  batch=64,
  stages=(2, 4),
  microbatches=("1", "S", "2S", "4S"),
  repeats=7,
  step_block_s=0.3,
)
QUICK = Config(
  "quick",
  layers=4,
  d_model=16,
  seq=4,
  batch=16,
  stages=(2,),
  microbatches=("2S",),
  repeats=1,
  step_block_s=0.0,
)
HEADS = 4
BASELINE = "data-parallel"  # The step-time samples' key of the baseline.


@dataclasses.dataclass(frozen=True)
class Row:
  stages: int
  schedule: str
  microbatches: int
  param_bytes: int  # The stack's, on one device.
  temp_bytes: int
  bubble: float
  gpipe_bubble: float  # (S-1)/(M+S-1).
  step_ratio: harness.Stat  # Step time / data-parallel's, paired.
  step_cpu_ratio: harness.Stat  # The same from process CPU time.


def microbatch_count(name: str, stages: int) -> int:
  return {"1": 1, "S": stages, "2S": 2 * stages, "4S": 4 * stages}[name]


def loss_fn(cfg: Config, pipeline: Optional[hkb.Pipeline]) -> hk.Transformed:
  layer = functools.partial(transformer.block, d_model=cfg.d_model, heads=HEADS)

  def loss(h):
    h = hkb.repeat_layer(layer, h, cfg.layers, name="layers", pipeline=pipeline)
    return jnp.mean(h**2)

  return hk.transform(loss)


@dataclasses.dataclass(frozen=True)
class Compiled:
  param_bytes: int  # The stack's, on device 0.
  temp_bytes: int  # Peak temporaries per device of the grad step.
  step: Callable[[], Any]  # One step, blocked on.


def compile_step(
  cfg: Config, mesh_shape: dict[str, int], pipeline: Optional[hkb.Pipeline]
) -> Compiled:
  """The grad step on a mesh of `mesh_shape`, compiled, and its memory."""
  mesh = jax.make_mesh(
    tuple(mesh_shape.values()), tuple(mesh_shape), axis_types=(AxisType.Auto,) * len(mesh_shape)
  )
  f = loss_fn(cfg, pipeline)
  x = jax.random.normal(jax.random.PRNGKey(1), [cfg.batch, cfg.seq, cfg.d_model])
  stacked = {"layers": "stage"} if "stage" in mesh_shape else {}
  rules = hkb.ShardingRules([], stacked=stacked)
  with jax.set_mesh(mesh):
    shapes = jax.eval_shape(f.init, jax.random.PRNGKey(0), x)
    shardings = hkb.param_shardings(shapes, mesh, rules)
    params = jax.jit(f.init, out_shardings=shardings)(jax.random.PRNGKey(0), x)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    step = jax.jit(jax.grad(f.apply), out_shardings=shardings)
    compiled = step.lower(params, None, x).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
  device = jax.devices()[0]
  param_bytes = sum(
    shard.data.nbytes
    for leaf in jax.tree.leaves(params)
    for shard in leaf.addressable_shards
    if shard.device == device
  )
  return Compiled(param_bytes, temp, lambda: jax.block_until_ready(compiled(params, None, x)))


def run(cfg: Config) -> tuple[Compiled, float, list[Row]]:
  """The data-parallel baseline, its step seconds and a row per (S, schedule, M).

  Every step is compiled first; then the step times are sampled side by
  side, so each row's ratio pairs it with the baseline's sample of the same
  repetition.
  """
  baseline = compile_step(cfg, {"data": 8}, None)
  pipes, compiled = {}, {}
  for stages in cfg.stages:
    for schedule in pipeline_lib.SCHEDULES:
      for name in cfg.microbatches:
        m = microbatch_count(name, stages)
        print(f"pipeline: S={stages} {schedule} M={m}", file=sys.stderr)
        key = (stages, schedule, m)
        pipes[key] = hkb.Pipeline("stage", m, schedule)
        compiled[key] = compile_step(cfg, {"stage": stages, "data": 8 // stages}, pipes[key])
  steps = {key: c.step for key, c in compiled.items()}
  steps[BASELINE] = baseline.step
  samples = harness.interleaved(
    "pipeline: step times",
    [{key: harness.step_timer(step, (), cfg.step_block_s) for key, step in steps.items()}],
    cfg.repeats,
    warmup=1,
  )
  rows = []
  for (stages, schedule, m), c in compiled.items():
    timetable = pipeline_lib.timetable(
      stages, m, pipes[(stages, schedule, m)].num_repeats(cfg.layers, stages)
    )
    rows.append(
      Row(
        stages,
        schedule,
        m,
        c.param_bytes,
        c.temp_bytes,
        timetable.bubble,
        (stages - 1) / (m + stages - 1),
        *(
          harness.pair_ratios(samples, (stages, schedule, m), BASELINE, phase)
          for phase in ("step", "step" + harness.CPU)
        ),
      )
    )
  base_step = harness.Stat.of(samples[BASELINE]["step"]).median
  return baseline, base_step, rows


def markdown(cfg: Config, baseline: Compiled, base_step: float, rows: list[Row]) -> str:
  base_params, base_temp = baseline.param_bytes, baseline.temp_bytes
  lines = [
    f"Stack: {cfg.layers} transformer blocks, d_model {cfg.d_model}, "
    f"{HEADS} heads; batch {cfg.batch} × {cfg.seq} tokens; grad step. "
    f"Baseline: data-parallel over 8 devices, no pipeline: "
    f"{base_params} param bytes and {base_temp} temp bytes per device, "
    f"{base_step * 1e3:.1f} ms per step (median). Circular: one layer per "
    f"stage per pass (repeats = N/S). Step time: median [min–max] of "
    f"{cfg.repeats} ratios paired within a repetition (process CPU time "
    f"median).",
    "",
  ]
  lines += markdown_table.lines(
    [
      "S",
      "schedule",
      "M",
      "param bytes / device",
      "× baseline",
      "temp bytes / device",
      "bubble (schedule)",
      "(S-1)/(M+S-1)",
      "step time / data-parallel",
    ],
    [
      [
        r.stages,
        r.schedule,
        r.microbatches,
        r.param_bytes,
        f"{r.param_bytes / base_params:.3f}",
        r.temp_bytes,
        f"{r.bubble:.3f}",
        f"{r.gpipe_bubble:.3f}",
        f"{r.step_ratio.ratio()} ({r.step_cpu_ratio.median:.2f})",
      ]
      for r in rows
    ],
  )
  return "\n".join(lines) + "\n"


# The cost table's step and theory: testing/pipeline_cost.py (docs/sharding.md,
# "What a pipelined step costs"), a residual MLP whose params dominate its memory.
COST_LAYERS, COST_BATCH = pipeline_cost.LAYERS, 32
COST_BOUND = 3  # Temporaries per device, in the stage's params.
AXIS_TYPES = (AxisType.Explicit, AxisType.Auto)


@dataclasses.dataclass(frozen=True)
class CostConfig:
  width: int
  stages: tuple[int, ...]
  microbatches: tuple[str, ...]


FULL_COST = CostConfig(width=256, stages=(2, 4), microbatches=("1", "S", "4S"))
QUICK_COST = CostConfig(width=16, stages=(2,), microbatches=("S",))


@dataclasses.dataclass(frozen=True)
class CostRow:
  stages: int
  schedule: str
  microbatches: int
  placement: str  # pipeline_cost.PLACEMENTS: as init returns them, or over "stage".
  stage_param_bytes: float  # The stack's params over S.
  temp_bytes: dict[str, int]  # Per axis type: peak temporaries per device.
  # Per axis type: (measured, theory) bytes per device and step, by
  # pipeline_cost.ROWS.
  collective_bytes: dict[str, dict[str, tuple[int, float]]]


def cost_row(cfg: CostConfig, stages: int, schedule: str, m: int, placement: str) -> CostRow:
  """The user's step (the loss after the stack) on both axis types."""
  pipe = hkb.Pipeline("stage", m, schedule)
  temp, moved = {}, {}
  for kind in AXIS_TYPES:
    step = pipeline_cost.compiled_step(
      (stages, 8 // stages), kind, cfg.width, pipe, placement=placement, batch=COST_BATCH
    )
    temp[kind.name] = step.compiled.memory_analysis().temp_size_in_bytes
    measured, theory = pipeline_cost.measured(step), pipeline_cost.theory(step)
    moved[kind.name] = {row: (measured[row], theory[row]) for row in pipeline_cost.ROWS}
  return CostRow(stages, schedule, m, placement, step.stage_param_bytes, temp, moved)


def cost_rows(cfg: CostConfig) -> list[CostRow]:
  rows = []
  for stages in cfg.stages:
    for schedule in pipeline_lib.SCHEDULES:
      for name in cfg.microbatches:
        m = microbatch_count(name, stages)
        for placement in pipeline_cost.PLACEMENTS:
          print(f"cost: S={stages} {schedule} M={m} {placement}", file=sys.stderr)
          rows.append(cost_row(cfg, stages, schedule, m, placement))
  return rows


def bytes_cell(measured: int, theory: float) -> str:
  """`measured (measured / theory)`; a theory of 0 said so."""
  if theory:
    return f"{measured} ({measured / theory:.2f})"
  return "0" if not measured else f"{measured} (theory 0)"


def cost_markdown(cfg: CostConfig, rows: list[CostRow]) -> str:
  lines = [
    f"Cost: {COST_LAYERS} residual MLP blocks (two Linears of width "
    f"{cfg.width}), batch {COST_BATCH}, `jax.value_and_grad` of apply, on "
    f"a (stage=S, data=8/S) mesh, Explicit and Auto axes, the params as "
    f"init returns them (`init`) or stored over the stages (`stage`). "
    f"Temporaries per device (`memory_analysis().temp_size_in_bytes`) in "
    f"the stage's params (the bound: {COST_BOUND}). Bytes per device and "
    f"step by collective kind (`hlo_collectives`: each op's bytes times "
    f"the trip counts of the loops around it), measured (measured / "
    f"theory); theory in testing/pipeline_cost.py: all-gather the "
    f"gradient whole (S × stage params) for `init`, all-reduce over data "
    f"the stage's gradient once (+ the loss's 4 bytes), over stage the "
    f"stack's output (M microbatches), collective-permute 2 microbatches "
    f"per timetable step (+ 2 × stage params for circular `stage`: the "
    f"stage's layers to the stages that run them, and the gradient "
    f"back).",
    "",
  ]
  lines += markdown_table.lines(
    ["S", "schedule", "M", "params", "axes", "stage params (bytes)", "temp", "temp / stage params"]
    + list(pipeline_cost.ROWS),
    [
      [
        r.stages,
        r.schedule,
        r.microbatches,
        r.placement,
        kind,
        f"{r.stage_param_bytes:.0f}",
        r.temp_bytes[kind],
        f"{r.temp_bytes[kind] / r.stage_param_bytes:.2f}",
      ]
      + [bytes_cell(*r.collective_bytes[kind][row]) for row in pipeline_cost.ROWS]
      for r in rows
      for kind in (k.name for k in AXIS_TYPES)
    ],
  )
  return "\n".join(lines) + "\n"


# The plot of the cost table: SVG written by hand (no plotting library is a
# dependency). Pixels; a panel per stage count.
_PANEL_W, _PANEL_H, _MARGIN = 320, 240, 56
_STYLE = {  # (schedule, axis type) -> stroke, dash, marker.
  ("gpipe", "Explicit"): ("#1f77b4", "", "circle"),
  ("gpipe", "Auto"): ("#1f77b4", "6,3", "square"),
  ("circular", "Explicit"): ("#2ca02c", "", "circle"),
  ("circular", "Auto"): ("#2ca02c", "6,3", "square"),
}
_BOUND_COLOR = "#d62728"
MIB = 2**20


def memory_svg(cfg: CostConfig, rows: list[CostRow]) -> str:
  """Per-device temporaries (MiB) against M, a panel per S, as an SVG document.

  The rows of params as init returns them. Each point's `<title>` names
  its S, schedule, axis type, M and MiB; the bound (`COST_BOUND` × the
  stage's params) is the dashed red line.
  """
  rows = [r for r in rows if r.placement == "init"]
  stages = sorted({r.stages for r in rows})
  width = len(stages) * (_PANEL_W + _MARGIN) + _MARGIN
  height = _PANEL_H + 2 * _MARGIN + 18 * len(_STYLE)
  parts = svg.open_document(
    width,
    height,
    "Pipelined grad step: temporaries per device against "
    f"microbatches ({COST_LAYERS} residual MLP blocks, width {cfg.width}, "
    f"batch {COST_BATCH})",
  )
  for i, s in enumerate(stages):
    mine = [r for r in rows if r.stages == s]
    bound = COST_BOUND * mine[0].stage_param_bytes / MIB
    highest = 1.1 * max([bound] + [t / MIB for r in mine for t in r.temp_bytes.values()])
    step = svg.tick_step(highest)
    ms = sorted({r.microbatches for r in mine})
    panel = svg.Panel(
      _MARGIN + i * (_PANEL_W + _MARGIN),
      _MARGIN,
      _PANEL_W,
      _PANEL_H,
      ms[0],
      ms[-1],
      step * math.ceil(highest / step),
      x_log=True,
    )
    parts += svg.frame(
      panel,
      f"S = {s} stages",
      step,
      [(m, str(m)) for m in ms],
      "microbatches M (log scale)",
      "temporaries per device (MiB)",
    )
    parts += svg.hline(
      panel,
      bound,
      _BOUND_COLOR,
      "bound",
      f"S={s} bound: {COST_BOUND} × stage params = {bound:.3f} MiB",
      f"bound {bound:.2f} MiB",
    )
    for (schedule, kind), (color, dash, marker) in _STYLE.items():
      points = [
        (r.microbatches, r.temp_bytes[kind] / MIB)
        for r in sorted(mine, key=lambda r: r.microbatches)
        if r.schedule == schedule
      ]
      if not points:
        continue
      parts.append(svg.polyline(panel, points, color, f"{schedule} {kind}", dash))
      parts.extend(
        svg.marker(
          marker, panel.x(m), panel.y(v), color, f"S={s} {schedule} {kind} M={m}: {v:.3f} MiB"
        )
        for m, v in points
      )
  parts += svg.legend(
    _MARGIN,
    _MARGIN + _PANEL_H + 52,
    [
      (color, dash, marker, f"{schedule}, {kind} axes")
      for (schedule, kind), (color, dash, marker) in _STYLE.items()
    ]
    + [(_BOUND_COLOR, "8,4", "", f"bound: {COST_BOUND} × the stage's params (docs/sharding.md)")],
  )
  return svg.close_document(parts)


def report(cfg: Config, command: str, cost: CostConfig, steps: bool = True, plot: str = "") -> str:
  """Runs the benchmark; returns the run's description and its tables.

  With `plot`, also writes `memory_svg` of the cost table there.
  """
  start = time.perf_counter()
  tables = []
  if steps:
    baseline, base_step, rows = run(cfg)
    tables.append(markdown(cfg, baseline, base_step, rows))
  costs = cost_rows(cost)
  tables.append(cost_markdown(cost, costs))
  if plot:
    with open(plot, "w") as f:
      f.write(memory_svg(cost, costs))
    tables.append(f"Plot: `{plot}`\n")
  return (
    environment.run_header(
      "Pipeline (`testing/benchmarks/pipeline_benchmark.py`)",
      command,
      cfg.mode,
      time.perf_counter() - start,
    )
    + "\n"
    + "\n".join(tables)
  )


def main(argv: list[str]) -> None:
  del argv  # Flags only.
  print(
    report(
      QUICK if _QUICK.value else FULL,
      " ".join(["python3"] + sys.argv),
      QUICK_COST if _QUICK.value else FULL_COST,
      steps=not _COST_ONLY.value,
      plot=_PLOT.value,
    )
  )


if __name__ == "__main__":
  app.run(main)
