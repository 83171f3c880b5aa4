"""What every scan of the bridge checks of its body and its steps, worded by the scan.

`check_step_output` / `CheckedBody`: a body returns a pair, with a carry
like the one it got (`carry_change`); `num_steps`: the count of steps,
given or read off the leading axis of `xs`. The layer scan, the time scans
and the pipeline's stages (through the layer scan) refuse here, in their
own words (`StepWords`, `StepAxis`), before the loop would in JAX's.
"""

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import errors
from haiku_bridge._src.pytree import PyTree


class StepWords(NamedTuple):
  """How a scan's messages name its body and what the body hands on."""

  body: str  # "`f`", "`core`", "a layer".
  pair: str  # The pair it returns: "(carry, y)".
  carry: str  # What the next step takes: "carry", "state".
  step: str  # "step", "layer".
  subject: str  # Who got the carry, in the message: "it", "the layer".
  pair_hint: str = ""  # A sentence after the message on the pair.
  carry_hint: str = ""  # A sentence after the message on the carry.


def check_step_output(
  out: Any, carry: PyTree, words: StepWords, carry_index: int = 0
) -> tuple[Any, Any]:
  """`out`, a body's output, if it is a pair whose `carry_index` is like `carry`.

  Every scan of the bridge (the layer scan, the time scans, the pipeline's
  stages through the layer scan) checks its body's output here, before the
  loop would refuse it in JAX's words.
  """
  if not (isinstance(out, tuple) and len(out) == 2):
    raise ValueError(
      errors.message(
        f"{words.body} must return a pair {words.pair}; it returned "
        f"{errors.describe(out)}.{words.pair_hint}"
      )
    )
  changed = carry_change(carry, out[carry_index])
  if changed is not None:
    raise ValueError(
      errors.message(
        f"{words.body} must return a {words.carry} like the one it gets, "
        f"since the next {words.step} takes it; {words.subject} got "
        f"{changed[0]} and returned {changed[1]}.{words.carry_hint}"
      )
    )
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
    return (
      "a leading layer axis (of size num_layers)"
      if count is None
      else f"a leading layer axis of size num_layers={count}"
    )


def num_steps(count: Any, xs: PyTree, axis: StepAxis, name: str = "xs") -> int:
  """The number of steps: `count`, or the leading axis every leaf of `xs` has.

  Raises TypeError or ValueError, naming `axis.argument` or the leaf of `xs`
  (by its path), for a count or a leaf the scan cannot run.
  """
  wants = "None or a non-negative int" if axis.least == 0 else "a positive int"
  if count is not None and axis.least == 0:
    count = _check_count(axis.argument, count, wants)
  leaves = jax.tree_util.tree_leaves_with_path(xs)
  for path, leaf in leaves:
    # A time scan needs a time axis on each leaf; a layer without one is
    # refused below, with its shape.
    if not hasattr(leaf, "shape") or (axis.least == 0 and not np.ndim(leaf)):
      hint = (
        f" For {leaf} layers without per-layer inputs, pass num_layers={leaf}."
        if axis.least and errors.is_int(leaf)
        else ""
      )
      raise TypeError(
        errors.message(
          f"{name}{jax.tree_util.keystr(path)} is {errors.got(leaf)}; every "
          f"leaf of {name} must be {axis.leaf}.{hint}"
        )
      )
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
      same = (
        f" (as {name}{jax.tree_util.keystr(leaves[0][0])} has)."
        if from_first and axis.least == 0
        else "."
      )
      raise ValueError(
        errors.message(
          f"{name}{jax.tree_util.keystr(path)} has shape "
          f"{tuple(leaf.shape)}, but every leaf of {name} needs "
          f"{axis.needs(count)}{same}"
        )
      )
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
    return str(jax.tree.map(lambda a: f"{jnp.result_type(a).name}{list(np.shape(a))}", tree))

  if jax.tree.structure(before) != jax.tree.structure(after) or any(
    (np.shape(a), jnp.result_type(a)) != (np.shape(b), jnp.result_type(b))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))
  ):
    return describe(before), describe(after)
  return None
