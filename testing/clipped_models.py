"""Two real models whose core is a gradient-clipping `hkb.custom_vjp` block.

- A character-level LSTM language model, after dm-haiku's `examples/rnn`
  (one-hot characters, two stacked LSTMs unrolled with `hk.dynamic_unroll`,
  an MLP head), made small.
- A pre-norm transformer block whose attention runs under `hk.remat`.

In each, one block's weights learn from a gradient clipped to a global norm
(`clip_bwd`), while the rest of the network gets the true gradient. The same
network inline, with the same clipping done by hand on the block's gradient
(`clip_by_hand`), is the reference: a training step must give the same
params.
"""

from typing import Any, Callable

import haiku as hk
import jax
import jax.numpy as jnp

import haiku_bridge as hkb

VOCAB = 11
HIDDEN = 8
MAX_NORM = 0.05


def clip(tree: Any, max_norm: float = MAX_NORM) -> Any:
  """`tree` scaled down to a global norm of at most `max_norm`."""
  norm = jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))
  scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-12))
  return jax.tree.map(lambda x: x * scale, tree)


def clip_bwd(vjp_fn, out_ct):
  """The block's weights get a clipped cotangent, its input the true one."""
  params_ct, *args_cts = vjp_fn(out_ct)
  return (clip(params_ct), *args_cts)


def clipped(f: Callable[..., Any]) -> Callable[..., Any]:
  return hkb.custom_vjp(f, hkb.vjp_fwd, clip_bwd)


# -- The character LSTM. ------------------------------------------------------


def lstm_core(one_hot: jax.Array) -> jax.Array:
  """Two LSTMs over time-major inputs `[T, B, VOCAB]`, as a DeepRNN."""
  core = hk.DeepRNN([hk.LSTM(HIDDEN), jax.nn.relu, hk.LSTM(HIDDEN)])
  outputs, _ = hk.dynamic_unroll(core, one_hot, core.initial_state(one_hot.shape[1]))
  return outputs


def char_lstm_loss(core: Callable[[jax.Array], jax.Array]):
  """The sequence loss of the model with `core` as its recurrent part."""

  def loss(batch):
    inputs = jax.nn.one_hot(batch["input"], VOCAB)
    logits = hk.nets.MLP([HIDDEN, VOCAB], name="head")(core(inputs))
    targets = jax.nn.one_hot(batch["target"], VOCAB)
    return -jnp.mean(jnp.sum(targets * jax.nn.log_softmax(logits), -1))

  return loss


def char_batch(key: jax.Array, steps: int = 6, batch: int = 2) -> dict:
  chars = jax.random.randint(key, [steps + 1, batch], 0, VOCAB)
  return {"input": chars[:-1], "target": chars[1:]}


# -- The transformer block. ---------------------------------------------------


def transformer_block(h: jax.Array) -> jax.Array:
  """A pre-norm block; the attention is rematerialised in the backward pass."""
  heads = 2

  def attend(x):
    return hk.MultiHeadAttention(
      heads, h.shape[-1] // heads, w_init=hk.initializers.VarianceScaling(), name="attention"
    )(x, x, x)

  ln = lambda name: hk.LayerNorm(-1, True, True, name=name)
  h = h + hk.remat(attend)(ln("ln_1")(h))
  return h + hk.nets.MLP([2 * h.shape[-1], h.shape[-1]])(ln("ln_2")(h))


def transformer_loss(block: Callable[[jax.Array], jax.Array]):
  def loss(batch):
    h = hk.Embed(VOCAB, HIDDEN, name="embed")(batch["input"])
    h = block(h)
    logits = hk.Linear(VOCAB, name="unembed")(h)
    targets = jax.nn.one_hot(batch["target"], VOCAB)
    return -jnp.mean(jnp.sum(targets * jax.nn.log_softmax(logits), -1))

  return loss


# -- Training. ----------------------------------------------------------------


def sgd_step(
  loss: hk.Transformed,
  params,
  batch,
  *,
  learning_rate: float,
  clip_by_hand: Callable[[dict], dict] = lambda g: g,
):
  """One SGD step; `clip_by_hand` edits the gradients before it."""
  grads = jax.grad(lambda p: loss.apply(p, None, batch))(params)
  grads = clip_by_hand(grads)
  return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)


def clip_bundles(prefix: str) -> Callable[[dict], dict]:
  """Clips, as one tree, the gradients of the bundles under `prefix`."""

  def clip_by_hand(grads):
    block = {b: g for b, g in grads.items() if b.startswith(prefix)}
    return {**grads, **clip(block)}

  return clip_by_hand
