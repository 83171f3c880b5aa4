"""The `Literal` mode types and the runtime checks accept the same values.

A type checker reads the aliases of modes.py; a caller without one gets the runtime check of
`loop.from_options` / `Pipeline`. Each value of an alias runs, and each misspelling is refused
at run time with the library's error (the type checker's side: testing/typecheck_test.py).
"""

import typing

from absl.testing import absltest

import haiku_bridge as hkb
from haiku_bridge._src.remat import loop
from haiku_bridge._src import modes
from haiku_bridge._src import pipeline
from haiku_bridge._src import layer_scan


class ModesTest(absltest.TestCase):
  def test_public_names_are_the_aliases(self):
    self.assertIs(hkb.RematMode, modes.RematMode)
    self.assertIs(hkb.PipelineSchedule, modes.PipelineSchedule)
    self.assertEqual(
      set(typing.get_args(modes.RematMode)),
      {bool, typing.Literal["nested", "binomial"], typing.Literal["auto"]},
    )

  def test_every_remat_mode_runs_and_typos_are_refused(self):
    for remat in (False, True) + modes.REMAT_SCHEDULES:
      self.assertEqual(loop.from_options(remat=remat).remat, remat)
    self.assertEqual(loop.from_options(remat=modes.REMAT_AUTO, memory_budget=1 << 20).remat, "auto")
    self.assertEqual(loop.REMAT_SCHEDULES, modes.REMAT_SCHEDULES)
    for typo in ("nestd", "binomal", "Nested", "true"):
      with self.assertRaisesRegex(ValueError, r"`remat`"):
        loop.from_options(remat=typo)

  def test_every_pipeline_schedule_is_accepted_and_typos_are_refused(self):
    if not pipeline.jax_has_pipelines():
      self.skipTest("pipelines need jax.shard_map and jax.set_mesh")
    for schedule in modes.PIPELINE_SCHEDULES:
      self.assertEqual(hkb.Pipeline(schedule=schedule).schedule, schedule)
    self.assertEqual(pipeline.SCHEDULES, modes.PIPELINE_SCHEDULES)
    with self.assertRaisesRegex(ValueError, r"^hkb\.Pipeline: `schedule`"):
      hkb.Pipeline(schedule="circulr")  # type: ignore[arg-type]

  def test_repeat_layer_options_are_typed(self):
    # The TypedDict of `repeat_layer(**options)` names exactly the options it passes on.
    self.assertEqual(set(layer_scan.RepeatOptions.__annotations__), set(layer_scan._REPEAT_OPTIONS))
    self.assertIs(layer_scan.RepeatOptions.__annotations__["remat"], modes.RematMode)


if __name__ == "__main__":
  absltest.main()
