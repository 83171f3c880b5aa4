"""A Haiku function as a pure function of its own params, named as if inline.

`call_pure(hk.transform(f), ...)` simply runs `f` inline. Where the caller
needs `f`'s params as an explicit pytree (the primal inputs of a custom
derivative, `call_pure(pure_fn, init=hk.transform(f))`), `InlineFunction`
binds them:

* `f` runs in a nested `hk.transform_with_state`, so its params come out under
  its own names (`{"mlp/~/linear_0": {"w": ...}}`), whatever the call site;
* those names map to the names inline code would use here
  (`naming.allocate_inline_names`: the inner `mlp` becomes `mlp_1` if the
  caller already has an `mlp`), under which the values are stored and read
  through `storage.PARAMS` / `storage.STATE` (interceptors see them once).
  Nothing is claimed: as inline, two calls share what they name alike (the
  params and state the function makes outside any module);
* its rng sequence starts where the caller's is, and the caller goes on from
  where `f` leaves it, so every key is the one inline code would draw.

At init, the nested init creates the values. At apply, `init` is never
traced: the params and state are those `f` reads when run with apply's own
arguments. `_discover` finds them by running `f` abstractly over storage
that forwards each bundle it asks for to the caller's stored values (through
the same name mapping, probed without taking names). The result is cached on
the exact signature of the arguments and checked on every hit against the
stored shapes and dtypes it assumed.
"""

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import haiku as hk
import jax
import numpy as np

from haiku_bridge._src import caches
from haiku_bridge._src import errors
from haiku_bridge._src import haiku_internals
from haiku_bridge._src import naming
from haiku_bridge._src import storage
from haiku_bridge._src import pytree
from haiku_bridge._src.pytree import PyTree

Transformed = hk.Transformed | hk.TransformedWithState


class InnerLeaf(NamedTuple):
  """One param or state leaf as the inner function names it."""
  bundle: str
  name: str
  spec: jax.ShapeDtypeStruct

  @property
  def path(self) -> str:
    return f"{self.bundle}/{self.name}"


class Reads(NamedTuple):
  """What the inner function reads at apply, for one argument signature."""
  params: tuple[InnerLeaf, ...]
  state: tuple[InnerLeaf, ...]
  # Bundles of the state it creates or sets without reading them first.
  written_state_bundles: tuple[str, ...]

  @property
  def bundles(self) -> list[str]:
    return ([leaf.bundle for leaf in self.params + self.state] +
            list(self.written_state_bundles))


@dataclasses.dataclass
class Bound:
  """The inner function's params and state, bound in the caller's transform.

  Attributes:
    params: `{inner bundle: {name: value}}`, as the caller reads them.
    state: the same for state (current values).
    mapping: inner bundle -> outer bundle, for every bundle above and any
      state bundle the function may write.
    state_bundles: the inner bundles of all state it reads or writes.
    out: at init, what the nested init returned, if the caller's
      interceptors changed no value; else None.
  """
  params: dict[str, dict[str, Any]]
  state: dict[str, dict[str, Any]]
  mapping: dict[str, str]
  state_bundles: tuple[str, ...] = ()
  out: Any = None
  has_out: bool = False

  def store_state(self, new_state: dict[str, dict[str, Any]]) -> None:
    """Writes each state leaf whose value the inner run changed."""
    leaves, old, new = [], [], []
    for bundle, entries in new_state.items():
      if bundle not in self.mapping:
        raise ValueError(errors.message(
            f"the inner function wrote state {bundle!r} that it did not "
            "write when its structure was found for these inputs. State "
            "written must not depend on values."))
      for name, value in entries.items():
        leaves.append(storage.Leaf(f"{bundle}/{name}", self.mapping[bundle],
                                   name))
        old.append(self.state.get(bundle, {}).get(name))
        new.append(value)
    storage.STATE.write(leaves, old, new)


_READS = caches.Cache("reads of a Haiku function at apply")


class InlineFunction:
  """An inner Haiku function `f`, run in its own transform but as if inline."""

  def __init__(self, f: Callable[..., Any]):
    self.f = f
    self._transformed = hk.transform_with_state(self._threaded)

  def _threaded(self, rng_state, *args, **kwargs):
    """`f` continuing the caller's rng sequence; hands the sequence back."""
    if rng_state is not None:
      hk.replace_rng_sequence_state(rng_state)
    out = self.f(*args, **kwargs)
    return out, hk.maybe_get_rng_sequence_state()

  # -- The pure function. ---------------------------------------------------

  def apply(self, params, state, rng_state, args, kwargs):
    """`(out, new_state, final_rng_state)`: `f` as a pure function."""
    key = None if rng_state is None else rng_state[0]
    with haiku_internals.interceptors_suspended():
      (out, final_rng), new_state = self._transformed.apply(
          params, state, key, rng_state, *args, **kwargs)
    return out, new_state, final_rng

  # -- Binding in the caller's transform. -----------------------------------

  def bind(self, args, kwargs) -> Bound:
    """Creates (init) or reads (apply) the params and state of `f(*args)`."""
    if hk.running_init():
      return self._bind_at_init(args, kwargs)
    return self._bind_at_apply(args, kwargs)

  def _bind_at_init(self, args, kwargs) -> Bound:
    require_haiku_trace()
    outer = haiku_internals.frame()
    probe = _ProbedNames(outer)
    # Over the caller's storage: params and state that already exist (a
    # module called again) are reused as inline code reuses them, drawing
    # no key; only the missing ones are created.
    params = haiku_internals.LazyBundles(
        _loader(outer, probe, "parameter"), state=False,
        every_bundle=lambda: probe.inner_bundles(outer, "parameter"))
    state = haiku_internals.LazyBundles(
        _loader(outer, probe, "state"), state=True,
        every_bundle=lambda: probe.inner_bundles(outer, "state"))
    rng_state = hk.maybe_get_rng_sequence_state()

    def run():
      with _Checked(outer):
        return self._threaded(rng_state, *args, **kwargs)

    with haiku_internals.interceptors_suspended():
      out, final_rng = haiku_internals.run_with_storage(
          run, params, state, None if rng_state is None else rng_state[0],
          frozen=False)
    if rng_state is not None:
      hk.replace_rng_sequence_state(final_rng)

    inner_params = {bundle: {name: dict.get(entries, name)
                             for name in _used(entries)}
                    for bundle, entries in dict.items(params)
                    if _used(entries)}
    inner_state = {bundle: {name: pair for name, pair in dict.items(entries)
                            if name in entries.read or
                            name not in entries.loaded or
                            pair.current is not pair.initial}
                   for bundle, entries in dict.items(state)}
    inner_state = {b: entries for b, entries in inner_state.items() if entries}
    pairs = [p for entries in inner_state.values() for p in entries.values()]
    inner_state = {b: {n: p.initial for n, p in entries.items()}
                   for b, entries in inner_state.items()}
    mapping = naming.allocate_inline_names(list(inner_params) +
                                           list(inner_state))
    p_leaves, p_inner = _leaves(inner_params, mapping)
    s_leaves, s_inner = _leaves(inner_state, mapping)
    p_made = [v for entries in inner_params.values() for v in entries.values()]
    p_values = storage.PARAMS.create(p_leaves, p_made)
    # Unless every value read is the one the nested init used (no
    # interceptor changed one), its output and state updates are not what
    # inline code computes: the caller runs the function again from the
    # initial state, as it reads it.
    exact = (not haiku_internals.getters_active("state") and
             all(a is b for a, b in zip(p_values, p_made)))
    initial = [p.initial for p in pairs]
    s_values = storage.STATE.create(
        s_leaves, initial, [p.current for p in pairs] if exact else initial)
    return Bound(params=_rebuild(p_inner, p_values),
                 state=_rebuild(s_inner, s_values), mapping=mapping,
                 state_bundles=tuple(inner_state),
                 out=out if exact else None, has_out=exact)

  def _bind_at_apply(self, args, kwargs) -> Bound:
    outer = haiku_internals.frame()
    reads = self._reads(outer, args, kwargs)
    mapping = naming.allocate_inline_names(reads.bundles)
    p_leaves = [_outer_leaf(leaf, mapping) for leaf in reads.params]
    s_leaves = [_outer_leaf(leaf, mapping) for leaf in reads.state]
    p_values = storage.PARAMS.read(p_leaves,
                                   [leaf.spec.shape for leaf in reads.params])
    s_values = storage.STATE.read(s_leaves,
                                  [leaf.spec.shape for leaf in reads.state])
    return Bound(params=_rebuild(reads.params, p_values),
                 state=_rebuild(reads.state, s_values), mapping=mapping,
                 state_bundles=tuple(dict.fromkeys(
                     [leaf.bundle for leaf in reads.state] +
                     list(reads.written_state_bundles))))

  # -- What `f` reads at apply. ---------------------------------------------

  def _reads(self, outer, args, kwargs) -> Reads:
    rng_state = hk.maybe_get_rng_sequence_state()
    key = caches.function_key(self.f, args, kwargs, rng_state,
                              bool(jax.config.jax_enable_x64))
    cached = _READS.get(key)
    if cached is not None and _still_holds(cached, outer):
      return cached
    reads = self._discover(outer, args, kwargs, rng_state)
    _READS.put(key, reads)
    return reads

  def _discover(self, outer, args, kwargs, rng_state) -> Reads:
    """Runs `f` abstractly over the caller's storage; records what it reads."""
    probe = _ProbedNames(outer)
    params = haiku_internals.LazyBundles(
        _loader(outer, probe, "parameter", standins=True), state=False,
        every_bundle=lambda: probe.inner_bundles(outer, "parameter"))
    state = haiku_internals.LazyBundles(
        _loader(outer, probe, "state", standins=True), state=True,
        every_bundle=lambda: probe.inner_bundles(outer, "state"))
    arrays, rebuild = _split_arrays((args, kwargs))
    checks = _Checked(outer, probe)

    def run(rng_state, arrays):
      args, kwargs = rebuild(arrays)

      def fn():
        with checks:
          return self._threaded(rng_state, *args, **kwargs)[0]

      key = None if rng_state is None else rng_state[0]
      with haiku_internals.interceptors_suspended():
        return haiku_internals.run_with_storage(fn, params, state, key,
                                                frozen=True)

    try:
      jax.eval_shape(run, rng_state, arrays)
    except Exception as error:  # pylint: disable=broad-except
      if checks.missing:
        bundle, _, name = checks.missing[0].rpartition("/")
        raise ValueError(errors.message(
            f"parameter '{probe(bundle)}/{name}' (inner path "
            f"{checks.missing[0]}) is missing "
            "at apply. It is created by init: pass apply the parameters that "
            "init returned for the same code path (a model saved before this "
            "call was added needs re-initialising or converting).")) from error
      raise
    return Reads(
        params=tuple(_read_leaves(params)),
        state=tuple(_read_leaves(state, state=True)),
        written_state_bundles=tuple(
            bundle for bundle, entries in dict.items(state)
            if _used(entries)))


def require_haiku_trace() -> None:
  if haiku_internals.inside_raw_jax_transform():
    raise ValueError(errors.message(
        "ran at init inside a raw JAX transform (the body of "
        "jax.lax.scan / jax.vmap / jax.checkpoint / jax.lax.cond, ...), where "
        "Haiku cannot create parameters. Use Haiku's wrapper instead (hk.scan, "
        "hk.vmap, hk.remat, hk.cond), or call hkb.get_relevant_parameters "
        "outside the JAX transform and pass the params into it."))


@functools.lru_cache(maxsize=256)
def _inline_function_for(f: Callable[..., Any]) -> InlineFunction:
  return InlineFunction(f)


def of(fn: Callable[..., Any] | Transformed) -> InlineFunction:
  """The `InlineFunction` of a Haiku function or its `hk.transform*`.

  Keyed by the Haiku function, not the transform object: code that calls
  `hk.transform(f)` afresh at each trace still hits the caches.
  """
  return _inline_function_for(haiku_function(fn))


def haiku_function(fn: Any) -> Callable[..., Any]:
  """The Haiku function behind `fn` (itself, if it is not transformed)."""
  if isinstance(fn, (hk.MultiTransformed, hk.MultiTransformedWithState)):
    raise TypeError(errors.message(
        "got an hk.multi_transform result, which holds several functions. "
        "Bridge one of them: pass hk.transform(that_function) (or the plain "
        "Haiku function)."))
  if haiku_internals.is_transformed(fn):
    original = haiku_internals.original_fn(fn)
    if original is None:
      raise TypeError(errors.message(
          f"cannot find the Haiku function behind {fn!r}; pass the result "
          "of hk.transform / hk.transform_with_state."))
    return original
  if not callable(fn):
    raise TypeError(errors.message(
        f"expected a Haiku function or its hk.transform; got "
        f"{errors.describe(fn)} ({fn!r:.60})."))
  return fn


# Holds Haiku transforms, no result; emptied with the rest all the same.
caches.register(_inline_function_for.cache_clear)


def _loader(outer, probe, kind: str, standins: bool = False):
  """Loads an inner bundle from the caller's storage, under its inline name.

  With `standins`, inside an abstract trace: zeros of each stored shape and
  dtype, so that no op on the stored values is traced.
  """

  def load(bundle):
    stored = haiku_internals.stored_bundle(outer, kind, probe(bundle))
    if standins:
      return {name: jax.numpy.zeros(np.shape(value), value.dtype)
              for name, value in stored.items()}
    return stored

  return load


class _ProbedNames:
  """Inner bundle -> the outer bundle inline code would use, taking no name."""

  def __init__(self, outer):
    self._outer = outer
    self._tops: dict[str, str] = {}
    with haiku_internals.in_naming_probe(outer):
      self._scope = hk.experimental.current_name()

  def inner_bundles(self, outer, kind: str) -> list[str]:
    """The caller's stored bundles that are the inner function's, by inner name.

    The inverse of the mapping: an outer `b_j` is the inner `b_k` whose
    forward mapping gives it (inner numbers count on from the caller's).
    """
    scope = self._scope
    found = []
    for bundle in haiku_internals.stored_bundle_names(outer, kind):
      if scope != naming.TOP_LEVEL:
        if bundle == scope:
          found.append(naming.TOP_LEVEL)
          continue
        if not bundle.startswith(scope + "/"):
          continue
        bundle = bundle[len(scope) + 1:]
      top, _, rest = bundle.partition("/")
      base, j = naming.split_number(top)
      first = naming.split_number(self(base).rpartition("/")[2])[1]
      k = j - first
      if k < 0:
        continue
      inner_top = base if k == 0 else f"{base}_{k}"
      if self(inner_top).rpartition("/")[2] == top:
        found.append(f"{inner_top}/{rest}" if rest else inner_top)
    return found

  def __call__(self, bundle: str) -> str:
    top, _, rest = bundle.partition("/")
    if top not in self._tops:
      with haiku_internals.in_naming_probe(self._outer):
        self._tops[top] = naming.allocate_inline_names([top])[top]
    outer_top = self._tops[top]
    return f"{outer_top}/{rest}" if rest else outer_top


class _Checked:  # pylint: disable=invalid-name
  """Checks each read of the inner function, with errors naming both paths.

  * A module the caller created, used inside: inline it keeps its own
    weights, while a nested transform would read them under the inner's
    names, silently giving it a second set. Raised.
  * At apply, a stored param whose shape is not the one asked for: Haiku's
    own error would name only the inner path.
  """

  def __init__(self, outer, probe=None):
    self._outer_id = haiku_internals.frame_id(outer)
    self._probe = probe
    self._scopes = []
    self.missing: list[str] = []  # At apply: params the function asked for.

  def _getter(self, next_getter, value, context):
    module = context.module
    if module is not None and (haiku_internals.creation_frame_id(module)
                               == self._outer_id):
      raise ValueError(errors.message(
          f"the bridged Haiku function uses module {module.module_name!r}, "
          "which was created outside it, in the caller's transform. Its "
          "parameters cannot be made explicit under the inner function's "
          "names. Create the module inside the function, or call it outside "
          "and pass its output in."))
    want = context.original_shape
    if (self._probe is not None and want is not None and
        tuple(np.shape(value)) != tuple(want)):
      bundle, _, name = context.full_name.rpartition("/")
      raise ValueError(errors.message(
          f"parameter '{self._probe(bundle)}/{name}' (inner path "
          f"{context.full_name}) has shape {list(np.shape(value))} in what "
          f"apply was given, but the inner function asks for {list(want)} "
          "here."))
    return next_getter(value)

  def _creator(self, next_creator, shape, dtype, init, context):
    # At apply a param is only ever created when it is missing.
    self.missing.append(context.full_name)
    return next_creator(shape, dtype, init)

  def __enter__(self):
    self._scopes = [hk.custom_getter(self._getter, params=True, state=True)]
    if self._probe is not None:
      self._scopes.append(hk.custom_creator(self._creator, params=True,
                                            state=False))
    for scope in self._scopes:
      scope.__enter__()
    return self

  def __exit__(self, *exc):
    for scope in reversed(self._scopes):
      scope.__exit__(*exc)


def _split_arrays(tree: PyTree):
  """The array leaves of `tree`, and how to put them back among the others."""
  leaves, treedef = jax.tree.flatten(tree)
  is_array = [hasattr(x, "dtype") and hasattr(x, "shape") for x in leaves]
  arrays = [x for x, a in zip(leaves, is_array) if a]

  def rebuild(new_arrays):
    it = iter(new_arrays)
    return treedef.unflatten([next(it) if a else x
                              for x, a in zip(leaves, is_array)])

  return arrays, rebuild


def _used(entries) -> list[str]:
  """The names of a bundle the run read or created (at init), in order."""
  made = [name for name in dict.keys(entries) if name not in entries.loaded]
  return list(dict.fromkeys(
      [n for n in entries.read if dict.__contains__(entries, n)] + made))


def _read_leaves(bundles, state: bool = False) -> list[InnerLeaf]:
  """The leaves read from storage (not created by the run), in read order."""
  leaves = []
  for bundle, entries in dict.items(bundles):
    for name in entries.read:
      if name in entries.loaded:
        value = dict.get(entries, name)
        value = value.initial if state else value
        leaves.append(InnerLeaf(bundle, name, pytree.spec(value)))
  return leaves


def _still_holds(reads: Reads, outer) -> bool:
  """Whether the caller's stored specs are still those `reads` assumed."""
  probe = _ProbedNames(outer)
  for kind, leaves in (("parameter", reads.params), ("state", reads.state)):
    for leaf in leaves:
      stored = haiku_internals.stored_bundle(outer, kind,
                                             probe(leaf.bundle)).get(leaf.name)
      if stored is None or pytree.spec(stored) != leaf.spec:
        return False
  return True


def _outer_leaf(leaf: InnerLeaf, mapping: dict[str, str]) -> storage.Leaf:
  return storage.Leaf(leaf.path, mapping[leaf.bundle], leaf.name)


def _leaves(inner: dict[str, dict[str, Any]], mapping: dict[str, str]):
  """Outer `Leaf`s and `InnerLeaf`s of a `{bundle: {name: value}}` dict."""
  outer_leaves, inner_leaves = [], []
  for bundle, entries in inner.items():
    for name, value in entries.items():
      inner_leaves.append(InnerLeaf(bundle, name, pytree.spec(value)))
      outer_leaves.append(storage.Leaf(f"{bundle}/{name}", mapping[bundle],
                                       name))
  return outer_leaves, inner_leaves


def _rebuild(leaves: Sequence[InnerLeaf],
             values: Sequence[Any]) -> dict[str, dict[str, Any]]:
  out: dict[str, dict[str, Any]] = {}
  for leaf, value in zip(leaves, values):
    out.setdefault(leaf.bundle, {})[leaf.name] = value
  return out
