"""Running an example as N processes (`jax.distributed`), on the CPU devices XLA simulates.

The examples that train on 8 devices (`sharded_training`, `pipelined_transformer`) run as one
process with 8 CPU devices, or as `--num_processes=N` processes with 8/N each, joined by
`jax.distributed` with gloo collectives. Each process feeds its own rows of the batch and holds
only its devices' shards of the params.
"""

from typing import Any

import jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
import numpy as np


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
        "(as `main` does), or run N processes with --num_processes=N.")


def start_processes(num_processes: int, process_id: int,
                    coordinator_address: str) -> None:
  """Joins `jax.distributed`: this process is one of `num_processes`."""
  # CPU collectives go over gloo.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes,
                             process_id=process_id)


def global_batch(batch: Any, sharding: NamedSharding) -> Any:
  """The global batch as arrays placed by `sharding`, from this process's rows.

  Every process draws the same batch here; in a real input pipeline each
  process reads only its own rows, `local_rows` of them.
  """
  def one(x):
    rows = local_rows(sharding, x.shape)
    return jax.make_array_from_process_local_data(
        sharding, np.asarray(x[rows]), x.shape)

  return jax.tree.map(one, batch)


def local_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
  """The rows of a batch that this process's devices hold."""
  starts, stops = zip(*[
      (index[0].start or 0, shape[0] if index[0].stop is None else
       index[0].stop)
      for index in sharding.addressable_devices_indices_map(shape).values()])
  return slice(min(starts), max(stops))


def gathered(params: Any) -> dict[str, np.ndarray]:
  """`{"bundle/name": array}`, each param whole, in every process."""
  whole = multihost_utils.process_allgather(params, tiled=True)
  return {f"{bundle}/{name}": np.asarray(value)
          for bundle, entries in whole.items()
          for name, value in entries.items()}
