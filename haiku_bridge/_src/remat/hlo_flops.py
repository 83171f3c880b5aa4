"""FLOPs of a compiled XLA program with every while loop counted by its trip count.

`compiled.cost_analysis()["flops"]` counts a while loop's body once: a
scan's gradient reports the same FLOPs at 256 steps as at 4096. `count`
reads the optimised HLO (`compiled.as_text()`) instead and multiplies each
loop's body by its trip count (`hlo_text.loop_trips`: the
`known_trip_count` XLA:CPU and XLA:GPU write on jax's scans, else the
loop's counter read off its HLO, as XLA:TPU leaves it). The rule, per
instruction, with `n` the elements of its result:

- `dot`: 2·n·(the product of the left operand's contracting dimensions).
- `convolution`: 2 per multiply-add, as XLA counts them: (input features
  per feature group)·(output features)·(batch per batch group)·(the
  (kernel, output) positions of each spatial dimension whose input is
  real, not padding nor a hole of `lhs_dilate`), from the operands' and
  result's shapes, `dim_labels` and `window`.
- `reduce`, `reduce-window`, `scatter`, `map`: the reducer's FLOPs per
  element of the input (of the updates, for `scatter`).
- a `custom-call` that is a matrix multiply (GPU's cuBLAS calls: a
  `dot_dimension_numbers` in its `gemm_backend_config`): as `dot`, on its
  first result. A cuDNN convolution (GPU's `__cudnn$conv...` calls, which
  keep the forward convolution's `window`, `dim_labels` and group counts):
  as `convolution`, with the forward convolution's input, kernel and
  output read from where the call keeps them (`convBackwardInput`: the
  output is the first operand, the input the first result;
  `convBackwardFilter`: the output is the second operand, the kernel the
  first result). Where XLA:GPU pads the input itself (a `pad` before the
  call, for a padding cuDNN cannot take), the zeros are the call's input
  and count, as the GPU multiplies them. XLA:TPU's `AllocateBuffer` (a
  buffer a loop then writes): 0. Any other `custom-call` (a LAPACK
  routine): 0, and named in `Count.opaque_custom_calls`.
- data movement (copy, broadcast, slices, reshapes, transposes, gathers,
  tuples, parameters, constants, iota, and the like), `sort`, `rng`,
  collectives, the ends of asynchronous pairs (`fusion-done`,
  `copy-done`, `all-reduce-done`, ...): 0.
- every other instruction (arithmetic, compares, selects, converts,
  transcendentals alike) on floating-point or complex values (its result's
  or its first operand's type): n, one per element; on integers and
  predicates (a loop's counter, a slice's start): 0.
- `fusion`, `call`, `async-start`, `fusion-start` (XLA:GPU's asynchronous
  fusion, whose `fusion-done` gives its result): the called computation's
  FLOPs.
- `while`: trip count × (body + condition) + one more condition. A loop
  whose trip count neither XLA wrote nor its counter tells is counted
  once and named in
  `Count.unknown_trip_counts`.
- `conditional`: which branch runs is known only at run time, so `flops`
  counts the cheapest branch (with `count(..., dearest=True)`, the
  dearest: a bound from above), and `Count.conditionals` lists each
  conditional's executions (the trip counts around it multiplied) with
  every branch's FLOPs, for a caller that knows how often each runs (a
  conditional inside another's branch counts in that branch, unlisted).

A value is counted once per execution of the computation that computes it
(a loop's body, a branch, the entry), in whichever of its fusions it sits:
XLA:GPU copies a cheap producer (an add, a tanh, a dynamic slice) into
each fusion that reads it rather than write it to memory, and copies
differently in a loop rolled and unrolled, or with and without
`jax.checkpoint`. Two instructions are the same value when their opcode,
type (no layout, no dimension of 1), attributes (not metadata nor
configs; an applied computation by its content) and operands' values
are; a copy, a reshape that only adds or drops dimensions of 1 (a bitcast
too, where it keeps the elements' order in memory), and an asynchronous
pair's end are their operand's value; a parameter
of the computation, a loop, a conditional, a custom-call, random bits, a
collective, an optimization barrier and a constant whose literal XLA
leaves out (`{...}`) are each a value of their own. So `flops` is the
program's arithmetic, not how often XLA chose to repeat it: a loop rolled
counts as the same loop unrolled, on CPU and GPU alike.

XLA's own count puts transcendentals apart, counts some elementwise ops
its own way and counts each copy a fusion makes, so compare `flops` with
`flops + transcendentals` of `cost_analysis()` of the same program
unrolled, on CPU, whose fusions copy little (`hlo_flops_test.py` does).
`remat_plan` measures the recomputation of each candidate with it.
"""

import math
import re
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

import jax
import numpy as np

from haiku_bridge._src import errors
from haiku_bridge._src import hlo_text
from haiku_bridge._src import pytree

# Instructions that move or name data and compute nothing.
_FREE = frozenset(
  """
    parameter constant iota bitcast bitcast-convert broadcast reshape
    transpose slice dynamic-slice dynamic-update-slice concatenate pad
    reverse gather tuple get-tuple-element sort get-dimension-size
    set-dimension-size
""".split()
)
# Instructions whose value is their first operand's: a copy, the end of an
# asynchronous copy or computation.
_SAME_VALUE = frozenset(
  ["copy", "copy-start", "copy-done", "fusion-done", "async-done", "add-dependency", "domain"]
)
# Instructions whose value is their own, 0 FLOPs but for a loop, a
# conditional and a library call: two alike may differ (random bits, a
# loop, a library call, what another device sends), or must not be merged
# (an optimization barrier, which keeps a recomputation apart from the
# forward pass it repeats). So are the other halves of asynchronous pairs
# (`...-start`, `...-update`, `...-done`: collectives, send and recv).
_OWN_VALUE = frozenset(
  """
    while conditional custom-call rng rng-bit-generator
    rng-get-and-update-state infeed outfeed send recv after-all
    opt-barrier partition-id replica-id all-reduce all-gather
    all-to-all reduce-scatter collective-permute collective-broadcast
    ragged-all-to-all async-update
""".split()
)
_COMMUTATIVE = frozenset(["add", "multiply", "maximum", "minimum", "and", "or", "xor"])
# Attributes that do not say what an instruction computes.
_NOT_ARITHMETIC = frozenset(
  [
    "metadata",
    "backend_config",
    "frontend_attributes",
    "control-predecessors",
    "sharding",
    "statistics",
    "origin",
  ]
)
_PER_INPUT_ELEMENT = frozenset(["reduce", "reduce-window", "map"])

_FLOAT = re.compile(r"^(f|bf|c)[0-9]")


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
      branch (by its dearest with `count(..., dearest=True)`).
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


def count(text: str, dearest: bool = False) -> Count:
  """The FLOPs of the optimised HLO `text` (`compiled.as_text()`).

  `dearest`: each conditional counted by its dearest branch, not its
  cheapest (in `flops`, and in the branches of another conditional).

  >>> from haiku_bridge._src.remat import hlo_flops
  >>> f = lambda a, b: a @ b
  >>> a = jnp.ones([4, 8])
  >>> hlo_flops.count(jax.jit(f).lower(a, a.T).compile().as_text()).flops
  256
  """
  program = hlo_text.parse(text)
  return _Counter(program, max if dearest else min).run(program.entry)


def _type(shape: str) -> str:
  """A type as a value's number takes it: no layout, no dimension of 1 (`f32[1,4]{1,0}`: `f32[4]`)."""
  if shape.startswith("("):
    return _without_layouts(shape)
  dims = ",".join(str(d) for d in hlo_text.dims(shape) if d != 1)
  return shape[: shape.find("[")] + f"[{dims}]"


def _in_memory(shape: str) -> tuple[int, ...]:
  """An array's order in memory: its dimensions other than 1, numbered among themselves, minor to major.

  (A bitcast keeps the bytes: where this changes, it reorders elements.)
  """
  dims = hlo_text.dims(shape)
  layout = re.search(r"\]\{([0-9,]*)", shape)
  order = (
    [int(d) for d in layout.group(1).split(",") if d]
    if layout
    else list(reversed(range(len(dims))))
  )
  kept = [d for d in range(len(dims)) if dims[d] != 1]
  return tuple(kept.index(d) for d in order if dims[d] != 1)


def _without_layouts(text: str) -> str:
  """`text` with the layouts of the types in it left out (`f32[4,8]{1,0}`: `f32[4,8]`)."""
  return re.sub(r"\{[^{}]*\}", "", text)


# What `_split` looks at: a quoted string (skipped whole), a bracket, a comma.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[()\[\]{},]')


def _split(attributes: str) -> list[str]:
  """An instruction's attributes (`, a=1, b={2,3}`), one `key=value` each."""
  parts, depth, start = [], 0, 0
  for token in _TOKEN.finditer(attributes):
    c = token.group()
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    elif c == "," and not depth:
      parts.append(attributes[start : token.start()].strip())
      start = token.end()
  parts.append(attributes[start:].strip())
  return [p for p in parts if p]


class _Values:
  """The values one execution of a computation computes, numbered by what they compute.

  A value is its opcode, type, attributes and operands' numbers (a
  parameter of the computation, or an instruction that computes nothing
  twice alike, e.g. a loop or a library call, is a value of its own), so
  that the same arithmetic on the same values gets the same number in
  whichever fusion XLA put it, and is counted once.
  """

  def __init__(self):
    self._numbers: dict[Any, int] = {}
    self._counted: set[int] = set()

  def number(self, key: Any) -> int:
    return self._numbers.setdefault(key, len(self._numbers))

  def unique(self) -> int:
    return self.number(object())

  def first(self, value: int) -> bool:
    """Whether `value` is counted for the first time (then it is counted)."""
    if value in self._counted:
      return False
    self._counted.add(value)
    return True


class _Counter:
  """Walks computations from the entry, multiplying by the loops around each."""

  def __init__(self, program: hlo_text.Program, branch: Callable[[tuple[int, ...]], int] = min):
    self._program = program
    self._branch = branch  # Which branch a conditional's FLOPs are.
    self._computations = program.computations
    self._roots = program.roots
    self._conditionals: list[Conditional] = []
    self._unknown = 0
    self._opaque: dict[str, None] = {}
    self._signatures: dict[str, tuple[Any, ...]] = {}

  def run(self, entry: str) -> Count:
    flops, _ = self._computation(entry, 1)
    return Count(flops, tuple(self._conditionals), self._unknown, tuple(self._opaque))

  def _computation(
    self,
    name: str,
    executions: int,
    values: Optional[_Values] = None,
    arguments: Sequence[int] = (),
  ) -> tuple[int, int]:
    """One execution of computation `name`: its FLOPs and its ROOT's value.

    `values`: those of the computation it is fused or called into, with
    its operands' as `arguments` (None: a computation of its own: a loop's
    body, a branch, the entry).
    """
    if values is None:
      values = _Values()
    shapes: dict[str, str] = {}
    numbers: dict[str, int] = {}
    total = 0
    for ins in self._computations[name]:
      shapes[ins.name] = ins.shape
      if ins.opcode == "parameter":
        index = int(ins.operand_text)
        numbers[ins.name] = arguments[index] if index < len(arguments) else values.unique()
        continue
      flops, numbers[ins.name] = self._instruction(ins, shapes, numbers, values, executions)
      total += flops
    root = self._roots.get(name, self._computations[name][-1].name)
    return total, numbers[root]

  def _instruction(
    self,
    ins: hlo_text.Instruction,
    shapes: dict[str, str],
    numbers: dict[str, int],
    values: _Values,
    executions: int,
  ) -> tuple[int, int]:
    """The FLOPs `ins` adds to its computation's (0 for a value counted already), and its value."""
    op = ins.opcode
    operands = tuple(numbers[o] for o in ins.operands)
    callee = hlo_text.runs(ins)
    if callee is not None:
      # A fusion's, call's or async start's computation: its instructions
      # are values of the caller's, its result is its ROOT's (an
      # asynchronous start's, which its `...-done` gives).
      return self._computation(callee, executions, values, operands)
    if op in _SAME_VALUE or (
      op in ("bitcast", "reshape")
      and _type(ins.shape) == _type(shapes[ins.operands[0]])
      and (op == "reshape" or _in_memory(ins.shape) == _in_memory(shapes[ins.operands[0]]))
    ):
      return 0, operands[0]
    if (
      op in _OWN_VALUE
      or op.endswith(("-start", "-done"))
      or (op == "constant" and "..." in ins.operand_text)
    ):
      # (XLA prints a large constant's literal as `{...}`.)
      return self._opaque_value(ins, shapes, executions), values.unique()
    if op in _COMMUTATIVE:
      operands = tuple(sorted(operands))
    # (A bitcast's layout says which elements it reads where.)
    value = values.number(
      (
        op,
        ins.shape if op == "bitcast" else _type(ins.shape),
        self._attributes(ins),
        operands,
        _without_layouts(re.sub(r"%[^\s,()]+", "", ins.operand_text)),
      )
    )
    if op in _FREE or not values.first(value):
      return 0, value
    return self._arithmetic(ins, shapes), value

  def _opaque_value(
    self, ins: hlo_text.Instruction, shapes: dict[str, str], executions: int
  ) -> int:
    """The FLOPs of a loop, conditional or library call (each a value of its own)."""
    op = ins.opcode
    if op == "while":
      trips = hlo_text.loop_trips(self._program, ins)
      if trips is None:
        self._unknown += 1
        trips = 1
      body, _ = self._computation(hlo_text.called(ins.attributes, "body"), executions * trips)
      cond, _ = self._computation(
        hlo_text.called(ins.attributes, "condition"), executions * (trips + 1)
      )
      return trips * body + (trips + 1) * cond
    if op == "conditional":
      branches = tuple(self._computation(b, 0)[0] for b in hlo_text.branches(ins.attributes))
      if executions:
        self._conditionals.append(Conditional(executions, branches))
      return self._branch(branches)
    if op == "custom-call":
      return self._custom_call(ins, shapes)
    return 0

  def _arithmetic(self, ins: hlo_text.Instruction, shapes: dict[str, str]) -> int:
    """The FLOPs of an instruction that computes a value (not free, not a call)."""
    op = ins.opcode
    n = hlo_text.elements(ins.shape)
    if op == "dot":
      lhs = hlo_text.dims(shapes[ins.operands[0]])
      contracting = hlo_text.int_list(ins.attributes, "lhs_contracting_dims")
      return 2 * n * math.prod(lhs[d] for d in contracting)
    if op == "convolution":
      return _convolution(
        ins.attributes,
        hlo_text.dims(shapes[ins.operands[0]]),
        hlo_text.dims(shapes[ins.operands[1]]),
        hlo_text.dims(ins.shape),
      )
    if op in _PER_INPUT_ELEMENT or op == "scatter":
      reducer, _ = self._computation(hlo_text.called(ins.attributes, "to_apply"), 0)
      source = ins.operands[-1] if op == "scatter" else ins.operands[0]
      return hlo_text.elements(shapes[source]) * reducer
    # Index arithmetic (a loop's counter, a slice's start) is not floating point.
    operand = shapes.get(ins.operands[0], "") if ins.operands else ""
    return n if _FLOAT.match(ins.shape) or _FLOAT.match(operand) else 0

  def _attributes(self, ins: hlo_text.Instruction) -> tuple[Any, ...]:
    """What of `ins`'s attributes says what it computes: no metadata, no configs, the computations it applies by their content, not their names."""
    kept = []
    for attribute in _split(ins.attributes):
      key, _, value = attribute.partition("=")
      if key in _NOT_ARITHMETIC:
        continue
      called = re.findall(r"%([^\s,{}]+)", value)
      kept.append((key, tuple(self._signature(c) for c in called) if called else value))
    return tuple(kept)

  def _signature(self, name: str) -> tuple[Any, ...]:
    """What a computation (a reducer) computes, whatever its and its instructions' names."""
    if name not in self._signatures:
      self._signatures[name] = ()  # A computation never applies itself.
      index = {}
      rows = []
      for i, ins in enumerate(self._computations[name]):
        index[ins.name] = i
        rows.append(
          (
            ins.opcode,
            _without_layouts(ins.shape),
            self._attributes(ins),
            tuple(index.get(o, -1) for o in ins.operands),
            _without_layouts(re.sub(r"%[^\s,()]+", "", ins.operand_text)),
          )
        )
      self._signatures[name] = tuple(rows)
    return self._signatures[name]

  def _custom_call(self, ins: hlo_text.Instruction, shapes: dict[str, str]) -> int:
    gemm = (hlo_text.backend_config(ins.attributes) or {}).get("gemm_backend_config", {})
    contracting = gemm.get("dot_dimension_numbers", {}).get("lhs_contracting_dimensions")
    if contracting is None:
      target = re.search(r'custom_call_target="([^"]*)"', ins.attributes)
      name = target.group(1) if target else "?"
      if name in _NO_ARITHMETIC:
        return 0
      roles = _CUDNN_CONVOLUTIONS.get(name)
      if roles is None:
        self._opaque[name] = None
        return 0
      # The forward convolution's input, kernel and output, where the call
      # keeps each: an operand (its index), or the first result (None).
      first_result = hlo_text.dims(ins.shape[1:] if ins.shape.startswith("(") else ins.shape)
      return _convolution(
        ins.attributes,
        *(first_result if i is None else hlo_text.dims(shapes[ins.operands[i]]) for i in roles),
      )
    # The product, then (on GPU) the library's workspace.
    result = ins.shape[1:] if ins.shape.startswith("(") else ins.shape
    lhs = hlo_text.dims(shapes[ins.operands[0]])
    return 2 * hlo_text.elements(result) * math.prod(lhs[int(d)] for d in contracting)


# Custom calls that compute nothing: XLA:TPU's allocation of a loop's
# output buffer before the loop writes it.
_NO_ARITHMETIC = frozenset({"AllocateBuffer"})

# cuDNN's convolutions (XLA:GPU's custom-call targets): where each keeps
# the forward convolution's input, kernel and output (an operand's index, or
# None for the first result). Their `window` and `dim_labels` are the
# forward convolution's.
_CUDNN_CONVOLUTIONS = {
  "__cudnn$convForward": (0, 1, None),
  "__cudnn$convBiasActivationForward": (0, 1, None),
  "__cudnn$convForwardGraph": (0, 1, None),
  "__cudnn$convBackwardInput": (None, 1, 0),
  "__cudnn$convBackwardFilter": (0, None, 1),
}


def _convolution(
  attributes: str, lhs: tuple[int, ...], kernel: tuple[int, ...], out: tuple[int, ...]
) -> int:
  """A convolution's FLOPs, as XLA counts them (see the module docstring)."""
  labels = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", attributes)
  assert labels, f"a convolution without dim_labels: {attributes[:200]}"
  lhs_labels, kernel_labels, out_labels = labels.groups()
  window = re.search(r"window=\{([^}]*)\}", attributes)
  fields = dict(f.split("=", 1) for f in window.group(1).split()) if (window) else {}
  spatial = sum(c.isdigit() for c in lhs_labels)

  def per_dim(key: str, default: str) -> list[str]:
    return fields[key].split("x") if key in fields else [default] * spatial

  positions = 1
  for d, stride, pad, lhs_dilate, rhs_dilate in zip(
    range(spatial),
    per_dim("stride", "1"),
    per_dim("pad", "0_0"),
    per_dim("lhs_dilate", "1"),
    per_dim("rhs_dilate", "1"),
  ):
    size = lhs[lhs_labels.index(str(d))]
    taps = np.arange(kernel[kernel_labels.index(str(d))])[:, None]
    outs = np.arange(out[out_labels.index(str(d))])[None, :]
    # The dilated input's index each (kernel, output) position reads.
    at = outs * int(stride) - int(pad.split("_")[0]) + taps * int(rhs_dilate)
    dilate = int(lhs_dilate)
    positions *= int(np.sum((at % dilate == 0) & (at >= 0) & (at < size * dilate - dilate + 1)))

  def group(key: str) -> int:
    found = re.search(key + r"=([0-9]+)", attributes)
    return int(found.group(1)) if found else 1

  return (
    2
    * lhs[lhs_labels.index("f")]
    // group("feature_group_count")
    * out[out_labels.index("f")]
    * (lhs[lhs_labels.index("b")] // group("batch_group_count"))
    * positions
  )


class MemoryAnalysis(Protocol):
  """The fields of `compiled.memory_analysis()` that `temporaries` reads."""

  temp_size_in_bytes: int
  peak_memory_in_bytes: int
  argument_size_in_bytes: int
  output_size_in_bytes: int
  alias_size_in_bytes: int


def temporaries(analysis: MemoryAnalysis, platform: str) -> int:
  """The bytes of temporaries a compiled program holds, as `memory_budget` counts them.

  XLA:CPU and XLA:GPU report them: `temp_size_in_bytes`. XLA:TPU reports
  besides the peak of every buffer the program holds at once, its arguments
  and outputs among them, and leaves `temp_size_in_bytes` at 0 for small
  programs (jax 0.10.2 on a TPU v5e: `jnp.sum(((x @ x) @ x) @ x)` of a 4 MiB
  `x` reports temp 0 and a peak of 12,583,424 bytes: the argument, the two
  4 MiB products and the 512-byte output). There the temporaries are the
  larger of `temp_size_in_bytes` and that peak less the arguments and
  outputs (an output that aliases an argument is one buffer in the peak):
  each buffer once. At users' sizes the two agree to an argument's bytes and
  the compiler checks `temp_size_in_bytes` ("HLO temporaries ... exceeds
  available HBM"); their sum would read twice over what the chip holds
  (RESULTS.md, "What XLA:TPU's memory analysis counts").

  >>> from haiku_bridge._src.remat import hlo_flops
  >>> x = jnp.ones([256, 256])  # 256 KiB.
  >>> grad = jax.grad(lambda x: jnp.sum(jnp.tanh(x @ x)))
  >>> compiled = jax.jit(grad).lower(x).compile()
  >>> held = hlo_flops.temporaries(compiled.memory_analysis(),
  ...                              jax.default_backend())
  >>> held >= x.nbytes  # The forward's tanh(x @ x), at least.
  True
  """
  if platform != "tpu":
    return analysis.temp_size_in_bytes
  held = (
    analysis.peak_memory_in_bytes
    - analysis.argument_size_in_bytes
    - analysis.output_size_in_bytes
    + analysis.alias_size_in_bytes
  )
  return max(analysis.temp_size_in_bytes, held)


class Held(NamedTuple):
  """What `memory_budget` counts of a compiled program: its temporaries and its array constants (bytes)."""

  temporaries: int
  constants: int

  @property
  def bytes(self) -> int:
    return self.temporaries + self.constants


def held(compiled: Any, text: Optional[str] = None) -> Held:
  """A compiled program's bytes as `memory_budget` counts them (`temporaries`; constants: `constant_bytes` and `lifted_bytes`).

  `compiled`: a `jax.stages.Compiled` of this process's default backend;
  `text`: its `as_text()`, where the caller has it already.

  >>> from haiku_bridge._src.remat import hlo_flops
  >>> table = np.random.default_rng(0).integers(0, 9, 1000).astype(np.int32)
  >>> compiled = jax.jit(lambda i: jnp.asarray(table)[i]).lower(3).compile()
  >>> hlo_flops.held(compiled).constants  # The table the program closes over.
  4000
  """
  analysis = compiled.memory_analysis()
  text = compiled.as_text() if text is None else text
  if analysis is None or text is None:
    raise ValueError(
      errors.message(
        f"remat=\"auto\" needs XLA's memory analysis and compiled HLO, "
        f"which the {jax.default_backend()} backend does not give."
      )
    )
  return Held(
    temporaries(analysis, jax.default_backend()),
    constant_bytes(text) + lifted_bytes(compiled, analysis),
  )


def lifted_bytes(compiled: Any, analysis: Any) -> int:
  """Bytes of the arrays a program closes over that jax passes it as arguments: its arguments less those it declares, as the device holds each.

  jax 0.12 compiles a closed-over array into the program only up to
  `jax_embedded_constants_max_bytes` (1,024 by default) and passes a larger
  one as an argument of its own (`constant_bytes` then sees none of it);
  jax 0.10 compiles every one in (none lifted). XLA's
  `argument_size_in_bytes` is what the device holds of the arguments, so
  the declared ones are taken at that too (`declared_bytes`): their tiles'
  padding (XLA:TPU), a dropped argument or a shard is not a lifted array.

  >>> from haiku_bridge._src.remat import hlo_flops
  >>> table = np.random.default_rng(0).integers(0, 9, 1000).astype(np.int32)
  >>> compiled = jax.jit(lambda i: jnp.asarray(table)[i]).lower(3).compile()
  >>> lifted = hlo_flops.lifted_bytes(compiled, compiled.memory_analysis())
  >>> lifted in (0, table.nbytes)  # jax 0.10: 0, in the text; 0.12: 4000.
  True
  """
  return max(0, analysis.argument_size_in_bytes - declared_bytes(compiled))


def declared_bytes(compiled: Any) -> int:
  """What one device holds of a compiled program's declared arguments: each one the program keeps (jit drops an argument it never reads), its shard, at its layout (XLA:TPU pads to its tiles).

  From `compiled.input_formats`; where jax gives none, the arguments'
  elements' bytes (`compiled.args_info`).

  >>> from haiku_bridge._src.remat import hlo_flops
  >>> compiled = jax.jit(lambda x, unread: 2 * x).lower(
  ...     jnp.ones([64]), jnp.ones([8])).compile()
  >>> hlo_flops.declared_bytes(compiled) == (
  ...     256 if jax.default_backend() == "cpu" else
  ...     compiled.memory_analysis().argument_size_in_bytes)
  True
  """
  infos = jax.tree.leaves(compiled.args_info)
  try:
    formats = jax.tree.leaves(compiled.input_formats, is_leaf=lambda f: hasattr(f, "layout"))
  except (AttributeError, NotImplementedError):  # jax without layouts.
    formats = []
  if len(formats) != len(infos):
    return pytree.nbytes(compiled.args_info)
  return sum(_declared(info, f) for info, f in zip(infos, formats))


def _declared(info: Any, given: Any) -> int:
  """What one device holds of a declared argument (`info`: its `ArgInfo`) given its `Format`."""
  layout, sharding = given.layout, given.sharding
  if layout is None and sharding is None:  # Dropped: never read, never passed.
    return 0
  shape = tuple(info.shape) if sharding is None else tuple(sharding.shard_shape(tuple(info.shape)))
  held = (
    None
    if layout is None
    else hlo_text.array_bytes(
      shape, info.dtype, getattr(layout, "major_to_minor", None), getattr(layout, "tiling", ())
    )
  )
  return pytree.nbytes(jax.ShapeDtypeStruct(shape, info.dtype)) if held is None else held


def constant_bytes(text: str) -> int:
  """Bytes of the array constants of the HLO `text` (e.g. a remat schedule's tables).

  XLA's memory analysis counts a program's temporaries, not the constants
  compiled into it (scalars, which live in the code, are left out).

  >>> from haiku_bridge._src.remat import hlo_flops
  >>> table = np.random.default_rng(0).integers(0, 9, 200).astype(np.int32)
  >>> f = jax.jit(lambda i: jnp.asarray(table)[i])
  >>> hlo_flops.constant_bytes(f.lower(3).compile().as_text())
  800
  """
  # Only the lines that may hold a constant are read (no whole parse: a
  # plan's read of a compiled program's bytes stops here).
  lines = (
    hlo_text.instruction(line)
    for line in text.splitlines()
    if " constant(" in line and " = " in line
  )
  return sum(
    array.bytes
    for ins in lines
    if ins.opcode == "constant"
    for array in hlo_text.arrays(ins.shape)
    if array.dims
  )
