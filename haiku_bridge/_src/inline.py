"""A Haiku function's params made explicit, named and run exactly as inline.

`call_pure(hk.transform(f), ...)` simply runs `f` inline. The other bridged
forms (`hkb.custom_vjp`, `hkb.custom_jvp`, `call_pure(pure_fn,
init=hk.transform(f))`, `get_relevant_parameters(hk.transform(f))`) need `f`'s
params as an explicit pytree under `f`'s own names (those
`hk.transform(f).init` gives), bound to what the caller stores under the
names inline code uses. Everything here runs `f` with Haiku's own machinery,
over plain dicts:

* **The bindings** (`HaikuFunction.bindings`): which params and state `f`
  has at this call, under both names. `f` runs twice in one `jax.eval_shape`: as
  `hk.transform_with_state(f).init` (its own names), and as inline init code
  at this point of the caller (a frame evolved from the caller's, over empty
  storage: the names inline code gets). Both runs create the same leaves in
  the same order, so the two name lists pair up one to one, whatever Haiku's
  allocator decided (renumbering, explicit numbers, lifted bundles). The
  second run also shows which module names inline code takes in the
  caller's scope.
* **Init** runs `f` inline, in the caller's frame itself: names, values, rng
  draws, interceptors, state and output are inline's because the code is.
* **Apply** (`Call.run`) runs `f` as a pure function of explicit params,
  state and rng: in a frame evolved from the caller's as it was at the call,
  over those values, with the interceptors in force at the call. This is how
  Haiku's own `hk.remat` and `hk.cond` run a body inside a JAX transform, so
  every Haiku mechanism inside `f` works there as it does inline.
"""

import contextlib
import dataclasses
import threading
from typing import Any, Callable, NamedTuple, Optional, Sequence

import haiku as hk
import jax

from haiku_bridge._src import errors
from haiku_bridge._src import guards
from haiku_bridge._src import haiku_internals
from haiku_bridge._src import naming
from haiku_bridge._src import pytree
from haiku_bridge._src import storage

Transformed = hk.Transformed | hk.TransformedWithState
Nested = dict[str, dict[str, Any]]  # `{bundle: {name: value}}`, as Haiku's.


_probes = threading.local()  # `depth`: how many probes are running `f` now.


def probing() -> bool:
  """Whether a bridge is running `f` abstractly now, only to find what it reads.

  Code inside `f` may then skip work that reads nothing more: the layer scan
  runs its plain loop instead of a pipeline, which needs a mesh.
  """
  return getattr(_probes, "depth", 0) > 0


@contextlib.contextmanager
def _probing() -> Any:
  _probes.depth = getattr(_probes, "depth", 0) + 1
  try:
    yield
  finally:
    _probes.depth -= 1


class BoundLeaf(NamedTuple):
  """One param or state leaf of `f`: its bundle inside `f` and here."""

  inner: str  # Its bundle in `hk.transform(f)`.
  outer: str  # Its bundle in the caller, as inline code names it.
  name: str
  spec: Optional[jax.ShapeDtypeStruct]  # As stored; None: not stored yet.

  @property
  def leaf(self) -> storage.Leaf:
    """Where it is stored; its inner path is its params path for messages."""
    return storage.Leaf(f"{self.inner}/{self.name}", self.outer, self.name)


class Bindings(NamedTuple):
  """`f`'s params and state at one call, bound to the caller's, and its module names.

  What inline apply code at the call reads and writes, each leaf under
  `f`'s own name and the caller's (`BoundLeaf`), and the module names it
  takes in the caller's scope.
  """

  params: tuple[BoundLeaf, ...]
  state: tuple[BoundLeaf, ...]
  naming: haiku_internals.NamingEffect

  def stored_params(self) -> list[Any]:
    """At apply: the caller's stored params (the probe found them there)."""
    return [haiku_internals.stored_param(leaf.outer, leaf.name) for leaf in self.params]

  def read_params(self) -> list[Any]:
    """The caller's params, read through any custom getter."""
    # A bound param always has its spec; only state may lack one.
    return storage.PARAMS.read(
      [leaf.leaf for leaf in self.params],
      [leaf.spec.shape for leaf in self.params],  # type: ignore[union-attr]
    )

  def stored_state(self) -> Nested:
    """At apply: the caller's current state values, by outer bundle.

    Missing ones are left out: as inline, `f` creates them if it can.
    """
    found: Nested = {}
    for leaf in self.state:
      value = haiku_internals.stored_state(leaf.outer, leaf.name)
      if value is not None:
        found.setdefault(leaf.outer, {})[leaf.name] = value
    return found

  def inner_params(self, values: Sequence[Any]) -> Nested:
    """`{inner bundle: {name: value}}` of `values`, in the order of `params`."""
    out: Nested = {}
    for leaf, value in zip(self.params, values):
      out.setdefault(leaf.inner, {})[leaf.name] = value
    return out

  def outer_params(self, inner: Nested) -> Nested:
    """The same values under the caller's bundle names."""
    out: Nested = {}
    for leaf in self.params:
      try:
        value = inner[leaf.inner][leaf.name]
      except (KeyError, TypeError):
        raise ValueError(
          errors.message(
            f"the params given to the bridged function lack "
            f"'{leaf.inner}/{leaf.name}'. Pass them with the structure of the "
            "params the block hands you (the function's own names)."
          )
        ) from None
      out.setdefault(leaf.outer, {})[leaf.name] = value
    return out


@dataclasses.dataclass(frozen=True)
class Call:
  """`f` at one call at apply, as a pure function of its params.

  Attributes:
    bindings: `f`'s params and state at this call.
    params: `{inner bundle: {name: value}}`, as stored (before getters:
      getters run inside `f`, where it reads them, as inline).
    state: `{outer bundle: {name: current value}}`.
  """

  f: Callable[..., Any]
  bindings: Bindings
  params: Nested
  state: Nested
  point: haiku_internals.Frame
  interceptors: haiku_internals.Interceptors

  def run(
    self, params: Nested, state: Nested, rng_state: Any, args: Sequence[Any], kwargs: dict[str, Any]
  ):
    """`(out, new_state, final_rng_state)` of `f(*args, **kwargs)`.

    Runs in a frame evolved from the caller's as it was at the call, so the
    same code at any later time (a backward pass that runs `f` again) names,
    reads and intercepts as inline code did there.
    """
    rng = None if rng_state is None else hk.PRNGSequence(rng_state)
    with (
      haiku_internals.interceptors_as(self.interceptors),
      haiku_internals.frame_from(
        self.point, params=self.bindings.outer_params(params), state=state, rng=rng, init=False
      ) as frame,
    ):
      out = self.f(*args, **kwargs)
      final_rng = hk.maybe_get_rng_sequence_state()
    new_state: Nested = {}
    for bundle, entries in haiku_internals.frame_state(frame).items():
      before = state.get(bundle, {})
      changed = {name: value for name, value in entries.items() if value is not before.get(name)}
      if changed:
        new_state[bundle] = changed
    return out, new_state, final_rng


class HaikuFunction:
  """A Haiku function `f`, bridged: bound, run inline, or run pure."""

  def __init__(self, f: Callable[..., Any]):
    self.f = f

  def run_at_init(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`f(*args, **kwargs)` at init: inline, in the caller's frame."""
    guards.require_haiku_trace()
    point = haiku_internals.call_point()
    out = self.f(*args, **kwargs)
    # What apply will run: refuses now what apply could not.
    self.bindings(point, args, kwargs)
    return out

  def call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
    """At apply: `f`'s stored params and state, bound for pure runs."""
    point = haiku_internals.call_point()
    bindings = self.bindings(point, args, kwargs)
    haiku_internals.take_names(bindings.naming)
    return Call(
      self.f,
      bindings,
      bindings.inner_params(bindings.stored_params()),
      bindings.stored_state(),
      point,
      haiku_internals.interceptors(),
    )

  def explicit_params(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Nested:
    """`f`'s params under its own names, read through any custom getter.

    For `init=hk.transform(f)` and `get_relevant_parameters`: at init `f`
    runs inline to create them (creators and rng as inline; getters see them
    once, when read here); at apply it only runs abstractly, to find them.
    """
    point = haiku_internals.call_point()
    if guards.initialising():
      guards.require_haiku_trace()
      with haiku_internals.interceptors_suspended(getters_only=True):
        self.f(*args, **kwargs)
    bindings = self.bindings(point, args, kwargs)
    if bindings.state:
      raise ValueError(
        errors.message(
          "`init` is a Haiku function with state "
          f"({sorted({leaf.inner for leaf in bindings.state})}); a pure "
          "function cannot update it. Pass the hk.TransformedWithState as "
          "`fn` itself (or use hkb.custom_vjp), where its state is read and "
          "written as inline."
        )
      )
    if not guards.initialising():
      haiku_internals.take_names(bindings.naming)
    return bindings.inner_params(bindings.read_params())

  def bindings(
    self, point: haiku_internals.Frame, args: Sequence[Any], kwargs: dict[str, Any]
  ) -> Bindings:
    """What `f` reads and writes at apply when called at `point`.

    `f` runs abstractly (`jax.eval_shape`) as inline apply code at `point`:
    in a frame evolved from it over (copies of) all the caller's stored
    params and state, with an abstract key. `_Recorder` notes what it reads.
    Its JAX array arguments are abstract; only if `f` needs their values
    (as eager inline code may) does it run over them as they are.
    """
    caller = haiku_internals.frame()
    rng_state = hk.maybe_get_rng_sequence_state()

    key_spec = pytree.key_spec(rng_state)

    def probe(arrays, rebuild, key=None):
      recorder = _Recorder(
        haiku_internals.frame_params(caller), haiku_internals.frame_state(caller), point
      )

      def run_as_inline(key, arrays):
        args, kwargs = rebuild(arrays)
        with (
          _probing(),
          haiku_internals.interceptors_suspended(),
          haiku_internals.frame_from(
            point,
            params=recorder.params,
            state=recorder.state,
            rng=hk.PRNGSequence(key),
            init=False,
          ) as here,
          recorder.recording(here),
        ):
          self.f(*args, **kwargs)
        recorder.finish(here)

      if key is None:
        jax.eval_shape(run_as_inline, key_spec, arrays)
      else:
        # Over the values themselves: what is concrete is computed.
        with jax.ensure_compile_time_eval():
          run_as_inline(key, arrays)
      return recorder.bindings()

    try:
      return probe(*pytree.split_arrays((tuple(args), kwargs), numpy=False))
    except pytree.CONCRETIZATION_ERRORS:
      pass
    try:
      return probe((), lambda _: (tuple(args), kwargs), key=pytree.concrete_key(key_spec))
    except pytree.CONCRETIZATION_ERRORS as error:
      raise TypeError(
        errors.message(
          f"{_describe(self.f)} needs concrete values where the bridge runs "
          "it abstractly (under jax.eval_shape) to find the parameters it "
          f"reads: {type(error).__name__}: {str(error).splitlines()[0]} "
          "Which parameters it reads must follow from the shapes and dtypes "
          "of its array arguments and from Python values: pass a Python "
          "value that decides it (a flag, a size) as a Python value (in "
          "nondiff_argnums for a custom derivative), not as an array."
        )
      ) from error


def of(fn: Callable[..., Any] | Transformed) -> HaikuFunction:
  """The bridged Haiku function behind `fn` (a Haiku function or transform)."""
  return HaikuFunction(haiku_function(fn))


def haiku_function(fn: Any) -> Callable[..., Any]:
  """The Haiku function behind `fn` (itself, if it is not transformed)."""
  if isinstance(fn, (hk.MultiTransformed, hk.MultiTransformedWithState)):
    raise TypeError(
      errors.message(
        "got an hk.multi_transform result, which holds several functions. "
        "Bridge one of them: pass hk.transform(that_function) (or the plain "
        "Haiku function)."
      )
    )
  if haiku_internals.is_transformed(fn):
    original = haiku_internals.original_fn(fn)
    if original is None:
      raise TypeError(
        errors.message(
          f"cannot find the Haiku function behind {fn!r}; pass the result "
          "of hk.transform / hk.transform_with_state."
        )
      )
    return original
  if not callable(fn):
    raise TypeError(
      errors.message(
        f"expected a Haiku function or its hk.transform; got {errors.describe(fn)} ({fn!r:.60})."
      )
    )
  return fn


class _Recorder:
  """What `f` reads and writes when run as inline apply code, in `bindings`.

  Params and state are `f`'s if it reads them (`hk.get_parameter` /
  `hk.get_state` in a frame of the caller's transform: its own code, and
  Haiku's wrappers inside it), if an `hk.lift*` it runs registers them
  (those its own transform reads, by their names there, follow from the
  lift), or (state) if it writes them.
  """

  def __init__(self, params: Nested, state: Nested, point: haiku_internals.Frame):
    self.params, self.state = params, state
    self._point = point
    self._here = None
    self._params_read: dict[tuple[str, str], None] = {}
    self._state_read: dict[tuple[str, str], None] = {}
    self._state_written: dict[tuple[str, str], None] = {}
    self._naming: Optional[haiku_internals.NamingEffect] = None
    self._scope = ""

  @contextlib.contextmanager
  def recording(self, here):
    self._here = here
    self._scope = hk.experimental.current_name()
    with (
      hk.custom_getter(self._param_getter),
      hk.custom_getter(self._state_getter, params=False, state=True),
      hk.custom_creator(self._creator),
      hk.intercept_methods(self._method),
    ):
      yield

  def finish(self, here) -> None:
    """After the run: the names it took, the state it wrote."""
    self._naming = haiku_internals.naming_effect(self._point, here)
    for bundle, entries in haiku_internals.frame_state(here).items():
      before = self.state.get(bundle, {})
      for name, value in entries.items():
        if value is not before.get(name):
          self._state_written[(bundle, name)] = None

  # -- Hooks. -----------------------------------------------------------------

  def _ours(self) -> bool:
    return haiku_internals.same_transform(haiku_internals.frame(), self._here)

  def _refuse_outer_module(self, context) -> None:
    module = context.module
    if (
      module is not None
      and (haiku_internals.creation_frame_id(module) or 0) < haiku_internals.frame_id(self._here)
      and not haiku_internals.in_module_stack(self._point, module)
    ):
      raise ValueError(
        errors.message(
          f"the bridged Haiku function uses module {module.module_name!r}, "
          "which was created outside it, in the caller's transform. Its "
          "parameters cannot be made explicit under the inner function's "
          "names. Create the module inside the function, or call it outside "
          "and pass its output in. (hk.layer_stack and hk.transparent_lift "
          "refuse this too.)"
        )
      )

  def _param_getter(self, next_getter, value, context):
    self._refuse_outer_module(context)
    if self._ours():
      bundle, _, name = context.full_name.rpartition("/")
      want = context.original_shape
      if want is not None and tuple(value.shape) != tuple(want):
        raise ValueError(
          errors.message(
            f"parameter '{context.full_name}' (inner path "
            f"{self._inner_path(bundle, name)}) has shape "
            f"{list(value.shape)} in what apply was given, but the inner "
            f"function asks for {list(want)} here."
          )
        )
      self._params_read[(bundle, name)] = None
    return next_getter(value)

  def _state_getter(self, next_getter, value, context):
    self._refuse_outer_module(context)
    if self._ours():
      bundle, _, name = context.full_name.rpartition("/")
      self._state_read[(bundle, name)] = None
    return next_getter(value)

  def _creator(self, next_creator, shape, dtype, init, context):
    """At apply, Haiku runs creators for a param it is about to miss."""
    self._refuse_outer_module(context)
    if not self._ours():
      return next_creator(shape, dtype, init)
    bundle, _, name = context.full_name.rpartition("/")
    raise ValueError(
      errors.message(
        f"parameter '{context.full_name}' (inner path "
        f"{self._inner_path(bundle, name)}) is missing at apply. It is "
        "created by init: pass apply the parameters that init returned for "
        "the same code path (a model saved before this call was added needs "
        "re-initialising or converting)."
      )
    )

  def _method(self, next_fun, args, kwargs, context):
    lifting = haiku_internals.lifting(context.module)
    if lifting is not None and context.method_name == "__call__" and self._ours():
      for bundle in self._lifted_bundles(lifting, args, kwargs):
        for name in self.params.get(bundle, {}):
          self._params_read[(bundle, name)] = None
        for name in self.state.get(bundle, {}):
          self._state_read[(bundle, name)] = None
    return next_fun(*args, **kwargs)

  def _lifted_bundles(self, lifting, args, kwargs) -> list[str]:
    """The caller's bundles an `hk.lift*` registers here."""
    prefix = f"{lifting.prefix}/" if lifting.prefix else ""
    under = [b for b in list(self.params) + list(self.state) if b.startswith(prefix)]
    if not lifting.transparent:
      return under  # Its own module's name: all under it is its.
    # Its scope is the caller's: only what its init function makes.
    try:
      made = jax.eval_shape(lambda: lifting.init_fn(*args, **kwargs))
    except Exception:  # pylint: disable=broad-except
      return under
    names = {f"{prefix}{b}" for tree in made for b in tree}
    return [b for b in under if b in names]

  # -- The bindings. ----------------------------------------------------------

  def _inner_bundle(self, bundle: str) -> str:
    """`bundle` as `f` names it in a transform of its own."""
    return naming.own_bundle(bundle, self._scope, haiku_internals.module_counters(self._point))

  def _inner_path(self, bundle: str, name: str) -> str:
    return f"{self._inner_bundle(bundle)}/{name}"

  def bindings(self) -> Bindings:
    assert self._naming is not None, "bindings() comes after finish()"
    params = []
    owner: dict[str, str] = {}
    for bundle, name in self._params_read:
      inner = self._inner_bundle(bundle)
      if owner.setdefault(inner, bundle) != bundle:
        raise ValueError(
          errors.message(
            f"parameters {owner[inner]!r} and {bundle!r} both map to "
            f"{inner!r} under the bridged function's own names. Give its "
            "modules names of their own (a module named explicitly with a "
            "number, `name=\"linear_3\"`, cannot be told from Haiku's "
            "numbering)."
          )
        )
      value = self.params[bundle][name]
      params.append(BoundLeaf(inner, bundle, name, jax.ShapeDtypeStruct(value.shape, value.dtype)))
    state = []
    for bundle, name in {**self._state_read, **self._state_written}:
      value = self.state.get(bundle, {}).get(name)
      spec = None if value is None else jax.ShapeDtypeStruct(value.shape, value.dtype)
      state.append(BoundLeaf(bundle, bundle, name, spec))
    return Bindings(tuple(params), tuple(state), self._naming)


def _describe(f: Any) -> str:
  name = getattr(f, "__qualname__", None) or getattr(f, "__name__", None)
  return (
    f"the bridged Haiku function {name!r}" if name else (f"the bridged Haiku function {f!r:.60}")
  )
