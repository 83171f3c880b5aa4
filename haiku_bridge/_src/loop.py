"""The loop under every scan of the bridge: plain, remat, or a remat schedule.

`layer_scan` runs its layers, `hkb.scan` / `hkb.dynamic_unroll` their time
steps, and each pipeline stage the layers of one visit, through a `Loop`.
It owns what the backward pass keeps:

* `remat=False`: `jax.lax.scan`; reverse mode keeps every step's
  activations.
* `remat=True`: `jax.checkpoint` on the step (with `remat_policy`), as
  `hk.remat` of the step does: one carry per step.
* `remat="nested"` / `"binomial"`: `scheduled_scan.scan` with a schedule of
  `remat_schedule.py`, about 2√N carries for N steps (or fewer, binomial),
  one more forward pass.

Values the step closes over (a time scan's shared weights) are constants
of the loop: in every mode their gradient is one buffer, summed over the
steps, never a copy per step.

`from_options` checks a public call's options and returns the loop they
describe, so every entry point refuses the same bad values with the same
words, naming itself (`errors.entry`).
"""

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import caches
from haiku_bridge._src import errors
from haiku_bridge._src import remat_schedule
from haiku_bridge._src import scheduled_scan
from haiku_bridge._src.pytree import PyTree

# `remat=` values that keep fewer carries than steps (remat_schedule.py).
REMAT_SCHEDULES = ("nested", "binomial")
REMAT_MODES = (False, True) + REMAT_SCHEDULES

Body = Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]


@dataclasses.dataclass(frozen=True)
class Loop:
  """`jax.lax.scan`, with what its backward pass keeps chosen by `remat`.

  Build it with `from_options`, which checks the options.

  >>> from haiku_bridge._src import loop
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
    remat: False, True, "nested" or "binomial".
    policy: with `remat=True`, a `jax.checkpoint_policies` policy.
    groups: with a schedule, `remat_groups`: the groups of "nested" (default
      ≈√N); "binomial" recomputes as many steps as "nested" with that many.
    unroll: passed to `jax.lax.scan`.
  """
  remat: bool | str = False
  policy: Optional[Callable[..., bool]] = None
  groups: Optional[int] = None
  unroll: int | bool = 1

  def __call__(self, body: Body, carry: PyTree, xs: PyTree, length: int,
               reverse: bool = False) -> tuple[PyTree, PyTree]:
    """`jax.lax.scan(body, carry, xs, length, reverse)`: `(carry, ys)`."""
    if self.remat in REMAT_SCHEDULES and length > 0:
      return scheduled_scan.scan(
          body, carry, xs, length=length,
          schedule=schedule(str(self.remat), length, self.groups),
          unroll=self.unroll, reverse=reverse,
          forward_mode_error=errors.message(
              f"`remat=\"{self.remat}\"` runs its own backward pass (a "
              "jax.custom_vjp), which forward-mode autodiff reaches here "
              "through a jax.jit (as in jax.jacfwd(jax.jit(f))), where the "
              "scan cannot see it to run the plain loop instead. Put the "
              "jit outside (jax.jit(jax.jacfwd(f))), or use remat=True, "
              "which every autodiff mode differentiates."))
    if self.remat:
      body = jax.checkpoint(body, policy=self.policy)
    return jax.lax.scan(body, carry, xs, length=length, unroll=self.unroll,
                        reverse=reverse)


def from_options(*, remat: Any = False, remat_policy: Any = None,
                 remat_groups: Any = None, unroll: Any = 1) -> Loop:
  """The `Loop` a public call's options describe, each option checked.

  Raises TypeError or ValueError, naming the option, for a value the loop
  cannot run (messages name the public call through `errors.entry`).
  """
  remat = _remat_mode(remat, remat_policy, remat_groups)
  if remat_groups is not None:
    remat_groups = errors.check_positive_int("remat_groups", remat_groups)
  if not (isinstance(unroll, (bool, np.bool_)) or
          (errors.is_int(unroll) and unroll >= 0)):
    raise (ValueError if errors.is_int(unroll) else TypeError)(
        errors.bad_argument("unroll", unroll, "a bool or a non-negative "
                            "int, as for jax.lax.scan"))
  unroll = (bool(unroll) if isinstance(unroll, (bool, np.bool_))
            else int(unroll))
  return Loop(remat, remat_policy, remat_groups, unroll)


_REMAT = "False, True, \"nested\" or \"binomial\""


def _remat_mode(remat: Any, policy: Any, groups: Any) -> bool | str:
  """`remat` checked: False, True, or one of REMAT_SCHEDULES."""
  if isinstance(remat, (bool, np.bool_)):
    remat = bool(remat)
  elif not isinstance(remat, str) or remat not in REMAT_SCHEDULES:
    # An int or float may be meant as a number of groups.
    example = (remat if errors.is_int(remat) and remat > 0 else 4)
    raise (ValueError if isinstance(remat, str) else TypeError)(
        errors.bad_argument(
            "remat", remat, _REMAT, "A schedule's number of groups goes in "
            f"`remat_groups=`: e.g. remat=\"nested\", remat_groups={example}."))
  if policy is not None:
    errors.check_callable("remat_policy", policy, "None or a "
                          "jax.checkpoint_policies policy")
    if remat is not True:
      raise ValueError(errors.message(
          "`remat_policy` needs `remat=True`: it says which activations the "
          "forward pass keeps for the backward pass, and the nested and "
          "binomial schedules keep none, only carries."))
  if groups is not None and remat not in REMAT_SCHEDULES:
    raise ValueError(errors.message(
        "`remat_groups` needs `remat=\"nested\"` or `\"binomial\"`."))
  return remat


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
def schedule(remat: str, length: int,
             groups: Optional[int]) -> remat_schedule.Schedule:
  """The schedule of `remat="nested"` / `"binomial"` for `length` steps.

  "binomial" keeps the fewest carries that recompute at most `length - 1`
  steps (one more forward pass, as "nested" costs), or, with `groups`, at
  most as many as "nested" with that many groups.
  """
  if remat == "nested":
    return remat_schedule.nested(length, groups)
  budget = (length - 1 if groups is None else
            remat_schedule.nested(length, groups).recomputed_steps)
  return remat_schedule.binomial(
      length, remat_schedule.fewest_binomial_slots(length, budget))
