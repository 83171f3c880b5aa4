"""Tests for remat_schedule: replayed on step numbers, against hand-written schedules."""

import functools
import itertools
import math
import tracemalloc

from absl.testing import absltest
from absl.testing import parameterized

from haiku_bridge._src.remat import schedule as remat_schedule
from haiku_bridge._src.remat.schedule import ADVANCE
from haiku_bridge._src.remat.schedule import BACKPROP
from haiku_bridge._src.remat.schedule import Action
from haiku_bridge._src.remat.schedule import NOWHERE
from haiku_bridge._src.remat.schedule import REGISTER

DEPTHS = list(range(1, 30)) + [63, 64, 65, 100, 128]


def griewank_advances(steps, slots):
  """Advances to reverse `steps` steps with `slots` slots: Griewank's binomial bound (1992).

  With s slots and each step advanced at most r times, C(s + r, s) steps can
  be reversed, with r·n − C(s + r, s + 1) advances (the first sweep's n − 1
  included). Written here from the paper, not from remat_schedule.
  """
  r = 0
  while math.comb(slots + r, slots) < steps:
    r += 1
  return r * steps - math.comb(slots + r, slots + 1) if steps > 1 else 0


@functools.lru_cache(maxsize=None)
def brute_force_cost(steps, free):
  """Fewest advanced steps over every way to split, by exhaustive recursion.

  Counts the first sweep's steps - 1 advances too.
  """
  if steps <= 1:
    return 0
  if free == 0:
    return steps * (steps - 1) // 2
  return min(
    cut + brute_force_cost(steps - cut, free - 1) + brute_force_cost(cut, free)
    for cut in range(1, steps)
  )


@functools.lru_cache(maxsize=None)
def cheapest_cut(steps, free):
  """The cheapest first cut of `steps` steps with `free` free slots.

  The leftmost of the cheapest, by exhaustive search over brute_force_cost;
  with no free slot the carry after the cut can only be in the register, so
  the cut is before the last step.
  """
  if free == 0:
    return steps - 1
  costs = [
    cut + brute_force_cost(steps - cut, free - 1) + brute_force_cost(cut, free)
    for cut in range(1, steps)
  ]
  return 1 + costs.index(min(costs))


def reference_schedule(steps, cut_rule, free):
  """A schedule built by plain recursion from `cut_rule(first, end, free)`.

  Written apart from remat_schedule's builder, for small `steps`: reverse
  [first, end) from the carry in `slot` = advance to the cut (the carry
  there kept in the lowest free slot, or only in the register when one step
  follows it), reverse the steps after the cut, then those before it.
  """
  in_use = set()

  def take():
    slot = min(set(range(len(in_use) + 1)) - in_use)
    in_use.add(slot)
    return slot

  def reverse(first, end, slot, free):
    if end - first == 1:
      return [Action(BACKPROP, first, slot, NOWHERE)]
    cut = cut_rule(first, end, free)
    keep = take() if end - cut > 1 else NOWHERE
    advance = [Action(ADVANCE, t, REGISTER, NOWHERE) for t in range(first, cut)]
    advance[0] = advance[0]._replace(load=slot)
    advance[-1] = advance[-1]._replace(store=keep)
    if keep == NOWHERE:
      after = [Action(BACKPROP, cut, REGISTER, NOWHERE)]
    else:
      after = reverse(cut, end, keep, free - 1)
      in_use.remove(keep)
    return advance + after + reverse(first, cut, slot, free)

  actions = reverse(0, steps, take(), free)
  slots_used = 1 + max([a.store for a in actions] + [0])
  # The forward sweep runs steps 0..steps-2 once and keeps what the first
  # advances of the plan keep; the backward sweep is the rest.
  lead = steps - 1
  forward_stores = [0] + [NOWHERE] * (steps - 1)
  for a in actions[:lead]:
    assert a.kind == ADVANCE, a
    if a.store != NOWHERE:
      forward_stores[a.step + 1] = a.store
  return remat_schedule.Schedule(steps, slots_used, tuple(forward_stores), tuple(actions[lead:]))


def assert_same_schedule(test, schedule, expected):
  test.assertEqual(
    (schedule.num_steps, schedule.num_slots, schedule.forward_stores, schedule.one_step_actions()),
    (expected.num_steps, expected.num_slots, expected.forward_stores, expected.actions),
  )


class NestedTest(parameterized.TestCase):
  def test_five_steps_in_two_groups(self):
    # Written by hand: groups [0, 1, 2] and [3, 4]. The forward sweep keeps
    # the carries entering steps 0 and 3; the register holds the one entering
    # step 4.
    schedule = remat_schedule.nested(5, groups=2)
    self.assertEqual(schedule.forward_stores, (0, NOWHERE, NOWHERE, 1, NOWHERE))
    self.assertEqual(
      schedule.actions,
      (
        Action(BACKPROP, 4, REGISTER, NOWHERE),
        Action(BACKPROP, 3, 1, NOWHERE),
        Action(ADVANCE, 0, 0, 1),  # Slot 1 is free again.
        Action(ADVANCE, 1, 1, NOWHERE),
        Action(BACKPROP, 2, REGISTER, NOWHERE),
        Action(BACKPROP, 1, 1, NOWHERE),
        Action(BACKPROP, 0, 0, NOWHERE),
      ),
    )
    self.assertEqual(schedule.num_slots, 2)
    self.assertEqual(schedule.recomputed_steps, 2)

  @parameterized.parameters(DEPTHS)
  def test_default_groups(self, steps):
    schedule = remat_schedule.nested(steps)
    remat_schedule.simulate(schedule)
    size = math.ceil(math.sqrt(steps))
    groups = math.ceil(steps / size)
    # While the last group is reversed, the slots hold every group's first
    # carry and the group's carries but its first and last (the register):
    # at most groups + size - 2, exactly that when the groups are even.
    self.assertLessEqual(schedule.num_slots, max(1, groups + size - 2))
    if steps == size * size:
      self.assertEqual(schedule.num_slots, max(1, groups + size - 2))
    # The last group's carries come from the forward sweep; in every other
    # group, every step but its last is recomputed once.
    self.assertEqual(schedule.recomputed_steps, (groups - 1) * (size - 1))

  def test_matches_a_recursive_reference(self):
    for steps in range(1, 25):
      for groups in range(1, steps + 1):
        size = -(-steps // groups)
        # A span longer than a group is cut after its first group; a group
        # is cut after its first step.
        rule = lambda first, end, free, size=size: first + (size if end - first > size else 1)
        schedule = remat_schedule.nested(steps, groups)
        remat_schedule.simulate(schedule)
        assert_same_schedule(self, schedule, reference_schedule(steps, rule, math.inf))

  def test_one_group_per_step_is_not_limited_by_recursion(self):
    # Every slot in use at once: 5000 levels of nesting. Builds in about
    # 0.02 s (not asserted).
    schedule = remat_schedule.nested(5000, groups=5000)
    remat_schedule.simulate(schedule)
    self.assertEqual(schedule.num_slots, 4999)  # And the register.
    self.assertEqual(schedule.recomputed_steps, 0)

  def test_any_number_of_groups(self):
    for steps, groups in itertools.product((1, 7, 12, 30), (1, 2, 3, 5, 40)):
      remat_schedule.simulate(remat_schedule.nested(steps, groups))

  def test_one_group_per_step_is_one_carry_per_step(self):
    schedule = remat_schedule.nested(8, groups=8)
    self.assertEqual(schedule.num_slots, 7)  # And the register.
    self.assertEqual(schedule.recomputed_steps, 0)

  @parameterized.parameters(0, -1, 2.0, True)
  def test_bad_groups(self, groups):
    with self.assertRaisesRegex(ValueError, "groups must be a positive int"):
      remat_schedule.nested(4, groups)


class BinomialTest(parameterized.TestCase):
  @parameterized.parameters(DEPTHS)
  def test_replays(self, steps):
    for slots in (1, 2, 3, 5, 9):
      schedule = remat_schedule.binomial(steps, slots)
      remat_schedule.simulate(schedule)
      self.assertLessEqual(schedule.num_slots, slots)
      self.assertEqual(schedule.recomputed_steps, remat_schedule.binomial_cost(steps, slots))

  def test_matches_a_recursive_reference(self):
    # Every slot count, each cut the cheapest by exhaustive search.
    rule = lambda first, end, free: first + cheapest_cut(end - first, free)
    for steps in range(1, 25):
      for slots in range(1, steps + 1):
        schedule = remat_schedule.binomial(steps, slots)
        remat_schedule.simulate(schedule)
        assert_same_schedule(self, schedule, reference_schedule(steps, rule, slots - 1))

  def test_a_slot_per_step_is_not_limited_by_recursion(self):
    # As many slots as steps: cuts nest as deep as slots are used. Builds
    # in about 0.1 s (not asserted).
    schedule = remat_schedule.binomial(5000, 5000)
    remat_schedule.simulate(schedule)
    self.assertEqual(schedule.recomputed_steps, 0)
    self.assertEqual(schedule.num_slots, 4999)  # And the register.

  def test_fewest_recomputations(self):
    for steps, slots in itertools.product(range(1, 13), range(1, 5)):
      self.assertEqual(
        remat_schedule.binomial_cost(steps, slots),
        brute_force_cost(steps, slots - 1) - (steps - 1),
        (steps, slots),
      )

  def test_griewank_closed_form(self):
    # Ground truth: the binomial bound (Griewank 1992), griewank_advances.
    for steps, slots in itertools.product((2, 5, 30, 99, 300, 1000), (1, 2, 3, 7, 20)):
      schedule = remat_schedule.binomial(steps, slots)
      remat_schedule.simulate(schedule)
      self.assertLessEqual(schedule.num_slots, slots)
      self.assertEqual(
        schedule.recomputed_steps, griewank_advances(steps, slots) - (steps - 1), (steps, slots)
      )

  def test_fewest_slots_for_one_more_forward_pass(self):
    # What remat="binomial" keeps (loop.schedule with no remat_groups).
    # Ground truth: Griewank's bound, griewank_advances; and Equinox's
    # checkpointed scan, whose default number of checkpoints (online
    # treeverse) is the fewest with (c + 1)(c + 2) / 2 > T.
    for steps in (1, 2, 3, 7, 100, 256, 1024, 4096, 16384):
      with self.subTest(steps=steps):
        schedule = remat_schedule.binomial(
          steps, remat_schedule.fewest_binomial_slots(steps, steps - 1)
        )
        remat_schedule.simulate(schedule)
        slots = schedule.num_slots
        recomputed = griewank_advances(steps, slots) - (steps - 1)
        self.assertEqual(schedule.recomputed_steps, recomputed)
        self.assertLessEqual(recomputed, steps - 1)
        if slots > 1:  # One slot fewer would recompute more.
          self.assertGreater(griewank_advances(steps, slots - 1) - (steps - 1), steps - 1)
        equinox = math.floor(-1.5 + math.sqrt(2 * steps + 0.25)) + 1
        self.assertLessEqual(slots, equinox)
        if steps >= 256:
          self.assertLess(slots, equinox)

  def test_long_scans_build_fast(self):
    # A table over (steps, slots) would take minutes here; the closed form
    # and a bisection per cut take well under a second (not asserted).
    schedule = remat_schedule.binomial(16384, 180)
    remat_schedule.simulate(schedule)
    self.assertLess(schedule.recomputed_steps, 16384)

  def test_one_slot_recomputes_from_the_first_carry(self):
    schedule = remat_schedule.binomial(4, 1)
    self.assertEqual(schedule.recomputed_steps, 0 + 1 + 2)
    self.assertEqual(schedule.forward_stores, (0, NOWHERE, NOWHERE, NOWHERE))

  @parameterized.parameters(16, 64, 128, 200)
  def test_never_more_slots_than_nested_for_as_many_recomputations(self, steps):
    nested = remat_schedule.nested(steps)
    slots = remat_schedule.fewest_binomial_slots(steps, nested.recomputed_steps)
    self.assertLessEqual(slots, nested.num_slots)
    self.assertLessEqual(remat_schedule.binomial_cost(steps, slots), nested.recomputed_steps)
    if steps >= 128:
      self.assertLess(slots, nested.num_slots)


class SizeTest(parameterized.TestCase):
  """A schedule is O(steps) data, however many steps it recomputes."""

  def test_at_most_two_actions_per_step(self):
    # One BACKPROP per step and one ADVANCE per cut: each run of advances
    # is one action, not one per step it runs (with one slot, 130816
    # advances for 512 steps).
    for steps, slots in itertools.product((1, 2, 7, 100, 512), (1, 2, 3, 40, 512)):
      schedule = remat_schedule.binomial(steps, slots)
      self.assertLess(len(schedule.actions), 2 * steps, (steps, slots))
      # An int32 a step and five an action, less the columns XLA folds.
      self.assertLessEqual(schedule.table_bytes, 4 * steps + 20 * len(schedule.actions))
      self.assertLess(schedule.table_bytes, 44 * steps)
      # The same steps, one by one: as many as recomputed and backpropagated.
      self.assertLen(
        schedule.one_step_actions(), steps + griewank_advances(steps, slots) - (steps - 1)
      )
    for groups in (1, 3, 22, 512):
      self.assertLess(len(remat_schedule.nested(512, groups).actions), 1024)

  def test_table_bytes_in_closed_form(self):
    # What a plan predicts for every count of slots without building the
    # schedules (scheduled_scan_test checks table_bytes against the
    # compiled constants): the lengths' column folded from
    # one_step_advances on, where every ADVANCE runs one step.
    cases = [(steps, slots) for steps in range(1, 64) for slots in range(1, steps + 2)]
    cases += [(1000, 43), (1000, 44), (4096, 89), (4096, 90), (4096, 4094)]
    for steps, slots in cases:
      schedule = remat_schedule.binomial(steps, slots)
      self.assertEqual(
        remat_schedule.binomial_table_bytes(steps, slots), schedule.table_bytes, (steps, slots)
      )
      lengths = {a.length for a in schedule.actions if a.kind == ADVANCE}
      if lengths:
        self.assertEqual(
          lengths == {1}, slots >= remat_schedule.one_step_advances(steps), (steps, slots)
        )

  @parameterized.parameters((16384, 1), (16384, 2), (16384, 16384))
  def test_builds_and_checks_in_linear_memory(self, steps, slots):
    # With one slot, 16384 steps recompute 134 M steps; the schedule takes
    # about 300 bytes a step to build (and about 0.05 s, not asserted).
    tracemalloc.start()
    try:
      schedule = remat_schedule.binomial(steps, slots)
      remat_schedule.simulate(schedule)
      peak = tracemalloc.get_traced_memory()[1]
    finally:
      tracemalloc.stop()
    self.assertLess(peak, 1000 * steps)
    self.assertEqual(schedule.recomputed_steps, griewank_advances(steps, slots) - (steps - 1))

  def test_cuts_where_the_bound_is_least(self):
    # Past the exhaustive search's reach: the first cut (where the forward
    # sweep keeps slot 1) is the leftmost cut that minimises Griewank's
    # cost, computed here from griewank_advances.
    for steps, slots in itertools.product((300, 1000), (2, 3, 6)):
      free = slots - 1
      costs = [
        cut + griewank_advances(steps - cut, free) + griewank_advances(cut, free + 1)
        for cut in range(1, steps)
      ]
      schedule = remat_schedule.binomial(steps, slots)
      self.assertEqual(
        schedule.forward_stores.index(1), 1 + costs.index(min(costs)), (steps, slots)
      )


class SimulateTest(absltest.TestCase):
  def test_rejects_a_wrong_carry(self):
    schedule = remat_schedule.nested(3)
    broken = remat_schedule.Schedule(
      3,
      schedule.num_slots,
      schedule.forward_stores,
      (Action(BACKPROP, 2, 0, NOWHERE),) + schedule.actions[1:],
    )
    with self.assertRaisesRegex(ValueError, "step 2 would get the carry entering step 0"):
      remat_schedule.simulate(broken)

  def test_rejects_a_missing_step(self):
    schedule = remat_schedule.nested(3)
    broken = remat_schedule.Schedule(
      3, schedule.num_slots, schedule.forward_stores, schedule.actions[:-1]
    )
    with self.assertRaisesRegex(ValueError, "never backpropagated"):
      remat_schedule.simulate(broken)

  def test_rejects_advances_past_the_last_step(self):
    schedule = remat_schedule.binomial(6, 1)
    first = schedule.actions[1]  # Advances steps 0..3 from slot 0.
    self.assertEqual(first, Action(ADVANCE, 0, 0, NOWHERE, 4))
    for length in (0, 7):
      broken = remat_schedule.Schedule(
        6,
        1,
        schedule.forward_stores,
        schedule.actions[:1] + (first._replace(length=length),) + schedule.actions[2:],
      )
      with self.assertRaisesRegex(ValueError, f"advances {length} steps"):
        remat_schedule.simulate(broken)


if __name__ == "__main__":
  absltest.main()
