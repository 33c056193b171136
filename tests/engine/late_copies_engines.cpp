// The twelve built-in engines on the late-copies test backend, compiled once
// for the tests and the offload benchmark that use it (instead of once in
// each of them), one precision per compile: ZERO_ENGINES_PRECISION = fp32,
// bf16 or fp16 (tests/engine/meson.build). late_copies.hpp declares them
// extern where ZERO_TEST_PRECOMPILED_LATE_COPIES is defined.
#include "late_copies.hpp"
#include "zero/runtime/precompiled.hpp"

ZERO_INSTANTIATE_ENGINES(ZERO_PRECISION_POLICY(ZERO_ENGINES_PRECISION), ::zero::backend::LateCopies)
