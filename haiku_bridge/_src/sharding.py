"""Sharding rules: how each parameter is split over a device mesh, by name.

JAX shards a model with `jax.jit` and `NamedSharding`s over a `Mesh` (or with
`jax.shard_map` and `PartitionSpec`s). Both need one spec per parameter, and a
Haiku params dict holds many. `ShardingRules` states them once, by name: an
ordered list of `(regex, PartitionSpec)` pairs, searched in the parameter's
full path `bundle/name` (`net/mlp/~/linear_0/w`), first match wins; a parameter
no rule matches is replicated. Bridged parameters (`call_pure`, `layer_scan`)
are ordinary Haiku parameters, so the same rules cover them.

Stacked parameters (from `layer_scan` / `repeat_layer` / `hk.layer_stack`) have
a leading layer axis. Rules are written for one layer, and the stacks are
declared once with `stacked=`: every parameter under a declared stack gets one
leading spec entry per stack (`None`, i.e. each device holds every layer,
unless the stack maps to a mesh axis), followed by its rule's per-layer spec.
Nothing is guessed from shapes, so a rule means the same for a stacked and an
unstacked copy of a layer.

    rules = hkb.ShardingRules(
        [(r"mlp/~/linear_0/w$", P(None, "model")),   # column split
         (r"mlp/~/linear_1/w$", P("model", None))],  # row split
        stacked=["encoder"])                        # layer_scan(name="encoder")
    shardings = hkb.param_shardings(jax.eval_shape(f.init, key, x), mesh, rules)
    params = jax.jit(f.init, out_shardings=shardings)(key, x)
    step = jax.jit(train_step, in_shardings=(shardings, batch_sharding))

`explain_shardings` lists each parameter with its rule and spec, the
parameters no rule matched, and the rules that matched nothing.
"""

import dataclasses
import math
import re
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from haiku_bridge._src import errors
from haiku_bridge._src import foreign_sharding
from haiku_bridge._src import typed_sharding
from haiku_bridge._src.pytree import PyTree
from haiku_bridge._src.typed_sharding import entry_without
from haiku_bridge._src.typed_sharding import MeshAxes

# A concrete mesh, or (jax's abstract mesh) its axis names and sizes alone.
MESH_TYPES = (Mesh,) + (
  (jax.sharding.AbstractMesh,) if hasattr(jax.sharding, "AbstractMesh") else ()
)


def spec_str(spec: PartitionSpec) -> str:
  """`P(None, 'model')`: a spec as jax >= 0.9.2 prints it, on every jax."""
  text = repr(spec)
  return "P(" + text[len("PartitionSpec(") :] if text.startswith("PartitionSpec(") else text


class Rule(NamedTuple):
  """One rule: parameters whose path `re.search`es `pattern` get `spec`."""

  pattern: str
  spec: PartitionSpec


class ParamSharding(NamedTuple):
  """Where one parameter goes, and why.

  Attributes:
    path: the parameter's full path, `bundle/name` for Haiku params.
    shape: its shape.
    spec: its `PartitionSpec`, layer axes included.
    rule: the index of the rule that matched it, or None (replicated).
    layer_axes: how many leading layer axes `stacked=` gave it.
  """

  path: str
  shape: tuple[int, ...]
  spec: PartitionSpec
  rule: Optional[int]
  layer_axes: int


class ShardingRules:
  """Ordered `(pattern, PartitionSpec)` rules; first match wins.

  >>> from jax.sharding import PartitionSpec as P
  >>> rules = hkb.ShardingRules([
  ...     (r"attention/(query|key|value)/w$", P(None, "model")),
  ...     (r"attention/linear/w$", P("model", None)),
  ...     (r"mlp/~/linear_0/w$", P(None, "model")),
  ...     (r"mlp/~/linear_0/b$", P("model")),
  ...     (r"mlp/~/linear_1/w$", P("model", None)),
  ... ], stacked=["transformer/layers"])
  >>> rules.spec_for("transformer/layers/mlp/~/linear_0/w", (12, 64, 256))
  P(None, None, 'model')
  >>> rules.spec_for("transformer/embed/embeddings", (1000, 64))  # No rule.
  P()

  Patterns are Python regexes, `re.search`ed in the full path, so anchor them
  (`$`, `^`, `/`) to avoid matching more than meant: `linear/w$` also matches
  `.../my_linear/w`, `/linear/w$` does not.

  A spec may be shorter than the parameter's rank (the remaining dimensions
  are not split), never longer.

  Args:
    rules: `(pattern, spec)` pairs (or `Rule`s), in order of priority. `spec`
      is a `PartitionSpec`; a tuple or list is turned into one.
    stacked: the layer stacks whose parameters carry a leading layer axis, as
      patterns of a path prefix: a parameter gets one layer axis for each
      prefix of its path (at a `/`) that ends with a match of one of them
      (where several match one prefix, the first one's mesh axes). So
      `"encoder"` covers `net/encoder/mlp/w`, `"net/encoder"` covers the same
      and not `other/encoder/...`, and `"__layer_stack_no_per_layer"` (the
      default name of `layer_scan` and `hk.layer_stack`) covers every unnamed
      stack, twice where two are nested. A stack's numbered copies are the
      same stack: when a name is given twice (two `repeat_layer(...,
      name="blocks")`), Haiku calls the second `blocks_1`, and `"blocks"`
      covers `blocks`, `blocks_1`, `blocks_2`, ... (a pattern that ends in
      its own number, `"blocks_1"`, covers that copy alone). Only the stack's
      own name is matched so; to cover the copies of an enclosing module
      (`net_1/encoder`), write `"encoder"` or `r"net(_[0-9]+)?/encoder"`. A
      sequence maps each stack's layer axis to no mesh axis (every device
      holds every layer); a mapping `{pattern: mesh axes}` may split it,
      e.g. `{"encoder": "stage"}` for pipeline stages, or `{"blocks":
      "data"}` to spread the layers over the data axis (FSDP over layers).
  """

  def __init__(
    self,
    rules: Iterable[Rule | tuple[str, Any]],
    *,
    stacked: Iterable[str] | Mapping[str, MeshAxes] = (),
  ) -> None:
    with errors.entry("ShardingRules", outer_wins=True):
      if (
        isinstance(rules, (str, Mapping))
        or not isinstance(rules, Iterable)
        or isinstance(rules, MESH_TYPES)
      ):
        raise TypeError(
          errors.message(
            f"`rules` is {rules!r:.80}; pass a list of (pattern, "
            "PartitionSpec) pairs, e.g. [(r\"mlp/w1$\", P(None, 'model'))]"
            + (" (for a dict: list(rules.items()))." if isinstance(rules, Mapping) else ".")
          )
        )
      self._rules = tuple(_to_rule(i, r) for i, r in enumerate(rules))
      self._compiled = tuple(_compile(r.pattern, f"rule {i}") for i, r in enumerate(self._rules))
      self._stacked = _check_stacked(stacked)
      self._stacked_compiled = tuple(
        (_compile(rf"(?:^|/)(?:{s})(?:_[1-9][0-9]*)?$", f"stacked pattern {s!r}"), s, axes)
        for s, axes in self._stacked.items()
      )

  @classmethod
  def from_foreign(
    cls,
    init: Any,
    *args: Any,
    rules: Iterable[Rule | tuple[str, Any]] = (),
    stacked: Iterable[str] | Mapping[str, MeshAxes] = (),
    logical_axis_rules: Optional[Sequence[tuple[str, Any]]] = None,
    **kwargs: Any,
  ) -> "ShardingRules":
    """Rules from the partitioning that Flax modules inside `init` declare.

    Runs `init(*args, **kwargs)` abstractly. Each param of a `hkb.from_flax`
    module that declares its partitioning (Linen `nn.with_partitioning`,
    `nn.with_logical_partitioning`; NNX `out_sharding` metadata) gets an
    exact rule with the spec Flax gives it (logical names through Flax's
    rules); `rules` follow, for every other param; `stacked=` is as for the
    constructor (a layer axis it does not declare is not split).

    >>> import functools
    >>> from flax import nnx
    >>> dense = functools.partial(nnx.Linear, 8, 16, kernel_init=
    ...     nnx.with_partitioning(nnx.initializers.lecun_normal(),
    ...                           (None, "model")))
    >>> f = hk.transform(lambda x: hkb.from_flax(dense, name="proj")(x))
    >>> key, x = jax.random.PRNGKey(0), jnp.ones([2, 8])
    >>> rules = hkb.ShardingRules.from_foreign(f.init, key, x)
    >>> rules.spec_for("proj/kernel", (8, 16))
    P(None, 'model')

    Args:
      init: an init function (`f.init`) or an `hk.Transformed*`.
      *args: its arguments (the rng first).
      rules: further `(pattern, spec)` rules, after the declared ones.
      stacked: layer stacks, as for `ShardingRules`.
      logical_axis_rules: Flax logical axis rules `(name, mesh axes)`;
        default: Flax's current ones (`nn.logical_axis_rules(...)`).
      **kwargs: its keyword arguments.

    Returns:
      A `ShardingRules`.
    """
    with errors.entry("ShardingRules.from_foreign"):
      _check_foreign_init(init)
      logical_axis_rules = _check_logical_axis_rules(logical_axis_rules)
      user = cls(rules, stacked=stacked)
      found = foreign_sharding.rules_from_foreign(
        init,
        args,
        kwargs,
        logical_axis_rules=logical_axis_rules,
        layer_axes=lambda path, shape: len(user._layer_stacks(path)),
      )  # pylint: disable=protected-access
      return cls(list(found.rules) + list(user.rules), stacked=user.stacked)

  @property
  def rules(self) -> tuple[Rule, ...]:
    return self._rules

  @property
  def stacked(self) -> dict[str, MeshAxes]:
    return dict(self._stacked)

  def __repr__(self) -> str:
    rules = ", ".join(f"({r.pattern!r}, {spec_str(r.spec)})" for r in self._rules)
    return f"ShardingRules([{rules}], stacked={self._stacked!r})"

  def place(self, path: str, shape: Sequence[int], mesh: Optional[Mesh] = None) -> ParamSharding:
    """Where the parameter at `path` with `shape` goes; checked against `mesh`.

    Args:
      path: the full path, e.g. `"net/linear/w"`.
      shape: the parameter's shape (layer axes included).
      mesh: if given, also check the spec's mesh axes exist and divide.

    Returns:
      A `ParamSharding`.

    Raises:
      ValueError: the spec has more axes than the parameter; with `mesh`, it
        names an axis the mesh lacks, uses one twice, or splits a dimension
        into parts of unequal size.
    """
    with errors.entry("ShardingRules.place", outer_wins=True):
      errors.check_str("path", path, "a parameter's full path, a string such as 'net/linear/w'")
      if (
        isinstance(shape, (str, bytes))
        or not isinstance(shape, Iterable)
        or not all(errors.is_int(d) and d >= 0 for d in shape)
      ):
        raise TypeError(
          errors.bad_argument(
            "shape", shape, "the parameter's shape, a sequence of non-negative ints"
          )
        )
      _check_mesh_arg(mesh, optional=True)
      return self._place(path, tuple(int(d) for d in shape), mesh)

  def spec_for(self, path: str, shape: Sequence[int], mesh: Optional[Mesh] = None) -> PartitionSpec:
    """The `PartitionSpec` of the parameter at `path`; see `place`."""
    with errors.entry("ShardingRules.spec_for", outer_wins=True):
      return self.place(path, shape, mesh).spec

  # -------------------------------------------------------------------------

  def _place(self, path: str, shape: tuple[int, ...], mesh: Optional[Mesh]) -> ParamSharding:
    layer_specs = [axes for _, axes in self._layer_stacks(path)]
    if len(layer_specs) > len(shape):
      raise ValueError(
        errors.message(
          f"parameter {path!r} has shape {shape}, but it lies "
          f"under {len(layer_specs)} declared layer stack(s) "
          f"({self._stacks_of(path)}), so it needs {len(layer_specs)} leading "
          "layer axes. Check the patterns in `stacked=`."
        )
      )
    index = self._match(path)
    if index is None:
      spec = (
        PartitionSpec(*layer_specs) if any(a is not None for a in layer_specs) else PartitionSpec()
      )
    else:
      spec = PartitionSpec(*layer_specs, *self._rules[index].spec)
    placed = ParamSharding(path, shape, spec, index, len(layer_specs))
    if len(spec) > len(shape):
      raise ValueError(
        errors.message(
          f"{self._describe(index)} gives parameter {path!r} (shape {shape}) "
          f"the spec {spec_str(spec)}, with {len(spec)} axes, more than its "
          f"{len(shape)} dimensions.{self._layer_hint(placed)}"
        )
      )
    if mesh is not None:
      self._check_mesh(placed, mesh)
    return placed

  def _match(self, path: str) -> Optional[int]:
    for i, pattern in enumerate(self._compiled):
      if pattern.search(path):
        return i
    return None

  def _prefixes(self, path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:k]) for k in range(1, len(parts))]

  def _layer_stacks(self, path: str) -> list[tuple[str, MeshAxes]]:
    """`(stacked pattern, mesh axes)` per stack the parameter lies under."""
    stacks = []
    for prefix in self._prefixes(path):
      for compiled, pattern, axes in self._stacked_compiled:
        if compiled.search(prefix):
          stacks.append((pattern, axes))
          break
    return stacks

  def _stacks_of(self, path: str) -> str:
    return ", ".join(
      repr(prefix)
      for prefix in self._prefixes(path)
      if any(p.search(prefix) for p, _, _ in self._stacked_compiled)
    )

  def _describe(self, index: Optional[int]) -> str:
    if index is None:
      return "no rule (replicated but for its layer axes)"
    rule = self._rules[index]
    return f"rule {index} ({rule.pattern!r} -> {spec_str(rule.spec)})"

  def _layer_hint(self, placed: ParamSharding) -> str:
    if placed.layer_axes:
      return (
        f" The first {placed.layer_axes} entr"
        f"{'y is' if placed.layer_axes == 1 else 'ies are'} for the "
        f"layer axes of stack(s) {self._stacks_of(placed.path)}; write "
        "the rule's spec for one layer."
      )
    return (
      " Shorten the spec; if this parameter is stacked (layer_scan, "
      "hk.layer_stack), write the spec for one layer and declare the "
      "stack in `stacked=`."
    )

  def _check_mesh(self, placed: ParamSharding, mesh: Mesh) -> None:
    stacks = self._layer_stacks(placed.path)
    spec = spec_str(placed.spec)
    seen: dict[str, int] = {}  # Mesh axis -> the dimension it splits.
    for dim, entry in enumerate(placed.spec):
      if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        continue
      axes = (entry,) if isinstance(entry, str) else tuple(entry)
      # A layer axis is placed by `stacked=`, every other by a rule.
      stack = stacks[dim][0] if dim < placed.layer_axes else None
      source = (
        f"`stacked=` ({stack!r} -> {entry!r})" if stack is not None else self._describe(placed.rule)
      )
      for axis in axes:
        if axis not in mesh.shape:
          raise ValueError(
            errors.message(
              f"{source} gives parameter {placed.path!r} the spec {spec}, "
              f"which names mesh axis {axis!r}; the mesh has axes "
              f"{tuple(mesh.axis_names)}."
            )
          )
        if axis in seen:
          raise ValueError(
            errors.message(
              f"{source} gives parameter {placed.path!r} the spec {spec}, "
              f"which splits dimensions {seen[axis]} and {dim} over the same "
              f"mesh axis {axis!r}; each mesh axis may split one dimension "
              "only."
            )
          )
        seen[axis] = dim
      parts = math.prod(mesh.shape[a] for a in axes)
      size = placed.shape[dim]
      if size % parts and stack is not None:
        raise ValueError(
          errors.message(
            f"{source} splits the layer axis of parameter {placed.path!r} "
            f"(shape {placed.shape}): {size} layers do not split over mesh "
            f"axes {axes} ({parts} parts); {parts} does not divide {size}. "
            f"Use a number of layers that {parts} divides, or map stack "
            f"{stack!r} to other mesh axes in `stacked=` (None keeps every "
            "layer on every device)."
          )
        )
      if size % parts:
        raise ValueError(
          errors.message(
            f"{source} gives parameter {placed.path!r} (shape "
            f"{placed.shape}) the spec {spec}, which splits dimension {dim} "
            f"(size {size}) into {parts} parts over mesh axes {axes}; "
            f"{parts} does not divide {size}. Pick a size it divides, or "
            "another spec for this parameter."
          )
        )


@dataclasses.dataclass(frozen=True)
class ShardingReport:
  """What `explain_shardings` found; `str()` gives a table.

  Attributes:
    params: one `ParamSharding` per parameter, in `jax.tree.leaves` order.
    rules: the rules applied.
  """

  params: tuple[ParamSharding, ...]
  rules: ShardingRules

  @property
  def unmatched(self) -> list[str]:
    """Paths of the parameters no rule matched (replicated)."""
    return [p.path for p in self.params if p.rule is None]

  @property
  def unused_rules(self) -> list[Rule]:
    """Rules that matched no parameter: often a typo in a pattern."""
    used = {p.rule for p in self.params}
    return [r for i, r in enumerate(self.rules.rules) if i not in used]

  def __str__(self) -> str:
    rows = [("parameter", "shape", "spec", "rule")]
    for p in self.params:
      rule = "-" if p.rule is None else f"{p.rule}: {self.rules.rules[p.rule].pattern}"
      rows.append((p.path, str(p.shape), spec_str(p.spec), rule))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[3] for row in rows]
    for unused in self.unused_rules:
      lines.append(f"unused rule: {unused.pattern!r} -> {spec_str(unused.spec)}")
    return "\n".join(lines)


def explain_shardings(
  params: PyTree, rules: ShardingRules | Iterable[tuple[str, Any]], *, mesh: Optional[Mesh] = None
) -> ShardingReport:
  """Each parameter with its rule and spec; unmatched params; unused rules.

  >>> from jax.sharding import PartitionSpec as P
  >>> params = {"mlp/~/linear_0": {"w": jnp.zeros([4, 8]), "b": jnp.zeros([8])}}
  >>> rules = [(r"linear_0/w$", P(None, "model")), (r"linear_1/w$", P("model"))]
  >>> report = hkb.explain_shardings(params, rules)
  >>> print(report)
  parameter         shape   spec              rule
  mlp/~/linear_0/b  (8,)    P()               -
  mlp/~/linear_0/w  (4, 8)  P(None, 'model')  0: linear_0/w$
  unused rule: 'linear_1/w$' -> P('model',)
  >>> report.unmatched
  ['mlp/~/linear_0/b']

  Args:
    params: a params tree (arrays, or `jax.eval_shape`'s
      `ShapeDtypeStruct`s): anything whose leaves have a `.shape`.
    rules: a `ShardingRules`, or the `(pattern, spec)` pairs for one.
    mesh: if given, also check each spec against it.

  Returns:
    A `ShardingReport`.

  Raises:
    ValueError: as `ShardingRules.place`, naming the parameter and the rule.
  """
  with errors.entry("explain_shardings"):
    _check_params_rules_mesh(params, rules, mesh, "explain_shardings", optional_mesh=True)
    return _explain(params, rules, mesh)


def _explain(params: PyTree, rules, mesh: Optional[Mesh]) -> ShardingReport:
  rules = _as_rules(rules)
  placed = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if not hasattr(leaf, "shape"):
      raise TypeError(
        errors.message(
          f"`params` must be a params tree of arrays or "
          f"jax.ShapeDtypeStructs; at {_path_string(path) or '<root>'} it "
          f"holds {errors.got(leaf)}."
        )
      )
    # pylint: disable-next=protected-access
    placed.append(rules._place(_path_string(path), tuple(leaf.shape), mesh))
  return ShardingReport(tuple(placed), rules)


def param_specs(
  params: PyTree, rules: ShardingRules | Iterable[tuple[str, Any]], *, mesh: Optional[Mesh] = None
) -> PyTree:
  """The tree of `PartitionSpec`s for `params`, e.g. `shard_map`'s `in_specs`.

  >>> from jax.sharding import PartitionSpec as P
  >>> params = {"linear": {"w": jnp.zeros([4, 8]), "b": jnp.zeros([8])}}
  >>> hkb.param_specs(params, [(r"linear/w$", P(None, "model"))])
  {'linear': {'b': P(), 'w': P(None, 'model')}}

  Pass them as `in_specs` of `jax.shard_map` to hand each device its shard.

  Args:
    params: a params tree (arrays or `ShapeDtypeStruct`s).
    rules: a `ShardingRules`, or the `(pattern, spec)` pairs for one.
    mesh: if given, also check each spec against it.

  Returns:
    A tree like `params` with a `PartitionSpec` for each leaf.
  """
  with errors.entry("param_specs"):
    _check_params_rules_mesh(params, rules, mesh, "param_specs", optional_mesh=True)
    report = _explain(params, rules, mesh)
  return jax.tree.unflatten(jax.tree.structure(params), [p.spec for p in report.params])


def param_shardings(
  params: PyTree,
  mesh: Mesh,
  rules: ShardingRules | Iterable[tuple[str, Any]],
  *,
  return_unmatched: bool = False,
) -> PyTree | tuple[PyTree, list[str]]:
  """The tree of `NamedSharding`s for `params` on `mesh`, by `rules`.

  Pass it as `out_shardings` of a jitted init, so each parameter is created
  where it belongs, and as `in_shardings` of the step:

  >>> from jax.sharding import AxisType, PartitionSpec as P
  >>> # Needs 8 devices (on a CPU: jax.config.update("jax_num_cpu_devices", 8)).
  >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  >>> f = hk.transform(lambda x: hk.Linear(16)(x))
  >>> key, x = jax.random.PRNGKey(0), jnp.ones([8, 4])
  >>> shapes = jax.eval_shape(f.init, key, x)
  >>> shardings = hkb.param_shardings(shapes, mesh,
  ...                                 [(r"linear/w$", P(None, "data"))])
  >>> params = jax.jit(f.init, out_shardings=shardings)(key, x)
  >>> params["linear"]["w"].sharding.spec
  P(None, 'data')

  Args:
    params: a params tree (arrays or `ShapeDtypeStruct`s).
    mesh: the device mesh.
    rules: a `ShardingRules`, or the `(pattern, spec)` pairs for one.
    return_unmatched: also return the paths no rule matched.

  Returns:
    A tree like `params` with a `NamedSharding` for each leaf; with
    `return_unmatched`, `(shardings, unmatched_paths)`.

  Raises:
    ValueError: a spec with more axes than its parameter, or a mesh axis
      the mesh lacks, used twice, or not dividing its dimension; the message
      names the parameter and the rule.
  """
  with errors.entry("param_shardings"):
    _check_params_rules_mesh(params, rules, mesh, "param_shardings")
    report = _explain(params, rules, mesh)
  shardings = jax.tree.unflatten(
    jax.tree.structure(params), [NamedSharding(mesh, p.spec) for p in report.params]
  )
  if return_unmatched:
    return shardings, report.unmatched
  return shardings


def gather_over(tree: PyTree, axes: str | Sequence[str]) -> PyTree:
  """Each array of `tree` all-gathered over the mesh `axes`: FSDP's gather.

  Under FSDP a weight is stored split over the data axis, and each layer
  gathers it just before use. Under Explicit mesh axes the gather is
  written in the model: this returns each array resharded to its own spec
  with `axes` left out (`P("data", "model")` -> `P(None, "model")`), so a
  tensor-parallel split stays. Arrays not split over `axes` pass through,
  and so does everything with no mesh or with Auto axes, where the spec is
  not part of the type and the partitioner places the gathers itself; so
  the same model runs on one device, on an Auto mesh and on an Explicit one.

  Call it inside the layer that uses the weights (inside a `layer_scan`
  layer, not around the scan, so one layer is gathered at a time). In a
  pure function: `params = hkb.gather_over(params, "data")`; in a Haiku
  layer, a custom getter:

  >>> def layer(h):
  ...   with hk.custom_getter(lambda next_getter, value, context:
  ...                         hkb.gather_over(next_getter(value), "data")):
  ...     return h + hk.Linear(h.shape[-1])(h)
  >>> f = hk.transform(lambda x: hkb.repeat_layer(layer, x, 4))
  >>> key, x = jax.random.PRNGKey(0), jnp.ones([8, 16])
  >>> from jax.sharding import AxisType, PartitionSpec as P
  >>> # Needs 8 devices (on a CPU: jax.config.update("jax_num_cpu_devices", 8)).
  >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  >>> rules = hkb.ShardingRules([(r"w$", P("data"))],
  ...                           stacked=["__layer_stack_no_per_layer"])
  >>> with jax.set_mesh(mesh):
  ...   shardings = hkb.param_shardings(jax.eval_shape(f.init, key, x), mesh,
  ...                                   rules)
  ...   params = jax.jit(f.init, out_shardings=shardings)(key, x)
  ...   y = jax.jit(f.apply)(params, None, jax.device_put(x, P("data")))
  >>> params["__layer_stack_no_per_layer/linear"]["w"].sharding.spec
  P(None, 'data')
  >>> y.sharding.spec
  P('data', None)

  Args:
    tree: arrays (or tracers).
    axes: a mesh axis name, or several.

  Returns:
    `tree`, each array resharded without `axes` where its type names them.
  """
  with errors.entry("gather_over"):
    if (
      not isinstance(axes, Iterable)
      or isinstance(axes, bytes)
      or not all(isinstance(a, str) for a in axes)
      or (isinstance(axes, str) and not axes)
    ):
      raise TypeError(
        errors.bad_argument("axes", axes, "a mesh axis name, or a sequence of them, e.g. \"data\"")
      )
    axes = (axes,) if isinstance(axes, str) else tuple(axes)

    def gather(x):
      sharding = jax.typeof(x).sharding
      _check_axes_in_mesh(axes, sharding.mesh)
      spec = sharding.spec
      gathered = PartitionSpec(*(entry_without(entry, axes) for entry in spec))
      if tuple(gathered) == tuple(spec):
        return x
      return typed_sharding.reshard(x, tuple(gathered))

    return jax.tree.map(gather, tree)


def _check_axes_in_mesh(axes: tuple[str, ...], mesh: Any) -> None:
  """Every axis of `gather_over` is one of the mesh's, where one is known."""
  names = tuple(getattr(mesh, "axis_names", ()) or ())
  if not names and hasattr(jax.sharding, "get_abstract_mesh"):
    names = tuple(jax.sharding.get_abstract_mesh().axis_names or ())
  unknown = [a for a in axes if a not in names]
  if names and unknown:
    raise ValueError(
      errors.message(
        f"`axes` names mesh axis {unknown[0]!r}, which the mesh lacks; the mesh has axes {names}."
      )
    )


# ---------------------------------------------------------------------------


def _as_rules(rules) -> ShardingRules:
  return rules if isinstance(rules, ShardingRules) else ShardingRules(rules)


def _check_mesh_arg(mesh: Any, *, optional: bool = False, hint: str = "") -> None:
  if (mesh is None and optional) or isinstance(mesh, MESH_TYPES):
    return
  raise TypeError(
    errors.bad_argument(
      "mesh",
      mesh,
      "a jax.sharding.Mesh (e.g. from jax.make_mesh)" + (" or None" if optional else ""),
      hint,
    )
  )


def _check_params_rules_mesh(
  params: Any, rules: Any, mesh: Any, api: str, optional_mesh: bool = False
) -> None:
  """The arguments shared by the three sharding functions, in their order."""
  order = (
    f"The order is {api}(params, rules, mesh=mesh)."
    if optional_mesh
    else f"The order is {api}(params, mesh, rules)."
  )
  if isinstance(rules, MESH_TYPES) and isinstance(mesh, ShardingRules):
    raise TypeError(
      errors.message(
        "`mesh` and `rules` are swapped (got a ShardingRules for `mesh` and "
        f"a Mesh for `rules`). {order}"
      )
    )
  if params is None or isinstance(params, (ShardingRules, *MESH_TYPES)):
    raise TypeError(
      errors.bad_argument(
        "params",
        params,
        "a params tree (arrays or jax.ShapeDtypeStructs, e.g. jax.eval_shape(f.init, key, x))",
        order,
      )
    )
  if isinstance(rules, MESH_TYPES) or rules is None:
    raise TypeError(
      errors.bad_argument(
        "rules", rules, "a ShardingRules, or a list of (pattern, spec) pairs", order
      )
    )
  _check_mesh_arg(mesh, optional=optional_mesh, hint=order)


def _check_stacked(stacked: Any) -> dict[str, MeshAxes]:
  """`ShardingRules(stacked=...)` as `{pattern: mesh axes}`."""
  if isinstance(stacked, str):
    raise TypeError(
      errors.message(
        f"`stacked` is the string {stacked!r}; pass a list of stack "
        f"patterns, e.g. stacked=[{stacked!r}]."
      )
    )
  if not isinstance(stacked, Iterable):
    raise TypeError(
      errors.bad_argument(
        "stacked", stacked, "a list of stack patterns, or a dict {pattern: mesh axes}"
      )
    )
  if not isinstance(stacked, Mapping):
    stacked = {s: None for s in stacked}
  for pattern, axes in stacked.items():
    if not isinstance(pattern, str):
      raise TypeError(
        errors.message(
          f"`stacked` holds the pattern {pattern!r}; each stack pattern must "
          "be a regex string, e.g. 'blocks'."
        )
      )
    if not (
      axes is None
      or isinstance(axes, str)
      or (isinstance(axes, (tuple, list)) and axes and all(isinstance(a, str) for a in axes))
    ):
      raise TypeError(
        errors.message(
          f"`stacked` maps {pattern!r} to {errors.got(axes)}; map each stack "
          "to the mesh axes of its layer axis: None (every device holds every "
          "layer), an axis name such as 'data', or a tuple of names."
        )
      )
  return {p: tuple(a) if isinstance(a, list) else a for p, a in stacked.items()}


def _check_foreign_init(init: Any) -> None:
  """`from_foreign`'s `init`: a function (`f.init`) or an `hk.Transformed*`."""
  if callable(getattr(init, "init", init)):
    return
  hint = (
    "It holds arrays: the params `init` returns (e.g. from "
    "jax.eval_shape(f.init, key, x)), where the function itself "
    "belongs. "
    if jax.tree.leaves(init)
    else ""
  )
  raise TypeError(
    errors.bad_argument(
      "init",
      init,
      "the init function (f.init) or the hk.Transformed, followed by its arguments",
      hint + "Write hkb.ShardingRules.from_foreign(f.init, key, x).",
    )
  )


def _check_logical_axis_rules(rules: Any) -> Optional[tuple[tuple[str, Any], ...]]:
  """`logical_axis_rules`: None or `(name, mesh axes)` pairs, as Flax's."""
  if rules is None:
    return None
  wants = (
    "None or a sequence of Flax logical axis rules, (logical name, "
    "mesh axes) pairs such as [(\"embed\", \"model\"), (\"batch\", "
    "\"data\")]"
  )
  if isinstance(rules, (str, bytes, Mapping)) or not isinstance(rules, Iterable):
    raise TypeError(
      errors.bad_argument(
        "logical_axis_rules",
        rules,
        wants,
        "For a dict, pass list(rules.items())." if isinstance(rules, Mapping) else "",
      )
    )
  rules = tuple(rules)
  for i, rule in enumerate(rules):
    if not (
      isinstance(rule, (tuple, list))
      and len(rule) == 2
      and isinstance(rule[0], str)
      and _is_mesh_axes(rule[1])
    ):
      raise TypeError(
        errors.message(f"`logical_axis_rules` must be {wants}; rule {i} is {rule!r:.80}.")
      )
  return tuple((name, axes) for name, axes in rules)


def _is_mesh_axes(axes: Any) -> bool:
  """None, a mesh axis name, or a sequence of them (as Flax takes)."""
  if axes is None or isinstance(axes, str):
    return True
  return isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes)


def _to_rule(index: int, rule: Any) -> Rule:
  if (
    isinstance(rule, (str, PartitionSpec)) or not isinstance(rule, (tuple, list)) or len(rule) != 2
  ):
    example = rule if isinstance(rule, str) else "pattern"
    rule_text = spec_str(rule) if isinstance(rule, PartitionSpec) else repr(rule)
    raise TypeError(
      errors.message(
        f"rule {index} is {rule_text}, not a (pattern, spec) pair. Write "
        f"each rule as a pair: ({example!r}, P(None, 'model')) to split its "
        f"parameters, ({example!r}, P()) to replicate them."
      )
    )
  pattern, spec = rule
  if not isinstance(pattern, str):
    raise TypeError(
      errors.message(f"rule {index} has pattern {pattern!r}; it must be a regex string.")
    )
  if isinstance(spec, (tuple, list)) and not isinstance(spec, PartitionSpec):
    spec = PartitionSpec(*spec)
  if not isinstance(spec, PartitionSpec):
    raise TypeError(
      errors.message(
        f"rule {index} ({pattern!r}) has spec {spec!r}; it must be a "
        "jax.sharding.PartitionSpec (P() to replicate)."
      )
    )
  return Rule(pattern, spec)


def _compile(pattern: str, what: str) -> re.Pattern[str]:
  try:
    return re.compile(pattern)
  except re.error as e:
    raise ValueError(errors.message(f"{what} is not a valid regex: {e}.")) from None


def _path_string(path: tuple[Any, ...]) -> str:
  """`bundle/name` for Haiku params; keys joined by `/` for any pytree."""
  return jax.tree_util.keystr(path, simple=True, separator="/")
