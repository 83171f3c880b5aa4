"""One benchmark run's results, and their JSON form (`results.json`).

The JSON holds everything the tables and the plot are drawn from: the run
(command, date, machine, configuration), every kept sample in seconds keyed by
its record's fields, the profiles and the targets.
"""

import dataclasses
import json
from typing import Any, Optional

from testing.benchmarks.lib import harness
from testing.benchmarks.lib.config import Config
from testing.benchmarks.lib.mlp_bench import MlpResult
from testing.benchmarks.lib.stack_bench import StackResult
from testing.benchmarks.lib.targets import Target
from testing.benchmarks.lib.trace_profile import TraceProfile


@dataclasses.dataclass
class Results:
  cfg: Config
  command: str
  date: str
  env: dict[str, str]
  mlp: list[MlpResult]
  stack: StackResult
  profiles: list[TraceProfile]
  targets: list[Target]
  run_s: float


def _key_fields(key: Any) -> dict[str, Any]:
  return key._asdict() if hasattr(key, "_asdict") else {"variant": key}


def _samples(samples: harness.Samples, **fields: Any) -> list[dict[str, Any]]:
  """One record per key and phase: the key's fields, the phase, the seconds."""
  return [
    dict(fields, **_key_fields(key), phase=phase, seconds=seconds)
    for key, phases in samples.items()
    for phase, seconds in phases.items()
  ]


def _stat(stat: Optional[harness.Stat]) -> Optional[dict[str, float]]:
  return None if stat is None else stat._asdict()


def to_json(res: Results) -> dict[str, Any]:
  samples = []
  for r in res.mlp:
    for measure, by_key in (("trace", r.trace), ("compile", r.compile), ("step", r.step)):
      samples += _samples(by_key, benchmark="mlp", size=r.size.name, measure=measure)
  for measure, by_key in (("trace+compile", res.stack.compile), ("step", res.stack.step)):
    samples += _samples(by_key, benchmark="stack", measure=measure)
  return {
    "run": {
      "command": res.command,
      "date": res.date,
      "run_s": res.run_s,
      "environment": res.env,
      "config": dict(
        dataclasses.asdict(res.cfg), mlp_sizes=[s._asdict() for s in res.cfg.mlp_sizes]
      ),
    },
    "targets": [
      dict(
        name=t.name,
        goal=t.goal,
        passed=t.passed,
        ratio=_stat(t.ratio),
        cpu_ratio=_stat(t.cpu_ratio),
        control=_stat(t.control),
        lift=_stat(t.lift),
      )
      for t in res.targets
    ],
    "samples": samples,
    "stack_temp_bytes": [dict(k._asdict(), bytes=b) for k, b in res.stack.temp_bytes.items()],
    "profiles": [
      dict(dataclasses.asdict(p), rows=[r._asdict() for r in p.rows]) for p in res.profiles
    ],
  }


def write_json(res: Results, path: str) -> None:
  with open(path, "w") as f:
    json.dump(to_json(res), f, indent=1, ensure_ascii=False)
    f.write("\n")
