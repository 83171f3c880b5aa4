"""testing/accelerator_check.sh names test files that exist and that Bazel runs too, and its shards cover them."""

import os
import re
import subprocess
import tempfile

from absl.testing import absltest

# Under Bazel the script is a runfiles link to the checkout's file: the listed
# tests and BUILD files are read beside it, in the checkout.
SCRIPT = os.path.realpath(os.path.join(os.path.dirname(__file__), "accelerator_check.sh"))
ROOT = os.path.dirname(os.path.dirname(SCRIPT))


def _script() -> str:
  with open(SCRIPT) as f:
    return f.read()


def _array(name: str) -> list[str]:
  """The words of the script's `name=( ... )`, comments left out."""
  block = re.search(rf"^{name}=\((.*?)^\)", _script(), re.M | re.S)
  assert block, f"{name}=( ... ) not found in testing/accelerator_check.sh"
  return " ".join(re.sub(r"#.*", "", line) for line in block[1].splitlines()).split()


def accelerator_tests() -> list[str]:
  return _array("ACCELERATOR_TESTS")


def shard(spec: str) -> list[str]:
  """The files the script's `shard_files` picks for ACCELERATOR_CHECK_SHARD=`spec`."""
  function = re.search(r"^shard_files\(\) \{.*?^\}", _script(), re.M | re.S)
  assert function, "shard_files() not found in testing/accelerator_check.sh"
  files = " ".join(accelerator_tests())
  code = f"ACCELERATOR_TESTS=({files})\nSHARD={spec}\n{function[0]}\nshard_files"
  return subprocess.run(
    ["bash", "-c", code], capture_output=True, text=True, check=True
  ).stdout.split()


def _stand_in_python(folder: str, *lines: str) -> str:
  """A stand-in for Python in `folder` that says the backend is a CPU, has no pytest-xdist, then runs `lines` (bash)."""
  python = os.path.join(folder, "python")
  with open(python, "w") as f:
    f.write(
      "#!/bin/bash\n"
      '[[ "$1" == - ]] && { cat >/dev/null; echo cpu > "${BACKEND_FILE}"; exit 0; }\n'
      '[[ "$1" == -c ]] && exit 1\n' + "".join(line + "\n" for line in lines)
    )
  os.chmod(python, 0o755)
  return python


class AcceleratorCheckTest(absltest.TestCase):
  def test_every_listed_file_is_a_bazel_test(self):
    files = accelerator_tests()
    self.assertGreater(len(files), 10)
    budget = _array("BUDGET_TESTS")  # Part 4's, run apart.
    self.assertIn("haiku_bridge/_src/remat/step_budget_test.py", budget)
    self.assertFalse(set(budget) & set(files))
    for path in files + budget:
      self.assertTrue(os.path.isfile(os.path.join(ROOT, path)), path)
      folder, name = os.path.split(path)
      with open(os.path.join(ROOT, folder, "BUILD")) as f:
        build = f.read()
      self.assertIn(f'name = "{name[: -len(".py")]}"', build, path)

  def test_every_test_left_out_on_a_tpu_exists(self):
    deselected = _array("TPU_DESELECTED")
    self.assertNotEmpty(deselected)
    for node in deselected:
      path, cls, method = node.split("::")
      self.assertIn(path, accelerator_tests())
      with open(os.path.join(ROOT, path)) as f:
        source = f.read()
      test_class = re.search(rf"^class {cls}\(.*?(?=^class |\Z)", source, re.M | re.S)
      self.assertIsNotNone(test_class, node)
      self.assertIn(f"def {method}(self", test_class[0], node)

  def test_shards_cover_the_list_once(self):
    files = accelerator_tests()
    self.assertEqual(shard("1/1"), files)
    shards = [shard(f"{i}/4") for i in range(1, 5)]
    self.assertEqual(sorted(sum(shards, [])), sorted(files))
    self.assertEqual(shards[1][:2], files[1:9:4][:2])

  def test_the_step_part_runs_both_phases_without_jaxs_compile_cache(self):
    # The script run with a stand-in for Python that logs each call: its
    # costs are of compiles, so jax's persistent cache (which the script
    # sets for the other parts) would make them a cache's reads.
    with tempfile.TemporaryDirectory() as out:
      python = _stand_in_python(
        out,
        'echo "$* cache=${JAX_COMPILATION_CACHE_DIR-unset} plans=${HAIKU_BRIDGE_CACHE_DIR}"'
        f" >> {out}/calls",
      )
      env = dict(os.environ, PYTHON=python, ACCELERATOR_CHECK_PARTS="step")
      # Both phases, then each apart (as two calls of a device's time limit take them).
      for phases in (None, "cold", "warm"):
        if phases is not None:
          env["ACCELERATOR_CHECK_STEP_PHASES"] = phases
        subprocess.run(["bash", SCRIPT, os.path.join(out, "check")], env=env, check=True,
                       capture_output=True)  # fmt: skip
      with open(os.path.join(out, "calls")) as f:
        calls = f.read().splitlines()
    plans = os.path.join(out, "check", "plans")
    self.assertEqual(
      calls,
      [
        f"-m testing.benchmarks.step_budget_figures --out={out}/check --small --cold_repeats=1"
        f" --phase={phase}"
        f" cache=unset plans={plans}"
        for phase in ("cold", "warm", "cold", "warm")
      ],
    )

  def test_the_summary_names_the_parts_run_and_their_status(self):
    with tempfile.TemporaryDirectory() as out:
      python = _stand_in_python(
        out,
        '[[ "$2" == testing.remat_auto_check ]] && exit 3',
        "exit 0",  # A part that fails.
      )
      env = dict(os.environ, PYTHON=python, ACCELERATOR_CHECK_PARTS="remat step")
      done = subprocess.run(["bash", SCRIPT, os.path.join(out, "check")], env=env,
                            capture_output=True, text=True)  # fmt: skip
      with open(os.path.join(out, "check", "summary.md")) as f:
        summary = f.read()
    self.assertNotEqual(done.returncode, 0)
    # Parts not run (tests, figures, budget) are not said to have passed.
    self.assertIn("\nremat: exit 3; step: exit 0\n", summary)
    for part in ("tests (shard", "figures:", "budget:"):
      self.assertNotIn(part, summary)


if __name__ == "__main__":
  absltest.main()
