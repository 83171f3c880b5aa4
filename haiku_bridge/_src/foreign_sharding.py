"""A foreign module's declared partitioning, carried over to its Haiku params.

Flax modules declare how their params are split over a mesh: Linen's
`nn.with_partitioning` / `nn.with_logical_partitioning` boxes, NNX's
`out_sharding` metadata (`sharding` / `sharding_names` in older Flax). The
Flax adapter turns each into a `PartitionSpec` for one layer (logical names
resolved by Flax's own rules) and, at init, hands it to `recording` beside
the Haiku name of the param it belongs to. `rules_from_foreign` runs an init
abstractly while recording, and returns one exact rule per declared param,
for `hkb.ShardingRules.from_foreign`:

* the Haiku name is the outer one: a param created inside `hk.lift`,
  `hk.layer_stack` or `hkb.layer_scan` gets the lifted prefix that Haiku's
  creators see (`context.lifted_prefix_name`);
* a stacked param (from `layer_scan`) has more axes than the one layer that
  declared the spec; the extra leading axes are its layer axes: not split,
  unless the stack is declared in `stacked=` (which then says how).

Free of Flax and Equinox: the adapters compute the specs.
"""

import contextlib
import contextvars
import re
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import haiku as hk
import jax
from jax.sharding import PartitionSpec

from haiku_bridge._src import errors
from haiku_bridge._src import pytree
from haiku_bridge._src import storage


class Declared(NamedTuple):
  """One param's declared partitioning, as its creator saw it."""

  path: str  # The outer Haiku name, `bundle/name`.
  ndim: int  # Its rank in the layer that declared it.
  spec: PartitionSpec  # For that layer.


class Recorder:
  """What one `rules_from_foreign` run records."""

  def __init__(self, logical_axis_rules: Optional[Sequence[tuple[str, Any]]]):
    self.logical_axis_rules = None if logical_axis_rules is None else tuple(logical_axis_rules)
    self.declared: dict[str, Declared] = {}


_RECORDER: contextvars.ContextVar[Optional[Recorder]] = contextvars.ContextVar(
  "haiku_bridge_foreign_sharding", default=None
)


def active() -> Optional[Recorder]:
  """The recorder of a running `rules_from_foreign`, or None."""
  return _RECORDER.get()


@contextlib.contextmanager
def recording(
  leaves: Sequence[storage.Leaf], specs: Optional[Sequence[Optional[PartitionSpec]]]
) -> Iterator[None]:
  """Records `specs[i]` for `leaves[i]` as Haiku creates it (if recording)."""
  recorder = _RECORDER.get()
  if recorder is None or specs is None or not any(s is not None for s in specs):
    yield
    return
  by_name = {leaf.full_name: spec for leaf, spec in zip(leaves, specs) if spec is not None}

  def creator(next_creator, shape, dtype, init, context):
    spec = by_name.get(context.full_name)
    if spec is not None:
      path = (context.lifted_prefix_name or "") + context.full_name
      recorder.declared[path] = Declared(path, len(shape), spec)
    return next_creator(shape, dtype, init)

  with hk.custom_creator(creator):
    yield


class ForeignRules(NamedTuple):
  """Exact rules for the params that declare a spec, and the stacks to keep."""

  rules: tuple[tuple[str, PartitionSpec], ...]
  declared: tuple[Declared, ...]


def rules_from_foreign(
  init: Callable[..., Any],
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  *,
  layer_axes: Callable[[str, Sequence[int]], int],
  logical_axis_rules: Optional[Sequence[tuple[str, Any]]] = None,
) -> ForeignRules:
  """One exact rule per param whose foreign module declared its partitioning.

  Args:
    init: an init function, or an `hk.Transformed*` (its `init`).
    args: positional arguments for `init` (the rng first).
    kwargs: keyword arguments for `init`.
    layer_axes: `layer_axes(path, shape)`: how many layer axes the caller's
      `stacked=` gives the param at `path`; the rule's spec then leaves
      those out, and any other extra leading axis is not split.
    logical_axis_rules: Flax logical axis rules, `(logical name, mesh
      axes)` pairs; default: Flax's current ones (`nn.logical_axis_rules`).

  Returns:
    A `ForeignRules`: `(^path$, spec)` pairs, and what was recorded.

  Raises:
    ValueError: when `stacked=` declares some but not all the layer stacks
      around a param (their order would be ambiguous).
  """
  init = getattr(init, "init", init)
  recorder = Recorder(logical_axis_rules)
  token = _RECORDER.set(recorder)
  try:
    # Only arrays are abstract: Python values (a `train` flag, a size) stay
    # static, as `init` sees them called directly. A new function each
    # time: `jax.eval_shape` caches traces by function, and a trace taken
    # from the cache would run no creator.
    arrays, rebuild = pytree.split_arrays((args, kwargs), numpy=True)

    def abstract(arrays):
      args, kwargs = rebuild(arrays)
      return init(*args, **kwargs)

    out = jax.eval_shape(abstract, arrays)
  finally:
    _RECORDER.reset(token)
  params = out[0] if isinstance(out, tuple) else out
  rules = []
  for declared in recorder.declared.values():
    bundle, _, name = declared.path.rpartition("/")
    shape = tuple(params[bundle][name].shape)
    extra = len(shape) - declared.ndim
    given = layer_axes(declared.path, shape)
    if given not in (0, extra):
      raise ValueError(
        errors.message(
          f"parameter {declared.path!r} (shape "
          f"{shape}) lies in {extra} layer stack(s), of which `stacked=` "
          f"declares {given}. Declare every stack around it in `stacked=`, or "
          "none (its layer axes are then not split)."
        )
      )
    spec = PartitionSpec(*([None] * (extra - given)), *declared.spec)
    rules.append((f"^{re.escape(declared.path)}$", spec))
  return ForeignRules(tuple(rules), tuple(recorder.declared.values()))
