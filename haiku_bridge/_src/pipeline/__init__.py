"""Pipeline parallelism for a layer scan, entered here: the names the rest of the library uses.

`layer_scan(..., pipeline=Pipeline(...))` (`layer_scan.py`) checks its pipeline
against the mesh, the stack and the batch and lays it out (`staging_for`,
at init under a mesh and at apply), then runs its stages (`run`). The
package, a file a job, its modules meeting each other by name:

* `config.py`: the public config, `Pipeline` (`hkb.Pipeline`), and what
  each part of it means for the layers, the batch, the state, the keys.
* `staging.py`: a pipeline checked and laid out once (`Staging`: the
  stack's placement on the stages, the microbatches, their timetable).
* `cost.py`: what a pipelined stack costs each device, before it runs
  (`pipeline_cost`, `hkb.pipeline_cost`): its shape, bubble, memory and
  bytes per collective kind, from the staging and a cost model.
* `timetables.py`: the timetable both schedules run from (`Timetable`), which
  stage runs which visit of which microbatch at each tick.
* `placement.py`: the stack and the batch moved from the scan's order to
  the stages' and back (`Placement`, `Batch`).
* `stage_program.py`: the program each stage runs inside the `shard_map`, and
  `run`, which runs it; `row_wise.py` says which layers treat each row on
  its own (their stages run apart over the batch's axes).
"""

# The names the rest of the library uses, and nothing else.
from haiku_bridge._src.pipeline.config import check_pipeline
from haiku_bridge._src.pipeline.config import jax_has_pipelines
from haiku_bridge._src.pipeline.config import jax_runs_stages_on_explicit_axes
from haiku_bridge._src.pipeline.config import Pipeline
from haiku_bridge._src.pipeline.config import SCHEDULES
from haiku_bridge._src.pipeline.cost import pipeline_cost
from haiku_bridge._src.pipeline.cost import PipelineCost
from haiku_bridge._src.pipeline.timetables import Timetable
from haiku_bridge._src.pipeline.timetables import timetable
from haiku_bridge._src.pipeline.stage_program import run
from haiku_bridge._src.pipeline.staging import Staging
from haiku_bridge._src.pipeline.staging import staging_for

__all__ = [
  "Pipeline",
  "PipelineCost",
  "SCHEDULES",
  "Staging",
  "Timetable",
  "check_pipeline",
  "jax_has_pipelines",
  "jax_runs_stages_on_explicit_axes",
  "pipeline_cost",
  "run",
  "staging_for",
  "timetable",
]
