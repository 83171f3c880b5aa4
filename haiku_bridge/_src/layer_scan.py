"""Scan over a stack of layers with explicit, stacked parameters.

A deep network repeats one block N times. Written as a Python loop, tracing
and compiling grow with N. `layer_scan` runs the block under `jax.lax.scan`
over parameters stacked along a leading layer axis, so they are traced once.
Because the bridge makes the parameters explicit, the layer may be any Haiku
function (or `hk.Transformed`) or any explicit-params function with its init
(a `jax.custom_vjp`, foreign code), and the scan may be rematerialised.

Names and shapes are those of `hk.layer_stack` for the same layer (params
under `<scope>/<name>/<inner module>`, each with a leading layer axis), and
keys are drawn as `hk.layer_stack` draws them, so checkpoints and outputs move
between the two (`unrolled_names.py` converts to and from the per-layer
names of an unrolled loop). What the backward pass keeps (`remat=`) is the
loop's (`remat/loop.py`); with `pipeline=` the layers run as pipeline stages
(the package `pipeline/`), each stage's layers through the same loop.
"""

import dataclasses
import inspect
from typing import Any, Callable, Mapping, NamedTuple, Optional, TypedDict, Unpack

import haiku as hk
import jax

from haiku_bridge._src import call_pure as call_pure_lib
from haiku_bridge._src import errors
from haiku_bridge._src import guards
from haiku_bridge._src import haiku_internals
from haiku_bridge._src import inline
from haiku_bridge._src import modes
from haiku_bridge._src import pipeline as pipeline_lib
from haiku_bridge._src import remat as remat_lib
from haiku_bridge._src.pytree import PyTree
from haiku_bridge._src.pytree import InitFn


# The names hk.layer_stack gives its stack when not given one.
NO_PER_LAYER_NAME = haiku_internals.LAYER_STACK_NAMES[False]
WITH_PER_LAYER_NAME = haiku_internals.LAYER_STACK_NAMES[True]


@remat_lib.plannable
def layer_scan(
  layer: Callable[..., Any] | hk.Transformed | hk.TransformedWithState,
  carry: PyTree,
  xs: PyTree = None,
  *,
  num_layers: Optional[int] = None,
  init: Optional[InitFn] = None,
  name: Optional[str] = None,
  remat: modes.RematMode = False,
  remat_policy: Optional[Callable[..., bool]] = None,
  remat_groups: Optional[int] = None,
  unroll: int | bool = 1,
  reverse: bool = False,
  pipeline: Optional[pipeline_lib.Pipeline] = None,
  memory_budget: Optional[int] = None,
  max_recompute: Optional[float] = None,
) -> tuple[PyTree, PyTree]:
  """Runs a stack of layers with `jax.lax.scan`, each with its own weights.

  The layer follows `jax.lax.scan`'s convention, `layer(carry, x) -> (carry,
  y)`, where `x` is the layer's slice of `xs` (None without `xs`) and the `y`s
  come back stacked. Example, 12 residual blocks traced once:

  >>> def block(h, _):
  ...   return h + hk.nets.MLP([64, h.shape[-1]])(h), None
  >>> def net(h):
  ...   return hkb.layer_scan(block, h, num_layers=12, remat=True)[0]
  >>> net = hk.transform(net)
  >>> params = net.init(jax.random.PRNGKey(0), jnp.ones([2, 16]))
  >>> params["__layer_stack_no_per_layer/mlp/~/linear_0"]["w"].shape
  (12, 16, 64)

  With `remat="nested"`, a training step keeps ≈2√N carries instead of one
  per layer, for the same params, outputs and gradients as `remat=True`:

  >>> nested = hk.transform(lambda h: hkb.layer_scan(
  ...     block, h, num_layers=12, remat="nested")[0])
  >>> def grads(f):
  ...   x = jnp.ones([2, 16])
  ...   return jax.grad(lambda p: jnp.sum(f.apply(p, None, x) ** 2))(params)
  >>> jax.tree.all(jax.tree.map(jnp.allclose, grads(nested), grads(net)))
  True

  It runs as `hk.layer_stack` runs the same layer: the same names, stacked
  shapes, initial values for the same key (each layer's init sees the carry
  the layer before it returns), rng keys, state, and what custom getters and
  creators see (each layer's own params). At apply nothing is initialised:
  eval-mode flags, new shapes and a process where init never ran all work.

  Args:
    layer: a Haiku function or `hk.Transformed(WithState)` called as
      `layer(carry, x)`; or, with `init=`, a pure function
      `layer(params, carry, x) -> (carry, y)`, which runs as the Haiku layer
      `hkb.call_pure(layer, carry, x, init=init)`. Haiku state is stacked per
      layer and written back after the scan; each layer gets its own rng.
    carry: the input of the first layer.
    xs: optional per-layer inputs, each leaf with a leading axis of size
      `num_layers`.
    num_layers: the number of layers; taken from `xs` when not given.
    init: for a pure `layer`, `init(rng, carry, x) -> params` of one layer.
    name: the name of the stack's module (default: `hk.layer_stack`'s),
      numbered as Haiku numbers modules when used again.
    remat: what the backward pass keeps and recomputes, trading compute for
      memory: `False`, `True`, `"nested"` or `"binomial"`. `True`:
      recompute each layer's activations from its carry, keeping one carry
      per layer (`jax.checkpoint` on the scan body, as `hk.layer_stack` of
      `hk.remat(layer)`). `"nested"`: keep ≈2√N carries
      for N layers: the layers in ≈√N groups, the backward pass recomputes
      one group's carries at a time from the group's first one, then each
      layer's activations (one more forward pass in all). `"binomial"`:
      the fewest carries that recompute at most one more forward pass
      (treeverse at Griewank's binomial bound). The schedules give the same values
      and derivatives as `True`. They shape reverse-mode autodiff
      (`jax.grad`, `jax.vjp`); forward mode (`jax.jvp`, `jax.jacfwd`,
      `jax.linearize` from jax 0.9) keeps nothing to schedule and runs as
      `True`, when it is applied to the function that calls the scan (not
      through a `jax.jit` inside it, nor `jax.linearize` on jax < 0.9, whose
      trace looks like a VJP's: there forward mode raises an error naming
      `remat`; see `scheduled_scan.py`).
    remat_policy: a `jax.checkpoint_policies` policy, with `remat=True`;
      with `remat="auto"`, `remat=True` under it is one more candidate.
    remat_groups: with `remat="nested"`, the number of groups, a positive
      int (default ≈√N; the last group takes what remains); with
      `"binomial"`, recompute no more layers than `"nested"` with that many
      groups.
      `remat="auto"` (with `memory_budget=`) chooses among all of these,
      and binomial with any number of slots, the plan that recomputes
      the least FLOPs whose predicted training-step temporaries fit the budget
      (`hkb.remat_plan` shows the candidates).
    unroll: passed to `jax.lax.scan`: a bool or a non-negative int.
    reverse: run the layers from last to first (as `jax.lax.scan`).
    memory_budget: with `remat="auto"`, the bytes the loop's part of a training step may take,
      as `hkb.remat_plan` counts them; None: the budget of the whole step, inside
      `hkb.budgeted_jit`; with `pipeline=`, per stage: those of one visit's loop on one
      microbatch.
    max_recompute: with `remat="auto"`, the most forward passes of the loop
      a plan may run again in the backward pass (`remat=True` runs 1;
      default 3; `math.inf` allows any). Where every plan that fits the
      budget recomputes more, `remat="auto"` raises an error naming the
      least budget within it.
    pipeline: an `hkb.Pipeline`: at apply, run the layers as pipeline
      stages over a mesh axis, the batch in microbatches (init runs the
      plain scan: the params are the same). The remat options apply to each
      stage's layers of one visit. With more than one microbatch, each `y`
      must have the batch on axis 0; see `hkb.Pipeline`.

  Returns:
    `(carry, ys)`: the last layer's carry, and the per-layer `y`s stacked.
  """
  with errors.entry("layer_scan"):
    guards.require_transform()
    _check_layer_args(layer, init, name, "(carry, x) -> (carry, y)")
    num_layers = remat_lib.num_steps(num_layers, xs, _LAYERS)
    options = _check_options(
      remat, remat_policy, remat_groups, unroll, reverse, pipeline, memory_budget, max_recompute
    )
    if name is None:
      name = NO_PER_LAYER_NAME if xs is None else WITH_PER_LAYER_NAME
    return _run(_haiku_layer(layer, init, carry, xs), carry, xs, num_layers, name, options)


class _Options(NamedTuple):
  """`layer_scan`'s options, checked once by the public call."""

  loop: remat_lib.Loop
  reverse: bool
  pipeline: Optional[pipeline_lib.Pipeline]


def _run(
  layer: Callable[..., Any],
  carry: PyTree,
  xs: PyTree,
  num_layers: int,
  name: str,
  options: _Options,
) -> tuple[PyTree, PyTree]:
  """The layer scan of a Haiku `layer(carry, x)`, its arguments checked."""
  layer_init, layer_apply = _transformed_layer(layer)

  def init_one(state, x):
    carry, key = state
    if key is None:
      key, next_key, apply_key = None, None, None
    else:
      key, next_key, apply_key = jax.random.split(key, 3)
    params, layer_state = layer_init(key, carry, x)
    # The next layer's init sees the carry this layer returns.
    (carry, _), layer_state = layer_apply(params, layer_state, apply_key, carry, x)
    return (carry, next_key), (params, layer_state)

  def init_stack(carry, xs, key):
    return jax.lax.scan(init_one, (carry, key), xs, length=num_layers)[1]

  lifted, updater = hk.lift_with_state(init_stack, allow_reuse=True, name=name)
  params, state = lifted(carry, xs, hk.maybe_next_rng_key())
  _check_depth(name, params, num_layers)
  key = hk.maybe_next_rng_key()
  keys = None if key is None else jax.random.split(key, num_layers)

  def body(carry, scanned):
    params, state, key, x = scanned
    (carry, y), state = layer_apply(params, state, key, carry, x)
    return carry, (y, state)

  def planned(carry, scanned):
    # What `remat="auto"` measures: a training step differentiates the
    # layers' params, not their state (Haiku's aux), which would otherwise
    # be planned as outputs with cotangents (a 16-layer stack keeping a
    # running mean: every plan predicted at 1.38× what it compiles to).
    params, state, key, x = scanned
    carry, (y, state) = body(carry, (params, jax.lax.stop_gradient(state), key, x))
    return carry, (y, jax.lax.stop_gradient(state))

  scanned = (params, state, keys, xs)
  try:
    carry, (ys, state) = _run_loop(body, carry, scanned, num_layers, options, planned)
  except remat_lib.Planned:
    updater.ignore_update()  # hkb.remat_plan took the plan: no layer ran.
    raise
  updater.update(state)
  return carry, ys


def _run_loop(body, carry, scanned, num_layers: int, options: _Options, planned=None):
  """The layers' loop, or with `pipeline=` at apply, its pipeline stages.

  `planned`: the body `remat="auto"` plans on, if not `body`.
  """
  pipeline, reverse = options.pipeline, options.reverse
  staging = None
  if pipeline is not None:
    # Init runs the plain scan (the same params), and so does a bridge
    # that runs this only to find the params it reads, where no mesh is
    # set (a bridged function's init): neither needs a mesh.
    staging = pipeline_lib.staging_for(
      pipeline, carry, num_layers, require_mesh=not (guards.initialising() or inline.probing())
    )
  if staging is not None and not guards.initialising():
    carry, (ys, state) = pipeline_lib.run(
      staging, body, carry, scanned, loop=options.loop, reverse=reverse, planned_body=planned
    )
  else:
    # With a pipeline, init (or a bridge finding the params) runs the whole
    # stack in one loop, which the per-stage budget is not for.
    loop = remat_lib.resolved(
      options.loop,
      body,
      carry,
      scanned,
      num_layers,
      whole_pipelined_stack=pipeline is not None,
      planned_body=planned,
    )
    carry, (ys, state) = loop(body, carry, scanned, num_layers, reverse)
  return carry, (ys, state)


class RepeatOptions(TypedDict, total=False):
  """`repeat_layer`'s `**options`, typed: those of `layer_scan` it passes on."""

  name: Optional[str]
  remat: modes.RematMode
  remat_policy: Optional[Callable[..., bool]]
  remat_groups: Optional[int]
  unroll: int | bool
  reverse: bool
  pipeline: Optional[pipeline_lib.Pipeline]
  memory_budget: Optional[int]
  max_recompute: Optional[float]


@remat_lib.plannable
def repeat_layer(
  layer: Callable[..., Any],
  x: PyTree,
  num_layers: int,
  *,
  init: Optional[InitFn] = None,
  **options: Unpack[RepeatOptions],
) -> PyTree:
  """`layer` applied `num_layers` times with separate weights: `layer_scan` for `x -> x` layers.

  >>> def net(x):
  ...   return hkb.repeat_layer(lambda h: h + hk.nets.MLP([64, 16])(h), x, 12)
  >>> net = hk.transform(net)
  >>> params = net.init(jax.random.PRNGKey(0), jnp.ones([2, 16]))
  >>> net.apply(params, None, jnp.ones([2, 16])).shape
  (2, 16)

  Args:
    layer: a Haiku function `layer(x) -> x`, or with `init=`, a pure
      `layer(params, x) -> x`.
    x: the input.
    num_layers: the number of layers.
    init: for a pure `layer`, `init(rng, x) -> params` of one layer.
    **options: `name`, `remat`, `remat_policy`, `remat_groups`, `unroll`,
      `reverse`, `pipeline`, `memory_budget`, `max_recompute`, as for
      `layer_scan`.

  Returns:
    The last layer's output.
  """
  with errors.entry("repeat_layer"):
    guards.require_transform()
    num_layers = errors.check_positive_int("num_layers", num_layers)
    checked = _check_repeat_options(options)
    name = options.get("name")
    _check_layer_args(layer, init, name, "x -> x")
    f = inline.haiku_function(layer) if init is None else layer
    _check_layer_signature(f, init, (x,))
    carry_layer = _haiku_layer(_CarryLayer(f), None if init is None else _CarryInit(init), x, None)
    return _run(carry_layer, x, None, num_layers, name or NO_PER_LAYER_NAME, checked)[0]


# `layer_scan`'s options that `repeat_layer` passes on, with their defaults.
_REPEAT_OPTIONS = {
  "name": None,
  "remat": False,
  "remat_policy": None,
  "remat_groups": None,
  "unroll": 1,
  "reverse": False,
  "pipeline": None,
  "memory_budget": None,
  "max_recompute": None,
}


def _check_repeat_options(options: Mapping[str, Any]) -> _Options:
  """`repeat_layer`'s `**options`: known names, each value checked."""
  if "xs" in options:
    raise TypeError(
      errors.message(
        "takes no `xs`: its layers map x -> x, with no per-layer inputs. "
        "For per-layer inputs use hkb.layer_scan(layer, carry, xs), whose "
        "layer is `layer(carry, x) -> (carry, y)`."
      )
    )
  errors.check_keywords(options, ("layer", "x", "num_layers", "init", *_REPEAT_OPTIONS))
  given = dict(_REPEAT_OPTIONS, **options)
  del given["name"]  # Checked with the layer.
  return _check_options(**given)


# `repeat_layer`'s adapters are dataclasses rather than lambdas: calls with one
# layer build equal adapters, which fingerprint alike
# (fingerprint.function_key).


@dataclasses.dataclass(frozen=True)
class _CarryLayer:
  """`x -> x` as `(carry, x) -> (carry, None)`, with or without leading params."""

  f: Callable[..., Any]

  def __call__(self, *args):
    *params, carry, _ = args
    return self.f(*params, carry), None


@dataclasses.dataclass(frozen=True)
class _CarryInit:
  """`init(rng, x)` as `init(rng, carry, x)`."""

  init: InitFn

  def __call__(self, rng, carry, _):
    return self.init(rng, carry)


@dataclasses.dataclass(frozen=True)
class _PureLayer:
  """A pure `layer(params, carry, x)` with its init, as a Haiku layer."""

  layer: Callable[..., Any]
  init: InitFn

  def __call__(self, carry, x):
    params = call_pure_lib.get_relevant_parameters(self.init, carry, x)
    return self.layer(params, carry, x)


# How the layer scan counts its layers (remat.num_steps).
_LAYERS = remat_lib.StepAxis(
  argument="num_layers",
  least=1,
  leaf="an array of per-layer inputs, with a leading layer axis",
  none="needs `num_layers=` when there are no `xs`.",
)

# How the layer scan's messages name its layer (remat.check_step_output).
_LAYER = remat_lib.StepWords(
  body="a layer",
  pair="(carry, y)",
  carry="carry",
  step="layer",
  subject="the layer",
  pair_hint=" Return `(new_carry, None)` for a layer "
  "without per-layer outputs, or use hkb.repeat_layer for `x -> x` layers.",
  carry_hint=" Return per-layer outputs as `y` in `(carry, y)`.",
)


def _check_layer_args(layer: Any, init: Any, name: Any, signature: str) -> None:
  """`layer`, `init` and `name` of `layer_scan` / `repeat_layer`."""
  if not (callable(layer) or haiku_internals.is_transformed(layer)):
    raise TypeError(
      errors.bad_argument(
        "layer",
        layer,
        f"a Haiku function `{signature}` (or its "
        "hk.transform), or with `init=`, a pure layer taking its params "
        "first",
      )
    )
  if init is not None:
    errors.check_callable(
      "init",
      init,
      "None or, for a pure layer, a function `init(rng, ...)` returning one layer's params",
    )
  errors.check_str("name", name, "a module name (a string) or None", optional=True)


def _haiku_layer(layer, init, carry, xs) -> Callable[..., Any]:
  if init is not None:
    if haiku_internals.is_transformed(layer):
      raise TypeError(
        errors.message(
          "`layer` is an hk.Transformed, which brings its own init; do not pass `init=` as well."
        )
      )
    return _PureLayer(layer, init)
  f = inline.haiku_function(layer)
  _check_layer_signature(f, init, (carry, None if xs is None else xs))
  return f


def _check_layer_signature(f, init, args) -> None:
  """A pure layer (one more leading argument) given without `init=`."""
  if init is not None:
    return
  try:
    signature = inspect.signature(f)
  except (TypeError, ValueError):
    return
  try:
    signature.bind(*args)
  except TypeError:
    try:
      signature.bind(None, *args)
    except TypeError:
      return
    raise TypeError(
      errors.message(
        f"{getattr(f, '__name__', f)!r} takes {len(args) + 1} arguments, one "
        f"more than a Haiku layer's {len(args)}: a pure layer "
        "`layer(params, ...)` needs `init=`, a function `init(rng, ...)` "
        "returning one layer's params."
      )
    ) from None


def _transformed_layer(f: Callable[..., Any]) -> hk.TransformedWithState:
  # Not cached: a cache here saved nothing measurable in a re-trace
  # (testing/benchmarks/results/RESULTS.md, "Caches: what they save").
  return hk.transform_with_state(remat_lib.CheckedBody(f, _LAYER, "layer_scan"))


def _check_options(
  remat: Any,
  remat_policy: Any,
  remat_groups: Any,
  unroll: Any,
  reverse: Any,
  pipeline: Any,
  memory_budget: Any = None,
  max_recompute: Any = None,
) -> _Options:
  """The scan's options, checked."""
  loop = remat_lib.from_options(
    remat=remat,
    remat_policy=remat_policy,
    remat_groups=remat_groups,
    unroll=unroll,
    memory_budget=memory_budget,
    max_recompute=max_recompute,
  )
  reverse = errors.check_bool("reverse", reverse)
  pipeline = pipeline_lib.check_pipeline(pipeline)
  return _Options(loop, reverse, pipeline)


def _check_depth(stack: str, params: PyTree, num_layers: int) -> None:
  """At apply, stacked params made for another number of layers."""
  for bundle, entries in params.items():
    for name, value in entries.items():
      depth = value.shape[0] if value.ndim else None
      if depth != num_layers:
        raise ValueError(
          errors.message(
            f"parameter '{stack}/{bundle}/{name}' has shape "
            f"{list(value.shape)}, a stack of {depth} layers, but this call "
            f"runs num_layers={num_layers}. Pass the number of layers the "
            "params were made with, or convert them (hkb.unstack_params / "
            "hkb.stack_params)."
          )
        )
