// The engines make_optimizer makes without being told more, compiled once
// for a whole build (zero/runtime/precompiled.hpp says why and how): this
// file is compiled once per precision, ZERO_ENGINES_PRECISION = fp32, bf16
// or fp16, so the three compile in parallel. Meson builds it as the
// dependency engines_dep (meson.build); a build of your own can compile it
// the same way, or write the lines below for the precisions it uses.
#include "zero/runtime/make_optimizer.hpp"
#if defined(ZERO_ENGINES_WITH_DISK_TIER)
#include "zero/offload/disk_state_store.hpp"
#endif
#include "zero/runtime/precompiled.hpp"

ZERO_INSTANTIATE_ENGINES(ZERO_PRECISION_POLICY(ZERO_ENGINES_PRECISION), ::zero::backend::Host)
ZERO_INSTANTIATE_HANDLES(ZERO_PRECISION_POLICY(ZERO_ENGINES_PRECISION), ::zero::backend::Host)
#if defined(ZERO_ENGINES_WITH_DISK_TIER)
ZERO_INSTANTIATE_DISK_STORES(ZERO_PRECISION_POLICY(ZERO_ENGINES_PRECISION))
#endif
