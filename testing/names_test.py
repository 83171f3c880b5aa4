"""One meaning per name (issue 63): words the library once used for several things, held to one.

- **`num_steps`** counts a loop's steps: remat's (`remat/schedule.py`'s `Schedule`,
  `remat/step_checks.py`'s count of a scan's steps) and the scans that count through them. A
  pipeline's timetable counts ticks of its clock (`Timetable.num_ticks`), not steps of a loop.

Each word may appear only in the files listed for it, each with the reason it is there; a new file
that uses the word in another sense fails the test, and so does one of its old senses coming back.
"""

import glob
import os
import re

from absl.testing import absltest

# Under Bazel the test reads the checkout through its runfiles' links (as contributing_test does).
_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))

# `num_steps`: a loop's steps, where remat's are counted or read.
NUM_STEPS_FILES = {
  "haiku_bridge/_src/remat/": "remat's loops: a schedule's steps, the count of a scan's steps",
  "haiku_bridge/_src/layer_scan.py": "counts its layers through remat's num_steps",
  "haiku_bridge/_src/time_scan.py": "counts its steps through remat's num_steps",
  "haiku_bridge/_src/pipeline/pipeline_test.py": "reads the remat schedules a stage's loop ran",
}


def files_using(word: re.Pattern, patterns: tuple[str, ...]) -> list[str]:
  """The files under `_ROOT` matching `patterns` whose text has `word`, as relative paths."""
  found = set()
  for pattern in patterns:
    for path in glob.glob(os.path.join(_ROOT, pattern), recursive=True):
      with open(path, encoding="utf-8") as f:
        if word.search(f.read()):
          found.add(os.path.relpath(path, _ROOT))
  return sorted(found)


def outside(paths: list[str], allowed: dict[str, str]) -> list[str]:
  """The paths neither listed in `allowed` nor under a folder (`.../`) it lists."""
  return [
    p
    for p in paths
    if p not in allowed and not any(a.endswith("/") and p.startswith(a) for a in allowed)
  ]


class NamesTest(absltest.TestCase):
  def test_num_steps_counts_a_loops_steps_only(self):
    found = files_using(re.compile(r"\bnum_steps\b"), ("haiku_bridge/**/*.py",))
    self.assertIn("haiku_bridge/_src/remat/schedule.py", found)  # The scan sees the files.
    self.assertEqual(
      outside(found, NUM_STEPS_FILES),
      [],
      "num_steps names a loop's steps (remat); a pipeline's timetable counts ticks (num_ticks)",
    )


if __name__ == "__main__":
  absltest.main()
