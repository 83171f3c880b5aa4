#!/usr/bin/env bash
# The accelerator check, in one command, on whatever jax the machine has:
#
#   bash testing/gpu_check.sh [OUT_DIR]        # default OUT_DIR: /tmp/haiku_bridge_gpu
#
# Needs jax with a GPU (or TPU) backend, dm-haiku, chex, absl-py, pytest (pytest-xdist and
# pytest-timeout if present), equinox and optionally flax: `pip install ".[test,flax]"` after JAX's
# CUDA build (README, Install). Three parts, each writing under OUT_DIR:
#
# 1. tests.log, junit.xml: the test files that hold on an accelerator (GPU_TESTS below: the
#    files that need no 8-device mesh), with pytest: in GPU_CHECK_WORKERS processes on a GPU,
#    in one on a TPU (which one process holds at a time; give it GPU_CHECK_TEST_S=1800 or
#    so: the remat files alone took over 230 s there). A GPU's reductions are not a CPU's: where a
#    test compares values computed two ways it states its tolerance per backend
#    (testing/backend_tolerance.py): bit-exact stays bit-exact on the CPU, and on an
#    accelerator the bound is explicit and small.
# 2. figures.md, figures.json: testing/benchmarks/gpu_figures.py, the bridge at parity on a
#    transformer LM step and the time scan's memory and time beside Equinox's.
# 3. remat.md: testing/remat_gpu_check.py, `remat="auto"`'s predictions against the compiled
#    programs on this backend, where that script exists.
#
# summary.md gathers the three with the date, device and versions; RESULTS.md's section
# "On a GPU" is written from it by hand. The CPU XLA flags of the test suite
# (testing/xla_flags.py) are not used here: XLA_FLAGS is left as the environment sets it.

set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly OUT="${1:-/tmp/haiku_bridge_gpu}"
mkdir -p "${OUT}"

export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}"
export XLA_FLAGS="${XLA_FLAGS-}"
# Several pytest workers share the device: each takes memory as it needs it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/haiku_bridge_xla_cache}"
readonly PYTHON="${PYTHON:-python3}"
readonly WORKERS="${GPU_CHECK_WORKERS:-8}"
readonly TEST_BUDGET_S="${GPU_CHECK_TEST_S:-300}"
# Which parts to run (all three by default), e.g. GPU_CHECK_PARTS="tests remat".
readonly PARTS=" ${GPU_CHECK_PARTS:-tests figures remat} "
runs() { [[ "${PARTS}" == *" $1 "* ]]; }

GPU_TESTS=(
  haiku_bridge/_src/call_pure_test.py
  haiku_bridge/_src/custom_grad_test.py
  haiku_bridge/_src/equinox_bridge_test.py
  haiku_bridge/_src/flax_bridge_test.py
  haiku_bridge/_src/foreign_module_test.py
  haiku_bridge/_src/inline_test.py
  haiku_bridge/_src/scan_test.py
  haiku_bridge/_src/stacked_init_test.py
  haiku_bridge/_src/storage_test.py
  haiku_bridge/_src/time_scan_test.py
  haiku_bridge/_src/unrolled_names_test.py
  haiku_bridge/_src/remat/hlo_flops_test.py
  haiku_bridge/_src/remat/loop_test.py
  haiku_bridge/_src/remat/plan_test.py
  haiku_bridge/_src/remat/schedule_test.py
  haiku_bridge/_src/remat/scheduled_scan_test.py
  testing/conformance/bridged_grid_test.py
  testing/conformance/clipped_models_test.py
  testing/conformance/equinox_conformance_test.py
  testing/conformance/haiku_flax_conformance_test.py
  testing/conformance/layer_stack_conformance_test.py
  testing/conformance/lift_conformance_test.py
  testing/conformance/models_conformance_test.py
)
# Left out: the files that need 8 devices (sharding, pipelines, foreign sharding), the wheel,
# docs and typecheck tests (no device in them), and testing/structure_test.py, whose facts are
# of the CPU's optimised HLO: on a GPU the autotuner picks a matmul's algorithm at each compile,
# so two compiles of one program may print different HLO (seen on an H200: its
# test_step_optimised_hlo_equals_inline failed in one run and passed in the next).

BACKEND_FILE="${OUT}/backend" "${PYTHON}" - <<'EOF' | tee "${OUT}/environment.txt"
import jax, jaxlib
print("date:", __import__("datetime").datetime.now(__import__("datetime").timezone.utc).isoformat(timespec="minutes"))
print("backend:", jax.default_backend(), "devices:", [d.device_kind for d in jax.devices()])
open(__import__("os").environ["BACKEND_FILE"], "w").write(jax.default_backend())
print("jax", jax.__version__, "jaxlib", jaxlib.__version__)
EOF

pytest_args=(-q -rfE -p no:cacheprovider --junitxml="${OUT}/junit.xml")
test_env=()
# A TPU is held by one process at a time: there the tests run in one. Its float32 matmuls run
# in bfloat16 passes by default, which the tests' comparisons of two computations (and of a
# finite difference with a derivative) are not bounded for: there they run at "highest"
# (testing/backend_tolerance.py). The figures and remat parts keep the default, as users run.
if [[ "$(cat "${OUT}/backend" 2>/dev/null)" == tpu ]]; then
  test_env+=(JAX_DEFAULT_MATMUL_PRECISION=highest)
elif "${PYTHON}" -c "import xdist" 2>/dev/null; then
  pytest_args+=(-n "${WORKERS}")
fi
if "${PYTHON}" -c "import pytest_timeout" 2>/dev/null; then pytest_args+=(--timeout=240); fi
tests_status=0
if runs tests; then
  echo "== tests (${#GPU_TESTS[@]} files, at most ${TEST_BUDGET_S} s)"
  env "${test_env[@]}" timeout "${TEST_BUDGET_S}" "${PYTHON}" -m pytest "${pytest_args[@]}" \
    "${GPU_TESTS[@]}" \
    >"${OUT}/tests.log" 2>&1
  tests_status=$?
  grep -E "^(FAILED|ERROR|SUBFAILED)|[0-9]+ (passed|failed)" "${OUT}/tests.log"
fi

figures_status=0
if runs figures; then
  echo "== figures"
  "${PYTHON}" -m testing.benchmarks.gpu_figures --out="${OUT}" 2>"${OUT}/figures.err"
  figures_status=$?
  [[ ${figures_status} -eq 0 ]] || tail -n 30 "${OUT}/figures.err"
fi

remat_status=0
if runs remat && [[ -f testing/remat_gpu_check.py ]]; then
  echo "== remat=\"auto\" predictions"
  "${PYTHON}" -m testing.remat_gpu_check >"${OUT}/remat.md" 2>"${OUT}/remat.err"
  remat_status=$?
  cat "${OUT}/remat.md"
  [[ ${remat_status} -eq 0 ]] || tail -n 30 "${OUT}/remat.err"
fi

{
  cat "${OUT}/environment.txt"
  echo
  runs tests && echo "tests: exit ${tests_status} ($(grep -E '[0-9]+ (passed|failed)' "${OUT}/tests.log" | tail -n 1))"
  echo "figures: exit ${figures_status}; remat: exit ${remat_status}"
  echo
  [[ -f "${OUT}/figures.md" ]] && cat "${OUT}/figures.md"
  [[ -f "${OUT}/remat.md" ]] && { echo; cat "${OUT}/remat.md"; }
} >"${OUT}/summary.md"
echo "== summary: ${OUT}/summary.md"
(( tests_status == 0 && figures_status == 0 && remat_status == 0 ))
