r"""A network written in plain JAX, stax-style, used inside a Haiku module.

Plenty of JAX code comes as an `(init, apply)` pair with explicit params:
`jax.example_libraries.stax`, hand-written research code, another library's
layers. `hkb.call_pure` runs such code inside a Haiku network as it is: the
pair's `init` runs once at Haiku's init, its params become Haiku parameters
named by their key path, and its `apply` gets them back at apply time.

Here a stax MLP is the head of a Haiku encoder. The example trains the whole
network for a few steps, saves its weights by name to an `.npz` file, restores
them into a freshly initialised network, and checks the restored network
computes the same outputs. The stax params (a list of `(W, b)` tuples and
empty tuples for activation layers) are stored as `net/head/layer_0_0` (W of
layer 0), `net/head/layer_0_1` (its b), `net/head/layer_2_0`, ...

Run it from a checkout, with haiku_bridge and what the examples import
installed (`pip install ".[examples]"`, once):

    python examples/foreign_stax.py

(from any other directory, with the file's path), or with Bazel:

    bazel run //examples:foreign_stax
"""

import os
import tempfile
from typing import Any, Callable

from absl import app
import haiku as hk
import haiku_bridge as hkb
import jax
from jax.example_libraries import stax
import jax.numpy as jnp
import numpy as np

# As a module (`python -m examples.foreign_stax`, the tests, Bazel's library) or as a file
# (`python examples/foreign_stax.py`: the file's folder is first on sys.path).
if __package__:
  from examples import jax_logging
else:
  import jax_logging  # pylint: disable=g-import-not-at-top

Params = Any

# A foreign network: stax's (init_fun, apply_fun) pair, knowing nothing of Haiku.
HEAD_INIT, HEAD_APPLY = stax.serial(stax.Dense(32), stax.Relu, stax.Dense(3))


def stax_layer(
  init_fun: Callable[..., Any], apply_fun: Callable[..., Any], x: jax.Array, name: str
) -> jax.Array:
  """Runs a stax `(init_fun, apply_fun)` pair inside a Haiku transform."""
  # stax's init takes an input *shape* and returns (output_shape, params);
  # call_pure's init takes the inputs and returns the params.
  return hkb.call_pure(
    lambda params, x: apply_fun(params, x),
    x,
    init=lambda rng, x: init_fun(rng, x.shape)[1],
    name=name,
  )


class Net(hk.Module):
  def __call__(self, x: jax.Array) -> jax.Array:
    h = jax.nn.relu(hk.Linear(16, name="encoder")(x))
    return stax_layer(HEAD_INIT, HEAD_APPLY, h, name="head")


def forward(x: jax.Array) -> jax.Array:
  return Net()(x)


NET = hk.without_apply_rng(hk.transform(forward))


def data(seed: int = 0) -> tuple[jax.Array, jax.Array]:
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(64, 8)).astype(np.float32)
  labels = (x[:, :3] ** 2).argmax(axis=-1)
  return jnp.asarray(x), jnp.asarray(labels)


def loss(params: Params, x: jax.Array, labels: jax.Array) -> jax.Array:
  logits = NET.apply(params, x)
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1))


def train(num_steps: int, learning_rate: float = 0.3) -> tuple[Params, list[float]]:
  x, labels = data()
  params = NET.init(jax.random.PRNGKey(0), x)
  step = jax.jit(jax.value_and_grad(loss))
  losses = []
  for _ in range(num_steps):
    value, grads = step(params, x, labels)
    params = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
    losses.append(float(value))
  return params, losses


def save(params: Params, path: str) -> None:
  """Saves Haiku params by full name: `module/param` -> array."""
  np.savez(
    path,
    **{
      f"{module}/{name}": np.asarray(value)
      for module, entries in params.items()
      for name, value in entries.items()
    },
  )


def restore(path: str) -> Params:
  params: dict[str, dict[str, jax.Array]] = {}
  with np.load(path) as saved:
    for full_name in saved.files:
      module, name = full_name.rsplit("/", 1)
      params.setdefault(module, {})[name] = jnp.asarray(saved[full_name])
  return params


def save_and_restore(params: Params) -> Params:
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "net.npz")
    save(params, path)
    return restore(path)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  jax_logging.quiet()  # jax's INFO lines (the backends it could not start) left out.
  params, losses = train(num_steps=100)
  print(f"Loss: {losses[0]:.3f} at step 0, {losses[-1]:.3f} at step {len(losses) - 1}.")
  print("Parameters by name:")
  for module in sorted(params):
    for name, value in sorted(params[module].items()):
      print(f"  {module + '/' + name:24s} {tuple(value.shape)}")
  restored = save_and_restore(params)
  x, _ = data(seed=1)
  np.testing.assert_array_equal(NET.apply(restored, x), NET.apply(params, x))
  print("Saved by name, restored into the network: same outputs.")


if __name__ == "__main__":
  app.run(main)
