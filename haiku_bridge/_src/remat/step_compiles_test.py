"""A budgeted step's compiles: the bytes read, a draft's failure, a compile left to finish in its thread."""

import threading
from unittest import mock

from absl.testing import absltest
import jax
import jax.numpy as jnp

from haiku_bridge._src.remat import step_compiles


class CompileTest(absltest.TestCase):
  def test_a_draft_that_fails_has_no_bytes_and_keeps_no_program(self):
    lowered = jax.jit(jnp.tanh).lower(jnp.ones([4]))
    done = step_compiles.drafted(lowered, 0.5, {"optimization_level": 9})
    self.assertEqual((done.bytes is not None, done.compiled, done.lowered), (True, None, None))
    self.assertEqual((done.draft, done.measuring), (True, False))
    for error in (ValueError("an option this XLA lacks"), RuntimeError("RESOURCE_EXHAUSTED: HBM")):

      def failing(lowered, options, error=error):
        raise error

      with mock.patch.object(step_compiles, "xla_compile", failing):
        done = step_compiles.drafted(lowered, 0.5, {"optimization_level": 9})
      self.assertEqual((done.bytes, done.draft), (None, True))
      self.assertGreaterEqual(done.seconds, 0.5)  # Its lowering's, at least.

  def test_at_close_a_compile_begun_ends_unused_and_one_not_begun_is_cancelled(self):
    release, begun, ended = threading.Event(), threading.Event(), []

    def compile_lowered(lowered, seconds):
      begun.set()
      release.wait(timeout=5)
      ended.append(lowered)
      return step_compiles.Compiled(1, None, 0.0, None, False)

    # Without drafts one thread: the second compile waits for the first's.
    ahead = step_compiles.Ahead(lambda rung: (rung, 0.0), compile_lowered)
    ahead.start("remat=True")  # A rung's key: any hashable.
    self.assertTrue(begun.wait(timeout=5))
    ahead.start("remat=\"binomial\"")
    ahead.close()  # At once: the first compile goes on in its thread.
    self.assertEqual(ended, [])
    threading.Timer(0.1, release.set).start()
    step_compiles.unused_compiles_ended()
    self.assertEqual(ended, ["remat=True"])

  def test_a_rung_compiles_apart_as_it_runs_from_one_lowering_and_aside_in_a_thread_of_its_own(
    self,
  ):
    lowered, made, threads = [], [], set()
    release = threading.Event()

    def lower_at(rung):
      lowered.append(rung)
      return f"{rung} lowered", 0.5

    def compiling(how):
      def compile_lowered(program, seconds):
        if how == "aside":
          release.wait(timeout=5)  # Holds its thread: the search's go on beside it.
        made.append((program, how, seconds))
        threads.add(threading.get_ident())
        return step_compiles.Compiled(len(made), None, seconds, program, how == "measuring")

      return compile_lowered

    ahead = step_compiles.Ahead(lower_at, compiling("measuring"), None, compiling("aside"))
    self.addCleanup(release.set)
    self.addCleanup(ahead.close)
    ahead.start_aside("remat=True")
    self.assertEqual(ahead("plain").bytes, 1)  # Not behind the aside compile.
    # A rung's measuring compile is not its compile as it runs: each its own.
    self.assertTrue(ahead("remat=True").measuring)
    release.set()
    self.assertFalse(ahead("remat=True", as_runs=True).measuring)
    self.assertEqual(lowered, ["remat=True", "plain"])  # Each rung lowered once.
    self.assertEqual(
      made,
      [
        ("plain lowered", "measuring", 0.5),
        ("remat=True lowered", "measuring", 0.0),  # Its lowering counted once.
        ("remat=True lowered", "aside", 0.5),
      ],
    )
    self.assertLen(threads, 2)
    # With no compile apart (where tries compile as the step runs), a rung
    # asked for as it runs is the one compile.
    made.clear()
    ahead = step_compiles.Ahead(lower_at, compiling("measuring"))
    self.addCleanup(ahead.close)
    ahead.start_aside("remat=True")
    ahead("remat=True")
    self.assertEqual(made, [("remat=True lowered", "measuring", 0.5)])


class StepBytesTest(absltest.TestCase):
  def test_a_tpu_peak_is_not_added_to_the_buffers_it_holds(self):
    # XLA:TPU at users' sizes: the peak holds the arguments, outputs and
    # temporaries it reports (the seq-1024 step: temporaries 7.40
    # GB, the peak less arguments and outputs 7.32 GB, the same buffers).
    fields = dict(
      argument_size_in_bytes=1_220,
      output_size_in_bytes=1_200,
      alias_size_in_bytes=1_100,
      temp_size_in_bytes=7_400,
      generated_code_size_in_bytes=10,
    )
    analysis = mock.Mock(peak_memory_in_bytes=8_640, **fields)
    self.assertEqual(step_compiles.step_bytes(analysis, "tpu"), 8_730)
    # At toy sizes the temporaries are partly missing: the peak says more.
    analysis = mock.Mock(peak_memory_in_bytes=20_000, **fields)
    self.assertEqual(step_compiles.step_bytes(analysis, "tpu"), 20_010)
    self.assertEqual(step_compiles.step_bytes(analysis, "cpu"), 8_730)


if __name__ == "__main__":
  absltest.main()
