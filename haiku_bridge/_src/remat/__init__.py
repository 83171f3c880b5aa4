"""What the backward pass of the bridge's loops keeps: the remat machinery, entered here.

The rest of the library reaches the machinery through this module only; its
rooms meet each other by name:

* `loop.py`: the loop under the layer scan, the time scans and each
  pipeline stage (`Loop`), its options checked (`from_options`).
* `step_checks.py`: the checks every scan makes of its body and its steps.
* `schedule.py`: the schedules of `remat="nested"` / `"binomial"` (which
  carries the backward pass keeps), as checkable data; `scheduled_scan.py`
  runs `jax.lax.scan` backwards by one.
* `step_budget.py`: `hkb.budgeted_jit`, one budget for a whole training
  step, which plans every `remat="auto"` loop without a budget of its own
  by compiling the step; `step_search.py` walks the ladder of plans to the
  first whose compiled step fits, and `step_compiles.py` compiles the step
  at a rung and reads its bytes.
* `plan.py`: `remat="auto"`, the plan that fits a memory budget, and its
  public API (`hkb.remat_plan`, `RematPlan`), made by the four modules
  below; `hlo_flops.py` counts a compiled program's FLOPs, every loop by
  its trip count, for them.
* `tracing.py`: the loop's step as JAX traces it, and what surrounds the
  loop (the derivatives, vmaps and mesh it runs under): the only module
  that reads JAX's internals.
* `measure.py`: what a plan costs: the measuring programs compiled (side
  by side) and read, and the model that predicts every candidate from them.
* `plan_cache.py`: where the measurements are kept, in memory and on
  disk, under keys of everything they depend on.
* `choice.py`: the choice for a budget, checked compiled (`RematPlan`),
  or the refusal that names the least budget.

When a plan is made is decided in one place, `resolved`: every loop of the
bridge (the scans', each pipeline stage's) passes it.
"""

# The names the rest of the library uses, and nothing else.
from haiku_bridge._src.remat.loop import from_options
from haiku_bridge._src.remat.loop import Loop
from haiku_bridge._src.remat.loop import resolved
from haiku_bridge._src.remat.plan import plannable
from haiku_bridge._src.remat.plan import Planned
from haiku_bridge._src.remat.plan import remat_plan
from haiku_bridge._src.remat.plan import remat_plans
from haiku_bridge._src.remat.plan import RematCandidate
from haiku_bridge._src.remat.plan import RematPlan
from haiku_bridge._src.remat.step_budget import budgeted_jit
from haiku_bridge._src.remat.step_budget import BudgetedStep
from haiku_bridge._src.remat.step_budget import StepPlan
from haiku_bridge._src.remat.step_checks import check_step_output
from haiku_bridge._src.remat.step_checks import CheckedBody
from haiku_bridge._src.remat.step_checks import num_steps
from haiku_bridge._src.remat.step_checks import StepAxis
from haiku_bridge._src.remat.step_checks import StepWords

__all__ = [
  "BudgetedStep",
  "CheckedBody",
  "Loop",
  "Planned",
  "RematCandidate",
  "RematPlan",
  "StepAxis",
  "StepPlan",
  "StepWords",
  "budgeted_jit",
  "check_step_output",
  "from_options",
  "num_steps",
  "plannable",
  "remat_plan",
  "remat_plans",
  "resolved",
]
