"""The machine and package versions a benchmark ran on."""

import datetime
import importlib.metadata
import os
import platform

import haiku as hk
import jax

import haiku_bridge as hkb
from testing.benchmarks.lib import markdown_table


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def environment() -> dict[str, str]:
  return {
    "platform": platform.platform(),
    "processor": platform.processor() or platform.machine(),
    "CPU count": str(os.cpu_count()),
    "CPUs usable": (
      str(len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else "n/a"
    ),
    "JAX devices": ", ".join(str(d) for d in jax.devices()),
    "python": platform.python_version(),
    "jax": jax.__version__,
    "jaxlib": _version("jaxlib"),
    "dm-haiku": hk.__version__,
    "numpy": _version("numpy"),
    "haiku_bridge": hkb.__version__,
    "XLA_FLAGS": os.environ.get("XLA_FLAGS", "(unset)"),
    "persistent compilation cache dir": str(jax.config.jax_compilation_cache_dir),
  }


def run_header(title: str, command: str, mode: str, seconds: float) -> str:
  """A benchmark run's description: its title, command, mode, date, run time and `environment()`."""
  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  lines = [
    f"## {title}",
    "",
    f"Command: `{command}`  ",
    f"Mode: {mode}  ",
    f"Date: {date}  ",
    f"Run time: {seconds:.0f} s",
    "",
  ]
  lines += markdown_table.lines(["", ""], environment().items())
  return "\n".join(lines) + "\n"
