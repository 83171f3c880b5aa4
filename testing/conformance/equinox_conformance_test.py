"""Conformance with Equinox's own tests (`test_nn.py`, `test_stateful.py`, `test_shared.py`).

Each case's models run twice with the same weights: natively (the peer) and
through `hkb.from_equinox` inside Haiku (the model instance, its
`eqx.nn.State` as Haiku state). Outputs, new state and the gradient of a loss
with respect to every weight must agree; where Equinox raises, the adapter
raises the same error. Models that see one example run under `hk.vmap`
(named axes for batch norm) natively under `jax.vmap`. Sizes are small (CI
has two cores): the cases are Equinox's, not its sizes. Differences by design
are listed with their reasons; a case neither ported nor listed fails
`test_every_equinox_case_is_covered` (the cases: `peer_cases.EQUINOX`).
"""

import contextlib
import functools
from typing import Any, Optional
import warnings

from absl.testing import absltest
import chex
import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import haiku_bridge as hkb
from testing.conformance import peer_cases

NOT_APPLICABLE = {
  "test_dot_product_attention_weights": (
    "a private function of Equinox (`_attention.dot_product_attention_"
    "weights`), no module: MultiheadAttention's cases run it"
  ),
  "test_dot_product_attention": "as test_dot_product_attention_weights",
  "test_rope_embeddings_freqs_cis": (
    "a static method of RotaryPositionalEmbedding on its own: the "
    "module's cases (shapes, values) run it inside the module"
  ),
  "test_mismatched_structure": (
    "eqx.nn.Shared refusing two nodes of different structure when it is "
    "built; the adapter's part, the same error from a constructor, is "
    "test_mismatched_structure_at_construction"
  ),
}
BY_DESIGN = {
  "nested vmap state": (
    "test_batch_norm vmaps the model over a second axis with the state "
    "broadcast in and batched out; Haiku state has no per-example axis "
    "under hk.vmap, so that step of the case is left out"
  ),
}


def keys(seed: int = 0):
  key = jr.PRNGKey(seed)
  while True:
    key, sub = jr.split(key)
    yield sub


def haiku_name(path) -> tuple[str, str]:
  """The documented rule: fields and keys by name, an index joined on."""
  parts = []
  for entry in path:
    if isinstance(entry, jax.tree_util.SequenceKey):
      parts.append(f"{parts.pop()}_{entry.idx}" if parts else f"layer_{entry.idx}")
    else:
      parts.append(str(getattr(entry, "name", getattr(entry, "key", entry))))
  return "/".join(["m"] + parts[:-1]), parts[-1]


def as_haiku(tree) -> dict[str, dict[str, Any]]:
  """A native pytree of arrays as the adapter names it, under `m`."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if leaf is not None:
      bundle, name = haiku_name(path)
      out.setdefault(bundle, {})[name] = leaf
  return out


def native_state(model, state) -> dict[str, dict[str, Any]]:
  """The model's `eqx.nn.State`, by the path of each StateIndex."""
  is_index = lambda x: isinstance(x, eqx.nn.StateIndex)
  return as_haiku(
    jax.tree.map(lambda i: state.get(i) if is_index(i) else None, model, is_leaf=is_index)
  )


def weights(model) -> dict[str, dict[str, Any]]:
  """A model's arrays as Haiku params: all but its state's initial values."""
  is_index = lambda x: isinstance(x, eqx.nn.StateIndex)
  return as_haiku(
    eqx.filter(
      jax.tree.map(lambda x: None if is_index(x) else x, model, is_leaf=is_index), eqx.is_array
    )
  )


def loss(out) -> jax.Array:
  return sum(jnp.sum(jnp.real(o).astype(jnp.float32) ** 2) for o in jax.tree.leaves(out))


class Both:
  """A model run natively and through the adapter, with the same weights.

  `state` is the model's current `eqx.nn.State` (None for a stateless one):
  each `check` starts both runs from it and moves it on as the native run
  does.
  """

  def __init__(self, test, model, state=None, *, axis: Optional[str] = None):
    self.test, self.model, self.state, self.axis = test, model, state, axis

  def native(self, model, args, kwargs):
    # Equinox refuses a state used twice: each run gets a copy.
    state = (
      None if self.state is None else jax.tree.unflatten(*reversed(jax.tree.flatten(self.state)))
    )

    def call(*a):
      return model(*a, **kwargs) if state is None else model(*a, state, **kwargs)

    if self.axis is None:
      return call(*args)
    return jax.vmap(call, axis_name=self.axis, out_axes=0 if state is None else (0, None))(*args)

  def adapter(self, args, kwargs) -> hk.TransformedWithState:
    def f(*a):
      call = functools.partial(hkb.from_equinox(self.model, state=self.state, name="m"), **kwargs)
      if self.axis is not None:
        call = hk.vmap(call, split_rng=False, axis_name=self.axis)
      return call(*a)

    return hk.transform_with_state(f)

  def check(self, *args, grads: bool = True, rtol: float = 1e-5, **kwargs) -> tuple[Any, Any]:
    """Same outputs, state and gradients; returns the adapter's `(out, state)`."""
    f = self.adapter(args, kwargs)
    params, hk_state = f.init(None, *args)
    out, new_state = f.apply(params, hk_state, None, *args)
    output = lambda result: result if self.state is None else result[0]
    theirs = self.native(self.model, args, kwargs)
    chex.assert_trees_all_close(out, output(theirs), rtol=rtol, atol=1e-6)
    if self.state is not None:
      chex.assert_trees_all_close(
        new_state, native_state(self.model, theirs[1]), rtol=rtol, atol=1e-6
      )
    if grads and jax.tree.leaves(params):
      ours = jax.grad(lambda p: loss(f.apply(p, hk_state, None, *args)[0]))(params)
      native = eqx.filter_grad(lambda m: loss(output(self.native(m, args, kwargs))))(self.model)
      chex.assert_trees_all_close(ours, weights(native), rtol=1e-4, atol=1e-5)
    if self.state is not None:
      self.state = theirs[1]
    return out, new_state


def check(test, model, *args, state=None, axis=None, **kwargs):
  return Both(test, model, state, axis=axis).check(*args, **kwargs)


@contextlib.contextmanager
def warns(test):
  """`test.assertWarns(Warning)`, recorded instead.

  `assertWarns` reads every module's `__warningregistry__`, and without Flax
  (jax < 0.8.1) dm-haiku's stand-in for `haiku.experimental.flax` raises
  ImportError on any attribute.
  """
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    yield
  test.assertNotEmpty(caught, "no warning")


class NnTest(absltest.TestCase):
  """`test_nn.py`."""

  def setUp(self):
    super().setUp()
    self.key = keys()

  def getkey(self):
    return next(self.key)

  def test_every_equinox_case_is_covered(self):
    self.assertEmpty(
      peer_cases.uncovered(peer_cases.EQUINOX, (NnTest, StatefulTest, SharedTest), NOT_APPLICABLE)
    )
    self.assertIn(peer_cases.check_against_sources("equinox", peer_cases.EQUINOX), (None, ""))

  def test_custom_init(self):
    for make in (
      lambda key: eqx.nn.Linear(3, 4),
      lambda key: eqx.nn.Linear(3),
      lambda key: eqx.nn.Linear(out_features=4),
    ):
      with self.assertRaises(TypeError):
        make(None)  # Natively.
      f = hk.transform(lambda: hkb.from_equinox(make)())
      with self.assertRaisesRegex(
        TypeError,
        r"hkb.from_equinox: calling the "
        r"constructor with `key=` alone failed",
      ):
        f.init(jr.PRNGKey(0))

  def test_linear(self):
    k = self.getkey
    for model, x in [
      (eqx.nn.Linear(0, 4, key=k()), jr.normal(k(), (0,))),
      (eqx.nn.Linear(4, 0, key=k()), jr.normal(k(), (4,))),
      (eqx.nn.Linear(3, 4, key=k()), jr.normal(k(), (3,))),
      (eqx.nn.Linear(3, out_features=4, key=k()), jr.normal(k(), (3,))),
      (eqx.nn.Linear("scalar", 2, key=k()), jr.normal(k(), ())),
      (eqx.nn.Linear(2, "scalar", key=k()), jr.normal(k(), (2,))),
      (
        eqx.nn.Linear(2, "scalar", key=k(), dtype=jnp.float16),
        jr.normal(k(), (2,), dtype=jnp.float16),
      ),
    ]:
      out, _ = check(self, model, x, rtol=1e-3)
      self.assertEqual(out.shape, model(x).shape)
    model = eqx.nn.Linear(2, "scalar", key=k(), dtype=jnp.complex64)
    out, _ = check(self, model, jr.normal(k(), (2,), dtype=jnp.complex64), grads=False)
    self.assertEqual(out.dtype, jnp.complex64)

  def test_identity(self):
    x = jr.normal(self.getkey(), (3, 5, 9))
    for model in (
      eqx.nn.Identity(),
      eqx.nn.Identity(1),
      eqx.nn.Identity(2, hi=True),
      eqx.nn.Identity(eqx.nn.Identity()),
    ):
      out, _ = check(self, model, x)
      np.testing.assert_array_equal(out, x)

  def test_dropout_basic(self):
    x, key = jr.normal(self.getkey(), (3, 4, 5)), self.getkey()
    out, _ = check(self, eqx.nn.Dropout(), x, key=key)
    self.assertTrue(jnp.all((out == 0) | (out == x / 0.5)))
    # The key from Haiku's rng: the first key of apply's sequence.
    f = hk.transform(lambda x: hkb.from_equinox(eqx.nn.Dropout())(x))
    rng = jr.PRNGKey(3)
    np.testing.assert_array_equal(
      f.apply({}, rng, x), eqx.nn.Dropout()(x, key=next(hk.PRNGSequence(rng)))
    )

  def test_dropout_inference(self):
    x = jr.normal(self.getkey(), (3, 4, 5))
    for out, _ in (
      check(self, eqx.nn.Dropout(), x, key=self.getkey(), inference=True),
      check(self, eqx.nn.Dropout(), x, inference=True),
      check(self, eqx.nn.Dropout(inference=True), x),
    ):
      np.testing.assert_array_equal(out, x)
    dropout = eqx.tree_at(lambda d: d.inference, eqx.nn.Dropout(inference=True), replace=False)
    out, _ = check(self, dropout, x, key=jr.PRNGKey(0))
    self.assertTrue(jnp.any(out != x))

  def test_dropout_deterministic(self):
    x = jr.normal(self.getkey(), (3, 4, 5))
    with warns(self):  # Deprecated in Equinox, as natively.
      out, _ = check(self, eqx.nn.Dropout(), x, deterministic=True)
    np.testing.assert_array_equal(out, x)

  def _cell(self, cell, h):
    xs = jr.normal(self.getkey(), (5, 2))

    def f(h):
      adapter = hkb.from_equinox(cell, name="m")
      for x in xs:
        h = adapter(x, h)
      return h

    f = hk.transform(f)
    params = f.init(None, h)
    native = h
    for x in xs:
      native = cell(x, native)
    chex.assert_trees_all_close(f.apply(params, None, h), native, rtol=1e-5)
    grads = jax.grad(lambda p: loss(f.apply(p, None, h)))(params)

    def native_loss(cell):
      out = h
      for x in xs:
        out = cell(x, out)
      return loss(out)

    chex.assert_trees_all_close(
      grads, weights(eqx.filter_grad(native_loss)(cell)), rtol=1e-4, atol=1e-6
    )

  def test_gru_cell(self):
    self._cell(eqx.nn.GRUCell(2, 8, key=self.getkey()), jr.normal(self.getkey(), (8,)))

  def test_lstm_cell(self):
    self._cell(
      eqx.nn.LSTMCell(2, 8, key=self.getkey()),
      (jr.normal(self.getkey(), (8,)), jr.normal(self.getkey(), (8,))),
    )

  def test_sequential(self):
    k = self.getkey
    seq = eqx.nn.Sequential(
      [
        eqx.nn.Linear(2, 4, key=k()),
        eqx.nn.Linear(4, 1, key=k()),
        eqx.nn.BatchNorm(1, axis_name="batch", mode="ema"),
        eqx.nn.Linear(1, 3, key=k()),
      ]
    )
    state = eqx.nn.State(seq)
    out, _ = check(self, seq, jr.normal(k(), (1, 2)), state=state, axis="batch")
    self.assertEqual(out[0].shape, (3,))

  def test_nested_sequential(self):
    for inner_stateful in (False, True):
      for outer_stateful in (False, True):
        k = self.getkey
        norm = lambda n, stateful: (
          eqx.nn.BatchNorm(n, axis_name="batch", mode="ema") if stateful else eqx.nn.Identity()
        )
        inner = eqx.nn.Sequential(
          [eqx.nn.Linear(2, 4, key=k()), norm(4, inner_stateful), eqx.nn.Linear(4, 3, key=k())]
        )
        model = eqx.nn.Sequential(
          [
            eqx.nn.Linear(5, 2, key=k()),
            inner,
            norm(3, outer_stateful),
            eqx.nn.Linear(3, 6, key=k()),
          ]
        )
        stateful = inner_stateful or outer_stateful
        out, _ = check(
          self,
          model,
          jr.normal(k(), (3, 5)),
          axis="batch",
          state=eqx.nn.State(model) if stateful else None,
        )
        self.assertEqual(out.shape, (3, 6))

  def test_mlp(self):
    k = self.getkey
    for scan in (False, True):
      for depth in (0, 1, 2):
        for model, x in [
          (eqx.nn.MLP(2, 3, 8, depth=depth, scan=scan, key=k()), jr.normal(k(), (2,))),
          (eqx.nn.MLP("scalar", 2, 2, depth=depth, scan=scan, key=k()), jr.normal(k(), ())),
          (eqx.nn.MLP(2, "scalar", 2, depth=depth, scan=scan, key=k()), jr.normal(k(), (2,))),
          (
            eqx.nn.MLP(
              2, 3, 8, depth=depth, use_bias=False, use_final_bias=True, scan=scan, key=k()
            ),
            jr.normal(k(), (2,)),
          ),
          (
            eqx.nn.MLP(
              2, 3, 8, depth=depth, use_bias=True, use_final_bias=False, scan=scan, key=k()
            ),
            jr.normal(k(), (2,)),
          ),
        ]:
          check(self, model, x)

  def test_scan_over_mlp_depth_one(self):
    key = self.getkey()
    mlp = eqx.nn.MLP(2, 3, 8, depth=1, key=key)
    scan_mlp = eqx.nn.MLP(2, 3, 8, depth=1, scan=True, key=key)
    x = jr.normal(self.getkey(), (2,))
    out, _ = check(self, scan_mlp, x)
    np.testing.assert_allclose(out, mlp(x), rtol=1e-6)

  def test_mlp_learnt_activation(self):
    mlp = eqx.nn.MLP(
      2, 5, 8, 2, activation=eqx.nn.PReLU(), final_activation=eqx.nn.PReLU(), key=jr.PRNGKey(5678)
    )
    check(self, mlp, jnp.array([0.5, 0.7]))
    f = hk.transform(lambda x: hkb.from_equinox(mlp, name="m")(x))
    params = f.init(None, jnp.zeros(2))
    self.assertEqual(params["m/activation"]["negative_slope"].shape, (2, 8))
    self.assertEqual(params["m/final_activation"]["negative_slope"].shape, (5,))

  def test_scan_over_mlp_learnt_activation(self):
    mlp = eqx.nn.MLP(
      2,
      5,
      8,
      2,
      activation=eqx.nn.PReLU(),
      final_activation=eqx.nn.PReLU(),
      scan=True,
      key=jr.PRNGKey(5678),
    )
    check(self, mlp, jnp.array([0.5, 0.7]))

  def _convs(self, models_and_shapes):
    for model, shape in models_and_shapes:
      check(self, model, jr.normal(self.getkey(), shape), rtol=1e-4)

  def test_conv1d(self):
    k = self.getkey
    self._convs(
      [
        (eqx.nn.Conv1d(1, 3, 3, key=k()), (1, 16)),
        (eqx.nn.Conv1d(1, out_channels=3, kernel_size=(3,), key=k()), (1, 16)),
        (eqx.nn.Conv1d(1, 3, 3, stride=2, padding=1, dilation=2, key=k()), (1, 16)),
        (eqx.nn.Conv1d(3, 6, 3, padding=1, groups=3, key=k()), (3, 16)),
        (eqx.nn.Conv1d(1, 3, kernel_size=3, padding=1, key=k()), (1, 16)),
      ]
    )

  def test_conv2d(self):
    k = self.getkey
    self._convs(
      [
        (eqx.nn.Conv2d(1, 3, 3, key=k()), (1, 8, 8)),
        (eqx.nn.Conv2d(1, 3, (3, 3), stride=2, padding=1, dilation=2, key=k()), (1, 8, 8)),
        (eqx.nn.Conv2d(3, 6, 3, padding=1, groups=3, key=k()), (3, 8, 8)),
        (eqx.nn.Conv2d(2, 2, kernel_size=3, padding=1, key=k(), groups=2), (2, 8, 8)),
      ]
    )
    conv = eqx.nn.Conv2d(1, 1, 3, padding=1, dtype=jnp.complex64, key=k())
    check(self, conv, jr.normal(k(), (1, 4, 4), dtype=jnp.complex64), grads=False, rtol=1e-4)

  def test_conv3d(self):
    k = self.getkey
    self._convs(
      [
        (eqx.nn.Conv3d(1, 3, 3, key=k()), (1, 3, 6, 6)),
        (eqx.nn.Conv3d(3, 6, 3, padding=1, groups=3, key=k()), (3, 3, 6, 6)),
        (eqx.nn.Conv3d(1, 1, kernel_size=(2, 1, 1), padding=(1, 0, 0), key=k()), (1, 3, 4, 4)),
      ]
    )

  def test_conv_padding(self):
    self._convs(
      [(eqx.nn.Conv2d(3, 8, 1, 2, padding=((0, 1), (0, 3)), key=self.getkey()), (3, 8, 8))]
    )

  def test_conv_circular(self):
    self._convs(
      [(eqx.nn.Conv1d(1, 1, 3, padding="SAME", padding_mode="CIRCULAR", key=self.getkey()), (1, 6))]
    )

  def test_convtranspose1d(self):
    k = self.getkey
    self._convs(
      [
        (eqx.nn.ConvTranspose1d(1, 3, 3, key=k()), (1, 16)),
        (
          eqx.nn.ConvTranspose1d(
            3, 6, 3, stride=2, padding=1, output_padding=1, dilation=2, groups=3, key=k()
          ),
          (3, 15),
        ),
        (eqx.nn.ConvTranspose1d(1, 3, kernel_size=3, padding=0, key=k()), (1, 16)),
      ]
    )

  def test_convtranspose2d(self):
    k = self.getkey
    self._convs(
      [
        (eqx.nn.ConvTranspose2d(1, 3, 3, key=k()), (1, 8, 8)),
        (
          eqx.nn.ConvTranspose2d(
            3, 6, 3, stride=2, padding=1, output_padding=1, dilation=2, groups=3, key=k()
          ),
          (3, 7, 7),
        ),
        (eqx.nn.ConvTranspose2d(2, 2, kernel_size=3, padding=1, key=k(), groups=2), (2, 8, 8)),
      ]
    )

  def test_convtranspose3d(self):
    k = self.getkey
    self._convs(
      [
        (eqx.nn.ConvTranspose3d(1, 3, 3, key=k()), (1, 3, 6, 6)),
        (
          eqx.nn.ConvTranspose3d(1, 1, kernel_size=(2, 2, 2), padding=(0, 0, 0), key=k()),
          (1, 3, 4, 4),
        ),
      ]
    )

  def test_convtranspose_padding(self):
    self._convs(
      [(eqx.nn.ConvTranspose2d(8, 3, 1, 2, padding=((0, 1), (0, 3)), key=self.getkey()), (8, 7, 8))]
    )

  def test_convtranspose_same_padding(self):
    k = self.getkey
    self._convs(
      [
        (eqx.nn.Conv1d(1, 1, 3, stride=2, padding="SAME", key=k()), (1, 5)),
        (
          eqx.nn.ConvTranspose1d(1, 1, 3, stride=2, padding="SAME", output_padding=1, key=k()),
          (1, 3),
        ),
      ]
    )

  def test_convtranspose_circular(self):
    k = self.getkey
    self._convs(
      [
        (eqx.nn.Conv1d(1, 1, 3, padding="SAME", padding_mode="CIRCULAR", key=k()), (1, 6)),
        (eqx.nn.ConvTranspose1d(1, 1, 3, padding="SAME", padding_mode="CIRCULAR", key=k()), (1, 6)),
      ]
    )

  def test_multihead_attention(self):
    k = self.getkey
    attn = eqx.nn.MultiheadAttention(
      num_heads=2,
      query_size=3,
      key_size=5,
      value_size=7,
      output_size=11,
      qk_size=13,
      vo_size=17,
      key=k(),
    )
    q, kk, v = (jr.uniform(k(), (6, 3)), jr.uniform(k(), (7, 5)), jr.uniform(k(), (7, 7)))
    out, _ = check(self, attn, q, kk, v)
    self.assertEqual(out.shape, (6, 11))
    attn = eqx.tree_at(
      lambda a: (a.query_proj.weight, a.key_proj.weight, a.value_proj.weight, a.output_proj.weight),
      eqx.nn.MultiheadAttention(num_heads=2, query_size=4, key=k()),
      [jnp.arange(16.0).reshape(4, 4) for _ in range(4)],
    )
    x = jnp.arange(1, 13, dtype=jnp.float32).reshape(3, 4)
    for mask in (
      jnp.broadcast_to(jnp.array([True, False, False]), (2, 3, 3)),
      jnp.broadcast_to(jnp.array([True, False, False]), (3, 3)),
    ):
      check(self, attn, x, x, x, mask, rtol=1e-4)

  def test_multihead_attention_inference(self):
    k = self.getkey
    x = jr.normal(k(), (3, 10))
    attn = eqx.nn.MultiheadAttention(num_heads=2, query_size=10, dropout_p=0.5, key=k())
    z1, _ = check(self, attn, x, x, x, key=k(), inference=True)
    z2, _ = check(self, attn, x, x, x, inference=True)
    np.testing.assert_array_equal(z1, z2)
    z1, _ = check(self, attn, x, x, x, key=k())
    z2, _ = check(self, attn, x, x, x, key=k())
    self.assertTrue(jnp.any(z1 != z2))

  def test_multihead_attention_deterministic(self):
    k = self.getkey
    x = jr.normal(k(), (3, 10))
    attn = eqx.nn.MultiheadAttention(num_heads=2, query_size=10, dropout_p=0.5, key=k())
    with warns(self):
      z1, _ = check(self, attn, x, x, x, key=k(), deterministic=True)
    with warns(self):
      z2, _ = check(self, attn, x, x, x, deterministic=True)
    np.testing.assert_array_equal(z1, z2)

  def test_embedding(self):
    k = self.getkey
    table = jnp.linspace(0.1, 10, 100).reshape(10, 10)
    for model, x in [
      (eqx.nn.Embedding(100, 16, key=k()), jnp.array(1)),
      (eqx.nn.Embedding(num_embeddings=10, embedding_size=20, key=k()), jnp.array(0)),
      (eqx.nn.Embedding(10, 10, weight=table, key=k()), jnp.array(-1)),
      (eqx.nn.Embedding(weight=table), jnp.array(-1)),
    ]:
      check(self, model, x)

  def test_layer_norm(self):
    k = self.getkey
    for model, x in [
      (eqx.nn.LayerNorm(16), jr.uniform(k(), (16,))),
      (eqx.nn.LayerNorm(shape=(4, 4), use_weight=False, use_bias=False), jr.uniform(k(), (4, 4))),
      (eqx.nn.LayerNorm(10), jnp.linspace(0.1, 1, 10)),
    ]:
      check(self, model, x, rtol=1e-4)
    out, _ = check(
      self,
      eqx.nn.LayerNorm(16, dtype=jnp.bfloat16),
      jr.uniform(k(), (16,), dtype=jnp.bfloat16),
      rtol=1e-2,
    )
    self.assertEqual(out.dtype, jnp.bfloat16)

  def test_group_norm(self):
    k = self.getkey
    for model, x in [
      (eqx.nn.GroupNorm(groups=4, channels=16), jr.uniform(k(), (16,))),
      (eqx.nn.GroupNorm(groups=4, channels=16), jr.uniform(k(), (16, 4, 5))),
      (
        eqx.nn.GroupNorm(groups=4, channels=16, channelwise_affine=False),
        jr.uniform(k(), (16, 4, 5)),
      ),
      (eqx.nn.GroupNorm(1, 10), jnp.linspace(0.1, 1, 10)),
      (eqx.nn.GroupNorm(2, 10), jnp.linspace(0.1, 1, 10)),
      (eqx.nn.GroupNorm(groups=4, channelwise_affine=False), jr.uniform(k(), (16,))),
    ]:
      check(self, model, x, rtol=1e-4)
    out, _ = check(
      self,
      eqx.nn.GroupNorm(groups=4, channels=16, dtype=jnp.bfloat16),
      jr.uniform(k(), (16,), dtype=jnp.bfloat16),
      rtol=1e-2,
    )
    self.assertEqual(out.dtype, jnp.bfloat16)
    for bad in (
      lambda key: eqx.nn.GroupNorm(groups=3, channels=4),
      lambda key: eqx.nn.GroupNorm(groups=4, channels=None, channelwise_affine=True),
    ):
      with self.assertRaises(ValueError):
        bad(None)
      with self.assertRaises(ValueError):  # The constructor's own error.
        hk.transform(lambda: hkb.from_equinox(bad)()).init(jr.PRNGKey(0))

  def test_batch_norm(self):
    k = self.getkey
    for mode in ("ema", "batch"):
      bn = eqx.nn.BatchNorm(5, "batch", mode=mode)
      both = Both(self, bn, eqx.nn.State(bn), axis="batch")
      for shape in ((10, 5), (10, 5, 6), (10, 5, 7, 8)):
        both.check(jr.uniform(k(), shape))
      # Without the named axis: the same NameError.
      with self.assertRaises(NameError):
        jax.vmap(bn, in_axes=(0, None), out_axes=(0, None))(
          jr.uniform(k(), (10, 5)), eqx.nn.State(bn)
        )
      f = hk.transform_with_state(lambda x: hk.vmap(hkb.from_equinox(bn), split_rng=False)(x))
      with self.assertRaises(NameError):
        f.init(None, jr.uniform(k(), (10, 5)))
      # Two named axes.
      vvbn = eqx.nn.BatchNorm(6, ("batch1", "batch2"), mode=mode)
      x2 = jr.uniform(k(), (10, 5, 6))
      native = vvbn
      for axis in ("batch1", "batch2"):
        native = jax.vmap(native, axis_name=axis, in_axes=(0, None), out_axes=(0, None))
      theirs, theirs_state = native(x2, eqx.nn.State(vvbn))

      def two_axes(x):
        call = hkb.from_equinox(vvbn, name="m")
        for axis in ("batch1", "batch2"):
          call = hk.vmap(call, axis_name=axis, split_rng=False)
        return call(x)

      f = hk.transform_with_state(two_axes)
      params, state = f.init(None, x2)
      out, state = f.apply(params, state, None, x2)
      chex.assert_trees_all_close(out, theirs, rtol=1e-5)
      chex.assert_trees_all_close(state, native_state(vvbn, theirs_state), rtol=1e-5)
      # Normalises, updates its statistics in training, not at inference,
      # and differentiates: steps run on one state, both ways.
      bn = eqx.nn.BatchNorm(5, "batch", channelwise_affine=False, mode=mode)
      both = Both(self, bn, eqx.nn.State(bn), axis="batch")
      x1 = jr.uniform(k(), (10, 5))
      for x in (jr.normal(jr.PRNGKey(5678), (10, 5)), x1, 3 * x1 + 10):
        both.check(x)
      both.model = eqx.nn.inference_mode(bn, value=True)
      before = both.state
      both.check(4 * x1 + 20)
      chex.assert_trees_all_equal(native_state(bn, both.state), native_state(bn, before))

  def test_batch_norm_zero_training_steps(self):
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
      input_size=3, axis_name="foo", mode="batch", inference=True
    )
    x = jr.normal(self.getkey(), (5, 3))
    out, _ = check(self, bn, x, state=state, axis="foo")
    np.testing.assert_allclose(out, x, rtol=1e-5)

  def test_spectral_norm(self):
    k = self.getkey
    spectral = eqx.nn.SpectralNorm(eqx.nn.Linear(5, 6, key=k()), "weight", key=k())
    both = Both(self, spectral, eqx.nn.State(spectral))
    x = jr.normal(k(), (5,))
    for _ in range(5):
      both.check(x, rtol=1e-4)
    # At inference its state does not change, both ways.
    both.model = eqx.nn.inference_mode(spectral)
    before = both.state
    both.check(x, rtol=1e-4)
    chex.assert_trees_all_equal(native_state(spectral, both.state), native_state(spectral, before))

  def test_weight_norm(self):
    k = self.getkey
    for model, shape in [
      (eqx.nn.WeightNorm(layer=eqx.nn.Linear(4, 4, key=k()), weight_name="weight"), (4,)),
      (
        eqx.nn.WeightNorm(layer=eqx.nn.Linear(4, 4, key=k()), weight_name="weight", axis=None),
        (4,),
      ),
      (
        eqx.nn.WeightNorm(layer=eqx.nn.Conv3d(2, 3, 3, key=k()), weight_name="weight"),
        (2, 3, 3, 3),
      ),
    ]:
      check(self, model, jr.normal(k(), shape), rtol=1e-4)

  def _pools(self, x, *pools):
    for pool in pools:
      out, _ = check(self, pool, x)
      np.testing.assert_array_equal(out, pool(x))

  def test_maxpool1d(self):
    self._pools(
      jnp.arange(14.0).reshape(1, 14),
      eqx.nn.MaxPool1d(2, 3),
      eqx.nn.MaxPool1d(kernel_size=3, stride=3, padding=0, use_ceil=True),
    )

  def test_avgpool1d(self):
    self._pools(jnp.arange(14.0).reshape(1, 14), eqx.nn.AvgPool1d(2, 3))

  def test_adaptive_avgpool1d(self):
    self._pools(
      jnp.arange(14.0).reshape(1, 14), eqx.nn.AdaptiveAvgPool1d(4), eqx.nn.AdaptiveAvgPool1d(14)
    )

  def test_adaptive_maxpool1d(self):
    self._pools(
      jnp.arange(14.0).reshape(1, 14), eqx.nn.AdaptiveMaxPool1d(4), eqx.nn.AdaptiveMaxPool1d(14)
    )

  def test_maxpool2d(self):
    self._pools(
      jnp.arange(36.0).reshape(1, 6, 6),
      eqx.nn.MaxPool2d(2, (3, 2)),
      eqx.nn.MaxPool2d((3, 3), 2, (1, 1), use_ceil=True),
    )

  def test_avgpool2d(self):
    self._pools(jnp.arange(36.0).reshape(1, 6, 6), eqx.nn.AvgPool2d((1, 3), 2))

  def test_adaptive_avgpool2d(self):
    self._pools(
      jnp.arange(12.0).reshape(1, 3, 4),
      eqx.nn.AdaptiveAvgPool2d((2, 3)),
      eqx.nn.AdaptiveAvgPool2d((3, 4)),
    )

  def test_adaptive_maxpool2d(self):
    self._pools(
      jnp.arange(12.0).reshape(1, 3, 4),
      eqx.nn.AdaptiveMaxPool2d((2, 3)),
      eqx.nn.AdaptiveMaxPool2d((3, 4)),
    )

  def test_maxpool3d(self):
    self._pools(
      jnp.arange(64.0).reshape(1, 4, 4, 4),
      eqx.nn.MaxPool3d(2, (3, 2, 1)),
      eqx.nn.MaxPool3d(kernel_size=3, padding=(0, 1, 1), stride=2, use_ceil=True),
    )

  def test_avgpool3d(self):
    self._pools(jnp.arange(64.0).reshape(1, 4, 4, 4), eqx.nn.AvgPool3d((1, 3, 1), 2))

  def test_adaptive_avgpool3d(self):
    self._pools(
      jnp.arange(18.0).reshape(1, 3, 2, 3),
      eqx.nn.AdaptiveAvgPool3d((2, 1, 3)),
      eqx.nn.AdaptiveAvgPool3d((3, 2, 3)),
    )

  def test_adaptive_maxpool3d(self):
    self._pools(
      jnp.arange(18.0).reshape(1, 3, 2, 3),
      eqx.nn.AdaptiveMaxPool3d((2, 1, 3)),
      eqx.nn.AdaptiveMaxPool3d((3, 2, 3)),
    )

  def test_poolpadding(self):
    self._pools(
      jnp.arange(64.0).reshape(1, 4, 4, 4), eqx.nn.MaxPool3d(2, 1, ((0, 1), (0, 1), (0, 1)))
    )

  def test_poolbackprop(self):
    pool = eqx.nn.MaxPool3d((2, 2, 2), (1, 1, 1), ((0, 1), (0, 1), (0, 1)))
    x = jnp.arange(64.0).reshape(1, 4, 4, 4)
    f = hk.transform(lambda x: jnp.mean(hkb.from_equinox(pool)(x)))
    ours = jax.value_and_grad(lambda x: f.apply({}, None, x))(x)
    theirs = jax.value_and_grad(lambda x: jnp.mean(pool(x)))(x)
    chex.assert_trees_all_close(ours, theirs)

  def test_poolnetworkbackprop(self):
    class Cnn(eqx.Module):
      conv_layer: list
      linear_layers: list

      def __init__(self, key):
        k1, k2, k3 = jr.split(key, 3)
        self.conv_layer = [eqx.nn.Conv2d(3, 2, 3, key=k1), eqx.nn.MaxPool2d(2, 2)]
        self.linear_layers = [eqx.nn.Linear(18, 16, key=k2), eqx.nn.Linear(16, 10, key=k3)]

      def __call__(self, x):
        for layer in self.conv_layer:
          x = layer(x)
        x = jnp.ravel(x)
        for layer in self.linear_layers:
          x = jax.nn.relu(layer(x))
        return x

    cnn = Cnn(self.getkey())
    x = jr.normal(self.getkey(), (4, 3, 8, 8))
    check(self, cnn, x, axis="batch", rtol=1e-4)

  def test_lambda_layer(self):
    net = eqx.nn.Sequential([eqx.nn.Identity(), eqx.nn.Lambda(jax.nn.relu)])
    out, _ = check(self, net, jnp.array([[-1.0, -2, -3], [1, 2, 3]]))
    self.assertTrue((out >= 0).all())

  def test_prelu(self):
    x = jnp.array([[-1.0, -2, -3], [-1, 2, 3]])
    for activation in (eqx.nn.PReLU(0.1), eqx.nn.PReLU(jnp.array([0.2, 0.1, 0.1]))):
      check(self, activation, x)

  def test_rope_embeddings_shapes(self):
    rope = eqx.nn.RotaryPositionalEmbedding(32)
    heads = jr.normal(self.getkey(), (8, 4, 32))
    f = hk.transform(
      lambda h: hk.vmap(hkb.from_equinox(rope), in_axes=1, out_axes=1, split_rng=False)(h)
    )
    out = f.apply({}, None, heads)
    np.testing.assert_allclose(out, jax.vmap(rope, in_axes=1, out_axes=1)(heads), rtol=1e-6)

  def test_rope_embeddings_values(self):
    rope = eqx.nn.RotaryPositionalEmbedding(4)
    x = jnp.arange(12.0).reshape(3, 4)
    out, _ = check(self, rope, x)
    np.testing.assert_allclose(out, rope(x), rtol=1e-6)


class StatefulTest(absltest.TestCase):
  """`test_stateful.py`."""

  def test_delete_init_state(self):
    model = eqx.nn.BatchNorm(3, "batch", mode="ema")
    state = eqx.nn.State(model)
    deleted = eqx.nn.delete_init_state(model)
    with self.assertRaises(ValueError):
      eqx.nn.State(deleted)
    # Its state given, the model runs as before; without it, the error says
    # to pass it.
    x = jr.normal(jr.PRNGKey(0), (4, 3))
    check(self, deleted, x, state=state, axis="batch")
    f = hk.transform_with_state(
      lambda x: hk.vmap(hkb.from_equinox(deleted), split_rng=False, axis_name="batch")(x)
    )
    with self.assertRaisesRegex(
      ValueError,
      r"hkb.from_equinox\(BatchNorm\): "
      r".*state=state",
    ):
      f.init(None, x)

  def test_double_state(self):
    class Counter(eqx.Module):
      index: eqx.nn.StateIndex

      def __init__(self):
        self.index = eqx.nn.StateIndex(jnp.array(0))

      def __call__(self, x, state):
        value = state.get(self.index)
        return x + value, state.set(self.index, value + 1)

    class Model(eqx.Module):
      linear: eqx.nn.Linear
      counter: Counter
      v_counter: Counter

      def __init__(self, key):
        self.linear = eqx.nn.Linear(2, 2, key=key)
        self.counter = Counter()
        self.v_counter = eqx.filter_vmap(Counter, axis_size=2)()

      def __call__(self, x, state):
        x, state = self.counter(self.linear(x), state)
        substate = state.substate(self.v_counter)
        x, substate = eqx.filter_vmap(self.v_counter)(x, substate)
        return x, state.update(substate)

    model, state = eqx.nn.make_with_state(Model)(jr.PRNGKey(0))
    x = jnp.array([5.0, -1.0])
    both = Both(self, model, state)
    for _ in range(3):
      both.check(x)
    # Built by the adapter from the constructor: the same initial state.
    f = hk.transform_with_state(lambda x: hkb.from_equinox(Model, name="m")(x))
    _, hk_state = f.init(jr.PRNGKey(1), x)
    chex.assert_trees_all_equal(
      hk_state, native_state(*eqx.nn.make_with_state(Model)(next(hk.PRNGSequence(jr.PRNGKey(1)))))
    )


class SharedTest(absltest.TestCase):
  """`test_shared.py`: weights tied with eqx.nn.Shared are stored once."""

  def setUp(self):
    super().setUp()
    self.key = keys(1)

  def getkey(self):
    return next(self.key)

  def test_shared_array(self):
    embedding = eqx.nn.Embedding(3, 4, key=self.getkey())
    head = eqx.nn.Linear(4, 3, key=self.getkey())

    class Tied(eqx.Module):
      shared: eqx.nn.Shared

      def __init__(self):
        self.shared = eqx.nn.Shared((embedding, head), lambda p: p[1].weight, lambda p: p[0].weight)

      def __call__(self, token):
        embedding, head = self.shared()
        assert embedding.weight is head.weight
        return head(embedding(token))

    check(self, Tied(), jnp.array(0))
    f = hk.transform(lambda t: hkb.from_equinox(Tied(), name="m")(t))
    params = f.init(None, jnp.array(0))
    # The tied weight is stored once, as the model holds it.
    self.assertEqual(jax.tree.map(jnp.shape, params), jax.tree.map(jnp.shape, weights(Tied())))
    self.assertLen(jax.tree.leaves(params), 2)  # The embedding, the bias.

  def _attention_pair(self, where, get):
    proj = eqx.nn.Linear(12, 12, use_bias=False, key=self.getkey())
    attention = eqx.nn.MultiheadAttention(num_heads=3, query_size=12, key=self.getkey())

    class Pair(eqx.Module):
      shared: eqx.nn.Shared

      def __init__(self):
        self.shared = eqx.nn.Shared((proj, attention), where, get)

      def __call__(self, x):
        proj, attention = self.shared()
        return jax.vmap(proj)(attention(x, x, x))

    model, x = Pair(), jr.normal(self.getkey(), (5, 12))
    check(self, model, x, rtol=1e-4)
    # One gradient step each way: the tie holds, the outputs agree.
    f = hk.transform(lambda x: hkb.from_equinox(model, name="m")(x))
    params = f.init(None, x)
    grads = jax.grad(lambda p: loss(f.apply(p, None, x)))(params)
    stepped = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
    native = eqx.apply_updates(
      model, jax.tree.map(lambda g: -1e-3 * g, eqx.filter_grad(lambda m: loss(m(x)))(model))
    )
    np.testing.assert_allclose(f.apply(stepped, None, x), native(x), rtol=1e-4, atol=1e-5)

  def test_shared_node(self):
    self._attention_pair(lambda pair: pair[1].key_proj, lambda pair: pair[0])

  def test_multi_shared(self):
    self._attention_pair(
      lambda pair: (pair[1].key_proj, pair[1].query_proj.weight),
      lambda pair: (pair[0], pair[0].weight + 1),
    )

  def test_mismatched_structure_at_construction(self):
    x, y = jr.normal(self.getkey(), (3, 4)), jr.normal(self.getkey(), (4, 3))
    make = lambda key: eqx.nn.Shared((x, y), lambda p: p[0], lambda p: p[1])
    with self.assertRaisesRegex(ValueError, "Every node being shared together"):
      make(None)
    f = hk.transform(lambda: hkb.from_equinox(make)())
    with self.assertRaisesRegex(ValueError, "Every node being shared together"):
      f.init(jr.PRNGKey(0))


if __name__ == "__main__":
  absltest.main()
