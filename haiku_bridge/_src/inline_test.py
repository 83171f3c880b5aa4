"""Tests for inline: a Haiku function's params made explicit, named as inline.

Each case runs the bridged call (`hkb.custom_vjp` with the true gradient, or
`hkb.get_relevant_parameters` of an `hk.Transformed`) beside the same code
inline, cold (every cache cleared) and warm, with and without an identity
custom getter. The fresh-process runs of these cases are in
testing/conformance/apply_path_test.py.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from haiku_bridge._src import inline
from testing import test_utils

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), [3, 16])


def identity_getter(next_getter, value, context):
  del context
  return next_getter(value)


def true_vjp(f, **kwargs):
  return hkb.custom_vjp(f, hkb.vjp_fwd, lambda vjp_fn, g: vjp_fn(g), **kwargs)


def widen_or_not(x):
  """Shape-dependent structure: a projection only when the width is not 8."""
  if x.shape[-1] != 8:
    x = hk.Linear(8, name="proj")(x)
  return jax.nn.relu(hk.Linear(8)(x))


def twice(block):
  def f(x):
    return block(block(x))  # Widths 16, then 8: only the first has `proj`.

  return f


def batch_norm(x, is_training):
  return hk.BatchNorm(True, True, 0.9)(x, is_training)


def run_both(test, bridged, inline_fn, *args, getter, cold, state=False):
  """Init and apply of both at `args`; asserts equal params, outputs, state."""
  wrap = lambda f: lambda *a: _with_getter(f, getter, *a)
  ours, theirs = (hk.transform_with_state(wrap(bridged)), hk.transform_with_state(wrap(inline_fn)))
  params, st = theirs.init(KEY, *args)
  if cold:
    hkb.clear_caches()
  p_ours, s_ours = ours.init(KEY, *args)
  chex.assert_trees_all_equal((p_ours, s_ours), (params, st))
  if cold:
    hkb.clear_caches()
  out = ours.apply(params, st, KEY, *args)
  chex.assert_trees_all_close(out, theirs.apply(params, st, KEY, *args), rtol=1e-6, atol=1e-6)
  del state
  return ours, theirs, params, st


def _with_getter(f, getter, *args):
  if getter:
    with hk.custom_getter(identity_getter, state=True):
      return f(*args)
  return f(*args)


CASES = [
  dict(
    testcase_name=f"{'cold' if cold else 'warm'}{'_getter' if getter else ''}",
    cold=cold,
    getter=getter,
  )
  for cold in (True, False)
  for getter in (False, True)
]


class ApplyReadsWhatApplyRunsTest(parameterized.TestCase):
  @parameterized.named_parameters(*CASES)
  def test_eval_mode_after_training(self, cold, getter):
    block = true_vjp(batch_norm, nondiff_argnums=(1,))
    x = jnp.abs(X) + 1
    ours, theirs, params, state = run_both(
      self, lambda x, t: block(x, t), batch_norm, x, True, getter=getter, cold=cold
    )
    # Eval mode reads only the moving averages, which init's trace never
    # read: apply must run as inline code runs.
    if cold:
      hkb.clear_caches()
    chex.assert_trees_all_close(
      ours.apply(params, state, None, x, False),
      theirs.apply(params, state, None, x, False),
      rtol=1e-6,
    )
    grad = lambda t: jax.grad(lambda p: jnp.sum(t.apply(p, state, None, x, False)[0]))(params)
    chex.assert_trees_all_close(grad(ours), grad(theirs), rtol=1e-5)

  @parameterized.named_parameters(*CASES)
  def test_shape_dependent_structure_at_a_new_batch_size(self, cold, getter):
    block = true_vjp(widen_or_not)
    ours, theirs, params, state = run_both(
      self, twice(block), twice(widen_or_not), X, getter=getter, cold=cold
    )
    self.assertIn("proj", params)
    self.assertNotIn("proj_1", params)
    x = jnp.ones([5, 16])
    if cold:
      hkb.clear_caches()
    chex.assert_trees_all_close(
      ours.apply(params, state, None, x), theirs.apply(params, state, None, x)
    )

  @parameterized.named_parameters(*CASES)
  def test_get_relevant_parameters_of_transformed(self, cold, getter):
    transformed = hk.transform(widen_or_not)

    def bridged(x):
      params = hkb.get_relevant_parameters(transformed, x)
      return transformed.apply(params, None, x)

    run_both(self, bridged, widen_or_not, X, getter=getter, cold=cold)
    run_both(self, bridged, widen_or_not, jnp.ones([2, 8]), getter=getter, cold=cold)

  def test_bf16_inputs_with_f32_params(self):
    mlp = lambda x: hk.nets.MLP([8, 4])(x)
    ours, theirs, params, state = run_both(self, true_vjp(mlp), mlp, X, getter=False, cold=True)
    x = X.astype(jnp.bfloat16)
    hkb.clear_caches()
    out, _ = ours.apply(params, state, None, x)
    self.assertEqual(out.dtype, jnp.float32)  # As inline: f32 params win.
    chex.assert_trees_all_equal(out, theirs.apply(params, state, None, x)[0])

  def test_init_is_never_run_at_apply(self):
    calls = []

    def counted_init(shape, dtype):
      calls.append(shape)
      return jnp.ones(shape, dtype)

    def f(x):
      return hk.Linear(4, w_init=counted_init)(x)

    block = true_vjp(f)
    g = hk.transform(lambda x: block(x))
    params = g.init(KEY, X)
    self.assertLen(calls, 1)
    hkb.clear_caches()
    jax.jit(g.apply)(params, None, X)
    jax.jit(g.apply)(params, None, jnp.ones([7, 16]))
    self.assertLen(calls, 1)

  def test_cached_reads_are_checked_against_the_stored_params(self):
    # Warm, then the stored params change dtype: the cached reads assumed
    # float32, so they are found afresh and apply runs as inline.
    block = true_vjp(widen_or_not)
    ours = hk.transform(lambda x: block(x))
    theirs = hk.transform(widen_or_not)
    params = theirs.init(KEY, X)
    ours.apply(params, None, X)
    half = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    out, expected = ours.apply(half, None, X), theirs.apply(half, None, X)
    self.assertEqual(out.dtype, expected.dtype)
    chex.assert_trees_all_equal(out, expected)


def counting_mlp(x):
  n = hk.get_state("n", [], init=jnp.zeros)
  hk.set_state("n", n + 1)
  return hk.nets.MLP([16, 16])(x) * (n + 1)


def init_outputs(f, *args):
  """What `f` returns at init (Haiku's init itself drops it)."""
  seen = []
  hk.transform_with_state(lambda *a: seen.append(f(*a))).init(KEY, *args)
  return seen[0]


class InitRunsAsInlineTest(parameterized.TestCase):
  @parameterized.parameters("twice", "hk_scan")
  def test_module_called_again_draws_no_keys(self, how):
    def net(block):
      def f(x):
        m = test_utils.Outer(block)
        if how == "twice":
          y = m(m(x))
        else:
          y = hk.scan(lambda c, _: (m(c), None), x, None, length=2)[0]
        return hk.Linear(3)(y)  # Its init key follows the block's draws.

      return f

    mlp = lambda x: hk.nets.MLP([16, 16])(x)
    run_both(self, net(true_vjp(mlp)), net(mlp), X, getter=False, cold=True)

  @parameterized.parameters(False, True)
  def test_init_outputs_of_a_stateful_function_called_twice(self, getter):
    def state_getter(next_getter, value, context):
      del context
      return next_getter(value + 10)

    def net(block):
      def f(x):
        y = block(block(x))
        return y

      if not getter:
        return f

      def with_getter(x):
        with hk.custom_getter(state_getter, params=False, state=True):
          return f(x)

      return with_getter

    bridged, inline_fn = net(true_vjp(counting_mlp)), net(counting_mlp)
    chex.assert_trees_all_close(init_outputs(bridged, X), init_outputs(inline_fn, X), rtol=1e-6)
    run_both(self, bridged, inline_fn, X, getter=False, cold=True)


def stack_with_batch_norm(x, is_training):
  """hk.lift inside (through the layer scan): params found by prefix."""
  x = hk.Linear(16)(x)
  return hkb.repeat_layer(lambda h: h + batch_norm(hk.Linear(16)(h), is_training), x, 3)


class LiftedInsideTest(parameterized.TestCase):
  """A bridged function whose own modules lift params (hk.lift, layer scans)."""

  @parameterized.named_parameters(*CASES)
  def test_layer_scan_inside_custom_vjp(self, cold, getter):
    block = true_vjp(stack_with_batch_norm, nondiff_argnums=(1,))

    def net(block):
      def f(x, is_training):
        h = hk.Linear(16)(x)
        return block(h, is_training) + hk.Linear(16)(h)  # Named after it.

      return f

    ours, theirs, params, state = run_both(
      self, net(block), net(stack_with_batch_norm), X, True, getter=getter, cold=cold
    )
    self.assertIn("linear_2", params)
    for is_training in (True, False):
      if cold:
        hkb.clear_caches()
      chex.assert_trees_all_close(
        ours.apply(params, state, KEY, X, is_training),
        theirs.apply(params, state, KEY, X, is_training),
        rtol=1e-6,
      )
      grad = lambda t, flag=is_training: jax.grad(
        lambda p: jnp.sum(t.apply(p, state, KEY, X, flag)[0])
      )(params)
      chex.assert_trees_all_close(grad(ours), grad(theirs), rtol=1e-5, atol=1e-6)


class NamesTest(absltest.TestCase):
  def test_inner_names_after_outer_modules(self):
    seen = []

    def fwd(f_pure, params, x):
      seen.append(sorted(params))
      return hkb.vjp_fwd(f_pure, params, x)

    block = hkb.custom_vjp(widen_or_not, fwd, lambda vjp_fn, g: vjp_fn(g))

    def net(x):
      x = hk.Linear(16)(x)  # Takes `linear`: the block's becomes `linear_1`.
      return block(x)

    def inline_net(x):
      return widen_or_not(hk.Linear(16)(x))

    f = hk.transform(net)
    params = f.init(KEY, X)
    chex.assert_trees_all_equal(params, hk.transform(inline_net).init(KEY, X))
    jax.grad(lambda p: jnp.sum(f.apply(p, None, X)))(params)
    # fwd sees the inner function's own names, whatever the call site.
    self.assertEqual(seen, [["linear", "proj"]])

  def test_module_created_outside_is_an_error(self):
    def net(x):
      outside = hk.Linear(4, name="inner")
      block = true_vjp(lambda x: outside(x) + hk.Linear(4, name="inner")(x))
      return block(x)

    with self.assertRaisesRegex(
      ValueError,
      r"hkb.custom_vjp: .*module 'inner', which was created "
      "outside it",
    ):
      hk.transform(net).init(KEY, X)

  def test_missing_param_names_both_paths(self):
    block = true_vjp(widen_or_not)
    f = hk.transform(lambda x: test_utils.Outer(block)(x))
    params = f.init(KEY, X)
    del params["outer/proj"]
    with self.assertRaisesRegex(
      ValueError,
      r"hkb.custom_vjp: parameter 'outer/proj/w' \(inner path "
      r"proj/w\) is missing at apply",
    ):
      f.apply(params, None, X)

  def test_wrong_shape_names_both_paths(self):
    block = true_vjp(widen_or_not)
    f = hk.transform(lambda x: test_utils.Outer(block)(x))
    params = f.init(KEY, X)
    params["outer/linear"]["w"] = jnp.zeros([8, 9])
    with self.assertRaisesRegex(
      ValueError,
      r"hkb.custom_vjp: parameter 'outer/linear/w' \(inner "
      r"path linear/w\) has shape \[8, 9\] .* asks for \[8, 8\]",
    ):
      f.apply(params, None, X)


def branchy(x, flag):
  """A structure chosen by a Python (or NumPy) flag."""
  if flag:
    return hk.Linear(8, name="on")(x)
  return hk.Linear(8, name="off")(x)


def noisy(x):
  return hk.dropout(hk.next_rng_key(), 0.5, hk.Linear(8)(x))


class ArgumentsAndKeysTest(parameterized.TestCase):
  @parameterized.parameters(True, False, np.bool_(True), np.bool_(False))
  def test_numpy_flag_in_nondiff_argnums(self, flag):
    block = true_vjp(branchy, nondiff_argnums=(1,))
    run_both(self, lambda x: block(x, flag), lambda x: branchy(x, flag), X, getter=False, cold=True)

  def test_a_block_needing_array_values_names_itself(self):
    def needs_values(x):
      return hk.Linear(8)(x) if float(x.sum()) > 0 else x

    block = true_vjp(needs_values)
    f = hk.transform(lambda x: block(x))
    params = hk.transform(needs_values).init(KEY, X)
    # Eagerly, with concrete arguments, it runs as inline.
    chex.assert_trees_all_close(
      f.apply(params, None, X), hk.transform(needs_values).apply(params, None, X)
    )
    with self.assertRaisesRegex(
      TypeError,
      r"hkb.custom_vjp: the bridged Haiku function "
      r"'.*needs_values' needs concrete values",
    ):
      jax.jit(f.apply)(params, None, X)

  def _check_keys(self, key):
    """A dropout block, both custom derivatives, against inline."""
    theirs = hk.transform(noisy)
    params = theirs.init(key, X)
    grad = lambda t: jax.grad(lambda p: jnp.sum(t.apply(p, key, X)))(params)
    for bridge in (
      true_vjp,
      lambda f: hkb.custom_jvp(f, lambda f_pure, p, t: jax.jvp(f_pure, p, t)),
    ):
      ours = hk.transform(lambda x, b=bridge: b(noisy)(x))
      chex.assert_trees_all_equal(ours.init(key, X), params)
      chex.assert_trees_all_close(ours.apply(params, key, X), theirs.apply(params, key, X))
      chex.assert_trees_all_close(grad(ours), grad(theirs), rtol=1e-5)

  @parameterized.parameters("rbg", "unsafe_rbg", "threefry2x32")
  def test_any_prng_implementation(self, impl):
    saved = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", impl)
    try:
      self._check_keys(jax.random.PRNGKey(0))
      # A block without rng, applied with none.
      ours = hk.transform(lambda x: true_vjp(widen_or_not)(x))
      params = ours.init(jax.random.PRNGKey(0), X)
      chex.assert_trees_all_close(
        ours.apply(params, None, X), hk.transform(widen_or_not).apply(params, None, X)
      )
    finally:
      jax.config.update("jax_default_prng_impl", saved)

  def test_typed_keys(self):
    self._check_keys(jax.random.key(0))


class HaikuFunctionTest(absltest.TestCase):
  def test_the_function_behind_a_transform(self):
    f = lambda x: hk.Linear(2)(x)
    self.assertIs(inline.of(hk.transform(f)).f, f)
    self.assertIs(inline.of(hk.transform_with_state(f)).f, f)
    self.assertIs(inline.of(f).f, f)

  def test_multi_transform_is_refused(self):
    multi = hk.multi_transform(lambda: ((), {"a": lambda: 1}))
    with self.assertRaisesRegex(TypeError, "hk.multi_transform result"):
      inline.haiku_function(multi)

  def test_not_a_function(self):
    with self.assertRaisesRegex(TypeError, "expected a Haiku function"):
      inline.haiku_function(3)


if __name__ == "__main__":
  absltest.main()
