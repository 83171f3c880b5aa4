"""Tests for hlo_collectives: bytes per device against the arrays' own sizes, loops by trip count."""

import doctest

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl.testing import absltest
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from testing import hlo_collectives

MESH = {"stage": 2, "data": 4}


def compiled(f, *args, specs):
  """`f` compiled on the MESH (Explicit axes), `args` placed by `specs`."""
  mesh = jax.make_mesh(
    tuple(MESH.values()), tuple(MESH), axis_types=(AxisType.Explicit,) * len(MESH)
  )
  with jax.set_mesh(mesh):
    args = [jax.device_put(a, s) for a, s in zip(args, specs)]
    return jax.jit(f).lower(*args).compile()


class CollectivesTest(absltest.TestCase):
  def test_the_docstring_example(self):
    # The package's doctest_test runs haiku_bridge's examples only; this module is testing/'s.
    result = doctest.testmod(hlo_collectives)
    self.assertEqual((result.failed, result.attempted > 0), (0, True))

  def test_each_kind_by_hand(self):
    # Every kind, and an async pair, in one program (HLO as XLA:GPU
    # writes it), each array's bytes per device by hand.
    text = """HloModule m
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (t: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %t = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%t), index=1
  %p = f32[8,16]{1,0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %r = f32[8,16]{1,0} all-reduce-start(%p), channel_id=2, replica_groups=[4,2]<=[8], to_apply=%add
  %d = f32[8,16]{1,0} all-reduce-done(%r)
  ROOT %o = (s32[], f32[8,16]{1,0}) tuple(%i, %d)
}

%cond (t: (s32[], f32[8,16])) -> pred[] {
  %t = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[8,16], h: bf16[4,6]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0)
  %h = bf16[4,6]{1,0} parameter(1)
  %g = (bf16[4,6]{1,0}, bf16[16,6]{1,0}) all-gather-start(%h), channel_id=3, replica_groups={{0,2,4,6},{1,3,5,7}}, dimensions={0}
  %gd = bf16[16,6]{1,0} all-gather-done(%g)
  %rs = f32[2,16]{1,0} reduce-scatter(%x), channel_id=4, replica_groups=mesh['x'=2,'y'=4], device_ids=([8]) {'y'}, dimensions={0}, to_apply=%add
  %aa = f32[8,16]{1,0} all-to-all(%x), channel_id=5, replica_groups={}, dimensions={0}
  %init = s32[] constant(0)
  %t = (s32[], f32[8,16]{1,0}) tuple(%init, %aa)
  %w = (s32[], f32[8,16]{1,0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%w), index=1
}
"""
    found = hlo_collectives.collectives(text)
    array = 8 * 16 * 4
    self.assertEqual(
      hlo_collectives.bytes_by_kind(found),
      {
        "all-gather": 16 * 6 * 2,  # The result, bfloat16.
        "all-reduce": 3 * array,  # In the loop of 3.
        "collective-permute": 3 * array,
        "reduce-scatter": array,  # The operand, not the 1/4 result.
        "all-to-all": array,
      },
    )
    axes = {c.kind: hlo_collectives.mesh_axes(c, MESH) for c in found}
    self.assertEqual(
      axes,
      {
        "all-gather": ("stage", "data"),  # Ids 0, 2, 4, 6.
        "reduce-scatter": ("data",),  # Over 'y' of [[0-3], [4-7]].
        "all-to-all": ("stage", "data"),  # All devices.
        "collective-permute": ("data",),  # 0 <-> 1.
        "all-reduce": ("data",),  # [4,2]<=[8]: {0,1}, {2,3}, ...
      },
    )
    loops = {c.kind: c.loops for c in found}
    self.assertEqual(loops["all-reduce"], (3,))
    self.assertEqual(loops["all-gather"], ())

  def test_named_axes_without_device_ids(self):
    # As jaxlib 0.11's XLA writes a pipelined step's reductions: the mesh's
    # axes named without `device_ids=` (the mesh's devices in order), and
    # the loss's sum combined with the gradient's leaves in one tuple
    # all-reduce. Read as all devices, both ran over every axis.
    text = """HloModule m
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (l: f32[], w: f32[4,16], x: f32[4,2,16]) -> (f32[], f32[4,16], f32[4,2,16]) {
  %l = f32[] parameter(0)
  %w = f32[4,16]{1,0} parameter(1)
  %x = f32[4,2,16]{2,1,0} parameter(2)
  %s = f32[4,2,16]{2,1,0} all-reduce(%x), channel_id=1, replica_groups=mesh['stage'=2,'data'=4] {'stage'}, use_global_device_ids=true, to_apply=%add
  %d = (f32[], f32[4,16]{1,0}) all-reduce(%l, %w), channel_id=2, replica_groups=mesh['stage'=2,'data'=4] {'data'}, use_global_device_ids=true, to_apply=%add
  %dl = f32[] get-tuple-element(%d), index=0
  %dw = f32[4,16]{1,0} get-tuple-element(%d), index=1
  ROOT %o = (f32[], f32[4,16]{1,0}, f32[4,2,16]{2,1,0}) tuple(%dl, %dw, %s)
}
"""
    over_stage, over_data = hlo_collectives.collectives(text)
    self.assertEqual(over_stage.groups, ((0, 4), (1, 5), (2, 6), (3, 7)))
    self.assertEqual(hlo_collectives.mesh_axes(over_stage, MESH), ("stage",))
    self.assertEqual(over_stage.bytes, 4 * 2 * 16 * 4)
    self.assertEqual(over_data.groups, ((0, 1, 2, 3), (4, 5, 6, 7)))
    self.assertEqual(hlo_collectives.mesh_axes(over_data, MESH), ("data",))
    self.assertEqual(over_data.bytes, 4 + 4 * 16 * 4)  # Both operands.

  def test_iota_groups_an_async_start_and_a_branch(self):
    # XLA's iota groups, `[groups, size]<=[dims]T(perm)`: the ids of an iota
    # of `dims`, transposed by `perm`, in rows of `size`. A reduce-scatter
    # run by an `async-start` counts once, its operand's bytes; one in a
    # conditional's branch is marked so.
    text = """HloModule m
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%scatter (y: f32[8,16]) -> f32[2,16] {
  %y = f32[8,16]{1,0} parameter(0)
  ROOT %rs = f32[2,16]{1,0} reduce-scatter(%y), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%add
}

%yes (u: f32[8,16]) -> f32[8,16] {
  %u = f32[8,16]{1,0} parameter(0)
  ROOT %ar = f32[8,16]{1,0} all-reduce(%u), channel_id=2, replica_groups=[4,2]<=[8], to_apply=%add
}

%no (v: f32[8,16]) -> f32[8,16] {
  ROOT %v = f32[8,16]{1,0} parameter(0)
}

ENTRY %main (x: f32[8,16], q: pred[]) -> (f32[2,16], f32[8,16]) {
  %x = f32[8,16]{1,0} parameter(0)
  %q = pred[] parameter(1)
  %st = ((f32[8,16]{1,0}), f32[2,16]{1,0}) async-start(%x), calls=%scatter
  %sd = f32[2,16]{1,0} async-done(%st)
  %c = f32[8,16]{1,0} conditional(%q, %x, %x), true_computation=%yes, false_computation=%no
  ROOT %o = (f32[2,16]{1,0}, f32[8,16]{1,0}) tuple(%sd, %c)
}
"""
    scatter, reduce = hlo_collectives.collectives(text)
    self.assertEqual(scatter.kind, "reduce-scatter")
    self.assertEqual(scatter.groups, ((0, 2, 4, 6), (1, 3, 5, 7)))
    self.assertEqual(scatter.bytes, 8 * 16 * 4)
    self.assertFalse(scatter.in_branch)
    self.assertEqual(reduce.groups, ((0, 1), (2, 3), (4, 5), (6, 7)))
    self.assertTrue(reduce.in_branch)

  def test_a_compiled_reduction_in_a_scan(self):
    # jax's own program: a sum over "data" in a scan of 5 steps, and one
    # after it; per device, the shapes are one device's.
    def f(xs, w):
      def step(h, x):
        return h + jnp.sum(x * w, axis=0), None

      h, _ = jax.lax.scan(step, jnp.zeros(w.shape[1:]), xs)
      return h, jnp.sum(xs, axis=1)

    found = [
      c
      for c in hlo_collectives.collectives(
        compiled(
          f, jnp.ones([5, 16, 32]), jnp.ones([16, 32]), specs=(P(None, "data"), P())
        ).as_text()
      )
      if c.kind == "all-reduce"
    ]
    self.assertNotEmpty(found)
    for c in found:
      self.assertEqual(hlo_collectives.mesh_axes(c, MESH), ("data",))
    # The scan's: one float32 row of 32 per step (or all 5 at once, if XLA
    # moved it out); the one after: [5, 32] per device.
    self.assertEqual(sum(c.bytes_per_step for c in found), 5 * 32 * 4 + 5 * 32 * 4)


if __name__ == "__main__":
  absltest.main()
