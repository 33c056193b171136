#!/usr/bin/env bash
# Builds tests/consumer as a separate Meson project that pulls zero in as a
# subproject (the way a user's project would), then runs it.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$repo/tests/consumer/meson.build" "$repo/tests/consumer/consumer.cpp" "$work/"
mkdir -p "$work/subprojects"
ln -s "$repo" "$work/subprojects/zero"
meson setup "$work/build" "$work" >"$work/setup.log" 2>&1 || { cat "$work/setup.log"; exit 1; }
ninja -C "$work/build" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
"$work/build/consumer"
