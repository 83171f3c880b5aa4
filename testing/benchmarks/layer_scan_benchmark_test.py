"""The layer scan benchmark's readers: op kinds from compiled HLO, gradients by layer, its tables."""

import contextlib
import io
import json
import os

from absl.testing import absltest
import haiku as hk
import jax
from jax import ad_checkpoint
import jax.numpy as jnp
import numpy as np

from testing.benchmarks import layer_scan_benchmark as lsb


class DeviceTimeTest(absltest.TestCase):
  def test_on_the_cpu_each_op_is_timed_as_its_thunk_ran(self):
    # A scan's loop and the ops of its body, named as the compiled program names them.
    def f(w, xs):
      body = lambda h, x: (jnp.tanh(h @ w + x), h.sum())
      return jax.lax.scan(body, jnp.zeros((64, 256)), xs)[1].sum()

    args = jnp.ones((256, 256)), jnp.ones((50, 64, 256))
    compiled = jax.jit(f).lower(*args).compile()
    per_op = lsb.device_time_by_op(compiled, args)
    kinds = lsb._op_kinds(compiled.as_text())  # pylint: disable=protected-access
    self.assertNotEmpty(per_op)
    self.assertContainsSubset(per_op, kinds)  # Instructions only, none of the host's own events.
    self.assertIn("loop", {kinds[name] for name in per_op})
    self.assertGreater(lsb.by_kind(compiled.as_text(), per_op).get("matmuls", 0.0), 0.0)


class OpKindsTest(absltest.TestCase):
  def test_a_scans_stacked_outputs_and_its_matmul_are_told_apart(self):
    def f(w, xs):
      def body(h, x):
        h = jnp.tanh(h @ w + x)
        return h, h * 2  # ys: stored into a stacked buffer, one row per step.

      return jax.lax.scan(body, jnp.zeros(8), xs)[1].sum()

    hlo = jax.jit(f).lower(jnp.ones((8, 8)), jnp.ones((5, 8))).compile().as_text()
    kinds = set(lsb._op_kinds(hlo).values())
    self.assertContainsSubset({"loop", "stacked stores", "matmuls"}, kinds)

  def test_a_matmul_fused_with_a_store_into_a_stack_is_told_apart(self):
    hlo = """HloModule m

%fused_store (p0: f32[4,8], p1: f32[8,8], p2: s32[]) -> f32[4,8] {
  %p0 = f32[4,8] parameter(0)
  %p1 = f32[8,8] parameter(1)
  %p2 = s32[] parameter(2)
  %dot.1 = f32[1,8] dot(%p1, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %zero = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = f32[4,8] dynamic-update-slice(%p0, %dot.1, %p2, %zero)
}

%fused_mul (p0: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8] parameter(0)
  ROOT %multiply.1 = f32[8,8] multiply(%p0, %p0)
}

ENTRY %main (a: f32[4,8], b: f32[8,8], i: s32[]) -> f32[4,8] {
  %a = f32[4,8] parameter(0)
  %b = f32[8,8] parameter(1)
  %i = s32[] parameter(2)
  %mul = f32[8,8] fusion(%b), kind=kLoop, calls=%fused_mul
  ROOT %store = f32[4,8] fusion(%a, %mul, %i), kind=kOutput, calls=%fused_store
}
"""
    kinds = lsb._op_kinds(hlo)
    self.assertEqual(kinds["store"], "matmuls storing to stacks")
    self.assertEqual(kinds["mul"], "other")

  def test_a_program_without_loops_has_no_stacked_ops(self):
    hlo = jax.jit(lambda a, b: jnp.tanh(a @ b)).lower(jnp.ones((4, 4)), jnp.ones((4, 4)))
    kinds = set(lsb._op_kinds(hlo.compile().as_text()).values())
    self.assertIn("matmuls", kinds)
    self.assertNoCommonElements({"loop", "stacked stores", "stacked reads"}, kinds)


class GradsTest(absltest.TestCase):
  def test_inline_layers_stack_in_their_order_past_ten(self):
    layers = 12
    inline = {f"layer_{i}/mlp": {"w": jnp.full((2,), i, jnp.bfloat16)} for i in range(layers)}
    inline["embed"] = {"embeddings": jnp.ones((3,))}
    inline = dict(sorted(inline.items()))  # As Haiku returns them: layer_10 before layer_2.
    stacked = {"layers/~/mlp": {"w": jnp.arange(layers)[:, None] * jnp.ones((1, 2))}}
    stacked["embed"] = {"embeddings": jnp.ones((3,))}
    a = lsb._flat_grads("inline", inline, layers)
    b = lsb._flat_grads("hk.layer_stack", stacked, layers)
    self.assertEqual(set(a), {"mlp/w", "embed/embeddings"})
    np.testing.assert_array_equal(a["mlp/w"], b["mlp/w"])
    self.assertEqual(lsb._grad_difference(a, b), 0.0)
    custom_jvp = lsb._flat_grads("inline" + lsb.SOFTMAX_CUSTOM_JVP, inline, layers)
    np.testing.assert_array_equal(custom_jvp["mlp/w"], a["mlp/w"])


class SoftmaxCustomJvpTest(absltest.TestCase):
  def test_the_form_keeps_one_seq_by_seq_array_a_layer_where_the_default_keeps_two(self):
    shape = lsb.size(small=True, layers=2)
    tokens = jnp.zeros([shape["batch"], shape["seq"] + 1], jnp.int32)
    # The attention's seq x seq arrays, stacked over the layers as the scan keeps them.
    square = f"[{shape['layers']},{shape['batch']},{shape['heads']},{shape['seq']},{shape['seq']}]"

    def kept(form):
      f = hk.transform(lsb.loss_fn(form, **shape))
      params = f.init(jax.random.PRNGKey(0), tokens)
      out = io.StringIO()
      with contextlib.redirect_stdout(out):
        ad_checkpoint.print_saved_residuals(lambda p: f.apply(p, None, tokens), params)
      return params, sum(square in line for line in out.getvalue().splitlines())

    params, default = kept("repeat_layer")
    custom_params, custom = kept("repeat_layer" + lsb.SOFTMAX_CUSTOM_JVP)
    # jax's softmax keeps exp's output and the probabilities; under the custom JVP (jax 0.12's
    # default, jax_softmax_custom_jvp), the probabilities alone.
    kept_by_default = 1 if getattr(jax.config, "jax_softmax_custom_jvp", False) else 2
    self.assertEqual((default, custom), (kept_by_default, 1))
    self.assertEqual(jax.tree.map(jnp.shape, custom_params), jax.tree.map(jnp.shape, params))


class ForwardedTest(absltest.TestCase):
  def test_the_form_is_the_scans_loss_and_gradients_its_matmuls_written_first(self):
    shape = lsb.size(small=True, layers=3)
    tokens = jax.random.randint(jax.random.PRNGKey(1), [shape["batch"], shape["seq"] + 1], 0, 64)
    form = "repeat_layer dots_saveable"
    params = hk.transform(lsb.loss_fn(form, **shape)).init(jax.random.PRNGKey(0), tokens)
    step = lambda form: jax.jit(
      jax.value_and_grad(hk.without_apply_rng(hk.transform(lsb.loss_fn(form, **shape))).apply)
    )
    want = step(form)(params, tokens)
    for ending in lsb.FORWARDED_SCANS:
      got = step(form + ending)(params, tokens)
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
    # The layers' saved matmul outputs go through their stacks: a barrier each.
    barriers = lambda form: step(form).lower(params, tokens).as_text().count("optimization_barrier")
    self.assertGreaterEqual(barriers(form + lsb.FORWARDED) - barriers(form), 5)


class ResultsTest(absltest.TestCase):
  def test_the_committed_tables_are_their_figures_written_out(self):
    results = os.path.join(os.path.dirname(__file__), "results")
    for run in ("profile", "forms", "softmax", "forwarded"):
      self._assert_written_out(os.path.join(results, "layer_scan_tpu_v5e", run))
    self._assert_written_out(os.path.join(results, "layer_scan_cpu", "forms"))

  def test_the_cpu_table_is_at_the_cpu_size(self):
    with open(
      os.path.join(os.path.dirname(__file__), "results", "layer_scan_cpu", "forms.json")
    ) as f:
      depths = json.load(f)["depths"]
    self.assertEqual([d["size"] for d in depths], [lsb.size(False, n, cpu=True) for n in (8, 24)])

  def _assert_written_out(self, stem: str) -> None:
    with open(f"{stem}.json") as f:
      figures = json.load(f)
    with open(f"{stem}.md") as f:
      self.assertEqual(lsb.markdown(figures), f.read().rstrip("\n"), stem)

  def test_a_tables_first_line_names_the_compilers_flags_a_run_set(self):
    path = os.path.join(
      os.path.dirname(__file__), "results", "layer_scan_tpu_v5e", "forwarded.json"
    )
    with open(path) as f:
      figures = json.load(f)
    figures["environment"]["LIBTPU_INIT_ARGS"] = "--xla_tpu_example=true"
    first = lsb.markdown(figures).splitlines()[0]
    self.assertIn("LIBTPU_INIT_ARGS='--xla_tpu_example=true'", first)
    self.assertNotIn("XLA_FLAGS", first)  # Set to '' there: not named.


if __name__ == "__main__":
  absltest.main()
