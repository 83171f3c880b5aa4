"""Importing haiku_bridge warns once past the tested jax / dm-haiku, and is silent within them."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from typing import Any
import warnings

from absl.testing import absltest

from haiku_bridge._src import versions

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def import_with(jax_version: str, haiku_version: str) -> tuple[list[dict[str, Any]], str]:
  """What `import haiku_bridge` warns in a fresh process whose jax and Haiku report these versions.

  The import is line 6 of a file `importer.py`, run as a script. Returns each warning as
  `{"category", "message", "filename", "lineno"}`, the category by its public name
  (`hkb.<name>`), and the file's path.
  """
  code = textwrap.dedent(f"""\
      import json, warnings
      import haiku, jax
      jax.__version__, haiku.__version__ = {jax_version!r}, {haiku_version!r}
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import haiku_bridge as hkb
      print(json.dumps([{{
          "category": next((f"hkb.{{n}}" for n in hkb.__all__ if getattr(hkb, n) is w.category),
                           w.category.__name__),
          "message": str(w.message), "filename": w.filename, "lineno": w.lineno}}
                        for w in caught]))
      """)
  with tempfile.TemporaryDirectory() as directory:
    path = os.path.join(directory, "importer.py")
    with open(path, "w") as f:
      f.write(code)
    # haiku_bridge from where this test has it (a script's own folder comes first on its path).
    env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      PYTHONPATH=os.pathsep.join([_ROOT] + [p for p in sys.path if p]),
    )
    run = subprocess.run(
      [sys.executable, path], cwd=_ROOT, capture_output=True, text=True, check=True, env=env
    )
  return json.loads(run.stdout.strip().splitlines()[-1]), path


class VersionsTest(absltest.TestCase):
  def test_release(self):
    self.assertEqual(versions.release("0.10.2"), (0, 10, 2))
    self.assertEqual(versions.release("0.0.17"), (0, 0, 17))
    self.assertEqual(versions.release("0.11.0rc1"), (0, 11, 0))
    self.assertGreater(versions.release("0.10.10"), versions.release("0.10.2"))

  def test_untested_names_only_newer_releases(self):
    low_jax, high_jax = versions.TESTED["jax"]
    low_haiku, high_haiku = versions.TESTED["dm-haiku"]
    self.assertEqual(versions.untested({"jax": high_jax, "dm-haiku": high_haiku}), [])
    self.assertEqual(versions.untested({"jax": low_jax, "dm-haiku": low_haiku}), [])
    self.assertEqual(
      versions.untested({"jax": "0.10.3", "dm-haiku": "0.0.18"}), ["jax 0.10.3", "dm-haiku 0.0.18"]
    )

  def test_warning_names_both_and_the_tested_range(self):
    # Recorded, not `assertWarns`: that reads every module's `__warningregistry__`, and without
    # Flax, dm-haiku's stand-in for `haiku.experimental.flax` raises on any attribute.
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      versions.warn_if_untested({"jax": "0.11.0", "dm-haiku": "0.0.17"})
    self.assertLen(caught, 1)
    self.assertIs(caught[0].category, versions.UntestedVersionWarning)
    # Said where warn_if_untested was called, not inside it (by default; on import, haiku_bridge's
    # __init__ asks for its importer: test_import_warns_past_the_tested_set_by_a_public_name).
    self.assertEqual(caught[0].filename, __file__)
    text = str(caught[0].message)
    self.assertIn("jax 0.6.0 to 0.10.2 and dm-haiku 0.0.14 to 0.0.17", text)
    self.assertIn("this is jax 0.11.0,", text)
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      # Silent at the newest tested pair (the installed one may be newer: the version matrix
      # runs these tests past the tested set too).
      versions.warn_if_untested({name: high for name, (_, high) in versions.TESTED.items()})

  def test_import_warns_past_the_tested_set_by_a_public_name(self):
    caught, importer = import_with("0.10.3", versions.TESTED["dm-haiku"][1])
    newer = [w for w in caught if "haiku_bridge is tested with" in w["message"]]
    self.assertLen(newer, 1)
    self.assertEqual(newer[0]["category"], "hkb.UntestedVersionWarning")
    self.assertIn("this is jax 0.10.3,", newer[0]["message"])
    # Said at the user's import, the line that reads `import haiku_bridge`, not inside the library.
    self.assertEqual((newer[0]["filename"], newer[0]["lineno"]), (importer, 6))
    # (On the tested set it is silent: test_warning_names_both_and_the_tested_range.)


if __name__ == "__main__":
  absltest.main()
