"""The examples leave out jax's INFO lines, keep its warnings, and show all where asked to."""

import logging

from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver

from examples import jax_logging

# The logger of jax's backend probes ("Unable to initialize backend 'tpu': ...").
_PROBES = logging.getLogger("jax._src.xla_bridge")


class JaxLoggingTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    jax = logging.getLogger("jax")
    self.addCleanup(jax.setLevel, jax.level)
    jax.setLevel(logging.NOTSET)
    root = logging.getLogger()  # Where absl's handler is, at INFO in an absl app.
    self.addCleanup(root.setLevel, root.level)
    root.setLevel(logging.INFO)

  def test_quiet_leaves_out_info_and_keeps_warnings(self):
    self.assertTrue(_PROBES.isEnabledFor(logging.INFO))
    with flagsaver.flagsaver():
      flags.FLAGS(["example"])
      jax_logging.quiet()
    self.assertFalse(_PROBES.isEnabledFor(logging.INFO))
    self.assertTrue(_PROBES.isEnabledFor(logging.WARNING))
    self.assertTrue(logging.getLogger("haiku_bridge.remat").isEnabledFor(logging.INFO))

  def test_verbosity_or_logger_levels_keep_jax_info(self):
    for argv in (["--verbosity=0"], ["-v", "1"], ["--logger_levels=jax:INFO"]):
      with flagsaver.flagsaver():
        flags.FLAGS(["example", *argv])
        jax_logging.quiet()
      self.assertTrue(_PROBES.isEnabledFor(logging.INFO), argv)


if __name__ == "__main__":
  absltest.main()
