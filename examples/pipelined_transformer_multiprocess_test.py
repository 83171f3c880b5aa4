"""The pipelined transformer as 2 processes equals it in one process.

Two processes on localhost join `jax.distributed` (gloo CPU collectives),
each with 4 CPU devices: stages 0-1 of the (stage=4, data=2) mesh on one,
stages 2-3 on the other, so activations and their gradients cross between
the processes. Ground truth: the same training in this process, on 8 local
devices. Leave it out where tests may not open ports:
`bazel test //... --test_tag_filters=-multiprocess`.
"""

from testing import devices

# Eight CPU devices for the one-process reference, before anything starts
# jax's backend. Each child asks for its own 4 (the example's `main`).
devices.use_cpu_devices(8)

# pylint: disable=g-import-not-at-top,wrong-import-position
import os

from absl.testing import absltest
import haiku_bridge as hkb
import numpy as np

from examples import pipelined_transformer as example
from testing import multiprocess

NUM_PROCESSES = 2
NUM_STEPS = 3
TIMEOUT_S = 240  # Both processes, start to finish; ~40 s on 2 busy cores.


class MultiProcessPipelineTest(absltest.TestCase):
  def test_two_processes_train_as_one(self):
    tmp = self.create_tempdir().full_path
    results = os.path.join(tmp, "results.npz")
    port = multiprocess.free_port()
    processes = multiprocess.Processes(
      "examples.pipelined_transformer",
      [
        [
          f"--num_processes={NUM_PROCESSES}",
          f"--process_id={i}",
          f"--coordinator_address=localhost:{port}",
          f"--num_steps={NUM_STEPS}",
          "--schedule=circular",
          f"--results={results}",
        ]
        for i in range(NUM_PROCESSES)
      ],
      tmp,
    )
    try:
      codes = processes.wait(TIMEOUT_S)
      self.assertEqual(codes, [0] * NUM_PROCESSES, processes.report())
      for i in range(NUM_PROCESSES):
        out, _ = processes.output(i)
        self.assertIn(f"process {i} of {NUM_PROCESSES}: 4 of 8 devices", out)
        # Each process holds 2 of the 4 stages, 2 blocks each, on 4 devices.
        self.assertIn("this process holds 4 shards of (2, 32, 128)", out)
      multi = dict(np.load(results))
    finally:
      processes.close()

    losses, params = example.train(NUM_STEPS, hkb.Pipeline("stage", 4, "circular"))
    multiprocess.assert_same_training(multi, losses, params)


if __name__ == "__main__":
  absltest.main()
