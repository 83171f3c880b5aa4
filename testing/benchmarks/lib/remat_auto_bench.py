"""The benchmark of `remat="auto"` (issue 37): every candidate plan against what the compiler does.

For each model (an LSTM unroll with the loss after it or in the step, a
residual MLP stack, a transformer stack; small widths: testing/remat_models.py,
on which haiku_bridge/_src/remat/plan_test.py checks the predictions),
`remat_plan` predicts every candidate's training-step temporaries and
recomputed steps from one plan; the manual plans (`False`, `True`, `"nested"`, `"binomial"`, `"nested"` with
2 groups) and what `remat="auto"` picks at a loose, a middle and a tight
budget are compiled, and their compiled temporaries (XLA's memory analysis
of the jitted `value_and_grad` step) set beside the predictions, with the
compiled step's FLOPs (`haiku_bridge/_src/remat/hlo_flops.py`: every loop by
its trip count) beside the least of the manual plans that fit, and the
predicted recomputed FLOPs beside the compiled ones.
"""

import contextlib
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence
from unittest import mock

import jax

import haiku_bridge as hkb
from haiku_bridge._src import caches
from haiku_bridge._src.remat import choice as remat_choice
from haiku_bridge._src.remat import loop as loop_lib
from haiku_bridge._src.remat import measure
from haiku_bridge._src.remat import plan as remat_plan
from haiku_bridge._src.remat import step_budget
from haiku_bridge._src.remat import step_compiles
from haiku_bridge._src.remat import step_search
from testing import remat_models
from testing.benchmarks.lib import markdown_table
from testing.benchmarks.lib import svg

# The init key's seed (a key made on import would start a backend: `planning`
# must not, so that its fresh processes may hold a TPU).
SEED = 0
# The manual plans compiled beside the predictions: (remat, remat_groups).
MANUAL = ((False, None), (True, None), ("nested", None), ("binomial", None), ("nested", 2))
BUDGETS = ("loose", "middle", "tight")


@dataclasses.dataclass(frozen=True)
class Config:
  mode: str
  lstm_lengths: tuple[int, ...]
  mlp_depths: tuple[int, ...]
  transformer_depths: tuple[int, ...]

  planning_repeats: int = 1  # Fresh processes per planning figure (the least taken).


FULL = Config("full", (256, 1024, 4096), (16, 64), (16, 64), 2)
QUICK = Config("quick", (16,), (4,), ())


def planning_models(mode: str) -> dict[str, Callable[..., Any]]:
  """The models planning is timed on: a user's sizes (quick: one small stack)."""
  if mode == "quick":
    return {"conv_depth_4": functools.partial(remat_models.conv, 4)}
  return {
    "transformer_24_blocks_d256_seq256_batch2": functools.partial(
      remat_models.language_model, 24, 256, 256, 2
    ),
    "gru_char_T2048_h256_batch8": functools.partial(remat_models.char_gru, 2048),
    "conv_depth_32_c64_w256_batch8": functools.partial(remat_models.conv, 32, 64, 256, 8),
  }


def models(cfg: Config) -> dict[str, Callable[..., Any]]:
  return remat_models.models(cfg.lstm_lengths, cfg.mlp_depths, cfg.transformer_depths)


@dataclasses.dataclass(frozen=True)
class Compiled:
  """A plan compiled: what remat= ran, its prediction and the compiler's figure."""

  label: str
  candidate: remat_plan.RematCandidate
  compiled: int  # Bytes of temporaries and constants (a schedule's tables).
  flops: int  # Of the compiled step, every loop by its trip count.
  budget: Optional[int] = None  # For auto's picks.


@dataclasses.dataclass(frozen=True)
class ModelResult:
  name: str
  length: int
  candidates: tuple[remat_plan.RematCandidate, ...]
  budgets: dict[str, int]
  manual: tuple[Compiled, ...]
  picks: tuple[Compiled, ...]


@contextlib.contextmanager
def _coefficients_seen():
  """The `Coefficients` the loops' plans are chosen from, in order."""
  seen = []
  real = remat_choice.choose

  def spy(c, *args):
    seen.append(c)
    return real(c, *args)

  with mock.patch.object(remat_choice, "choose", spy):
    yield seen


def _predicted(c, length: int, remat, groups) -> remat_plan.RematCandidate:
  """The prediction for a manual plan (the model's formulas, its slots)."""
  if remat in (False, True):
    plan = remat_choice.choose(c, length, 1 << 62)
    return next(k for k in plan.candidates if k.remat is remat)
  sched = loop_lib.schedule(remat, length, groups)
  return measure._recomputing(  # pylint: disable=protected-access
    c, remat, sched.num_slots, groups, length, sched.recomputed_steps
  )


def bench_model(name: str, model) -> ModelResult:
  net, x = model()
  params = net.init(jax.random.PRNGKey(SEED), x)
  length = x.shape[0] if name.startswith("lstm") else int(jax.tree.leaves(params)[0].shape[0])
  with _coefficients_seen() as seen:
    remat_models.step_cost(model, params, x, length, remat="auto", memory_budget=1 << 40)
  c = seen[-1]
  candidates = remat_choice.choose(c, length, 1 << 62).candidates
  manual = []
  for remat, groups in MANUAL:
    kw = {} if groups is None else {"remat_groups": groups}
    cost = remat_models.step_cost(model, params, x, length, remat=remat, **kw)
    manual.append(
      Compiled(
        f"{remat}" + ("" if groups is None else f", groups={groups}"),
        _predicted(c, length, remat, groups),
        cost.bytes,
        cost.flops,
      )
    )
  plain = next(k for k in candidates if k.remat is False).temporaries
  per_step = next(k for k in candidates if k.remat is True).temporaries
  smallest = min(k.temporaries for k in candidates)
  budgets = {
    "loose": int(plain * 1.01),
    "middle": int((per_step + smallest) / 2),
    "tight": int(smallest * 1.01),
  }
  picks = []
  for label, budget in budgets.items():
    # Any recomputation (the tight budget may need more than the default
    # bound's 3 forward passes): the budgets compare the model's choices.
    with remat_models.plans_made() as made:
      cost = remat_models.step_cost(
        model, params, x, length, remat="auto", memory_budget=budget, max_recompute=math.inf
      )
    choice = made[-1].choice
    picks.append(Compiled(label, choice, cost.bytes, cost.flops, budget))
    print(f"remat auto: {name} {label}: {choice}", file=sys.stderr, flush=True)
  return ModelResult(name, length, tuple(candidates), budgets, tuple(manual), tuple(picks))


def bench(cfg: Config) -> list[ModelResult]:
  return [bench_model(name, model) for name, model in models(cfg).items()]


@dataclasses.dataclass(frozen=True)
class Planning:
  """The first compiled step of a model, each in a fresh process: seconds."""

  name: str
  budget: int
  plan: str  # What `remat="auto"` chose.
  per_step: float  # remat=True.
  cold: float  # remat="auto", its plan cache directory empty.
  warm: float  # remat="auto", a second process with that directory.
  # The same, CPU seconds of the process (every thread): the work, which
  # other programs on the machine move less than the wall time.
  per_step_cpu: float = 0.0
  cold_cpu: float = 0.0
  warm_cpu: float = 0.0
  # `hkb.budgeted_jit` at the middle of the whole step's bytes (between
  # remat=True's and the least rung's): cold, and a second process.
  step_budget: int = 0
  step_plan: str = ""
  step_cold: float = 0.0
  step_warm: float = 0.0
  step_cold_cpu: float = 0.0
  step_warm_cpu: float = 0.0


def _step(name: str, mode: str, **remat):
  """The model's params and input, and its jitted training step."""
  params, x, step = _training_step(name, mode, **remat)
  return params, x, jax.jit(step)


def _training_step(name: str, mode: str, **remat):
  """The model's params and input, and its training step (`value_and_grad`)."""
  net, x = planning_models(mode)[name](**remat)
  params = net.init(jax.random.PRNGKey(SEED), x)  # Init plans nothing.
  return params, x, jax.value_and_grad(lambda p, x: net.apply(p, None, x))


def _middle_step_budget(name: str, mode: str) -> int:
  """Halfway between the whole step's bytes with remat=True and at `budgeted_jit`'s least rung."""
  params, x, step = _step(name, mode, remat=True)
  per_step = step_compiles.step_bytes(
    step.lower(params, x).compile().memory_analysis(), jax.default_backend()
  )
  params, x, step = _training_step(name, mode, remat="auto")
  every = step_budget.BudgetedStep(step, None, remat_choice.MAX_RECOMPUTE, {})
  trace = step_budget._Trace(step_search.Rung(step_search.PLAIN))  # pylint: disable=protected-access
  every._lowered(-1, trace.rung, (params, x), {}, trace)  # pylint: disable=protected-access
  least = step_search.ladder(trace.loops, remat_choice.MAX_RECOMPUTE)[-1]
  least_bytes = every._compiled(-1, least, (params, x), {}).bytes  # pylint: disable=protected-access
  assert least_bytes is not None
  return (per_step + least_bytes) // 2


def _middle_budget(name: str, mode: str) -> int:
  """Halfway between remat=True's bytes and the least plan's, planned here with nothing cached."""
  with caches.disabled(), remat_models.plans_made() as made:
    params, x, step = _step(name, mode, remat="auto", memory_budget=1 << 40)
    step.lower(params, x)
  candidates = made[-1].candidates
  per_step = next(k for k in candidates if k.remat is True).temporaries
  return (per_step + min(k.temporaries for k in candidates)) // 2


def first_step(name: str, mode: str, remat: str, budget: int) -> dict[str, Any]:
  """In a fresh process: seconds (wall and CPU) to trace and compile the step, plan included; the plan."""
  jax.config.update("jax_enable_compilation_cache", False)
  if remat == "step":  # The whole step's budget.
    params, x, step = _training_step(name, mode, remat="auto")
    step = hkb.budgeted_jit(step, memory_budget=budget)
  else:
    options = dict(remat=True) if remat == "true" else dict(remat="auto", memory_budget=budget)
    params, x, step = _step(name, mode, **options)
  with remat_models.plans_made() as made:
    start, cpu = time.perf_counter(), time.process_time()
    step.lower(params, x).compile()
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu
  if remat == "step":
    plan = step.plan(params, x)
    name = ", ".join(
      sorted(
        {str(loop.remat) + (f", {loop.slots} slots" if loop.slots else "") for loop in plan.loops}
      )
    )
    return {
      "seconds": seconds,
      "cpu_seconds": cpu,
      "plan": name,
      "kept": plan.kept,
      "compiles": len(plan.tries),
    }
  return {
    "seconds": seconds,
    "cpu_seconds": cpu,
    "plan": _plan_name(made[-1].choice) if made else "",
  }


def _in_fresh_process(
  name: str, mode: str, remat: str, budget: int, directory: str
) -> dict[str, Any]:
  env = dict(
    os.environ,
    HAIKU_BRIDGE_CACHE_DIR=directory,
    JAX_ENABLE_COMPILATION_CACHE="false",
    PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
  )
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "testing.benchmarks.lib.remat_auto_bench",
      name,
      mode,
      remat,
      str(budget),
    ],
    env=env,
    capture_output=True,
    text=True,
    check=False,
  )
  if out.returncode:
    raise RuntimeError(f"{name} {remat}: {out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def planning(cfg: Config, only: Sequence[str] = ()) -> list[Planning]:
  """Each planning model's first step (those named in `only`, if any): remat=True, auto cold, auto in a second process."""
  unknown = sorted(set(only) - set(planning_models(cfg.mode)))
  if unknown:
    raise ValueError(
      f"planning_models: no planning model named {unknown} "
      f"in {cfg.mode} mode; the models: "
      f"{', '.join(planning_models(cfg.mode))}."
    )
  out = []
  for name in planning_models(cfg.mode):
    if only and name not in only:
      continue
    # Every figure from a child: on a TPU only one process at a time may
    # hold the chip, so this one never touches a backend.
    with tempfile.TemporaryDirectory() as directory:
      budget = _in_fresh_process(name, cfg.mode, "budget", 0, directory)["budget"]
      whole = _in_fresh_process(name, cfg.mode, "step_budget", 0, directory)["budget"]
    times: dict[str, list[tuple[float, float]]] = {
      "true": [],
      "cold": [],
      "warm": [],
      "step_cold": [],
      "step_warm": [],
    }
    plans = {"auto": "", "step": ""}
    for _ in range(cfg.planning_repeats):
      with tempfile.TemporaryDirectory() as directory:
        for run in times:
          kind = "true" if run == "true" else "step" if run.startswith("step") else "auto"
          got = _in_fresh_process(
            name, cfg.mode, kind, whole if kind == "step" else budget, directory
          )
          times[run].append((got["seconds"], got["cpu_seconds"]))
          plans[kind] = got["plan"] or plans.get(kind, "")
    wall = {run: min(t for t, _ in got) for run, got in times.items()}
    cpu = {run: min(c for _, c in got) for run, got in times.items()}
    out.append(
      Planning(
        name,
        budget,
        plans["auto"],
        wall["true"],
        wall["cold"],
        wall["warm"],
        cpu["true"],
        cpu["cold"],
        cpu["warm"],
        whole,
        plans["step"],
        wall["step_cold"],
        wall["step_warm"],
        cpu["step_cold"],
        cpu["step_warm"],
      )
    )
    print(f"remat auto: planning {out[-1]}", file=sys.stderr, flush=True)
  return out


def planning_markdown(results: list[Planning]) -> str:
  out = [
    "### What planning costs: the first compiled step",
    "",
    "Seconds to trace and compile a model's training step "
    "(`value_and_grad`) the first time, each in a fresh process with "
    "JAX's compilation cache off (the least of the repetitions): "
    "`remat=True`; `remat=\"auto\"` at the middle budget with its plan "
    "cache directory empty (cold: planned, the choice compiled and "
    "checked); and a second process with that directory (the plan read "
    "from disk). Wall seconds, then the ratios of the processes' CPU "
    "seconds (every thread's), the work, which other programs on a "
    "shared machine move less.",
    "",
  ]
  out += markdown_table.lines(
    [
      "model",
      "budget (KiB)",
      "auto's plan",
      "remat=True (s)",
      "auto, cold (s)",
      "cold / True",
      "auto, second process (s)",
      "second / True",
      "cold / True, CPU",
      "second / True, CPU",
    ],
    [
      [
        r.name,
        _kib(r.budget),
        r.plan,
        f"{r.per_step:.2f}",
        f"{r.cold:.2f}",
        f"{r.cold / r.per_step:.2f}",
        f"{r.warm:.2f}",
        f"{r.warm / r.per_step:.2f}",
        f"{r.cold_cpu / r.per_step_cpu:.2f}",
        f"{r.warm_cpu / r.per_step_cpu:.2f}",
      ]
      for r in results
    ],
    align="lrlrrrrrrr",
  )
  out += [
    "",
    "The same models under `hkb.budgeted_jit` (every loop "
    "`remat=\"auto\"` with no budget of its own), the whole step's "
    "budget halfway between its bytes with `remat=True` and at the "
    "least rung (a schedule: the search's dearest case), against the "
    "same `remat=True` first step:",
    "",
  ]
  out += markdown_table.lines(
    [
      "model",
      "step budget (KiB)",
      "plan",
      "cold (s)",
      "cold / True",
      "second process (s)",
      "second / True",
      "cold / True, CPU",
      "second / True, CPU",
    ],
    [
      [
        r.name,
        _kib(r.step_budget),
        r.step_plan,
        f"{r.step_cold:.2f}",
        f"{r.step_cold / r.per_step:.2f}",
        f"{r.step_warm:.2f}",
        f"{r.step_warm / r.per_step:.2f}",
        f"{r.step_cold_cpu / r.per_step_cpu:.2f}",
        f"{r.step_warm_cpu / r.per_step_cpu:.2f}",
      ]
      for r in results
    ],
    align="lrlrrrrrr",
  )
  return "\n".join(out) + "\n"


def _plan_name(k: remat_plan.RematCandidate) -> str:
  out = str(k.remat)
  if k.slots is not None:
    out += f", {k.slots} slots"
  if k.groups is not None:
    out += f", {k.groups} groups"
  return out


def _kib(n: float) -> str:
  return f"{n / 1024:,.1f}"


def _mega(n: float) -> str:
  return f"{n / 1e6:,.2f}"


def markdown(results: list[ModelResult]) -> str:
  """Auto's picks per budget, then every compiled plan's prediction against the compiler."""
  out = [
    "### What `remat=\"auto\"` picks",
    "",
    "Budgets: loose = 1.01 × no remat's predicted temporaries, middle = "
    "halfway between `remat=True`'s and the smallest candidate's, tight "
    "= 1.01 × the smallest. \"Fewest manual\": the fewest recomputed "
    "steps of the manual plans whose compiled temporaries fit; "
    "\"least manual\": the least FLOPs of those. FLOPs: of the compiled "
    "training step, every loop by its trip count "
    "(`haiku_bridge/_src/remat/hlo_flops.py`), in millions. Bytes: XLA's "
    "temporaries and the program's constants (a schedule's tables), "
    "what `memory_budget` counts; \"predicted\" for auto's plan is the "
    "figure its plan holds for the choice: the loop's gradient "
    "compiled, as the plan checks it; \"compiled\" is the whole "
    "training step.",
    "",
  ]
  picks = []
  for r in results:
    for p in r.picks:
      fitting = [m for m in r.manual if m.compiled <= p.budget]
      least = min((m.flops for m in fitting), default=None)
      picks.append(
        [
          r.name,
          p.label,
          _kib(p.budget),
          _plan_name(p.candidate),
          _kib(p.candidate.temporaries),
          _kib(p.compiled),
          f"{p.compiled / p.budget:.3f}",
          p.candidate.recomputed_steps,
          min((m.candidate.recomputed_steps for m in fitting), default="none fits"),
          _mega(p.flops),
        ]
        + ([_mega(least), f"{p.flops / least:.3f}"] if least else ["none fits", ""])
      )
  out += markdown_table.lines(
    [
      "model",
      "budget",
      "budget (KiB)",
      "auto's plan",
      "predicted (KiB)",
      "compiled (KiB)",
      "compiled / budget",
      "recomputed steps",
      "fewest manual",
      "MFLOPs",
      "least manual MFLOPs",
      "FLOPs / least",
    ],
    picks,
    align="llrlrrrrrrrr",
  )
  out += [
    "",
    "### Predicted against compiled temporaries and recomputed FLOPs",
    "",
    "Recomputed MFLOPs, compiled: the plan's MFLOPs less no remat's.",
    "",
  ]
  compiled = []
  for r in results:
    plain = next(m.flops for m in r.manual if m.candidate.remat is False)
    for m in r.manual + r.picks:
      label = (
        f"auto ({m.label}): {_plan_name(m.candidate)}" if m.budget else _plan_name(m.candidate)
      )
      compiled.append(
        [
          r.name,
          label,
          _kib(m.candidate.temporaries),
          _kib(m.compiled),
          f"{m.candidate.temporaries / m.compiled - 1:+.1%}",
          m.candidate.recomputed_steps,
          _mega(m.flops),
          _mega(m.candidate.recomputed_flops),
          _mega(m.flops - plain),
        ]
      )
  out += markdown_table.lines(
    [
      "model",
      "plan",
      "predicted (KiB)",
      "compiled (KiB)",
      "predicted / compiled − 1",
      "recomputed steps",
      "MFLOPs",
      "recomputed MFLOPs, predicted",
      "recomputed MFLOPs, compiled",
    ],
    compiled,
    align="llrrrrrrr",
  )
  return "\n".join(out) + "\n"


def pareto(candidates) -> list[remat_plan.RematCandidate]:
  """The candidates no other beats in both recomputed steps and temporaries."""
  front, least = [], math.inf
  for k in sorted(candidates, key=lambda k: (k.recomputed_steps, k.temporaries)):
    if k.temporaries < least:
      front.append(k)
      least = k.temporaries
  return front


_PANEL_W, _PANEL_H, _MARGIN, _COLUMNS = 260, 200, 72, 2
_CANDIDATE, _FRONT, _MANUAL = "#7f7f7f", "#1f77b4", "#2ca02c"
_BUDGET_COLORS = {"loose": "#9467bd", "middle": "#ff7f0e", "tight": "#d62728"}
_KIND_MARKER = {"binomial": "square", "nested": "diamond"}


def _passes(r: ModelResult, k: remat_plan.RematCandidate) -> float:
  """Forward passes over the loop a training step runs with `k`: 1 + recomputed / T."""
  return 1 + k.recomputed_steps / r.length


def pareto_svg(results: list[ModelResult]) -> str:
  """A panel per model: every candidate's predicted temporaries against its forward passes.

  Both axes are log-scaled: x is 1 + recomputed steps / T (1: no remat,
  2: per-step remat), y the temporaries in KiB.
  Grey: each candidate (square binomial, diamond nested, circle no remat /
  per-step remat), blue line: their Pareto front; green circles: the manual
  plans, compiled; a ring per budget at auto's pick (compiled) on the
  budget's dashed line. Each point's `<title>` gives its figures.
  """
  rows = math.ceil(len(results) / _COLUMNS)
  width = _COLUMNS * (_PANEL_W + _MARGIN + 16) + _MARGIN
  panel_h = _PANEL_H + _MARGIN + 24
  height = rows * panel_h + _MARGIN + 16 * 9
  parts = svg.open_document(
    width,
    height,
    "remat=\"auto\": training-step temporaries against forward passes, every candidate (predicted)",
  )
  for i, r in enumerate(results):
    ys = (
      [k.temporaries for k in r.candidates]
      + list(r.budgets.values())
      + [m.compiled for m in r.manual + r.picks]
    )
    passes = [_passes(r, k) for k in r.candidates]
    panel = svg.Panel(
      _MARGIN + (i % _COLUMNS) * (_PANEL_W + _MARGIN + 16),
      _MARGIN + (i // _COLUMNS) * panel_h,
      _PANEL_W,
      _PANEL_H,
      1,
      max(passes),
      10 ** math.ceil(math.log10(1.1 * max(ys) / 1024)),
      x_log=True,
      y_low=10 ** math.floor(math.log10(0.9 * min(ys) / 1024)),
      y_log=True,
    )
    x_ticks = [2**j for j in range(math.ceil(math.log2(max(passes))) + 1) if 2**j <= max(passes)]
    x_ticks = x_ticks[:: max(1, math.ceil(len(x_ticks) / 6))]
    parts += svg.frame(
      panel,
      f"{r.name} (T = {r.length})",
      0,
      [(x, f"{x:g}") for x in x_ticks],
      "forward passes per step: 1 + recomputed / T (log)",
      "temporaries (KiB, log)",
      "g",
    )
    for label, budget in r.budgets.items():
      parts += svg.hline(
        panel,
        budget / 1024,
        _BUDGET_COLORS[label],
        f"budget {label}",
        f"{r.name} {label} budget: {_kib(budget)} KiB",
        label,
        dash="4,3",
        at_start=label == "middle",
      )
    parts.append(
      svg.polyline(
        panel,
        [(_passes(r, k), k.temporaries / 1024) for k in pareto(r.candidates)],
        _FRONT,
        "pareto",
      )
    )
    for k in r.candidates:
      parts.append(
        svg.marker(
          _KIND_MARKER.get(k.remat, "circle"),
          panel.x(_passes(r, k)),
          panel.y(k.temporaries / 1024),
          _CANDIDATE,
          f"{r.name} candidate {_plan_name(k)}: predicted "
          f"{_kib(k.temporaries)} KiB, {k.recomputed_steps} recomputed",
        )
      )
    for m in r.manual + r.picks:
      if m.budget is None:
        kind, color, what = "circle", _MANUAL, f"manual {m.label}:"
      else:
        kind, color = "ring", _BUDGET_COLORS[m.label]
        what = f"auto {m.label}: {_plan_name(m.candidate)},"
      parts.append(
        svg.marker(
          kind,
          panel.x(_passes(r, m.candidate)),
          panel.y(m.compiled / 1024),
          color,
          f"{r.name} {what} compiled {_kib(m.compiled)} KiB, "
          f"{m.candidate.recomputed_steps} recomputed",
        )
      )
  parts += svg.legend(
    _MARGIN,
    rows * panel_h + _MARGIN,
    [
      (_CANDIDATE, None, "square", "candidate, binomial (predicted)"),
      (_CANDIDATE, None, "diamond", "candidate, nested (predicted)"),
      (_CANDIDATE, None, "circle", "candidate, no remat / per-step (predicted)"),
      (_FRONT, "", "", "Pareto front of the candidates"),
      (_MANUAL, None, "circle", "manual plan (compiled)"),
    ]
    + [
      (color, "4,3", "ring", f"{label} budget and auto's pick (compiled)")
      for label, color in _BUDGET_COLORS.items()
    ],
  )
  return svg.close_document(parts)


if __name__ == "__main__":
  # The child of `planning`: MODEL MODE REMAT BUDGET, one JSON line out;
  # REMAT "budget": the model's middle budget.
  if sys.argv[3] == "budget":
    print(json.dumps({"budget": _middle_budget(sys.argv[1], sys.argv[2])}))
  elif sys.argv[3] == "step_budget":
    print(json.dumps({"budget": _middle_step_budget(sys.argv[1], sys.argv[2])}))
  else:
    print(json.dumps(first_step(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))))
