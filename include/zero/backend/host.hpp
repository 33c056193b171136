// Why: the engine is written once against a small set of buffer operations;
// this is the host implementation (CI runs the whole engine on it, and
// ZeRO-Offload runs its CPU side on it). Buffers (host_buffer.hpp) are 64-byte
// aligned and allocated only when the optimizer is finalized; the allocation
// counter lets tests prove that steady-state steps allocate nothing.
#pragma once

#include "zero/compiler.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "zero/backend/host_buffer.hpp"
#include "zero/backend/ops.hpp"
#include "zero/kernels/fused_step.hpp"
#include "zero/kernels/host_convert.hpp"
#include "zero/kernels/host_quantize.hpp"
#include "zero/kernels/host_step.hpp"
#include "zero/policies.hpp"
#include "zero/precision/convert.hpp"
#include "zero/quant/symmetric.hpp"

namespace zero::backend {

template <>
struct Ops<Host> {
  template <class T>
  using Buffer = HostBuffer<T>;

  // Buffers allocated so far by this backend (all instances).
  static std::uint64_t allocation_count() { return detail::host_allocations().load(); }

  template <class T>
  static void copy(T* dst, const T* src, std::size_t n) {
    if (n != 0 && dst != src) std::memmove(static_cast<void*>(dst), src, n * sizeof(T));
  }
  template <class T>
  static void zero(T* dst, std::size_t n) {
    if (n != 0) std::memset(static_cast<void*>(dst), 0, n * sizeof(T));
  }
  // Host <-> backend memory: the same space here.
  template <class T>
  static void upload(T* dst, const T* host_src, std::size_t n) {
    copy(dst, host_src, n);
  }
  template <class T>
  static void download(T* host_dst, const T* src, std::size_t n) {
    copy(host_dst, src, n);
  }
  // The offload contract (see OffloadOps): on the host, plain copies.
  template <class T>
  using PinnedBuffer = HostBuffer<T>;
  template <class T>
  static void upload_async(T* dst, const T* host_src, std::size_t n) {
    copy(dst, host_src, n);
  }
  template <class T>
  static void download_async(T* host_dst, const T* src, std::size_t n) {
    copy(host_dst, src, n);
  }

  // dst = to<To>(src) elementwise.
  template <class To, class From>
  static void convert(To* dst, const From* src, std::size_t n) {
    kernels::host_convert(src, dst, n);
  }

  // dst (+)= src, summed in fp32 and rounded once to T.
  template <class T, class S>
  static void accumulate(T* dst, const S* src, std::size_t n, bool overwrite) {
    if (overwrite)
      kernels::host_convert(src, dst, n);
    else
      kernels::host_accumulate(dst, src, n);
  }

  template <class Opt, class Grad, class Param>
  static void fused_step(const kernels::FusedStepArgs<Opt, Grad, Param>& args) {
    kernels::host_fused_step(args);
  }
  // ZeRO++'s quantized payloads (quant/symmetric.hpp), piece by piece:
  // quantize x (plus the residual, replaced by the new error, where not
  // null: qgZ's error feedback) into payloads; dequantize them back; and sum
  // `count` payloads of n elements each into out[0, n) in fp32 (qgZ's reduction).
  template <class T>
  static void quantize(const T* x, float* residual, const quant::Pieces& p, const quant::Format& f, void* payload) {
    for (std::size_t k = 0; k < p.count; ++k)
      quant::host_quantize(x + k * p.stride, residual != nullptr ? residual + k * p.stride : nullptr, p.elements, f,
                           static_cast<std::uint8_t*>(payload) + k * p.payload_stride);
  }
  template <class T>
  static void dequantize(const void* payload, const quant::Pieces& p, const quant::Format& f, T* out) {
    for (std::size_t k = 0; k < p.count; ++k)
      quant::host_dequantize(static_cast<const std::uint8_t*>(payload) + k * p.payload_stride, p.elements, f,
                             out + k * p.stride);
  }
  static void dequantize_sum(const void* payloads, std::size_t count, std::size_t payload_stride, std::size_t n,
                             const quant::Format& f, float* out) {
    quant::host_dequantize_sum(payloads, count, payload_stride, n, f, out);
  }
  template <class Grad>
  static kernels::GradStats grad_stats(const Grad* grad, std::size_t n) {
    return kernels::host_grad_stats(grad, n);
  }
  // The statistics of several ranges, piece(i) -> {grad, n} for i < count,
  // added in order.
  template <class Piece>
  static kernels::GradStats grad_stats_pieces(std::size_t count, Piece&& piece) {
    kernels::GradStats stats;
    for (std::size_t i = 0; i < count; ++i) {
      const auto [grad, n] = piece(i);
      stats += kernels::host_grad_stats(grad, n);
    }
    return stats;
  }
  static void synchronize() {}

  // Compute/communication overlap (see Ops<Cuda>::Overlap). Host
  // communicators run each collective to completion on the calling thread,
  // in program order, so there is nothing to order and nothing overlaps.
  class Overlap {
   public:
    Overlap() = default;
    Overlap(void* /*comm_stream*/, std::size_t /*events*/) {}
    struct Lane {
      ~Lane() {}  // user-provided: an unused guard draws no warning
    };
    bool active() const { return false; }
    [[nodiscard]] Lane lane() { return {}; }
    void mark(std::size_t /*event*/) {}
    void wait(std::size_t /*event*/) {}
    void join() {}
  };
};

static_assert(OffloadOps<Ops<Host>>);

}  // namespace zero::backend
