"""FLOPs of a compiled XLA program with every while loop counted by its trip count.

`compiled.cost_analysis()["flops"]` counts a while loop's body once: a
scan's gradient reports the same FLOPs at 256 steps as at 4096. `count`
reads the optimised HLO (`compiled.as_text()`) instead and multiplies each
loop's body by the trip count XLA wrote on it (`known_trip_count` in the
while's backend_config; jax's scans always have one). The rule, per
instruction, with `n` the elements of its result:

- `dot`: 2·n·(the product of the left operand's contracting dimensions);
  `convolution`: 2·n·(the kernel's elements over its output features: its
  input features are already those of one feature group).
- `reduce`, `reduce-window`, `scatter`, `map`: the reducer's FLOPs per
  element of the input (of the updates, for `scatter`).
- a `custom-call` that is a matrix multiply (GPU's cuBLAS calls: a
  `dot_dimension_numbers` in its `gemm_backend_config`): as `dot`, on its
  first result. Any other `custom-call` (a cuDNN convolution, a LAPACK
  routine): 0, and named in `Count.opaque_custom_calls`.
- data movement (copy, broadcast, slices, reshapes, transposes, gathers,
  tuples, parameters, constants, iota, and the like), `sort`, `rng`,
  collectives: 0.
- every other instruction (arithmetic, compares, selects, converts,
  transcendentals alike) on floating-point or complex values (its result's
  or its first operand's type): n, one per element; on integers and
  predicates (a loop's counter, a slice's start): 0.
- `fusion`, `call`, `async-start`: the called computation's FLOPs.
- `while`: trip count × (body + condition) + one more condition. A loop
  with no known trip count is counted once and named in
  `Count.unknown_trip_counts`.
- `conditional`: which branch runs is known only at run time, so `flops`
  counts the cheapest branch, and `Count.conditionals` lists each
  conditional's executions (the trip counts around it multiplied) with
  every branch's FLOPs, for a caller that knows how often each runs (a
  conditional inside another's branch counts in that branch, unlisted).

XLA's own count puts transcendentals apart and counts some elementwise
ops its own way, so compare `flops` with `flops + transcendentals` of
`cost_analysis()` of the same program unrolled (`hlo_flops_test.py` does).
`remat_plan` measures the recomputation of each candidate with it.
"""

import json
import math
import re
from typing import Iterator, NamedTuple

# Instructions that move or name data and compute nothing.
_FREE = frozenset("""
    parameter constant iota copy copy-start copy-done bitcast bitcast-convert
    broadcast reshape transpose slice dynamic-slice dynamic-update-slice
    concatenate pad reverse gather tuple get-tuple-element sort
    rng rng-bit-generator rng-get-and-update-state after-all partition-id
    replica-id all-reduce all-gather all-to-all reduce-scatter
    collective-permute send recv send-done recv-done infeed outfeed
    optimization-barrier domain add-dependency async-done async-update
    get-dimension-size set-dimension-size
""".split())
_CALLS = frozenset(["fusion", "call", "async-start"])
_PER_INPUT_ELEMENT = frozenset(["reduce", "reduce-window", "map"])

_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_FLOAT = re.compile(r"^(f|bf|c)[0-9]")
_SHAPE = re.compile(r"^[a-z][a-z0-9]*\[([0-9,]*)\]")


class Conditional(NamedTuple):
  """A `conditional` of the program: how often it runs, what each branch costs.

  Attributes:
    executions: how many times it runs (the trip counts around it, multiplied).
    branches: each branch's FLOPs for one execution, in the HLO's order
      (for `jax.lax.cond(p, t, f)`: `f`'s, then `t`'s).
  """
  executions: int
  branches: tuple[int, ...]


class Count(NamedTuple):
  """The FLOPs of a program (see the module docstring for the rule).

  Attributes:
    flops: every loop by its trip count, every conditional by its cheapest
      branch.
    conditionals: every conditional outside another's branches, by its
      executions and branches.
    unknown_trip_counts: the while loops counted once, for want of a trip count.
    opaque_custom_calls: the targets of the custom-calls counted as 0 FLOPs
      (every one that is not a matrix multiply), each once.
  """
  flops: int
  conditionals: tuple[Conditional, ...]
  unknown_trip_counts: int
  opaque_custom_calls: tuple[str, ...] = ()


class _Instruction(NamedTuple):
  name: str
  shape: str  # The result type as printed: `f32[4,16]{1,0}` or a tuple.
  opcode: str
  operands: tuple[str, ...]
  attributes: str


def count(hlo_text: str) -> Count:
  """The FLOPs of the optimised HLO `hlo_text` (`compiled.as_text()`).

  >>> from haiku_bridge._src import hlo_flops
  >>> f = lambda a, b: a @ b
  >>> a = jnp.ones([4, 8])
  >>> hlo_flops.count(jax.jit(f).lower(a, a.T).compile().as_text()).flops
  256
  """
  computations, entry = _parse(hlo_text)
  counter = _Counter(computations)
  return counter.run(entry)


class _Counter:
  """Walks computations from the entry, multiplying by the loops around each."""

  def __init__(self, computations: dict[str, list[_Instruction]]):
    self._computations = computations
    self._conditionals: list[Conditional] = []
    self._unknown = 0
    self._opaque: dict[str, None] = {}

  def run(self, entry: str) -> Count:
    flops = self._computation(entry, 1)
    return Count(flops, tuple(self._conditionals), self._unknown,
                 tuple(self._opaque))

  def _computation(self, name: str, executions: int) -> int:
    shapes = {}
    total = 0
    for ins in self._computations[name]:
      shapes[ins.name] = ins.shape
      total += self._instruction(ins, shapes, executions)
    return total

  def _instruction(self, ins: _Instruction, shapes: dict[str, str],
                   executions: int) -> int:
    op = ins.opcode
    if op in _FREE:
      return 0
    if op in _CALLS:
      # A fusion names its computation `calls=`, a call `to_apply=`.
      key = "to_apply" if op == "call" else "calls"
      return self._computation(_called(ins.attributes, key), executions)
    if op == "while":
      trips = _trip_count(ins.attributes)
      if trips is None:
        self._unknown += 1
        trips = 1
      body = self._computation(_called(ins.attributes, "body"),
                               executions * trips)
      cond = self._computation(_called(ins.attributes, "condition"),
                               executions * (trips + 1))
      return trips * body + (trips + 1) * cond
    if op == "conditional":
      branches = tuple(self._computation(b, 0) for b in _branches(
          ins.attributes))
      if executions:
        self._conditionals.append(Conditional(executions, branches))
      return min(branches)
    if op == "custom-call":
      return self._custom_call(ins, shapes)
    n = _elements(ins.shape)
    if op == "dot":
      lhs = _dims(shapes[ins.operands[0]])
      contracting = _int_list(ins.attributes, "lhs_contracting_dims")
      return 2 * n * math.prod(lhs[d] for d in contracting)
    if op == "convolution":
      kernel = _dims(shapes[ins.operands[1]])
      labels = re.search(r"dim_labels=[^_]+_([^-]+)->", ins.attributes)
      assert labels, f"a convolution without dim_labels: {ins}"
      # The kernel's input features are already per feature group.
      return 2 * n * math.prod(kernel) // kernel[labels.group(1).index("o")]
    if op in _PER_INPUT_ELEMENT or op == "scatter":
      reducer = self._computation(_called(ins.attributes, "to_apply"), 0)
      source = ins.operands[-1] if op == "scatter" else ins.operands[0]
      return _elements(shapes[source]) * reducer
    # Index arithmetic (a loop's counter, a slice's start) is not floating point.
    operand = shapes.get(ins.operands[0], "") if ins.operands else ""
    return n if _FLOAT.match(ins.shape) or _FLOAT.match(operand) else 0


  def _custom_call(self, ins: _Instruction, shapes: dict[str, str]) -> int:
    gemm = (_backend_config(ins.attributes) or {}).get(
        "gemm_backend_config", {})
    contracting = gemm.get("dot_dimension_numbers", {}).get(
        "lhs_contracting_dimensions")
    if contracting is None:
      target = re.search(r'custom_call_target="([^"]*)"', ins.attributes)
      self._opaque[target.group(1) if target else "?"] = None
      return 0
    # The product, then (on GPU) the library's workspace.
    result = ins.shape[1:] if ins.shape.startswith("(") else ins.shape
    lhs = _dims(shapes[ins.operands[0]])
    return 2 * _elements(result) * math.prod(lhs[int(d)] for d in contracting)


def _parse(text: str) -> tuple[dict[str, list[_Instruction]], str]:
  computations: dict[str, list[_Instruction]] = {}
  entry = None
  current = None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header and current is None:
      current = computations.setdefault(header.group(2), [])
      if header.group(1):
        entry = header.group(2)
    elif line == "}":
      current = None
    elif current is not None and " = " in line:
      current.append(_instruction(line))
  assert entry is not None, "XLA's HLO text names an ENTRY computation"
  return computations, entry


def _instruction(line: str) -> _Instruction:
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
  return _Instruction(name.lstrip("%"), shape, opcode, operands,
                      rest[end + 1:])


def _closing(text: str, start: int) -> int:
  """The index of the bracket closing the one at `start`."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] in "([{":
      depth += 1
    elif text[i] in ")]}":
      depth -= 1
      if not depth:
        return i
  raise AssertionError(f"Unbalanced brackets in XLA's HLO: {text[:200]}")


def _dims(shape: str) -> tuple[int, ...]:
  match = _SHAPE.match(shape)
  if match is None:  # A tuple, a token.
    return ()
  return tuple(int(d) for d in match.group(1).split(",") if d)


def _elements(shape: str) -> int:
  return math.prod(_dims(shape)) if _SHAPE.match(shape) else 0


def _int_list(attributes: str, key: str) -> tuple[int, ...]:
  match = re.search(key + r"=\{([0-9,]*)\}", attributes)
  return tuple(int(d) for d in match.group(1).split(",") if d) if match else ()


def _called(attributes: str, key: str) -> str:
  match = re.search(key + r"=%([^\s,]+)", attributes)
  assert match, f"no {key}= in {attributes[:200]}"
  return match.group(1)


def _branches(attributes: str) -> Iterator[str]:
  listed = re.search(r"branch_computations=\{([^}]*)\}", attributes)
  if listed:
    yield from re.findall(r"%([^\s,]+)", listed.group(1))
  else:
    yield _called(attributes, "false_computation")
    yield _called(attributes, "true_computation")


def _backend_config(attributes: str):
  """An instruction's JSON `backend_config`, as a dict (None without one)."""
  start = attributes.find("backend_config={")
  if start < 0:
    return None
  start += len("backend_config=")
  try:
    return json.loads(attributes[start:_closing(attributes, start) + 1])
  except json.JSONDecodeError:
    return None


def _trip_count(attributes: str):
  config = _backend_config(attributes) or {}
  n = config.get("known_trip_count", {}).get("n")
  return None if n is None else int(n)


_CONSTANT = re.compile(r"^\s*(?:ROOT )?%\S+ = ([a-z][a-z0-9]*)\[([0-9,]+)\]\S* "
                       r"constant\(")


def constant_bytes(hlo_text: str) -> int:
  """Bytes of the array constants the HLO `hlo_text` holds (e.g. a remat schedule's tables).

  XLA's memory analysis counts a program's temporaries, not the constants
  compiled into it.

  >>> from haiku_bridge._src import hlo_flops
  >>> table = np.random.default_rng(0).integers(0, 9, 1000).astype(np.int32)
  >>> f = jax.jit(lambda i: jnp.asarray(table)[i])
  >>> hlo_flops.constant_bytes(f.lower(3).compile().as_text())
  4000
  """
  total = 0
  for line in hlo_text.splitlines():
    match = _CONSTANT.match(line)
    if match:
      dims = [int(d) for d in match.group(2).split(",") if d]
      total += math.prod(dims) * _ITEMSIZE.get(match.group(1), 4)
  return total


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
             "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
             "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
