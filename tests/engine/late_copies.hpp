// A test backend with device = true whose "device" buffers are separate host
// allocations and whose asynchronous copies are LATE: queued, and run only
// when stream order forces them (the next operation on the stream, a
// communication lane's fork, or synchronize()), as a GPU runs them whenever
// it gets to them. A host read of a download_async destination without the
// engine's wait reads stale data. Its pinned buffers are cut into pieces
// as the CUDA backend's are, with page-locking logged instead of done. Used by
// the offload tests and by bench/bench_offload.cpp.
#pragma once

#include <cstddef>
#include <functional>
#include <utility>
#include <vector>

#include "zero/zero.hpp"

namespace zero::test {

// The stream's queued asynchronous copies (one stream per rank thread).
struct LateCopyQueue {
  std::vector<std::function<void()>> pending;
  std::size_t deferred = 0;  // copies queued (the test's evidence that it deferred)
  std::size_t ran_late = 0;  // ... and that were still queued when an operation forced them
  std::size_t stats_fetches = 0;  // gradient statistics brought to the host (a wait each)
  std::size_t host_waits = 0;     // calls that return only when the stream got there
  void drain() {
    ran_late += pending.size();
    for (auto& copy : pending) copy();
    pending.clear();
  }
};
inline LateCopyQueue& late_copies() {
  thread_local LateCopyQueue q;
  return q;
}

// Page-locking as the CUDA backend does it, logged instead: each piece a
// PinnedBuffer locks or unlocks on this thread (a rank), and after
// `refuse_after` locked pieces, lock() refuses (a low `ulimit -l`).
struct LockLog {
  std::vector<std::pair<const void*, std::size_t>> locked;  // address, bytes
  std::vector<const void*> unlocked;
  std::size_t refuse_after = static_cast<std::size_t>(-1);
};
inline LockLog& lock_log() {
  thread_local LockLog log;
  return log;
}
struct LoggingLocker {
  static bool lock(void* p, std::size_t bytes) {
    LockLog& log = lock_log();
    if (log.locked.size() >= log.refuse_after) return false;
    log.locked.emplace_back(p, bytes);
    return true;
  }
  static void unlock(void* p) { lock_log().unlocked.push_back(p); }
  static const char* last_error() { return "refused by the test's locker"; }
};

}  // namespace zero::test

namespace zero::backend {

struct LateCopies {
  static constexpr bool device = true;
  static constexpr const char* name = "late-copies";
};

template <>
struct Ops<LateCopies> {
  using Eager = Ops<Host>;
  template <class T>
  using Buffer = HostBuffer<T>;
  // Cut into pieces as on CUDA, each piece logged (test::lock_log()).
  template <class T>
  using PinnedBuffer = PiecedBuffer<T, test::LoggingLocker>;

  static std::uint64_t allocation_count() { return Eager::allocation_count(); }

  // Every operation on the stream first runs the copies queued before it.
  static void in_order() { test::late_copies().drain(); }
  // ... and a call that returns with its result on the host waits for the stream.
  static void host_wait() {
    in_order();
    ++test::late_copies().host_waits;
  }

  template <class T>
  static void copy(T* dst, const T* src, std::size_t n) {
    in_order();
    Eager::copy(dst, src, n);
  }
  template <class T>
  static void zero(T* dst, std::size_t n) {
    in_order();
    Eager::zero(dst, n);
  }
  template <class T>
  static void upload(T* dst, const T* host_src, std::size_t n) {
    host_wait();
    Eager::upload(dst, host_src, n);
  }
  template <class T>
  static void download(T* host_dst, const T* src, std::size_t n) {
    host_wait();
    Eager::download(host_dst, src, n);
  }
  template <class T>
  static void upload_async(T* dst, const T* host_src, std::size_t n) {
    auto& q = test::late_copies();
    q.pending.push_back([=] { Eager::copy(dst, host_src, n); });
    ++q.deferred;
  }
  template <class T>
  static void download_async(T* host_dst, const T* src, std::size_t n) {
    upload_async(host_dst, src, n);  // the same late copy, the other way
  }
  template <class To, class From>
  static void convert(To* dst, const From* src, std::size_t n) {
    in_order();
    Eager::convert(dst, src, n);
  }
  template <class T, class S>
  static void accumulate(T* dst, const S* src, std::size_t n, bool overwrite) {
    in_order();
    Eager::accumulate(dst, src, n, overwrite);
  }
  template <class Opt, class Grad, class Param>
  static void fused_step(const kernels::FusedStepArgs<Opt, Grad, Param>& args) {
    in_order();
    Eager::fused_step(args);
  }
  template <class T>
  static void quantize(const T* x, float* residual, const quant::Pieces& p, const quant::Format& f, void* payload) {
    in_order();
    Eager::quantize(x, residual, p, f, payload);
  }
  template <class T>
  static void dequantize(const void* payload, const quant::Pieces& p, const quant::Format& f, T* out) {
    in_order();
    Eager::dequantize(payload, p, f, out);
  }
  static void dequantize_sum(const void* payloads, std::size_t count, std::size_t payload_stride, std::size_t n,
                             const quant::Format& f, float* out) {
    in_order();
    Eager::dequantize_sum(payloads, count, payload_stride, n, f, out);
  }
  // Each is one wait for the stream (counted: a step should make one).
  template <class Grad>
  static kernels::GradStats grad_stats(const Grad* grad, std::size_t n) {
    host_wait();
    ++test::late_copies().stats_fetches;
    return Eager::grad_stats(grad, n);
  }
  template <class Piece>
  static kernels::GradStats grad_stats_pieces(std::size_t count, Piece&& piece) {
    host_wait();
    ++test::late_copies().stats_fetches;
    return Eager::grad_stats_pieces(count, piece);
  }
  static void synchronize() { host_wait(); }

  // One stream for compute and communication; a lane (where the collectives
  // run) still starts after the copies queued before it.
  class Overlap : public Eager::Overlap {
   public:
    using Eager::Overlap::Overlap;
    [[nodiscard]] Lane lane() {
      in_order();
      return {};
    }
  };
};

static_assert(OffloadOps<Ops<LateCopies>>);

}  // namespace zero::backend

#if defined(ZERO_TEST_PRECOMPILED_LATE_COPIES)  // late_copies_engines.cpp
#include "zero/runtime/precompiled.hpp"
ZERO_EXTERN_ENGINES(::zero::backend::LateCopies)
#endif
