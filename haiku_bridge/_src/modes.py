"""The string modes of the public API, as `Literal` types a type checker reads.

An option that takes one of a few strings is annotated with its alias here, so
mypy (or pyright) reports `remat="nestd"` where it is written, not when it
runs. The runtime checks stay (a caller without a type checker still gets the
library's error), and read their values from these aliases:

>>> from haiku_bridge._src import modes
>>> modes.REMAT_SCHEDULES, modes.PIPELINE_SCHEDULES
(('nested', 'binomial'), ('gpipe', 'circular'))

A user's own wrapper names them as `hkb.RematMode` and `hkb.PipelineSchedule`.
"""

import typing
from typing import Literal

# What `remat=` of `layer_scan`, `repeat_layer`, `scan` and `dynamic_unroll`
# keeps for the backward pass: its schedules keep fewer carries than steps
# (remat/schedule.py).
RematSchedule = Literal["nested", "binomial"]
# "auto": the plan with the least recomputation under `memory_budget=`
# (remat/plan.py).
RematMode = bool | RematSchedule | Literal["auto"]
# `Pipeline(schedule=...)`: which stage runs which layers (pipeline/config.py).
PipelineSchedule = Literal["gpipe", "circular"]

REMAT_SCHEDULES: tuple[str, ...] = typing.get_args(RematSchedule)
REMAT_AUTO = "auto"
PIPELINE_SCHEDULES: tuple[str, ...] = typing.get_args(PipelineSchedule)
