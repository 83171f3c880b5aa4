"""The pipeline as a drop-in for the plain stack: a pairwise grid of everything a user may combine.

Ground truth is the same stack without `pipeline=`, jitted on one device, in
the same dtype: its loss, gradients and second derivative (a Hessian-vector
product: grad of grad), and its init. Twelve factors (mesh axis types, param
placement, batch placement, carry/xs/ys, schedule, microbatches, dtype,
stages, remat with or without a `remat_policy`, `unroll`, where the stack
runs, what is differentiated) would make 311,040 cells; `pairwise` picks
rows in which every pair of settings of every two factors occurs (bugs seen
so far needed two settings at once: an Explicit mesh and params as init
returns them), counted by brute force in `test_rows_cover_every_pair`, and
the rows of issue 26's failures are pinned in whole. Each cell compiles one
function, the plain stack's init checked beside it.

The seven factors that meet where arrays move between the layers' order and
the stages' placement and in and out of microbatches (axis type, batch placement,
carry/xs/ys, schedule, microbatches, stages, and params as init returns
them or stored over the stages) are run whole, all 576 combinations,
traced only (`jax.eval_shape`: a six-way bug is a type error
at trace time, as issue 34's `ys` reshape was): each gives init and
`value_and_grad` of apply the plain stack's shapes, dtypes and shardings,
the stack's outputs included.
"""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import functools
import itertools
from typing import Any, Optional

from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import haiku_bridge as hkb
from haiku_bridge._src import pipeline as pipeline_lib
from testing import pairwise

KEY = jax.random.PRNGKey(0)
DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
LAYERS, BATCH, WIDTH, HIDDEN = 8, 8, 8, 16
DATA = 2  # Devices over the batch; the rest of 8 / stages is "model".

FACTORS = {
  "axis_type": ("auto", "explicit"),
  # As init returns them; the layer axis over the stages; and FSDP +
  # tensor-parallel rules (docs/sharding.md) on top.
  "params": ("init", "stage", "fsdp_tp"),
  "batch": ("replicated", "data"),
  # Carry only (`repeat_layer`), per-layer `xs`, per-example `ys`.
  "io": ("carry", "xs", "ys"),
  "schedule": ("gpipe", "circular"),
  # "over": more microbatches than a data shard has rows (1 row each).
  "microbatches": ("1", "S", "2S", "over"),
  "dtype": ("float32", "bfloat16"),
  "stages": (1, 2, 4),
  # "dots": remat=True with a `remat_policy` that keeps the matmuls.
  "remat": (False, True, "dots", "nested", "binomial"),
  # `jax.lax.scan`'s, for the loop of each visit (and of the plain stack).
  "unroll": (1, 2, True),
  # The stack in a plain transform, inside `hkb.custom_vjp`, inside
  # `call_pure(hk.transform)`; or each layer an `hkb.custom_vjp`.
  "where": ("plain", "custom_vjp", "call_pure", "vjp_layer"),
  # What is computed: the loss, its gradient, or the gradient of
  # <gradient, params>: a Hessian-vector product.
  "derivative": ("apply", "grad", "grad_of_grad"),
}


def _row(**settings):
  row = dict(
    axis_type="explicit",
    params="init",
    batch="replicated",
    io="carry",
    schedule="gpipe",
    microbatches="S",
    dtype="float32",
    stages=4,
    remat=False,
    unroll=1,
    where="plain",
    derivative="grad",
  )
  row.update(settings)
  return row


# Issue 26's failures, each a cell of its own (the pairwise rows need not
# hold their triples).
ISSUE_ROWS = (
  _row(),  # 1: Explicit axes, params as init returns them, grad.
  _row(io="ys", microbatches="2S"),  # 2, 9: ys under Explicit axes.
  _row(params="stage", batch="data", microbatches="over"),  # 3.
  _row(axis_type="auto", stages=1, batch="data"),  # 5: one stage.
  _row(axis_type="auto", dtype="bfloat16"),  # 6.
  _row(where="custom_vjp", params="stage"),  # 7: init with no mesh.
  _row(derivative="grad_of_grad"),
)


def jax_fails(row) -> bool:
  """The cells where jax 0.10.2 itself fails (`test_jax_failure_pinned`).

  The second derivative of a layer with a `jax.custom_vjp` of its own (its
  residuals a `jax.vjp` closure), in a remat schedule's scan, inside the
  `lax.scan` of a `shard_map` (stages > 1): jax checks the closure's
  cotangents against another residual's type. The same failure in pure
  JAX: `jax_failure_without_the_bridge`, which passes with
  `check_vma=False` and with `jnp.tanh` in place of `jax.nn.gelu`.
  """
  return (
    row["where"] == "vjp_layer"
    and row["remat"] in ("nested", "binomial")
    and row["derivative"] == "grad_of_grad"
    and row["stages"] > 1
  )


# What jax says in the cells of `jax_fails`: one residual taken for another,
# (8, 16) for (8, 8): "Expected cotangent type" on jax 0.10, "expected ..." on
# 0.9, "mul got incompatible shapes" on 0.7.
JAX_FAILURE = "(?i)expected cotangent type|incompatible shapes"
JAX_RELEASE = tuple(int(part) for part in jax.__version__.split(".")[:2])


def jax_failure_without_the_bridge(activation=jax.nn.gelu, check_vma: bool = True) -> None:
  """The failure of `jax_fails` in pure JAX: a layer under two custom_vjps.

  The inner one's residuals are its `jax.vjp` closure (as `hkb.vjp_fwd`
  makes them); the outer one's forward rule runs the inner one and its
  backward rule recomputes the layer with `jax.vjp` (as a remat schedule's
  sweeps do, `scheduled_scan.py`). Two steps of a `lax.scan` (the
  timetable) in a `jax.shard_map` over 2 stages, the carry varying over
  them; the gradient of a Hessian-vector product, traced.
  """

  def layer(w, h):
    return h + activation(h @ w[0]) @ w[1]

  inner = jax.custom_vjp(layer)
  inner.defvjp(lambda w, h: jax.vjp(layer, w, h), lambda vjp_fn, g: vjp_fn(g))
  outer = jax.custom_vjp(layer)
  outer.defvjp(lambda w, h: (inner(w, h), (w, h)), lambda res, g: jax.vjp(layer, *res)[1](g))

  def stage(w, h):
    w = jax.tree.map(lambda a: a[0], w)
    h = jax.lax.pcast(h, "stage", to="varying")  # As the timetable's carry.
    return jax.lax.scan(lambda h, _: (outer(w, h), None), h, length=2)[0]

  mesh = jax.make_mesh((2,), ("stage",), axis_types=(AxisType.Auto,))

  def loss(w, h):
    out = jax.shard_map(
      stage, mesh=mesh, in_specs=(P("stage"), P()), out_specs=P("stage"), check_vma=check_vma
    )(w, h)
    return jnp.sum(out**2)

  def hessian_vector_product(w, h):
    grads = jax.grad(loss)(w, h)
    return sum(jnp.vdot(g, jax.lax.stop_gradient(v)) for g, v in zip(grads, w))

  w = (jnp.ones([2, 4, 8]), jnp.ones([2, 8, 4]))
  jax.eval_shape(jax.grad(hessian_vector_product), w, jnp.ones([2, 4]))


ROWS = pairwise.pairwise(FACTORS, required=ISSUE_ROWS, allowed=lambda row: not jax_fails(row))


def _name(row) -> str:
  return "_".join(f"{value}" for value in row.values()).replace(".", "")


def _identity_bwd(vjp_fn, g):
  return vjp_fn(g)


def layer(h):
  """A residual MLP whose weights FSDP + tensor-parallel rules may split."""
  d = h.shape[-1]
  init = hk.initializers.RandomNormal(0.3)
  params = {
    "w1": hk.get_parameter("w1", [d, HIDDEN], init=init),
    "w2": hk.get_parameter("w2", [HIDDEN, d], init=init),
  }
  params = hkb.gather_over(params, "data")  # FSDP's gather, where split.
  z = jax.nn.gelu(h @ params["w1"])
  # Under Explicit axes, a matmul contracting a split axis names its output.
  return h + jnp.dot(z, params["w2"], out_sharding=jax.typeof(h).sharding)


def model(row, pipeline=None, outputs=False) -> hk.Transformed:
  """`loss(x, xs)` of the stack of `row`: plain without `pipeline`.

  With `outputs`, `(loss, (out, ys))`: the stack's outputs beside it.
  """
  io, where = row["io"], row["where"]
  one = hkb.custom_vjp(layer, hkb.vjp_fwd, _identity_bwd) if where == "vjp_layer" else layer
  remat = row["remat"]
  options = dict(
    name="blocks", remat=remat != "dots" and remat, unroll=row["unroll"], pipeline=pipeline
  )
  if remat == "dots":
    options.update(remat=True, remat_policy=DOTS)

  def stack(x, xs):
    if io == "carry":
      return hkb.repeat_layer(one, x, LAYERS, **options)
    if io == "xs":
      return hkb.layer_scan(lambda c, s: (one(c + s), None), x, xs, **options)[0]

    def with_y(c, _):
      c = one(c)
      return c, jnp.mean(c.astype(jnp.float32) ** 2, axis=-1)

    out, ys = hkb.layer_scan(with_y, x, num_layers=LAYERS, **options)
    return out, ys

  def loss(x, xs):
    if where == "custom_vjp":
      out = hkb.custom_vjp(stack, hkb.vjp_fwd, _identity_bwd)(x, xs)
    elif where == "call_pure":
      out = hkb.call_pure(hk.transform(stack), x, xs)
    else:
      out = stack(x, xs)
    out, ys = out if io == "ys" else (out, None)
    value = jnp.mean(out.astype(jnp.float32) ** 2)
    value = value if ys is None else value + jnp.mean(ys)
    return (value, (out, ys)) if outputs else value

  return hk.transform(loss)


def derivatives(f: hk.Transformed, derivative: str):
  """The loss of `f`, `(loss, grads)`, or a Hessian-vector product (grad of grad)."""

  def loss(params, x, xs):
    return f.apply(params, None, x, xs)

  def inner(params, x, xs):
    grads = jax.grad(loss)(params, x, xs)
    direction = jax.lax.stop_gradient(params)
    # Elementwise, then summed: a dot would contract split axes.
    return sum(
      jnp.sum(g.astype(jnp.float32) * v.astype(jnp.float32))
      for g, v in zip(jax.tree.leaves(grads), jax.tree.leaves(direction))
    )

  if derivative == "apply":
    return loss
  if derivative == "grad":
    return jax.value_and_grad(loss)
  return jax.grad(inner)


def inputs(dtype):
  x = jax.random.normal(jax.random.PRNGKey(1), [BATCH, WIDTH]).astype(dtype)
  xs = (jax.random.normal(jax.random.PRNGKey(2), [LAYERS, WIDTH]) / 4).astype(dtype)
  return x, xs


@functools.lru_cache(maxsize=None)
def reference(io: str, where: str, dtype: str, derivative: str) -> tuple[Any, Any]:
  """The plain stack's init (as init returns it) and `derivatives`, on one device."""
  row = dict(io=io, where=where, remat=False, unroll=1)
  f = model(row)
  x, xs = inputs(jnp.float32)
  params = jax.tree.map(lambda p: p.astype(dtype), f.init(KEY, x, xs))
  x, xs = inputs(dtype)
  return params, jax.device_get(jax.jit(derivatives(f, derivative))(params, x, xs))


def tolerance(dtype: str) -> dict[str, float]:
  # Microbatches sum a gradient in another order than the whole batch.
  if dtype == "bfloat16":
    return dict(rtol=5e-2, atol=1e-2, scaled_atol=5e-2)
  return dict(rtol=1e-4, atol=1e-6, scaled_atol=1e-4)


def assert_close(got, expected, rtol, atol, scaled_atol):
  """Leaf by leaf: atol at least `scaled_atol` × the leaf's largest magnitude."""

  def check(path, g, e):
    e = np.asarray(e, np.float32)
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    np.testing.assert_allclose(
      np.asarray(g, np.float32),
      e,
      rtol=rtol,
      atol=max(atol, scaled_atol * scale),
      err_msg=f"leaf {jax.tree_util.keystr(path)}",
    )

  jax.tree_util.tree_map_with_path(check, got, expected)


def microbatch_count(row) -> int:
  stages = row["stages"]
  return {"1": 1, "S": stages, "2S": 2 * stages, "over": BATCH}[row["microbatches"]]


def pipeline_of(row) -> hkb.Pipeline:
  repeats = 2 if row["schedule"] == "circular" else None
  return hkb.Pipeline("stage", microbatch_count(row), row["schedule"], repeats)


def mesh_of(row) -> jax.sharding.Mesh:
  stages = row["stages"]
  axis_type = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[row["axis_type"]]
  return jax.make_mesh(
    (stages, DATA, 8 // stages // DATA), ("stage", "data", "model"), axis_types=(axis_type,) * 3
  )


def skip_where_jax_refuses(axis_type: str) -> None:
  """Skips the test where this jax cannot pipeline (refused up front).

  Before jax 0.9, pipelines on Explicit axes are refused with the library's
  error (`pipeline_test.test_explicit_axes_before_jax_09`).
  """
  if axis_type == "explicit" and not pipeline_lib.jax_runs_stages_on_explicit_axes():
    raise absltest.SkipTest(
      f"jax {jax.__version__} cannot run a pipeline's stages on Explicit "
      "mesh axes; the library refuses it."
    )


# How each param placement is written (None: as init returns them).
RULES = {
  "init": None,
  "stage": hkb.ShardingRules([], stacked={"blocks": "stage"}),
  "fsdp_tp": hkb.ShardingRules(
    [(r"/w1$", P("data", "model")), (r"/w2$", P("model", "data"))], stacked={"blocks": "stage"}
  ),
}


def check_cell(row) -> None:
  """The pipelined stack of `row` against the plain one, on 8 devices."""
  skip_where_jax_refuses(row["axis_type"])
  f = model(row, pipeline_of(row))
  params, expected = reference(row["io"], row["where"], row["dtype"], row["derivative"])
  x, xs = inputs(jnp.float32)

  # Init needs no mesh and is the plain stack's (case 7: inside
  # custom_vjp too).
  init = jax.tree.map(lambda p: p.astype(row["dtype"]), f.init(KEY, x, xs))
  jax.tree.map(np.testing.assert_array_equal, init, params)

  mesh = mesh_of(row)
  rules = RULES[row["params"]]
  x, xs = inputs(row["dtype"])
  with jax.set_mesh(mesh):
    if rules is not None:
      params = jax.device_put(params, hkb.param_shardings(params, mesh, rules))
    if row["batch"] == "data":
      x = jax.device_put(x, NamedSharding(mesh, P("data")))
    got = jax.jit(derivatives(f, row["derivative"]))(params, x, xs)
  assert_close(got, expected, **tolerance(row["dtype"]))


# Where arrays move between the layers' order and the stages' placement and in and out of
# microbatches: every combination of these factors, traced.
# The params as init returns them and stored over the stages (issue 43):
# GPipe keeps a layer axis stored there, circular moves it.
PLACEMENT_FACTORS = {
  name: FACTORS[name] for name in ("axis_type", "batch", "io", "schedule", "microbatches", "stages")
}
PLACEMENT_FACTORS["params"] = ("init", "stage")
PLACEMENT_ROWS = [
  _row(**dict(zip(PLACEMENT_FACTORS, settings)))
  for settings in itertools.product(*PLACEMENT_FACTORS.values())
]


@dataclasses.dataclass(frozen=True)
class Type:
  """An array's type as traced: shape, dtype, sharding spec (None: none)."""

  shape: tuple[int, ...]
  dtype: Any
  spec: Optional[tuple[Any, ...]]


def types(tree) -> Any:
  def of(a):
    spec = None
    if a.sharding is not None:  # P("stage") is P("stage", None, ...).
      spec = tuple(a.sharding.spec)
      spec += (None,) * (len(a.shape) - len(spec))
    return Type(a.shape, a.dtype, spec)

  return jax.tree.map(of, tree)


def traced(row, pipelined: bool) -> Any:
  """The types of init's params and of `value_and_grad` of apply with the stack's outputs.

  Traced under `row`'s mesh, never compiled: params and batch as `row`
  places them.
  """
  f = model(row, pipeline_of(row) if pipelined else None, outputs=True)
  mesh = mesh_of(row)
  x, xs = inputs(jnp.float32)
  batch = P("data") if row["batch"] == "data" else P()
  x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, batch))
  xs = jax.ShapeDtypeStruct(xs.shape, xs.dtype)
  step = jax.value_and_grad(lambda p, x, xs: f.apply(p, None, x, xs), has_aux=True)
  with jax.set_mesh(mesh):
    params = placed_params(row, jax.eval_shape(f.init, KEY, x, xs))
    return types((params, jax.eval_shape(step, params, x, xs)))


def placed_params(row, params) -> Any:
  """`params` (shapes) placed as `row` says, under its mesh."""
  rules = RULES[row["params"]]
  if rules is None:
    return params
  return jax.tree.map(
    lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s),
    params,
    hkb.param_shardings(params, mesh_of(row), rules),
  )


def plain_traced(row) -> Any:
  """`traced` of the plain stack: the types the pipelined one must have."""
  if row["params"] == "stage" and row["axis_type"] == "explicit":
    # jax 0.10.2 scans no array over a leading axis split over an Explicit
    # mesh axis ("0th dimension of all xs should be replicated"), so the
    # plain stack is traced with the params as init returns them; its
    # params and their gradients are typed as placed.
    _, (value, _) = traced(dict(row, params="init"), pipelined=False)
    f = model(row, outputs=True)
    x, xs = inputs(jnp.float32)
    with jax.set_mesh(mesh_of(row)):
      placed = types(placed_params(row, jax.eval_shape(f.init, KEY, x, xs)))
    return placed, (value, placed)
  return traced(row, pipelined=False)


@absltest.skipUnless(
  pipeline_lib.jax_has_pipelines(), "pipelines need jax.shard_map and jax.set_mesh."
)
class PipelineGridTest(parameterized.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    if jax.device_count() < 8:
      raise absltest.SkipTest(f"needs 8 devices, jax has {jax.device_count()}.")

  def test_rows_cover_every_pair(self):
    # By brute force: every two factors, every two settings of theirs, in
    # some row that runs (`True` is not `1`: `unroll` has both).
    def same(value, setting):
      return type(value) is type(setting) and value == setting

    names = list(FACTORS)
    factor_pairs = list(itertools.combinations(names, 2))
    self.assertLen(factor_pairs, len(names) * (len(names) - 1) // 2)
    missing = [
      ((a, x), (b, y))
      for a, b in factor_pairs
      for x in FACTORS[a]
      for y in FACTORS[b]
      if not any(same(row[a], x) and same(row[b], y) for row in ROWS)
    ]
    self.assertEqual(missing, [])
    self.assertTrue(all(set(row) == set(names) for row in ROWS))
    self.assertFalse(any(jax_fails(row) for row in ROWS))

  @parameterized.named_parameters((_name(row), row) for row in ROWS)
  def test_cell(self, row):
    check_cell(row)

  def test_placement_rows_are_the_whole_product(self):
    self.assertLen(PLACEMENT_ROWS, 2 * 2 * 3 * 2 * 4 * 3 * 2)
    settings = {tuple(row[name] for name in PLACEMENT_FACTORS) for row in PLACEMENT_ROWS}
    self.assertEqual(settings, set(itertools.product(*PLACEMENT_FACTORS.values())))
    # None is one of jax's own failures (those need `vjp_layer`, a remat
    # schedule and grad of grad): every cell must trace.
    self.assertFalse(any(jax_fails(row) for row in PLACEMENT_ROWS))

  @parameterized.named_parameters(("auto", "auto"), ("explicit", "explicit"))
  def test_placement_factors_traced_whole(self, axis_type):
    skip_where_jax_refuses(axis_type)
    # One plain trace per (batch, io, stages, params), each pipelined cell
    # beside it.
    plain = {}
    wrong = []
    for row in PLACEMENT_ROWS:
      if row["axis_type"] != axis_type:
        continue
      key = (row["batch"], row["io"], row["stages"], row["params"])
      if key not in plain:
        plain[key] = plain_traced(row)
      expected = plain[key]
      try:
        got = traced(row, pipelined=True)
      except Exception as e:  # pylint: disable=broad-except
        wrong.append((_name(row), f"{type(e).__name__}: {e}"[:400]))
        continue
      if got != expected:
        wrong.append((_name(row), got, expected))
    self.assertEqual(wrong, [])

  def test_jax_failure_pinned(self):
    # When jax fixes it, this fails: drop `jax_fails` from the grid.
    row = _row(
      where="vjp_layer",
      remat="nested",
      derivative="grad_of_grad",
      axis_type="auto",
      stages=2,
      microbatches="1",
    )
    self.assertTrue(jax_fails(row))
    with self.assertRaisesRegex((ValueError, TypeError), JAX_FAILURE):
      check_cell(row)

  @absltest.skipIf(JAX_RELEASE < (0, 10), "reproduced on jax 0.10.2; not checked on older jax.")
  def test_jax_failure_reproduced_without_the_bridge(self):
    # When jax fixes it, this fails: check `test_jax_failure_pinned`, and
    # drop `jax_fails` and this program.
    with self.assertRaisesRegex(
      ValueError,
      r"Expected cotangent type float32\[2,8\]\{V:stage\} but "
      r"got float32\[2,4\]\{V:stage\}",
    ):
      jax_failure_without_the_bridge()
    # As in the grid: it needs jax's check of varying types, and gelu.
    jax_failure_without_the_bridge(check_vma=False)
    jax_failure_without_the_bridge(activation=jnp.tanh)


if __name__ == "__main__":
  absltest.main()
