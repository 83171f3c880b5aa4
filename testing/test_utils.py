"""Helpers shared by haiku_bridge's tests."""

import collections
from typing import Any, Callable

import haiku as hk
import jax
import jax.extend.core as jax_core


def primitive_counts(fn: Callable[..., Any], *args: Any) -> collections.Counter:
  """Counts the primitives in `fn`'s jaxpr, including all nested jaxprs.

  Two functions with equal counts run the same operations, whatever names or
  Python structure produced them: the structural fact behind "zero overhead".
  """
  counts = collections.Counter()

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      counts[eqn.primitive.name] += 1
      for sub in jax_core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return counts


def param_shapes(params: Any) -> Any:
  return jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), params)


class Outer(hk.Module):
  """A module whose `__call__` runs `body`: puts any test code inside a module."""

  def __init__(self, body: Callable[..., Any], name: str | None = None):
    super().__init__(name=name)
    self._body = body

  def __call__(self, *args: Any) -> Any:
    return self._body(*args)
