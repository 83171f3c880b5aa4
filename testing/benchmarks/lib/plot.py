"""The figure of a run, `compile_time_vs_depth.png`, if matplotlib is here."""

from typing import Any, Optional

from testing.benchmarks.lib import harness
from testing.benchmarks.lib import models
from testing.benchmarks.lib import targets
from testing.benchmarks.lib import trace_rows
from testing.benchmarks.lib.mlp_bench import TraceKey
from testing.benchmarks.lib.results import Results
from testing.benchmarks.lib.stack_bench import StackKey

_COLORS = {models.SCAN: "tab:blue", models.LAYER_STACK: "tab:orange", models.LOOP: "tab:green"}
# Hollow, larger markers for layer_scan: its line often lies exactly on
# layer_stack's (same memory), and both must stay visible.
_MARKS = {
  models.SCAN: dict(marker="o", markersize=9, markerfacecolor="none"),
  models.LAYER_STACK: dict(marker="s", markersize=5),
  models.LOOP: dict(marker="^", markersize=6),
}


def pyplot() -> Optional[Any]:
  """matplotlib's pyplot on the Agg backend, or None when not installed."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  return plt


def _errorbar(ax: Any, xs: list[Any], stats: list[harness.Stat], **style: Any) -> None:
  ax.errorbar(
    xs,
    [s.median for s in stats],
    yerr=[[s.median - s.lo for s in stats], [s.hi - s.median for s in stats]],
    capsize=3,
    **style,
  )


def _depth_axis(ax: Any, depths: list[int]) -> None:
  ax.set_xscale("log")
  ax.set_xticks(depths, [str(d) for d in depths])
  ax.minorticks_off()
  ax.set_xlabel("depth (layers)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)


def _label(variant: str, remat: bool) -> str:
  return variant + (" + remat" if remat else "")


def _trace_compile(ax: Any, res: Results, depths: list[int]) -> None:
  for v in models.STACK_VARIANTS:
    for remat, line in ((False, "-"), (True, "--")):
      _errorbar(
        ax,
        depths,
        [harness.Stat.of(res.stack.compile[StackKey(d, remat, v)]["total"]) for d in depths],
        ls=line,
        color=_COLORS[v],
        label=_label(v, remat),
        **_MARKS[v],
      )
  ax.set(ylabel="trace + compile (s)", title="Trace + compile time of the training step vs depth")
  _depth_axis(ax, depths)


def _step_ratios(ax: Any, res: Results, depths: list[int]) -> None:
  for v in (models.SCAN, models.LOOP):
    for remat, line in ((False, "-"), (True, "--")):
      _errorbar(
        ax,
        depths,
        [
          harness.pair_ratios(
            res.stack.step, StackKey(d, remat, v), StackKey(d, remat, models.LAYER_STACK), "step"
          )
          for d in depths
        ],
        ls=line,
        color=_COLORS[v],
        label=_label(v, remat),
        **_MARKS[v],
      )
  ax.axhline(1.0, color="gray", lw=1)
  ax.axhline(
    targets.SCAN_STEP_GOAL,
    color="red",
    lw=1,
    ls=":",
    label=f"goal for layer_scan ({targets.SCAN_STEP_GOAL})",
  )
  ax.set(
    ylabel="step time / hk.layer_stack step time",
    title="Step-time ratio to hk.layer_stack (same remat), wall clock",
  )
  _depth_axis(ax, depths)


def _memory(ax: Any, res: Results, depths: list[int]) -> None:
  known = [b for b in res.stack.temp_bytes.values() if b is not None]
  unit, scale = ("MiB", 1 << 20) if max(known, default=0) >= 1 << 20 else ("KiB", 1 << 10)
  for v in models.STACK_VARIANTS:
    for remat, line in ((False, "-"), (True, "--")):
      mem = [res.stack.temp_bytes[StackKey(d, remat, v)] for d in depths]
      if None not in mem:
        ax.plot(
          depths,
          [m / scale for m in mem],
          ls=line,
          color=_COLORS[v],
          label=_label(v, remat),
          **_MARKS[v],
        )
  ax.set(
    ylabel=f"compiled temp memory ({unit})", title="Compiled temporary memory of the training step"
  )
  _depth_axis(ax, depths)


def _trace_ratios(ax: Any, res: Results) -> None:
  names = [r.size.name for r in res.mlp]
  bars = [(v, row) for v in models.BRIDGED + (models.LIFT,) for row in trace_rows.APPLY_ROWS]
  width = 0.8 / len(bars)
  for i, (v, row) in enumerate(bars):
    stats = [
      harness.pair_ratios(r.trace, TraceKey(v, row), TraceKey(models.INLINE, row), "trace")
      for r in res.mlp
    ]
    xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(names))]
    ax.bar(
      xs,
      [s.median for s in stats],
      width,
      yerr=[[s.median - s.lo for s in stats], [s.hi - s.median for s in stats]],
      capsize=2,
      label=f"{v}: {row}",
      hatch={models.BRIDGED_PURE: "//", models.LIFT: ".."}.get(v),
    )
  ax.axhline(1.0, color="gray", lw=1)
  goals = sorted({goal for by_row in targets.TRACE_GOALS.values() for goal in by_row.values()})
  for goal, line in zip(goals, (":", "--", "-.")):
    ax.axhline(goal, color="red", lw=1, ls=line, label=f"goal {goal}")
  ax.set_xticks(range(len(names)), names)
  ax.set(
    ylabel="/ inline apply trace time (wall clock)",
    title="Apply trace time relative to inline Haiku, by model size",
  )
  ax.grid(alpha=0.3, axis="y")
  # Below the axes: inside, it would hide bars and whiskers.
  ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.07))


def write_plot(res: Results, path: str) -> bool:
  """Draws the figure to `path`; False (nothing written) without matplotlib."""
  plt = pyplot()
  if plt is None:
    return False
  depths = list(res.cfg.depths)
  fig, axes = plt.subplots(2, 2, figsize=(13, 12))
  _trace_compile(axes[0][0], res, depths)
  _step_ratios(axes[0][1], res, depths)
  _memory(axes[1][0], res, depths)
  _trace_ratios(axes[1][1], res)
  fig.suptitle(
    f"haiku_bridge benchmarks ({res.cfg.mode}), {res.date}, "
    f"{res.env['processor']}, {res.env['CPUs usable']} CPUs, "
    f"jax {res.env['jax']}; bars/whiskers: median [min–max]",
    fontsize=10,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True
