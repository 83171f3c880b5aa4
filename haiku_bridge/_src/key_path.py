"""Any params pytree, bound to Haiku parameters by its key paths.

`bind(init, args, kwargs)` is how a pure function's params become Haiku's:
at init, `init(rng, *args, **kwargs)` runs once with a key from Haiku's rng
sequence and each leaf is stored where its key path says (`naming.py`); at
apply, `init` never runs: its output's structure and shapes come from
`jax.eval_shape` (no op of it reaches the jaxpr), kept per exact argument
signature, and the leaves are read back from what apply was given, each
checked for presence and shape. Dtypes are the stored params' own, as inline
Haiku reads them.
"""

from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import caches
from haiku_bridge._src import errors
from haiku_bridge._src import haiku_internals
from haiku_bridge._src import inline
from haiku_bridge._src import naming
from haiku_bridge._src import storage
from haiku_bridge._src import pytree
from haiku_bridge._src.pytree import InitFn
from haiku_bridge._src.pytree import PyTree


_STRUCTURE = caches.Cache("structure of init's output")


def bind(init: InitFn, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PyTree:
  """The params pytree `init` describes: created at init, read at apply."""
  if not callable(init):
    raise TypeError(errors.message(
        f"`init` must be a function `init(rng, *args, **kwargs) -> params`; "
        f"got {errors.describe(init)}."))
  key_spec = _key_spec()
  if hk.running_init():
    inline.require_haiku_trace()
    tree = _run_init(init, args, kwargs)
    _check_array_leaves(tree)
    tree = jax.tree.map(storage.canonical, tree)
    _STRUCTURE.put(_cache_key(init, key_spec, args, kwargs),
                   pytree.specs(tree))
  else:
    tree = _STRUCTURE.get_or_compute(
        _cache_key(init, key_spec, args, kwargs),
        lambda: jax.eval_shape(lambda k: init(k, *args, **kwargs), key_spec))
  flat = jax.tree.leaves(tree)
  values = [None] * len(flat)
  for top, members in naming.key_path_groups(tree).items():
    # One module per first path component: it takes the name and is the
    # scope its leaves are read and written in.
    with naming.module_scope(top, members[0].keypath):
      scope = hk.experimental.current_name()
      leaves = [storage.Leaf(m.keypath, naming.join_bundle(scope, m.below),
                             m.name) for m in members]
      storage.PARAMS.claim(leaves)
      group = [flat[m.index] for m in members]
      if hk.running_init():
        got = storage.PARAMS.create(leaves, group)
      else:
        got = storage.PARAMS.read(leaves, [x.shape for x in group])
    for member, value in zip(members, got):
      values[member.index] = value
  return jax.tree.structure(tree).unflatten(values)


def _run_init(init, args, kwargs) -> PyTree:
  key = hk.maybe_next_rng_key()
  before = haiku_internals.stored_names()
  try:
    tree = init(key, *args, **kwargs)
  except Exception as error:  # pylint: disable=broad-except
    if key is not None:
      raise
    raise ValueError(errors.message(
        f"`init` failed when called with rng=None ({type(error).__name__}: "
        f"{error}). The transform has no rng key to draw one from: pass a "
        "key to init, e.g. `f.init(jax.random.PRNGKey(0), ...)`.")) from error
  created = sorted(haiku_internals.stored_names() - before)
  if created:
    raise ValueError(errors.message(
        f"`init` created Haiku parameters or state itself ({created[:4]}); "
        "an init function returns its params, and the bridge stores them. "
        "Return the values instead of calling hk.get_parameter, or bridge a "
        "Haiku function as its hk.transform."))
  return tree


def _check_array_leaves(tree: PyTree) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
      raise TypeError(errors.message(
          f"init returned a {type(leaf).__name__} at params path "
          f"{errors.keystr(path)} ({leaf!r:.60}); every leaf must be an "
          "array. Wrap it with jnp.asarray, or use None for an empty "
          "subtree."))


def _key_spec() -> jax.ShapeDtypeStruct:
  rng_state = hk.maybe_get_rng_sequence_state()
  if rng_state is None:
    return jax.ShapeDtypeStruct((2,), jnp.uint32)
  return pytree.spec(rng_state[0])


def _cache_key(init, key_spec, args, kwargs):
  return caches.function_key(init, args, kwargs, key_spec,
                             bool(jax.config.jax_enable_x64))
