"""`step_budget_figures`: the committed tables are its JSON written out, each phase writes them, each cold repeat searches."""

import json
import os
import tempfile
from unittest import mock

from absl.testing import absltest

from testing.benchmarks import step_budget_figures as sbf

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def _read(name: str, run: str = "") -> dict:
  with open(os.path.join(RESULTS, "step_budget_tpu", run, f"{name}.json")) as f:
    return json.load(f)


class TablesTest(absltest.TestCase):
  def test_the_committed_tables_are_the_json_written_out(self):
    tables = sbf.markdown(_read("cold"), _read("warm"))
    with open(os.path.join(RESULTS, "step_budget_tpu", "step_budget.md")) as f:
      self.assertEqual(tables, f.read().rstrip("\n"))
    # remat_auto.md shows each table as the script writes it.
    with open(os.path.join(RESULTS, "remat_auto.md")) as f:
      page = f.read()
    tables = [block for block in tables.split("\n\n") if block.startswith("|")]
    self.assertLen(tables, 2)
    for table in tables:
      self.assertIn(table, page)
    # The run since the second process compiles the kept plan beside plain's lowering.
    run = "second_process_hint"
    with open(os.path.join(RESULTS, "step_budget_tpu", run, "step_budget.md")) as f:
      self.assertEqual(sbf.markdown(_read("cold", run), _read("warm", run)), f.read().rstrip("\n"))

  def test_a_refused_compile_and_a_second_process_in_their_rows(self):
    cold, warm = _read("cold"), _read("warm")
    rows = sbf.markdown(cold, warm).splitlines()
    # XLA's refusal in its words; the 5.6e9 budget's search: three compiles and three drafts
    # (cold.json's tries: six), the plain step's out of memory; the second process's first
    # call against remat=True's compile (9.68 s / the median of 9.69, 9.60, 9.34 s).
    self.assertIn("42.04G of temporaries over 15.75G", rows[4])
    (schedule,) = [r for r in rows if "| 5,600,000,000 |" in r]
    self.assertIn(
      "| binomial, 12 slots | 3 and 3 drafts (remat=False out of memory in 1.8 s) |", schedule
    )
    self.assertTrue(schedule.endswith("| 9.68 | 1.01 |"), schedule)
    (true,) = [r for r in rows if "| 7,730,000,000 |" in r]
    self.assertIn("| `remat=True` | 2 (remat=False out of memory in 1.8 s) |", true)
    # Without the second process, its columns are empty.
    (schedule,) = [r for r in sbf.markdown(cold).splitlines() if "| 5,600,000,000 |" in r]
    self.assertTrue(schedule.endswith("| 1.83 |  |  |"), schedule)

  def test_the_tables_are_written_from_the_phases_run(self):
    with tempfile.TemporaryDirectory() as out:
      written = os.path.join(out, "step_budget.md")
      sbf._write_tables(out)  # pylint: disable=protected-access
      self.assertFalse(os.path.exists(written))  # No phase yet.
      for phase in ("cold", "warm"):
        with open(os.path.join(out, f"{phase}.json"), "w") as f:
          json.dump(_read(phase), f)
        sbf._write_tables(out)  # pylint: disable=protected-access
        with open(written) as f:
          want = sbf.markdown(_read("cold"), _read("warm") if phase == "warm" else None)
          self.assertEqual(f.read(), want + "\n", phase)

  def test_the_sweeps_model_named_where_the_run_recorded_it(self):
    cold = dict(_read("cold"), sweep_model={"seq": 1024})
    self.assertIn("`remat=False` by batch of {'seq': 1024}:", sbf.markdown(cold))


class ColdRepeatsTest(absltest.TestCase):
  def test_each_compile_starts_from_the_bridges_memory_cleared_and_its_plan_files_kept(self):
    seen = []
    clear = lambda: seen.append(os.environ.get("HAIKU_BRIDGE_CACHE_DIR"))
    with mock.patch.dict(os.environ, {"HAIKU_BRIDGE_CACHE_DIR": "/plans"}):
      with mock.patch.object(sbf.hkb, "clear_caches", clear):
        sbf._cleared()  # pylint: disable=protected-access
      self.assertEqual(os.environ["HAIKU_BRIDGE_CACHE_DIR"], "/plans")
    self.assertEqual(seen, [""])  # Cleared, with nothing on disk to clear.

  def test_each_cold_repeat_searches_and_the_last_keeps_its_plan_for_the_second_process(self):
    size, budget = sbf.SMALL_SIZES[0][1], 3_000_000  # remat=False fits: the cheapest search.
    with tempfile.TemporaryDirectory() as plans:
      with mock.patch.dict(os.environ, {"HAIKU_BRIDGE_CACHE_DIR": plans}):
        cold = sbf.budgeted(size, budget, repeats=1, cold_repeats=2)
        warm = sbf.budgeted(size, budget, repeats=1, cold_repeats=1, cold=False)
    self.assertLen(cold["first_samples"], 2)
    self.assertTrue(cold["same_plans"])
    self.assertFalse(cold["kept"])  # Its last repeat searched: the first kept nothing on disk.
    self.assertTrue(warm["kept"])  # The second process read the last one's plan.
    self.assertEqual(warm["loops"], cold["loops"])


if __name__ == "__main__":
  absltest.main()
