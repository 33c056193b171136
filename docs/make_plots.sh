#!/usr/bin/env bash
# Runs the programs behind the figures of docs/ and draws them into docs/images/.
#
#   bash docs/make_plots.sh [BUILD_DIR] [DATA_DIR]      (defaults: build, docs/plot-data)
#   PARTS="step training" bash docs/make_plots.sh       (a subset of: memory step comm training peers;
#                                                        peers only when named: PEERS_JSON=FILE draws FILE)
#   IMAGES=/tmp/figures ...                             (draw elsewhere than docs/images)
#   STEP_REPS=41 STEP_ROUNDS=5 ...                      (bench_step_host: repetitions per run, default 21;
#                                                        passes over all sizes, default 3)
#
# Every part runs only if its program is built (meson compile -C BUILD_DIR
# zero_plan bench_step_host bench_comm train_fashion_mnist); the JSON lands in
# DATA_DIR, next to machine.json (where it was measured), so a figure can be
# redrawn, or checked, without running anything: /usr/bin/python3 docs/plots.py --data DATA_DIR
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
data=${2:-$here/plot-data}
parts=${PARTS:-memory step comm training}
images=${IMAGES:-$here/images}  # where the figures go
python=/usr/bin/python3

mkdir -p "$data"
has_part() { [[ " $parts " == *" $1 "* ]]; }

# Where the figures come from: written every run, read by plots.py for the titles.
l3_bytes=$(getconf LEVEL3_CACHE_SIZE 2>/dev/null || echo 0)
cpu=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1)
cat >"$data/machine.json" <<EOF
{"cpu": "${cpu:-unknown CPU}", "cores": $(nproc), "l3_bytes": ${l3_bytes:-0}, "date": "$(date -u +%Y-%m-%d)",
 "compiler": "$(${CXX:-g++} --version 2>/dev/null | head -n 1)"}
EOF

# ready PART PROGRAM SUBDIR: true when PART was asked for and PROGRAM is built; DATA/SUBDIR is then emptied
# for its new output. Otherwise says why the part is skipped.
ready() {
  has_part "$1" || return 1
  if [[ ! -x $2 ]]; then
    echo "$1: $2 is not built (meson compile -C $build $(basename "$2")); skipped"
    return 1
  fi
  rm -rf "${data:?}/$3" && mkdir -p "$data/$3"
}

# (1) Memory per rank against N, 7.5B parameters as in the ZeRO paper's example, in 32 units (layers)
#     of 234M: the largest units size stage 3's gather arena and the gradient staging. Without zero_plan,
#     plots.py draws the paper's formulas from any plan data already in DATA_DIR, or alone.
plan=$build/examples/zero_plan
if ready memory "$plan" plan; then
  for stage in 0 1 2 3; do
    for n in 1 2 4 8 16 32 64 128 256 512 1024; do
      if ((n <= 8)); then per_node=$n nodes=1; else per_node=8 nodes=$((n / 8)); fi
      "$plan" --params 7.5B --units 32 --ranks-per-node "$per_node" --nodes "$nodes" --stage "$stage" --precision fp16 \
        --optimizer adam --json >"$data/plan/stage${stage}_n${n}.json"
    done
  done
fi

# (2) The host fused step against its bandwidth probe, 64K..64M parameters. Several passes over all
#     sizes, so that the machine's drift hits every size; plots.py keeps the fastest step and the
#     fastest probe of each size over all passes.
bench=$build/bench/bench_step_host
if ready step "$bench" step_host; then
  for round in $(seq "${STEP_ROUNDS:-3}"); do
    for size in 64K 128K 256K 512K 1M 2M 4M 8M 16M 32M 64M; do
      echo "bench_step_host --n $size (pass $round)"
      "$bench" --json --n "$size" --reps "${STEP_REPS:-21}" >"$data/step_host/n${size}_pass$round.json"
    done
  done
fi

# (3) Communicator bandwidth over message sizes: comm::Local, and comm::Mpi when the benchmark takes
#     --comm (its usage line says so) and mpirun exists.
bench=$build/bench/bench_comm
if ready comm "$bench" comm; then
  "$bench" --json >"$data/comm/local.json"
  usage=$("$bench" --help 2>&1 || true)
  if command -v mpirun >/dev/null && [[ $usage == *--comm* ]]; then
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none \
      mpirun -np 2 --oversubscribe "$bench" --comm mpi --json >"$data/comm/mpi.json" ||
      { echo "comm: the mpirun run failed; Local rows only"; rm -f "$data/comm/mpi.json"; }
  fi
fi

# (4) The trainer's loss and test accuracy per epoch, stages 0-3 (4 in-process ranks, bf16, AdamW):
#     its --history-json when it has one, its stdout in any case.
trainer=$build/examples/train_fashion_mnist
if ready training "$trainer" train; then
  usage=$("$trainer" --help 2>&1 || true)
  for stage in 0 1 2 3; do
    echo "train_fashion_mnist --stage $stage"
    history=()
    [[ $usage == *--history-json* ]] && history=(--history-json "$data/train/stage$stage.json")
    "$trainer" --stage "$stage" "${history[@]}" | tee "$data/train/stage$stage.txt"
  done
fi

# (5) zero beside PyTorch 2.x, FSDP2 and DeepSpeed (asked for alone: PARTS=peers): the results JSON
#     of PEERS_JSON=FILE (bench/peers/run.sh --json FILE, bench/results/*-peers-*.json), or of a
#     full run of bench/peers/run.sh now (under 30 minutes on 2 cores, and a 5.4 GB environment once).
if has_part peers; then
  rm -rf "${data:?}/peers" && mkdir -p "$data/peers"
  if [[ -n ${PEERS_JSON:-} ]]; then
    cp "$PEERS_JSON" "$data/peers/results.json"
  else
    "$here/../bench/peers/run.sh" --json "$data/peers/results.json"
  fi
fi

only=$(echo "$parts" | tr ' ' ',')
"$python" "$here/plots.py" --data "$data" --out "$images" --only "$only"
