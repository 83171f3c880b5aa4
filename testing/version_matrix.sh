#!/usr/bin/env bash
# Runs the unit and conformance tests with pytest on every supported (dm-haiku, jax) pair, each in
# its own virtual environment with the versions pinned, and prints one summary line per pair.
#
#   bash testing/version_matrix.sh                  # every pair below, PAIRS and NEWER_PAIRS
#   bash testing/version_matrix.sh 0.0.14/0.6.0     # some pairs: <dm-haiku>/<jax>
#
# PAIRS are the tested range: pyproject.toml's lower bounds and the README state it, and
# testing/versions_test.py checks that all three agree. NEWER_PAIRS are past it: the newest releases
# the package index serves, run the same way so that what a newer jax changes shows as soon as it
# is out. Importing haiku_bridge warns on them (UntestedVersionWarning) until they pass here and
# move into PAIRS. jax 0.11 and later need Python 3.12 or newer (their wheels' Requires-Python), so
# those pairs run on HB_PYTHON312. Each environment is built once (python3 -m
# venv, pip from PyPI) under ${HB_MATRIX_DIR:-~/.cache/haiku_bridge/version_matrix}/<pair>/ and
# reused; HB_MATRIX_REBUILD=1 builds them afresh. The optional libraries are installed where the
# pair can have them, at the versions pip finds with the pair's jax pinned: Equinox and optax on
# every pair, Flax (pyproject.toml's `flax` extra) on the pairs with jax >= FLAX_MIN_JAX; a test file
# that imports a library the pair lacks is left out (HB_MATRIX_EXTRAS=0 installs none of them).
# pytest runs each test file in a process of its own; each pair's full log: <dir>/<pair>.log.
# Environment:
# HB_PYTHON (default python3, 3.11 or newer), HB_PYTHON312 (default python3.12: the pairs with jax >=
# PYTHON312_MIN_JAX), HB_MATRIX_NEWER=0 (leave NEWER_PAIRS out of a run of every pair),
# HB_MATRIX_FILES (some test files instead of all, e.g. "testing/versions_test.py"), PYTEST_ADDOPTS
# (passed to pytest as usual).
#
# Exit status: 0 when every pair passes, 1 otherwise. Last lines, one per pair:
#   dm-haiku 0.0.14 / jax 0.6.0: 300 passed, 0 failed, 4 skipped (112 s)

set -uo pipefail

# <dm-haiku>/<jax>: every dm-haiku release from 0.0.14, with a jax of its time.
readonly PAIRS=(
  0.0.14/0.6.0
  0.0.15/0.7.2
  0.0.16/0.8.1
  0.0.16/0.9.2
  0.0.17/0.10.2
)

# Past the tested set (above): jax 0.11.2, which GPU images ship, and the newest, which CI's
# newest-jax leg (//testing:newest_jax_test, testing/requirements-newest.txt) runs a core subset on.
readonly NEWER_PAIRS=(
  0.0.17/0.11.2
  0.0.17/0.12.1
)

# The oldest jax whose wheels need Python >= 3.12: its pairs run on HB_PYTHON312.
readonly PYTHON312_MIN_JAX=0.11.0

# The oldest jax the Flax adapter runs on: Flax >= 0.12.6 (pyproject.toml) needs it.
readonly FLAX_MIN_JAX=0.8.1
readonly FLAX_REQUIREMENT="flax>=0.12.6"

readonly ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly DIR="${HB_MATRIX_DIR:-${HOME}/.cache/haiku_bridge/version_matrix}"
readonly PYTHON="${HB_PYTHON:-python3}"
readonly PYTHON312="${HB_PYTHON312:-python3.12}"
readonly TEST_PATHS=(haiku_bridge testing/conformance)
readonly TEST_PACKAGES=(absl-py chex pytest hypothesis)

if [[ "$#" -gt 0 ]]; then
  pairs=("$@")
elif [[ "${HB_MATRIX_NEWER:-1}" == 1 ]]; then
  pairs=("${PAIRS[@]}" "${NEWER_PAIRS[@]}")
else
  pairs=("${PAIRS[@]}")
fi

# Whether version $1 is at least $2.
at_least() {
  [[ "$(printf '%s\n' "$2" "$1" | sort -V | head -n 1)" == "$2" ]]
}

# Builds the environment of one pair unless it is there; prints why it failed, if it did.
build_env() {
  local haiku="$1" jax="$2" env="$3"
  if [[ -x "${env}/bin/python" && -f "${env}/.complete" && "${HB_MATRIX_REBUILD:-0}" != 1 ]]; then
    return 0
  fi
  rm -rf "${env}"
  local extras=()
  if [[ "${HB_MATRIX_EXTRAS:-1}" == 1 ]]; then
    extras=("equinox>=0.13.8" "optax>=0.2.8")
    if at_least "${jax}" "${FLAX_MIN_JAX}"; then
      extras+=("${FLAX_REQUIREMENT}")
    fi
  fi
  local python="${PYTHON}"
  if at_least "${jax}" "${PYTHON312_MIN_JAX}"; then python="${PYTHON312}"; fi
  "${python}" -m venv "${env}" &&
    "${env}/bin/python" -m pip install -q --upgrade pip &&
    "${env}/bin/python" -m pip install -q "dm-haiku==${haiku}" "jax==${jax}" "jaxlib==${jax}" \
      "${TEST_PACKAGES[@]}" "${extras[@]}" &&
    touch "${env}/.complete"
}

summaries=()
status=0
mkdir -p "${DIR}"
for pair in "${pairs[@]}"; do
  haiku="${pair%/*}"
  jax="${pair#*/}"
  env="${DIR}/haiku-${haiku}_jax-${jax}"
  log="${DIR}/haiku-${haiku}_jax-${jax}.log"
  label="dm-haiku ${haiku} / jax ${jax}"
  if [[ " ${NEWER_PAIRS[*]} " == *" ${pair} "* ]]; then label+=" (past the tested set)"; fi
  echo "== ${label}: environment ${env}" >&2
  if ! build_env "${haiku}" "${jax}" "${env}" >"${log}" 2>&1; then
    summaries+=("${label}: environment failed to build (${log})")
    status=1
    continue
  fi
  # The test files, less those that import an optional package the pair does not have.
  missing=()
  for library in flax equinox optax; do
    "${env}/bin/python" -c "import ${library}" >/dev/null 2>&1 || missing+=("${library}")
  done
  files=()
  while IFS= read -r file; do
    if [[ "${#missing[@]}" -gt 0 ]] &&
       grep -qE "^(import|from) ($(IFS='|'; echo "${missing[*]}"))([. ]|$)" "${ROOT}/${file}"; then
      continue
    fi
    files+=("${file}")
  done < <(cd "${ROOT}" && if [[ -n "${HB_MATRIX_FILES:-}" ]]; then
             printf '%s\n' ${HB_MATRIX_FILES}
           else
             find "${TEST_PATHS[@]}" -name '*_test.py' | sort
           fi)
  # One pytest process per file: each starts with a fresh XLA, as under Bazel, and a process that
  # dies (a crash in XLA) costs its own file only, named in the summary.
  echo "== ${label}: pytest, ${#files[@]} files, one process each (log: ${log})" >&2
  start="${SECONDS}"
  passed=0 failed=0 skipped=0 crashed=()
  for file in "${files[@]}"; do
    out="$(cd "${ROOT}" && "${env}/bin/python" -m pytest -q -p no:cacheprovider "${file}" 2>&1)"
    code=$?
    printf '== %s (exit status %d)\n%s\n' "${file}" "${code}" "${out}" >>"${log}"
    # pytest's closing line: "4 failed, 500 passed, 18 skipped, 8 warnings in 2072.03s" (with -q).
    last="$(grep -E '(passed|failed|error|skipped).* in [0-9.]+s' <<<"${out}" | tail -n 1)"
    count() { grep -oE "[0-9]+ $1" <<<"${last}" | grep -oE '^[0-9]+' || echo 0; }
    if [[ -z "${last}" ]]; then
      crashed+=("${file} (exit status ${code})")
      continue
    fi
    passed=$((passed + $(count passed)))
    failed=$((failed + $(count failed) + $(count error)))
    skipped=$((skipped + $(count skipped)))
  done
  took=$((SECONDS - start))
  summary="${label}: ${passed} passed, ${failed} failed, ${skipped} skipped (${took} s)"
  if [[ "${#crashed[@]}" -gt 0 ]]; then
    summary+="; no pytest summary from: ${crashed[*]}"
  fi
  summaries+=("${summary}")
  if [[ "${failed}" -ne 0 || "${#crashed[@]}" -gt 0 ]]; then status=1; fi
done

printf '%s\n' "${summaries[@]}"
exit "${status}"
