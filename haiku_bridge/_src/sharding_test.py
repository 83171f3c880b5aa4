"""Tests for sharding rules; bridged params under jit and shard_map, 8 devices.

Every numeric check compares a sharded run with the same model run on one
device; every placement check reads the arrays' actual `.sharding.spec`.
"""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import functools
import re
from typing import NamedTuple
import unittest

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from haiku_bridge._src import call_pure as call_pure_lib
from haiku_bridge._src import custom_grad
from haiku_bridge._src import layer_scan
from haiku_bridge._src import sharding
from testing import transformer as transformer_model

call_pure = call_pure_lib.call_pure
STACK = layer_scan.NO_PER_LAYER_NAME

KEY = jax.random.PRNGKey(0)
IN, WIDTH, HIDDEN, DEPTH, BATCH = 8, 16, 32, 3, 16
TOL = dict(rtol=1e-5, atol=1e-5)
# A gradient summed over 8 devices adds its terms in another order than one device does: the
# difference scales with the leaf's magnitude, not the entry's. Measured on jax 0.12.1 (XLA:CPU):
# 1.8e-5 on a stacked weight's gradient entry of 0.29, 2.3e-4 on an embedding's of 0.32 whose
# leaf reaches 39; within 1e-5 on jax 0.10.2.
SUM_ORDER_RTOL = 3e-5


def assert_sums_close(got, want, rtol=TOL["rtol"], atol=TOL["atol"]) -> None:
  """`got` within `rtol`/`atol` of `want`, `atol` at least `SUM_ORDER_RTOL` of each leaf's largest."""
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    w = np.asarray(w)
    np.testing.assert_allclose(
      g,
      w,
      rtol=rtol,
      atol=max(atol, SUM_ORDER_RTOL * float(np.max(np.abs(w), initial=0))),
      err_msg=jax.tree_util.keystr(path),
    )


def setUpModule():
  if jax.device_count() < 8:
    raise unittest.SkipTest(
      f"needs 8 devices, jax has {jax.device_count()} {jax.default_backend()} devices."
    )


def needs_jax_0_7(what):
  """Skips a test of `what` on jax 0.6, which lacks it."""
  return unittest.skipUnless(
    hasattr(jax, "shard_map") and hasattr(jax, "set_mesh"),
    f"{what} needs jax >= 0.7.0 (this is jax {jax.__version__}).",
  )


def make_mesh(shape, names, axis_type=AxisType.Auto):
  devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, names, axis_types=(axis_type,) * len(names))


def batch():
  return jax.random.normal(jax.random.PRNGKey(1), [BATCH, IN])


# ---------------------------------------------------------------------------
# Models: a bridged MLP block, and a stack of layers under lax.scan.
# ---------------------------------------------------------------------------


def mlp(params, x):
  """A plain-JAX MLP block; bridged by `call_pure`."""
  h = jax.nn.gelu(x @ params["w1"] + params["b1"])
  return h @ params["w2"] + params["b2"]


def init_mlp(rng, x):
  k1, k2 = jax.random.split(rng)
  return {
    "w1": jax.random.normal(k1, [x.shape[-1], HIDDEN]) * 0.3,
    "b1": jax.random.normal(k2, [HIDDEN]) * 0.1,
    "w2": jax.random.normal(k2, [HIDDEN, x.shape[-1]]) * 0.3,
    "b2": jnp.zeros([x.shape[-1]]),
  }


class Net(hk.Module):
  """Puts the model body in a module, so params live under `net/`."""

  def __init__(self, body, name="net"):
    super().__init__(name=name)
    self._body = body

  def __call__(self, x):
    h = hk.Linear(WIDTH, name="embed")(x)
    return self._body(h)


def call_pure_model(x):
  return Net(lambda h: h + call_pure(mlp, h, init=init_mlp, name="mlp"))(x)


def haiku_layer(h):
  return h + hk.Linear(WIDTH, name="out")(jax.nn.gelu(hk.Linear(HIDDEN, name="in")(h)))


def scan_model(x):
  def body(h):
    h = layer_scan.repeat_layer(lambda p, h: h + mlp(p, h), h, DEPTH, init=init_mlp)
    return layer_scan.repeat_layer(haiku_layer, h, DEPTH, name="blocks")

  return Net(body)(x)


MODELS = {"call_pure": call_pure_model, "layer_scan": scan_model}


def loss_fn(f):
  return lambda params, x: jnp.mean(f.apply(params, None, x) ** 2)


def loss_out_and_grads(f):
  """`(params, x) -> ((loss, out), grads)`: one program for all three."""

  def loss_and_out(params, x):
    out = f.apply(params, None, x)
    return jnp.mean(out**2), out

  return jax.value_and_grad(loss_and_out, has_aux=True)


@functools.cache
def initial_params(model):
  """The model's params on the host, made once per test run."""
  return jax.device_get(jax.jit(hk.transform(MODELS[model]).init)(KEY, batch()))


def call_pure_reference():
  """`(x, params, loss, grads)` of `call_pure_model` on one device."""
  x = batch()
  params = initial_params("call_pure")
  loss, grads = on_one_device(jax.value_and_grad(loss_fn(hk.transform(call_pure_model))), params, x)
  return x, params, loss, grads


def on_one_device(fn, *args):
  """`fn(*args)` jitted with no shardings: the one-device ground truth."""
  out = jax.jit(fn)(*args)
  devices = {d for x in jax.tree.leaves(out) for d in x.sharding.device_set}
  assert len(devices) == 1, devices
  return out


def assert_specs(test, tree, expected):
  """Each array's actual `.sharding.spec` is `expected[bundle][name]`.

  Trailing `None`s are dropped on both sides: `P(None,)` and `P()` say the
  same (jax writes the first for a result of Explicit-axes autodiff).
  """
  trimmed = lambda spec: tuple(spec)[
    : max([i + 1 for i, e in enumerate(spec) if e is not None], default=0)
  ]
  actual = jax.tree.map(lambda a: trimmed(a.sharding.spec), tree)
  test.assertEqual(actual, jax.tree.map(trimmed, expected, is_leaf=lambda s: isinstance(s, P)))


# ---------------------------------------------------------------------------
# The rules themselves.
# ---------------------------------------------------------------------------


class ShardingRulesTest(parameterized.TestCase):
  def setUp(self):
    super().setUp()
    self.mesh = make_mesh((2, 4), ("data", "model"))

  def test_first_match_wins(self):
    rules = sharding.ShardingRules(
      [(r"mlp/w1$", P(None, "model")), (r"w1$", P("model")), (r"/w", P("data"))]
    )
    self.assertEqual(rules.spec_for("net/mlp/w1", (8, 8)), P(None, "model"))
    self.assertEqual(rules.spec_for("net/other/w1", (8, 8)), P("model"))
    self.assertEqual(rules.spec_for("net/other/w2", (8, 8)), P("data"))

  def test_a_stack_two_patterns_match_has_one_layer_axis_the_firsts(self):
    # One layer axis per prefix of the path, however many patterns match it;
    # its mesh axes are the first matching pattern's, as rules' first wins.
    for stacked, layer in (
      ({"blocks": "data", "net/blocks": None}, "data"),
      ({"net/blocks": None, "blocks": "data"}, None),
    ):
      rules = sharding.ShardingRules([(r"w$", P(None, "model"))], stacked=stacked)
      self.assertEqual(rules.spec_for("net/blocks/linear/w", (4, 8, 16)), P(layer, None, "model"))

  def test_pairs_and_tuples_are_accepted(self):
    params = {"a": {"w": jnp.zeros([4, 8])}}
    specs = sharding.param_specs(params, [(r"w$", (None, "model"))])
    self.assertEqual(specs, {"a": {"w": P(None, "model")}})

  def test_unmatched_are_replicated_and_reported(self):
    shapes = jax.eval_shape(hk.transform(call_pure_model).init, KEY, batch())
    rules = sharding.ShardingRules([(r"mlp/w1$", P(None, "model")), (r"no/such/param", P("data"))])
    shardings, unmatched = sharding.param_shardings(shapes, self.mesh, rules, return_unmatched=True)
    self.assertEqual(shardings["net/mlp"]["w1"], NamedSharding(self.mesh, P(None, "model")))
    self.assertEqual(shardings["net/mlp"]["w2"], NamedSharding(self.mesh, P()))
    self.assertEqual(
      sorted(unmatched), ["net/embed/b", "net/embed/w", "net/mlp/b1", "net/mlp/b2", "net/mlp/w2"]
    )

    report = sharding.explain_shardings(shapes, rules, mesh=self.mesh)
    self.assertEqual(sorted(report.unmatched), sorted(unmatched))
    self.assertEqual(report.unused_rules, [rules.rules[1]])
    by_path = {p.path: p for p in report.params}
    self.assertEqual(by_path["net/mlp/w1"].rule, 0)
    self.assertEqual(by_path["net/mlp/w1"].shape, (WIDTH, HIDDEN))
    table = str(report)
    self.assertRegex(
      table,
      r"net/mlp/w1 +\(16, 32\) +P\(None, 'model'\) +0: "
      r"mlp/w1\$",
    )
    self.assertRegex(table, r"net/embed/w +\(8, 16\) +P\(\) +-")
    self.assertIn("unused rule: 'no/such/param'", table)

  def test_stacked_rule_is_written_for_one_layer(self):
    shapes = jax.eval_shape(hk.transform(scan_model).init, KEY, batch())
    rules = sharding.ShardingRules(
      [
        (r"w1$", P(None, "model")),
        (r"b1$", P("model")),
        (r"w2$", P("model", None)),
        (r"in/w$", P(None, "model")),
        (r"out/w$", P("model")),
      ],
      stacked=[STACK, "blocks"],
    )
    self.assertEqual(
      sharding.param_specs(shapes, rules, mesh=self.mesh),
      {
        "net/embed": {"b": P(), "w": P()},
        f"net/{STACK}/~": {
          "w1": P(None, None, "model"),
          "b1": P(None, "model"),
          "w2": P(None, "model", None),
          "b2": P(),
        },
        "net/blocks/in": {"w": P(None, None, "model"), "b": P()},
        "net/blocks/out": {"w": P(None, "model"), "b": P()},
      },
    )

  def test_stack_prefix_must_end_at_a_path_boundary(self):
    rules = sharding.ShardingRules([(r"w$", P("model"))], stacked=["blocks"])
    self.assertEqual(rules.place("net/blocks/lin/w", (3, 4, 4)).layer_axes, 1)
    self.assertEqual(rules.place("net/myblocks/lin/w", (4, 4)).layer_axes, 0)
    # The parameter name itself is not a stack.
    self.assertEqual(rules.place("net/lin/blocks", (4,)).layer_axes, 0)

  def test_nested_stacks_get_one_layer_axis_each(self):
    rules = sharding.ShardingRules([(r"w$", P("model"))], stacked=[STACK])
    placed = rules.place(f"net/{STACK}/{STACK}/lin/w", (2, 3, 8, 8))
    self.assertEqual(placed.layer_axes, 2)
    self.assertEqual(placed.spec, P(None, None, "model"))

  def test_layer_axis_may_be_split_over_a_mesh_axis(self):
    rules = sharding.ShardingRules([(r"w$", P(None, "model"))], stacked={"blocks": "data"})
    self.assertEqual(rules.spec_for("blocks/lin/w", (2, 8, 8), self.mesh), P("data", None, "model"))
    # Unmatched: the layer axis is still split; the rest is replicated.
    self.assertEqual(rules.spec_for("blocks/lin/b", (2, 8), self.mesh), P("data"))

  def test_undeclared_stack_gets_the_rule_as_written(self):
    # Nothing is guessed from the rank: a per-layer rule on an undeclared
    # stack applies to the stack's leading axes.
    rules = sharding.ShardingRules([(r"w$", P(None, "model"))])
    self.assertEqual(rules.spec_for(f"{STACK}/lin/w", (4, 8, 8)), P(None, "model"))

  def test_arrays_and_eval_shape_agree(self):
    rules = sharding.ShardingRules([(r"w1$", P(None, "model"))], stacked=[STACK, "blocks"])
    self.assertEqual(
      sharding.param_specs(initial_params("layer_scan"), rules),
      sharding.param_specs(jax.eval_shape(hk.transform(scan_model).init, KEY, batch()), rules),
    )

  def test_any_pytree_paths_join_keys(self):

    class MomentumState(NamedTuple):
      count: jax.Array
      mu: dict

    params = {"net/mlp": {"w1": jnp.zeros([4, 8])}}
    state = (MomentumState(jnp.zeros([]), params), [jnp.zeros([8, 8])], {3: jnp.zeros([2])})
    report = sharding.explain_shardings(
      state, [(r"mlp/w1$", P(None, "model")), (r"^1/0$", P("data"))]
    )
    self.assertEqual(
      [(p.path, p.spec) for p in report.params],
      [("0/count", P()), ("0/mu/net/mlp/w1", P(None, "model")), ("1/0", P("data")), ("2/3", P())],
    )
    # The same strings as jax's own `keystr`.
    self.assertEqual(
      [p.path for p in report.params],
      [
        jax.tree_util.keystr(path, simple=True, separator="/")
        for path, _ in jax.tree_util.tree_leaves_with_path(state)
      ],
    )

  def test_numbered_copies_of_a_stack_are_the_same_stack(self):
    # Haiku names the second `repeat_layer(name="blocks")` `blocks_1`, the
    # second unnamed stack `{STACK}_1`; each copy's layer axis comes first.
    def two_of_each(x):
      h = layer_scan.repeat_layer(haiku_layer, x, DEPTH, name="blocks")
      h = layer_scan.repeat_layer(haiku_layer, h, DEPTH, name="blocks")
      h = layer_scan.repeat_layer(haiku_layer, h, DEPTH)
      return layer_scan.repeat_layer(haiku_layer, h, DEPTH)

    shapes = jax.eval_shape(hk.transform(lambda x: Net(two_of_each)(x)).init, KEY, batch())
    rules = sharding.ShardingRules(
      [(r"in/w$", P(None, "model")), (r"out/w$", P("model", None))], stacked=["blocks", STACK]
    )
    per_layer = {
      "in": {"w": P(None, None, "model"), "b": P()},
      "out": {"w": P(None, "model", None), "b": P()},
    }
    self.assertEqual(
      sharding.param_specs(shapes, rules, mesh=self.mesh),
      {
        "net/embed": {"w": P(), "b": P()},
        **{
          f"net/{stack}/{layer}": specs
          for stack in ("blocks", "blocks_1", STACK, f"{STACK}_1")
          for layer, specs in per_layer.items()
        },
      },
    )

  def test_numbered_copy_matching(self):
    rules = sharding.ShardingRules([], stacked=["blocks"])
    for path in ("blocks/lin/w", "blocks_1/lin/w", "net/blocks_12/lin/w"):
      self.assertEqual(rules.place(path, (3, 4, 4)).layer_axes, 1, path)
    # Not a copy of `blocks`: another name, or Haiku's `_0` of a list.
    for path in ("blocks_a/lin/w", "blocks_0/lin/w", "blocksy_1/lin/w"):
      self.assertEqual(rules.place(path, (4, 4)).layer_axes, 0, path)
    # A pattern naming one copy covers that copy only.
    second = sharding.ShardingRules([], stacked=["blocks_1"])
    self.assertEqual(second.place("blocks_1/lin/w", (3, 4)).layer_axes, 1)
    self.assertEqual(second.place("blocks/lin/w", (4, 4)).layer_axes, 0)

  # Bad input ---------------------------------------------------------------

  def test_spec_longer_than_param_names_param_and_rule(self):
    params = {"net/mlp": {"b1": jnp.zeros([HIDDEN])}}
    rules = [(r"w1$", P()), (r"mlp/b1$", P(None, "model"))]
    with self.assertRaisesRegex(
      ValueError,
      re.escape(
        "rule 1 ('mlp/b1$' -> P(None, 'model')) gives parameter "
        "'net/mlp/b1' (shape (32,)) the spec P(None, 'model'), with "
        "2 axes, more than its 1 dimensions"
      ),
    ):
      sharding.param_shardings(params, self.mesh, rules)

  def test_stacked_spec_too_long_says_rules_are_per_layer(self):
    rules = sharding.ShardingRules([(r"w$", P(None, None, "model"))], stacked=["blocks"])
    with self.assertRaisesRegex(
      ValueError,
      r"(?s)rule 0 .*'blocks/lin/w'.*first 1 entry is for the "
      r"layer axes of stack\(s\) 'blocks'; write the rule's spec for one "
      r"layer",
    ):
      rules.place("blocks/lin/w", (3, 8, 8))

  def test_stacked_param_without_a_layer_axis(self):
    rules = sharding.ShardingRules([], stacked=["blocks", "inner"])
    with self.assertRaisesRegex(
      ValueError,
      re.escape(
        "parameter 'blocks/inner/b' has shape (4,), but it lies under 2 "
        "declared layer stack(s) ('blocks', 'blocks/inner')"
      ),
    ):
      rules.place("blocks/inner/b", (4,))

  def test_unknown_mesh_axis_names_param_rule_and_mesh_axes(self):
    params = {"net/mlp": {"w1": jnp.zeros([WIDTH, HIDDEN])}}
    with self.assertRaisesRegex(
      ValueError,
      re.escape(
        "rule 0 ('w1$' -> P(None, 'modle')) gives parameter "
        "'net/mlp/w1' the spec P(None, 'modle'), which names mesh "
        "axis 'modle'; the mesh has axes ('data', 'model')"
      ),
    ):
      sharding.param_shardings(params, self.mesh, [(r"w1$", P(None, "modle"))])

  def test_unknown_axis_in_a_tuple_entry(self):
    with self.assertRaisesRegex(ValueError, r"mesh axis 'x'"):
      sharding.param_specs({"w": jnp.zeros([8])}, [("w", P(("data", "x")))], mesh=self.mesh)

  def test_unknown_axis_for_the_layer_axis(self):
    rules = sharding.ShardingRules([], stacked={"blocks": "stage"})
    with self.assertRaisesRegex(
      ValueError,
      r"^hkb.ShardingRules.place: `stacked=` \('blocks' -> "
      r"'stage'\) gives parameter 'blocks/lin/w' .*mesh axis 'stage'",
    ):
      rules.place("blocks/lin/w", (2, 8), self.mesh)

  def test_indivisible_dimension(self):
    with self.assertRaisesRegex(
      ValueError,
      r"rule 0 .*'lin/w'.*splits dimension 1 \(size 6\) into 4 "
      r"parts",
    ):
      sharding.param_specs(
        {"lin": {"w": jnp.zeros([8, 6])}}, [(r"w$", P(None, "model"))], mesh=self.mesh
      )

  def test_mesh_axis_used_twice(self):
    with self.assertRaisesRegex(ValueError, r"dimensions 0 and 1 over the same mesh axis"):
      sharding.param_specs({"w": jnp.zeros([8, 8])}, [(r"w", P("model", "model"))], mesh=self.mesh)

  def test_unmatched_param_keeps_each_split_layer_axis(self):
    # Nested stacks, only the inner one split: an unmatched parameter keeps
    # that split in its own place (one entry per stack, outermost first).
    rules = sharding.ShardingRules([], stacked={"outer": None, "inner": "data"})
    spec = rules.spec_for("outer/inner/lin/b", (3, 2, 8), self.mesh)
    self.assertEqual(spec, P(None, "data"))
    # jax splits the inner layer axis so: each device holds 1 of 2 layers.
    array = jax.device_put(jnp.zeros([3, 2, 8]), NamedSharding(self.mesh, spec))
    self.assertEqual(array.addressable_shards[0].data.shape, (3, 1, 8))

  def test_stack_pattern_alternatives_each_end_at_a_boundary(self):
    rules = sharding.ShardingRules([], stacked=["encoder|decoder"])
    for path in ("net/encoder/lin/w", "net/decoder/lin/w", "net/decoder_1/lin/w"):
      self.assertEqual(rules.place(path, (3, 4)).layer_axes, 1, path)
    for path in ("net/mydecoder/lin/w", "net/encoders/lin/w", "net/lin/decoder"):
      self.assertEqual(rules.place(path, (3, 4)).layer_axes, 0, path)

  def test_unconstrained_entries_pass_the_mesh_check(self):
    # P.UNCONSTRAINED leaves a dimension to the partitioner (for
    # with_sharding_constraint); it names no mesh axis.
    spec = P(P.UNCONSTRAINED, "model")
    self.assertEqual(
      sharding.param_specs({"w": jnp.zeros([8, 8])}, [(r"w$", spec)], mesh=self.mesh), {"w": spec}
    )

  def test_tuple_entry_divides_by_the_product_of_its_axes(self):
    # ("data", "model") splits a dimension 2 * 4 = 8 ways, as jax counts.
    spec = P(("data", "model"))
    for size, divides in ((16, True), (4, False)):
      named = NamedSharding(self.mesh, spec)
      if divides:
        jax.device_put(jnp.zeros([size]), named)
        sharding.param_specs({"w": jnp.zeros([size])}, [(r"w$", spec)], mesh=self.mesh)
        continue
      with self.assertRaisesRegex(Exception, "8 times"):
        jax.device_put(jnp.zeros([size]), named)
      with self.assertRaisesRegex(ValueError, r"splits dimension 0 \(size 4\) into 8 parts"):
        sharding.param_specs({"w": jnp.zeros([size])}, [(r"w$", spec)], mesh=self.mesh)

  def test_indivisible_layer_axis_says_layers_and_stack(self):
    rules = sharding.ShardingRules([], stacked={"blocks": "data"})
    with self.assertRaisesRegex(Exception, "2 times"):  # jax refuses too.
      jax.device_put(jnp.zeros([3, 8]), NamedSharding(self.mesh, P("data")))
    with self.assertRaisesRegex(
      ValueError,
      r"`stacked=` \('blocks' -> 'data'\) splits the layer axis "
      r"of parameter 'blocks/lin/b' \(shape \(3, 8\)\): 3 layers do not "
      r"split over mesh axes \('data',\)",
    ):
      rules.place("blocks/lin/b", (3, 8), self.mesh)

  def test_report_table_names_each_rule_and_lines_up(self):
    params = {
      "a": {"w": jnp.zeros([4, 8]), "bias": jnp.zeros([8])},
      "long/name": {"w": jnp.zeros([8])},
    }
    rules = [(r"a/w$", P(None, "model")), (r"long/name/w$", P("data")), (r"^a/bias$", P())]
    lines = str(sharding.explain_shardings(params, rules)).splitlines()
    rows = {line.split()[0]: line for line in lines}
    self.assertTrue(rows["a/w"].endswith("  0: a/w$"), rows["a/w"])
    self.assertTrue(rows["long/name/w"].endswith("  1: long/name/w$"))
    self.assertTrue(rows["a/bias"].endswith("  2: ^a/bias$"))
    # Each column starts where its header does.
    for header in ("shape", "spec", "rule"):
      column = lines[0].index(header)
      for line in lines[1:]:
        self.assertNotEqual(line[column], " ", (header, line))
        self.assertEqual(line[column - 2 : column], "  ", (header, line))

  def test_stacked_axes_list_is_copied(self):
    # A list of mesh axes is read once: changing it later changes nothing.
    axes = ["data"]
    rules = sharding.ShardingRules([], stacked={"blocks": axes})
    axes.append("model")
    self.assertEqual(rules.spec_for("blocks/lin/b", (2, 8), self.mesh), P("data"))
    self.assertEqual(rules.stacked, {"blocks": ("data",)})

  def test_zero_sized_parameter_is_placed(self):
    # jax places an empty array by a spec like any other.
    rules = sharding.ShardingRules([(r"w$", P(None, "model"))])
    self.assertEqual(rules.spec_for("lin/w", (0, 8), self.mesh), P(None, "model"))
    params = {"lin": {"w": jnp.zeros([0, 8])}}
    shardings = sharding.param_shardings(params, self.mesh, [(r"w$", P(None, "model"))])
    placed = jax.device_put(params, shardings)
    self.assertEqual(placed["lin"]["w"].sharding.spec, P(None, "model"))

  def test_bad_rules(self):
    with self.assertRaisesRegex(ValueError, r"rule 1 is not a valid regex"):
      sharding.ShardingRules([(r"w$", P()), (r"(w", P())])
    with self.assertRaisesRegex(TypeError, r"rule 0 \('w'\) has spec 'model'"):
      sharding.ShardingRules([(r"w", "model")])
    with self.assertRaisesRegex(TypeError, r"stacked=\['blocks'\]"):
      sharding.ShardingRules([], stacked="blocks")

  @parameterized.named_parameters(
    ("pattern_alone", [r"w$"], re.escape("rule 0 is 'w$', not a (pattern, spec) pair")),
    (
      "spec_alone",
      [(r"w$", P()), P("model")],
      re.escape("rule 1 is P('model',), not a (pattern, spec)"),
    ),
    ("triple", [(r"w$", P(), P())], r"rule 0 is .*, not a \(pattern, spec\) pair"),
  )
  def test_rule_that_is_not_a_pair_says_what_to_write(self, rules, message):
    with self.assertRaisesRegex(TypeError, message) as raised:
      sharding.ShardingRules(rules)
    self.assertIn("Write each rule as a pair: (", str(raised.exception))
    if isinstance(rules[0], str):
      self.assertIn("('w$', P(None, 'model'))", str(raised.exception))

  def test_rules_that_are_not_a_list(self):
    with self.assertRaisesRegex(TypeError, r"`rules` is 'w\$'; pass a list of"):
      sharding.ShardingRules(r"w$")
    with self.assertRaisesRegex(TypeError, r"list\(rules.items\(\)\)"):
      sharding.ShardingRules({r"w$": P("model")})


# ---------------------------------------------------------------------------
# jit with NamedShardings: params created and kept where the rules say.
# ---------------------------------------------------------------------------

# One-dimensional mesh: the batch and every weight matrix split 8 ways.
FSDP_RULES = sharding.ShardingRules(
  [(r"/w1$|/in/w$|embed/w$", P(None, "data")), (r"/b1$", P("data")), (r"/w2$", P("data", None))],
  stacked=[STACK, "blocks"],
)

FSDP_SPECS = {
  "call_pure": {
    "net/embed": {"w": P(None, "data"), "b": P()},
    "net/mlp": {"w1": P(None, "data"), "b1": P("data"), "w2": P("data", None), "b2": P()},
  },
  "layer_scan": {
    "net/embed": {"w": P(None, "data"), "b": P()},
    f"net/{STACK}/~": {
      "w1": P(None, None, "data"),
      "b1": P(None, "data"),
      "w2": P(None, "data", None),
      "b2": P(),
    },
    "net/blocks/in": {"w": P(None, None, "data"), "b": P()},
    "net/blocks/out": {"w": P(), "b": P()},
  },
}


class JitShardedTest(parameterized.TestCase):
  @parameterized.parameters("call_pure", "layer_scan")
  def test_init_and_step_sharded_equal_one_device(self, model):
    mesh = make_mesh((8,), ("data",))
    f = hk.transform(MODELS[model])
    x = batch()
    ref_params = initial_params(model)
    (ref_loss, ref_out), ref_grads = on_one_device(loss_out_and_grads(f), ref_params, x)

    shardings = sharding.param_shardings(jax.eval_shape(f.init, KEY, x), mesh, FSDP_RULES)
    batch_sharding = NamedSharding(mesh, P("data"))
    params = jax.jit(f.init, out_shardings=shardings)(KEY, x)
    assert_specs(self, params, FSDP_SPECS[model])
    chex.assert_trees_all_close(params, ref_params, **TOL)

    step = jax.jit(
      loss_out_and_grads(f),
      in_shardings=(shardings, batch_sharding),
      out_shardings=((None, batch_sharding), shardings),
    )
    (loss, out), grads = step(params, jax.device_put(x, batch_sharding))
    assert_specs(self, grads, FSDP_SPECS[model])
    self.assertEqual(out.sharding.spec, P("data"))
    np.testing.assert_allclose(loss, ref_loss, **TOL)
    chex.assert_trees_all_close(out, ref_out, **TOL)
    assert_sums_close(grads, ref_grads)


# ---------------------------------------------------------------------------
# shard_map data parallelism: local gradients, averaged with pmean.
# ---------------------------------------------------------------------------


@needs_jax_0_7("jax.shard_map")
class ShardMapDataParallelTest(parameterized.TestCase):
  @parameterized.product(model=["call_pure", "layer_scan"], check_vma=[True, False])
  def test_pmean_of_local_gradients_equals_one_device(self, model, check_vma):
    if check_vma and not hasattr(jax.lax, "pcast"):
      self.skipTest(f"jax.lax.pcast needs jax >= 0.9.0 (this is jax {jax.__version__}).")
    mesh = make_mesh((8,), ("data",))
    f = hk.transform(MODELS[model])
    x = batch()
    params = initial_params(model)
    ref_grads = on_one_device(jax.grad(loss_fn(f)), params, x)

    def local_grads(params, x):
      if check_vma:
        # Replicated params are invariant over "data"; their gradient would
        # be summed over devices by autodiff. Cast them to varying to get
        # each device's own gradient, as in the unchecked mode.
        params = jax.lax.pcast(params, "data", to="varying")
      grads = jax.grad(loss_fn(f))(params, x)  # Over this device's batch.
      return jax.lax.pmean(grads, "data")

    specs = sharding.param_specs(params, [], mesh=mesh)  # All replicated.
    self.assertEqual(set(jax.tree.leaves(specs)), {P()})
    grads = jax.jit(
      jax.shard_map(
        local_grads, mesh=mesh, in_specs=(specs, P("data")), out_specs=specs, check_vma=check_vma
      )
    )(params, x)
    chex.assert_trees_all_close(grads, ref_grads, **TOL)

  def test_psum_of_local_gradients_equals_one_device_sum(self):
    mesh = make_mesh((8,), ("data",))
    f = hk.transform(scan_model)
    x = batch()
    params = initial_params("layer_scan")
    sum_loss = lambda p, x: jnp.sum(f.apply(p, None, x) ** 2)
    ref_grads = on_one_device(jax.grad(sum_loss), params, x)
    specs = sharding.param_specs(params, [])
    grads = jax.jit(
      jax.shard_map(
        lambda p, x: jax.lax.psum(jax.grad(sum_loss)(p, x), "data"),
        mesh=mesh,
        in_specs=(specs, P("data")),
        out_specs=specs,
        check_vma=False,
      )
    )(params, x)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------
# A 2-D (data, model) mesh: Megatron-style split of a bridged MLP block.
# ---------------------------------------------------------------------------

# Column-split first weight, row-split second: the hidden activation stays
# split over "model", and one all-reduce per block gives the output.
MEGATRON_RULES = sharding.ShardingRules(
  [(r"/w1$", P(None, "model")), (r"/b1$", P("model")), (r"/w2$", P("model", None))], stacked=[STACK]
)


def megatron_specs(bundle, layer_axes=0):
  lead = (None,) * layer_axes
  return {
    bundle: {
      "w1": P(*lead, None, "model"),
      "b1": P(*lead, "model"),
      "w2": P(*lead, "model", None),
      "b2": P(),
    }
  }


def shard_mapped_mlp(mesh, seen_shapes):
  """`mlp` with the Megatron split written out: shard_map and one psum.

  Bridged by `call_pure`, so the Haiku params stay global arrays; the split
  happens inside the pure function, where the params are explicit.
  """
  block_rules = [(r"w1$", P(None, "model")), (r"b1$", P("model")), (r"w2$", P("model", None))]

  def local(params, x):
    seen_shapes.update(jax.tree.map(jnp.shape, params))
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])  # h: hidden/4 columns.
    partial = h @ params["w2"]  # A partial sum...
    return jax.lax.psum(partial, "model") + params["b2"]  # ...all-reduced.

  def block(params, x):
    specs = sharding.param_specs(params, block_rules, mesh=mesh)
    return jax.shard_map(local, mesh=mesh, in_specs=(specs, P("data")), out_specs=P("data"))(
      params, x
    )

  return block


def explicit_mlp(params, x):
  """`mlp` for Explicit mesh axes: the row-split matmul names its output's.

  `jax.typeof(x).sharding` is `x`'s own: under an Explicit mesh its spec
  (batch over "data"), with no mesh none, so one function serves both.
  """
  h = jax.nn.gelu(x @ params["w1"] + params["b1"])
  out = jnp.dot(h, params["w2"], out_sharding=jax.typeof(x).sharding)
  return out + params["b2"]


class MegatronTest(parameterized.TestCase):
  def setUp(self):
    super().setUp()
    self.mesh = make_mesh((2, 4), ("data", "model"))
    self.batch_sharding = NamedSharding(self.mesh, P("data"))

  def check_sharded_equals_one_device(self, f, expected_specs):
    x = batch()
    shardings = sharding.param_shardings(jax.eval_shape(f.init, KEY, x), self.mesh, MEGATRON_RULES)
    params = jax.jit(f.init, out_shardings=shardings)(KEY, x)
    ref_params = jax.device_get(params)
    (_, ref_out), ref_grads = on_one_device(loss_out_and_grads(f), ref_params, x)
    (_, out), grads = jax.jit(
      loss_out_and_grads(f),
      in_shardings=(shardings, self.batch_sharding),
      out_shardings=((None, self.batch_sharding), shardings),
    )(params, jax.device_put(x, self.batch_sharding))
    block_params = {k: v for k, v in params.items() if k in expected_specs}
    assert_specs(self, block_params, expected_specs)
    assert_specs(self, {k: grads[k] for k in expected_specs}, expected_specs)
    chex.assert_trees_all_close(out, ref_out, **TOL)
    chex.assert_trees_all_close(grads, ref_grads, **TOL)
    return params

  def test_bridged_block_under_jit(self):
    self.check_sharded_equals_one_device(hk.transform(call_pure_model), megatron_specs("net/mlp"))

  def test_stacked_bridged_blocks_under_jit(self):
    f = hk.transform(
      lambda x: Net(
        lambda h: layer_scan.repeat_layer(lambda p, h: h + mlp(p, h), h, DEPTH, init=init_mlp)
      )(x)
    )
    self.check_sharded_equals_one_device(f, megatron_specs(f"net/{STACK}/~", layer_axes=1))

  @needs_jax_0_7("jax.shard_map")
  def test_shard_map_inside_the_bridged_function(self):
    seen_shapes = {}
    block = shard_mapped_mlp(self.mesh, seen_shapes)
    sharded = hk.transform(
      lambda x: Net(lambda h: h + call_pure(block, h, init=init_mlp, name="mlp"))(x)
    )
    # The reference: the same params through the plain `mlp`, one device.
    x, ref_params, ref_loss, ref_grads = call_pure_reference()

    shardings = sharding.param_shardings(
      jax.eval_shape(sharded.init, KEY, x), self.mesh, MEGATRON_RULES
    )
    params = jax.jit(sharded.init, out_shardings=shardings)(KEY, x)
    chex.assert_trees_all_close(params, ref_params, **TOL)
    loss, grads = jax.jit(
      jax.value_and_grad(loss_fn(sharded)),
      in_shardings=(shardings, self.batch_sharding),
      out_shardings=(None, shardings),
    )(params, jax.device_put(x, self.batch_sharding))
    self.assertEqual(
      seen_shapes,
      {
        "w1": (WIDTH, HIDDEN // 4),
        "b1": (HIDDEN // 4,),
        "w2": (HIDDEN // 4, WIDTH),
        "b2": (WIDTH,),
      },
    )
    assert_specs(self, {"net/mlp": grads["net/mlp"]}, megatron_specs("net/mlp"))
    np.testing.assert_allclose(loss, ref_loss, **TOL)
    chex.assert_trees_all_close(grads, ref_grads, **TOL)

  @needs_jax_0_7("A matmul's out_sharding under Explicit axes")
  def test_explicit_mesh_axes(self):
    # `jax.make_mesh`'s default axis type: shardings are part of the types.
    mesh = make_mesh((2, 4), ("data", "model"), AxisType.Explicit)
    sharded = hk.transform(
      lambda x: Net(lambda h: h + call_pure(explicit_mlp, h, init=init_mlp, name="mlp"))(x)
    )
    x, ref_params, ref_loss, ref_grads = call_pure_reference()
    # With no mesh, the same model is the plain one.
    chex.assert_trees_all_close(
      jax.jit(jax.value_and_grad(loss_fn(sharded)))(ref_params, x), (ref_loss, ref_grads), **TOL
    )

    with jax.set_mesh(mesh):
      shardings = sharding.param_shardings(
        jax.eval_shape(sharded.init, KEY, x), mesh, MEGATRON_RULES
      )
      params = jax.jit(sharded.init, out_shardings=shardings)(KEY, x)
      loss, grads = jax.jit(jax.value_and_grad(loss_fn(sharded)))(
        params, jax.device_put(x, NamedSharding(mesh, P("data")))
      )
    assert_specs(self, {"net/mlp": params["net/mlp"]}, megatron_specs("net/mlp"))
    self.assertEqual(grads["net/mlp"]["w2"].sharding.spec, P("model", None))
    chex.assert_trees_all_close(params, ref_params, **TOL)
    np.testing.assert_allclose(loss, ref_loss, **TOL)
    chex.assert_trees_all_close(grads, ref_grads, **TOL)


# ---------------------------------------------------------------------------
# Explicit mesh axes (`jax.make_mesh`'s default from jax 0.9): every bridged
# API, with a model written for explicit sharding; Megatron and FSDP rules.
# ---------------------------------------------------------------------------


class RowLinear(hk.Module):
  """`hk.Linear` whose input may be split: names its output's sharding.

  Under Explicit axes a matmul over a split dimension must say how its
  output is sharded; `like`'s sharding is the answer (none with no mesh).
  """

  def __init__(self, size, name=None):
    super().__init__(name=name)
    self._size = size

  def __call__(self, x, like):
    w = hk.get_parameter(
      "w", [x.shape[-1], self._size], init=hk.initializers.TruncatedNormal(x.shape[-1] ** -0.5)
    )
    b = hk.get_parameter("b", [self._size], init=jnp.zeros)
    return jnp.dot(x, w, out_sharding=jax.typeof(like).sharding) + b


def gathering(axes):
  """A Haiku custom getter: each parameter `gather_over` `axes` when read."""

  def getter(next_getter, value, context):
    del context  # Unused.
    return sharding.gather_over(next_getter(value), axes)

  return getter


def explicit_haiku_layer(h, fsdp=()):
  with hk.custom_getter(gathering(fsdp)):
    return h + RowLinear(WIDTH, name="out")(jax.nn.gelu(hk.Linear(HIDDEN, name="in")(h)), h)


def true_vjp(vjp_fn, g):
  return vjp_fn(g)


def all_apis_model(x, fsdp=()):
  """`call_pure`, a pure and a Haiku `layer_scan`, and `hkb.custom_vjp`.

  Written for explicit sharding: each row-split matmul names its output's
  sharding, and each block gathers its own weights over the `fsdp` axes
  (inside the scanned layer: one layer at a time).
  """
  gather = functools.partial(sharding.gather_over, axes=fsdp)
  haiku_layer_ = functools.partial(explicit_haiku_layer, fsdp=fsdp)

  def body(h):
    h = h + call_pure(lambda p, h: explicit_mlp(gather(p), h), h, init=init_mlp, name="mlp")
    h = layer_scan.repeat_layer(
      lambda p, h: h + explicit_mlp(gather(p), h), h, DEPTH, init=init_mlp
    )
    h = layer_scan.repeat_layer(haiku_layer_, h, DEPTH, name="blocks")
    block = custom_grad.custom_vjp(haiku_layer_, custom_grad.vjp_fwd, true_vjp)
    h = block(h)
    with hk.custom_getter(gathering(fsdp)):
      return hk.Linear(WIDTH, name="readout")(h)

  with hk.custom_getter(gathering(fsdp)):
    h = hk.Linear(WIDTH, name="embed")(x)
  with hk.experimental.name_scope("net"):
    return body(h)


# Megatron: hidden units over "model"; the batch over "data".
TP_RULES = sharding.ShardingRules(
  [
    (r"/w1$|/in/w$", P(None, "model")),
    (r"/b1$|/in/b$", P("model")),
    (r"/w2$|/out/w$", P("model", None)),
  ],
  stacked=[STACK, "blocks"],
)

# FSDP + tensor parallelism: each weight's other dimension also over "data",
# so each device stores 1/8 of it; gathered over "data" where it is used.
FSDP_TP_RULES = sharding.ShardingRules(
  [
    (r"/w1$|/in/w$", P("data", "model")),
    (r"/b1$|/in/b$", P("model")),
    (r"/w2$|/out/w$", P("model", "data")),
    (r"embed/w$|readout/w$", P(None, "data")),
  ],
  stacked=[STACK, "blocks"],
)


def per_device_bytes(params):
  """Bytes of `params` that one device (the first) holds."""
  device = jax.devices()[0]
  return sum(
    shard.data.nbytes
    for leaf in jax.tree.leaves(params)
    for shard in leaf.addressable_shards
    if shard.device == device
  )


@needs_jax_0_7("Explicit mesh axes (jax.set_mesh, jax.sharding.reshard)")
class GatherOverTest(parameterized.TestCase):
  def test_gathers_over_every_axis_named(self):
    x = jnp.arange(64.0).reshape(8, 8)
    for axes, kept in (
      (("data", "model"), P()),
      (("model",), P("data")),
      ("data", P(None, "model")),
    ):
      with jax.set_mesh(make_mesh((2, 4), ("data", "model"), AxisType.Explicit)):
        split = jax.device_put(x, P("data", "model"))
        gathered = sharding.gather_over(split, axes)
        expected = jax.sharding.reshard(split, kept)  # jax's own gather.
      self.assertEqual(gathered.sharding, expected.sharding, axes)
      np.testing.assert_array_equal(gathered, x)

  @parameterized.parameters(AxisType.Explicit, AxisType.Auto)
  def test_array_made_outside_the_mesh_checked_against_the_mesh_in_force(self, axis_type):
    x = jnp.ones([8])  # No mesh in its type.
    with jax.set_mesh(make_mesh((2, 4), ("data", "model"), axis_type)):
      self.assertEqual(jax.typeof(x).sharding.mesh.axis_names, ())
      np.testing.assert_array_equal(sharding.gather_over(x, "data"), x)
      with self.assertRaisesRegex(ValueError, r"mesh axis 'modle', which the mesh lacks"):
        sharding.gather_over(x, "modle")


@needs_jax_0_7("Explicit mesh axes (jax.set_mesh, out_sharding)")
class ExplicitMeshTest(parameterized.TestCase):
  """Bridged params on an Explicit (data, model) mesh equal one device."""

  @parameterized.named_parameters(
    ("megatron", TP_RULES, ()), ("fsdp_and_megatron", FSDP_TP_RULES, "data")
  )
  def test_all_apis_equal_one_device(self, rules, fsdp):
    f = hk.transform(functools.partial(all_apis_model, fsdp=fsdp))
    x = batch()
    ref_params = jax.device_get(jax.jit(f.init)(KEY, x))
    (ref_loss, ref_out), ref_grads = on_one_device(loss_out_and_grads(f), ref_params, x)
    mesh = make_mesh((2, 4), ("data", "model"), AxisType.Explicit)
    with jax.set_mesh(mesh):
      shardings = sharding.param_shardings(jax.eval_shape(f.init, KEY, x), mesh, rules)
      params = jax.jit(f.init, out_shardings=shardings)(KEY, x)
      (loss, out), grads = jax.jit(loss_out_and_grads(f))(params, jax.device_put(x, P("data")))
    expected = jax.tree.map(lambda s: s.spec, shardings)
    assert_specs(self, params, expected)
    assert_specs(self, grads, expected)  # The types carry them through.
    self.assertEqual(out.sharding.spec, P("data", None))
    chex.assert_trees_all_close(params, ref_params, **TOL)
    np.testing.assert_allclose(loss, ref_loss, **TOL)
    chex.assert_trees_all_close(out, ref_out, **TOL)
    # Gradients up to ~40, summed in another order over 8 devices.
    assert_sums_close(grads, ref_grads, rtol=1e-4, atol=1e-4)

  def test_a_matmul_over_a_split_dimension_must_name_its_output(self):
    # The price of Explicit axes: `hk.Linear` as the row-split layer is
    # ambiguous, and jax says so (RowLinear above is the fix).
    f = hk.transform(lambda x: layer_scan.repeat_layer(haiku_layer, x, 2, name="blocks"))
    x = jnp.ones([BATCH, WIDTH])
    mesh = make_mesh((2, 4), ("data", "model"), AxisType.Explicit)
    with jax.set_mesh(mesh):
      shardings = sharding.param_shardings(jax.eval_shape(f.init, KEY, x), mesh, TP_RULES)
      params = jax.jit(f.init, out_shardings=shardings)(KEY, x)
      with self.assertRaisesRegex(
        Exception,
        r"Contracting dimensions are "
        r"sharded.*out_sharding",
      ):
        jax.jit(f.apply)(params, None, jax.device_put(x, P("data")))


# ---------------------------------------------------------------------------
# FSDP + tensor parallelism for a transformer of Haiku's own modules.
# ---------------------------------------------------------------------------

VOCAB, D_MODEL, HEADS, SEQ, LAYERS = 64, 32, 4, 4, 2

TRANSFORMER_RULES = transformer_model.RULES
transformer = functools.partial(
  transformer_model.transformer, vocab=VOCAB, d_model=D_MODEL, heads=HEADS, layers=LAYERS
)


def ways(spec, mesh):
  """Into how many parts `spec` splits an array on `mesh`."""
  parts = 1
  for entry in spec:
    for axis in () if entry is None else (entry,) if isinstance(entry, str) else entry:
      parts *= mesh.shape[axis]
  return parts


class FsdpTest(parameterized.TestCase):
  def check_equals_one_device(self, rules, mesh):
    """Trains one step sharded by `rules`; returns the params and grads."""
    f = hk.transform(transformer)
    tokens = jax.random.randint(jax.random.PRNGKey(2), [8, SEQ], 0, VOCAB)
    targets = jax.nn.one_hot(jnp.roll(tokens, 1, axis=1), VOCAB)
    loss = lambda p, t: -jnp.mean(jax.nn.log_softmax(f.apply(p, None, t)) * targets)
    ref_params = jax.device_get(jax.jit(f.init)(KEY, tokens))
    ref_loss, ref_grads = on_one_device(jax.value_and_grad(loss), ref_params, tokens)

    shardings = sharding.param_shardings(jax.eval_shape(f.init, KEY, tokens), mesh, rules)
    params = jax.jit(f.init, out_shardings=shardings)(KEY, tokens)
    data = NamedSharding(mesh, P("data"))
    value, grads = jax.jit(
      jax.value_and_grad(loss), in_shardings=(shardings, data), out_shardings=(None, shardings)
    )(params, jax.device_put(tokens, data))
    chex.assert_trees_all_close(params, ref_params, **TOL)
    np.testing.assert_allclose(value, ref_loss, **TOL)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-4, atol=1e-6)
    return params, grads

  def test_fsdp_and_tensor_parallel_rules(self):
    mesh = make_mesh((2, 4), ("data", "model"))
    params, _ = self.check_equals_one_device(TRANSFORMER_RULES, mesh)
    self.assertEqual(params["layers/attention/query"]["w"].sharding.spec, P(None, "data", "model"))
    self.assertEqual(
      params["layers/attention/query"]["w"].addressable_shards[0].data.shape,
      (LAYERS, D_MODEL // 2, D_MODEL // 4),
    )
    # Bytes one device holds: each weight matrix 1/8 of it, the rest by its
    # spec; at most 1/8 of all plus the remainder not split 8 ways.
    leaves = jax.tree.leaves(params)
    total = sum(leaf.nbytes for leaf in leaves)
    rest = sum(leaf.nbytes for leaf in leaves if ways(leaf.sharding.spec, mesh) < 8)
    held = per_device_bytes(params)
    self.assertEqual(held, sum(leaf.nbytes // ways(leaf.sharding.spec, mesh) for leaf in leaves))
    self.assertLessEqual(held, (total - rest) / 8 + rest)
    self.assertLess(held, total / 6)

  def test_layer_axis_over_data(self):
    # FSDP over layers: each "data" group stores half the layers, with the
    # Megatron split inside each.
    mesh = make_mesh((2, 4), ("data", "model"))
    rules = sharding.ShardingRules(
      [
        (pattern, P(*(None if e == "data" else e for e in spec)))
        for pattern, spec in TRANSFORMER_RULES.rules
      ],
      stacked={"layers": "data"},
    )
    params, grads = self.check_equals_one_device(rules, mesh)
    for tree in (params, grads):
      self.assertEqual(tree["layers/mlp/~/linear_0"]["w"].sharding.spec, P("data", None, "model"))
    self.assertEqual(
      params["layers/mlp/~/linear_0"]["w"].addressable_shards[0].data.shape,
      (LAYERS // 2, D_MODEL, 4 * D_MODEL // 4),
    )


class SpecStrTest(absltest.TestCase):
  def test_specs_print_as_jax_0_9_2_prints_them(self):
    self.assertEqual(sharding.spec_str(P(None, ("data", "model"))), "P(None, ('data', 'model'))")
    self.assertEqual(sharding.spec_str(P()), "P()")

  def test_older_jax_repr(self):
    class OldSpec(tuple):  # jax < 0.9.2 prints `PartitionSpec(...)`.
      def __repr__(self):
        return "PartitionSpec(None, 'model')"

    self.assertEqual(sharding.spec_str(OldSpec()), "P(None, 'model')")


if __name__ == "__main__":
  absltest.main()
