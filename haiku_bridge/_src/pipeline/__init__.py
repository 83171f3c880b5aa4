"""Pipeline parallelism for a layer scan: the one entry the rest of the library uses.

`layer_scan(..., pipeline=Pipeline(...))` checks and lays out its pipeline
(`plan.plan`) and runs it (`stages.run`); the public config is `Pipeline`.
A module a job: `config.py` the public config, `plan.py` the checks and the
layout, `layout.py` the stack and the batch between the scan and the
stages, `stages.py` the program each stage runs, `row_wise.py` which layers
treat each row on their own.
"""

from haiku_bridge._src.pipeline.config import check_pipeline
from haiku_bridge._src.pipeline.config import jax_has_pipelines
from haiku_bridge._src.pipeline.config import jax_runs_stages_on_explicit_axes
from haiku_bridge._src.pipeline.config import Pipeline
from haiku_bridge._src.pipeline.config import SCHEDULES
from haiku_bridge._src.pipeline.config import Timetable
from haiku_bridge._src.pipeline.config import timetable

__all__ = [
    "Pipeline", "SCHEDULES", "Timetable", "check_pipeline",
    "jax_has_pipelines", "jax_runs_stages_on_explicit_axes", "timetable",
]
