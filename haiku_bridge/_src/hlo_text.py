"""XLA's optimised HLO text (`compiled.as_text()`) read into computations of instructions, and walked.

The one reader of HLO text that the measures built on it share: FLOPs
(`hlo_flops`) and the bytes collectives move (`testing/hlo_collectives.py`). `parse`
gives each computation's instructions (name, result type, opcode, operands,
attributes); `walk` visits every instruction the entry computation reaches,
with the trip counts of the while loops around it (`loop_trips`: XLA's
`known_trip_count` where it wrote one, as XLA:CPU and XLA:GPU do on jax's
scans, else read off the loop's counter, as XLA:TPU leaves it).
"""

import json
import math
import re
from typing import Any, Iterator, NamedTuple, Optional, Sequence

import numpy as np

_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_SHAPE = re.compile(r"^[a-z][a-z0-9]*\[([0-9,]*)\]")
# An array type, and its layout where printed: `f32[4,16]{1,0:T(8,128)}`.
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{([0-9,]*)(?::([^}]*))?\})?")
_BRACKET = re.compile(r"[()\[\]{}]")
# Instructions that run another computation once per execution of their own.
# (`fusion-start`: XLA:GPU's asynchronous fusion, its result read by a
# `fusion-done`.)
_CALLS = {"fusion": "calls", "call": "to_apply", "async-start": "calls", "fusion-start": "calls"}


class Instruction(NamedTuple):
  """One line of a computation: `name = shape opcode(operands), attributes`."""

  name: str
  shape: str  # The result type as printed: `f32[4,16]{1,0}` or a tuple.
  opcode: str
  operands: tuple[str, ...]
  attributes: str
  # The text between the opcode's brackets: the operands as printed, a
  # constant's literal, a parameter's number.
  operand_text: str = ""


class Program(NamedTuple):
  """The computations of an HLO module, by name, the entry's name, and each computation's ROOT instruction's name."""

  computations: dict[str, list[Instruction]]
  entry: str
  roots: dict[str, str] = {}
  # Every instruction of the module by name (XLA's names are the module's own).
  instructions: dict[str, Instruction] = {}


class Site(NamedTuple):
  """An instruction where the walk reached it.

  Attributes:
    instruction: the instruction.
    shapes: the result type of each instruction of its computation so far
      (its operands' among them), by name.
    loops: the trip counts of the while loops around it, outermost first
      (1 for a loop with no known trip count: see `unknown_trip_counts`).
    in_branch: whether it is inside a `conditional`'s branch (which runs
      is known only at run time).
  """

  instruction: Instruction
  shapes: dict[str, str]
  loops: tuple[int, ...]
  in_branch: bool

  @property
  def executions(self) -> int:
    """How many times it runs: the trip counts around it, multiplied."""
    return math.prod(self.loops)


def parse(text: str) -> Program:
  """The computations of the HLO module `text`."""
  computations: dict[str, list[Instruction]] = {}
  roots: dict[str, str] = {}
  entry = None
  name = ""
  current = None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header and current is None:
      name = header.group(2)
      current = computations.setdefault(name, [])
      if header.group(1):
        entry = name
    elif line == "}":
      current = None
    elif current is not None and " = " in line:
      current.append(instruction(line))
      if line.lstrip().startswith("ROOT "):
        roots[name] = current[-1].name
  assert entry is not None, "XLA's HLO text names an ENTRY computation"
  return Program(
    computations, entry, roots, {ins.name: ins for body in computations.values() for ins in body}
  )


def walk(program: Program) -> Iterator[Site]:
  """Every instruction the entry reaches, each time a computation calls it.

  A while's body and condition are walked inside one more loop, its trip
  count (a condition runs once more than that: a caller counting its
  instructions exactly adds one execution); fusions, calls and async
  starts at their caller's loops; every branch of a conditional at its
  caller's loops, marked `in_branch`.
  """

  def visit(name: str, loops: tuple[int, ...], in_branch: bool) -> Iterator[Site]:
    shapes: dict[str, str] = {}
    for ins in program.computations[name]:
      shapes[ins.name] = ins.shape
      yield Site(ins, shapes, loops, in_branch)
      callee = runs(ins)
      if callee is not None:
        yield from visit(callee, loops, in_branch)
      elif ins.opcode == "while":
        inner = loops + (loop_trips(program, ins) or 1,)
        yield from visit(called(ins.attributes, "condition"), inner, in_branch)
        yield from visit(called(ins.attributes, "body"), inner, in_branch)
      elif ins.opcode == "conditional":
        for branch in branches(ins.attributes):
          yield from visit(branch, loops, True)

  yield from visit(program.entry, (), False)


def instruction(line: str) -> Instruction:
  """One instruction line of HLO text."""
  line = line.strip()
  if line.startswith("ROOT "):
    line = line[5:]
  name, rest = line.split(" = ", 1)
  if rest.startswith("("):
    end = _closing(rest, 0)
    shape, rest = rest[: end + 1], rest[end + 2 :]
  else:
    shape, rest = rest.split(" ", 1)
  opcode, rest = rest.split("(", 1)
  end = _closing("(" + rest, 0) - 1
  operands = tuple(re.findall(r"%([^\s,()]+)", rest[:end]))
  return Instruction(name.lstrip("%"), shape, opcode, operands, rest[end + 1 :], rest[:end])


def _closing(text: str, start: int) -> int:
  """The index of the bracket closing the one at `start`.

  The brackets found by a regular expression, not character by character:
  a constant's literal (a remat schedule's table) runs to many thousand
  characters with few brackets.
  """
  depth = 0
  for bracket in _BRACKET.finditer(text, start):
    if bracket.group() in "([{":
      depth += 1
    else:
      depth -= 1
      if not depth:
        return bracket.start()
  raise AssertionError(f"Unbalanced brackets in XLA's HLO: {text[:200]}")


def dims(shape: str) -> tuple[int, ...]:
  """The dimensions of an array type (`()` for a tuple or a token)."""
  match = _SHAPE.match(shape)
  if match is None:  # A tuple, a token.
    return ()
  return tuple(int(d) for d in match.group(1).split(",") if d)


def elements(shape: str) -> int:
  """The elements of an array type (0 for a tuple or a token)."""
  return math.prod(dims(shape)) if _SHAPE.match(shape) else 0


# Bytes per element of each element type XLA prints (`pred` is a byte).
_BITS = {
  "pred": 8,
  "s2": 2,
  "u2": 2,
  "s4": 4,
  "u4": 4,
  "s8": 8,
  "u8": 8,
  "s16": 16,
  "u16": 16,
  "s32": 32,
  "u32": 32,
  "s64": 64,
  "u64": 64,
  "f16": 16,
  "bf16": 16,
  "f32": 32,
  "f64": 64,
  "c64": 64,
  "c128": 128,
}


class Array(NamedTuple):
  """One array of a type: its dimensions and its bytes (as its layout holds them)."""

  dims: tuple[int, ...]
  bytes: int


def arrays(shape: str) -> list[Array]:
  """The arrays of a type, a tuple's in order (tokens: none).

  An array's bytes are those its layout holds: where the layout tiles it
  (XLA:TPU's `{1,0:T(8,128)}`), its minor dimensions are padded to the
  first tile's, as XLA allocates them; XLA:CPU and XLA:GPU print no tiles.

  >>> from haiku_bridge._src import hlo_text
  >>> [a.bytes for a in hlo_text.arrays("(f32[4,16]{1,0}, bf16[8]{0}, token[])")]
  [256, 16]
  >>> [a.bytes for a in hlo_text.arrays("f32[4,16]{1,0:T(8,128)}")]  # 8 × 128.
  [4096]
  """
  found = []
  for dtype, sizes, minor_to_major, tiling in _ARRAY.findall(shape):
    if dtype == "token":
      continue
    bits = _BITS.get(dtype, 8 if dtype.startswith("f8") else None)
    assert bits is not None, f"an element type of XLA's HLO: {dtype}"
    array_dims = tuple(int(d) for d in sizes.split(",") if d)
    held = _tiled(array_dims, minor_to_major, tiling)
    found.append(Array(array_dims, math.prod(held) * bits // 8))
  return found


def array_bytes(
  shape: Sequence[int],
  dtype: Any,
  major_to_minor: Optional[Sequence[int]] = None,
  tiling: Sequence[Sequence[int]] = (),
) -> Optional[int]:
  """The bytes a device holds of an array of `shape` and `dtype` at a layout, as `arrays` reads them from HLO.

  The layout as jax gives it (`jax.stages.Compiled.input_formats`' layouts:
  `major_to_minor`, `tiling`); None: no layout, the elements' bytes. None
  for an element type HLO has no name for here (a typed PRNG key).

  >>> from haiku_bridge._src import hlo_text
  >>> hlo_text.array_bytes((4, 16), jnp.float32, (0, 1), ((8, 128),))  # 8 × 128.
  4096
  >>> hlo_text.array_bytes((4, 16), jnp.float32, (0, 1))
  256
  """
  name = _element_type(dtype)
  if name is None:
    return None
  layout = ""
  if major_to_minor is not None:
    tiles = "".join(
      ("T" if i == 0 else "") + "(" + ",".join(map(str, tile)) + ")"
      for i, tile in enumerate(tiling)
    )
    layout = (
      "{" + ",".join(map(str, reversed(major_to_minor))) + (":" + tiles if tiles else "") + "}"
    )
  (array,) = arrays(f"{name}[{','.join(map(str, shape))}]{layout}")
  return array.bytes


def _element_type(dtype: Any) -> Optional[str]:
  """HLO's name of a numpy (or jax) element type: `f32`, `bf16`, `pred`; None where `arrays` knows none."""
  try:
    name = np.dtype(dtype).name
  except TypeError:  # jax's extended types (a typed PRNG key's).
    return None
  if name == "bool":
    return "pred"
  if name == "bfloat16":
    return "bf16"
  if name.startswith("float8_"):
    return "f8" + name[len("float8_") :]
  kind = re.fullmatch(r"(int|uint|float|complex)([0-9]+)", name)
  if kind is None:
    return None
  hlo = {"int": "s", "uint": "u", "float": "f", "complex": "c"}[kind.group(1)] + kind.group(2)
  return hlo if hlo in _BITS else None


def _tiled(array_dims: tuple[int, ...], minor_to_major: str, tiling: str) -> tuple[int, ...]:
  """The dimensions an array's layout holds, major to minor: its first tile's pads the minor ones.

  (A layout's further tiles, `(2,1)` packing bfloat16 pairs, divide the
  first's and pad nothing more; measured on XLA:TPU, `hlo_text_test`.)
  """
  tile = re.search(r"T\(([0-9,]*)\)", tiling)
  if tile is None:
    return array_dims
  order = [int(d) for d in minor_to_major.split(",") if d]
  held = [array_dims[d] for d in reversed(order)] if order else []
  sizes = [int(t) for t in tile.group(1).split(",") if t]
  held = [1] * (len(sizes) - len(held)) + held  # A scalar's tile holds it.
  for i, t in enumerate(sizes, start=len(held) - len(sizes)):
    held[i] = -(-held[i] // t) * t
  return tuple(held)


def int_list(attributes: str, key: str) -> tuple[int, ...]:
  """The integers of an attribute `key={1,2}` (none without it)."""
  match = re.search(key + r"=\{([0-9,]*)\}", attributes)
  return tuple(int(d) for d in match.group(1).split(",") if d) if match else ()


def called(attributes: str, key: str) -> str:
  """The computation an attribute (`body=`, `calls=`, `to_apply=`) names."""
  match = re.search(key + r"=%([^\s,]+)", attributes)
  assert match, f"no {key}= in {attributes[:200]}"
  return match.group(1)


def runs(ins: Instruction) -> Optional[str]:
  """The computation `ins` runs once per execution of its own, if it is a fusion, call or async start."""
  key = _CALLS.get(ins.opcode)
  return None if key is None else called(ins.attributes, key)


def branches(attributes: str) -> Iterator[str]:
  """A conditional's branch computations, in the HLO's order."""
  listed = re.search(r"branch_computations=\{([^}]*)\}", attributes)
  if listed:
    yield from re.findall(r"%([^\s,]+)", listed.group(1))
  else:
    yield called(attributes, "false_computation")
    yield called(attributes, "true_computation")


def backend_config(attributes: str) -> Optional[dict[str, Any]]:
  """An instruction's JSON `backend_config`, as a dict (None without one)."""
  start = attributes.find("backend_config={")
  if start < 0:
    return None
  start += len("backend_config=")
  try:
    return json.loads(attributes[start : _closing(attributes, start) + 1])
  except json.JSONDecodeError:
    return None


def trip_count(attributes: str) -> Optional[int]:
  """A while loop's `known_trip_count` (None where XLA wrote none)."""
  config = backend_config(attributes) or {}
  n = config.get("known_trip_count", {}).get("n")
  return None if n is None else int(n)


def loop_trips(program: Program, loop: Instruction) -> Optional[int]:
  """How many times a while loop runs its body (None where the HLO does not say).

  XLA's `known_trip_count` where it wrote one; else the loop's own counter,
  as XLA:TPU's compiled loops leave it: an element of the loop's tuple that
  starts at a constant (the while's operand), that the body steps by a
  constant and that the condition compares with a constant.

  >>> from haiku_bridge._src import hlo_text
  >>> program = hlo_text.parse('''
  ... %cond (p: (s32[], f32[4])) -> pred[] {
  ...   %p = (s32[], f32[4]) parameter(0)
  ...   %i = s32[] get-tuple-element(%p), index=0
  ...   %n = s32[] constant(6)
  ...   ROOT %lt = pred[] compare(%i, %n), direction=LT
  ... }
  ... %body (q: (s32[], f32[4])) -> (s32[], f32[4]) {
  ...   %q = (s32[], f32[4]) parameter(0)
  ...   %j = s32[] get-tuple-element(%q), index=0
  ...   %two = s32[] constant(2)
  ...   %next = s32[] add(%j, %two)
  ...   %x = f32[4] get-tuple-element(%q), index=1
  ...   ROOT %t = (s32[], f32[4]) tuple(%next, %x)
  ... }
  ... ENTRY %main (x: f32[4]) -> (s32[], f32[4]) {
  ...   %x0 = f32[4] parameter(0)
  ...   %zero = s32[] constant(0)
  ...   %init = (s32[], f32[4]) tuple(%zero, %x0)
  ...   ROOT %w = (s32[], f32[4]) while(%init), condition=%cond, body=%body
  ... }''')
  >>> hlo_text.loop_trips(program, program.instructions["w"])
  3
  """
  known = trip_count(loop.attributes)
  if known is not None or not program.instructions:
    return known
  cond = called(loop.attributes, "condition")
  body = called(loop.attributes, "body")
  compare = _value(program, program.roots.get(cond, ""))
  if compare is None or compare[0] != "compare":
    return None
  _, direction, a, b = compare
  if a[0] != "element" or b[0] != "constant":  # `limit OP counter`.
    a, b = b, a
    direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
  if a[0] != "element" or b[0] != "constant":
    return None
  index, limit = a[1], b[1]
  root = program.instructions.get(program.roots.get(body, ""))
  start = _element(program, loop.operands[0], index)
  if (
    root is None
    or root.opcode != "tuple"
    or index >= len(root.operands)
    or start is None
    or start[0] != "constant"
  ):
    return None
  stepped = _value(program, root.operands[index])
  if stepped is None or stepped[0] not in ("add", "subtract"):
    return None
  op, x, y = stepped
  if op == "add" and y == ("element", index):
    x, y = y, x
  if x != ("element", index) or y[0] != "constant" or not y[1]:
    return None
  step, start = (-y[1] if op == "subtract" else y[1]), start[1]
  distance = limit - start
  if direction in ("LE", "GE"):
    distance += 1 if step > 0 else -1
  if direction in ("LT", "LE") and step > 0 or (direction in ("GT", "GE") and step < 0):
    return max(0, -(-distance // step))
  if direction == "NE" and distance % step == 0 and distance // step >= 0:
    return distance // step
  return None


def _value(program: Program, name: str, args: tuple[Any, ...] = ()) -> Optional[tuple[Any, ...]]:
  """What `name` computes, as far as a loop's counter needs it (None beyond).

  `("constant", n)` for an integer scalar, `("element", k)` for element k
  of the loop's tuple (its computation's parameter), `(op, x, y)` for an
  add or subtract, `("compare", direction, x, y)`; through copies,
  bitcasts and the fusions and calls XLA wraps them in (`args`: a fused
  computation's operands, each `(name, args)` where it is computed).
  """
  ins = _source(program, name)
  if ins is None:
    return None
  op = ins.opcode
  if op == "parameter":
    if not args:
      return ("parameter",)
    number = int(ins.operand_text)
    return _value(program, *args[number]) if number < len(args) else None
  if op == "constant":
    literal = ins.operand_text.strip()
    return (
      ("constant", int(literal))
      if not dims(ins.shape) and re.fullmatch(r"-?[0-9]+", literal)
      else None
    )
  if op == "get-tuple-element":
    index = re.search(r"index=([0-9]+)", ins.attributes)
    return (
      ("element", int(index.group(1)))
      if index and _value(program, ins.operands[0], args) == ("parameter",)
      else None
    )
  if op in ("add", "subtract") and len(ins.operands) == 2:
    x, y = (_value(program, o, args) for o in ins.operands)
    return None if x is None or y is None else (op, x, y)
  if op == "compare" and len(ins.operands) == 2:
    direction = re.search(r"direction=(\w+)", ins.attributes)
    x, y = (_value(program, o, args) for o in ins.operands)
    return (
      None if direction is None or x is None or y is None else ("compare", direction.group(1), x, y)
    )
  callee = runs(ins)
  if callee is not None and op in ("fusion", "call"):
    return _value(program, program.roots.get(callee, ""), tuple((o, args) for o in ins.operands))
  return None


def _source(program: Program, name: str) -> Optional[Instruction]:
  """The instruction `name` copies or bitcasts, through any number of them (`name`'s own if neither)."""
  ins = program.instructions.get(name)
  while ins is not None and ins.opcode in ("copy", "bitcast") and ins.operands:
    ins = program.instructions.get(ins.operands[0])
  return ins


def _element(program: Program, name: str, index: int) -> Optional[tuple[Any, ...]]:
  """What element `index` of the tuple that `name` builds computes (`_value`)."""
  ins = _source(program, name)
  if ins is None or ins.opcode != "tuple" or index >= len(ins.operands):
    return None
  return _value(program, ins.operands[index])
