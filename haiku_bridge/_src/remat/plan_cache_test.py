"""Tests for `plan_cache.py`: the keys of a plan's measurements, and what is read back of them."""

import jax
from testing import devices

devices.use_cpu_devices(8)  # Before anything starts jax's backend.

# pylint: disable=g-import-not-at-top,wrong-import-position
import json
import os
import shutil
from unittest import mock

from absl.testing import absltest
import jax.numpy as jnp
import jaxlib
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import haiku_bridge as hkb
from haiku_bridge._src import caches
from haiku_bridge._src.remat import measure
from haiku_bridge._src.remat import plan_cache
from haiku_bridge._src.remat import tracing
from testing import test_utils
from testing.plan_fixtures import CPU_SIZED
from testing.plan_fixtures import measuring_compiles
from testing.plan_fixtures import on_cpu_and_gpu
from testing.plan_fixtures import plan_in_a_directory_of_its_own
from testing.plan_fixtures import tpu_like_figures
from testing.plan_fixtures import toy_step

plan_in_a_directory_of_its_own(__file__)


class KeyTest(absltest.TestCase):
  """A file is read back only where everything its figures depend on is the same."""

  def test_the_disk_key_changes_with_everything_the_figures_depend_on(self):
    # A file measured by another jax, jaxlib, haiku_bridge, backend, device
    # or measuring code (or XLA flags) is never read: each is in the key.
    init, xs = jnp.zeros([4, 16]), jnp.ones([32, 4, 16])
    step, consts = tracing.trace(toy_step, init, xs, 32)
    key = lambda: plan_cache._disk_key(step, consts, 32, None)
    here = key()
    self.assertEqual(key(), here)
    for name, patch in test_utils.environment_patches() + [
      ("jaxlib", mock.patch.object(jaxlib, "__version__", "0.0.1")),
      ("haiku_bridge", mock.patch.object(plan_cache, "_version", lambda: "0.0.1")),
      ("measuring code", mock.patch.object(plan_cache, "_code_digest", lambda: "0" * 64)),
    ]:
      with self.subTest(name), patch:
        self.assertNotEqual(key(), here)

  def test_the_disk_key_covers_what_the_figures_depend_on(self):
    # The figures read back in another process are those measured for the
    # same step, shapes, policy, length, flags and dtypes: a change in any
    # of them is another file.
    def trace(f=toy_step, batch=4, length=256, **loop):
      return tracing.trace(f, jnp.zeros([batch, 16]), jnp.ones([length, batch, 16]), length, **loop)

    def key(traced, length=256, policy=None):
      return plan_cache._disk_key(*traced, length, policy)

    def closing_over(shape):
      w = jnp.ones(shape)
      return lambda h, x: (jnp.tanh(h @ w[:16, :16] + x), jnp.sum(h))

    traced = trace()
    same = key(traced)
    self.assertEqual(key(trace()), same)
    changed = {
      "length": key(trace(length=128), 128),
      "carry's shape": key(trace(batch=2)),
      "step": key(trace(lambda h, x: (jnp.sin(h) + x, jnp.sum(h)))),
      "policy": key(traced, policy=jax.checkpoint_policies.dots_saveable),
      "unroll": key(trace(unroll=2)),
      "batch-major copies": key(trace(batch_major=True)),
    }
    traced_under = []

    def loss(h):  # A gradient of the carry only: the xs are data.
      traced_under.append(tracing.trace(toy_step, h, jnp.ones([256, 4, 16]), 256))
      return 0.0

    jax.eval_shape(jax.grad(loss), jnp.zeros([4, 16]))
    changed["what is differentiated"] = key(traced_under[0])
    # The same, differentiated again (a gradient of that gradient).
    jax.eval_shape(
      jax.grad(lambda h: jnp.sum(jax.grad(lambda h: loss(h) + jnp.sum(h))(h))), jnp.zeros([4, 16])
    )
    changed["the derivatives"] = key(traced_under[1])
    with mock.patch.dict(
      os.environ, {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_dump_to=x"}
    ):
      changed["XLA_FLAGS"] = key(traced)
    with jax.enable_x64(True):
      changed["x64"] = key(traced)
    with jax.set_mesh(jax.make_mesh((jax.device_count(),), ("data",))):
      changed["mesh"] = key(traced)
    explicit = jax.make_mesh(
      (jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    with jax.set_mesh(explicit):
      # The same shapes, the batch sharded over the mesh's Explicit axis.
      replicated = key(trace(batch=8))
      changed["sharding"] = key(
        tracing.trace(
          toy_step,
          jax.device_put(jnp.zeros([8, 16]), NamedSharding(explicit, P("data"))),
          jax.device_put(jnp.ones([256, 8, 16]), NamedSharding(explicit, P(None, "data"))),
          256,
        )
      )
    self.assertNotEqual(changed["sharding"], replicated)
    with mock.patch.object(
      measure, "measuring_options", lambda: {"xla_backend_optimization_level": 1}
    ):
      changed["compile options"] = key(traced)
    for what, other in changed.items():
      self.assertNotIn(other, (same, None), what)
    self.assertLen(set(changed.values()), len(changed))
    # What a step closes over, by its shape.
    self.assertNotEqual(key(trace(closing_over([16, 16]))), key(trace(closing_over([17, 16]))))
    # A policy with no stable name (a function of the user's) is kept in
    # memory only.
    self.assertIsNone(key(traced, policy=lambda *_, **__: True))

  def test_the_digest_covers_each_module_that_makes_the_figures(self):
    # The modules whose code makes the figures (the measuring programs, the
    # trace they are built from, the schedules, the FLOP count, the keys and
    # the files' format): a change to any of them is another digest, so a
    # file measured by other code is never read. The choice (choice.py)
    # makes no figure.
    self.assertEqual(
      {m.__name__.rsplit(".", 1)[1] for m in plan_cache._MEASURING_CODE},
      {"schedule", "scheduled_scan", "hlo_flops", "hlo_text", "tracing", "measure", "plan_cache"},
    )
    test_utils.assert_digest_follows_code(self, plan_cache._code_digest, plan_cache._MEASURING_CODE)


class KeptTest(absltest.TestCase):
  """What is kept, in memory and on disk, and what is read back of it."""

  def test_a_plan_file_of_strings_is_a_miss(self):
    # A file of the right shape whose numbers are strings (hand-edited, or
    # written by another tool) is measured again, not a TypeError mid-step.
    def strings(value):
      if isinstance(value, dict):
        return {k: v if k == "format" else strings(v) for k, v in value.items()}
      if isinstance(value, list):
        return [strings(v) for v in value]
      return (
        str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
      )

    directory = self.create_tempdir().full_path
    folder = os.path.join(directory, "remat_plans")
    kept = os.path.join(self.create_tempdir().full_path, "kept")
    init, xs = jnp.zeros([4, 16]), jnp.ones([128, 4, 16])
    budget = []  # Read from the plan: a backend's bytes are its own.

    def again():
      """The plan made anew in this process, its files on disk as they are."""
      shutil.copytree(folder, kept, dirs_exist_ok=True)
      hkb.clear_caches()  # Memory and disk; the files are put back.
      shutil.copytree(kept, folder)
      shutil.rmtree(kept)
      with measuring_compiles() as compiles:
        made = hkb.remat_plan(toy_step, init, xs, memory_budget=budget[0])
      return made, compiles

    # The figures as XLA:TPU's (a TPU-like reading on other backends: every
    # schedule is then over remat=True's bytes, as on a TPU v5e), so that no
    # budget here is set in one backend's bytes and the test holds whichever
    # plan a backend's figures choose.
    with (
      mock.patch.dict(os.environ, {"HAIKU_BRIDGE_CACHE_DIR": directory}),
      mock.patch.object(caches, "_enabled", True),
      tpu_like_figures(16),
    ):
      hkb.clear_caches()
      loose = hkb.remat_plan(toy_step, init, xs, memory_budget=1 << 40)
      # remat=True's bytes: a budget every backend's plan takes (remat=True
      # fits it, within max_recompute).
      budget.append(next(k for k in loose.candidates if k.remat is True).temporaries)
      first = hkb.remat_plan(toy_step, init, xs, memory_budget=budget[0])
      files = {}
      for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
          files[name] = json.load(f)
      # Kept, each in a file of its own: the coefficients, and the figures
      # of a schedule compiled for a budget (its line's second point).
      self.assertTrue(any("format" in value for value in files.values()))
      self.assertIn(measure.Figures._fields, [tuple(value) for value in files.values()])
      self.assertEqual(again(), (first, []))  # The files serve it.
      for name, value in files.items():
        with open(os.path.join(folder, name), "w") as f:
          json.dump(strings(value), f)
      made, compiles = again()
    self.assertEqual(made, first)
    self.assertNotEqual(compiles, [])
    # Read field by field: each number given as a string is refused.
    good = measure.Coefficients(
      length=8,
      plain=100,
      per_step=60,
      scheduled=(40.0, 4.0),
      constants=(8.0, 0.0),
      step_flops=2.0,
      advance_flops=3.0,
      policy=("dots", 50, 1.0),
      measured=(((False, None, None, None), 100),),
    )
    value = plan_cache._to_json(good)
    self.assertEqual(plan_cache._from_json(value), good)
    for field in ("length", "plain", "per_step", "step_flops", "advance_flops"):
      self.assertIsNone(plan_cache._from_json({**value, field: "8"}), field)
    for field, bad in (
      ("scheduled", ["40", 4.0]),
      ("constants", [8.0, "0"]),
      ("policy", ["dots", "50", 1.0]),
      ("measured", [[[False, None, None, None], "100"]]),
    ):
      self.assertIsNone(plan_cache._from_json({**value, field: bad}), field)

  @on_cpu_and_gpu(CPU_SIZED)
  def test_a_policy_has_its_own_figures_in_memory_and_on_disk(self):
    # One step planned without a policy, with one, and without again: in
    # one process (the memory caches), then in a "new" one (memory emptied,
    # the files kept). Each plan is the one made with nothing cached.
    init, xs = jnp.zeros([4, 16]), jnp.ones([256, 4, 16])
    policy = jax.checkpoint_policies.dots_saveable

    def plans():
      return [
        hkb.remat_plan(toy_step, init, xs, memory_budget=100_000, remat_policy=p)
        for p in (None, policy, None)
      ]

    with caches.disabled():
      cold = plans()
    with (
      mock.patch.dict(os.environ, {"HAIKU_BRIDGE_CACHE_DIR": self.create_tempdir().full_path}),
      mock.patch.object(caches, "_enabled", True),
    ):
      caches.clear_caches()
      try:
        in_memory = plans()
        plan_cache._COEFFICIENTS.clear()
        plan_cache._COMPILED.clear()
        from_disk = plans()
      finally:
        caches.clear_caches()
    self.assertEqual([any(c.policy for c in p.candidates) for p in cold], [False, True, False])
    self.assertEqual(in_memory, cold)
    self.assertEqual(from_disk, cold)


if __name__ == "__main__":
  absltest.main()
