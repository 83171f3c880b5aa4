"""Conformance with dm-haiku's own Flax interop tests: `hk.experimental.flax` against the bridge.

dm-haiku 0.0.17 ships `haiku/_src/flax/`: `lift` (a Linen module inside
Haiku, `transform_flax_test.py`), `Module` (a Haiku function inside Linen,
`flax_module_test.py`) and their name helpers (`utils_test.py`). Each case runs
here through Haiku's construct and through the bridge's counterpart
(`hkb.from_flax` for `lift`, `hkb.to_nnx` for `Module`: the bridge takes Haiku
into NNX, not Linen) with the same weights, and they must agree: values,
outputs, state updates, and names up to the differences listed below, each with
its reason. `test_every_haiku_case_is_covered` reads Haiku's installed test
files: a case neither ported here nor listed fails it.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import flax.linen as nn
import haiku as hk
from haiku._src.flax import utils as flax_utils
import jax
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from testing.conformance import common

KEY = jax.random.PRNGKey(42)
HAIKU_FILES = ("flax/transform_flax_test.py", "flax/flax_module_test.py", "flax/utils_test.py")

# By design: the bridge names as inline Haiku code and NNX do.
NAMES = (
  "names: lift puts a module's top-level variables under `<name>/~` and "
  "each state collection under `<name>/<collection>/...`; the adapter is a "
  "Haiku module like any other: its top-level variables are in `<name>` "
  "itself, and a collection name is no part of a Haiku name, so one bundle "
  "holds a submodule's params and state (`block/bn`: `scale` and `mean`), "
  "as NNX and hk.BatchNorm have them"
)
COLLISION = (
  "the case's `Child` holds `s` in two collections (`flim_state`, "
  "`flam_state`); without collection names (see NAMES) both would be "
  "`<name>/.../s`, so the adapter refuses it, naming both, where lift keeps "
  "them apart. The case is run through lift (Haiku's assertions) and the "
  "adapter's error is checked"
)
BY_DESIGN = {
  "test_lift_toplevel": COLLISION,
  "test_lift": COLLISION,
  "test_lift_used_inside_module": COLLISION,
  "test_lift_module_called_repeatedly": COLLISION,
  "test_uses_updated_params": COLLISION,
  "test_non_mapping_rngs": (
    "lift refuses a bare key as `rngs=` ('should be a dictionary'); the "
    "adapter takes it as Linen's own `init` and `apply` do (as `params`), "
    "checked against Linen"
  ),
  "test_lift_multiple_uses": (
    "values: a module called twice keeps the params its first call "
    "created, as an inline Haiku module does; lift (allow_reuse=True) runs "
    "init again on each call and keeps the last call's. Names, shapes and "
    "outputs for the same params agree"
  ),
}


# The peer's fixtures, in our words: what each module declares.
class Child(nn.Module):
  """A param and two state collections, all put at init."""

  @nn.compact
  def __call__(self):
    if self.is_initializing():
      zero = jnp.zeros([])
      self.put_variable("params", "w", zero)
      self.put_variable("flim_state", "s", zero + 1)
      self.put_variable("flam_state", "s", zero + 2)
    return tuple(
      self.get_variable(c, n)
      for c, n in (("params", "w"), ("flim_state", "s"), ("flam_state", "s"))
    )


class Parent(nn.Module):
  @nn.compact
  def __call__(self):
    return Child()()


class Outer(nn.Module):
  @nn.compact
  def __call__(self):
    return Parent()()


class Empty(nn.Module):
  def __call__(self):
    return None


class ParamsRng(nn.Module):
  @nn.compact
  def __call__(self):
    return self.make_rng("params")


class UsesRng(nn.Module):
  @nn.compact
  def __call__(self):
    self.make_rng("foo")
    return self.param("w", nn.initializers.normal(), [], jnp.float32)


class Counter(nn.Module):
  @nn.compact
  def __call__(self):
    if self.is_initializing():
      count = jnp.zeros([])
      self.put_variable("state", "count", count)
      return count
    count = self.get_variable("state", "count")
    self.put_variable("state", "count", count + 1)
    return count


def lifted(module, name="foo"):
  return hk.experimental.flax.lift(module, name=name)


def adapted(module, name="foo"):
  return hkb.from_flax(module, name=name)


def without_lift_levels(tree, name="foo"):
  """lift's names as the adapter's: `<name>/~` -> `<name>`, collections out."""
  out = {}
  for bundle, entries in tree.items():
    parts = bundle.split("/")
    parts = [
      p
      for i, p in enumerate(parts)
      if not (
        p == "~"
        or (i == 1 and parts[0] == name and p.endswith("_state"))
        or (i == 1 and parts[0] == name and p == "state")
      )
    ]
    out.setdefault("/".join(parts), {}).update(entries)
  return out


class TransformFlaxTest(parameterized.TestCase):
  """`transform_flax_test.py`: lift against from_flax."""

  def run_both(self, make, *, rng=KEY):
    """Inits `make(lift)` and `make(adapter)`; same values, names as NAMES."""
    ours = hk.transform_with_state(make(adapted))
    theirs = hk.transform_with_state(make(lifted))
    p1, s1 = ours.init(rng)
    p2, s2 = theirs.init(rng)
    common.assert_same_tree(self, p1, without_lift_levels(p2))
    common.assert_same_tree(self, s1, without_lift_levels(s2))
    return (ours, p1, s1), (theirs, p2, s2)

  def test_every_haiku_case_is_covered(self):
    cases = set().union(*(common.haiku_test_cases(f) for f in HAIKU_FILES))
    ours = [
      n
      for n in dir(TransformFlaxTest) + dir(FlaxModuleTest) + dir(UtilsTest)
      if n.startswith("test_")
    ]
    missing = {c for c in cases if not any(n.startswith(c) for n in ours)}
    self.assertEmpty(missing)

  def test_lift_empty_unused(self):
    def make(wrap):
      def f():
        wrap(Empty())  # Created, never called.

      return f

    (_, p, s), _ = self.run_both(make)
    self.assertEmpty(p)
    self.assertEmpty(s)

  def test_lift_empty(self):
    (_, p, s), _ = self.run_both(lambda wrap: lambda: wrap(Empty())())
    self.assertEmpty(p)
    self.assertEmpty(s)

  def _collision_case(self, make, haiku_params, haiku_state):
    theirs = hk.transform_with_state(make(lifted))
    params, state = theirs.init(KEY)
    self.assertEqual(params, haiku_params)  # Haiku's own assertions.
    self.assertEqual(state, haiku_state)
    ours = hk.transform_with_state(make(adapted))
    with self.assertRaisesRegex(
      ValueError,
      r"hkb.from_flax\(\w+\): params paths "
      r"flam_state.*s and flim_state.*s both map to the Haiku state "
      r"'.*s'. Rename one of them.",
    ):
      ours.init(KEY)

  def test_lift_toplevel(self):
    self._collision_case(
      lambda wrap: lambda: wrap(Child())(),
      {"foo/~": {"w": 0}},
      {"foo/flim_state/~": {"s": 1}, "foo/flam_state/~": {"s": 2}},
    )

  def test_lift(self):
    self._collision_case(
      lambda wrap: lambda: wrap(Outer())(),
      {"foo/Parent_0/Child_0": {"w": 0}},
      {"foo/flim_state/Parent_0/Child_0": {"s": 1}, "foo/flam_state/Parent_0/Child_0": {"s": 2}},
    )

  def test_lift_used_inside_module(self):
    def make(wrap):
      class OuterHk(hk.Module):
        def __call__(self):
          return wrap(Outer(), name="outer")()

      return lambda: OuterHk()()

    self._collision_case(
      make,
      {"outer_hk/outer/Parent_0/Child_0": {"w": 0}},
      {
        "outer_hk/outer/flim_state/Parent_0/Child_0": {"s": 1},
        "outer_hk/outer/flam_state/Parent_0/Child_0": {"s": 2},
      },
    )

  def test_lift_module_called_repeatedly(self):
    def make(wrap):
      def f():
        mod = wrap(Outer())
        mod()
        return mod()

      return f

    self._collision_case(
      make,
      {"foo/Parent_0/Child_0": {"w": 0}},
      {"foo/flim_state/Parent_0/Child_0": {"s": 1}, "foo/flam_state/Parent_0/Child_0": {"s": 2}},
    )

  def test_uses_updated_params(self):
    # lift's part of the case (the values apply is given come out as they
    # are); the adapter refuses `Child` (COLLISION): the same with one
    # collection is checked below.
    theirs = hk.transform_with_state(lambda: lifted(Child())())
    params, state = jax.tree.map(lambda x: x + 1, theirs.init(KEY))
    (w, flim, flam), _ = theirs.apply(params, state, None)
    self.assertIs(w, params["foo/~"]["w"])
    self.assertIs(flim, state["foo/flim_state/~"]["s"])
    self.assertIs(flam, state["foo/flam_state/~"]["s"])
    self._collision_case(
      lambda wrap: lambda: wrap(Child())(),
      {"foo/~": {"w": 0}},
      {"foo/flim_state/~": {"s": 1}, "foo/flam_state/~": {"s": 2}},
    )

    class OneCollection(nn.Module):
      @nn.compact
      def __call__(self):
        if self.is_initializing():
          self.put_variable("params", "w", jnp.zeros([]))
          self.put_variable("flim_state", "s", jnp.ones([]))
        return self.get_variable("params", "w"), self.get_variable("flim_state", "s")

    (ours, p, s), _ = self.run_both(lambda wrap: lambda: wrap(OneCollection())())
    p, s = jax.tree.map(lambda x: x + 1, (p, s))
    (w, flim), _ = ours.apply(p, s, None)
    self.assertIs(w, p["foo"]["w"])  # Read as given: no initialiser re-ran.
    self.assertIs(flim, s["foo"]["s"])

  def test_stateful_equivalence(self):
    counter = Counter()
    (ours, _, s1), (theirs, _, s2) = self.run_both(lambda wrap: lambda: wrap(counter)())
    self.assertEqual(s2, {"foo/state/~": {"count": 0}})  # Haiku's assertion.
    variables = counter.init(KEY)
    for i in range(10):
      out1, s1 = ours.apply({}, s1, None)
      out2, s2 = theirs.apply({}, s2, None)
      native, variables = counter.apply(variables, mutable=["state"])
      self.assertEqual(out1, native)
      self.assertEqual(out2, native)
      self.assertEqual(s1, {"foo": {"count": i + 1}})
      self.assertEqual(s2, {"foo/state/~": {"count": i + 1}})

  def test_with_explicit_rngs(self):
    def make(wrap):
      return lambda: wrap(ParamsRng())(rngs={"params": KEY})

    ours, theirs = hk.transform(make(adapted)), hk.transform(make(lifted))
    self.assertEqual(ours.init(None), theirs.init(None))  # No rng given.
    np.testing.assert_array_equal(ours.apply({}, None), theirs.apply({}, None))

  @parameterized.parameters(True, False)
  def test_with_keys_dict(self, with_params_rng):
    def make(wrap):
      def f():
        rngs = {"foo": hk.next_rng_key()}
        if with_params_rng:
          rngs["params"] = hk.next_rng_key()
        return wrap(UsesRng())(rngs=rngs)

      return f

    ours, theirs = hk.transform(make(adapted)), hk.transform(make(lifted))
    init_rng, apply_rng = jax.random.split(KEY)
    p1, p2 = ours.init(init_rng), theirs.init(init_rng)
    common.assert_same_tree(self, p1, without_lift_levels(p2))
    np.testing.assert_array_equal(ours.apply(p1, apply_rng), theirs.apply(p2, apply_rng))

  def test_non_mapping_rngs(self):
    theirs = hk.transform(lambda: lifted(ParamsRng())(rngs=KEY))
    with self.assertRaisesRegex(Exception, "should be a dictionary"):
      theirs.init(None)
    # By design (BY_DESIGN): as Linen takes it.
    ours = hk.transform(lambda: adapted(ParamsRng())(rngs=KEY))
    np.testing.assert_array_equal(
      ours.apply(ours.init(None), None), ParamsRng().apply({}, rngs=KEY)
    )

  def test_lift_multiple_uses(self):
    def make(wrap):
      def f(x):
        mod = wrap(nn.Dense(1), name="mod")
        return mod(mod(x))

      return f

    x = jnp.ones([1, 1])
    ours, theirs = hk.transform(make(adapted)), hk.transform(make(lifted))
    p1, p2 = ours.init(KEY, x), theirs.init(KEY, x)
    self.assertEqual(
      jax.tree.map(lambda a: (a.shape, a.dtype), p2),
      {"mod/~": {"bias": ((1,), jnp.float32), "kernel": ((1, 1), jnp.float32)}},
    )  # Haiku's assertion.
    # BY_DESIGN: the values are the first call's (as inline Haiku).
    chex.assert_trees_all_equal_shapes_and_dtypes(p1, without_lift_levels(p2, "mod"))
    np.testing.assert_array_equal(
      ours.apply(without_lift_levels(p2, "mod"), None, x), theirs.apply(p2, None, x)
    )
    np.testing.assert_array_equal(  # The first key drawn, as hk.Linear's.
      p1["mod"]["kernel"], nn.Dense(1).init(next(hk.PRNGSequence(KEY)), x)["params"]["kernel"]
    )


class HaikuCounter(hk.Module):
  def __call__(self):
    c = hk.get_state("c", [], init=jnp.zeros)
    hk.set_state("c", c + 1)
    return c


def flax_init_rng(rng):
  """The key Haiku's flax `Module` gives its Haiku function's init."""
  return ParamsRng().apply({}, rngs={"params": rng})


class FlaxModuleTest(parameterized.TestCase):
  """`flax_module_test.py`: Haiku in Linen (`Module`) against Haiku in NNX (`to_nnx`).

  The same Haiku function through each; both keep Haiku's own names
  (`Module` in the `params` and `state` collections, `to_nnx` as
  `haiku_params()` / `haiku_state()`).
  """

  def test_transform(self):
    def f():
      return (hk.get_parameter("w1", [], init=jnp.zeros), hk.get_parameter("w2", [], init=jnp.ones))

    f = hk.transform(f)
    variables = hk.experimental.flax.Module(f).init(KEY)
    self.assertEqual(variables, {"params": {"~": {"w1": 0, "w2": 1}}})
    model = hkb.to_nnx(f, rngs=nnx.Rngs(KEY))
    self.assertEqual(model.haiku_params(), {"~": {"w1": 0, "w2": 1}})
    w1, w2 = model()
    self.assertEqual((w1, w2), (0, 1))

  def _stateful(self, f, steps, mutating=True):
    module = hk.experimental.flax.Module(f)
    variables = module.init(KEY)
    model = hkb.to_nnx(f, params=variables.get("params", {}), state=variables["state"])
    for _ in range(steps):
      if mutating:
        theirs, variables = module.apply(variables, mutable=["state"])
      else:
        theirs = module.apply(variables)
      ours = model()
      chex.assert_trees_all_equal(ours, theirs)
      chex.assert_trees_all_equal(model.haiku_state(), dict(variables["state"]))
    return model

  def test_transform_with_state(self):
    def f():
      s1 = hk.get_state("s1", [], init=jnp.zeros)
      s2 = hk.get_state("s2", [], init=jnp.ones)
      hk.set_state("s1", s1 + 1)
      hk.set_state("s2", s2 + 1)
      return s1, s2

    model = self._stateful(hk.transform_with_state(f), 5)
    self.assertEqual(model.haiku_state(), {"~": {"s1": 5, "s2": 6}})

  def test_transform_with_state_not_mutating_state_after_ini(self):
    def f():
      return (hk.get_state("s1", [], init=jnp.zeros), hk.get_state("s2", [], init=jnp.ones))

    model = self._stateful(hk.transform_with_state(f), 3, mutating=False)
    self.assertEqual(model.haiku_state(), {"~": {"s1": 0, "s2": 1}})

  def test_stateful_module(self):
    model = self._stateful(hk.transform_with_state(lambda: HaikuCounter()()), 10)
    self.assertEqual(model.haiku_state(), {"haiku_counter": {"c": 10}})

  # Haiku's cases use ResNet50 on 224x224 inputs; ResNet18 on 32x32 runs the
  # same code paths (BatchNorm state, many modules) in CI's time.
  def _resnet(self):
    return hk.transform_with_state(lambda x: hk.nets.ResNet18(10)(x, is_training=True))

  def test_resnet_50_init_equivalence_to_flax(self):
    f, x = self._resnet(), jnp.ones([1, 32, 32, 3])
    variables = hk.experimental.flax.Module(f).init(KEY, x)
    params, state = f.init(flax_init_rng(KEY), x)  # Haiku's assertion.
    chex.assert_trees_all_equal(flax_utils.flatten_flax_to_haiku(variables["params"]), params)
    rngs = nnx.Rngs(params=KEY)
    model = hkb.to_nnx(f, x, rngs=rngs)
    params, state = f.init(nnx.Rngs(params=KEY).params(), x)
    chex.assert_trees_all_equal(model.haiku_params(), params)
    chex.assert_trees_all_equal(model.haiku_state(), state)

  def test_resnet_50_apply_equivalence(self):
    f, x = self._resnet(), jnp.ones([1, 32, 32, 3])
    module = hk.experimental.flax.Module(f)
    variables = dict(module.init(KEY, x))
    model = hkb.to_nnx(
      f,
      params=flax_utils.flatten_flax_to_haiku(variables["params"]),
      state=flax_utils.flatten_flax_to_haiku(variables["state"]),
    )
    for _ in range(3):
      theirs, updates = module.apply(variables, x, mutable=["state"])
      variables = {**variables, **updates}
      np.testing.assert_array_equal(model(x), theirs)
      chex.assert_trees_all_equal(
        model.haiku_state(), flax_utils.flatten_flax_to_haiku(variables["state"])
      )


class Leaf(nn.Module):
  value: float

  @nn.compact
  def __call__(self):
    return self.param("w", lambda _: jnp.asarray(self.value))


class Nested(nn.Module):
  """`{"mod1": {"mod2": {"w": 0}}}`: a param two submodules down."""

  @nn.compact
  def __call__(self):
    return Holder(name="mod1")()


class Holder(nn.Module):
  @nn.compact
  def __call__(self):
    return Leaf(0.0, name="mod2")()


class TopLevel(nn.Module):
  @nn.compact
  def __call__(self):
    return self.param("w", lambda _: jnp.asarray(0.0))


class UtilsTest(absltest.TestCase):
  """`utils_test.py`: Flax's nested names as Haiku's (lift's and the adapter's)."""

  def _names(self, module):
    variables = module.init(KEY)
    params = hk.transform(lambda: hkb.from_flax(module, name="x")()).init(KEY)
    return flax_utils.flatten_flax_to_haiku(variables["params"]), params

  def test_flatten_flax_to_haiku(self):
    theirs, ours = self._names(Nested())
    self.assertEqual(theirs, {"mod1/mod2": {"w": 0}})
    self.assertEqual(ours, {"x/mod1/mod2": {"w": 0}})

  def test_flatten_flax_to_haiku_toplevel(self):
    theirs, ours = self._names(TopLevel())
    self.assertEqual(theirs, {"~": {"w": 0}})
    # NAMES: top-level variables are in the adapter's own bundle, not `~`.
    self.assertEqual(ours, {"x": {"w": 0}})


if __name__ == "__main__":
  absltest.main()
