"""The search down a budgeted step's ladder of plans, on compiles faked to lie where XLA's do: the first rung that fits, in few compiles."""

import fractions
import math
import threading
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized

from haiku_bridge._src.remat import step_compiles
from haiku_bridge._src.remat import step_search


def _compiled(size: int, lowered=None) -> step_compiles.Compiled:
  """A compile of `size` bytes, as the search records it (no program)."""
  analysis = mock.Mock(
    argument_size_in_bytes=1,
    output_size_in_bytes=1,
    alias_size_in_bytes=0,
    temp_size_in_bytes=1,
    generated_code_size_in_bytes=0,
  )
  return step_compiles.Compiled(
    size, mock.Mock(**{"memory_analysis.return_value": analysis}), 0.0, lowered, False
  )


class AheadTest(absltest.TestCase):
  def test_the_next_rung_lowers_while_one_compiles_and_only_asked_rungs_compile(self):
    rungs = [step_search.Rung(step_search.PLAIN), step_search.Rung(step_search.REMAT)] + [
      step_search.Rung(step_search.SCHEDULE, fractions.Fraction(k)) for k in (1, 2, 3)
    ]
    sizes = dict(zip(rungs, (100, 60, 52, 45, 40)))
    loops = [step_search.TracedLoop(8, False, math.inf, 4)]
    lowered_ahead = {rung: threading.Event() for rung in rungs}
    compiled, overlapped = [], {}

    def lower_at(rung):
      lowered_ahead[rung].set()
      return rung, 0.0

    def compile_lowered(rung, seconds):
      # Plain's and remat=True's compiles wait (briefly) for the rung the
      # search asks for after them to be lowered on the caller's thread.
      after = {rungs[0]: rungs[1], rungs[1]: rungs[-1]}.get(rung)
      if after is not None:
        overlapped[rung] = lowered_ahead[after].wait(timeout=5)
      compiled.append(rung)
      return _compiled(sizes[rung], rung)

    for budget, asked in ((50, 4), (100, 1)):  # A schedule (two tries aimed), or plain.
      compiled.clear()
      ahead = step_compiles.Ahead(lower_at, compile_lowered)
      try:
        found = step_search.Search(budget, math.inf, rungs, loops, ahead)
        chosen = found.run()
      finally:
        ahead.close()
      one_by_one = step_search.Search(
        budget, math.inf, rungs, loops, lambda r: _compiled(sizes[r], r)
      )
      self.assertEqual(chosen, one_by_one.run())
      self.assertEqual(found.made, one_by_one.made)
      self.assertLen(found.made, asked)
      self.assertEqual(compiled, list(found.tried))  # Nothing compiled unasked.
    self.assertEqual(overlapped, {rungs[0]: True, rungs[1]: True})

  def test_remat_true_compiles_beside_plain_and_the_drafts_beside_it(self):
    loops = [step_search.TracedLoop(16, False, math.inf, 64)]
    ladder = step_search.ladder(loops, math.inf)
    kept = [step_search.carries_kept(rung, loops) for rung in ladder]
    sizes = dict(zip(ladder, [50_000, 20_000 + kept[1]] + [20_000 + x for x in kept[2:]]))
    budget = sizes[ladder[-4]]
    with_plain = threading.Barrier(2, timeout=5)  # Plain's and remat=True's compiles.
    with_drafts = threading.Barrier(4, timeout=5)  # remat=True's and the three drafts.
    together = {}

    def meet(barrier, key):
      try:
        barrier.wait()
        together[key] = True
      except threading.BrokenBarrierError:
        together[key] = False

    def compile_lowered(rung, seconds):
      if rung in ladder[:2]:
        meet(with_plain, (rung, "plain"))
      if rung == ladder[1]:
        meet(with_drafts, (rung, "drafts"))
      return _compiled(sizes[rung], rung)

    def draft_lowered(rung, seconds):
      meet(with_drafts, ("draft", rung))
      return _compiled(sizes[rung] + 100, rung)._replace(draft=True)

    ahead = step_compiles.Ahead(lambda rung: (rung, 0.0), compile_lowered, draft_lowered)
    try:
      search = step_search.Search(budget, math.inf, ladder, loops, ahead)
      chosen = search.run()
    finally:
      ahead.close()
    self.assertEqual(chosen, ladder[-4])
    # Each compile met the others it runs beside: plain and remat=True, then
    # remat=True and three drafts.
    self.assertEqual(together, dict.fromkeys(together, True))
    self.assertLen(together, 6)
    # The drafts aim exactly, their offset everywhere 100: the rung before
    # the aim, then the aim, on the line through it at the drafts' slope.
    self.assertEqual(
      [t.rung for t in search.made if not t.draft],
      [rung.describe() for rung in (*ladder[:2], *ladder[-5:-3])],
    )


class AimTest(parameterized.TestCase):
  """The search's compiles where a schedule's bytes lie on a line in the carries kept, remat=True's off it (as XLA:CPU compiles them: LadderTest)."""

  @parameterized.named_parameters(
    # Each slot a carry's bytes (a loop, two, a layer stack); three carries
    # (a vmap over an ensemble of three members' params, the loop seeing
    # one member's carry).
    ("a_carry_a_slot", 1.0, 4),
    ("three_carries_a_slot", 3.0, 4),
    # Less than a carry a slot: the first aim (a whole carry) may miss,
    # never decide: the choice is still the first that fits.
    ("half_a_carry_a_slot", 0.5, 5),
  )
  def test_the_least_rung_and_the_line_through_it_find_the_first_that_fits(self, slope, most):
    loops = [step_search.TracedLoop(16, False, math.inf, 64)]
    ladder = step_search.ladder(loops, math.inf)
    kept = [step_search.carries_kept(rung, loops) for rung in ladder]
    # Plain holds most; remat=True two carries' worth below the schedules'
    # line (it keeps its carries in another program); then the line.
    sizes = [50_000, round(20_000 + slope * (kept[1] - 2 * 64))]
    sizes += [round(20_000 + slope * x) for x in kept[2:]]
    fake = dict(zip(ladder, sizes))
    for budget in sorted({*sizes, *(size - 1 for size in sizes)}):
      first = next((rung for rung, size in zip(ladder, sizes) if size <= budget), None)
      search = step_search.Search(
        budget, math.inf, ladder, loops, lambda rung: _compiled(fake[rung])
      )
      with self.subTest(budget=budget):
        self.assertEqual(search.run(), first)
        self.assertLessEqual(len(search.made), most)


class AsRunsTest(absltest.TestCase):
  def test_the_aims_compile_as_the_step_runs_the_other_tries_measure(self):
    # Where tries measure (the CPU's cheaper compiles), an aim between two
    # compiled rungs is the choice as a rule: compiled as the step runs, it
    # is measured and made at once.
    loops = [step_search.TracedLoop(16, False, math.inf, 64)]
    ladder = step_search.ladder(loops, math.inf)
    kept = [step_search.carries_kept(rung, loops) for rung in ladder]
    fake = dict(zip(ladder, [50_000, 20_000 + kept[1] - 128] + [20_000 + x for x in kept[2:]]))
    for budget in sorted(set(fake.values()))[2:-1]:
      ahead = step_compiles.Ahead(
        lambda rung: (rung, 0.0),
        lambda rung, seconds: _compiled(fake[rung], rung)._replace(measuring=True),
        None,
        lambda rung, seconds: _compiled(fake[rung], rung),
      )
      try:
        search = step_search.Search(budget, math.inf, ladder, loops, ahead)
        chosen = search.run()
      finally:
        ahead.close()
      with self.subTest(budget=budget):
        self.assertEqual(chosen, next(r for r in ladder if fake[r] <= budget))
        ends = (ladder[0], ladder[1], ladder[-1])  # Plain, remat=True, the least.
        self.assertEqual(
          {rung: done.measuring for rung, done in search.tried.items()},
          {rung: rung in ends for rung in search.tried},
        )


class LineTest(parameterized.TestCase):
  """The first rung the schedules' line puts within a budget, found by bisection, is the first a walk down the ladder finds."""

  @parameterized.named_parameters(
    ("a_loop", [(16, False, math.inf)]),
    ("two_loops_bounded_apart", [(16, False, math.inf), (9, False, 2.0)]),
    ("a_policy_and_a_short_loop", [(12, True, 3.0), (2, False, math.inf)]),
  )
  def test_the_bisection_finds_what_a_walk_finds(self, specs):
    loops = [step_search.TracedLoop(n, policy, most, 64) for n, policy, most in specs]
    ladder = step_search.ladder(loops, 3.0)
    kept = [step_search.carries_kept(rung, loops) for rung in ladder]
    # What the bisection rests on: the carries kept never grow down it.
    self.assertEqual(kept, sorted(kept, reverse=True))
    search = step_search.Search(0, 3.0, ladder, loops, lambda rung: None)
    for over in range(len(ladder)):
      for fits in range(over + 1, len(ladder)):
        for slope in (-64.0, 0.0, 0.5, 64.0, 192.0):
          line = [10_000 + slope * (x - kept[fits]) for x in kept]
          for budget in sorted({*line, *(b - 1 for b in line)}):
            walk = next((i for i in range(over + 1, fits) if line[i] <= budget), None)
            got = search._first_on_line(over, fits, kept[fits], 10_000, slope, budget)  # pylint: disable=protected-access
            self.assertEqual(got, walk, (over, fits, slope, budget))

  def test_a_long_loop_plans_reading_few_rungs(self):
    # A loop of 4,096 steps: a ladder of thousands of rungs, each rung's
    # carries a bisection of its own; the search reads a few dozen.
    loops = [step_search.TracedLoop(4096, False, math.inf, 64)]
    ladder = step_search.ladder(loops, 3.0)
    self.assertGreater(len(ladder), 4000)
    # As AimTest's: plain over all, remat=True two carries below the line.
    fake = {rung: 1_000 + step_search.carries_kept(rung, loops) for rung in ladder}
    fake.update({ladder[0]: 10**9, ladder[1]: fake[ladder[1]] - 2 * 64})
    budget = fake[ladder[len(ladder) // 3]]
    with mock.patch.object(step_search, "carries_kept", wraps=step_search.carries_kept) as read:
      search = step_search.Search(budget, 3.0, ladder, loops, lambda rung: _compiled(fake[rung]))
      chosen = search.run()
    self.assertEqual(chosen, next(r for r in ladder if fake[r] <= budget))
    self.assertLess(read.call_count, 100)


class LadderTest(absltest.TestCase):
  def test_every_schedule_within_the_bound_in_order_of_recomputation(self):
    for lengths in ([10], [2048], [3, 1, 2], [24, 31], [100, 7, 7], [13, 64, 200]):
      for max_recompute in (0.5, 1.0, 1.0000001, 1.3, 1.7, 2.0, 2.9999, 3.0, math.inf):
        loops = [step_search.TracedLoop(n, i % 2 == 0, math.inf, 8) for i, n in enumerate(lengths)]
        # Each loop's schedules, slot by slot, the steps they recompute beyond remat=True's
        # over its length, compared with the bound as fractions.
        extras = {
          fractions.Fraction(step_search.remat_schedule.binomial_cost(n, slots), n)
          for n in lengths
          for slots in range(1, n - 1)
        }
        bound = (
          max_recompute - 1 if max_recompute == math.inf else fractions.Fraction(max_recompute - 1)
        )
        within = sorted(e for e in extras if 0 < e <= bound)
        first = [step_search.Rung(step_search.PLAIN)]
        first += [step_search.Rung(step_search.POLICY), step_search.Rung(step_search.REMAT)]
        self.assertEqual(
          step_search.ladder(loops, max_recompute),
          first + [step_search.Rung(step_search.SCHEDULE, e) for e in within],
          (lengths, max_recompute),
        )


class OnLadderTest(absltest.TestCase):
  def test_a_rung_is_on_the_ladder_where_the_ladder_holds_it(self):
    for specs in (
      [(16, False)],
      [(2, True), (9, False), (16, False)],
      [(3, False), (1, False), (0, False)],
    ):
      loops = [step_search.TracedLoop(n, policy, math.inf, 64) for n, policy in specs]
      ladder = set(step_search.ladder(loops, math.inf))
      rungs = {
        step_search.Rung(kind, fractions.Fraction(top, bottom))
        for kind in range(-1, 5)
        for bottom in (1, 2, 3, 9, 16, 32)
        for top in range(-1, 3 * bottom)
      }
      for rung in rungs | ladder:
        self.assertEqual(step_search.on_ladder(rung, loops), rung in ladder, (specs, rung))


class _Rounds(step_compiles.OneByOne):
  """`OneByOne`, counting the rounds of compiles the search waits for: those it started together are one."""

  def __init__(self, compile_at, draft_at):
    super().__init__(compile_at, draft_at)
    self.rounds = 0
    self._started, self._running = set(), set()

  def start(self, rung):
    self._started.add(rung)

  def __call__(self, rung, as_runs=False):
    if rung in self._running:  # Compiled beside the round's first.
      self._running.remove(rung)
    else:
      self.rounds += 1
      self._running, self._started = self._started - {rung}, set()
    return super().__call__(rung, as_runs)


class DraftTest(parameterized.TestCase):
  """The search where drafts (`measure.draft_options`, on a TPU) hold more than the step as it runs, by a constant along the schedules and another at remat=True (as XLA:TPU at O0 compiles them: remat_auto.md)."""

  @parameterized.named_parameters(
    # (offset at remat=True, at the schedules, the drafts' slope against
    # the step's, the most full compiles): as on the TPU, remat=True's
    # offset under the schedules' by less than a slot's bytes (the aim a
    # rung late at most: the rung before it decides, or the line through it
    # aims at the aim), and by more; equal; over them (the aim early: the
    # line through the rung before it aims on); the drafts' slope a fifth
    # off, steeper (a rung before the one compiled said over by less than a
    # quarter slot: compiled, it fits) or shallower. A slot holds a carry:
    # 64 bytes.
    ("tpu_like", 2_600, 2_660, 1.0, 4),
    ("two_rungs_late", 2_580, 2_700, 1.0, 4),
    ("equal", 3_000, 3_000, 1.0, 4),
    ("early", 3_100, 3_000, 1.0, 4),
    ("a_steeper_slope", 3_000, 3_000, 1.2, 5),
    ("a_shallower_slope", 3_000, 3_000, 0.8, 5),
  )
  def test_the_drafts_line_finds_the_first_that_fits(self, at_true, along, slope, most):
    loops = [step_search.TracedLoop(16, False, math.inf, 64)]
    ladder = step_search.ladder(loops, math.inf)
    kept = [step_search.carries_kept(rung, loops) for rung in ladder]
    sizes = [50_000, round(20_000 + (kept[1] - 2 * 64))]
    sizes += [round(20_000 + x) for x in kept[2:]]
    fake = dict(zip(ladder, sizes))
    drafts = {ladder[1]: sizes[1] + at_true}
    drafts.update(
      (rung, round(20_000 + along + slope * x)) for rung, x in zip(ladder[2:], kept[2:])
    )
    for budget in sorted({*sizes, *(size - 1 for size in sizes)}):
      first = next((rung for rung, size in zip(ladder, sizes) if size <= budget), None)
      compiler = _Rounds(
        lambda r: _compiled(fake[r]), lambda r: _compiled(drafts[r])._replace(draft=True)
      )
      search = step_search.Search(budget, math.inf, ladder, loops, compiler)
      with self.subTest(budget=budget):
        self.assertEqual(search.run(), first)
        if first in ladder[:2]:  # remat=True compiled beside plain; no draft waited for.
          self.assertEqual((compiler.rounds, search.made[-1].draft), (1, False))
        if first is None or first.kind != step_search.SCHEDULE:
          continue
        # Three drafts beside remat=True's compile (itself beside plain's),
        # then the rung before the drafts' aim, then (where it is over, or
        # the line says a rung before it may fit) the line's aim: each
        # round a compile's time.
        full = len([t for t in search.made if not t.draft])
        self.assertLen([t for t in search.made if t.draft], 3)
        self.assertLessEqual((full, compiler.rounds), (most, most - 1))
        i = ladder.index(first)
        said = [
          size + along - at_true for size in sizes
        ]  # The drafts' line, remat=True's offset off.
        late = i + 1 < len(ladder) and said[i] > budget >= said[i + 1]
        clear = sizes[i - 1] - budget >= (sizes[i - 1] - sizes[i]) / 4
        if slope == 1.0 and i > 2 and late and clear:
          # The aim a rung late (the TPU's case) and the rung before over by
          # a quarter slot or more: one compile after remat=True's decides.
          self.assertEqual((full, compiler.rounds), (3, 2))

  def test_remat_true_compiles_beside_plain_the_drafts_beside_it_and_a_draft_without_bytes_aims_nothing(
    self,
  ):
    loops = [step_search.TracedLoop(16, False, math.inf, 64)]
    ladder = step_search.ladder(loops, math.inf)
    kept = [step_search.carries_kept(rung, loops) for rung in ladder]
    sizes = dict(zip(ladder, [50_000, 20_000 + kept[1]] + [20_000 + x for x in kept[2:]]))
    events = []

    class Recorded(step_compiles.Compiler):
      drafting = True

      def __call__(self, rung, as_runs=False):
        events.append(("wait", ladder.index(rung)))
        return _compiled(sizes[rung])

      def draft(self, rung):
        return _compiled(None)._replace(draft=True)  # Out of memory, or failed.

      def start(self, rung):
        events.append(("start", ladder.index(rung)))

      def start_draft(self, rung):
        events.append(("draft", ladder.index(rung)))

    budget = sizes[ladder[-4]]
    search = step_search.Search(budget, math.inf, ladder, loops, Recorded())
    self.assertEqual(search.run(), ladder[-4])
    self.assertEqual(
      events[:7],
      [
        ("start", 0),
        ("start", 1),  # Beside plain's compile.
        ("wait", 0),
        ("draft", 1),
        ("draft", 2 + (len(ladder) - 2) // 2),
        ("draft", len(ladder) - 1),
        ("wait", 1),
      ],
    )
    # No line from the drafts: the least rung is compiled, as without them.
    self.assertIn(("wait", len(ladder) - 1), events)


class RefusalTest(absltest.TestCase):
  def test_a_refusal_names_the_least_bytes_compiled_where_memory_does_not_fall(self):
    # remat=True holding less than every schedule (jax.jacrev on jax 0.12):
    # the refusal names its bytes, which the call then takes, not the last
    # rung's.
    rungs = [step_search.Rung(step_search.PLAIN), step_search.Rung(step_search.REMAT)] + [
      step_search.Rung(step_search.SCHEDULE, fractions.Fraction(k)) for k in (1, 2)
    ]
    sizes = dict(zip(rungs, (100, 40, 60, 50)))
    loops = [step_search.TracedLoop(8, False, math.inf, 4)]
    fake = lambda rung: _compiled(sizes[rung])
    search = step_search.Search(30, 3.0, rungs, loops, fake)
    self.assertIsNone(search.run())
    self.assertEqual(search.least_tried(), rungs[1])
    self.assertIn("Pass memory_budget=40 or more", search.refusal(False))
    self.assertEqual(step_search.Search(40, 3.0, rungs, loops, fake).run(), rungs[1])


if __name__ == "__main__":
  absltest.main()
