"""Starting an example as several processes on localhost, for the tests that train with `jax.distributed`.

The children run `python -m <module>` with this process's `sys.path` on CPUs; each writes its
stdout and stderr to a file in a log directory, read back for the test's messages.
"""

import os
import socket
import subprocess
import sys
import time
from typing import Any

import jax
import numpy as np


def free_port() -> int:
  """A port no one listens on now: the OS picks it for a socket bound to 0."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def child_env() -> dict[str, str]:
  """This environment, on CPUs (each child sets `jax_num_cpu_devices` to 4)."""
  env = dict(os.environ)
  # The children import `examples` and `haiku_bridge` as this process does
  # (the repository root under pytest, the runfiles tree under Bazel).
  env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
  env["JAX_PLATFORMS"] = "cpu"
  return env


class Processes:
  """`python -m module` once per argument list: the children, started together.

  All are ended if any fails or hangs.
  """

  def __init__(self, module: str, args_per_process: list[list[str]], logdir: str):
    self._logs = []
    self.procs = []
    for i, args in enumerate(args_per_process):
      out = open(os.path.join(logdir, f"process_{i}.out"), "w+")
      err = open(os.path.join(logdir, f"process_{i}.err"), "w+")
      self._logs.append((out, err))
      self.procs.append(
        subprocess.Popen(
          [sys.executable, "-m", module, *args], stdout=out, stderr=err, env=child_env()
        )
      )

  def wait(self, timeout_s: float) -> list[int]:
    """Exit codes, once all have ended; kills every child at the deadline
    or as soon as one fails (the other would wait for it forever)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      codes = [p.poll() for p in self.procs]
      if any(c not in (None, 0) for c in codes) or None not in codes:
        break
      time.sleep(0.2)
    self.kill()
    return [p.wait() for p in self.procs]

  def kill(self) -> None:
    for p in self.procs:
      if p.poll() is None:
        p.kill()

  def output(self, i: int) -> tuple[str, str]:
    out, err = self._logs[i]
    out.flush()
    err.flush()
    out.seek(0)
    err.seek(0)
    return out.read(), err.read()

  def report(self) -> str:
    """Every child's exit code, stdout and stderr (the last 3000 chars)."""
    parts = []
    for i, p in enumerate(self.procs):
      out, err = self.output(i)
      parts.append(
        f"--- process {i}: exit code {p.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
      )
    return "\n".join(parts)

  def close(self) -> None:
    self.kill()
    for out, err in self._logs:
      out.close()
      err.close()


def assert_same_training(results: dict[str, np.ndarray], losses: np.ndarray, params: Any) -> None:
  """The children's `--results` (losses, whole params) against one process's."""
  results = dict(results)
  single = {
    f"{bundle}/{name}": np.asarray(value)
    for bundle, entries in jax.device_get(params).items()
    for name, value in entries.items()
  }
  np.testing.assert_allclose(results.pop("losses"), losses, rtol=1e-6)
  if sorted(results) != sorted(single):
    raise AssertionError(f"params {sorted(results)} != {sorted(single)}")
  for name, value in single.items():
    np.testing.assert_allclose(results[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
