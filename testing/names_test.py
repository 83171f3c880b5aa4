"""One meaning per name (issue 63): words the library once used for several things, held to one.

- **layout** is XLA's word for how an HLO array's dimensions sit in memory (`f32[4,16]{1,0}`), and
  means nothing else here. The things it once named each have their own word: a pipeline's
  **placement** of the stack on its stages (`pipeline/placement.py`, `Placement`); the
  **structure** of a pure function's params (`key_path.py`'s `_Structure`); a foreign module's
  **skeleton**, its params and state without their values (`foreign_module.py`'s cached skeletons,
  the adapters' `NnxSkeleton`, `LinenSkeleton`, `EquinoxSkeleton`); a checkpointed scan's **slot
  moves** (`remat/scheduled_scan.py`'s `_SlotMoves`); `hk.layer_stack`'s names and stacked
  **shapes**; and the repository's files, "Where things live" in CONTRIBUTING.md. (matplotlib's
  `tight_layout` is its own name.)
- **`num_steps`** counts a loop's steps: remat's (`remat/schedule.py`'s `Schedule`,
  `remat/step_checks.py`'s count of a scan's steps) and the scans that count through them. A
  pipeline's timetable counts ticks of its clock (`Timetable.num_ticks`), not steps of a loop.
- **A module's name** is used once in the library: two `schedule.py` files (remat's and a
  pipeline's) are now `remat/schedule.py` and `pipeline/timetables.py`.

Each word may appear only in the files listed for it, each with the reason it is there; a new file
that uses the word in another sense fails the test, and so does one of its old senses coming back.
"""

import os
import re

from absl.testing import absltest

# Under Bazel the test reads the checkout through its runfiles' links (as contributing_test does).
_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# What is read: the folders of the library, its tests, docs and examples, and the files at the
# root; text only, the docs' built site aside.
_FOLDERS = ("haiku_bridge", "testing", "docs", "examples", "bazel", ".ci")
_TEXT = re.compile(r"(\.(py|md|sh|bzl|toml|cfg|txt|yaml|yml|css)|^BUILD|^WORKSPACE|^\.bazelrc)$")
_SKIPPED_FOLDERS = {"_build", "__pycache__", ".hypothesis"}

# `layout`: an HLO array's layout, where HLO text is read.
LAYOUT_FILES = {
  "haiku_bridge/_src/hlo_text.py": "reads HLO types, their layouts and tiles",
  "haiku_bridge/_src/hlo_text_test.py": "its test",
  "haiku_bridge/_src/remat/hlo_flops.py": "reads HLO instructions, their types' layouts left out",
  "haiku_bridge/_src/remat/hlo_flops_test.py": "its test",
  "testing/benchmarks/results/RESULTS.md": "a TPU's tiled layout's bytes (hlo_text)",
  "CHANGELOG.md": "history: the names before, in the rename maps",
  "testing/names_test.py": "this test, which names the word",
}

# `num_steps`: a loop's steps, where remat's are counted or read.
NUM_STEPS_FILES = {
  "haiku_bridge/_src/remat/": "remat's loops: a schedule's steps, the count of a scan's steps",
  "haiku_bridge/_src/layer_scan.py": "counts its layers through remat's num_steps",
  "haiku_bridge/_src/time_scan.py": "counts its steps through remat's num_steps",
  "haiku_bridge/_src/pipeline/pipeline_test.py": "reads the remat schedules a stage's loop ran",
}


def text_files() -> list[str]:
  """The text files read, as paths relative to the root (links to folders not followed)."""
  found = [f for f in os.listdir(_ROOT) if _TEXT.search(f) and os.path.isfile(_path(f))]
  for folder in _FOLDERS:
    for top, dirs, files in os.walk(_path(folder)):
      dirs[:] = [d for d in dirs if d not in _SKIPPED_FOLDERS]
      found += [os.path.relpath(os.path.join(top, f), _ROOT) for f in files if _TEXT.search(f)]
  return sorted(found)


def _path(relative: str) -> str:
  return os.path.join(_ROOT, relative)


def files_using(word: re.Pattern, paths: list[str]) -> list[str]:
  """The `paths` whose text has `word`."""
  found = []
  for path in paths:
    with open(_path(path), encoding="utf-8") as f:
      if word.search(f.read()):
        found.append(path)
  return found


def outside(paths: list[str], allowed: dict[str, str]) -> list[str]:
  """The paths neither listed in `allowed` nor under a folder (`.../`) it lists."""
  return [
    p
    for p in paths
    if p not in allowed and not any(a.endswith("/") and p.startswith(a) for a in allowed)
  ]


class NamesTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.files = text_files()

  def test_the_scan_reads_the_tree(self):
    for path in ("README.md", "CONTRIBUTING.md", "haiku_bridge/_src/hlo_text.py", "docs/remat.md"):
      self.assertIn(path, self.files)
    self.assertFalse([p for p in self.files if "/_build/" in p or p.endswith(".png")])

  def test_layout_means_an_hlo_layout_only(self):
    # matplotlib's `Figure.tight_layout()` is its name, not ours.
    found = files_using(re.compile(r"layout(?<!tight_layout)", re.IGNORECASE), self.files)
    self.assertIn("haiku_bridge/_src/hlo_text.py", found)
    self.assertEqual(
      outside(found, LAYOUT_FILES),
      [],
      "'layout' is XLA's word for an HLO array's layout; say placement (a pipeline's stages), "
      "structure (key paths), skeleton (foreign modules), slot moves (a checkpointed scan), "
      "shapes (a stack's params) or where things live (the repository)",
    )
    # Each listed file still uses it: a stale entry would let the word back in unseen.
    self.assertEqual(outside(list(LAYOUT_FILES), dict.fromkeys(found, "")), [])

  def test_num_steps_counts_a_loops_steps_only(self):
    library = [p for p in self.files if p.startswith("haiku_bridge/") and p.endswith(".py")]
    found = files_using(re.compile(r"\bnum_steps\b"), library)
    self.assertIn("haiku_bridge/_src/remat/schedule.py", found)
    self.assertEqual(
      outside(found, NUM_STEPS_FILES),
      [],
      "num_steps names a loop's steps (remat); a pipeline's timetable counts ticks (num_ticks)",
    )

  def test_each_module_name_once_in_the_library(self):
    # One module per name: `remat/schedule.py` beside a `pipeline/schedule.py`
    # (now `timetables.py`) made a reader ask which schedule was meant.
    by_name: dict[str, list[str]] = {}
    for path in self.files:
      if path.startswith("haiku_bridge/") and path.endswith(".py"):
        by_name.setdefault(os.path.basename(path), []).append(path)
    self.assertGreater(len(by_name), 40)
    twice = {n: sorted(p) for n, p in by_name.items() if len(p) > 1 and n != "__init__.py"}
    self.assertEqual(twice, {}, "name each module for what it holds, once in the library")


if __name__ == "__main__":
  absltest.main()
