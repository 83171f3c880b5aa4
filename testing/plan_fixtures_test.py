"""Tests for `plan_fixtures.py`."""

import unittest
from unittest import mock

from absl.testing import absltest
import jax

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


if __name__ == "__main__":
  absltest.main()
