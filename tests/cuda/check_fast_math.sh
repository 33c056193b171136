#!/usr/bin/env bash
# Why: the device step gives the host's bits only when subnormals are kept,
# so device code built with -ftz=true (which --use_fast_math implies) must not
# build unless the user accepts the difference with ZERO_ALLOW_FAST_MATH
# (zero/cuda/exact_math.cuh). nvcc defines no macro for either flag, so the
# refusal comes from ptxas; this checks it with the real compiler, on a file
# that instantiates one library kernel, the fused step, and includes no other
# (device code exists only for kernels a translation unit refers to).
# Compile-only: no GPU needed.
#
#   check_fast_math.sh NVCC INCLUDE_DIR ARCH      (ARCH as in -Dgpu_arch, e.g. 80)
set -u
if [ $# -ne 3 ]; then
  echo "usage: check_fast_math.sh NVCC INCLUDE_DIR ARCH" >&2
  exit 2
fi
nvcc=$1 include=$2 arch=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/step.cu" <<'CU'
#include "zero/kernels/cuda_step.cuh"
#include "zero/optim/adam.hpp"
void step(const zero::kernels::FusedStepArgs<zero::optim::AdamW, zero::bf16, zero::bf16>& args) {
  zero::kernels::cuda_fused_step(args, nullptr);
}
CU
symbol=zero_error_device_code_built_with_ftz_true_or_use_fast_math
failed=0

# compile EXPECT LABEL FLAGS...: EXPECT is "fails" (naming $symbol) or "builds".
compile() {
  local expect=$1 label=$2
  shift 2
  local out rc
  out=$("$nvcc" -std=c++20 --expt-relaxed-constexpr "-I$include" "-arch=sm_$arch" --cubin "$@" "$tmp/step.cu" \
    -o "$tmp/step.cubin" 2>&1)
  rc=$?
  if [ "$expect" = fails ] && [ $rc -ne 0 ] && grep -q "$symbol" <<<"$out"; then
    echo "ok: $label fails to build, naming $symbol..."
  elif [ "$expect" = builds ] && [ $rc -eq 0 ]; then
    echo "ok: $label builds"
  else
    echo "FAIL: $label: expected \"$expect\", nvcc exited $rc:"
    echo "$out" | head -20
    failed=1
  fi
}

compile fails "--use_fast_math" --use_fast_math
compile fails "-ftz=true" -ftz=true
compile builds "--use_fast_math -DZERO_ALLOW_FAST_MATH" --use_fast_math -DZERO_ALLOW_FAST_MATH
exit $failed
