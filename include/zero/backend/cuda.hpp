// Why: the engine is written once against the buffer operations of
// zero/backend/host.hpp; this is their GPU implementation, so the same
// ZeroOptimizer runs on device memory with zero::backend::Cuda. It mirrors
// Ops<Host> function for function and bit for bit (convert, accumulate and
// the fused step round exactly as the host does), so CPU and GPU runs agree,
// as ZeRO-Offload's two halves must (the device computes, the host steps).
//
// Ordering is by streams, never by host synchronisation. Every operation
// here is enqueued on Ops<Cuda>::stream(), the calling thread's current
// stream (zero/cuda/stream.hpp; default a lazily created non-blocking
// stream, or one set with set_stream): the compute stream. Kernels the user
// runs on the engine's buffers (forward, backward writing grad_buffer)
// belong on it too, or must be ordered against it with events. The
// communicator may enqueue on the same stream, or on its own (comm::Nccl by
// default): then the engine runs its communication work on that stream and
// orders the two with events (Ops<Cuda>::Overlap below), so collectives run
// beside the user's kernels.
//
// The host waits only where it must: download, grad_stats(_pieces) and synchronize
// return results to the host; upload returns when the host buffer may be
// reused. Those waits go through zero::cuda::wait_stream, which turns a
// collective that will never finish into a CommError instead of a hang.
//
// This is host code: any C++20 compiler takes it, given the CUDA toolkit's
// headers. Its few kernel launches are declared in kernels/cuda_launchers.hpp
// and defined by nvcc (zero/zero_cuda.cuh says how a program gets them).
#pragma once

#include "zero/compiler.hpp"

#include "zero/cuda/runtime.hpp"

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "zero/backend/host.hpp"
#include "zero/backend/pieced_buffer.hpp"
#include "zero/cuda/check.hpp"
#include "zero/cuda/device.hpp"
#include "zero/cuda/stream.hpp"
#include "zero/kernels/cuda_grad_stats.hpp"
#include "zero/kernels/cuda_launch.hpp"
#include "zero/kernels/cuda_launchers.hpp"
#include "zero/kernels/fused_step.hpp"
#include "zero/policies.hpp"

namespace zero::backend {

namespace detail {

// Per-thread workspaces of grad_stats, one per device: allocated on a
// thread's first call on a device and kept, so a thread that alternates
// between GPUs allocates (and synchronises) nothing in its steady state.
class CudaThreadWorkspace {
 public:
  kernels::CudaGradStats& stats(int device) {
    if (static_cast<std::size_t>(device) >= per_device_.size())
      per_device_.resize(static_cast<std::size_t>(device) + 1);
    std::unique_ptr<kernels::CudaGradStats>& w = per_device_[static_cast<std::size_t>(device)];
    if (!w) w = std::make_unique<kernels::CudaGradStats>();  // on `device`, the current one
    return *w;
  }

 private:
  std::vector<std::unique_ptr<kernels::CudaGradStats>> per_device_;  // by device number
};

inline CudaThreadWorkspace& cuda_thread_workspace() {
  thread_local CudaThreadWorkspace w;
  return w;
}

}  // namespace detail

// Owning device array (cudaMalloc, so 256-byte aligned), zero-filled in
// stream order on the allocating thread's current stream. Move-only; freed
// with cudaFree on the device it was allocated on.
template <class T>
class CudaBuffer {
 public:
  CudaBuffer() = default;
  explicit CudaBuffer(std::size_t n) : n_(n) {
    if (n == 0) return;
    ZERO_CUDA_CHECK(cudaGetDevice(&device_));
    void* p = nullptr;
    const cudaError_t status = cudaMalloc(&p, n * sizeof(T));
    if (status != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it so later calls do not report it
      throw BackendError(zero::detail::concat(
          "backend::Cuda: cudaMalloc of ", n, " elements (", n * sizeof(T), " bytes) on device ", device_,
          " failed: ", cudaGetErrorString(status),
          "; free device memory, use a higher ZeRO stage or more ranks, or reduce Options::prefetch_units"));
    }
    data_ = static_cast<T*>(p);
    const cudaError_t zeroed = cudaMemsetAsync(p, 0, n * sizeof(T), zero::cuda::current_stream());
    if (zeroed != cudaSuccess) {
      cudaFree(p);
      data_ = nullptr;
      zero::cuda::detail::throw_cuda_error(zeroed, "cudaMemsetAsync(buffer, 0, bytes, stream)", __FILE__, __LINE__);
    }
    zero::cuda::count_device_allocations();
  }
  CudaBuffer(CudaBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), n_(std::exchange(o.n_, 0)), device_(o.device_) {}
  CudaBuffer& operator=(CudaBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      n_ = std::exchange(o.n_, 0);
      device_ = o.device_;
    }
    return *this;
  }
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;
  ~CudaBuffer() { release(); }

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return n_; }
  std::size_t bytes() const { return n_ * sizeof(T); }
  int device() const { return device_; }

 private:
  // cudaFree waits for the device, so work still reading the buffer finishes
  // first. Errors are ignored: a destructor must not throw.
  void release() noexcept {
    if (data_ == nullptr) return;
    {
      const zero::cuda::DeviceScope owner(device_);
      cudaFree(data_);
    }
    data_ = nullptr;
    n_ = 0;
  }

  T* data_ = nullptr;
  std::size_t n_ = 0;
  int device_ = 0;
};

// Page-locking for host memory that copies to and from the device reach at
// full PCIe speed and asynchronously: cudaHostRegister, one piece at a time
// (backend/pieced_buffer.hpp cuts the buffer).
struct CudaPageLocker {
  static bool lock(void* p, std::size_t bytes) {
    const cudaError_t status = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    if (status == cudaSuccess) return true;
    last() = status;
    cudaGetLastError();  // not sticky
    return false;
  }
  // The device first finishes what it queued: a copy may still read the piece.
  static void unlock(void* p) {
    cudaDeviceSynchronize();
    cudaHostUnregister(p);
  }
  static const char* last_error() { return cudaGetErrorString(last()); }

 private:
  static cudaError_t& last() {
    thread_local cudaError_t status = cudaSuccess;
    return status;
  }
};

// Host memory for offloaded model state and its transfers: one contiguous
// range, page-locked in pieces of at most Options::pinned_piece_bytes cut
// between units. Where pinning fails (a low `ulimit -l`, a container's limit)
// it stays pageable with a one-line warning, and says so through
// page_locked(): the engine refuses it when Options::require_pinned_memory is
// set. Zero-filled, move-only.
template <class T>
using CudaPinnedBuffer = PiecedBuffer<T, CudaPageLocker>;

template <>
struct Ops<Cuda> {
  template <class T>
  using Buffer = CudaBuffer<T>;

  // Device allocations made so far by the library, all threads: buffers
  // and the gradient-statistics workspaces.
  static std::uint64_t allocation_count() { return zero::cuda::device_allocation_count(); }

  // The stream of the calling thread that every operation below uses.
  static cudaStream_t stream() { return zero::cuda::current_stream(); }
  // Makes `s` the calling thread's stream (not owned; keep it alive while in
  // use). Communicators built afterwards on this thread default to it.
  static void set_stream(cudaStream_t s) { zero::cuda::set_current_stream(s); }
  // Back to the thread's own lazily created non-blocking stream.
  static void reset_stream() { zero::cuda::reset_current_stream(); }

  // Device to device (any pointers the device can address). The ranges must
  // not overlap unless dst == src.
  template <class T>
  static void copy(T* dst, const T* src, std::size_t n) {
    if (n != 0 && dst != src) ZERO_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDefault, stream()));
  }
  template <class T>
  static void zero(T* dst, std::size_t n) {
    if (n != 0) ZERO_CUDA_CHECK(cudaMemsetAsync(dst, 0, n * sizeof(T), stream()));
  }
  // Host -> device. Returns when host_src may be reused (the copy is done).
  // The stream is drained first (watched, see wait_stream): a copy from
  // pageable memory would otherwise wait for it inside CUDA, unwatched.
  template <class T>
  static void upload(T* dst, const T* host_src, std::size_t n) {
    if (n == 0) return;
    zero::cuda::wait_stream(stream());
    ZERO_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, n * sizeof(T), cudaMemcpyHostToDevice, stream()));
    zero::cuda::wait_stream(stream());
  }
  // Device -> host. Returns when the data is in host_dst (everything enqueued
  // before it on the stream has finished).
  template <class T>
  static void download(T* host_dst, const T* src, std::size_t n) {
    zero::cuda::wait_stream(stream());
    if (n == 0) return;
    ZERO_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, n * sizeof(T), cudaMemcpyDeviceToHost, stream()));
    zero::cuda::wait_stream(stream());
  }

  // The offload contract (see OffloadOps): copies between device memory and
  // a PinnedBuffer, enqueued on the stream; the host waits with synchronize().
  template <class T>
  using PinnedBuffer = CudaPinnedBuffer<T>;
  template <class T>
  static void upload_async(T* dst, const T* host_src, std::size_t n) {
    if (n != 0) ZERO_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, n * sizeof(T), cudaMemcpyHostToDevice, stream()));
  }
  template <class T>
  static void download_async(T* host_dst, const T* src, std::size_t n) {
    if (n != 0) ZERO_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, n * sizeof(T), cudaMemcpyDeviceToHost, stream()));
  }
  // dst = to<To>(src) elementwise.
  template <class To, class From>
  static void convert(To* dst, const From* src, std::size_t n) {
    kernels::cuda_convert(dst, src, n, stream());
  }

  // dst (+)= src, summed in fp32 and rounded once to T.
  template <class T, class S>
  static void accumulate(T* dst, const S* src, std::size_t n, bool overwrite) {
    if (overwrite) return convert(dst, src, n);
    kernels::cuda_accumulate(dst, src, n, stream());
  }

  template <class Opt, class Grad, class Param>
  static void fused_step(const kernels::FusedStepArgs<Opt, Grad, Param>& args) {
    kernels::cuda_fused_step(args, stream());
  }
  // ZeRO++'s quantized payloads (quant/symmetric.hpp; Ops<Host> says what each does).
  template <class T>
  static void quantize(const T* x, float* residual, const quant::Pieces& p, const quant::Format& f, void* payload) {
    kernels::cuda_quantize(x, residual, p, f, payload, stream());
  }
  template <class T>
  static void dequantize(const void* payload, const quant::Pieces& p, const quant::Format& f, T* out) {
    kernels::cuda_dequantize(payload, p, f, out, stream());
  }
  static void dequantize_sum(const void* payloads, std::size_t count, std::size_t payload_stride, std::size_t n,
                             const quant::Format& f, float* out) {
    kernels::cuda_dequantize_sum(payloads, count, payload_stride, n, f, out, stream());
  }

  // Squared norm and inf/NaN of grad[0, n): waits for the stream and returns
  // the result. Allocates only on a thread's first call on each device (its
  // workspace there).
  template <class Grad>
  static kernels::GradStats grad_stats(const Grad* grad, std::size_t n) {
    if (n == 0) return {};
    int device = 0;
    ZERO_CUDA_CHECK(cudaGetDevice(&device));
    return detail::cuda_thread_workspace().stats(device).compute(grad, n, stream());
  }

  // The statistics of several ranges, piece(i) -> {grad, n} for i < count:
  // added on the device in order (as the host adds them), and fetched with
  // one wait instead of one per range.
  template <class Piece>
  static kernels::GradStats grad_stats_pieces(std::size_t count, Piece&& piece) {
    int device = 0;
    ZERO_CUDA_CHECK(cudaGetDevice(&device));
    kernels::CudaGradStats& stats = detail::cuda_thread_workspace().stats(device);
    bool any = false;
    for (std::size_t i = 0; i < count; ++i) {
      const auto [grad, n] = piece(i);
      if (n == 0) continue;
      stats.enqueue(grad, n, stream(), any);
      any = true;
    }
    return any ? stats.fetch(stream()) : kernels::GradStats{};
  }

  // Waits for everything enqueued on this thread's stream.
  static void synchronize() { zero::cuda::wait_stream(stream()); }

  // Compute/communication overlap. When the communicator enqueues on a stream
  // of its own (comm::Nccl or comm::LocalDevice built with a second stream),
  // the engine runs its communication work (gradient buckets, stage-3
  // gathers: the collectives and the copies around them) on that stream in a
  // Lane, ordered after the compute stream's work so far, and the compute
  // stream waits for numbered events only where it reads a result or reuses
  // a buffer. In between, backward and forward kernels run beside the
  // collectives. With one stream for both every call here is a no-op.
  class Overlap {
   public:
    Overlap() = default;
    // `comm_stream`: the communicator's stream (nullptr: it has none);
    // `events`: how many numbered events mark() and wait() use.
    Overlap(void* comm_stream, std::size_t events) {
      const auto comm = static_cast<cudaStream_t>(comm_stream);
      if (comm == nullptr || comm == stream()) return;  // one stream: nothing to order
      events_.assign(events + first_numbered, nullptr);
      try {
        for (cudaEvent_t& e : events_) ZERO_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      } catch (...) {
        destroy();
        throw;
      }
      comm_ = comm;
    }
    Overlap(Overlap&& o) noexcept : comm_(std::exchange(o.comm_, nullptr)), events_(std::exchange(o.events_, {})) {}
    Overlap& operator=(Overlap&& o) noexcept {
      if (this != &o) {
        destroy();
        comm_ = std::exchange(o.comm_, nullptr);
        events_ = std::exchange(o.events_, {});
      }
      return *this;
    }
    Overlap(const Overlap&) = delete;
    Overlap& operator=(const Overlap&) = delete;
    ~Overlap() { destroy(); }

    // Communication and compute run on different streams.
    bool active() const { return comm_ != nullptr; }

    // For its lifetime the communicator's stream is the thread's current
    // stream (so Ops<Cuda> calls land on it too), and it starts after
    // everything enqueued on the compute stream so far.
    class Lane {
     public:
      Lane() = default;
      Lane(cudaStream_t compute, cudaStream_t comm, cudaEvent_t fork) {
        zero::cuda::order_after(comm, compute, fork);
        scope_.emplace(comm);
      }

     private:
      std::optional<zero::cuda::CurrentStreamScope> scope_;
    };
    [[nodiscard]] Lane lane() {
      if (!active() || stream() == comm_) return {};  // inactive, or already in a lane
      return Lane(stream(), comm_, events_[fork_event]);
    }
    // Inside a lane: event k marks the communication work enqueued so far.
    void mark(std::size_t k) {
      if (active()) ZERO_CUDA_CHECK(cudaEventRecord(events_[first_numbered + k], comm_));
    }
    // Outside a lane: the compute stream waits for what event k marked
    // (nothing if it was never marked).
    void wait(std::size_t k) {
      if (active()) ZERO_CUDA_CHECK(cudaStreamWaitEvent(stream(), events_[first_numbered + k], 0));
    }
    // Outside a lane: the compute stream waits for all communication work
    // enqueued so far.
    void join() {
      if (active()) zero::cuda::order_after(stream(), comm_, events_[join_event]);
    }

   private:
    static constexpr std::size_t fork_event = 0, join_event = 1, first_numbered = 2;
    void destroy() noexcept {
      for (cudaEvent_t e : events_)
        if (e != nullptr) cudaEventDestroy(e);
      events_.clear();
    }
    cudaStream_t comm_ = nullptr;
    std::vector<cudaEvent_t> events_;
  };
};

static_assert(OffloadOps<Ops<Cuda>>);

}  // namespace zero::backend
