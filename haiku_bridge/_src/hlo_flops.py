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

import math
import re
from typing import NamedTuple

from haiku_bridge._src import hlo_text

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

_FLOAT = re.compile(r"^(f|bf|c)[0-9]")

# The parser is hlo_text's, shared with hlo_collectives.
_Instruction = hlo_text.Instruction
_parse = hlo_text.parse
_dims, _elements = hlo_text.dims, hlo_text.elements
_int_list, _called, _branches = (hlo_text.int_list, hlo_text.called,
                                 hlo_text.branches)
_backend_config, _trip_count = hlo_text.backend_config, hlo_text.trip_count


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


def count(hlo_text: str) -> Count:
  """The FLOPs of the optimised HLO `hlo_text` (`compiled.as_text()`).

  >>> from haiku_bridge._src import hlo_flops
  >>> f = lambda a, b: a @ b
  >>> a = jnp.ones([4, 8])
  >>> hlo_flops.count(jax.jit(f).lower(a, a.T).compile().as_text()).flops
  256
  """
  program = _parse(hlo_text)
  counter = _Counter(program.computations)
  return counter.run(program.entry)


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
