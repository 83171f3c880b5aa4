"""The XLA flags every test process compiles with: XLA:CPU's cheaper code generation.

A fresh machine's test run is mostly XLA:CPU compiling small programs (measured on
`time_scan_test`: 115 s of its 185 s in `backend_compile`, 601 compiles). Two flags
of the CPU backend's code generation cut that compile time by about a half
(`testing/xla_flags_test.py` states what they leave unchanged):

- `--xla_cpu_use_fusion_emitters=false`: the fused kernels from XLA's older
  emitters instead of its MLIR fusion emitters (jaxlib 0.11 removed the older
  emitters and the flag with them).
- `--xla_backend_optimization_level=1`: LLVM's -O1 instead of -O2.

They change how kernels are generated, not what the tests read of a program:
its optimised HLO's buffer assignment (`compiled.memory_analysis()`, which
memory tests hold to bounds) and its values up to float rounding.
`xla_flags_test.py` checks both on the programs the memory tests measure,
against a process with XLA's defaults.

XLA aborts a process whose XLA_FLAGS names a flag it does not know ("Unknown
flag in XLA_FLAGS"), so no flag of `CANDIDATES` is given untried: `flags()`
returns those that the installed XLA accepts, as a fresh process found them
(one `jax.devices()` with the candidates set; the flags XLA names as unknown
are dropped and the rest tried again). The answer is cached in a file, keyed on
the candidates, the installed jax packages (jaxlib and any PJRT plugin, each of
which parses XLA_FLAGS) and JAX_PLATFORMS: a new jaxlib is probed afresh.
`conftest.py` gives pytest's processes `flags()` unless the environment names
its own XLA_FLAGS, and `readme_test.py` gives them to the snippets it runs.
`.bazelrc` gives Bazel's tests a fixed line, the flags of the jaxlib that
requirements.txt pins (`xla_flags_test.py` checks that it agrees). Benchmarks
run with whatever the user's environment says (their tables record it).
"""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

CANDIDATES = ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=1")

# What the probe runs: starting a backend is when XLA parses XLA_FLAGS.
_PROBE = "import jax; jax.devices()"
# "Unknown flag in XLA_FLAGS: --a" or, for more than one, "Unknown flags in XLA_FLAGS: --a --b".
_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)$", re.MULTILINE)
_TIMEOUT_S = 120
# The packages that hold an XLA, each parsing XLA_FLAGS: jaxlib, a PJRT plugin (jax-cuda13-plugin,
# jax-cuda13-pjrt, ...), libtpu.
_XLA_PACKAGES = re.compile(r"jaxlib|jax[-_]\w+[-_](plugin|pjrt)|libtpu(-nightly)?", re.IGNORECASE)


def cache_path() -> str:
  """The probe's cache file: beside the tests' XLA compilation cache."""
  directory = os.environ.get("JAX_COMPILATION_CACHE_DIR") or tempfile.gettempdir()
  return os.path.join(directory, "haiku_bridge_xla_flags.json")


def cache_key(candidates: Sequence[str]) -> str:
  """What the probe's answer depends on: the candidates, jax's packages, JAX_PLATFORMS."""
  packages = sorted(
    f"{d.metadata['Name']}=={d.version}"
    for d in importlib.metadata.distributions()
    if _XLA_PACKAGES.fullmatch(d.metadata["Name"] or "")
  )
  return json.dumps(
    {
      "candidates": list(candidates),
      "packages": packages,
      "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", ""),
    }
  )


def probe(candidates: Sequence[str]) -> tuple[str, ...]:
  """The `candidates` that XLA accepts, as fresh processes find them."""
  known = list(candidates)
  while True:
    env = dict(os.environ, XLA_FLAGS=" ".join(known))
    result = subprocess.run(
      [sys.executable, "-c", _PROBE],
      env=env,
      capture_output=True,
      text=True,
      timeout=_TIMEOUT_S,
      check=False,
    )
    if result.returncode == 0:
      return tuple(known)
    named = _UNKNOWN.search(result.stderr)
    unknown = set(named[1].split()) & set(known) if named else set()
    if not unknown:
      raise RuntimeError(
        f"testing/xla_flags.py: a process with XLA_FLAGS={env['XLA_FLAGS']!r} "
        f"failed for another reason than an unknown flag:\n"
        f"{result.stderr[-3000:]}"
      )
    known = [flag for flag in known if flag not in unknown]


def _read_cache(path: str) -> dict[str, list[str]]:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def known_flags(
  candidates: Sequence[str] = CANDIDATES, path: Optional[str] = None
) -> tuple[str, ...]:
  """The `candidates` the installed XLA knows: cached, else probed and cached."""
  path = path or cache_path()
  key = cache_key(candidates)
  cached = _read_cache(path)
  if key in cached:
    return tuple(cached[key])
  known = probe(candidates)
  cached = dict(_read_cache(path), **{key: list(known)})  # Another process may have written.
  try:  # Atomically: parallel test processes (pytest -n) probe and write at once.
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False) as f:
      json.dump(cached, f, indent=1)
    os.replace(f.name, path)
  except OSError:
    pass  # A read-only directory: the next process probes again.
  return known


def flags() -> str:
  """The XLA_FLAGS value of every test process: the candidates this XLA knows."""
  return " ".join(known_flags())
