r"""Migrating a Haiku model to Flax NNX, with its checkpoint carried over.

A team moving off Haiku keeps its trained weights: `hkb.to_nnx` turns the
Haiku function into an `nnx.Module` whose `nnx.Param`s have Haiku's names
(`model.params["mlp/~/linear_0"]["w"]`), so the Haiku checkpoint loads into
it as it is, and Haiku state (batch norm statistics) becomes NNX variables.

The example trains the Haiku model a few steps with optax, saves the params
and state by name to an `.npz` file, loads the file into the NNX module,
checks that both give the same outputs and gradients, trains on in NNX with
`nnx.Optimizer`, and exports the NNX weights back to Haiku's names (same
outputs again).

Run it from a checkout, with haiku_bridge and what the examples import
installed (`pip install ".[examples]"`, once):

    python examples/migration_to_nnx.py

(from any other directory, with the file's path), or with Bazel:

    bazel run //examples:migration_to_nnx
"""

import os
import tempfile
from typing import Any

from absl import app
from absl import flags
from flax import nnx
import haiku as hk
import haiku_bridge as hkb
import jax
import jax.numpy as jnp
import numpy as np
import optax

# As a module (`python -m examples.migration_to_nnx`, the tests, Bazel's library) or as a file
# (`python examples/migration_to_nnx.py`: the file's folder is first on sys.path).
if __package__:
  from examples import jax_logging
else:
  import jax_logging  # pylint: disable=g-import-not-at-top

_HAIKU_STEPS = flags.DEFINE_integer("haiku_steps", 50, "Steps in Haiku.")
_NNX_STEPS = flags.DEFINE_integer("nnx_steps", 50, "Steps in NNX.")


def forward(x: jax.Array, is_training: bool = True) -> jax.Array:
  h = jax.nn.relu(hk.Linear(32)(x))
  h = hk.BatchNorm(True, True, 0.9)(h, is_training)
  if is_training:
    h = hk.dropout(hk.next_rng_key(), 0.1, h)
  return hk.nets.MLP([32, 1])(h)[:, 0]


HAIKU = hk.transform_with_state(forward)


def data(seed: int = 0, n: int = 128) -> tuple[jax.Array, jax.Array]:
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 4)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(np.cos(x[:, 0]) + x[:, 1] ** 2)


def train_haiku(num_steps: int) -> tuple[Any, Any, list[float]]:
  x, y = data()
  params, state = HAIKU.init(jax.random.PRNGKey(0), x)
  optimizer = optax.adam(1e-2)
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, state, opt_state, rng):
    def loss(p):
      pred, s = HAIKU.apply(p, state, rng, x)
      return jnp.mean((pred - y) ** 2), s

    (value, state), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), state, opt_state, value

  rngs, losses = hk.PRNGSequence(1), []
  for _ in range(num_steps):
    params, state, opt_state, value = step(params, state, opt_state, next(rngs))
    losses.append(float(value))
  return params, state, losses


def eval_loss(predict) -> float:
  """The loss on the training data with dropout off and batch norm's averages.

  The loss each training step reports is drawn under dropout: at this size it
  moves by more than a few steps of progress, so the phases compare this one.
  """
  x, y = data()
  return float(jnp.mean((predict(x) - y) ** 2))


def haiku_loss(params, state) -> float:
  return eval_loss(lambda x: HAIKU.apply(params, state, None, x, is_training=False)[0])


def nnx_loss(model: nnx.Module) -> float:
  return eval_loss(lambda x: model(x, is_training=False))


def save(path: str, params, state) -> None:
  """A Haiku checkpoint: `params/<module>/<name>`, `state/<module>/<name>`."""
  np.savez(
    path,
    **{
      f"{kind}/{module}/{name}": np.asarray(value)
      for kind, tree in (("params", params), ("state", state))
      for module, entries in tree.items()
      for name, value in entries.items()
    },
  )


def load(path: str) -> tuple[dict, dict]:
  trees = {"params": {}, "state": {}}
  with np.load(path) as saved:
    for key in saved.files:
      kind, rest = key.split("/", 1)
      module, name = rest.rsplit("/", 1)
      trees[kind].setdefault(module, {})[name] = jnp.asarray(saved[key])
  return trees["params"], trees["state"]


def migrate(params, state) -> nnx.Module:
  """The Haiku checkpoint, through a file, into an NNX module."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "haiku.npz")
    save(path, params, state)
    params, state = load(path)
  return hkb.to_nnx(HAIKU, params=params, state=state, rngs=nnx.Rngs(dropout=0))


def train_nnx(model: nnx.Module, num_steps: int) -> list[float]:
  x, y = data()
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    loss = lambda m: jnp.mean((m(x) - y) ** 2)
    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value

  return [float(step(model, optimizer)) for _ in range(num_steps)]


def main(argv: list[str]) -> None:
  del argv  # Unused.
  jax_logging.quiet()  # jax's INFO lines (the backends it could not start) left out.
  print("Loss: mean squared error on the training data, dropout off.")
  initial = haiku_loss(*HAIKU.init(jax.random.PRNGKey(0), data()[0]))
  params, state, _ = train_haiku(_HAIKU_STEPS.value)
  print(
    f"Haiku: loss {initial:.4f} at init, {haiku_loss(params, state):.4f} "
    f"after {_HAIKU_STEPS.value} steps."
  )
  model = migrate(params, state)
  print(
    "NNX module params (Haiku's names):",
    sorted(nnx.to_pure_dict(nnx.state(model, nnx.Param))["params"]),
  )

  x, _ = data(seed=1, n=16)
  haiku_out, _ = HAIKU.apply(params, state, None, x, is_training=False)
  np.testing.assert_allclose(model(x, is_training=False), haiku_out, rtol=1e-6)
  print("Same outputs in NNX as in Haiku.")

  migrated = nnx_loss(model)
  train_nnx(model, _NNX_STEPS.value)
  print(
    f"NNX: loss {migrated:.4f} after migration, {nnx_loss(model):.4f} "
    f"after {_NNX_STEPS.value} more steps."
  )
  back_out, _ = HAIKU.apply(model.haiku_params(), model.haiku_state(), None, x, is_training=False)
  np.testing.assert_allclose(model(x, is_training=False), back_out, rtol=1e-6)
  print("Exported back to Haiku's params dict: same outputs.")


if __name__ == "__main__":
  app.run(main)
