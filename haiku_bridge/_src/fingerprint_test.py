"""Tests for fingerprint: a key holds everything a function's result depends on."""

import dataclasses
import functools
import types

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import fingerprint


class SignatureTest(absltest.TestCase):
  def test_full_shapes_not_ranks(self):
    self.assertNotEqual(
      fingerprint.signature(jnp.ones([2, 3])), fingerprint.signature(jnp.ones([4, 3]))
    )

  def test_dtype_and_weak_type(self):
    self.assertNotEqual(
      fingerprint.signature(jnp.ones([2])), fingerprint.signature(jnp.ones([2], jnp.bfloat16))
    )
    self.assertNotEqual(
      fingerprint.signature(jnp.asarray(1.0)),
      fingerprint.signature(jnp.float32(1.0) * jnp.ones([])),
    )

  def test_values_of_python_arguments(self):
    self.assertNotEqual(fingerprint.signature(True), fingerprint.signature(False))
    self.assertEqual(
      fingerprint.signature(jnp.ones([2]), True), fingerprint.signature(jnp.zeros([2]), True)
    )

  def test_numpy_integer_and_bool_scalars_by_value(self):
    # Python values to the bridge, as to inline code (pytree.split_arrays).
    self.assertNotEqual(fingerprint.signature(np.int64(7)), fingerprint.signature(np.int64(8)))
    self.assertNotEqual(
      fingerprint.signature(np.bool_(True)), fingerprint.signature(np.bool_(False))
    )
    self.assertNotEqual(fingerprint.signature(np.int64(7)), fingerprint.signature(7))
    self.assertEqual(fingerprint.signature(np.float32(1.0)), fingerprint.signature(np.float32(2.0)))

  def test_numpy_and_jax_arrays_and_specs_agree(self):
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    self.assertEqual(
      fingerprint.signature(np.ones([2], np.float32)), fingerprint.signature(jnp.ones([2]))
    )
    self.assertEqual(fingerprint.signature(spec), fingerprint.signature(jnp.ones([2])))

  def test_prng_implementations_differ(self):
    # Typed keys of two implementations: same shape, other bits.
    self.assertNotEqual(
      fingerprint.signature(jax.random.key(0)), fingerprint.signature(jax.random.key(0, impl="rbg"))
    )
    self.assertEqual(
      fingerprint.signature(jax.random.key(0)), fingerprint.signature(jax.random.key(1))
    )

  def test_unhashable_gives_none(self):
    self.assertIsNone(fingerprint.signature([{1, 2}]))
    self.assertIsNone(fingerprint.function_key(lambda: None, [{1}]))
    unhashable = type(
      "Unhashable", (), {"__eq__": lambda a, b: True, "__call__": lambda self: None}
    )()
    self.assertIsNone(fingerprint.function_key(unhashable, 1))


SIZE = 3  # Read by `reads_a_global`.


def reads_a_global():
  return SIZE


def calls_a_helper():
  return reads_a_global() + 1


def reads_a_global_in_a_nested_function():
  return (lambda: SIZE)()


@dataclasses.dataclass
class Scale:
  factor: int

  def __call__(self, x):
    return x * self.factor


class Sized:
  @property
  def size(self):
    return SIZE


class FingerprintTest(absltest.TestCase):
  def test_globals_read_directly_and_through_helpers(self):
    global SIZE
    before = [fingerprint.fingerprint(f) for f in (reads_a_global, calls_a_helper)]
    try:
      SIZE = 4
      after = [fingerprint.fingerprint(f) for f in (reads_a_global, calls_a_helper)]
    finally:
      SIZE = 3
    self.assertNotEqual(before[0], after[0])
    self.assertNotEqual(before[1], after[1])
    self.assertEqual(before, [fingerprint.fingerprint(f) for f in (reads_a_global, calls_a_helper)])

  def test_a_global_read_by_nested_code(self):
    global SIZE
    f = reads_a_global_in_a_nested_function
    before = fingerprint.fingerprint(f)
    try:
      SIZE = 4
      self.assertEqual(f(), 4)
      self.assertNotEqual(fingerprint.fingerprint(f), before)
    finally:
      SIZE = 3

  def test_a_property_by_what_it_reads(self):
    global SIZE
    before = fingerprint.fingerprint(Sized)
    try:
      SIZE = 4
      self.assertEqual(Sized().size, 4)
      self.assertNotEqual(fingerprint.fingerprint(Sized), before)
    finally:
      SIZE = 3
    self.assertEqual(fingerprint.fingerprint(Sized), before)

  def test_functions_that_behave_differently_differ(self):
    # Each pair: same code, other results; each function made afresh twice
    # keys the same (a cache hit).
    def keyword_default(width):
      def f(x, *, n=width):
        return x * n

      return f

    def closes_over(c):
      return lambda: isinstance(c, list)

    pairs = {
      "keyword-only default": lambda v: keyword_default(v),
      "partial's keyword": lambda v: functools.partial(lambda x, n: x * n, n=v),
      "bound method's object": lambda v: Scale(v).__call__,
      "dataclass field": lambda v: Scale(v),
      "array in a closure": lambda v: (lambda a: lambda x: x * a)(np.array([1, v])),
      "list or tuple": lambda v: closes_over([1] if v == 2 else (1,)),
    }
    for name, make in pairs.items():
      with self.subTest(name):
        f2, f3 = make(2), make(3)
        args = () if name == "list or tuple" else (np.ones(2),)
        self.assertFalse(np.array_equal(f2(*args), f3(*args)))
        self.assertNotEqual(fingerprint.fingerprint(f2), fingerprint.fingerprint(f3))
        self.assertEqual(fingerprint.fingerprint(f2), fingerprint.fingerprint(make(2)))

  def test_closure_cells_and_defaults(self):
    sizes = [1]

    def f(x=2):
      return sizes, x

    first = fingerprint.fingerprint(f)
    sizes.append(2)  # Mutated in place: keyed by contents.
    self.assertNotEqual(fingerprint.fingerprint(f), first)
    f.__defaults__ = (3,)
    self.assertNotEqual(fingerprint.fingerprint(f), first)

  def test_partials_and_dataclass_fields(self):
    g = lambda n: n
    self.assertNotEqual(
      fingerprint.fingerprint(functools.partial(g, 1)),
      fingerprint.fingerprint(functools.partial(g, 2)),
    )
    self.assertEqual(
      fingerprint.fingerprint(functools.partial(g, 1)),
      fingerprint.fingerprint(functools.partial(g, 1)),
    )

  def test_a_class_by_its_own_methods_and_values(self):
    global SIZE

    class Base:
      scale = 2

    class Model(Base):
      def __init__(self):
        self.size = reads_a_global()

    before = [
      fingerprint.fingerprint(f) for f in (Model, lambda: Model(), functools.partial(Model))
    ]
    try:
      SIZE = 4
      after = [
        fingerprint.fingerprint(f) for f in (Model, lambda: Model(), functools.partial(Model))
      ]
    finally:
      SIZE = 3
    self.assertTrue(all(b != a for b, a in zip(before, after)))
    Base.scale = 3
    self.assertNotEqual(fingerprint.fingerprint(Model), before[0])
    Base.scale = 2
    self.assertEqual(fingerprint.fingerprint(Model), before[0])

  def test_attributes_of_your_module_that_the_code_names(self):
    # `config.WIDTH`, `config.SIZES["a"]`: a config module of yours.
    config = types.ModuleType("a_config_of_yours")
    config.WIDTH, config.SIZES = 4, {"a": 1}
    namespace = {"config": config}
    code = "def f():\n  return config.WIDTH, config.SIZES['a']"
    exec(code, namespace)  # pylint: disable=exec-used
    f = namespace["f"]
    before = fingerprint.fingerprint(f)
    config.WIDTH = 5
    self.assertNotEqual(fingerprint.fingerprint(f), before)
    config.WIDTH = 4
    config.SIZES["a"] = 2
    self.assertNotEqual(fingerprint.fingerprint(f), before)
    config.SIZES["a"] = 1
    config.UNREAD = 3
    self.assertEqual(fingerprint.fingerprint(f), before)

  def test_an_installed_class_by_identity(self):
    # An installed package's code cannot change while the process runs.
    # pylint: disable=protected-access
    self.assertIs(fingerprint._freeze_class(np.ndarray, 3), np.ndarray)
    self.assertIsNot(fingerprint._freeze_class(FingerprintTest, 3), FingerprintTest)

  def test_a_dataclass_config_is_keyed_by_its_fields(self):
    # Until now every dataclass was unkeyable (its `__repr__`'s closure holds
    # a set): a function reading a config dataclass was never cached.
    global CONFIG
    # CONFIG: a module global, set below and deleted after (pyflakes sees no definition).
    f = lambda x: x * CONFIG.factor  # noqa: F821
    try:
      CONFIG = Scale(2)
      key = fingerprint.function_key(f, 1)
      self.assertIsNotNone(key)
      CONFIG = Scale(3)
      self.assertNotEqual(fingerprint.function_key(f, 1), key)
      CONFIG = Scale(2)  # Made afresh, equal fields: the same key.
      self.assertEqual(fingerprint.function_key(f, 1), key)
    finally:
      del CONFIG

  def test_a_set_is_keyed_by_its_contents(self):
    # As a list or a dict is; it was unkeyable (no key: never cached).
    names = {"w", "b"}
    f = lambda: sorted(names)
    key = fingerprint.function_key(f)
    self.assertIsNotNone(key)
    names = {"b", "w"}  # Made afresh, another order: the same key.
    self.assertEqual(fingerprint.function_key(f), key)
    names.add("scale")
    self.assertNotEqual(fingerprint.function_key(f), key)
    names = frozenset({"w", "b"})
    self.assertIsNotNone(fingerprint.function_key(f))
    self.assertNotEqual(fingerprint.function_key(f), key)
    names = {"w", (1, 2)}  # Elements of any hashable kind.
    self.assertIsNotNone(fingerprint.function_key(f))

  def test_large_or_traced_values_cannot_be_keyed(self):
    big = np.zeros([4096])
    self.assertIsNone(fingerprint.function_key(lambda: big))
    self.assertIsNotNone(fingerprint.function_key(lambda: np.zeros([3])))


if __name__ == "__main__":
  absltest.main()
