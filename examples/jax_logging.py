"""The examples' logging: jax's INFO lines left out, unless the command line asks for them.

An absl app logs at INFO (absl lowers `--verbosity` from WARNING to INFO once it has parsed the
flags), and jax logs at INFO each backend it could not start, before the example prints anything:
"Unable to initialize backend 'tpu': ... libtpu.so: cannot open shared object file" on a machine
without a TPU, and on jax 0.12 'proxy' as well. They are jax probing the machine, not news of the
example, so each example's `main` calls `quiet()` first. jax's warnings still show, and so does
what haiku_bridge and the example log at INFO; `--verbosity` (`-v`) or `--logger_levels=jax:INFO`
brings jax's INFO lines back.
"""

import logging

from absl import flags


def quiet() -> None:
  """jax's loggers at WARNING, unless `--verbosity` or `--logger_levels` set jax's level."""
  given = flags.FLAGS["verbosity"].present or "jax" in flags.FLAGS.logger_levels
  if not given:
    logging.getLogger("jax").setLevel(logging.WARNING)
