"""A small transformer of Haiku's own modules, and its FSDP + tensor-parallel rules.

The rule set is the one docs/sharding.md documents: every matrix split over
"model" (Megatron: heads and hidden units) and its other dimension over "data"
(FSDP: each of 8 devices stores 1/8 of it). Layer norms and the biases after a
row split are small and replicated. Shared by sharding_test.py, layer_scan_test.py
and the benchmarks testing/benchmarks/fsdp_memory.py and
testing/bench/remat_bench.py (which stacks `block` with `hk.layer_stack`).
"""

import functools
from typing import Optional

import haiku as hk
import jax
from jax.sharding import PartitionSpec as P

import haiku_bridge as hkb

RULES = hkb.ShardingRules(
  [
    (r"attention/(query|key|value)/w$", P("data", "model")),
    (r"attention/(query|key|value)/b$", P("model")),
    (r"attention/linear/w$", P("model", "data")),
    (r"mlp/~/linear_0/w$", P("data", "model")),
    (r"mlp/~/linear_0/b$", P("model")),
    (r"mlp/~/linear_1/w$", P("model", "data")),
    (r"embed/embeddings$", P("model", "data")),
    (r"unembed/w$", P("data", "model")),
  ],
  stacked=["layers"],
)


def block(h: jax.Array, *, d_model: int, heads: int) -> jax.Array:
  """One pre-norm block: self-attention, then an MLP, each residual."""
  ln = lambda name: hk.LayerNorm(-1, True, True, name=name)
  attention = hk.MultiHeadAttention(
    heads, d_model // heads, w_init=hk.initializers.VarianceScaling(), name="attention"
  )
  x = ln("ln_1")(h)
  h = h + attention(x, x, x)
  return h + hk.nets.MLP([4 * d_model, d_model], name="mlp")(ln("ln_2")(h))


def transformer(
  tokens: jax.Array,
  *,
  vocab: int,
  d_model: int,
  heads: int,
  layers: int,
  remat: bool | str = False,
  pipeline: Optional[hkb.Pipeline] = None,
) -> jax.Array:
  """Logits of a pre-norm transformer whose blocks run under `hkb.repeat_layer`.

  `remat` and `pipeline` are `hkb.repeat_layer`'s: what the backward pass
  recomputes, and the stages the blocks run as.
  """
  layer = functools.partial(block, d_model=d_model, heads=heads)
  h = hk.Embed(vocab, d_model, name="embed")(tokens)
  h = hkb.repeat_layer(layer, h, layers, name="layers", remat=remat, pipeline=pipeline)
  return hk.Linear(vocab, name="unembed")(h)
