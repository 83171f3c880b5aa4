"""The CPU devices that tests see: `use_cpu_devices(8)`, before jax starts a backend.

On a CPU, XLA simulates the devices, so the sharding tests run on any machine. Every test file
that needs them calls `use_cpu_devices` right after `import jax`, before any jax operation: that
is how Bazel runs it (one file per process). Under pytest, which imports every file into one
process, conftest.py calls it first with the same count, and the files' calls change nothing.
"""

import jax

DEFAULT_COUNT = 8


def use_cpu_devices(count: int = DEFAULT_COUNT) -> None:
  """Gives jax `count` CPU devices (`jax_num_cpu_devices`); a no-op if it already has them."""
  if jax.config.jax_num_cpu_devices == count:
    return
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError as e:
    raise RuntimeError(
      f"use_cpu_devices({count}): jax already started its backend with "
      f"jax_num_cpu_devices={jax.config.jax_num_cpu_devices}. Call "
      "use_cpu_devices before any jax operation: first thing after "
      "`import jax` in the test file (or in conftest.py under pytest)."
    ) from e
