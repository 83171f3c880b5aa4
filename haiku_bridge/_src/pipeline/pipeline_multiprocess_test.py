"""A pipeline inside data parallelism across 2 processes trains as in one, its gradient reduced once per step.

Two processes on localhost join `jax.distributed` (gloo CPU collectives),
4 CPU devices each, on a (stage=2, data=4) mesh laid out so that each
stage's data devices are split between the processes: the reduction of the
gradient over `data` crosses them, the stages' activations do not. Each
process runs this file as a child (`--child`): a few SGD steps of a
pipelined residual MLP stack, and the compiled step's HLO. Ground truth:
the same training in this process on 8 local devices; the bytes
all-reduced over `data` in the children's step, one reduction of the
stage's params (`hlo_collectives`). Leave it out where tests
may not open ports: `bazel test //... --test_tag_filters=-multiprocess`.
"""

import sys

import jax

from testing import devices

CHILD = "--child" in sys.argv
# Before anything starts jax's backend: each child 4 devices, this process
# (the one-process reference) 8.
devices.use_cpu_devices(4 if CHILD else 8)

# pylint: disable=g-import-not-at-top,wrong-import-position
import os

from absl.testing import absltest
import haiku as hk
from jax.experimental import multihost_utils
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import haiku_bridge as hkb
from testing import hlo_collectives
from testing import multiprocess

NUM_PROCESSES = 2
STEPS = 3
LAYERS, BATCH, WIDTH = 8, 32, 16
STAGES, DATA = 2, 4
TIMEOUT_S = 240  # Both processes, start to finish.


def block(h):
  return h + hk.Linear(WIDTH)(jnp.tanh(hk.Linear(WIDTH)(h)))


LOSS = hk.transform(
  lambda x: jnp.mean(
    hkb.repeat_layer(
      block, x, LAYERS, name="layers", pipeline=hkb.Pipeline("stage", microbatches=4)
    )
    ** 2
  )
)


def make_mesh() -> Mesh:
  """(stage, data): stage s on devices 2s, 2s+1 of each process."""
  ids = np.array(jax.devices()).reshape(NUM_PROCESSES, STAGES, -1)
  return Mesh(
    ids.transpose(1, 0, 2).reshape(STAGES, DATA),
    ("stage", "data"),
    axis_types=(jax.sharding.AxisType.Explicit,) * 2,
  )


def batches():
  rng = np.random.default_rng(0)
  while True:
    yield rng.normal(size=(BATCH, WIDTH)).astype(np.float32)


def train(place_batch):
  """`STEPS` SGD steps under the mesh: the losses, the params, the compiled step's HLO."""
  mesh = make_mesh()

  @jax.jit
  def step(params, x):
    loss, grads = jax.value_and_grad(LOSS.apply)(params, None, x)
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss

  with jax.set_mesh(mesh):
    rows = NamedSharding(mesh, P("data"))
    params = jax.jit(LOSS.init, out_shardings=NamedSharding(mesh, P()))(
      jax.random.PRNGKey(0), jnp.zeros([BATCH, WIDTH])
    )
    losses, hlo = [], None
    for _, x in zip(range(STEPS), batches()):
      x = place_batch(x, rows)
      if hlo is None:
        hlo = step.lower(params, x).compile().as_text()
      params, loss = step(params, x)
      losses.append(float(loss))
  return np.array(losses), params, hlo


def child(process_id: int, port: int, results: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"localhost:{port}", num_processes=NUM_PROCESSES, process_id=process_id
  )

  def local_rows(x, sharding):
    index = sharding.addressable_devices_indices_map(x.shape).values()
    mine = sorted({i for part in index for i in range(*part[0].indices(x.shape[0]))})
    # This process's rows, as jax.make_array_from_process_local_data
    # expects them: in order, one block per local device.
    return jax.make_array_from_process_local_data(sharding, x[mine], x.shape)

  losses, params, hlo = train(local_rows)
  whole = multihost_utils.process_allgather(params, tiled=True)
  if process_id == 0:
    np.savez(
      results,
      losses=losses,
      hlo=np.array(hlo),
      **{
        f"{bundle}/{name}": np.asarray(value)
        for bundle, entries in whole.items()
        for name, value in entries.items()
      },
    )


class PipelineDataParallelProcessesTest(absltest.TestCase):
  def test_two_processes_train_as_one(self):
    tmp = self.create_tempdir().full_path
    results = os.path.join(tmp, "results.npz")
    port = multiprocess.free_port()
    processes = multiprocess.Processes(
      "haiku_bridge._src.pipeline.pipeline_multiprocess_test",
      [["--child", str(i), str(port), results] for i in range(NUM_PROCESSES)],
      tmp,
    )
    try:
      codes = processes.wait(TIMEOUT_S)
      self.assertEqual(codes, [0] * NUM_PROCESSES, processes.report())
      multi = dict(np.load(results))
    finally:
      processes.close()

    losses, params, _ = train(lambda x, sharding: jax.device_put(x, sharding))
    hlo = str(multi.pop("hlo"))
    multiprocess.assert_same_training(multi, losses, params)
    stage_params = sum(a.nbytes for a in jax.tree.leaves(params)) / STAGES
    mesh = {"stage": STAGES, "data": DATA}
    reduced = sum(
      c.bytes_per_step
      for c in hlo_collectives.collectives(hlo)
      if c.kind == "all-reduce" and hlo_collectives.mesh_axes(c, mesh) == ("data",)
    )
    # The gradient once (and the loss's mean, 4 bytes).
    self.assertBetween(reduced / stage_params, 1.0, 1.1, reduced)


if __name__ == "__main__":
  if CHILD:
    child(*map(int, sys.argv[2:4]), sys.argv[4])
  else:
    absltest.main()
