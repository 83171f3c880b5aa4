"""Tests for caches: keys hold everything a result depends on; one clear."""

import functools
import os
import subprocess
import sys
import types

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from haiku_bridge._src import caches


class SignatureTest(absltest.TestCase):

  def test_full_shapes_not_ranks(self):
    self.assertNotEqual(caches.signature(jnp.ones([2, 3])),
                        caches.signature(jnp.ones([4, 3])))

  def test_dtype_and_weak_type(self):
    self.assertNotEqual(caches.signature(jnp.ones([2])),
                        caches.signature(jnp.ones([2], jnp.bfloat16)))
    self.assertNotEqual(caches.signature(jnp.asarray(1.0)),
                        caches.signature(jnp.float32(1.0) * jnp.ones([])))

  def test_values_of_python_arguments(self):
    self.assertNotEqual(caches.signature(True), caches.signature(False))
    self.assertEqual(caches.signature(jnp.ones([2]), True),
                     caches.signature(jnp.zeros([2]), True))

  def test_numpy_integer_and_bool_scalars_by_value(self):
    # Python values to the bridge, as to inline code (pytree.split_arrays).
    self.assertNotEqual(caches.signature(np.int64(7)),
                        caches.signature(np.int64(8)))
    self.assertNotEqual(caches.signature(np.bool_(True)),
                        caches.signature(np.bool_(False)))
    self.assertNotEqual(caches.signature(np.int64(7)), caches.signature(7))
    self.assertEqual(caches.signature(np.float32(1.0)),
                     caches.signature(np.float32(2.0)))

  def test_numpy_and_jax_arrays_and_specs_agree(self):
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    self.assertEqual(caches.signature(np.ones([2], np.float32)),
                     caches.signature(jnp.ones([2])))
    self.assertEqual(caches.signature(spec), caches.signature(jnp.ones([2])))

  def test_unhashable_gives_none(self):
    self.assertIsNone(caches.signature([{1, 2}]))
    self.assertIsNone(caches.function_key(lambda: None, [{1}]))
    unhashable = type("Unhashable", (), {"__eq__": lambda a, b: True,
                                         "__call__": lambda self: None})()
    self.assertIsNone(caches.function_key(unhashable, 1))


SIZE = 3  # Read by `reads_a_global`.


def reads_a_global():
  return SIZE


def calls_a_helper():
  return reads_a_global() + 1


class FingerprintTest(absltest.TestCase):

  def test_globals_read_directly_and_through_helpers(self):
    global SIZE
    before = [caches.fingerprint(f) for f in (reads_a_global, calls_a_helper)]
    try:
      SIZE = 4
      after = [caches.fingerprint(f) for f in (reads_a_global, calls_a_helper)]
    finally:
      SIZE = 3
    self.assertNotEqual(before[0], after[0])
    self.assertNotEqual(before[1], after[1])
    self.assertEqual(before,
                     [caches.fingerprint(f) for f in (reads_a_global,
                                                      calls_a_helper)])

  def test_closure_cells_and_defaults(self):
    sizes = [1]
    def f(x=2):
      return sizes, x
    first = caches.fingerprint(f)
    sizes.append(2)  # Mutated in place: keyed by contents.
    self.assertNotEqual(caches.fingerprint(f), first)
    f.__defaults__ = (3,)
    self.assertNotEqual(caches.fingerprint(f), first)

  def test_partials_and_dataclass_fields(self):
    g = lambda n: n
    self.assertNotEqual(caches.fingerprint(functools.partial(g, 1)),
                        caches.fingerprint(functools.partial(g, 2)))
    self.assertEqual(caches.fingerprint(functools.partial(g, 1)),
                     caches.fingerprint(functools.partial(g, 1)))

  def test_a_class_by_its_own_methods_and_values(self):
    global SIZE

    class Base:
      scale = 2

    class Model(Base):

      def __init__(self):
        self.size = reads_a_global()

    before = [caches.fingerprint(f) for f in (Model, lambda: Model(),
                                             functools.partial(Model))]
    try:
      SIZE = 4
      after = [caches.fingerprint(f) for f in (Model, lambda: Model(),
                                              functools.partial(Model))]
    finally:
      SIZE = 3
    self.assertTrue(all(b != a for b, a in zip(before, after)))
    Base.scale = 3
    self.assertNotEqual(caches.fingerprint(Model), before[0])
    Base.scale = 2
    self.assertEqual(caches.fingerprint(Model), before[0])

  def test_attributes_of_your_module_that_the_code_names(self):
    # `config.WIDTH`, `config.SIZES["a"]`: a config module of yours.
    config = types.ModuleType("a_config_of_yours")
    config.WIDTH, config.SIZES = 4, {"a": 1}
    namespace = {"config": config}
    code = "def f():\n  return config.WIDTH, config.SIZES['a']"
    exec(code, namespace)  # pylint: disable=exec-used
    f = namespace["f"]
    before = caches.fingerprint(f)
    config.WIDTH = 5
    self.assertNotEqual(caches.fingerprint(f), before)
    config.WIDTH = 4
    config.SIZES["a"] = 2
    self.assertNotEqual(caches.fingerprint(f), before)
    config.SIZES["a"] = 1
    config.UNREAD = 3
    self.assertEqual(caches.fingerprint(f), before)

  def test_an_installed_class_by_identity(self):
    # An installed package's code cannot change while the process runs.
    # pylint: disable=protected-access
    self.assertIs(caches._freeze_class(np.ndarray, 3), np.ndarray)
    self.assertIsNot(caches._freeze_class(FingerprintTest, 3), FingerprintTest)

  def test_large_or_traced_values_cannot_be_keyed(self):
    big = np.zeros([4096])
    self.assertIsNone(caches.function_key(lambda: big))
    self.assertIsNotNone(caches.function_key(lambda: np.zeros([3])))


class SwitchTest(absltest.TestCase):

  def test_disabled_keeps_nothing(self):
    cache = caches.Cache("switch")
    cache.put("k", 1)
    with caches.disabled():
      self.assertFalse(caches.enabled())
      self.assertIsNone(cache.get("k"))
      cache.put("j", 2)
    self.assertTrue(caches.enabled())
    self.assertIsNone(cache.get("j"))

  def test_environment_variable(self):
    code = ("from haiku_bridge._src import caches; "
            "print(caches.enabled())")
    env = dict(os.environ, HAIKU_BRIDGE_CACHES="0",
               PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout
    self.assertEqual(out.strip(), "False")


class ClearCachesTest(absltest.TestCase):

  def test_clears_every_cache(self):
    cache = caches.Cache("test")
    cleared = []
    caches.register(lambda: cleared.append(True))
    cache.put("k", 1)
    self.assertEqual(cache.get("k"), 1)
    hkb.clear_caches()
    self.assertIsNone(cache.get("k"))
    self.assertEqual(cleared, [True])

  def test_every_memo_of_the_package_is_registered(self):
    # A `functools.lru_cache` anywhere in the package empties with the rest.
    memos = {
        f"{name}.{attr}": value
        for name, module in list(sys.modules.items())
        if name.startswith("haiku_bridge._src.")
        for attr, value in vars(module).items()
        if callable(getattr(value, "cache_clear", None))}
    self.assertIn("haiku_bridge._src.pytree.key_spec_of", memos)
    self.assertIn("haiku_bridge._src.loop.schedule", memos)
    for name, memo in memos.items():
      with self.subTest(name):
        self.assertIn(memo.cache_clear, caches._CLEARERS)  # pylint: disable=protected-access

  def test_memoize(self):
    calls = []

    @caches.memoize(maxsize=None)
    def double(x):
      calls.append(x)
      return 2 * x

    self.assertEqual([double(1), double(1)], [2, 2])
    self.assertLen(calls, 1)
    hkb.clear_caches()
    self.assertEqual(double(1), 2)
    self.assertLen(calls, 2)
    with caches.disabled():  # Off: computed on every call, nothing kept.
      self.assertEqual([double(3), double(3)], [6, 6])
    self.assertLen(calls, 4)
    self.assertEqual(double.cache_info().currsize, 0)

  def test_lru_bound(self):
    cache = caches.Cache("small", max_entries=2)
    for key in "abc":
      cache.put(key, key)
    self.assertIsNone(cache.get("a"))
    self.assertEqual(cache.get("c"), "c")

  def test_none_key_is_never_stored(self):
    cache = caches.Cache("none")
    calls = []
    compute = lambda: calls.append(1) or 7
    self.assertEqual(cache.get_or_compute(None, compute), 7)
    self.assertEqual(cache.get_or_compute(None, compute), 7)
    self.assertLen(calls, 2)


if __name__ == "__main__":
  absltest.main()
