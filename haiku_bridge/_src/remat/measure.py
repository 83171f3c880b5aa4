"""What a plan costs, measured and predicted: the loop's training step compiled for a plan and read, and the model that predicts every candidate from a few such compiles.

A measuring program (`_lower`) is the loop's part of a training step, as
the budget counts it: the value and gradient of a loss of the loop's
outputs with respect to what it closes over and its per-step inputs (those
a gradient is taken of, as `tracing.py` reads them), at the loop's own
length T (so that what XLA does only for long loops, or short ones:
unrolling, double buffering, is in every figure), run as a plan says (remat=False; remat=True, under a policy or
none; a schedule of `schedule.py`, run by `scheduled_scan.py`), with the
loop's unroll, the vmaps around it and the derivatives taken of it. It is
compiled with XLA's cheaper code generation (`measuring_options`), which
leaves buffers as they are, and read with `hlo_flops.py`: its bytes (XLA's
temporaries and the constants compiled in) and its FLOPs, every loop by its
trip count. Several compile side by side (`_Compiles`): each program
lowered while the last compiles in a thread, as many compiling at once as
there are cores.

The model, at the loop's own length T:

    remat=False, remat=True, remat=True under a policy:  compiled, exactly
    binomial with s slots:  a + c·s + k + t   (nested: s = its slots)

where t is its tables' bytes as XLA keeps them (`Schedule.table_bytes`:
an int32 per step and one per action, 2·T - 1 - s of them, in five
columns, or four where every advance runs one step and XLA folds the
lengths' column: 18% fewer bytes; `schedule.binomial_table_bytes`), and k
the other constants the program compiles in (one slot's less its
tables'). `coefficients` compiles
remat=False and remat=True (and the policy) beside the binomial schedule
with one slot, so that the least plan's bytes are compiled, and takes a
slot at the carry's bytes (`slot_guess`) until a second schedule, compiled
for a budget, draws the line (`choice.py`). A schedule keeps up
to T - 2 slots (`most_slots`).

Recomputed FLOPs come from the same compiles: r, one step's recomputation
under `jax.checkpoint` (what its backward pass needs), is the FLOPs of
remat=True less those of remat=False, over T, and likewise under the
policy; f, one advance of a schedule (a whole step's forward, for the
carry), is the cheaper branch of the schedule's conditional in its
compile. remat=True recomputes T·r, the policy its own part of each step,
a schedule T·r and f for each step it advances to rebuild carries
(`remat_schedule.binomial_cost`, `Schedule.recomputed_steps`); False none.
`candidates` predicts each candidate's bytes and FLOPs so, but where a
plan was compiled: its compiled bytes.
"""

import concurrent.futures
import contextvars
import dataclasses
import functools
import math
import operator
import os
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import jaxlib

from haiku_bridge._src import caches
from haiku_bridge._src import modes
from haiku_bridge._src import pytree
from haiku_bridge._src import versions
from haiku_bridge._src.remat import hlo_flops
from haiku_bridge._src.remat import schedule as remat_schedule
from haiku_bridge._src.remat import scheduled_scan
from haiku_bridge._src.remat import tracing
from haiku_bridge._src.pytree import PyTree


class RematCandidate(NamedTuple):
  """One way to run a loop, with its predicted cost: a row of `RematPlan`.

  Attributes:
    remat: `False`, `True`, `"nested"` or `"binomial"`, as `remat=` takes it.
    slots: the carries a schedule keeps (None without one).
    groups: `remat_groups` of `"nested"` (None otherwise).
    temporaries: bytes of a training step of the loop that the budget
      counts (XLA's temporaries and the constants compiled in): compiled
      where the plan compiled it, else predicted.
    recomputed_steps: the steps whose forward the backward pass runs
      again (in whole or, under a policy, in part): T for `remat=True`, T
      and the advances that rebuild carries for a schedule.
    recomputed_flops: predicted FLOPs of that recomputation.
    policy: with `remat=True`, the `remat_policy` it runs under, by
      `policy_name` (None: no policy).
    predicted: where `temporaries` is compiled, the model's prediction of
      them (remat=False, remat=True and a policy are predicted by their
      own compiles: the same bytes); None where `temporaries` is the
      prediction, the plan never compiled.
  """

  remat: modes.RematMode
  slots: Optional[int]
  groups: Optional[int]
  temporaries: int
  recomputed_steps: int
  recomputed_flops: int
  policy: Optional[str] = None
  predicted: Optional[int] = None

  @property
  def compiled(self) -> Optional[int]:
    """`temporaries` where the plan was compiled, else None.

    >>> hkb.RematCandidate("binomial", 4, None, 900, 20, 0, None, 1000).compiled
    900
    """
    return None if self.predicted is None else self.temporaries

  def describe(self) -> str:
    """The candidate as one phrase: `remat="binomial", 12 slots`."""
    remat = f'remat="{self.remat}"' if isinstance(self.remat, str) else f"remat={self.remat}"
    return remat + "".join(
      f", {text}"
      for value, text in (
        (self.slots, f"{self.slots} slots"),
        (self.groups, f"remat_groups={self.groups}"),
        (self.policy, f"remat_policy={self.policy}"),
      )
      if value is not None
    )


Key = tuple[Any, ...]  # A plan's identity: (remat, slots, groups, policy).


def key(k: RematCandidate) -> Key:
  """A candidate's plan, without its costs: (remat, slots, groups, policy)."""
  return (k.remat, k.slots, k.groups, k.policy)


class Coefficients(NamedTuple):
  """What the model predicts from, measured at the loop's own length (module docstring).

  Bytes are a compiled program's temporaries plus the constants it holds.
  """

  length: int  # T, the steps every figure is measured at.
  plain: int  # remat=False, compiled.
  per_step: Optional[int]  # remat=True, compiled; None: nothing to differentiate.
  scheduled: Optional[tuple[float, float]]  # A schedule with s slots: a + c·s temporaries.
  # A schedule's constants besides its tables (`Schedule.table_bytes`): (k, 0), bytes.
  constants: tuple[float, float]
  step_flops: float  # r: one step's recomputation under jax.checkpoint.
  advance_flops: float  # f: one advance of a schedule.
  # With a policy: its name, its bytes and one step's recomputation under it.
  policy: Optional[tuple[str, int, float]] = None
  # The plans compiled at T, by `key`: their bytes, which override a prediction.
  measured: tuple[tuple[Key, int], ...] = ()


def policy_name(policy: Callable[..., bool]) -> str:
  """How a `RematCandidate` names a policy: a function's name, else its repr.

  A policy object's sets of names are written sorted: Python orders a
  set's strings by their hashes, which differ from process to process
  (`save_only_these_names("a", "b")`), and the name keys its figures on
  disk.

  >>> from haiku_bridge._src.remat import measure
  >>> measure.policy_name(jax.checkpoint_policies.nothing_saveable)
  'nothing_saveable'
  """
  name = getattr(policy, "__name__", None)
  if name:
    return name
  if dataclasses.is_dataclass(policy) and not isinstance(policy, type):
    fields = ", ".join(
      f"{f.name}={_sorted_repr(getattr(policy, f.name))}"
      for f in dataclasses.fields(policy)
      if f.repr
    )
    return f"{type(policy).__name__}({fields})"
  return repr(policy)


def _sorted_repr(value: Any) -> str:
  """`repr(value)`, a set's (or frozenset's) members in sorted order."""
  if isinstance(value, (set, frozenset)):
    members = ", ".join(sorted(map(repr, value)))
    return f"{type(value).__name__}({{{members}}})" if value else repr(value)
  return repr(value)


def measuring_options() -> dict[str, Any]:
  """XLA options for the measuring compiles: cheaper code, the same buffers.

  On CPU, LLVM without optimisation and XLA's older fusion emitters:
  compiles about 10× faster, and neither changes the buffer assignment
  that the memory analysis reads (measure_test checks the figures
  against a compile with XLA's defaults); and the code generated in one
  piece, not split for LLVM threads, which at that level costs more CPU
  time (about a third of a compile) than it saves (the measurements
  compile side by side instead: `_Compiles`). Elsewhere, the defaults.
  jaxlib 0.11's XLA:CPU has no older emitters (nor the option: a compile
  given it fails), so there only the other two.
  """
  if jax.default_backend() != "cpu":
    return {}
  options: dict[str, Any] = {
    "xla_backend_optimization_level": 0,
    "xla_cpu_parallel_codegen_split_count": 1,
  }
  if OLDER_FUSION_EMITTERS:
    options["xla_cpu_use_fusion_emitters"] = False
  return options


def draft_options() -> Optional[dict[str, Any]]:
  """XLA options for `hkb.budgeted_jit`'s drafts: a cheaper compile, its bytes off by a constant; None: no drafts.

  On a TPU, XLA at its least effort (`optimization_level` O0). On a TPU
  v5e, the 24-layer transformer step of
  `testing/benchmarks/step_budget_figures.py`: a draft of remat=True
  compiled in 3.1 s beside the step's own compile of 7.7 s, and held
  257,786,880 bytes more; at a binomial schedule 332,164,608 more, as at
  every schedule an earlier run compiled both ways
  (testing/benchmarks/results/remat_auto.md: "Drafts", and the tries at
  XLA's least effort before them). So a draft's bytes never decide alone:
  two of them give the slope of the schedules' line, which a compiled
  schedule places. On a TPU only, where that was measured: None on the
  CPU, whose measuring compiles keep the buffers at a tenth of the cost
  (`measuring_options`), on a GPU (not measured there: its tries compile
  as the step runs, one by one), and on a host of fewer than `DRAFT_CORES`
  cores, where drafts compiled beside the step's own compile would slow it.
  """
  if jax.default_backend() != "tpu" or (os.cpu_count() or 1) < DRAFT_CORES:
    return None
  return {"optimization_level": 9}  # XLA's effort level O0.


# A draft compiles beside the step's own compile and two more drafts.
DRAFT_CORES = 4


# Whether XLA:CPU has its older fusion emitters, and the option that picks
# them: before jaxlib 0.11.
OLDER_FUSION_EMITTERS = versions.release(jaxlib.__version__) < (0, 11)


def coefficients(
  step: tracing.Traced,
  consts,
  length: int,
  policy,
  then: Optional[Callable[["Measured"], None]] = None,
) -> Coefficients:
  """The model's coefficients for `step` over `length` steps, measured by 3 compiles (4 with a policy).

  Each compiles the loop's gradient at `length` steps, with XLA's cheaper
  code generation (`measuring_options`): remat=False, remat=True, and the
  binomial schedule with one slot; a slot is taken at the carry's bytes
  (`slot_guess`). `then` is called with one slot's figures as soon as they
  are in, while the others compile (`choice.py` compiles the budget's
  second schedule there). Kept in memory and on disk by `plan_cache.py`.
  """
  if not tracing.differentiable(step):
    # Nothing reaches a float output from a float input: no backward pass
    # keeps anything, and every plan is the plain loop.
    plain = _measure(step, consts, length, None)
    return Coefficients(
      length,
      plain.bytes,
      None,
      None,
      (0.0, 0.0),
      0.0,
      0.0,
      None,
      (((False, None, None, None), plain.bytes),),
    )
  # The least plan, binomial with one slot (a schedule of O(T) actions),
  # compiled beside remat=False and remat=True: the line a + c·s starts
  # there, and a slot's bytes are first taken as the carry's, until a
  # second schedule is compiled (choice.py's `_sloped`).
  one_slot = (
    [remat_schedule.binomial(length, 1)] if length > 1 and not tracing.no_schedules(step) else []
  )
  with _Compiles(step, consts, length, _compile_threads()) as compiles:
    # One slot's first, so that `then` can start while the rest compile:
    # it needs that program's bytes only.
    schedules = [compiles.submit(s) for s in one_slot]
    others = [
      compiles.submit(remat, p)
      for remat, p in [(None, None), (True, None)] + ([] if policy is None else [(True, policy)])
    ]
    if then is not None and schedules:
      then(schedules[0].bytes())
    plain, per_step, *rest = [m.result() for m in others + schedules]

  def recomputed(k: Measured) -> float:
    # XLA may find nothing to recompute; never a gain. Fewer FLOPs than
    # remat=False's is no plan's doing: said, then counted as none.
    if k.flops < plain.flops:
      tracing.LOG.warning(
        "remat=\"auto\": remat=True%s over %d steps compiled to %d FLOPs, "
        "fewer than remat=False's %d (counted as recomputing nothing; the "
        "FLOP count of this %s program may be off: please report it).",
        "" if k is per_step else ", under the policy,",
        length,
        k.flops,
        plain.flops,
        jax.default_backend(),
      )
    return max(0.0, (k.flops - plain.flops) / length)

  r = recomputed(per_step)
  measured: list[tuple[Key, int]] = [
    ((False, None, None, None), plain.bytes),
    ((True, None, None, None), per_step.bytes),
  ]
  with_policy = None
  if policy is not None:
    k = rest.pop(0)
    with_policy = (policy_name(policy), k.bytes, recomputed(k))
    measured.append(((True, None, None, with_policy[0]), k.bytes))
  scheduled, constants, advance = None, (0.0, 0.0), r
  if one_slot:
    k = rest[0]
    measured.append((("binomial", 1, None, None), k.bytes))
    if k.advance_flops is not None:
      advance = float(k.advance_flops)
    guess = slot_guess(step)
    scheduled = (k.temporaries - guess, guess)
    # Each schedule's tables are known to the byte (`Schedule.table_bytes`);
    # what else the program compiles in (an array the step closes over) is
    # every schedule's.
    constants = (besides_tables(k.constants, length), 0.0)
  return Coefficients(
    length,
    plain.bytes,
    per_step.bytes,
    scheduled,
    constants,
    r,
    advance,
    with_policy,
    tuple(measured),
  )


def besides_tables(one_slot: int, length: int) -> float:
  """Of one slot's schedule's constants `one_slot` bytes (over `length` steps), those that are not its tables: every schedule's (an array the step closes over)."""
  return max(0.0, float(one_slot - remat_schedule.binomial_table_bytes(length, 1)))


def slot_guess(step: tracing.Traced) -> float:
  """A slot's bytes before a second schedule is compiled: the carry's (the batch's, under `jax.vmap`), with its tangent under each forward derivative."""
  _, carry, _ = _batched(step, ([], list(step.carry), []))
  return float(pytree.nbytes(carry)) * math.prod(
    1 + at_once for kind, at_once in step.derivatives if kind == "forward"
  )


def _batched(step: tracing.Traced, shapes: tuple[list[Any], ...]) -> tuple[list[Any], ...]:
  """`shapes` (consts, carry, xs of one example) with the batch's dimensions of `step.vmaps`."""
  for size, _, *dims in step.vmaps:
    shapes = tuple(
      [
        s if d is None else jax.ShapeDtypeStruct(s.shape[:d] + (size,) + s.shape[d:], s.dtype)
        for s, d in zip(group, group_dims)
      ]
      for group, group_dims in zip(shapes, dims)
    )
  return shapes


class Figures(NamedTuple):
  """A plan compiled for a budget: its bytes (temporaries + constants), and its temporaries."""

  bytes: int
  temporaries: int


def compile_plans(
  step: tracing.Traced, consts, length: int, plans: Sequence[Key], policy
) -> list[Figures]:
  """Each of `plans` compiled at `length` steps (the loop's gradient, as it is measured), for its bytes only: one alone, several side by side (`_Compiles`)."""

  def run(plan: Key) -> tuple[Any, Any]:
    """What `_measure` takes for `plan`: its schedule (or True) and policy."""
    remat, slots, groups, name = plan
    schedule: Any = True  # remat=True: measured with the coefficients.
    if remat == "binomial":
      schedule = remat_schedule.binomial(length, slots)
    elif remat == "nested":
      schedule = remat_schedule.nested(length, groups)
    return schedule, policy if name is not None else None

  if len(plans) <= 1:
    measured = [_measure(step, consts, length, *run(plan), flops=False) for plan in plans]
  else:
    with _Compiles(step, consts, length, _compile_threads()) as compiles:
      jobs = [compiles.submit(*run(plan)) for plan in plans]
      measured = [job.bytes() for job in jobs]
  return [Figures(k.bytes, k.temporaries) for k in measured]


def most_slots(length: int) -> int:
  """The most slots a schedule keeps among the candidates: all the carries but two.

  Up to T - 2 slots, XLA's temporaries grow by a slot's bytes, to the byte
  (measured: the planning benchmark's Conv1D stack, 24-block transformer
  and GRU over 2048 steps, 1 to T - 2 slots). At T - 1 the schedule keeps
  every carry and compiles off that line (1.76×, 1.33× and 1.017× its
  prediction there), over `remat=True`'s bytes, which recompute no more.
  """
  return max(1, length - 2)


def _bytes(c: Coefficients, plan: Key, predicted: float) -> tuple[int, Optional[int]]:
  """A plan's bytes, compiled where it was, else predicted; and its prediction where compiled (`RematCandidate.predicted`)."""
  guess = int(round(predicted))
  compiled = dict(c.measured).get(plan)
  return (guess, None) if compiled is None else (compiled, guess)


def schedule_bytes(c: Coefficients, slots: int, tables: int) -> float:
  """A schedule's predicted bytes: its `slots` slots' temporaries, its tables' `tables` bytes (`Schedule.table_bytes`) and the other constants."""
  assert c.scheduled is not None, "a loop with schedules measured them"
  a, per_slot = c.scheduled
  return a + per_slot * slots + c.constants[0] + tables


def _recomputing(
  c: Coefficients,
  remat,
  slots,
  groups,
  length: int,
  advances: int,
  temporaries: Optional[tuple[int, Optional[int]]] = None,
  tables: int = 0,
) -> RematCandidate:
  """A candidate that recomputes each step where it backpropagates it, and advances.

  `temporaries`: its bytes and their prediction, as `_bytes` gives them
  (None: a schedule's, from the line, with its tables' `tables` bytes).
  """
  if temporaries is None:
    temporaries = _bytes(c, (remat, slots, groups, None), schedule_bytes(c, slots, tables))
  held, predicted = temporaries
  return RematCandidate(
    remat,
    slots,
    groups,
    held,
    length + advances,
    int(round(length * c.step_flops + advances * c.advance_flops)),
    predicted=predicted,
  )


def binomial(c: Coefficients, length: int, slots: int) -> RematCandidate:
  """The binomial schedule of `slots` slots, predicted.

  Each step is run again once where it is backpropagated (as
  jax.checkpoint does), besides the schedule's advances.
  """
  return _recomputing(
    c,
    "binomial",
    slots,
    None,
    length,
    remat_schedule.binomial_cost(length, slots),
    tables=remat_schedule.binomial_table_bytes(length, slots),
  )


def candidates(c: Coefficients, length: int) -> list[RematCandidate]:
  """No remat, remat=True, a few groupings of "nested", binomial by slots."""
  plain, predicted = _bytes(c, (False, None, None, None), c.plain)
  out = [RematCandidate(False, None, None, plain, 0, 0, predicted=predicted)]
  if c.per_step is None:  # Nothing to differentiate: nothing to keep.
    return out
  out.append(
    _recomputing(c, True, None, None, length, 0, _bytes(c, (True, None, None, None), c.per_step))
  )
  if c.policy is not None:
    name, temporaries, flops = c.policy
    held, predicted = _bytes(c, (True, None, None, name), temporaries)
    out.append(
      RematCandidate(True, None, None, held, length, int(round(length * flops)), name, predicted)
    )
  if c.scheduled is None:  # One step: no schedule keeps fewer carries.
    return out
  # Every count of slots up to 16, then about 20% apart: the budget's own
  # count is added by `choose`.
  slots = 1
  while slots <= most_slots(length):
    out.append(binomial(c, length, slots))
    slots = slots + 1 if slots < 16 else int(slots * 1.2)
  # A few groupings of "nested", for the record: binomial recomputes no
  # more with as many slots.
  for groups in sorted({2, max(1, math.isqrt(length)), length // 4} - {0, 1}):
    if groups < length:
      slots, recomputed_steps, tables = _nested(length, groups)
      out.append(_recomputing(c, "nested", slots, groups, length, recomputed_steps, tables=tables))
  return out


@caches.memoize(maxsize=256)
def _nested(length: int, groups: int) -> tuple[int, int, int]:
  """The slots, recomputed steps and table bytes of "nested" with `groups` groups (its schedule built once)."""
  nested = remat_schedule.nested(length, groups)
  return nested.num_slots, nested.recomputed_steps, nested.table_bytes


class Measured(NamedTuple):
  """A measuring program's figures: its bytes, and its FLOPs where they were counted."""

  bytes: int  # temporaries + constants.
  temporaries: int
  constants: int  # Bytes of the program's array constants (a schedule's tables).
  flops: int
  advance_flops: Optional[int]  # With a schedule.


def _measure(
  step: tracing.Traced, consts, length: int, remat, policy=None, *, flops: bool = True
) -> Measured:
  """Compiled bytes and FLOPs of the VJP of `length` steps, run as `remat` says.

  One program, compiled here (`_Compiles` compiles several side by side);
  `flops=False`: bytes only (FLOPs 0).
  """
  return _read(_compile(_lower(step, consts, length, remat, policy)), remat, flops)


class _Compiles:
  """Measuring programs, lowered here and compiled in `threads` threads.

  Each program is traced and lowered by `submit`, one after another
  (Python, under the GIL), and compiled in a thread (XLA compiles without
  the GIL): the next program lowers while the last compiles, and the
  compiles run side by side on the cores the lowering leaves
  (`_compile_threads`). Each figure is its own program's, so the figures
  are those of compiling them one by one (measure_test checks it). Each
  thread runs in the caller's context (`contextvars`): an error there
  names the public call as one here would. With no thread, `submit`
  compiles before it returns.
  """

  def __init__(self, step: tracing.Traced, consts, length: int, threads: int):
    self._args = step, consts, length
    self._pool = (
      concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="remat_plan")
      if threads
      else None
    )

  def __enter__(self) -> "_Compiles":
    return self

  def __exit__(self, *exc_info) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True)

  def submit(self, remat, policy=None) -> "_Measurement":
    """The figures of the program `remat` (under `policy`) runs, to come."""
    lowered = _lower(*self._args, remat, policy)
    if self._pool is not None:
      return _Measurement(
        self._pool.submit(contextvars.copy_context().run, _bytes_of, lowered), remat
      )
    done: concurrent.futures.Future[tuple[Measured, str]] = concurrent.futures.Future()
    done.set_result(_bytes_of(lowered))
    return _Measurement(done, remat)


def _bytes_of(lowered) -> tuple[Measured, str]:
  """A measuring program compiled, its bytes and its HLO text: a compiling thread's work."""
  return _bytes_read(_compile(lowered))


class _Measurement:
  """A measuring program's figures to come (`_Compiles.submit`).

  Its bytes as soon as it is compiled; its FLOPs counted by the thread
  that asks for them (`result`). A count walks the program in Python,
  under the GIL: in a compiling thread it held up the lowering on the
  caller's thread and the compiles queued behind it (one slot's count
  took 30-60 ms there, cold, on the planning benchmark's conv stack).
  """

  def __init__(self, job: "concurrent.futures.Future[tuple[Measured, str]]", remat):
    self._job, self._remat = job, remat

  def bytes(self) -> Measured:
    """The program's bytes (FLOPs 0, no advance)."""
    return self._job.result()[0]

  def result(self) -> Measured:
    """Bytes and FLOPs (an error of the compiling thread is raised here)."""
    return _counted(*self._job.result(), self._remat)


def _compile_threads() -> int:
  """Threads that compile measurements at once: a core each but the one the caller lowers on, one at least.

  (One per core was 2.4% slower cold on the planning benchmark's
  transformer, 2 cores: the lowering, under the GIL, shared its core.)
  """
  return max(1, (os.cpu_count() or 1) - 1)


def _lower(step: tracing.Traced, consts, length: int, remat, policy=None):
  """The program `_measure` compiles, lowered: the VJP of `length` steps run as `remat` says.

  `remat`: None (plain scan), True (checkpointed step, under `policy`), or
  a `remat_schedule.Schedule`. A loop with nothing to differentiate is
  compiled forward only.
  """
  # A schedule's program runs the step as one jit, as `scheduled_scan` runs
  # the loop's own; remat=False's and True's as the loop's scan and
  # `jax.checkpoint` run it, equation by equation (a jit would change their
  # programs: a policy's `saveable` sees no equation inside it, and jaxlib
  # 0.11's XLA keeps a checkpointed jit's carries otherwise).
  call = tracing.as_function(step.jaxpr) if remat is None or remat is True else step.call

  def body(consts, carry, x):
    out = call(*consts, *carry, *x)
    return out[: len(step.carry)], out[len(step.carry) :]

  def scan(consts, carry, xs):
    f = lambda c, x: body(consts, c, x)
    if remat is None:
      return jax.lax.scan(f, carry, xs, length=length, unroll=step.unroll)
    if remat is True:
      return jax.lax.scan(
        jax.checkpoint(f, policy=policy), carry, xs, length=length, unroll=step.unroll
      )
    return scheduled_scan.scan(f, carry, xs, length=length, schedule=remat, unroll=step.unroll)

  def run(consts, carry, xs):
    if not step.batch_major:
      return scan(consts, carry, xs)
    # The loop's own copies: its inputs made time-major, its outputs made
    # batch-major again (`hkb.dynamic_unroll(time_major=False)`).
    carry, ys = scan(consts, carry, pytree.swap_batch_time(xs))
    return carry, pytree.swap_batch_time(ys)

  def vmapped(program, vmaps):
    for size, _, *dims in vmaps:  # Innermost first.
      program = jax.vmap(program, in_axes=tuple(list(d) for d in dims), axis_size=size)
    return program

  # The loop's vmaps (`Traced.vmaps`): those the gradient is taken around run the
  # loop, the others the training step.
  of_the_batch = [v for v in step.vmaps if v[1]]
  per_example = [v for v in step.vmaps if not v[1]]

  def train(consts, carry, xs):
    # A loss of the outputs, as a training step has one: the ys are made
    # and kept for it, and their cotangent made from them (a loss in the
    # step returns small ys, and this costs little).
    args, taken = (consts, carry, xs), step.wrt

    def loss(*leaves):
      # Of the batch's outputs, outside the vmaps, where a loss of the
      # outputs a vmap returns takes them: moved to the vmap's axis first,
      # a copy a loss taken inside the vmap, per example, does not make
      # (which the plan cannot see): that one is over-predicted by it.
      out = _on_leaves(vmapped(run, of_the_batch), args, taken)(*leaves)
      return sum(jnp.sum(jnp.square(o.astype(jnp.float32))) for o in out)

    leaves = [a for a, t in zip(jax.tree.leaves(args), taken) if t]
    argnums = tuple(range(len(leaves)))
    # The loss's value is an output too, as a training step (value_and_grad)
    # returns it: with it, XLA:CPU keeps one more copy of the outputs at
    # some sizes (ys of about 2.5-16 KB: 1.43× a GRU's temporaries at 48
    # steps), which a gradient alone does not.
    derivative = loss
    for i, (kind, at_once) in enumerate(step.derivatives):  # Outward.
      derivative = _derived(derivative, kind, at_once, argnums, i == 0)
    value, grads = derivative(*leaves)
    # The gradients of the weights (consts, xs) are the step's outputs, as
    # a training step returns them; the carry's feeds what came before the
    # loop (or nothing), so it is a temporary, as there.
    first = sum(taken[: len(consts)])
    end = first + sum(taken[len(consts) : len(consts) + len(carry)])
    return (value, list(grads[:first]) + list(grads[end:]), _total(grads[first:end]))

  def stack(x):
    """A step's slice `x` stacked `length` times, on its time axis."""
    at = 1 if step.batch_major and x.shape else 0
    spec = tracing.spec_over(x, x.sharding.mesh) if x.sharding else ()
    sharding = x.sharding and jax.sharding.NamedSharding(
      x.sharding.mesh, jax.sharding.PartitionSpec(*spec[:at], None, *spec[at:])
    )
    return jax.ShapeDtypeStruct(x.shape[:at] + (length,) + x.shape[at:], x.dtype, sharding=sharding)

  stacked = [stack(x) for x in step.x]
  program = (
    vmapped(train, per_example) if tracing.differentiable(step) else vmapped(run, step.vmaps)
  )
  consts, carry, xs = _batched(step, (list(consts), list(step.carry), stacked))

  def closing_over_known(traced, carry, xs):
    # The consts that are no tracer compiled in, as the user's program has
    # them (`tracing.Traced.known`); the rest arguments.
    it = iter(traced)
    return program([next(it) if v is None else v for v in step.known], carry, xs)

  return jax.jit(closing_over_known).lower(
    [c for c, v in zip(consts, step.known, strict=True) if v is None], carry, xs
  )


def _compile(lowered):
  """A measurement's program compiled, with `measuring_options`: every measuring compile passes here."""
  return lowered.compile(measuring_options())


def _read(compiled, remat, flops: bool = True) -> Measured:
  """A compiled measurement's figures.

  The FLOPs count every loop by its trip count (only `remat=True`'s and
  `None`'s are used), and a conditional of the step (`jax.lax.cond`) by
  its dearest branch, which the run may take at every step: what a plan
  recomputes, bounded from above; a schedule's conditional, which its
  backward sweep runs once per action (more often than any in the step),
  gives an advance's FLOPs: its cheaper branch. With `flops=False` (a plan compiled
  for its bytes only) nothing is counted: FLOPs 0, no advance.
  """
  figures, text = _bytes_read(compiled)
  return _counted(figures, text, remat) if flops else figures


def _bytes_read(compiled) -> tuple[Measured, str]:
  """A compiled measurement's bytes (FLOPs 0, no advance), and its HLO text."""
  text = compiled.as_text()
  held = hlo_flops.held(compiled, text)
  return Measured(held.bytes, held.temporaries, held.constants, 0, None), text


def _counted(figures: Measured, text: str, remat) -> Measured:
  """`figures` with the FLOPs of the compiled program `text` (`_read`)."""
  count = hlo_flops.count(text, dearest=True)
  schedule = max(count.conditionals, key=lambda c: c.executions, default=None)
  return figures._replace(
    flops=count.flops,
    advance_flops=(None if remat in (None, True) or schedule is None else min(schedule.branches)),
  )


def _derived(
  derivative: Callable[..., Any],
  kind: str,
  at_once: int,
  argnums: tuple[int, ...],
  of_the_loss: bool,
) -> Callable[..., Any]:
  """`derivative` (leaves -> the loss where `of_the_loss`, else a value and gradients) differentiated as `kind` says, `at_once` times under one vmap: leaves -> a value and gradients.

  "reverse": the value and gradient of its outputs' sum (the loss; a loss
  of the gradient); "forward": its JVP along the leaves themselves, each
  output beside its tangent (both outputs, as a Hessian-vector product
  returns a gradient and its product). `at_once` derivatives are taken as
  `jax.vmap` takes a Jacobian's: one primal pass, the cotangents (or
  tangents) batched, by a batched scale of them.
  """

  def reverse(scale, *leaves):
    return jax.value_and_grad(lambda *leaves: _total(derivative(*leaves), scale), argnums=argnums)(
      *leaves
    )

  def forward(scale, *leaves):
    tangents = tuple(
      leaves if scale is None else ((scale * leaf).astype(leaf.dtype) for leaf in leaves)
    )
    out, d_out = jax.jvp(derivative, leaves, tangents)
    if of_the_loss:  # No gradients.
      return (out, d_out), []
    (value, grads), (d_value, d_grads) = out, d_out
    return (value, d_value), [(g, d) for g, d in zip(grads, d_grads)]

  one = reverse if kind == "reverse" else forward
  if at_once == 1:
    return functools.partial(one, None)

  def batched(*leaves):
    grads = 0 if of_the_loss else len(leaves)
    out_axes = 0 if kind == "reverse" else ((None, 0), [(None, 0)] * grads)
    return jax.vmap(lambda scale: one(scale, *leaves), out_axes=out_axes)(
      jnp.ones([at_once], jnp.float32)
    )

  return batched


def _total(tree: PyTree, scale: Optional[jax.Array] = None) -> jax.Array:
  """The sum of every element of `tree`'s leaves in float32 (a float32 scalar as it is), times `scale`."""
  parts = [
    leaf if leaf.ndim == 0 and leaf.dtype == jnp.float32 else jnp.sum(leaf.astype(jnp.float32))
    for leaf in jax.tree.leaves(tree)
  ]
  total = functools.reduce(operator.add, parts) if parts else jnp.zeros([], jnp.float32)
  return total if scale is None else scale * total


def _floats(tree):
  return [leaf for leaf in jax.tree.leaves(tree) if tracing.is_float(leaf)]


def _on_leaves(fn, args, taken: Sequence[bool]):
  """`fn(*args)`'s float leaves, as a function of the leaves of `args` that `taken` marks only."""
  leaves, tree = jax.tree.flatten(args)

  def g(*chosen):
    it = iter(chosen)
    full = [next(it) if t else leaf for leaf, t in zip(leaves, taken)]
    return _floats(fn(*tree.unflatten(full)))

  return g
