"""The tests' XLA flags (`testing/xla_flags.py`) reach only an XLA that knows them, and change the
compile's cost, not what tests measure.

XLA aborts a process that names a flag it does not know, so `xla_flags.flags()` gives only the
candidates the installed XLA accepts: checked here against fresh processes (each flag it gives is
accepted, each it drops is refused, a made-up one among the candidates never comes through), cold
and from its cache. `.bazelrc`'s fixed line must be what the pinned jaxlib (requirements.txt) gets.

Every test process compiles with `xla_flags.flags()`. Here the programs whose
compiled memory the suite holds to bounds (a remat'd Haiku RNN, a nested
layer scan, a pipelined stack on jax's default mesh, the compiles of
`remat="auto"`'s plan) are compiled with those flags in this process and
with XLA's defaults in a fresh one: the memory analysis and the plan must be
the same, and the values equal up to float rounding.
"""

import jax

from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import contextlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from unittest import mock

from absl.testing import absltest
import haiku as hk
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

import haiku_bridge as hkb
from testing import test_utils
from testing import xla_flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _block(h):
  return h + hk.Linear(h.shape[-1])(jnp.tanh(hk.Linear(h.shape[-1])(h)))


def _rnn(x):
  core = hk.LSTM(16)
  out, _ = hk.dynamic_unroll(hk.remat(core), x, core.initial_state(x.shape[1]))
  return out


def _nested_stack(x):
  return hkb.repeat_layer(_block, x, 8, remat="nested")


def _pipelined_stack(x):
  return hkb.repeat_layer(_block, x, 8, pipeline=hkb.Pipeline("stage", 4))


def _step(fn, x, mesh=None):
  """Memory and values of the compiled `value_and_grad` of a loss after `fn`."""
  f = hk.transform(lambda x: jnp.mean(fn(x) ** 2))
  params = f.init(jax.random.PRNGKey(0), x)
  step = jax.jit(jax.value_and_grad(f.apply))
  with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
    if mesh is not None:
      x = jax.device_put(x, P("data"))
    compiled = step.lower(params, None, x).compile()
  memory = compiled.memory_analysis()
  loss, grads = compiled(params, None, x)
  return {
    "temp": memory.temp_size_in_bytes,
    "output": memory.output_size_in_bytes,
    "argument": memory.argument_size_in_bytes,
    "values": [float(loss)] + [float(jnp.sum(g)) for g in jax.tree.leaves(grads)],
  }


def _plan_step(h, x):
  h = jnp.tanh(h @ jnp.full([16, 16], 0.1) + x)
  return h, jnp.sum(h**2)


def figures() -> dict[str, object]:
  """What the suite's memory tests read, for each program."""
  mesh = jax.make_mesh((4, 2), ("stage", "data"))  # Explicit axes.
  plan = hkb.remat_plan(
    _plan_step, jnp.zeros([4, 16]), jnp.ones([256, 4, 16]), memory_budget=60_000
  )
  return {
    "rnn": _step(_rnn, jnp.ones([24, 4, 8])),
    "nested_stack": _step(_nested_stack, jnp.ones([8, 32])),
    "pipelined_stack": _step(_pipelined_stack, jnp.ones([16, 32]), mesh),
    "remat_plan": plan.table(),
  }


def _print_figures() -> None:
  """In a fresh process with XLA's default flags: `figures()` as JSON."""
  print(json.dumps(figures()))


_NO_SUCH_FLAG = "--xla_haiku_bridge_no_such_flag=true"


def read(path: str) -> str:
  with open(os.path.join(_ROOT, path)) as f:
    return f.read()


def starts(flags: str) -> subprocess.CompletedProcess:
  """A fresh process that starts jax's backend with `XLA_FLAGS=flags`."""
  return subprocess.run(
    [sys.executable, "-c", "import jax; jax.devices()"],
    env=dict(os.environ, XLA_FLAGS=flags),
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )


class KnownFlagsTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    self.cache = os.path.join(self.create_tempdir().full_path, "flags.json")

  def test_only_flags_xla_accepts_come_through(self):
    candidates = xla_flags.CANDIDATES + (_NO_SUCH_FLAG,)
    known = xla_flags.known_flags(candidates, self.cache)  # Cold: an empty cache file.
    self.assertNotIn(_NO_SUCH_FLAG, known)
    self.assertEqual(list(known), [c for c in candidates if c in known])  # In their order.
    accepted = starts(" ".join(known))
    self.assertEqual(accepted.returncode, 0, accepted.stderr[-3000:])
    for dropped in sorted(set(candidates) - set(known)):
      with self.subTest(dropped):
        refused = starts(dropped)
        self.assertNotEqual(refused.returncode, 0)
        self.assertRegex(refused.stderr, "Unknown flags? in XLA_FLAGS: " + re.escape(dropped))
    # Warm: the cached answer, with no process started.
    with mock.patch.object(subprocess, "run", side_effect=AssertionError("probed again")):
      self.assertEqual(xla_flags.known_flags(candidates, self.cache), known)

  def test_cache_is_keyed_on_candidates_packages_and_platforms(self):
    key = xla_flags.cache_key(xla_flags.CANDIDATES)
    self.assertIn(f"jaxlib=={importlib.metadata.version('jaxlib')}", key)
    self.assertNotEqual(key, xla_flags.cache_key(xla_flags.CANDIDATES[:1]))
    with mock.patch.dict(os.environ, {"JAX_PLATFORMS": "haiku_bridge_elsewhere"}):
      self.assertNotEqual(key, xla_flags.cache_key(xla_flags.CANDIDATES))
    # An entry under another key is not read as this one's answer.
    with open(self.cache, "w") as f:
      json.dump({xla_flags.cache_key(xla_flags.CANDIDATES[:1]): []}, f)
    with mock.patch.object(xla_flags, "probe", return_value=("--probed",)) as probe:
      self.assertEqual(xla_flags.known_flags(xla_flags.CANDIDATES, self.cache), ("--probed",))
    probe.assert_called_once_with(xla_flags.CANDIDATES)
    with open(self.cache) as f:
      self.assertLen(json.load(f), 2)  # The other entry is kept.

  def test_both_wordings_of_xla_unknown_flags_are_read(self):
    # XLA names one unknown flag "Unknown flag in XLA_FLAGS: --a" and several
    # "Unknown flags in XLA_FLAGS: --a --b" (a jaxlib that knows neither
    # candidate, e.g. 0.11 on a newer XLA); the pinned jaxlib knows both, so
    # the probe above meets neither wording: here XLA's answers are played back.
    for stderr, unknown in (
      ("Unknown flag in XLA_FLAGS: --b\n", ["--b"]),
      ("Unknown flags in XLA_FLAGS: --a --b\n", ["--a", "--b"]),
    ):
      answers = [
        subprocess.CompletedProcess([], 1, "", "F1207 " + stderr),
        subprocess.CompletedProcess([], 0, "", ""),
      ]
      with self.subTest(stderr), mock.patch.object(subprocess, "run", side_effect=answers):
        self.assertEqual(
          xla_flags.probe(("--a", "--b", "--c")),
          tuple(f for f in ("--a", "--b", "--c") if f not in unknown),
        )

  def test_a_process_failing_otherwise_is_an_error(self):
    with mock.patch.dict(os.environ, {"JAX_PLATFORMS": "haiku_bridge_no_such_platform"}):
      with self.assertRaisesRegex(RuntimeError, "another reason than an unknown flag"):
        xla_flags.probe(xla_flags.CANDIDATES)


class XlaFlagsTest(absltest.TestCase):
  def test_bazelrc_gives_tests_the_pinned_jaxlibs_flags(self):
    line = re.search(r'^test --test_env=XLA_FLAGS="(.*)"$', read(".bazelrc"), re.MULTILINE)[1]
    self.assertEqual(line.split(), [c for c in xla_flags.CANDIDATES if c in line.split()])
    pinned = re.search(r"^jaxlib==(\S+)$", read("requirements.txt"), re.MULTILINE)[1]
    if importlib.metadata.version("jaxlib") != pinned:
      self.skipTest(f"jaxlib {importlib.metadata.version('jaxlib')} is not the pinned {pinned}")
    self.assertEqual(line, xla_flags.flags())

  def test_this_process_compiles_with_them(self):
    if "TEST_TARGET" not in os.environ and os.environ.get("XLA_FLAGS") != xla_flags.flags():
      # Under pytest, conftest.py keeps XLA_FLAGS the environment names.
      self.skipTest("the environment names its own XLA_FLAGS")
    self.assertEqual(os.environ.get("XLA_FLAGS"), xla_flags.flags())

  def test_memory_and_plans_as_with_xla_defaults(self):
    ours = figures()
    child = test_utils.run_in_fresh_process(__file__, "_print_figures", env={"XLA_FLAGS": ""})
    self.assertEqual(child.returncode, 0, child.stderr[-3000:])
    defaults = json.loads(child.stdout.strip().splitlines()[-1])
    self.assertEqual(ours["remat_plan"], defaults["remat_plan"])
    for name in ("rnn", "nested_stack", "pipelined_stack"):
      with self.subTest(name):
        got, expected = ours[name], defaults[name]
        self.assertEqual(
          {k: got[k] for k in ("temp", "output", "argument")},
          {k: expected[k] for k in ("temp", "output", "argument")},
        )
        np.testing.assert_allclose(got["values"], expected["values"], rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
  absltest.main()
