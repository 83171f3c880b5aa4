"""What a pipelined training step costs a device: compiled memory and collectives.

Ground truth is the cost model of docs/pipelines.md, read off the compiled
step (`jax.jit(...).lower(...).compile()`): its memory analysis and its
optimised HLO. The step is a user's: the loss after the pipelined stack,
`jax.value_and_grad` of apply, params as init returns them (replicated),
under `jax.make_mesh`'s default (Explicit) axes or Auto axes.
"""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import re

from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np

import haiku_bridge as hkb

LAYERS = 8
BATCH = 32


def block(h):
  """A residual MLP block: two Linears, so the params dominate its memory."""
  width = h.shape[-1]
  return h + hk.Linear(width)(jnp.tanh(hk.Linear(width)(h)))


def one_leaf_block(h):
  """A block of one Linear's weights and bias: its largest leaf is most of it."""
  return h + hk.Linear(h.shape[-1])(h)


def compiled_step(mesh_shape, axis_type, width, pipeline, remat=False,
                  layer=block, batch=BATCH, rules=None, **options):
  """The compiled `value_and_grad` step and the stack's param bytes.

  Params as init returns them, or with `rules` placed on the mesh by
  `hkb.param_shardings` (and their gradients placed so).
  """
  def loss(x):
    h = hkb.repeat_layer(layer, x, LAYERS, name="layers", pipeline=pipeline,
                         remat=remat, **options)
    return jnp.mean(h ** 2)

  f = hk.transform(loss)
  x = jnp.ones([batch, width])
  params = f.init(jax.random.PRNGKey(0), x)
  names = ("stage", "data")
  if axis_type is None:  # jax.make_mesh's default: Explicit axes.
    mesh = jax.make_mesh(mesh_shape, names)
  else:
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(axis_type,) * 2)
  param_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
  with jax.set_mesh(mesh):
    x = jax.device_put(x, P("data"))
    step = jax.value_and_grad(f.apply)
    if rules is None:
      step = jax.jit(step)
    else:
      shardings = hkb.param_shardings(params, mesh, rules)
      params = jax.device_put(params, shardings)
      step = jax.jit(step, out_shardings=(None, shardings))
    compiled = step.lower(params, None, x).compile()
  return compiled, param_bytes


AXES = (("explicit", None), ("auto", AxisType.Auto))


class MemoryTest(parameterized.TestCase):
  """Per device: the stage's params once, one gradient for them, flat in M."""

  @parameterized.product(axes=AXES, schedule=("gpipe", "circular"),
                         remat=(False, True))
  def test_temporaries_flat_in_microbatches(self, axes, schedule, remat):
    _, axis_type = axes
    stages = 4
    temp = {}
    for m in (4, 16):
      compiled, param_bytes = compiled_step(
          (stages, 2), axis_type, 64, hkb.Pipeline("stage", m, schedule),
          remat)
      temp[m] = compiled.memory_analysis().temp_size_in_bytes
    stage_params = param_bytes / stages
    # Before issue 34, each step of the timetable kept its own copy of the
    # stage's params for the backward pass: 22x at M=16, 2.2x M=4's.
    self.assertLessEqual(temp[16], 3 * stage_params, (temp, stage_params))
    self.assertLessEqual(temp[16], 1.25 * temp[4], temp)


  def test_circular_gathers_one_leaf_of_the_stack_at_a_time(self):
    # With params as init returns them, circular gathers each gradient
    # leaf's whole stack over the stages and copies it into layer order: a
    # buffer of the largest leaf's stack (docs/sharding.md), S times the
    # stage's params for a block of one leaf, beside which the rest of the
    # step fits in the bound above.
    stages, width = 4, 64
    compiled, param_bytes = compiled_step(
        (stages, 2), None, width, hkb.Pipeline("stage", 16, "circular"),
        layer=one_leaf_block)
    temp = compiled.memory_analysis().temp_size_in_bytes
    stage_params = param_bytes / stages
    gathered = LAYERS * width * width * 4  # The stack's weights, float32.
    self.assertLessEqual(temp, max(3 * stage_params,
                                   gathered + 0.1 * stage_params),
                         (temp, gathered, stage_params))


  def test_circular_with_params_stored_over_the_stages(self):
    # Params stored over "stage" (`stacked={"layers": "stage"}`, as
    # docs/sharding.md shows), in blocks of layers that circular runs
    # interleaved: each stage sends its blocks' layers to the stages that
    # run them, as the partitioner does on Auto axes. Until issue 43, on
    # Explicit axes each leaf's whole stack was all-gathered onto every
    # device (8 times the stage's params of all-gathers; temporaries 4.57x).
    stages, width = 4, 256
    found = {}
    for name, axis_type in AXES:
      compiled, param_bytes = compiled_step(
          (stages, 2), axis_type, width, hkb.Pipeline("stage", 16, "circular"),
          rules=hkb.ShardingRules([], stacked={"layers": "stage"}))
      found[name] = (compiled.memory_analysis().temp_size_in_bytes,
                     bytes_per_step(compiled, "all-gather"))
    stage_params = param_bytes / stages
    self.assertLessEqual(found["explicit"][0], 3 * stage_params,
                         (found, stage_params))
    self.assertLessEqual(found["explicit"][1], found["auto"][1], found)


class RematPolicyTest(parameterized.TestCase):
  """`remat_policy` changes only what a stage keeps: its compiled temporaries."""

  @parameterized.parameters("gpipe", "circular")
  def test_a_policy_that_keeps_more_holds_more(self, schedule):
    # Keeping nothing but each layer's input < keeping the matmuls' outputs
    # too < keeping everything (the tanh's as well), per microbatch in
    # flight: the orders of what each policy keeps.
    pipe = hkb.Pipeline("stage", 4, schedule)
    policies = jax.checkpoint_policies
    temp = [compiled_step((2, 4), None, 16, pipe, remat=True,
                          remat_policy=policy)[0].memory_analysis(
                          ).temp_size_in_bytes
            for policy in (policies.nothing_saveable, policies.dots_saveable,
                           policies.everything_saveable)]
    self.assertLess(temp[0], temp[1], temp)
    self.assertLess(temp[1], temp[2], temp)


_COLLECTIVE = re.compile(
    r"= (\(?[^=]*?\)?) (all-gather|collective-permute|all-reduce)(?:-start)?\(")
_ARRAY = re.compile(r"[a-z]+[0-9]*\[([0-9,]*)\]")


def collectives(compiled):
  """`{op: [shape of each result]}` of the collectives in the optimised HLO."""
  found = {"all-gather": [], "collective-permute": [], "all-reduce": []}
  for line in compiled.as_text().splitlines():
    match = _COLLECTIVE.search(line)
    if match:
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
# mesh['a'=4,'b'=2], device_ids=([dims]T(permutation)) {'a'}: reduce over 'a'.
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\], device_ids=\(\[([0-9,]+)\]"
    r"(?:T\(([0-9,]+)\))?\) \{([^}]*)\}")


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
    ids = _iota(_ints(match.group(2)), match.group(3)).reshape(sizes)
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


def _computations(compiled):
  """`{name: its lines}` and `{name: (caller, trip count of the loop it is the body of, or None)}`."""
  computations, current = {}, None
  for line in compiled.as_text().splitlines():
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


def all_reduces_by_loop(compiled):
  """`[(trip counts of the while loops around it, outermost first, its result shapes)]` per all-reduce."""
  return sorted((loops, [tuple(_ints(dims)) for _, dims in types])
                for kind, loops, types, _ in _collectives_in_loops(compiled)
                if kind == "all-reduce")


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


class CollectivesTest(parameterized.TestCase):
  """Explicit axes (jax's default mesh) communicate as Auto axes do."""

  @parameterized.parameters("gpipe", "circular")
  def test_explicit_axes_add_no_collectives(self, schedule):
    stages, data, m, width = 2, 4, 4, 16
    pipe = hkb.Pipeline("stage", m, schedule)
    found = {name: collectives(compiled_step((stages, data), axis_type,
                                             width, pipe)[0])
             for name, axis_type in AXES}
    explicit, auto = found["explicit"], found["auto"]
    # Before issue 34, 7 all-gathers over `data` on Explicit axes (gpipe),
    # none on Auto: the shard_map's inputs, outputs and residuals whole.
    for op in explicit:
      self.assertLen(explicit[op], len(auto[op]), (op, explicit, auto))
    if schedule == "gpipe":
      self.assertEmpty(explicit["all-gather"])
    # The boundary activations: forward, and their cotangents back; each
    # one microbatch's rows on this data device.
    rows = BATCH // m // data
    self.assertEqual(explicit["collective-permute"],
                     [[(rows, width)]] * 2)

  @parameterized.product(axes=AXES, schedule=("gpipe", "circular"))
  def test_gradient_reduced_over_data_once_per_step(self, axes, schedule):
    # Theory, and plain data parallelism: each device's gradient of the
    # stage's params summed over its microbatches, then all-reduced over
    # `data` once. Until issue 43 XLA reduced each layer's gradient where it
    # was made, inside the backward loops: M+S-1 times (GPipe; 5x at M=4,
    # 17x at M=16) or ·max(M, S)+M+S-1 times one layer's reduction
    # per visit (circular; 4.25x, 16.25x).
    _, axis_type = axes
    stages, data, width = 2, 4, 16
    mesh = jax.make_mesh((stages, data), ("stage", "data"))
    for m in (4, 16):
      compiled, param_bytes = compiled_step(
          (stages, data), axis_type, width, hkb.Pipeline("stage", m, schedule),
          batch=4 * m)  # One row per data device in a microbatch.
      reduced = bytes_per_step(compiled, "all-reduce",
                               mesh_groups(mesh, "data"))
      stage_params = param_bytes / stages
      self.assertBetween(reduced / stage_params, 1.0, 1.1, (m, reduced))

if __name__ == "__main__":
  absltest.main()
