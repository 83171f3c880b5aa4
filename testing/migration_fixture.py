"""A small stateful Haiku model and a few optax steps of it, for the migration tests.

`to_nnx` and `to_equinox` are both checked on the same thing: a Haiku model
with params, state (BatchNorm) and rng (dropout), trained a few steps in
Haiku, whose checkpoint then loads into the other library as it is.
"""

from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import optax


def haiku_net(x: jax.Array, is_training: bool = True) -> jax.Array:
  h = jax.nn.relu(hk.Linear(8)(x))
  h = hk.BatchNorm(True, True, 0.9)(h, is_training)
  if is_training:
    h = hk.dropout(hk.next_rng_key(), 0.25, h)
  return hk.nets.MLP([8, 3])(h)


HAIKU = hk.transform_with_state(haiku_net)


def trained_in_haiku(x: jax.Array, steps: int = 3) -> tuple[Any, Any]:
  """`(params, state)` after `steps` Adam steps on `mean(HAIKU(x) ** 2)`."""
  params, state = HAIKU.init(jax.random.PRNGKey(0), x)
  opt = optax.adam(1e-2)
  opt_state = opt.init(params)
  rngs = hk.PRNGSequence(1)

  def loss(p, s, rng):
    y, s = HAIKU.apply(p, s, rng, x)
    return jnp.mean(y**2), s

  for _ in range(steps):
    grads, state = jax.grad(loss, has_aux=True)(params, state, next(rngs))
    updates, opt_state = opt.update(grads, opt_state)
    params = optax.apply_updates(params, updates)
  return params, state
