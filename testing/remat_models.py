"""The models `remat="auto"` is measured on: an LSTM unroll, readout RNNs, residual MLP, transformer and conv stacks.

Small widths, so a grid of them compiles in minutes; shared by
haiku_bridge/_src/remat/plan_test.py (predictions against compiled memory)
and testing/benchmarks/lib/remat_auto_bench.py (the Pareto plot). Each takes
the loop's remat keywords and returns the transformed net and its input.
`plans_made` records the plans `remat="auto"` makes (`hkb.remat_plans`; remat/plan_test,
pipeline_test); `step_cost` compiles a training step and measures it.
"""

import functools
from typing import Any, Callable, NamedTuple
from unittest import mock

import haiku as hk
import jax
import jax.numpy as jnp

import haiku_bridge as hkb
from haiku_bridge._src.remat import hlo_flops
from haiku_bridge._src.remat import loop as loop_lib
from haiku_bridge._src.remat import schedule as remat_schedule
from testing import transformer as transformer_lib

BATCH, HIDDEN, INPUTS = 4, 32, 8
WIDTH = 64
CHANNELS = 16


# The plans `remat="auto"` makes while a block runs, in order (the public
# `hkb.remat_plans`; the logging it mirrors: `VisibleTest`).
plans_made = hkb.remat_plans


class StepCost(NamedTuple):
  """A compiled training step's bytes as `memory_budget` counts them (`hlo_flops.held`) and its FLOPs (`hlo_flops`)."""

  held: hlo_flops.Held
  flops: int

  @property
  def temporaries(self) -> int:
    return self.held.temporaries

  @property
  def constants(self) -> int:
    """A schedule's tables, compiled in."""
    return self.held.constants

  @property
  def bytes(self) -> int:
    """What `memory_budget` counts: temporaries and constants."""
    return self.held.bytes


def step_cost(model, params, x, length: int, **remat) -> StepCost:
  """What a training step (`value_and_grad`) of `model` run with `remat` costs, compiled.

  Each conditional of these models is a remat schedule's, in the backward
  sweep of `scheduled_scan`: its dearest branch backpropagates a step, and
  runs once per step of the `length`; the others advance a carry.
  """
  net, _ = model(**remat)
  step = jax.value_and_grad(lambda p, x: net.apply(p, None, x))
  compiled = jax.jit(step).lower(params, x).compile()
  text = compiled.as_text()
  return StepCost(hlo_flops.held(compiled, text), step_flops(text, length))


def binomial_cost(model, params, x, length: int, slots: int) -> StepCost:
  """`step_cost` of `model` run with `remat="binomial"` keeping `slots` slots (not the default count)."""
  with mock.patch.object(
    loop_lib, "schedule", lambda *_, **__: remat_schedule.binomial(length, slots)
  ):
    return step_cost(model, params, x, length, remat="binomial")


def step_flops(text: str, length: int) -> int:
  """The FLOPs of a compiled training step (`hlo_flops`), a schedule's conditionals as `step_cost` says."""
  count = hlo_flops.count(text)
  if count.unknown_trip_counts:
    raise ValueError(f"A loop without a known trip count: {count}")
  return count.flops + sum(length * (max(c.branches) - min(c.branches)) for c in count.conditionals)


def lstm(length: int, loss_in_step: bool, **remat):
  """An LSTM over `length` steps, the loss after the unroll or in the step."""

  def f(xs):
    core = hk.LSTM(HIDDEN)
    state = core.initial_state(BATCH)
    if loss_in_step:
      losses, _ = hkb.dynamic_unroll(core, xs, state, readout=lambda y: jnp.sum(y**2), **remat)
      return jnp.sum(losses)
    ys, _ = hkb.dynamic_unroll(core, xs, state, **remat)
    return jnp.sum(ys**2)

  return hk.transform(f), jnp.ones([length, BATCH, INPUTS])


def readout(core: Callable[[], Any], length: int, batch: int = BATCH, **remat):
  """`core()`, an RNN core, over `length` steps, the loss computed in the step from its outputs (`readout=`)."""

  def f(xs):
    rnn = core()
    losses, _ = hkb.dynamic_unroll(
      rnn, xs, rnn.initial_state(batch), readout=lambda y: jnp.sum(y**2), **remat
    )
    return jnp.sum(losses)

  return hk.transform(f), jnp.ones([length, batch, INPUTS])


# Readout models (issue 61): carries of a few hundred bytes over a few
# hundred steps, where a schedule's tables are a fifth of its bytes. Each:
# (model, T), T where the default binomial's every advance runs one step
# (C(s + 2, 2) = T: 300 = C(25, 2), 190 = C(20, 2)), its tables a column
# short.
READOUT_MODELS = {
  "lstm_24": (functools.partial(readout, lambda: hk.LSTM(24), 300), 300),
  "deep_rnn": (
    functools.partial(readout, lambda: hk.DeepRNN([hk.LSTM(16), hk.LSTM(16)]), 190, batch=2),
    190,
  ),
}


def mlp(depth: int, **remat):
  """A residual MLP stack of `depth` layers."""

  def f(x):
    def block(h):
      return h + hk.nets.MLP([4 * WIDTH, WIDTH])(h)

    return jnp.sum(hkb.repeat_layer(block, x, depth, **remat) ** 2)

  return hk.transform(f), jnp.ones([8, WIDTH])


def transformer(depth: int, **remat):
  """A pre-norm transformer stack of `depth` blocks (attention and MLP)."""

  def f(x):
    block = functools.partial(transformer_lib.block, d_model=32, heads=4)
    return jnp.sum(hkb.repeat_layer(block, x, depth, **remat) ** 2)

  return hk.transform(f), jnp.ones([2, 16, 32])


def conv(depth: int, channels: int = CHANNELS, width: int = 32, batch: int = 2, **remat):
  """A residual stack of `depth` Conv1D blocks (two convolutions each)."""

  def f(x):
    def block(h):
      y = jax.nn.relu(hk.Conv1D(channels, 3, name="conv_0")(h))
      return h + hk.Conv1D(channels, 3, name="conv_1")(y)

    return jnp.sum(hkb.repeat_layer(block, x, depth, **remat) ** 2)

  return hk.transform(f), jnp.ones([batch, width, channels])


def language_model(depth: int, d_model: int, seq: int, batch: int, vocab: int = 256, **remat):
  """A transformer language model: embedding, `depth` blocks, logits, cross-entropy."""

  def f(tokens):
    block = functools.partial(transformer_lib.block, d_model=d_model, heads=4)
    h = hk.Embed(vocab, d_model)(tokens)
    h = hkb.repeat_layer(block, h, depth, **remat)
    logits = hk.Linear(vocab)(h)
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  return hk.transform(f), jnp.zeros([batch, seq], jnp.int32)


def char_gru(length: int, hidden: int = 256, batch: int = 8, vocab: int = 64, **remat):
  """A character GRU over `length` steps: embedding, GRU, logits, cross-entropy."""

  def f(tokens):
    core = hk.GRU(hidden)
    xs = hk.Embed(vocab, 32)(tokens)
    ys, _ = hkb.dynamic_unroll(core, xs, core.initial_state(batch), **remat)
    logits = hk.Linear(vocab)(ys)
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  return hk.transform(f), jnp.zeros([length, batch], jnp.int32)


def models(
  lstm_lengths, mlp_depths, transformer_depths, conv_depths=()
) -> dict[str, Callable[..., Any]]:
  """The models by name: `lstm_{T}_loss_after`, `lstm_{T}_loss_in_step`,
  `mlp_depth_{D}`, `transformer_depth_{D}` and `conv_depth_{D}`."""
  out = {}
  for t in lstm_lengths:
    for where in ("after", "in_step"):
      out[f"lstm_{t}_loss_{where}"] = functools.partial(lstm, t, where == "in_step")
  for d in mlp_depths:
    out[f"mlp_depth_{d}"] = functools.partial(mlp, d)
  for d in transformer_depths:
    out[f"transformer_depth_{d}"] = functools.partial(transformer, d)
  for d in conv_depths:
    out[f"conv_depth_{d}"] = functools.partial(conv, d)
  return out
