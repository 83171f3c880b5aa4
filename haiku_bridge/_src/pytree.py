"""Pytree types and shape records shared across haiku_bridge."""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any  # Nested dicts, lists, tuples, NamedTuples, dataclasses of arrays.
InitFn = Callable[..., PyTree]  # `init(rng, *args, **kwargs) -> params`.


def spec(x: Any) -> jax.ShapeDtypeStruct:
  """The shape and dtype of an array, a tracer or a Python scalar."""
  return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


def specs(tree: PyTree) -> PyTree:
  """`spec` of every leaf."""
  return jax.tree.map(spec, tree)
