"""The figure of a run, `compile_time_vs_depth.svg`: four panels drawn with `svg`.

Trace + compile time, the step-time ratio to `hk.layer_stack` and the compiled
temporaries of the layer stacks against depth (log scale), and the apply trace
ratios to inline by model size. Each point is the median, its whisker the
samples' [min–max]; its `<title>` names the series, where it is and the figures.
"""

import math
from typing import Hashable, Sequence

from testing.benchmarks.lib import harness
from testing.benchmarks.lib import models
from testing.benchmarks.lib import svg
from testing.benchmarks.lib import targets
from testing.benchmarks.lib import trace_rows
from testing.benchmarks.lib.mlp_bench import TraceKey
from testing.benchmarks.lib.results import Results
from testing.benchmarks.lib.stack_bench import StackKey

FILE = "compile_time_vs_depth.svg"

_COLORS = {models.SCAN: "#1f77b4", models.LAYER_STACK: "#ff7f0e", models.LOOP: "#2ca02c"}
# A large hollow ring for layer_scan: its line often lies exactly on
# layer_stack's (same memory), and both must stay visible.
_MARKS = {models.SCAN: "ring", models.LAYER_STACK: "square", models.LOOP: "diamond"}
_REMAT_DASH = {False: "", True: "6,3"}
_GOAL, _ONE = "#d62728", "#888"
_PANEL_W, _PANEL_H, _MARGIN = 440, 260, 64
_CELL_H = _PANEL_H + 90 + 16 * 10  # Title, axis labels and the legend below.


def _label(variant: str, remat: bool) -> str:
  return variant + (" + remat" if remat else "")


def _panel(column: int, row: int, x_low: float, x_high: float, y_top: float, **kw) -> svg.Panel:
  left = _MARGIN + column * (_PANEL_W + 2 * _MARGIN)
  return svg.Panel(
    left, 2 * _MARGIN + row * _CELL_H, _PANEL_W, _PANEL_H, x_low, x_high, y_top, **kw
  )


def _top(values: Sequence[float]) -> tuple[float, float]:
  """The y axis' top and tick step for `values` (from 0)."""
  step = svg.tick_step(1.1 * max(values))
  return step * math.ceil(1.1 * max(values) / step), step


def _series(
  p: svg.Panel, points: Sequence[tuple[float, harness.Stat]], style: tuple[str, str, str], what: str
) -> list[str]:
  """A line through the medians, each with its whisker and a marker titled `what` at x."""
  color, dash, kind = style
  parts = [svg.polyline(p, [(x, s.median) for x, s in points], color, what, dash)]
  for x, s in points:
    parts.append(svg.whisker(p, p.x(x), s.lo, s.hi, color))
    parts.append(
      svg.marker(
        kind,
        p.x(x),
        p.y(s.median),
        color,
        f"{what} at {x:g}: {s.median:.4g} [{s.lo:.4g}–{s.hi:.4g}]",
      )
    )
  return parts


def _by_depth(
  p: svg.Panel,
  title: str,
  y_step: float,
  y_label: str,
  depths: Sequence[int],
  series: dict[tuple[str, bool], list[harness.Stat]],
  lines: Sequence[tuple[float, str, str]] = (),
) -> list[str]:
  """A panel of `series` (variant, remat) against depth, with horizontal `lines` and a legend."""
  parts = svg.frame(p, title, y_step, [(d, str(d)) for d in depths], "depth (layers)", y_label, "g")
  for value, color, label in lines:
    parts += svg.hline(p, value, color, "goal", f"{title}: {label}", label, dash="3,3")
  for (v, remat), stats in series.items():
    style = (_COLORS[v], _REMAT_DASH[remat], _MARKS[v])
    parts += _series(p, list(zip(depths, stats)), style, f"{title}: {_label(v, remat)}")
  legend = [(_COLORS[v], _REMAT_DASH[r], _MARKS[v], _label(v, r)) for v, r in series]
  return parts + svg.legend(p.left, p.top + p.height + 56, legend)


def _trace_compile(res: Results, depths: list[int]) -> list[str]:
  series = {
    (v, remat): [harness.Stat.of(res.stack.compile[StackKey(d, remat, v)]["total"]) for d in depths]
    for v in models.STACK_VARIANTS
    for remat in (False, True)
  }
  top, step = _top([s.hi for stats in series.values() for s in stats])
  p = _panel(0, 0, depths[0], depths[-1], top, x_log=True)
  return _by_depth(p, "trace + compile of the training step", step, "seconds", depths, series)


def _step_ratios(res: Results, depths: list[int]) -> list[str]:
  base = lambda d, remat: StackKey(d, remat, models.LAYER_STACK)
  series = {
    (v, remat): [
      harness.pair_ratios(res.stack.step, StackKey(d, remat, v), base(d, remat), "step")
      for d in depths
    ]
    for v in (models.SCAN, models.LOOP)
    for remat in (False, True)
  }
  goal = targets.SCAN_STEP_GOAL
  top, step = _top([goal] + [s.hi for stats in series.values() for s in stats])
  p = _panel(1, 0, depths[0], depths[-1], top, x_log=True)
  lines = [(1.0, _ONE, "1"), (goal, _GOAL, f"goal for layer_scan ({goal})")]
  title = "step time / hk.layer_stack's (same remat), wall clock"
  return _by_depth(p, title, step, "ratio", depths, series, lines)


def _memory(res: Results, depths: list[int]) -> list[str]:
  known = [b for b in res.stack.temp_bytes.values() if b is not None]
  unit, scale = ("MiB", 1 << 20) if max(known, default=0) >= 1 << 20 else ("KiB", 1 << 10)
  series = {}
  for v in models.STACK_VARIANTS:
    for remat in (False, True):
      got = [res.stack.temp_bytes[StackKey(d, remat, v)] for d in depths]
      if None not in got:
        series[v, remat] = [harness.Stat(b / scale, b / scale, b / scale) for b in got]
  top, step = _top([s.hi for stats in series.values() for s in stats] or [1.0])
  p = _panel(0, 1, depths[0], depths[-1], top, x_log=True)
  title = "compiled temporaries of the training step"
  return _by_depth(p, title, step, unit, depths, series)


def _trace_ratios(res: Results) -> list[str]:
  """Apply trace time / inline's, a column of points per model size, one per variant and row."""
  names = [r.size.name for r in res.mlp]
  bars = [(v, row) for v in models.BRIDGED + (models.LIFT,) for row in trace_rows.APPLY_ROWS]
  colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
  kinds = {models.BRIDGED_PURE: "diamond", models.LIFT: "circle"}
  stats: dict[Hashable, list[harness.Stat]] = {
    bar: [
      harness.pair_ratios(r.trace, TraceKey(*bar), TraceKey(models.INLINE, bar[1]), "trace")
      for r in res.mlp
    ]
    for bar in bars
  }
  goals = sorted({g for by_row in targets.TRACE_GOALS.values() for g in by_row.values()})
  top, step = _top(goals + [s.hi for ss in stats.values() for s in ss])
  p = _panel(1, 1, -0.5, len(names) - 0.5, top, pad=0)
  title = "apply trace time / inline Haiku's, by model size"
  parts = svg.frame(p, title, step, list(enumerate(names)), "model size", "ratio", "g")
  parts += svg.hline(p, 1.0, _ONE, "goal", f"{title}: 1", "1", dash="3,3", at_start=True)
  for goal in goals:
    parts += svg.hline(p, goal, _GOAL, "goal", f"{title}: goal {goal}", f"goal {goal}", dash="3,3")
  width = 0.8 * _PANEL_W / len(names) / len(bars)  # Pixels between neighbours in a column.
  legend = []
  for i, ((v, row), color) in enumerate(zip(bars, colors * len(bars))):
    kind = kinds.get(v, "square")
    legend.append((color, None, kind, f"{v}: {row}"))
    for j, (name, s) in enumerate(zip(names, stats[v, row])):
      x = p.x(j) + (i - (len(bars) - 1) / 2) * width
      parts.append(svg.whisker(p, x, s.lo, s.hi, color))
      what = f"{title}: {v}: {row}, {name}: {s.median:.4g} [{s.lo:.4g}–{s.hi:.4g}]"
      parts.append(svg.marker(kind, x, p.y(s.median), color, what))
  return parts + svg.legend(p.left, p.top + p.height + 56, legend)


def figure(res: Results) -> str:
  """The run's four panels as an SVG document."""
  depths = list(res.cfg.depths)
  parts = svg.open_document(
    2 * (_PANEL_W + 2 * _MARGIN),
    2 * _CELL_H + 2 * _MARGIN,
    f"haiku_bridge benchmarks ({res.cfg.mode}), {res.date}, {res.env['processor']}, "
    f"{res.env['CPUs usable']} CPUs, jax {res.env['jax']}; points: median, whiskers: [min–max]",
  )
  parts += _trace_compile(res, depths) + _step_ratios(res, depths)
  parts += _memory(res, depths) + _trace_ratios(res)
  return svg.close_document(parts)
