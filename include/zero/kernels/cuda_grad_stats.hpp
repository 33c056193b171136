// Why: the gradient statistics (squared norm and inf/NaN of the gradient
// shards) are one kernel pass (kernels/cuda_step.cuh) around which the host
// keeps a workspace, a pinned result and a device check; that host side is
// here, in host code, so that the engine on backend::Cuda compiles without
// nvcc (kernels/cuda_launchers.hpp says how the kernel reaches it).
#pragma once

#include "zero/cuda/runtime.hpp"

#include <cstddef>
#include <cstdint>
#include <utility>

#include "zero/cuda/check.hpp"
#include "zero/cuda/device.hpp"
#include "zero/cuda/stream.hpp"
#include "zero/error.hpp"
#include "zero/kernels/cuda_launch.hpp"
#include "zero/kernels/cuda_launchers.hpp"
#include "zero/kernels/fused_step.hpp"
#include "zero/precision/types.hpp"

namespace zero::kernels {
namespace detail {

template <class T>
bool can_align(const T* p, std::size_t skip) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  return address % alignof(T) == 0 && (address + skip * sizeof(T)) % 16 == 0;
}

// Vectors each thread sums in fp32 before adding the partial into its double
// accumulator: enough loads in flight per thread, and a float sum of at most
// 32 squares loses nothing that matters to a norm.
inline constexpr int grad_stats_unroll = 4;

}  // namespace detail

// Squared L2 norm (double) and inf/NaN detection of device gradient shards,
// one launch each, with its workspace allocated once on the current device at
// construction: no allocation per call. One object serves one stream at a
// time (its calls are ordered on that stream); results can accumulate over
// several shards (the owned shards of every unit) before being fetched.
// Every host wait (construction, fetch) goes through zero::cuda::wait_stream,
// so a collective that will never finish is a CommError there, not a hang.
//
//   CudaGradStats stats;                       // on the device that holds the shards
//   stats.enqueue(grad_a, n_a, stream);        // result = stats of a
//   stats.enqueue(grad_b, n_b, stream, true);  // result += stats of b
//   GradStats s = stats.fetch(stream);         // waits for the stream
//
// device_result() stays valid for kernels that read the norm on the device.
// The block size (CudaLaunch::threads) must be 128, 256, 512 or 1024.
class CudaGradStats {
 public:
  explicit CudaGradStats(const CudaLaunch& launch = {}) {
    detail::validate_launch(launch, "CudaGradStats");
    device_ = detail::current_cuda_device();
    const detail::CudaDeviceInfo info = detail::cuda_device_info(device_);
    const CudaLaunch defaults = detail::arch_default_launch(info);
    threads_ = launch.threads > 0 ? launch.threads : defaults.threads;
    require(threads_ == 128 || threads_ == 256 || threads_ == 512 || threads_ == 1024,
            "CudaGradStats: CudaLaunch::threads is ", threads_, "; it must be 128, 256, 512 or 1024 (or 0)");
    const int per_sm = launch.blocks_per_sm > 0 ? launch.blocks_per_sm : (info.max_threads_per_sm / threads_);
    max_blocks_ = info.sm_count * (per_sm > 0 ? per_sm : 1);
    try {
      ZERO_CUDA_CHECK(cudaMalloc(&partial_sum_, sizeof(double) * static_cast<std::size_t>(max_blocks_)));
      ZERO_CUDA_CHECK(cudaMalloc(&partial_flag_, sizeof(int) * static_cast<std::size_t>(max_blocks_)));
      ZERO_CUDA_CHECK(cudaMalloc(&blocks_done_, sizeof(unsigned int)));
      ZERO_CUDA_CHECK(cudaMalloc(&device_result_, sizeof(GradStats)));
      ZERO_CUDA_CHECK(cudaMallocHost(&host_result_, sizeof(GradStats)));
      zero::cuda::count_device_allocations(4);  // the cudaMalloc calls above
      *host_result_ = GradStats{};
      // Zeroed on this thread's stream and waited for there (watched), so
      // that kernels on any stream find them zeroed; a plain
      // cudaDeviceSynchronize would wait unwatched behind every collective.
      const cudaStream_t stream = zero::cuda::current_stream();
      ZERO_CUDA_CHECK(cudaMemsetAsync(blocks_done_, 0, sizeof(unsigned int), stream));
      ZERO_CUDA_CHECK(cudaMemsetAsync(device_result_, 0, sizeof(GradStats), stream));
      zero::cuda::wait_stream(stream);
    } catch (...) {
      release();
      throw;
    }
  }

  CudaGradStats(const CudaGradStats&) = delete;
  CudaGradStats& operator=(const CudaGradStats&) = delete;
  CudaGradStats(CudaGradStats&& o) noexcept { swap(o); }
  CudaGradStats& operator=(CudaGradStats&& o) noexcept {
    if (this != &o) {
      release();
      swap(o);
    }
    return *this;
  }
  ~CudaGradStats() { release(); }

  // Enqueues the statistics of grad[0, n) (raw values, before any scaling) on
  // `stream`; with accumulate, adds them to the current result instead.
  template <StorageType Grad>
  void enqueue(const Grad* grad, std::size_t n, cudaStream_t stream, bool accumulate = false) {
    require(device_result_ != nullptr, "CudaGradStats: this object was moved from; use the one it was moved to");
    require(n == 0 || grad != nullptr, "CudaGradStats::enqueue: grad is null for ", n, " elements");
    const int device = detail::current_cuda_device();
    require(device == device_, "CudaGradStats::enqueue: the current device is ", device,
            " but this object's workspace is on device ", device_, "; call cudaSetDevice(", device_,
            ") first or make one CudaGradStats per device");
    constexpr int V = 16 / static_cast<int>(sizeof(Grad));
    std::size_t head = 0;
    std::size_t vectors = 0;
    for (std::size_t h = 0; h < static_cast<std::size_t>(V) && h < n; ++h) {
      if (detail::can_align(grad, h)) {
        head = h;
        vectors = (n - h) / static_cast<std::size_t>(V);
        break;
      }
    }
    const std::size_t singles = n - vectors * static_cast<std::size_t>(V);
    const std::size_t work_per_thread_pass = (vectors + detail::grad_stats_unroll - 1) / detail::grad_stats_unroll;
    const std::size_t work = work_per_thread_pass > singles ? work_per_thread_pass : singles;
    std::size_t blocks = (work + static_cast<std::size_t>(threads_) - 1) / static_cast<std::size_t>(threads_);
    if (blocks > static_cast<std::size_t>(max_blocks_)) blocks = static_cast<std::size_t>(max_blocks_);
    if (blocks < 1) blocks = 1;
    const int grid = static_cast<int>(blocks);
    detail::launch_grad_stats(threads_, grid, grad, n, head, vectors,
                              detail::GradStatsWorkspace{partial_sum_, partial_flag_, blocks_done_, device_result_},
                              accumulate, stream);
  }

  // The result in device memory, ordered after the enqueues on their stream.
  const GradStats* device_result() const { return device_result_; }

  // Copies the result to pinned host memory on `stream`, waits for the
  // stream (zero::cuda::wait_stream), and returns it.
  GradStats fetch(cudaStream_t stream) {
    require(device_result_ != nullptr, "CudaGradStats: this object was moved from; use the one it was moved to");
    ZERO_CUDA_CHECK(cudaMemcpyAsync(host_result_, device_result_, sizeof(GradStats), cudaMemcpyDeviceToHost, stream));
    zero::cuda::wait_stream(stream);
    return *host_result_;
  }

  // enqueue (not accumulating) and fetch.
  template <StorageType Grad>
  GradStats compute(const Grad* grad, std::size_t n, cudaStream_t stream) {
    enqueue(grad, n, stream);
    return fetch(stream);
  }

  int device() const { return device_; }
  int threads() const { return threads_; }
  int max_blocks() const { return max_blocks_; }

 private:
  void swap(CudaGradStats& o) noexcept {
    std::swap(device_, o.device_);
    std::swap(threads_, o.threads_);
    std::swap(max_blocks_, o.max_blocks_);
    std::swap(partial_sum_, o.partial_sum_);
    std::swap(partial_flag_, o.partial_flag_);
    std::swap(blocks_done_, o.blocks_done_);
    std::swap(device_result_, o.device_result_);
    std::swap(host_result_, o.host_result_);
  }

  // Frees on the owning device; errors are ignored (a destructor must not
  // throw, and a failed free at teardown has nothing left to protect).
  void release() noexcept {
    if (partial_sum_ == nullptr && partial_flag_ == nullptr && blocks_done_ == nullptr && device_result_ == nullptr &&
        host_result_ == nullptr)
      return;
    {
      const zero::cuda::DeviceScope owner(device_);
      cudaFree(partial_sum_);
      cudaFree(partial_flag_);
      cudaFree(blocks_done_);
      cudaFree(device_result_);
      cudaFreeHost(host_result_);
    }
    partial_sum_ = nullptr;
    partial_flag_ = nullptr;
    blocks_done_ = nullptr;
    device_result_ = nullptr;
    host_result_ = nullptr;
  }

  int device_ = 0;
  int threads_ = 256;
  int max_blocks_ = 0;
  double* partial_sum_ = nullptr;
  int* partial_flag_ = nullptr;
  unsigned int* blocks_done_ = nullptr;
  GradStats* device_result_ = nullptr;
  GradStats* host_result_ = nullptr;
};

}  // namespace zero::kernels
