"""The step compiled at a rung of `hkb.budgeted_jit`'s search: its bytes as a device holds them, the compiles one by one or in threads.

A compile's figure is the step's on one device (`step_bytes`, what the
budget checks); one that runs out of device memory (RESOURCE_EXHAUSTED, as
XLA:TPU's compiler raises, fast, for a program over its HBM) has no bytes:
a rung over any budget, never an error (`compiled`). A draft
(`measure.draft_options`, on a TPU) is a cheaper compile whose bytes only
aim. The search (`step_search.py`) asks for compiles through a `Compiler`:
`OneByOne` compiles each when asked; `Ahead` lowers the rung likely asked
next while one compiles in a thread, and on a TPU compiles what the search
starts together side by side.
"""

import concurrent.futures
import contextvars
import threading
import time
from typing import Any, Callable, Generic, Hashable, NamedTuple, Optional, TypeVar

import jax

from haiku_bridge._src.remat import measure
from haiku_bridge._src.remat import tracing

API = "budgeted_jit"  # The public call whose compiles these are, as its messages name it.
THREADS = API  # The names of a search's compiling threads begin so.
K = TypeVar("K", bound=Hashable)  # What a compile is asked for by: a rung of the search.


class StepTry(NamedTuple):
  """One compile of the step: the rung, its bytes (None: out of device memory), its seconds (lowering and compiling).

  `measuring`: compiled with XLA's cheaper code generation, which keeps
  the buffers (on the CPU: `measure.measuring_options`), for its bytes
  only; where that rung is the choice it is then compiled as it runs, and
  checked (a rung the search aims at compiles as it runs from the start).
  `draft`: compiled at XLA's least effort beside the search's other
  compiles (`measure.draft_options`, on a TPU), its bytes off the
  step's by a constant: read for the slope of the schedules' line only.
  """

  rung: str
  bytes: Optional[int]
  seconds: float
  measuring: bool = False
  draft: bool = False

  def __str__(self) -> str:
    how = ", measuring" if self.measuring else ", draft" if self.draft else ""
    return (
      f"{self.rung}: "
      + ("out of device memory" if self.bytes is None else f"{self.bytes:,} bytes")
      + f" ({self.seconds:.1f} s{how})"
    )


def step_bytes(analysis: Any, platform: str) -> int:
  """The bytes a compiled step holds on one device: what `budgeted_jit` checks.

  Its arguments, its outputs (less those that reuse a donated argument's
  buffer), its temporaries and its code, as XLA's memory analysis gives
  them. XLA:TPU also gives the peak of the buffers live at once, the
  arguments and outputs among them, and at small sizes reports temporaries
  only in part: there the larger of the two, each buffer counted once.

  >>> from haiku_bridge._src.remat import step_compiles
  >>> x = jnp.ones([256, 256])  # 256 KiB.
  >>> compiled = jax.jit(lambda x: jnp.tanh(x @ x)).lower(x).compile()
  >>> step_compiles.step_bytes(compiled.memory_analysis(),
  ...                          jax.default_backend()) >= 2 * x.nbytes
  True
  """
  total = (
    analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    - analysis.alias_size_in_bytes
    + analysis.temp_size_in_bytes
    + analysis.generated_code_size_in_bytes
  )
  if platform == "tpu":
    total = max(
      total, getattr(analysis, "peak_memory_in_bytes", 0) + analysis.generated_code_size_in_bytes
    )
  return int(total)


def device_memory() -> Optional[int]:
  """The bytes the default device has for XLA (`memory_stats()["bytes_limit"]`); None where it does not say (the CPU)."""
  stats = jax.devices()[0].memory_stats()
  limit = (stats or {}).get("bytes_limit")
  return int(limit) if limit else None


def out_of_memory(error: Exception) -> bool:
  """Whether a compile failed for want of device memory (XLA's RESOURCE_EXHAUSTED)."""
  return "RESOURCE_EXHAUSTED" in str(error)


class Compiled(NamedTuple):
  """One compile of the step at a rung, as the search keeps it (`compiled`, `drafted`)."""

  bytes: Optional[int]  # None: out of device memory.
  compiled: Any
  seconds: float  # Lowering and compiling.
  lowered: Any
  measuring: bool  # With `measure.measuring_options`: bytes only.
  draft: bool = False  # With `measure.draft_options`: a line's slope only.


def xla_compile(lowered: Any, options: dict[str, Any]) -> Any:
  """`lowered.compile(options)`: one seam, where a test runs a device out of memory."""
  return lowered.compile(options) if options else lowered.compile()


def compiled(lowered: Any, lowering: float, options: dict[str, Any]) -> Compiled:
  """`lowered` (in `lowering` seconds) compiled with `options`, its bytes read; out of device memory, no bytes."""
  start = time.perf_counter()
  try:
    program = xla_compile(lowered, options)
  except Exception as error:  # pylint: disable=broad-except
    if not out_of_memory(error):
      raise
    program = None
  return Compiled(
    None if program is None else step_bytes(program.memory_analysis(), jax.default_backend()),
    program,
    lowering + time.perf_counter() - start,
    lowered,
    bool(options),
  )


def drafted(lowered: Any, lowering: float, options: dict[str, Any]) -> Compiled:
  """A draft of `lowered`: its bytes at `options` (`measure.draft_options`), no program kept; any failure, no bytes (a draft only aims)."""
  try:
    done = compiled(lowered, lowering, options)
  except Exception as error:  # pylint: disable=broad-except
    tracing.LOG.debug("hkb.%s: a draft compile failed: %s", API, error)
    done = Compiled(None, None, lowering, None, False)
  return done._replace(compiled=None, lowered=None, measuring=False, draft=True)


class Compiler(Generic[K]):
  """Compiles the step at a rung when asked (`__call__`), and drafts it (`draft`) where it can; hints let it look ahead."""

  drafting = False  # Whether `draft` compiles.

  def __call__(self, rung: K, as_runs: bool = False) -> Compiled:
    """`rung` compiled; with `as_runs`, as the step runs (no measuring options), where the compiler measures otherwise."""
    raise NotImplementedError

  def draft(self, rung: K) -> Compiled:
    """A draft of the step at `rung` (`_drafted`), where `drafting`."""
    raise NotImplementedError

  def lower(self, rung: K) -> None:
    """A hint: `rung` is likely asked for after the compile under way."""

  def start(self, rung: K) -> None:
    """`rung` is asked for next: its compile may begin."""

  def start_draft(self, rung: K) -> None:
    """`rung`'s draft is asked for next: its compile may begin."""

  def close(self) -> None:
    """Ends what was started."""


class OneByOne(Compiler[K]):
  """Each rung compiled (or drafted) when asked, by `compile_at` (`draft_at`): the hints and `as_runs` ignored."""

  def __init__(
    self,
    compile_at: Callable[[K], Compiled],
    draft_at: Optional[Callable[[K], Compiled]] = None,
  ):
    self._compile_at, self._draft_at = compile_at, draft_at
    self.drafting = draft_at is not None

  def __call__(self, rung: K, as_runs: bool = False) -> Compiled:
    return self._compile_at(rung)

  def draft(self, rung: K) -> Compiled:
    assert self._draft_at is not None
    return self._draft_at(rung)


class Ahead(Compiler[K]):
  """A search's compiles in threads, each next rung lowered while the last compiles.

  Lowering traces the step in Python, under the GIL; XLA compiles without
  it. So the rung the search is likely to ask for next is lowered on the
  caller's thread while the one it asked for compiles in another: the
  search waits for the longer of the two, not their sum. Only what the
  search starts is compiled (a rung lowered ahead and never asked for
  costs its lowering, alongside a compile); each figure is its own
  program's. With `draft_lowered` (drafts: `measure.draft_options`) the
  compiles the search starts together run side by side, in
  `measure.DRAFT_CORES` threads, a draft from a lowering of its own; else
  one at a time. A rung asked for `as_runs` compiles with
  `compile_as_runs`, a compile apart from its measuring one (none given:
  the two are one, `compile_lowered`); a rung is lowered once for both.
  `start_aside` compiles a rung as it runs in a thread of its own, beside
  the search's, for the search to ask for or not. The threads run in the
  caller's context (`contextvars`): an error there names the public
  call. At `close` a compile started and not waited for finishes in its
  thread, unused, and one not yet begun (its thread still busy, or not
  yet running) is cancelled: a count of the compiles a search left unused
  depends on timing.
  """

  def __init__(
    self,
    lower_at: Callable[[K], tuple[Any, float]],
    compile_lowered: Callable[[Any, float], Compiled],
    draft_lowered: Optional[Callable[[Any, float], Compiled]] = None,
    compile_as_runs: Optional[Callable[[Any, float], Compiled]] = None,
  ):
    self._lower_at, self._compile_lowered = lower_at, compile_lowered
    self._draft_lowered = draft_lowered
    self._compile_as_runs = compile_as_runs or compile_lowered
    self._as_runs_apart = compile_as_runs is not None
    self.drafting = draft_lowered is not None
    self._lowered: dict[K, tuple[Any, float]] = {}
    # By (rung, as it runs): a rung's measuring compile and the one as it runs are two.
    self._jobs: dict[tuple[K, bool], concurrent.futures.Future[Compiled]] = {}
    self._drafts: dict[K, concurrent.futures.Future[Compiled]] = {}
    self._pool = concurrent.futures.ThreadPoolExecutor(
      measure.DRAFT_CORES if self.drafting else 1, thread_name_prefix=THREADS
    )
    self._aside: Optional[concurrent.futures.ThreadPoolExecutor] = None

  def given(self, rung: K, lowered: Any, seconds: float) -> None:
    """`rung`, already lowered (in `seconds`)."""
    self._lowered[rung] = lowered, seconds

  def _job(self, rung: K, as_runs: bool) -> tuple[K, bool]:
    return rung, as_runs and self._as_runs_apart

  def lower(self, rung: K) -> None:
    if rung not in self._lowered:
      self._lowered[rung] = self._lower_at(rung)

  def _lowering(self, rung: K) -> tuple[Any, float]:
    """`rung` lowered (here, where not yet) and the seconds it took; a second compile of it took none."""
    self.lower(rung)
    program, seconds = self._lowered[rung]
    self._lowered[rung] = program, 0.0
    return program, seconds

  def start(self, rung: K, as_runs: bool = False, aside: bool = False) -> None:
    if self._job(rung, as_runs) not in self._jobs:
      compile_lowered = self._compile_as_runs if as_runs else self._compile_lowered
      if aside and self._aside is None:
        self._aside = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=THREADS)
      pool = self._aside if aside else self._pool
      self._jobs[self._job(rung, as_runs)] = self._submit(
        pool, compile_lowered, *self._lowering(rung)
      )

  def start_aside(self, rung: K) -> None:
    """`rung` lowered, then compiled as it runs in a thread of its own, beside the search's compiles: the search may ask for it (`as_runs`) or not."""
    self.start(rung, as_runs=True, aside=True)

  def start_draft(self, rung: K) -> None:
    if rung not in self._drafts:
      assert self._draft_lowered is not None
      self._drafts[rung] = self._submit(self._pool, self._draft_lowered, *self._lower_at(rung))

  @staticmethod
  def _submit(pool, compile_lowered, program, seconds) -> concurrent.futures.Future[Compiled]:
    context = contextvars.copy_context()
    return pool.submit(lambda: context.run(compile_lowered, program, seconds))

  def __call__(self, rung: K, as_runs: bool = False) -> Compiled:
    self.start(rung, as_runs)
    return self._jobs.pop(self._job(rung, as_runs)).result()

  def draft(self, rung: K) -> Compiled:
    self.start_draft(rung)
    return self._drafts.pop(rung).result()

  def close(self) -> None:
    # A compile the search did not wait for (remat=True's beside a plain
    # step that fits, drafts beside a remat=True that fits, the rest of a
    # round the choice left behind) finishes in its thread, unused; one not
    # yet begun is cancelled.
    for pool in (self._pool, self._aside):
      if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
    self._lowered.clear()
    self._jobs.clear()
    self._drafts.clear()


def unused_compiles_ended() -> None:
  """Returns once the compiles searches started and left unused (`Ahead.close`) have ended: a timing or a count after it is not shared with them."""
  for thread in threading.enumerate():
    if thread.name.startswith(THREADS):
      thread.join()
