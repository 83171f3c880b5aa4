"""Stacked params to and from the per-layer names of an unrolled loop.

A layer scan (`hkb.layer_scan`, `hk.layer_stack`) stores each param once,
with a leading layer axis, under `<stack>/<inner bundle>`; the same layers
written as a Python loop store one bundle per layer, `layer_{i}/<inner
bundle>`. `unstack_params` and `stack_params` move a checkpoint between the
two, so a model can change how it runs its layers and keep its weights.
"""

import re
import string
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import errors
from haiku_bridge._src.pytree import PyTree


def _loop_bundle(layer_scope: str, i: int, inner: str) -> str:
  scope = layer_scope.format(i=i)
  return scope if inner == "~" else f"{scope}/{inner}"


def unstack_params(
  params: PyTree, *, stack: str, num_layers: int, layer_scope: str = "layer_{i}"
) -> PyTree:
  """Stacked params (a layer scan's) to the per-layer names of a loop.

  For a loop that runs layer `i` under `hk.name_scope(f"layer_{i}")`, stack
  bundle `<stack>/linear` becomes `layer_0/linear`, `layer_1/linear`, ...; the
  layer's own top-level params (`<stack>/~`) go to `layer_i` itself. Example:
  a scanned stack's params, run by the same 4 layers written as a loop:

  >>> def scanned(x):
  ...   with hk.name_scope("net"):
  ...     return hkb.repeat_layer(lambda h: jnp.tanh(hk.Linear(16)(h)), x, 4)
  >>> def looped(x):
  ...   with hk.name_scope("net"):
  ...     for i in range(4):
  ...       with hk.name_scope(f"layer_{i}"):
  ...         x = jnp.tanh(hk.Linear(16)(x))
  ...   return x
  >>> scanned, looped = hk.transform(scanned), hk.transform(looped)
  >>> x = jnp.ones([2, 16])
  >>> params = scanned.init(jax.random.PRNGKey(0), x)
  >>> sorted(params)
  ['net/__layer_stack_no_per_layer/linear']
  >>> loop_params = hkb.unstack_params(params, num_layers=4,
  ...                                  stack="net/__layer_stack_no_per_layer",
  ...                                  layer_scope="net/layer_{i}")
  >>> sorted(loop_params)
  ['net/layer_0/linear', 'net/layer_1/linear', 'net/layer_2/linear',
   'net/layer_3/linear']
  >>> np.allclose(looped.apply(loop_params, None, x),
  ...             scanned.apply(params, None, x), atol=1e-6)
  True

  Args:
    params: params holding a stack under `stack`; others are kept as they are.
    stack: the stack's full bundle prefix, e.g. `"net/encoder"`.
    num_layers: the number of layers.
    layer_scope: the full name scope of layer `i` in the loop, with `{i}`.

  Returns:
    The params with the stack split into per-layer bundles.
  """
  with errors.entry("unstack_params"):
    num_layers = _check_conversion(params, stack, num_layers, layer_scope)
    out = {
      bundle: dict(entries)
      for bundle, entries in params.items()
      if _inner_bundle(stack, bundle) is None
    }
    stacked = {bundle: entries for bundle, entries in params.items() if bundle not in out}
    if params and not stacked:
      raise ValueError(
        errors.message(
          f"no params under stack {stack!r}. Its bundles start with "
          f"'{stack}/'; the params have {sorted(params)[:8]}."
        )
      )
    for bundle, entries in stacked.items():
      inner = _inner_bundle(stack, bundle)
      assert inner is not None, "a stacked bundle has a bundle inside"
      for key, value in entries.items():
        if value.shape[:1] != (num_layers,):
          raise ValueError(
            errors.message(
              f"{bundle}/{key} has shape {tuple(value.shape)}, not a leading "
              f"layer axis of {num_layers}."
            )
          )
      for i in range(num_layers):
        loop_bundle = _loop_bundle(layer_scope, i, inner)
        if loop_bundle in params:
          raise ValueError(
            errors.message(
              f"layer {i} of {bundle!r} goes to {loop_bundle!r} by "
              f"layer_scope {layer_scope!r}, but the params already have a "
              f"bundle {loop_bundle!r}. Pass the loop's own layer_scope."
            )
          )
        loop = out.setdefault(loop_bundle, {})
        for key, value in entries.items():
          loop[key] = value[i]
  return out


def stack_params(
  params: PyTree, *, stack: str, num_layers: int, layer_scope: str = "layer_{i}"
) -> PyTree:
  """The inverse of `unstack_params`: loop params to a layer scan's.

  Example: a loop's checkpoint, run by the same 3 layers under `repeat_layer`
  (at top level, so `layer_scope` is the default `"layer_{i}"`):

  >>> def looped(x):
  ...   for i in range(3):
  ...     with hk.name_scope(f"layer_{i}"):
  ...       x = jnp.tanh(hk.Linear(16)(x))
  ...   return x
  >>> looped = hk.transform(looped)
  >>> scanned = hk.transform(
  ...     lambda x: hkb.repeat_layer(lambda h: jnp.tanh(hk.Linear(16)(h)), x, 3))
  >>> x = jnp.ones([2, 16])
  >>> loop_params = looped.init(jax.random.PRNGKey(0), x)
  >>> params = hkb.stack_params(loop_params, num_layers=3,
  ...                           stack="__layer_stack_no_per_layer")
  >>> jax.tree.map(jnp.shape, params)
  {'__layer_stack_no_per_layer/linear': {'b': (3, 16), 'w': (3, 16, 16)}}
  >>> np.allclose(scanned.apply(params, None, x),
  ...             looped.apply(loop_params, None, x), atol=1e-6)
  True

  Args:
    params: loop params holding `num_layers` bundles `layer_scope`, one
      per layer; others are kept as they are.
    stack: the stack's full bundle prefix to write, e.g. `"net/encoder"`.
    num_layers: the number of layers.
    layer_scope: the loop's per-layer scope, with `{i}` for the index.

  Returns:
    `params` with the layers' params stacked under `stack`.
  """
  with errors.entry("stack_params"):
    num_layers = _check_conversion(params, stack, num_layers, layer_scope)
    pattern = re.compile(
      "^"
      + re.escape(layer_scope).replace(re.escape("{i}"), r"(?P<i>\d+)")
      + r"(?:/(?P<inner>.+))?$"
    )
    per_layer: dict[str, dict[str, list[Any]]] = {}
    out = {}
    for bundle, entries in params.items():
      match = pattern.match(bundle)
      if match is None:
        out[bundle] = dict(entries)
        continue
      if int(match["i"]) >= num_layers:
        raise ValueError(
          errors.message(
            f"{bundle!r} is layer {match['i']} by {layer_scope!r}, but "
            f"num_layers={num_layers}. Pass the number of layers the loop "
            "has."
          )
        )
      stacked_bundle = f"{stack}/{match['inner'] or '~'}"
      for key, value in entries.items():
        slots = per_layer.setdefault(stacked_bundle, {}).setdefault(key, [None] * num_layers)
        slots[int(match["i"])] = value
    if params and not per_layer:
      raise ValueError(
        errors.message(
          f"no bundle is a layer by layer_scope {layer_scope!r} (layer 0 "
          f"would be {layer_scope.format(i=0)!r} or start with "
          f"'{layer_scope.format(i=0)}/'); the params have "
          f"{sorted(params)[:8]}. Pass the full name scope of layer i in the "
          "loop."
        )
      )
    for bundle, entries in per_layer.items():
      if bundle in out:
        raise ValueError(
          errors.message(
            f"the layers stack into {bundle!r}, but the params already have "
            f"a bundle {bundle!r}. Pass another `stack`."
          )
        )
      for key, values in entries.items():
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
          raise ValueError(
            errors.message(
              f"{bundle}/{key} is missing for layers {missing} (looked for "
              f"{layer_scope!r} bundles)."
            )
          )
        shapes = [tuple(np.shape(v)) for v in values]
        if len(set(shapes)) > 1:
          i = next(i for i, shape in enumerate(shapes) if shape != shapes[0])
          raise ValueError(
            errors.message(
              f"{bundle}/{key} has shape {shapes[0]} in layer 0 but "
              f"{shapes[i]} in layer {i}; only layers of one shape stack."
            )
          )
        out.setdefault(bundle, {})[key] = jnp.stack(values)
  return out


def _check_conversion(params: Any, stack: Any, num_layers: Any, layer_scope: Any) -> int:
  """The arguments of `unstack_params` / `stack_params`; returns num_layers."""
  _check_params_dict(params)
  errors.check_str(
    "stack",
    stack,
    "the stack's full bundle prefix, a string such as "
    "'net/__layer_stack_no_per_layer' (no trailing '/')",
  )
  if stack.endswith("/"):
    raise ValueError(
      errors.bad_argument("stack", stack, "the stack's full bundle prefix, without a trailing '/'")
    )
  errors.check_str("layer_scope", layer_scope, "a string such as 'layer_{i}' or 'net/block_{i}'")
  try:
    fields = [
      field for _, field, _, _ in string.Formatter().parse(layer_scope) if field is not None
    ]
  except ValueError:
    fields = None
  if fields != ["i"]:
    raise ValueError(
      errors.bad_argument(
        "layer_scope",
        layer_scope,
        "the full name scope of layer i in the "
        "loop, with `{i}` once where the layer's number goes, e.g. "
        "'layer_{i}' or 'net/block_{i}'",
        "Without `{i}` every layer would get one name.",
      )
    )
  return errors.check_positive_int("num_layers", num_layers)


def _check_params_dict(params: Any) -> None:
  wants = "a Haiku params dict {bundle: {name: array}}, as `f.init` returns"
  if not isinstance(params, Mapping):
    raise TypeError(errors.bad_argument("params", params, wants))
  for bundle, entries in params.items():
    if not isinstance(bundle, str) or not isinstance(entries, Mapping):
      raise TypeError(
        errors.message(f"`params` must be {wants}; at {bundle!r} it holds {errors.got(entries)}.")
      )
    for name, value in entries.items():
      if not isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(
          errors.message(
            f"`params` must be {wants}; at {bundle}/{name} it holds {errors.got(value)}."
          )
        )


def _inner_bundle(stack: str, bundle: str) -> Optional[str]:
  if bundle.startswith(stack + "/"):
    return bundle[len(stack) + 1 :]
  return None
