"""Running an example as N processes (`jax.distributed`), on the CPU devices XLA simulates.

The examples that train on 8 devices (`sharded_training`, `pipelined_transformer`) run as one
process with 8 CPU devices, or as `--num_processes=N` processes with 8/N each, joined by
`jax.distributed` with gloo collectives. Each process feeds its own rows of the batch and holds
only its devices' shards of the params.
"""

from typing import Any

from absl import flags
import jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
import numpy as np


NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes", 1, "Processes (jax.distributed); 1: no jax.distributed."
)
PROCESS_ID = flags.DEFINE_integer("process_id", 0, "This process's index.")
COORDINATOR = flags.DEFINE_string(
  "coordinator_address",
  "localhost:12355",
  "host:port of process 0, for jax.distributed.initialize.",
)
RESULTS = flags.DEFINE_string(
  "results",
  None,
  "If set, process 0 writes the losses and the trained "
  "params (gathered from all processes) to this .npz file.",
)


def start(total_devices: int) -> None:
  """This process's CPU devices, and `jax.distributed` by the flags above."""
  use_cpu_devices(total_devices, NUM_PROCESSES.value)
  if NUM_PROCESSES.value > 1:
    start_processes(NUM_PROCESSES.value, PROCESS_ID.value, COORDINATOR.value)


def save_results(losses: np.ndarray, params: Any) -> None:
  """With `--results`, process 0 writes the losses and the whole params there."""
  if not RESULTS.value:
    return
  whole = gathered(params)  # Every process takes part in the gather.
  if jax.process_index() == 0:
    np.savez(RESULTS.value, losses=losses, **whole)
    print(f"wrote {RESULTS.value}")


def use_cpu_devices(total: int, num_processes: int) -> None:
  """This process's share of `total` devices, which XLA simulates on a CPU.

  Call it before jax starts a backend (before any jax operation). GPUs and
  TPUs bring their own devices; it changes only the CPU backend.
  """
  jax.config.update("jax_num_cpu_devices", total // num_processes)


def require_devices(total: int) -> None:
  """Raises unless jax has `total` devices, over all processes."""
  if jax.device_count() != total:
    raise RuntimeError(
      f"This example needs {total} devices; jax has {jax.device_count()} "
      f"({jax.process_count()} process(es)). On a CPU, call "
      f"processes.use_cpu_devices({total}, num_processes) before jax starts "
      "(as `main` does), or run N processes with --num_processes=N."
    )


def start_processes(num_processes: int, process_id: int, coordinator_address: str) -> None:
  """Joins `jax.distributed`: this process is one of `num_processes`."""
  # CPU collectives go over gloo.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
  )


def global_batch(batch: Any, sharding: NamedSharding) -> Any:
  """The global batch as arrays placed by `sharding`, from this process's rows.

  Every process draws the same batch here; in a real input pipeline each
  process reads only its own rows, `local_rows` of them.
  """

  def one(x):
    rows = local_rows(sharding, x.shape)
    return jax.make_array_from_process_local_data(sharding, np.asarray(x[rows]), x.shape)

  return jax.tree.map(one, batch)


def local_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
  """The rows of a batch that this process's devices hold."""
  starts, stops = zip(
    *[
      (index[0].start or 0, shape[0] if index[0].stop is None else index[0].stop)
      for index in sharding.addressable_devices_indices_map(shape).values()
    ]
  )
  return slice(min(starts), max(stops))


def gathered(params: Any) -> dict[str, np.ndarray]:
  """`{"bundle/name": array}`, each param whole, in every process."""
  whole = multihost_utils.process_allgather(params, tiled=True)
  return {
    f"{bundle}/{name}": np.asarray(value)
    for bundle, entries in whole.items()
    for name, value in entries.items()
  }
