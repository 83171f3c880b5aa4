#!/usr/bin/env bash
# Prepares this machine to build and test haiku_bridge with Bazel. Safe to run again: it installs
# only what is missing and rewrites .bazelrc.offline only when its contents would change.
#
#   bash testing/setup.sh && bazel test //...
#
# 1. If there is no `bazel`, installs Debian's (bazel-bootstrap, Bazel 4.2.3) and the rules_java it
#    uses offline (bazel-rules-java) with apt-get. Needs root, or sudo.
# 2. If `python3` cannot make virtual environments, installs python3 and python3-venv the same way.
#    (Bazel itself makes the virtual environment with requirements.txt on its first build; see
#    third_party/python_venv/defs.bzl.)
# 3. If the `bazel` on PATH is Debian's, writes .bazelrc.offline, which .bazelrc imports: it takes
#    rules_java, rules_cc and remote_coverage_tools from local directories, so that Bazel needs the
#    internet only for pip. Otherwise removes that file. HB_OFFLINE_RC=1 or =0 forces either way.
# 4. Creates the directory of the tests' shared XLA compilation cache (.bazelrc), which the sandbox
#    may write to only if it exists.

set -euo pipefail

readonly ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly OFFLINE_RC="${ROOT}/.bazelrc.offline"
readonly DEBIAN_RULES_JAVA=/usr/share/bazel/rules/java
readonly PYTHON="${HB_PYTHON:-python3}"

as_root() {
  if [[ "$(id -u)" -eq 0 ]]; then
    "$@"
  elif command -v sudo >/dev/null; then
    sudo "$@"
  else
    echo "testing/setup.sh: run as root (or install sudo) to run: $*" >&2
    exit 1
  fi
}

is_debian_bazel() {
  local bazel
  bazel="$(command -v bazel)" || return 1
  dpkg-query -S "$(readlink -f "${bazel}")" 2>/dev/null | grep -q '^bazel-bootstrap:'
}

packages=()
if ! command -v bazel >/dev/null; then
  packages+=(bazel-bootstrap bazel-rules-java)
elif is_debian_bazel && [[ ! -f "${DEBIAN_RULES_JAVA}/WORKSPACE" ]]; then
  packages+=(bazel-rules-java)
fi
if ! "${PYTHON}" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  packages+=(python3 python3-venv)
fi

if [[ "${#packages[@]}" -gt 0 ]]; then
  if ! command -v apt-get >/dev/null; then
    echo "testing/setup.sh: please install: ${packages[*]} (Bazel 4.2.3 is the tested version)." >&2
    exit 1
  fi
  echo "testing/setup.sh: installing ${packages[*]} with apt-get" >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${packages[@]}"
fi

offline="${HB_OFFLINE_RC:-}"
if [[ -z "${offline}" ]]; then
  if is_debian_bazel; then offline=1; else offline=0; fi
fi

if [[ "${offline}" == 1 ]]; then
  # `query` and `fetch` do not inherit `build` options, so each command gets the flags.
  contents="# Written by testing/setup.sh for Debian's Bazel; delete it to fetch these repositories."
  for command in build fetch query sync; do
    for override in \
        "rules_java=${DEBIAN_RULES_JAVA}" \
        "rules_cc=${ROOT}/third_party/rules_cc" \
        "remote_coverage_tools=${ROOT}/third_party/remote_coverage_tools"; do
      contents+=$'\n'"${command} --override_repository=${override}"
    done
  done
  if [[ ! -f "${OFFLINE_RC}" || "$(cat "${OFFLINE_RC}")" != "${contents}" ]]; then
    printf '%s\n' "${contents}" > "${OFFLINE_RC}"
  fi
else
  rm -f "${OFFLINE_RC}"
fi

mkdir -p /tmp/haiku_bridge_xla_cache
