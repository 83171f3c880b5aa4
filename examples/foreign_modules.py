r"""A Haiku model with a Flax NNX block and an Equinox block, trained with optax.

Teams with Haiku code often need a component written in another JAX library.
`hkb.from_flax` and `hkb.from_equinox` make such a component a Haiku module:
its weights are Haiku params named by its own attribute paths
(`net/nnx_block/linear1/kernel`, `net/mlp/layers_0/weight`), its batch norm
statistics are Haiku state, and its dropout draws from Haiku's rng.

The example trains the mixed model on a toy regression task with
`optax.adam`, prints the loss falling and the parameter names, and checks the
trained NNX block against the same NNX module run natively with the weights
Haiku holds.

Run it from a checkout, with haiku_bridge and what the examples import
installed (`pip install ".[examples]"`, once):

    python examples/foreign_modules.py

(from any other directory, with the file's path), or with Bazel:

    bazel run //examples:foreign_modules
"""

import functools
from typing import Any

from absl import app
from absl import flags
import equinox as eqx
from flax import nnx
import haiku as hk
import haiku_bridge as hkb
import jax
import jax.numpy as jnp
import numpy as np
import optax

# As a module (`python -m examples.foreign_modules`, the tests, Bazel's library) or as a file
# (`python examples/foreign_modules.py`: the file's folder is first on sys.path).
if __package__:
  from examples import jax_logging
else:
  import jax_logging  # pylint: disable=g-import-not-at-top

_NUM_STEPS = flags.DEFINE_integer("num_steps", 200, "Training steps.")

WIDTH = 16


class NnxBlock(nnx.Module):
  """A residual block written in Flax NNX: linear, batch norm, dropout."""

  def __init__(self, width: int, *, rngs: nnx.Rngs):
    self.linear1 = nnx.Linear(width, width, rngs=rngs)
    self.bn = nnx.BatchNorm(width, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.linear2 = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.drop(jax.nn.gelu(self.bn(self.linear1(x))))
    return x + self.linear2(h)


# The Equinox head sees one example at a time, as Equinox models do.
EQX_HEAD = functools.partial(eqx.nn.MLP, WIDTH, 1, 32, 2)


def forward(x: jax.Array, is_training: bool) -> jax.Array:
  return Net()(x, is_training)


class Net(hk.Module):
  def __call__(self, x: jax.Array, is_training: bool) -> jax.Array:
    return _net(x, is_training)


def _net(x: jax.Array, is_training: bool) -> jax.Array:
  h = jax.nn.gelu(hk.Linear(WIDTH, name="embed")(x))
  block = hkb.from_flax(functools.partial(NnxBlock, WIDTH), name="nnx_block")
  h = (block.train() if is_training else block.eval())(h)
  head = hkb.from_equinox(EQX_HEAD, name="mlp")
  return hk.vmap(head, split_rng=False)(h)[:, 0]


NET = hk.transform_with_state(forward)


def data(seed: int = 0, n: int = 128) -> tuple[jax.Array, jax.Array]:
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 8)).astype(np.float32)
  y = np.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2]
  return jnp.asarray(x), jnp.asarray(y)


def loss_fn(params, state, rng, x, y):
  pred, state = NET.apply(params, state, rng, x, is_training=True)
  return jnp.mean((pred - y) ** 2), state


def train(num_steps: int, seed: int = 0) -> tuple[Any, Any, list[float]]:
  x, y = data()
  params, state = NET.init(jax.random.PRNGKey(seed), x, is_training=True)
  optimizer = optax.adam(3e-3)
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, state, opt_state, rng):
    (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, rng, x, y)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), state, opt_state, loss

  rngs = hk.PRNGSequence(seed + 1)
  losses = []
  for _ in range(num_steps):
    params, state, opt_state, loss = step(params, state, opt_state, next(rngs))
    losses.append(float(loss))
  return params, state, losses


def native_nnx_block(params, state) -> NnxBlock:
  """The NNX block holding the weights Haiku trained, for a native call."""
  block = NnxBlock(WIDTH, rngs=nnx.Rngs(0))
  for tree in (params, state):
    for module, entries in tree.items():
      if module.startswith("net/nnx_block/"):
        node = getattr(block, module.split("/")[-1])
        for name, value in entries.items():
          getattr(node, name)[...] = value
  return block


def main(argv: list[str]) -> None:
  del argv  # Unused.
  jax_logging.quiet()  # jax's INFO lines (the backends it could not start) left out.
  params, state, losses = train(_NUM_STEPS.value)
  print(
    f"Training with optax.adam: loss {losses[0]:.4f} at step 0, "
    f"{losses[-1]:.4f} at step {len(losses) - 1}."
  )
  print("Parameters (Haiku names) and state:")
  for module in sorted(params):
    for name, value in sorted(params[module].items()):
      print(f"  param  {module + '/' + name:32s} {tuple(value.shape)}")
  for module in sorted(state):
    for name, value in sorted(state[module].items()):
      print(f"  state  {module + '/' + name:32s} {tuple(value.shape)}")

  # The trained NNX block, run natively in NNX, gives what Haiku computes.
  probe = hk.transform_with_state(
    lambda h: hkb.from_flax(functools.partial(NnxBlock, WIDTH), name="nnx_block").eval()(h)
  )
  h = jax.random.normal(jax.random.PRNGKey(3), [16, WIDTH])
  sub = {k[len("net/") :]: v for k, v in params.items() if "nnx_block" in k}
  sub_state = {k[len("net/") :]: v for k, v in state.items()}
  ours, _ = probe.apply(sub, sub_state, None, h)
  native = native_nnx_block(params, state)
  native.eval()
  np.testing.assert_allclose(ours, native(h), rtol=1e-5, atol=1e-6)
  print("The trained NNX block run natively in Flax gives the same outputs.")


if __name__ == "__main__":
  app.run(main)
