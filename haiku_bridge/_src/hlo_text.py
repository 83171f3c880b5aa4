"""XLA's optimised HLO text (`compiled.as_text()`) read into computations of instructions, and walked.

The one reader of HLO text that the measures built on it share: FLOPs
(`hlo_flops`) and the bytes collectives move (`hlo_collectives`). `parse`
gives each computation's instructions (name, result type, opcode, operands,
attributes); `walk` visits every instruction the entry computation reaches,
with the trip counts of the while loops around it (`known_trip_count` in a
while's backend_config, which jax's scans always have).
"""

import json
import math
import re
from typing import Any, Iterator, NamedTuple, Optional

_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_SHAPE = re.compile(r"^[a-z][a-z0-9]*\[([0-9,]*)\]")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_BRACKET = re.compile(r"[()\[\]{}]")
# Instructions that run another computation once per execution of their own.
# (`fusion-start`: XLA:GPU's asynchronous fusion, its result read by a
# `fusion-done`.)
_CALLS = {"fusion": "calls", "call": "to_apply", "async-start": "calls",
          "fusion-start": "calls"}


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
  return Program(computations, entry, roots)


def walk(program: Program) -> Iterator[Site]:
  """Every instruction the entry reaches, each time a computation calls it.

  A while's body and condition are walked inside one more loop, its trip
  count (a condition runs once more than that: a caller counting its
  instructions exactly adds one execution); fusions, calls and async
  starts at their caller's loops; every branch of a conditional at its
  caller's loops, marked `in_branch`.
  """
  def visit(name: str, loops: tuple[int, ...], in_branch: bool
            ) -> Iterator[Site]:
    shapes: dict[str, str] = {}
    for ins in program.computations[name]:
      shapes[ins.name] = ins.shape
      yield Site(ins, shapes, loops, in_branch)
      callee = runs(ins)
      if callee is not None:
        yield from visit(callee, loops, in_branch)
      elif ins.opcode == "while":
        inner = loops + (trip_count(ins.attributes) or 1,)
        yield from visit(called(ins.attributes, "condition"), inner,
                         in_branch)
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
    shape, rest = rest[:end + 1], rest[end + 2:]
  else:
    shape, rest = rest.split(" ", 1)
  opcode, rest = rest.split("(", 1)
  end = _closing("(" + rest, 0) - 1
  operands = tuple(re.findall(r"%([^\s,()]+)", rest[:end]))
  return Instruction(name.lstrip("%"), shape, opcode, operands,
                     rest[end + 1:], rest[:end])


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
_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
         "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
         "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128}


class Array(NamedTuple):
  """One array of a type: its dimensions and its bytes."""
  dims: tuple[int, ...]
  bytes: int


def arrays(shape: str) -> list[Array]:
  """The arrays of a type, a tuple's in order (tokens: none).

  >>> from haiku_bridge._src import hlo_text
  >>> [a.bytes for a in hlo_text.arrays("(f32[4,16]{1,0}, bf16[8]{0}, token[])")]
  [256, 16]
  """
  found = []
  for dtype, sizes in _ARRAY.findall(shape):
    if dtype == "token":
      continue
    bits = _BITS.get(dtype, 8 if dtype.startswith("f8") else None)
    assert bits is not None, f"an element type of XLA's HLO: {dtype}"
    array_dims = tuple(int(d) for d in sizes.split(",") if d)
    found.append(Array(array_dims, math.prod(array_dims) * bits // 8))
  return found


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
    return json.loads(attributes[start:_closing(attributes, start) + 1])
  except json.JSONDecodeError:
    return None


def trip_count(attributes: str) -> Optional[int]:
  """A while loop's `known_trip_count` (None where XLA wrote none)."""
  config = backend_config(attributes) or {}
  n = config.get("known_trip_count", {}).get("n")
  return None if n is None else int(n)
