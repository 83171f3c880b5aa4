r"""A transformer-style stack of N blocks through the layer scan, with remat.

Written as a Python loop, a stack of N blocks is traced and compiled N times
over: compile time grows with depth. `hkb.repeat_layer` runs the block under
`jax.lax.scan` over weights stacked on a leading layer axis, so the block is
traced and compiled once, whatever N is; `remat=True` recomputes each block's
activations in the backward pass instead of keeping them.

The example builds the same pre-LayerNorm transformer both ways, checks that
they compute the same loss and gradients on the same weights (the scan's
stacked weights mapped to the loop's per-layer names with
`hkb.unstack_params`), and prints trace+compile time and compiled temporary
memory against depth.

Run it from a checkout, with haiku_bridge and what the examples import
installed (`pip install ".[examples]"`, once):

    python examples/transformer_stack.py --depths=2,8,32

(from any other directory, with the file's path), or with Bazel:

    bazel run //examples:transformer_stack
"""

import time
from typing import Sequence

from absl import app
from absl import flags
import haiku as hk
import haiku_bridge as hkb
import jax
import jax.numpy as jnp
import numpy as np

# As a module (`python -m examples.transformer_stack`, the tests, Bazel's library) or as a file
# (`python examples/transformer_stack.py`: the file's folder is first on sys.path).
if __package__:
  from examples import jax_logging
else:
  import jax_logging  # pylint: disable=g-import-not-at-top

_DEPTHS = flags.DEFINE_list("depths", ["2", "8", "32", "128"], "Stack depths to compile and time.")
_LOOP_MAX_DEPTH = flags.DEFINE_integer(
  "loop_max_depth",
  8,
  "Compile the Python-loop version only up to this depth (its compile time "
  "grows with depth: minutes at 32 on two cores).",
)

MODEL_SIZE = 32
NUM_HEADS = 4
SEQ_LEN = 16
BATCH = 4
STACK = "transformer/blocks"


def block(h: jax.Array) -> jax.Array:
  """One pre-LayerNorm transformer block: self-attention, then an MLP."""
  ln = lambda name: hk.LayerNorm(-1, create_scale=True, create_offset=True, name=name)
  x = ln("ln_attn")(h)
  h = h + hk.MultiHeadAttention(
    NUM_HEADS, MODEL_SIZE // NUM_HEADS, w_init=hk.initializers.VarianceScaling(1.0), name="attn"
  )(x, x, x)
  x = ln("ln_mlp")(h)
  return h + hk.nets.MLP([4 * MODEL_SIZE, MODEL_SIZE], activation=jax.nn.gelu, name="mlp")(x)


def make_model(depth: int, scanned: bool) -> hk.Transformed:
  """The loss of a `depth`-block transformer, as a scan or as a Python loop."""

  def loss(tokens: jax.Array) -> jax.Array:
    with hk.name_scope("transformer"):
      h = hk.Embed(64, MODEL_SIZE, name="embed")(tokens)
      if scanned:
        h = hkb.repeat_layer(block, h, depth, remat=True, name="blocks")
      else:
        with hk.name_scope("blocks_loop"):
          for i in range(depth):
            with hk.name_scope(f"layer_{i}"):
              h = hk.remat(block)(h)
      logits = hk.Linear(64, name="unembed")(h)
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  return hk.transform(loss)


def tokens() -> jax.Array:
  return jax.random.randint(jax.random.PRNGKey(1), [BATCH, SEQ_LEN], 0, 64)


def scan_params_for_loop(params, depth: int):
  return hkb.unstack_params(
    params, stack=STACK, num_layers=depth, layer_scope="transformer/blocks_loop/layer_{i}"
  )


def check_same_model(depth: int) -> float:
  """Loss and gradients of scan and loop agree on the same weights.

  Returns:
    The largest absolute difference between the two gradients.
  """
  scan, loop = make_model(depth, True), make_model(depth, False)
  params = scan.init(jax.random.PRNGKey(0), tokens())
  loop_params = scan_params_for_loop(params, depth)
  l_scan, g_scan = jax.value_and_grad(scan.apply)(params, None, tokens())
  l_loop, g_loop = jax.value_and_grad(loop.apply)(loop_params, None, tokens())
  np.testing.assert_allclose(l_scan, l_loop, rtol=1e-5)
  g_scan = scan_params_for_loop(g_scan, depth)
  return max(
    float(jnp.max(jnp.abs(g_scan[k][n] - g_loop[k][n]))) for k in g_loop for n in g_loop[k]
  )


def compile_stats(depth: int, scanned: bool) -> dict[str, float]:
  """Trace+compile seconds, jaxpr equations and compiled temp bytes of a step."""
  model = make_model(depth, scanned)
  params = model.init(jax.random.PRNGKey(0), tokens())
  step = jax.jit(jax.grad(model.apply))
  start = time.perf_counter()
  lowered = step.lower(params, None, tokens())
  compiled = lowered.compile()
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  eqns = len(jax.make_jaxpr(jax.grad(model.apply))(params, None, tokens()).eqns)
  return {
    "seconds": seconds,
    "eqns": eqns,
    "temp_bytes": getattr(memory, "temp_size_in_bytes", float("nan")),
  }


def compile_table(
  depths: Sequence[int], loop_max_depth: int
) -> dict[str, list[dict[str, float] | None]]:
  """Compile stats per depth; the loop's are None above `loop_max_depth`."""
  return {
    "scan": [compile_stats(d, True) for d in depths],
    "loop": [compile_stats(d, False) if d <= loop_max_depth else None for d in depths],
  }


def main(argv: list[str]) -> None:
  del argv  # Unused.
  jax_logging.quiet()  # jax's INFO lines (the backends it could not start) left out.
  depths = [int(d) for d in _DEPTHS.value]
  print(
    f"Scan and loop agree at depth {depths[0]}: max |grad difference| "
    f"{check_same_model(depths[0]):.1e}"
  )
  table = compile_table(depths, _LOOP_MAX_DEPTH.value)
  print("\nTrace+compile of one training step (jax.jit(jax.grad(loss))):")
  print(
    f"  {'depth':>5s}  {'scan s':>7s} {'loop s':>7s}  {'scan eqns':>9s} "
    f"{'loop eqns':>9s}  {'scan temp B':>11s} {'loop temp B':>11s}"
  )
  for depth, s, unrolled in zip(depths, table["scan"], table["loop"]):
    loop = (
      (f"{unrolled['seconds']:7.2f}", f"{unrolled['eqns']:9d}", f"{unrolled['temp_bytes']:11.0f}")
      if unrolled
      else ("-".rjust(7), "-".rjust(9), "-".rjust(11))
    )
    print(
      f"  {depth:5d}  {s['seconds']:7.2f} {loop[0]}  {s['eqns']:9d} "
      f"{loop[1]}  {s['temp_bytes']:11.0f} {loop[2]}"
    )
  first, last = table["scan"][0], table["scan"][-1]
  print(
    f"\nScan: depth {depths[-1]} compiles in {last['seconds']:.2f}s, "
    f"{last['seconds'] / first['seconds']:.2f}x depth {depths[0]}; its "
    f"jaxpr has {last['eqns']} equations at every depth."
  )


if __name__ == "__main__":
  app.run(main)
