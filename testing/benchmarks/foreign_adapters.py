r"""Foreign blocks through their adapters against the same modules run natively.

For a Flax NNX block and the same block in Linen (`hkb.from_flax`) and an
Equinox MLP (`hkb.from_equinox`), each inside a Haiku transform, against the
same module called natively with the same weights:

1. whether the optimised HLO of the training step (gradient of a loss of the
   block's output, weights as one flat list in the same order) is identical;
2. the ratio of Python trace times (`jax.jit(step).trace(...)` of a fresh
   function, the adapter's skeleton cache warm as after `init`), adapter over
   native: median [min-max] of pair-by-pair ratios, order alternated; in wall
   time and in the tracing thread's CPU time (`time.thread_time`), which
   other processes' load hardly moves.

It prints the figures and never fails on a timing.

    PYTHONPATH=. python3 testing/benchmarks/foreign_adapters.py [--repeats=N]
"""

import functools
import gc
import statistics
import time
from typing import Any, Callable

from absl import app
from absl import flags
import equinox as eqx
from flax import nnx
import flax.linen as nn
import haiku as hk
import haiku_bridge as hkb
from testing import test_utils
import jax
import jax.numpy as jnp

_REPEATS = flags.DEFINE_integer("repeats", 15, "Timed traces per variant.")

WIDTH, BATCH = 64, 32


class NnxBlock(nnx.Module):
  def __init__(self, width: int, *, rngs: nnx.Rngs):
    self.linear1 = nnx.Linear(width, 4 * width, rngs=rngs)
    self.linear2 = nnx.Linear(4 * width, width, rngs=rngs)
    self.norm = nnx.LayerNorm(width, rngs=rngs)

  def __call__(self, x):
    return x + self.linear2(jax.nn.gelu(self.linear1(self.norm(x))))


def _steps(
  native_loss: Callable[[list[Any], Any], Any], adapter_loss: Callable[[list[Any], Any], Any]
):
  grad = lambda loss: lambda ws, x: jax.grad(loss)(ws, x)
  return {"native": grad(native_loss), "adapter": grad(adapter_loss)}


def _flax_adapter_loss(f: hk.Transformed, paths: list[tuple[str, ...]]):
  """The loss through a Flax adapter named `block`, weights in `paths` order."""

  def adapter(ws, x):
    p = {}
    for path, w in zip(paths, ws):
      p.setdefault("block/" + "/".join(path[:-1]), {})[path[-1]] = w
    return jnp.sum(f.apply(p, x) ** 2)

  return adapter


def nnx_case():
  make = functools.partial(NnxBlock, WIDTH)
  graphdef, params, rest = nnx.split(make(rngs=nnx.Rngs(0)), nnx.Param, ...)
  paths = [
    tuple(str(k.key) for k in p if hasattr(k, "key"))
    for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
  ]
  treedef = jax.tree.structure(params)
  f = hk.without_apply_rng(hk.transform(lambda x: hkb.from_flax(make, name="block")(x)))
  x = jnp.ones([BATCH, WIDTH])
  hk_params = f.init(jax.random.PRNGKey(0), x)
  ws = [hk_params["block/" + "/".join(p[:-1])][p[-1]] for p in paths]

  def native(ws, x):
    m = nnx.merge(graphdef, jax.tree.unflatten(treedef, ws), rest, copy=True)
    return jnp.sum(m(x) ** 2)

  return _steps(native, _flax_adapter_loss(f, paths)), ws, x


class LinenBlock(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="norm")(x)
    h = nn.Dense(4 * self.width, name="linear1")(h)
    return x + nn.Dense(self.width, name="linear2")(jax.nn.gelu(h))


def linen_case():
  module = LinenBlock(WIDTH)
  x = jnp.ones([BATCH, WIDTH])
  params = module.init(jax.random.PRNGKey(0), x)["params"]
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  paths = [tuple(k.key for k in p) for p, _ in flat]
  f = hk.without_apply_rng(
    hk.transform(lambda x: hkb.from_flax(module, name="block", rng_streams=())(x))
  )
  hk_params = f.init(jax.random.PRNGKey(0), x)
  ws = [hk_params["block/" + "/".join(p[:-1])][p[-1]] for p in paths]

  def native(ws, x):
    return jnp.sum(module.apply({"params": jax.tree.unflatten(treedef, ws)}, x) ** 2)

  return _steps(native, _flax_adapter_loss(f, paths)), ws, x


def equinox_case():
  make = functools.partial(eqx.nn.MLP, WIDTH, WIDTH, 4 * WIDTH, 2)
  params, static = eqx.partition(make(key=jax.random.PRNGKey(0)), eqx.is_array)
  treedef = jax.tree.structure(params)
  f = hk.without_apply_rng(
    hk.transform(lambda x: hk.vmap(hkb.from_equinox(make, name="mlp"), split_rng=False)(x))
  )
  x = jnp.ones([BATCH, WIDTH])
  hk_params = f.init(jax.random.PRNGKey(0), x)
  names = [(f"mlp/layers_{i}", n) for i in range(3) for n in ("weight", "bias")]
  ws = [hk_params[m][n] for m, n in names]

  def native(ws, x):
    m = eqx.combine(jax.tree.unflatten(treedef, ws), static)
    return jnp.sum(jax.vmap(m)(x) ** 2)

  def adapter(ws, x):
    p = {}
    for (m, n), w in zip(names, ws):
      p.setdefault(m, {})[n] = w
    return jnp.sum(f.apply(p, x) ** 2)

  return _steps(native, adapter), ws, x


def trace_seconds(step, ws, x) -> tuple[float, float]:
  """Wall and thread CPU seconds of one trace of `step`."""
  gc.disable()
  try:
    fresh = jax.jit(lambda ws, x: step(ws, x))  # No trace cache hit.
    wall, cpu = time.perf_counter(), time.thread_time()
    fresh.trace(ws, x)
    return time.perf_counter() - wall, time.thread_time() - cpu
  finally:
    gc.enable()


def _summary(ratios: list[float]) -> str:
  return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"


def report(name: str, case) -> None:
  steps, ws, x = case
  hlo = {v: test_utils.canonical_hlo(jax.jit(s).lower(ws, x).compile()) for v, s in steps.items()}
  same = hlo["native"] == hlo["adapter"]
  wall, cpu = [], []
  for i in range(_REPEATS.value + 2):
    order = ["native", "adapter"] if i % 2 else ["adapter", "native"]
    times = {v: trace_seconds(steps[v], ws, x) for v in order}
    if i >= 2:  # The first two are warm-up.
      wall.append(times["adapter"][0] / times["native"][0])
      cpu.append(times["adapter"][1] / times["native"][1])
  print(
    f"{name:8s} identical optimised HLO: {'yes' if same else 'NO'};  "
    f"trace time adapter/native: wall {_summary(wall)}, thread CPU "
    f"{_summary(cpu)} over {len(wall)} pairs"
  )


def main(argv: list[str]) -> None:
  del argv  # Unused.
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}; block width {WIDTH}, batch {BATCH}")
  report("nnx", nnx_case())
  report("linen", linen_case())
  report("equinox", equinox_case())


if __name__ == "__main__":
  app.run(main)
