"""Helpers shared by haiku_bridge's tests."""

import collections
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import types
from typing import Any, Callable, ContextManager, Sequence
from unittest import mock

import haiku as hk
import jax

from haiku_bridge._src import jaxpr_walk


def primitive_counts(fn: Callable[..., Any], *args: Any) -> collections.Counter:
  """Counts the primitives in `fn`'s jaxpr, including all nested jaxprs.

  Two functions with equal counts run the same operations, whatever names or
  Python structure produced them: the structural fact behind "zero overhead".
  """
  return collections.Counter(
    eqn.primitive.name for eqn in jaxpr_walk.equations(jax.make_jaxpr(fn)(*args))
  )


def value_shapes(fn: Callable[..., Any], *args: Any) -> set[tuple[int, ...]]:
  """The shape of every value `fn`'s jaxpr computes, nested jaxprs included.

  What a program may hold at once: a value of shape `(T,) + w.shape` means a
  copy of `w` per step somewhere.
  """
  return {
    tuple(v.aval.shape)
    for eqn in jaxpr_walk.equations(jax.make_jaxpr(fn)(*args))
    for v in eqn.outvars
    if hasattr(v.aval, "shape")
  }


def canonical_hlo(compiled: jax.stages.Compiled) -> str:
  """Optimised HLO text without names, source locations or metadata.

  Two programs with the same canonical text run the same kernels.
  """
  lines = compiled.as_text().splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("HloModule"))
  body = lines[start + 1 :]
  # Skip the debug tables (file names, stack frames) before the computations.
  first = next((i for i, line in enumerate(body) if line.startswith(("%", "ENTRY"))), 0)
  text = "\n".join(body[first:])
  text = re.sub(r", metadata=\{[^}]*\}", "", text)
  # Parameter names in computation headers (they carry module names).
  text = re.sub(
    r"^(.*?\()(.*)(\) -> .*\{)$",
    lambda m: m[1] + re.sub(r"[\w.\-]+: ", "", m[2]) + m[3],
    text,
    flags=re.M,
  )
  names = {}
  return re.sub(r"%([\w.\-]+)", lambda m: "%" + names.setdefault(m[1], f"v{len(names)}"), text)


def param_shapes(params: Any) -> Any:
  return jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), params)


class Outer(hk.Module):
  """A module whose `__call__` runs `body`: puts any test code inside a module."""

  def __init__(self, body: Callable[..., Any], name: str | None = None):
    super().__init__(name=name)
    self._body = body

  def __call__(self, *args: Any) -> Any:
    return self._body(*args)


_FRESH_PROCESS = """
import importlib.util, sys
import jax
jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
spec = importlib.util.spec_from_file_location("fresh_process", sys.argv[2])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
getattr(module, sys.argv[3])(*sys.argv[4:])
"""


def environment_patches() -> list[tuple[str, ContextManager[Any]]]:
  """Patches that each make this process look like another install: jax's version, the backend, the device, XLA's flags.

  A cache kept across processes (a plan on disk) must key on each: a test
  asks that its key changes under every one.
  """
  device = jax.devices()[0]
  other = mock.Mock(device_kind=device.device_kind + " other", client=device.client)
  return [
    ("jax", mock.patch.object(jax, "__version__", "0.0.1")),
    ("backend", mock.patch.object(jax, "default_backend", lambda: "gpu")),
    ("device", mock.patch.object(jax, "devices", lambda: [other])),
    ("XLA flags", mock.patch.dict(os.environ, {"XLA_FLAGS": "--x"})),
  ]


def assert_digest_follows_code(test: Any, digest: Any, modules: Sequence[types.ModuleType]) -> None:
  """`digest()` (a `caches.memoize`d digest of `modules`' files) changes when any one file does, and is back once none is edited.

  A cache kept across processes keys on the code that makes what it keeps:
  an edit to any of that code is another key.
  """
  digest.cache_clear()
  here = digest()
  with tempfile.TemporaryDirectory() as folder:
    for module in modules:
      edited = os.path.join(folder, module.__name__ + ".py")
      with open(str(module.__file__)) as f:
        source = f.read()
      with open(edited, "w") as f:
        f.write(source + "\n# Edited.\n")
      digest.cache_clear()
      with test.subTest(module.__name__), mock.patch.object(module, "__file__", edited):
        test.assertNotEqual(digest(), here)
  digest.cache_clear()
  test.assertEqual(digest(), here)


def _fresh_process_command(path: str, function: str, *args: str) -> list[str]:
  return [
    sys.executable,
    "-c",
    _FRESH_PROCESS,
    str(jax.device_count("cpu")),
    os.path.abspath(path),
    function,
    *args,
  ]


def _fresh_process_env(env: dict[str, str] | None) -> dict[str, str]:
  """This process's environment for a child, with `env` added last.

  One process at a time can open a TPU ("libtpu multi-process lockfile"):
  beside a parent that holds one, the child runs on the CPU.
  """
  child = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
  if jax.default_backend() == "tpu":
    child["JAX_PLATFORMS"] = "cpu"
  return {**child, **(env or {})}


def on_the_fresh_process_backend() -> ContextManager[None]:
  """Computes in its block where `run_in_fresh_process`'s child computes: beside a TPU, on this process's CPU.

  A fresh process's values are compared with this process's as the same
  arithmetic gives them, within the CPU's bounds: the restore path is what
  such a test checks, not two backends' rounding (beside a TPU at
  "highest", a gradient after a `lax.cond` differed by 1.9e-4 of its size,
  `bridged_grid_test`, 2026-12-07). This process's own backend is tested in
  process. The inputs both processes make are made in it too: a TPU's
  `jax.random.normal` is not the CPU's to the last bits (with `X` made on
  the TPU, those tests' values still differed by up to 2.0e-5).
  """
  if jax.default_backend() == "tpu":
    return jax.default_device(jax.devices("cpu")[0])
  return contextlib.nullcontext()


def run_in_fresh_process(
  path: str, function: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
  """Runs `function(*args)` of the Python file `path` in a new process.

  The restore-a-checkpoint path: nothing this process cached is there. The
  new process has this one's `sys.path` and its number of CPU devices, so it
  runs the same programs: XLA:CPU may order a reduction differently with
  another count (jax 0.7.2, measured: a ResNet's batch-norm statistic moved
  by 1.3e-5 between 8 devices and 1). Beside a TPU this process holds, it
  runs on the CPU (`JAX_PLATFORMS=cpu`). Its stdout and stderr are
  captured. `env` adds to (or replaces in) this process's environment, e.g.
  `{"HAIKU_BRIDGE_CACHES": "0"}`.
  """
  return subprocess.run(
    _fresh_process_command(path, function, *args),
    env=_fresh_process_env(env),
    capture_output=True,
    text=True,
    check=False,
  )


class FreshProcess:
  """One new process (as `run_in_fresh_process` starts) that runs many calls.

  Each `call(*args)` runs `function(*args)` of `path` there and returns
  `None`, or the child's traceback if it raised. One process start (a jax
  import, the programs compiled once) serves every call: what a call must
  find fresh (e.g. the library's caches), `function` resets itself.
  Protocol: one line of tab-separated arguments in, one marked line out.
  """

  _PREFIX = "fresh-process: "
  _OK = _PREFIX + "ok"

  def __init__(self, path: str, function: str, env: dict[str, str] | None = None):
    self._stderr = tempfile.TemporaryFile(mode="w+")
    self._process = subprocess.Popen(
      _fresh_process_command(__file__, "_serve", path, function),
      env=_fresh_process_env(env),
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=self._stderr,
      text=True,
    )

  def call(self, *args: str) -> str | None:
    assert not any("\t" in a or "\n" in a for a in args), args
    self._process.stdin.write("\t".join(args) + "\n")
    self._process.stdin.flush()
    reply = "fresh-process: the process ended"
    for line in self._process.stdout:  # Lines the call printed come first.
      if line.startswith(self._PREFIX):
        reply = line.rstrip("\n")
        break
    if reply == self._OK:
      return None
    self._stderr.seek(0)
    return reply[len(self._PREFIX) :].replace("\x00", "\n") + "\n" + self._stderr.read()[-3000:]

  def close(self) -> None:
    self._process.stdin.close()
    self._process.wait()
    self._process.stdout.close()
    self._stderr.close()


def _serve(path: str, function: str) -> None:
  """The child of `FreshProcess`: calls `function` for each line of stdin."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import traceback  # pylint: disable=g-import-not-at-top

  spec = importlib.util.spec_from_file_location("fresh_process_served", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for line in sys.stdin:
    try:
      getattr(module, function)(*line.rstrip("\n").split("\t"))
      reply = FreshProcess._OK  # pylint: disable=protected-access
    except Exception:  # pylint: disable=broad-except
      reply = FreshProcess._PREFIX + traceback.format_exc().replace(  # pylint: disable=protected-access
        "\n", "\x00"
      )
    sys.stdout.write(reply + "\n")
    sys.stdout.flush()
