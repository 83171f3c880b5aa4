#!/usr/bin/env bash
# The accelerator check, in one command, on whatever jax the machine has (a GPU or a TPU):
#
#   bash testing/accelerator_check.sh [OUT_DIR]   # default OUT_DIR: /tmp/haiku_bridge_accelerator
#
# Needs jax with a GPU or TPU backend, dm-haiku, chex, absl-py, pytest (pytest-xdist if present),
# equinox and flax: `pip install ".[test,flax,equinox]"` after JAX's CUDA or TPU build (README,
# Install). Three parts, each under a time limit of its own (9 minutes by default), each printing as
# it goes and writing under OUT_DIR:
#
# 1. tests.log, junit.xml: the test files that hold on one device (ACCELERATOR_TESTS below: the
#    files that need no 8-device mesh), with `pytest -v`, each test's line as it ends: in
#    ACCELERATOR_CHECK_WORKERS processes on a GPU; in one on a TPU, which one process holds at a
#    time (there a test's fresh process runs on the CPU, testing/test_utils.py). A GPU's
#    reductions are not a CPU's: where a test compares values computed two ways it states its
#    tolerance per backend (testing/backend_tolerance.py). At its limit pytest is interrupted and
#    reports what ran; on a TPU the list takes about four such parts: ACCELERATOR_CHECK_SHARD=i/n
#    runs files i, i+n, i+2n, ... of the list.
# 2. figures.md, figures.json: testing/benchmarks/accelerator_figures.py, the bridge against
#    inline Haiku on a transformer LM step, `hkb.repeat_layer` against `hk.layer_stack`, and the
#    time scan's memory and time beside Equinox's; sized to the device's memory, each line printed
#    as it is measured (on a CPU, `--small`: a check of the script).
# 3. remat.md: testing/remat_auto_check.py, `remat="auto"`'s predictions against the compiled
#    programs on this backend.
# 4. budget.log, budget.xml, memory.txt: `hkb.budgeted_jit`'s tests and what they read of XLA's
#    memory analysis (BUDGET_TESTS below, run as part 1 runs its files), then
#    testing/benchmarks/memory_reading.py: a loop's gradient as XLA's memory analysis reports it
#    and as the library reads it, against whether the device's compiler takes it (on a CPU,
#    `--small`).
# 5. step.log, cold.json, warm.json, step_budget.md (not among the default parts: about 11 minutes on
#    a TPU v5e, the cold phase 7.3 and the second process 3.6, 2026-12-07): testing/benchmarks/
#    step_budget_figures.py, `hkb.budgeted_jit` on a 24-layer transformer LM step with an Adam update
#    at the budgets of testing/benchmarks/results/remat_auto.md's TPU table, then the same in a
#    second process that reads the first one's plans (under OUT_DIR/plans): the tables of that page,
#    written by the script (on a CPU, `--small`). `ACCELERATOR_CHECK_PARTS=step bash
#    testing/accelerator_check.sh OUT_DIR` runs it alone; ACCELERATOR_CHECK_STEP_PHASES=cold, then
#    =warm with the same OUT_DIR, runs its two phases apart (each within a 10-minute call).
#
# Settings (environment): ACCELERATOR_CHECK_PARTS (default "tests figures remat budget"; add
# "step" for part 5), ACCELERATOR_CHECK_STEP_PHASES (part 5's, default "cold warm"),
# ACCELERATOR_CHECK_PART_S (each part's limit in seconds, default 540),
# ACCELERATOR_CHECK_SHARD, ACCELERATOR_CHECK_WORKERS (default 8, on a GPU), PYTHON (default python3).
#
# summary.md gathers the parts run (each one's exit status) with the date, device and versions;
# RESULTS.md's sections "On a GPU" and "On a TPU v5e" are written from it by hand. The CPU XLA
# flags of the test suite (testing/xla_flags.py) are not used here: XLA_FLAGS is left as the
# environment sets it.

set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly OUT="${1:-/tmp/haiku_bridge_accelerator}"
mkdir -p "${OUT}"

# Extended, never replaced: dm-haiku and the rest may be on PYTHONPATH alone.
export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONUNBUFFERED=1
export XLA_FLAGS="${XLA_FLAGS-}"
# Several pytest workers share a GPU: each takes memory as it needs it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/haiku_bridge_xla_cache}"
readonly PYTHON="${PYTHON:-python3}"
readonly WORKERS="${ACCELERATOR_CHECK_WORKERS:-8}"
readonly PART_S="${ACCELERATOR_CHECK_PART_S:-540}"
readonly SHARD="${ACCELERATOR_CHECK_SHARD:-1/1}"
readonly PARTS=" ${ACCELERATOR_CHECK_PARTS:-tests figures remat budget} "
runs() { [[ "${PARTS}" == *" $1 "* ]]; }
[[ "${SHARD}" =~ ^[1-9][0-9]*/[1-9][0-9]*$ ]] && (( ${SHARD%/*} <= ${SHARD#*/} )) \
  || { echo "ACCELERATOR_CHECK_SHARD=${SHARD}: want i/n with 1 <= i <= n" >&2; exit 2; }
# A part under its limit: interrupted (SIGINT, so that pytest still reports what ran and writes
# its junit.xml), killed 30 s later if it has not ended.
readonly LIMITED=(timeout -s INT -k 30 "${PART_S}")

# In an order that shares the files' time about equally among the four shards of
# ACCELERATOR_CHECK_SHARD=i/4 (files i, i+4, ...) on a TPU v5e, where the list needs them: about
# 400 s of tests each, from each file's time in the shards run there on 2026-12-07 (junit.xml;
# time_scan_test 257 s and bridged_grid_test 142 s before their shards' limits stopped them),
# each shard's cheapest first: shards 1-3 then took 427, 393 and 387 s there
# (testing/benchmarks/results/accelerator_tpu_v5e/summary.md). On a GPU the list runs whole, in
# parallel processes.
ACCELERATOR_TESTS=(
  haiku_bridge/_src/unrolled_names_test.py
  haiku_bridge/_src/storage_test.py
  testing/conformance/lift_conformance_test.py
  haiku_bridge/_src/foreign_module_test.py
  haiku_bridge/_src/remat/schedule_test.py
  haiku_bridge/_src/stacked_init_test.py
  haiku_bridge/_src/remat/choice_test.py
  haiku_bridge/_src/call_pure_test.py
  haiku_bridge/_src/remat/hlo_flops_test.py
  testing/conformance/clipped_models_test.py
  haiku_bridge/_src/remat/plan_cache_test.py
  haiku_bridge/_src/inline_test.py
  haiku_bridge/_src/remat/loop_test.py
  haiku_bridge/_src/remat/measure_test.py
  haiku_bridge/_src/remat/tracing_test.py
  haiku_bridge/_src/remat/scheduled_scan_test.py
  testing/conformance/haiku_flax_conformance_test.py
  haiku_bridge/_src/equinox_bridge_test.py
  testing/conformance/layer_stack_conformance_test.py
  haiku_bridge/_src/remat/plan_test.py
  haiku_bridge/_src/flax_bridge_test.py
  haiku_bridge/_src/custom_grad_test.py
  testing/conformance/models_conformance_test.py
  testing/conformance/bridged_grid_test.py
  haiku_bridge/_src/time_scan_test.py
  haiku_bridge/_src/layer_scan_test.py
  testing/conformance/equinox_conformance_test.py
)
# Part 4's: the step budget's tests (about 4 minutes on a TPU v5e, 2026-12-07) and the readings
# of XLA's memory analysis they stand on; their 8-device cases skip on one device.
BUDGET_TESTS=(
  haiku_bridge/_src/hlo_text_test.py
  testing/plan_fixtures_test.py
  haiku_bridge/_src/remat/step_compiles_test.py
  haiku_bridge/_src/remat/step_search_test.py
  haiku_bridge/_src/remat/step_budget_test.py
)
# Left out: the files that need 8 devices (sharding, pipelines, foreign sharding), the wheel,
# docs and typecheck tests (no device in them), and testing/structure_test.py, whose facts are
# of the CPU's optimised HLO: on a GPU the autotuner picks a matmul's algorithm at each compile,
# so two compiles of one program may print different HLO (seen on an H200: its
# test_step_optimised_hlo_equals_inline failed in one run and passed in the next).

# Left out on a TPU: a test that compares a fresh process's results with this process's where
# they depend on the backend. The fresh process runs on the CPU beside the chip this one holds.
TPU_DESELECTED=(
  # The child's remat plans are the CPU's compiled bytes; this process's, the TPU's.
  haiku_bridge/_src/remat/plan_test.py::AutoTest::test_plans_persist_across_processes
)

shard_files() {  # Files i, i+n, ... (1-based) of ACCELERATOR_TESTS, for SHARD=i/n.
  local i="${SHARD%/*}" n="${SHARD#*/}" k
  for k in "${!ACCELERATOR_TESTS[@]}"; do
    if (( k % n == i - 1 )); then echo "${ACCELERATOR_TESTS[k]}"; fi
  done
}

BACKEND_FILE="${OUT}/backend" "${PYTHON}" - <<'EOF' | tee "${OUT}/environment.txt"
import datetime, os
import jax, jaxlib
print("date:", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"))
print("backend:", jax.default_backend(), "devices:", [d.device_kind for d in jax.devices()])
open(os.environ["BACKEND_FILE"], "w").write(jax.default_backend())
print("jax", jax.__version__, "jaxlib", jaxlib.__version__)
EOF
backend="$(cat "${OUT}/backend" 2>/dev/null)"

pytest_args=(-v -rfE -p no:cacheprovider --junitxml="${OUT}/junit.xml")
test_env=()
# A TPU is held by one process at a time: there the tests run in one. Its float32 matmuls run
# in bfloat16 passes by default, which the tests' comparisons of two computations (and of a
# finite difference with a derivative) are not bounded for: there they run at "highest"
# (testing/backend_tolerance.py). The figures and remat parts keep the default, as users run.
if [[ "${backend}" == tpu ]]; then
  test_env+=(JAX_DEFAULT_MATMUL_PRECISION=highest)
  for t in "${TPU_DESELECTED[@]}"; do pytest_args+=(--deselect "${t}"); done
elif "${PYTHON}" -c "import xdist" 2>/dev/null; then
  pytest_args+=(-n "${WORKERS}")
fi
tests_status=0
if runs tests; then
  mapfile -t files < <(shard_files)
  echo "== tests (${#files[@]} of ${#ACCELERATOR_TESTS[@]} files, shard ${SHARD}, at most ${PART_S} s)"
  env "${test_env[@]}" "${LIMITED[@]}" "${PYTHON}" -m pytest "${pytest_args[@]}" "${files[@]}" 2>&1 \
    | tee "${OUT}/tests.log"
  tests_status=$?
  (( tests_status == 124 )) && echo "== tests: stopped at the limit of ${PART_S} s"
fi

figures_status=0
if runs figures; then
  echo "== figures (at most ${PART_S} s)"
  figures_args=(--out="${OUT}")
  [[ "${backend}" == cpu ]] && figures_args+=(--small)  # A check of the script on a CPU.
  "${LIMITED[@]}" "${PYTHON}" -m testing.benchmarks.accelerator_figures "${figures_args[@]}" \
    2>"${OUT}/figures.err"
  figures_status=$?
  (( figures_status == 124 )) && echo "== figures: stopped at the limit of ${PART_S} s"
  (( figures_status == 0 )) || tail -n 30 "${OUT}/figures.err"
fi

remat_status=0
if runs remat; then
  echo "== remat=\"auto\" predictions (at most ${PART_S} s)"
  "${LIMITED[@]}" "${PYTHON}" -m testing.remat_auto_check 2>"${OUT}/remat.err" | tee "${OUT}/remat.md"
  remat_status=$?
  (( remat_status == 0 )) || tail -n 30 "${OUT}/remat.err"
fi

step_status=0
if runs step; then
  echo "== step budget: step_budget_figures, phases: ${ACCELERATOR_CHECK_STEP_PHASES:-cold warm} (at most ${PART_S} s each)"
  step_args=(--out="${OUT}")
  [[ "${backend}" == cpu ]] && step_args+=(--small --cold_repeats=1)  # A check of the script.
  for phase in ${ACCELERATOR_CHECK_STEP_PHASES:-cold warm}; do
    # Its costs are of compiles: jax's persistent compilation cache (set above) is off here.
    env -u JAX_COMPILATION_CACHE_DIR HAIKU_BRIDGE_CACHE_DIR="${OUT}/plans" "${LIMITED[@]}" "${PYTHON}" \
      -m testing.benchmarks.step_budget_figures "${step_args[@]}" --phase="${phase}" 2>&1 \
      | tee -a "${OUT}/step.log"
    (( ${PIPESTATUS[0]} == 0 )) || { step_status=1; break; }
  done
fi

budget_status=0
if runs budget; then
  echo "== budget: ${#BUDGET_TESTS[@]} test files, then memory_reading (at most ${PART_S} s each)"
  budget_args=("${pytest_args[@]/--junitxml=*/--junitxml=${OUT}/budget.xml}")
  env "${test_env[@]}" "${LIMITED[@]}" "${PYTHON}" -m pytest "${budget_args[@]}" "${BUDGET_TESTS[@]}" \
    2>&1 | tee "${OUT}/budget.log"
  budget_status=$?
  reading_args=()
  [[ "${backend}" == cpu ]] && reading_args+=(--small)
  "${LIMITED[@]}" "${PYTHON}" -m testing.benchmarks.memory_reading "${reading_args[@]}" \
    2>"${OUT}/memory.err" | tee "${OUT}/memory.txt"
  (( ${PIPESTATUS[0]} == 0 )) || { budget_status=1; tail -n 30 "${OUT}/memory.err"; }
fi

{
  cat "${OUT}/environment.txt"
  echo
  runs tests && echo "tests (shard ${SHARD}): exit ${tests_status} ($(grep -E '^=+ .* in [0-9.]+s' "${OUT}/tests.log" | tail -n 1))"
  ran=""  # The other parts' statuses, of those run only.
  for part in figures remat budget step; do
    status="${part}_status"
    runs "${part}" && ran+="${ran:+; }${part}: exit ${!status}"
  done
  [[ -n "${ran}" ]] && echo "${ran}"
  echo
  [[ -f "${OUT}/figures.md" ]] && cat "${OUT}/figures.md"
  [[ -f "${OUT}/remat.md" ]] && { echo; cat "${OUT}/remat.md"; }
  [[ -f "${OUT}/memory.txt" ]] && { echo; cat "${OUT}/memory.txt"; }
  [[ -f "${OUT}/step_budget.md" ]] && { echo; cat "${OUT}/step_budget.md"; }
} >"${OUT}/summary.md"
echo "== summary: ${OUT}/summary.md"
(( tests_status == 0 && figures_status == 0 && remat_status == 0 && budget_status == 0 \
   && step_status == 0 ))
