#!/bin/bash
# run_fuzzer.sh FUZZER CORPUS_DIR RUNS: a short libFuzzer pass seeded with the
# committed corpus; new inputs go to a scratch directory, so the corpus in the
# source tree is never modified. Fails on any crash, leak or timeout.
set -euo pipefail
fuzzer=$1 corpus=$2 runs=$3
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$fuzzer" -runs="$runs" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
  -artifact_prefix="$scratch/" "$scratch" "$corpus" 2>&1 | tail -n 5
