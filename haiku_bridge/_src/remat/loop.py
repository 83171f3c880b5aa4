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
and its steps is here once too: `check_step_output` / `CheckedBody` (a pair,
with a carry like the one the body got) and `num_steps` (the count, from
the leading axis of `xs`), each worded by the scan (`StepWords`,
`StepAxis`).
"""

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import caches
from haiku_bridge._src import errors
from haiku_bridge._src import guards
from haiku_bridge._src import modes
from haiku_bridge._src.remat import plan as remat_plan
from haiku_bridge._src.remat import schedule as remat_schedule
from haiku_bridge._src.remat import scheduled_scan
from haiku_bridge._src.remat import step_budget
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
    memory_budget: with `remat="auto"`, the bytes the loop's part of a training
      step may take, held by the compiled loop: its temporaries (what its
      backward pass keeps, its outputs and their cotangents, the carry's
      cotangent, its working memory) and the constants it compiles in (a
      schedule's tables, arrays the step closes over); not the params or
      their gradients, nor the rest
      of the step (README, "Choosing remat for one loop"); None: the budget of the
      whole step, inside `hkb.budgeted_jit`.
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
  max_recompute: float = remat_plan.MAX_RECOMPUTE
  batch_major: bool = False
  planned: bool = False
  refused: Optional[str] = None

  def __call__(self, body: Body, carry: PyTree, xs: PyTree, length: int,
               reverse: bool = False) -> tuple[PyTree, PyTree]:
    """`jax.lax.scan(body, carry, xs, length, reverse)`: `(carry, ys)`."""
    if self.remat == modes.REMAT_AUTO:
      return resolved(self, body, carry, xs, length)(body, carry, xs, length,
                                                     reverse)
    if self.remat in REMAT_SCHEDULES and length > 0:
      return scheduled_scan.scan(
          body, carry, xs, length=length,
          schedule=schedule(str(self.remat), length, self.groups,
                            self.slots),
          unroll=self.unroll, reverse=reverse,
          forward_mode_error=errors.message(
              (f"`remat=\"auto\"` (its plan here: \"{self.remat}\")"
               if self.planned else f"`remat=\"{self.remat}\"`") +
              " runs its own backward pass (a "
              "jax.custom_vjp), which forward-mode autodiff reaches here "
              "through a jax.jit (as in jax.jacfwd(jax.jit(f))), where the "
              "scan cannot see it to run the plain loop instead. Put the "
              "jit outside (jax.jit(jax.jacfwd(f))), or use remat=True, "
              "which every autodiff mode differentiates."))
    if self.remat:
      body = jax.checkpoint(body, policy=self.policy)
    else:  # A loop with "auto" inside knows whose body it runs in.
      body = remat_plan.in_body(body, self.planned)
    out = jax.lax.scan(body, carry, xs, length=length, unroll=self.unroll,
                       reverse=reverse)
    if self.refused is None:
      return out
    return jax.tree.map(
        lambda v: (_refused_if_differentiated(self.refused, v)
                   if jnp.issubdtype(v.dtype, jnp.inexact) else v), out)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _refused_if_differentiated(refusal: str, value: jax.Array) -> jax.Array:
  """`value`; differentiated with a tangent other than zero, raises `refusal`."""
  del refusal
  return value


@_refused_if_differentiated.defjvp
def _refused_if_differentiated_jvp(refusal, primals, tangents):
  del primals, tangents  # Called only where a tangent is not zero.
  raise remat_plan.refusal(refusal)


def resolved(loop: Loop, body: Body, carry: PyTree, xs: PyTree, length: int,
             *, whole_pipelined_stack: bool = False,
             planned_body: Optional[Body] = None) -> Loop:
  """The loop that runs on these shapes: the one place `remat="auto"` is planned.

  Any other `remat` runs as it is. `remat="auto"` is planned here, for the
  shapes the loop runs on (`remat_plan.loop_plan`, which logs the plan),
  except where no plan is for it, and there it runs plain, unplanned (every
  remat computes the same values, and a plan is for the backward pass):

  * at Haiku's init (`hk.transform(f).init`), which runs no backward pass;
  * with `whole_pipelined_stack`: the loop runs all the layers of a
    pipelined stack at once (its init, or a bridge running the layer only
    to find its params), and `memory_budget` is per stage, not for this loop
    (each stage's plan is made here too, for one visit: `pipeline/stages.py`);
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
  if whole_pipelined_stack or (guards.inside_transform() and
                               hk.running_init()):
    return dataclasses.replace(loop, remat=False, policy=None,
                               memory_budget=None,
                               max_recompute=remat_plan.MAX_RECOMPUTE)
  if length == 0:
    return Loop(unroll=loop.unroll)
  if loop.memory_budget is None:
    if not step_budget.active():
      return _unbudgeted(loop)
    step = step_budget.loop_plan(length, carry, loop.policy is not None,
                                 loop.max_recompute)
    return Loop(step.remat, loop.policy if step.policy else None, None,
                loop.unroll, slots=step.slots, planned=True)
  try:
    choice = remat_plan.loop_plan(planned_body or body, carry, xs, length,
                                  loop.memory_budget,
                                  loop.policy, loop.max_recompute,
                                  loop.unroll, loop.batch_major).choice
  except ValueError as error:
    # No derivative seen around the loop: inference (which keeps nothing
    # for a backward pass, and computes the same values with any plan), or
    # a gradient taken outside a jax.jit or jax.checkpoint around it. The
    # refusal stands for that gradient alone.
    if not (remat_plan.is_refusal(error) and remat_plan.deferrable()):
      raise
    remat_plan.LOG.info(
        "remat=\"auto\": no derivative is seen around this loop, which runs "
        "plain; differentiated, it raises: %s", error)
    return Loop(unroll=loop.unroll, refused=str(error))
  return Loop(choice.remat, None if choice.policy is None else loop.policy,
              choice.groups, loop.unroll,
              slots=choice.slots if choice.remat == "binomial" else None,
              planned=True)


def _unbudgeted(loop: Loop) -> Loop:
  """`remat="auto"` with no budget, outside `budgeted_jit`: plain, refusing a differentiation."""
  refusal = remat_plan.refusal(errors.message(
      "`remat=\"auto\"` needs `memory_budget=`, the bytes the loop's "
      "training-step temporaries may take (hkb.remat_plan shows what each "
      "plan needs), or the training step jitted with hkb.budgeted_jit, "
      "whose budget for the whole step plans it."))
  if not remat_plan.deferrable():
    raise refusal
  return Loop(unroll=loop.unroll, refused=str(refusal))


def from_options(*, remat: Any = False, remat_policy: Any = None,
                 remat_groups: Any = None, unroll: Any = 1,
                 memory_budget: Any = None, max_recompute: Any = None) -> Loop:
  """The `Loop` a public call's options describe, each option checked.

  Raises TypeError or ValueError, naming the option, for a value the loop
  cannot run (messages name the public call through `errors.entry`).
  """
  remat = _remat_mode(remat, remat_policy, remat_groups)
  if remat == modes.REMAT_AUTO:
    if memory_budget is not None:
      memory_budget = remat_plan.check_budget(memory_budget)
    # With no budget of its own, the step's bound (budgeted_jit's) applies.
    max_recompute = (math.inf if memory_budget is None and max_recompute is None
                     else remat_plan.check_max_recompute(max_recompute))
  else:
    for name, value in (("memory_budget", memory_budget),
                        ("max_recompute", max_recompute)):
      if value is not None:
        raise ValueError(errors.message(
            f"`{name}` needs `remat=\"auto\"`, which chooses the plan that "
            "fits it."))
    max_recompute = remat_plan.MAX_RECOMPUTE
  if remat_groups is not None:
    remat_groups = errors.check_positive_int("remat_groups", remat_groups)
  if not (isinstance(unroll, (bool, np.bool_)) or
          (errors.is_int(unroll) and unroll >= 0)):
    raise (ValueError if errors.is_int(unroll) else TypeError)(
        errors.bad_argument("unroll", unroll, "a bool or a non-negative "
                            "int, as for jax.lax.scan"))
  unroll = (bool(unroll) if isinstance(unroll, (bool, np.bool_))
            else int(unroll))
  return Loop(remat, remat_policy, remat_groups, unroll, memory_budget,
              max_recompute=max_recompute)


_REMAT = "False, True, \"nested\", \"binomial\" or \"auto\""


def _remat_mode(remat: Any, policy: Any, groups: Any) -> bool | str:
  """`remat` checked: False, True, one of REMAT_SCHEDULES, or "auto"."""
  if isinstance(remat, (bool, np.bool_)):
    remat = bool(remat)
  elif not isinstance(remat, str) or remat not in (
      REMAT_SCHEDULES + (modes.REMAT_AUTO,)):
    # An int or float may be meant as a number of groups.
    example = (remat if errors.is_int(remat) and remat > 0 else 4)
    raise (ValueError if isinstance(remat, str) else TypeError)(
        errors.bad_argument(
            "remat", remat, _REMAT, "A schedule's number of groups goes in "
            f"`remat_groups=`: e.g. remat=\"nested\", remat_groups={example}."))
  if policy is not None:
    errors.check_callable("remat_policy", policy, "None or a "
                          "jax.checkpoint_policies policy")
    if remat is not True and remat != modes.REMAT_AUTO:
      raise ValueError(errors.message(
          "`remat_policy` needs `remat=True` (or `remat=\"auto\"`, which "
          "weighs it as one more plan): it says which activations the "
          "forward pass keeps for the backward pass, and the nested and "
          "binomial schedules keep none, only carries."))
  if groups is not None and remat not in REMAT_SCHEDULES:
    raise ValueError(errors.message(
        "`remat_groups` needs `remat=\"nested\"` or `\"binomial\"`."))
  return remat


class StepWords(NamedTuple):
  """How a scan's messages name its body and what the body hands on."""
  body: str  # "`f`", "`core`", "a layer".
  pair: str  # The pair it returns: "(carry, y)".
  carry: str  # What the next step takes: "carry", "state".
  step: str  # "step", "layer".
  subject: str  # Who got the carry, in the message: "it", "the layer".
  pair_hint: str = ""  # A sentence after the message on the pair.
  carry_hint: str = ""  # A sentence after the message on the carry.


def check_step_output(out: Any, carry: PyTree, words: StepWords,
                      carry_index: int = 0) -> tuple[Any, Any]:
  """`out`, a body's output, if it is a pair whose `carry_index` is like `carry`.

  Every scan of the bridge (the layer scan, the time scans, the pipeline's
  stages through the layer scan) checks its body's output here, before the
  loop would refuse it in JAX's words.
  """
  if not (isinstance(out, tuple) and len(out) == 2):
    raise ValueError(errors.message(
        f"{words.body} must return a pair {words.pair}; it returned "
        f"{errors.describe(out)}.{words.pair_hint}"))
  changed = carry_change(carry, out[carry_index])
  if changed is not None:
    raise ValueError(errors.message(
        f"{words.body} must return a {words.carry} like the one it gets, "
        f"since the next {words.step} takes it; {words.subject} got "
        f"{changed[0]} and returned {changed[1]}.{words.carry_hint}"))
  return out


@dataclasses.dataclass(frozen=True)
class CheckedBody:
  """`f(carry, x) -> (carry, y)`, its output checked (`check_step_output`).

  A dataclass, so that two built from one `f` are equal (and fingerprint
  alike for the caches). With `entry`, messages name that public call even
  when the body runs after the call returned (a backward pass).
  """
  f: Callable[..., Any]
  words: StepWords
  entry: Optional[str] = None

  def __call__(self, carry: PyTree, x: PyTree) -> tuple[Any, Any]:
    if self.entry is None:
      return check_step_output(self.f(carry, x), carry, self.words)
    with errors.entry(self.entry):
      return check_step_output(self.f(carry, x), carry, self.words)


class StepAxis(NamedTuple):
  """How a scan counts its steps: the argument, its least value, the words."""
  argument: str  # The argument giving the count: "length", "num_layers".
  least: int  # Its least value: 0 steps of time, 1 layer.
  leaf: str  # What each leaf of `xs` must be: "an array with ...".
  none: str  # The message when there are no arrays to count ({name}: xs).

  def needs(self, count: Optional[int]) -> str:
    """The leading axis every leaf of `name` needs, for `count` steps."""
    if self.argument == "length":
      return f"a leading time axis of {count} steps"
    return ("a leading layer axis (of size num_layers)" if count is None else
            f"a leading layer axis of size num_layers={count}")


def num_steps(count: Any, xs: PyTree, axis: StepAxis,
              name: str = "xs") -> int:
  """The number of steps: `count`, or the leading axis every leaf of `xs` has.

  Raises TypeError or ValueError, naming `axis.argument` or the leaf of `xs`
  (by its path), for a count or a leaf the scan cannot run.
  """
  wants = ("None or a non-negative int" if axis.least == 0 else
           "a positive int")
  if count is not None and axis.least == 0:
    count = _check_count(axis.argument, count, wants)
  leaves = jax.tree_util.tree_leaves_with_path(xs)
  for path, leaf in leaves:
    # A time scan needs a time axis on each leaf; a layer without one is
    # refused below, with its shape.
    if not hasattr(leaf, "shape") or (axis.least == 0 and not np.ndim(leaf)):
      hint = (f" For {leaf} layers without per-layer inputs, pass "
              f"num_layers={leaf}." if axis.least and errors.is_int(leaf)
              else "")
      raise TypeError(errors.message(
          f"{name}{jax.tree_util.keystr(path)} is {errors.got(leaf)}; every "
          f"leaf of {name} must be {axis.leaf}.{hint}"))
  from_first = count is None
  if count is None:
    if not leaves:
      raise ValueError(errors.message(axis.none.format(name=name)))
    first = np.shape(leaves[0][1])
    count = first[0] if first else None
  if count is not None and axis.least:
    count = errors.check_positive_int(axis.argument, count)
  for path, leaf in leaves:
    if not np.ndim(leaf) or leaf.shape[0] != count:
      same = (f" (as {name}{jax.tree_util.keystr(leaves[0][0])} has)."
              if from_first and axis.least == 0 else ".")
      raise ValueError(errors.message(
          f"{name}{jax.tree_util.keystr(path)} has shape "
          f"{tuple(leaf.shape)}, but every leaf of {name} needs "
          f"{axis.needs(count)}{same}"))
  assert count is not None, "found above, or a leaf of xs was refused"
  return int(count)


def _check_count(name: str, count: Any, wants: str) -> int:
  if not errors.is_int(count):
    raise TypeError(errors.bad_argument(name, count, wants))
  if count < 0:
    raise ValueError(errors.bad_argument(name, count, wants))
  return int(count)


def carry_change(before: PyTree, after: PyTree) -> Optional[tuple[str, str]]:
  """None if a step's carry `after` is like `before`, else both described.

  Like: the same structure, and each leaf the same shape and dtype (weak
  types as JAX promotes them), which a loop needs of the carry it hands on.
  """
  def describe(tree):
    return str(jax.tree.map(
        lambda a: f"{jnp.result_type(a).name}{list(np.shape(a))}", tree))

  if jax.tree.structure(before) != jax.tree.structure(after) or any(
      (np.shape(a), jnp.result_type(a)) != (np.shape(b), jnp.result_type(b))
      for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))):
    return describe(before), describe(after)
  return None


@caches.memoize(maxsize=256)
def schedule(remat: str, length: int, groups: Optional[int],
             slots: Optional[int] = None) -> remat_schedule.Schedule:
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
  budget = (length - 1 if groups is None else
            remat_schedule.nested(length, groups).recomputed_steps)
  return remat_schedule.binomial(
      length, remat_schedule.fewest_binomial_slots(length, budget))
