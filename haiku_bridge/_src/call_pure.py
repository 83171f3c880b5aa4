"""`call_pure`: run an explicit-params JAX function inside a Haiku transform.

Inside `hk.transform`, parameters are implicit: modules fetch them with
`hk.get_parameter`. `call_pure(fn, *args, init=init_fn)` makes them explicit
for one call: at init it runs `init_fn(rng, *args)` and stores every leaf of
the returned pytree as a Haiku parameter, named by its key path
(`key_path.py`); at apply it reads those leaves back and calls
`fn(params, *args)`. Because `fn` is a plain function of its weights, any JAX
transform can wrap it: `jax.custom_vjp`, `jax.checkpoint`, `jax.lax.scan`,
`jax.vmap`.

A Haiku function given as `fn` (its `hk.transform*`) runs inline, exactly as
the same code written at the call site; given as `init`, its params are bound
as inline code would name them (`inline.py`).
"""

import contextlib
from typing import Any, Callable, Iterator, Optional

import haiku as hk

from haiku_bridge._src import errors
from haiku_bridge._src import guards
from haiku_bridge._src import haiku_internals
from haiku_bridge._src import inline
from haiku_bridge._src import key_path
from haiku_bridge._src.pytree import PyTree
from haiku_bridge._src.pytree import InitFn

Transformed = hk.Transformed | hk.TransformedWithState


def call_pure(
  fn: Callable[..., Any] | Transformed,
  *args: Any,
  init: InitFn | Transformed | None = None,
  name: Optional[str] = None,
  **kwargs: Any,
) -> Any:
  """Calls `fn(params, *args, **kwargs)` with params owned by the transform.

  Example: a linear layer written in plain JAX, used in a Haiku network.

  >>> def linear(params, x):
  ...   return x @ params["w"] + params["b"]
  >>> def init_linear(rng, x):
  ...   return {"w": jax.random.normal(rng, (x.shape[-1], 3)), "b": jnp.zeros(3)}
  >>> f = hk.transform(lambda x: hkb.call_pure(linear, x, init=init_linear,
  ...                                          name="proj"))
  >>> params = f.init(jax.random.PRNGKey(0), jnp.ones([2, 4]))
  >>> jax.tree.map(jnp.shape, params)
  {'proj': {'b': (3,), 'w': (4, 3)}}

  Args:
    fn: a pure function `fn(params, *args, **kwargs)`, or an `hk.Transformed`
      / `hk.TransformedWithState`. A transformed `fn` runs exactly as its
      Haiku function called inline here: the same parameter and state names,
      initial values, outputs, state and errors, in init and apply alike.
    *args: positional arguments for `fn` and `init`.
    init: `init(rng, *args, **kwargs) -> params`, any pytree of arrays (dicts,
      lists, tuples, NamedTuples, registered dataclasses; `None` for an empty
      subtree). Called once at init with a key from Haiku's rng sequence;
      never run at apply. May be an `hk.Transformed`: then `fn` gets its
      params dict under the inner function's own names, stored under the
      names inline code would use. Not given when `fn` is transformed.
    name: an extra name scope for the parameters (as `hk.name_scope(name)`).
    **kwargs: keyword arguments for `fn` and `init`.

  Returns:
    What `fn` returns.

  Raises:
    ValueError: outside a transform; at init inside a raw JAX transform (use
      Haiku's wrapper, e.g. `hk.scan`); at apply for a parameter that is
      missing or whose shape differs from what this call needs; for two
      leaves or two calls that map to the same parameter name.
    TypeError: for an `fn` or `init` that is not a function, or an `init`
      that returns a leaf that is not an array.
  """
  with errors.entry("call_pure"):
    guards.require_transform()
    _check_name(name)
    if haiku_internals.is_transformed(fn) or isinstance(
      fn, (hk.MultiTransformed, hk.MultiTransformedWithState)
    ):
      if init is not None and init is not fn:
        raise TypeError(
          errors.message(
            "`fn` is an hk.Transformed, which brings its own init; do not pass `init=` as well."
          )
        )
      f = inline.haiku_function(fn)
      if guards.initialising():
        guards.require_haiku_trace()
      with _name_scope(name):
        return f(*args, **kwargs)
    if not callable(fn):
      raise TypeError(
        errors.message(
          f"`fn` must be a function `fn(params, *args)` or an hk.Transformed; "
          f"got {errors.describe(fn)} ({fn!r:.60})."
        )
      )
    if init is None:
      raise TypeError(
        errors.message(
          "needs `init=`: a function `init(rng, *args, **kwargs)` that "
          f"returns the params pytree of {getattr(fn, '__name__', fn)!r}."
        )
      )
    with _name_scope(name):
      params = _params_for(init, args, kwargs)
  return fn(params, *args, **kwargs)


def get_relevant_parameters(
  init: InitFn | Transformed,
  *args: Any,
  name: Optional[str] = None,
  **kwargs: Any,
) -> PyTree:
  """Returns the explicit params that `call_pure` would pass, without a call.

  Created at init and read at apply under the same naming rules as
  `call_pure(fn, *args, init=init, name=name)`; `call_pure` is this plus the
  call. Use it to share one set of weights between several pure calls:

  >>> def dense(params, x):
  ...   return jnp.tanh(x @ params["w"] + params["b"])
  >>> def init_dense(rng, x):
  ...   return {"w": jax.random.normal(rng, (x.shape[-1], 4)), "b": jnp.zeros(4)}
  >>> def f(x1, x2):
  ...   params = hkb.get_relevant_parameters(init_dense, x1, name="shared")
  ...   return dense(params, x1) + dense(params, x2)
  >>> f = hk.transform(f)
  >>> params = f.init(jax.random.PRNGKey(0), jnp.ones([2, 4]), jnp.ones([2, 4]))
  >>> list(params)
  ['shared']

  Args:
    init: `init(rng, *args, **kwargs) -> params`, or an `hk.Transformed`.
    *args: positional arguments for `init`.
    name: an extra name scope for the parameters.
    **kwargs: keyword arguments for `init`.

  Returns:
    The params pytree, with the structure `init` returns.
  """
  with errors.entry("get_relevant_parameters"):
    guards.require_transform()
    _check_name(name)
    with _name_scope(name):
      return _params_for(init, args, kwargs)


def _params_for(init, args, kwargs) -> PyTree:
  # `f.init` of an hk.transform* is bridged as the transform itself (its
  # output is Haiku's params dict, or (params, state)).
  haiku_fn = haiku_internals.original_fn(init)
  if haiku_fn is not None or isinstance(init, (hk.MultiTransformed, hk.MultiTransformedWithState)):
    return inline.of(haiku_fn or init).explicit_params(args, kwargs)
  return key_path.bind(init, args, kwargs)


def _check_name(name: Optional[str]) -> None:
  errors.check_str("name", name, "None or a module name (a string)", optional=True)


@contextlib.contextmanager
def _name_scope(name: Optional[str]) -> Iterator[None]:
  if name is None:
    yield
  else:
    with hk.name_scope(name):
      yield
