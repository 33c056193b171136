#!/usr/bin/env bash
# Why: ZeRO++ (issue 22) is worth its inexactness only where the link
# between nodes is what a step waits for. This script measures that on one
# machine: two network namespaces joined by a rate-limited veth
# (bench/netns_link.sh) as two nodes of two ranks, Open MPI over TCP between
# them, and the GPT trainer at stage 3 three times:
#   fast   plain stage 3 over a fast link (--fast-rate): the step without the
#          slow link, so (slow - fast) / slow is communication's share of it;
#   plain  plain stage 3 over the slow link (--rate);
#   zeropp --hpz --qwz --qgz over the slow link,
# each from a freshly made link (its counters from zero). For each it prints
# the time per step, the bytes the veth pair carried (both directions) and
# the bytes every rank's comm_report() says it sent to the other node,
# summed over the ranks (the trainer's "communication_all_ranks" report),
# and their ratio; then the speedup of zeropp over plain. The veth MTU is
# 9000, so that per-packet headers (66 bytes each) are under 1% of what
# crosses.
#
#   bench/zeropp_link.sh [--rate 200mbit] [--fast-rate 10gbit] [--steps 20]
#                        [--gpt PATH] [--check] [-- MORE GPT_TRAIN ARGS]
#
# --gpt     the gpt_train binary (default: build/examples/gpt_train beside
#           the source tree, else /work/build/examples/gpt_train)
# --check   exit 1 unless every run's veth bytes are within 5% of what the
#           reports say crossed (the CI test runs it with --steps 3); the
#           speedup is printed, not checked (times on a shared machine drift)
#
# Needs what bench/netns_link.sh needs (root, iproute2 with tbf, Open MPI);
# without it, its message and exit 77.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LINK="$HERE/netns_link.sh"
RATE=200mbit
FAST=10gbit
STEPS=20
CHECK=0
GPT=""
for candidate in "$HERE/../build/examples/gpt_train" /work/build/examples/gpt_train; do
  [[ -z $GPT && -x $candidate ]] && GPT=$candidate
done
EXTRA=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --rate) RATE=${2:?--rate needs a value}; shift 2 ;;
    --fast-rate) FAST=${2:?--fast-rate needs a value}; shift 2 ;;
    --steps) STEPS=${2:?--steps needs a value}; shift 2 ;;
    --gpt) GPT=${2:?--gpt needs a path}; shift 2 ;;
    --check) CHECK=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h | --help) sed -n '/^#   bench/,/^#  *\[--gpt/p' "${BASH_SOURCE[0]}" | sed 's/^#  //' >&2; exit 2 ;;
    *) echo "zeropp_link: unknown argument '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done
[[ -n $GPT && -x $GPT ]] || { echo "zeropp_link: no gpt_train binary: build it (ninja -C build examples/gpt_train) or pass --gpt PATH" >&2; exit 2; }
[[ $STEPS =~ ^[1-9][0-9]*$ ]] || { echo "zeropp_link: --steps wants a positive number" >&2; exit 2; }

trap '"$LINK" down >/dev/null 2>&1 || true' EXIT
failed=0
declare -A MS CROSSED

# run NAME RATE [GPT ARGS...]: one trainer run over a fresh link at RATE.
run() {
  local name=$1 rate=$2
  shift 2
  local out rc=0
  "$LINK" down >/dev/null 2>&1 || true
  out=$("$LINK" up --rate "$rate" --mtu 9000 2>&1) || { rc=$?; echo "$out" >&2; exit "$rc"; }  # 77: cannot, here
  out=$("$LINK" run --ppn 2 -- "$GPT" --comm mpi --steps "$STEPS" --eval-every "$STEPS" --sample 0 --report \
        "${EXTRA[@]}" "$@" 2>&1) || rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "$out" >&2
    echo "zeropp_link: the $name run failed (exit $rc)" >&2
    exit 1
  fi
  local ms veth reported
  ms=$(grep -o '[0-9.]* ms/step' <<<"$out" | tail -1 | cut -d' ' -f1)
  veth=$(grep -o 'zveth[01]: tx [0-9.]* MB ([0-9]* B)' <<<"$out" | grep -o '([0-9]* B)' | tr -dc '0-9\n' |
         awk '{s += $1} END {print s + 0}')
  reported=$(grep -o '"across_nodes_sent_bytes":[0-9.e+]*' <<<"$out" | tail -1 | cut -d: -f2)
  [[ -n $ms && -n $reported ]] || { echo "$out" >&2; echo "zeropp_link: no ms/step or report in the $name run" >&2; exit 1; }
  local ratio
  ratio=$(awk -v a="$veth" -v b="$reported" 'BEGIN { printf "%.4f", (b > 0 ? a / b : 0) }')
  MS[$name]=$ms
  CROSSED[$name]=$veth
  printf "%-7s link %-8s %8.1f ms/step   veth %12d B   reports %12.0f B   veth / reports %s\n" \
    "$name" "$rate" "$ms" "$veth" "$reported" "$ratio"
  if ! awk -v r="$ratio" 'BEGIN { exit !(r >= 0.95 && r <= 1.05) }'; then
    echo "zeropp_link: the $name run's link carried $ratio x what the reports say crossed nodes (outside 0.95-1.05)" >&2
    failed=1
  fi
}

echo "GPT trainer (${GPT}), 4 ranks as 2 nodes of 2 (Open MPI over TCP between two namespaces), stage 3, $STEPS steps"
run fast "$FAST"
run plain "$RATE"
run zeropp "$RATE" --hpz --qwz --qgz
awk -v fast="${MS[fast]}" -v plain="${MS[plain]}" -v zpp="${MS[zeropp]}" -v bp="${CROSSED[plain]}" \
    -v bz="${CROSSED[zeropp]}" -v rate="$RATE" 'BEGIN {
  printf "communication share of plain stage 3 at %s: %.0f%% ((plain - fast) / plain)\n", rate, (100 * (plain - fast) / plain)
  printf "zeropp (--hpz --qwz --qgz) over plain at %s: %.2fx faster per step, %.1fx fewer bytes through the link\n",
         rate, plain / zpp, (bz > 0 ? bp / bz : 0)
}'
if [[ $CHECK -eq 1 && $failed -ne 0 ]]; then exit 1; fi
exit 0
