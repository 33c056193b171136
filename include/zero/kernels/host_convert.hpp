// Why: the Host backend changes the precision of whole buffers: 16-bit
// gradients widened for an fp32 reduction and rounded back, or accumulated;
// qgZ's one-rank nodes; the run-time handle's fp32 views (acquire_fp32,
// grad_buffer_fp32). A scalar loop over from_float would
// be neither vectorised (no -march in a user's build) nor threaded, so these
// converters reuse the host-kernel machinery: one body written against SIMD
// packs, compiled per instruction set and split across OpenMP threads
// (zero/simd/dispatch.hpp). They add no
// conversion math: the packs' loads and stores are the same exact algorithms
// as zero::from_float / zero::to_float, so every path rounds like CUDA.
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "zero/precision/convert.hpp"
#include "zero/precision/stochastic.hpp"
#include "zero/precision/types.hpp"
#include "zero/simd/dispatch.hpp"
#include "zero/simd/pack.hpp"

namespace zero::kernels {
namespace detail {

template <class From, class To>
struct HostConvertBody {
  template <class Isa>
  ZERO_FLATTEN static void run(const From* src, To* dst, int /*thread*/, std::size_t begin, std::size_t end) {
    if constexpr (std::is_same_v<From, To>) {
      // Same type: a bit copy (NaN payloads and all), not a round trip.
      if (end > begin) std::memcpy(dst + begin, src + begin, (end - begin) * sizeof(To));
    } else {
      std::size_t i = begin;
#if ZERO_HOST_SIMD_X86
      if constexpr (Isa::width > 1) {
        constexpr int W = Isa::width;
        for (; i + W <= end; i += W) simd::store(dst + i, simd::load<Isa>(src + i));
      }
#endif
      // Tail, or all of it without SIMD. Between fp16 and bf16 the value passes
      // through fp32 exactly, so there is a single rounding, as on the GPU.
      for (; i < end; ++i) dst[i] = from_float<To>(to_float(src[i]));
    }
  }
};

// dst[i] = dst[i] + src[i], summed in fp32 and rounded once to To (gradient
// accumulation across micro-batches).
template <class To, class From>
struct HostAccumulateBody {
  template <class Isa>
  ZERO_FLATTEN static void run(const From* src, To* dst, int /*thread*/, std::size_t begin, std::size_t end) {
    std::size_t i = begin;
#if ZERO_HOST_SIMD_X86
    if constexpr (Isa::width > 1) {
      constexpr int W = Isa::width;
      for (; i + W <= end; i += W) simd::store(dst + i, simd::load<Isa>(dst + i) + simd::load<Isa>(src + i));
    }
#endif
    for (; i < end; ++i) dst[i] = from_float<To>(to_float(dst[i]) + to_float(src[i]));
  }
};

template <class To>
struct HostConvertStochasticBody {
  template <class Isa>
  ZERO_FLATTEN static void run(const float* src, To* dst, const StochasticRounding& rounding,
                               std::uint64_t global_offset, int /*thread*/, std::size_t begin, std::size_t end) {
    // Element-wise: the random bits depend on the global index only, so the
    // result is the same for any thread count or shard split. A local copy of
    // the settings lets g++ hoist the per-call part of the hash out of the
    // loop (through the reference it cannot rule out that dst aliases it).
    const StochasticRounding r = rounding;
    for (std::size_t i = begin; i < end; ++i) dst[i] = stochastic_round<To>(src[i], r, global_offset + i);
  }
};

}  // namespace detail

// Converts n elements src[i] -> dst[i] with round-to-nearest-even (NaN becomes
// CUDA's canonical NaN), using every host thread and the best SIMD the CPU has
// (or the one forced through zero::simd::force_isa / ZERO_HOST_ISA). Any pair
// of {float, fp16, bf16} is valid; the same type on both sides is a copy.
// src and dst must not overlap.
template <StorageType From, StorageType To>
void host_convert(const From* src, To* dst, std::size_t n) {
  simd::parallel_dispatch<detail::HostConvertBody<From, To>>(n, src, dst);
}

// fp32 -> To with stochastic rounding where `rounding.enabled` (bf16; fp16 and
// fp32 keep round-to-nearest, as zero::stochastic_round defines), exactly as
// the fused step writes its parameter copy: element i uses the random stream
// of global index global_offset + i. Without `enabled` it is host_convert.
template <StorageType To, StorageType From>
void host_accumulate(To* dst, const From* src, std::size_t n) {
  simd::parallel_dispatch<detail::HostAccumulateBody<To, From>>(n, src, dst);
}

template <StorageType To>
void host_convert_stochastic(const float* src, To* dst, std::size_t n, const StochasticRounding& rounding,
                             std::uint64_t global_offset) {
  if (!rounding.enabled) {
    host_convert(src, dst, n);
    return;
  }
  simd::parallel_dispatch<detail::HostConvertStochasticBody<To>>(n, src, dst, rounding, global_offset);
}

}  // namespace zero::kernels
