"""testing/gpu_check.sh names test files that exist and that Bazel runs too."""

import os
import re

from absl.testing import absltest

# Under Bazel the script is a runfiles link to the checkout's file: the listed
# tests and BUILD files are read beside it, in the checkout.
SCRIPT = os.path.realpath(os.path.join(os.path.dirname(__file__),
                                       "gpu_check.sh"))
ROOT = os.path.dirname(os.path.dirname(SCRIPT))


def gpu_tests() -> list[str]:
  with open(SCRIPT) as f:
    text = f.read()
  block = re.search(r"^GPU_TESTS=\((.*?)^\)", text, re.M | re.S)
  assert block, "GPU_TESTS=( ... ) not found in testing/gpu_check.sh"
  return block[1].split()


class GpuCheckTest(absltest.TestCase):

  def test_every_listed_file_is_a_bazel_test(self):
    files = gpu_tests()
    self.assertGreater(len(files), 10)
    for path in files:
      self.assertTrue(os.path.isfile(os.path.join(ROOT, path)), path)
      folder, name = os.path.split(path)
      with open(os.path.join(ROOT, folder, "BUILD")) as f:
        build = f.read()
      self.assertIn(f'name = "{name[:-len(".py")]}"', build, path)


if __name__ == "__main__":
  absltest.main()
