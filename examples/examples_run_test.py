"""Each example runs as its docstring says: `python examples/<name>.py`, after `pip install ".[examples]"`.

The package is built and installed offline into a fresh virtual environment with its `examples`
extra (`testing/installed_package.py`), and each example file runs there in one process of its
own, with the command its docstring gives plus the smallest flags the example offers: by the
file's path, from an empty directory outside the checkout, with no PYTHONPATH. So haiku_bridge is
the installed one and a sibling module (`processes.py`) is found beside the file, as for a user.
Each prints what it found and logs no INFO line: jax's, of the backends it could not start
("Unable to initialize backend 'tpu': ... libtpu.so"), are left out (`jax_logging.py`).
The fresh environment sees this interpreter's packages (the build is offline), so what the
examples import is checked against what the package declares instead: each library an example
imports must be a dependency of haiku_bridge or of its `examples` extra.
"""

import ast
import email.message
import email.parser
import glob
import importlib.metadata
import os
import re
import shutil
import sys
import tempfile
import zipfile

from absl.testing import absltest
from absl.testing import parameterized

from testing import installed_package
from testing import xla_flags

_EXAMPLES = os.path.join(installed_package.ROOT, "examples")
# The smallest run each example offers (its flags for fewer steps, layers or a shorter sequence).
SMALL_FLAGS = {
  "custom_vjp_routing": [],
  "foreign_modules": ["--num_steps=3"],
  "foreign_stax": [],
  "long_sequence_lstm": ["--length=64", "--hidden=8", "--batch=2", "--steps=3"],
  "migration_to_nnx": ["--haiku_steps=3", "--nnx_steps=3"],
  "pipelined_transformer": ["--num_steps=2"],
  "sharded_training": ["--num_steps=2"],
  "transformer_stack": ["--depths=1", "--loop_max_depth=1"],
}
# Modules of examples/ that are not examples: run by none, imported by some.
_HELPERS = ("__init__", "jax_logging", "processes")
# A line absl logs at INFO: `I1206 23:49:01.259494 139742137801600 xla_bridge.py:849] Unable ...`.
_INFO_LINE = re.compile(r"^I\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] .*$", re.MULTILINE)


def source(name: str) -> str:
  with open(os.path.join(_EXAMPLES, f"{name}.py")) as f:
    return f.read()


def example_names() -> list[str]:
  names = [
    os.path.basename(path)[: -len(".py")] for path in glob.glob(os.path.join(_EXAMPLES, "*.py"))
  ]
  return sorted(n for n in names if not n.endswith("_test") and n not in _HELPERS)


def docstring_command(name: str) -> list[str]:
  """The flags of the docstring's one-process command, `python examples/<name>.py [flags]`."""
  doc = ast.get_docstring(ast.parse(source(name))) or ""
  match = re.search(rf"^ +python examples/{name}\.py(.*?)( \\)?$", doc, re.MULTILINE)
  if match is None:
    raise AssertionError(f"examples/{name}.py: its docstring gives no `python examples/{name}.py`")
  return match[1].split()


def imported_libraries(code: str) -> set[str]:
  """The top-level names of the modules `code` imports that are neither stdlib nor ours."""
  names = set()
  for node in ast.walk(ast.parse(code)):
    if isinstance(node, ast.Import):
      names |= {alias.name.split(".")[0] for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      names.add(node.module.split(".")[0])
  return names - set(sys.stdlib_module_names) - {"examples", "haiku_bridge", *_HELPERS}


def normalized(distribution: str) -> str:
  return re.sub(r"[-_.]+", "-", distribution).lower()


def declared(metadata: email.message.Message, extra: str) -> set[str]:
  """The distributions the package requires, and those of `extra`."""
  names = set()
  for requirement in metadata.get_all("Requires-Dist"):
    name, _, marker = requirement.partition(";")
    if not marker or re.search(rf"extra\s*==\s*['\"]{extra}['\"]", marker):
      names.add(normalized(re.match(r"[\w.-]+", name.strip())[0]))
  return names


class ExamplesRunTest(parameterized.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    src, dist = os.path.join(cls.tmp, "src"), os.path.join(cls.tmp, "dist")
    installed_package.copy_project(src)
    built = installed_package.build(src, dist)
    if built.returncode != 0:
      raise AssertionError(f"python -m build failed:\n{built.stderr[-3000:]}")
    cls.wheel = next(os.path.join(dist, f) for f in os.listdir(dist) if f.endswith(".whl"))
    cls.python, _ = installed_package.fresh_venv(os.path.join(cls.tmp, "venv"))
    cls.installed = installed_package.install(cls.python, cls.wheel, ("examples",))

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.tmp, ignore_errors=True)
    super().tearDownClass()

  def test_every_example_has_small_flags(self):
    self.assertEqual(sorted(SMALL_FLAGS), example_names())

  def test_the_extra_installs(self):
    status, output, unprovided = self.installed
    self.assertEqual(status, 0, f"pip install failed:\n{output[-3000:]}")
    self.assertEqual(unprovided, [])

  def test_the_package_declares_what_the_examples_import(self):
    with zipfile.ZipFile(self.wheel) as z:
      metadata = email.parser.Parser().parsestr(
        z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
      )
    provided = declared(metadata, "examples")
    self.assertContainsSubset({"optax", "equinox", "flax", "absl-py"}, provided)
    distributions = importlib.metadata.packages_distributions()
    undeclared = {}
    for name in example_names() + ["jax_logging", "processes"]:
      for library in imported_libraries(source(name)):
        if not {normalized(d) for d in distributions.get(library, [library])} & provided:
          undeclared.setdefault(library, []).append(name)
    self.assertEqual(undeclared, {})

  @parameterized.parameters(*example_names())
  def test_runs_as_its_docstring_says(self, name):
    self.assertNotIn("PYTHONPATH", source(name))
    args = docstring_command(name) + SMALL_FLAGS[name]  # The later flag of a name wins.
    workdir = tempfile.mkdtemp(dir=self.tmp)
    # The tests' compile flags (cheaper code generation, the same programs).
    env = dict(installed_package.clean_env(), XLA_FLAGS=xla_flags.flags())
    ran = installed_package.run(
      [self.python, os.path.join(_EXAMPLES, f"{name}.py"), *args], cwd=workdir, env=env
    )
    self.assertEqual(
      ran.returncode, 0, f"python examples/{name}.py {' '.join(args)} failed:\n{ran.stderr[-3000:]}"
    )
    self.assertEqual(_INFO_LINE.findall(ran.stderr), [], f"python examples/{name}.py logs INFO")

  def test_info_line_finds_absl_info_lines(self):
    stderr = (
      "I1206 23:49:01.259494 139742137801600 xla_bridge.py:849] Unable to initialize "
      "backend 'tpu': INTERNAL: Failed to open libtpu.so\n"
      "W1206 23:49:01.259494 139742137801600 x.py:1] a warning\n"
      "example.py:3: UntestedVersionWarning: haiku_bridge is tested with ...\n"
    )
    found = _INFO_LINE.findall(stderr)
    self.assertLen(found, 1)
    self.assertIn("xla_bridge.py:849] Unable to initialize backend 'tpu'", found[0])


if __name__ == "__main__":
  absltest.main()
