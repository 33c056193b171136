#!/usr/bin/env bash
# Why: GPU time is scarce and machines with GPUs here have no package access
# and no Catch2, so every CUDA check runs from this one prepared script, in a
# fixed order of value (build, tests, benchmarks, then the sanitizers), each
# step under its own timeout inside one overall deadline (7.5 minutes), and
# leaves at most 8 files in OUTDIR (all that some remote runners bring back).
#
#   bash bench/gpu_check.sh OUTDIR          (from the repository root)
#   bash bench/gpu_check.sh --prepare-carry (here, before: see the GPT trainer below)
#
# Needs: an NVIDIA GPU and driver, the CUDA toolkit (nvcc; compute-sanitizer
# optional), a C++20 host compiler, Meson (a command or the Python package),
# ninja, Python 3 with PyTorch 2.x (optional: its peer numbers are skipped).
# Environment: ZERO_GPU_BUILD (build directory, default /tmp/zero-gpu-build),
# ZERO_GPU_ARCH (e.g. 90; default: detected), ZERO_GPU_DEADLINE (seconds, 450),
# ZERO_GPU_CARRY (default .gpu_carry in the repository root).
#
# The GPT trainer (examples/gpt, --backend cuda) needs what the examples need:
# BLAS and zlib (from the machine), CLI11, nlohmann-json and xxHash (header-only;
# the last two for --save/--resume) and its corpus, The Devil's Dictionary,
# which GPU machines lack. `--prepare-carry`, run where they are installed (apt
# libcli11-dev nlohmann-json3-dev libxxhash-dev dict-devil), copies them into
# .gpu_carry/ (git-ignored), which travels with the working tree when the
# runner carries it; the build then adds .gpu_carry/include to the include
# path. Without BLAS or zlib the examples do not configure: the GPT runs are
# then NOT RUN and the rest goes on as before.
#
# OUTDIR gets: summary.txt (results, step outcomes, environment; with the
# offload step's split into GPU wait, CPU update and transfers, and device
# memory against memory_report(), from the tests' log), build.log,
# tests.log, sanitizer.log, bench.log (the benchmarks' stderr, the GPT runs,
# the host step's lines), bench_step_cuda.jsonl and torch_cuda_optim.jsonl
# (JSON lines only), and bench_comm_cuda.json (LocalDevice and Nccl
# bandwidths, bench_comm's schema).
set -u -o pipefail

if [ "${1:-}" = --prepare-carry ]; then
  carry=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.gpu_carry
  mkdir -p "$carry/include" || exit 1
  cp -r /usr/include/CLI "$carry/include/" || { echo "no /usr/include/CLI: apt-get install libcli11-dev" >&2; exit 1; }
  cp -r /usr/include/nlohmann /usr/include/xxhash.h "$carry/include/" ||
    { echo "no nlohmann/ or xxhash.h: apt-get install nlohmann-json3-dev libxxhash-dev" >&2; exit 1; }
  cp /usr/share/dictd/devil.dict.dz "$carry/" || { echo "no corpus: apt-get install dict-devil" >&2; exit 1; }
  echo "prepared $carry ($(du -sh "$carry" | cut -f1)); carry .gpu_carry with the working tree"
  exit 0
fi
if [ $# -ne 1 ]; then
  echo "usage: bash bench/gpu_check.sh OUTDIR | --prepare-carry" >&2
  exit 2
fi
OUT=$1
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${ZERO_GPU_BUILD:-/tmp/zero-gpu-build}
CARRY=${ZERO_GPU_CARRY:-$ROOT/.gpu_carry}
DEADLINE_S=${ZERO_GPU_DEADLINE:-450}
START=$(date +%s)
SUMMARY=$OUT/summary.txt
ENVLOG=$(mktemp)  # appended to summary.txt at the end
: >"$SUMMARY"
STATUS_LINES=()

now() { date +%s; }
left() { echo $((DEADLINE_S - ($(now) - START))); }

# run_step NAME CAP_SECONDS LOG [--stdout FILE] COMMAND...: runs COMMAND
# under min(CAP, time left - 5 s), appending its stderr (and its stdout, unless
# --stdout sends that to FILE) to LOG; records the outcome (PASS, FAIL rc,
# SKIP (77), TIMEOUT, NO TIME) and returns the rc.
run_step() {
  local name=$1 cap=$2 log=$3 stdout=$3
  shift 3
  if [ "${1:-}" = --stdout ]; then
    stdout=$2
    shift 2
  fi
  local budget
  budget=$(($(left) - 5))
  [ "$budget" -gt "$cap" ] && budget=$cap
  if [ "$budget" -lt 10 ]; then
    STATUS_LINES+=("$(printf '%-22s NO TIME (deadline %ss reached)' "$name" "$DEADLINE_S")")
    echo "== $name: not run, no time left" >>"$log"
    return 125
  fi
  echo "== $name (timeout ${budget}s): $*" >>"$log"
  local t0 rc outcome
  t0=$(now)
  timeout --signal=TERM --kill-after=10 "$budget" "$@" >>"$stdout" 2>>"$log"
  rc=$?
  case $rc in
    0) outcome=PASS ;;
    77) outcome="SKIP (exit 77)" ;;
    124 | 137) outcome="TIMEOUT after ${budget}s" ;;
    *) outcome="FAIL (exit $rc)" ;;
  esac
  STATUS_LINES+=("$(printf '%-22s %-26s %4ss  -> %s' "$name" "$outcome" "$(($(now) - t0))" "$(basename "$stdout")")")
  echo "== $name: $outcome" >>"$log"
  return $rc
}

# ---- tools ------------------------------------------------------------------
for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
  if [ -x "$d/nvcc" ] && ! command -v nvcc >/dev/null 2>&1; then PATH=$d:$PATH; fi
done
if ! command -v ninja >/dev/null 2>&1; then
  ninja_dir=$(python3 -c 'import ninja, os; print(ninja.BIN_DIR)' 2>/dev/null) && PATH=$ninja_dir:$PATH
fi
export PATH
if command -v meson >/dev/null 2>&1; then
  MESON=(meson)
else
  MESON=(python3 -m mesonbuild.mesonmain)
fi

# ---- environment and architecture --------------------------------------------
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "root: $ROOT"
  (cd "$ROOT" && git rev-parse HEAD 2>/dev/null && git status --short 2>/dev/null | head -40) || echo "git: n/a"
  echo "--- nvidia-smi"
  timeout 20 nvidia-smi 2>&1 || echo "nvidia-smi failed"
  timeout 20 nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,clocks.max.memory,clocks.max.sm \
    --format=csv 2>&1 || true
  echo "--- tools"
  command -v nvcc && timeout 20 nvcc --version 2>&1 | tail -2
  command -v compute-sanitizer || echo "compute-sanitizer: not found"
  echo "meson: ${MESON[*]} $(timeout 20 "${MESON[@]}" --version 2>&1)"
  echo "ninja: $(command -v ninja) $(timeout 10 ninja --version 2>&1)"
  echo "c++: $(timeout 10 c++ --version 2>&1 | head -1)"
  echo "python3: $(command -v python3) $(python3 --version 2>&1)"
  timeout 60 python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 | tail -1
  echo "cpus: $(nproc) $(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2-)"
} >>"$ENVLOG" 2>&1

ARCH=${ZERO_GPU_ARCH:-}
if [ -z "$ARCH" ]; then
  ARCH=$(timeout 20 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
fi
if ! [[ "$ARCH" =~ ^[0-9]+[a-z]?$ ]] && command -v __nvcc_device_query >/dev/null 2>&1; then
  ARCH=$(timeout 20 __nvcc_device_query 2>/dev/null | tr ', ' '\n' | grep -E '^[0-9]+$' | head -1)
fi
if ! [[ "$ARCH" =~ ^[0-9]+[a-z]?$ ]]; then
  ARCH=90
  echo "architecture: not detected, using $ARCH" >>"$ENVLOG"
fi
echo "architecture: sm_$ARCH" >>"$ENVLOG"

# ---- configure and build ----------------------------------------------------------
BUILDLOG=$OUT/build.log
: >"$BUILDLOG"
rm -rf "$BUILD"
TEST_BIN=$BUILD/tests/cuda/test_cuda_kernels
BENCH_BIN=$BUILD/bench/cuda/bench_step_cuda
COMM_BIN=$BUILD/bench/cuda/bench_comm_cuda
GPT_BIN=$BUILD/examples/gpt_train
build_ok=0
configured=0
# With the examples (for the GPT trainer) where their dependencies are here;
# otherwise without, as before.
if run_step configure_examples 90 "$BUILDLOG" "${MESON[@]}" setup "$BUILD" "$ROOT" --buildtype=release -Dtests=false \
  -Dmpi=disabled -Dexamples=true -Dcuda=enabled "-Dgpu_arch=$ARCH" "-Dcpp_args=-I$CARRY/include"; then
  configured=1
else
  rm -rf "$BUILD"
  run_step configure 90 "$BUILDLOG" "${MESON[@]}" setup "$BUILD" "$ROOT" --buildtype=release -Dtests=false \
    -Dmpi=disabled -Dexamples=false -Dcuda=enabled "-Dgpu_arch=$ARCH" && configured=1
fi
if [ $configured = 1 ]; then
  targets=(tests/cuda/test_cuda_kernels)
  # The build's targets, listed once. (Not `ninja -t targets | grep -q`: grep
  # -q exits at the first match, ninja then dies of SIGPIPE, and under
  # pipefail the test fails at random: a dry run without a GPU lost
  # test_cuda_failures and bench_comm_cuda that way.)
  known_targets=$(ninja -C "$BUILD" -t targets all 2>/dev/null)
  has_target() { grep -q "^$1:" <<<"$known_targets"; }
  if has_target examples/gpt_train; then
    targets+=(examples/gpt_train)
  fi
  # `meson test --no-rebuild` below runs every test of suite cuda: build each one's program.
  for t in test_cuda_engine test_cuda_failures test_gpt_cuda; do
    if has_target "tests/cuda/$t"; then
      targets+=("tests/cuda/$t")
    fi
  done
  for bench in bench_step_cuda bench_comm_cuda; do
    if has_target "bench/cuda/$bench"; then
      targets+=("bench/cuda/$bench")
    fi
  done
  # The host step too: this machine's CPU cores are the ones ZeRO-Offload's
  # update runs on, and more of them than CI's 2 (issue 21's host figures).
  if has_target bench/bench_step_host; then
    targets+=(bench/bench_step_host)
  fi
  if run_step build 240 "$BUILDLOG" ninja -C "$BUILD" "${targets[@]}"; then build_ok=1; fi
  if [ ! -x "$BENCH_BIN" ]; then
    # bench/meson.build does not reach bench/cuda: build it the way bench/cuda/meson.build would.
    mkdir -p "$(dirname "$BENCH_BIN")"
    run_step build_bench_direct 150 "$BUILDLOG" nvcc -std=c++20 -O3 --expt-relaxed-constexpr -lineinfo \
      -Xcompiler=-fopenmp,-Wno-psabi "-I$ROOT/include" "-gencode=arch=compute_$ARCH,code=[sm_$ARCH,compute_$ARCH]" \
      "$ROOT/bench/bench_step_cuda.cu" -o "$BENCH_BIN" -lgomp
  fi
fi

# ---- tests ----------------------------------------------------------------------------
TESTLOG=$OUT/tests.log
: >"$TESTLOG"
if [ $build_ok = 1 ]; then
  run_step tests 200 "$TESTLOG" "${MESON[@]}" test -C "$BUILD" --suite cuda --no-rebuild --print-errorlogs -v
else
  STATUS_LINES+=("$(printf '%-22s %s' tests "NOT RUN (build failed)")")
fi

# ---- the GPT trainer on this GPU ------------------------------------------------------------
# 30 steps of the default model (0.8M parameters) per ZeRO stage with 4 ranks
# on this GPU (comm::LocalDevice), one bf16 run, and one rank through NCCL:
# tokens/s, MFU and device memory per rank against memory_report() go to
# bench.log and the summary. About 40 s of GPU time in all.
BENCHLOG=$OUT/bench.log
: >"$BENCHLOG"
GPT_RUNS=()
if [ -x "$GPT_BIN" ] && [ -f "$CARRY/devil.dict.dz" -o -f /usr/share/dictd/devil.dict.dz ]; then
  corpus=/usr/share/dictd/devil.dict.dz
  [ -f "$corpus" ] || corpus=$CARRY/devil.dict.dz
  gpt=("$GPT_BIN" --backend cuda --data "$corpus" --steps 30 --eval-every 30 --sample 40)
  for stage in 0 1 2 3; do
    run_step "gpt_stage$stage" 40 "$BENCHLOG" "${gpt[@]}" --comm local --ranks 4 --stage "$stage"
    GPT_RUNS+=("gpt_stage$stage")
  done
  run_step gpt_stage3_bf16 40 "$BENCHLOG" "${gpt[@]}" --comm local --ranks 4 --stage 3 --precision bf16
  GPT_RUNS+=(gpt_stage3_bf16)
  # Lean states on the GPU: the remainder master and 8-bit block-wise states
  # (docs/lean-states.md), val_loss beside gpt_stage3_bf16's.
  run_step gpt_stage3_bf16_lean 40 "$BENCHLOG" "${gpt[@]}" --comm local --ranks 4 --stage 3 --precision bf16 \
    --master remainder --states blockwise8
  GPT_RUNS+=(gpt_stage3_bf16_lean)
  # ZeRO++ qwZ on the GPU: the gathers as int8 blocks (cuda_quantize_int8),
  # val_loss beside gpt_stage3_bf16's (docs/zeropp.md). (hpZ needs a node
  # split, which comm::LocalDevice and comm::Nccl do not have yet.)
  run_step gpt_stage3_bf16_qwz 40 "$BENCHLOG" "${gpt[@]}" --comm local --ranks 4 --stage 3 --precision bf16 --qwz
  GPT_RUNS+=(gpt_stage3_bf16_qwz)
  if grep -q "NCCL in" "$BUILD/meson-logs/meson-log.txt" 2>/dev/null; then
    run_step gpt_nccl_1rank 40 "$BENCHLOG" "${gpt[@]}" --comm nccl --stage 1
    GPT_RUNS+=(gpt_nccl_1rank)
  fi
  # --save, SIGKILL after a checkpoint, --resume on the GPU: the uninterrupted
  # run's val_loss to the last digit (2 ranks on this GPU; then resumed on 1).
  if grep -q "ZERO_EXAMPLE_HAVE_CHECKPOINTS" "$BUILD/build.ninja" 2>/dev/null; then
    run_step gpt_resume 90 "$BENCHLOG" python3 "$ROOT/tests/gpt/check_gpt_resume.py" "$GPT_BIN" \
      --backend cuda --data "$corpus"
  else
    STATUS_LINES+=("$(printf '%-22s %s' gpt_resume "NOT RUN (built without checkpoints: --prepare-carry)")")
  fi
else
  STATUS_LINES+=("$(printf '%-22s %s' gpt_train "NOT RUN (not built: examples not configured, see build.log; or no corpus: --prepare-carry)")")
fi

# ---- benchmarks -----------------------------------------------------------------------------
BENCHJSON=$OUT/bench_step_cuda.jsonl
TORCHJSON=$OUT/torch_cuda_optim.jsonl
COMMJSON=$OUT/bench_comm_cuda.json
: >"$BENCHJSON"
: >"$TORCHJSON"
: >"$COMMJSON"
if [ -x "$BENCH_BIN" ]; then
  run_step bench_step_cuda 90 "$BENCHLOG" --stdout "$BENCHJSON" "$BENCH_BIN" --json
else
  STATUS_LINES+=("$(printf '%-22s %s' bench_step_cuda "NOT RUN (not built)")")
fi
if [ -x "$COMM_BIN" ]; then
  run_step bench_comm_cuda 60 "$BENCHLOG" --stdout "$COMMJSON" "$COMM_BIN" --json
else
  STATUS_LINES+=("$(printf '%-22s %s' bench_comm_cuda "NOT RUN (not built)")")
fi
run_step torch_cuda_optim 120 "$BENCHLOG" --stdout "$TORCHJSON" \
  env PYTHONUNBUFFERED=1 python3 "$ROOT/bench/torch_fused_adamw.py" --json
# The host step on this machine's cores (bench.log): the bf16-mixed step,
# the remainder master, bf16 and 8-bit states, each beside a probe of its
# own bytes (docs/lean-states.md). Where memory, not arithmetic, bounds the
# step (more cores than CI's 2), the 8-bit step's 14 bytes per parameter
# against the bf16 step's 28 show.
HOST_BIN=$BUILD/bench/bench_step_host
if [ -x "$HOST_BIN" ]; then
  run_step bench_step_host 60 "$BENCHLOG" "$HOST_BIN" --n 64M --reps 5 --only bf16_
else
  STATUS_LINES+=("$(printf '%-22s %s' bench_step_host "NOT RUN (not built)")")
fi

# ---- sanitizers (last: slowest, and unavailable on some virtualised GPUs) --------------------
SANLOG=$OUT/sanitizer.log
: >"$SANLOG"
sanitizer_unsupported=0
if [ -x "$TEST_BIN" ] && command -v compute-sanitizer >/dev/null 2>&1; then
  run_step memcheck 180 "$SANLOG" compute-sanitizer --tool memcheck --leak-check full --error-exitcode 1 \
    "$TEST_BIN" --quick
  if [ "$(left)" -gt 40 ]; then
    run_step racecheck 90 "$SANLOG" compute-sanitizer --tool racecheck --error-exitcode 1 "$TEST_BIN" --quick \
      --only stats
  fi
  if grep -qiE 'device not supported|not supported on this' "$SANLOG"; then
    sanitizer_unsupported=1
    STATUS_LINES+=("compute-sanitizer said the device is not supported (a virtualised GPU?): memcheck not counted")
  fi
else
  STATUS_LINES+=("$(printf '%-22s %s' memcheck "NOT RUN (no test binary or no compute-sanitizer)")")
fi

# ---- summary ----------------------------------------------------------------------------------
{
  echo "zero GPU check, sm_$ARCH, $(($(now) - START))s of a ${DEADLINE_S}s deadline"
  timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
  echo
  echo "steps:"
  for line in "${STATUS_LINES[@]}"; do echo "  $line"; done
  echo
  echo "test totals (each program's own count: the suite's programs, then memcheck --quick and racecheck --quick --only stats):"
  grep -hE '^[0-9]+ passed, [0-9]+ failed' "$TESTLOG" "$SANLOG" 2>/dev/null | sed 's/^/  /'
  grep -hE '^(FAIL|SKIP)|NOT RUN|ERROR SUMMARY|Device not supported' "$TESTLOG" "$SANLOG" 2>/dev/null | head -30 |
    sed 's/^ *//; s/^/  /'
  echo
  # test_cuda_engine's offload section (run with the tests above): device
  # memory against memory_report(), and an offloaded step's time split into
  # GPU wait, CPU update and the rest, beside the same transfers alone.
  # The GPT trainer's runs (bench.log): speed, MFU, device memory, loss.
  echo "GPT trainer, default model, 30 steps (bench.log):"
  for run in "${GPT_RUNS[@]}"; do
    awk -v run="$run" '
      /^== / { inside = ($2 == run || $2 == run ":") }
      inside && /^training: / { sub(/^training: /, ""); speed = $0 }
      inside && /^device memory per rank: / { sub(/^device memory per rank: /, ""); memory = $0 }
      inside && /^val_loss=/ { loss = $0 }
      END {
        printf "  %-16s %s  %s\n", run, (speed == "" ? "no result" : speed), loss
        if (memory != "") printf "  %-16s memory/rank: %s\n", "", memory
      }' "$BENCHLOG"
  done
  echo "GPT --save/--resume on this GPU (bench.log, gpt_resume):"
  awk '/^== / { inside = ($2 == "gpt_resume" || $2 == "gpt_resume:") }
       inside && /^(FAIL:|uninterrupted val_loss|refused as expected|checkpoints:)/ { print "  " $0 }' "$BENCHLOG"
  echo
  echo "host step on this machine's $(nproc) cores (bench.log, bench_step_host):"
  grep -hE '^bf16_[a-z0-9_]+ +n=' "$BENCHLOG" 2>/dev/null | sed 's/^/  /'
  echo
  echo "offload::Cpu on this GPU (tests.log, test_cuda_engine --only offload):"
  grep -hE '^offload::Cpu (stage 2, 64 Mi|step split)' "$TESTLOG" 2>/dev/null | sed 's/^/  /'
  echo
  python3 - "$BENCHJSON" "$TORCHJSON" "$COMMJSON" <<'EOF'
import json, sys

def load(path):
    rows = []
    try:
        for line in open(path):
            line = line.strip()
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return rows

zero, torch = load(sys.argv[1]), load(sys.argv[2])
print("zero CUDA step (bench_step_cuda):")
for r in zero:
    peak = r.get("ratio_to_peak")
    probe = r.get("ratio_to_probe")
    print(f"  {r['config']:<18} {r['params_per_s']:.3e} params/s  {r['gb_per_s']:8.1f} GB/s"
          + (f"  ratio to probe {probe:.3f}" if probe is not None else "")
          + (f"  ratio to peak {peak:.3f}" if peak is not None else ""))
print("PyTorch (torch_fused_adamw.py):")
for r in torch:
    if "error" in r:
        print(f"  {r['config']:<18} {r['impl']:<8} error: {r['error'][:120]}")
    else:
        print(f"  {r['config']:<18} {r['impl']:<8} {r['params_per_s']:.3e} params/s  {r['gb_per_s']:8.1f} GB/s")
z = {r["config"]: r for r in zero}
t = {(r["config"], r["impl"]): r for r in torch if "error" not in r}
pairs = [("fp32_adamw", "fp32_adamw"), ("bf16_mixed_adamw", "bf16_adamw"), ("fp32_sgd_momentum", "fp32_sgd_momentum")]
print("zero params/s over torch params/s (bf16: zero keeps an fp32 master, torch does not):")
for zc, tc in pairs:
    for impl in ("fused", "foreach"):
        if zc in z and (tc, impl) in t:
            print(f"  {zc:<18} vs torch {tc} {impl:<8} {z[zc]['params_per_s'] / t[(tc, impl)]['params_per_s']:.2f}x")
try:
    comm = json.load(open(sys.argv[3]))
except (OSError, ValueError):
    comm = None
print("device communicators (bench_comm_cuda), messages >= 16 MiB:")
if comm:
    print(f"  copy probe {comm['probe_GBps']:.0f} GB/s (read + write)")
    for r in comm["rows"]:
        if r["bytes"] >= 16 << 20:
            print(f"  {r['comm']:<12} {r['ranks']} ranks {r['op']:<14} {r['dtype']} {r['bytes'] >> 20:4d} MiB"
                  f"  algbw {r['algbw_GBps']:8.1f}  busbw {r['busbw_GBps']:8.1f} GB/s  limit ratio {r['limit_ratio']:.2f}")
else:
    print("  no results")
EOF
  echo
  echo "environment:"
  sed 's/^/  /' "$ENVLOG"
} >>"$SUMMARY" 2>&1
rm -f "$ENVLOG"

cat "$SUMMARY"
# Exit status: the build, the tests, the GPT runs and memcheck (where they ran) must pass.
failed=0
for line in "${STATUS_LINES[@]}"; do
  case $line in
    configure_examples*) ;;  # the configure without the examples after it decides
    configure*FAIL* | build*FAIL* | build*TIMEOUT* | tests*FAIL* | tests*TIMEOUT* | tests*NOT\ RUN*) failed=1 ;;
    gpt_*FAIL* | gpt_*TIMEOUT*) failed=1 ;;
    memcheck*FAIL*) [ $sanitizer_unsupported = 1 ] || failed=1 ;;
  esac
done
exit $failed
