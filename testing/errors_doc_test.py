"""docs/errors.md says what the code says: each documented error is raised here and compared.

Every row of the doc's tables (`| when | error |`) has a function below, under the row's "when"
text, that raises the error the row documents; the test compares `TypeName: message` with the row's text
exactly (a row that starts with `... ` documents the end of a message). A row without a function,
or a function without a row, fails the test, so the doc cannot drift from the code.

The doc shows what the pinned environment (requirements.txt) raises, and there the comparison is
exact. Three rows hold facts of the install: the jax version a message names and the error jax
raised, and the temporaries the remat plan (`_src/remat/plan.py`) predicts from XLA's compiles. On
another jax, those parts of the row are this install's (the version it runs, the least temporaries
of `hkb.remat_plan`'s own candidates, the parts `INSTALL_SLOTS` takes from the raised text) and the
rest must be the doc's word for word.
"""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import os
import re
import types
from typing import Any, Callable
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np

import haiku_bridge as hkb
from haiku_bridge._src import haiku_internals
from haiku_bridge._src.pipeline import config as pipeline_config

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DOC = os.path.join(_ROOT, "docs", "errors.md")
KEY = jax.random.PRNGKey(0)


def doc_rows() -> dict[tuple[str, str], str]:
  """`{(section, when): documented error}` from the tables of docs/errors.md."""
  rows = {}
  section = ""
  with open(_DOC) as f:
    for line in f:
      if line.startswith("## "):
        section = line[3:].strip()
      match = re.match(r"^\| (.+?) \| (`+) ?(.*?) ?\2 \|$", line.rstrip("\n"))
      if match and match[1] != "when":
        rows[(section, match[1])] = match[3]
  return rows


def init(fn: Callable[[], Any]) -> Any:
  return hk.transform(fn).init(KEY)


def dense(params, x):
  return x @ params["w"] + params["b"]


def init_dense(rng, x):
  return {"w": jax.random.normal(rng, [x.shape[-1], 5]), "b": jnp.zeros([5])}


def apply_with(fn, params_from, x_init, x_apply):
  f = hk.transform(fn)
  params = f.init(KEY, x_init)
  if params_from is not None:
    params = params_from(params)
  return f.apply(params, None, x_apply)


def mlp(x):
  return hk.nets.MLP([3, 2])(x)


def vjp_apply(fn, x, params_from=None, x_apply=None, grad=False):
  f = hk.transform(fn)
  params = f.init(KEY, x)
  if params_from is not None:
    params = params_from(params)
  x_apply = x if x_apply is None else x_apply
  if grad:
    return jax.grad(lambda p: jnp.sum(f.apply(p, None, x_apply)))(params)
  return f.apply(params, None, x_apply)


def mesh() -> Mesh:
  return Mesh(
    np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )


def outer_module_used_inside():
  lin = hk.Linear(2)
  block = hkb.custom_vjp(lambda x: lin(x), hkb.vjp_fwd, lambda r, g: r(g))
  return block(jnp.ones([2, 3]))


def shard_shaped(params):
  params = dict(params)
  params["proj"] = {"w": jnp.ones([4, 5])[:, :1], "b": params["proj"]["b"]}
  return params


def stateful(x):
  return hk.BatchNorm(True, True, 0.9)(x, is_training=True)


X4 = jnp.ones([2, 4])
SECTION_CALL = "`call_pure` and `get_relevant_parameters`"
SECTION_CUSTOM = "`custom_vjp` and `custom_jvp`"
SECTION_SCAN = "`layer_scan` and `repeat_layer`"
SECTION_TIME = "`scan` and `dynamic_unroll`"
SECTION_BUDGETED = "`budgeted_jit`"
SECTION_SHARDING = "Sharding rules"
SECTION_PIPELINE = "Pipelines"
SECTION_ADAPTERS = "Flax and Equinox adapters"
SECTION_INSTALL = "Installation"
# The rows that hold a fact of the install (the module docstring).
ROW_BUDGET = (
  SECTION_SCAN,
  "a budget below what any plan needs (`remat=\"auto\"`, `hkb.remat_plan`; where the "
  "loop sees no derivative around it, raised when its outputs are differentiated)",
)
ROW_CLOSED_OVER = (
  SECTION_PIPELINE,
  "a layer passing a closed-over array into its own scan, Explicit axes",
)
ROW_MAX_RECOMPUTE = (
  SECTION_SCAN,
  "a budget that only plans recomputing more than `max_recompute` fit "
  "(`remat=\"auto\"`, `hkb.remat_plan`; where the loop sees no derivative "
  "around it, raised when its outputs are differentiated)",
)
# Parts of a row that another jax words its own way, as patterns whose group is that part: the
# error jax raises inside (TypeError on the pinned jax, ValueError on 0.12) and a predicted figure.
INSTALL_SLOTS = {
  ROW_CLOSED_OVER: r"its own\): (\w+)\.",
  ROW_MAX_RECOMPUTE: r"The least budget within it is (\d+) bytes \(predicted\)",
}


def newer_haiku_without(name: str) -> None:
  """The check run on import, as on a dm-haiku 0.0.18 whose haiku._src.base lost `name`."""
  with mock.patch.object(haiku_internals.hk, "__version__", "0.0.18"):
    haiku_internals.check_haiku({haiku_internals._base: ("current_frame", name)})


def another_depth():
  stack = lambda n: hk.transform(lambda x: hkb.repeat_layer(lambda h: hk.Linear(4)(h), x, n))
  stack(4).apply(stack(3).init(KEY, X4), None, X4)


def jacfwd_through_jit_planned():
  """`jacfwd_through_jit`, the schedule planned by `remat="auto"` at the least budget."""
  w = jnp.eye(64) / 2
  step = lambda c, x: (jnp.tanh(c @ w + x), None)
  h, xs = jnp.zeros([8, 64]), jnp.ones([16, 8, 64])
  # Planned as the jitted loop is: `w`, closed over, compiled in.
  plans = []
  jax.eval_shape(lambda: plans.append(hkb.remat_plan(step, h, xs, memory_budget=2**30)))
  least = plans[0].least_budget
  jax.jacfwd(
    jax.jit(
      lambda s: jnp.sum(
        hkb.scan(step, h, s * xs, remat="auto", memory_budget=least, max_recompute=float("inf"))[0]
      )
    )
  )(1.0)


def meta_gradient_over_budget() -> None:
  def loss(w):
    h, _ = hkb.scan(
      lambda h, x: (jnp.tanh(h @ w + x), None),
      jnp.zeros([2, 4]),
      jnp.ones([8, 2, 4]),
      remat="auto",
      memory_budget=100,
    )
    return jnp.sum(h)

  jax.eval_shape(jax.grad(lambda w: jnp.sum(jax.grad(loss)(w))), jnp.eye(4))


def jacfwd_through_jit():
  def net(xs):
    linear = hk.Linear(4)
    return jnp.sum(
      hkb.scan(lambda c, x: (jnp.tanh(linear(c) + x), None), X4, xs, remat="nested")[0]
    )

  f = hk.transform(net)
  params = f.init(KEY, jnp.ones([3, 2, 4]))
  jax.jacfwd(jax.jit(lambda p: f.apply(p, None, jnp.ones([3, 2, 4]))))(params)


def sized_under_jit():
  sized = lambda r, x, n: {"w": jnp.zeros([x.shape[-1], int(n)])}
  f = hk.transform(lambda x, n: hkb.call_pure(lambda p, x, n: x @ p["w"], x, n, init=sized))
  params = f.init(KEY, X4, 3)
  jax.jit(f.apply)(params, None, X4, jnp.int32(3))


def needs_values(x):
  return hk.Linear(4)(x) if float(x.sum()) > 0 else x


def needs_values_under_jit():
  block = hkb.custom_vjp(needs_values, hkb.vjp_fwd, lambda r, g: r(g))
  f = hk.transform(lambda x: block(x))
  params = f.init(KEY, X4)
  jax.jit(f.apply)(params, None, X4)


def nnx_linear(rngs):
  from flax import nnx  # pylint: disable=g-import-not-at-top,import-outside-toplevel

  return nnx.Linear(4, 2, rngs=rngs)


def linen_call_with_rngs(rngs):
  import flax.linen as nn  # pylint: disable=g-import-not-at-top,import-outside-toplevel

  init(lambda: hkb.from_flax(nn.Dense(2))(X4, rngs=rngs))


def equinox_state_pair():
  import equinox as eqx  # pylint: disable=g-import-not-at-top,import-outside-toplevel

  model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch", mode="batch")
  hkb.from_equinox(model, state=(model, state))


def to_nnx(f, *args, **kwargs):
  from flax import nnx  # pylint: disable=g-import-not-at-top,import-outside-toplevel

  return hkb.to_nnx(f, *args, rngs=nnx.Rngs(0), **kwargs)


def stateful_params_without_state():
  f = hk.transform_with_state(stateful)
  hkb.to_equinox(f, X4, params=f.init(KEY, X4)[0])


def adapters_installed() -> bool:
  try:
    import equinox  # noqa: F401  # pylint: disable=g-import-not-at-top,import-outside-toplevel,unused-import
    import flax  # noqa: F401  # pylint: disable=g-import-not-at-top,import-outside-toplevel,unused-import
  except ImportError:
    return False
  return True


def stack_leaf(num_layers: int) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((num_layers, 16), jnp.float32)


def cost_of(stack_params: Any, **options: Any) -> Any:
  """`hkb.pipeline_cost` of 4 stages × 2 data devices, 4 microbatches of a batch of 32."""
  return hkb.pipeline_cost(
    hkb.Pipeline("stage", 4),
    jax.sharding.AbstractMesh((4, 2), ("stage", "data")),
    stack_params,
    jax.ShapeDtypeStruct((32, 16), jnp.float32),
    **options,
  )


def pipelined(num_layers: int, pipeline: Any, mesh_shape: dict[str, int]) -> None:
  """Applies a pipelined stack of `num_layers` to a batch of 2 under a mesh of `mesh_shape`."""
  f = hk.transform(
    lambda x: hkb.repeat_layer(lambda h: hk.Linear(4)(h), x, num_layers, pipeline=pipeline)
  )
  params = f.init(KEY, X4)
  shape = dict(mesh_shape, rest=8 // np.prod(list(mesh_shape.values()), dtype=int))
  with jax.set_mesh(jax.make_mesh(tuple(shape.values()), tuple(shape))):
    f.apply(params, None, X4)


def pipelined_scan(layer: Callable[..., Any], carry: Any, pipeline: Any) -> None:
  """Applies a pipelined `layer_scan` of 4 layers to `carry` on 2 stages."""
  f = hk.transform(lambda c: hkb.layer_scan(layer, c, num_layers=4, pipeline=pipeline))
  params = f.init(KEY, carry)
  with jax.set_mesh(jax.make_mesh((2, 4), ("stage", "rest"))):
    f.apply(params, None, carry)


RAISERS: dict[tuple[str, str], Callable[[], Any]] = {
  # call_pure and get_relevant_parameters.
  (SECTION_CALL, "called outside a transform"): lambda: hkb.call_pure(dense, X4, init=init_dense),
  (SECTION_CALL, "a pure `fn` without `init=`"): lambda: init(lambda: hkb.call_pure(dense, X4)),
  (SECTION_CALL, "an `hk.Transformed` `fn` and `init=`"): lambda: init(
    lambda: hkb.call_pure(hk.transform(mlp), X4, init=init_dense)
  ),
  (SECTION_CALL, "`init` returns a leaf that is not an array"): lambda: init(
    lambda: hkb.call_pure(dense, X4, init=lambda r, x: {"b": 0})
  ),
  (SECTION_CALL, "`init` calls `hk.get_parameter` itself"): lambda: init(
    lambda: hkb.call_pure(
      dense, X4, init=lambda r, x: {"w": hk.get_parameter("w", [1], init=jnp.ones)}
    )
  ),
  (SECTION_CALL, "`f.init(None, ...)` with an `init` that needs its key"): lambda: hk.transform(
    lambda x: hkb.call_pure(dense, x, init=init_dense)
  ).init(None, X4),
  (SECTION_CALL, "two leaves map to one param"): lambda: init(
    lambda: hkb.call_pure(
      lambda p, x: x, X4, init=lambda r, x: {"layers": [jnp.ones(1)], "layers_0": jnp.ones(1)}
    )
  ),
  (SECTION_CALL, "two calls map to one param"): lambda: init(
    lambda: [
      hkb.call_pure(lambda p, x: x, X4, init=lambda r, x: {"b": jnp.ones(1)}) for _ in range(2)
    ]
  ),
  (SECTION_CALL, "a key that is not a module name"): lambda: init(
    lambda: hkb.call_pure(lambda p, x: x, X4, init=lambda r, x: {"my-layer": {"w": jnp.ones(1)}})
  ),
  (SECTION_CALL, "a param name with `/`"): lambda: init(
    lambda: hkb.call_pure(lambda p, x: x, X4, init=lambda r, x: {"a/w": jnp.ones(1)})
  ),
  (SECTION_CALL, "at init inside a raw JAX transform"): lambda: init(
    lambda: jax.vmap(lambda x: hkb.call_pure(dense, x, init=init_dense))(jnp.ones([3, 2, 4]))
  ),
  (SECTION_CALL, "a param missing at apply"): lambda: apply_with(
    lambda x: hkb.call_pure(dense, x, init=init_dense, name="proj"),
    lambda p: {"proj": {"w": p["proj"]["w"]}},
    X4,
    X4,
  ),
  (SECTION_CALL, "a param of the wrong shape at apply"): lambda: apply_with(
    lambda x: hkb.call_pure(
      dense, x, init=lambda r, x: init_dense(r, x) | {"w": jnp.ones([4, 5])}, name="proj"
    ),
    lambda p: {"proj": p["proj"] | {"w": jnp.ones([4, 6])}},
    X4,
    X4,
  ),
  (SECTION_CALL, "the same, where the shape looks like one device's shard"): lambda: apply_with(
    lambda x: hkb.call_pure(dense, x, init=init_dense, name="proj"), shard_shaped, X4, X4
  ),
  (SECTION_CALL, "a stateful Haiku function as `init=`"): lambda: init(
    lambda: hkb.call_pure(lambda p, x: x, X4, init=hk.transform_with_state(stateful))
  ),
  (SECTION_CALL, "`init` fails (here `fn` and `init` swapped)"): lambda: init(
    lambda: hkb.call_pure(init_dense, X4, init=dense)
  ),
  (
    SECTION_CALL,
    "`init` needs values its arguments do not have at apply (under `jax.jit`)",
  ): lambda: sized_under_jit(),
  (SECTION_CALL, "`name=` not a string"): lambda: init(
    lambda: hkb.call_pure(dense, X4, init=init_dense, name=3)
  ),
  (SECTION_CALL, "an `hk.multi_transform` result"): lambda: init(
    lambda: hkb.call_pure(hk.multi_transform(lambda: (lambda x: x, (lambda x: x,))), X4)
  ),
  # custom_vjp and custom_jvp.
  (SECTION_CUSTOM, "a param missing at apply"): lambda: vjp_apply(
    lambda x: hkb.custom_vjp(mlp, hkb.vjp_fwd, lambda r, g: r(g))(x),
    X4,
    lambda p: {k: v for k, v in p.items() if "linear_0" not in k},
  ),
  (SECTION_CUSTOM, "a param of the wrong shape at apply"): lambda: vjp_apply(
    lambda x: hkb.custom_vjp(mlp, hkb.vjp_fwd, lambda r, g: r(g))(x),
    X4,
    lambda p: p | {"mlp/~/linear_0": {"w": jnp.ones([4, 2]), "b": jnp.ones([3])}},
  ),
  (SECTION_CUSTOM, "a module created outside `f`, used inside"): lambda: init(
    outer_module_used_inside
  ),
  (SECTION_CUSTOM, "`f` needs the values of its array arguments (under `jax.jit`)"): lambda: (
    needs_values_under_jit()
  ),
  (SECTION_CUSTOM, "keyword arguments"): lambda: init(
    lambda: hkb.custom_vjp(mlp, hkb.vjp_fwd, lambda r, g: r(g))(x=X4)
  ),
  (SECTION_CUSTOM, "`bwd` returns the wrong number of cotangents"): lambda: vjp_apply(
    lambda x: hkb.custom_vjp(mlp, hkb.vjp_fwd, lambda r, g: r(g)[:1])(x), X4, grad=True
  ),
  (SECTION_CUSTOM, "a cotangent of the wrong shape"): lambda: vjp_apply(
    lambda x: hkb.custom_vjp(mlp, hkb.vjp_fwd, lambda r, g: (r(g)[0], jnp.zeros([2, 5])))(x),
    X4,
    grad=True,
  ),
  (SECTION_CUSTOM, "`fwd` / `bwd` / `jvp` not a function"): lambda: hkb.custom_vjp(mlp, None, None),
  (SECTION_CUSTOM, "`split` / `combine` of `route_cotangents` not a function"): lambda: (
    hkb.route_cotangents(None, None)
  ),
  # layer_scan and repeat_layer.
  (SECTION_SCAN, "a layer that does not return `(carry, y)`"): lambda: init(
    lambda: hkb.layer_scan(lambda c, x: c, jnp.ones([2, 4]), num_layers=2)
  ),
  (SECTION_SCAN, "a carry that changes type"): lambda: init(
    lambda: hkb.layer_scan(lambda c, x: (hk.Linear(2)(c), None), jnp.ones([2, 4]), num_layers=2)
  ),
  (SECTION_SCAN, "`xs` without a leading layer axis"): lambda: init(
    lambda: hkb.layer_scan(lambda c, x: (c, None), jnp.ones([2]), jnp.ones([3, 2]), num_layers=2)
  ),
  (SECTION_SCAN, "no `num_layers` and no `xs`"): lambda: init(
    lambda: hkb.layer_scan(lambda c, x: (c, None), jnp.ones([2]))
  ),
  (SECTION_SCAN, "`num_layers` 0 or negative"): lambda: init(
    lambda: hkb.repeat_layer(lambda x: x, X4, 0)
  ),
  (SECTION_SCAN, "`num_layers` not an int (a bool, a float)"): lambda: init(
    lambda: hkb.repeat_layer(lambda x: x, X4, True)
  ),
  (
    SECTION_SCAN,
    "`remat` not `False`, `True`, `\"nested\"`, `\"binomial\"` or `\"auto\"`",
  ): lambda: init(lambda: hkb.repeat_layer(lambda x: x, X4, 3, remat=4)),
  (SECTION_SCAN, "`remat_groups` not a positive int"): lambda: init(
    lambda: hkb.layer_scan(
      lambda c, x: (c, None), X4, num_layers=3, remat="nested", remat_groups=2.5
    )
  ),
  (SECTION_SCAN, "`remat_groups` without a schedule"): lambda: init(
    lambda: hkb.layer_scan(lambda c, x: (c, None), X4, num_layers=3, remat=True, remat_groups=2)
  ),
  (
    SECTION_SCAN,
    "`remat=\"auto\"` without `memory_budget`, differentiated outside "
    "`hkb.budgeted_jit` (at init and in inference it runs plain)",
  ): lambda: unbudgeted_gradient(),
  (
    SECTION_BUDGETED,
    "no `memory_budget` where the backend does not say how much memory its device has (the CPU)",
  ): lambda: hkb.budgeted_jit(jax.grad(lambda w: jnp.sum(w**2)))(X4),
  (SECTION_BUDGETED, "`memory_budget` not a positive int"): lambda: hkb.budgeted_jit(
    jax.grad(lambda w: jnp.sum(w**2)), memory_budget="1GB"
  ),
  (
    SECTION_BUDGETED,
    "a step no plan fits (its bytes at the least plan, compiled, are named first)",
  ): lambda: budgeted_layers(memory_budget=100),
  (SECTION_BUDGETED, "a step over its budget with no `remat=\"auto\"` loop to plan"): lambda: (
    hkb.budgeted_jit(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w))), memory_budget=100)(
      jnp.ones([4, 4]), X4
    )
  ),
  (SECTION_SCAN, "`memory_budget` without `remat=\"auto\"`"): lambda: init(
    lambda: hkb.repeat_layer(lambda x: x, X4, 3, memory_budget=10**6)
  ),
  (SECTION_SCAN, "`memory_budget` not a positive int"): lambda: init(
    lambda: hkb.layer_scan(
      lambda c, x: (c, None), X4, num_layers=3, remat="auto", memory_budget=1e6
    )
  ),
  ROW_BUDGET: lambda: tanh_scan_plan(memory_budget=100),
  (
    SECTION_SCAN,
    "a budget below `remat=True`'s under a gradient of a gradient (`jax.grad` of "
    "a loss of `jax.grad`, `remat=\"auto\"`)",
  ): meta_gradient_over_budget,
  (SECTION_SCAN, "`hkb.remat_plan` of a function with other arguments than a scan's"): lambda: (
    hkb.remat_plan(lambda h, x: (h, None), X4, jnp.ones([8, 2, 4]), X4, memory_budget=10**6)
  ),
  (SECTION_SCAN, "`hkb.remat_plan` of a loop at init"): lambda: init(
    lambda: hkb.remat_plan(hkb.repeat_layer, lambda x: hk.Linear(4)(x), X4, 3, memory_budget=10**6)
  ),
  (SECTION_SCAN, "`hkb.remat_plan` of a loop given `remat=`"): lambda: hkb.remat_plan(
    hkb.scan, lambda h, x: (h, None), X4, jnp.ones([8, 2, 4]), memory_budget=10**6, remat="binomial"
  ),
  (SECTION_SCAN, "`hkb.remat_plan` of a loop of no steps"): lambda: hkb.remat_plan(
    hkb.scan, lambda h, x: (h, None), X4, jnp.ones([0, 2, 4]), memory_budget=10**6
  ),
  ROW_MAX_RECOMPUTE: lambda: hkb.remat_plan(
    lambda h, x: (jnp.tanh(h + x), jnp.sum(h**2)),
    jnp.zeros([2, 16]),
    jnp.ones([16, 2, 16]),
    memory_budget=2400,
  ),
  (SECTION_SCAN, "`max_recompute` without `remat=\"auto\"`"): lambda: init(
    lambda: hkb.repeat_layer(lambda x: x, X4, 3, max_recompute=3)
  ),
  (SECTION_SCAN, "`max_recompute` not a number ≥ 0"): lambda: init(
    lambda: hkb.layer_scan(
      lambda c, x: (c, None), X4, num_layers=3, remat="auto", memory_budget=10**6, max_recompute=-1
    )
  ),
  (SECTION_SCAN, "`unroll` or `reverse` of the wrong type"): lambda: init(
    lambda: hkb.layer_scan(lambda c, x: (c, None), X4, num_layers=3, unroll=-1)
  ),
  (SECTION_SCAN, "`xs` given to `repeat_layer`"): lambda: init(
    lambda: hkb.repeat_layer(lambda x: x, X4, 3, xs=jnp.ones([3]))
  ),
  (SECTION_SCAN, "an option `repeat_layer` does not have"): lambda: init(
    lambda: hkb.repeat_layer(lambda x: x, X4, 3, remat_group=2)
  ),
  (SECTION_SCAN, "`remat_policy` without `remat=True` or `\"auto\"`"): lambda: init(
    lambda: hkb.layer_scan(
      lambda c, x: (c, None),
      X4,
      num_layers=2,
      remat_policy=jax.checkpoint_policies.everything_saveable,
    )
  ),
  (SECTION_SCAN, "stacked params made for another number of layers"): lambda: another_depth(),
  (SECTION_SCAN, "a pure layer without `init=`"): lambda: init(
    lambda: hkb.repeat_layer(dense, X4, 2)
  ),
  (SECTION_SCAN, "`unstack_params` with a wrong stack name"): lambda: hkb.unstack_params(
    {"s/linear": {"w": jnp.ones([3, 3, 3])}}, stack="t", num_layers=3
  ),
  (SECTION_SCAN, "`unstack_params` with a wrong `num_layers`"): lambda: hkb.unstack_params(
    {"s/linear": {"w": jnp.ones([2, 3, 3])}}, stack="s", num_layers=3
  ),
  (SECTION_SCAN, "a `layer_scope` without `{i}`"): lambda: hkb.unstack_params(
    {"s/linear": {"w": jnp.ones([2, 3, 3])}}, stack="s", num_layers=2, layer_scope="block"
  ),
  (SECTION_SCAN, "`stack_params` with a `layer_scope` that matches no bundle"): lambda: (
    hkb.stack_params(
      {"layer_0/linear": {"w": jnp.ones([3])}}, stack="s", num_layers=1, layer_scope="layers_{i}"
    )
  ),
  (SECTION_SCAN, "`stack_params` with a layer index ≥ `num_layers`"): lambda: hkb.stack_params(
    {f"layer_{i}/linear": {"w": jnp.ones([3])} for i in (0, 5)}, stack="s", num_layers=2
  ),
  (SECTION_SCAN, "`stack_params` with a layer missing"): lambda: hkb.stack_params(
    {"layer_1/linear": {"w": jnp.ones([3])}}, stack="s", num_layers=2
  ),
  (SECTION_SCAN, "`stacked_init` with an int `in_axes`"): lambda: hkb.stacked_init(
    init_dense, 3, in_axes=0
  ),
  # scan and dynamic_unroll.
  (SECTION_TIME, "`f` that does not return `(carry, y)`"): lambda: init(
    lambda: hkb.scan(lambda c, x: c, X4, jnp.ones([3, 2, 4]))
  ),
  (SECTION_TIME, "a carry that changes type"): lambda: init(
    lambda: hkb.scan(lambda c, x: (hk.Linear(2)(c), None), X4, jnp.ones([3]))
  ),
  (SECTION_TIME, "an `xs` leaf that is not an array with a time axis"): lambda: init(
    lambda: hkb.scan(lambda c, x: (c, None), X4, {"x": jnp.ones([3]), "t": 2})
  ),
  (SECTION_TIME, "`xs` leaves of different lengths, or not of `length`"): lambda: init(
    lambda: hkb.scan(lambda c, x: (c, None), X4, {"a": jnp.ones([3]), "b": jnp.ones([2])})
  ),
  (SECTION_TIME, "no `xs` and no `length`"): lambda: init(
    lambda: hkb.scan(lambda c, x: (c, None), X4, None)
  ),
  (SECTION_TIME, "`length` negative, or not an int"): lambda: init(
    lambda: hkb.scan(lambda c, x: (c, None), X4, None, length=-1)
  ),
  (SECTION_TIME, "`f` or `core` not a function"): lambda: init(
    lambda: hkb.dynamic_unroll(jnp.ones([3, 2, 4]), hk.LSTM(4), X4)
  ),
  (SECTION_TIME, "a flag that is not a bool"): lambda: init(
    lambda: hkb.dynamic_unroll(lambda x, s: (x, s), jnp.ones([3, 2, 4]), X4, time_major=0)
  ),
  (SECTION_TIME, "a core that does not return `(output, state)`"): lambda: init(
    lambda: hkb.dynamic_unroll(lambda x, s: x, jnp.ones([3, 2, 4]), X4)
  ),
  (SECTION_TIME, "a core whose state changes type"): lambda: init(
    lambda: hkb.dynamic_unroll(lambda x, s: (x, hk.Linear(2)(s)), jnp.ones([3, 2, 4]), X4)
  ),
  (SECTION_TIME, "batch-major inputs without a batch and a time axis"): lambda: init(
    lambda: hkb.dynamic_unroll(lambda x, s: (x, s), jnp.ones([3]), X4, time_major=False)
  ),
  (SECTION_TIME, "a step that creates params at init after the first step"): lambda: init(
    lambda: hkb.scan(lambda c, x: (hk.Linear(4)(c), None), X4, jnp.ones([3]))
  ),
  (SECTION_TIME, "an option the call does not take"): lambda: init(
    lambda: hkb.scan(lambda c, x: (c, None), X4, jnp.ones([3]), remat_group=2)
  ),
  (SECTION_TIME, "`readout_inputs` without `readout`"): lambda: init(
    lambda: hkb.dynamic_unroll(
      lambda x, s: (x, s), jnp.ones([3, 2, 4]), X4, readout_inputs=jnp.ones([3, 2])
    )
  ),
  (SECTION_TIME, "`jax.jacfwd(jax.jit(f))` through a schedule"): jacfwd_through_jit,
  (
    SECTION_TIME,
    "`jax.jacfwd(jax.jit(f))` through a schedule `remat=\"auto\"` chose",
  ): jacfwd_through_jit_planned,
  # Sharding rules.
  (SECTION_SHARDING, "a rule that is not a pair"): lambda: hkb.ShardingRules(["/w$"]),
  (SECTION_SHARDING, "`stacked=` a string"): lambda: hkb.ShardingRules([], stacked="blocks"),
  (SECTION_SHARDING, "a spec longer than its param"): lambda: hkb.param_specs(
    {"mlp": {"w": jnp.ones([16])}}, [(r"/w$", P(None, "model"))]
  ),
  (SECTION_SHARDING, "a mesh axis the mesh lacks"): lambda: hkb.param_shardings(
    {"mlp": {"w": jnp.ones([16, 8])}}, mesh(), [(r"/w$", P(None, "tensor"))]
  ),
  (SECTION_SHARDING, "a dimension the mesh axes do not divide"): lambda: hkb.param_shardings(
    {"mlp": {"w": jnp.ones([16, 6])}}, mesh(), [(r"/w$", P(None, "model"))]
  ),
  (SECTION_SHARDING, "a param under `stacked=` without a layer axis"): lambda: hkb.param_specs(
    {"blocks/mlp": {"b": jnp.ones([])}}, hkb.ShardingRules([], stacked=["blocks"])
  ),
  (
    SECTION_SHARDING,
    "a layer axis that `stacked=` maps to a mesh axis that does not divide it",
  ): lambda: hkb.param_shardings(
    {"blocks/mlp": {"w": jnp.ones([3, 8])}},
    mesh(),
    hkb.ShardingRules([], stacked={"blocks": "data"}),
  ),
  (SECTION_SHARDING, "`mesh` and `rules` swapped"): lambda: hkb.param_shardings(
    {"mlp": {"w": jnp.ones([8])}}, hkb.ShardingRules([]), mesh()
  ),
  (SECTION_SHARDING, "`from_foreign` given the params instead of `init`"): lambda: (
    hkb.ShardingRules.from_foreign(jax.eval_shape(hk.transform(mlp).init, KEY, X4), KEY, X4)
  ),
  (SECTION_SHARDING, "`logical_axis_rules` not (name, mesh axes) pairs"): lambda: (
    hkb.ShardingRules.from_foreign(
      hk.transform(mlp).init, KEY, X4, logical_axis_rules=[("embed", 3)]
    )
  ),
  (SECTION_SHARDING, "`gather_over` with an axis the mesh lacks"): lambda: hkb.gather_over(
    jax.device_put(jnp.ones([8]), jax.sharding.NamedSharding(mesh(), P("data"))), "dta"
  ),
  # Pipelines.
  (SECTION_PIPELINE, "`stack_params` of two stacks (leaves of different lengths)"): lambda: cost_of(
    {"w": stack_leaf(8), "b": stack_leaf(3)}
  ),
  (SECTION_PIPELINE, "`stack_params` with no array"): lambda: cost_of({}),
  (SECTION_PIPELINE, "`data_axes` not the mesh's"): lambda: cost_of(
    {"w": stack_leaf(8)}, data_axes=("model",)
  ),
  (SECTION_PIPELINE, "`num_layers` not a multiple of the stages"): lambda: pipelined(
    6, hkb.Pipeline("stage", 2), {"stage": 4}
  ),
  (SECTION_PIPELINE, "`num_layers` not a multiple of stages × `repeats`"): lambda: pipelined(
    6, hkb.Pipeline("stage", 2, "circular", repeats=2), {"stage": 2}
  ),
  (SECTION_PIPELINE, "a batch that `microbatches` does not divide"): lambda: pipelined(
    4, hkb.Pipeline("stage", 3), {"stage": 2}
  ),
  (SECTION_PIPELINE, "a carry leaf without a batch axis, in microbatches"): lambda: pipelined_scan(
    lambda c, _: ((hk.Linear(4)(c[0]), c[1] + 1), None),
    (X4, jnp.zeros([])),
    hkb.Pipeline("stage", 2),
  ),
  (SECTION_PIPELINE, "a `y` without a batch axis, in microbatches"): lambda: pipelined_scan(
    lambda c, _: (hk.Linear(4)(c), jnp.sum(c)), X4, hkb.Pipeline("stage", 2)
  ),
  (SECTION_PIPELINE, "a mesh without the stage axis"): lambda: pipelined(
    4, hkb.Pipeline("stage", 2), {"data": 2}
  ),
  (SECTION_PIPELINE, "apply without a mesh"): lambda: apply_with(
    lambda x: hkb.repeat_layer(lambda h: hk.Linear(4)(h), x, 4, pipeline=hkb.Pipeline("stage", 2)),
    lambda p: p,
    X4,
    X4,
  ),
  (SECTION_PIPELINE, "`pipeline=` not a `Pipeline`"): lambda: init(
    lambda: hkb.repeat_layer(lambda h: h, X4, 4, pipeline="stage")
  ),
  (SECTION_PIPELINE, "an unknown `schedule`"): lambda: hkb.Pipeline(schedule="1f1b"),
  (SECTION_PIPELINE, "`repeats` with the GPipe schedule"): lambda: hkb.Pipeline(repeats=2),
  (SECTION_PIPELINE, "a jax without `jax.shard_map` (before 0.7)"): lambda: jax_without_shard_map(
    hkb.Pipeline
  ),
  (SECTION_PIPELINE, "stages on Explicit mesh axes, jax 0.7 or 0.8"): lambda: (
    explicit_stages_on_jax_08()
  ),
  ROW_CLOSED_OVER: lambda: closed_over_array_into_a_scan(),
  # Flax and Equinox adapters.
  (SECTION_ADAPTERS, "`from_flax` of something that is not a module"): lambda: hkb.from_flax(3),
  (SECTION_ADAPTERS, "`method=` neither a name nor a function"): lambda: hkb.from_flax(
    nnx_linear, method=3
  ),
  (SECTION_ADAPTERS, "`intermediates=` not a name"): lambda: hkb.from_flax(
    nnx_linear, intermediates=3
  ),
  (SECTION_ADAPTERS, "`rng_streams=` with an NNX module"): lambda: hkb.from_flax(
    nnx_linear, rng_streams=("noise",)
  ),
  (SECTION_ADAPTERS, "a Linen call's `rngs=` that are not keys"): lambda: linen_call_with_rngs(
    {"dropout": 3}
  ),
  (SECTION_ADAPTERS, "`from_equinox`'s `state=` not an `eqx.nn.State`"): equinox_state_pair,
  (SECTION_ADAPTERS, "`to_nnx` / `to_equinox` of a function, not its `hk.transform`"): lambda: (
    to_nnx(mlp, X4)
  ),
  (SECTION_ADAPTERS, "`state=` without `params=`"): lambda: to_nnx(hk.transform(mlp), X4, state={}),
  (
    SECTION_ADAPTERS,
    "`params=` of a function with state, without `state=`",
  ): stateful_params_without_state,
  (SECTION_ADAPTERS, "`params=` of another model"): lambda: to_nnx(
    hk.transform(mlp), X4, params=hk.transform(mlp).init(KEY, jnp.ones([2, 5]))
  ),
  (SECTION_ADAPTERS, "`to_nnx` with neither `rngs=` nor `params=`"): lambda: hkb.to_nnx(
    hk.transform(mlp), X4
  ),
  (SECTION_INSTALL, "`import haiku_bridge` with a dm-haiku whose internals moved"): lambda: (
    newer_haiku_without("frame_stack_v2")
  ),
}


def jax_without_shard_map(fn: Callable[[], Any]) -> Any:
  """`fn()` where the pipeline sees jax 0.6.0, which has no jax.shard_map."""
  old = types.SimpleNamespace(__version__="0.6.0")
  with mock.patch.object(pipeline_config, "jax", old):
    return fn()


def explicit_stages_on_jax_08() -> None:
  """A pipeline on 2 stages of an Explicit mesh, where the pipeline sees jax 0.8.1."""
  with mock.patch.object(pipeline_config.jax, "__version__", "0.8.1"):
    pipelined(4, hkb.Pipeline("stage", 2), {"stage": 2})


def closed_over_array_into_a_scan() -> None:
  """A layer whose scan closes over an outer param, params put on an Explicit mesh."""

  def f(x):
    scale = hk.get_parameter("scale", [4], init=jnp.ones)

    def layer(h):
      step = lambda c, x: (jnp.tanh(c + x) * scale, None)
      return jax.lax.scan(step, jnp.zeros_like(h), jnp.stack([h, -h]))[0]

    return hkb.repeat_layer(layer, x, 4, pipeline=hkb.Pipeline("stage", 2))

  f = hk.transform(f)
  params = f.init(KEY, X4)
  with jax.set_mesh(jax.make_mesh((2, 4), ("stage", "rest"))):
    f.apply(jax.device_put(params, P()), None, X4)


def layers_loss():
  """A loss of three layers under `repeat_layer(remat="auto")` with no budget of its own."""
  return hk.transform(
    lambda x: jnp.sum(hkb.repeat_layer(lambda x: jnp.tanh(hk.Linear(4)(x)), x, 3, remat="auto"))
  )


def unbudgeted_gradient() -> Any:
  f = layers_loss()
  return jax.grad(f.apply)(f.init(KEY, X4), None, X4)


def budgeted_layers(memory_budget: int) -> Any:
  f = layers_loss()
  return hkb.budgeted_jit(jax.grad(f.apply), memory_budget=memory_budget)(f.init(KEY, X4), None, X4)


def tanh_scan_plan(memory_budget: int) -> Any:
  return hkb.remat_plan(
    lambda h, x: (jnp.tanh(h + x), None),
    jnp.zeros([2, 4]),
    jnp.ones([8, 2, 4]),
    memory_budget=memory_budget,
  )


def pinned_jax() -> str:
  """The jax of the environment the doc's rows come from (requirements.txt)."""
  with open(os.path.join(_ROOT, "requirements.txt")) as f:
    return re.search(r"^jax==(\S+)$", f.read(), re.MULTILINE)[1]


def on_this_install(row: tuple[str, str], documented: str, got: str) -> str:
  """`documented`, with the facts of the pinned install in it replaced by this install's.

  The version a row names and `ROW_BUDGET`'s least temporaries are computed here; the parts of
  `INSTALL_SLOTS` are taken from `got`, the raised text, where its pattern finds them in both.
  """
  slot = INSTALL_SLOTS.get(row)
  theirs = re.search(slot, got) if slot else None
  if theirs:
    documented = re.sub(slot, lambda ours: ours[0].replace(ours[1], theirs[1]), documented)
  if row == ROW_CLOSED_OVER:
    return documented.replace(f"jax {pinned_jax()} ", f"jax {jax.__version__} ")
  if row == ROW_BUDGET:
    least = min(k.temporaries for k in tanh_scan_plan(memory_budget=10**9).candidates)
    return re.sub(r"(the least any needs is )\d+( bytes)", rf"\g<1>{least}\g<2>", documented)
  return documented


def raised(fn: Callable[[], Any]) -> str:
  try:
    fn()
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {str(e).splitlines()[0]}"
  return "(nothing raised)"


class ErrorsDocTest(parameterized.TestCase):
  def test_rows_of_the_install_name_the_pinned_one(self):
    rows = doc_rows()
    self.assertIn(f"jax {pinned_jax()} cannot close over", rows[ROW_CLOSED_OVER])
    self.assertRegex(rows[ROW_BUDGET], r"the least any needs is \d+ bytes")
    for row, slot in INSTALL_SLOTS.items():
      self.assertRegex(rows[row], slot)

  def test_every_row_has_a_raiser_and_every_raiser_a_row(self):
    rows = set(doc_rows())
    self.assertGreater(len(rows), 30)
    self.assertEqual(sorted(rows - set(RAISERS)), [], "rows without a raiser")
    self.assertEqual(sorted(set(RAISERS) - rows), [], "raisers without a row")

  @parameterized.named_parameters(
    (re.sub(r"\W+", "_", f"{section}_{when}"), section, when) for section, when in RAISERS
  )
  def test_documented_text_is_the_raised_text(self, section, when):
    documented = doc_rows().get((section, when))
    if documented is None:
      self.skipTest("no row (reported by the test above)")
    if section == SECTION_ADAPTERS and not adapters_installed():
      self.skipTest("needs flax and equinox")
    got = raised(RAISERS[(section, when)])
    hkb.clear_caches()
    if jax.__version__ != pinned_jax():
      documented = on_this_install((section, when), documented, got)
    if documented.startswith("... "):
      self.assertEndsWith(got, documented[len("... ") :])
    else:
      self.assertEqual(got, documented)


if __name__ == "__main__":
  absltest.main()
