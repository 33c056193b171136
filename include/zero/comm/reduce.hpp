// Why: the in-process and MPI communicators reduce 16-bit floats themselves
// (MPI has no bf16/fp16 sum). Summing in fp32 in a fixed rank order and
// rounding once makes the result independent of thread timing, so tests are
// reproducible bit for bit. comm::Local's reduction runs on SIMD packs
// compiled per instruction set (zero/simd/dispatch.hpp): a scalar loop over
// ranks per element would run far below memory bandwidth. Packs add lane by
// lane in the same rank order and round with the same conversion, so both
// paths give the same bits. Outputs far larger than the cache are written
// with non-temporal stores, which skip reading each line before writing it
// (a third of the traffic of a copy), unless they are inputs (in place).
// In-process ranks on one GPU reduce with the device twin of this file,
// zero/comm/reduce.cuh, to the same bits.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "zero/comm/communicator.hpp"
#include "zero/error.hpp"
#include "zero/precision/convert.hpp"
#include "zero/simd/dispatch.hpp"

#if ZERO_HOST_SIMD_X86
#include <immintrin.h>
#endif
#include <unistd.h>

namespace zero::comm::detail {

template <class T>
inline T combine(T a, T b, ReduceOp op) {
  return op == ReduceOp::sum ? a + b : (a > b ? a : b);
}

// out[i] = op over k of inputs[k][i], for i in [begin, end). `out` may alias
// inputs[j] for any j (each element is read from all inputs before it is written).
template <class T>
void reduce_typed(void* out, const void* const* inputs, int n_inputs, std::size_t begin, std::size_t end, ReduceOp op) {
  using Acc = std::conditional_t<std::is_same_v<T, fp16> || std::is_same_v<T, bf16>, float, T>;
  T* o = static_cast<T*>(out);
  for (std::size_t i = begin; i < end; ++i) {
    Acc acc;
    if constexpr (std::is_same_v<Acc, float> && !std::is_same_v<T, float>)
      acc = to_float(static_cast<const T*>(inputs[0])[i]);
    else
      acc = static_cast<const T*>(inputs[0])[i];
    for (int k = 1; k < n_inputs; ++k) {
      Acc x;
      if constexpr (std::is_same_v<Acc, float> && !std::is_same_v<T, float>)
        x = to_float(static_cast<const T*>(inputs[k])[i]);
      else
        x = static_cast<const T*>(inputs[k])[i];
      acc = combine(acc, x, op);
    }
    if constexpr (std::is_same_v<Acc, float> && !std::is_same_v<T, float>)
      o[i] = from_float<T>(acc);
    else
      o[i] = acc;
  }
}

// Where a reduction reads and writes: element i of the result is op over k
// of inputs[k][i] (in k order), written to outputs[o][i] for every o, for i
// in [begin, end). Any output may alias any input (each element is read from
// all inputs before it is written). `stream`: write with non-temporal stores
// (see streaming_pays); the result is the same.
struct ReduceArgs {
  void* const* outputs;
  int n_outputs;
  const void* const* inputs;
  int n_inputs;
  std::size_t begin, end;
  bool stream = false;
};

// Whether a collective touching `footprint` bytes (all ranks' buffers) should
// write with non-temporal stores: when it would not stay in the cache
// anyway, caching the output only costs the extra read of each line. The
// cache counted on is the private L2 of each online core, at most half the
// last-level cache: the L3 that a core reports is shared with the other
// cores of its socket and, in a virtual machine, with other tenants.
// Measured on a 2-core VM of a 64-core Xeon (L2 2 MiB, L3 260 MiB reported):
// streamed outputs were faster from 1 MiB collectives up (a 4-rank
// all-gather of 16 MiB: 1.8 ms against 4.4 ms plain), where half the L3 as
// the threshold had kept them plain up to 32 MiB.
inline bool streaming_pays(std::size_t footprint) {
  static const std::size_t threshold = [] {
    long l2 = -1, llc = -1;
#if defined(_SC_LEVEL2_CACHE_SIZE) && defined(_SC_LEVEL3_CACHE_SIZE)
    l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (l2 <= 0 || cores <= 0) return std::size_t{16} << 20;
    const std::size_t private_caches = static_cast<std::size_t>(l2) * static_cast<std::size_t>(cores);
    return llc > 0 ? std::min(private_caches, static_cast<std::size_t>(llc) / 2) : private_caches;
  }();
  return footprint > threshold;
}

#if ZERO_HOST_SIMD_X86
// Non-temporal stores of one pack of fp32 lanes (p aligned to the pack's size).
__attribute__((target("avx512f"))) inline void stream_floats(float* p, const simd::Avx512::F& v) {
  _mm512_stream_ps(p, (__m512)v);
}
__attribute__((target("avx"))) inline void stream_floats(float* p, const simd::Avx2::F& v) {
  _mm256_stream_ps(p, (__m256)v);
}
#endif

template <class T, ReduceOp Op>
struct ReduceBody {
  // Inputs and outputs the pack loop takes (its pointers live in locals).
  static constexpr int local_pointers = 64;

  // bf16 is reduced in pairs: 32-bit word j of 2W consecutive bf16 holds
  // element 2j in its low half and 2j + 1 in its high half, so shifting the
  // low half up and masking the high one gives both as fp32 lanes with no
  // shuffle, and the result packs back the same way. (Widening 16-bit lanes
  // one pack at a time kept the shuffle port busy: 2.4e9 elements/s on one
  // core in cache, below the memory's pace; in pairs 5.8e9.) Each element
  // still sums in fp32 in rank order and rounds once: the same bits.
  static constexpr bool pairs = std::is_same_v<T, bf16>;
  // 16-bit inputs are prefetched this many bytes ahead. Their conversions'
  // instructions fill the out-of-order window, and the hardware prefetcher
  // alone fell behind: a bf16 all-reduce of 256 MiB over 2 ranks on 2 cores
  // took 27-30 ms against 20-21 ms prefetched (fp32 keeps up without it;
  // 512 to 4096 bytes ahead measured alike).
  static constexpr std::size_t prefetch_ahead = sizeof(T) == 2 ? 2048 : 0;
  // Elements one step of the pack loop covers.
  template <class Isa>
  static constexpr std::size_t step = pairs ? 2 * Isa::width : Isa::width;

  template <class Isa>
  ZERO_FLATTEN static void run(const ReduceArgs& a) {
    std::size_t i = a.begin;
#if ZERO_HOST_SIMD_X86
    if constexpr (Isa::width > 1 && StorageType<T>) {
      constexpr std::size_t align = step<Isa> * sizeof(T);
      // Streaming stores need aligned outputs: a scalar head aligns the
      // first, and the others must be aligned alike (else plain stores).
      bool stream = a.stream && !writes_an_input(a);
      for (int o = 1; o < a.n_outputs; ++o)
        stream = stream && (address(a.outputs[o]) - address(a.outputs[0])) % align == 0;
      if (stream) {
        std::size_t head = i;
        while (head < a.end && (address(a.outputs[0]) + head * sizeof(T)) % align != 0) ++head;
        scalar(a, i, head);
        i = head;
      }
      // More ranks than that in one process: the scalar loop below.
      if (a.n_inputs <= local_pointers && a.n_outputs <= local_pointers) {
        const std::size_t packs_end = i + (a.end - i) / step<Isa> * step<Isa>;
        if (stream)
          packs<Isa, true>(a, i, packs_end);
        else
          packs<Isa, false>(a, i, packs_end);
        i = packs_end;
      }
    }
#endif
    // The tail (or all of it without SIMD, and for f64/u64).
    scalar(a, i, a.end);
  }

#if ZERO_HOST_SIMD_X86
  // Whole packs [from, to) of at most local_pointers inputs and outputs. The
  // pointers are copied into locals first: as far as the compiler knows, the
  // stores could change a.inputs and a.outputs, and it would reload every
  // pointer for every pack.
  template <class Isa, bool Stream>
  ZERO_FORCE_INLINE static void packs(const ReduceArgs& a, std::size_t from, std::size_t to) {
    constexpr std::size_t W = step<Isa>;
    const int n_in = a.n_inputs, n_out = a.n_outputs;
    const T* in[local_pointers];
    T* out[local_pointers];
    for (int k = 0; k < n_in; ++k) in[k] = static_cast<const T*>(a.inputs[k]);
    for (int o = 0; o < n_out; ++o) out[o] = static_cast<T*>(a.outputs[o]);
    // Four steps at a time: independent sums, so one step's adds do not wait
    // on the last one's, and the loop over inputs runs once per four steps.
    constexpr std::size_t U = 4;
    std::size_t i = from;
    for (; i + U * W <= to; i += U * W) block<Isa, Stream, U>(in, n_in, out, n_out, i);
    for (; i < to; i += W) block<Isa, Stream, 1>(in, n_in, out, n_out, i);
    if constexpr (Stream) _mm_sfence();  // the stores are visible before the next rendezvous
  }

  // Steps i, i + step, ... (U of them): reduced over the inputs in order,
  // stored to every output.
  template <class Isa, bool Stream, std::size_t U>
  ZERO_FORCE_INLINE static void block(const T* const* in, int n_in, T* const* out, int n_out, std::size_t i) {
    constexpr std::size_t S = step<Isa>, L = pairs ? 2 : 1;  // fp32 packs per step
    if constexpr (prefetch_ahead > 0 && U > 1)
      for (int k = 0; k < n_in; ++k)
        for (std::size_t b = 0; b < U * S * sizeof(T); b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(in[k] + i) + prefetch_ahead + b, _MM_HINT_T0);
    simd::Pack<Isa> acc[U][L];
    for (std::size_t u = 0; u < U; ++u) load<Isa>(acc[u], in[0] + i + u * S);
    for (int k = 1; k < n_in; ++k)
      for (std::size_t u = 0; u < U; ++u) {
        simd::Pack<Isa> x[L];
        load<Isa>(x, in[k] + i + u * S);
        for (std::size_t l = 0; l < L; ++l)
          acc[u][l] = Op == ReduceOp::sum ? acc[u][l] + x[l] : simd::max(acc[u][l], x[l]);  // combine()'s a > b ? a : b
      }
    for (int o = 0; o < n_out; ++o)
      for (std::size_t u = 0; u < U; ++u) store<Isa, Stream>(out[o] + i + u * S, acc[u]);
  }

  // One step's elements from p as fp32 packs (pairs: the low halves, then the high).
  template <class Isa>
  ZERO_FORCE_INLINE static void load(simd::Pack<Isa>* x, const T* p) {
    if constexpr (pairs) {
      typename Isa::U w;
      std::memcpy(&w, p, sizeof w);
      x[0].v = __builtin_bit_cast(typename Isa::F, w << 16);
      x[1].v = __builtin_bit_cast(typename Isa::F, w & 0xffff0000u);
    } else {
      x[0] = simd::load<Isa>(p);
    }
  }

  template <class Isa, bool Stream>
  ZERO_FORCE_INLINE static void store(T* p, const simd::Pack<Isa>* x) {
    if constexpr (pairs) {
      typename Isa::U low, high;
      zero::detail::float_to_bf16_bits_generic(low, x[0].v);
      zero::detail::float_to_bf16_bits_generic(high, x[1].v);
      const typename Isa::U w = low | (high << 16);
      if constexpr (Stream)
        stream_floats(reinterpret_cast<float*>(p), __builtin_bit_cast(typename Isa::F, w));
      else
        std::memcpy(p, &w, sizeof w);
    } else if constexpr (!Stream) {
      simd::store(p, x[0]);
    } else if constexpr (std::is_same_v<T, float>) {
      stream_floats(p, x[0].v);
    } else {
      simd::stream_store(p, x[0]);
    }
  }
#endif

  static std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

  // Whether an output is one of the inputs (an in-place all-reduce or
  // reduce-scatter). Its lines were just read, so they are in the cache and a
  // plain store costs no extra read; a non-temporal store would only evict
  // them first. Measured with 4 inputs of 64 MiB on 2 and 4 threads: in-place
  // fp32 50 GB/s of traffic with plain stores against 34 streamed, bf16 43
  // against 23.
  static bool writes_an_input(const ReduceArgs& a) {
    for (int o = 0; o < a.n_outputs; ++o)
      for (int k = 0; k < a.n_inputs; ++k)
        if (a.outputs[o] == a.inputs[k]) return true;
    return false;
  }

  // Elements [from, to): reduce into the first output, then copy (the inputs
  // are all read by then).
  static void scalar(const ReduceArgs& a, std::size_t from, std::size_t to) {
    if (from >= to) return;
    reduce_typed<T>(a.outputs[0], a.inputs, a.n_inputs, from, to, Op);
    for (int o = 1; o < a.n_outputs; ++o)
      std::memcpy(static_cast<T*>(a.outputs[o]) + from, static_cast<const T*>(a.outputs[0]) + from,
                  (to - from) * sizeof(T));
  }
};

template <class T>
void reduce_dispatch(const ReduceArgs& a, ReduceOp op) {
  const simd::IsaLevel level = simd::active_isa();
  if (op == ReduceOp::sum)
    simd::dispatch<ReduceBody<T, ReduceOp::sum>>(level, a);
  else
    simd::dispatch<ReduceBody<T, ReduceOp::max>>(level, a);
}

// The reduction of ReduceArgs on the calling thread, for any element type.
inline void reduce(DType t, const ReduceArgs& a, ReduceOp op) {
  switch (t) {
    case DType::f32: return reduce_dispatch<float>(a, op);
    case DType::f16: return reduce_dispatch<fp16>(a, op);
    case DType::bf16: return reduce_dispatch<bf16>(a, op);
    case DType::f64: return reduce_dispatch<double>(a, op);
    case DType::u64: return reduce_dispatch<std::uint64_t>(a, op);
    case DType::u8: throw InvalidArgument(reduce_bytes_refused);
  }
}

// out[i] = op over k of inputs[k][i], for i in [begin, end); `out` may alias
// any input.
inline void reduce(DType t, void* out, const void* const* inputs, int n_inputs, std::size_t begin, std::size_t end,
                   ReduceOp op) {
  void* const outputs[1] = {out};
  reduce(t, ReduceArgs{outputs, 1, inputs, n_inputs, begin, end}, op);
}

// dsts[k] = src for every k, `bytes` each (none overlapping src or each
// other). With `stream`: one pass that reads src once and writes every
// destination with non-temporal stores, through the reduction of one fp32
// input (a bit copy: no arithmetic touches the lanes), where every pointer
// and the size are whole floats; else (a 16-bit block of odd length) memcpy.
inline void copy(void* const* dsts, int n_dsts, const void* src, std::size_t bytes, bool stream) {
  if (bytes == 0 || n_dsts == 0) return;
  auto whole_floats = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % alignof(float) == 0; };
  bool as_floats = stream && bytes % sizeof(float) == 0 && whole_floats(src);
  for (int k = 0; k < n_dsts && as_floats; ++k) as_floats = whole_floats(dsts[k]);
  if (!as_floats) {
    for (int k = 0; k < n_dsts; ++k) std::memcpy(dsts[k], src, bytes);
    return;
  }
  const void* const inputs[1] = {src};
  reduce(DType::f32, ReduceArgs{dsts, n_dsts, inputs, 1, 0, bytes / sizeof(float), true}, ReduceOp::sum);
}

}  // namespace zero::comm::detail
