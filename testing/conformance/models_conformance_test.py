"""Real models, bridged inside a larger network, against the same network inline.

`hk.nets.ResNet18` (train and eval), `hk.nets.MLP` with dropout and a small
transformer language model (after dm-haiku's `examples/transformer`) each run
through `hkb.call_pure` inside a network with modules before and after it, and
must equal the network written inline: param and state names, initial values
for the same key, outputs (dropout included), new state and gradients. A
transformer block through `hkb.layer_scan` (with and without remat) must equal
`hk.layer_stack` of the same block (under `hk.remat` for remat).

Sizes are tiny (CI has two cores): ResNet18 on one 16x16x3 image.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax
import jax.numpy as jnp

import haiku_bridge as hkb
from testing.conformance import common

KEY = jax.random.PRNGKey(0)
APPLY_KEY = jax.random.PRNGKey(1)


def compare(
  test, bridged, inline, init_args, apply_args_list, *, rng=KEY, apply_rng=APPLY_KEY, grads=True
):
  """Both `hk.transform_with_state`ed: same init, outputs, state, gradients.

  `apply_args_list` are applied in turn, each on the state the previous one
  left; gradients are taken at the first.
  """
  bridged = hk.transform_with_state(bridged)
  inline = hk.transform_with_state(inline)
  # Init runs op by op (its many initializer ops are compiled once for both);
  # apply and grad are jitted whole, with their arguments (Python flags among
  # them) closed over. CI has two cores.
  init = lambda f: f.init(rng, *init_args)
  p_b, s_b = init(bridged)
  p_i, s_i = init(inline)
  common.assert_same_tree(test, p_b, p_i)
  common.assert_same_tree(test, s_b, s_i)
  tol = dict(rtol=1e-5, atol=1e-6)
  if grads:

    def grad(f):
      def scalar(p):
        out, new_state = f.apply(p, s_i, apply_rng, *apply_args_list[0])
        return sum(
          jnp.sum(jnp.square(o.astype(jnp.float32))) for o in jax.tree.leaves(out)
        ), new_state

      return jax.jit(jax.grad(scalar, has_aux=True))(p_i)

    g_b, gs_b = grad(bridged)
    g_i, gs_i = grad(inline)
    common.assert_same_tree(test, g_b, g_i, rtol=1e-4, atol=1e-5)
    common.assert_same_tree(test, gs_b, gs_i, **tol)
  s_b = s_i
  for args in apply_args_list:
    apply = lambda f, s, args=args: jax.jit(lambda p, s: f.apply(p, s, apply_rng, *args))(p_i, s)
    out_b, s_b = apply(bridged, s_b)
    out_i, s_i = apply(inline, s_i)
    chex.assert_trees_all_close(out_b, out_i, **tol)
    common.assert_same_tree(test, s_b, s_i, **tol)
  return p_i, s_i


# ---------------------------------------------------------------------------
# ResNet18.
# ---------------------------------------------------------------------------


def resnet18(x, is_training):
  return hk.nets.ResNet18(10)(x, is_training=is_training)


RESNET18 = hk.transform_with_state(resnet18)


def image_net(bridged):
  def net(x, is_training):
    h = hk.Conv2D(3, 1, name="stem")(x)  # Something before,
    if bridged:
      logits = hkb.call_pure(RESNET18, h, is_training=is_training)
    else:
      logits = resnet18(h, is_training)
    return hk.Linear(4, name="head")(logits)  # and after.

  return net


# ---------------------------------------------------------------------------
# MLP with dropout.
# ---------------------------------------------------------------------------


def dropout_mlp(x):
  return hk.nets.MLP([16, 16, 8])(x, dropout_rate=0.5, rng=hk.next_rng_key())


def mlp_net(bridged):
  inner = hk.transform(dropout_mlp)

  def net(x):
    h = hk.Linear(8, name="pre")(x)
    h = hkb.call_pure(inner, h) if bridged else dropout_mlp(h)
    # A second, inline MLP after the bridged one: numbered `mlp_1` in both.
    return hk.nets.MLP([4])(h)

  return net


# ---------------------------------------------------------------------------
# A transformer language model, after dm-haiku's examples/transformer.
# ---------------------------------------------------------------------------

VOCAB, D_MODEL, HEADS, LAYERS, SEQ, DROPOUT = 32, 16, 2, 2, 8, 0.1


def transformer_block(h, is_training=True):
  rate = DROPOUT if is_training else 0.0
  seq = h.shape[1]
  mask = jnp.tril(jnp.ones([1, 1, seq, seq]))
  attn_in = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(h)
  attn = hk.MultiHeadAttention(
    num_heads=HEADS, key_size=D_MODEL // HEADS, w_init=hk.initializers.VarianceScaling(2 / LAYERS)
  )(attn_in, attn_in, attn_in, mask=mask)
  h = h + hk.dropout(hk.next_rng_key(), rate, attn)
  dense_in = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(h)
  dense = hk.Linear(4 * D_MODEL)(dense_in)
  dense = hk.Linear(D_MODEL)(jax.nn.gelu(dense))
  return h + hk.dropout(hk.next_rng_key(), rate, dense)


def transformer_core(h, is_training=True):
  for _ in range(LAYERS):
    h = transformer_block(h, is_training)
  return hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(h)


def language_model(bridged):
  core = hk.transform(transformer_core)

  def lm(tokens, is_training):
    embed = hk.Embed(VOCAB, D_MODEL)(tokens)
    positions = hk.get_parameter(
      "positional_embeddings", [SEQ, D_MODEL], init=hk.initializers.TruncatedNormal(0.02)
    )
    h = embed + positions[: tokens.shape[1]]
    if bridged:
      h = hkb.call_pure(core, h, is_training=is_training)
    else:
      h = transformer_core(h, is_training)
    logits = hk.Linear(VOCAB)(h)
    targets = jax.nn.one_hot(jnp.roll(tokens, -1, axis=1), VOCAB)
    return -jnp.mean(jnp.sum(targets * jax.nn.log_softmax(logits), -1))

  return lm


class ModelsConformanceTest(parameterized.TestCase):
  def test_resnet18_train_and_eval(self):
    x = jax.random.normal(KEY, [1, 16, 16, 3])
    compare(self, image_net(True), image_net(False), (x, True), [(x, True), (x, False)])

  def test_resnet18_eval(self):
    x = jax.random.normal(KEY, [1, 16, 16, 3])
    compare(self, image_net(True), image_net(False), (x, True), [(x, False)])

  def test_mlp_with_dropout(self):
    x = jax.random.normal(KEY, [3, 4])
    params, _ = compare(self, mlp_net(True), mlp_net(False), (x,), [(x,)])
    self.assertIn("mlp_1/~/linear_0", params)

  def test_transformer_language_model(self):
    tokens = jax.random.randint(KEY, [2, SEQ], 0, VOCAB)
    compare(
      self,
      language_model(True),
      language_model(False),
      (tokens, True),
      [(tokens, True), (tokens, False)],
    )

  @parameterized.named_parameters(("plain", False), ("remat", True))
  def test_transformer_block_layer_scan_vs_layer_stack(self, remat):

    def ours(h):
      return hkb.layer_scan(
        lambda c, _: (transformer_block(c), None), h, num_layers=3, remat=remat
      )[0]

    def theirs(h):
      block = hk.remat(transformer_block) if remat else transformer_block
      return hk.layer_stack(3)(block)(h)

    h = jax.random.normal(KEY, [2, SEQ, D_MODEL])
    params, _ = compare(self, ours, theirs, (h,), [(h,)])
    self.assertEqual(
      params["__layer_stack_no_per_layer/linear"]["w"].shape, (3, D_MODEL, 4 * D_MODEL)
    )


if __name__ == "__main__":
  absltest.main()
