"""Tests for hlo_flops: rolled loops against XLA's own count of the same program unrolled."""

import dataclasses
import re
from typing import Any, NamedTuple, Optional

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src.remat import hlo_flops
from testing.flops_programs import CPU
from testing.flops_programs import H
from testing.flops_programs import LOOPS
from testing.flops_programs import W
from testing.flops_programs import XS
from testing.flops_programs import compiled
from testing.flops_programs import ours
from testing.flops_programs import unrolled
from testing.flops_programs import xla


def convolutions():
  """`(name, f, x, k)`: 2D convolutions and their gradients, padded, strided, dilated, grouped."""
  for strides, padding, dilation, groups in (
    ((1, 1), "SAME", (1, 1), 1),
    ((2, 2), ((1, 0), (1, 1)), (1, 1), 1),
    ((1, 1), "SAME", (2, 2), 1),
    ((1, 1), "VALID", (1, 1), 2),
  ):
    conv = lambda x, k, s=strides, p=padding, d=dilation, g=groups: jax.lax.conv_general_dilated(
      x, k, s, p, rhs_dilation=d, feature_group_count=g, dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    x, k = jnp.ones([2, 10, 10, 8]), jnp.ones([3, 3, 8 // groups, 6])
    name = f"{strides} {padding} {dilation} {groups}"
    yield name, conv, x, k
    yield (
      name + " gradients",
      jax.grad(lambda x, k, conv=conv: jnp.sum(conv(x, k) ** 2), (0, 1)),
      x,
      k,
    )


class _Analysis(NamedTuple):
  """The fields of a `compiled.memory_analysis()` that `temporaries` reads."""

  temp_size_in_bytes: int
  peak_memory_in_bytes: int
  argument_size_in_bytes: int
  output_size_in_bytes: int
  alias_size_in_bytes: int


# Objects, not NamedTuples: jax's trees would look inside those.
@dataclasses.dataclass(frozen=True)
class _ArgInfo:
  """A declared argument as `compiled.args_info` gives it."""

  shape: tuple[int, ...]
  dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class _Layout:
  """A layout as jax gives it (`jax.stages.Compiled.input_formats`)."""

  major_to_minor: tuple[int, ...]
  tiling: tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class _Format:
  layout: Optional[_Layout]
  sharding: Optional[jax.sharding.Sharding]


class _Compiled(NamedTuple):
  """What `lifted_bytes` reads of a compiled program, as a backend reports it."""

  args_info: Any
  input_formats: Any
  analysis: _Analysis

  def memory_analysis(self) -> _Analysis:
    return self.analysis


def held_on_the_device(array: np.ndarray) -> int:
  """The bytes the default device holds of `array`, as XLA reports them: a program's argument's."""
  return compiled(lambda a: a[0], array).memory_analysis().argument_size_in_bytes


def cudnn_convolution(
  target: str, operands: tuple[str, str], result: str, window: str, groups: int
) -> str:
  """A program of one cuDNN convolution custom-call, as XLA:GPU writes it."""
  layout = lambda t: t + "{3,2,1,0}"
  params = ", ".join(f"p{i}: {t}" for i, t in enumerate(operands))
  lines = [f"  %p{i} = {layout(t)} parameter({i})" for i, t in enumerate(operands)]
  grouped = f", feature_group_count={groups}" if groups > 1 else ""
  return "\n".join(
    [
      "HloModule m",
      "",
      f"ENTRY %main ({params}) -> {result} {{",
      *lines,
      f"  %c = ({layout(result)}, u8[0]{{0}}) custom-call(%p0, %p1), "
      f"window={{{window}}}, dim_labels=b01f_o01i->b01f{grouped}, "
      f'custom_call_target="__cudnn${target}", backend_config='
      '{"cudnn_conv_backend_config":{"activation_mode":"kNone",'
      '"algorithm":{"algo_id":"28","is_cudnn_frontend":false,"math_type":'
      '"DEFAULT_MATH","tuning_knobs":{},"workspace_size":"0"},'
      '"conv_result_scale":1,"leakyrelu_alpha":0,"side_input_scale":0},'
      '"device_type":"DEVICE_TYPE_INVALID","force_earliest_schedule":false,'
      '"operation_queue_id":"0","reification_cost":[]}',
      f"  ROOT %r = {layout(result)} get-tuple-element(%c), index=0",
      "}",
      "",
    ]
  )


F32_4_32, F32_8_4_32 = "f32[4,32]{1,0}", "f32[8,4,32]{2,1,0}"


def eight_steps(computations: str, *carry: str) -> str:
  """A program running `%body` of `computations` 8 times, as XLA writes a scan.

  The loop's carry: an s32 counter (index 0), then the entry's parameters,
  of types `carry`; the program returns the loop's carry.
  """
  types = ", ".join(("s32[]",) + carry)
  params = ", ".join(f"p{i}: {t}" for i, t in enumerate(carry))
  return "\n".join(
    [
      computations,
      "",
      f"%condition (arg.1: ({types})) -> pred[] {{",
      f"  %arg.1 = ({types}) parameter(0)",
      "  %i.1 = s32[] get-tuple-element(%arg.1), index=0",
      "  %constant_8 = s32[] constant(8)",
      "  ROOT %lt = pred[] compare(%i.1, %constant_8), direction=LT",
      "}",
      "",
      f"ENTRY %main ({params}) -> ({types}) {{",
      *(f"  %p{i} = {t} parameter({i})" for i, t in enumerate(carry)),
      "  %zero = s32[] constant(0)",
      f"  %init = ({types}) tuple(%zero, {', '.join(f'%p{i}' for i in range(len(carry)))})",
      f"  ROOT %while = ({types}) while(%init), condition=%condition, "
      "body=%body, backend_config={\"dynamic_variables\":[],"
      "\"known_induction_variable\":{\"tuple_index\":\"0\"},"
      "\"known_init_step\":{\"init\":\"0\",\"step\":\"1\"},"
      "\"known_trip_count\":{\"n\":\"8\"}}",
      "}",
      "",
    ]
  )


class CountTest(absltest.TestCase):
  def test_one_matmul_and_one_convolution_by_hand(self):
    a, b = jnp.ones([4, 8]), jnp.ones([8, 3])
    self.assertEqual(ours(jnp.matmul, a, b).flops, 2 * 4 * 3 * 8)
    image, kernel = jnp.ones([1, 6, 6, 2]), jnp.ones([3, 3, 2, 5])
    conv = lambda x, k: jax.lax.conv_general_dilated(
      x, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
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

  def test_an_asynchronous_fusion_counts_its_computation_once(self):
    # XLA:GPU runs a scan's store of each step's output as an asynchronous
    # fusion (jax 0.11.2, an H200): `fusion-start` runs the computation,
    # `fusion-done` hands over the whole buffer. By hand: one multiply of
    # [4,32] a step, 8 steps (the rest moves data or counts integers).
    # Counting the done as elementwise gave 8 × 8·4·32 instead, growing
    # with the square of the length.
    text = """HloModule m

%fused_update (param_0: f32[8,4,32], param_1: s32[], param_2: f32[4,32]) -> f32[8,4,32] {
  %param_0 = f32[8,4,32]{2,1,0} parameter(0)
  %param_2 = f32[4,32]{1,0} parameter(2)
  %constant_2 = f32[] constant(2)
  %broadcast = f32[4,32]{1,0} broadcast(%constant_2), dimensions={}
  %mul = f32[4,32]{1,0} multiply(%param_2, %broadcast), metadata={op_name="jit(f)/while/body/mul" stack_frame_id=3}
  %bitcast = f32[1,4,32]{2,1,0} bitcast(%mul)
  %param_1 = s32[] parameter(1)
  %constant_0 = s32[] constant(0)
  ROOT %dynamic-update-slice = f32[8,4,32]{2,1,0} dynamic-update-slice(%param_0, %bitcast, %param_1, %constant_0, %constant_0), backend_config={"dynamic_slice_config":{"byte_offset":"0","byte_stride":"512","loop_index":"0"}}
}

%fused_add (param_0.1: s32[]) -> s32[] {
  %param_0.1 = s32[] parameter(0)
  %constant_1 = s32[] constant(1)
  ROOT %add = s32[] add(%param_0.1, %constant_1)
}

%body (arg: (s32[], f32[4,32], f32[8,4,32])) -> (s32[], f32[4,32], f32[8,4,32]) {
  %arg = (s32[], f32[4,32]{1,0}, f32[8,4,32]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %h = f32[4,32]{1,0} get-tuple-element(%arg), index=1
  %ys = f32[8,4,32]{2,1,0} get-tuple-element(%arg), index=2
  %fusion-start = ((f32[8,4,32]{2,1,0}, s32[], f32[4,32]{1,0}), f32[8,4,32]{2,1,0}, u32[]) fusion-start(%ys, %i, %h), kind=kLoop, calls=%fused_update, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"native_emitter_backend_config":{"type":"NATIVE_EMITTER_TYPE_INVALID","unroll_factor":0}}
  %fusion-done = f32[8,4,32]{2,1,0} fusion-done(%fusion-start), backend_config={"operation_queue_id":"0","wait_on_operation_queues":[]}
  %next = s32[] fusion(%i), kind=kLoop, calls=%fused_add, control-predecessors={%fusion-done}
  ROOT %tuple = (s32[], f32[4,32]{1,0}, f32[8,4,32]{2,1,0}) tuple(%next, %h, %fusion-done)
}

"""
    self.assertEqual(hlo_flops.count(eight_steps(text, F32_4_32, F32_8_4_32)).flops, 8 * (4 * 32))

  def test_a_value_copied_into_two_fusions_counts_once(self):
    # XLA:GPU copies a cheap producer into each fusion that reads it: the
    # first step of a scan unrolled (jax 0.11.2, an H200) computes
    # tanh(h + xs[0]) in the matmul's (Triton) fusion and again in the
    # reduction's, its operands in another order. By hand, once each:
    # add, tanh, square and sum over 4·32 (128 each), the matmul 2·4·32·32.
    text = """HloModule m

%gemm_fusion_dot_general_computation (parameter_0: f32[4,32], parameter_1: f32[8,4,32], parameter_2: f32[32,32]) -> f32[4,32] {
  %parameter_0 = f32[4,32]{1,0} parameter(0)
  %parameter_1 = f32[8,4,32]{2,1,0} parameter(1)
  %slice.0 = f32[1,4,32]{2,1,0} slice(%parameter_1), slice={[0:1], [0:4], [0:32]}
  %bitcast.0 = f32[4,32]{1,0} bitcast(%slice.0)
  %add.0 = f32[4,32]{1,0} add(%parameter_0, %bitcast.0), metadata={op_name="jit(f)/add"}
  %tanh.0 = f32[4,32]{1,0} tanh(%add.0), metadata={op_name="jit(f)/tanh"}
  %parameter_2 = f32[32,32]{1,0} parameter(2)
  ROOT %dot_general.0 = f32[4,32]{1,0} dot(%tanh.0, %parameter_2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%region_sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_reduce_tanh (param_0: f32[8,4,32], param_1: f32[4,32]) -> (f32[], f32[4,32]) {
  %param_0 = f32[8,4,32]{2,1,0} parameter(0)
  %slice.1.clone = f32[1,4,32]{2,1,0} slice(%param_0), slice={[0:1], [0:4], [0:32]}
  %bitcast.1.clone = f32[4,32]{1,0} bitcast(%slice.1.clone)
  %param_1 = f32[4,32]{1,0} parameter(1)
  %add.1.clone = f32[4,32]{1,0} add(%bitcast.1.clone, %param_1), metadata={op_name="jit(f)/add"}
  %tanh.1.clone = f32[4,32]{1,0} tanh(%add.1.clone), metadata={op_name="jit(f)/tanh"}
  %square = f32[4,32]{1,0} multiply(%tanh.1.clone, %tanh.1.clone)
  %bitcast.2 = f32[128]{0} bitcast(%square)
  %constant_0 = f32[] constant(0)
  %reduce = f32[] reduce(%bitcast.2, %constant_0), dimensions={0}, to_apply=%region_sum
  ROOT %tuple = (f32[], f32[4,32]{1,0}) tuple(%reduce, %tanh.1.clone)
}

ENTRY %main (h: f32[4,32], xs: f32[8,4,32]) -> (f32[4,32], f32[]) {
  %h = f32[4,32]{1,0} parameter(0)
  %xs = f32[8,4,32]{2,1,0} parameter(1)
  %constant_w = f32[32,32]{1,0} constant({...})
  %gemm_fusion_dot_general = f32[4,32]{1,0} fusion(%h, %xs, %constant_w), kind=kCustom, calls=%gemm_fusion_dot_general_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"16","block_n":"32","block_k":"32","split_k":"1","num_stages":"1","num_warps":"4","num_ctas":"1"}}}
  %input_reduce_tanh_fusion = (f32[], f32[4,32]{1,0}) fusion(%xs, %h), kind=kInput, calls=%fused_reduce_tanh
  %get-tuple-element = f32[] get-tuple-element(%input_reduce_tanh_fusion), index=0
  ROOT %out = (f32[4,32]{1,0}, f32[]) tuple(%gemm_fusion_dot_general, %get-tuple-element)
}
"""
    self.assertEqual(hlo_flops.count(text).flops, 4 * 128 + 2 * 4 * 32 * 32)

  def test_a_value_through_an_asynchronous_slice_is_the_slices_value(self):
    # A scan's backward step (jax 0.11.2, an H200): the cotangent's slice
    # comes through an asynchronous fusion and a bitcast to the matmul's
    # fusion, and is sliced again inside the fusion that stores the
    # gradient of xs; both compute (g + ct[i])², counted once. By hand, 8
    # steps of an add and a square over 4·32 and a matmul 2·4·32·32.
    text = """HloModule m

%fused_dynamic_slice.clone (param_0: f32[8,4,32], param_1: s32[]) -> f32[1,4,32] {
  %param_0 = f32[8,4,32]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %constant_7 = s32[] constant(7)
  %subtract = s32[] subtract(%constant_7, %param_1)
  %constant_0 = s32[] constant(0)
  ROOT %dynamic-slice = f32[1,4,32]{2,1,0} dynamic-slice(%param_0, %subtract, %constant_0, %constant_0), dynamic_slice_sizes={1,4,32}
}

%fused_dynamic_update_slice (param_0.1: f32[8,4,32], param_1.1: f32[4,32], param_2.1: s32[], param_3.1: f32[8,4,32]) -> f32[8,4,32] {
  %param_0.1 = f32[8,4,32]{2,1,0} parameter(0)
  %param_1.1 = f32[4,32]{1,0} parameter(1)
  %param_3.1 = f32[8,4,32]{2,1,0} parameter(3)
  %constant_7.1 = s32[] constant(7)
  %param_2.1 = s32[] parameter(2)
  %subtract.1 = s32[] subtract(%constant_7.1, %param_2.1)
  %constant_0.1 = s32[] constant(0)
  %dynamic-slice.1 = f32[1,4,32]{2,1,0} dynamic-slice(%param_3.1, %subtract.1, %constant_0.1, %constant_0.1), dynamic_slice_sizes={1,4,32}
  %bitcast.1 = f32[4,32]{1,0} bitcast(%dynamic-slice.1)
  %add_any.1 = f32[4,32]{1,0} add(%param_1.1, %bitcast.1)
  %mul.1 = f32[4,32]{1,0} multiply(%add_any.1, %add_any.1)
  %bitcast.2 = f32[1,4,32]{2,1,0} bitcast(%mul.1)
  ROOT %dynamic-update-slice = f32[8,4,32]{2,1,0} dynamic-update-slice(%param_0.1, %bitcast.2, %subtract.1, %constant_0.1, %constant_0.1)
}

%gemm_fusion_dot_general_computation (parameter_0: f32[4,32], parameter_1: f32[4,32], parameter_2: f32[32,32]) -> f32[4,32] {
  %parameter_0 = f32[4,32]{1,0} parameter(0)
  %parameter_1 = f32[4,32]{1,0} parameter(1)
  %add_any.0 = f32[4,32]{1,0} add(%parameter_0, %parameter_1)
  %mul.0 = f32[4,32]{1,0} multiply(%add_any.0, %add_any.0)
  %parameter_2 = f32[32,32]{1,0} parameter(2)
  ROOT %dot_general = f32[4,32]{1,0} dot(%mul.0, %parameter_2), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%body (arg: (s32[], f32[4,32], f32[8,4,32], f32[8,4,32])) -> (s32[], f32[4,32], f32[8,4,32], f32[8,4,32]) {
  %arg = (s32[], f32[4,32]{1,0}, f32[8,4,32]{2,1,0}, f32[8,4,32]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %g = f32[4,32]{1,0} get-tuple-element(%arg), index=1
  %dxs = f32[8,4,32]{2,1,0} get-tuple-element(%arg), index=2
  %cts = f32[8,4,32]{2,1,0} get-tuple-element(%arg), index=3
  %fusion-start = ((f32[8,4,32]{2,1,0}, s32[]), f32[1,4,32]{2,1,0}, u32[]) fusion-start(%cts, %i), kind=kLoop, calls=%fused_dynamic_slice.clone
  %loop_dynamic_update_slice_fusion = f32[8,4,32]{2,1,0} fusion(%dxs, %g, %i, %cts), kind=kLoop, calls=%fused_dynamic_update_slice
  %fusion-done = f32[1,4,32]{2,1,0} fusion-done(%fusion-start)
  %bitcast.3 = f32[4,32]{1,0} bitcast(%fusion-done)
  %constant_w = f32[32,32]{1,0} constant({...})
  %gemm_fusion_dot_general = f32[4,32]{1,0} fusion(%g, %bitcast.3, %constant_w), kind=kCustom, calls=%gemm_fusion_dot_general_computation
  %constant_1 = s32[] constant(1)
  %next = s32[] add(%i, %constant_1)
  %copy = f32[4,32]{1,0} copy(%gemm_fusion_dot_general)
  ROOT %tuple = (s32[], f32[4,32]{1,0}, f32[8,4,32]{2,1,0}, f32[8,4,32]{2,1,0}) tuple(%next, %copy, %loop_dynamic_update_slice_fusion, %cts)
}

"""
    self.assertEqual(
      hlo_flops.count(eight_steps(text, F32_4_32, F32_8_4_32, F32_8_4_32)).flops,
      8 * (2 * 128 + 2 * 4 * 32 * 32),
    )

  def test_only_the_same_arithmetic_on_the_same_values_counts_once(self):
    # tanh(h) in three fusions counts once; but not two matmuls of it with
    # two constants XLA prints alike (`{...}`), two reductions of it by
    # different reducers, a tanh of h past an optimization barrier (what
    # jax.checkpoint's recomputation reads), nor a tanh of h's bytes read
    # as its transpose (a bitcast to another layout). By hand: tanh, sum,
    # max, the second and third tanh 4·32 each, two matmuls 2·4·32·32
    # each.
    text = """HloModule m

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%max (a.1: f32[], b.1: f32[]) -> f32[] {
  %a.1 = f32[] parameter(0)
  %b.1 = f32[] parameter(1)
  ROOT %maximum = f32[] maximum(%a.1, %b.1)
}

%fused_a (p0: f32[4,32], p1: f32[32,32]) -> f32[4,32] {
  %p0 = f32[4,32]{1,0} parameter(0)
  %t = f32[4,32]{1,0} tanh(%p0)
  %p1 = f32[32,32]{1,0} parameter(1)
  ROOT %d = f32[4,32]{1,0} dot(%t, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_b (q0: f32[4,32], q1: f32[32,32]) -> f32[4,32] {
  %q0 = f32[4,32]{1,0} parameter(0)
  %t.1 = f32[4,32]{1,0} tanh(%q0)
  %q1 = f32[32,32]{1,0} parameter(1)
  ROOT %d.1 = f32[4,32]{1,0} dot(%t.1, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_reductions (r0: f32[4,32]) -> (f32[4], f32[4]) {
  %r0 = f32[4,32]{1,0} parameter(0)
  %t.2 = f32[4,32]{1,0} tanh(%r0)
  %zero = f32[] constant(0)
  %s = f32[4]{0} reduce(%t.2, %zero), dimensions={1}, to_apply=%sum
  %m = f32[4]{0} reduce(%t.2, %zero), dimensions={1}, to_apply=%max
  ROOT %tuple = (f32[4]{0}, f32[4]{0}) tuple(%s, %m)
}

ENTRY %main (h: f32[4,32]) -> (f32[4,32], f32[4,32], (f32[4], f32[4]), f32[4,32], f32[4,32]) {
  %h = f32[4,32]{1,0} parameter(0)
  %w1 = f32[32,32]{1,0} constant({...})
  %w2 = f32[32,32]{1,0} constant({...})
  %a = f32[4,32]{1,0} fusion(%h, %w1), kind=kCustom, calls=%fused_a
  %b = f32[4,32]{1,0} fusion(%h, %w2), kind=kCustom, calls=%fused_b
  %r = (f32[4]{0}, f32[4]{0}) fusion(%h), kind=kInput, calls=%fused_reductions
  %kept = (f32[4,32]{1,0}) tuple(%h)
  %barrier = (f32[4,32]{1,0}) opt-barrier(%kept)
  %h.1 = f32[4,32]{1,0} get-tuple-element(%barrier), index=0
  %again = f32[4,32]{1,0} tanh(%h.1)
  %read_transposed = f32[4,32]{0,1} bitcast(%h)
  %transposed = f32[4,32]{0,1} tanh(%read_transposed)
  ROOT %out = (f32[4,32]{1,0}, f32[4,32]{1,0}, (f32[4]{0}, f32[4]{0}), f32[4,32]{1,0}, f32[4,32]{0,1}) tuple(%a, %b, %r, %again, %transposed)
}
"""
    self.assertEqual(hlo_flops.count(text).flops, 5 * 128 + 2 * (2 * 4 * 32 * 32))

  def test_gpu_convolutions_count_as_xla_counts_them_on_cpu(self):
    # XLA:GPU runs a convolution and its two transposes as cuDNN
    # custom-calls, written below as XLA:GPU writes them (jax 0.11.2, an
    # H200: the kernel laid out o01i, a workspace result, the forward
    # convolution's window and dim_labels on each call). The ground truth:
    # XLA's count of the same convolution and transposes on CPU.
    for window, groups, (x_shape, k_shape, y_shape) in (
      ("size=3x3 pad=1_1x1_1", 1, ((2, 9, 9, 4), (3, 3, 4, 8), (2, 9, 9, 8))),
      ("size=3x3 stride=2x2 pad=1_1x1_1", 1, ((2, 9, 9, 4), (3, 3, 4, 6), (2, 5, 5, 6))),
      ("size=3x3", 2, ((2, 8, 8, 8), (3, 3, 4, 8), (2, 6, 6, 8))),
    ):
      stride = 2 if "stride" in window else 1
      x, k = jnp.ones(x_shape), jnp.ones(k_shape)
      conv = lambda x, k, s=stride, g=groups: jax.lax.conv_general_dilated(
        x,
        k,
        (s, s),
        "VALID" if g > 1 else ((1, 1), (1, 1)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=g,
      )
      y = conv(x, k)
      self.assertEqual(y.shape, y_shape)
      d_x = lambda y, k: jax.linear_transpose(lambda x: conv(x, k), x)(y)[0]
      d_k = lambda x, y: jax.linear_transpose(lambda k: conv(x, k), k)(y)[0]
      h, w, i, o = k_shape  # HWIO on CPU, o01i on GPU:
      gpu_k = f"f32[{o},{h},{w},{i}]"
      x_t, y_t = (f"f32[{','.join(map(str, s))}]" for s in (x_shape, y_shape))
      for target, operands, result, truth in (
        ("convForward", (x_t, gpu_k), y_t, xla(conv, x, k, device=CPU)),
        ("convBackwardInput", (y_t, gpu_k), x_t, xla(d_x, y, k, device=CPU)),
        ("convBackwardFilter", (x_t, y_t), gpu_k, xla(d_k, x, y, device=CPU)),
      ):
        got = hlo_flops.count(cudnn_convolution(target, operands, result, window, groups))
        self.assertEqual(got.opaque_custom_calls, ())
        self.assertAlmostEqual(got.flops / truth, 1, delta=0.02, msg=(target, window))

  def test_convolutions_count_only_real_inputs_as_xla_does(self):
    # On CPU: the convolution, and its gradients (XLA writes those as
    # convolutions with dilated or padded inputs, and batch groups).
    for name, f, x, k in convolutions():
      self.assertAlmostEqual(
        ours(f, x, k, device=CPU).flops / xla(f, x, k, device=CPU), 1, delta=0.02, msg=name
      )

  def test_constant_bytes_are_the_arrays_not_the_scalars(self):
    # 200 int32s: within jax 0.12's jax_embedded_constants_max_bytes (1,024),
    # which compiles a closed-over array in only up to that size (a larger
    # one is an argument there; jax 0.10 compiles in any). Counted as the
    # device holds them (XLA:TPU pads them to its tiles: 1,024 bytes).
    table = np.random.default_rng(0).integers(0, 9, 200).astype(np.int32)
    text = compiled(lambda i, x: jnp.asarray(table)[i] * x + 1.5, 3, 2.0).as_text()
    scalars = [
      line for line in text.splitlines() if re.search(r"= [fs]32\[\](\{[^}]*\})? constant\(", line)
    ]
    self.assertNotEmpty(scalars)  # In the code, not in the program's data.
    self.assertEqual(hlo_flops.constant_bytes(text), held_on_the_device(table))

  def test_a_closed_over_array_counts_once_compiled_in_or_passed_as_an_argument(self):
    # 1,000 int32s: compiled in by jax 0.10, an argument of its own on jax
    # 0.12 (over its jax_embedded_constants_max_bytes); held either way,
    # once, as the device holds it, and none of the step's own arguments
    # (nor one it never reads, which jit drops, nor their tiles' padding).
    table = np.random.default_rng(0).integers(0, 9, 1000).astype(np.int32)
    got = hlo_flops.held(
      compiled(lambda i, x, unread: jnp.asarray(table)[i] * x, 3, jnp.ones([64]), jnp.ones([8]))
    )
    self.assertEqual(got.constants, held_on_the_device(table))

  def test_declared_arguments_are_taken_as_the_device_holds_them(self):
    # What XLA:TPU reported (jax 0.10.2, a TPU v5e) for the program of the
    # test above without its unread argument: 1,024 bytes of arguments for
    # an s32[] and an f32[64], each padded to a 128-element tile (512
    # bytes: hlo_text_test's measured layouts), the table compiled in. On
    # jax 0.12 the table is an argument too: 4,096 bytes more. The declared
    # arguments' padding is theirs, not a lifted array's; nor is an
    # argument jit drops, and a sharded one is held a shard a device.
    def layout(*major_to_minor, tile=(128,)):
      return _Layout(major_to_minor, (tile,))

    args_info = ((_ArgInfo((), np.int32), _ArgInfo((64,), np.float32)), {})
    formats = ((_Format(layout(), None), _Format(layout(0), None)), {})
    for lifted in (0, 4096):
      with self.subTest(lifted=lifted):
        program = _Compiled(args_info, formats, _Analysis(0, 0, 1024 + lifted, 4, 0))
        self.assertEqual(hlo_flops.declared_bytes(program), 1024)
        self.assertEqual(hlo_flops.lifted_bytes(program, program.memory_analysis()), lifted)
    # Dropped, and sharded over the devices there are (an f32[64, 16] over
    # 8 is f32[8, 16] on each, 512 bytes, in XLA:CPU's untiled layout;
    # Bazel's test processes have one device, pytest's eight).
    devices = jax.devices("cpu")[:8]
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    program = _Compiled(
      ((_ArgInfo((64, 16), np.float32), _ArgInfo((7,), np.float32)), {}),
      ((_Format(_Layout((0, 1), ()), rows), _Format(None, None)), {}),
      _Analysis(0, 0, 64 * 16 * 4 // len(devices) + 4000, 4, 0),
    )
    self.assertEqual(hlo_flops.lifted_bytes(program, program.memory_analysis()), 4000)

  def test_a_tpus_temporaries_count_each_buffer_once(self):
    # `memory_analysis()` as XLA:TPU reported it (jax 0.10.2, one TPU v5e,
    # 2026-12-05), for programs of x: f32[1024,1024] (4 MiB) whose
    # temporaries their arithmetic tells: the products of a chain of
    # matmuls, two of them live at once (the one read and the one written);
    # none where XLA:TPU fuses exp and cos into the matmul.
    mib4 = 4 << 20
    for name, analysis, want in (
      ("x * 2", _Analysis(0, 8388608, mib4, mib4, 0), 0),
      ("((x @ x) @ x) @ x", _Analysis(0, 16777216, mib4, mib4, 0), 2 * mib4),
      ("jnp.sum(((x @ x) @ x) @ x)", _Analysis(0, 12583424, mib4, 512, 0), 2 * mib4),
      ("jnp.sum(jnp.exp(x) @ jnp.cos(x))", _Analysis(0, 4194816, mib4, 512, 0), 0),
      # An output that aliases its argument (donated) is one buffer: a
      # donated step holding one 4 MiB temporary besides.
      ("donated step", _Analysis(0, 2 * mib4, mib4, mib4, mib4), mib4),
      # A remat schedule's step at toy size (an LSTM, 256 steps, binomial):
      # the temporaries XLA:TPU reports lie above its peak, and are taken.
      ("binomial LSTM step", _Analysis(1036800, 358400, 53760, 22016, 0), 1036800),
      # At users' sizes XLA:TPU reports temporaries for every program, its
      # peak them plus arguments and outputs (2026-12-07, RESULTS.md, "What
      # XLA:TPU's memory analysis counts": the gradient of a 64-step scan
      # of a 128 MiB carry). Its compiler checks the temporaries ("HLO
      # temporaries (24.62G) exceeds available HBM (15.75G)" for
      # remat=False's), and took and ran programs whose temporaries and
      # peak added exceed the chip's 15.75 GiB: each is read once.
      (
        "remat=True, 15.75 GiB chip",
        _Analysis(8858661888, 8992596480, 134218240, 134218752, 0),
        8858661888,
      ),
      (
        "binomial, 80 slots, 128 steps",
        _Analysis(12080244224, 12213829632, 134218240, 134218752, 0),
        12080244224,
      ),
    ):
      with self.subTest(name):
        self.assertEqual(hlo_flops.temporaries(analysis, "tpu"), want)
    # Elsewhere, XLA's temporaries as it reports them.
    for platform in ("cpu", "gpu"):
      self.assertEqual(hlo_flops.temporaries(_Analysis(1234, 10**9, 5, 6, 0), platform), 1234)

  def test_batch_groups_count_as_xla_counts_them(self):
    # XLA:CPU rewrites a convolution's batch groups before the program we
    # read, so this one is written out, as another backend may leave it;
    # the ground truth is XLA's count of the same convolution from jax.
    def conv(x, k):
      return jax.lax.conv_general_dilated(
        x, k, (1, 1), "VALID", batch_group_count=2, dimension_numbers=("NHWC", "HWIO", "NHWC")
      )

    x, k = jnp.ones([4, 10, 10, 8]), jnp.ones([3, 3, 8, 6])
    text = "\n".join(
      [
        "HloModule m",
        "",
        "ENTRY %main (x: f32[4,10,10,8], k: f32[3,3,8,6]) -> f32[2,8,8,6] {",
        "  %x = f32[4,10,10,8]{3,2,1,0} parameter(0)",
        "  %k = f32[3,3,8,6]{3,2,1,0} parameter(1)",
        "  ROOT %c = f32[2,8,8,6]{3,2,1,0} convolution(%x, %k), "
        "window={size=3x3}, dim_labels=b01f_01io->b01f, batch_group_count=2",
        "}",
      ]
    )
    self.assertEqual(
      hlo_flops.count(text).flops,
      jax.jit(conv).lower(*jax.device_put((x, k), CPU)).cost_analysis()["flops"],
    )

  @absltest.skipUnless(
    jax.default_backend() == "gpu", "XLA:GPU writes convolutions as cuDNN custom-calls"
  )
  def test_a_gpu_programs_convolutions_count_as_xla_counts_them_on_cpu(self):
    for name, f, x, k in convolutions():
      if "((1, 0)" in name:
        # XLA:GPU pads this input itself, and cuDNN multiplies the zeros.
        continue
      text = compiled(f, x, k).as_text()
      self.assertIn("__cudnn$conv", text, name)
      self.assertAlmostEqual(
        hlo_flops.count(text).flops / xla(f, x, k, device=CPU), 1, delta=0.02, msg=name
      )

  def test_rolled_loops_count_as_xla_counts_them_unrolled(self):
    # The ground truth, on any backend: XLA's count of the loop unrolled on
    # CPU (XLA:GPU's count of an unrolled program counts each copy of a
    # value its fusions make, 2.5-3.8% more on an H200 here).
    for name in ("scan", "gradient", "nested"):
      rolled = ours(LOOPS[name](1), H, XS)
      self.assertEqual(rolled.unknown_trip_counts, 0, name)
      self.assertEqual(rolled.conditionals, (), name)
      # XLA's count of the rolled loop sees one step of 8.
      self.assertLess(xla(LOOPS[name](1), H, XS), rolled.flops / 4, name)
      self.assertAlmostEqual(rolled.flops / unrolled(name, CPU), 1, delta=0.02, msg=name)

  def test_a_checkpointed_scan_counts_one_more_forward_per_step(self):
    # Unrolled, XLA merges the recomputation with the forward pass, so the
    # ground truth is the plain gradient unrolled and, for each step, the
    # forward of its carry that jax.checkpoint runs again (XLA's counts on
    # CPU, as above): `unrolled("checkpointed")`. Its program is the plain
    # step's: jax 0.12's XLA keeps an unrolled checkpointed step's
    # recomputation, which the truth would then count twice (1.29x).
    plain = lambda name: str(jax.make_jaxpr(LOOPS[name](True))(H, XS))
    self.assertEqual(plain("checkpointed"), plain("gradient"))
    got = ours(LOOPS["checkpointed"](1), H, XS).flops
    self.assertAlmostEqual(got / unrolled("checkpointed", CPU), 1, delta=0.02)

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

  def test_dearest_counts_each_conditional_by_its_dearest_branch(self):
    # A cond in a cond's branch: counted in that branch, by its dearest too.
    def f(h, xs):
      def body(h, x):
        inner = lambda: jax.lax.cond(jnp.sum(x) > 1, lambda: h @ W, lambda: h * 2.0)
        h = jax.lax.cond(jnp.sum(x) > 0, inner, lambda: h + 1.0)
        return h, None

      return jax.lax.scan(body, h, xs)[0]

    text = jax.jit(f).lower(H, XS).compile().as_text()
    cheapest = hlo_flops.count(text)
    dearest = hlo_flops.count(text, dearest=True)
    dot = 2 * 4 * 32 * 32
    (conditional,) = dearest.conditionals
    self.assertGreaterEqual(max(conditional.branches), dot)
    self.assertGreaterEqual(dearest.flops, 8 * dot)
    self.assertLess(dearest.flops, 8 * dot * 1.1)
    self.assertLess(cheapest.flops, 8 * dot / 10)


if __name__ == "__main__":
  absltest.main()
