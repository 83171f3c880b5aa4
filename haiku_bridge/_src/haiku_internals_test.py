"""Pins the private Haiku facts the bridge reads; a Haiku upgrade fails here first."""

from absl.testing import absltest
import haiku as hk
import jax
import jax.numpy as jnp

from haiku_bridge._src import haiku_internals


class HaikuInternalsTest(absltest.TestCase):

  def test_stored_param_ignores_getters(self):
    def f():
      hk.get_parameter("w", [2], init=jnp.ones)
      with hk.custom_getter(lambda nxt, v, ctx: nxt(v.astype(jnp.bfloat16))):
        return haiku_internals.stored_param("~", "w"), haiku_internals.stored_param(
            "~", "missing")

    stored, missing = hk.transform(f).apply({"~": {"w": jnp.ones([2])}}, None)
    self.assertEqual(stored.dtype, jnp.float32)
    self.assertIsNone(missing)

  def test_stored_state(self):
    def f():
      hk.set_state("s", jnp.zeros([]))
      hk.set_state("s", jnp.ones([]))
      return haiku_internals.stored_state("~", "s"), haiku_internals.stored_state(
          "~", "missing")

    (current, missing), _ = hk.transform_with_state(f).apply(
        {}, {"~": {"s": jnp.zeros([])}}, None)
    self.assertEqual(current, 1.)
    self.assertIsNone(missing)

  def test_inside_raw_jax_transform(self):
    def f(xs):
      seen = [haiku_internals.inside_raw_jax_transform()]
      probe = lambda x: seen.append(haiku_internals.inside_raw_jax_transform())
      hk.vmap(probe, split_rng=False)(xs)
      jax.vmap(probe)(xs)
      return seen

    outside, in_haiku_vmap, in_jax_vmap = hk.transform(f).apply(
        {}, None, jnp.ones([2]))
    self.assertFalse(outside)
    self.assertFalse(in_haiku_vmap)
    self.assertTrue(in_jax_vmap)

  def test_inside_raw_jax_transform_under_jit_of_init(self):
    seen = []
    f = hk.transform(lambda: seen.append(
        haiku_internals.inside_raw_jax_transform()))
    jax.jit(f.init)(jax.random.PRNGKey(0))
    self.assertEqual(seen, [False])

  def test_original_fn(self):
    fn = lambda x: x
    self.assertIs(haiku_internals.original_fn(hk.transform(fn)), fn)
    self.assertIs(haiku_internals.original_fn(
        hk.without_apply_rng(hk.transform_with_state(fn))), fn)
    self.assertIsNone(haiku_internals.original_fn(fn))

  def test_interceptors_suspended(self):
    double = lambda nxt, v, ctx: nxt(2 * v)

    def f():
      with hk.custom_getter(double):
        with haiku_internals.interceptors_suspended():
          inside = hk.get_parameter("w", [], init=jnp.ones)
        return inside, hk.get_parameter("w", [], init=jnp.ones)

    inside, after = hk.transform(f).apply({"~": {"w": jnp.ones([])}}, None)
    self.assertEqual(inside, 1.)
    self.assertEqual(after, 2.)

  def test_getters_active(self):
    getter = lambda nxt, v, ctx: nxt(v)

    def f():
      before = (haiku_internals.getters_active("parameter"),
                haiku_internals.getters_active("state"))
      with hk.custom_getter(getter):
        params_only = (haiku_internals.getters_active("parameter"),
                       haiku_internals.getters_active("state"))
      with hk.custom_getter(getter, params=False, state=True):
        state_only = (haiku_internals.getters_active("parameter"),
                      haiku_internals.getters_active("state"))
      return before, params_only, state_only

    self.assertEqual(hk.transform(f).apply({}, None),
                     ((False, False), (True, False), (False, True)))

  def test_claim_name(self):
    class M(hk.Module):

      def __call__(self):
        return (haiku_internals.claim_name("x"),
                haiku_internals.claim_name("x"))

    def f():
      m = M()
      return m(), m()

    first_call, second_call = hk.transform(f).apply({}, None)
    self.assertEqual(first_call, (True, False))
    self.assertEqual(second_call, (True, False))

  def test_stored_names_and_bundle(self):
    seen = []

    def f():
      hk.get_parameter("w", [2], init=jnp.ones)
      hk.set_state("s", jnp.zeros([]))
      frame = haiku_internals.frame()
      seen.append((haiku_internals.stored_names(),
                   haiku_internals.stored_bundle(frame, "parameter", "~"),
                   haiku_internals.stored_bundle(frame, "state", "~"),
                   haiku_internals.stored_bundle(frame, "state", "missing")))

    hk.transform_with_state(f).init(jax.random.PRNGKey(0))
    (names, params, state, missing), = seen
    self.assertEqual(names, {"~/w", "~/s"})
    self.assertEqual(list(params), ["w"])
    self.assertEqual(list(state), ["s"])
    self.assertEqual(missing, {})

  def test_creation_frame_id(self):
    def f():
      module = hk.Linear(1)
      return (haiku_internals.creation_frame_id(module) ==
              haiku_internals.frame_id(haiku_internals.frame()))

    self.assertTrue(hk.transform(f).apply({}, None))

  def test_in_naming_probe_takes_no_name(self):
    def f():
      hk.Linear(1)
      with haiku_internals.in_naming_probe(haiku_internals.frame()):
        probed = hk.Linear(1).module_name
      return probed, hk.Linear(1).module_name

    self.assertEqual(hk.transform(f).apply({}, None), ("linear_1", "linear_1"))

  def test_run_with_storage_loads_and_records(self):
    loaded = []

    def load(bundle):
      loaded.append(bundle)
      return {"w": jnp.ones([2])} if bundle == "linear" else {}

    def fn():
      w = hk.get_parameter("w", [2], init=jnp.zeros)
      with hk.name_scope("linear"):
        v = hk.get_parameter("w", [2], init=jnp.zeros)
      n = hk.get_state("n", [], init=jnp.zeros)
      return w, v, n, hk.running_init()

    params = haiku_internals.LazyBundles(load, state=False)
    state = haiku_internals.LazyBundles(lambda b: {}, state=True)
    w, v, n, running_init = haiku_internals.run_with_storage(
        fn, params, state, None, frozen=False)
    self.assertTrue(running_init)
    self.assertEqual((float(w[0]), float(v[0]), float(n)), (0., 1., 0.))
    self.assertEqual(loaded, ["~", "linear"])
    self.assertEqual(params["linear"].read, ["w"])
    self.assertEqual(params["linear"].loaded, {"w"})
    self.assertEqual(params["~"].loaded, frozenset())
    frozen = haiku_internals.LazyBundles(load, state=False)
    with self.assertRaisesRegex(ValueError, "Unable to retrieve parameter"):
      haiku_internals.run_with_storage(fn, frozen, state, None, frozen=True)

  def test_lazy_bundles_under_lift(self):
    # hk.lift writes whole bundles at init and iterates all bundles at apply.
    lifted = hk.transform(lambda x: hk.Linear(2)(x))

    def fn(x):
      params = hk.lift(lifted.init, name="inner")(
          jax.random.PRNGKey(0) if hk.running_init() else None, x)
      return lifted.apply(params, None, x)

    x = jnp.ones([1, 3])
    init_params = haiku_internals.LazyBundles(lambda b: {}, state=False)
    haiku_internals.run_with_storage(lambda: fn(x), init_params,
                                     haiku_internals.LazyBundles(
                                         lambda b: {}, state=True),
                                     None, frozen=False)
    created = dict.__getitem__(init_params, "inner/linear")
    self.assertIsInstance(created, haiku_internals.RecordingBundle)
    self.assertEqual(sorted(dict.keys(created)), ["b", "w"])
    self.assertEqual(created.loaded, frozenset())

    stored = {"inner/linear": {"w": jnp.ones([3, 2]), "b": jnp.zeros([2])},
              "other": {"w": jnp.ones([])}}
    apply_params = haiku_internals.LazyBundles(
        lambda b: dict(stored.get(b, {})), state=False,
        every_bundle=lambda: list(stored))
    out = haiku_internals.run_with_storage(
        lambda: fn(x), apply_params,
        haiku_internals.LazyBundles(lambda b: {}, state=True), None,
        frozen=True)
    self.assertEqual(out.tolist(), [[3., 3.]])
    # Only the bundle lift copied counts as read.
    self.assertEqual(sorted(dict.__getitem__(apply_params, "inner/linear").read),
                     ["b", "w"])
    self.assertEqual(dict.__getitem__(apply_params, "other").read, [])


if __name__ == "__main__":
  absltest.main()
