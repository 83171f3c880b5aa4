r"""`remat="auto"` on whatever backend runs it: predicted against compiled bytes, choice against budget.

A standalone check (no pytest) for a machine the test suite does not run on,
a GPU or a TPU above all (`testing/accelerator_check.sh` runs it): for
`remat/plan_test`'s models and a plain-JAX LSTM training step (H=1024, B=64,
T=4096, the loss in the step), it plans each at a tight
and a middle budget, prints the plan's first prediction for its choice (before
the compiled check), the choice and what the compiled training step takes
(XLA's temporaries and the constants of the program), and for `remat=False`
and `remat=True` the prediction against the compiled step. FLOPs too
(`hlo_flops`, every loop by its trip count): `remat=True`'s predicted
recomputation against the compiled steps' difference (True less False),
and each chosen plan's step against `remat=False`'s (a plan runs at least
the plain step's arithmetic). First, `hlo_flops` on small loops compiled
here (`testing/flops_programs.py`), rolled against XLA's count on CPU of the
same loops unrolled (as `hlo_flops_test` does; XLA:GPU's own count of a
program counts each copy of a value its fusions make, printed beside it).
Exits 1 if a whole step compiles over its budget by more than the tests
allow (`remat/plan_test.py`'s `STEP_TOLERANCE`), a prediction of
`False`/`True` (bytes, or `True`'s recomputed FLOPs) is more than 10% off, a
chosen plan counts fewer FLOPs than `remat=False`, or a rolled loop's count is
more than 2% off. `--small`: small shapes for a CPU (a minute or two).

    PYTHONPATH=. python3 testing/remat_auto_check.py            # an accelerator's run
    PYTHONPATH=. python3 testing/remat_auto_check.py --small    # a CPU's
    PYTHONPATH=. python3 testing/remat_auto_check.py --only 'jax_lstm|lstm_4096'

Each model prints its seconds: on a GPU (XLA autotunes every compile, and
the measuring compiles keep XLA's defaults there), pick with `--only` what
fits the time.
"""

import argparse
import contextlib
import functools
import math
import re
import sys
import time
from typing import Any, Iterator, NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp

import haiku_bridge as hkb
from haiku_bridge._src.remat import hlo_flops
from haiku_bridge._src.remat import choice as remat_choice
from haiku_bridge._src.remat import plan as remat_plan
from testing import flops_programs
from testing import remat_models
from testing.benchmarks.lib import remat_auto_bench

KEY = jax.random.PRNGKey(0)
# What remat/plan_test allows a whole step over its budget, and a prediction
# of remat=False or remat=True off from the compiled step.
STEP_TOLERANCE = 0.02
PREDICTION_TOLERANCE = 0.10


@contextlib.contextmanager
def first_choices() -> Iterator[list[remat_plan.RematCandidate]]:
  """The choice each plan predicted first, before its compiled check."""
  made: list[remat_plan.RematCandidate] = []
  real = remat_choice.choose
  planning = [False]

  def plan(*args, **kwargs):
    planning[0] = True
    try:
      return real_plan(*args, **kwargs)
    finally:
      planning[0] = False

  def choose(*args, **kwargs):
    chosen = real(*args, **kwargs)
    if planning[0]:
      made.append(chosen.choice)
      planning[0] = False  # Only the first of each plan.
    return chosen

  real_plan = remat_plan.plan
  with (
    mock.patch.object(remat_choice, "choose", choose),
    mock.patch.object(remat_plan, "plan", plan),
  ):
    yield made


class Compiled(NamedTuple):
  bytes: int  # XLA's temporaries and the program's constants.
  flops: float  # `remat_models.step_flops`: every loop by its trip count (nan: not counted).


def compiled_cost(length: int, f, *args) -> Compiled:
  """What `jax.jit(f)(*args)`, a training step of a loop of `length` steps, compiles to."""
  compiled = jax.jit(f).lower(*args).compile()
  text = compiled.as_text()
  try:
    flops = remat_models.step_flops(text, length)
  except ValueError as e:  # A loop hlo_flops cannot count: the FLOP rows fail.
    print(f"     ({e})", file=sys.stderr)
    flops = math.nan
  return Compiled(hlo_flops.held(compiled, text).bytes, flops)


def _row(
  name: str, what: str, predicted: int, compiled: int, budget: Any = None, plan: str = ""
) -> tuple[str, bool]:
  """A line of the report, and whether it is within its bound."""
  if budget is None:
    ok = abs(predicted / compiled - 1) <= PREDICTION_TOLERANCE
    ratio = f"predicted/compiled {predicted / compiled:.3f}"
  else:
    ok = compiled <= budget * (1 + STEP_TOLERANCE)
    ratio = f"compiled/budget {compiled / budget:.3f}"
  return (
    f"{'ok  ' if ok else 'FAIL'} {name:32} {what:10} {plan:30} "
    f"predicted {predicted / 1e6:10.3f} MB  compiled "
    f"{compiled / 1e6:10.3f} MB  {ratio}"
  ), ok


def _plan_name(k: remat_plan.RematCandidate) -> str:
  return f"{k.remat}" + (f", {k.slots} slots" if k.slots else "")


def _flops_row(
  name: str, what: str, got: float, truth: float, ok: bool, compared: str
) -> tuple[str, bool]:
  return (
    f"{'ok  ' if ok else 'FAIL'} {name:32} {what:10} {got / 1e6:14.3f} "
    f"MFLOP  {compared} {truth / 1e6:14.3f} MFLOP  ratio "
    f"{got / truth if truth else float('nan'):.3f}"
  ), ok


def check(name: str, step_of, args) -> list[tuple[str, bool]]:
  """`step_of(**remat)`: a training step; each plan and budget checked."""
  rows = []
  with remat_models.plans_made() as made:
    jax.jit(step_of(remat="auto", memory_budget=1 << 50)).lower(*args)
  candidates, length = made[-1].candidates, made[-1].length
  by_kind = {k.remat: k for k in candidates if k.slots is None and k.policy is None}
  compiled = {remat: compiled_cost(length, step_of(remat=remat), *args) for remat in (False, True)}
  for remat in (False, True):
    rows.append(_row(name, f"{remat}", by_kind[remat].temporaries, compiled[remat].bytes))
  # remat=True's recomputation: predicted, and the compiled steps' FLOPs
  # True less False (what remat/plan_test checks, within 10%).
  recomputed = compiled[True].flops - compiled[False].flops
  predicted = by_kind[True].recomputed_flops
  rows.append(
    _flops_row(
      name,
      "True flops",
      predicted,
      recomputed,
      recomputed > 0 and abs(predicted / recomputed - 1) <= 0.10,
      "recomputed; compiled True - False",
    )
  )
  least = min(k.temporaries for k in candidates)
  budgets = {"middle": (by_kind[True].temporaries + least) // 2, "tight": int(least * 1.01)}
  for label, budget in budgets.items():
    # Any recomputation, as remat/plan_test: a tight budget needs a
    # schedule of few slots.
    step = step_of(remat="auto", memory_budget=budget, max_recompute=math.inf)
    with first_choices() as first, remat_models.plans_made() as made:
      got = compiled_cost(length, step, *args)
    choice = made[-1].choice
    rows.append(
      _row(
        name,
        label,
        first[-1].temporaries,
        got.bytes,
        budget,
        f"{_plan_name(first[-1])} -> {_plan_name(choice)}",
      )
    )
    # Any plan runs at least the plain step's arithmetic.
    rows.append(
      _flops_row(
        name,
        label + " flops",
        got.flops,
        compiled[False].flops,
        got.flops >= 0.99 * compiled[False].flops,
        "step; remat=False's",
      )
    )
  return rows


def rolled_loops() -> list[tuple[str, bool]]:
  """`hlo_flops` of small loops compiled here, rolled, against XLA:CPU's count of them unrolled."""
  rows = []
  for name, make in flops_programs.LOOPS.items():
    rolled = flops_programs.ours(make(1), flops_programs.H, flops_programs.XS)
    truth, here = flops_programs.unrolled(name, flops_programs.CPU), flops_programs.unrolled(name)
    ok = abs(rolled.flops / truth - 1) <= 0.02 and not rolled.unknown_trip_counts
    row, _ = _flops_row("hlo_flops " + name, "rolled", rolled.flops, truth, ok, "XLA:CPU unrolled")
    rows.append(
      (
        f"{row}  (XLA:{jax.default_backend().upper()} unrolled "
        f"{here / 1e6:.3f} MFLOP; unknown trip counts "
        f"{rolled.unknown_trip_counts}, opaque "
        f"{rolled.opaque_custom_calls})",
        ok,
      )
    )
  return rows


def haiku_step(model, **remat):
  """The training step (`value_and_grad` of the loss) of a Haiku model."""
  net, _ = model(**remat)
  return jax.value_and_grad(lambda p, x: net.apply(p, None, x))


def lstm_step(hidden: int, batch: int, inputs: int):
  """A plain-JAX LSTM training step: the loss in the step, grads of the weights."""

  def run(params, xs, **remat):
    def step(carry, x):
      h, c = carry
      gates = x @ params["wx"] + h @ params["wh"] + params["b"]
      i, f, g, o = jnp.split(gates, 4, axis=-1)
      c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
      h = jax.nn.sigmoid(o) * jnp.tanh(c)
      return (h, c), jnp.sum(h**2)

    zeros = jnp.zeros([batch, hidden])
    _, losses = hkb.scan(step, (zeros, zeros), xs, **remat)
    return jnp.sum(losses)

  params = {
    "wx": jnp.zeros([inputs, 4 * hidden]),
    "wh": jnp.zeros([hidden, 4 * hidden]),
    "b": jnp.zeros([4 * hidden]),
  }
  return (lambda **remat: jax.value_and_grad(functools.partial(run, **remat))), params


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true", help="small shapes, for a CPU")
  parser.add_argument(
    "--only",
    default="",
    help="a regular expression: only the models it finds (e.g. 'jax_lstm|lstm_4096')",
  )
  args = parser.parse_args()
  small, only = args.small, re.compile(args.only)
  print(
    f"backend {jax.default_backend()}: {jax.devices()[0].device_kind}, jax {jax.__version__}",
    flush=True,
  )
  if small:
    grid = remat_models.models((256,), (16,), (16,), (32,))
    hidden, batch, length = 64, 8, 512
  else:
    grid = remat_models.models((256, 1024, 4096), (16, 64), (16, 64), (32,))
    grid.update(remat_auto_bench.planning_models("full"))  # Issue 42's three.
    hidden, batch, length = 1024, 64, 4096
  rows = rolled_loops()
  print("\n".join(r for r, _ in rows), flush=True)
  for name, model in grid.items():
    if not only.search(name):
      continue
    start = time.perf_counter()
    net, x = model()
    params = net.init(KEY, x)
    rows += check(name, functools.partial(haiku_step, model), (params, x))
    print("\n".join(r for r, _ in rows[-7:]), flush=True)
    print(f"     ({time.perf_counter() - start:.0f} s)", flush=True)
  name = f"jax_lstm_H{hidden}_B{batch}_T{length}"
  if only.search(name):
    start = time.perf_counter()
    step_of, params = lstm_step(hidden, batch, 32)
    xs = jnp.ones([length, batch, 32])
    rows += check(name, step_of, (params, xs))
    print("\n".join(r for r, _ in rows[-7:]), flush=True)
    print(f"     ({time.perf_counter() - start:.0f} s)", flush=True)
  failed = [r for r, ok in rows if not ok]
  print(
    f"{len(rows) - len(failed)} of {len(rows)} within bounds"
    + ("" if not failed else ":\n" + "\n".join(failed))
  )
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
