"""Tests for hlo_flops: rolled loops against XLA's own count of the same program unrolled."""

from absl.testing import absltest
import jax
import jax.numpy as jnp

from haiku_bridge._src.remat import hlo_flops

W = jnp.linspace(-1, 1, 32 * 32).reshape(32, 32)
H = jnp.zeros([4, 32])
XS = jnp.ones([8, 4, 32])


def step(h, x):
  h = jnp.tanh(h @ W + x)
  return h, jnp.sum(h ** 2)


# XLA's CPU count is the ground truth of the convolution tests, on any
# backend (XLA:GPU's cost analysis does not count cuDNN's calls).
CPU = jax.devices("cpu")[0]


def compiled(f, *args, device=None):
  """`f` compiled for `args`, on `device` (default: the default backend)."""
  if device is not None:
    args = jax.device_put(args, device)
  return jax.jit(f).lower(*args).compile()


def ours(f, *args, device=None) -> hlo_flops.Count:
  return hlo_flops.count(compiled(f, *args, device=device).as_text())


def xla(f, *args, device=None) -> float:
  """XLA's count, right where no loop is left (transcendentals as FLOPs)."""
  analysis = compiled(f, *args, device=device).cost_analysis()
  return analysis["flops"] + analysis.get("transcendentals", 0.0)


def convolutions():
  """`(name, f, x, k)`: 2D convolutions and their gradients, padded, strided, dilated, grouped."""
  for strides, padding, dilation, groups in (
      ((1, 1), "SAME", (1, 1), 1), ((2, 2), ((1, 0), (1, 1)), (1, 1), 1),
      ((1, 1), "SAME", (2, 2), 1), ((1, 1), "VALID", (1, 1), 2)):
    conv = lambda x, k, s=strides, p=padding, d=dilation, g=groups: (
        jax.lax.conv_general_dilated(
            x, k, s, p, rhs_dilation=d, feature_group_count=g,
            dimension_numbers=("NHWC", "HWIO", "NHWC")))
    x, k = jnp.ones([2, 10, 10, 8]), jnp.ones([3, 3, 8 // groups, 6])
    name = f"{strides} {padding} {dilation} {groups}"
    yield name, conv, x, k
    yield name + " gradients", jax.grad(
        lambda x, k, conv=conv: jnp.sum(conv(x, k) ** 2), (0, 1)), x, k


def gradient(body, unroll=1):
  """The gradient of a loss of a scan of `body` over `XS`."""
  def loss(h, xs):
    h, ys = jax.lax.scan(body, h, xs, unroll=unroll)
    return jnp.sum(ys) + jnp.sum(h)
  return jax.grad(loss, argnums=(0, 1))


def nested(unroll=1):
  """The gradient of a scan over 2 scans of 4 steps each."""
  def loss(h, xs):
    inner = lambda h, xs: jax.lax.scan(step, h, xs, unroll=unroll)
    h, ys = jax.lax.scan(inner, h, xs.reshape(2, 4, *xs.shape[1:]),
                         unroll=unroll)
    return jnp.sum(ys) + jnp.sum(h)
  return jax.grad(loss, argnums=(0, 1))


def cudnn_convolution(target: str, operands: tuple[str, str], result: str,
                      window: str, groups: int) -> str:
  """A program of one cuDNN convolution custom-call, as XLA:GPU writes it."""
  layout = lambda t: t + "{3,2,1,0}"
  params = ", ".join(f"p{i}: {t}" for i, t in enumerate(operands))
  lines = [f"  %p{i} = {layout(t)} parameter({i})"
           for i, t in enumerate(operands)]
  grouped = f", feature_group_count={groups}" if groups > 1 else ""
  return "\n".join([
      "HloModule m", "",
      f"ENTRY %main ({params}) -> {result} {{", *lines,
      f"  %c = ({layout(result)}, u8[0]{{0}}) custom-call(%p0, %p1), "
      f"window={{{window}}}, dim_labels=b01f_o01i->b01f{grouped}, "
      f'custom_call_target="__cudnn${target}", backend_config='
      '{"cudnn_conv_backend_config":{"activation_mode":"kNone",'
      '"algorithm":{"algo_id":"28","is_cudnn_frontend":false,"math_type":'
      '"DEFAULT_MATH","tuning_knobs":{},"workspace_size":"0"},'
      '"conv_result_scale":1,"leakyrelu_alpha":0,"side_input_scale":0},'
      '"device_type":"DEVICE_TYPE_INVALID","force_earliest_schedule":false,'
      '"operation_queue_id":"0","reification_cost":[]}',
      f"  ROOT %r = {layout(result)} get-tuple-element(%c), index=0", "}",
      ""])


class CountTest(absltest.TestCase):

  def test_one_matmul_and_one_convolution_by_hand(self):
    a, b = jnp.ones([4, 8]), jnp.ones([8, 3])
    self.assertEqual(ours(jnp.matmul, a, b).flops, 2 * 4 * 3 * 8)
    image, kernel = jnp.ones([1, 6, 6, 2]), jnp.ones([3, 3, 2, 5])
    conv = lambda x, k: jax.lax.conv_general_dilated(
        x, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    # Each of the 1·4·4·5 outputs: 3·3·2 multiply-adds.
    self.assertEqual(ours(conv, image, kernel).flops, 2 * (4 * 4 * 5) * 18)

  def test_a_call_counts_its_computation(self):
    # XLA:CPU wraps a small loop in a `call` (`to_apply=`), as here.
    text = """HloModule m
%c (p: f32[4,8], q: f32[8,3]) -> f32[4,3] {
  %p = f32[4,8]{1,0} parameter(0)
  %q = f32[8,3]{1,0} parameter(1)
  ROOT %d = f32[4,3]{1,0} dot(%p, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[4,8], b: f32[8,3]) -> f32[4,3] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,3]{1,0} parameter(1)
  ROOT %r = f32[4,3]{1,0} call(%a, %b), to_apply=%c
}
"""
    self.assertEqual(hlo_flops.count(text).flops, 2 * 4 * 3 * 8)

  def test_a_gpu_matmul_custom_call_counts_as_a_dot(self):
    # XLA:GPU writes a matmul as a cuBLAS custom-call with a workspace
    # result; a library call of no known cost is named instead.
    text = """HloModule m
ENTRY %main (a: f32[2,4,8], b: f32[2,8,3], x: f32[4,4]) -> f32[2,4,3] {
  %a = f32[2,4,8]{2,1,0} parameter(0)
  %b = f32[2,8,3]{2,1,0} parameter(1)
  %x = f32[4,4]{1,0} parameter(2)
  %g = (f32[2,4,3]{2,1,0}, s8[4194304]{0}) custom-call(f32[2,4,8]{2,1,0} %a, f32[2,8,3]{2,1,0} %b), custom_call_target="__cublas$gemm", backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0"],"rhs_batch_dimensions":["0"]},"alpha_imag":0,"epilogue":"DEFAULT"},"force_earliest_schedule":false}
  %c = (f32[4,4]{1,0}, s32[4]{0}, s32[]) custom-call(f32[4,4]{1,0} %x), custom_call_target="cusolver_getrf_ffi", api_version=API_VERSION_TYPED_FFI
  ROOT %r = f32[2,4,3]{2,1,0} get-tuple-element(%g), index=0
}
"""
    got = hlo_flops.count(text)
    self.assertEqual(got.flops, 2 * (2 * 4 * 3) * 8)
    self.assertEqual(got.opaque_custom_calls, ("cusolver_getrf_ffi",))

  def test_gpu_convolutions_count_as_xla_counts_them_on_cpu(self):
    # XLA:GPU runs a convolution and its two transposes as cuDNN
    # custom-calls, written below as XLA:GPU writes them (jax 0.11.2, an
    # H200: the kernel laid out o01i, a workspace result, the forward
    # convolution's window and dim_labels on each call). The ground truth:
    # XLA's count of the same convolution and transposes on CPU.
    for window, groups, (x_shape, k_shape, y_shape) in (
        ("size=3x3 pad=1_1x1_1", 1, ((2, 9, 9, 4), (3, 3, 4, 8),
                                     (2, 9, 9, 8))),
        ("size=3x3 stride=2x2 pad=1_1x1_1", 1, ((2, 9, 9, 4), (3, 3, 4, 6),
                                                (2, 5, 5, 6))),
        ("size=3x3", 2, ((2, 8, 8, 8), (3, 3, 4, 8), (2, 6, 6, 8)))):
      stride = 2 if "stride" in window else 1
      x, k = jnp.ones(x_shape), jnp.ones(k_shape)
      conv = lambda x, k, s=stride, g=groups: jax.lax.conv_general_dilated(
          x, k, (s, s), "VALID" if g > 1 else ((1, 1), (1, 1)),
          dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=g)
      y = conv(x, k)
      self.assertEqual(y.shape, y_shape)
      d_x = lambda y, k: jax.linear_transpose(lambda x: conv(x, k), x)(y)[0]
      d_k = lambda x, y: jax.linear_transpose(lambda k: conv(x, k), k)(y)[0]
      h, w, i, o = k_shape  # HWIO on CPU, o01i on GPU:
      gpu_k = f"f32[{o},{h},{w},{i}]"
      x_t, y_t = (f"f32[{','.join(map(str, s))}]" for s in (x_shape,
                                                              y_shape))
      for target, operands, result, truth in (
          ("convForward", (x_t, gpu_k), y_t, xla(conv, x, k, device=CPU)),
          ("convBackwardInput", (y_t, gpu_k), x_t,
           xla(d_x, y, k, device=CPU)),
          ("convBackwardFilter", (x_t, y_t), gpu_k,
           xla(d_k, x, y, device=CPU))):
        got = hlo_flops.count(cudnn_convolution(target, operands, result,
                                                window, groups))
        self.assertEqual(got.opaque_custom_calls, ())
        self.assertAlmostEqual(got.flops / truth, 1, delta=0.02,
                               msg=(target, window))

  def test_convolutions_count_only_real_inputs_as_xla_does(self):
    # On CPU: the convolution, and its gradients (XLA writes those as
    # convolutions with dilated or padded inputs, and batch groups).
    for name, f, x, k in convolutions():
      self.assertAlmostEqual(ours(f, x, k, device=CPU).flops /
                             xla(f, x, k, device=CPU), 1, delta=0.02, msg=name)

  @absltest.skipUnless(jax.default_backend() == "gpu",
                       "XLA:GPU writes convolutions as cuDNN custom-calls")
  def test_a_gpu_programs_convolutions_count_as_xla_counts_them_on_cpu(self):
    for name, f, x, k in convolutions():
      if "((1, 0)" in name:
        # XLA:GPU pads this input itself, and cuDNN multiplies the zeros.
        continue
      text = compiled(f, x, k).as_text()
      self.assertIn("__cudnn$conv", text, name)
      self.assertAlmostEqual(hlo_flops.count(text).flops /
                             xla(f, x, k, device=CPU), 1, delta=0.02, msg=name)

  def test_rolled_loops_count_as_xla_counts_them_unrolled(self):
    scan = lambda unroll: (lambda h, xs: jax.lax.scan(step, h, xs,
                                                      unroll=unroll))
    for name, make in (("scan", scan), ("gradient", lambda u: gradient(
        step, u)), ("nested", nested)):
      rolled = ours(make(1), H, XS)
      self.assertEqual(rolled.unknown_trip_counts, 0, name)
      self.assertEqual(rolled.conditionals, (), name)
      # XLA's count of the rolled loop sees one step of 8.
      self.assertLess(xla(make(1), H, XS), rolled.flops / 4, name)
      self.assertAlmostEqual(rolled.flops / xla(make(True), H, XS), 1,
                             delta=0.02, msg=name)

  def test_a_checkpointed_scan_counts_one_more_forward_per_step(self):
    # Unrolled, XLA merges the recomputation with the forward pass, so the
    # ground truth is the plain gradient unrolled and, for each step, the
    # forward of its carry that jax.checkpoint runs again.
    recompute = xla(lambda h, x: step(h, x)[0], H, XS[0])
    expected = xla(gradient(step, True), H, XS) + len(XS) * recompute
    got = ours(gradient(jax.checkpoint(step)), H, XS).flops
    self.assertAlmostEqual(got / expected, 1, delta=0.02)

  def test_a_conditional_counts_its_cheapest_branch_and_lists_all(self):
    def f(h, xs):
      def body(h, x):
        h = jax.lax.cond(jnp.sum(x) > 0, lambda: h @ W, lambda: h + 1.0)
        return h, None
      return jax.lax.scan(body, h, xs)[0]
    count = ours(f, H, XS)
    (conditional,) = count.conditionals
    self.assertEqual(conditional.executions, 8)
    dot = 2 * 4 * 32 * 32
    self.assertEqual(max(conditional.branches), dot)
    self.assertLess(min(conditional.branches), dot / 10)
    self.assertLess(count.flops, dot)


if __name__ == "__main__":
  absltest.main()
