"""Tests for caches: the switch, the registry and its one clear (keys: fingerprint_test.py)."""

import os
import subprocess
import sys
from unittest import mock

from absl.testing import absltest

import haiku_bridge as hkb
from haiku_bridge._src import caches


class SwitchTest(absltest.TestCase):
  def test_disabled_keeps_nothing(self):
    cache = caches.Cache("switch")
    cache.put("k", 1)
    with caches.disabled():
      self.assertFalse(caches.enabled())
      self.assertIsNone(cache.get("k"))
      cache.put("j", 2)
    self.assertTrue(caches.enabled())
    self.assertIsNone(cache.get("j"))

  @mock.patch.object(caches, "_enabled", False)  # As HAIKU_BRIDGE_CACHES=0.
  def test_disabled_restores_off(self):
    with caches.disabled():
      pass
    self.assertFalse(caches.enabled())

  def test_environment_variable(self):
    code = "from haiku_bridge._src import caches; print(caches.enabled())"
    env = dict(os.environ, HAIKU_BRIDGE_CACHES="0", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
      [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    ).stdout
    self.assertEqual(out.strip(), "False")


class OnDiskTest(absltest.TestCase):
  @mock.patch.object(caches, "_enabled", True)  # The suite runs caches off too.
  def test_where_files_go_and_what_clears_them(self):
    root = self.create_tempdir().full_path
    store = caches.OnDisk("on_disk_test")
    with mock.patch.dict(os.environ, {"HAIKU_BRIDGE_CACHE_DIR": root}):
      self.assertEqual(caches.directory(), root)
      store.put("k", {"a": [1, 2]})
      self.assertEqual(os.listdir(os.path.join(root, "on_disk_test")), ["k.json"])
      self.assertEqual(store.get("k"), {"a": [1, 2]})
      self.assertIsNone(store.get("other"))
      with caches.disabled():  # Off: nothing read, nothing written.
        self.assertIsNone(store.get("k"))
        store.put("j", 1)
      self.assertIsNone(store.get("j"))
      hkb.clear_caches()  # Deletes the files too.
      self.assertIsNone(store.get("k"))
      # A file that is not JSON is a miss, never an error.
      os.makedirs(os.path.join(root, "on_disk_test"))
      with open(os.path.join(root, "on_disk_test", "bad.json"), "w") as f:
        f.write("{")
      self.assertIsNone(store.get("bad"))
      store.put("not_json", object())  # Not JSON: kept nowhere, no error.
      self.assertIsNone(store.get("not_json"))
    with mock.patch.dict(os.environ, {"HAIKU_BRIDGE_CACHE_DIR": ""}):
      self.assertIsNone(caches.directory())  # Set and empty: nowhere.
      store.put("k", 1)
      self.assertIsNone(store.get("k"))
    home = self.create_tempdir().full_path
    with mock.patch.dict(os.environ, {"XDG_CACHE_HOME": home}):
      os.environ.pop("HAIKU_BRIDGE_CACHE_DIR", None)
      self.assertEqual(caches.directory(), os.path.join(home, "haiku_bridge"))


class ClearCachesTest(absltest.TestCase):
  def test_clears_every_cache(self):
    cache = caches.Cache("test")
    cleared = []
    caches.register(lambda: cleared.append(True))
    cache.put("k", 1)
    self.assertEqual(cache.get("k"), 1)
    hkb.clear_caches()
    self.assertIsNone(cache.get("k"))
    self.assertEqual(cleared, [True])

  def test_every_memo_of_the_package_is_registered(self):
    # A `functools.lru_cache` anywhere in the package empties with the rest.
    memos = {
      f"{name}.{attr}": value
      for name, module in list(sys.modules.items())
      if name.startswith("haiku_bridge._src.")
      for attr, value in vars(module).items()
      if callable(getattr(value, "cache_clear", None))
    }
    self.assertIn("haiku_bridge._src.pytree.key_spec_of", memos)
    self.assertIn("haiku_bridge._src.remat.loop.schedule", memos)
    for name, memo in memos.items():
      with self.subTest(name):
        self.assertIn(memo.cache_clear, caches._CLEARERS)  # pylint: disable=protected-access

  def test_memoize(self):
    calls = []

    @caches.memoize(maxsize=None)
    def double(x):
      calls.append(x)
      return 2 * x

    self.assertEqual([double(1), double(1)], [2, 2])
    self.assertLen(calls, 1)
    hkb.clear_caches()
    self.assertEqual(double(1), 2)
    self.assertLen(calls, 2)
    with caches.disabled():  # Off: computed on every call, nothing kept.
      self.assertEqual([double(3), double(3)], [6, 6])
    self.assertLen(calls, 4)
    self.assertEqual(double.cache_info().currsize, 0)

  @mock.patch.object(caches, "_enabled", True)  # The suite runs caches off too.
  def test_lru_bound(self):
    cache = caches.Cache("small", max_entries=2)
    for key in "ab":
      cache.put(key, key)
    self.assertLen(cache, 2)  # Full, nothing dropped yet.
    self.assertEqual(cache.get("a"), "a")  # Now the most recently used.
    cache.put("c", "c")
    self.assertIsNone(cache.get("b"))  # The least recently used goes.
    self.assertEqual([cache.get("a"), cache.get("c")], ["a", "c"])

  def test_unhashable_key_is_a_miss(self):
    cache = caches.Cache("unhashable")
    calls = []
    compute = lambda: calls.append(1) or 7
    key = ("k", [1])  # A tuple holding a list.
    self.assertIsNone(cache.get(key))
    self.assertEqual(cache.get_or_compute(key, compute), 7)
    self.assertEqual(cache.get_or_compute(key, compute), 7)
    self.assertLen(calls, 2)

  def test_none_key_is_never_stored(self):
    cache = caches.Cache("none")
    calls = []
    compute = lambda: calls.append(1) or 7
    self.assertEqual(cache.get_or_compute(None, compute), 7)
    self.assertEqual(cache.get_or_compute(None, compute), 7)
    self.assertLen(calls, 2)


if __name__ == "__main__":
  absltest.main()
