"""The apply path of issue 10: cold, warm, in a fresh process, with and without getters.

Each case runs a bridged model (`hkb.call_pure`, `hkb.custom_vjp`,
`hkb.repeat_layer`) and its reference (the same code inline, or
`hk.layer_stack` for `repeat_layer`) and compares params, state, outputs and
gradients. Each is run

- cold: every cache of the bridge cleared before init and again before apply
  (`hkb.clear_caches`, when the library has it);
- in a fresh process, where `init` never ran: params restored from saved
  arrays, only the apply program runs, every cache of the bridge cleared
  first (`test_utils.FreshProcess`: one child serves all such cases);
- warm: the apply program run twice in one process after init;

and each of these with and without an identity `hk.custom_getter`, which must
change nothing. Init runs eagerly; the apply program runs as one `jax.jit`,
traced afresh each time (a new jit per run: cold and warm are about the
bridge's caches, not jax's), and the reference's results are computed once
per (case, reference), without the getter: an identity getter changes nothing
inline, so the bridged runs with one must equal them as well.

The cases: `hk.BatchNorm` and a small `hk.nets.ResNet` initialised with
`is_training=True` and applied with `False` (the ResNet trained one step first,
its `custom_vjp` gradient from `hkb.vjp_fwd` and `lambda vjp_fn, g: vjp_fn(g)`
equal to inline's); a block whose modules depend on the input width, bridged
twice and applied at a new batch size and at init's own; bf16 inputs with f32
params; and a key-path name (`{"linear": ...}`) followed by an inline
`hk.Linear` in the same module, which must get a fresh name or an error, never
share the bridged weights.
"""

import dataclasses
import functools
import os
from typing import Any, Callable, Optional

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
TOL = dict(rtol=1e-5, atol=1e-5)


def clear_caches() -> None:
  """Clears every cache of the bridge, when the library offers it."""
  clear = getattr(hkb, "clear_caches", None)
  if clear is not None:
    clear()


def identity_getter(next_getter, value, context):
  del context
  return next_getter(value)


def true_vjp(f, nondiff_argnums=()):
  return hkb.custom_vjp(
    f, hkb.vjp_fwd, lambda vjp_fn, g: vjp_fn(g), nondiff_argnums=nondiff_argnums
  )


# .npz has no bfloat16: such arrays are saved as float32, under a key that
# says so (so a dtype that differs still shows as a differing key).
BF16 = "@bfloat16"


def flat(tree: Any, prefix: str) -> dict[str, np.ndarray]:
  """`{prefix + keystr: array}`: any result tree as named arrays (for .npz)."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    key = prefix + jax.tree_util.keystr(path)
    if leaf.dtype == jnp.bfloat16:
      key, leaf = key + BF16, leaf.astype(jnp.float32)
    out[key] = np.asarray(leaf)
  return out


def haiku_dicts(arrays: dict[str, np.ndarray], prefix: str) -> dict:
  """Params or state saved by `flat` (`[bundle][name]` keys) as Haiku dicts."""
  out = {}
  for key, value in arrays.items():
    if key.startswith(prefix):
      value = jnp.asarray(value)
      if key.endswith(BF16):
        key, value = key[: -len(BF16)], value.astype(jnp.bfloat16)
      bundle, name = key[len(prefix) + 2 : -2].split("']['")
      out.setdefault(bundle, {})[name] = value
  return out


@dataclasses.dataclass(frozen=True)
class Case:
  """A model, its bridged variants, and the apply program run on each.

  `model(kind, getter)` builds the Haiku function for `kind` (a bridged kind,
  or "inline" / "layer_stack", the references). `program(f, params, state)`
  only applies `f` (never inits): it is all a fresh process runs.
  """

  name: str
  kinds: dict[str, Optional[str]]  # Bridged kind: its reference kind.
  model: Callable[[str, bool], Callable[..., Any]]
  init_args: Callable[[], tuple[Any, ...]]
  program: Callable[[hk.TransformedWithState, Any, Any], dict[str, Any]]

  def transformed(self, kind: str, getter: bool) -> hk.TransformedWithState:
    f = self.model(kind, getter)
    if getter:
      inner = f

      def f(*args):
        with hk.custom_getter(identity_getter, state=True):
          return inner(*args)

    return hk.transform_with_state(f)

  def run(self, f: hk.TransformedWithState, params, state) -> dict[str, Any]:
    """`program` as one jit, traced afresh: each call runs the bridge again."""
    return jax.jit(functools.partial(self.program, f))(params, state)


# ---------------------------------------------------------------------------
# Case: hk.BatchNorm initialised for training, applied for evaluation.
# ---------------------------------------------------------------------------


def bn_layer(x, is_training):
  h = hk.Linear(x.shape[-1])(x)
  h = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(
    h, is_training=is_training
  )
  return x + jax.nn.relu(h)


BN_LAYER = hk.transform_with_state(bn_layer)
BN_LAYER_VJP = true_vjp(bn_layer, nondiff_argnums=(1,))


def bn_model(kind, getter):
  del getter

  def f(x, is_training):
    if kind == "call_pure":
      return hkb.call_pure(BN_LAYER, x, is_training=is_training)
    if kind == "custom_vjp":
      return BN_LAYER_VJP(x, is_training)
    if kind == "repeat_layer":
      return hkb.repeat_layer(lambda h: bn_layer(h, is_training), x, 2)
    if kind == "layer_stack":
      return hk.layer_stack(2)(lambda h: bn_layer(h, is_training))(x)
    return bn_layer(x, is_training)

  return f


def train_then_eval(x):
  """One SGD step in training mode (its gradients returned), then evaluation."""

  def program(f, params, state):
    def loss(p):
      out, new_state = f.apply(p, state, None, x, True)
      return jnp.sum(jnp.square(out)), new_state

    (value, new_state), grads = jax.value_and_grad(loss, has_aux=True)(params)
    trained = jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)
    evaluated, eval_state = f.apply(trained, new_state, None, x, False)
    # And evaluation straight from init's state (the row).
    at_init, _ = f.apply(params, state, None, x, False)
    return {
      "loss": value,
      "grads": grads,
      "train_state": new_state,
      "eval": evaluated,
      "eval_state": eval_state,
      "eval_at_init": at_init,
    }

  return program


# ---------------------------------------------------------------------------
# Case: a small hk.nets.ResNet trained one step, then evaluated.
# ---------------------------------------------------------------------------

IMAGE_SHAPE = (1, 16, 16, 3)


def resnet(x, is_training):
  """ResNet18's modules (`hk.nets.ResNet18`'s config), fewer and narrower.

  What the apply path meets in ResNet18 is all here: the initial conv and
  batch norm, a block group of two blocks without projection (`block_0`,
  `block_1`), groups whose block projects and strides, batch norm state in
  every block, the logits. With 5 blocks of 8 to 16 channels (ResNet18: 8 of
  64 to 512) its 18 cases take two thirds of ResNet18's CPU time (CI has two
  cores); ResNet18 itself runs through `hkb.call_pure` in
  models_conformance_test.
  """
  return hk.nets.ResNet(
    blocks_per_group=(2, 1, 1, 1),
    num_classes=4,
    bottleneck=False,
    channels_per_group=(8, 8, 16, 16),
    use_projection=(False, True, True, True),
    initial_conv_config={"output_channels": 8},
  )(x, is_training=is_training)


RESNET = hk.transform_with_state(resnet)
RESNET_VJP = true_vjp(resnet, nondiff_argnums=(1,))


def resnet_model(kind, getter):
  del getter

  def layer(is_training):
    # A repeatable layer: the image passes through, the logits add up.
    def apply_layer(carry):
      image, logits = carry
      return image, logits + resnet(image, is_training)

    return apply_layer

  def f(x, is_training):
    if kind == "call_pure":
      return hkb.call_pure(RESNET, x, is_training=is_training)
    if kind == "custom_vjp":
      return RESNET_VJP(x, is_training)
    start = (x, jnp.zeros([x.shape[0], 4]))
    if kind == "repeat_layer":
      return hkb.repeat_layer(layer(is_training), start, 2)[1]
    if kind == "layer_stack":
      return hk.layer_stack(2)(layer(is_training))(start)[1]
    return resnet(x, is_training)

  return f


# ---------------------------------------------------------------------------
# Case: a block whose modules depend on its input width, bridged twice.
# ---------------------------------------------------------------------------


def width_block(x):
  if x.shape[-1] != 8:
    x = hk.Linear(8, name="proj")(x)
  return jnp.tanh(hk.Linear(8)(x))


WIDTH_BLOCK = hk.transform(width_block)
WIDTH_BLOCK_VJP = true_vjp(width_block)


def width_model(kind, getter):
  del getter

  def f(x):
    if kind == "call_pure":
      h = hkb.call_pure(WIDTH_BLOCK, x)
      return hkb.call_pure(WIDTH_BLOCK, h)
    if kind == "custom_vjp":
      return WIDTH_BLOCK_VJP(WIDTH_BLOCK_VJP(x))
    return width_block(width_block(x))

  return f


def width_program(f, params, state):
  results = {}
  for batch in (2, 3):  # init's own batch size, and a new one.
    x = jax.random.normal(jax.random.PRNGKey(batch), [batch, 16])
    out, _ = f.apply(params, state, None, x)
    grads = jax.grad(lambda p, x=x: jnp.sum(f.apply(p, state, None, x)[0]))(params)
    results[f"out_batch{batch}"] = out
    results[f"grads_batch{batch}"] = grads
  return results


# ---------------------------------------------------------------------------
# Case: bf16 inputs, f32 params.
# ---------------------------------------------------------------------------


def bf16_mlp(x):
  return hk.nets.MLP([8, 4])(x)


BF16_MLP = hk.transform(bf16_mlp)
BF16_MLP_VJP = true_vjp(bf16_mlp)


def bf16_model(kind, getter):
  del getter

  def f(x):
    if kind == "call_pure":
      return hkb.call_pure(BF16_MLP, x)
    if kind == "custom_vjp":
      return BF16_MLP_VJP(x)
    return bf16_mlp(x)

  return f


def bf16_program(f, params, state):
  x = jax.random.normal(KEY, [2, 4]).astype(jnp.bfloat16)
  out, _ = f.apply(params, state, None, x)
  grads = jax.grad(lambda p: jnp.sum(f.apply(p, state, None, x)[0].astype(jnp.float32)))(params)
  return {"out": out, "grads": grads}


# ---------------------------------------------------------------------------
# Case: a key-path name, then an inline module of the same name.
# ---------------------------------------------------------------------------


def keyed_linear(params, x):
  return x @ params["linear"]["w"]


def init_keyed_linear(rng, x):
  return {"linear": {"w": jax.random.normal(rng, [x.shape[-1], 4])}}


class Net(hk.Module):
  def __call__(self, x):
    a = hkb.call_pure(keyed_linear, x, init=init_keyed_linear)
    return a, hk.Linear(4)(x)


def keyed_model(kind, getter):
  del kind, getter
  return lambda x: Net()(x)


def keyed_program(f, params, state):
  x = jax.random.normal(KEY, [2, 4])
  return {"outs": f.apply(params, state, None, x)[0]}


# ---------------------------------------------------------------------------

CASES = {
  "batchnorm": Case(
    "batchnorm",
    {"call_pure": "inline", "custom_vjp": "inline", "repeat_layer": "layer_stack"},
    bn_model,
    lambda: (jax.random.normal(KEY, [4, 8]), True),
    train_then_eval(jax.random.normal(jax.random.PRNGKey(1), [4, 8])),
  ),
  "resnet": Case(
    "resnet",
    {"call_pure": "inline", "custom_vjp": "inline", "repeat_layer": "layer_stack"},
    resnet_model,
    lambda: (jax.random.normal(KEY, IMAGE_SHAPE), True),
    train_then_eval(jax.random.normal(jax.random.PRNGKey(1), IMAGE_SHAPE)),
  ),
  "width_dependent_block": Case(
    "width_dependent_block",
    {"call_pure": "inline", "custom_vjp": "inline"},
    width_model,
    lambda: (jax.random.normal(KEY, [2, 16]),),
    width_program,
  ),
  "bf16_inputs": Case(
    "bf16_inputs",
    {"call_pure": "inline", "custom_vjp": "inline"},
    bf16_model,
    lambda: (jax.random.normal(KEY, [2, 4]).astype(jnp.bfloat16),),
    bf16_program,
  ),
  "key_path_then_inline": Case(
    "key_path_then_inline",
    {"call_pure": None},
    keyed_model,
    lambda: (jax.random.normal(KEY, [2, 4]),),
    keyed_program,
  ),
}

TEMPERATURES = ("cold", "subprocess", "warm")


@functools.cache
def reference_results(case_name: str, kind: str):
  """The reference's params, state and flat results, once per process."""
  case = CASES[case_name]
  reference = case.transformed(kind, getter=False)
  params, state = reference.init(KEY, *case.init_args())
  return params, state, flat(case.run(reference, params, state), "results")


def _parameters():
  for case in CASES.values():
    for kind in case.kinds:
      for temperature in TEMPERATURES:
        for getter in (False, True):
          yield (
            f"{case.name}_{kind}_{temperature}{'_getter' if getter else ''}",
            case.name,
            kind,
            temperature,
            getter,
          )


def _child_main(case_name, kind, getter, in_path, out_path):
  """In a fresh process: restore params and state, run the apply program.

  One child serves every such case of a test process (a process start and a
  jax import each would cost more than the cases): init never runs in it, and
  each case finds the bridge's caches empty, as in a process of its own.
  """
  clear_caches()
  case = CASES[case_name]
  getter = getter == "True"
  with np.load(in_path) as saved:
    saved = dict(saved)
  params, state = haiku_dicts(saved, "params"), haiku_dicts(saved, "state")
  results = case.run(case.transformed(kind, getter), params, state)
  np.savez(out_path, **flat(results, "results"))


class ApplyPathTest(parameterized.TestCase):
  _child = None  # The fresh process of the "subprocess" cases, when started.

  @classmethod
  def tearDownClass(cls):
    if cls._child is not None:
      cls._child.close()
      cls._child = None
    super().tearDownClass()

  def _run_in_fresh_process(self, case, kind, getter, params, state):
    tmp = self.create_tempdir().full_path
    in_path = os.path.join(tmp, "checkpoint.npz")
    out_path = os.path.join(tmp, "results.npz")
    np.savez(in_path, **flat(params, "params"), **flat(state, "state"))
    if ApplyPathTest._child is None:
      ApplyPathTest._child = test_utils.FreshProcess(__file__, "_child_main")
    error = ApplyPathTest._child.call(case.name, kind, str(getter), in_path, out_path)
    if error is not None:
      self.fail(f"apply in a fresh process failed:\n{error}")
    with np.load(out_path) as results:
      return dict(results)

  @parameterized.named_parameters(*_parameters())
  def test_apply_path(self, case_name, kind, temperature, getter):
    case = CASES[case_name]
    reference_kind = case.kinds[kind]
    ours = case.transformed(kind, getter)
    if temperature != "warm":
      clear_caches()

    try:
      params, state = ours.init(KEY, *case.init_args())
    except ValueError:
      if reference_kind is None:  # An error is an accepted answer here.
        return
      raise

    if reference_kind is None:
      self._check_keyed(params, state, temperature, case, kind, getter)
      return

    ref_params, ref_state, expected = reference_results(case_name, reference_kind)
    chex.assert_trees_all_equal(params, ref_params)
    chex.assert_trees_all_equal(state, ref_state)
    self.assertEqual(sorted(params), sorted(ref_params))

    if temperature == "subprocess":
      # A checkpoint of the reference, restored where init never ran.
      actual = self._run_in_fresh_process(case, kind, getter, ref_params, ref_state)
    else:
      if temperature == "cold":
        clear_caches()
      actual = flat(case.run(ours, ref_params, ref_state), "results")
      if temperature == "warm":
        actual = flat(case.run(ours, ref_params, ref_state), "results")

    self.assertEqual(sorted(actual), sorted(expected))
    for name, value in expected.items():
      self.assertEqual(actual[name].dtype, value.dtype, msg=name)
      np.testing.assert_allclose(actual[name], value, err_msg=name, **TOL)

  def _check_keyed(self, params, state, temperature, case, kind, getter):
    # The bridged `net/linear/w` and hk.Linear's weights must be two params.
    self.assertLen(
      [p for p in jax.tree.leaves(params) if p.shape == (4, 4)],
      2,
      msg=jax.tree.map(jnp.shape, params),
    )
    linear = [b for b in params if "b" in params[b]]
    self.assertLen(linear, 1)
    if temperature == "subprocess":
      results = self._run_in_fresh_process(case, kind, getter, params, state)
      a, b = results["results['outs'][0]"], results["results['outs'][1]"]
    else:
      if temperature == "cold":
        clear_caches()
      runs = 2 if temperature == "warm" else 1
      for _ in range(runs):
        a, b = case.run(case.transformed(kind, getter), params, state)["outs"]
    x = jax.random.normal(KEY, [2, 4])
    bridged_w = [params[bundle]["w"] for bundle in params if bundle not in linear]
    np.testing.assert_allclose(a, x @ bridged_w[0], **TOL)
    w, bias = params[linear[0]]["w"], params[linear[0]]["b"]
    np.testing.assert_allclose(b, x @ w + bias, **TOL)


if __name__ == "__main__":
  absltest.main()
