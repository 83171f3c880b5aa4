"""Small scans whose FLOPs are counted two ways: `hlo_flops` on the loop rolled, XLA unrolled.

XLA's own count (`cost_analysis`) sees one step of a rolled loop; of the same
loop unrolled it counts every step, which is the ground truth `hlo_flops`'s
count of the rolled loop (every loop by its trip count) is held to, on CPU
(XLA:GPU's count of an unrolled program counts each copy of a value its
fusions make). `haiku_bridge/_src/remat/hlo_flops_test.py` checks this in the
suite, and `testing/remat_auto_check.py` on the machine it runs on.
"""

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from haiku_bridge._src.remat import hlo_flops

W = jnp.linspace(-1, 1, 32 * 32).reshape(32, 32)
H = jnp.zeros([4, 32])
XS = jnp.ones([8, 4, 32])


def step(h, x):
  h = jnp.tanh(h @ W + x)
  return h, jnp.sum(h**2)


# XLA's CPU count is the ground truth, on any backend (XLA:GPU's cost
# analysis does not count cuDNN's calls).
CPU = jax.devices("cpu")[0]


def compiled(f, *args, device=None):
  """`f` compiled for `args`, on `device` (default: the default backend)."""
  if device is not None:
    args = jax.device_put(args, device)
  return jax.jit(f).lower(*args).compile()


def ours(f, *args, device=None) -> hlo_flops.Count:
  return hlo_flops.count(compiled(f, *args, device=device).as_text())


def xla(f, *args, device=None) -> float:
  """XLA's count, right where no loop is left (transcendentals as FLOPs)."""
  analysis = compiled(f, *args, device=device).cost_analysis()
  return analysis["flops"] + analysis.get("transcendentals", 0.0)


def gradient(body, unroll=1):
  """The gradient of a loss of a scan of `body` over `XS`."""

  def loss(h, xs):
    h, ys = jax.lax.scan(body, h, xs, unroll=unroll)
    return jnp.sum(ys) + jnp.sum(h)

  return jax.grad(loss, argnums=(0, 1))


def nested(unroll=1):
  """The gradient of a scan over 2 scans of 4 steps each."""

  def loss(h, xs):
    inner = lambda h, xs: jax.lax.scan(step, h, xs, unroll=unroll)
    h, ys = jax.lax.scan(inner, h, xs.reshape(2, 4, *xs.shape[1:]), unroll=unroll)
    return jnp.sum(ys) + jnp.sum(h)

  return jax.grad(loss, argnums=(0, 1))


# Each program of `H` and `XS`, by name, made with the scans' `unroll`: 1 (rolled) or True.
LOOPS: dict[str, Callable[[Any], Callable[..., Any]]] = {
  "scan": lambda unroll: lambda h, xs: jax.lax.scan(step, h, xs, unroll=unroll),
  "gradient": lambda unroll: gradient(step, unroll),
  "nested": nested,
  # Rolled, the checkpointed step; unrolled, the plain one (see `unrolled`). (`True == 1`:
  # `unroll == 1` made the unrolled one checkpointed too.)
  "checkpointed": lambda unroll: gradient(step if unroll is True else jax.checkpoint(step), unroll),
}


def unrolled(name: str, device: Optional[Any] = None) -> float:
  """XLA's count of `LOOPS[name]` unrolled, on `device`: what `ours` of it rolled should count.

  Unrolled, a checkpointed step's recomputation is merged with the forward
  pass on jax 0.10 and kept on jax 0.12 (60,160 FLOPs more), so
  `"checkpointed"`'s truth is the plain gradient unrolled plus, for each
  step, the forward of its carry that `jax.checkpoint` runs again.
  """
  flops = xla(LOOPS[name](True), H, XS, device=device)
  if name == "checkpointed":
    flops += len(XS) * xla(lambda h, x: step(h, x)[0], H, XS[0], device=device)
  return flops
