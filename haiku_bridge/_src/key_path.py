"""Any params pytree, bound to Haiku parameters by its key paths.

`bind(init, args, kwargs)` is how a pure function's params become Haiku's:
at init, `init(rng, *args, **kwargs)` runs once with a key from Haiku's rng
sequence and each leaf is stored where its key path says (`naming.py`); at
apply, `init` never runs: its output's structure and shapes come from
`jax.eval_shape` (no op of it reaches the jaxpr), kept per exact argument
signature (`_structure`) together with the key-path names of its leaves (a
`_Structure`), and the leaves are read back from what apply was given, each
checked for presence and shape. Dtypes are the stored params' own, as inline
Haiku reads them.
"""

from typing import Any, NamedTuple, Optional

import haiku as hk
import jax
import numpy as np

from haiku_bridge._src import caches
from haiku_bridge._src import fingerprint
from haiku_bridge._src import errors
from haiku_bridge._src import guards
from haiku_bridge._src import haiku_internals
from haiku_bridge._src import naming
from haiku_bridge._src import storage
from haiku_bridge._src import pytree
from haiku_bridge._src.pytree import InitFn
from haiku_bridge._src.pytree import PyTree


_STRUCTURE = caches.Cache("structure of init's output")


class _Structure(NamedTuple):
  """What reading a params pytree needs of it: a function of its structure.

  Computed from `init`'s output once per signature and kept with it, so a
  re-trace neither flattens nor names the tree again. The module names the
  groups enter are still allocated by Haiku at each call
  (`naming.module_scope`): they depend on what the caller's scope holds.
  """

  treedef: Any  # jax.tree_util.PyTreeDef.
  shapes: tuple[tuple[int, ...], ...]  # Per leaf, in `jax.tree.leaves` order.
  groups: tuple[tuple[Optional[str], tuple[naming.KeyPathLeaf, ...]], ...]


def _structure_of(tree: PyTree) -> _Structure:
  """`tree`'s structure; raises for a key path that is no Haiku name."""
  groups = tuple((top, tuple(members)) for top, members in naming.key_path_groups(tree).items())
  return _Structure(
    jax.tree.structure(tree), tuple(tuple(x.shape) for x in jax.tree.leaves(tree)), groups
  )


def bind(init: InitFn, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PyTree:
  """The params pytree `init` describes: created at init, read at apply."""
  if not callable(init):
    raise TypeError(
      errors.message(
        f"`init` must be a function `init(rng, *args, **kwargs) -> params`; "
        f"got {errors.describe(init)}."
      )
    )
  if guards.initialising():
    guards.require_haiku_trace()
    tree = _run_init(init, args, kwargs)
    _check_array_leaves(tree)
    tree = jax.tree.map(storage.canonical, tree)
    structure, flat = _structure_of(tree), jax.tree.leaves(tree)
  else:
    structure = _structure(init, args, kwargs)
  values = [None] * len(structure.shapes)
  for top, members in structure.groups:
    # One module per first path component: it takes the name and is the
    # scope its leaves are read and written in.
    with naming.module_scope(top, members[0].keypath):
      scope = hk.experimental.current_name()
      leaves = [
        storage.Leaf(m.keypath, naming.join_bundle(scope, m.below), m.name) for m in members
      ]
      storage.PARAMS.claim(leaves)
      if guards.initialising():
        got = storage.PARAMS.create(leaves, [flat[m.index] for m in members])
      else:
        got = storage.PARAMS.read(leaves, [structure.shapes[m.index] for m in members])
    for member, value in zip(members, got):
      values[member.index] = value
  return structure.treedef.unflatten(values)


def _run_init(init, args, kwargs) -> PyTree:
  key = hk.maybe_next_rng_key()
  before = haiku_internals.stored_names()
  try:
    tree = init(key, *args, **kwargs)
  except Exception as error:  # pylint: disable=broad-except
    if key is None:
      raise ValueError(
        errors.message(
          f"`init` failed when called with rng=None ({type(error).__name__}: "
          f"{error}). The transform has no rng key to draw one from: pass a "
          "key to init, e.g. `f.init(jax.random.PRNGKey(0), ...)`."
        )
      ) from error
    named = errors.named(
      error,
      (
        f"`init` raised {type(error).__name__} when called as `init(rng, "
        f"*args, **kwargs)`: {error} `init` makes the params from a key and "
        "the arguments, `fn` takes them: check that the two are not "
        "swapped."
      ),
    )
    if named is error:
      raise
    raise named from error
  created = sorted(haiku_internals.stored_names() - before)
  if created:
    raise ValueError(
      errors.message(
        f"`init` created Haiku parameters or state itself ({created[:4]}); "
        "an init function returns its params, and the bridge stores them. "
        "Return the values instead of calling hk.get_parameter, or bridge a "
        "Haiku function as its hk.transform."
      )
    )
  return tree


def _check_array_leaves(tree: PyTree) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
      raise TypeError(
        errors.message(
          f"init returned a {type(leaf).__name__} at params path "
          f"{errors.keystr(path)} ({leaf!r:.60}); every leaf must be an "
          "array. Wrap it with jnp.asarray, or use None for an empty "
          "subtree."
        )
      )


def _structure(init, args, kwargs) -> _Structure:
  """The structure of `init(rng, *args, **kwargs)`'s output, never running it.

  Found by `jax.eval_shape` with every array argument abstract, which is
  kept per exact signature: if `init` ran that way, its output cannot depend
  on the values of its arrays. Python values, and NumPy integer and bool
  scalars with them, stay static and are part of the signature, as inline
  code sees them (a size in `np.int64(7)`). An `init` that needs values (a
  size in a NumPy array, NumPy seeded from the key) runs abstractly over the
  values themselves and a key of zeros instead, each time: that result
  depends on them, so it is not kept.
  """
  key_spec = pytree.key_spec(hk.maybe_get_rng_sequence_state())
  cache_key = fingerprint.function_key(
    init,
    key_spec,
    args,
    kwargs,
    bool(jax.config.jax_enable_x64),  # type: ignore[attr-defined, unused-ignore]
  )
  cached = _STRUCTURE.get(cache_key)
  if cached is not None:
    return cached
  arrays, rebuild = pytree.split_arrays((args, kwargs), numpy=True)
  abstract = lambda key, arrays: init(key, *rebuild(arrays)[0], **rebuild(arrays)[1])
  try:
    shaped = jax.eval_shape(abstract, key_spec, arrays)
  except pytree.CONCRETIZATION_ERRORS:
    key = pytree.concrete_key(key_spec)
    try:
      shaped = jax.eval_shape(lambda: init(key, *args, **kwargs))
    except pytree.CONCRETIZATION_ERRORS as error:
      raise TypeError(
        errors.message(
          "`init` needs concrete values to give the structure of its params, "
          "and at apply (here under a JAX transform such as jax.jit) its "
          f"arguments are abstract: {type(error).__name__}: "
          f"{str(error).splitlines()[0]} Make the structure follow from the "
          "shapes of array arguments and from Python values (pass sizes and "
          "flags as Python ints and bools)."
        )
      ) from error
    return _structure_of(shaped)  # It depends on values: not kept.
  structure = _structure_of(shaped)
  _STRUCTURE.put(cache_key, structure)
  return structure
