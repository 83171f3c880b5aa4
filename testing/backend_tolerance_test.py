"""`backend_tolerance`: bit-exact on the CPU, a stated small bound elsewhere.

The tests hand `assert_same` values computed two ways that the CPU computes bit for bit; a bound
loosened there would pass them all and hide a difference in what is computed. Here it is handed
values one float32 ulp apart.
"""

from unittest import mock

from absl.testing import absltest
import jax.numpy as jnp
import numpy as np

from testing import backend_tolerance

X = {"w": jnp.linspace(-2.0, 3.0, 7, dtype=jnp.float32)}
ONE_ULP = {"w": jnp.nextafter(X["w"], jnp.inf)}


class AssertSameTest(absltest.TestCase):
  def test_the_cpu_refuses_one_ulp(self):
    with mock.patch.object(backend_tolerance, "on_cpu", return_value=True):
      backend_tolerance.assert_same(X, {"w": jnp.array(X["w"])})
      with self.assertRaises(AssertionError):
        backend_tolerance.assert_same(ONE_ULP, X)

  def test_an_accelerator_allows_one_ulp_and_no_more_than_its_bound(self):
    with mock.patch.object(backend_tolerance, "on_cpu", return_value=False):
      backend_tolerance.assert_same(ONE_ULP, X)
      with self.assertRaises(AssertionError):
        backend_tolerance.assert_same({"w": X["w"] * (1 + 1e-5)}, X)

  def test_the_cpu_bounds_are_the_tighter(self):
    for bound in (
      backend_tolerance.values,
      backend_tolerance.second_order,
      backend_tolerance.numerical,
    ):
      with mock.patch.object(backend_tolerance, "on_cpu", return_value=True):
        cpu = bound()
      with mock.patch.object(backend_tolerance, "on_cpu", return_value=False):
        other = bound()
      with self.subTest(bound.__name__):
        self.assertLessEqual(cpu["rtol"], other["rtol"])
        self.assertLessEqual(np.float32(cpu["atol"]), np.float32(other["atol"]))

  def test_a_fresh_process_beside_an_accelerator_allows_what_a_tpu_measured(self):
    # A CPU child's gradient against the TPU parent's, bridged_grid_test's
    # test_fresh_process on a TPU v5e: -0.0114 after terms up to 2.9 cancel.
    tpu, cpu = np.float32(-0.011458665132522583), np.float32(-0.01144285500049591)
    with mock.patch.object(backend_tolerance, "on_cpu", return_value=True):
      self.assertEqual(backend_tolerance.fresh_process(dict(rtol=2e-5)), dict(rtol=2e-5))
    with mock.patch.object(backend_tolerance, "on_cpu", return_value=False):
      bound = backend_tolerance.fresh_process(dict(rtol=2e-5))
    np.testing.assert_allclose(cpu, tpu, **bound)
    with self.assertRaises(AssertionError):
      np.testing.assert_allclose(cpu, tpu + 10 * (tpu - cpu), **bound)
    # The same test under remat: a weight's gradient whose entries reach
    # 5.15 (the child's, the parent's); the bound grows with that scale.
    cpu = np.float32([0.3899933695793152, -0.07951942086219788, -5.148919])
    tpu = np.float32([0.38988378643989563, -0.07967393845319748, -5.148887])
    with mock.patch.object(backend_tolerance, "on_cpu", return_value=False):
      unscaled = backend_tolerance.fresh_process(dict(rtol=2e-5))
      scaled = backend_tolerance.fresh_process(dict(rtol=2e-5), np.max(np.abs(tpu)))
    np.testing.assert_allclose(cpu, tpu, **scaled)
    with self.assertRaises(AssertionError):
      np.testing.assert_allclose(cpu, tpu, **unscaled)


if __name__ == "__main__":
  absltest.main()
