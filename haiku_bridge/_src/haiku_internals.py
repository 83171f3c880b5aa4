"""The only place haiku_bridge reads Haiku's private state.

Everything else in the bridge uses Haiku's public API. Three facts are not
public in dm-haiku 0.0.17, and the bridge needs them to give clear errors and
exact names, so they are read here, behind small functions with their own tests
(`haiku_internals_test.py`): a Haiku upgrade that moves them fails those tests
first, and this file is the one place to mend.
"""

import contextlib
from typing import Any, Callable, Iterator, Optional

import haiku as hk
from haiku._src import base as _base


def stored_param(bundle: str, name: str) -> Optional[Any]:
  """The value stored for parameter `bundle/name`, before any custom getter."""
  return _base.current_frame().params.get(bundle, {}).get(name)


def stored_state(bundle: str, name: str) -> Optional[Any]:
  """The current value of state `bundle/name`, before any custom getter."""
  state = _base.current_frame().state
  if state is None or name not in state.get(bundle, {}):
    return None
  return state[bundle][name].current


def getters_active(kind: str) -> bool:
  """Whether a custom getter would see a `kind` ("parameter" or "state") read."""
  stack = (_base.param_getter_stack if kind == "parameter"
           else _base.state_getter_stack)
  return bool(stack)


def inside_raw_jax_transform() -> bool:
  """True inside a JAX transform that Haiku does not know about.

  Haiku's own wrappers (`hk.vmap`, `hk.scan`, `hk.remat`, ...) record the JAX
  trace they run under; a raw `jax.lax.scan` or `jax.vmap` body does not. Haiku
  performs this comparison itself only when `check_jax_usage` is on; the bridge
  needs it unconditionally, because creating a parameter there would leak a
  tracer into the transform's params.
  """
  frame = _base.current_frame()
  return frame.jax_trace_stack.peek() != _base.JaxTraceLevel.current()


def original_fn(f: Any) -> Optional[Callable[..., Any]]:
  """The function an `hk.transform*` was built from, or None."""
  init = getattr(f, "init", None)
  return getattr(init, "_original_fn", None)


def is_transformed(f: Any) -> bool:
  return isinstance(f, (hk.Transformed, hk.TransformedWithState))


_INTERCEPTOR_STACKS = (
    _base.param_creator_stack,
    _base.state_creator_stack,
    _base.param_getter_stack,
    _base.state_getter_stack,
    _base.state_setter_stack,
)


@contextlib.contextmanager
def interceptors_suspended() -> Iterator[None]:
  """Runs a nested transform without the caller's custom creators/getters/setters.

  Haiku keeps interceptors in thread-global stacks, so they would also run
  inside a nested `hk.transform` that the bridge calls; the bridge applies them
  once, in the caller's transform, where inline code would meet them.
  """
  saved = [list(stack) for stack in _INTERCEPTOR_STACKS]
  for stack in _INTERCEPTOR_STACKS:
    while stack:
      stack.pop()
  try:
    yield
  finally:
    for stack, entries in zip(_INTERCEPTOR_STACKS, saved):
      while stack:
        stack.pop()
      for entry in entries:
        stack.push(entry)


def claim_name(full_name: str) -> bool:
  """Claims `full_name` in the current module call; False if already claimed.

  Haiku gives each module method call a fresh set of used names, so calling
  one module twice (weight sharing) claims afresh, while two bridged calls in
  one method that map to the same parameter are caught. Haiku's wrappers that
  trace a body again (`hk.scan` after its unrolled first step, `hk.vmap`, ...)
  run it in a new frame holding a copy of that set; the frame id in the key
  keeps those copies from reading as a second claim. The ':' keeps these
  entries apart from module names, which can never contain one.
  """
  frame = _base.current_frame()
  used = frame.used_names_stack.peek()
  key = f"haiku_bridge:{frame.frame_id}:{full_name}"
  if key in used:
    return False
  used.add(key)
  return True
