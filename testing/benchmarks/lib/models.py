"""The benchmarks' models: one MLP four ways, one residual stack three ways.

Only the public API: `import haiku_bridge as hkb`.
"""

import functools
import math
from typing import Any, Callable, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp

import haiku_bridge as hkb

KEY = jax.random.PRNGKey(0)  # The init key of every model.

# The MLP variants.
INLINE = "inline"
BRIDGED_TRANSFORMED = "call_pure(hk.transform)"
BRIDGED_PURE = "call_pure(pure fn)"
LIFT = "hk.lift"
MLP_VARIANTS = (INLINE, BRIDGED_TRANSFORMED, BRIDGED_PURE, LIFT)
BRIDGED = (BRIDGED_TRANSFORMED, BRIDGED_PURE)
# A/A control: a second, separately built copy of the baseline, timed like the
# others. Its ratio to the baseline is what the method reports for two equal
# programs on this machine: the noise floor of the ratios.
INLINE_COPY = "inline (A/A copy)"

# The stack variants.
SCAN = "layer_scan"
LAYER_STACK = "hk.layer_stack"
LOOP = "loop"
STACK_VARIANTS = (SCAN, LAYER_STACK, LOOP)
LAYER_STACK_COPY = "hk.layer_stack (A/A copy)"


def clear_caches() -> None:
  """`hkb.clear_caches()` where the library has it; else nothing to clear."""
  getattr(hkb, "clear_caches", lambda: None)()


class MlpSize(NamedTuple):
  name: str
  width: int
  depth: int
  batch: int


def pure_mlp_init(
  rng: jax.Array, x: jax.Array, *, widths: tuple[int, ...]
) -> list[dict[str, jax.Array]]:
  """Params of `pure_mlp`, drawn as `hk.Linear` draws them."""
  params, fan_in = [], x.shape[-1]
  for width in widths:
    rng, key = jax.random.split(rng)
    w = jax.random.truncated_normal(key, -2.0, 2.0, (fan_in, width), x.dtype)
    params.append({"w": w / math.sqrt(fan_in), "b": jnp.zeros([width], x.dtype)})
    fan_in = width
  return params


def pure_mlp(
  params: list[dict[str, jax.Array]], x: jax.Array, *, widths: tuple[int, ...]
) -> jax.Array:
  """`hk.nets.MLP` in plain JAX, op for op (so the jaxprs can be compared)."""
  del widths  # Only init needs them.
  for i, p in enumerate(params):
    out = jnp.dot(x, p["w"])
    x = out + jnp.broadcast_to(p["b"], out.shape)
    if i < len(params) - 1:
      x = jax.nn.relu(x)
  return x


class MlpModels(NamedTuple):
  """One MLP, built afresh, in every variant."""

  transformed: dict[str, hk.Transformed]  # By variant (MLP_VARIANTS).
  inner_init: Callable[..., Any]  # call_pure(hk.transform) shapes it at apply.
  pure_init: Callable[..., Any]  # What call_pure(pure fn) shapes at apply.


def mlp_models(size: MlpSize) -> MlpModels:
  """New model objects at each call: no cache keyed on a model can hit."""
  widths = (size.width,) * size.depth

  def mlp(x):
    return hk.nets.MLP(widths, name="mlp")(x)

  inner = hk.transform(mlp)  # Built once, as a user would at module level.
  pure_init = functools.partial(pure_mlp_init, widths=widths)

  def bridged_transformed(x):
    return hkb.call_pure(inner, x)

  def bridged_pure(x):
    return hkb.call_pure(pure_mlp, x, init=pure_init, name="mlp", widths=widths)

  def lifted(x):
    params = hk.lift(inner.init, name="lifted")(hk.maybe_next_rng_key(), x)
    return inner.apply(params, None, x)

  return MlpModels(
    transformed={
      INLINE: hk.transform(mlp),
      BRIDGED_TRANSFORMED: hk.transform(bridged_transformed),
      BRIDGED_PURE: hk.transform(bridged_pure),
      LIFT: hk.transform(lifted),
    },
    inner_init=inner.init,
    pure_init=pure_init,
  )


def mlp_model(size: MlpSize, variant: str) -> hk.Transformed:
  """A new model object of one variant; INLINE_COPY is another inline one."""
  return mlp_models(size).transformed[INLINE if variant == INLINE_COPY else variant]


def stack_model(variant: str, depth: int, remat: bool | str, width: int) -> hk.Transformed:
  """A residual MLP block repeated `depth` times, three ways.

  `remat` is `hkb.repeat_layer`'s; the other variants take a bool (`True`:
  `hk.remat` of the block).
  """
  if variant != SCAN and not isinstance(remat, bool):
    raise ValueError(f"{variant} has no remat={remat!r}; only {SCAN} has.")

  def block(x):
    return x + hk.nets.MLP([width, width], name="mlp")(x)

  def layer_scan(x):
    return hkb.repeat_layer(block, x, depth, remat=remat)

  def layer_stack(x):
    layer = hk.remat(block) if remat else block  # hk.remat needs a transform.
    return hk.layer_stack(depth)(layer)(x)

  def loop(x):
    layer = hk.remat(block) if remat else block
    for i in range(depth):
      with hk.name_scope(f"layer_{i}"):
        x = layer(x)
    return x

  return hk.transform({SCAN: layer_scan, LAYER_STACK: layer_stack, LOOP: loop}[variant])


def grad_step(transformed: hk.Transformed) -> Callable[..., Any]:
  """Forward + backward of a scalar loss of `apply`: what training compiles."""

  def loss(params, x):
    return jnp.mean(jnp.square(transformed.apply(params, None, x)))

  return jax.grad(loss)


def apply_without_rng(transformed: hk.Transformed) -> Callable[..., Any]:
  """`apply(params, x)`: the models draw no random numbers at apply."""
  return lambda params, x: transformed.apply(params, None, x)
