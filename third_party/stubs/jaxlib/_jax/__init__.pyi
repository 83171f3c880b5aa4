# Partial stub (see third_party/stubs/README.md): `pytree` typed, the rest Any.
from typing import Any

from . import pytree as pytree

def __getattr__(name: str) -> Any: ...
