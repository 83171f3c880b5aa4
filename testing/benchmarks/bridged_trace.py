r"""Trace time of a bridged Haiku function beside the same code inline.

A `hkb.custom_vjp` block runs `f` inline at init; at apply it runs `f`
abstractly once (to find the params `f` reads) and then as a pure function
inside `jax.custom_vjp`. This measures what that costs where it is paid, when
JAX traces the apply or the training step, for two blocks that the bridge
could not run before (issue 17): an LSTM unrolled with `hk.dynamic_unroll`,
and a transformer block whose attention is under `hk.remat`. Rows:

- apply trace: `jax.make_jaxpr` of `apply`, bridged / inline, median of
  side-by-side pairs (each pair times both, in alternating order);
- step trace: the same for `jax.grad` of a loss;
- step time: the jitted grad step, compiled once, median over runs;
- jaxpr equations of the grad step (a structural fact: the bridged step adds
  only the custom_vjp wrapper).

Timings are ratios measured side by side in one process; on a shared machine
they are noisy. Run from the repository root:

    PYTHONPATH=. python3 testing/benchmarks/bridged_trace.py [--pairs=15]
"""

import statistics
import sys
import time

from absl import app
from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp

import haiku_bridge as hkb
from haiku_bridge._src import jaxpr_walk
from testing import clipped_models as models
from testing.benchmarks.lib import markdown_table

_PAIRS = flags.DEFINE_integer("pairs", 15, "Side-by-side pairs per row.")

KEY = jax.random.PRNGKey(0)


def lstm_block(x):
  return models.lstm_core(x)


def blocks():
  true_rule = lambda f: hkb.custom_vjp(f, hkb.vjp_fwd, lambda vjp_fn, g: vjp_fn(g))
  lstm_x = jax.nn.one_hot(jax.random.randint(KEY, [16, 8], 0, models.VOCAB), models.VOCAB)
  attn_x = jax.random.normal(KEY, [8, 16, models.HIDDEN])
  return {
    "lstm (dynamic_unroll)": (lstm_block, true_rule(lstm_block), lstm_x),
    "transformer block (remat attention)": (
      models.transformer_block,
      true_rule(models.transformer_block),
      attn_x,
    ),
  }


def network(block):
  return hk.transform(lambda x: hk.Linear(x.shape[-1])(block(x)))


def loss_of(f):
  return lambda p, x: jnp.sum(jnp.square(f.apply(p, None, x)))


def timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def pairs(make_ours, make_theirs, n: int) -> float:
  """Median of `ours / theirs` over `n` pairs, alternating which runs first."""
  ratios = []
  for i in range(n):
    if i % 2:
      theirs, ours = timed(make_theirs), timed(make_ours)
    else:
      ours, theirs = timed(make_ours), timed(make_theirs)
    ratios.append(ours / theirs)
  return statistics.median(ratios)


def equations(jaxpr) -> int:
  return sum(1 for _ in jaxpr_walk.equations(jaxpr))


def main(argv):
  del argv
  n = _PAIRS.value
  print(f"jax {jax.__version__}, dm-haiku {hk.__version__}, {n} pairs", file=sys.stderr)
  rows = []
  for name, (f, bridged, x) in blocks().items():
    print(f"measuring {name}", file=sys.stderr)
    ours, theirs = network(bridged), network(f)
    params = theirs.init(KEY, x)
    # A new function object each time: JAX keeps traces per function.
    fresh = lambda f: lambda *a: f(*a)
    apply_trace = pairs(
      lambda: jax.make_jaxpr(fresh(ours.apply))(params, None, x),
      lambda: jax.make_jaxpr(fresh(theirs.apply))(params, None, x),
      n,
    )
    grad = lambda t: jax.grad(loss_of(t))
    step_trace = pairs(
      lambda: jax.make_jaxpr(grad(ours))(params, x),
      lambda: jax.make_jaxpr(grad(theirs))(params, x),
      n,
    )
    steps = {k: jax.jit(grad(t)) for k, t in (("ours", ours), ("theirs", theirs))}
    for step in steps.values():
      jax.block_until_ready(step(params, x))
    run = lambda k: lambda: jax.block_until_ready(steps[k](params, x))
    step_time = pairs(run("ours"), run("theirs"), n)
    eqns = [equations(jax.make_jaxpr(grad(t))(params, x).jaxpr) for t in (ours, theirs)]
    rows.append(
      [
        name,
        f"{apply_trace:.2f}",
        f"{step_trace:.2f}",
        f"{step_time:.2f}",
        f"{eqns[0]} / {eqns[1]}",
      ]
    )
  header = ["block", "apply trace", "step trace", "step time", "grad-step eqns (bridged / inline)"]
  print("\n".join(markdown_table.lines(header, rows)))


if __name__ == "__main__":
  app.run(main)
