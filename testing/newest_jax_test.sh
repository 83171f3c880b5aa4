#!/usr/bin/env bash
# The newest-jax leg: a core subset of the suite on the newest jax the package index serves.
#
#   bazel test //testing:newest_jax_test        # as part of `bazel test //...`
#
# The pinned leg (every other target) runs on requirements.txt's jax. This one runs the files
# testing/BUILD lists for it (README snippets, call_pure, the scans, custom gradients, the Flax and
# Equinox adapters) with pytest, on @hb_python_newest: Python >= 3.12 with
# testing/requirements-newest.txt installed (third_party/python_venv/defs.bzl finds the Python).
# XLA_FLAGS is left to conftest.py, which gives only the flags this jaxlib knows (testing/xla_flags.py).
#
# Arguments: the environment's `python` script, then pytest's arguments (the test files).
# Where no Python >= 3.12 is found the leg cannot run: it says so and passes, except under CI=true,
# where it fails.

set -uo pipefail
readonly PYTHON="$1"
shift

# Bazel's test sharding (`shard_count`): this process runs shard TEST_SHARD_INDEX of
# TEST_TOTAL_SHARDS, whole test classes, chosen by conftest.py (testing/pytest_shards.py).
if [[ -n "${TEST_TOTAL_SHARDS:-}" ]]; then
  touch "${TEST_SHARD_STATUS_FILE}"
  export HB_PYTEST_SHARD="${TEST_SHARD_INDEX}/${TEST_TOTAL_SHARDS}"
fi

"${PYTHON}" -c "pass"
status=$?
if [[ ${status} -eq 3 ]]; then
  if [[ "${CI:-}" == true ]]; then
    echo "newest_jax_test: CI=true and no Python >= 3.12: the newest-jax leg cannot run." >&2
    exit 1
  fi
  echo "newest_jax_test: skipped, no Python >= 3.12 (see above)." >&2
  exit 0
elif [[ ${status} -ne 0 ]]; then
  exit "${status}"
fi

unset XLA_FLAGS
"${PYTHON}" -c "import jax, sys; print('newest-jax leg: Python', sys.version.split()[0], 'jax', jax.__version__)"
exec "${PYTHON}" -m pytest -q -p no:cacheprovider -rfEs --durations=10 "$@"
