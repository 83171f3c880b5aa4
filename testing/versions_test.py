"""The supported versions are stated once and agree everywhere.

`testing/version_matrix.sh` lists the tested (dm-haiku, jax) pairs; pyproject.toml's bounds must
be the oldest of them, lower bounds only (as Flax, Optax and Equinox set theirs: a newer jax
installs, and importing haiku_bridge warns past the tested set), the library's own record of the
tested set (`_src/versions.py`, which warns past it) must be the range they span, the install page
(docs/install.md, which the README's install section links) must state that range and every pair,
and requirements.txt (Bazel's test environment) must pin one of the pairs. numpy's bound is no
tighter than what the installed jax asks for. The Flax extra's bound is the one the matrix
installs, on the pairs the install page names.
"""

import importlib.metadata
import os
import re

from absl.testing import absltest

from haiku_bridge._src import versions

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the versions are stated for users; the README's install section links it.
INSTALL_PAGE = os.path.join("docs", "install.md")


def read(path: str) -> str:
  with open(os.path.join(_ROOT, path)) as f:
    return f.read()


def version(text: str) -> tuple[int, ...]:
  return tuple(int(part) for part in text.split("."))


def lower_bound(requirement: str) -> tuple[int, ...]:
  """The `>=` bound of `numpy>=2.0` / `numpy >=2.0, <3`."""
  return version(re.search(r">=\s*([\d.]+)", requirement)[1])


def pyproject_deps() -> dict[str, str]:
  return dict(re.findall(r'^  "([\w-]+)([<>=]\S*)",$', read("pyproject.toml"), re.MULTILINE))


def matrix_pairs(name: str = "PAIRS") -> list[tuple[str, str]]:
  """The pairs of version_matrix.sh's array `name`: PAIRS (the tested set) or NEWER_PAIRS."""
  block = re.search(
    rf"^readonly {name}=\(\n(.*?)^\)", read("testing/version_matrix.sh"), re.MULTILINE | re.DOTALL
  )[1]
  return [tuple(line.strip().split("/")) for line in block.splitlines() if line.strip()]


class VersionsTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    self.pairs = matrix_pairs()
    self.haiku = sorted({h for h, _ in self.pairs}, key=version)
    self.jax = sorted({j for _, j in self.pairs}, key=version)

  def test_matrix_covers_every_haiku_release_from_0_0_14(self):
    self.assertEqual(self.haiku, ["0.0.14", "0.0.15", "0.0.16", "0.0.17"])

  def test_pyproject_bounds_are_the_oldest_tested_lower_bounds_only(self):
    deps = pyproject_deps()
    self.assertEqual(deps["dm-haiku"], f">={self.haiku[0]}")
    self.assertEqual(deps["jax"], f">={self.jax[0]}")
    self.assertEqual(deps["jaxlib"], deps["jax"])
    self.assertEqual({name: bound for name, bound in deps.items() if "<" in bound}, {})

  def test_newer_pairs_are_past_the_tested_set(self):
    # The matrix runs them too; importing haiku_bridge warns on their jax until they move up.
    newer = matrix_pairs("NEWER_PAIRS")
    self.assertNotEmpty(newer)
    for haiku, jax in newer:
      self.assertIn(haiku, self.haiku)
      self.assertEqual(versions.untested({"jax": jax, "dm-haiku": haiku}), [f"jax {jax}"])

  def test_the_library_knows_the_tested_range(self):
    self.assertEqual(
      versions.TESTED,
      {"jax": (self.jax[0], self.jax[-1]), "dm-haiku": (self.haiku[0], self.haiku[-1])},
    )

  def test_numpy_bound_is_what_jax_needs(self):
    # jax asks for numpy itself; ours may not exclude a numpy that the installed jax accepts.
    jax_numpy = [
      r
      for r in importlib.metadata.requires("jax")
      if re.match(r"numpy\b", r) and "extra" not in r and "python_version" not in r
    ]
    self.assertLen(jax_numpy, 1)
    self.assertLessEqual(lower_bound(pyproject_deps()["numpy"]), lower_bound(jax_numpy[0]))

  def test_install_page_states_the_range_and_every_pair(self):
    page = " ".join(read(INSTALL_PAGE).split())
    self.assertIn(
      f"`dm-haiku` {self.haiku[0]} to {self.haiku[-1]} and `jax` {self.jax[0]} to {self.jax[-1]}",
      page,
    )
    tested = re.search(r"Tested pairs: (.*?) \(`bash testing/version_matrix.sh`", page)[1]
    stated, haiku = [], None
    for v in re.findall(r"\d+\.\d+\.\d+", tested):  # Each jax goes with the dm-haiku before it.
      if v.startswith("0.0."):
        haiku = v
      else:
        stated.append((haiku, v))
    self.assertEqual(stated, self.pairs)

  def test_flax_extra_is_the_matrix_one_on_the_pairs_the_install_page_names(self):
    matrix = read("testing/version_matrix.sh")
    flax = re.search(r'^readonly FLAX_REQUIREMENT="(.*)"$', matrix, re.MULTILINE)[1]
    min_jax = re.search(r"^readonly FLAX_MIN_JAX=(\S+)$", matrix, re.MULTILINE)[1]
    extras = re.search(
      r"^\[project.optional-dependencies\]\n(.*?)^\[",
      read("pyproject.toml"),
      re.MULTILINE | re.DOTALL,
    )[1]
    self.assertIn(f'flax = ["{flax}"]', extras)
    self.assertNotIn('"flax', extras.split("test = [")[1])  # `.[test]` installs on every pair.
    with_flax = [j for j in self.jax if version(j) >= version(min_jax)]
    page = " ".join(read(INSTALL_PAGE).split())
    self.assertIn(
      f"`flax` (Flax ≥ {flax.split('>=')[1]}, which needs jax ≥ {min_jax}) on the "
      f"pairs with jax {', '.join(with_flax[:-1])} and {with_flax[-1]}",
      page,
    )

  def test_readme_install_section_links_the_install_page(self):
    install = re.search(r"^## Install\n(.*?)^## ", read("README.md"), re.MULTILINE | re.DOTALL)[1]
    self.assertIn("](docs/install.md)", install)

  def test_the_newest_leg_pins_the_newest_pair(self):
    # CI's newest-jax leg (//testing:newest_jax_test) runs the last pair past the tested set.
    pins = dict(
      re.findall(
        r"^(dm-haiku|jax|jaxlib)==(\S+)$", read("testing/requirements-newest.txt"), re.MULTILINE
      )
    )
    self.assertEqual((pins["dm-haiku"], pins["jax"]), matrix_pairs("NEWER_PAIRS")[-1])
    self.assertEqual(pins["jaxlib"], pins["jax"])

  def test_bazel_pins_a_tested_pair(self):
    pins = dict(re.findall(r"^(dm-haiku|jax)==(\S+)$", read("requirements.txt"), re.MULTILINE))
    self.assertIn((pins["dm-haiku"], pins["jax"]), self.pairs)


if __name__ == "__main__":
  absltest.main()
