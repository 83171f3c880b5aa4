"""Every Haiku mechanism inside every bridged form of a Haiku function, against inline.

A bridged Haiku function `f` is one whose params the bridge hands over as a
pytree: `hkb.custom_vjp(f, ...)`, `hkb.custom_jvp(f, ...)`,
`hkb.call_pure(pure_fn, x, init=hk.transform(f))` and
`hkb.get_relevant_parameters(hk.transform(f), x)`. The grid runs each form
over each mechanism Haiku offers inside `f` (control flow, RNN unrolls, remat,
vmap, lifting, layer stacks, a bridged block inside, `hk.running_init`
branches, rng, state), inside a module of the caller that has its own
modules before and after the block (so every inner name is numbered on from
the caller's), and compares with the same network with `f` called inline:

- init: params and state, exactly (names and values);
- apply: outputs and new state;
- grad: the gradients of a loss w.r.t. params and input (the custom rules are
  the identity rules, so the gradients must be inline's);

each cold (every cache cleared before init and apply), warm (apply run twice
after init), and under an identity `hk.custom_getter` of params and state;
and, in one fresh process per form, apply and grad on restored params (init
never ran there). Init runs eagerly; apply and grad run as one `jax.jit`
program, traced afresh on each run (a new jit each time, so cold and warm
are about the bridge's caches, not jax's), and inline's results are computed
once per (mechanism, getter). The forms that take a pure function cannot carry state or rng: those
mechanisms run in the two custom-derivative forms only (a stateful `f` is
refused as `init=`, tested in call_pure_test).

Interceptors around the block see what they see inline (`InterceptorsTest`).
"""

import dataclasses
import functools
import os
from typing import Any, Callable

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from testing import test_utils

KEY = jax.random.PRNGKey(0)
T, B, F = 3, 2, 4  # Time, batch, features: RNNs unroll over the first axis.
# Made on the CPU: a fresh process (on the CPU beside a TPU) makes the same values.
with test_utils.on_the_fresh_process_backend():
  X = jax.random.normal(jax.random.PRNGKey(1), [T, B, F])
TOL = dict(rtol=2e-5, atol=2e-6)


# ---------------------------------------------------------------------------
# The mechanisms: each a Haiku function `f(x) -> y`, y shaped like x.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mechanism:
  f: Callable[[jax.Array], jax.Array]
  stateful: bool = False  # Uses Haiku state.
  rng: bool = False  # Draws keys.
  grad: bool = True  # JAX can differentiate it in reverse mode.


def remat(x):
  return hk.remat(lambda a: jax.nn.gelu(hk.Linear(F)(a)))(x)


def cond(x):
  one, other = hk.Linear(F), hk.Linear(F, name="other")
  if hk.running_init():  # As Haiku asks: create both branches' params.
    return one(x) + other(x)
  return hk.cond(jnp.sum(x) > 0, one, lambda a: 2 * other(a), x)


def switch(x):
  branches = [hk.Linear(F), lambda a: -hk.Linear(F, name="negated")(a)]
  if hk.running_init():
    return sum(branch(x) for branch in branches)
  return hk.switch(jnp.argmax(jnp.sum(x, (0, 1))) % 2, branches, x)


def fori_loop(x):
  linear = hk.Linear(F)
  return hk.fori_loop(0, 3, lambda i, a: jnp.tanh(linear(a)), x)


def while_loop(x):
  linear = hk.Linear(F)
  if hk.running_init():  # As Haiku asks: while loops cannot init.
    return linear(x)
  return hk.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(linear(c[1]))), (0, x))[1]


def lax_map(x):
  linear = hk.Linear(F)
  return hk.map(lambda a: jnp.tanh(linear(a)), x)


def scan(x):
  linear = hk.Linear(F)
  return hk.scan(lambda c, a: (jnp.tanh(linear(c) + a), c), x[0], x)[1]


def lstm(x):
  core = hk.LSTM(F)
  return hk.dynamic_unroll(core, x, core.initial_state(B))[0]


def gru_static(x):
  core = hk.GRU(F)
  return hk.static_unroll(core, x, core.initial_state(B))[0]


def deep_rnn(x):
  core = hk.DeepRNN([hk.LSTM(F), jax.nn.relu, hk.GRU(F)])
  return hk.dynamic_unroll(core, x, core.initial_state(B))[0]


def vmap(x):
  return hk.vmap(lambda a: hk.Linear(F)(a), split_rng=False)(x)


_LIFTED = hk.transform(lambda a: hk.nets.MLP([F, F])(a))


def lift(x):
  params = hk.lift(_LIFTED.init, name="lifted")(hk.maybe_next_rng_key(), x)
  return _LIFTED.apply(params, None, x)


def transparent_lift(x):
  """The README's `by_hand`: a pure apply over transparently lifted params."""
  params = hk.transparent_lift(_LIFTED.init)(hk.maybe_next_rng_key(), x)
  return _LIFTED.apply(params, None, x)


def _residual(a):
  return a + jnp.tanh(hk.Linear(F)(a))


def layer_stack(x):
  return hk.layer_stack(2)(_residual)(x)


def layer_scan(x):
  return hkb.repeat_layer(_residual, x, 2)


_NESTED = hkb.custom_vjp(lambda a: hk.nets.MLP([F, F])(a), hkb.vjp_fwd, lambda vjp_fn, g: vjp_fn(g))


def nested(x):
  return hk.Linear(F)(_NESTED(hk.Linear(F)(x)))


def running_init(x):
  y = hk.Linear(F)(x)
  if hk.running_init():  # Made at init, never read at apply.
    hk.Linear(F, name="init_only")(x)
  return y


def dropout(x):
  return hk.dropout(hk.next_rng_key(), 0.5, hk.Linear(F)(x))


def dropout_in_scan(x):
  linear = hk.Linear(F)
  return hk.scan(lambda c, a: (c, hk.dropout(hk.next_rng_key(), 0.5, linear(a))), 0.0, x)[1]


def batch_norm(x):
  return hk.BatchNorm(True, True, 0.9)(hk.Linear(F)(x), is_training=True)


def batch_norm_in_remat(x):
  return hk.remat(lambda a: hk.BatchNorm(True, True, 0.9)(a, is_training=True))(hk.Linear(F)(x))


MECHANISMS = {
  "remat": Mechanism(remat),
  "cond": Mechanism(cond),
  "switch": Mechanism(switch),
  "fori_loop": Mechanism(fori_loop),
  # lax.while_loop has no reverse-mode derivative, inline or bridged.
  "while_loop": Mechanism(while_loop, grad=False),
  "map": Mechanism(lax_map),
  "scan": Mechanism(scan),
  "lstm_dynamic_unroll": Mechanism(lstm),
  "gru_static_unroll": Mechanism(gru_static),
  "deep_rnn": Mechanism(deep_rnn),
  "vmap": Mechanism(vmap),
  "lift": Mechanism(lift),
  "transparent_lift": Mechanism(transparent_lift),
  "layer_stack": Mechanism(layer_stack),
  "layer_scan": Mechanism(layer_scan),
  "nested_block": Mechanism(nested),
  "running_init": Mechanism(running_init),
  "dropout": Mechanism(dropout, rng=True),
  "dropout_in_scan": Mechanism(dropout_in_scan, rng=True),
  "batch_norm": Mechanism(batch_norm, stateful=True),
  "batch_norm_in_remat": Mechanism(batch_norm_in_remat, stateful=True),
}


# ---------------------------------------------------------------------------
# The bridged forms.
# ---------------------------------------------------------------------------


def true_jvp(f_pure, primals, tangents):
  return jax.jvp(f_pure, primals, tangents)


def init_transform(f):
  transformed = hk.transform(f)
  return lambda x: hkb.call_pure(lambda p, x: transformed.apply(p, None, x), x, init=transformed)


def relevant_parameters(f):
  transformed = hk.transform(f)
  return lambda x: transformed.apply(hkb.get_relevant_parameters(transformed, x), None, x)


FORMS = {
  "custom_vjp": lambda f: hkb.custom_vjp(f, hkb.vjp_fwd, lambda vjp_fn, g: vjp_fn(g)),
  "custom_jvp": lambda f: hkb.custom_jvp(f, true_jvp),
  "init_transform": init_transform,
  "get_relevant_parameters": relevant_parameters,
}
PURE_FORMS = ("init_transform", "get_relevant_parameters")


def identity_getter(next_getter, value, context):
  del context
  return next_getter(value)


class Net(hk.Module):
  """The caller: its own `linear`s before and after the block."""

  def __init__(self, block):
    super().__init__(name="net")
    self._block = block

  def __call__(self, x):
    return hk.Linear(F)(self._block(jnp.tanh(hk.Linear(F)(x))))


def network(mechanism: str, form: str, getter: bool) -> hk.TransformedWithState:
  """The network around `f`, bridged by `form` (or "inline")."""
  f = MECHANISMS[mechanism].f
  block = f if form == "inline" else FORMS[form](f)

  def net(x):
    if getter:
      with hk.custom_getter(identity_getter, state=True):
        return Net(block)(x)
    return Net(block)(x)

  return hk.transform_with_state(net)


def cases():
  for mechanism, m in MECHANISMS.items():
    for form in FORMS:
      if form in PURE_FORMS and (m.stateful or m.rng):
        continue
      yield mechanism, form


def program(f: hk.TransformedWithState, params, state, grad: bool = True) -> dict[str, Any]:
  """What apply is checked on: outputs, new state, gradients."""
  out, new_state = f.apply(params, state, KEY, X)
  results = {"out": out, "state": new_state}
  if grad:

    def loss(p, x):
      out, _ = f.apply(p, state, KEY, x)
      return jnp.sum(jnp.sin(out) * jnp.arange(F))

    results["param_grads"], results["x_grad"] = jax.grad(loss, argnums=(0, 1))(params, X)
  return results


def compiled_program(
  f: hk.TransformedWithState, params, state, grad: bool = True
) -> dict[str, Any]:
  """`program` as one jit, traced afresh: each call runs the bridge again."""
  return jax.jit(functools.partial(program, f, grad=grad))(params, state)


def computed_inline(mechanism: str, getter: bool):
  """Inline's params, state and program results."""
  inline_net = network(mechanism, "inline", getter)
  params, state = inline_net.init(KEY, X)
  return params, state, compiled_program(inline_net, params, state, MECHANISMS[mechanism].grad)


inline_results = functools.cache(computed_inline)  # Once per process.


def assert_results_close(test, got, want):
  test.assertEqual(jax.tree.structure(got), jax.tree.structure(want))
  chex.assert_trees_all_close(got, want, **TOL)


class GridTest(parameterized.TestCase):
  @parameterized.named_parameters(
    (
      f"{mechanism}_{form}_{temperature}{'_getter' if getter else ''}",
      mechanism,
      form,
      temperature,
      getter,
    )
    for mechanism, form in cases()
    for temperature in ("cold", "warm")
    for getter in (False, True)
    if not (getter and temperature == "warm")
  )
  def test_grid(self, mechanism, form, temperature, getter):
    params, state, want = inline_results(mechanism, getter)
    ours = network(mechanism, form, getter)
    if temperature == "cold":
      hkb.clear_caches()
    got_params, got_state = ours.init(KEY, X)
    chex.assert_trees_all_equal((got_params, got_state), (params, state))
    self.assertEqual(list(got_params), list(params))  # The same order too.
    grad = MECHANISMS[mechanism].grad
    for _ in range(2 if temperature == "warm" else 1):
      if temperature == "cold":
        hkb.clear_caches()
      assert_results_close(self, compiled_program(ours, params, state, grad), want)

  @parameterized.parameters(*FORMS)
  def test_fresh_process(self, form):
    """Apply and grad of every case of `form` where init never ran."""
    tmp = self.create_tempdir().full_path
    checkpoint = {}
    expected = {}
    for mechanism, case_form in cases():
      if case_form != form:
        continue
      with test_utils.on_the_fresh_process_backend():
        params, state, results = computed_inline(mechanism, False)
      name = f"{mechanism}:{form}"
      checkpoint.update(_flat((params, state), name))
      expected.update(_flat(results, name))
    in_path, out_path = (os.path.join(tmp, f) for f in ("in.npz", "out.npz"))
    np.savez(in_path, **checkpoint)
    child = test_utils.run_in_fresh_process(__file__, "run_restored", form, in_path, out_path)
    if child.returncode:
      self.fail(f"the fresh process failed:\n{child.stderr[-4000:]}")
    with np.load(out_path) as results:
      actual = dict(results)
    self.assertEqual(sorted(actual), sorted(expected))
    for key, value in expected.items():
      np.testing.assert_allclose(actual[key], value, err_msg=key, **TOL)


def _flat(tree, prefix: str) -> dict[str, np.ndarray]:
  return {
    prefix + jax.tree_util.keystr(path): np.asarray(leaf)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
  }


def run_restored(form: str, in_path: str, out_path: str) -> None:
  """The fresh process: every case of `form` applied on restored params."""
  with np.load(in_path) as saved:
    saved = dict(saved)
  results = {}
  for mechanism, case_form in cases():
    if case_form != form:
      continue
    name = f"{mechanism}:{form}"
    inline_net = network(mechanism, "inline", False)
    # The structure of params and state, from an abstract init of the
    # inline network: nothing of the bridged one runs before its apply.
    shapes = jax.eval_shape(inline_net.init, KEY, X)
    leaves = [
      jnp.asarray(saved[name + jax.tree_util.keystr(path)])
      for path, _ in jax.tree_util.tree_leaves_with_path(shapes)
    ]
    params, state = jax.tree.structure(shapes).unflatten(leaves)
    results.update(
      _flat(
        compiled_program(
          network(mechanism, form, False), params, state, MECHANISMS[mechanism].grad
        ),
        name,
      )
    )
  np.savez(out_path, **results)


# ---------------------------------------------------------------------------
# Interceptors around the block.
# ---------------------------------------------------------------------------


def orthogonal_w(next_creator, shape, dtype, init, context):
  if context.full_name.endswith("/w"):
    init = hk.initializers.Orthogonal()
  return next_creator(shape, dtype, init)


def bf16_creator(next_creator, shape, dtype, init, context):
  del context
  return next_creator(shape, jnp.bfloat16, init)


def round_to_bf16(next_getter, value, context):
  del context
  return next_getter(value).astype(jnp.bfloat16).astype(jnp.float32)


def to_original_dtype(next_getter, value, context):
  return next_getter(value).astype(context.original_dtype)


def bn_block(x):
  return hk.BatchNorm(True, True, 0.9)(hk.Linear(F)(x), is_training=True)


def counted_state_block(x):
  n = hk.get_state("n", [], init=jnp.zeros)
  hk.set_state("n", n + 1)
  return hk.Linear(F)(x) * (n + 1)


def plus_one(next_getter, value, context):
  del context
  return next_getter(value) + 1


def doubled(next_setter, value, context):
  del context
  return next_setter(2 * value)


class InterceptorsTest(parameterized.TestCase):
  """Interceptors around a bridged block see and do what they do inline."""

  def _compare(self, f, form, around, x=X, check_out_dtype=False):
    def net(block):
      def fn(x):
        h = hk.Linear(F)(x)
        with around():
          y = block(h)
        return hk.Linear(F)(y.astype(jnp.float32)), y.dtype

      return fn

    ours = hk.transform_with_state(net(FORMS[form](f)))
    theirs = hk.transform_with_state(net(f))
    hkb.clear_caches()
    params, state = theirs.init(KEY, x)
    chex.assert_trees_all_equal(ours.init(KEY, x), (params, state))
    (out, dtype), new_state = ours.apply(params, state, KEY, x)
    (want, want_dtype), want_state = theirs.apply(params, state, KEY, x)
    if check_out_dtype:
      self.assertEqual(dtype, want_dtype)
    chex.assert_trees_all_close((out, new_state), (want, want_state), **TOL)

  @parameterized.parameters(*FORMS)
  def test_creator_swapping_the_initializer(self, form):
    self._compare(lambda x: hk.nets.MLP([F, F])(x), form, lambda: hk.custom_creator(orthogonal_w))

  @parameterized.parameters(*FORMS)
  def test_creator_asking_bfloat16(self, form):
    self._compare(lambda x: hk.nets.MLP([F, F])(x), form, lambda: hk.custom_creator(bf16_creator))

  @parameterized.parameters("custom_vjp", "custom_jvp")
  def test_getter_rounding_params_before_batch_norm(self, form):
    # The init state is computed from the rounded params, as inline.
    self._compare(bn_block, form, lambda: hk.custom_getter(round_to_bf16))

  @parameterized.parameters("custom_vjp", "custom_jvp")
  def test_getter_casting_to_the_original_dtype(self, form):
    # hk.Linear asks for params of its input's dtype: bf16 here.
    self._compare(
      lambda x: hk.nets.MLP([F, F])(x),
      form,
      lambda: hk.custom_getter(to_original_dtype),
      x=X.astype(jnp.bfloat16),
      check_out_dtype=True,
    )

  @parameterized.parameters("custom_vjp", "custom_jvp")
  def test_state_getter_and_setter(self, form):
    def around():
      getter = hk.custom_getter(plus_one, params=False, state=True)
      setter = hk.custom_setter(doubled)

      class Both:
        def __enter__(self):
          getter.__enter__()
          setter.__enter__()

        def __exit__(self, *exc):
          setter.__exit__(*exc)
          getter.__exit__(*exc)

      return Both()

    self._compare(counted_state_block, form, around)

  @parameterized.named_parameters(
    ("custom_vjp", lambda f: hkb.custom_vjp(f, hkb.vjp_fwd, lambda vjp_fn, g: vjp_fn(g))),
    (
      "custom_vjp_own_fwd",
      lambda f: hkb.custom_vjp(
        f, lambda f_pure, p, x: (f_pure(p, x), None), lambda res, g: (None, None)
      ),
    ),
    ("custom_jvp", lambda f: hkb.custom_jvp(f, run_once_jvp)),
  )
  def test_getter_contexts(self, bridge):
    # Rules that run `f` once, as inline code does: the bridge adds no run
    # of its own, so a getter sees each read once, with inline's context.
    seen = {"ours": [], "theirs": []}

    def recording(who):
      def getter(next_getter, value, context):
        seen[who].append(
          (
            context.full_name,
            context.module.module_name,
            tuple(context.original_shape),
            jnp.dtype(context.original_dtype).name,
            hk.running_init(),
          )
        )
        return next_getter(value)

      return getter

    f = lambda x: hk.nets.MLP([F, F])(x)
    for who, block in (("ours", bridge(f)), ("theirs", f)):

      def fn(x, block=block, who=who):
        with hk.custom_getter(recording(who)):
          return Net(block)(x)

      transformed = hk.transform(fn)
      params = transformed.init(KEY, X)
      jax.grad(lambda p, t=transformed: jnp.sum(t.apply(p, KEY, X)))(params)
    self.assertEqual(seen["ours"], seen["theirs"])


def run_once_jvp(f_pure, primals, tangents):
  """A rule that runs `f` once: its output, and a zero tangent."""
  del tangents
  out = f_pure(*primals)
  return out, jax.tree.map(jnp.zeros_like, out)


if __name__ == "__main__":
  absltest.main()
