"""The only place haiku_bridge reads or writes Haiku's private state.

Everything else in the bridge uses Haiku's public API. What is not public in
dm-haiku, and the bridge needs to run a Haiku function exactly as inline code
runs it, is reached here, behind small functions, each pinned by
`haiku_internals_test.py`: a Haiku upgrade that moves one fails there first,
and this file is the one place to mend. On a user's machine, importing this
file checks that what it reads is still there (`check_haiku`), and refuses a
dm-haiku that moved it with the library's error, naming what moved.

The bridge runs Haiku code the way Haiku's own `hk.remat` / `hk.cond` do: in
a new frame (Haiku's per-transform record of params, state, rng and module
names) evolved from the caller's, over plain dicts, with the JAX trace level
pushed. That is `frame_from`; everything else here is a read or a small write.

Reads:
  * `stored_param`, `stored_state`, `stored_names`: the current frame's
    stored values, before getters.
  * `inside_raw_jax_transform`: the frame's recorded JAX trace level.
  * `original_fn`: the function behind an `hk.transform*`.
  * `frame`, `frame_id`, `creation_frame_id`: frame and module identities.
  * `interceptors`: the custom creators, getters and setters in force.
  * `naming_effect`: which module names a run took in the caller's scope.
  * `same_transform`: whether two frames belong to one run of a transform.
  * `lifting`: what an `hk.lift*` module registers.
  * `LAYER_STACK_NAMES`: the names `hk.layer_stack` gives unnamed stacks.

Writes:
  * `interceptors_as`, `interceptors_suspended`: other interceptor stacks for
    a while.
  * `claim_name`: adds an entry to the current module call's used names.
  * `call_point`, `frame_from`: a copy of the caller's frame as it is now,
    and a new frame evolved from such a copy over given storage, pushed.
  * `take_names`: takes module names in the caller's scope, as a run did.
  * `write_state`: stores new state values in the current frame.

Loops (`hkb.scan`), as `hk.scan` runs its steps:
  * `loop_state`: the frame's state and rng, as a loop's carry.
  * `loop_step`: runs one step on such a carry, saying which params it
    created; `set_loop_state` stores the carry the loop ends with.
"""

import collections
import contextlib
import inspect
import types
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional

import haiku as hk
from haiku._src import base as _base
from haiku._src import layer_stack as _layer_stack
from haiku._src import lift as _lift
from haiku._src import module as _module
from haiku._src import stateful as _stateful

from haiku_bridge._src import errors
from haiku_bridge._src import versions

# -- What this file reads of Haiku, checked on import. ------------------------

# The private names used below, by module.
READS = {
  _base: (
    "current_frame",
    "Frame",
    "StatePair",
    "JaxTraceLevel",
    "param_creator_stack",
    "state_creator_stack",
    "param_getter_stack",
    "state_getter_stack",
    "state_setter_stack",
    "context_stack",
    "new_context",
    "frame_stack",
    "push_jax_trace_level",
    "param_names",
  ),
  _module: ("interceptor_stack",),
  _lift: ("LiftingModule",),
  _stateful: (
    "reserve_up_to_full_rng_block",
    "internal_state",
    "temporary_internal_state",
    "update_internal_state",
  ),
}
# The fields of Haiku's frame (a NamedTuple) and of a state entry that this file reads.
FRAME_FIELDS = (
  "params",
  "state",
  "freeze_params",
  "module_stack",
  "counter_stack",
  "used_names_stack",
  "jax_trace_stack",
  "frame_id",
)
STATE_PAIR_FIELDS = ("initial", "current")
# The names hk.layer_stack gives a stack without `name=`, by whether it has
# per-layer inputs (haiku/_src/layer_stack.py).
LAYER_STACK_NAMES = {False: "__layer_stack_no_per_layer", True: "__layer_stack_with_per_layer"}


def changed_reads(reads: Mapping[types.ModuleType, tuple[str, ...]] = READS) -> list[str]:
  """What this file reads of Haiku that this dm-haiku no longer has, described.

  Only facts that can be read without running Haiku (so without starting
  JAX): names, the fields of the frame and of a state entry, `Frame.evolve`'s
  `decoupled=` and the layer stack's default names. Their behaviour is pinned
  by haiku_internals_test.py.
  """
  changed = [
    f"{module.__name__}.{name} is gone"
    for module, names in reads.items()
    for name in names
    if not hasattr(module, name)
  ]
  frame_type = getattr(_base, "Frame", None)
  if frame_type is not None:
    fields = getattr(frame_type, "_fields", ())
    changed += [f"its Frame has no field {f!r}" for f in FRAME_FIELDS if f not in fields]
    evolve = getattr(frame_type, "evolve", None)
    if evolve is None or "decoupled" not in inspect.signature(evolve).parameters:
      changed.append("Frame.evolve takes no `decoupled=`")
  pair = getattr(_base, "StatePair", None)
  if pair is not None and tuple(getattr(pair, "_fields", ())) != STATE_PAIR_FIELDS:
    changed.append(f"StatePair's fields are not {STATE_PAIR_FIELDS}")
  try:
    source = inspect.getsource(_layer_stack)
  except (OSError, TypeError):
    source = None  # Installed without sources: nothing to read, nothing refused.
  if source is not None:
    changed += [
      f"hk.layer_stack does not name a stack {name!r}"
      for name in LAYER_STACK_NAMES.values()
      if f'"{name}"' not in source
    ]
  return changed


def check_haiku(reads: Mapping[types.ModuleType, tuple[str, ...]] = READS) -> None:
  """Raises `errors.unsupported_haiku` if dm-haiku changed what this file reads."""
  changed = changed_reads(reads)
  if changed:
    low, high = versions.TESTED["dm-haiku"]
    raise errors.unsupported_haiku(hk.__version__, f"{low} to {high}", changed)


check_haiku()  # Before the reads below run.

Frame = Any  # Haiku's private frame object: only passed around, never read.


# -- Reads. -------------------------------------------------------------------


def stored_param(bundle: str, name: str) -> Optional[Any]:
  """The value stored for parameter `bundle/name`, before any custom getter."""
  return _base.current_frame().params.get(bundle, {}).get(name)


def stored_state(bundle: str, name: str) -> Optional[Any]:
  """The current value of state `bundle/name`, before any custom getter."""
  # `{bundle: {name: StatePair}}`; Haiku's annotation says arrays.
  state: Any = _base.current_frame().state
  if state is None or name not in state.get(bundle, {}):
    return None
  return state[bundle][name].current


def stored_names() -> set[str]:
  """`bundle/name` of every param and state stored in the current frame."""
  current = _base.current_frame()
  names = {f"{b}/{n}" for b, entries in current.params.items() for n in entries}
  for b, entries in (current.state or {}).items():
    names.update(f"{b}/{n}" for n in entries)
  return names


def inside_raw_jax_transform() -> bool:
  """True inside a JAX transform that Haiku does not know about.

  Haiku's own wrappers (`hk.vmap`, `hk.scan`, `hk.remat`, ...) record the JAX
  trace they run under; a raw `jax.lax.scan` or `jax.vmap` body does not. Haiku
  performs this comparison itself only when `check_jax_usage` is on; the bridge
  needs it unconditionally, because creating a parameter there would leak a
  tracer into the transform's params.
  """
  frame_ = _base.current_frame()
  return frame_.jax_trace_stack.peek() != _base.JaxTraceLevel.current()


def original_fn(f: Any) -> Optional[Callable[..., Any]]:
  """The function an `hk.transform*` (or its `init`) was built from, or None."""
  init = getattr(f, "init", f)
  return getattr(init, "_original_fn", None)


def is_transformed(f: Any) -> bool:
  return isinstance(f, (hk.Transformed, hk.TransformedWithState))


def frame() -> Frame:
  """The current Haiku frame (one per running init/apply), as a handle."""
  return _base.current_frame()


def frame_id(handle: Frame) -> int:
  """Frames are numbered in creation order, process-wide."""
  return handle.frame_id


def creation_frame_id(module: hk.Module) -> Optional[int]:
  """The id of the frame a module was created in."""
  return getattr(module, "_creation_frame_id", None)


def same_transform(handle: Frame, other: Frame) -> bool:
  """Whether two frames belong to one run of one transform.

  Frames evolved from a frame (by Haiku's wrappers, `hk.remat`, `hk.cond`,
  ..., or by `frame_from`) keep its JAX trace stack's first entry, made once
  when the transform started; a transform run inside (`hk.lift`'s, or any
  `hk.transform(g).apply` called in the code) starts a stack of its own.
  """
  return handle.jax_trace_stack.peek(0) is other.jax_trace_stack.peek(0)


class Lifting(NamedTuple):
  """What an `hk.lift*` module registers in the transform it runs in."""

  prefix: str  # Its bundles are `prefix/<inner bundle>` ("" for none).
  transparent: bool  # Whether `prefix` is the scope it runs in.
  init_fn: Callable[..., Any]  # Returns (inner params, inner state).


def lifting(module: Any) -> Optional[Lifting]:
  """The `Lifting` of an `hk.lift*` module; None for any other module.

  Also None while the module is being constructed (method interceptors see
  its `__init__`).
  """
  if not isinstance(module, _lift.LiftingModule) or not hasattr(module, "prefix_name"):
    return None
  return Lifting(module.prefix_name, module.module_name != module.prefix_name, module._init_fn)  # pylint: disable=protected-access


# -- Interceptors. ------------------------------------------------------------

_PARAM_CREATORS = _base.param_creator_stack
_STATE_CREATORS = _base.state_creator_stack
_PARAM_GETTERS = _base.param_getter_stack
_STATE_GETTERS = _base.state_getter_stack
_STATE_SETTERS = _base.state_setter_stack
_METHOD_INTERCEPTORS = _module.interceptor_stack  # hk.intercept_methods
_ALL = (
  _PARAM_CREATORS,
  _STATE_CREATORS,
  _PARAM_GETTERS,
  _STATE_GETTERS,
  _STATE_SETTERS,
  _METHOD_INTERCEPTORS,
)
_GETTERS = (_PARAM_GETTERS, _STATE_GETTERS)

Interceptors = tuple[tuple[Any, ...], ...]


def interceptors() -> Interceptors:
  """The custom creators, getters, setters and method interceptors in force."""
  return tuple(_entries(stack) for stack in _ALL)


def _entries(stack) -> tuple[Any, ...]:
  """A stack's entries in the order they were pushed, outermost first.

  Haiku's stacks iterate innermost first; pushing them back in that order
  would turn nested interceptors inside out.
  """
  return tuple(stack)[::-1]


@contextlib.contextmanager
def interceptors_as(entries: Interceptors) -> Iterator[None]:
  """Puts `entries` (from `interceptors()`) in force for a while.

  Haiku keeps interceptors in thread-global stacks, not in the frame, so code
  the bridge runs later (a backward pass re-running a block, after the
  `hk.custom_getter` scope of the forward pass has closed) would otherwise
  meet whatever is in force then.
  """
  with _replaced(_ALL, entries):
    yield


@contextlib.contextmanager
def interceptors_suspended(getters_only: bool = False) -> Iterator[None]:
  """Runs code with no interceptors of any kind (or only with no getters)."""
  stacks = _GETTERS if getters_only else _ALL
  with _replaced(stacks, [()] * len(stacks)):
    yield


@contextlib.contextmanager
def _replaced(stacks, entries) -> Iterator[None]:
  saved = [_entries(stack) for stack in stacks]
  _fill(stacks, entries)
  try:
    yield
  finally:
    _fill(stacks, saved)


def _fill(stacks, entries) -> None:
  for stack, items in zip(stacks, entries):
    while stack:
      stack.pop()
    for item in items:
      stack.push(item)


# -- Names. -------------------------------------------------------------------


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
  key = f"{_CLAIM_PREFIX}{current.frame_id}:{full_name}"
  if key in used:
    return False
  used.add(key)
  return True


_CLAIM_PREFIX = "haiku_bridge:"


class NamingEffect(NamedTuple):
  """Module names a run took in the caller's scope: counters and used names."""

  counters: tuple[tuple[str, int], ...]
  used: frozenset[str]


def naming_effect(before: Frame, after: Frame) -> NamingEffect:
  """What running code in `after` (evolved from `before`) did to the names.

  Module names are allocated from the current module call's counters and
  used names (the top of the frame's stacks); nested modules' own calls push
  and pop theirs. So the top entries are all a run changes.
  """
  old, new = before.counter_stack.peek(), after.counter_stack.peek()
  counters = tuple(sorted((name, n) for name, n in new.items() if n > old.get(name, 0)))
  used = frozenset(
    name
    for name in after.used_names_stack.peek() - before.used_names_stack.peek()
    if not name.startswith(_CLAIM_PREFIX)
  )
  return NamingEffect(counters, used)


def module_counters(point: Frame) -> dict[str, int]:
  """How many modules of each name the current module call at `point` made."""
  return dict(point.counter_stack.peek())


def in_module_stack(point: Frame, module: hk.Module) -> bool:
  """Whether code at `point` runs inside a method of `module`."""
  return any(state.module is module for state in point.module_stack)


def take_names(effect: NamingEffect) -> None:
  """Takes the names `effect` lists in the current module call's scope."""
  current = _base.current_frame()
  counters = current.counter_stack.peek()
  for name, n in effect.counters:
    counters[name] = max(counters[name], n)
  current.used_names_stack.peek().update(effect.used)


# -- Frames. ------------------------------------------------------------------


def call_point() -> Frame:
  """A copy of the current frame's module names as they are now.

  Code run later in a frame evolved from it (`frame_from`) names its modules
  exactly as code run here, now, would: the module stack, counters and used
  names are copied, so what the caller does next changes neither.
  """
  return _base.current_frame().evolve(None, None, None, decoupled=True)


@contextlib.contextmanager
def frame_from(
  point: Frame,
  *,
  params: Mapping[str, Mapping[str, Any]],
  state: Mapping[str, Mapping[str, Any]],
  rng: Optional[hk.PRNGSequence],
  init: bool,
) -> Iterator[Frame]:
  """Runs the code inside in a new frame evolved from `point` (`call_point`).

  The frame names modules as code at `point` would (its naming state is
  copied again, so `point` serves any number of runs), holds `params` and
  `state` (current values) in plain dicts of its own, draws keys from `rng`,
  and is in init mode (`hk.running_init()`) if `init`, else in apply mode. As
  Haiku's own wrappers do, the JAX trace level of the code inside is pushed,
  so Haiku's wrappers inside see it as theirs.

  Yields the frame: after the code ran, its `params` and `state` hold what
  the code created and wrote.
  """
  ddict: Callable[[], collections.defaultdict[str, dict[str, Any]]] = lambda: (
    collections.defaultdict(dict)
  )
  params_ = ddict()
  for bundle, entries in params.items():
    params_[bundle].update(entries)
  state_ = ddict()
  for bundle, entries in state.items():
    state_[bundle].update({name: _base.StatePair(value, value) for name, value in entries.items()})
  new = point.evolve(params_, state_, rng, decoupled=True)
  if new.freeze_params == init:
    new = new._replace(freeze_params=not init)
  with contextlib.ExitStack() as stack:
    if not _base.context_stack:
      # Run after the transform returned (a backward pass running the code
      # again): Haiku's state updaters (`hk.lift_with_state`) need a context.
      stack.enter_context(_base.new_context())
    stack.enter_context(_base.frame_stack(new))
    stack.enter_context(_base.push_jax_trace_level())
    yield new


def frame_params(handle: Frame) -> dict[str, dict[str, Any]]:
  """The params a frame holds, in creation order, empty bundles dropped."""
  return {b: dict(e) for b, e in handle.params.items() if e}


def frame_state(handle: Frame) -> dict[str, dict[str, Any]]:
  """The current state values a frame holds, in creation order."""
  return {b: {n: pair.current for n, pair in e.items()} for b, e in handle.state.items() if e}


def write_state(new_state: Mapping[str, Mapping[str, Any]]) -> None:
  """Stores `{bundle: {name: value}}` as the current frame's new state.

  As Haiku's wrappers hand a body's state back: the values were set (and
  state setters ran) inside the run, so they are stored as they are.
  """
  # `{bundle: {name: StatePair}}`; Haiku's annotation says arrays.
  state: Any = _base.current_frame().state
  for bundle, entries in new_state.items():
    for name, value in entries.items():
      old = state[bundle].get(name)
      state[bundle][name] = _base.StatePair(value if old is None else old.initial, value)


# -- Loops. -------------------------------------------------------------------

# Haiku's state and rng, as a pytree a loop carries (an `InternalState`
# without params): only passed around, never read.
LoopState = Any


def loop_state() -> LoopState:
  """The current frame's state and rng, as a loop carries them from step to step.

  A full block of rng keys is reserved first, as `hk.scan` does before its
  loop and after each step, so that the carry a step returns has the
  structure of the one it got however many keys the step drew.
  """
  _stateful.reserve_up_to_full_rng_block()
  return _stateful.internal_state(params=False)


@contextlib.contextmanager
def loop_step(state: LoopState) -> Iterator[Callable[[], list[str]]]:
  """Runs the code inside as one step of a loop, on the carry `state`.

  As `hk.scan`'s body runs: in a frame evolved from the current one (its
  params) holding `state`'s state and rng, with the JAX trace level pushed,
  so Haiku's wrappers inside see it as theirs. `loop_state()` inside gives
  the carry the step hands on. Yields a function that lists the params
  (`bundle/name`) the code created so far, which a step may not (they come
  from the first step, run outside the loop at init; `hk.scan` asserts
  the same).
  """
  with _stateful.temporary_internal_state(state):
    with _base.push_jax_trace_level():
      before = _base.param_names()
      yield lambda: sorted(f"{bundle}/{name}" for bundle, name in _base.param_names() - before)


def set_loop_state(state: LoopState) -> None:
  """Stores the carry a loop ended with as the current frame's state and rng."""
  _stateful.update_internal_state(state)
