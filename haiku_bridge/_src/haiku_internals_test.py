"""Pins the private Haiku facts the bridge reads; a Haiku upgrade fails here first.

A user's newer dm-haiku fails on import instead, with the library's error, where what the bridge
reads of it is gone: simulated below by taking a name or a field away.
"""

import collections
import contextlib
import functools
import os
import subprocess
import sys
from unittest import mock

from absl.testing import absltest
import haiku as hk
from haiku._src import base as _base
import jax
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from haiku_bridge._src import errors
from haiku_bridge._src import haiku_internals

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class HaikuInternalsTest(absltest.TestCase):
  def test_stored_param_ignores_getters(self):
    def f():
      hk.get_parameter("w", [2], init=jnp.ones)
      with hk.custom_getter(lambda nxt, v, ctx: nxt(v.astype(jnp.bfloat16))):
        return haiku_internals.stored_param("~", "w"), haiku_internals.stored_param("~", "missing")

    stored, missing = hk.transform(f).apply({"~": {"w": jnp.ones([2])}}, None)
    self.assertEqual(stored.dtype, jnp.float32)
    self.assertIsNone(missing)

  def test_stored_state(self):
    def f():
      hk.set_state("s", jnp.zeros([]))
      hk.set_state("s", jnp.ones([]))
      return haiku_internals.stored_state("~", "s"), haiku_internals.stored_state("~", "missing")

    (current, missing), _ = hk.transform_with_state(f).apply({}, {"~": {"s": jnp.zeros([])}}, None)
    self.assertEqual(current, 1.0)
    self.assertIsNone(missing)

  def test_inside_raw_jax_transform(self):
    def f(xs):
      seen = [haiku_internals.inside_raw_jax_transform()]
      probe = lambda x: seen.append(haiku_internals.inside_raw_jax_transform())
      hk.vmap(probe, split_rng=False)(xs)
      jax.vmap(probe)(xs)
      return seen

    outside, in_haiku_vmap, in_jax_vmap = hk.transform(f).apply({}, None, jnp.ones([2]))
    self.assertFalse(outside)
    self.assertFalse(in_haiku_vmap)
    self.assertTrue(in_jax_vmap)

  def test_inside_raw_jax_transform_under_jit_of_init(self):
    seen = []
    f = hk.transform(lambda: seen.append(haiku_internals.inside_raw_jax_transform()))
    jax.jit(f.init)(jax.random.PRNGKey(0))
    self.assertEqual(seen, [False])

  def test_original_fn(self):
    fn = lambda x: x
    self.assertIs(haiku_internals.original_fn(hk.transform(fn)), fn)
    self.assertIs(
      haiku_internals.original_fn(hk.without_apply_rng(hk.transform_with_state(fn))), fn
    )
    self.assertIsNone(haiku_internals.original_fn(fn))

  def test_interceptors_suspended(self):
    double = lambda nxt, v, ctx: nxt(2 * v)

    def f():
      with hk.custom_getter(double):
        with haiku_internals.interceptors_suspended():
          inside = hk.get_parameter("w", [], init=jnp.ones)
        return inside, hk.get_parameter("w", [], init=jnp.ones)

    inside, after = hk.transform(f).apply({"~": {"w": jnp.ones([])}}, None)
    self.assertEqual(inside, 1.0)
    self.assertEqual(after, 2.0)

  def test_claim_name(self):
    class M(hk.Module):
      def __call__(self):
        return (haiku_internals.claim_name("x"), haiku_internals.claim_name("x"))

    def f():
      m = M()
      return m(), m()

    first_call, second_call = hk.transform(f).apply({}, None)
    self.assertEqual(first_call, (True, False))
    self.assertEqual(second_call, (True, False))

  def test_claim_is_per_frame_under_haiku_wrappers(self):
    # hk.vmap traces its body in a new frame with a copy of the used names:
    # a claim there is new once, as Haiku's own names are.
    seen = []

    class M(hk.Module):
      def __call__(self, x):
        seen.append(haiku_internals.claim_name("x"))
        hk.vmap(
          lambda a: (
            seen.extend([haiku_internals.claim_name("x"), haiku_internals.claim_name("x")]) or a
          ),
          split_rng=False,
        )(x)

    hk.transform(lambda x: M()(x)).apply({}, None, jnp.ones([2]))
    self.assertEqual(seen, [True, True, False])

  def test_naming_effect_and_take_names_as_inline(self):
    # A run at a point the caller has moved past: take_names never lowers a
    # counter the caller moved on, it takes the explicit names the run used
    # (`own` is then `own_1`, as inline), and the effect holds only what the
    # run took: module names, no claims.
    def names(bridged):
      hk.Linear(1, name="conv")
      point = haiku_internals.call_point()
      taken = [hk.Linear(1).module_name, hk.Linear(1).module_name]
      if not bridged:  # Inline at the point: what the run below does.
        taken += [hk.Linear(1).module_name, hk.Linear(1, name="own").module_name]
        return taken, hk.Linear(1).module_name, hk.Linear(1, name="own").module_name, None
      with haiku_internals.frame_from(point, params={}, state={}, rng=None, init=True) as frame:
        taken += [hk.Linear(1).module_name, hk.Linear(1, name="own").module_name]
        hk.Linear(1, name="numbered_3")
        haiku_internals.claim_name("x")
      effect = haiku_internals.naming_effect(point, frame)
      haiku_internals.take_names(effect)
      # Haiku refuses an explicitly numbered name given twice in a scope.
      with self.assertRaisesRegex(ValueError, "'numbered_3' is not unique"):
        hk.Linear(1, name="numbered_3")
      return taken, hk.Linear(1).module_name, hk.Linear(1, name="own").module_name, effect

    f = lambda bridged: hk.transform(lambda: names(bridged)).apply({}, None)
    taken, after, own, effect = f(True)
    inline_taken, inline_after, inline_own, _ = f(False)
    self.assertEqual(taken[:2], inline_taken[:2])
    self.assertEqual(taken[2:], ["linear", "own"])  # The point's next names.
    self.assertEqual((after, own), ("linear_2", "own_1"))
    self.assertEqual((inline_after, inline_own), ("linear_3", "own_1"))
    self.assertEqual(dict(effect.counters), {"linear": 1, "own": 1, "numbered": 4})
    self.assertEqual(effect.used, frozenset({"linear", "own", "numbered_3"}))

  def test_frame_from_and_loop_step_are_haikus_own_level(self):
    # Under a raw JAX transform (jax.eval_shape, lax.scan) the code inside
    # runs as inside Haiku's own wrappers: not a raw transform to it.
    seen = []

    def f(x):
      def run(_):
        with haiku_internals.frame_from(
          haiku_internals.call_point(), params={}, state={}, rng=None, init=False
        ):
          seen.append(haiku_internals.inside_raw_jax_transform())

      jax.eval_shape(run, x)

      def body(carry, _):
        with haiku_internals.loop_step(carry):
          seen.append(haiku_internals.inside_raw_jax_transform())
          return haiku_internals.loop_state(), None

      jax.lax.scan(body, haiku_internals.loop_state(), None, length=2)

    hk.transform_with_state(f).apply({}, {}, None, jnp.ones([]))
    self.assertEqual(seen, [False, False])

  def test_stored_names_and_frame_contents(self):
    seen = []

    def f():
      hk.get_parameter("w", [2], init=jnp.ones)
      hk.set_state("s", jnp.zeros([]))
      hk.get_state("t", [], init=jnp.ones)
      hk.set_state("t", 2 * jnp.ones([]))
      frame = haiku_internals.frame()
      seen.append(
        (
          haiku_internals.stored_names(),
          haiku_internals.frame_params(frame),
          haiku_internals.frame_state(frame),
        )
      )

    hk.transform_with_state(f).init(jax.random.PRNGKey(0))
    ((names, params, state),) = seen
    self.assertEqual(names, {"~/w", "~/s", "~/t"})
    self.assertEqual(jax.tree.map(lambda a: a.tolist(), params), {"~": {"w": [1.0, 1.0]}})
    self.assertEqual(jax.tree.map(float, state), {"~": {"s": 0.0, "t": 2.0}})

  def test_frame_params_drop_empty_bundles(self):
    # Haiku keeps a bundle passed empty (hk.get_params() lists it); the
    # bridge's view of stored params holds only bundles that hold some.
    seen = []
    hk.transform(
      lambda: seen.append((haiku_internals.frame_params(haiku_internals.frame()), hk.get_params()))
    ).apply({"m": {}, "n": {"w": jnp.ones([])}}, None)
    ((ours, haikus),) = seen
    self.assertEqual(list(haikus), ["m", "n"])
    self.assertEqual(list(ours), ["n"])

  def test_creation_frame_id(self):
    def f():
      module = hk.Linear(1)
      return haiku_internals.creation_frame_id(module) == haiku_internals.frame_id(
        haiku_internals.frame()
      )

    self.assertTrue(hk.transform(f).apply({}, None))

  def test_interceptors_as_and_suspended(self):
    double = lambda nxt, v, ctx: nxt(2 * v)
    get = lambda: hk.get_parameter("w", [], init=jnp.ones)

    def f():
      with hk.custom_getter(double):
        saved = haiku_internals.interceptors()
        with haiku_internals.interceptors_suspended():
          suspended = get()
          with haiku_internals.interceptors_as(saved):
            restored = get()
        with haiku_internals.interceptors_suspended(getters_only=True):
          no_getters = get()
        return suspended, restored, no_getters, get()

    self.assertEqual(hk.transform(f).apply({"~": {"w": jnp.ones([])}}, None), (1.0, 2.0, 1.0, 2.0))

  def test_interceptors_as_keeps_their_order(self):
    # Two getters that do not commute: restored, they compose as Haiku
    # composed them inline.
    plus_one = lambda nxt, v, ctx: nxt(v + 1)
    double = lambda nxt, v, ctx: nxt(2 * v)
    get = lambda: hk.get_parameter("w", [], init=jnp.ones)

    def f():
      with hk.custom_getter(plus_one), hk.custom_getter(double):
        inline = get()
        saved = haiku_internals.interceptors()
      with haiku_internals.interceptors_as(saved):
        restored = get()
      return inline, restored

    inline, restored = hk.transform(f).apply({"~": {"w": jnp.ones([])}}, None)
    self.assertEqual(restored, inline)

  def test_suspending_getters_only_keeps_creators_and_setters(self):
    double = lambda nxt, shape, dtype, init, ctx: nxt(shape, dtype, lambda s, d: 2 * init(s, d))

    def f(suspend):
      with (
        hk.custom_creator(double, state=True),
        hk.custom_setter(lambda nxt, value, ctx: nxt(value + 1)),
        hk.custom_getter(lambda nxt, value, ctx: nxt(value + 10)),
      ):
        with (
          haiku_internals.interceptors_suspended(getters_only=True)
          if suspend
          else contextlib.nullcontext()
        ):
          hk.get_parameter("w", [], init=jnp.ones)
          hk.get_state("n", [], init=jnp.ones)
          hk.set_state("m", 1.0)

    # As Haiku runs the same code inline: getters do not change what is
    # stored, so init stores the same with or without them.
    ours, inline = (
      jax.tree.map(
        float, hk.transform_with_state(functools.partial(f, suspend)).init(jax.random.PRNGKey(0))
      )
      for suspend in (True, False)
    )
    self.assertEqual(ours, inline)
    self.assertEqual(ours, ({"~": {"w": 2.0}}, {"~": {"n": 2.0, "m": 2.0}}))

  def test_interceptors_include_method_interceptors(self):
    calls = []

    def interceptor(next_f, args, kwargs, context):
      calls.append(context.method_name)
      return next_f(*args, **kwargs)

    def f(x):
      with hk.intercept_methods(interceptor):
        with haiku_internals.interceptors_suspended():
          hk.Linear(1)(x)
      return calls

    hk.transform(f).init(jax.random.PRNGKey(0), jnp.ones([1, 1]))
    self.assertEqual(calls, [])

  def test_call_point_and_frame_from(self):
    # A frame evolved from a call point names modules as code at that point
    # would, over the storage it is given, in the mode asked for, and takes
    # no name at the point; `take_names` takes them afterwards.
    def f(x):
      hk.Linear(1)(x)
      point = haiku_internals.call_point()
      after_point = hk.Linear(1).module_name  # The caller goes on.
      runs = []
      for init in (True, False):
        with haiku_internals.frame_from(
          point,
          params={"linear_1": {"w": jnp.ones([1, 1]), "b": jnp.zeros([1])}},
          state={"s": {"n": jnp.ones([])}},
          rng=None,
          init=init,
        ) as frame:
          linear = hk.Linear(1)
          runs.append(
            (
              linear.module_name,
              hk.running_init(),
              float(hk.get_state("n", [], init=jnp.zeros) if False else 0),
            )
          )
        effect = haiku_internals.naming_effect(point, frame)
      haiku_internals.take_names(effect)
      return after_point, runs, effect, hk.Linear(1).module_name

    after_point, runs, effect, after_take = hk.transform(f).apply(
      {
        "linear": {"w": jnp.ones([1, 1]), "b": jnp.zeros([1])},
        "linear_1": {"w": jnp.ones([1, 1]), "b": jnp.zeros([1])},
      },
      None,
      jnp.ones([1, 1]),
    )
    self.assertEqual(after_point, "linear_1")
    self.assertEqual(runs, [("linear_1", True, 0.0), ("linear_1", False, 0.0)])
    self.assertEqual(effect.used, frozenset({"linear_1"}))
    self.assertEqual(dict(effect.counters), {"linear": 2})
    self.assertEqual(after_take, "linear_2")

  def test_frame_from_storage_and_state_written(self):
    point = []

    def f():
      point.append(haiku_internals.call_point())

    hk.transform(f).apply({}, None)

    def g():
      w = hk.get_parameter("w", [2], init=jnp.zeros)
      n = hk.get_state("n", [], init=jnp.zeros)
      hk.set_state("m", n + 1)
      return w, n

    with haiku_internals.frame_from(
      point[0],
      params={"~": {"w": jnp.ones([2])}},
      state={"~": {"n": jnp.full([], 3.0)}},
      rng=None,
      init=False,
    ) as frame:
      # Outside any transform: a context is made for the run.
      w, n = g()
    self.assertEqual(w.tolist(), [1.0, 1.0])
    self.assertEqual(float(n), 3.0)
    self.assertEqual(
      jax.tree.map(float, haiku_internals.frame_state(frame)), {"~": {"n": 3.0, "m": 4.0}}
    )

  def test_frame_from_outside_a_transform_updates_lifted_state(self):
    # hk.lift_with_state's updater needs a transform's context; run later,
    # outside one, the frame gives it one and it writes as inline apply.
    point = []
    hk.transform(lambda: point.append(haiku_internals.call_point())).apply({}, None)
    inner = hk.transform_with_state(
      lambda: hk.set_state("n", hk.get_state("n", [], init=jnp.zeros) + 1)
    )

    def g():
      init, updater = hk.lift_with_state(inner.init, name="inner")
      updater.update(inner.apply(*init(None), None)[1])

    state = {"inner/~": {"n": jnp.zeros([])}}
    with haiku_internals.frame_from(
      point[0], params={}, state=state, rng=None, init=False
    ) as frame:
      g()
    inline = hk.transform_with_state(g).apply({}, state, None)[1]
    self.assertEqual(
      jax.tree.map(float, haiku_internals.frame_state(frame)), jax.tree.map(float, inline)
    )

  def test_write_state_keeps_the_initial_value(self):
    seen = []

    def f():
      hk.get_state("n", [], init=jnp.zeros)
      haiku_internals.write_state({"~": {"n": jnp.ones([]), "new": 2.0}})
      seen.append((hk.get_state("n"), hk.get_state("new")))

    _, initial = hk.transform_with_state(f).init(jax.random.PRNGKey(0))
    self.assertEqual(seen, [(1.0, 2.0)])
    self.assertEqual(jax.tree.map(float, initial), {"~": {"n": 0.0, "new": 2.0}})

  def test_same_transform(self):
    seen = []

    def f(x):
      outer = haiku_internals.frame()
      hk.remat(
        lambda a: seen.append(haiku_internals.same_transform(haiku_internals.frame(), outer)) or a
      )(x)
      inner = hk.transform(
        lambda: seen.append(haiku_internals.same_transform(haiku_internals.frame(), outer))
      )
      inner.apply({}, None)

    hk.transform(f).apply({}, None, jnp.ones([]))
    self.assertEqual(seen, [True, False])

  def test_same_transform_under_pushed_trace_levels(self):
    # hk.vmap and frame_from push a JAX trace level: still the same run.
    seen = []

    def f(x):
      outer = haiku_internals.frame()
      probe = lambda a: (
        seen.append(haiku_internals.same_transform(haiku_internals.frame(), outer)) or a
      )
      hk.vmap(probe, split_rng=False)(x)
      with haiku_internals.frame_from(
        haiku_internals.call_point(), params={}, state={}, rng=None, init=False
      ):
        probe(x)

    hk.transform(f).apply({}, None, jnp.ones([2]))
    self.assertEqual(seen, [True, True])

  def test_lifting(self):
    inner = hk.transform(lambda x: hk.Linear(1)(x))
    seen = []

    def interceptor(next_f, args, kwargs, context):
      info = haiku_internals.lifting(context.module)
      if info is not None and context.method_name == "__call__":
        seen.append((info.prefix, info.transparent, sorted(info.init_fn(*args, **kwargs)[0])))
      return next_f(*args, **kwargs)

    class M(hk.Module):
      def __call__(self, x):
        hk.lift(inner.init, name="lifted")(jax.random.PRNGKey(0), x)
        hk.transparent_lift(inner.init)(jax.random.PRNGKey(0), x)

    def f(x):
      with hk.intercept_methods(interceptor):
        M()(x)

    hk.transform(f).init(jax.random.PRNGKey(0), jnp.ones([1, 1]))
    self.assertEqual(seen, [("m/lifted", False, ["linear"]), ("m", True, ["linear"])])
    self.assertIsNone(haiku_internals.lifting(object()))

  def test_module_counters_and_module_stack(self):
    class M(hk.Module):
      def __call__(self):
        hk.Linear(1)
        point = haiku_internals.call_point()
        return (
          haiku_internals.module_counters(point),
          haiku_internals.in_module_stack(point, self),
        )

    counters, inside = hk.transform(lambda: M()()).apply({}, None)
    self.assertEqual(counters, {"m/linear": 1})
    self.assertTrue(inside)

  def test_layer_stack_names(self):
    f = hk.transform(
      lambda x: (
        hk.layer_stack(2)(lambda a: hk.Linear(1)(a))(x),
        hk.layer_stack(2, with_per_layer_inputs=True)(lambda a, b: (hk.Linear(1)(a), b))(x, x),
      )
    )
    params = f.init(jax.random.PRNGKey(0), jnp.ones([2, 1]))
    tops = {b.split("/")[0] for b in params}
    self.assertEqual(tops, set(haiku_internals.LAYER_STACK_NAMES.values()))

  def test_loop_state_step_and_set(self):
    # A loop over the three functions is hk.scan's loop: the same state
    # and the same dropout keys at each step, and the same state after.
    def step(linear):
      def f(h, x):
        n = hk.get_state("n", [], init=jnp.zeros)
        hk.set_state("n", n + 1)
        h = hk.dropout(hk.next_rng_key(), 0.5, jnp.tanh(linear(x) + h))
        return h, h * n

      return f

    def by_hand(xs):
      f = step(hk.Linear(3))
      h, ys0 = f(jnp.zeros([3]), xs[0])  # Init: the first step creates.

      def body(carry, x):
        h, state = carry
        with haiku_internals.loop_step(state):
          h, y = f(h, x)
          return (h, haiku_internals.loop_state()), y

      (h, state), ys = jax.lax.scan(body, (h, haiku_internals.loop_state()), xs[1:])
      haiku_internals.set_loop_state(state)
      return h, jnp.concatenate([ys0[None], ys])

    def haikus(xs):
      return hk.scan(step(hk.Linear(3)), jnp.zeros([3]), xs)

    xs = jnp.ones([4, 2])
    ours, theirs = (hk.transform_with_state(by_hand), hk.transform_with_state(haikus))
    key = jax.random.PRNGKey(0)
    # Haiku splits keys in blocks of `rng_reserve_size`; the carry must keep
    # its structure whatever part of a block a step draws.
    for reserve in (1, 4):
      with hk.config.context(rng_reserve_size=reserve):
        params, state = theirs.init(key, xs)
        jax.tree.map(np.testing.assert_array_equal, ours.init(key, xs), (params, state))
        jax.tree.map(
          np.testing.assert_array_equal,
          ours.apply(params, state, key, xs),
          theirs.apply(params, state, key, xs),
        )

  def test_loop_step_lists_new_params(self):
    def f():
      with haiku_internals.loop_step(haiku_internals.loop_state()) as new:
        hk.get_parameter("old", [1], init=jnp.ones)
        seen = [new()]
        hk.Linear(1)(jnp.ones([1, 1]))
        return seen + [new()]

    def run():
      hk.get_parameter("old", [1], init=jnp.ones)
      return f()

    out = []
    hk.transform(lambda: out.extend(run())).init(jax.random.PRNGKey(0))
    self.assertEqual(out, [[], ["linear/b", "linear/w"]])


class ChangedHaikuTest(absltest.TestCase):
  """A dm-haiku that moved what the bridge reads is refused on import, saying what moved."""

  def test_this_haiku_has_everything(self):
    self.assertEqual(haiku_internals.changed_reads(), [])

  def test_a_name_gone(self):
    reads = {_base: ("current_frame", "frame_stack_v2")}
    with mock.patch.object(hk, "__version__", "0.0.18"):
      with self.assertRaisesRegex(
        errors.UnsupportedHaikuError,
        r"^haiku_bridge cannot run on dm-haiku 0\.0\.18: .*\(haiku\._src\.base\."
        r"frame_stack_v2 is gone\).* supports dm-haiku 0\.0\.14 to 0\.0\.17",
      ):
        haiku_internals.check_haiku(reads)
    # An ImportError: code that treats haiku_bridge as optional goes on without it. Public, so
    # that code can name it.
    self.assertTrue(issubclass(errors.UnsupportedHaikuError, ImportError))
    self.assertIs(hkb.UnsupportedHaikuError, errors.UnsupportedHaikuError)

  def test_a_frame_field_gone(self):
    fields = [f for f in _base.Frame._fields if f != "jax_trace_stack"]
    frame = collections.namedtuple("Frame", fields)
    frame.evolve = _base.Frame.evolve
    with mock.patch.object(_base, "Frame", frame):
      self.assertEqual(
        haiku_internals.changed_reads(), ["its Frame has no field 'jax_trace_stack'"]
      )

  def test_state_pair_fields_changed(self):
    pair = collections.namedtuple("StatePair", ["initial", "value"])
    with mock.patch.object(_base, "StatePair", pair):
      self.assertEqual(
        haiku_internals.changed_reads(), ["StatePair's fields are not ('initial', 'current')"]
      )

  def test_evolve_changed_and_layer_stack_renamed(self):
    frame = collections.namedtuple("Frame", _base.Frame._fields)
    frame.evolve = lambda self, params, state, rng: self
    source = "name = '__layer_stack_no_per_layer'; name = \"__layer_stack_with_per_layer\""
    with (
      mock.patch.object(_base, "Frame", frame),
      mock.patch.object(haiku_internals.inspect, "getsource", lambda module: source),
    ):
      self.assertEqual(
        haiku_internals.changed_reads(),
        [
          "Frame.evolve takes no `decoupled=`",
          "hk.layer_stack does not name a stack '__layer_stack_no_per_layer'",
        ],
      )

  def test_no_source_no_refusal(self):
    def no_source(module):
      raise OSError(f"no source for {module}")

    with mock.patch.object(haiku_internals.inspect, "getsource", no_source):
      self.assertEqual(haiku_internals.changed_reads(), [])

  def test_import_refuses_a_changed_haiku(self):
    # A fresh process whose Haiku lost a function the bridge calls: importing haiku_bridge
    # raises the library's error, not an AttributeError (or a wrong result) later.
    code = (
      "import haiku; from haiku._src import stateful; haiku.__version__ = '0.0.18'; "
      "del stateful.temporary_internal_state; import haiku_bridge"
    )
    run = subprocess.run(
      [sys.executable, "-c", code],
      cwd=_ROOT,
      capture_output=True,
      text=True,
      check=False,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    self.assertNotEqual(run.returncode, 0)
    self.assertIn(
      "UnsupportedHaikuError: haiku_bridge cannot run on dm-haiku 0.0.18: this "
      "release changed Haiku internals that haiku_bridge reads (haiku._src.stateful."
      "temporary_internal_state is gone)",
      run.stderr,
    )


if __name__ == "__main__":
  absltest.main()
