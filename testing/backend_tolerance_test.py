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


if __name__ == "__main__":
  absltest.main()
