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


class TpuLikeFiguresTest(absltest.TestCase):
  @plan_fixtures.on_cpu_and_gpu("a TPU's figures are its own, not simulated")
  def test_every_byte_times_the_factor_and_a_conditionals_peak_added(self):
    table = np.random.default_rng(0).integers(0, 9, 200).astype(np.int32)  # Not an iota.
    plain_program = (
      jax.jit(lambda i: jnp.tanh(jnp.ones([64, 64]) * jnp.asarray(table)[i])).lower(3).compile()
    )
    with_conditional = (
      jax.jit(lambda x, i: jax.lax.cond(i > 0, jnp.tanh, jnp.cos, x @ x) * jnp.asarray(table)[i])
      .lower(jnp.ones([64, 64]), 3)
      .compile()
    )
    self.assertGreater(hlo_flops.held(plain_program).constants, 0)  # The table.
    for compiled in (plain_program, with_conditional):
      plain = hlo_flops.held(compiled)
      self.assertGreater(plain.temporaries, 0)
      # XLA:TPU's temp_size of a program with a conditional: its peak at least.
      a = compiled.memory_analysis()
      peak = (
        plain.temporaries
        + a.argument_size_in_bytes
        + a.output_size_in_bytes
        - a.alias_size_in_bytes
      )
      conditional = compiled is with_conditional
      self.assertEqual(" conditional(" in compiled.as_text(), conditional)
      with plan_fixtures.tpu_like_figures(16):
        self.assertEqual(
          hlo_flops.held(compiled),
          hlo_flops.Held(
            16 * (plain.temporaries + (peak if conditional else 0)), 16 * plain.constants
          ),
        )
      self.assertEqual(hlo_flops.held(compiled), plain)
      with mock.patch.object(jax, "default_backend", lambda: "tpu"):
        on_a_tpu = hlo_flops.held(compiled)
        with plan_fixtures.tpu_like_figures(16):
          self.assertEqual(hlo_flops.held(compiled), on_a_tpu)  # A TPU's own.


if __name__ == "__main__":
  absltest.main()
