r"""A custom gradient deep inside a Haiku network routes its cotangent by piece.

The scenario. `Net -> Encoder -> RoutedBlock` is an ordinary Haiku network,
except that the block, two modules deep and used twice with separate weights,
has a custom backward pass. The block is a two-layer MLP (`layer1`, `layer2`)
whose output features are split in two halves, pieces "a" and "b". Its
backward pass practises *gradient routing*: the error on piece "a" may only
teach `layer1`, the error on piece "b" only `layer2`, so each sub-layer is
made responsible for part of the block's output. The input cotangent stays
the true one (the sum over all pieces), so every layer outside the block still
trains on the exact gradient.

Haiku alone cannot express this: a `jax.custom_vjp` backward pass must return
cotangents for the weights, so the weights must be explicit arguments, while
Haiku hides them behind `hk.get_parameter`. `hkb.call_pure` makes them
explicit for one call, wherever it sits in the network:

    y = hkb.call_pure(routed_mlp, x, init=hk.transform(mlp))

At init the bridge runs `mlp` to create the weights, named exactly as inline
code would name them (`net/encoder/routed_block/layer1/w`, ...); at apply
it reads them back and passes `routed_mlp` the inner's params dict
`{"layer1": {"w", "b"}, "layer2": {"w", "b"}}`.

`routed_mlp`'s forward pass stores the `jax.vjp` closure of the MLP as its
residual; the backward pass splits the output cotangent into full-shaped
pieces, `jax.vmap`s the stored closure over them (one backward pass for all
pieces) and picks each weight's cotangent from the piece it is routed to.

The example trains the network with plain SGD on synthetic data, then checks
the custom gradient against the plain one (they differ on the routed block
weights, agree elsewhere) and against an independent reference written with
`lax.stop_gradient`.

Run it from a checkout, with haiku_bridge and what the examples import
installed (`pip install ".[examples]"`, once):

    python examples/custom_vjp_routing.py

(from any other directory, with the file's path), or with Bazel:

    bazel run //examples:custom_vjp_routing
"""

from typing import Any, Callable, Iterator

from absl import app
import haiku as hk
import haiku_bridge as hkb
import jax
import jax.numpy as jnp
import numpy as np

# As a module (`python -m examples.custom_vjp_routing`, the tests, Bazel's library) or as a file
# (`python examples/custom_vjp_routing.py`: the file's folder is first on sys.path).
if __package__:
  from examples import jax_logging
else:
  import jax_logging  # pylint: disable=g-import-not-at-top

Params = Any
Batch = tuple[jax.Array, jax.Array]
BlockFn = Callable[[Params, jax.Array], jax.Array]

IN_FEATURES = 8
WIDTH = 16
OUT_FEATURES = 4
BATCH_SIZE = 128
LEARNING_RATE = 0.1

# The routing rule. Each piece is a slice of the block's output features; each
# sub-layer of the block learns from exactly one piece.
PIECES = {"a": slice(0, WIDTH // 2), "b": slice(WIDTH // 2, WIDTH)}
ROUTE = {"layer1": "a", "layer2": "b"}


# ---------------------------------------------------------------------------
# The block: written once in Haiku, then used as a pure function of its params.
# ---------------------------------------------------------------------------


def mlp(x: jax.Array) -> jax.Array:
  h = jax.nn.gelu(hk.Linear(2 * WIDTH, name="layer1")(x))
  return hk.Linear(WIDTH, name="layer2")(h)


MLP = hk.transform(mlp)


def plain_mlp(params: Params, x: jax.Array) -> jax.Array:
  """The block's forward pass as a pure function; JAX's own gradient."""
  return MLP.apply(params, None, x)


def _piece_masks() -> jax.Array:
  """[num_pieces, WIDTH] 0/1 masks, one row per piece, in `PIECES` order."""
  masks = np.zeros((len(PIECES), WIDTH), np.float32)
  for row, features in enumerate(PIECES.values()):
    masks[row, features] = 1.0
  return jnp.asarray(masks)


@jax.custom_vjp
def routed_mlp(params: Params, x: jax.Array) -> jax.Array:
  """The block's forward pass, with the routed backward pass below."""
  return plain_mlp(params, x)


def _routed_mlp_fwd(params, x):
  # The vjp closure is a pytree (a `jax.tree_util.Partial`), so it can be the
  # residual itself: the backward pass reuses the forward's activations.
  y, mlp_vjp = jax.vjp(plain_mlp, params, x)
  return y, mlp_vjp


def _routed_mlp_bwd(mlp_vjp, dy):
  # Each piece is a full-shaped cotangent, zero outside its features, so that
  # the pieces sum to `dy`.
  pieces = jnp.stack([mask * dy for mask in _piece_masks()])  # [pieces, ...]
  # One vmapped backward pass gives every piece's cotangents, stacked.
  dparams, dx = jax.vmap(mlp_vjp)(pieces)
  index = {name: i for i, name in enumerate(PIECES)}
  routed = {
    layer: jax.tree.map(lambda d, i=index[ROUTE[layer]]: d[i], grads)
    for layer, grads in dparams.items()
  }
  # Cotangents are linear in `dy`: summing over the pieces gives the true
  # input cotangent, so the layers before the block see the exact gradient.
  return routed, dx.sum(axis=0)


routed_mlp.defvjp(_routed_mlp_fwd, _routed_mlp_bwd)


def reference_mlp(params: Params, x: jax.Array) -> jax.Array:
  """Routing written independently: no vjp closure, no vmap.

  The forward value is `sum_p mask_p * mlp(x)`, i.e. `mlp(x)`. In the term of
  piece p, the layers routed elsewhere are behind `stop_gradient`, so JAX's own
  gradient of that term reaches only piece p's layers and `x`.
  """
  y = 0.0
  for mask, piece in zip(_piece_masks(), PIECES):
    params_for_piece = {
      layer: (p if ROUTE[layer] == piece else jax.lax.stop_gradient(p))
      for layer, p in params.items()
    }
    y = y + mask * plain_mlp(params_for_piece, x)
  return y


BLOCKS: dict[str, BlockFn] = {
  "routed": routed_mlp,
  "plain": plain_mlp,
  "reference": reference_mlp,
}


# ---------------------------------------------------------------------------
# The network: the block sits two modules deep, used at two call sites.
# ---------------------------------------------------------------------------


class RoutedBlock(hk.Module):
  """A residual MLP block whose weights are explicit for `block_fn`."""

  def __init__(self, block_fn: BlockFn, name: str | None = None):
    super().__init__(name=name)
    self._block_fn = block_fn

  def __call__(self, x: jax.Array) -> jax.Array:
    # `init=MLP` creates layer1/layer2 under this module, as inline code would.
    return x + hkb.call_pure(self._block_fn, x, init=MLP)


class Encoder(hk.Module):
  def __init__(self, block_fn: BlockFn, name: str | None = None):
    super().__init__(name=name)
    self._block_fn = block_fn

  def __call__(self, x: jax.Array) -> jax.Array:
    x = hk.Linear(WIDTH, name="embed")(x)
    # Two call sites, two sets of weights: routed_block and routed_block_1.
    x = RoutedBlock(self._block_fn)(x)
    return RoutedBlock(self._block_fn)(x)


class Net(hk.Module):
  def __init__(self, block_fn: BlockFn, name: str | None = None):
    super().__init__(name=name)
    self._block_fn = block_fn

  def __call__(self, x: jax.Array) -> jax.Array:
    return hk.Linear(OUT_FEATURES, name="readout")(Encoder(self._block_fn)(x))


def make_loss(block: str) -> hk.Transformed:
  """The mean squared error of `Net` with the block's gradient `block`.

  All three choices of `BLOCKS` create the same parameters, so their gradients
  can be compared on one params dict.
  """

  def loss(batch: Batch) -> jax.Array:
    x, y = batch
    return jnp.mean((Net(BLOCKS[block])(x) - y) ** 2)

  return hk.transform(loss)


# ---------------------------------------------------------------------------
# Synthetic data, training, and the gradient comparison.
# ---------------------------------------------------------------------------


def batches(seed: int = 0) -> Iterator[Batch]:
  """Endless batches of a fixed random smooth function: y = sin(x A) B."""
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(IN_FEATURES, WIDTH)) / np.sqrt(IN_FEATURES)
  b = rng.normal(size=(WIDTH, OUT_FEATURES)) / np.sqrt(WIDTH)
  while True:
    x = rng.normal(size=(BATCH_SIZE, IN_FEATURES))
    y = np.sin(x @ a) @ b
    yield jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)


def init_params(seed: int = 0) -> Params:
  return make_loss("routed").init(jax.random.PRNGKey(seed), next(batches()))


def train(num_steps: int, seed: int = 0) -> list[float]:
  """Trains with the routed gradient and plain SGD; returns the loss per step."""
  loss_fn = make_loss("routed").apply

  @jax.jit
  def sgd_step(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, None, batch)
    params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return params, loss

  params = init_params(seed)
  losses = []
  for _, batch in zip(range(num_steps), batches(seed)):
    params, loss = sgd_step(params, batch)
    losses.append(float(loss))
  return losses


def is_routed(module_name: str) -> bool:
  """Whether `module_name` (a Haiku params key) is a sub-layer of a block."""
  return module_name.rsplit("/", 1)[-1] in ROUTE


def gradient_report(seed: int = 0) -> dict[str, Params]:
  """The gradient of the loss, at the initial params, for each block in BLOCKS.

  Returns:
    `{"routed": grads, "plain": grads, "reference": grads}`, each a Haiku
    params dict `{module_name: {param_name: array}}`.
  """
  params = init_params(seed)
  batch = next(batches(seed))
  return {block: jax.jit(jax.grad(make_loss(block).apply))(params, None, batch) for block in BLOCKS}


def _max_abs_diff(a: Params, b: Params) -> float:
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def main(argv: list[str]) -> None:
  del argv  # Unused.
  jax_logging.quiet()  # jax's INFO lines (the backends it could not start) left out.
  num_steps, log_every = 300, 50
  print(f"Training Net with the routed gradient ({num_steps} steps of SGD):")
  losses = train(num_steps)
  print(f"  step    0        loss {losses[0]:.4f}")
  # Window means: single-batch losses are noisy.
  for start in range(0, num_steps, log_every):
    window = losses[start : start + log_every]
    print(f"  steps {start:3d}-{start + len(window) - 1:3d}  mean loss {np.mean(window):.4f}")

  grads = gradient_report()
  print("\nGradient at init: max |difference| per module")
  print(f"  {'module':34s} {'routed-plain':>12s} {'routed-ref':>11s}  rule")
  for module in sorted(grads["routed"]):
    vs_plain = _max_abs_diff(grads["routed"][module], grads["plain"][module])
    vs_ref = _max_abs_diff(grads["routed"][module], grads["reference"][module])
    layer = module.rsplit("/", 1)[-1]
    rule = f"learns from piece {ROUTE[layer]!r}" if is_routed(module) else "exact gradient"
    print(f"  {module:34s} {vs_plain:12.2e} {vs_ref:11.2e}  {rule}")
    # The rule: routed weights lose the other piece's error; every other
    # weight keeps its exact gradient; the reference agrees everywhere.
    np.testing.assert_allclose(vs_ref, 0.0, atol=1e-5)
    if is_routed(module):
      assert vs_plain > 1e-4, module
    else:
      np.testing.assert_allclose(vs_plain, 0.0, atol=1e-5)
  print(
    "\nRouted gradient == stop_gradient reference everywhere; it differs "
    "from the plain gradient\nexactly on the routed block weights."
  )


if __name__ == "__main__":
  app.run(main)
