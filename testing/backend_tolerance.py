"""What two computations of the same values may differ by, on each backend.

The tests compare the bridge with inline Haiku (or one remat schedule with
another) by running both. On the CPU the two agree as the tests state it: an
initial value bit for bit, a loss and its gradients within float32 rounding
(`values()`). A GPU's arithmetic is another: op-by-op and jitted random
initialisers differ in the last bit, float32 matmuls run in TF32 by default
on Ampere and newer, and its reductions associate differently, so a
recomputed forward (a remat schedule) lands a few rounding steps away. There
the bound is explicit and small, each beside the largest difference measured
on an H200 with jax 0.11.2 (`bash testing/accelerator_check.sh`, 2026-12-04):

- `assert_same`: bit-exact on the CPU; elsewhere within 1e-6 (measured: 4.3e-7
  relative, one float32 ulp, between a jitted and an op-by-op init).
- `values()` (losses, first-order gradients): CPU rtol 1e-5; elsewhere 1e-4
  (measured: 1.6e-5, a char LM's loss under `readout=` against the usual form).
- `second_order()` (per-example gradients and Hessian-vector products through a
  recomputing schedule): CPU as `values()`; elsewhere rtol 2e-3 (measured:
  5.5e-4, an LSTM's Hessian-vector product under "nested" against `remat=True`).

- `numerical()` (`jax.test_util.check_grads` of order 2, finite differences
  of float32): CPU atol/rtol 1e-2; elsewhere 5e-2 (measured on a TPU v5e, jax
  0.10.2, 2026-12-05: 2.6e-2 relative, a custom_jvp MLP's VJP of its JVP).
A fresh process's values (`testing/test_utils.py`) need no bound here: beside
a TPU the fresh process runs on the CPU, and the values it is compared with
are computed on this process's CPU (`test_utils.on_the_fresh_process_backend`),
so the CPU's bounds hold. (Compared with the TPU's instead, a gradient summing
terms of opposite signs moved by up to 1.9e-4 of its array's largest entry,
which each new case exceeded again.)

On a TPU the tests run with `JAX_DEFAULT_MATMUL_PRECISION=highest`
(`testing/accelerator_check.sh` sets it): at XLA:TPU's default a float32 matmul runs
in bfloat16 passes, and a test comparing two computations of the same
values, or a finite difference with its derivative, then fails by far more
than any bound here (measured there at the default: 16 of 18 such tests
failed, `check_grads` 86% off, per-example gradients 1.3e-4; at "highest",
1 of 85, the one `numerical()` now bounds).

Tests compare like with like first (a jitted init with a jitted init), so
these bounds cover arithmetic, never a difference in what is computed.
"""

from typing import Any

import chex
import jax


def on_cpu() -> bool:
  return jax.default_backend() == "cpu"


def _by_backend(cpu: dict[str, float], other: dict[str, float]):
  return cpu if on_cpu() else other


_CPU_VALUES = dict(rtol=1e-5, atol=1e-6)


def values() -> dict[str, float]:
  """`rtol`/`atol` for losses and first-order gradients computed two ways."""
  return _by_backend(_CPU_VALUES, dict(rtol=1e-4, atol=1e-5))


def second_order() -> dict[str, float]:
  """`rtol`/`atol` for gradients of gradients through a recomputing schedule."""
  return _by_backend(_CPU_VALUES, dict(rtol=2e-3, atol=2e-4))


def numerical() -> dict[str, float]:
  """`atol`/`rtol` for `jax.test_util.check_grads` of order 2 (finite differences of float32)."""
  return _by_backend(dict(atol=1e-2, rtol=1e-2), dict(atol=5e-2, rtol=5e-2))


def assert_same(got: Any, want: Any) -> None:
  """The same values: bit for bit on the CPU, within one or two ulp elsewhere."""
  if on_cpu():
    chex.assert_trees_all_equal(got, want)
  else:
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)
