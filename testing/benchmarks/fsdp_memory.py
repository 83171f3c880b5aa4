r"""Per-device parameter bytes and step time: replicated, Megatron, FSDP + Megatron.

A transformer of Haiku's own modules (`hk.MultiHeadAttention`, `hk.nets.MLP`,
`hk.Embed`), its layers under `hkb.repeat_layer`, trained with SGD on 8 CPU
devices, a (data=2, model=4) mesh with Auto axes, batch over "data". Three
rule sets, side by side:

- replicated: every device holds every param (data parallelism);
- megatron: matrices split over "model" (heads, hidden units);
- fsdp_megatron: the rule set of docs/sharding.md, each matrix's other
  dimension over "data" too: 1/8 of every matrix per device, gathered one
  layer at a time inside the scan.
- fsdp_layers: Megatron, plus the stack's layer axis over "data".

For each it prints the bytes of params one device holds (from the arrays'
addressable shards), the compiled step's `memory_analysis()` (arguments,
temporaries), and the median step time. Timings on a shared CPU are noisy
and the collectives are memory copies here: compare them, never assert
them. Run from the repository root:

    PYTHONPATH=. python3 testing/benchmarks/fsdp_memory.py
"""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import time

import haiku as hk
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import haiku_bridge as hkb
from testing import transformer

VOCAB, D_MODEL, HEADS, SEQ, BATCH, LAYERS = 512, 256, 8, 32, 16, 8
STEPS = 10

FSDP_MEGATRON = transformer.RULES  # The rule set of docs/sharding.md.


def without_data(rules: hkb.ShardingRules, stacked) -> hkb.ShardingRules:
  return hkb.ShardingRules(
    [(pattern, P(*(None if e == "data" else e for e in spec))) for pattern, spec in rules.rules],
    stacked=stacked,
  )


RULE_SETS = {
  "replicated": hkb.ShardingRules([], stacked=["layers"]),
  "megatron": without_data(FSDP_MEGATRON, ["layers"]),
  "fsdp_megatron": FSDP_MEGATRON,
  "fsdp_layers": without_data(FSDP_MEGATRON, {"layers": "data"}),
}


def loss_fn(tokens):
  logits = transformer.transformer(tokens, vocab=VOCAB, d_model=D_MODEL, heads=HEADS, layers=LAYERS)
  targets = jax.nn.one_hot(jnp.roll(tokens, 1, axis=1), VOCAB)
  return -jnp.mean(jax.nn.log_softmax(logits) * targets)


def measure(name, rules, mesh, f, tokens):
  key = jax.random.PRNGKey(0)
  shardings = hkb.param_shardings(jax.eval_shape(f.init, key, tokens), mesh, rules)
  params = jax.jit(f.init, out_shardings=shardings)(key, tokens)
  data = NamedSharding(mesh, P("data"))

  def step(params, tokens):
    loss, grads = jax.value_and_grad(f.apply)(params, None, tokens)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), loss

  step = jax.jit(
    step, in_shardings=(shardings, data), out_shardings=(shardings, None), donate_argnums=0
  )
  tokens = jax.device_put(tokens, data)
  memory = step.lower(params, tokens).compile().memory_analysis()
  device = jax.devices()[0]
  held = sum(
    s.data.nbytes
    for leaf in jax.tree.leaves(params)
    for s in leaf.addressable_shards
    if s.device == device
  )
  params, loss = step(params, tokens)  # Compile and warm up.
  times = []
  for _ in range(STEPS):
    start = time.perf_counter()
    params, loss = step(params, tokens)
    loss.block_until_ready()
    times.append(time.perf_counter() - start)
  return dict(
    name=name,
    held=held,
    args=memory.argument_size_in_bytes,
    temp=memory.temp_size_in_bytes,
    ms=1e3 * np.median(times),
    loss=float(loss),
  )


def main():
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  f = hk.transform(loss_fn)
  tokens = jax.random.randint(jax.random.PRNGKey(1), [BATCH, SEQ], 0, VOCAB)
  total = sum(
    x.size * x.dtype.itemsize
    for x in jax.tree.leaves(jax.eval_shape(f.init, jax.random.PRNGKey(0), tokens))
  )
  print(
    f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} "
    f"devices, mesh {dict(mesh.shape)}; transformer d={D_MODEL}, "
    f"{LAYERS} layers, vocab {VOCAB}: {total / 2**20:.2f} MiB of params; "
    f"batch {BATCH}x{SEQ}; median of {STEPS} SGD steps\n"
  )
  header = (
    f"{'rules':15s} {'params/device':>14s} {'of all':>7s} "
    f"{'step args':>10s} {'step temp':>10s} {'step ms':>8s} "
    f"{'loss':>8s}"
  )
  print(header)
  for name, rules in RULE_SETS.items():
    r = measure(name, rules, mesh, f, tokens)
    print(
      f"{name:15s} {r['held'] / 2**20:11.3f} MiB {r['held'] / total:7.3f} "
      f"{r['args'] / 2**20:6.2f} MiB {r['temp'] / 2**20:6.2f} MiB "
      f"{r['ms']:8.1f} {r['loss']:8.5f}"
    )


if __name__ == "__main__":
  main()
