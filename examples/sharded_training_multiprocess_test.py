"""The sharded training example as 2 processes equals it in one process.

Two processes on localhost join `jax.distributed` (gloo CPU collectives),
each with 4 CPU devices, and train the example (a `call_pure` block with a
custom VJP, a `layer_scan` stack, an `hkb.custom_vjp` readout) on a global
(data=2, model=4) mesh over the 8 devices: params created sharded by
`hkb.param_shardings`, each process holding only its own devices' shards,
and each feeding its own rows of the batch through
`jax.make_array_from_process_local_data`. Ground truth: the same training in
this process, on 8 local devices. The loss curve and the trained params must
agree.

The test opens a local TCP port (the coordinator's); where that is not
allowed, leave it out: `bazel test //... --test_tag_filters=-multiprocess`.
"""

import jax

from testing import devices

# Eight CPU devices for the one-process reference, before anything starts
# jax's backend. Each child asks for its own 4 (the example's `main`).
devices.use_cpu_devices(8)

# pylint: disable=g-import-not-at-top,wrong-import-position
import os
import re
import unittest

from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import AxisType
import numpy as np

from examples import sharded_training as example
from testing import multiprocess

NUM_PROCESSES = 2
NUM_STEPS = 4
# Both processes together, start to finish: jax start-up, gloo connection,
# four compiled steps. Measured ~30 s on 2 busy cores.
TIMEOUT_S = 240
AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def setUpModule():
  if jax.device_count() < 8:
    raise unittest.SkipTest(
      f"needs 8 devices for the one-process reference, jax has "
      f"{jax.device_count()} {jax.default_backend()} devices."
    )


class MultiProcessTrainingTest(parameterized.TestCase):
  @parameterized.named_parameters(("auto_axes", "auto"), ("explicit_axes", "explicit"))
  def test_two_processes_train_as_one(self, axis_type):
    tmp = self.create_tempdir().full_path
    results = os.path.join(tmp, "results.npz")
    port = multiprocess.free_port()
    processes = multiprocess.Processes(
      "examples.sharded_training",
      [
        [
          f"--num_processes={NUM_PROCESSES}",
          f"--process_id={i}",
          f"--coordinator_address=localhost:{port}",
          f"--num_steps={NUM_STEPS}",
          f"--axis_type={axis_type}",
          f"--results={results}",
        ]
        for i in range(NUM_PROCESSES)
      ],
      tmp,
    )
    try:
      codes = processes.wait(TIMEOUT_S)
      self.assertEqual(
        codes,
        [0] * NUM_PROCESSES,
        f"the {NUM_PROCESSES} processes did not all end well within "
        f"{TIMEOUT_S} s (-9: killed at the deadline, or because the other "
        f"failed):\n{processes.report()}",
      )
      for i in range(NUM_PROCESSES):
        out, _ = processes.output(i)
        self.assertIn(f"process {i} of {NUM_PROCESSES}: 4 of 8 devices", out)
        # Each process holds its own 4 devices' shards of each param, e.g.
        # a quarter of the hidden units of the stack's first weight.
        self.assertRegex(
          out,
          r"blocks/up/w +P\(None, None, 'model'\) +4 "
          r"shards of \(3, 32, 32\)",
        )
        self.assertLen(re.findall(r" 4 shards of ", out), 12, out)
      multi = dict(np.load(results))
    finally:
      processes.close()

    # Ground truth: the same training in one process on 8 devices.
    losses, params = example.train(NUM_STEPS, axis_type=AXIS_TYPES[axis_type])
    multiprocess.assert_same_training(multi, losses, params)


if __name__ == "__main__":
  absltest.main()
