"""What the tests of `remat="auto"` share: a step to plan, its loss and compiled bytes, the measuring compiles counted, and the skips on a TPU.

The planner's modules each have their tests beside them (haiku_bridge/_src/remat/: `plan_test`,
the public API and the plans end to end; `tracing_test`, `measure_test`, `choice_test`,
`plan_cache_test`); the models they measure are `remat_models.py`'s.
"""

import contextlib
import functools
import os
import tempfile
import threading
from typing import Any, Callable, Iterator
from unittest import mock

import jax
import jax.numpy as jnp

import haiku_bridge as hkb
from haiku_bridge._src.remat import hlo_flops
from haiku_bridge._src.remat import measure

# What the tests that hold on XLA:CPU and XLA:GPU only are sized on: on a TPU they skip
# (`on_cpu_and_gpu`), and `testing/accelerator_check.sh` reports what fails there. The TPU's bytes
# are checked at users' sizes by `testing/remat_auto_check.py`.
TOY_BYTES = (
  "compiled bytes of toy widths against a budget or a prediction: on a TPU, "
  "memory_analysis() of such programs counts arrays XLA:TPU keeps outside "
  "HBM (memory space 1; the user's step and the plan's measuring program "
  "held the same HBM where their figures differed by 2-32%, RESULTS.md, "
  "'On a TPU, a third time')"
)
CPU_SIZED = (
  "budgets, plan kinds or compile counts set on XLA:CPU's figures "
  "(a TPU pads these toy arrays to its tiles and chooses otherwise)"
)

# What the tests allow a whole training step's compiled bytes over the budget (README, "Choosing
# remat": the loop's own gradient is held to it).
STEP_TOLERANCE = 0.02


def plan_in_a_directory_of_its_own(test_file: str) -> None:
  """Plans made by this process kept in a directory of its own, unless the environment names one.

  A test file's processes run side by side (Bazel's shards, pytest's workers), and its tests count
  what a plan compiles after clearing the caches: no plan another process wrote may be read there
  (a shard once found one: 0 compiles), unless the test gives it one (a fresh process of
  `test_plans_persist_across_processes`).
  """
  name = os.path.splitext(os.path.basename(test_file))[0]
  os.environ.setdefault("HAIKU_BRIDGE_CACHE_DIR", tempfile.mkdtemp(prefix=f"{name}_"))


def on_cpu_and_gpu(reason: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """A test that skips on a TPU, for `reason` (`TOY_BYTES`, `CPU_SIZED`)."""

  def decorate(test):
    @functools.wraps(test)
    def run(self, *args, **kwargs):
      if jax.default_backend() == "tpu":
        self.skipTest(f"on a TPU: {reason}.")
      return test(self, *args, **kwargs)

    return run

  return decorate


@contextlib.contextmanager
def measuring_compiles() -> Iterator[list[str]]:
  """The compiles `remat="auto"` measures while the block runs: each one's thread name."""
  threads: list[str] = []  # list.append is atomic: compiles run in threads.
  real = measure._compile  # pylint: disable=protected-access

  def counted(lowered):
    threads.append(threading.current_thread().name)
    return real(lowered)

  with mock.patch.object(measure, "_compile", counted):
    yield threads


@contextlib.contextmanager
def tpu_like_figures(factor: int) -> Iterator[None]:
  """Every measuring compile's bytes read as XLA:TPU's would be, while the block runs (on a TPU: its own, untouched).

  Two ways a TPU's figures differ from the CPU's, and the second reorders the plans:

  - XLA:TPU pads small arrays to its tiles: the toy's `f32[4, 16]` to an (8, 128) tile, 16 times
    its bytes. Every array of the toy is one of those (or a stack of them), so every byte is read
    `factor` times over: no budget is set in one backend's bytes.
  - At toy sizes XLA:TPU reports a `temp_size_in_bytes` only for a program with a remat
    schedule's conditional, and there above the program's whole peak (a binomial step: 1,036,800
    against a peak of 358,400, RESULTS.md, "On a TPU"), which `hlo_flops.temporaries` takes (the
    larger of it and the peak's temporaries). So a schedule is read at no less than its peak,
    arguments and outputs among them, over what a plan without one is read at: taken here at that
    least, the CPU's temporaries, arguments and outputs added to its temporaries. For a loop whose inputs and their cotangents outweigh a stack of its
    carries (the toy's), every schedule then reads above remat=True.
  """
  if jax.default_backend() == "tpu":
    yield
    return
  real = hlo_flops.held

  def held(compiled, text=None):
    text = compiled.as_text() if text is None else text
    got = real(compiled, text)
    temporaries = got.temporaries
    if " conditional(" in text:
      a = compiled.memory_analysis()
      peak = temporaries + a.argument_size_in_bytes + a.output_size_in_bytes - a.alias_size_in_bytes
      temporaries += peak
    return hlo_flops.Held(temporaries * factor, got.constants * factor)

  with mock.patch.object(hlo_flops, "held", held):
    yield


def toy_step(h, x):
  """A tanh RNN's step over a carry of width 16, its loss in the step."""
  h = jnp.tanh(h @ jnp.eye(16) + x)
  return h, jnp.sum(h**2)


def compiled_bytes(f, *args) -> int:
  """What `memory_budget` counts of `jax.jit(f)(*args)`: its temporaries and constants, compiled."""
  return hlo_flops.held(jax.jit(f).lower(*args).compile()).bytes


def scan_loss(step_fn, init, remat, **options):
  """A training loss of `hkb.scan(step_fn, init, xs)`: every float output, squared."""

  def loss(xs):
    carry, ys = hkb.scan(step_fn, init, xs, remat=remat, **options)
    return sum(
      jnp.sum(jnp.square(leaf.astype(jnp.float32)))
      for leaf in jax.tree.leaves((carry, ys))
      if jnp.issubdtype(leaf.dtype, jnp.floating)
    )

  return loss
