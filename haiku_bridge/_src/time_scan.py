"""Scans over time with shared weights: `hk.scan` and `hk.dynamic_unroll` with remat schedules.

An RNN unrolled over T steps keeps, for the backward pass, every step's
activations (`hk.dynamic_unroll`), or every step's carry (with `hk.remat` on
the step). `scan` and `dynamic_unroll` are Haiku's, run through the bridge's
loop (`remat/loop.py`), so `remat="nested"` keeps about 2√T carries and
`"binomial"` the fewest for at most one more forward pass: the same outputs,
state and gradients. `dynamic_unroll(readout=)` runs a per-step head and
loss inside the checkpointed step, so that the `[T, ...]` outputs are never
kept.

What Haiku does, they do: at init the first step runs outside the loop
(where it creates the params and state), the loop runs the others on them;
the params are shared by every step (constants of the loop, whose gradient
is one buffer summed over the steps); Haiku state and the rng sequence are
carried from step to step as `hk.scan` carries them (`haiku_internals`), so
dropout draws the same keys. Outside a transform, `dynamic_unroll` runs
`jax.lax.scan` as Haiku's does, and so does `scan` (where `hk.scan` raises):
both with the schedule.
"""

import dataclasses
import functools
import inspect
from typing import Any, Callable, Optional, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src import errors
from haiku_bridge._src import guards
from haiku_bridge._src import haiku_internals
from haiku_bridge._src import modes
from haiku_bridge._src import pytree
from haiku_bridge._src import remat as remat_lib
from haiku_bridge._src.pytree import PyTree

StepFn = Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def _known_keywords(api: str) -> Callable[[_Fn], _Fn]:
  """Refuses a keyword the public call `api` does not take, in our words."""

  def wrap(fn: _Fn) -> _Fn:
    names = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
      with errors.entry(api):
        errors.check_keywords(kwargs, names)
      return fn(*args, **kwargs)

    return cast(_Fn, checked)

  return wrap


@remat_lib.plannable
@_known_keywords("scan")
def scan(
  f: StepFn,
  init: PyTree,
  xs: PyTree,
  length: Optional[int] = None,
  reverse: bool = False,
  unroll: int | bool = 1,
  *,
  remat: modes.RematMode = False,
  remat_groups: Optional[int] = None,
  remat_policy: Optional[Callable[..., bool]] = None,
  memory_budget: Optional[int] = None,
  max_recompute: Optional[float] = None,
) -> tuple[PyTree, PyTree]:
  """`hk.scan`, with what its backward pass keeps chosen by `remat`.

  `f(carry, x) -> (carry, y)` runs once per step with the same params, as
  in `hk.scan`; `remat="nested"` or `"binomial"` keep a few carries for the
  backward pass instead of every step's activations. Example: an LSTM over
  64 steps, the gradients of `hk.scan`'s:

  >>> def unroll(scan):
  ...   def f(xs):
  ...     lstm = hk.LSTM(8)
  ...     step = lambda state, x: lstm(x, state)[::-1]
  ...     state, ys = scan(step, lstm.initial_state(2), xs)
  ...     return jnp.sum(ys ** 2)
  ...   return hk.transform(f)
  >>> ours = unroll(lambda *a: hkb.scan(*a, remat="binomial"))
  >>> xs = jnp.ones([64, 2, 4])
  >>> params = ours.init(jax.random.PRNGKey(0), xs)
  >>> grad = lambda f: jax.grad(f.apply)(params, None, xs)
  >>> jax.tree.all(jax.tree.map(lambda a, b: jnp.allclose(a, b, atol=1e-6),
  ...                           grad(ours), grad(unroll(hk.scan))))
  True

  Args:
    f: `f(carry, x) -> (carry, y)`, a Haiku function. At init its first step
      runs outside the loop and creates its params and state; the other
      steps read them (a step that creates a param there is an error, as in
      `hk.scan`).
    init: the first carry.
    xs: per-step inputs, each leaf with a leading axis of `length` steps
      (None with `length=`).
    length: the number of steps; taken from `xs` when not given.
    reverse: run the steps last to first, as `jax.lax.scan` does.
    unroll: passed to `jax.lax.scan`: a bool or a non-negative int.
    remat: what the backward pass keeps: `False` (every step's
      activations), `True` (one carry per step: `hk.remat` of the step),
      `"nested"` (≈2√T carries: the steps in ≈√T groups, each recomputed
      from its first carry) or `"binomial"` (the fewest carries that
      recompute at most one more forward pass: Griewank's binomial
      bound), or `"auto"` (with `memory_budget=`: of those, and binomial
      with any number of slots, the one recomputing the least FLOPs whose
      predicted temporaries fit; see `hkb.remat_plan`). The carry here includes
      Haiku state and the rng. The schedules give `remat=True`'s values
      and derivatives.
    remat_groups: with `"nested"`, the number of groups (default ≈√T); with
      `"binomial"`, recompute no more steps than `"nested"` with that many
      (by default, at most one more forward pass, with the fewest carries).
    remat_policy: with `remat=True`, a `jax.checkpoint_policies` policy:
      which of a step's activations the forward pass keeps; with
      `remat="auto"`, `remat=True` under it is one more candidate.
    memory_budget: with `remat="auto"`, the bytes the loop's part of a training step may take,
      as `hkb.remat_plan` counts them; None: the budget of the whole step, inside
      `hkb.budgeted_jit`.
    max_recompute: with `remat="auto"`, the most forward passes of the loop
      a plan may run again in the backward pass (`remat=True` runs 1;
      default 3; `math.inf` allows any). Where every plan that fits the
      budget recomputes more, `remat="auto"` raises an error naming the
      least budget within it.

  Returns:
    `(carry, ys)`: the last carry and the per-step `y`s stacked, as
    `hk.scan` returns them.
  """
  with errors.entry("scan"):
    errors.check_callable("f", f, "a function `f(carry, x) -> (carry, y)`")
    loop = _check_options(remat, remat_groups, remat_policy, unroll, memory_budget, max_recompute)
    reverse = errors.check_bool("reverse", reverse)
    length = remat_lib.num_steps(length, xs, _TIME)
    return _scan(remat_lib.CheckedBody(f, _STEP), init, xs, length, reverse, loop)


@remat_lib.plannable
@_known_keywords("dynamic_unroll")
def dynamic_unroll(
  core: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
  input_sequence: PyTree,
  initial_state: PyTree,
  time_major: bool = True,
  reverse: bool = False,
  return_all_states: bool = False,
  unroll: int | bool = 1,
  *,
  remat: modes.RematMode = False,
  remat_groups: Optional[int] = None,
  remat_policy: Optional[Callable[..., bool]] = None,
  readout: Optional[Callable[..., PyTree]] = None,
  readout_inputs: Optional[PyTree] = None,
  memory_budget: Optional[int] = None,
  max_recompute: Optional[float] = None,
) -> tuple[PyTree, PyTree]:
  """`hk.dynamic_unroll`, with what its backward pass keeps chosen by `remat`.

  Calls `core(input, state) -> (output, state)` on each step of
  `input_sequence`, carrying the state, as `hk.dynamic_unroll` does (through
  `hkb.scan`). Example: an LSTM over 256 steps keeping ≈2√256 states for
  the backward pass, the gradients of `hk.dynamic_unroll`'s:

  >>> def net(unroll):
  ...   def f(xs):
  ...     lstm = hk.LSTM(8)
  ...     ys, _ = unroll(lstm, xs, lstm.initial_state(2))
  ...     return jnp.sum(ys ** 2)
  ...   return hk.transform(f)
  >>> nested = net(lambda *a: hkb.dynamic_unroll(*a, remat="nested"))
  >>> xs = jnp.ones([256, 2, 4])
  >>> params = nested.init(jax.random.PRNGKey(0), xs)
  >>> grad = lambda f: jax.grad(f.apply)(params, None, xs)
  >>> jax.tree.all(jax.tree.map(lambda a, b: jnp.allclose(a, b, atol=1e-6),
  ...                           grad(nested), grad(net(hk.dynamic_unroll))))
  True

  Args:
    core: an RNN core (`hk.LSTM`, `hk.GRU`, `hk.DeepRNN`, `hk.ResetCore`,
      ...) or any Haiku function `core(input, state) -> (output, state)`.
    input_sequence: the inputs, each leaf `[T, ...]` (time major) or
      `[B, T, ...]`.
    initial_state: the core's state before the first step.
    time_major: whether the time axis is axis 0 of the inputs and outputs
      (else axis 1).
    reverse: run the steps last to first.
    return_all_states: return the state after every step, stacked on the
      time axis, instead of the last.
    unroll: passed to `jax.lax.scan`: a bool or a non-negative int.
    remat: `False`, `True`, `"nested"`, `"binomial"` or `"auto"`, as for
      `hkb.scan`.
    remat_groups: as for `hkb.scan`.
    remat_policy: as for `hkb.scan`.
    memory_budget: as for `hkb.scan`.
    max_recompute: as for `hkb.scan`.
    readout: a Haiku function run on each step's output inside the step,
      `readout(output)` or, with `readout_inputs`, `readout(output, r)` (`r`:
      that step's slice of `readout_inputs`), such as a head and its loss.
      Its results are returned instead of the outputs, so that the backward
      pass keeps the schedule's carries, never the `[T, ...]` outputs or
      their cotangent. Create its modules outside (e.g. `head =
      hk.Linear(V)` before the unroll): they get the names and params they
      get when called on the stacked outputs after the unroll. At init the
      readout runs after the unroll, as such a head does, so its params
      are the usual form's, initial values included (also where the core
      draws rng at init, as dropout does). Its values differ from the
      usual form's only where the readout draws rng itself (dropout in the
      head): it draws a key per step, where a head after the unroll draws
      one for all steps.
    readout_inputs: per-step inputs of `readout` (e.g. the targets), laid out
      as `input_sequence` (time axis 0, or 1 with `time_major=False`).

  Returns:
    `(output_sequence, state)`: the outputs on the time axis (or, with
    `readout`, its results), and the last state, or every state with
    `return_all_states`. With `time_major=False` each is `[B, T, ...]`,
    except a leaf of one value per step (a readout's scalar loss), `[T]`.
  """
  with errors.entry("dynamic_unroll"):
    errors.check_callable(
      "core", core, "an RNN core, `core(input, state) -> (output, state)`, such as an hk.LSTM"
    )
    time_major = errors.check_bool("time_major", time_major)
    reverse = errors.check_bool("reverse", reverse)
    return_all_states = errors.check_bool("return_all_states", return_all_states)
    loop = _check_options(remat, remat_groups, remat_policy, unroll, memory_budget, max_recompute)
    if readout is not None:
      errors.check_callable(
        "readout",
        readout,
        "a function of each step's output (and its "
        "slice of `readout_inputs`), such as a head and its loss",
      )
    elif readout_inputs is not None:
      raise ValueError(
        errors.message(
          "`readout_inputs` are the per-step inputs of `readout`: pass "
          "`readout=` too, e.g. `readout=lambda y, target: loss(head(y), "
          "target)`."
        )
      )
    with_readout_inputs = readout_inputs is not None
    if not time_major:
      _check_batch_major(input_sequence)
      input_sequence = pytree.swap_batch_time(input_sequence)
      # `remat="auto"` counts the copies made here and below.
      loop = dataclasses.replace(loop, batch_major=True)
      if with_readout_inputs:
        _check_batch_major(readout_inputs, "readout_inputs")
        readout_inputs = pytree.swap_batch_time(readout_inputs)
    length = remat_lib.num_steps(None, input_sequence, _TIME_INPUTS, "input_sequence")
    if with_readout_inputs:
      remat_lib.num_steps(length, readout_inputs, _TIME_INPUTS, "readout_inputs")
      input_sequence = (input_sequence, readout_inputs)

    # At init the usual form's head runs after the unroll, and its params
    # draw their keys after every step's (a core's dropout draws one per
    # step): so the readout runs after the unroll there, in a loop of its own.
    read_after = readout is not None and guards.initialising()

    def read(outputs, readout_in):
      assert readout is not None, "read runs only with a readout"
      return readout(outputs, readout_in) if with_readout_inputs else readout(outputs)

    def step(state, inputs):
      readout_in = None
      if with_readout_inputs:
        inputs, readout_in = inputs
      outputs, new_state = remat_lib.check_step_output(
        core(inputs, state), state, _CORE, carry_index=1
      )
      if readout is not None and not read_after:
        outputs = read(outputs, readout_in)
      return new_state, ((outputs, new_state) if return_all_states else outputs)

    last_state, out = _scan(step, initial_state, input_sequence, length, reverse, loop)
    outputs, states = out if return_all_states else (out, last_state)
    if read_after:
      outputs = _scan(
        lambda _, step: (None, read(*step)),
        None,
        (outputs, input_sequence[1] if with_readout_inputs else None),
        length,
        False,
        loop,
      )[1]
    if not time_major:
      outputs = pytree.swap_batch_time(outputs)
      if return_all_states:
        states = pytree.swap_batch_time(states)
    return outputs, states


# How the time scans' messages name their bodies (remat.check_step_output).
_STEP = remat_lib.StepWords(
  body="`f`",
  pair="(carry, y)",
  carry="carry",
  step="step",
  subject="it",
  pair_hint=" Return `(new_carry, None)` for a step without per-step outputs.",
  carry_hint=" Return per-step outputs as `y` in `(carry, y)`.",
)
_CORE = remat_lib.StepWords(
  body="`core`", pair="(output, state)", carry="state", step="step", subject="it"
)


def _check_options(
  remat: Any,
  remat_groups: Any,
  remat_policy: Any,
  unroll: Any,
  memory_budget: Any,
  max_recompute: Any,
) -> remat_lib.Loop:
  return remat_lib.from_options(
    remat=remat,
    remat_groups=remat_groups,
    remat_policy=remat_policy,
    unroll=unroll,
    memory_budget=memory_budget,
    max_recompute=max_recompute,
  )


def _scan(
  f: StepFn, init: PyTree, xs: PyTree, length: int, reverse: bool, loop: remat_lib.Loop
) -> tuple[PyTree, PyTree]:
  """`scan` of checked arguments: in a transform, with Haiku state and rng."""
  if not guards.inside_transform():
    return loop(f, init, xs, length, reverse)
  first = None
  if guards.initialising():
    # The first step creates the params and state, which the loop cannot
    # (its carry keeps one structure): it runs outside, as in hk.scan. (The
    # loop runs unplanned: `remat_lib.resolved` plans nothing at init.)
    if length == 0:
      x = jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), xs)
      y = f(init, x)[1]
      return init, jax.tree.map(lambda a: jnp.zeros((0,) + a.shape, a.dtype), y)
    at = -1 if reverse else 0
    init, first = f(init, jax.tree.map(lambda a: a[at], xs))
    first = jax.tree.map(lambda a: jnp.expand_dims(a, 0), first)
    xs = jax.tree.map(lambda a: a[:-1] if reverse else a[1:], xs)
    length -= 1
    if not length:
      return init, first

  def step(carry, x):
    carry, state = carry
    with haiku_internals.loop_step(state) as created:
      carry, y = f(carry, x)
      new = created()
      if new:
        # The loop's carry holds no params: they cannot change in a step.
        raise AssertionError(
          errors.message(
            f"a step created params {new}, which the first step did not. "
            "At init the first step runs alone and creates the params that "
            "every step shares, as in hk.scan: create modules outside the "
            "step (e.g. `lstm = hk.LSTM(8)` before the scan) so that each "
            "step calls the same ones."
          )
        )
      return (carry, haiku_internals.loop_state()), y

  (carry, state), ys = loop(step, (init, haiku_internals.loop_state()), xs, length, reverse)
  haiku_internals.set_loop_state(state)
  if first is not None:
    parts = (lambda y, y0: (y, y0)) if reverse else (lambda y, y0: (y0, y))
    ys = jax.tree.map(lambda y, y0: jnp.concatenate(parts(y, y0)), ys, first)
  return carry, ys


# How the time scans count their steps (remat.num_steps).
_TIME = remat_lib.StepAxis(
  argument="length",
  least=0,
  leaf="an array with a leading time axis, one entry per step",
  none="{name} holds no arrays, so the number of steps is unknown: pass "
  "`length=`, the number of steps.",
)
_TIME_INPUTS = _TIME._replace(
  none="{name} holds no arrays, so the number of steps is unknown: pass inputs with a time axis."
)


def _check_batch_major(input_sequence: PyTree, name: str = "input_sequence") -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(input_sequence):
    if np.ndim(leaf) < 2:
      raise ValueError(
        errors.message(
          f"{name}{jax.tree_util.keystr(path)} is "
          f"{errors.got(leaf)}; with time_major=False every leaf needs a "
          "batch axis and a time axis, [B, T, ...]."
        )
      )
