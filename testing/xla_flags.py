"""The XLA flags every test process compiles with: XLA:CPU's cheaper code generation.

A fresh machine's test run is mostly XLA:CPU compiling small programs (measured on
`time_scan_test`: 115 s of its 185 s in `backend_compile`, 601 compiles). Two flags
of the CPU backend's code generation cut that compile time by about a half
(`testing/xla_flags_test.py` states what they leave unchanged):

- `--xla_cpu_use_fusion_emitters=false`: the fused kernels from XLA's older
  emitters instead of its MLIR fusion emitters.
- `--xla_backend_optimization_level=1`: LLVM's -O1 instead of -O2.

They change how kernels are generated, not what the tests read of a program:
its optimised HLO's buffer assignment (`compiled.memory_analysis()`, which
memory tests hold to bounds) and its values up to float rounding.
`xla_flags_test.py` checks both on the programs the memory tests measure,
against a process with XLA's defaults. `.bazelrc` gives Bazel's tests these
flags, conftest.py gives pytest's them unless the environment names its own
XLA_FLAGS, and `readme_test.py` gives them to the snippets it runs.
Benchmarks run with whatever the user's environment says (their tables
record it).
"""

FLAGS = "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=1"
