"""haiku_bridge: explicit-params JAX code inside Haiku transforms."""

from haiku_bridge._src.call_pure import call_pure
from haiku_bridge._src.call_pure import get_relevant_parameters
from haiku_bridge._src.custom_grad import custom_jvp
from haiku_bridge._src.custom_grad import custom_vjp
from haiku_bridge._src.custom_grad import route_cotangents
from haiku_bridge._src.custom_grad import vjp_fwd
from haiku_bridge._src.hk_namespace import hk
from haiku_bridge._src.scan import layer_scan
from haiku_bridge._src.scan import repeat_layer
from haiku_bridge._src.scan import stack_params
from haiku_bridge._src.scan import stacked_init
from haiku_bridge._src.scan import unstack_params
from haiku_bridge._src.sharding import explain_shardings
from haiku_bridge._src.sharding import param_shardings
from haiku_bridge._src.sharding import param_specs
from haiku_bridge._src.sharding import ShardingRules

__version__ = "0.1.0"

__all__ = (
    "ShardingRules",
    "call_pure",
    "custom_jvp",
    "custom_vjp",
    "explain_shardings",
    "get_relevant_parameters",
    "hk",
    "layer_scan",
    "param_shardings",
    "param_specs",
    "repeat_layer",
    "route_cotangents",
    "stack_params",
    "stacked_init",
    "unstack_params",
    "vjp_fwd",
)
