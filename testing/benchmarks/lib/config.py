"""How big and how often the benchmarks run: `FULL` and `QUICK`."""

import dataclasses

from testing.benchmarks.lib.models import MlpSize


@dataclasses.dataclass(frozen=True)
class Config:
  """Sizes and repetition counts; `FULL` fits ~10 minutes on 2 shared cores."""

  mode: str
  mlp_sizes: tuple[MlpSize, ...]
  depths: tuple[int, ...]
  stack_width: int
  stack_batch: int
  warmup: int  # Repetitions run first and dropped.
  trace_repeats: int
  fresh_process_repeats: int  # Each sample of each variant is a subprocess.
  compile_repeats: int
  step_repeats: int
  step_block_s: float  # Each step sample times enough calls to last this.
  profile_repeats: int  # Traces per in-process profile.
  fresh_profile_repeats: int  # Subprocesses per fresh-process profile.

  @property
  def compile_warmup(self) -> int:
    return max(1, self.warmup - 1)


FULL = Config(
  mode="full",
  mlp_sizes=(
    MlpSize("small", 64, 2, 16),
    MlpSize("medium", 256, 4, 64),
    MlpSize("large", 512, 16, 64),
  ),
  depths=(1, 4, 16, 48, 64),
  stack_width=128,
  stack_batch=64,
  warmup=2,
  trace_repeats=31,
  fresh_process_repeats=9,
  compile_repeats=5,
  step_repeats=31,
  step_block_s=0.05,
  profile_repeats=20,
  fresh_profile_repeats=3,
)

QUICK = Config(
  mode="quick",
  mlp_sizes=(MlpSize("tiny", 16, 2, 4),),
  depths=(2, 4),
  stack_width=16,
  stack_batch=4,
  warmup=1,
  trace_repeats=2,
  fresh_process_repeats=1,
  compile_repeats=1,
  step_repeats=2,
  step_block_s=0.002,
  profile_repeats=1,
  fresh_profile_repeats=1,
)
