"""haiku_bridge as a user installs it: built by `python -m build`, installed into a fresh venv.

`//testing:wheel_test` checks the package this builds; `//examples:examples_run_test` runs the
examples against it, as `pip install ".[examples]"` leaves them.

Offline: the build runs without isolation on the setuptools installed here, and the fresh
environment sees this interpreter's installed packages (jax, Haiku, Flax, Equinox) through a `.pth`
file, so pip installs the wheel with `--no-index` and finds every dependency already satisfied, or
fails naming the one it lacks.
"""

import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What a checkout holds for the package: the files pyproject.toml names, and the package.
PROJECT_FILES = ("pyproject.toml", "README.md", "setup.py", "LICENSE", "NOTICE")
TIMEOUT_S = 240


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
  return subprocess.run(
    args, capture_output=True, text=True, timeout=TIMEOUT_S, check=False, **kwargs
  )


def clean_env() -> dict[str, str]:
  """This environment without what would put the checkout on the child's path."""
  env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
  for name in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "XLA_FLAGS"):
    env.pop(name, None)
  return env


def copy_project(src: str) -> None:
  """The package's files of the checkout, as plain files (Bazel's runfiles are links), in `src`."""
  os.makedirs(src)
  for name in PROJECT_FILES:
    shutil.copy(os.path.join(ROOT, name), src)
  shutil.copytree(
    os.path.join(ROOT, "haiku_bridge"),
    os.path.join(src, "haiku_bridge"),
    ignore=shutil.ignore_patterns("__pycache__"),
  )


def build(src: str, dist: str) -> subprocess.CompletedProcess:
  """`python -m build` of `src` into `dist`: the sdist and, from it, the wheel."""
  return run(
    [sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, src], env=clean_env()
  )


def fresh_venv(path: str) -> tuple[str, str]:
  """A new venv at `path` that sees this interpreter's packages after its own: (python, purelib)."""
  created = run([sys.executable, "-m", "venv", "--without-pip", path])
  if created.returncode != 0:
    raise RuntimeError(f"python -m venv failed:\n{created.stderr}")
  python = os.path.join(path, "bin", "python")
  purelib = run(
    [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=clean_env()
  ).stdout.strip()
  with open(os.path.join(purelib, "_installed_here.pth"), "w") as f:
    f.write("\n".join(site.getsitepackages() + [sysconfig.get_paths()["purelib"]]) + "\n")
  return python, purelib


def install(python: str, wheel: str, extras: tuple[str, ...]) -> tuple[int, str, list[str]]:
  """pip installs `wheel[extras]` offline into `python`'s venv.

  Returns pip's exit status, its output, and its lines saying an extra is not provided.
  """
  installed = run(
    [
      sys.executable,
      "-m",
      "pip",
      "--python",
      python,
      "install",
      "--no-index",
      "--no-cache-dir",
      f"{wheel}[{','.join(extras)}]",
    ],
    env=clean_env(),
  )
  output = installed.stdout + installed.stderr
  return (
    installed.returncode,
    output,
    re.findall(r"^.*does not provide the extra.*$", output, re.MULTILINE),
  )
