"""haiku_bridge: explicit-params JAX code inside Haiku transforms."""

from haiku_bridge._src.call_pure import call_pure
from haiku_bridge._src.call_pure import get_relevant_parameters
from haiku_bridge._src.caches import clear_caches
from haiku_bridge._src.custom_grad import custom_jvp
from haiku_bridge._src.custom_grad import custom_vjp
from haiku_bridge._src.custom_grad import route_cotangents
from haiku_bridge._src.custom_grad import vjp_fwd
from haiku_bridge._src.errors import UnsupportedHaikuError
from haiku_bridge._src.hk_namespace import hk
from haiku_bridge._src.modes import PipelineSchedule
from haiku_bridge._src.modes import RematMode

# The Flax and Equinox adapters load on first use (see _src/optional.py): the module's
# `__getattr__` (PEP 562), which Python calls, not a name of `__all__`.
from haiku_bridge._src.optional import module_getattr as __getattr__  # noqa: F401
from haiku_bridge._src.pipeline import Pipeline
from haiku_bridge._src.pipeline import pipeline_cost
from haiku_bridge._src.pipeline import PipelineCost
from haiku_bridge._src.remat import budgeted_jit
from haiku_bridge._src.remat import BudgetedStep
from haiku_bridge._src.remat import remat_plan
from haiku_bridge._src.remat import remat_plans
from haiku_bridge._src.remat import RematCandidate
from haiku_bridge._src.remat import RematPlan
from haiku_bridge._src.remat import StepPlan
from haiku_bridge._src.layer_scan import layer_scan
from haiku_bridge._src.layer_scan import repeat_layer
from haiku_bridge._src.stacked_init import stacked_init
from haiku_bridge._src.time_scan import dynamic_unroll
from haiku_bridge._src.time_scan import scan
from haiku_bridge._src.sharding import explain_shardings
from haiku_bridge._src.sharding import gather_over
from haiku_bridge._src.sharding import param_shardings
from haiku_bridge._src.sharding import param_specs
from haiku_bridge._src.sharding import ShardingReport
from haiku_bridge._src.sharding import ShardingRules
from haiku_bridge._src.unrolled_names import stack_params
from haiku_bridge._src.unrolled_names import unstack_params
from haiku_bridge._src.versions import UntestedVersionWarning
from haiku_bridge._src import versions as _versions

# Once, on import: a jax or dm-haiku newer than the tested set. Said at the line that imports
# haiku_bridge (Python skips importlib's frames in between), not here.
_versions.warn_if_untested(stacklevel=2)

__version__ = "0.1.0"

__all__ = (
  "BudgetedStep",
  "Pipeline",
  "PipelineCost",
  "PipelineSchedule",
  "RematCandidate",
  "RematMode",
  "RematPlan",
  "ShardingReport",
  "ShardingRules",
  "StepPlan",
  "UnsupportedHaikuError",
  "UntestedVersionWarning",
  "budgeted_jit",
  "call_pure",
  "clear_caches",
  "custom_jvp",
  "custom_vjp",
  "dynamic_unroll",
  "explain_shardings",
  "gather_over",
  "from_equinox",
  "from_flax",
  "get_relevant_parameters",
  "hk",
  "layer_scan",
  "param_shardings",
  "param_specs",
  "pipeline_cost",
  "remat_plan",
  "remat_plans",
  "repeat_layer",
  "route_cotangents",
  "scan",
  "stack_params",
  "stacked_init",
  "to_equinox",
  "to_nnx",
  "unstack_params",
  "vjp_fwd",
)
