r"""The first trace of `apply` in a new Python process, where `init` never ran.

What a user pays after restarting from a checkpoint: the process imports the
library, restores params from arrays, builds the model and traces `apply` for
the first time, with no shape or trace cache warmed by `init`. The parent
writes each variant's params to an `.npz`; every sample is a new subprocess
(`sys.executable -m testing.benchmarks.lib.fresh_process ...`) that times
`jax.jit(apply).trace(...)` and then `.lower()` of that trace, and prints
the phase times as one JSON line. With `--eval_shape_init` it times instead
what a bridged variant adds at a cold start: `jax.eval_shape` of the `init`
it shapes, the first in that process. The variants' subprocesses run one after
another, in an order rotated each repetition (`harness.interleaved`), so the
ratios pair up as in the in-process rows.

The child, by hand (the parent passes the same arguments):

    PYTHONPATH=. python3 -m testing.benchmarks.lib.fresh_process \
        --variant=inline --size=small,64,2,16 --params=/tmp/inline.npz
"""

import argparse
import contextlib
import cProfile
import functools
import json
import os
import pstats
import subprocess
import sys
from typing import Any, Hashable, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from testing.benchmarks.lib import harness
from testing.benchmarks.lib import models
from testing.benchmarks.lib import trace_profile
from testing.benchmarks.lib import trace_rows

_NAMES = "__param_names__"  # The .npz entry that lists "module\tname" keys.


def save_params(params: hk.Params, path: str) -> None:
  """Writes Haiku params to `path` (.npz), as a checkpoint would hold them."""
  entries = list(hk.data_structures.traverse(params))
  np.savez(
    path,
    *(np.asarray(value) for _, _, value in entries),
    **{_NAMES: np.array([f"{m}\t{n}" for m, n, _ in entries])},
  )


def load_params(path: str) -> hk.Params:
  """The params of `save_params`, as device arrays."""
  params: dict[str, dict[str, jax.Array]] = {}
  with np.load(path) as data:
    for i, key in enumerate(data[_NAMES]):
      module, name = str(key).split("\t")
      params.setdefault(module, {})[name] = jnp.asarray(data[f"arr_{i}"])
  return params


def _size_arg(size: models.MlpSize) -> str:
  return ",".join(str(field) for field in size)


def _parse_size(text: str) -> models.MlpSize:
  name, width, depth, batch = text.split(",")
  return models.MlpSize(name, int(width), int(depth), int(batch))


def _child_command(
  variant: str,
  size: models.MlpSize,
  params_path: str,
  profile_out: Optional[str],
  eval_shape_init: bool,
) -> list[str]:
  command = [
    sys.executable,
    "-m",
    "testing.benchmarks.lib.fresh_process",
    f"--variant={variant}",
    f"--size={_size_arg(size)}",
    f"--params={params_path}",
  ]
  if profile_out:
    command.append(f"--profile_out={profile_out}")
  if eval_shape_init:
    command.append("--eval_shape_init")
  return command


def child_env() -> dict[str, str]:
  """This process's environment, with a PYTHONPATH that finds this checkout.

  The child finds this checkout (or Bazel's runfiles) where the parent does.
  """
  path = [p for p in sys.path if p and os.path.isdir(p)]
  return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def run_child(
  variant: str,
  size: models.MlpSize,
  params_path: str,
  profile_out: Optional[str] = None,
  eval_shape_init: bool = False,
) -> harness.Phases:
  """Runs one fresh process; returns its phase times."""
  done = subprocess.run(
    _child_command(variant, size, params_path, profile_out, eval_shape_init),
    env=child_env(),
    capture_output=True,
    text=True,
    check=False,
  )
  if done.returncode != 0:
    raise RuntimeError(
      f"fresh-process child for {variant!r} failed (exit {done.returncode}):\n{done.stderr}"
    )
  return json.loads(done.stdout.strip().splitlines()[-1])


def write_params(
  size: models.MlpSize, params: dict[str, hk.Params], directory: str
) -> dict[str, str]:
  """Saves each variant's params; returns the .npz path by variant."""
  paths = {}
  for i, (variant, variant_params) in enumerate(params.items()):
    paths[variant] = os.path.join(directory, f"{size.name}-{i}.npz")
    save_params(variant_params, paths[variant])
  return paths


def samples(
  size: models.MlpSize, children: dict[Hashable, dict[str, Any]], repeats: int, warmup: int
) -> harness.Samples:
  """First-trace times, one subprocess per sample, side by side.

  Args:
    size: the MLP's size.
    children: by sample key, the keyword arguments of `run_child` (less
      `size`) that measure it.
    repeats: samples per key.
    warmup: unrecorded samples per key first.

  Returns:
    Samples by key, phases "trace" (and "lower" after an apply trace), each
    with its CPU time.
  """
  group = {
    key: functools.partial(run_child, size=size, **kwargs) for key, kwargs in children.items()
  }
  return harness.interleaved(f"fresh process ({size.name})", [group], repeats, warmup)


def profile(
  size: models.MlpSize, variant: str, params_path: str, repeats: int, directory: str
) -> trace_profile.TraceProfile:
  """cProfile of the first trace in `repeats` fresh processes, merged."""
  files = []
  for i in range(repeats):
    out = os.path.join(directory, f"fresh-profile-{i}.pstats")
    run_child(variant, size, params_path, profile_out=out)
    files.append(out)
  stats = pstats.Stats(*files)
  return trace_profile.summarize(stats, repeats, variant, trace_rows.FRESH_PROCESS, size.name)


def first_eval_shape(variant: str, size: models.MlpSize) -> harness.Phases:
  """In the child: the first `jax.eval_shape` of the `init` `variant` shapes."""
  x = jnp.zeros([size.batch, size.width])
  fresh = models.mlp_models(size)
  init = {models.BRIDGED_TRANSFORMED: fresh.inner_init, models.BRIDGED_PURE: fresh.pure_init}[
    variant
  ]
  return harness.timed(lambda: jax.eval_shape(init, models.KEY, x), "trace")


def first_trace(
  variant: str, size: models.MlpSize, params_path: str, profiler: Optional[cProfile.Profile]
) -> harness.Phases:
  """In the child: restore params, build the model, time its first trace."""
  params = load_params(params_path)
  x = jnp.zeros([size.batch, size.width])
  apply = models.mlp_model(size, variant).apply
  traced: list[Any] = []

  def trace():
    with profiler or contextlib.nullcontext():
      traced.append(jax.jit(apply).trace(params, None, x))

  phases = harness.timed(trace, "trace")
  phases.update(harness.timed(lambda: traced[0].lower(), "lower"))
  return phases


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--variant", required=True, choices=models.MLP_VARIANTS + (models.INLINE_COPY,)
  )
  parser.add_argument("--size", required=True, type=_parse_size, help="name,width,depth,batch")
  parser.add_argument("--params", required=True, help="an .npz of params")
  parser.add_argument("--profile_out", help="also write a cProfile of the trace here")
  parser.add_argument(
    "--eval_shape_init",
    action="store_true",
    help="time jax.eval_shape of the variant's init instead",
  )
  args = parser.parse_args()
  if args.eval_shape_init:
    print(json.dumps(first_eval_shape(args.variant, args.size)))
    return
  profiler = cProfile.Profile() if args.profile_out else None
  phases = first_trace(args.variant, args.size, args.params, profiler)
  if profiler:
    profiler.dump_stats(args.profile_out)
  print(json.dumps(phases))


if __name__ == "__main__":
  main()
