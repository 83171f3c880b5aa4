"""Every public entry point checks its arguments on entry, through one error path.

For each name of `hkb.__all__`, each class of bad input that it can be given is refused with a
message `hkb.<name>: ...` that names the argument and says what to pass:

- `wrong_type`: a value of the wrong type (None, an int for a function, a string for a dict);
- `wrong_arity`: the wrong number of things (of arguments, of `in_axes` entries, of rule parts);
- `shape_or_depth`: a shape or a number of layers that does not fit;
- `unknown_name`: a name or mesh axis that does not exist (a typo);
- `argument_order`: two arguments swapped, or one function passed where another belongs.

`COVERAGE` says which classes apply to which public name (and why not, where one does not);
`CoverageTest` fails when a public name, or one of its classes, has no test here. The rows of the
issues that asked for these checks (issues 19 and 27) are regression tests below, each named
after its row.

Left unchecked on purpose, because any value is valid there or JAX checks it as it would
inline: the arguments passed through to the user's own functions (`*args` / `**kwargs` of
`call_pure`, `get_relevant_parameters`, `ShardingRules.from_foreign`, `to_nnx`, `to_equinox`,
`vjp_fwd`'s `params` and `*args`, a block's arguments beyond its `nondiff_argnums` checks), the
scanned `carry` / `x` of `layer_scan` / `repeat_layer` (any pytree `jax.lax.scan` takes, as
for `hk.layer_stack`), `gather_over`'s `tree` (any pytree), and the attributes of an NNX
adapter's `.train(**attributes)` / `.eval(**attributes)` (NNX's own).
"""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import re
import string
import sys

from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import hypothesis
from hypothesis import strategies as st
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import haiku_bridge as hkb
from haiku_bridge._src import pipeline as pipeline_lib

KEY = jax.random.PRNGKey(0)
X = jnp.ones([2, 4])
DEPTH = 3
SETTINGS = hypothesis.settings(max_examples=30, deadline=None, derandomize=True, database=None)

# Pipelines need jax.shard_map and jax.set_mesh (jax 0.7 on): errors_doc_test.
NEEDS_SHARD_MAP = absltest.skipUnless(
  pipeline_lib.jax_has_pipelines(), "pipelines need jax.shard_map and jax.set_mesh"
)

CLASSES = ("wrong_type", "wrong_arity", "shape_or_depth", "unknown_name", "argument_order")

# Which classes of bad input each public name can be given; a class left out says why.
COVERAGE = {
  "BudgetedStep": set(),  # What `budgeted_jit` returns; users do not build one.
  "StepPlan": set(),  # A record `BudgetedStep.plan` returns (a named tuple).
  "budgeted_jit": {"wrong_type", "unknown_name"},
  # budgeted_jit: one function, its options by keyword (a swap shows as wrong_type).
  "Pipeline": {"wrong_type", "shape_or_depth", "unknown_name"},
  "PipelineCost": set(),  # A record `pipeline_cost` returns; users do not build one.
  "pipeline_cost": {"wrong_type", "shape_or_depth", "unknown_name"},
  "PipelineSchedule": set(),  # A type (of `Pipeline(schedule=)`), not a function.
  "RematMode": set(),  # A type (of `remat=`), not a function.
  # RematPlan / RematCandidate: records `remat_plan` returns (named tuples), not functions.
  "RematCandidate": set(),
  "RematPlan": set(),
  "UnsupportedHaikuError": set(),  # An exception class that import raises, takes no input.
  "UntestedVersionWarning": set(),  # A warning class that import issues, takes no input.
  # Pipeline: keyword fields of distinct types; a swap shows as wrong_type.
  "ShardingRules": {"wrong_type", "wrong_arity", "unknown_name", "shape_or_depth"},
  # argument_order: rules and stacked= are distinct types, caught as wrong_type.
  "ShardingReport": set(),  # What `explain_shardings` returns; users do not build one.
  "call_pure": {"wrong_type", "wrong_arity", "shape_or_depth", "unknown_name", "argument_order"},
  "clear_caches": set(),  # Takes no arguments.
  "custom_jvp": {"wrong_type", "wrong_arity", "shape_or_depth", "argument_order"},
  "custom_vjp": {"wrong_type", "wrong_arity", "shape_or_depth", "argument_order"},
  # unknown_name: neither takes names.
  "explain_shardings": {"wrong_type", "unknown_name", "shape_or_depth", "argument_order"},
  "gather_over": {"wrong_type", "unknown_name"},
  # gather_over: one tree and its axes; nothing to count or to swap with another type.
  "get_relevant_parameters": {"wrong_type", "wrong_arity", "shape_or_depth", "unknown_name"},
  "hk": set(),  # A namespace, not a function.
  "layer_scan": {"wrong_type", "wrong_arity", "shape_or_depth", "unknown_name", "argument_order"},
  "param_shardings": {"wrong_type", "unknown_name", "shape_or_depth", "argument_order"},
  "param_specs": {"wrong_type", "unknown_name", "shape_or_depth", "argument_order"},
  "repeat_layer": {"wrong_type", "wrong_arity", "shape_or_depth", "unknown_name", "argument_order"},
  "remat_plan": {"wrong_type", "wrong_arity", "shape_or_depth", "argument_order"},
  # remat_plan: a scan's arguments, by keyword after f, init and xs, or a loop's (checked by the
  # loop); no names to look up.
  "remat_plans": set(),  # Takes no arguments.
  "route_cotangents": {"wrong_type", "wrong_arity", "shape_or_depth"},
  "scan": {"wrong_type", "wrong_arity", "shape_or_depth", "argument_order"},
  "dynamic_unroll": {"wrong_type", "wrong_arity", "shape_or_depth", "argument_order"},
  # scan / dynamic_unroll: Haiku's arguments and keyword options, no names to look up.
  # route_cotangents: split and combine are both functions; a swap shows as wrong_arity.
  "stack_params": {"wrong_type", "shape_or_depth", "unknown_name", "argument_order"},
  "stacked_init": {"wrong_type", "wrong_arity", "shape_or_depth"},
  "unstack_params": {"wrong_type", "shape_or_depth", "unknown_name", "argument_order"},
  # stack_params / unstack_params / stacked_init: keyword arguments; their counts are checked
  # as shapes and depths.
  "vjp_fwd": {"wrong_type", "argument_order"},
  # The adapters (skipped without flax and equinox). from_flax / from_equinox: names are
  # free (a method name is checked at the call, against the module); to_nnx / to_equinox:
  # keyword arguments of distinct types.
  "from_flax": {"wrong_type", "argument_order"},
  "from_equinox": {"wrong_type"},
  "to_nnx": {"wrong_type", "wrong_arity", "shape_or_depth"},
  "to_equinox": {"wrong_type", "wrong_arity", "shape_or_depth"},
}


# `max_recompute` refused by every loop that takes remat="auto": on entry, before planning.
MAX_RECOMPUTE_REFUSED = (
  (dict(remat="auto", memory_budget=1 << 20, max_recompute="3"), TypeError, "max_recompute"),
  (dict(remat="auto", memory_budget=1 << 20, max_recompute=True), TypeError, "max_recompute"),
  (dict(remat="auto", memory_budget=1 << 20, max_recompute=-1), ValueError, "max_recompute"),
  (
    dict(remat="auto", memory_budget=1 << 20, max_recompute=float("nan")),
    ValueError,
    "max_recompute",
  ),
  (dict(remat=True, max_recompute=3), ValueError, "max_recompute"),
)


def refused(test, error, api, argument=None):
  """`assertRaisesRegex` for a message `hkb.<api>: ...` naming `argument`, once prefixed."""
  pattern = rf"^hkb\.{re.escape(api)}: (?!.*\bhkb(\.\w+)?: )"
  if argument is not None:
    pattern += rf".*`{re.escape(argument)}`"
  return test.assertRaisesRegex(error, re.compile(pattern, re.DOTALL))


def init(fn, *args):
  """Runs `fn(*args)` at init of a transform (where the bridge's functions run)."""
  return hk.transform(lambda: fn(*args)).init(KEY)


def linear(h):
  return hk.Linear(h.shape[-1])(h)


def dense(params, h):
  return jnp.tanh(h @ params["w"])


def init_dense(rng, h):
  return {"w": jax.random.normal(rng, [h.shape[-1], h.shape[-1]])}


def stacked_params(depth=DEPTH, stack="s"):
  return {f"{stack}/linear": {"w": jnp.ones([depth, 4, 4]), "b": jnp.zeros([depth, 4])}}


def loop_params(depth=DEPTH, scope="layer_{i}"):
  return {
    f"{scope.format(i=i)}/linear": {"w": jnp.ones([4, 4]), "b": jnp.zeros([4])}
    for i in range(depth)
  }


def explicit_mesh(shape=(2, 4), names=("data", "model"), axis_type=AxisType.Explicit):
  devices_ = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
  return Mesh(devices_, names, axis_types=(axis_type,) * len(names))


# Names that are not Haiku scopes with `{i}`: anything without braces.
no_field = st.text(alphabet=string.ascii_letters + string.digits + "_/", min_size=1, max_size=20)
axis_names = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=8)


class TestCase(parameterized.TestCase):
  """Hides Haiku's stand-in for a missing Flax from hypothesis while a test runs.

  Without Flax, dm-haiku puts an object in `sys.modules["haiku.experimental.flax"]` whose every
  attribute raises ImportError, and hypothesis reads `__file__` of every module in `sys.modules`.
  """

  def setUp(self):
    super().setUp()
    name = "haiku.experimental.flax"
    if type(sys.modules.get(name)).__name__ == "FlaxNotInstalled":
      stand_in = sys.modules.pop(name)
      self.addCleanup(sys.modules.__setitem__, name, stand_in)


class CoverageTest(absltest.TestCase):
  def test_every_public_name_is_covered(self):
    self.assertEqual(set(COVERAGE), set(hkb.__all__))

  def test_every_class_that_applies_has_a_test(self):
    missing = []
    for name, classes in COVERAGE.items():
      self.assertLessEqual(classes, set(CLASSES), name)
      case = globals().get(f"{name[0].upper()}{name[1:]}Test")
      for cls in classes:
        if case is None or not any(m.startswith(f"test_{cls}") for m in dir(case)):
          missing.append(f"{name}: {cls}")
    self.assertEmpty(missing)


# ---------------------------------------------------------------------------
# layer_scan.py: layer_scan, repeat_layer; stacked_init.py; unrolled_names.py: unstack_params,
# stack_params.
# ---------------------------------------------------------------------------


class Budgeted_jitTest(TestCase):
  """`budgeted_jit(step, *, memory_budget=None, max_recompute=None, **jit_kwargs)`."""

  def test_wrong_type(self):
    step = lambda x: x
    for kwargs, argument in (
      (dict(step=None), "step"),
      (dict(step=12e9), "step"),
      (dict(step=step, memory_budget="1GB"), "memory_budget"),
      (dict(step=step, memory_budget=1e9), "memory_budget"),
      (dict(step=step, max_recompute="3"), "max_recompute"),
    ):
      with refused(self, TypeError, "budgeted_jit", argument):
        hkb.budgeted_jit(**kwargs)
    for kwargs, argument in (
      (dict(memory_budget=0), "memory_budget"),
      (dict(max_recompute=-1), "max_recompute"),
    ):
      with refused(self, ValueError, "budgeted_jit", argument):
        hkb.budgeted_jit(step, **kwargs)

  def test_unknown_name_a_misspelt_option(self):
    for typo, near in (("memory_budgets", "memory_budget"), ("donate_argnum", "donate_argnums")):
      with self.assertRaisesRegex(
        TypeError,
        rf"^hkb.budgeted_jit: got an unexpected keyword argument "
        rf"'{typo}' \(did you mean '{near}'\?\); its arguments are step, "
        r"memory_budget, max_recompute, in_shardings, ",
      ):
        hkb.budgeted_jit(lambda x: x, **{typo: 0})


class Unstack_paramsTest(TestCase):
  """`unstack_params(params, *, stack, num_layers, layer_scope)`."""

  def call(self, params=None, **kwargs):
    kwargs = dict(dict(stack="s", num_layers=DEPTH), **kwargs)
    return hkb.unstack_params(stacked_params() if params is None else params, **kwargs)

  def test_unknown_name_issue_row_scope_without_i(self):
    # Was: every layer written into one bundle, only the last surviving.
    with refused(self, ValueError, "unstack_params", "layer_scope"):
      self.call(layer_scope="block")

  def test_unknown_name_scope_with_another_field(self):
    for scope in ("layer_{j}", "layer_{i}_{i}", "layer_{", "{0}"):
      with refused(self, ValueError, "unstack_params", "layer_scope"):
        self.call(layer_scope=scope)

  @hypothesis.given(stack=axis_names)
  @SETTINGS
  def test_unknown_name_stack(self, stack):
    hypothesis.assume(stack != "s")
    with self.assertRaisesRegex(
      ValueError, rf"^hkb.unstack_params: no params under stack '{stack}'.*\['s/linear'\]"
    ):
      self.call(stack=stack)

  def test_wrong_type_issue_row_params_none(self):
    with refused(self, TypeError, "unstack_params", "params"):
      hkb.unstack_params(None, stack="s", num_layers=DEPTH)

  def test_wrong_type_issue_row_stack_int(self):
    with refused(self, TypeError, "unstack_params", "stack"):
      self.call(stack=3)

  def test_wrong_type_flat_dict_and_non_array_leaf(self):
    with refused(self, TypeError, "unstack_params", "params"):
      self.call(params={"s/linear": jnp.ones([3])})
    with refused(self, TypeError, "unstack_params", "params"):
      self.call(params={"s/linear": {"w": [1.0, 2.0, 3.0]}})

  def test_wrong_type_num_layers(self):
    for bad, error in ((None, TypeError), ("3", TypeError), (3.0, TypeError), (0, ValueError)):
      with refused(self, error, "unstack_params", "num_layers"):
        self.call(num_layers=bad)

  @hypothesis.given(depth=st.integers(1, 8))
  @SETTINGS
  def test_shape_or_depth(self, depth):
    hypothesis.assume(depth != DEPTH)
    with self.assertRaisesRegex(
      ValueError,
      rf"^hkb.unstack_params: s/linear/[wb] has shape "
      rf"\({DEPTH}, .*not a leading layer axis of {depth}",
    ):
      self.call(num_layers=depth)

  def test_shape_or_depth_scope_that_collides(self):
    params = dict(stacked_params(), **{"layer_1/linear": {"w": jnp.ones([4, 4])}})
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.unstack_params: layer 1 .*'layer_1/linear'"
      r".*already have",
    ):
      self.call(params=params)

  def test_argument_order_stack_name_as_params(self):
    with refused(self, TypeError, "unstack_params", "params"):
      hkb.unstack_params("s", stack="s", num_layers=DEPTH)

  def test_round_trip_still_works(self):
    out = self.call(layer_scope="net/block_{i}")
    self.assertEqual(sorted(out), [f"net/block_{i}/linear" for i in range(DEPTH)])
    np.testing.assert_array_equal(out["net/block_2/linear"]["w"], jnp.ones([4, 4]))


class Stack_paramsTest(TestCase):
  """`stack_params(params, *, stack, num_layers, layer_scope)`."""

  def call(self, params=None, **kwargs):
    kwargs = dict(dict(stack="s", num_layers=DEPTH), **kwargs)
    return hkb.stack_params(loop_params() if params is None else params, **kwargs)

  def test_unknown_name_issue_row_scope_matching_no_bundle(self):
    # Was: the params returned unchanged.
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.stack_params: no bundle is a layer by layer_scope 'layers_\{i\}'.*"
      r"'layer_0/linear'",
    ):
      self.call(layer_scope="layers_{i}")

  def test_wrong_type(self):
    with refused(self, TypeError, "stack_params", "params"):
      hkb.stack_params(None, stack="s", num_layers=DEPTH)
    with refused(self, TypeError, "stack_params", "stack"):
      self.call(stack=None)
    with refused(self, TypeError, "stack_params", "layer_scope"):
      self.call(layer_scope=0)
    with refused(self, ValueError, "stack_params", "stack"):
      self.call(stack="s/")

  @hypothesis.given(depth=st.integers(1, DEPTH - 1))
  @SETTINGS
  def test_shape_or_depth_fewer_layers_than_the_loop(self, depth):
    with self.assertRaisesRegex(
      ValueError,
      rf"^hkb.stack_params: 'layer_\d/linear' is layer "
      rf"\d by 'layer_{{i}}', but num_layers={depth}",
    ):
      self.call(num_layers=depth)

  def test_shape_or_depth_layers_of_different_shapes(self):
    params = loop_params()
    params["layer_2/linear"] = {"w": jnp.ones([4, 5]), "b": jnp.zeros([4])}
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.stack_params: s/linear/w has shape \(4, 4\) "
      r"in layer 0 but \(4, 5\) in layer 2",
    ):
      self.call(params=params)

  def test_shape_or_depth_stack_that_collides(self):
    params = dict(loop_params(), **{"s/linear": {"w": jnp.ones([3, 4, 4])}})
    with self.assertRaisesRegex(ValueError, r"^hkb.stack_params: .*'s/linear'.*already have"):
      self.call(params=params)

  def test_argument_order_stacked_params_given(self):
    # Stacked params handed to stack_params: no bundle is a loop layer.
    with self.assertRaisesRegex(ValueError, r"^hkb.stack_params: no bundle is a layer"):
      self.call(params=stacked_params())

  def test_round_trip(self):
    params = stacked_params()
    back = self.call(params=hkb.unstack_params(params, stack="s", num_layers=DEPTH))
    self.assertEqual(jax.tree.map(jnp.shape, back), jax.tree.map(jnp.shape, params))


class LayerScopeTest(TestCase):
  """Both conversions refuse any `layer_scope` without `{i}`."""

  @hypothesis.given(scope=no_field)
  @SETTINGS
  def test_any_scope_without_i(self, scope):
    for convert, params in (
      (hkb.unstack_params, stacked_params()),
      (hkb.stack_params, loop_params()),
    ):
      with refused(self, ValueError, convert.__name__, "layer_scope"):
        convert(params, stack="s", num_layers=DEPTH, layer_scope=scope)


class Stacked_initTest(TestCase):
  """`stacked_init(init, num_layers, in_axes=None)`."""

  def test_wrong_type_issue_row_in_axes_int(self):
    # Was: `'int' object is not iterable`.
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.stacked_init: `in_axes` must be None, or a "
      r"sequence with one entry per positional argument.*got an int 0\. "
      r"For one argument split on axis 0, write in_axes=\(0,\)\.",
    ):
      hkb.stacked_init(init_dense, DEPTH, in_axes=0)

  def test_wrong_type(self):
    with refused(self, TypeError, "stacked_init", "init"):
      hkb.stacked_init(None, DEPTH)
    with refused(self, TypeError, "stacked_init", "num_layers"):
      hkb.stacked_init(init_dense, "3")
    with refused(self, TypeError, "stacked_init", "in_axes"):
      hkb.stacked_init(init_dense, DEPTH, in_axes=[0.0])
    with refused(self, TypeError, "stacked_init", "in_axes"):
      hkb.stacked_init(init_dense, DEPTH, in_axes="0")

  def test_wrong_arity_in_axes_against_the_arguments(self):
    stacked = hkb.stacked_init(init_dense, DEPTH, in_axes=(None, 0))
    with refused(self, ValueError, "stacked_init", "in_axes"):
      stacked(KEY, X)

  @hypothesis.given(size=st.integers(1, 6))
  @SETTINGS
  def test_shape_or_depth_per_layer_axis(self, size):
    hypothesis.assume(size != DEPTH)
    stacked = hkb.stacked_init(lambda rng, h: {"w": h}, DEPTH, in_axes=(0,))
    with self.assertRaisesRegex(
      ValueError,
      rf"^hkb.stacked_init: `in_axes\[0\]` is 0.*shape "
      rf"\({size}, 4\).*num_layers={DEPTH}",
    ):
      stacked(KEY, jnp.ones([size, 4]))

  def test_in_axes_still_slice(self):
    stacked = hkb.stacked_init(lambda rng, h: {"w": h * 2}, DEPTH, in_axes=(0,))
    np.testing.assert_array_equal(stacked(KEY, jnp.ones([DEPTH, 4]))["w"], 2 * jnp.ones([3, 4]))


class Layer_scanTest(TestCase):
  """`layer_scan(layer, carry, xs=None, *, num_layers, init, name, ...)`."""

  def test_wrong_type(self):
    for kwargs, argument in (
      (dict(layer=None), "layer"),
      (dict(init=3), "init"),
      (dict(name=3), "name"),
    ):
      args = dict(dict(layer=lambda c, x: (linear(c), None), num_layers=DEPTH), **kwargs)
      layer = args.pop("layer")
      with refused(self, TypeError, "layer_scan", argument):
        init(lambda: hkb.layer_scan(layer, X, **args))

  def test_wrong_arity_pure_layer_without_init(self):
    with self.assertRaisesRegex(TypeError, r"^hkb.layer_scan: .*takes 3 arguments.*`init=`"):
      init(lambda: hkb.layer_scan(lambda p, c, x: (c, None), X, num_layers=DEPTH))

  def test_shape_or_depth_xs(self):
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.layer_scan: xs\['a'\] has shape \(2, 4\).*"
      r"num_layers=3",
    ):
      init(
        lambda: hkb.layer_scan(lambda c, x: (c, None), X, {"a": jnp.ones([2, 4])}, num_layers=DEPTH)
      )

  def test_argument_order_num_layers_as_xs(self):
    # layer_scan(layer, carry, 12): the 12 lands in `xs`.
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.layer_scan: xs is an int 3; .*pass "
      r"num_layers=3\.",
    ):
      init(lambda: hkb.layer_scan(lambda c, x: (c, None), X, DEPTH))

  def test_wrong_type_options(self):
    # remat_policy, remat_groups, unroll, reverse: each named, on entry.
    layer = lambda c, x: (linear(c), None)
    for kwargs, error, argument in (
      (dict(remat=True, remat_policy="dots"), TypeError, "remat_policy"),
      (dict(remat="nested", remat_groups=2.0), TypeError, "remat_groups"),
      (dict(remat="nested", remat_groups="2"), TypeError, "remat_groups"),
      (dict(remat="nested", remat_groups=0), ValueError, "remat_groups"),
      (dict(unroll="2"), TypeError, "unroll"),
      (dict(unroll=1.0), TypeError, "unroll"),
      (dict(unroll=-1), ValueError, "unroll"),
      (dict(reverse=None), TypeError, "reverse"),
      (dict(reverse=1), TypeError, "reverse"),
    ) + MAX_RECOMPUTE_REFUSED:
      with refused(self, error, "layer_scan", argument):
        init(lambda kwargs=kwargs: hkb.layer_scan(layer, X, num_layers=DEPTH, **kwargs))

  @parameterized.parameters(
    (4, TypeError),
    (1.5, TypeError),
    (None, TypeError),
    (0, TypeError),
    ("Nested", ValueError),
    ("none", ValueError),
  )
  def test_wrong_type_issue_row_remat(self, remat, error):
    # Issue 27, row 1: an int or a float (perhaps meant as remat_groups) was taken as
    # remat=True, None as False.
    with self.assertRaisesRegex(
      error,
      r"^hkb.layer_scan: `remat` must be False, True, "
      r"\"nested\", \"binomial\" or \"auto\"; .*`remat_groups=`",
    ):
      init(lambda: hkb.layer_scan(lambda c, x: (linear(c), None), X, num_layers=DEPTH, remat=remat))

  def test_valid_options_still_run(self):
    # NumPy bools and ints are the Python values they are.
    out = hk.transform(
      lambda: hkb.layer_scan(
        lambda c, x: (linear(c), None),
        X,
        num_layers=DEPTH,
        remat="binomial",
        remat_groups=np.int32(2),
        unroll=np.int64(2),
        reverse=np.bool_(True),
      )
    )
    params = out.init(KEY)
    same = hk.transform(
      lambda: hkb.layer_scan(
        lambda c, x: (linear(c), None),
        X,
        num_layers=DEPTH,
        remat=np.bool_(True),
        reverse=True,
        unroll=True,
      )
    )
    np.testing.assert_allclose(out.apply(params, None)[0], same.apply(params, None)[0], rtol=1e-6)

  def test_wrong_type_pipeline(self):
    with refused(self, TypeError, "layer_scan", "pipeline"):
      init(lambda: hkb.layer_scan(lambda c, x: (c, None), X, num_layers=DEPTH, pipeline="stage"))

  @NEEDS_SHARD_MAP
  @hypothesis.given(axis=axis_names)
  @SETTINGS
  def test_unknown_name_pipeline_axis(self, axis):
    hypothesis.assume(axis not in ("data", "model"))
    with jax.set_mesh(explicit_mesh()):
      with self.assertRaisesRegex(
        ValueError,
        rf"^hkb.layer_scan: `pipeline.axis` is '{axis}', "
        r"but the mesh has axes \('data', 'model'\)",
      ):
        init(
          lambda: hkb.layer_scan(
            lambda c, x: (c, None), X, num_layers=4, pipeline=hkb.Pipeline(axis)
          )
        )

  @NEEDS_SHARD_MAP
  @hypothesis.given(depth=st.integers(1, 12), microbatches=st.integers(1, 4))
  @SETTINGS
  def test_shape_or_depth_pipeline(self, depth, microbatches):
    # Stages over "model" (4 devices): the layers split into 4 stages, the batch of 2 rows
    # into microbatches.
    hypothesis.assume(depth % 4 or 2 % microbatches)
    argument = "num_layers" if depth % 4 else "pipeline.microbatches"
    with jax.set_mesh(explicit_mesh()):
      with refused(self, ValueError, "layer_scan", argument):
        init(
          lambda: hkb.layer_scan(
            lambda c, x: (c, None),
            X,
            num_layers=depth,
            pipeline=hkb.Pipeline("model", microbatches),
          )
        )


class Repeat_layerTest(TestCase):
  """`repeat_layer(layer, x, num_layers, *, init, **options)`."""

  def test_wrong_type(self):
    with refused(self, TypeError, "repeat_layer", "layer"):
      init(lambda: hkb.repeat_layer(None, X, DEPTH))
    with refused(self, TypeError, "repeat_layer", "num_layers"):
      init(lambda: hkb.repeat_layer(linear, X, None))
    with refused(self, TypeError, "repeat_layer", "init"):
      init(lambda: hkb.repeat_layer(dense, X, DEPTH, init="dense"))
    with refused(self, TypeError, "repeat_layer", "name"):
      init(lambda: hkb.repeat_layer(linear, X, DEPTH, name=1))

  def test_wrong_arity_pure_layer_without_init(self):
    with self.assertRaisesRegex(TypeError, r"^hkb.repeat_layer: 'dense' takes 2 arguments"):
      init(lambda: hkb.repeat_layer(dense, X, DEPTH))

  def test_wrong_arity_issue_row_xs(self):
    # Issue 27, row 2: `xs` was dropped, and the stack renamed
    # `__layer_stack_with_per_layer` (the checkpoint's names changed).
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.repeat_layer: takes no `xs`: .*use "
      r"hkb.layer_scan\(layer, carry, xs\)",
    ):
      init(lambda: hkb.repeat_layer(linear, X, DEPTH, xs=jnp.ones([DEPTH])))

  def test_unknown_name_option(self):
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.repeat_layer: got an unexpected keyword "
      r"argument 'remat_group' \(did you mean 'remat_groups'\?\); "
      r"its arguments are layer, x, num_layers, init, name, remat, "
      r"remat_policy, remat_groups, unroll, reverse, pipeline, "
      r"memory_budget, max_recompute\.$",
    ):
      init(lambda: hkb.repeat_layer(linear, X, DEPTH, remat="nested", remat_group=2))

  def test_wrong_type_options_on_entry(self):
    # Checked before the layer runs or the scan starts, num_layers first.
    calls = []
    counted = lambda h: calls.append(1) or linear(h)
    for kwargs, error, argument in (
      (dict(remat=4), TypeError, "remat"),
      (dict(remat_groups=2), ValueError, "remat_groups"),
      (dict(unroll=None), TypeError, "unroll"),
      (dict(pipeline="stage"), TypeError, "pipeline"),
      *MAX_RECOMPUTE_REFUSED,
    ):
      with refused(self, error, "repeat_layer", argument):
        init(lambda kwargs=kwargs: hkb.repeat_layer(counted, X, DEPTH, **kwargs))
    with refused(self, ValueError, "repeat_layer", "num_layers"):
      init(lambda: hkb.repeat_layer(None, X, 0, remat=4))
    self.assertEqual(calls, [])

  def test_argument_order_x_and_layer_swapped(self):
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.repeat_layer: `layer` must be a Haiku "
      r"function.*got an array float32\[2, 4\]",
    ):
      init(lambda: hkb.repeat_layer(X, linear, DEPTH))

  def test_shape_or_depth_issue_row_params_of_another_depth(self):
    # Was: JAX's `scan got length argument of 4 which disagrees with leading axis sizes [3, 3]`.
    three = hk.transform(lambda x: hkb.repeat_layer(linear, x, 3))
    four = hk.transform(lambda x: hkb.repeat_layer(linear, x, 4))
    params = three.init(KEY, X)
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.repeat_layer: .*__layer_stack_no_per_layer/"
      r"linear.*\b3\b.*\b4\b",
    ):
      four.apply(params, None, X)

  def test_shape_or_depth_num_layers(self):
    for bad in (0, -2):
      with refused(self, ValueError, "repeat_layer", "num_layers"):
        init(lambda: hkb.repeat_layer(linear, X, bad))

  @NEEDS_SHARD_MAP
  def test_unknown_name_pipeline_axis(self):
    with jax.set_mesh(explicit_mesh()):
      with refused(self, ValueError, "repeat_layer", "pipeline.axis"):
        init(lambda: hkb.repeat_layer(linear, X, 4, pipeline=hkb.Pipeline("stage")))

  @NEEDS_SHARD_MAP
  def test_shape_or_depth_pipeline_circular(self):
    # 4 layers on 2 stages ("data") in 3 passes: 6 groups.
    with jax.set_mesh(explicit_mesh()):
      with self.assertRaisesRegex(
        ValueError,
        r"^hkb.repeat_layer: `num_layers` is 4, which does "
        r"not split into 2 stages × 3 passes",
      ):
        init(
          lambda: hkb.repeat_layer(
            linear, X, 4, pipeline=hkb.Pipeline("data", 2, "circular", repeats=3)
          )
        )


def cost_of(pipeline=None, stack=8, mesh_axes=("stage", "data"), **options):
  """`hkb.pipeline_cost` of a stack of `stack` layers, 4 stages × 2, a batch of 32."""
  return hkb.pipeline_cost(
    hkb.Pipeline("stage", 4) if pipeline is None else pipeline,
    jax.sharding.AbstractMesh((4, 2), mesh_axes),
    {"w": jax.ShapeDtypeStruct((stack, 16), jnp.float32)},
    jax.ShapeDtypeStruct((32, 16), jnp.float32),
    **options,
  )


@NEEDS_SHARD_MAP
class Pipeline_costTest(TestCase):
  """`pipeline_cost(pipeline, mesh, stack_params, carry, *, stored_over_stages, data_axes)`."""

  def test_wrong_type(self):
    with refused(self, TypeError, "pipeline_cost", "pipeline"):
      hkb.pipeline_cost(None, jax.sharding.AbstractMesh((4,), ("stage",)), {}, X)
    with refused(self, TypeError, "pipeline_cost", "stored_over_stages"):
      cost_of(stored_over_stages="stage")

  def test_shape_or_depth(self):
    with refused(self, ValueError, "pipeline_cost", "num_layers"):
      cost_of(stack=6)
    with refused(self, ValueError, "pipeline_cost", "stack_params"):
      hkb.pipeline_cost(
        hkb.Pipeline("stage", 4),
        jax.sharding.AbstractMesh((4, 2), ("stage", "data")),
        {"w": jnp.ones([8, 2]), "b": jnp.ones([3])},
        jnp.ones([32, 2]),
      )

  def test_unknown_name(self):
    with refused(self, ValueError, "pipeline_cost", "data_axes"):
      cost_of(data_axes=("dta",))
    with refused(self, ValueError, "pipeline_cost", "pipeline.axis"):
      cost_of(mesh_axes=("stages", "data"))


class PipelineTest(TestCase):
  """`Pipeline(axis="stage", microbatches=1, schedule="gpipe", repeats=None)`."""

  def test_wrong_type(self):
    for kwargs, argument in (
      (dict(axis=3), "axis"),
      (dict(axis=""), "axis"),
      (dict(microbatches="4"), "microbatches"),
      (dict(microbatches=2.0), "microbatches"),
      (dict(schedule=None), "schedule"),
      (dict(schedule="circular", repeats=1.5), "repeats"),
    ):
      with refused(self, TypeError, "Pipeline", argument):
        hkb.Pipeline(**kwargs)

  @hypothesis.given(microbatches=st.integers(-3, 0))
  @SETTINGS
  def test_shape_or_depth_microbatches(self, microbatches):
    with refused(self, ValueError, "Pipeline", "microbatches"):
      hkb.Pipeline(microbatches=microbatches)

  def test_shape_or_depth_repeats(self):
    with refused(self, ValueError, "Pipeline", "repeats"):
      hkb.Pipeline(schedule="circular", repeats=0)
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.Pipeline: `repeats` must be None or 1 with "
      r"schedule=\"gpipe\"; got an int 2\. For several passes",
    ):
      hkb.Pipeline(repeats=2)

  @hypothesis.given(schedule=axis_names)
  @SETTINGS
  def test_unknown_name_schedule(self, schedule):
    hypothesis.assume(schedule not in ("gpipe", "circular"))
    with self.assertRaisesRegex(
      ValueError,
      rf"^hkb.Pipeline: `schedule` must be \"gpipe\" or "
      rf"\"circular\"; got a str '{schedule}'\.",
    ):
      hkb.Pipeline(schedule=schedule)

  @NEEDS_SHARD_MAP
  def test_valid_fields_are_kept(self):
    pipe = hkb.Pipeline("pipe", np.int32(4), "circular", repeats=2)
    self.assertEqual(pipe, hkb.Pipeline("pipe", 4, "circular", 2))
    self.assertIsInstance(pipe.microbatches, int)


# ---------------------------------------------------------------------------
# time_scan.py: scan, dynamic_unroll.
# ---------------------------------------------------------------------------

SEQUENCE = jnp.ones([DEPTH, 2, 4])  # [T, B, F].


def step(h, x):
  return jnp.tanh(linear(h) + x), jnp.sum(h)


def lstm_unroll(*args, **kwargs):
  """`hkb.dynamic_unroll` of an LSTM, its state made for a batch of 2."""
  core = hk.LSTM(4)
  return hkb.dynamic_unroll(core, *args[:1], core.initial_state(2), *args[1:], **kwargs)


class Remat_planTest(TestCase):
  """`remat_plan(f, *args, memory_budget, remat_policy=None, **options)`: a step's `init, xs,
  length=`, or a loop's arguments."""

  def test_wrong_type(self):
    for kwargs, argument in (
      (dict(f=None), "f"),
      (dict(memory_budget="1GB"), "memory_budget"),
      (dict(length=3.0), "length"),
      (dict(max_recompute="3"), "max_recompute"),
      (dict(max_recompute=True), "max_recompute"),
    ):
      args = dict(dict(f=step, init=X, xs=SEQUENCE, memory_budget=1 << 20), **kwargs)
      with refused(self, TypeError, "remat_plan", argument):
        hkb.remat_plan(**args)

  def test_shape_or_depth(self):
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.remat_plan: xs\['b'\] has shape \(2, 2, 4\), "
      "but every leaf of xs needs a leading axis of 3 steps",
    ):
      hkb.remat_plan(step, X, {"a": SEQUENCE, "b": SEQUENCE[:2]}, memory_budget=1 << 20)
    with refused(self, ValueError, "remat_plan", "length"):
      hkb.remat_plan(step, X, SEQUENCE, memory_budget=1 << 20, length=0)
    with refused(self, ValueError, "remat_plan", "memory_budget"):
      hkb.remat_plan(step, X, SEQUENCE, memory_budget=0)
    for max_recompute in (-1, float("nan")):
      with refused(self, ValueError, "remat_plan", "max_recompute"):
        hkb.remat_plan(step, X, SEQUENCE, memory_budget=1 << 20, max_recompute=max_recompute)

  def test_argument_order_f_and_init_swapped(self):
    with refused(self, TypeError, "remat_plan", "f"):
      hkb.remat_plan(X, step, SEQUENCE, memory_budget=1 << 20)

  def test_wrong_arity(self):
    # A step with a loop's arguments (a core's state after xs), or a scan's `length` by position.
    for args in ((X, SEQUENCE, X), (X, SEQUENCE, 3)):
      with refused(self, TypeError, "remat_plan", "f"):
        hkb.remat_plan(step, *args, memory_budget=1 << 20)


class ScanTest(TestCase):
  """`scan(f, init, xs, length=None, reverse=False, unroll=1, *, remat, remat_groups)`."""

  def test_wrong_type(self):
    for kwargs, argument in (
      (dict(f=None), "f"),
      (dict(length=3.0), "length"),
      (dict(reverse=1), "reverse"),
      (dict(unroll="2"), "unroll"),
      (dict(remat=None), "remat"),
      (dict(remat="nested", remat_groups=2.0), "remat_groups"),
    ):
      args = dict(dict(f=step, init=X, xs=SEQUENCE), **kwargs)
      with refused(self, TypeError, "scan", argument):
        init(lambda args=args: hkb.scan(**args))
    for kwargs, error, argument in MAX_RECOMPUTE_REFUSED:
      with refused(self, error, "scan", argument):
        init(lambda kwargs=kwargs: hkb.scan(step, X, SEQUENCE, **kwargs))

  def test_wrong_type_xs_leaf(self):
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.scan: xs\['t'\] is an int 3; every leaf of "
      "xs must be an array with a leading time axis",
    ):
      init(lambda: hkb.scan(step, X, {"x": SEQUENCE, "t": 3}))

  def test_wrong_arity_step_output(self):
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.scan: `f` must return a pair \(carry, y\); "
      "it returned a tuple of length 3",
    ):
      init(lambda: hkb.scan(lambda h, x: (h, x, x), X, SEQUENCE))

  def test_shape_or_depth(self):
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.scan: xs\['b'\] has shape \(2, 2, 4\), but "
      r"every leaf of xs needs a leading time axis of 3 steps",
    ):
      init(lambda: hkb.scan(step, X, {"a": SEQUENCE, "b": SEQUENCE[:2]}))
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.scan: xs has shape \(3, 2, 4\), but every "
      r"leaf of xs needs a leading time axis of 5 steps\.",
    ):
      init(lambda: hkb.scan(step, X, SEQUENCE, length=5))
    with refused(self, ValueError, "scan", "length"):
      init(lambda: hkb.scan(step, X, None, length=-1))
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.scan: `f` must return a carry like the one it "
      r"gets.*got float32\[2, 4\] and returned float32\[2, 3\]",
    ):
      init(lambda: hkb.scan(lambda h, x: (hk.Linear(3)(h), None), X, SEQUENCE))

  def test_argument_order_f_and_init_swapped(self):
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.scan: `f` must be a function .*got an array "
      r"float32\[2, 4\]",
    ):
      init(lambda: hkb.scan(X, step, SEQUENCE))


class Dynamic_unrollTest(TestCase):
  """`dynamic_unroll(core, input_sequence, initial_state, time_major=True, reverse=False,
  return_all_states=False, unroll=1, *, remat, remat_groups)`."""

  def test_wrong_type(self):
    for kwargs, argument in (
      (dict(time_major=None), "time_major"),
      (dict(reverse="no"), "reverse"),
      (dict(return_all_states=1), "return_all_states"),
      (dict(unroll=None), "unroll"),
      (dict(remat=2), "remat"),
    ):
      with refused(self, TypeError, "dynamic_unroll", argument):
        init(lambda kwargs=kwargs: lstm_unroll(SEQUENCE, **kwargs))
    for kwargs, error, argument in MAX_RECOMPUTE_REFUSED:
      with refused(self, error, "dynamic_unroll", argument):
        init(lambda kwargs=kwargs: lstm_unroll(SEQUENCE, **kwargs))
    with refused(self, TypeError, "dynamic_unroll", "core"):
      init(lambda: hkb.dynamic_unroll("lstm", SEQUENCE, X))

  def test_wrong_arity_core_output(self):
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.dynamic_unroll: `core` must return a pair "
      r"\(output, state\); it returned an array float32\[2, 4\]\.",
    ):
      init(lambda: hkb.dynamic_unroll(lambda x, h: x + h, SEQUENCE, X))

  def test_shape_or_depth(self):
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.dynamic_unroll: input_sequence\[1\] has shape "
      r"\(2, 2, 4\), but every leaf of input_sequence needs a leading "
      r"time axis of 3 steps \(as input_sequence\[0\] has\)\.",
    ):
      init(lambda: hkb.dynamic_unroll(lambda x, h: (x[0], h), (SEQUENCE, SEQUENCE[:2]), X))
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.dynamic_unroll: input_sequence is an array "
      r"float32\[4\]; with time_major=False",
    ):
      init(lambda: lstm_unroll(jnp.ones([4]), time_major=False))
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.dynamic_unroll: `core` must return a state "
      r"like the one it gets.*got float32\[2, 4\] and returned "
      r"float32\[2, 3\]",
    ):
      init(lambda: hkb.dynamic_unroll(lambda x, h: (x, hk.Linear(3)(h)), SEQUENCE, X))

  def test_argument_order_core_and_inputs_swapped(self):
    with refused(self, TypeError, "dynamic_unroll", "core"):
      init(lambda: hkb.dynamic_unroll(SEQUENCE, hk.LSTM(4), X))


# ---------------------------------------------------------------------------
# custom_grad.py: custom_vjp, custom_jvp, route_cotangents, vjp_fwd.
# ---------------------------------------------------------------------------


def mlp(x):
  return hk.Linear(4, name="layer2")(jax.nn.relu(hk.Linear(8, name="layer1")(x)))


def true_bwd(vjp_fn, g):
  return vjp_fn(g)


class Custom_vjpTest(TestCase):
  """`custom_vjp(f, fwd, bwd, *, nondiff_argnums=())`, refused at construction."""

  @parameterized.parameters(
    ("fwd", (mlp, None, true_bwd)),
    ("bwd", (mlp, hkb.vjp_fwd, None)),
    ("f", (None, hkb.vjp_fwd, true_bwd)),
    ("fwd", (mlp, "vjp_fwd", true_bwd)),
  )
  def test_wrong_type_issue_row_none(self, argument, args):
    # Was: accepted; the first jax.grad failed with `'NoneType' object is not callable`.
    with refused(self, TypeError, "custom_vjp", argument):
      hkb.custom_vjp(*args)

  def test_wrong_type_nondiff_argnums(self):
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.custom_vjp: `nondiff_argnums` .*got an int 1\."
      r" Write nondiff_argnums=\(1,\)\.",
    ):
      hkb.custom_vjp(mlp, hkb.vjp_fwd, true_bwd, nondiff_argnums=1)
    for bad in (("1",), (1.0,), (True,)):
      with refused(self, TypeError, "custom_vjp", "nondiff_argnums"):
        hkb.custom_vjp(mlp, hkb.vjp_fwd, true_bwd, nondiff_argnums=bad)
    with refused(self, ValueError, "custom_vjp", "nondiff_argnums"):
      hkb.custom_vjp(mlp, hkb.vjp_fwd, true_bwd, nondiff_argnums=(-1,))

  def test_argument_order_fwd_and_bwd(self):
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.custom_vjp: the arguments are `\(f, fwd, "
      r"bwd\)`",
    ):
      hkb.custom_vjp(mlp, true_bwd, hkb.vjp_fwd)
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.custom_vjp: `bwd` is hkb.route_cotangents "
      r"itself; call it",
    ):
      hkb.custom_vjp(mlp, hkb.vjp_fwd, hkb.route_cotangents)

  def test_wrong_arity_bwd_cotangents(self):
    net = hk.transform(lambda x: hkb.custom_vjp(mlp, hkb.vjp_fwd, lambda r, g: r(g)[:1])(x))
    params = net.init(KEY, X)
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.custom_vjp: bwd must return \(params_ct, "
      r"\*args_cts\): 2 cotangents",
    ):
      jax.grad(lambda p: net.apply(p, None, X).sum())(params)

  def test_shape_or_depth_cotangent(self):
    bwd = lambda r, g: (r(g)[0], jnp.zeros([2, 5]))
    net = hk.transform(lambda x: hkb.custom_vjp(mlp, hkb.vjp_fwd, bwd)(x))
    params = net.init(KEY, X)
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.custom_vjp: bwd's cotangent for args\[0\] at "
      r"<root> has shape \[2, 5\], but args\[0\] there is "
      r"float32\[2, 4\]",
    ):
      jax.grad(lambda p: net.apply(p, None, X).sum())(params)

  def test_shape_or_depth_issue_row_non_array_output_leaf(self):
    # Was: init works; apply fails inside _src/inline.py (`... is not a valid JAX type`).
    # Issue 27, row 11: a non-array leaf passes through, as inline.
    tagged = lambda x: (mlp(x), "tag")
    ours = hk.transform(lambda x: hkb.custom_vjp(tagged, hkb.vjp_fwd, true_bwd)(x))
    params = ours.init(KEY, X)
    out = ours.apply(params, None, X)
    expected = hk.transform(tagged).apply(params, None, X)
    self.assertEqual(out[1], expected[1])
    np.testing.assert_allclose(out[0], expected[0], rtol=1e-6)


class Custom_jvpTest(TestCase):
  """`custom_jvp(f, jvp, *, nondiff_argnums=())`, refused at construction."""

  def test_wrong_type_issue_row_none(self):
    with refused(self, TypeError, "custom_jvp", "jvp"):
      hkb.custom_jvp(mlp, None)
    with refused(self, TypeError, "custom_jvp", "f"):
      hkb.custom_jvp(3, lambda f, p, t: f(*p))
    with refused(self, TypeError, "custom_jvp", "nondiff_argnums"):
      hkb.custom_jvp(mlp, lambda f, p, t: f(*p), nondiff_argnums="1")

  def test_wrong_arity_jvp_result(self):
    net = hk.transform(lambda x: hkb.custom_jvp(mlp, lambda f, p, t: (f(*p),))(x))
    params = net.init(KEY, X)
    with self.assertRaisesRegex(TypeError, r"^hkb.custom_jvp: jvp must return a pair"):
      jax.jvp(lambda p: net.apply(p, None, X), (params,), (params,))

  def test_argument_order_rules_given_to_custom_jvp(self):
    # custom_jvp(f, fwd, bwd): the bwd lands in the keyword-only nondiff_argnums' place.
    with self.assertRaises(TypeError):
      hkb.custom_jvp(mlp, hkb.vjp_fwd, true_bwd)  # pylint: disable=too-many-function-args

  def test_shape_or_depth_tangent(self):
    jvp = lambda f, p, t: (f(*p), jnp.zeros([2, 3]))
    net = hk.transform(lambda x: hkb.custom_jvp(mlp, jvp)(x))
    params = net.init(KEY, X)
    with self.assertRaisesRegex(ValueError, r"jvp's out_dot at <root> is float32\[2, 3\]"):
      jax.jvp(lambda p: net.apply(p, None, X), (params,), (params,))


class Route_cotangentsTest(TestCase):
  """`route_cotangents(split, combine)`."""

  def test_wrong_type_issue_row_none(self):
    with refused(self, TypeError, "route_cotangents", "split"):
      hkb.route_cotangents(None, None)
    with refused(self, TypeError, "route_cotangents", "combine"):
      hkb.route_cotangents(lambda g: {"a": g}, {"a": 0})

  def test_wrong_arity_split_result(self):
    bwd = hkb.route_cotangents(lambda g: [g], lambda cts: cts["a"])
    net = hk.transform(lambda x: hkb.custom_vjp(mlp, hkb.vjp_fwd, bwd)(x))
    params = net.init(KEY, X)
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.route_cotangents: split must return a "
      r"non-empty dict",
    ):
      jax.grad(lambda p: net.apply(p, None, X).sum())(params)

  def test_shape_or_depth_issue_row_one_prefix(self):
    # Was: `hkb.route_cotangents: hkb: piece 'a' ...`.
    bwd = hkb.route_cotangents(lambda g: {"a": g[:, :2]}, lambda cts: cts["a"])
    net = hk.transform(lambda x: hkb.custom_vjp(mlp, hkb.vjp_fwd, bwd)(x))
    params = net.init(KEY, X)
    with refused(self, ValueError, "route_cotangents"):
      jax.grad(lambda p: net.apply(p, None, X).sum())(params)


class Vjp_fwdTest(TestCase):
  """`vjp_fwd(f_pure, params, *args)`: given to custom_vjp, rarely called by hand."""

  def test_wrong_type(self):
    with refused(self, TypeError, "vjp_fwd", "f_pure"):
      hkb.vjp_fwd(None, {})

  def test_argument_order_params_first(self):
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.vjp_fwd: `f_pure` must be .*got a dict\. "
      r"Pass hkb.vjp_fwd itself",
    ):
      hkb.vjp_fwd({"w": X}, lambda p, x: x)


# ---------------------------------------------------------------------------
# sharding.py: ShardingRules, param_shardings, param_specs, explain_shardings, gather_over.
# ---------------------------------------------------------------------------

SHAPES = {
  "blocks/linear": {
    "w": jax.ShapeDtypeStruct((3, 8, 8), jnp.float32),
    "b": jax.ShapeDtypeStruct((3, 8), jnp.float32),
  }
}
RULES = hkb.ShardingRules([(r"/w$", P(None, "model"))], stacked=["blocks"])


class ShardingRulesTest(TestCase):
  """`ShardingRules(rules, *, stacked=())` and its `place` / `spec_for`."""

  @parameterized.parameters(None, 3, "/w$", ({"/w$": P()},))
  def test_wrong_type_rules(self, rules):
    with refused(self, TypeError, "ShardingRules", "rules"):
      hkb.ShardingRules(rules)

  def test_wrong_type_stacked(self):
    for stacked in (3, "blocks", {"blocks": 2}, {3: None}, {"blocks": ["data", 1]}):
      with refused(self, TypeError, "ShardingRules", "stacked"):
        hkb.ShardingRules([], stacked=stacked)

  def test_wrong_type_place(self):
    with refused(self, TypeError, "ShardingRules.place", "path"):
      RULES.place(None, (8,))
    with refused(self, TypeError, "ShardingRules.place", "shape"):
      RULES.place("w", 8)
    with refused(self, TypeError, "ShardingRules.spec_for", "mesh"):
      RULES.spec_for("w", (8,), mesh="data")

  def test_wrong_type_issue_row_from_foreign_init_output(self):
    # Issue 27, row 6: `'dict' object is not callable`.
    f = hk.transform(linear)
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.ShardingRules.from_foreign: `init` must be "
      r"the init function \(f.init\) or the hk.Transformed, .*got a "
      r"dict\. It holds arrays: the params `init` returns",
    ):
      hkb.ShardingRules.from_foreign(jax.eval_shape(f.init, KEY, X), KEY, X)
    with refused(self, TypeError, "ShardingRules.from_foreign", "init"):
      hkb.ShardingRules.from_foreign(None, KEY, X)

  def test_wrong_type_from_foreign_options(self):
    f = hk.transform(linear)
    for bad in ("embed", {"embed": "model"}, [("embed",)], [("embed", 3)], [(3, "model")]):
      with refused(self, TypeError, "ShardingRules.from_foreign", "logical_axis_rules"):
        hkb.ShardingRules.from_foreign(f.init, KEY, X, logical_axis_rules=bad)
    with refused(self, TypeError, "ShardingRules.from_foreign", "rules"):
      hkb.ShardingRules.from_foreign(f.init, KEY, X, rules="/w$")
    with refused(self, TypeError, "ShardingRules.from_foreign", "stacked"):
      hkb.ShardingRules.from_foreign(f.init, KEY, X, stacked=3)
    # What Flax takes: None, a name, or names, for each logical axis.
    rules = hkb.ShardingRules.from_foreign(
      f,
      KEY,
      X,
      logical_axis_rules=[("embed", None), ("mlp", "model"), ("heads", ("data", "model"))],
    )
    self.assertEqual(rules.rules, ())

  @parameterized.parameters([("/w$",)], [("/w$", P(), "extra")], [P("data")])
  def test_wrong_arity_rule(self, rule):
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.ShardingRules: rule 0 is .*not a "
      r"\(pattern, spec\) pair",
    ):
      hkb.ShardingRules([rule])

  def test_unknown_name_bad_regex(self):
    with self.assertRaisesRegex(ValueError, r"^hkb.ShardingRules: rule 0 is not a valid regex"):
      hkb.ShardingRules([("(", P())])

  def test_shape_or_depth_spec_longer_than_param(self):
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.ShardingRules.place: rule 0 .*P\(None, "
      r"'model'\), with 2 axes, more than its 1 dimensions",
    ):
      hkb.ShardingRules([("w", P(None, "model"))]).place("w", (8,))


class Param_shardingsTest(TestCase):
  """`param_shardings(params, mesh, rules)`."""

  def setUp(self):
    super().setUp()
    self.mesh = explicit_mesh(axis_type=AxisType.Auto)

  def test_argument_order_issue_row_rules_and_mesh_swapped(self):
    # Was: `'Mesh' object is not iterable`.
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.param_shardings: `mesh` and `rules` are "
      r"swapped \(got a ShardingRules for `mesh` and a Mesh for "
      r"`rules`\)\. The order is param_shardings\(params, mesh, "
      r"rules\)\.",
    ):
      hkb.param_shardings(SHAPES, RULES, self.mesh)

  def test_argument_order_params_last(self):
    with refused(self, TypeError, "param_shardings", "params"):
      hkb.param_shardings(self.mesh, RULES, SHAPES)

  def test_wrong_type(self):
    with refused(self, TypeError, "param_shardings", "params"):
      hkb.param_shardings(None, self.mesh, RULES)
    with refused(self, TypeError, "param_shardings", "rules"):
      hkb.param_shardings(SHAPES, self.mesh, None)
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.param_shardings: `params` must be a params "
      r"tree of arrays .*at blocks/linear/w it holds a str 'w'",
    ):
      hkb.param_shardings({"blocks/linear": {"w": "w"}}, self.mesh, RULES)
    with self.assertRaisesRegex(TypeError, r"^hkb.param_shardings: rule 0 is"):
      hkb.param_shardings(SHAPES, self.mesh, [("/w$",)])  # Named by the call, not the class.

  def test_shape_or_depth_issue_row_layers_over_data(self):
    # Was: "no rule ..." for b, rule 0 blamed for w; no word of `stacked=` or the layer count.
    rules = hkb.ShardingRules([(r"/w$", P(None, "model"))], stacked={"blocks": "data"})
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.param_shardings: `stacked=` \('blocks' -> "
      r"'data'\) splits the layer axis of parameter 'blocks/linear/[bw]'"
      r".*3 layers do not split over mesh axes \('data',\) \(2 parts\)",
    ):
      hkb.param_shardings(SHAPES, self.mesh, rules)

  @hypothesis.given(layers=st.integers(1, 9))
  @SETTINGS
  def test_shape_or_depth_any_layer_count(self, layers):
    shapes = {"blocks/linear": {"w": jax.ShapeDtypeStruct((layers, 8, 8), jnp.float32)}}
    rules = hkb.ShardingRules([], stacked={"blocks": "model"})
    if layers % 4:
      with self.assertRaisesRegex(ValueError, rf"{layers} layers do not split .*\(4 parts\)"):
        hkb.param_shardings(shapes, self.mesh, rules)
    else:
      spec = hkb.param_shardings(shapes, self.mesh, rules)["blocks/linear"]["w"].spec
      self.assertEqual(spec, P("model"))

  @hypothesis.given(axis=axis_names)
  @SETTINGS
  def test_unknown_name_axis_in_a_rule(self, axis):
    hypothesis.assume(axis not in ("data", "model"))
    with self.assertRaisesRegex(
      ValueError,
      rf"^hkb.param_shardings: rule 0 .*names mesh axis "
      rf"'{axis}'; the mesh has axes \('data', 'model'\)",
    ):
      hkb.param_shardings(SHAPES, self.mesh, [(r"/w$", P(None, axis))])


class Param_specsTest(TestCase):
  """`param_specs(params, rules, *, mesh=None)`."""

  def test_wrong_type(self):
    with refused(self, TypeError, "param_specs", "rules"):
      hkb.param_specs(SHAPES, None)
    with refused(self, TypeError, "param_specs", "mesh"):
      hkb.param_specs(SHAPES, RULES, mesh=("data",))

  def test_argument_order_mesh_as_rules(self):
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.param_specs: `rules` .*got a Mesh\. The "
      r"order is param_specs\(params, rules, mesh=mesh\)\.",
    ):
      hkb.param_specs(SHAPES, explicit_mesh())

  def test_unknown_name_axis(self):
    with refused(self, ValueError, "param_specs"):
      hkb.param_specs(SHAPES, [(r"/w$", P("tensor"))], mesh=explicit_mesh())

  def test_shape_or_depth(self):
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.param_specs: parameter 'blocks/linear/b' has "
      r"shape \(\), but it lies under 1 declared layer stack",
    ):
      hkb.param_specs({"blocks/linear": {"b": jnp.zeros([])}}, RULES)


class Explain_shardingsTest(TestCase):
  """`explain_shardings(params, rules, *, mesh=None)`."""

  def test_wrong_type(self):
    with refused(self, TypeError, "explain_shardings", "params"):
      hkb.explain_shardings(None, RULES)
    with self.assertRaisesRegex(TypeError, r"^hkb.explain_shardings: `rules` is 'w'"):
      hkb.explain_shardings(SHAPES, "w")

  def test_argument_order_rules_first(self):
    with refused(self, TypeError, "explain_shardings", "params"):
      hkb.explain_shardings(RULES, SHAPES)

  def test_unknown_name_axis(self):
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.explain_shardings: `stacked=` \('blocks' -> "
      r"'stage'\) .*mesh axis 'stage'",
    ):
      hkb.explain_shardings(
        SHAPES, hkb.ShardingRules([], stacked={"blocks": "stage"}), mesh=explicit_mesh()
      )

  def test_shape_or_depth(self):
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.explain_shardings: rule 0 .*splits dimension "
      r"2 \(size 8\) into 3 parts",
    ):
      hkb.explain_shardings(SHAPES, RULES, mesh=explicit_mesh((1, 3), ("data", "model")))


class Gather_overTest(TestCase):
  """`gather_over(tree, axes)`."""

  def test_wrong_type(self):
    for axes in (None, 0, "", ["data", 1]):
      with refused(self, TypeError, "gather_over", "axes"):
        hkb.gather_over(X, axes)

  def test_unknown_name_issue_row_typo_under_explicit_mesh(self):
    # Was: the axis ignored; the weight stayed split.
    mesh = explicit_mesh()
    w = jax.device_put(jnp.ones([8, 8]), NamedSharding(mesh, P("data", "model")))
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.gather_over: `axes` names mesh axis 'dta', "
      r"which the mesh lacks; the mesh has axes \('data', 'model'\)",
    ):
      jax.jit(lambda w: hkb.gather_over(w, "dta"))(w)

  @hypothesis.given(axis=axis_names)
  @SETTINGS
  def test_unknown_name_any_axis_under_auto_mesh(self, axis):
    hypothesis.assume(axis not in ("data", "model"))
    mesh = explicit_mesh(axis_type=AxisType.Auto)
    w = jax.device_put(jnp.ones([8, 8]), NamedSharding(mesh, P("data")))
    with refused(self, ValueError, "gather_over", "axes"):
      hkb.gather_over({"w": w}, ("data", axis))

  def test_without_a_mesh_nothing_to_check(self):
    np.testing.assert_array_equal(hkb.gather_over(X, "anything"), X)


# ---------------------------------------------------------------------------
# call_pure.py: call_pure, get_relevant_parameters (the lead's rewrite).
# ---------------------------------------------------------------------------


class Call_pureTest(TestCase):
  """`call_pure(fn, *args, init=None, name=None, **kwargs)`."""

  def test_wrong_type(self):
    with refused(self, TypeError, "call_pure", "fn"):
      init(lambda: hkb.call_pure(3, X, init=init_dense))
    with refused(self, TypeError, "call_pure", "init"):
      init(lambda: hkb.call_pure(dense, X, init=3))

  def test_unknown_name_name_not_a_string(self):
    with refused(self, TypeError, "call_pure", "name"):
      init(lambda: hkb.call_pure(dense, X, init=init_dense, name=3))

  def test_wrong_arity_no_init(self):
    with self.assertRaisesRegex(TypeError, r"^hkb.call_pure: needs `init=`"):
      init(lambda: hkb.call_pure(dense, X))

  def test_argument_order_fn_and_init_swapped(self):
    # call_pure(init_dense, X, init=dense): init runs with (rng, X) and fails inside.
    with self.assertRaisesRegex(Exception, r"^hkb.call_pure: .*`init`"):
      init(lambda: hkb.call_pure(init_dense, X, init=dense))

  def test_shape_or_depth_at_apply(self):
    f = hk.transform(lambda x: hkb.call_pure(dense, x, init=init_dense, name="proj"))
    params = f.init(KEY, X)
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.call_pure: parameter 'proj/w' .*has shape "
      r"\[4, 4\] in what apply was given, but this call needs \[5, 5\]",
    ):
      f.apply(params, None, jnp.ones([2, 5]))


class Get_relevant_parametersTest(TestCase):
  """`get_relevant_parameters(init, *args, name=None, **kwargs)`."""

  def test_wrong_type(self):
    with refused(self, TypeError, "get_relevant_parameters", "init"):
      init(lambda: hkb.get_relevant_parameters(None, X))

  def test_unknown_name_name_not_a_string(self):
    # Now: `'int' object is not subscriptable`.
    with refused(self, TypeError, "get_relevant_parameters", "name"):
      init(lambda: hkb.get_relevant_parameters(init_dense, X, name=4))

  def test_wrong_arity_init_arguments(self):
    with self.assertRaisesRegex(Exception, r"init_dense\(\) takes 2 positional arguments"):
      init(lambda: hkb.get_relevant_parameters(init_dense, X, X))

  def test_shape_or_depth_at_apply(self):
    f = hk.transform(lambda x: dense(hkb.get_relevant_parameters(init_dense, x), x))
    params = f.init(KEY, X)
    with self.assertRaisesRegex(ValueError, r"^hkb.get_relevant_parameters: parameter '~/w'"):
      f.apply(params, None, jnp.ones([2, 5]))


# ---------------------------------------------------------------------------
# The adapters (optional extras): from_flax, from_equinox, to_nnx, to_equinox.
# ---------------------------------------------------------------------------


class _AdapterCases(TestCase):
  def setUp(self):
    super().setUp()
    try:
      import equinox  # noqa: F401  # pylint: disable=unused-import,import-outside-toplevel
      from flax import nnx  # noqa: F401  # pylint: disable=unused-import,import-outside-toplevel
    except ImportError:
      self.skipTest("needs flax and equinox")


def nnx_linear(rngs):
  from flax import nnx  # pylint: disable=import-outside-toplevel

  return nnx.Linear(4, 2, rngs=rngs)


class From_flaxTest(_AdapterCases):
  """`from_flax(module, *, name, method, rng_streams, intermediates)`."""

  def test_wrong_type_module(self):
    with refused(self, TypeError, "from_flax", "module"):
      init(lambda: hkb.from_flax(None)(X))

  def test_wrong_type_name_and_streams(self):
    with refused(self, TypeError, "from_flax", "name"):
      init(lambda: hkb.from_flax(nnx_linear, name=3)(X))
    with refused(self, TypeError, "from_flax", "rng_streams"):
      init(lambda: hkb.from_flax(nnx_linear, rng_streams="dropout")(X))

  def test_wrong_type_issue_row_intermediates(self):
    # Issue 27, row 7: `sequence item 0: expected str instance, int found`.
    for bad in (3, "", ("intermediates",)):
      with refused(self, TypeError, "from_flax", "intermediates"):
        init(lambda bad=bad: hkb.from_flax(nnx_linear, intermediates=bad)(X))

  def test_wrong_type_method(self):
    # On entry, as `name=` (was: at the first call); and per call. An
    # empty name is no method (it would run `__call__` unnoticed).
    for bad in (3, ""):
      with refused(self, TypeError, "from_flax", "method"):
        hk.transform(lambda bad=bad: hkb.from_flax(nnx_linear, method=bad)).init(KEY)
      with refused(self, TypeError, "from_flax(Linear)", "method"):
        init(lambda bad=bad: hkb.from_flax(nnx_linear)(X, method=bad))

  def test_wrong_type_linen_call_rngs(self):
    import flax.linen as nn  # pylint: disable=import-outside-toplevel

    for rngs in (3, {"dropout": 3}, {1: KEY}):
      with refused(self, TypeError, "from_flax(Dense)", "rngs"):
        init(lambda rngs=rngs: hkb.from_flax(nn.Dense(2))(X, rngs=rngs))

  def test_argument_order_linen_streams_for_nnx(self):
    # An NNX module brings its streams: `rng_streams` (Linen's) was ignored.
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.from_flax: `rng_streams` is \('noise',\), "
      r"but it names the streams of a Linen module",
    ):
      init(lambda: hkb.from_flax(nnx_linear, rng_streams=("noise",))(X))


class From_equinoxTest(_AdapterCases):
  """`from_equinox(model, *, state, name)`."""

  def test_wrong_type_model(self):
    with refused(self, TypeError, "from_equinox", "model"):
      init(lambda: hkb.from_equinox(None)(X))

  def test_wrong_type_name(self):
    import equinox as eqx  # pylint: disable=import-outside-toplevel

    with refused(self, TypeError, "from_equinox", "name"):
      init(lambda: hkb.from_equinox(lambda key: eqx.nn.Linear(4, 2, key=key), name=3)(X))

  def test_wrong_type_issue_row_state(self):
    # Issue 27, row 8: `'tuple' object has no attribute 'get'` at the first call.
    import equinox as eqx  # pylint: disable=import-outside-toplevel

    model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch")
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.from_equinox: `state` must be None or the "
      r"model's eqx.nn.State; got a tuple of length 2\. Pass the state "
      r"that eqx.nn.make_with_state made",
    ):
      hkb.from_equinox(model, state=(model, state))
    with self.assertRaisesRegex(
      TypeError,
      r"^hkb.from_equinox: `state=` goes with a model "
      r"instance",
    ):
      hkb.from_equinox(lambda key: model, state=state)


LINEAR = hk.transform(lambda x: hk.Linear(2)(x))


class _ToForeignCases:
  """What `to_nnx` and `to_equinox` share: `f`, `params`, `state` (a mixin)."""

  api = ""

  def convert(self, f, *args, **kwargs):
    raise NotImplementedError

  def test_wrong_type_f(self):
    with refused(self, TypeError, self.api, "f"):
      self.convert(LINEAR.apply, X)

  def test_wrong_type_params_and_state(self):
    with refused(self, TypeError, self.api, "params"):
      self.convert(LINEAR, X, params=3)
    with refused(self, TypeError, self.api, "state"):
      self.convert(LINEAR, X, params=LINEAR.init(KEY, X), state=[{}])

  def test_wrong_arity_state_without_params(self):
    # Was: the state dropped, f.init's used.
    with refused(self, ValueError, self.api, "state"):
      self.convert(LINEAR, X, state={})

  def test_shape_or_depth_params(self):
    params = LINEAR.init(KEY, X)
    with refused(self, ValueError, self.api, "params"):
      self.convert(LINEAR, jnp.ones([2, 5]), params=params)

  def test_shape_or_depth_state(self):
    f = hk.transform_with_state(lambda x: hk.BatchNorm(True, True, 0.9)(x, True))
    params, state = f.init(KEY, X)
    with self.assertRaisesRegex(
      ValueError,
      rf"^hkb.{self.api}: f has state .*`params=` came "
      r"without `state=`",
    ):
      self.convert(f, X, params=params)
    with refused(self, ValueError, self.api, "state"):
      self.convert(f, jnp.ones([2, 5]), params=f.init(KEY, jnp.ones([2, 5]))[0], state=state)

  def test_issue_row_without_apply_rng_as_its_apply(self):
    # Issue 27, row 9: accepted, then each call failed (`takes 1 positional argument but 2
    # were given`). Now its apply runs, without an rng.
    f = hk.without_apply_rng(LINEAR)
    params = f.init(KEY, X)
    model = self.convert(f, X, params=params)
    np.testing.assert_allclose(model(X), f.apply(params, X), rtol=1e-6)


class To_nnxTest(_ToForeignCases, _AdapterCases):
  """`to_nnx(f, *args, rngs, params, state, rng_stream, **kwargs)`."""

  api = "to_nnx"

  def convert(self, f, *args, **kwargs):
    from flax import nnx  # pylint: disable=import-outside-toplevel

    kwargs.setdefault("rngs", nnx.Rngs(0))
    return hkb.to_nnx(f, *args, **kwargs)

  def test_wrong_type_rngs_and_stream(self):
    with refused(self, TypeError, "to_nnx", "rngs"):
      hkb.to_nnx(LINEAR, X, rngs=KEY)
    with refused(self, TypeError, "to_nnx", "rng_stream"):
      self.convert(LINEAR, X, rng_stream=3)


class To_equinoxTest(_ToForeignCases, _AdapterCases):
  """`to_equinox(f, *args, key, params, state, **kwargs)`."""

  api = "to_equinox"

  def convert(self, f, *args, **kwargs):
    kwargs.setdefault("key", KEY)
    return hkb.to_equinox(f, *args, **kwargs)

  def test_wrong_type_key(self):
    with refused(self, TypeError, "to_equinox", "key"):
      hkb.to_equinox(LINEAR, X, key=3)


if __name__ == "__main__":
  absltest.main()
