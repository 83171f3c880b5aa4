"""The collectives of a compiled XLA program, read off its optimised HLO text: which, over which devices, how many bytes per run.

A collective inside a `while` loop runs once per trip: `bytes_per_step`
counts its result's bytes times the known trip counts of the loops around
it. Device groups (`replica_groups`, in XLA's three spellings) are logical
device ids: a device's place in the mesh, flattened (`mesh_groups`).
"""

import re

import numpy as np

_COLLECTIVE = re.compile(
    r"= (\(?[^=]*?\)?) (all-gather|collective-permute|all-reduce|"
    r"reduce-scatter|all-to-all)(?:-start)?\(")
_ARRAY = re.compile(r"[a-z]+[0-9]*\[([0-9,]*)\]")


def collectives(compiled):
  """`{op: [shape of each result]}` of the collectives in the optimised HLO."""
  found = {"all-gather": [], "collective-permute": [], "all-reduce": []}
  for line in _text(compiled).splitlines():
    match = _COLLECTIVE.search(line)
    if match and match.group(2) in found:
      shapes = [tuple(int(d) for d in dims.split(",") if d)
                for dims in _ARRAY.findall(match.group(1))]
      found[match.group(2)].append(shapes)
  return found


_COMPUTATION = re.compile(r"^(?:ENTRY )?%([^ ]+) ")
_CALLED = re.compile(r"(condition|body|calls|to_apply)=%([^ ,)}]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_TYPED_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_LISTED_GROUPS = re.compile(r"replica_groups=\{(\{[0-9,{}]*\})\}")
# [groups, size]<=[dims]T(permutation): iota(dims), transposed, reshaped.
_IOTA_GROUPS = re.compile(
    r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
# mesh['a'=4,'b'=2](, device_ids=([dims]T(permutation)))? {'a'}: over 'a'.
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([0-9,]+)\]"
    r"(?:T\(([0-9,]+)\))?\))? \{([^}]*)\}")


def _ints(text):
  return [int(d) for d in text.split(",") if d]


def _iota(dims, permutation):
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  return ids.transpose(_ints(permutation)) if permutation else ids


def replica_groups(line):
  """The device groups of a collective's HLO line, as a set of sorted tuples (None where it names none)."""
  if match := _LISTED_GROUPS.search(line):
    groups = [_ints(g) for g in re.findall(r"\{([0-9,]+)\}", match.group(1))]
  elif match := _IOTA_GROUPS.search(line):
    groups = _iota(_ints(match.group(2)), match.group(3)).reshape(
        _ints(match.group(1))).tolist()
  elif match := _MESH_GROUPS.search(line):
    names, sizes = zip(*(
        (name.strip("'"), int(size)) for name, size in
        (entry.split("=") for entry in match.group(1).split(","))))
    dims = _ints(match.group(2)) if match.group(2) else [int(np.prod(sizes))]
    ids = _iota(dims, match.group(3)).reshape(sizes)
    over = [names.index(n.strip().strip("'"))
            for n in match.group(4).split(",")]
    kept = [i for i in range(len(names)) if i not in over]
    groups = ids.transpose(kept + over).reshape(
        -1, int(np.prod([sizes[i] for i in over]))).tolist()
  else:
    return None
  return frozenset(tuple(sorted(g)) for g in groups)


def mesh_groups(mesh, axis):
  """The device groups of collectives over `axis` of `mesh` (devices by their place in it)."""
  ids = np.moveaxis(np.arange(mesh.size).reshape(mesh.devices.shape),
                    mesh.axis_names.index(axis), -1)
  return frozenset(tuple(g) for g in ids.reshape(-1, ids.shape[-1]).tolist())


def _text(compiled):
  """The optimised HLO of a compiled program (or that text itself)."""
  return compiled if isinstance(compiled, str) else compiled.as_text()


def _computations(compiled):
  """`{name: its lines}` and `{name: (caller, trip count of the loop it is the body of, or None)}`."""
  computations, current = {}, None
  for line in _text(compiled).splitlines():
    match = _COMPUTATION.match(line)
    if match and line.rstrip().endswith("{"):
      current = computations.setdefault(match.group(1), [])
    elif current is not None and line.startswith(" "):
      current.append(line)
  caller = {}
  for name, lines in computations.items():
    for line in lines:
      trips = _TRIP_COUNT.search(line)
      for kind, called in _CALLED.findall(line):
        loop = kind == "body" and trips is not None
        caller.setdefault(called, (name, int(trips.group(1)) if loop else None))
  return computations, caller


def _collectives_in_loops(compiled):
  """Per collective: (its kind, trip counts of the loops around it, outermost first, its result types, its line)."""
  computations, caller = _computations(compiled)
  found = []
  for name, lines in computations.items():
    for line in lines:
      match = _COLLECTIVE.search(line)
      if match:
        loops, at = [], name
        while at in caller:
          at, trips = caller[at]
          if trips is not None:
            loops.insert(0, trips)
        found.append((match.group(2), tuple(loops),
                      _TYPED_ARRAY.findall(match.group(1)), line))
  return found


def bytes_per_step(compiled, kind, groups=None):
  """The bytes a step's `kind` collectives (over `groups`, or any) return, each counted as often as its loops run."""
  total = 0
  for found, loops, types, line in _collectives_in_loops(compiled):
    if found == kind and groups in (None, replica_groups(line)):
      size = sum(_BYTES[dtype] * int(np.prod(_ints(dims)))
                 for dtype, dims in types)
      total += size * int(np.prod(loops))
  return total


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2,
          "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
