#!/usr/bin/env bash
# Installs zero from this build (with DESTDIR, into a scratch folder: the
# package config must find its prefix from its own place), then configures,
# builds and runs tests/consumer_cmake with CMake against that tree. Also holds
# the package config to its contract: a version of another major is refused,
# and COMPONENTS nccl fails with a message naming NCCL wherever NCCL is absent.
#
#   check_cmake_consumer.sh MESON BUILD_DIR PREFIX CXX...
set -euo pipefail
command -v cmake >/dev/null || { echo "SKIP: cmake is not installed (apt-get install cmake)"; exit 77; }
meson=$1 build=$2 prefix=$3
shift 3
cxx=("$@")
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
step() {  # step NAME COMMAND...: runs it, shows its log only when it fails
  local name=$1
  shift
  "$@" >"$work/$name.log" 2>&1 || { echo "FAIL: $name: $*"; cat "$work/$name.log"; exit 1; }
}

# The headers and config files only: nothing in the build needs compiling.
step install "$meson" install -C "$build" --no-rebuild --destdir "$work/dest"
installed=$work/dest$prefix
config=$(find "$installed" -name zeroConfig.cmake)
[[ -n $config ]] || { echo "FAIL: no zeroConfig.cmake under $installed"; exit 1; }
echo "installed: ${config#"$work/dest"}"

# The compiler Meson uses (the last word of its command: a launcher such as ccache may come first).
# No build type: what is checked is that the package config is found and
# compiles and links a program, which -O0 checks too (12 s at -O3, 5 s).
configure=(cmake -G Ninja -DCMAKE_BUILD_TYPE= -DCMAKE_CXX_COMPILER="${cxx[-1]}"
           -DCMAKE_PREFIX_PATH="$installed")
step configure "${configure[@]}" -S "$repo/tests/consumer_cmake" -B "$work/build"
grep -E "zero::nccl|zero [0-9]" "$work/configure.log"
step build cmake --build "$work/build"
"$work/build/cmake_consumer"

# Contract checks on a one-line project each.
said() {  # said NAME TEXT: NAME's log says TEXT (CMake wraps its messages: lines are joined first)
  tr -s ' \n' '  ' <"$work/$1.log" | grep -qF "$2" || { echo "FAIL: $1 did not say: $2"; cat "$work/$1.log"; exit 1; }
}
probe() {  # probe NAME FIND_PACKAGE_ARGS: configures a project that only calls find_package
  rm -rf "$work/$1"
  mkdir -p "$work/$1"
  # It says where it found NCCL, as the consumer does, so that a probe that
  # should not have found it names the copy to hide next.
  printf '%s\n' 'cmake_minimum_required(VERSION 3.16)' 'project(probe LANGUAGES CXX)' "find_package($2)" \
    'if(TARGET zero::nccl)' \
    '  message(STATUS "zero::nccl: NCCL at ${ZERO_NCCL_INCLUDE_DIR} and ${ZERO_NCCL_LIBRARY}")' \
    'endif()' >"$work/$1/CMakeLists.txt"
  "${configure[@]}" "${hide[@]}" -S "$work/$1" -B "$work/$1/build" >"$work/$1.log" 2>&1
}
hide=()
if probe major "zero 1.0 CONFIG REQUIRED"; then
  echo "FAIL: find_package(zero 1.0) accepted version 0.x"; cat "$work/major.log"; exit 1
fi
said major "zeroConfig.cmake, version: 0."
echo "find_package(zero 1.0) refused, as it must be"
# COMPONENTS nccl: found here, it must succeed; then, with NCCL hidden (or
# where there is none), it must fail naming what is missing. A machine may hold
# several copies (the toolkit's, one in /usr/local/include, a distribution's)
# and reach a folder through a link (/usr/local/cuda -> cuda-13.0): each round
# hides the folders of the copy the last probe found, as found and as resolved,
# until none is found. CMAKE_IGNORE_PATH matches folders exactly, so nothing
# else a folder's parent holds is hidden.
if grep -q "zero::nccl: NCCL at " "$work/configure.log"; then
  step nccl probe nccl "zero CONFIG REQUIRED COMPONENTS nccl"
fi
hidden=()
hide_copy() {  # hide_copy LOG: adds the folders of the NCCL copy LOG reports to hidden
  local header_dir library dir
  read -r _ _ _ header_dir _ library < <(grep -o "zero::nccl: NCCL at .*" "$work/$1.log")
  for dir in "$header_dir" "$(dirname "$library")"; do
    hidden+=("$dir" "$(realpath -m "$dir")")
  done
  hide=(-DCMAKE_IGNORE_PATH="$(IFS=';'; echo "${hidden[*]}")")
  echo "found NCCL at $header_dir and $library; hiding its folders"
}
found=configure
for round in 1 2 3 4 5 6; do
  grep -q "zero::nccl: NCCL at " "$work/$found.log" || break
  hide_copy "$found"
  if ! probe no_nccl "zero CONFIG REQUIRED COMPONENTS nccl"; then
    break
  fi
  found=no_nccl
  if ((round == 6)); then
    echo "FAIL: COMPONENTS nccl succeeded without NCCL: still found after hiding ${hidden[*]}"
    cat "$work/no_nccl.log"; exit 1
  fi
done
if ((${#hidden[@]} == 0)) && probe no_nccl "zero CONFIG REQUIRED COMPONENTS nccl"; then
  echo "FAIL: COMPONENTS nccl succeeded without NCCL"; cat "$work/no_nccl.log"; exit 1
fi
said no_nccl "zero: the 'nccl' component (zero::nccl) was asked for, but"
said no_nccl "was not found"
echo "find_package(zero COMPONENTS nccl) without NCCL: $(tr -s ' \n' '  ' <"$work/no_nccl.log" | grep -o "zero: the 'nccl'.*its prefix")"
if probe bogus "zero CONFIG REQUIRED COMPONENTS mpi"; then
  echo "FAIL: an unknown component was accepted"; exit 1
fi
said bogus "zero has no component 'mpi'"
echo "find_package(zero COMPONENTS mpi) refused: no such component"
