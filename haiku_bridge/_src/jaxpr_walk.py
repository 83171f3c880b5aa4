"""Walking a jaxpr: the jaxprs an equation holds, and every equation through them.

A scan's body, a cond's branches, a while loop's condition and body, a jit's
function, a `jax.checkpoint`'s, a custom derivative's function: each is a
jaxpr in the params of the equation that runs it. `sub_jaxprs` finds them
with `jax.extend.core.jaxprs_in_params` (jax >= 0.10), and on the older
releases the library supports (from jax 0.6, whose `jax.extend.core` has
the jaxpr types but not that function) reads them the same way;
`equations` walks through them, depth first. A custom derivative's rules
(`jax.custom_vjp`'s forward and backward, `jax.custom_jvp`'s) are functions
in its params, not jaxprs: they are traced only when differentiated, and
then appear inline in the derivative's jaxpr.

>>> import jax, jax.numpy as jnp
>>> from haiku_bridge._src import jaxpr_walk
>>> closed = jax.make_jaxpr(lambda x: jax.lax.cond(x > 0, jnp.sin, jnp.cos, x))(1.0)
>>> sorted(eqn.primitive.name for eqn in jaxpr_walk.equations(closed))
['cond', 'convert_element_type', 'cos', 'gt', 'sin']
"""

from typing import Any, Callable, Iterator, Mapping, Optional

from jax.extend import core as jax_core

Jaxpr = jax_core.Jaxpr
ClosedJaxpr = jax_core.ClosedJaxpr

# jax.extend.core's own, from jax 0.10 (None before).
_JAXPRS_IN_PARAMS: Optional[Callable[[Mapping[str, Any]], Iterator[Jaxpr]]] = getattr(
  jax_core, "jaxprs_in_params", None
)


def sub_jaxprs(params: Mapping[str, Any]) -> Iterator[Jaxpr]:
  """The jaxprs an equation's `params` hold, one level down, each open (a closed one's `.jaxpr`)."""
  if _JAXPRS_IN_PARAMS is not None:
    yield from _JAXPRS_IN_PARAMS(params)
    return
  # What jaxprs_in_params reads: a jaxpr, or a tuple of them (a cond's branches).
  for value in params.values():
    for v in value if isinstance(value, tuple) else (value,):
      if isinstance(v, Jaxpr):
        yield v
      elif isinstance(v, ClosedJaxpr):
        yield v.jaxpr


def equations(jaxpr: Jaxpr | ClosedJaxpr) -> Iterator[jax_core.JaxprEqn]:
  """Every equation of `jaxpr`, each followed by those of the jaxprs it holds (`sub_jaxprs`), at any depth."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in sub_jaxprs(eqn.params):
      yield from equations(sub)
