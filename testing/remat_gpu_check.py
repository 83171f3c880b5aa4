r"""`remat="auto"` on whatever backend runs it: predicted against compiled bytes, choice against budget.

A standalone check (no pytest) for a machine the test suite does not run on,
a GPU above all: for `remat/plan_test`'s models and a plain-JAX LSTM training
step (H=1024, B=64, T=4096, the loss in the step), it plans each at a tight
and a middle budget, prints the plan's first prediction for its choice (before
the compiled check), the choice and what the compiled training step takes
(XLA's temporaries and the constants of the program), and for `remat=False`
and `remat=True` the prediction against the compiled step. Exits 1 if a
whole step compiles over its budget by more than the tests allow
(`remat/plan_test.py`'s `STEP_TOLERANCE`), or a prediction of `False`/`True` is more
than 10% off. `--small`: small shapes for a CPU (a minute or two).

    PYTHONPATH=. python3 testing/remat_gpu_check.py            # the GPU's run
    PYTHONPATH=. python3 testing/remat_gpu_check.py --small    # a CPU's
    PYTHONPATH=. python3 testing/remat_gpu_check.py --only 'jax_lstm|lstm_4096'

Each model prints its seconds: on a GPU (XLA autotunes every compile, and
the measuring compiles keep XLA's defaults there), pick with `--only` what
fits the time.
"""

import argparse
import contextlib
import functools
import re
import sys
import time
from typing import Any, Iterator
from unittest import mock

import jax
import jax.numpy as jnp

import haiku_bridge as hkb
from haiku_bridge._src.remat import hlo_flops
from haiku_bridge._src.remat import plan as remat_plan
from testing import remat_models

KEY = jax.random.PRNGKey(0)
# What remat/plan_test allows a whole step over its budget, and a prediction
# of remat=False or remat=True off from the compiled step.
STEP_TOLERANCE = 0.02
PREDICTION_TOLERANCE = 0.10


@contextlib.contextmanager
def first_choices() -> Iterator[list[remat_plan.RematCandidate]]:
  """The choice each plan predicted first, before its compiled check."""
  made: list[remat_plan.RematCandidate] = []
  real = remat_plan.choose
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
  with mock.patch.object(remat_plan, "choose", choose), \
      mock.patch.object(remat_plan, "plan", plan):
    yield made


def compiled_bytes(f, *args) -> int:
  """XLA's temporaries and the program's constants, for `jax.jit(f)(*args)`."""
  compiled = jax.jit(f).lower(*args).compile()
  return (compiled.memory_analysis().temp_size_in_bytes +
          hlo_flops.constant_bytes(compiled.as_text()))


def _row(name: str, what: str, predicted: int, compiled: int,
         budget: Any = None, plan: str = "") -> tuple[str, bool]:
  """A line of the report, and whether it is within its bound."""
  if budget is None:
    ok = abs(predicted / compiled - 1) <= PREDICTION_TOLERANCE
    ratio = f"predicted/compiled {predicted / compiled:.3f}"
  else:
    ok = compiled <= budget * (1 + STEP_TOLERANCE)
    ratio = f"compiled/budget {compiled / budget:.3f}"
  return (f"{'ok  ' if ok else 'FAIL'} {name:32} {what:10} {plan:30} "
          f"predicted {predicted / 1e6:10.3f} MB  compiled "
          f"{compiled / 1e6:10.3f} MB  {ratio}"), ok


def _plan_name(k: remat_plan.RematCandidate) -> str:
  return f"{k.remat}" + (f", {k.slots} slots" if k.slots else "")


def check(name: str, step_of, args) -> list[tuple[str, bool]]:
  """`step_of(**remat)`: a training step; each plan and budget checked."""
  rows = []
  with remat_models.plans_made() as made:
    jax.jit(step_of(remat="auto", memory_budget=1 << 50)).lower(*args)
  candidates = made[-1].candidates
  by_kind = {k.remat: k for k in candidates if k.slots is None and
             k.policy is None}
  for remat in (False, True):
    rows.append(_row(name, f"{remat}", by_kind[remat].temporaries,
                     compiled_bytes(step_of(remat=remat), *args)))
  least = min(k.temporaries for k in candidates)
  budgets = {"middle": (by_kind[True].temporaries + least) // 2,
             "tight": int(least * 1.01)}
  for label, budget in budgets.items():
    step = step_of(remat="auto", memory_budget=budget)
    with first_choices() as first, remat_models.plans_made() as made:
      got = compiled_bytes(step, *args)
    choice = made[-1].choice
    rows.append(_row(name, label, first[-1].temporaries, got, budget,
                     f"{_plan_name(first[-1])} -> {_plan_name(choice)}"))
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
      return (h, c), jnp.sum(h ** 2)
    zeros = jnp.zeros([batch, hidden])
    _, losses = hkb.scan(step, (zeros, zeros), xs, **remat)
    return jnp.sum(losses)

  params = {"wx": jnp.zeros([inputs, 4 * hidden]),
            "wh": jnp.zeros([hidden, 4 * hidden]),
            "b": jnp.zeros([4 * hidden])}
  return (lambda **remat: jax.value_and_grad(
      functools.partial(run, **remat))), params


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true",
                      help="small shapes, for a CPU")
  parser.add_argument("--only", default="",
                      help="a regular expression: only the models it finds "
                           "(e.g. 'jax_lstm|lstm_4096')")
  args = parser.parse_args()
  small, only = args.small, re.compile(args.only)
  print(f"backend {jax.default_backend()}: {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}", flush=True)
  if small:
    grid = remat_models.models((256,), (16,), (16,), (32,))
    hidden, batch, length = 64, 8, 512
  else:
    grid = remat_models.models((256, 1024, 4096), (16, 64), (16, 64), (32,))
    hidden, batch, length = 1024, 64, 4096
  rows = []
  for name, model in grid.items():
    if not only.search(name):
      continue
    start = time.perf_counter()
    net, x = model()
    params = net.init(KEY, x)
    rows += check(name, functools.partial(haiku_step, model), (params, x))
    print("\n".join(r for r, _ in rows[-4:]), flush=True)
    print(f"     ({time.perf_counter() - start:.0f} s)", flush=True)
  name = f"jax_lstm_H{hidden}_B{batch}_T{length}"
  if only.search(name):
    start = time.perf_counter()
    step_of, params = lstm_step(hidden, batch, 32)
    xs = jnp.ones([length, batch, 32])
    rows += check(name, step_of, (params, xs))
    print("\n".join(r for r, _ in rows[-4:]), flush=True)
    print(f"     ({time.perf_counter() - start:.0f} s)", flush=True)
  failed = [r for r, ok in rows if not ok]
  print(f"{len(rows) - len(failed)} of {len(rows)} within bounds"
        + ("" if not failed else ":\n" + "\n".join(failed)))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
