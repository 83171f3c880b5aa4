"""The XLA flags every test process compiles with: XLA:CPU's cheaper code generation.

A fresh machine's test run is mostly XLA:CPU compiling small programs (measured on
`time_scan_test`: 115 s of its 185 s in `backend_compile`, 601 compiles). Two flags
of the CPU backend's code generation cut that compile time by about a half
(`testing/xla_flags_test.py` states what they leave unchanged):

- `--xla_cpu_use_fusion_emitters=false`: the fused kernels from XLA's older
  emitters instead of its MLIR fusion emitters.
- `--xla_backend_optimization_level=1`: LLVM's -O1 instead of -O2.

Neither changes what a test measures of a program: the optimised HLO's buffer
assignment (`compiled.memory_analysis()`), hence every memory figure a test
holds to a bound, and every value up to float rounding (`xla_flags_test.py`
checks both against the default flags, in a process without these). A run
with other XLA_FLAGS keeps them: `.bazelrc` gives Bazel's tests these, and
conftest.py gives pytest's these unless the environment names its own.
Benchmarks run with whatever the user's environment says (their tables
record it).
"""

FLAGS = "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=1"
