"""`from haiku_bridge import hk`: Haiku's namespace with the bridge added.

A read-only view: every name resolves to the installed `haiku` module's own
attribute, except the bridge's additions. The installed `haiku` module is not
modified, so code that imports `haiku` directly sees Haiku exactly as shipped.
"""

import types
from typing import Any

import haiku

from haiku_bridge._src import call_pure as call_pure_lib

ADDITIONS = {
  "call_pure": call_pure_lib.call_pure,
  "get_relevant_parameters": call_pure_lib.get_relevant_parameters,
}


class _HaikuWithBridge(types.ModuleType):
  """Module type whose attributes fall through to `haiku`."""

  def __getattr__(self, name: str) -> Any:
    return getattr(haiku, name)

  def __dir__(self) -> list[str]:
    return sorted(set(dir(haiku)) | set(ADDITIONS))


def make_namespace() -> types.ModuleType:
  namespace = _HaikuWithBridge(
    "haiku_bridge.hk", "Haiku's public namespace plus the bridge: `hk.call_pure`."
  )
  for name, value in ADDITIONS.items():
    setattr(namespace, name, value)
  return namespace


hk = make_namespace()
