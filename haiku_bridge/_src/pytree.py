"""Pytree types and shape records shared across haiku_bridge."""

import functools
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


def nbytes(tree: PyTree) -> int:
  """Bytes of the arrays (or avals, specs, `args_info`) of `tree`; a typed PRNG key's are its key data's.

  >>> from haiku_bridge._src import pytree
  >>> pytree.nbytes({"w": jnp.ones([2, 3]), "key": jax.random.key(0)})
  32
  """
  return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def key_spec(rng_state: Any) -> jax.ShapeDtypeStruct:
  """A key like those an rng sequence in state `rng_state` draws.

  `rng_state` is `hk.maybe_get_rng_sequence_state()`; with none, a key like
  `jax.random.PRNGKey(0)`'s.
  """
  if rng_state is None:
    return default_key_spec()
  key = rng_state[0]
  return jax.ShapeDtypeStruct(key.shape, key.dtype)


def is_key(x: Any) -> bool:
  """A JAX random key: a typed key array, or raw `uint32` key data."""
  return isinstance(x, jax.Array) and (
    jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) or x.dtype == jnp.uint32
  )


def concrete_key(spec: jax.ShapeDtypeStruct) -> Any:
  """A key of `spec` with a value (zeros), even inside a JAX trace."""
  if not jax.dtypes.issubdtype(spec.dtype, jax.dtypes.prng_key):
    return np.zeros(spec.shape, spec.dtype)
  with jax.ensure_compile_time_eval():
    key = jax.random.key(0)
  if (key.shape, key.dtype) != (spec.shape, spec.dtype):
    raise TypeError(f"no key of {spec} can be made here.")
  return key


# What JAX raises where code needs the value of an abstract array.
CONCRETIZATION_ERRORS = (
  jax.errors.ConcretizationTypeError,
  jax.errors.TracerArrayConversionError,
  jax.errors.TracerIntegerConversionError,
  jax.errors.TracerBoolConversionError,
)


def is_python_value(x: Any) -> bool:
  """A NumPy integer or bool scalar: a Python value (a size, a flag).

  Inline Haiku code may use `np.int64(7)` as a shape or `np.bool_(True)` as
  a branch, as it would `7` or `True`; so the bridge keeps such values
  static, as it keeps Python ones.
  """
  return isinstance(x, (np.integer, np.bool_))


def split_arrays(tree: PyTree, numpy: bool):
  """The array leaves of `tree`, and `rebuild(arrays)` to put them back.

  Arrays are JAX arrays (tracers among them) and, with `numpy`, NumPy arrays
  and NumPy floating and complex scalars too (integer and bool ones are
  Python values: `is_python_value`); every other leaf stays as it is in
  `rebuild`'s output.
  """
  leaves, treedef = jax.tree.flatten(tree)
  is_array = [
    isinstance(x, jax.Array)
    or (numpy and isinstance(x, (np.ndarray, np.generic)) and not is_python_value(x))
    for x in leaves
  ]
  arrays = [x for x, a in zip(leaves, is_array) if a]

  def rebuild(new_arrays):
    it = iter(new_arrays)
    return treedef.unflatten([next(it) if a else x for x, a in zip(leaves, is_array)])

  return arrays, rebuild


def default_key_spec() -> jax.ShapeDtypeStruct:
  """The shape and dtype of `jax.random.PRNGKey(0)` under the PRNG in force.

  `jax_default_prng_impl` decides it: `uint32[2]` for threefry, `uint32[4]`
  for rbg.
  """
  return key_spec_of(jax.config.jax_default_prng_impl)  # type: ignore[attr-defined, unused-ignore]


@functools.lru_cache(maxsize=None)
def key_spec_of(impl: str) -> jax.ShapeDtypeStruct:
  del impl  # The key: jax.random reads the config itself.
  return jax.eval_shape(lambda: jax.random.PRNGKey(0))


def swap_batch_time(tree: PyTree) -> PyTree:
  """`[T, B, ...]` leaves as `[B, T, ...]` (and back); a leaf of one value per step stays `[T]`.

  What `hkb.dynamic_unroll(time_major=False)` does to its inputs and
  outputs, and what `remat="auto"` measures it doing.
  """
  return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1) if np.ndim(a) > 1 else a, tree)
