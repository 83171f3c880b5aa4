"""The library type-checks, and its public API is fully annotated.

mypy runs over haiku_bridge/ with `[tool.mypy]` of pyproject.toml (which says what is checked and
why), against the installed jax, Haiku, Flax and Equinox. The annotations of the public API are
checked here directly: every parameter and return of every name of `haiku_bridge.__all__` and of
their public methods, which mypy's per-function flags cannot single out. And a user's script is
type-checked as a user's mypy reads it: a misspelt mode string (`remat="nestd"`) is reported.
"""

import inspect
import os
import re
import sys
import tempfile
import textwrap
import typing
from typing import Any, Callable, Iterator

from absl.testing import absltest
from mypy import api as mypy_api

import haiku_bridge as hkb

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_mypy(*args: str) -> tuple[str, int]:
  """mypy over `args` (default: the library), from the repository root as a user would run it."""
  cwd = os.getcwd()
  os.chdir(_ROOT)
  try:
    # No cache: nothing is written, and nothing stale is read.
    stdout, stderr, status = mypy_api.run(
      ["--cache-dir", os.devnull, "--python-executable", sys.executable, *args]
    )
  finally:
    os.chdir(cwd)
  return stdout + stderr, status


# A user's script: each line marked `# error` holds a misspelt mode; the others are every valid
# mode of each option, and a user's own wrapper naming the public types.
USER_SCRIPT = textwrap.dedent("""\
    import haiku as hk
    import jax.numpy as jnp
    import haiku_bridge as hkb

    def block(h: jnp.ndarray) -> jnp.ndarray:
      return h + hk.Linear(4)(h)

    def pair(h: jnp.ndarray, x: None) -> tuple[jnp.ndarray, None]:
      return block(h), None

    def deep(x: jnp.ndarray, remat: hkb.RematMode = "binomial") -> jnp.ndarray:
      return hkb.repeat_layer(block, x, 4, remat=remat)

    def net(x: jnp.ndarray) -> jnp.ndarray:
      for mode in (False, True, "nested", "binomial"):
        x = hkb.repeat_layer(block, x, 4, remat=mode)
      x = hkb.layer_scan(pair, x, num_layers=2, remat="nested")[0]
      x = hkb.scan(pair, x, None, length=3, remat="binomial")[0]
      x = hkb.dynamic_unroll(pair, x, x, remat=True)[0]
      x = hkb.repeat_layer(block, x, 4, remat="binomal")  # error
      x = hkb.layer_scan(pair, x, num_layers=2, remat="nestd")[0]  # error
      x = hkb.scan(pair, x, None, length=3, remat="nested ")[0]  # error
      x = hkb.dynamic_unroll(pair, x, x, remat="True")[0]  # error
      return deep(x, remat="nested")

    GPIPE = hkb.Pipeline("stage", microbatches=2, schedule="gpipe")
    CIRCULAR: hkb.PipelineSchedule = "circular"
    PIPE = hkb.Pipeline("stage", microbatches=2, schedule=CIRCULAR)
    TYPO = hkb.Pipeline("stage", microbatches=2, schedule="circulr")  # error
    """)


def public_callables() -> Iterator[tuple[str, Callable[..., Any]]]:
  """`(name, function)` for each public function, class and public method."""
  for name in hkb.__all__:
    obj = getattr(hkb, name)
    if inspect.ismodule(obj):  # `hkb.hk`: Haiku's namespace, typed by Haiku.
      continue
    if typing.get_origin(obj) is not None:  # A type such as `hkb.RematMode`.
      continue
    if not inspect.isclass(obj):
      yield name, obj
      continue
    for attr, value in vars(obj).items():
      if attr.startswith("_") and attr not in ("__init__", "__call__"):
        continue
      if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
      elif isinstance(value, property):
        value = value.fget
      if inspect.isfunction(value):
        yield f"{name}.{attr}", value


def unannotated(fn: Callable[..., Any]) -> list[str]:
  """The parameters of `fn` (and "return") that have no annotation."""
  signature = inspect.signature(fn)
  missing = [
    p.name
    for i, p in enumerate(signature.parameters.values())
    if p.annotation is inspect.Parameter.empty and not (i == 0 and p.name in ("self", "cls"))
  ]
  if signature.return_annotation is inspect.Signature.empty:
    missing.append("return")
  return missing


class TypecheckTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # One run of mypy (it reads jax, Haiku, Flax and Equinox once): the library, as pyproject.toml
    # configures it, and a user's script beside it.
    with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as tmp:
      path = os.path.join(tmp, "user.py")
      with open(path, "w") as f:
        f.write(USER_SCRIPT)
      cls.mypy_output, cls.mypy_status = run_mypy("haiku_bridge", path)

  def test_mypy_finds_no_error(self):
    output = self.mypy_output
    library_errors = [
      line for line in output.splitlines() if ": error:" in line and "user.py:" not in line
    ]
    self.assertEqual(library_errors, [], f"mypy found errors:\n{output}")
    # Every module of the library was read (none of its tests), and the user's script.
    modules = [
      f
      for _, _, files in os.walk(os.path.join(_ROOT, "haiku_bridge"))
      for f in files
      if f.endswith(".py") and not f.endswith("_test.py")
    ]
    self.assertGreater(len(modules), 20)
    self.assertIn(f"errors in 1 file (checked {len(modules) + 1} source files)", output)
    self.assertEqual(self.mypy_status, 1)  # The user's misspelt modes.

  def test_public_api_is_annotated(self):
    found = dict(public_callables())
    # Guards the walk: functions, a class's `__init__`, methods, properties.
    for name in (
      "call_pure",
      "from_flax",
      "ShardingRules.__init__",
      "ShardingRules.place",
      "ShardingRules.from_foreign",
      "ShardingRules.rules",
      "Pipeline.num_repeats",
    ):
      self.assertIn(name, found)
    missing = {name: unannotated(fn) for name, fn in found.items()}
    self.assertEqual({name: m for name, m in missing.items() if m}, {})

  def test_misspelt_modes_are_type_errors(self):
    output = self.mypy_output
    expected = {
      i + 1 for i, line in enumerate(USER_SCRIPT.splitlines()) if line.endswith("# error")
    }
    reported = {int(n) for n in re.findall(r"user\.py:(\d+): error:", output)}
    self.assertLen(expected, 5)
    self.assertEqual(reported, expected, output)
    for n in expected:
      self.assertRegex(output, rf"user\.py:{n}: error: Argument \"(remat|schedule)\"", output)

  def test_unannotated_finds_what_is_missing(self):
    def partly(self, a: int, b, *args, c: str = "", **kwargs) -> int:
      del self, a, b, args, c, kwargs
      return 0

    def typed(x: int) -> None:
      del x

    self.assertEqual(unannotated(partly), ["b", "args", "kwargs"])
    self.assertEqual(unannotated(lambda x: x), ["x", "return"])
    self.assertEqual(unannotated(typed), [])


if __name__ == "__main__":
  absltest.main()
