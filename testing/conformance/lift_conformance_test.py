"""Conformance with Haiku's own `lift_test.py`: `hk.lift` & co. against the bridge.

For each case of dm-haiku 0.0.17's `haiku/_src/lift_test.py`, the same program
is run three ways: with Haiku's construct (`hk.lift`, `hk.transparent_lift`,
`hk.lift_with_state`, `hk.transparent_lift_with_state`), with the bridge
(`hkb.call_pure` / `hkb.get_relevant_parameters`), and inline (the lifted
function called in place). The bridge must equal inline code exactly (names,
values, outputs, state, gradients, interceptor calls) and agree with Haiku's
construct up to the by-design differences listed below; where Haiku raises, the
bridge raises too, unless the difference is listed.

The test names follow Haiku's; `test_every_haiku_case_is_covered` keeps the two
files in step.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from testing.conformance import common

KEY = jax.random.PRNGKey(428)

# hk.lift puts a function's top-level params and state under `<name>/~`; the
# bridge follows the inline rule (`call_pure` of an `hk.Transformed` names
# everything as inline code would), so they land where inline code puts them.
# Per case: {name Haiku's construct gives: name the bridge (and inline) gives}.
LIFTED_TILDE = (
  "inline naming rule: hk.lift adds a `lifted/~` scope for the "
  "inner function's top level; inline code has none"
)
NAME_DIFFERENCES = {
  "test_lift_with_vmap": (
    {"lifted/bias": "bias_1"},
    "inline naming rule: hk.lift puts the inner `bias` under `lifted/`; "
    "inline, a second Bias() in the same scope is `bias_1`",
  ),
  "test_lift_with_scan": ({"outer/lifted/~": "outer/lifted"}, LIFTED_TILDE),
  "test_lift_with_state": ({"lifted/~": "~"}, LIFTED_TILDE),
  "test_lift_with_state_nested": ({"outer/lifted/~": "outer"}, LIFTED_TILDE),
  "test_transparent_lift_with_state_nested": (
    {"outer/~": "outer"},
    "inline naming rule: transparent_lift_with_state keeps the inner `~` "
    "inside module `outer` (`outer/~`); inline state of module `outer` is "
    "`outer`",
  ),
}

# Cases where Haiku's construct raises and the bridge, by design, runs as the
# same code inline does (which these tests check instead).
BEHAVIOUR_DIFFERENCES = {
  "test_lift_with_scan[disallow_reuse]": (
    "hk.lift(allow_reuse=False) raises when hk.scan traces its body twice; "
    "the bridge has no allow_reuse: a module called twice shares its "
    "weights, bridged or not, as inline"
  ),
  "test_transparent_lift_existing_params_error": (
    "transparent_lift raises when the inner `my_module` meets the outer "
    "`my_module`; inline code numbers the second `my_module_1`, and so does "
    "the bridge (inline rule)"
  ),
  "test_custom_full_lift_prefix": (
    "context.lifted_prefix_name is set by hk.lift; the bridge gives "
    "interceptors the context inline code gives them (full names exact)"
  ),
}

# Haiku cases with no bridge analogue: the bridge has no state updater object
# (`call_pure` of an hk.TransformedWithState reads and writes the caller's state
# itself, exactly once per call), so misuse of an updater cannot happen.
NOT_APPLICABLE = {
  "test_unused_updater": "no LiftWithStateUpdater in the bridge",
  "test_used_multiple_times": "no LiftWithStateUpdater in the bridge",
  "test_updater_used_in_different_inner_transform": "no LiftWithStateUpdater in the bridge",
}


class Bias(hk.Module):
  def __call__(self, x):
    return x + hk.get_parameter("b", (), init=jnp.ones)


class Outer(hk.Module):
  """Runs `body` inside a module named `outer` (Haiku's tests' scope)."""

  def __init__(self, body, name="outer"):
    super().__init__(name=name)
    self._body = body

  def __call__(self, *args):
    return self._body(*args)


def with_lift(f, *, name="inner"):
  def wrapped(*args):
    inner = hk.transform(f)
    params = hk.lift(inner.init, name=name)(None, *args)
    return inner.apply(params, None, *args)

  return wrapped


def with_transparent_lift(f, **kwargs):
  def wrapped(*args):
    inner = hk.transform(f)
    params = hk.transparent_lift(inner.init, **kwargs)(None, *args)
    return inner.apply(params, None, *args)

  return wrapped


def with_bridge(f, **kwargs):
  inner = hk.transform(f)
  return lambda *args: hkb.call_pure(inner, *args, **kwargs)


def renamed(params, mapping):
  return {mapping.get(bundle, bundle): entries for bundle, entries in params.items()}


def assert_same_names_and_values(test, actual, expected):
  test.assertEqual(sorted(actual), sorted(expected))
  for bundle in expected:
    test.assertEqual(sorted(actual[bundle]), sorted(expected[bundle]), msg=bundle)
  chex.assert_trees_all_equal(dict(actual), dict(expected))


def run_three_ways(test, fns, *args, rng=None, apply_rng=None, mapping=None):
  """Inits and applies `fns` = {"haiku", "bridge", "inline"}; checks they agree.

  The bridge's params equal inline's; Haiku's construct's params, renamed by
  `mapping` (its by-design differences), have the same names and values. Each
  applies the others' params (renamed back for Haiku) with the same output.
  """
  mapping = mapping or {}
  back = {v: k for k, v in mapping.items()}
  transformed = {k: hk.transform(f) for k, f in fns.items()}
  params = {k: t.init(rng, *args) for k, t in transformed.items()}
  assert_same_names_and_values(test, params["bridge"], params["inline"])
  if "haiku" in params:
    assert_same_names_and_values(test, renamed(params["haiku"], mapping), params["inline"])
  reference = transformed["inline"].apply(params["inline"], apply_rng, *args)
  for k, t in transformed.items():
    p = renamed(params["inline"], back) if k == "haiku" else params["inline"]
    chex.assert_trees_all_close(t.apply(p, apply_rng, *args), reference, rtol=1e-6, atol=1e-6)
  return params["bridge"]


class LiftConformanceTest(parameterized.TestCase):
  def test_every_haiku_case_is_covered(self):
    haiku_cases = common.haiku_test_cases("lift_test.py")
    ours = [name for name in dir(self) if name.startswith("test_")]
    missing = {
      case
      for case in haiku_cases - set(NOT_APPLICABLE)
      if not any(name.startswith(case) for name in ours)
    }
    self.assertEmpty(missing)

  def test_lift_with_vmap(self):
    inner = hk.without_apply_rng(hk.transform(lambda x: Bias()(x)))

    def lifted(x):
      x = Bias()(x)
      params = hk.lift(inner.init)(hk.next_rng_key(), x[0])
      return jax.vmap(inner.apply, in_axes=(None, 0))(params, x)

    def bridged(x):
      x = Bias()(x)
      params = hkb.get_relevant_parameters(inner, x[0])
      return jax.vmap(inner.apply, in_axes=(None, 0))(params, x)

    def inline(x):
      x = Bias()(x)
      return hk.vmap(lambda row: Bias()(row), split_rng=False)(x)

    data = np.zeros((3, 2), np.float32)
    params = run_three_ways(
      self,
      {"haiku": lifted, "bridge": bridged, "inline": inline},
      data,
      rng=KEY,
      apply_rng=KEY,
      mapping=NAME_DIFFERENCES["test_lift_with_vmap"][0],
    )
    self.assertEqual(params, {"bias": {"b": np.ones(())}, "bias_1": {"b": np.ones(())}})
    out = hk.transform(bridged).apply(params, KEY, data)
    np.testing.assert_array_equal(out, 2 * np.ones((3, 2)))

  def _scan_model(self, mode):
    inner_fn = lambda x: x * hk.get_parameter("w", x.shape, init=hk.initializers.RandomNormal())
    inner = hk.transform(inner_fn)

    def step(carry, x):
      x += hk.get_parameter("w", [], init=jnp.zeros)
      if mode in ("haiku", "haiku_no_reuse"):
        key = hk.next_rng_key() if hk.running_init() else None
        params = hk.lift(inner.init, allow_reuse=(mode == "haiku"))(key, x)
        return carry, inner.apply(params, None, x)
      if mode == "bridge":
        return carry, hkb.call_pure(inner, x, name="lifted")
      if mode == "bridge_unnamed":
        return carry, hkb.call_pure(inner, x)
      if mode == "inline_unnamed":
        return carry, inner_fn(x)
      with hk.name_scope("lifted"):
        return carry, inner_fn(x)

    return lambda xs: hk.scan(Outer(step), (), xs)[1]

  def test_lift_with_scan(self):
    data = np.zeros((4, 3, 2), np.float32)
    mapping, _ = NAME_DIFFERENCES["test_lift_with_scan"]
    fns = {k: self._scan_model(k) for k in ("haiku", "bridge", "inline")}
    # Values: hk.lift seeds the inner init with its own key, so only the
    # bridge and inline are compared by value; Haiku by names and outputs.
    transformed = {k: hk.transform(f) for k, f in fns.items()}
    params = {k: t.init(KEY, data) for k, t in transformed.items()}
    assert_same_names_and_values(self, params["bridge"], params["inline"])
    chex.assert_trees_all_equal_shapes(renamed(params["haiku"], mapping), params["inline"])
    self.assertEqual(sorted(params["bridge"]), ["outer", "outer/lifted"])
    ref = transformed["inline"].apply(params["inline"], None, data)
    back = {v: k for k, v in mapping.items()}
    chex.assert_trees_all_close(
      transformed["bridge"].apply(params["inline"], None, data), ref, rtol=1e-6
    )
    chex.assert_trees_all_close(
      transformed["haiku"].apply(renamed(params["inline"], back), None, data), ref, rtol=1e-6
    )
    # Gradients, with respect to the same params.
    grad = lambda t: jax.grad(lambda p: jnp.sum(t.apply(p, None, data) ** 2))
    chex.assert_trees_all_close(
      grad(transformed["bridge"])(params["inline"]),
      grad(transformed["inline"])(params["inline"]),
      rtol=1e-6,
    )

  def test_lift_with_scan_disallow_reuse_haiku_case(self):
    # By design (BEHAVIOUR_DIFFERENCES): Haiku raises, the bridge is inline.
    data = np.zeros((4, 3, 2), np.float32)
    with self.assertRaisesRegex(ValueError, "Key '.*' already exists"):
      hk.transform(self._scan_model("haiku_no_reuse")).init(KEY, data)
    bridged = hk.transform(self._scan_model("bridge"))
    inline = hk.transform(self._scan_model("inline"))
    chex.assert_trees_all_equal(bridged.init(KEY, data), inline.init(KEY, data))

  def test_lift_with_scan_unnamed_collides_as_inline_does(self):
    # Without a name the inner `w` is `outer/w`, the step's own scalar `w`:
    # inline code raises on the shape mismatch, and so must the bridge.
    data = np.zeros((4, 3, 2), np.float32)
    with self.assertRaises(ValueError):
      hk.transform(self._scan_model("inline_unnamed")).init(KEY, data)
    with self.assertRaises(ValueError):
      hk.transform(self._scan_model("bridge_unnamed")).init(KEY, data)

  @parameterized.named_parameters(
    ("lift", lambda: hk.lift(lambda: None)),
    ("lift_with_state", lambda: hk.lift_with_state(lambda: (None, None))),
    ("get_relevant_parameters", lambda: hkb.get_relevant_parameters(hk.transform(lambda: None))),
    ("call_pure", lambda: hkb.call_pure(hk.transform(lambda: None))),
    ("call_pure_with_state", lambda: hkb.call_pure(hk.transform_with_state(lambda: None))),
  )
  def test_inside_transform(self, outside_call):
    with self.assertRaisesRegex(ValueError, "transform"):
      outside_call()

  def test_empty_lift(self):
    empty = hk.transform(lambda: None)

    def bridged():
      self.assertEmpty(hkb.get_relevant_parameters(empty))
      return hkb.call_pure(empty)

    def lifted():
      self.assertEmpty(hk.lift(empty.init)(None))

    for rng in (KEY, None):  # Inline `lambda: None` needs no key.
      f = hk.transform(bridged)
      params = f.init(rng)
      self.assertEmpty(params)
      self.assertIsNone(f.apply(params, rng))
      self.assertEmpty(hk.transform(lifted).init(rng))

  def test_empty_lift_with_state(self):
    empty = hk.transform_with_state(lambda: None)
    for rng in (KEY, None):
      f = hk.transform_with_state(lambda: hkb.call_pure(empty))
      params, state = f.init(rng)
      self.assertEmpty(params)
      self.assertEmpty(state)
      out, state = f.apply(params, state, rng)
      self.assertIsNone(out)
      self.assertEmpty(state)

  def test_lift_raises_with_state(self):
    stateful = hk.transform_with_state(lambda: hk.get_state("w", [], init=jnp.zeros))
    with self.assertRaisesRegex(ValueError, "lift_with_state"):
      hk.transform(lambda: hk.lift(stateful.init)(None)).init(KEY)
    # The bridge's analogue: a stateful function's params for a pure call.
    with self.assertRaisesRegex(ValueError, "state"):
      hk.transform(lambda: hkb.get_relevant_parameters(stateful)).init(KEY)
    with self.assertRaisesRegex(ValueError, "state"):
      hk.transform(lambda: hkb.call_pure(lambda p: 0.0, init=stateful)).init(KEY)

  def _counter_three_ways(self, wrap, transparent=False):
    """A counter in state, through lift_with_state, the bridge and inline."""

    def counter():
      w = hk.get_state("w", [], init=jnp.zeros)
      w += 1
      hk.set_state("w", w)
      return w

    inner = hk.transform_with_state(counter)

    def lifted():
      lift = hk.transparent_lift_with_state if transparent else hk.lift_with_state
      init, updater = lift(inner.init)
      params, state = init(None)
      self.assertEmpty(params)
      out, state = inner.apply(params, state, None)
      updater.update(state)
      return out

    return {
      "haiku": wrap(lifted),
      "bridge": wrap(lambda: hkb.call_pure(inner)),
      "inline": wrap(counter),
    }

  def _check_counter(self, fns, mapping):
    transformed = {k: hk.transform_with_state(f) for k, f in fns.items()}
    states = {}
    for k, t in transformed.items():
      params, states[k] = t.init(None)
      self.assertEmpty(params)
    assert_same_names_and_values(self, renamed(states["haiku"], mapping), states["inline"])
    assert_same_names_and_values(self, states["bridge"], states["inline"])
    for expected in (1, 2, 3):
      for k, t in transformed.items():
        out, states[k] = t.apply({}, states[k], None)
        self.assertEqual(out, expected, msg=k)
      assert_same_names_and_values(self, renamed(states["haiku"], mapping), states["inline"])
      assert_same_names_and_values(self, states["bridge"], states["inline"])
    return states["bridge"]

  def test_lift_with_state(self):
    state = self._check_counter(
      self._counter_three_ways(lambda f: f), NAME_DIFFERENCES["test_lift_with_state"][0]
    )
    self.assertEqual(jax.tree.map(int, state), {"~": {"w": 3}})

  def test_lift_with_state_nested(self):
    wrap = lambda f: lambda: Outer(f)()
    state = self._check_counter(
      self._counter_three_ways(wrap), NAME_DIFFERENCES["test_lift_with_state_nested"][0]
    )
    self.assertEqual(jax.tree.map(int, state), {"outer": {"w": 3}})

  def test_transparent_lift_with_state(self):
    state = self._check_counter(self._counter_three_ways(lambda f: f, transparent=True), {})
    self.assertEqual(jax.tree.map(int, state), {"~": {"w": 3}})

  def test_transparent_lift_with_state_nested(self):
    wrap = lambda f: lambda: Outer(f)()
    state = self._check_counter(
      self._counter_three_ways(wrap, transparent=True),
      NAME_DIFFERENCES["test_transparent_lift_with_state_nested"][0],
    )
    self.assertEqual(jax.tree.map(int, state), {"outer": {"w": 3}})

  def test_transparent_lift(self):

    class InnerModule(hk.Module):
      def __call__(self, x):
        return x + hk.get_parameter("b", [10, 10], init=hk.initializers.RandomNormal())

    inner_fn = lambda x: InnerModule(name="inner")(x)

    def make(call_inner):
      def body(x):
        x += hk.get_parameter("a", [10, 10], init=jnp.zeros)
        return call_inner(x)

      return lambda x: Outer(body)(x)

    def transparent(x):
      inner = hk.transform(inner_fn)
      params = hk.transparent_lift(inner.init)(hk.next_rng_key(), x)
      return inner.apply(params, hk.next_rng_key(), x)

    fns = {
      "haiku": make(transparent),
      "bridge": make(with_bridge(inner_fn)),
      "inline": make(inner_fn),
    }
    x = jnp.ones([10, 10])
    transformed = {k: hk.transform(f) for k, f in fns.items()}
    params = {k: t.init(KEY, x) for k, t in transformed.items()}
    self.assertCountEqual(params["haiku"], ["outer/inner", "outer"])
    assert_same_names_and_values(self, params["bridge"], params["inline"])
    chex.assert_trees_all_equal_shapes(params["haiku"], params["inline"])
    ref = transformed["inline"].apply(params["inline"], KEY, x)
    for k in ("haiku", "bridge"):
      chex.assert_trees_all_close(transformed[k].apply(params["inline"], KEY, x), ref, rtol=1e-6)

  def test_transparent_lift_top_level(self):

    class MyModule(hk.Module):
      def __call__(self, x):
        return x + hk.get_parameter("b", [10, 10], init=jnp.zeros)

    def inner_fn(x):
      return MyModule(name="top_level")(MyModule(name="top_level")(x))

    params = run_three_ways(
      self,
      {
        "haiku": with_transparent_lift(inner_fn),
        "bridge": with_bridge(inner_fn),
        "inline": inner_fn,
      },
      jnp.ones([10, 10]),
    )
    self.assertCountEqual(params, ["top_level", "top_level_1"])

  def test_transparent_lift_existing_params_error(self):

    class MyModule(hk.Module):
      def __call__(self, x):
        return x + hk.get_parameter("b", [3, 7], init=jnp.zeros)

    inner_fn = lambda x: MyModule()(x)
    make = lambda call_inner: lambda x: call_inner(MyModule()(x))
    x = jnp.ones([3, 7])
    with self.assertRaisesRegex(ValueError, "Key 'my_module' already exists"):
      hk.transform(make(with_transparent_lift(inner_fn))).init(None, x)
    # By design (BEHAVIOUR_DIFFERENCES): the bridge numbers it as inline does.
    params = run_three_ways(
      self, {"bridge": make(with_bridge(inner_fn)), "inline": make(inner_fn)}, x
    )
    self.assertCountEqual(params, ["my_module", "my_module_1"])

  @parameterized.named_parameters(
    ("top_level", "top_level"),
    ("nested", "nested"),
    ("expected_duplicate_name", "expected_duplicate_name"),
  )
  def test_lift_naming_semantics(self, case):

    def top_level(x):
      return Bias(name="top_level")(Bias(name="top_level")(x))

    def nested(x):
      return Outer(lambda x: Bias(name="inner")(x))(x)

    def expected_duplicate_name(x):
      def body(x):
        x = Outer(lambda x: Bias(name="inner")(x))(x)
        return Bias(name="outer")(x)

      return Outer(body)(x)

    inner_fn = locals()[case]
    run_three_ways(
      self,
      {
        "haiku": with_transparent_lift(inner_fn),
        "bridge": with_bridge(inner_fn),
        "inline": inner_fn,
      },
      jnp.ones([10, 10]),
    )

  def _closed_over_case(self, nested):
    """Inner code calls a module created outside the lifted function."""

    def make(wrap):
      def body(x):
        outer_defined = Bias(name="inner")

        def inner_fn(x):
          x = outer_defined(x)
          return Bias(name="inner")(x)

        return wrap(inner_fn)(x)

      if nested:
        return lambda x: Outer(body)(x)
      return body

    x = jnp.ones((10, 10))
    with self.assertRaisesRegex(ValueError, "close over a module.*transparent_lift"):
      hk.transform(make(with_transparent_lift)).init(None, x)
    # The bridge either raises as well or runs exactly as inline code
    # (`inner`, `inner_1`); a silently shared or misnamed param is neither.
    bridged = hk.transform(make(with_bridge))
    try:
      params = bridged.init(KEY, x)
    except ValueError:
      return
    run_three_ways(self, {"bridge": make(with_bridge), "inline": make(lambda f: f)}, x, rng=KEY)
    self.assertLen(jax.tree.leaves(params), 2)

  def test_transparent_lift_closed_over_errors(self):
    self._closed_over_case(nested=False)

  def test_transparent_lift_closed_over_nested_errors(self):
    self._closed_over_case(nested=True)

  def test_transparent_lift_reuse_and_define_new(self):
    f = lambda: hk.get_parameter("w1", [], init=jnp.zeros)
    g = lambda: hk.get_parameter("w2", [], init=jnp.ones)
    fns = {
      "haiku": lambda: [
        with_transparent_lift(f, allow_reuse=True)(),
        with_transparent_lift(g, allow_reuse=True)(),
      ],
      "bridge": lambda: [with_bridge(f)(), with_bridge(g)()],
      "inline": lambda: [f(), g()],
    }
    params = run_three_ways(self, fns)
    self.assertEqual(params, {"~": {"w1": 0, "w2": 1}})

  def test_same_name_across_transforms_no_closed_error(self):
    bias_fn = lambda x: Bias()(x)
    bridged = [hk.transform(with_bridge(bias_fn)) for _ in range(2)]
    params = [t.init(None, 1.0) for t in bridged]  # Neither fails.
    inline = hk.transform(bias_fn).init(None, 1.0)
    for p in params:
      assert_same_names_and_values(self, p, inline)

  def test_closed_over_within_transparent_lift_no_closed_error(self):

    def lifted_fn(x):
      outer_defined = Bias(name="inner")
      x = hk.vmap(lambda x: outer_defined(x), split_rng=False)(x)
      return Bias(name="inner")(x)

    params = run_three_ways(
      self,
      {
        "haiku": with_transparent_lift(lifted_fn),
        "bridge": with_bridge(lifted_fn),
        "inline": lifted_fn,
      },
      jnp.ones((10, 10)),
    )
    self.assertCountEqual(params, ["inner", "inner_1"])

  @parameterized.named_parameters(
    # (Haiku's wrapper, the bridge's, inline code, lift's prefix).
    ("lift", "lift", "outer/inner/"),
    ("transparent_lift", "transparent_lift", "outer/"),
    ("nested_lift", "nested_lift", "outer/inner/inner/"),
    ("nested_transparent_lift", "nested_transparent_lift", "outer/"),
  )
  def test_custom_full_lift_prefix(self, case, lift_prefix):
    haiku_wrap, bridge_wrap, inline_wrap = {
      "lift": (with_lift, lambda f: with_bridge(f, name="inner"), lambda f: _in_scope(f, "inner")),
      "transparent_lift": (with_transparent_lift, with_bridge, lambda f: f),
      "nested_lift": (
        lambda f: with_lift(with_lift(f)),
        lambda f: with_bridge(with_bridge(f, name="inner"), name="inner"),
        lambda f: _in_scope(_in_scope(f, "inner"), "inner"),
      ),
      "nested_transparent_lift": (
        lambda f: with_transparent_lift(with_transparent_lift(f)),
        lambda f: with_bridge(with_bridge(f)),
        lambda f: f,
      ),
    }[case]
    calls = {}

    def model(kind, wrap):
      def creator(next_creator, shape, dtype, init, context):
        calls[kind].append(
          (
            "create",
            context.full_name,
            tuple(shape),
            jnp.dtype(dtype).name,
            context.lifted_prefix_name,
          )
        )
        return next_creator(shape, dtype, init)

      def getter(next_getter, value, context):
        calls[kind].append(
          (
            "get",
            context.full_name,
            value.shape,
            value.dtype.name,
            context.lifted_prefix_name,
            hk.running_init(),
          )
        )
        return next_getter(value)

      def body(x):
        with hk.custom_getter(getter), hk.custom_creator(creator):
          return wrap(lambda x: Bias()(x))(x)

      return hk.transform(lambda x: Outer(body)(x))

    x = jnp.ones([10, 10])
    outs, params = {}, {}
    for kind, wrap in (("haiku", haiku_wrap), ("bridge", bridge_wrap), ("inline", inline_wrap)):
      calls[kind] = []
      f = model(kind, wrap)
      params[kind] = f.init(None, x)
      outs[kind] = f.apply(params[kind], None, x)

    # Haiku's own fact: lift's prefix reaches the interceptors.
    self.assertIn(lift_prefix, {c[4] for c in calls["haiku"] if c[0] == "create"})
    # The bridge: interceptors called exactly as inline, same names and values.
    # (By design, lifted_prefix_name is inline's: see BEHAVIOUR_DIFFERENCES.)
    self.assertEqual(calls["bridge"], calls["inline"])
    assert_same_names_and_values(self, params["bridge"], params["inline"])
    chex.assert_trees_all_close(outs["bridge"], outs["inline"])
    if case in ("lift", "nested_lift"):
      # Named lifts and named bridge calls give the same full names.
      self.assertEqual(sorted(params["haiku"]), sorted(params["bridge"]))


def _in_scope(f, name):
  def scoped(*args):
    with hk.name_scope(name):
      return f(*args)

  return scoped


if __name__ == "__main__":
  absltest.main()
