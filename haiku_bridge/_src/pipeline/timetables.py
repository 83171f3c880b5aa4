"""A pipeline's timetable: which stage runs which visit of which microbatch at each tick.

Both schedules run from one (`Pipeline.schedule`): GPipe is the timetable of
one pass (`repeats=1`), circular that of several. The stages run it
(`stage_program.py`); the checks that lay a pipeline out make it (`staging.py`).
"""

from typing import Any, NamedTuple

import numpy as np


class Timetable(NamedTuple):
  """At each tick, each stage runs one visit of a microbatch, or idles.

  A tick is one step of the pipeline's clock (the docs and `PipelineCost.steps`
  call them the timetable's steps); the library's code says ticks, as a
  loop's steps are another thing (`remat/`).

  A microbatch visits the stages 0, 1, ..., S-1 in turn, `repeats` times
  (passes). Visits are numbered in periods of P = max(M, S) ticks, visit
  `k = r·P + m` being pass r of microbatch m, and stage s runs visit k at
  tick k + s. So pass r + 1 of a microbatch reaches stage 0 no earlier than
  pass r leaves stage S - 1. An idle slot (k < 0, r ≥ repeats, m ≥ M) still
  computes, on a real microbatch, and its result is masked out: it is the
  bubble.

  Attributes:
    active: `[ticks, stages]` bool, whether the stage runs a visit.
    repeat: `[ticks, stages]`, the pass of that visit (clipped where idle).
    microbatch: `[ticks, stages]`, its microbatch (clipped where idle).
    period: P, the ticks between two passes of a microbatch at one stage.
  """

  active: np.ndarray
  repeat: np.ndarray
  microbatch: np.ndarray
  period: int

  @property
  def num_ticks(self) -> int:
    return self.active.shape[0]

  @property
  def bubble(self) -> float:
    """Idle stage-ticks over all stage-ticks."""
    return float(1 - self.active.mean())

  def tick_of(self, stage: Any, repeat: Any, microbatch: Any) -> Any:
    """The tick at which `stage` runs pass `repeat` of `microbatch` (ints or arrays)."""
    return repeat * self.period + microbatch + stage


def timetable(num_stages: int, microbatches: int, repeats: int = 1) -> Timetable:
  """The timetable of `num_stages` stages, `microbatches` microbatches, `repeats` passes.

  >>> from haiku_bridge._src import pipeline
  >>> gpipe = pipeline.timetable(4, 8)
  >>> gpipe.num_ticks, round(gpipe.bubble, 4), round(3 / (8 + 3), 4)
  (11, 0.2727, 0.2727)
  >>> circular = pipeline.timetable(4, 8, repeats=2)
  >>> circular.num_ticks, round(circular.bubble, 4), round(3 / (2 * 8 + 3), 4)
  (19, 0.1579, 0.1579)
  >>> circular.active.astype(int)[:10].T  # Stage 0 starts pass 1 at tick 8.
  array([[1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
         [0, 1, 1, 1, 1, 1, 1, 1, 1, 1],
         [0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
         [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
  """
  period = max(microbatches, num_stages)
  ticks = (repeats - 1) * period + microbatches + num_stages - 1
  visit = np.arange(ticks)[:, None] - np.arange(num_stages)[None, :]
  repeat, micro = np.divmod(np.maximum(visit, 0), period)
  active = (visit >= 0) & (repeat < repeats) & (micro < microbatches)
  return Timetable(
    active, np.minimum(repeat, repeats - 1), np.minimum(micro, microbatches - 1), period
  )
