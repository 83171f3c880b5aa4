"""The bytes a compiled XLA program's collectives move per device, each loop by its trip count.

`collectives(hlo_text)` reads the optimised HLO (`compiled.as_text()`, after
SPMD partitioning: every shape is one device's) with `hlo_text`, and returns
each collective with the bytes of one execution and how often it runs (the
trip counts of the while loops around it, multiplied). The bytes of one
execution, per device, are the size of the whole array the collective is
about, as the device holds it before or after, whichever is larger:

- `all-reduce`: its operands' bytes (= its result's): the array summed.
- `all-gather`: its result's bytes: the array gathered, which each device
  ends with (its operand is 1/n of it, n the devices in its group).
- `reduce-scatter`: its operands' bytes: the array summed, which each
  device contributes whole (its result is 1/n of it).
- `all-to-all`: its operands' bytes: the array each device splits among
  its group (its result is as large).
- `collective-permute`: its operands' bytes: the array each device sends
  on (and receives one as large).

So a gradient all-reduced, or all-gathered and reduce-scattered, counts
the gradient's bytes either way; what a ring actually sends over the
interconnect is (n-1)/n of it (twice for an all-reduce), which the caller
applies if it wants wire bytes. Async pairs (`all-reduce-start` /
`-done`, `async-start` of a `reduce-scatter`) count once, at the start.
A collective inside a `conditional`'s branch counts as if that branch ran
each time (`Collective.in_branch` says which).

>>> from testing import hlo_collectives
>>> text = '''HloModule m
... ENTRY %main (p: f32[4,16]) -> f32[4,16] {
...   %p = f32[4,16]{1,0} parameter(0)
...   ROOT %r = f32[4,16]{1,0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
... }'''
>>> hlo_collectives.bytes_by_kind(hlo_collectives.collectives(text))["all-reduce"]
256
"""

import re
from typing import NamedTuple, Sequence

import numpy as np

from haiku_bridge._src import hlo_text

KINDS = ("all-gather", "all-reduce", "collective-permute", "reduce-scatter", "all-to-all")
_START = "-start"


class Collective(NamedTuple):
  """One collective of a program.

  Attributes:
    kind: one of `KINDS`.
    bytes: per device, one execution (see the module docstring for which
      array that is for each kind).
    executions: how many times it runs: the trip counts of the loops
      around it, multiplied.
    loops: those trip counts, outermost first.
    groups: the devices that take part together, as partition ids (a
      `collective-permute`: its `(source, target)` pairs); `()` for all.
    in_branch: inside a `conditional`'s branch.
    shapes: the dimensions of each array `bytes` counts.
  """

  kind: str
  bytes: int
  executions: int
  loops: tuple[int, ...]
  groups: tuple[tuple[int, ...], ...]
  in_branch: bool
  shapes: tuple[tuple[int, ...], ...]

  @property
  def bytes_per_step(self) -> int:
    """`bytes` × `executions`: what it moves in one run of the program."""
    return self.bytes * self.executions


def collectives(hlo: str) -> list[Collective]:
  """Every collective of the optimised HLO `hlo`, in the order the walk reaches them."""
  found = []
  for site in hlo_text.walk(hlo_text.parse(hlo)):
    ins = site.instruction
    kind = ins.opcode[: -len(_START)] if ins.opcode.endswith(_START) else ins.opcode
    if kind not in KINDS:
      continue
    if kind == "all-gather":
      arrays = hlo_text.arrays(ins.shape)
      if ins.opcode.endswith(_START):  # (operands, results).
        arrays = arrays[len(arrays) // 2 :]
    else:
      arrays = [a for o in ins.operands for a in hlo_text.arrays(site.shapes[o])]
    found.append(
      Collective(
        kind,
        sum(a.bytes for a in arrays),
        site.executions,
        site.loops,
        _groups(ins.attributes),
        site.in_branch,
        tuple(a.dims for a in arrays),
      )
    )
  return found


def bytes_by_kind(found: Sequence[Collective]) -> dict[str, int]:
  """The bytes per device of one run of the program, summed by kind (every kind, 0 where none)."""
  total = dict.fromkeys(KINDS, 0)
  for c in found:
    total[c.kind] += c.bytes_per_step
  return total


def mesh_axes(c: Collective, axis_sizes: dict[str, int]) -> tuple[str, ...]:
  """The mesh axes a collective runs over: those whose index differs within a group.

  `axis_sizes` is the mesh's, in its order (`dict(mesh.shape)`): a
  partition id is the device's index in the mesh's devices, flattened, as
  `jax.jit` numbers them. A collective over all devices runs over every
  axis of more than one device.
  """
  names = tuple(axis_sizes)
  shape = tuple(axis_sizes.values())
  if not c.groups:
    return tuple(n for n, size in zip(names, shape) if size > 1)
  varying = set()
  for group in c.groups:
    coords = np.array(np.unravel_index(np.asarray(group), shape))
    varying |= {names[i] for i in range(len(names)) if len(set(coords[i])) > 1}
  return tuple(n for n in names if n in varying)


def _groups(attributes: str) -> tuple[tuple[int, ...], ...]:
  """The groups of device ids a collective runs over, `()` for all.

  XLA writes them in one of three forms: listed (`replica_groups={{0,1},
  {2,3}}`, or a permute's `source_target_pairs={{0,1},{1,0}}`), as an iota
  (`replica_groups=[4,2]<=[2,4]T(1,0)`: the ids of an iota of `[2,4]`,
  transposed, as `[groups, size]`), or over named axes of a mesh of the
  devices (`replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0))
  {'a'}`: a group for each index of the other axes; jaxlib 0.11's XLA leaves out
  `device_ids=` where they are the mesh's in order: `mesh['a'=4,'b'=2]
  {'a'}`).
  """
  listed = re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[^=]*?\})\}", attributes)
  if listed:
    return tuple(
      tuple(int(d) for d in g.split(",") if d)
      for g in re.findall(r"\{([0-9,]*)\}", listed.group(1))
    )
  iota = re.search(r"replica_groups=\[([0-9,]+)\]<=(\[[0-9,]+\](?:T\([0-9,]+\))?)", attributes)
  if iota:
    size = _ints(iota.group(1))[-1]
    return _as_groups(_iota(iota.group(2)).reshape(-1, size))
  named = re.search(
    r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\("
    r"(\[[0-9,]+\](?:T\([0-9,]+\))?)\))? "
    r"\{([^}]*)\}",
    attributes,
  )
  if named:
    axes = re.findall(r"'([^']+)'=([0-9]+)", named.group(1))
    names = [name for name, _ in axes]
    sizes = [int(n) for _, n in axes]
    ids = (_iota(named.group(2)) if named.group(2) else np.arange(int(np.prod(sizes)))).reshape(
      sizes
    )
    over = [names.index(a) for a in re.findall(r"'([^']+)'", named.group(3))]
    others = [i for i in range(len(names)) if i not in over]
    size = int(np.prod([ids.shape[i] for i in over]))
    return _as_groups(ids.transpose(others + over).reshape(-1, size))
  return ()


def _ints(text: str) -> list[int]:
  return [int(d) for d in text.split(",") if d]


def _iota(text: str) -> np.ndarray:
  """The device ids `[dims]` or `[dims]T(perm)` name, flattened."""
  match = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text.strip())
  assert match, f"device ids of XLA's HLO: {text}"
  dims = _ints(match.group(1))
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if match.group(2):
    ids = ids.transpose(_ints(match.group(2)))
  return ids.reshape(-1)


def _as_groups(ids: np.ndarray) -> tuple[tuple[int, ...], ...]:
  return tuple(tuple(int(i) for i in row) for row in ids)
