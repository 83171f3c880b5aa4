"""Tests for `plan_fixtures.py`."""

import unittest
from unittest import mock

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from haiku_bridge._src.remat import hlo_flops
from testing import plan_fixtures


class OnCpuAndGpuTest(absltest.TestCase):
  def test_runs_on_the_cpu_and_skips_on_a_tpu(self):
    ran = []

    @plan_fixtures.on_cpu_and_gpu("a reason")
    def test(self):
      ran.append(jax.default_backend())

    for backend in ("cpu", "gpu"):
      with mock.patch.object(jax, "default_backend", lambda b=backend: b):
        test(self)
    with (
      mock.patch.object(jax, "default_backend", lambda: "tpu"),
      self.assertRaisesRegex(unittest.SkipTest, "on a TPU: a reason"),
    ):
      test(self)
    self.assertEqual(ran, ["cpu", "gpu"])


class ScaledFiguresTest(absltest.TestCase):
  def test_every_measured_byte_times_the_factor_inside_only(self):
    table = jnp.asarray(np.arange(300, dtype=np.int32))
    compiled = jax.jit(lambda i: jnp.tanh(jnp.ones([64, 64]) * table[i])).lower(3).compile()
    plain = hlo_flops.held(compiled)
    self.assertGreater(plain.temporaries, 0)
    with plan_fixtures.scaled_figures(16):
      self.assertEqual(
        hlo_flops.held(compiled), hlo_flops.Held(16 * plain.temporaries, 16 * plain.constants)
      )
    self.assertEqual(hlo_flops.held(compiled), plain)


if __name__ == "__main__":
  absltest.main()
