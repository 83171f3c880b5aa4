"""`stacked_init`: the init of one layer, made the init of a stack of them.

Each layer's init gets the key that the same layer's init gets in
`hk.layer_stack`: the first one drawn from that layer's rng sequence, whose
key is drawn as `hk.layer_stack` draws them (`layer_keys`). So a stack
initialised here has the values a Haiku layer stack of the same layer would
have (and `repeat_layer` with the same `init`).
"""

import dataclasses
from typing import Any, Optional, Sequence

import haiku as hk
import jax
import numpy as np

from haiku_bridge._src import errors
from haiku_bridge._src.pytree import InitFn


def layer_keys(rng: Optional[jax.Array], num_layers: int) -> Optional[jax.Array]:
  """`num_layers` independent init keys from one key, as `hk.layer_stack` makes them."""
  if rng is None:
    return None

  def step(key, _):
    key, next_key, _ = jax.random.split(key, 3)
    return next_key, key

  return jax.lax.scan(step, rng, None, length=num_layers)[1]


def stacked_init(
  init: InitFn, num_layers: int, in_axes: Optional[Sequence[Optional[int]]] = None
) -> InitFn:
  """Stacks `num_layers` independent inits of `init` along a new leading axis.

  Usable as the `init` of `call_pure`, for a `jax.lax.scan` body of your own.
  Example: 8 dense layers in plain JAX, scanned, their weights Haiku params:

  >>> def dense(p, h):
  ...   return jnp.tanh(h @ p["w"] + p["b"])
  >>> def init_dense(rng, h):
  ...   return {"w": jax.random.normal(rng, [16, 16]) / 4, "b": jnp.zeros([16])}
  >>> def stack(params, x):
  ...   return jax.lax.scan(lambda h, p: (dense(p, h), None), x, params)[0]
  >>> net = hk.transform(
  ...     lambda x: hkb.call_pure(stack, x, name="stack",
  ...                             init=hkb.stacked_init(init_dense, 8)))
  >>> params = net.init(jax.random.PRNGKey(0), jnp.ones([2, 16]))
  >>> jax.tree.map(jnp.shape, params)
  {'stack': {'b': (8, 16), 'w': (8, 16, 16)}}
  >>> net.apply(params, None, jnp.ones([2, 16])).shape
  (2, 16)

  Args:
    init: `init(rng, *args, **kwargs) -> params` for one layer.
    num_layers: how many layers.
    in_axes: for each positional argument, the axis holding per-layer values,
      or None to give every layer the whole argument (the default for all).

  Returns:
    `init_stack(rng, *args, **kwargs)`: params whose every leaf has a leading
    axis of size `num_layers`; layer `i` is `init(key_i, ...)` with its own key.
    With `rng=None`, each layer's `init` gets None.
  """
  with errors.entry("stacked_init"):
    errors.check_callable(
      "init", init, "a function `init(rng, *args, **kwargs) -> params` for one layer"
    )
    num_layers = errors.check_positive_int("num_layers", num_layers)
    return _StackedInit(init, num_layers, _check_in_axes(in_axes))


_IN_AXES = (
  "None, or a sequence with one entry per positional argument of "
  "`init`: the axis of its per-layer values (an int), or None to "
  "give every layer all of it"
)


def _check_in_axes(in_axes: Any) -> Optional[tuple[Optional[int], ...]]:
  if in_axes is None:
    return None
  if (
    isinstance(in_axes, (str, bytes))
    or not isinstance(in_axes, Sequence)
    or not all(a is None or errors.is_int(a) for a in in_axes)
  ):
    raise TypeError(
      errors.bad_argument(
        "in_axes",
        in_axes,
        _IN_AXES,
        f"For one argument split on axis {in_axes!r}, write in_axes=({in_axes!r},)."
        if errors.is_int(in_axes)
        else "",
      )
    )
  return tuple(None if a is None else int(a) for a in in_axes)


@dataclasses.dataclass(frozen=True)
class _StackedInit:
  """`stacked_init`'s result: equal for equal inputs, so shape caches hit."""

  init: InitFn
  num_layers: int
  in_axes: Optional[tuple[Optional[int], ...]]

  def __call__(self, rng, *args, **kwargs):
    axes = self.in_axes if self.in_axes is not None else (None,) * len(args)
    with errors.entry("stacked_init"):
      self._check_args(axes, args)
    keys = layer_keys(rng, self.num_layers)

    def one_layer(key, *a):
      # A Haiku layer's init draws the first key of its rng sequence.
      key = None if key is None else hk.PRNGSequence(key).next()
      return self.init(key, *a, **kwargs)

    return jax.vmap(
      one_layer, in_axes=(None if keys is None else 0,) + axes, axis_size=self.num_layers
    )(keys, *args)

  def _check_args(self, axes, args) -> None:
    """`in_axes` against the arguments the init is called with."""
    if len(axes) != len(args):
      raise ValueError(
        errors.message(
          f"`in_axes` has {len(axes)} entries, {axes}, but the stacked init "
          f"was called with {len(args)} positional arguments after the rng; "
          "give one entry per argument (None to give every layer all of "
          "it)."
        )
      )
    for i, (axis, arg) in enumerate(zip(axes, args)):
      if axis is None:
        continue
      for path, leaf in jax.tree_util.tree_leaves_with_path(arg):
        shape = np.shape(leaf)
        in_range = -len(shape) <= axis < len(shape)
        if not in_range or shape[axis] != self.num_layers:
          raise ValueError(
            errors.message(
              f"`in_axes[{i}]` is {axis}, so argument {i} holds per-layer "
              f"values on axis {axis}; but at {errors.keystr(path)} it has "
              f"shape {shape}, where that axis should have size "
              f"num_layers={self.num_layers}."
            )
          )
