"""What XLA's memory analysis says of a loop's gradient, against whether the device takes it.

    python -m testing.benchmarks.memory_reading           # a TPU
    python -m testing.benchmarks.memory_reading --small   # a CPU check

The gradient of a scan of `T` steps over a float32 carry of `n` values
(`tanh(c * x + 1)`, its inputs and its cotangents one carry each), run as
`remat=False` and `True` (`jax.checkpoint` on the step) and as remat
schedules with their conditionals (`"binomial"` at several slot counts,
`"nested"`), each compiled and, where it compiles, run. Per program, one
line: `compiled.memory_analysis()`'s figures, the temporaries
`hlo_flops.temporaries` reads (what a loop's `memory_budget` counts), the
bytes `step_compiles.step_bytes` reads (what `hkb.budgeted_jit` checks),
whether the device's compiler took it (else its RESOURCE_EXHAUSTED message,
which names what it checks) and whether it ran. The device is the ground
truth: a reading above the device's memory for a program that compiled and
ran over-counts.
"""

import time
from typing import Optional

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from haiku_bridge._src.remat import hlo_flops
from haiku_bridge._src.remat import loop
from haiku_bridge._src.remat import scheduled_scan
from haiku_bridge._src.remat import step_compiles

_SMALL = flags.DEFINE_bool("small", False, "Small shapes (a CPU check).")

# (remat, slots or None for the schedule's own, n, T).
PROGRAMS = tuple(
  (remat, slots, 2**25, steps)
  for remat, slots, steps in (
    (False, None, 64),
    (True, None, 64),
    ("binomial", None, 64),
    ("binomial", 24, 64),
    ("binomial", 48, 64),
    ("nested", None, 64),
    (False, None, 128),
    ("binomial", 80, 128),
  )
)


def _step(c: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
  """One step of the loop: the carry and a step's scalar, as `jax.lax.scan` passes them."""
  return jnp.tanh(c * x + 1.0), None


def gradient(remat, slots: Optional[int], steps: int):
  """The jitted gradient of the scan's summed last carry, the loop run as `remat` says."""

  def loss(c0, xs):
    if remat in (False, True):
      c, _ = jax.lax.scan(jax.checkpoint(_step) if remat else _step, c0, xs)
    else:
      schedule = loop.schedule(remat, steps, None, slots)
      c, _ = scheduled_scan.scan(_step, c0, xs, length=steps, schedule=schedule)
    return jnp.sum(c)

  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def reading(remat, slots: Optional[int], n: int, steps: int) -> str:
  """One program's line (see the module's docstring)."""
  c0 = jnp.ones([n], jnp.float32)
  xs = jnp.linspace(0.5, 1.0, steps, dtype=jnp.float32)
  name = (
    f"remat={remat!r}" + (f" slots={slots}" if slots else "") + f", carry {4 * n:,} B, T={steps}"
  )
  start = time.perf_counter()
  try:
    compiled = gradient(remat, slots, steps).lower(c0, xs).compile()
  except Exception as e:  # pylint: disable=broad-except  # The device's refusal is a figure.
    if not step_compiles.out_of_memory(e):
      raise
    return f"{name}: did not compile: {str(e).splitlines()[0][:200]}"
  seconds = time.perf_counter() - start
  a = compiled.memory_analysis()
  platform = jax.default_backend()
  figures = (
    f"temp {a.temp_size_in_bytes:,}, peak {getattr(a, 'peak_memory_in_bytes', 0):,}, "
    f"arguments {a.argument_size_in_bytes:,}, outputs {a.output_size_in_bytes:,}, "
    f"code {a.generated_code_size_in_bytes:,}; read: temporaries "
    f"{hlo_flops.temporaries(a, platform):,}, step {step_compiles.step_bytes(a, platform):,}"
  )
  jax.block_until_ready(compiled(c0, xs))
  return f"{name}: {figures}; compiled in {seconds:.1f} s and ran"


def main(argv):
  del argv
  device = jax.devices()[0]
  print(f"{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"device memory {step_compiles.device_memory()}", flush=True)  # fmt: skip
  for remat, slots, n, steps in PROGRAMS:
    if _SMALL.value:
      n, steps = 1024, steps // 8
      slots = slots and slots // 8
    print(reading(remat, slots, n, steps), flush=True)


if __name__ == "__main__":
  app.run(main)
