"""The supported versions are stated once and agree everywhere.

`testing/version_matrix.sh` lists the tested (dm-haiku, jax) pairs; pyproject.toml's bounds must be
exactly the range they span, the README must state that range and every pair, and requirements.txt
(Bazel's test environment) must pin one of the pairs.
"""

import os
import re

from absl.testing import absltest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path: str) -> str:
  with open(os.path.join(_ROOT, path)) as f:
    return f.read()


def version(text: str) -> tuple[int, ...]:
  return tuple(int(part) for part in text.split("."))


def matrix_pairs() -> list[tuple[str, str]]:
  block = re.search(r"^readonly PAIRS=\(\n(.*?)^\)", read("testing/version_matrix.sh"),
                    re.MULTILINE | re.DOTALL)[1]
  return [tuple(line.strip().split("/")) for line in block.splitlines() if line.strip()]


class VersionsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.pairs = matrix_pairs()
    self.haiku = sorted({h for h, _ in self.pairs}, key=version)
    self.jax = sorted({j for _, j in self.pairs}, key=version)

  def test_matrix_covers_every_haiku_release_from_0_0_14(self):
    self.assertEqual(self.haiku, ["0.0.14", "0.0.15", "0.0.16", "0.0.17"])

  def test_pyproject_bounds_are_the_tested_range(self):
    deps = dict(re.findall(r'^  "([\w-]+)([<>=]\S*)",$', read("pyproject.toml"), re.MULTILINE))
    self.assertEqual(deps["dm-haiku"], f">={self.haiku[0]},<={self.haiku[-1]}")
    self.assertEqual(deps["jax"], f">={self.jax[0]},<={self.jax[-1]}")
    self.assertEqual(deps["jaxlib"], deps["jax"])

  def test_readme_states_the_range_and_every_pair(self):
    readme = " ".join(read("README.md").split())
    self.assertIn(f"`dm-haiku` {self.haiku[0]} to {self.haiku[-1]} and `jax` {self.jax[0]} to "
                  f"{self.jax[-1]}", readme)
    tested = re.search(r"Tested pairs: (.*?) \(`bash testing/version_matrix.sh`", readme)[1]
    stated, haiku = [], None
    for v in re.findall(r"\d+\.\d+\.\d+", tested):  # Each jax goes with the dm-haiku before it.
      if v.startswith("0.0."):
        haiku = v
      else:
        stated.append((haiku, v))
    self.assertEqual(stated, self.pairs)

  def test_bazel_pins_a_tested_pair(self):
    pins = dict(re.findall(r"^(dm-haiku|jax)==(\S+)$", read("requirements.txt"), re.MULTILINE))
    self.assertIn((pins["dm-haiku"], pins["jax"]), self.pairs)


if __name__ == "__main__":
  absltest.main()
