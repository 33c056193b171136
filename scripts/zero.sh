#!/usr/bin/env bash
# The newcomer's entry point, and CI's: installs what is missing on a Debian
# machine, configures and builds with Meson, then runs the main job or the tests.
#
#   scripts/zero.sh train [TRAINER OPTIONS]   Fashion-MNIST MLP, 4 in-process ranks, ZeRO stage 3 (CPU)
#   scripts/zero.sh test  [MESON TEST OPTIONS] every test of the build (GPU tests skip without a GPU)
#   scripts/zero.sh setup                      only install the missing packages
#
# Environment:
#   ZERO_BUILD_DIR    build folder (default: build)
#   ZERO_SETUP_ARGS   extra `meson setup` options for a new build folder (e.g. -Db_sanitize=address,undefined)
#   ZERO_NO_INSTALL=1 never call apt-get; fail with the list of missing packages instead
#   CXX               the C++ compiler of a new build folder (as Meson reads it)
#
# One list of packages serves the README, CI and this script. Why a script and
# not a paragraph: a newcomer runs the first command they see, and a command
# that stops at `meson: command not found` teaches nothing.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# What building and running the main job needs.
# liburing, nlohmann-json and xxHash serve the disk offload tier and the
# checkpoints, which the trainers use.
train_packages=(meson ninja-build g++ pkg-config libopenblas-dev zlib1g-dev libcli11-dev
                dataset-fashion-mnist python3 liburing-dev nlohmann-json3-dev libxxhash-dev)
# What the whole test suite needs beyond that: Catch2, Open MPI for the MPI
# communicator tests, CMake for the CMake-consumer test, clang (with its OpenMP
# runtime) for the second compiler CI builds with and the fuzzers, The
# Devil's Dictionary, the GPT trainer's corpus, and PyTorch, which evaluates
# the checkpoint tool's Hugging Face export as an independent reference, and
# LibTorch (PyTorch's C++ library, the same 1.13), for the LibTorch adapter's
# example and its tests against torch::optim::AdamW; lld, which links the
# test programs in a third of GNU ld's time (meson.build uses it where found).
test_packages=(catch2 libopenmpi-dev openmpi-bin cmake clang libomp-dev dict-devil python3-torch libtorch-dev lld)

say() { printf 'zero.sh: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

usage() {
  sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# Installs the packages among "$@" that dpkg does not list as installed.
install_missing() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
  done
  ((${#missing[@]})) || return 0

  command -v apt-get >/dev/null 2>&1 ||
    die "missing packages: ${missing[*]}; this script installs them with apt-get (Debian 12), which is not here. Install their equivalents, then run it again."
  [[ "${ZERO_NO_INSTALL:-0}" == 1 ]] &&
    die "missing packages: ${missing[*]} (ZERO_NO_INSTALL=1 forbids installing them). Run: apt-get install ${missing[*]}"

  local as_root=()
  if [[ "$(id -u)" != 0 ]]; then
    command -v sudo >/dev/null 2>&1 ||
      die "missing packages: ${missing[*]}; installing needs root and sudo is not here. As root run: apt-get install ${missing[*]}"
    as_root=(sudo)
  fi
  say "installing ${#missing[@]} missing package(s): ${missing[*]}"
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq ||
    die "apt-get update failed (no access to the Debian archive?)"
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" ||
    die "apt-get install failed for: ${missing[*]}"
}

# Configures the build folder once; later calls reuse it (Meson reconfigures by
# itself when a meson.build changes).
configure() {
  local build=$1
  shift
  if [[ ! -f "$build/build.ninja" ]]; then
    # shellcheck disable=SC2086 # ZERO_SETUP_ARGS is a list of options
    meson setup "$build" "$repo" ${ZERO_SETUP_ARGS:-} "$@"
  else
    # Reconfigure only for an option whose value differs: each reconfigure
    # re-runs the CUDA probes.
    local option
    for option in "$@"; do
      [[ "$(option_value "$build" "${option%%=*}")" == "${option#*=}" ]] || meson configure "$build" "$option" >/dev/null
    done
  fi
}

# The value of -D<name> in a configured build folder ("true", "false", ...).
option_value() {
  meson introspect "$1" --buildoptions | python3 -c '
import json, sys
name = sys.argv[1]
for option in json.load(sys.stdin):
    if option["name"] == name:
        print(str(option["value"]).lower())' "${2#-D}"
}

command=${1:-}
[[ $# -gt 0 ]] && shift
build=${ZERO_BUILD_DIR:-$repo/build}
[[ "$build" = /* ]] || build=$PWD/$build

# Open MPI refuses to start as root without these (containers and CI run as root).
if [[ "$(id -u)" == 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

case "$command" in
  setup)
    install_missing "${train_packages[@]}" "${test_packages[@]}"
    ;;
  train)
    install_missing "${train_packages[@]}"
    # The main job needs no test framework: a build folder made for it leaves
    # the tests out, and `test` turns them back on.
    if [[ -f "$build/build.ninja" ]]; then configure "$build"; else configure "$build" -Dtests=false; fi
    meson compile -C "$build" train_fashion_mnist
    exec "$build/examples/train_fashion_mnist" "$@"
    ;;
  test)
    install_missing "${train_packages[@]}" "${test_packages[@]}"
    configure "$build" -Dtests=true
    meson compile -C "$build"
    exec meson test -C "$build" --print-errorlogs "$@"
    ;;
  -h | --help | help | '')
    usage
    ;;
  *)
    say "unknown command '$command'"
    usage
    ;;
esac
