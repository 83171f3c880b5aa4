"""Helpers shared by haiku_bridge's tests."""

import collections
import os
import re
import subprocess
import sys
from typing import Any, Callable, Iterator

import haiku as hk
import jax
import jax.extend.core as jax_core


def primitive_counts(fn: Callable[..., Any], *args: Any) -> collections.Counter:
  """Counts the primitives in `fn`'s jaxpr, including all nested jaxprs.

  Two functions with equal counts run the same operations, whatever names or
  Python structure produced them: the structural fact behind "zero overhead".
  """
  counts = collections.Counter()

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      counts[eqn.primitive.name] += 1
      for sub in jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return counts


def value_shapes(fn: Callable[..., Any], *args: Any) -> set[tuple[int, ...]]:
  """The shape of every value `fn`'s jaxpr computes, nested jaxprs included.

  What a program may hold at once: a value of shape `(T,) + w.shape` means a
  copy of `w` per step somewhere.
  """
  shapes = set()

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      shapes.update(tuple(v.aval.shape) for v in eqn.outvars
                    if hasattr(v.aval, "shape"))
      for sub in jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return shapes


def jaxprs_in_params(params: dict[str, Any]) -> Iterator[jax_core.Jaxpr]:
  """The jaxprs an equation's params hold: `jax.extend.core.jaxprs_in_params` (jax >= 0.10)."""
  if hasattr(jax_core, "jaxprs_in_params"):
    yield from jax_core.jaxprs_in_params(params)
    return
  for value in params.values():
    for v in value if isinstance(value, tuple) else (value,):
      if isinstance(v, jax_core.Jaxpr):
        yield v
      elif isinstance(v, jax_core.ClosedJaxpr):
        yield v.jaxpr


def canonical_hlo(compiled: jax.stages.Compiled) -> str:
  """Optimised HLO text without names, source locations or metadata.

  Two programs with the same canonical text run the same kernels.
  """
  lines = compiled.as_text().splitlines()
  start = next(i for i, line in enumerate(lines)
               if line.startswith("HloModule"))
  body = lines[start + 1:]
  # Skip the debug tables (file names, stack frames) before the computations.
  first = next((i for i, line in enumerate(body)
                if line.startswith(("%", "ENTRY"))), 0)
  text = "\n".join(body[first:])
  text = re.sub(r", metadata=\{[^}]*\}", "", text)
  # Parameter names in computation headers (they carry module names).
  text = re.sub(r"^(.*?\()(.*)(\) -> .*\{)$",
                lambda m: m[1] + re.sub(r"[\w.\-]+: ", "", m[2]) + m[3],
                text, flags=re.M)
  names = {}
  return re.sub(r"%([\w.\-]+)",
                lambda m: "%" + names.setdefault(m[1], f"v{len(names)}"),
                text)


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


def run_in_fresh_process(path: str, function: str, *args: str,
                         env: dict[str, str] | None = None
                         ) -> subprocess.CompletedProcess:
  """Runs `function(*args)` of the Python file `path` in a new process.

  The restore-a-checkpoint path: nothing this process cached is there. The
  new process has this one's `sys.path` and its number of CPU devices, so it
  runs the same programs: XLA:CPU may order a reduction differently with
  another count (jax 0.7.2, measured: a ResNet's batch-norm statistic moved
  by 1.3e-5 between 8 devices and 1). Its stdout and stderr are captured.
  `env` adds to (or replaces in) this process's environment, e.g.
  `{"HAIKU_BRIDGE_CACHES": "0"}`.
  """
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **(env or {}))
  return subprocess.run(
      [sys.executable, "-c", _FRESH_PROCESS, str(jax.device_count("cpu")),
       os.path.abspath(path), function, *args],
      env=env, capture_output=True, text=True, check=False)
