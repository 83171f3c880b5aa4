"""Tests for hlo_text: bytes as XLA counts them, and where the walk goes."""

from absl.testing import absltest
import jax
import jax.numpy as jnp

from haiku_bridge._src import hlo_text


class ArraysTest(absltest.TestCase):

  def test_bytes_are_xlas(self):
    # Each element type's bytes against the compiled program's own output
    # size (pred a byte, s4 and u4 half of one).
    x = jnp.ones([64])
    for dtype in (jnp.bool_, jnp.int4, jnp.uint4, jnp.bfloat16, jnp.uint8,
                  jnp.float8_e4m3fn, jnp.float32, jnp.complex64):
      with self.subTest(jnp.dtype(dtype).name):
        compiled = jax.jit(lambda x, dtype=dtype: (
            x > 0 if dtype == jnp.bool_ else x.astype(dtype))).lower(
                x).compile()
        program = hlo_text.parse(compiled.as_text())
        root = next(i for i in program.computations[program.entry]
                    if i.name == program.roots[program.entry])
        self.assertEqual(sum(a.bytes for a in hlo_text.arrays(root.shape)),
                         compiled.memory_analysis().output_size_in_bytes)

  def test_a_tuple_has_no_elements(self):
    self.assertEqual(hlo_text.elements("(f32[2,3]{1,0}, s32[2]{0})"), 0)
    self.assertEqual(hlo_text.elements("f32[2,3]{1,0}"), 6)


class WalkTest(absltest.TestCase):

  def test_where_each_instruction_runs(self):
    # A loop without a known trip count (counted once), its condition and
    # body inside it, an async start's computation and a conditional's
    # branches (marked) at their caller's loops.
    text = """HloModule m
%cond (u: (s32[])) -> pred[] {
  %u = (s32[]) parameter(0)
  ROOT %c = pred[] constant(true)
}

%body (v: (s32[])) -> (s32[]) {
  %v = (s32[]) parameter(0)
  ROOT %b = (s32[]) tuple(%v)
}

%async (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%a)
}

%yes (y: f32[4]) -> f32[4] {
  ROOT %y = f32[4]{0} parameter(0)
}

%no (z: f32[4]) -> f32[4] {
  ROOT %z = f32[4]{0} parameter(0)
}

ENTRY %main (p: f32[4], q: pred[]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %q = pred[] parameter(1)
  %i = s32[] constant(0)
  %t = (s32[]) tuple(%i)
  %w = (s32[]) while(%t), condition=%cond, body=%body
  %s = ((f32[4]{0}), f32[4]{0}) async-start(%p), calls=%async
  %d = f32[4]{0} async-done(%s)
  ROOT %r = f32[4]{0} conditional(%q, %d, %d), true_computation=%yes, false_computation=%no
}
"""
    sites = {s.instruction.name: (s.loops, s.in_branch)
             for s in hlo_text.walk(hlo_text.parse(text))}
    self.assertEqual(sites, {
        "p": ((), False), "q": ((), False), "i": ((), False),
        "t": ((), False), "w": ((), False), "u": ((1,), False),
        "c": ((1,), False), "v": ((1,), False),
        "b": ((1,), False), "s": ((), False), "a": ((), False),
        "n": ((), False), "d": ((), False), "r": ((), False),
        "z": ((), True), "y": ((), True)})


if __name__ == "__main__":
  absltest.main()
