"""The loop under every scan of the bridge: plain, remat, or a remat schedule.

`layer_scan` runs its layers, `hkb.scan` / `hkb.dynamic_unroll` their time
steps, and each pipeline stage the layers of one visit, through a `Loop`.
It owns what the backward pass keeps:

* `remat=False`: `jax.lax.scan`; reverse mode keeps every step's
  activations.
* `remat=True`: `jax.checkpoint` on the step (with `remat_policy`), as
  `hk.remat` of the step does: one carry per step.
* `remat="nested"` / `"binomial"`: `scheduled_scan.scan` with a schedule of
  `schedule.py`, about 2√N carries for N steps (or fewer, binomial),
  one more forward pass.
* `remat="auto"` with `memory_budget=`: one of those (with
  `remat_policy=`, `remat=True` under it too), the one that recomputes the
  least FLOPs among those whose training-step bytes fit the budget
  (predicted, then checked compiled) and that recompute at most
  `max_recompute` forward passes (`plan.py`), planned on the step's
  shapes when the loop is traced, in one place: `resolved`, which every
  loop of the bridge passes, and which plans nothing at init.

Values the step closes over (a time scan's shared weights) are constants
of the loop: in every mode their gradient is one buffer, summed over the
steps, never a copy per step.

`from_options` checks a public call's options and returns the loop they
describe, so every entry point refuses the same bad values with the same
words, naming itself (`errors.entry`). What every scan checks of its body
and its steps is in `step_checks.py`.
"""

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import caches
from haiku_bridge._src import errors
from haiku_bridge._src import guards
from haiku_bridge._src import modes
from haiku_bridge._src.remat import choice as remat_choice
from haiku_bridge._src.remat import plan as remat_plan
from haiku_bridge._src.remat import schedule as remat_schedule
from haiku_bridge._src.remat import scheduled_scan
from haiku_bridge._src.remat import step_budget
from haiku_bridge._src.remat import tracing
from haiku_bridge._src.pytree import PyTree

# `remat=` values that keep fewer carries than steps (schedule.py).
REMAT_SCHEDULES = modes.REMAT_SCHEDULES
REMAT_MODES = (False, True) + REMAT_SCHEDULES

Body = Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]


@dataclasses.dataclass(frozen=True)
class Loop:
  """`jax.lax.scan`, with what its backward pass keeps chosen by `remat`.

  Build it with `from_options`, which checks the options.

  >>> from haiku_bridge._src.remat import loop
  >>> def step(h, w):
  ...   return jnp.tanh(h @ w), jnp.sum(h)
  >>> ws = jax.random.normal(jax.random.PRNGKey(0), [9, 4, 4]) / 2
  >>> def loss(run):
  ...   return lambda ws: jnp.sum(run(step, jnp.ones([2, 4]), ws, 9)[0] ** 2)
  >>> nested = jax.grad(loss(loop.Loop(remat="nested")))(ws)
  >>> plain = jax.grad(loss(loop.Loop()))(ws)
  >>> bool(jnp.allclose(nested, plain, atol=1e-6))
  True

  Attributes:
    remat: False, True, "nested", "binomial" or "auto".
    policy: with `remat=True`, a `jax.checkpoint_policies` policy; with
      `remat="auto"`, one more candidate.
    groups: with a schedule, `remat_groups`: the groups of "nested" (default
      ≈√N); "binomial" recomputes no more steps than "nested" with that
      many (by default, at most N - 1: one more forward pass).
    unroll: passed to `jax.lax.scan`.
    slots: with "binomial", the slots to keep (instead of `groups`).
    memory_budget: with `remat="auto"`, the bytes the loop's part of a
      training step may take, as `hkb.remat_plan` counts them; None: the
      budget of the whole step, inside `hkb.budgeted_jit`.
    max_recompute: with `remat="auto"`, the most forward passes of the
      loop a plan may recompute.
    batch_major: with `remat="auto"`, whether the caller swaps the loop's
      inputs and outputs between batch-major and time-major around it
      (`hkb.dynamic_unroll(time_major=False)`): the plan counts those copies.
    planned: whether `remat` is the plan of `remat="auto"` (`resolved`), as
      the loop's messages say.
    refused: where `remat="auto"` found no plan for the budget and saw no
      derivative around the loop (`resolved`), the refusal, raised if the
      loop's outputs are differentiated; its forward is the plain loop's.
  """

  remat: modes.RematMode = False
  policy: Optional[Callable[..., bool]] = None
  groups: Optional[int] = None
  unroll: int | bool = 1
  memory_budget: Optional[int] = None
  slots: Optional[int] = None
  max_recompute: float = remat_choice.MAX_RECOMPUTE
  batch_major: bool = False
  planned: bool = False
  refused: Optional[str] = None

  def __call__(
    self, body: Body, carry: PyTree, xs: PyTree, length: int, reverse: bool = False
  ) -> tuple[PyTree, PyTree]:
    """`jax.lax.scan(body, carry, xs, length, reverse)`: `(carry, ys)`."""
    if self.remat == modes.REMAT_AUTO:
      return resolved(self, body, carry, xs, length)(body, carry, xs, length, reverse)
    if self.remat in REMAT_SCHEDULES and length > 0:
      return scheduled_scan.scan(
        body,
        carry,
        xs,
        length=length,
        schedule=schedule(str(self.remat), length, self.groups, self.slots),
        unroll=self.unroll,
        reverse=reverse,
        forward_mode_error=errors.message(
          (
            f"`remat=\"auto\"` (its plan here: \"{self.remat}\")"
            if self.planned
            else f"`remat=\"{self.remat}\"`"
          )
          + " runs its own backward pass (a "
          "jax.custom_vjp), which forward-mode autodiff reaches here "
          "through a jax.jit (as in jax.jacfwd(jax.jit(f))), where the "
          "scan cannot see it to run the plain loop instead. Put the "
          "jit outside (jax.jit(jax.jacfwd(f))), or use remat=True, "
          "which every autodiff mode differentiates."
        ),
      )
    if self.remat:
      body = jax.checkpoint(body, policy=self.policy)
    else:  # A loop with "auto" inside knows whose body it runs in.
      body = tracing.in_body(body, self.planned)
    out = jax.lax.scan(body, carry, xs, length=length, unroll=self.unroll, reverse=reverse)
    if self.refused is None:
      return out
    return jax.tree.map(
      lambda v: (
        _refused_if_differentiated(self.refused, v) if jnp.issubdtype(v.dtype, jnp.inexact) else v
      ),
      out,
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _refused_if_differentiated(refusal: str, value: jax.Array) -> jax.Array:
  """`value`; differentiated with a tangent other than zero, raises `refusal`."""
  del refusal
  return value


@_refused_if_differentiated.defjvp
def _refused_if_differentiated_jvp(refusal, primals, tangents):
  del primals, tangents  # Called only where a tangent is not zero.
  raise remat_choice.refusal(refusal)


def resolved(
  loop: Loop,
  body: Body,
  carry: PyTree,
  xs: PyTree,
  length: int,
  *,
  whole_pipelined_stack: bool = False,
  planned_body: Optional[Body] = None,
) -> Loop:
  """The loop that runs on these shapes: the one place `remat="auto"` is planned.

  Any other `remat` runs as it is. `remat="auto"` is planned here, for the
  shapes the loop runs on (`remat_plan.loop_plan`, which logs the plan),
  except where no plan is for it, and there it runs plain, unplanned (every
  remat computes the same values, and a plan is for the backward pass):

  * at Haiku's init (`hk.transform(f).init`), which runs no backward pass;
  * with `whole_pipelined_stack`: the loop runs all the layers of a
    pipelined stack at once (its init, or a bridge running the layer only
    to find its params), and `memory_budget` is per stage, not for this loop
    (each stage's plan is made here too, for one visit: `pipeline/stage_program.py`);
  * with no steps.

  Where no plan fits the budget, the loop refuses it (ValueError), unless
  it sees no derivative around it (`remat_plan.deferrable`): there it may
  be inference, which keeps nothing for a backward pass, or a gradient
  taken outside a `jax.jit` or `jax.checkpoint` around the loop, which it
  cannot see; it runs plain, and the refusal is raised where its outputs
  are differentiated.

  `planned_body`, where given, is what the plan measures instead of `body`:
  the same step with what a training step does not differentiate (a layer
  scan's Haiku state) under `jax.lax.stop_gradient`.
  """
  if loop.remat != modes.REMAT_AUTO:
    return loop
  if whole_pipelined_stack or guards.initialising():
    return dataclasses.replace(
      loop, remat=False, policy=None, memory_budget=None, max_recompute=remat_choice.MAX_RECOMPUTE
    )
  if length == 0:
    return Loop(unroll=loop.unroll)
  if loop.memory_budget is None:
    if not step_budget.active():
      return _unbudgeted(loop)
    step = step_budget.loop_plan(length, carry, loop.policy is not None, loop.max_recompute)
    return Loop(
      step.remat,
      loop.policy if step.policy else None,
      None,
      loop.unroll,
      slots=step.slots,
      planned=True,
    )
  try:
    choice = remat_plan.loop_plan(
      planned_body or body,
      carry,
      xs,
      length,
      loop.memory_budget,
      loop.policy,
      loop.max_recompute,
      loop.unroll,
      loop.batch_major,
    ).choice
  except ValueError as error:
    # No derivative seen around the loop: inference (which keeps nothing
    # for a backward pass, and computes the same values with any plan), or
    # a gradient taken outside a jax.jit or jax.checkpoint around it. The
    # refusal stands for that gradient alone.
    if not (remat_choice.is_refusal(error) and remat_plan.deferrable()):
      raise
    tracing.LOG.info(
      "remat=\"auto\": no derivative is seen around this loop, which runs "
      "plain; differentiated, it raises: %s",
      error,
    )
    return Loop(unroll=loop.unroll, refused=str(error))
  return Loop(
    choice.remat,
    None if choice.policy is None else loop.policy,
    choice.groups,
    loop.unroll,
    slots=choice.slots if choice.remat == "binomial" else None,
    planned=True,
  )


def _unbudgeted(loop: Loop) -> Loop:
  """`remat="auto"` with no budget, outside `budgeted_jit`: plain, refusing a differentiation."""
  refusal = remat_choice.refusal(
    errors.message(
      "`remat=\"auto\"` needs `memory_budget=`, the bytes the loop's "
      "training-step temporaries may take (hkb.remat_plan shows what each "
      "plan needs), or the training step jitted with hkb.budgeted_jit, "
      "whose budget for the whole step plans it."
    )
  )
  if not remat_plan.deferrable():
    raise refusal
  return Loop(unroll=loop.unroll, refused=str(refusal))


def from_options(
  *,
  remat: Any = False,
  remat_policy: Any = None,
  remat_groups: Any = None,
  unroll: Any = 1,
  memory_budget: Any = None,
  max_recompute: Any = None,
) -> Loop:
  """The `Loop` a public call's options describe, each option checked.

  Raises TypeError or ValueError, naming the option, for a value the loop
  cannot run (messages name the public call through `errors.entry`).
  """
  remat = _remat_mode(remat, remat_policy, remat_groups)
  if remat == modes.REMAT_AUTO:
    if memory_budget is not None:
      memory_budget = remat_plan.check_budget(memory_budget)
    # With no budget of its own, the step's bound (budgeted_jit's) applies.
    max_recompute = (
      math.inf
      if memory_budget is None and max_recompute is None
      else remat_plan.check_max_recompute(max_recompute)
    )
  else:
    for name, value in (("memory_budget", memory_budget), ("max_recompute", max_recompute)):
      if value is not None:
        raise ValueError(
          errors.message(f"`{name}` needs `remat=\"auto\"`, which chooses the plan that fits it.")
        )
    max_recompute = remat_choice.MAX_RECOMPUTE
  if remat_groups is not None:
    remat_groups = errors.check_positive_int("remat_groups", remat_groups)
  if not (isinstance(unroll, (bool, np.bool_)) or (errors.is_int(unroll) and unroll >= 0)):
    raise (ValueError if errors.is_int(unroll) else TypeError)(
      errors.bad_argument("unroll", unroll, "a bool or a non-negative int, as for jax.lax.scan")
    )
  unroll = bool(unroll) if isinstance(unroll, (bool, np.bool_)) else int(unroll)
  return Loop(remat, remat_policy, remat_groups, unroll, memory_budget, max_recompute=max_recompute)


_REMAT = "False, True, \"nested\", \"binomial\" or \"auto\""


def _remat_mode(remat: Any, policy: Any, groups: Any) -> bool | str:
  """`remat` checked: False, True, one of REMAT_SCHEDULES, or "auto"."""
  if isinstance(remat, (bool, np.bool_)):
    remat = bool(remat)
  elif not isinstance(remat, str) or remat not in (REMAT_SCHEDULES + (modes.REMAT_AUTO,)):
    # An int or float may be meant as a number of groups.
    example = remat if errors.is_int(remat) and remat > 0 else 4
    raise (ValueError if isinstance(remat, str) else TypeError)(
      errors.bad_argument(
        "remat",
        remat,
        _REMAT,
        "A schedule's number of groups goes in "
        f"`remat_groups=`: e.g. remat=\"nested\", remat_groups={example}.",
      )
    )
  if policy is not None:
    errors.check_callable("remat_policy", policy, "None or a jax.checkpoint_policies policy")
    if remat is not True and remat != modes.REMAT_AUTO:
      raise ValueError(
        errors.message(
          "`remat_policy` needs `remat=True` (or `remat=\"auto\"`, which "
          "weighs it as one more plan): it says which activations the "
          "forward pass keeps for the backward pass, and the nested and "
          "binomial schedules keep none, only carries."
        )
      )
  if groups is not None and remat not in REMAT_SCHEDULES:
    raise ValueError(errors.message("`remat_groups` needs `remat=\"nested\"` or `\"binomial\"`."))
  return remat


@caches.memoize(maxsize=256)
def schedule(
  remat: str, length: int, groups: Optional[int], slots: Optional[int] = None
) -> remat_schedule.Schedule:
  """The schedule of `remat="nested"` / `"binomial"` for `length` steps.

  "binomial" keeps the fewest carries that recompute at most `length - 1`
  steps (one more forward pass, as "nested" costs), or, with `groups`, at
  most as many as "nested" with that many groups; or, with `slots` (a plan
  of `remat="auto"`), that many.
  """
  if remat == "nested":
    return remat_schedule.nested(length, groups)
  if slots is not None:
    return remat_schedule.binomial(length, slots)
  budget = length - 1 if groups is None else remat_schedule.nested(length, groups).recomputed_steps
  return remat_schedule.binomial(length, remat_schedule.fewest_binomial_slots(length, budget))
