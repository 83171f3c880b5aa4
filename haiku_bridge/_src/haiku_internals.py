"""The only place haiku_bridge reads or writes Haiku's private state.

Everything else in the bridge uses Haiku's public API. What is not public in
dm-haiku 0.0.17, and the bridge needs for clear errors and exact names, is
reached here, behind small functions, each pinned by `haiku_internals_test.py`:
a Haiku upgrade that moves one fails there first, and this file is the one
place to mend.

Reads:
  * `stored_param`, `stored_state`, `stored_bundle`, `stored_names`: a
    frame's stored values, before getters.
  * `getters_active`: whether a getter stack is non-empty.
  * `inside_raw_jax_transform`: the frame's recorded JAX trace level.
  * `original_fn`: the function behind an `hk.transform*`.
  * `frame`, `creation_frame_id`: frame and module identities.

Writes:
  * `interceptors_suspended`: empties the interceptor stacks for a while.
  * `claim_name`: adds an entry to the current module call's used names.
  * `in_naming_probe`: pushes a throw-away copy of a frame, to ask it which
    module names it would give without taking them.
  * `run_with_storage`: runs a function in a new frame over storage mappings
    that the bridge supplies (and may fill lazily).
"""

import contextlib
from typing import Any, Callable, Iterator, MutableMapping, Optional

import haiku as hk
from haiku._src import base as _base

Frame = Any  # Haiku's private frame object: only passed around, never read.


def stored_param(bundle: str, name: str) -> Optional[Any]:
  """The value stored for parameter `bundle/name`, before any custom getter."""
  return _base.current_frame().params.get(bundle, {}).get(name)


def stored_state(bundle: str, name: str) -> Optional[Any]:
  """The current value of state `bundle/name`, before any custom getter."""
  state = _base.current_frame().state
  if state is None or name not in state.get(bundle, {}):
    return None
  return state[bundle][name].current


def stored_names() -> set[str]:
  """`bundle/name` of every param and state stored in the current frame."""
  current = _base.current_frame()
  names = {f"{b}/{n}" for b, entries in current.params.items()
           for n in entries}
  for b, entries in (current.state or {}).items():
    names.update(f"{b}/{n}" for n in entries)
  return names


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


def frame() -> Frame:
  """The current Haiku frame (one per running init/apply), as a handle."""
  return _base.current_frame()


def creation_frame_id(module: hk.Module) -> Optional[int]:
  """The id of the frame a module was created in."""
  return getattr(module, "_creation_frame_id", None)


def frame_id(handle: Frame) -> int:
  return handle.frame_id


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
  current = _base.current_frame()
  used = current.used_names_stack.peek()
  key = f"haiku_bridge:{current.frame_id}:{full_name}"
  if key in used:
    return False
  used.add(key)
  return True


@contextlib.contextmanager
def in_naming_probe(handle: Frame) -> Iterator[None]:
  """Makes a throw-away copy of frame `handle` current.

  Modules created inside are named exactly as they would be in `handle` at
  this point (its module stack, counters and used names are copied), but
  `handle` itself is left untouched: the names are only looked at, not taken.
  """
  probe = handle.evolve(handle.params, handle.state, None, decoupled=True)
  _base.frame_stack.push(probe)
  try:
    yield
  finally:
    _base.frame_stack.pop()


def stored_bundle(handle: Frame, kind: str, bundle: str) -> dict[str, Any]:
  """All values stored in frame `handle` under `bundle`, before getters."""
  if kind == "parameter":
    return dict(handle.params.get(bundle, {}))
  state = handle.state or {}
  return {name: pair.current for name, pair in state.get(bundle, {}).items()}


def stored_bundle_names(handle: Frame, kind: str) -> list[str]:
  """The bundles stored in frame `handle`, params or state."""
  if kind == "parameter":
    return list(handle.params)
  return [b for b, entries in (handle.state or {}).items() if entries]


class LazyBundles(dict):
  """A frame's params or state dict that fills each bundle when first asked.

  Haiku looks a bundle up with `in` (params) or `[...]` (state) before it
  reads a name from it; `load(bundle)` supplies `{name: value}` then. Each
  bundle is a `RecordingBundle`, which notes the names read from it.
  `hk.lift` (and so `hk.layer_stack`, `hkb.layer_scan`) instead writes whole
  bundles at init and, at apply, iterates over all bundles to take those
  under its prefix: `every_bundle()` names the bundles there are, and a
  bundle copied whole (`dict(bundle)`) counts as read in full.
  """

  def __init__(self, load: Callable[[str], dict[str, Any]], *, state: bool,
               every_bundle: Callable[[], list[str]] = list):
    super().__init__()
    self._load = load
    self._state = state
    self._every_bundle = every_bundle

  def __setitem__(self, bundle, values):
    dict.__setitem__(self, bundle, values if isinstance(
        values, RecordingBundle) else RecordingBundle({}, written=values))

  def setdefault(self, bundle, default=None):
    if not dict.__contains__(self, bundle):
      self[bundle] = {} if default is None else default
    return dict.__getitem__(self, bundle)

  def items(self):
    for bundle in self._every_bundle():
      self[bundle]  # pylint: disable=pointless-statement
    return [(b, e) for b, e in dict.items(self) if e]

  def keys(self):
    return [bundle for bundle, _ in self.items()]

  def __iter__(self):
    return iter(self.keys())

  def _fill(self, bundle: str) -> "RecordingBundle":
    values = self._load(bundle)
    if self._state:
      values = {k: _base.StatePair(v, v) for k, v in values.items()}
    filled = RecordingBundle(values)
    dict.__setitem__(self, bundle, filled)
    return filled

  def __missing__(self, bundle: str) -> "RecordingBundle":
    return self._fill(bundle)

  def __contains__(self, bundle: object) -> bool:
    if not dict.__contains__(self, bundle):
      self._fill(bundle)  # pytype: disable=wrong-arg-types
    return bool(dict.__getitem__(self, bundle))

  def get(self, bundle, default=None):
    return self[bundle] if bundle in self else default


class RecordingBundle(dict):
  """One bundle of a `LazyBundles`.

  `loaded` holds the names it was filled with; `read` lists the names looked
  up, in order.
  """

  def __init__(self, values: dict[str, Any], written: Any = None):
    super().__init__(values)
    self.loaded = frozenset(values)
    self.read: list[str] = []
    if written:
      self.update(written)

  def get(self, name, default=None):
    if name not in self.read:
      self.read.append(name)
    return super().get(name, default)

  def keys(self):
    # `dict(bundle)`, as `hk.lift` copies the bundles under its prefix.
    for name in dict.keys(self):
      if name not in self.read:
        self.read.append(name)
    return dict.keys(self)

  def __iter__(self):
    return iter(self.keys())


def run_with_storage(fn: Callable[[], Any], params: MutableMapping[str, Any],
                     state: MutableMapping[str, Any], rng: Optional[Any], *,
                     frozen: bool) -> Any:
  """Runs `fn()` in a new frame over the given storage dicts.

  `hk.transform(...)` copies the params and state it is given; this runs on
  the mappings themselves (e.g. `LazyBundles`), so the bridge sees each
  bundle the moment the function asks for it. `frozen` params are apply's
  (a missing one is an error); unfrozen ones are init's (a missing one is
  created, and `hk.running_init()` is True).
  """
  sequence = None if rng is None else hk.PRNGSequence(rng)
  with _base.HaikuContext(params, state, sequence, freeze_params=frozen):
    return fn()
