r"""A character LSTM trained on one long sequence, its backward pass checkpointed.

Backpropagation through time keeps, for the backward pass, what each of the T
steps computed (`hk.dynamic_unroll`), or at least each step's carry
(`hk.dynamic_unroll` of `hk.remat(core)`): memory grows with T. With
`hkb.dynamic_unroll(..., remat="nested")` the backward pass keeps about 2√T
carries and recomputes the rest, one more forward pass in all; with
`remat="binomial"` it keeps the fewest carries that this much recomputation
allows. The params, outputs and gradients are `hk.dynamic_unroll`'s.

The data: a synthetic text over a small alphabet, from a fixed Markov chain
whose next character depends on the last two (so an LSTM can learn it), read
as `batch` long sequences of `length` characters. The model: an embedding, an
`hk.LSTM`, a softmax head; each step computes its own loss, so what a step
keeps for the backward pass is its carry. The example

1. prints the compiled temporaries of the training step with each way of
   unrolling, and their ratio to the per-step remat;
2. checks that the gradient of `remat=` (the `--remat` flag's schedule) is
   `hk.dynamic_unroll`'s, on the same params;
3. trains a few steps of Adam (optax) with that schedule, the loss falling.

Run it from a checkout, with haiku_bridge and what the examples import
installed (`pip install ".[examples]"`, once):

    python examples/long_sequence_lstm.py --length=4096 --remat=nested

(from any other directory, with the file's path), or with Bazel:

    bazel run //examples:long_sequence_lstm
"""

from typing import Any

from absl import app
from absl import flags
import haiku as hk
import haiku_bridge as hkb
import jax
import jax.numpy as jnp
import numpy as np
import optax

# As a module (`python -m examples.long_sequence_lstm`, the tests, Bazel's library) or as a file
# (`python examples/long_sequence_lstm.py`: the file's folder is first on sys.path).
if __package__:
  from examples import jax_logging
else:
  import jax_logging  # pylint: disable=g-import-not-at-top

_LENGTH = flags.DEFINE_integer("length", 2048, "Characters per sequence (T).")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per step.")
_HIDDEN = flags.DEFINE_integer("hidden", 128, "LSTM width.")
_STEPS = flags.DEFINE_integer("steps", 20, "Training steps.")
_REMAT = flags.DEFINE_enum(
  "remat", "binomial", ["nested", "binomial"], "The schedule to train with."
)

VOCAB = 16

# How each way of unrolling is called: the per-step remat is the baseline.
WAYS = {
  "hk.dynamic_unroll": None,
  "hk.dynamic_unroll + hk.remat (baseline)": True,
  'hkb.dynamic_unroll(remat="nested")': "nested",
  'hkb.dynamic_unroll(remat="binomial")': "binomial",
}


def text(length: int, batch: int, seed: int = 0) -> np.ndarray:
  """`[length + 1, batch]` characters of a fixed order-2 Markov chain."""
  rng = np.random.default_rng(seed)
  # Each pair of characters makes a few next characters likely.
  logits = 3.0 * rng.standard_normal([VOCAB, VOCAB, VOCAB])
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  chars = np.zeros([length + 1, batch], np.int32)
  chars[:2] = rng.integers(0, VOCAB, [2, batch])
  for t in range(2, length + 1):
    cumulative = probs[chars[t - 2], chars[t - 1]].cumsum(-1)
    chars[t] = (rng.random([batch, 1]) > cumulative).sum(-1)
  return np.minimum(chars, VOCAB - 1)


class CharCore(hk.RNNCore):
  """One step: embed a character, step the LSTM, the loss on the next one."""

  def __init__(self, hidden: int):
    super().__init__(name="char_core")
    self.embed = hk.Embed(VOCAB, hidden, name="embed")
    self.lstm = hk.LSTM(hidden, name="lstm")
    self.head = hk.Linear(VOCAB, name="head")

  def __call__(self, inputs, state):
    chars, targets = inputs
    h, state = self.lstm(self.embed(chars), state)
    log_p = jax.nn.log_softmax(self.head(h))
    return -jnp.sum(log_p * jax.nn.one_hot(targets, VOCAB), -1), state

  def initial_state(self, batch_size: Any):
    return self.lstm.initial_state(batch_size)


def model(hidden: int, remat: Any) -> hk.Transformed:
  """The mean next-character loss; `remat`: a `WAYS` value."""

  def loss(chars: jax.Array) -> jax.Array:
    core = CharCore(hidden)
    inputs, state = (chars[:-1], chars[1:]), core.initial_state(chars.shape[1])
    if remat is None:
      losses, _ = hk.dynamic_unroll(core, inputs, state)
    elif remat is True:
      losses, _ = hk.dynamic_unroll(hk.remat(core), inputs, state)
    else:
      losses, _ = hkb.dynamic_unroll(core, inputs, state, remat=remat)
    return jnp.mean(losses)

  return hk.transform(loss)


def temporaries(hidden: int, chars: jax.Array) -> dict[str, int | None]:
  """Compiled temporary bytes of the grad step, for each of `WAYS`."""
  out = {}
  for name, remat in WAYS.items():
    net = model(hidden, remat)
    params = jax.jit(net.init)(jax.random.PRNGKey(0), chars)
    analysis = jax.jit(jax.grad(net.apply)).lower(params, None, chars).compile().memory_analysis()
    out[name] = None if analysis is None else analysis.temp_size_in_bytes
  return out


def gradient_difference(hidden: int, remat: str, chars: jax.Array) -> float:
  """Largest |difference| between the schedule's gradient and hk.dynamic_unroll's."""
  ours, theirs = model(hidden, remat), model(hidden, None)
  params = theirs.init(jax.random.PRNGKey(0), chars)
  grads = [jax.jit(jax.grad(f.apply))(params, None, chars) for f in (ours, theirs)]
  return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(*map(jax.tree.leaves, grads)))


def train(hidden: int, remat: str, chars: jax.Array, steps: int) -> list[float]:
  """Adam on the one batch of long sequences; the loss at each step."""
  net = model(hidden, remat)
  params = net.init(jax.random.PRNGKey(0), chars)
  optimizer = optax.adam(1e-2)
  state = optimizer.init(params)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(net.apply)(params, None, chars)
    updates, state = optimizer.update(grads, state)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(steps):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  return losses


def main(argv: list[str]) -> None:
  del argv  # Flags only.
  jax_logging.quiet()  # jax's INFO lines (the backends it could not start) left out.
  length, batch, hidden = _LENGTH.value, _BATCH.value, _HIDDEN.value
  chars = jnp.asarray(text(length, batch))
  print(
    f"Character LSTM (hidden {hidden}) on {batch} sequences of {length} "
    "characters.\n\nGrad-step temporaries:"
  )
  memory = temporaries(hidden, chars)
  baseline = memory["hk.dynamic_unroll + hk.remat (baseline)"]
  for name, n in memory.items():
    if n is None:
      print(f"  {name:42s} n/a (no memory_analysis on this backend)")
    else:
      ratio = f"  ({n / baseline:.3f} × baseline)" if baseline else ""
      print(f"  {name:42s} {n / 2**20:9.2f} MiB{ratio}")

  diff = gradient_difference(hidden, _REMAT.value, chars)
  print(
    f"\nremat={_REMAT.value!r}: gradient against hk.dynamic_unroll's, max |difference| {diff:.2e}"
  )
  np.testing.assert_allclose(diff, 0.0, atol=1e-5)

  print(f"\nTraining with remat={_REMAT.value!r} ({_STEPS.value} steps of Adam):")
  losses = train(hidden, _REMAT.value, chars, _STEPS.value)
  for i, loss in enumerate(losses):
    print(f"  step {i:3d}  loss {loss:.4f}")
  assert losses[-1] < losses[0], losses


if __name__ == "__main__":
  app.run(main)
