// Why: the Host backend runs the fused step here, and so does the CPU side
// of ZeRO-Offload (offload cpu and nvme). It must reach the memory-bandwidth
// limit of its own access pattern on any x86-64 machine, whatever flags the
// user compiled with: the body is written once against SIMD packs and
// compiled per instruction set (zero/simd/dispatch.hpp), then split across
// OpenMP threads.
#pragma once

#include "zero/compiler.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "zero/kernels/fused_step.hpp"
#include "zero/quant/code_segments.hpp"
#include "zero/quant/dynamic_code.hpp"
#include "zero/simd/code_lookup.hpp"
#include "zero/simd/dispatch.hpp"
#include "zero/simd/pack.hpp"

namespace zero::kernels {
namespace detail {

#if ZERO_HOST_SIMD_X86
// The low-precision copy of W updated master values, at param + j:
// stochastically rounded, rounded half away from zero (bf16 with
// ties_away), or to nearest even. Both host step loops write it so.
template <class Isa, class Param>
ZERO_FORCE_INLINE void store_copy(Param* param, std::size_t j, const simd::Pack<Isa>& w,
                                  const StochasticRounding& rounding, bool ties_away, std::uint64_t global_offset) {
  if (rounding.enabled) {
    for (int l = 0; l < Isa::width; ++l)
      param[j + l] = stochastic_round<Param>(w.v[l], rounding, global_offset + j + l);
  } else if constexpr (std::is_same_v<Param, bf16>) {
    if (ties_away)
      simd::store_ties_away(param + j, w);
    else
      simd::store(param + j, w);
  } else {
    simd::store(param + j, w);
  }
}
#endif

template <optim::Policy Opt, class Grad, class Param>
struct HostStepBody {
  using Args = FusedStepArgs<Opt, Grad, Param>;

  // A low-precision copy larger than a last-level cache is written without
  // being read: stream it past the caches, saving each line's read for
  // ownership (aligned ranges only; the scalar tail stores normally).
  // Smaller copies stay cached for the all-gather or forward that reads them.
  static constexpr std::size_t stream_threshold = std::size_t{1} << 24;
  // Packs per iteration, each a whole update: their chains of divides and
  // square roots are independent, so the divider works on one while the
  // other waits. With AVX-512 (32 registers) two packs gave 7% (fp32 AdamW)
  // and 18% (bf16-mixed) more elements per second on one core when
  // compute-bound, measured in cache; with AVX2 (16 registers) two were 22%
  // slower, so it keeps one.
  template <class Isa>
  static constexpr int unroll_for = Isa::width >= 16 ? 2 : 1;

  template <class Isa>
  ZERO_FLATTEN static void run(const Args& a, int /*thread*/, std::size_t begin, std::size_t end) {
    std::size_t i = begin;
#if ZERO_HOST_SIMD_X86
    if constexpr (Isa::width > 1) {
      using P = simd::Pack<Isa>;
      constexpr int W = Isa::width;
      constexpr int S = Opt::state_slots;
      // A local copy: read through the reference, g++ recomputes the hash's
      // seed-and-step part for every element.
      const StochasticRounding rounding = a.rounding;
      const StochasticRounding state_rounding = a.state_rounding;
      constexpr bool low_precision_copy = !std::is_same_v<Param, float>;
      const bool stream_copy = low_precision_copy && !rounding.enabled && !a.ties_away && a.remainder == nullptr &&
                               a.n >= stream_threshold &&
                               reinterpret_cast<std::uintptr_t>(a.param + i) % (W * sizeof(Param)) == 0;
      // Elements ahead of the loads: 1 KiB of fp32 per array. Measured on a
      // 2-core EPYC VM (bench_step_host, fp32 AdamW): 256 beat 512 by 4-6%
      // while memory ran at ~80 GB/s and tied it at ~55 GB/s; 1024 and more
      // were 10-20% slower at both, 64 and 128 no better than 256. (A local:
      // as a member of the struct, g++ allocated the loop's registers
      // otherwise, and the bf16-state step ran 3-5% slower.)
      constexpr std::size_t ahead = 256;
      // U packs per iteration (unroll_for<Isa>). Split: the master is the
      // bf16 copy plus a remainder (read and written in place of the fp32
      // master; compiled for bf16 only). S16: the state in bf16. Both are
      // compiled loops of their own: as branches in one loop they cost
      // today's bf16 step 10-30% (register pressure beside the update;
      // bench_step_host, 2-core EPYC).
      auto packs = [&]<int U, bool Split, bool S16>(std::size_t at) ZERO_FLATTEN {
        if ((at & 15) == 0 && at + ahead < end) {
          for (int u = 0; u < U; u += (W >= 16 ? 1 : 2)) {
            const std::size_t p = at + ahead + static_cast<std::size_t>(u * W);
            if constexpr (Split) {
              __builtin_prefetch(a.param + p, 1);
              __builtin_prefetch(a.remainder + p, 1);
            } else {
              __builtin_prefetch(a.master + p, 1);
            }
            __builtin_prefetch(a.grad + p, 0);
            for (int k = 0; k < S; ++k) {
              if constexpr (S16)
                __builtin_prefetch(a.state16[k] + p, 1);
              else
                __builtin_prefetch(a.state[k] + p, 1);
            }
          }
        }
        P w[U], st[U][S > 0 ? S : 1];
        for (int u = 0; u < U; ++u) {
          const std::size_t j = at + static_cast<std::size_t>(u * W);
          if constexpr (Split)
            w[u] = simd::load_joined<Isa>(a.param + j, a.remainder + j);
          else
            w[u] = simd::load<Isa>(a.master + j);
          for (int k = 0; k < S; ++k) {
            if constexpr (S16)
              st[u][k] = simd::load<Isa>(a.state16[k] + j);
            else
              st[u][k] = simd::load<Isa>(a.state[k] + j);
          }
          Opt::update(a.scalars, w[u], simd::load<Isa>(a.grad + j) * a.grad_scale, st[u]);
        }
        for (int u = 0; u < U; ++u) {
          const std::size_t j = at + static_cast<std::size_t>(u * W);
          for (int k = 0; k < S; ++k) {
            if constexpr (!S16) {
              simd::store(a.state[k] + j, st[u][k]);
            } else if (!state_rounding.enabled) {
              simd::store(a.state16[k] + j, st[u][k]);
            } else {
              for (int l = 0; l < W; ++l)
                a.state16[k][j + l] = rounded_state(state_rounding, st[u][k].v[l], a.global_offset + j + l, k);
            }
          }
          if constexpr (Split) {
            simd::store_split(a.param + j, a.remainder + j, w[u]);
            continue;
          }
          simd::store(a.master + j, w[u]);
          if constexpr (!std::is_same_v<Param, float>) {
            if (stream_copy)
              simd::stream_store(a.param + j, w[u]);
            else
              store_copy<Isa>(a.param, j, w[u], rounding, a.ties_away, a.global_offset);
          }
        }
      };
      constexpr int unroll = unroll_for<Isa>;
      auto loop = [&]<bool Split, bool S16>() ZERO_FLATTEN {
        for (; i + unroll * W <= end; i += unroll * W) packs.template operator()<unroll, Split, S16>(i);
        for (; i + W <= end; i += W) packs.template operator()<1, Split, S16>(i);
      };
      auto with_states = [&]<bool Split>() ZERO_FLATTEN {
        if (a.states_in_bf16())
          loop.template operator()<Split, true>();
        else
          loop.template operator()<Split, false>();
      };
      if constexpr (Args::can_split_master) {
        if (a.remainder != nullptr)
          with_states.template operator()<true>();
        else
          with_states.template operator()<false>();
      } else {
        with_states.template operator()<false>();
      }
      if (stream_copy) Isa::stream_fence();
    }
#endif
    for (; i < end; ++i) fused_step_element(a, i);  // tail, or all of it without SIMD
  }
};

// The lookups of a step's code tables, per slot: the exact bucket lookup
// (quant::NearestCode; null for a table that is not built in, which then
// goes through quant::quantize()) and, where the table has the dynamic
// code's structure, its segments (quant::CodeSegments: AVX-512 encodes
// without table reads).
struct CodeLookups {
  static constexpr int max_slots = 4;
  const quant::NearestCode* exact[max_slots] = {};
  const quant::CodeSegments* segments[max_slots] = {};
};

// The 8-bit state step (FusedStepArgs::state8), a thread's blocks at a time:
// each slot's codes decoded into a scratch of fp32 states, the block's update
// on them, then each slot quantized with the block's new absmax. A slot at a
// time, so that each decoding and encoding loop keeps its table in registers
// (zero/simd/code_lookup.hpp).
template <optim::Policy Opt, class Grad, class Param>
struct HostBlockStepBody {
  using Args = FusedStepArgs<Opt, Grad, Param>;
  static constexpr int S = Opt::state_slots;
  static_assert(S <= CodeLookups::max_slots, "an 8-bit state step for more state slots than CodeLookups holds");

  template <class Isa>
  ZERO_FLATTEN static void run(const Args& a, const CodeLookups& lookups, int /*thread*/, std::size_t first,
                               std::size_t last) {
    // Room for one block's states (slots x block fp32, 16 KiB for Adam at
    // the paper's 2048): kept per thread across steps.
    thread_local std::vector<float> scratch;
    if (scratch.size() < static_cast<std::size_t>(S) * a.block) scratch.resize(static_cast<std::size_t>(S) * a.block);
    bool built_in = true;
    for (int k = 0; k < S; ++k) built_in = built_in && lookups.exact[k] != nullptr;
    for (std::size_t b = first; b < last; ++b) {
#if ZERO_HOST_SIMD_X86
      if constexpr (Isa::width > 1) {
        if (built_in) {
          block<Isa>(a, lookups, b, scratch.data());
          continue;
        }
      }
#endif
      fused_step_block(a, b, scratch.data());
    }
  }

#if ZERO_HOST_SIMD_X86
  template <class Isa>
  ZERO_FLATTEN static void block(const Args& a, const CodeLookups& lookups, std::size_t b, float* scratch) {
    using P = simd::Pack<Isa>;
    constexpr int W = Isa::width;
    const std::size_t begin = a.block_begin(b), end = a.block_end(b), n = end - begin;
    // Pass 1: each slot's states, decoded.
    for (int k = 0; k < S; ++k)
      simd::decode_codes<Isa>(a.state8[k] + begin, n, a.code[k], a.absmax[k][b],
                              scratch + static_cast<std::size_t>(k) * a.block);
    // Pass 2: the update, the new states back into the scratch. The block's
    // streams stop while passes 1 and 3 run, so the hardware prefetchers
    // lose them; each array the update reads is prefetched 1024 elements
    // ahead (into the next block), a line of the 16-bit arrays every 32
    // elements: 1.5x the step on a 2-core EPYC VM. The codes a whole block
    // ahead: 1.13x more (bench/results/2026-12-06-8bit-step.md).
    constexpr std::size_t ahead = 1024;
    // Locals, not reads through `a`: the byte and 16-bit stores may alias
    // anything, so g++ reloads every field after each of them otherwise.
    const auto scalars = a.scalars;
    const float grad_scale = a.grad_scale;
    const std::size_t block = a.block;
    const std::uint8_t* codes[S > 0 ? S : 1] = {};
    for (int k = 0; k < S; ++k) codes[k] = a.state8[k];
    Param* const param = a.param;
    float* const master = a.master;
    const Grad* const grad = a.grad;
    std::uint16_t* rest = nullptr;
    if constexpr (Args::can_split_master) rest = a.remainder;
    // Each slot's largest magnitude, folded here rather than in a pass of
    // its own: the largest of the values' bits without their sign (for
    // non-negative floats the same order; an infinity or NaN is at least
    // 0x7f800000, which quant::quantize_block then handles).
    using U = typename Isa::U;
    U largest[S > 0 ? S : 1] = {};
    // Split (a remainder master) or not, a loop of its own: as a branch in
    // one loop it left g++ short of registers (constants rebuilt in every
    // iteration), as the main step found (HostStepBody).
    std::size_t i = begin;
    auto update_pass = [&]<bool Split>() ZERO_FLATTEN {
      for (; i + W <= end; i += W) {
        if ((i & 31) == 0) {
          const std::size_t p = i + ahead;
          if constexpr (Split) {
            __builtin_prefetch(param + p, 1);
            __builtin_prefetch(rest + p, 1);
          } else {
            __builtin_prefetch(master + p, 1);
          }
          __builtin_prefetch(grad + p, 0);
          // The codes are read first, by the next block's pass 1: a block
          // ahead, so that all of the next block's are, a line per 64.
          if ((i & 63) == 0)
            for (int k = 0; k < S; ++k) __builtin_prefetch(codes[k] + i + block, 1);
        }
        P w;
        if constexpr (Split)
          w = simd::load_joined<Isa>(param + i, rest + i);
        else
          w = simd::load<Isa>(master + i);
        P st[S > 0 ? S : 1];
        for (int k = 0; k < S; ++k) st[k] = simd::load<Isa>(scratch + static_cast<std::size_t>(k) * block + (i - begin));
        Opt::update(scalars, w, simd::load<Isa>(grad + i) * grad_scale, st);
        for (int k = 0; k < S; ++k) {
          simd::store(scratch + static_cast<std::size_t>(k) * block + (i - begin), st[k]);
          const U magnitude = (U)st[k].v & 0x7fffffffu;
          largest[k] = largest[k] > magnitude ? largest[k] : magnitude;
        }
        if constexpr (Split) {
          simd::store_split(param + i, rest + i, w);
        } else {
          simd::store(master + i, w);
          if constexpr (!std::is_same_v<Param, float>)
            store_copy<Isa>(param, i, w, a.rounding, a.ties_away, a.global_offset);
        }
      }
    };
    if constexpr (Args::can_split_master) {
      if (rest != nullptr)
        update_pass.template operator()<true>();
      else
        update_pass.template operator()<false>();
    } else {
      update_pass.template operator()<false>();
    }
    const std::size_t tail = i - begin;  // its states are not in `largest`
    for (; i < end; ++i) blockwise_update_element(a, b, i, scratch);  // reads the codes, not yet rewritten
    // Pass 3: each slot's absmax (the lanes', and the tail's), then its codes.
    for (int k = 0; k < S; ++k) {
      const float* x = scratch + static_cast<std::size_t>(k) * a.block;
      std::uint8_t* q = a.state8[k] + begin;
      std::uint32_t most = 0;
      for (int l = 0; l < W; ++l) most = largest[k][l] > most ? largest[k][l] : most;
      for (std::size_t t = tail; t < n; ++t) {
        const std::uint32_t magnitude = __builtin_bit_cast(std::uint32_t, x[t]) & 0x7fffffffu;
        most = magnitude > most ? magnitude : most;
      }
      if (most >= 0x7f800000u || most == 0) {  // rare: the serial quantizer's rule (an infinity or NaN, or zeros)
        a.absmax[k][b] = quant::quantize_block(x, n, a.code[k], q);
        continue;
      }
      const float absmax = __builtin_bit_cast(float, most);
      a.absmax[k][b] = absmax;
      simd::encode_codes<Isa>(x, n, absmax, *lookups.exact[k], lookups.segments[k], q);
    }
  }
#endif
};

template <class Grad>
struct HostGradStatsBody {
  template <class Isa>
  ZERO_FLATTEN static void run(const Grad* g, GradStats* partial, int thread, std::size_t begin, std::size_t end) {
    GradStats s;
    std::size_t i = begin;
#if ZERO_HOST_SIMD_X86
    if constexpr (Isa::width > 1) {
      using P = simd::Pack<Isa>;
      using U = typename Isa::U;
      constexpr int W = Isa::width;
      // Lanes accumulate in fp32 over short blocks only, then into a double,
      // so the norm of a shard of 10^9 elements keeps its precision.
      constexpr std::size_t block = 1024;
      U exp_all_ones{};
      while (i + W <= end) {
        P acc{};
        const std::size_t block_end = i + block < end ? i + block : end;
        for (; i + W <= block_end; i += W) {
          const P x = simd::load<Isa>(g + i);
          acc.v += x.v * x.v;
          exp_all_ones |= (U)(((U)x.v & 0x7f800000u) == 0x7f800000u);
        }
        double sum = 0.0;
        for (int l = 0; l < W; ++l) sum += static_cast<double>(acc.v[l]);
        s.sum_squares += sum;
      }
      for (int l = 0; l < W; ++l) s.non_finite = s.non_finite || exp_all_ones[l] != 0;
    }
#endif
    for (; i < end; ++i) {
      const float x = to_float(g[i]);
      s.sum_squares += static_cast<double>(x) * static_cast<double>(x);
      s.non_finite = s.non_finite || !(x - x == 0.0f);  // inf - inf and NaN - NaN are NaN
    }
    partial[thread] = s;
  }
};

}  // namespace detail

// One fused optimizer step over a host shard (see FusedStepArgs).
template <optim::Policy Opt, StorageType Grad, StorageType Param>
void host_fused_step(const FusedStepArgs<Opt, Grad, Param>& args) {
  if (args.states_blockwise()) {
    detail::CodeLookups lookups;
    for (int k = 0; k < Opt::state_slots; ++k) {
      lookups.exact[k] = quant::nearest_code_for(args.code[k]);
      lookups.segments[k] = quant::code_segments_for(args.code[k]);
    }
    simd::parallel_dispatch_grains<detail::HostBlockStepBody<Opt, Grad, Param>>(args.block_count(), 1, args.n, args,
                                                                               lookups);
    return;
  }
  simd::parallel_dispatch<detail::HostStepBody<Opt, Grad, Param>>(args.n, args);
}

// Sum of squares (in double) and whether any element is inf or NaN.
// Allocates nothing (the engine's steady-state step must not).
template <StorageType Grad>
GradStats host_grad_stats(const Grad* grad, std::size_t n) {
  std::array<GradStats, simd::max_host_threads> partial{};
  simd::parallel_dispatch<detail::HostGradStatsBody<Grad>>(n, grad, partial.data());
  GradStats total;
  for (const GradStats& p : partial) total += p;
  return total;
}

}  // namespace zero::kernels
