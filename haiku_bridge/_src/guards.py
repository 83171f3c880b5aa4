"""Where the code runs (inside a Haiku transform, in its init), and the checks every public entry point makes on it.

`initialising` is the one place the library asks whether this is Haiku's
init (`guards_test` holds every other module to it).
"""

import haiku as hk

from haiku_bridge._src import errors
from haiku_bridge._src import haiku_internals


def inside_transform() -> bool:
  """Whether the code runs inside a Haiku transform."""
  try:
    hk.running_init()
  except ValueError:
    return False
  return True


def initialising() -> bool:
  """Whether this runs Haiku's init: inside a transform, creating params.

  Haiku's `hk.running_init()`, and False outside a transform (where Haiku
  raises): inside `hk.experimental.lift`, `hk.remat` or a custom getter it
  is the init of the transform that runs them.
  """
  try:
    return hk.running_init()
  except ValueError:
    return False


def require_transform() -> None:
  """Raises unless inside a Haiku transform."""
  if not inside_transform():
    raise ValueError(
      errors.message(
        "must be called inside a Haiku transform (a function passed to "
        "hk.transform / hk.transform_with_state, e.g. from a module's "
        "__call__). Outside Haiku there is nothing to bridge: call the pure "
        "function with its params directly."
      )
    )


def require_haiku_trace() -> None:
  """Raises at init inside a raw JAX transform, where params cannot be made."""
  if haiku_internals.inside_raw_jax_transform():
    raise ValueError(
      errors.message(
        "ran at init inside a raw JAX transform (the body of "
        "jax.lax.scan / jax.vmap / jax.checkpoint / jax.lax.cond, ...), where "
        "Haiku cannot create parameters. Use Haiku's wrapper instead (hk.scan, "
        "hk.vmap, hk.remat, hk.cond), or call hkb.get_relevant_parameters "
        "outside the JAX transform and pass the params into it."
      )
    )
