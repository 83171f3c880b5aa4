"""Tests for hlo_text: bytes as XLA counts them, and where the walk goes."""

import functools
import re
from typing import Any, Callable, Optional

from absl.testing import absltest
import jax
import jax.numpy as jnp

from haiku_bridge._src import hlo_text


class ArraysTest(absltest.TestCase):
  def test_bytes_are_xlas(self):
    # Each element type's bytes against the compiled program's own output
    # size (pred a byte, s4 and u4 half of one).
    x = jnp.ones([64])
    for dtype in (
      jnp.bool_,
      jnp.int4,
      jnp.uint4,
      jnp.bfloat16,
      jnp.uint8,
      jnp.float8_e4m3fn,
      jnp.float32,
      jnp.complex64,
    ):
      with self.subTest(jnp.dtype(dtype).name):
        compiled = (
          jax.jit(lambda x, dtype=dtype: x > 0 if dtype == jnp.bool_ else x.astype(dtype))
          .lower(x)
          .compile()
        )
        program = hlo_text.parse(compiled.as_text())
        root = next(
          i for i in program.computations[program.entry] if i.name == program.roots[program.entry]
        )
        self.assertEqual(
          sum(a.bytes for a in hlo_text.arrays(root.shape)),
          compiled.memory_analysis().output_size_in_bytes,
        )

  def test_a_tiled_layouts_bytes_are_xla_tpus(self):
    # Array types as XLA:TPU compiled them (a TPU v5e, jax 0.10.2, 2026-12-05:
    # `x.astype(dtype)`'s output, its `output_size_in_bytes` beside it; all
    # 110 measured agree). The layout's first tile pads the minor dimensions
    # (in the layout's order); a tile's packing, `(2,1)`, pads nothing more.
    measured = [
      ("pred[64]{0:T(512)(128)(4,1)}", 512),
      ("s4[64]{0:T(1024)(128)(8,1)E(4)}", 512),
      ("bf16[64]{0:T(256)(128)(2,1)}", 512),
      ("f32[64]{0:T(128)}", 512),
      ("c64[64]{0:T(128)}", 1024),
      ("f32[130]{0:T(256)}", 1024),
      ("s4[5,16]{1,0:T(8,128)(8,1)E(4)}", 512),
      ("bf16[5,16]{1,0:T(8,128)(2,1)}", 2048),
      ("f32[5,16]{1,0:T(8,128)}", 4096),
      ("f32[3,7]{1,0:T(4,128)}", 2048),
      ("f32[16,5]{0,1:T(8,128)}", 4096),
      ("u8[2,3,7]{2,1,0:T(4,128)(4,1)}", 1024),
      ("bf16[2,3,7]{2,0,1:T(2,128)(2,1)}", 1536),
      ("f32[2,3,7]{2,0,1:T(2,128)}", 3072),
      ("f32[256,4,8]{0,2,1:T(8,128)}", 32768),
      ("pred[256,4,8]{0,2,1:T(8,128)(4,1)}", 8192),
      ("f32[1,1,1,3]{3,2,1,0:T(1,128)}", 512),
      ("c64[1,1,1,3]{3,2,1,0:T(1,128)}", 1024),
    ]
    for shape, held in measured:
      with self.subTest(shape):
        (array,) = hlo_text.arrays(shape)
        self.assertEqual(array.bytes, held)
        self.assertEqual(array.dims, hlo_text.dims(shape))
    # The same arrays given as jax gives a layout (`Compiled.input_formats`).
    dtypes = {
      "pred": jnp.bool_,
      "s4": jnp.int4,
      "bf16": jnp.bfloat16,
      "f32": jnp.float32,
      "c64": jnp.complex64,
      "u8": jnp.uint8,
    }
    for shape, held in measured:
      dtype, minor_to_major, tiles = re.fullmatch(
        r"(\w+)\[[0-9,]*\]\{([0-9,]*):(.*)\}", shape
      ).groups()
      with self.subTest(shape, given_as="layout"):
        self.assertEqual(
          hlo_text.array_bytes(
            hlo_text.dims(shape),
            dtypes[dtype],
            [int(d) for d in reversed(minor_to_major.split(","))],
            [tuple(map(int, t.split(","))) for t in re.findall(r"\(([0-9,]+)\)", tiles)],
          ),
          held,
        )
    # No HLO name for a typed PRNG key's type: none (its caller counts it).
    self.assertIsNone(hlo_text.array_bytes((), jax.random.key(0).dtype, (), ((128,),)))
    # A scalar's tile holds it; a tuple's arrays each as their layouts say.
    self.assertEqual(
      [a.bytes for a in hlo_text.arrays("(s32[]{:T(128)}, f32[4,16]{1,0}, bf16[8]{0})")],
      [512, 256, 16],
    )

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
    sites = {
      s.instruction.name: (s.loops, s.in_branch) for s in hlo_text.walk(hlo_text.parse(text))
    }
    self.assertEqual(
      sites,
      {
        "p": ((), False),
        "q": ((), False),
        "i": ((), False),
        "t": ((), False),
        "w": ((), False),
        "u": ((1,), False),
        "c": ((1,), False),
        "v": ((1,), False),
        "b": ((1,), False),
        "s": ((), False),
        "a": ((), False),
        "n": ((), False),
        "d": ((), False),
        "r": ((), False),
        "z": ((), True),
        "y": ((), True),
      },
    )


def _loops() -> dict[str, tuple[Callable[..., Any], tuple[jax.Array, ...], frozenset[int]]]:
  """Programs of while loops: each `(f, args, lengths)`, `lengths` the trip counts its loops are written with."""
  w = jnp.linspace(-1, 1, 64).reshape(8, 8)
  xs = jnp.ones([6, 2, 8])

  def step(h, x):
    h = jnp.tanh(h @ w + x)
    return h, jnp.sum(h)

  def loss(h, xs):
    h, ys = jax.lax.scan(step, h, xs)
    return jnp.sum(h) + jnp.sum(ys)

  def nested(h, xs):
    inner = lambda h, xs: jax.lax.scan(step, h, xs)
    h, ys = jax.lax.scan(inner, h, xs.reshape(3, 2, 2, 8))
    return jnp.sum(h) + jnp.sum(ys)

  h = jnp.zeros([2, 8])
  six = frozenset([6])  # xs' length.
  return {
    "scan": (lambda h, xs: jax.lax.scan(step, h, xs), (h, xs), six),
    "reversed scan": (lambda h, xs: jax.lax.scan(step, h, xs, reverse=True), (h, xs), six),
    "gradient": (jax.grad(loss, argnums=(0, 1)), (h, xs), six),
    "nested gradient": (jax.grad(nested, argnums=(0, 1)), (h, xs), frozenset([3, 2])),
    "fori_loop from 3 to 11": (
      lambda h: jax.lax.fori_loop(3, 11, lambda i, h: jnp.tanh(h @ w + i), h),
      (h,),
      frozenset([8]),
    ),
    "fori_loop of 2 scans": (
      lambda h, xs: jax.lax.fori_loop(0, 2, lambda i, h: jax.lax.scan(step, h, xs)[0], h),
      (h, xs),
      frozenset([2, 6]),
    ),
  }


@functools.cache
def _compiled_loops() -> dict[str, tuple[str, frozenset[int]]]:
  """`_loops()` compiled on the default backend: each program's HLO text, beside its loops' written lengths."""
  return {
    name: (jax.jit(f).lower(*args).compile().as_text(), lengths)
    for name, (f, args, lengths) in _loops().items()
  }


def _whiles(program: hlo_text.Program) -> list[hlo_text.Instruction]:
  return [i for i in program.instructions.values() if i.opcode == "while"]


class LoopTripsTest(absltest.TestCase):
  def test_the_counter_gives_xlas_known_trip_count(self):
    # XLA:CPU and XLA:GPU write each while's trip count on it; with every
    # backend config removed, the count read off the loop's counter is XLA's.
    if jax.default_backend() == "tpu":
      self.skipTest(
        "XLA:TPU writes no known_trip_count on its loops, so there is no XLA count to compare "
        "with: test_the_counter_gives_each_loops_written_length holds the counter there."
      )
    for name, (text, _) in _compiled_loops().items():
      with self.subTest(name):
        known = {i.name: hlo_text.trip_count(i.attributes) for i in _whiles(hlo_text.parse(text))}
        self.assertNotEmpty(known)
        self.assertNotIn(None, known.values())
        bare = hlo_text.parse(_WITHOUT_CONFIG.sub("", text))
        self.assertEqual(
          {i.name: hlo_text.trip_count(i.attributes) for i in _whiles(bare)}, dict.fromkeys(known)
        )
        self.assertEqual({n: hlo_text.loop_trips(bare, bare.instructions[n]) for n in known}, known)

  def test_the_counter_gives_each_loops_written_length(self):
    # On every backend (XLA:TPU's loops carry no count to read but their
    # counter's): each loop of the compiled program, its backend configs
    # removed, runs one of the lengths its loops were written with.
    for name, (text, lengths) in _compiled_loops().items():
      with self.subTest(name):
        bare = hlo_text.parse(_WITHOUT_CONFIG.sub("", text))
        loops = _whiles(bare)
        self.assertNotEmpty(loops)
        self.assertEqual({hlo_text.trip_count(i.attributes) for i in loops}, {None})
        trips = [hlo_text.loop_trips(bare, i) for i in loops]
        self.assertContainsSubset(trips, lengths)

  def test_each_comparison_and_step(self):
    # A counter from `start`, stepped by `step`, compared with `limit` by
    # `direction` (the counter first, or the limit first).
    for start, step, direction, limit, counter_first, trips in (
      (0, 1, "LT", 8, True, 8),
      (0, 3, "LT", 8, True, 3),
      (0, 3, "LE", 9, True, 4),
      (2, 1, "LT", 2, True, 0),
      (10, -1, "GT", 0, True, 10),
      (10, -3, "GE", 1, True, 4),
      (0, 2, "NE", 8, True, 4),
      (0, 3, "NE", 8, True, None),
      (0, 1, "GT", 8, False, 8),
      (5, -1, "LT", 0, False, 5),
      (0, -1, "LT", 8, True, None),
      (0, 0, "LT", 8, True, None),
    ):
      with self.subTest(
        start=start, step=step, direction=direction, limit=limit, counter_first=counter_first
      ):
        operands = "%i, %n" if counter_first else "%n, %i"
        program = hlo_text.parse(
          _COUNTED.format(
            start=start, step=step, direction=direction, limit=limit, operands=operands
          )
        )
        self.assertEqual(hlo_text.loop_trips(program, program.instructions["w"]), trips)

  def test_a_counter_stepped_and_compared_inside_fusions(self):
    # As jaxlib 0.11's XLA:CPU wraps them (without its known_trip_count):
    # the add in a fusion of its own, the compare in the condition's.
    program = hlo_text.parse(_FUSED_COUNTER)
    self.assertEqual(hlo_text.loop_trips(program, program.instructions["w"]), 6)

  def test_a_counter_that_starts_at_a_parameter_is_unknown(self):
    self.assertIsNone(_trips_of_counted("%zero = s32[] constant(0)", "%zero = s32[] parameter(1)"))

  def test_xlas_known_trip_count_comes_first(self):
    self.assertEqual(
      _trips_of_counted("body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"5"}}'),
      5,
    )


def _trips_of_counted(old: str, new: str) -> Optional[int]:
  """`loop_trips` of `_COUNTED`'s loop of 8 steps, with `old` replaced by `new`."""
  program = hlo_text.parse(
    _COUNTED.format(start=0, step=1, direction="LT", limit=8, operands="%i, %n").replace(old, new)
  )
  return hlo_text.loop_trips(program, program.instructions["w"])


# An HLO text's backend configs (each ends its line or comes before another attribute).
_WITHOUT_CONFIG = re.compile(r", backend_config=\{.*?\}(?=$|, [a-z_]+=)", re.M)

_FUSED_COUNTER = """HloModule m
%lt_computation (p0: s32[], p1: s32[]) -> pred[] {
  %p0 = s32[] parameter(0)
  %p1 = s32[] parameter(1)
  ROOT %lt = pred[] compare(%p0, %p1), direction=LT
}

%cond (c: (s32[], f32[4])) -> pred[] {
  %c = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(6)
  ROOT %wrapped_lt = pred[] fusion(%i, %n), kind=kLoop, calls=%lt_computation
}

%add_computation (q0: s32[], q1: s32[]) -> s32[] {
  %q0 = s32[] parameter(0)
  %q1 = s32[] parameter(1)
  ROOT %add = s32[] add(%q0, %q1)
}

%body (b: (s32[], f32[4])) -> (s32[], f32[4]) {
  %b = (s32[], f32[4]{0}) parameter(0)
  %j = s32[] get-tuple-element(%b), index=0
  %one = s32[] constant(1)
  %wrapped_add = s32[] fusion(%j, %one), kind=kLoop, calls=%add_computation
  %x = f32[4]{0} get-tuple-element(%b), index=1
  %y = f32[4]{0} negate(%x)
  ROOT %t = (s32[], f32[4]{0}) tuple(%wrapped_add, %y)
}

ENTRY %main (p: f32[4]) -> (s32[], f32[4]) {
  %zero = s32[] constant(0)
  %p = f32[4]{0} parameter(0)
  %init = (s32[], f32[4]{0}) tuple(%zero, %p)
  ROOT %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
}
"""

# A loop as XLA:TPU compiles one: the counter copied before it is stepped,
# its start a copy of a constant, no backend config on the while.
_COUNTED = """HloModule m
%cond (c: (s32[], f32[4])) -> pred[] {{
  %n = s32[]{{:T(128)}} constant({limit})
  %c = (s32[]{{:T(128)}}, f32[4]{{0}}) parameter(0)
  %i = s32[]{{:T(128)}} get-tuple-element(%c), index=0
  ROOT %cmp = pred[]{{:T(512)}} compare({operands}), direction={direction}
}}

%body (b: (s32[], f32[4])) -> (s32[], f32[4]) {{
  %one..sunk = s32[]{{:T(128)}} constant({step})
  %b = (s32[]{{:T(128)}}, f32[4]{{0}}) parameter(0)
  %j = s32[]{{:T(128)}} get-tuple-element(%b), index=0
  %copy = s32[]{{:T(128)S(6)}} copy(%j)
  %next = s32[]{{:T(128)}} add(%copy, %one..sunk)
  %x = f32[4]{{0}} get-tuple-element(%b), index=1
  %y = f32[4]{{0}} negate(%x)
  ROOT %t = (s32[]{{:T(128)}}, f32[4]{{0}}) tuple(%next, %y)
}}

ENTRY %main (p: f32[4]) -> (s32[], f32[4]) {{
  %zero = s32[] constant({start})
  %p = f32[4]{{0}} parameter(0)
  %start = s32[]{{:T(128)}} copy(%zero)
  %init = (s32[]{{:T(128)}}, f32[4]{{0}}) tuple(%start, %p)
  ROOT %w = (s32[]{{:T(128)}}, f32[4]{{0}}) while(%init), condition=%cond, body=%body
}}
"""


if __name__ == "__main__":
  absltest.main()
