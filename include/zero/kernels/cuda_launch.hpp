// Why: the library's CUDA kernels are memory-bound streams, and how fast they
// stream depends on the launch shape (threads per block, blocks resident per
// multiprocessor), which depends on the GPU, not on the user's model. As in
// CUB's tuning policies, that choice is a small aggregate chosen per
// architecture here, overridable per call, and never part of a user-facing
// type. Grids are sized to what the device can hold at once and walk the
// array grid-stride, so one launch covers any shard size.
#pragma once

#include "zero/compiler.hpp"

#include "zero/cuda/runtime.hpp"

#include <cstddef>
#include <map>
#include <mutex>
#include <tuple>

#include "zero/cuda/check.hpp"
#include "zero/error.hpp"

namespace zero::kernels {

// Launch shape of one kernel call. Zero fields take the architecture's choice.
struct CudaLaunch {
  int threads = 0;        // threads per block: a multiple of 32, at most 1024
  int blocks_per_sm = 0;  // blocks per multiprocessor the grid is sized for (0: as many as are resident at once)
};

namespace detail {

struct CudaDeviceInfo {
  int sm_count = 0;
  int cc_major = 0;
  int cc_minor = 0;
  int max_threads_per_sm = 0;
};

// Attributes of `device`, read once per device and process.
inline CudaDeviceInfo cuda_device_info(int device) {
  static std::mutex mutex;
  static std::map<int, CudaDeviceInfo> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  auto found = cache.find(device);
  if (found != cache.end()) return found->second;
  CudaDeviceInfo info;
  ZERO_CUDA_CHECK(cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, device));
  ZERO_CUDA_CHECK(cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, device));
  ZERO_CUDA_CHECK(cudaDeviceGetAttribute(&info.cc_minor, cudaDevAttrComputeCapabilityMinor, device));
  ZERO_CUDA_CHECK(cudaDeviceGetAttribute(&info.max_threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device));
  cache.emplace(device, info);
  return info;
}

inline int current_cuda_device() {
  int device = 0;
  ZERO_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

// The per-architecture defaults. A streaming kernel needs enough 16-byte
// loads in flight to cover memory latency, which means filling every thread
// slot of every multiprocessor; 256-thread blocks (8 warps) do that on every
// architecture while leaving the last wave of a grid-stride loop short.
// Architectures whose best shape is measured to differ get their own line.
inline CudaLaunch arch_default_launch(const CudaDeviceInfo& d) {
  CudaLaunch l;
  l.threads = 256;
  // sm_80/sm_90/sm_100 hold 2048 threads per multiprocessor (8 blocks),
  // sm_86/sm_89/sm_120 hold 1536 (6 blocks).
  l.blocks_per_sm = d.max_threads_per_sm > 0 ? d.max_threads_per_sm / l.threads : 4;
  if (l.blocks_per_sm < 1) l.blocks_per_sm = 1;
  return l;
}

inline void validate_launch(const CudaLaunch& l, const char* kernel) {
  require(l.threads == 0 || (l.threads >= 32 && l.threads <= 1024 && l.threads % 32 == 0), "CudaLaunch::threads is ",
          l.threads, " for ", kernel,
          "; it must be a multiple of 32 from 32 to 1024, or 0 for the architecture's choice");
  require(l.blocks_per_sm >= 0, "CudaLaunch::blocks_per_sm is ", l.blocks_per_sm, " for ", kernel,
          "; it must be >= 0 (0: as many as the device holds at once)");
}

// How many blocks of `kernel` with `threads` threads one multiprocessor holds
// at once (registers and shared memory permitting); cached per kernel, device
// and block size, since the answer never changes within a process.
template <class Kernel>
int resident_blocks_per_sm(Kernel kernel, int device, int threads) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int>, int> cache;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), device, threads);
  const std::lock_guard<std::mutex> lock(mutex);
  auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  int blocks = 0;
  ZERO_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0));
  if (blocks < 1) blocks = 1;
  cache.emplace(key, blocks);
  return blocks;
}

struct GridShape {
  int blocks = 1;
  int threads = 256;
};

// The grid for `work` independent items (one per thread and iteration) of
// `kernel` on the current device: no more blocks than the work needs, no more
// than `blocks_per_sm` (default: what is resident at once) per multiprocessor.
template <class Kernel>
GridShape grid_for(Kernel kernel, const CudaLaunch& requested, std::size_t work, const char* name) {
  validate_launch(requested, name);
  const int device = current_cuda_device();
  const CudaDeviceInfo info = cuda_device_info(device);
  const CudaLaunch defaults = arch_default_launch(info);
  GridShape g;
  g.threads = requested.threads > 0 ? requested.threads : defaults.threads;
  int per_sm = requested.blocks_per_sm;
  if (per_sm == 0) {
    per_sm = defaults.blocks_per_sm;
    const int resident = resident_blocks_per_sm(kernel, device, g.threads);
    if (resident < per_sm) per_sm = resident;
  }
  const std::size_t cap = static_cast<std::size_t>(info.sm_count) * static_cast<std::size_t>(per_sm);
  const std::size_t needed = (work + static_cast<std::size_t>(g.threads) - 1) / static_cast<std::size_t>(g.threads);
  std::size_t blocks = needed < cap ? needed : cap;
  if (blocks < 1) blocks = 1;
  g.blocks = static_cast<int>(blocks);
  return g;
}

}  // namespace detail
}  // namespace zero::kernels
