"""Tests for key_path: the structure of `init`'s params at apply, cached or not.

A cache never changes a result: each case runs cold (caches cleared), warm,
after what it depends on changed, and with caches off
(`caches.disabled()`), and must give what inline reasoning gives: the params
that init made for the same inputs, read back.
"""

import contextlib
import os
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from haiku_bridge._src import caches
from haiku_bridge._src import naming
from haiku_bridge._src import pytree
from testing import test_utils

KEY = jax.random.PRNGKey(0)
X = jnp.ones([2, 3])

WIDTH = 4  # Read by `init_reading_a_global`; a test changes it.


def matmul(params, x):
  return x @ params["w"]


def init_sized_by(rng, x, n):
  return {"w": jax.random.normal(rng, [x.shape[-1], int(n)])}


def init_reading_a_global(rng, x):
  return {"w": jax.random.normal(rng, [x.shape[-1], WIDTH])}


def init_seeding_numpy(rng, x):
  seed = int(np.asarray(rng).ravel()[0])
  w = np.random.default_rng(seed).normal(size=[x.shape[-1], 4])
  return {"w": jnp.asarray(w, jnp.float32)}


def init_per_row(rng, x):
  """Params whose structure follows the batch size: one layer per row."""
  keys = jax.random.split(rng, x.shape[0])
  return [{"w": jax.random.normal(k, [x.shape[-1]])} for k in keys]


def per_row(params, x):
  return jnp.stack([x[i] @ p["w"] for i, p in enumerate(params)])


def run(init, *args, **kwargs):
  """Init and apply of `call_pure(matmul, X, *args, init=init, **kwargs)`."""
  f = hk.transform(
    lambda x, *a: hkb.call_pure(lambda p, x, *_, **__: matmul(p, x), x, *a, init=init, **kwargs)
  )
  params = f.init(KEY, X, *args)
  return params, f.apply(params, None, X, *args)


def temperature_context(temperature):
  """The caches as `temperature` says: cleared now, kept, or off."""
  if temperature == "off":
    return caches.disabled()
  if temperature == "cold":
    hkb.clear_caches()
  return contextlib.nullcontext()


def run_child(test, function, path):
  """stdout of `function(path)` of this file in a new Python process."""
  child = test_utils.run_in_fresh_process(__file__, function, path)
  test.assertEqual(child.returncode, 0, child.stderr[-3000:])
  return child.stdout


TEMPERATURES = (("cold", "cold"), ("warm", "warm"), ("off", "off"))


class StructureTest(parameterized.TestCase):
  def _apply(self, temperature, init, *args, **kwargs):
    with temperature_context(temperature):
      return run(init, *args, **kwargs)

  @parameterized.named_parameters(*TEMPERATURES)
  def test_size_in_an_argument(self, temperature):
    # A NumPy scalar is static (as inline code sees it); a keyword's value is
    # part of the signature too; a NumPy array's is read from its value, so
    # that structure is never kept.
    for wrap in (np.int64, np.int32, lambda n: {"n": n}, np.array):
      for n in (4, 5, 4):
        size = wrap(n)
        args, kwargs = ((), size) if isinstance(size, dict) else ((size,), {})
        params, out = self._apply(temperature, init_sized_by, *args, **kwargs)
        np.testing.assert_allclose(out, X @ params["~"]["w"], rtol=1e-6)
        self.assertEqual(out.shape, (2, n))

  @parameterized.named_parameters(*TEMPERATURES)
  def test_a_structure_that_follows_the_key(self, temperature):
    # The key's spec is part of the signature: an init whose params follow
    # it is shaped afresh for a key of another implementation.
    init = lambda rng, x: {"w": jnp.zeros([x.shape[-1], jnp.size(rng)])}
    f = hk.transform(lambda x: hkb.call_pure(matmul, x, init=init))
    for impl in ("threefry2x32", "rbg", "threefry2x32"):
      with jax.default_prng_impl(impl):
        key = jax.random.PRNGKey(0)
        params = f.init(key, X)
        with temperature_context(temperature):
          out = f.apply(params, key, X)
        self.assertEqual(out.shape, (2, key.size))

  @parameterized.named_parameters(*TEMPERATURES)
  def test_a_structure_that_follows_x64(self, temperature):
    # Whether x64 is on is part of the signature: an init whose params follow
    # the default float's width is shaped afresh when it changes.
    init = lambda rng, x: {"w": jnp.zeros([x.shape[-1], jnp.asarray(1.0).dtype.itemsize])}
    f = hk.transform(lambda x: hkb.call_pure(matmul, x, init=init))
    for x64 in (False, True, False):
      with jax.enable_x64(x64):
        params = f.init(KEY, X)
        with temperature_context(temperature):
          out = f.apply(params, None, X)
        self.assertEqual(out.shape, (2, 8 if x64 else 4))

  @parameterized.named_parameters(*TEMPERATURES)
  def test_numpy_integer_and_bool_scalars_as_inline(self, temperature):
    # Issue 27, row 4: a size in np.int64 used as a shape failed at apply
    # (traced by eval_shape); inline Haiku takes it as the Python value.
    def init(rng, x, n, bias):
      params = {"w": jax.random.normal(rng, [x.shape[-1], n])}
      if bias:
        params["b"] = jnp.ones([n])
      return params

    def inline(x, n, bias):
      return hk.Linear(n, with_bias=bool(bias), b_init=jnp.ones)(x)

    def pure(params, x, n, bias):
      del n, bias  # In the params' structure.
      return x @ params["w"] + params.get("b", 0.0)

    ours = hk.transform(
      lambda x, n, bias: hkb.call_pure(pure, x, n, bias, init=init, name="linear")
    )
    theirs = hk.transform(inline)
    for n, bias in (
      (np.int64(7), np.bool_(True)),
      (np.int32(5), np.True_),
      (np.int64(7), np.bool_(False)),
      (7, True),
    ):
      params = theirs.init(KEY, X, n, bias)
      with temperature_context(temperature):
        self.assertEqual(
          test_utils.param_shapes(ours.init(KEY, X, n, bias)), test_utils.param_shapes(params)
        )
        np.testing.assert_allclose(
          ours.apply(params, None, X, n, bias), theirs.apply(params, None, X, n, bias), rtol=1e-6
        )

  @parameterized.named_parameters(*TEMPERATURES)
  def test_a_global_that_changed(self, temperature):
    global WIDTH
    try:
      for WIDTH in (4, 5, 4):
        params, out = self._apply(temperature, init_reading_a_global)
        self.assertEqual(out.shape, (2, WIDTH))
        np.testing.assert_allclose(out, X @ params["~"]["w"], rtol=1e-6)
    finally:
      WIDTH = 4

  @parameterized.named_parameters(*TEMPERATURES)
  def test_a_closure_that_changed(self, temperature):
    width = 4

    def init(rng, x):
      return {"w": jax.random.normal(rng, [x.shape[-1], width])}

    for width in (4, 6):  # pylint: disable=redefined-outer-name
      _, out = self._apply(temperature, init)
      self.assertEqual(out.shape, (2, width))

  @parameterized.named_parameters(*TEMPERATURES)
  def test_numpy_seeded_from_the_key(self, temperature):
    params, out = self._apply(temperature, init_seeding_numpy)
    np.testing.assert_allclose(out, X @ params["~"]["w"], rtol=1e-6)

  def test_numpy_seeded_from_the_key_in_a_fresh_process(self):
    params, expected = run(init_seeding_numpy)
    path = os.path.join(self.create_tempdir().full_path, "w.npy")
    np.save(path, np.asarray(params["~"]["w"]))
    stdout = run_child(self, "child_numpy_seeded", path)
    np.testing.assert_allclose(
      np.array(stdout.split(), np.float32), np.asarray(expected).ravel(), rtol=1e-6
    )

  def test_values_needed_under_jit_name_the_cause(self):
    f = hk.transform(
      lambda x, n: hkb.call_pure(lambda p, x, n: matmul(p, x), x, n, init=init_sized_by)
    )
    params = f.init(KEY, X, 4)
    with self.assertRaisesRegex(
      TypeError,
      r"hkb.call_pure: `init` needs concrete values .* under a "
      "JAX transform",
    ):
      jax.jit(f.apply)(params, None, X, jnp.int32(4))


class ApplyTraceTest(parameterized.TestCase):
  """What tracing apply runs of `init`: once per signature, never on a re-trace.

  The structure of a pure function's params comes from its `init`, and only
  from it: the params apply is given may hold more, less or other shapes, and
  then the call must fail (or read a part) as it would for the inputs given.
  So it is shaped by `jax.eval_shape` once per exact argument signature, and
  a new batch size is a new signature.
  """

  def setUp(self):
    super().setUp()
    # The default key's spec is shaped once per process too (`pytree`): not
    # what these tests count.
    pytree.default_key_spec()

  def _eval_shapes_in_trace(self, apply, *args):
    with mock.patch.object(jax, "eval_shape", wraps=jax.eval_shape) as spy:
      jax.jit(lambda *a: apply(*a)).trace(*args)
    return spy.call_count

  @parameterized.named_parameters(("plain", False), ("identity_getter", True))
  def test_shaped_once_per_signature_and_read_by_the_same_names(self, getter):
    seen = []

    def record(next_getter, value, context):
      seen.append(context.full_name)
      return next_getter(value)

    def net(x):
      with hk.custom_getter(record) if getter else contextlib.nullcontext():
        return hkb.call_pure(per_row, x, init=init_per_row, name="net")

    f = hk.transform(net)
    params = f.init(KEY, X)
    init_names, seen[:] = list(seen), []
    hkb.clear_caches()
    # What is counted is `init`'s shaping: the PRNG's key shape (a memo of
    # its own, also cleared, found by an `eval_shape` too) is known first.
    pytree.default_key_spec()
    counts = [self._eval_shapes_in_trace(f.apply, params, None, X) for _ in range(2)]
    self.assertEqual(counts, [1, 0 if caches.enabled() else 1])
    self.assertEqual(self._eval_shapes_in_trace(f.apply, params, None, X[:1]), 1)
    expected = ["net/layer_0/w", "net/layer_1/w"] if getter else []
    self.assertEqual(init_names, expected)
    self.assertEqual(seen, expected * 2 + expected[:1])

  @parameterized.named_parameters(("plain", False), ("identity_getter", True))
  def test_an_init_reading_a_set_is_shaped_once_and_again_when_it_changes(self, getter):
    # A set of names in `init`'s closure keys its structure by its contents
    # (it was unkeyable: shaped afresh at every trace).
    names = {"b", "a"}

    def init(rng, x):
      return {
        n: jax.random.normal(jax.random.fold_in(rng, i), [x.shape[-1]])
        for i, n in enumerate(sorted(names))
      }

    def apply(params, x):
      return sum(x @ params[n] for n in sorted(names))

    def net(x):
      with (
        hk.custom_getter(lambda next_getter, value, context: next_getter(value))
        if getter
        else contextlib.nullcontext()
      ):
        return hkb.call_pure(apply, x, init=init, name="net")

    f = hk.transform(net)
    for more in ((), ("c",)):
      names.update(more)
      params = f.init(KEY, X)
      with caches.disabled():
        expected = f.init(KEY, X)
      chex.assert_trees_all_equal(params, expected)
      hkb.clear_caches()
      pytree.default_key_spec()  # Shaped once per process: not counted.
      counts = [self._eval_shapes_in_trace(f.apply, params, None, X) for _ in range(2)]
      self.assertEqual(counts, [1, 0 if caches.enabled() else 1])
      np.testing.assert_allclose(
        f.apply(params, None, X), sum(X @ w for w in jax.tree.leaves(expected)), rtol=1e-6
      )
    # The names changed after a warm trace: shaped again, not taken from
    # the cache (a key by the set's identity would read two params of three).
    names.discard("a")
    params = f.init(KEY, X)
    self.assertEqual(self._eval_shapes_in_trace(f.apply, params, None, X), 1)
    self.assertLen(jax.tree.leaves(params), 2)

  def test_a_warm_retrace_names_no_leaf_again(self):
    # The key-path names are kept with the structure; the module names are
    # still allocated at each call (call_pure_test: a bundle never shares an
    # inline module's name, whichever ran first, warm or cold).
    f = hk.transform(lambda x: hkb.call_pure(per_row, x, init=init_per_row))
    params = f.init(KEY, X)
    f.apply(params, None, X)
    with mock.patch.object(naming, "key_path_groups", wraps=naming.key_path_groups) as spy:
      jax.jit(lambda p, x: f.apply(p, None, x)).trace(params, X)
    self.assertEqual(spy.call_count, 0 if caches.enabled() else 1)

  @parameterized.named_parameters(*TEMPERATURES)
  def test_a_new_batch_size_is_shaped_afresh(self, temperature):
    # A structure taken from another signature (or from the params given)
    # would read both rows' params for one row, or miss the third.
    f = hk.transform(lambda x: hkb.call_pure(per_row, x, init=init_per_row))
    params = f.init(KEY, X)
    w = [params[f"layer_{i}"]["w"] for i in range(2)]
    context = caches.disabled() if temperature == "off" else contextlib.nullcontext()
    with context:
      if temperature == "cold":
        hkb.clear_caches()
      np.testing.assert_allclose(
        f.apply(params, None, X), jnp.stack([X[0] @ w[0], X[1] @ w[1]]), rtol=1e-6
      )
      if temperature == "cold":
        hkb.clear_caches()
      np.testing.assert_allclose(f.apply(params, None, X[:1]), (X[0] @ w[0])[None], rtol=1e-6)
      if temperature == "cold":
        hkb.clear_caches()
      with self.assertRaisesRegex(
        ValueError,
        r"parameter 'layer_2/w' \(params path \[2\]\['w'\]\) "
        "is missing at apply",
      ):
        f.apply(params, None, jnp.ones([3, 3]))

  def test_a_fresh_process_shapes_init_once_and_reads_it_back(self):
    f = hk.transform(lambda x: hkb.call_pure(per_row, x, init=init_per_row))
    params = f.init(KEY, X)
    path = os.path.join(self.create_tempdir().full_path, "params.npz")
    np.savez(path, *(params[f"layer_{i}"]["w"] for i in range(2)))
    counts, out = run_child(self, "child_fresh_apply", path).strip().splitlines()
    self.assertEqual(counts.split(), ["1", "0" if caches.enabled() else "1"])
    np.testing.assert_allclose(
      np.array(out.split(), np.float32),
      np.asarray(jnp.stack([X[0] @ params["layer_0"]["w"], X[1] @ params["layer_1"]["w"]])).ravel(),
      rtol=1e-6,
    )


class KeysTest(parameterized.TestCase):
  def _check(self, key, apply_key):
    def init(rng, x):
      return {"w": jax.random.normal(rng, [x.shape[-1], 4])}

    f = hk.transform(lambda x: hkb.call_pure(matmul, x, init=init))
    params = f.init(key, X)
    hkb.clear_caches()
    np.testing.assert_allclose(f.apply(params, apply_key, X), X @ params["~"]["w"], rtol=1e-6)

  @parameterized.parameters("rbg", "unsafe_rbg", "threefry2x32")
  def test_any_prng_implementation(self, impl):
    saved = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", impl)
    try:
      self._check(jax.random.PRNGKey(0), None)
      self._check(jax.random.PRNGKey(0), jax.random.PRNGKey(1))
    finally:
      jax.config.update("jax_default_prng_impl", saved)

  def test_typed_keys(self):
    self._check(jax.random.key(0), None)
    self._check(jax.random.key(0), jax.random.key(1))


# Run by `test_utils.run_in_fresh_process`: in a new process, init never ran.


def child_numpy_seeded(path):
  """Prints apply's output on the params saved at `path`."""
  f = hk.transform(lambda x: hkb.call_pure(matmul, x, init=init_seeding_numpy))
  params = {"~": {"w": jnp.asarray(np.load(path))}}
  print(" ".join(map(str, np.asarray(f.apply(params, None, X)).ravel())))


def child_fresh_apply(path):
  """Restores params and traces apply twice; prints the eval_shape calls of
  each trace, then the output."""
  f = hk.transform(lambda x: hkb.call_pure(per_row, x, init=init_per_row))
  with np.load(path) as data:
    params = {f"layer_{i}": {"w": jnp.asarray(data[f"arr_{i}"])} for i in range(2)}
  # The default key's spec is shaped once per process too (`pytree`): not
  # what is counted here.
  pytree.default_key_spec()
  counts = []
  for _ in range(2):
    with mock.patch.object(jax, "eval_shape", wraps=jax.eval_shape) as spy:
      jax.jit(lambda p, x: f.apply(p, None, x)).trace(params, X)
    counts.append(spy.call_count)
  print(*counts)
  print(" ".join(map(str, np.asarray(f.apply(params, None, X)).ravel())))


if __name__ == "__main__":
  absltest.main()
