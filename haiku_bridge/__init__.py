"""haiku_bridge: explicit-params JAX code inside Haiku transforms."""

from haiku_bridge._src.call_pure import call_pure
from haiku_bridge._src.call_pure import get_relevant_parameters
from haiku_bridge._src.hk_namespace import hk
from haiku_bridge._src.scan import layer_scan
from haiku_bridge._src.scan import repeat_layer
from haiku_bridge._src.scan import stack_params
from haiku_bridge._src.scan import stacked_init
from haiku_bridge._src.scan import unstack_params

__version__ = "0.1.0"

__all__ = (
    "call_pure",
    "get_relevant_parameters",
    "hk",
    "layer_scan",
    "repeat_layer",
    "stack_params",
    "stacked_init",
    "unstack_params",
)
