r"""What the bridge's caches save (issue 28): re-trace and time to first step, on and off.

The bridge keeps what tracing told it (`haiku_bridge/_src/caches.py`): the
structure of a pure function's `init` (`call_pure(fn, init=...)`, a pure
layer), the skeletons of foreign modules (`hkb.from_flax`, `hkb.from_equinox`),
and the memos of `caches.memoize`, the remat schedules of `hkb.repeat_layer` /
`hkb.dynamic_unroll` among them. (The layer scan's transformed layer was
memoized too until this benchmark found it saved nothing; its row,
`repeat_layer`, is now a control.) For each benchmark model (`CASES`) this measures, side
by side in one run, with the caches on and off:

1. **Re-trace**: `jax.jit(step).trace(...)` of the training step (the grad of
   a mean square of `apply`) with a new `jax.jit` wrapper, then `.lower()` of
   that trace; the model and its input shape traced before, as after a first
   step. The two arms run back to back in an order rotated each repetition
   (`harness.interleaved`); ratios on / off are taken pair by pair. Beside
   them: the compile time of the step (caches on, for scale) and whether the
   step's jaxpr is the same both ways (a cache never changes a result).
2. **Time to first step**: in a new Python process per sample
   (`--first_step_case`), `jax.jit(init)`, then the trace, the lower +
   compile and one call of a jitted SGD step; the arms' processes alternate.
3. **Cache hits**: how many times each cache answered in a first trace (a
   cleared process state) and in a re-trace, counted, not timed: which rows
   a cache can move at all. Rows where no cache answers are the controls:
   their on / off ratio is the noise floor of the method on this machine.

"Off" is `caches.disabled()` (`HAIKU_BRIDGE_CACHES=0` in the first-step
processes): every `Cache` and every memo of `caches.memoize` off and empty,
as if the library had none. One memo stays on in both arms: the key shape of
the PRNG implementation (`pytree.key_spec_of`, a constant of jax's).

Prints the run (command, date, machine, versions) and the tables to stdout,
progress to stderr; `testing/benchmarks/results/RESULTS.md` holds the
conclusions people draw from them. Timings never fail the program.

    bazel run //testing/benchmarks:cache_benchmark              # full run, ~10 minutes
    bazel run //testing/benchmarks:cache_benchmark -- --quick   # smoke run, under a minute

or, without Bazel, from the repository root:

    PYTHONPATH=. python3 testing/benchmarks/cache_benchmark.py [--quick]
"""

import collections
import contextlib
import dataclasses
import functools
import json
import subprocess
import sys
import time
from typing import Any, Callable, Iterator, NamedTuple
from unittest import mock

from absl import app
from absl import flags
import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp

import haiku_bridge as hkb
from haiku_bridge._src import caches
from haiku_bridge._src.remat import loop
from testing.benchmarks import bridged_trace
from testing.benchmarks import foreign_adapters
from testing.benchmarks.lib import environment
from testing.benchmarks.lib import fresh_process
from testing.benchmarks.lib import harness
from testing.benchmarks.lib import markdown_table
from testing.benchmarks.lib import models
from testing.benchmarks.lib import time_scan_bench

ON, OFF = "on", "off"
ARMS = (ON, OFF)

# The memos (`caches.memoize`) a trace of these models can hit, by the name
# the tables give them: (module, attribute).
LRU_CACHES = {
  "remat schedule": (loop, "schedule"),
}


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  """Sizes and repetitions; `FULL` fits ~10 minutes on 2 shared cores."""

  mode: str
  mlp: models.MlpSize
  loop_layers: int  # Layers of the Python loop of `call_pure` layers.
  stack_depth: int
  stack_width: int
  stack_batch: int
  time_scan: time_scan_bench.TimeScanConfig  # Its one length is used.
  warmup: int  # Re-trace repetitions run first and dropped.
  retrace_repeats: int
  compile_repeats: int
  first_step_cases: tuple[str, ...]
  first_step_warmup: int  # Processes per case and arm run first and dropped.
  first_step_repeats: int  # Processes per case and arm kept.


def _time_scan_config(
  mode: str, length: int, hidden: int, batch: int, vocab: int
) -> time_scan_bench.TimeScanConfig:
  return time_scan_bench.TimeScanConfig(
    mode=mode,
    lengths=(length,),
    hidden=hidden,
    batch=batch,
    vocab=vocab,
    warmup=0,
    step_repeats=0,
    step_block_s=0.0,
  )


# A model and the inputs of its `init` and `apply` (after params and rng).
Model = tuple[hk.Transformed, tuple[Any, ...]]


class Case(NamedTuple):
  """One benchmark model: how to build it, and which cache it may use."""

  name: str
  uses: str  # The cache the bridge consults for it ("none": a control).
  build: Callable[[CacheConfig], Model]


def _mlp(variant: str) -> Callable[[CacheConfig], Model]:
  def build(cfg: CacheConfig) -> Model:
    return (models.mlp_model(cfg.mlp, variant), (jnp.zeros([cfg.mlp.batch, cfg.mlp.width]),))

  return build


def _call_pure_loop(cfg: CacheConfig) -> Model:
  """`loop_layers` pure MLP layers of one signature, each its own `call_pure`."""
  widths = (cfg.mlp.width,)
  init = functools.partial(models.pure_mlp_init, widths=widths)

  def net(x):
    for i in range(cfg.loop_layers):
      x = x + hkb.call_pure(models.pure_mlp, x, init=init, name=f"layer_{i}", widths=widths)
    return x

  return hk.transform(net), (jnp.zeros([cfg.mlp.batch, cfg.mlp.width]),)


def _custom_vjp(block: str) -> Callable[[CacheConfig], Model]:
  def build(cfg: CacheConfig) -> Model:
    del cfg  # bridged_trace's sizes.
    _, bridged, x = bridged_trace.blocks()[block]
    return bridged_trace.network(bridged), (x,)

  return build


def _repeat_layer(cfg: CacheConfig) -> Model:
  return (
    models.stack_model(models.SCAN, cfg.stack_depth, False, cfg.stack_width),
    (jnp.zeros([cfg.stack_batch, cfg.stack_width]),),
  )


def _time_scan(cfg: CacheConfig) -> Model:
  ts = cfg.time_scan
  chars = jax.random.randint(jax.random.PRNGKey(1), [ts.lengths[0] + 1, ts.batch], 0, ts.vocab)
  return (time_scan_bench.model(time_scan_bench.BINOMIAL, ts), (chars[:-1], chars[1:]))


def _foreign(kind: str) -> Callable[[CacheConfig], Model]:
  """The adapted blocks of `foreign_adapters.py`, in a Haiku transform."""

  def build(cfg: CacheConfig) -> Model:
    del cfg  # foreign_adapters' sizes.
    width = foreign_adapters.WIDTH
    if kind == "nnx":
      make = functools.partial(foreign_adapters.NnxBlock, width)
      f = lambda x: hkb.from_flax(make, name="block")(x)
    elif kind == "linen":
      module = foreign_adapters.LinenBlock(width)
      f = lambda x: hkb.from_flax(module, name="block", rng_streams=())(x)
    else:
      make = functools.partial(eqx.nn.MLP, width, width, 4 * width, 2)
      f = lambda x: hk.vmap(hkb.from_equinox(make, name="mlp"), split_rng=False)(x)
    return hk.transform(f), (jnp.ones([foreign_adapters.BATCH, width]),)

  return build


PURE_MLP = "call_pure(pure fn), MLP"
PURE_LOOP = "call_pure(pure fn) layers in a Python loop"
TRANSFORMED_MLP = "call_pure(hk.transform), MLP"
VJP_LSTM = "custom_vjp(LSTM unroll)"
VJP_BLOCK = "custom_vjp(transformer block)"
REPEAT = "repeat_layer"
TIME_SCAN = 'dynamic_unroll(remat="binomial")'
NNX = "from_flax(nnx)"
LINEN = "from_flax(linen)"
EQUINOX = "from_equinox"

_STRUCTURE = "structure of init's output"
_SKELETONS = "skeletons of foreign modules"
CASES = {
  c.name: c
  for c in (
    Case(PURE_MLP, _STRUCTURE, _mlp(models.BRIDGED_PURE)),
    Case(PURE_LOOP, _STRUCTURE, _call_pure_loop),
    Case(TRANSFORMED_MLP, "none", _mlp(models.BRIDGED_TRANSFORMED)),
    Case(VJP_LSTM, "none", _custom_vjp("lstm (dynamic_unroll)")),
    Case(VJP_BLOCK, "none", _custom_vjp("transformer block (remat attention)")),
    Case(REPEAT, "none", _repeat_layer),
    Case(TIME_SCAN, "remat schedule", _time_scan),
    Case(NNX, _SKELETONS, _foreign("nnx")),
    Case(LINEN, _SKELETONS, _foreign("linen")),
    Case(EQUINOX, _SKELETONS, _foreign("equinox")),
  )
}

FULL = CacheConfig(
  mode="full",
  mlp=models.MlpSize("medium", 256, 4, 64),
  loop_layers=16,
  stack_depth=16,
  stack_width=128,
  stack_batch=64,
  time_scan=_time_scan_config("full", 1024, 64, 8, 32),
  warmup=2,
  retrace_repeats=21,
  compile_repeats=3,
  first_step_cases=(PURE_MLP, PURE_LOOP, TRANSFORMED_MLP, REPEAT, TIME_SCAN, NNX, LINEN, EQUINOX),
  first_step_warmup=0,
  first_step_repeats=4,
)

QUICK = CacheConfig(
  mode="quick",
  mlp=models.MlpSize("tiny", 16, 2, 4),
  loop_layers=2,
  stack_depth=2,
  stack_width=16,
  stack_batch=4,
  time_scan=_time_scan_config("quick", 8, 8, 2, 8),
  warmup=1,
  retrace_repeats=2,
  compile_repeats=1,
  first_step_cases=(PURE_MLP, EQUINOX),
  first_step_warmup=0,
  first_step_repeats=1,
)

CONFIGS = {c.mode: c for c in (FULL, QUICK)}


# -- Caches on and off. --------------------------------------------------------


@contextlib.contextmanager
def caches_off() -> Iterator[None]:
  """Every cache of the bridge off and empty: as if the library had none."""
  with caches.disabled():
    yield


def arm(name: str) -> contextlib.AbstractContextManager[Any]:
  """Caches off (`caches_off`), or on even under `HAIKU_BRIDGE_CACHES=0`."""
  if name == OFF:
    return caches_off()
  return mock.patch.object(caches, "_enabled", True)


@contextlib.contextmanager
def counting_hits() -> Iterator[collections.Counter[str]]:
  """Counts, by cache name, the lookups that found a value while it is open."""
  hits: collections.Counter[str] = collections.Counter()
  get = caches.Cache.get

  def counted_get(self: caches.Cache, key: Any) -> Any:
    value = get(self, key)
    if value is not None:
      hits[self.name] += 1
    return value

  lru = {name: getattr(module, attr) for name, (module, attr) in LRU_CACHES.items()}
  before = {name: fn.cache_info().hits for name, fn in lru.items()}
  with mock.patch.object(caches.Cache, "get", counted_get):
    yield hits
  for name, fn in lru.items():
    if fn.cache_info().hits > before[name]:
      hits[name] += fn.cache_info().hits - before[name]


# -- The training step. --------------------------------------------------------


def grad_step(transformed: hk.Transformed) -> Callable[..., Any]:
  """Gradient of a mean square of `apply(params, None, *inputs)`."""

  def loss(params, *inputs):
    return jnp.mean(jnp.square(transformed.apply(params, None, *inputs)))

  return jax.grad(loss)


def sgd_step(transformed: hk.Transformed) -> Callable[..., Any]:
  """One SGD step on `grad_step`'s loss: what a first training step runs."""
  grad = grad_step(transformed)

  def step(params, *inputs):
    grads = grad(params, *inputs)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)

  return step


def init_params(transformed: hk.Transformed, inputs: tuple[Any, ...]) -> Any:
  return jax.block_until_ready(jax.jit(transformed.init)(models.KEY, *inputs))


def _trace_and_lower(step: Callable[..., Any], args: tuple[Any, ...]) -> harness.Phases:
  """Phases "trace" and "trace+lower" of a new `jax.jit(step)` (no trace-cache hit)."""
  traced = []
  phases = harness.timed(lambda: traced.append(jax.jit(lambda *a: step(*a)).trace(*args)), "trace")
  lower = harness.timed(lambda: traced[0].lower(), "lower")
  for suffix in ("", harness.CPU):
    phases["trace+lower" + suffix] = phases["trace" + suffix] + lower["lower" + suffix]
  return phases


# -- 1. Re-trace. ---------------------------------------------------------------


class Retrace(NamedTuple):
  samples: harness.Samples  # By (case, arm); phases of `_trace_and_lower`.
  compile_s: dict[str, harness.Stat]  # By case: lower + compile, caches on.
  same_jaxpr: dict[str, bool]  # By case: the step's jaxpr on == off.
  hits: dict[str, dict[str, collections.Counter[str]]]  # case -> trace -> hits.


FIRST_TRACE, RETRACE = "first trace", "re-trace"


def _retrace_measurement(
  step: Callable[..., Any], args: tuple[Any, ...], name: str
) -> harness.Measurement:
  def measure() -> harness.Phases:
    with arm(name):
      # The step was traced before: with caches on, that fills them again
      # (the other arm empties them); both arms run it, so that both timed
      # traces follow the same work.
      jax.jit(lambda *a: step(*a)).trace(*args)
      return _trace_and_lower(step, args)

  return measure


def bench_retrace(cfg: CacheConfig, names: tuple[str, ...]) -> Retrace:
  """Re-trace times on and off, compile times, jaxpr equality and hits."""
  steps, args = {}, {}
  for name in harness.with_progress("caches: building models", names):
    transformed, inputs = CASES[name].build(cfg)
    steps[name] = grad_step(transformed)
    args[name] = (init_params(transformed, inputs),) + inputs
  hits, same_jaxpr, compile_s = {}, {}, {}
  for name in harness.with_progress("caches: hits, jaxprs, compiles", names):
    step, a = steps[name], args[name]
    with arm(ON):
      hkb.clear_caches()
      with counting_hits() as first:
        jaxpr_on = str(jax.make_jaxpr(step)(*a))
      with counting_hits() as again:
        jax.jit(lambda *b: step(*b)).trace(*a)
      hits[name] = {FIRST_TRACE: first, RETRACE: again}
      compile_s[name] = harness.Stat.of(
        harness.trace_and_compile_time(step, *a)["compile"] for _ in range(cfg.compile_repeats)
      )
    with caches_off():
      same_jaxpr[name] = str(jax.make_jaxpr(step)(*a)) == jaxpr_on
  samples = harness.interleaved(
    "caches: re-trace, on and off",
    [{(name, a): _retrace_measurement(steps[name], args[name], a) for a in ARMS} for name in names],
    cfg.retrace_repeats,
    cfg.warmup,
  )
  return Retrace(samples, compile_s, same_jaxpr, hits)


# -- 2. Time to first step, a new process per sample. ----------------------------


FIRST_STEP_PHASES = ("init", "trace", "compile", "step")
FIRST_STEP_TOTAL = "init+trace+compile+step"
HITS = "cache hits"  # Not a time: lookups that found a value, counted.


def first_step(cfg: CacheConfig, name: str) -> harness.Phases:
  """In a new process: init, trace, compile and one call of the SGD step."""
  transformed, inputs = CASES[name].build(cfg)
  with counting_hits() as hits:
    phases = _first_step_phases(transformed, inputs)
  phases[HITS] = float(sum(hits.values()))
  return phases


def _first_step_phases(transformed: hk.Transformed, inputs: tuple[Any, ...]) -> harness.Phases:
  params = []
  phases = harness.timed(lambda: params.append(init_params(transformed, inputs)), "init")
  step = jax.jit(sgd_step(transformed))
  traced, compiled = [], []
  phases.update(harness.timed(lambda: traced.append(step.trace(params[0], *inputs)), "trace"))
  phases.update(harness.timed(lambda: compiled.append(traced[0].lower().compile()), "compile"))
  phases.update(
    harness.timed(lambda: jax.block_until_ready(compiled[0](params[0], *inputs)), "step")
  )
  for suffix in ("", harness.CPU):
    phases[FIRST_STEP_TOTAL + suffix] = sum(phases[p + suffix] for p in FIRST_STEP_PHASES)
  return phases


def run_first_step_child(cfg: CacheConfig, name: str, arm_name: str) -> harness.Phases:
  """Runs `first_step` in a new Python process; returns its phases."""
  env = fresh_process.child_env()
  if arm_name == OFF:
    env["HAIKU_BRIDGE_CACHES"] = "0"
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "testing.benchmarks.cache_benchmark",
      f"--first_step_case={name}",
      f"--first_step_caches={arm_name}",
      f"--mode={cfg.mode}",
    ],
    env=env,
    capture_output=True,
    text=True,
    check=False,
  )
  if done.returncode != 0:
    raise RuntimeError(
      f"first-step child for {name!r}, caches {arm_name}, "
      f"failed (exit {done.returncode}):\n{done.stderr}"
    )
  return json.loads(done.stdout.strip().splitlines()[-1])


def bench_first_step(cfg: CacheConfig) -> harness.Samples:
  """Time to first step on and off, by (case, arm), a process per sample."""
  return harness.interleaved(
    "caches: first step, a process each",
    [
      {(name, a): functools.partial(run_first_step_child, cfg, name, a) for a in ARMS}
      for name in cfg.first_step_cases
    ],
    cfg.first_step_repeats,
    cfg.first_step_warmup,
  )


# -- Report. --------------------------------------------------------------------


class CacheResult(NamedTuple):
  cfg: CacheConfig
  retrace: Retrace
  first_step: harness.Samples


def bench_caches(cfg: CacheConfig) -> CacheResult:
  return CacheResult(cfg, bench_retrace(cfg, tuple(CASES)), bench_first_step(cfg))


def _ms(samples: harness.Samples, key: Any, phase: str) -> str:
  return f"{harness.Stat.of(samples[key][phase]).median * 1e3:.2f}"


def _saved_ms(samples: harness.Samples, name: str, phase: str) -> str:
  """off − on pair by pair, ms: median [min–max]."""
  on, off = samples[(name, ON)][phase], samples[(name, OFF)][phase]
  return harness.Stat.of(b - a for a, b in zip(on, off, strict=True)).ms()


def _hits(counter: collections.Counter[str]) -> str:
  return ", ".join(f"{n} × {k}" for k, n in sorted(counter.items())) or "none"


def _controls(result: CacheResult) -> list[str]:
  """The rows where no cache answered in a re-trace: the noise floor."""
  return [name for name in CASES if not result.retrace.hits[name][RETRACE]]


def _ratio_cell(samples: harness.Samples, name: str, phase: str) -> str:
  return harness.pair_ratios(samples, (name, ON), (name, OFF), phase).ratio()


def markdown(result: CacheResult) -> str:
  """The tables: cache hits, re-trace on / off, time to first step on / off."""
  cfg, retrace = result.cfg, result.retrace
  rs, fs = retrace.samples, result.first_step
  lines = [
    f"Models: MLP {cfg.mlp.width} wide, {cfg.mlp.depth} deep, batch "
    f"{cfg.mlp.batch}; {cfg.loop_layers} `call_pure` layers "
    f"{cfg.mlp.width} wide; `repeat_layer` of {cfg.stack_depth} residual "
    f"MLP blocks {cfg.stack_width} wide, batch {cfg.stack_batch}; "
    f"`dynamic_unroll` of `time_scan_bench`'s character LSTM, T = "
    f"{cfg.time_scan.lengths[0]}, hidden {cfg.time_scan.hidden}, batch "
    f"{cfg.time_scan.batch}; `bridged_trace.py`'s custom-VJP blocks and "
    "`foreign_adapters.py`'s Flax and Equinox blocks at their sizes.",
    "",
    "### Cache hits per trace of the grad step (counted)",
    "",
  ]
  lines += markdown_table.lines(
    ["model", "cache it may use", "first trace (caches empty)", "re-trace"],
    [
      [name, case.uses, _hits(retrace.hits[name][FIRST_TRACE]), _hits(retrace.hits[name][RETRACE])]
      for name, case in CASES.items()
    ],
  )
  controls = _controls(result)
  lines += [
    "",
    f"### Re-trace of the grad step, caches on / off "
    f"({cfg.retrace_repeats} pairs, median [min–max])",
    "",
    "Rows where no cache answers are controls: their ratios show the "
    "method's noise on this machine" + (f" ({', '.join(controls)})." if controls else "."),
    "",
  ]
  lines += markdown_table.lines(
    [
      "model",
      "on: trace ms",
      "off: trace ms",
      "on / off trace",
      "on / off trace (CPU)",
      "saved ms (off − on)",
      "on / off trace+lower",
      "compile ms (on)",
      "same jaxpr on and off",
    ],
    [
      [
        name,
        _ms(rs, (name, ON), "trace"),
        _ms(rs, (name, OFF), "trace"),
        _ratio_cell(rs, name, "trace"),
        _ratio_cell(rs, name, "trace" + harness.CPU),
        _saved_ms(rs, name, "trace"),
        _ratio_cell(rs, name, "trace+lower"),
        f"{retrace.compile_s[name].median * 1e3:.0f}",
        "yes" if retrace.same_jaxpr[name] else "NO",
      ]
      for name in CASES
    ],
  )
  lines += [
    "",
    f"### Time to first step, caches on / off (a new process per "
    f"sample, {cfg.first_step_repeats} each, median [min–max])",
    "",
    f"`{FIRST_STEP_TOTAL}`: `jax.jit(init)`, the trace, lower + compile "
    "and one call of the jitted SGD step.",
    "",
  ]
  lines += markdown_table.lines(
    [
      "model",
      "cache hits (on)",
      "on: ms",
      "off: ms",
      "on / off",
      "on / off (CPU)",
      "saved ms (off − on)",
      "on / off trace",
      "on: init / trace / compile / step ms",
    ],
    [
      [
        name,
        f"{harness.Stat.of(fs[(name, ON)][HITS]).median:.0f}",
        _ms(fs, (name, ON), FIRST_STEP_TOTAL),
        _ms(fs, (name, OFF), FIRST_STEP_TOTAL),
        _ratio_cell(fs, name, FIRST_STEP_TOTAL),
        _ratio_cell(fs, name, FIRST_STEP_TOTAL + harness.CPU),
        _saved_ms(fs, name, FIRST_STEP_TOTAL),
        _ratio_cell(fs, name, "trace"),
        " / ".join(_ms(fs, (name, ON), p) for p in FIRST_STEP_PHASES),
      ]
      for name in cfg.first_step_cases
    ],
  )
  return "\n".join(lines) + "\n"


def report(cfg: CacheConfig, command: str) -> str:
  """Runs the benchmark; returns the run's description and its tables."""
  start = time.perf_counter()
  result = bench_caches(cfg)
  return (
    environment.run_header(
      "Caches (`testing/benchmarks/cache_benchmark.py`)",
      command,
      cfg.mode,
      time.perf_counter() - start,
    )
    + "\n"
    + markdown(result)
  )


def main(argv: list[str]) -> None:
  del argv  # Flags only.
  fl = flags.FLAGS
  cfg = QUICK if fl.quick else CONFIGS[fl.mode]
  if fl.first_step_case:
    with arm(fl.first_step_caches):
      print(json.dumps(first_step(cfg, fl.first_step_case)))
    return
  print(report(cfg, " ".join(["python3"] + sys.argv)))


if __name__ == "__main__":
  # Defined here, not on import: the other benchmarks' modules define a
  # `--quick` too, and one process (pytest) may import them all.
  flags.DEFINE_bool("quick", False, "Smoke mode: tiny models, few repetitions.")
  flags.DEFINE_enum(
    "mode", FULL.mode, list(CONFIGS), "Sizes and repetitions (`--quick` is `--mode=quick`)."
  )
  flags.DEFINE_enum(
    "first_step_case",
    None,
    list(CASES),
    "Internal: time this model's first step in this process and print the phases as JSON.",
  )
  flags.DEFINE_enum(
    "first_step_caches", ON, list(ARMS), "Internal: with --first_step_case, caches on or off."
  )
  app.run(main)
