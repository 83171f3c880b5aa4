"""The adapters' skeleton cache against a config their constructors read (issue 27, row 3).

A constructor that reads a global (`lambda rngs: nnx.Linear(4, CONFIG["width"], rngs=rngs)`),
applied at one width and then at another, must be laid out at the width in force, whatever the
cache holds: the same output as the foreign library's own run of the same layer on the same
params. `SkeletonCacheCases` checks it cold (caches cleared before each apply), warm (with and
without an identity custom getter), with caches off, and in a fresh process where init never
ran (with caches and with `HAIKU_BRIDGE_CACHES=0`). Each adapter's test file gives the nets,
the native run, and a module-level `child_configured_apply(path)` that calls `child_apply`.
"""

import contextlib
import os
from typing import Any, Callable, Iterator

from absl.testing import parameterized
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import haiku_bridge as hkb
from haiku_bridge._src import caches
from testing import test_utils

CONFIG = {"width": 4}  # Read by the test files' constructors; the cases change it.
WIDTHS = (4, 6, 4)  # Applied in turn: the last finds the first's skeleton cached.

Net = Callable[..., hk.Transformed]  # `net(kind, getter=False)`.


@contextlib.contextmanager
def configured(width: int) -> Iterator[None]:
  saved, CONFIG["width"] = CONFIG["width"], width
  try:
    yield
  finally:
    CONFIG["width"] = saved


def identity_getter(getter: bool):
  """An identity `hk.custom_getter` (or nothing): what a cache must not notice."""
  if not getter:
    return contextlib.nullcontext()
  return hk.custom_getter(lambda next_getter, value, context: next_getter(value))


def child_apply(path: str, net: Net, kinds: tuple[str, ...], x: Any) -> None:
  """In a fresh process: applies each kind's params saved at `path`; prints each output."""
  with np.load(path) as data:
    params = {}
    for key in data.files:
      kind, width, bundle, name = key.split("|")
      params.setdefault((kind, int(width)), {}).setdefault(bundle, {})[name] = jnp.asarray(
        data[key]
      )
  for kind in kinds:
    f = net(kind)
    for width in WIDTHS:
      with configured(width):
        out = f.apply(params[(kind, width)], None, x)
      print(" ".join(map(str, np.asarray(out).ravel())))


class SkeletonCacheCases(parameterized.TestCase):
  """The cases; a subclass sets the class attributes below."""

  KINDS: tuple[str, ...] = ()  # What each case passes to the adapter.
  X: Any = None  # The input.
  FILE = ""  # The test file, whose `child_configured_apply(path)` runs in a fresh process.
  net: Net  # A staticmethod: `net(kind, getter=False)`.
  native: Callable[[str, hk.Params, Any], Any]  # A staticmethod: the library's own run.

  def _params(self, kind: str) -> dict[int, hk.Params]:
    params = {}
    for width in sorted(set(WIDTHS)):
      with configured(width):
        params[width] = self.net(kind).init(jax.random.PRNGKey(width), self.X)
    return params

  @parameterized.parameters("cold", "warm", "warm_getter", "off")
  def test_a_global_the_constructor_reads(self, temperature):
    for kind in self.KINDS:
      f = self.net(kind, getter=temperature == "warm_getter")
      params = self._params(kind)
      with caches.disabled() if temperature == "off" else contextlib.nullcontext():
        for width in WIDTHS:
          if temperature == "cold":
            hkb.clear_caches()
          with configured(width):
            np.testing.assert_allclose(
              f.apply(params[width], None, self.X),
              self.native(kind, params[width], self.X),
              rtol=1e-5,
              err_msg=f"{kind} at width {width}",
            )

  def test_a_global_the_constructor_reads_in_a_fresh_process(self):
    arrays, expected = {}, []
    with test_utils.on_the_fresh_process_backend():  # Where the child computes.
      for kind in self.KINDS:
        params = self._params(kind)
        for width in WIDTHS:
          with configured(width):
            expected.append(self.native(kind, params[width], self.X))
          for bundle, entries in params[width].items():
            for name, value in entries.items():
              arrays[f"{kind}|{width}|{bundle}|{name}"] = value
    path = os.path.join(self.create_tempdir().full_path, "params.npz")
    np.savez(path, **arrays)
    for env in ({}, {"HAIKU_BRIDGE_CACHES": "0"}):
      child = test_utils.run_in_fresh_process(self.FILE, "child_configured_apply", path, env=env)
      self.assertEqual(child.returncode, 0, child.stderr[-3000:])
      got = [np.array(line.split(), np.float32) for line in child.stdout.strip().splitlines()]
      self.assertLen(got, len(expected))
      for g, e in zip(got, expected):
        np.testing.assert_allclose(
          g,
          np.asarray(e).ravel(),
          err_msg=str(env),
          rtol=1e-5,
        )
