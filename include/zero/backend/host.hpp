// Why: the engine is written once against a small set of buffer operations;
// this is the host implementation (CI runs the whole engine on it; the
// planned ZeRO-Offload will run its CPU side on it too). Buffers are 64-byte
// aligned and allocated only when the optimizer is finalized; the allocation
// counter lets tests prove that steady-state steps allocate nothing.
#pragma once

#include "zero/config.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "zero/backend/ops.hpp"
#include "zero/kernels/fused_step.hpp"
#include "zero/kernels/host_convert.hpp"
#include "zero/kernels/host_step.hpp"
#include "zero/policies.hpp"
#include "zero/precision/convert.hpp"

namespace zero::backend {

namespace detail {
inline std::atomic<std::uint64_t>& host_allocations() {
  static std::atomic<std::uint64_t> n{0};
  return n;
}
}  // namespace detail

// Owning, aligned, zero-initialised host array.
template <class T>
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(std::size_t n) : n_(n) {
    if (n == 0) return;
    if (n > (static_cast<std::size_t>(-1) - 63) / sizeof(T)) throw std::bad_alloc();  // bytes would wrap
    const std::size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
    data_ = static_cast<T*>(std::aligned_alloc(64, bytes));
    if (data_ == nullptr) throw std::bad_alloc();
    std::memset(static_cast<void*>(data_), 0, bytes);
    detail::host_allocations().fetch_add(1, std::memory_order_relaxed);
  }
  HostBuffer(HostBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  HostBuffer& operator=(HostBuffer&& o) noexcept {
    if (this != &o) {
      std::free(data_);
      data_ = std::exchange(o.data_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() { std::free(data_); }

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return n_; }
  std::size_t bytes() const { return n_ * sizeof(T); }
  // As a backend's PinnedBuffer: host memory is all the host backend has.
  bool page_locked() const { return true; }

 private:
  T* data_ = nullptr;
  std::size_t n_ = 0;
};

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
