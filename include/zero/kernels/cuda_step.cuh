// Why: on the GPU the optimizer step is one pass over the owned shard, bound
// by memory bandwidth, so the kernel's job is to move bytes: 16-byte loads and
// stores on every array, a grid-stride loop sized to the device, 64-bit
// indices (a shard can exceed 2^31 elements). The arithmetic is NOT written
// here: every element goes through fused_step_element (zero/kernels/
// fused_step.hpp), the same body as the host kernel, so the GPU and the CPU
// produce bit-identical master weights, states and copies (as the planned
// ZeRO-Offload needs; device code built with -ftz=true is refused for that,
// zero/cuda/exact_math.cuh).
// The gradient statistics (squared norm, inf/NaN) are a second, read-only
// pass that the step needs before it can run; it is one launch too.
#pragma once

#if !defined(__CUDACC__)
#error "zero/kernels/cuda_step.cuh holds CUDA kernels: include it from a .cu file compiled by nvcc"
#endif

#include "zero/config.hpp"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <cub/block/block_reduce.cuh>
#include <type_traits>
#include <utility>

#include "zero/cuda/check.cuh"
#include "zero/cuda/device.cuh"
#include "zero/cuda/exact_math.cuh"
#include "zero/cuda/stream.cuh"
#include "zero/error.hpp"
#include "zero/kernels/cuda_launch.cuh"
#include "zero/kernels/fused_step.hpp"
#include "zero/precision/types.hpp"

namespace zero::kernels {
namespace detail {

// Elements per vector step: 16 bytes of the narrowest array (4 when all are
// fp32, 8 with a 16-bit gradient or copy); wider arrays take several 16-byte
// accesses per step.
template <class Grad, class Param>
constexpr int cuda_vector_width() {
  std::size_t narrowest = sizeof(float);
  if (sizeof(Grad) < narrowest) narrowest = sizeof(Grad);
  if (!std::is_same_v<Param, float> && sizeof(Param) < narrowest) narrowest = sizeof(Param);
  return static_cast<int>(16 / narrowest);
}

template <int V, class T>
__device__ __forceinline__ void load_vector(const T* p, T (&out)[V]) {
  static_assert((V * sizeof(T)) % 16 == 0, "a vector is a whole number of 16-byte accesses");
#pragma unroll
  for (int c = 0; c < static_cast<int>(V * sizeof(T) / 16); ++c) {
    const uint4 raw = reinterpret_cast<const uint4*>(p)[c];
    std::memcpy(reinterpret_cast<char*>(out) + 16 * c, &raw, 16);
  }
}

template <int V, class T>
__device__ __forceinline__ void store_vector(T* p, const T (&in)[V]) {
#pragma unroll
  for (int c = 0; c < static_cast<int>(V * sizeof(T) / 16); ++c) {
    uint4 raw;
    std::memcpy(&raw, reinterpret_cast<const char*>(in) + 16 * c, 16);
    reinterpret_cast<uint4*>(p)[c] = raw;
  }
}

// V consecutive elements starting at i (16-byte aligned on every array):
// load each array into registers, run fused_step_element on the registers
// (an argument block whose pointers are the register arrays, offset so that
// stochastic rounding sees the same global index), store back.
template <int V, class Opt, class Grad, class Param>
__device__ __forceinline__ void fused_step_vector(const FusedStepArgs<Opt, Grad, Param>& a, std::size_t i) {
  constexpr int S = Opt::state_slots;
  float w[V];
  Grad g[V];
  float st[S > 0 ? S : 1][V];
  Param p[V];
  load_vector<V>(a.master + i, w);
  load_vector<V>(a.grad + i, g);
#pragma unroll
  for (int k = 0; k < S; ++k) load_vector<V>(a.state[k] + i, st[k]);

  FusedStepArgs<Opt, Grad, Param> r = a;
  r.master = w;
  r.grad = g;
#pragma unroll
  for (int k = 0; k < S; ++k) r.state[k] = st[k];
  r.param = p;
  r.n = V;
  r.global_offset = a.global_offset + i;
#pragma unroll
  for (int l = 0; l < V; ++l) fused_step_element(r, static_cast<std::size_t>(l));

  store_vector<V>(a.master + i, w);
#pragma unroll
  for (int k = 0; k < S; ++k) store_vector<V>(a.state[k] + i, st[k]);
  if constexpr (!std::is_same_v<Param, float>) store_vector<V>(a.param + i, p);
}

// Elements [0, head) and [head + vectors*V, n) go one at a time (unaligned
// head, short tail, or everything when the arrays' alignments disagree);
// [head, head + vectors*V) goes V at a time.
template <int V, class Opt, class Grad, class Param>
__global__ void fused_step_kernel(const FusedStepArgs<Opt, Grad, Param> a, std::size_t head, std::size_t vectors) {
  cuda::require_exact_float_flags();
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (std::size_t c = first; c < vectors; c += stride) fused_step_vector<V>(a, head + c * V);
  const std::size_t tail = head + vectors * V;
  const std::size_t singles = head + (a.n - tail);
  for (std::size_t s = first; s < singles; s += stride) fused_step_element(a, s < head ? s : tail + (s - head));
}

struct VectorPlan {
  std::size_t head = 0;     // elements before the first aligned vector
  std::size_t vectors = 0;  // whole vectors of V elements after them
};

template <class T>
bool can_align(const T* p, std::size_t skip) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  return address % alignof(T) == 0 && (address + skip * sizeof(T)) % 16 == 0;
}

// The smallest head h < V after which every array is 16-byte aligned; no
// vectors at all when none exists (arrays offset by different amounts).
template <int V, class Opt, class Grad, class Param>
VectorPlan plan_vectors(const FusedStepArgs<Opt, Grad, Param>& a) {
  for (std::size_t h = 0; h < static_cast<std::size_t>(V) && h < a.n; ++h) {
    bool ok = can_align(a.master, h) && can_align(a.grad, h);
    for (int k = 0; k < Opt::state_slots; ++k) ok = ok && can_align(a.state[k], h);
    if constexpr (!std::is_same_v<Param, float>) ok = ok && can_align(a.param, h);
    if (ok) return VectorPlan{h, (a.n - h) / static_cast<std::size_t>(V)};
  }
  return VectorPlan{};
}

template <class Opt, class Grad, class Param>
void require_step_pointers(const FusedStepArgs<Opt, Grad, Param>& a) {
  require(a.master != nullptr, "cuda_fused_step: FusedStepArgs::master is null; pass the fp32 master shard");
  require(a.grad != nullptr, "cuda_fused_step: FusedStepArgs::grad is null; pass the gradient shard");
  for (int k = 0; k < Opt::state_slots; ++k)
    require(a.state[k] != nullptr, "cuda_fused_step: FusedStepArgs::state[", k, "] is null; ", Opt::name, " keeps ",
            Opt::state_slots, " fp32 state array(s) of n elements");
  if constexpr (!std::is_same_v<Param, float>)
    require(a.param != nullptr, "cuda_fused_step: FusedStepArgs::param is null; a ", dtype_traits<Param>::name,
            " step writes the low-precision copy there");
}

}  // namespace detail

// One fused optimizer step over a device shard (see FusedStepArgs), enqueued
// on `stream`. Every pointer must be device-accessible; the arrays are used
// 16 bytes at a time when they can all be aligned by skipping the same number
// of leading elements, else element by element. Results are bit-identical to
// host_fused_step on the same inputs. Throws InvalidArgument for a null
// array or a bad launch shape, BackendError when the launch fails.
template <optim::Policy Opt, StorageType Grad, StorageType Param>
void cuda_fused_step(const FusedStepArgs<Opt, Grad, Param>& args, cudaStream_t stream, const CudaLaunch& launch = {}) {
  if (args.n == 0) return;
  detail::require_step_pointers(args);
  constexpr int V = detail::cuda_vector_width<Grad, Param>();
  const auto kernel = detail::fused_step_kernel<V, Opt, Grad, Param>;
  const detail::VectorPlan plan = detail::plan_vectors<V>(args);
  const std::size_t singles = args.n - plan.vectors * static_cast<std::size_t>(V);
  const detail::GridShape grid =
      detail::grid_for(kernel, launch, plan.vectors > singles ? plan.vectors : singles, "cuda_fused_step");
  kernel<<<grid.blocks, grid.threads, 0, stream>>>(args, plan.head, plan.vectors);
  cuda::check_launch("zero::kernels::cuda_fused_step<", Opt::name, ", ", dtype_traits<Grad>::name, ", ",
                     dtype_traits<Param>::name, "> (", args.n, " elements, ", grid.blocks, " blocks of ", grid.threads,
                     " threads)");
}

namespace detail {

__device__ __forceinline__ bool is_non_finite(float x) { return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u; }

// Vectors each thread sums in fp32 before adding the partial into its double
// accumulator: enough loads in flight per thread, and a float sum of at most
// 32 squares loses nothing that matters to a norm.
inline constexpr int grad_stats_unroll = 4;

// One pass: each thread sums squares (fp32 over short runs, then double) and
// ORs the non-finite flag; each block reduces its threads (CUB) into one
// partial; the last block to finish reduces the partials in block order (so
// the result does not depend on scheduling) and writes, or adds to, *result.
template <int Threads, class Grad>
__global__ void __launch_bounds__(Threads)
    grad_stats_kernel(const Grad* g, std::size_t n, std::size_t head, std::size_t vectors, double* partial_sum,
                      int* partial_flag, unsigned int* blocks_done, GradStats* result, bool accumulate) {
  cuda::require_exact_float_flags();
  constexpr int V = 16 / static_cast<int>(sizeof(Grad));
  constexpr int U = grad_stats_unroll;
  using Reduce = cub::BlockReduce<double, Threads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ bool last_block;

  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * Threads;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * Threads + threadIdx.x;
  double sum = 0.0;
  bool bad = false;
  for (std::size_t c = first; c < vectors; c += stride * U) {
    float run = 0.0f;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const std::size_t cu = c + static_cast<std::size_t>(u) * stride;
      if (cu < vectors) {
        Grad x[V];
        load_vector<V>(g + head + cu * V, x);
#pragma unroll
        for (int l = 0; l < V; ++l) {
          const float f = to_float(x[l]);
          run = __fmaf_rn(f, f, run);
          bad = bad || is_non_finite(f);
        }
      }
    }
    sum += static_cast<double>(run);
  }
  const std::size_t tail = head + vectors * V;
  const std::size_t singles = head + (n - tail);
  for (std::size_t s = first; s < singles; s += stride) {
    const float f = to_float(g[s < head ? s : tail + (s - head)]);
    sum += static_cast<double>(f) * static_cast<double>(f);
    bad = bad || is_non_finite(f);
  }

  const double block_sum = Reduce(temp).Sum(sum);
  const int block_bad = __syncthreads_or(bad ? 1 : 0);
  if (threadIdx.x == 0) {
    partial_sum[blockIdx.x] = block_sum;
    partial_flag[blockIdx.x] = block_bad;
    __threadfence();  // partials visible device-wide before the count says so
    last_block = atomicAdd(blocks_done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last_block) return;

  __threadfence();
  double total = 0.0;
  int any_bad = 0;
  for (unsigned int b = threadIdx.x; b < gridDim.x; b += Threads) {
    total += __ldcg(partial_sum + b);  // L2, never a stale L1 line
    any_bad |= __ldcg(partial_flag + b);
  }
  total = Reduce(temp).Sum(total);
  any_bad = __syncthreads_or(any_bad);
  if (threadIdx.x == 0) {
    if (accumulate) {
      result->sum_squares += total;
      result->non_finite = result->non_finite || any_bad != 0;
    } else {
      result->sum_squares = total;
      result->non_finite = any_bad != 0;
    }
    *blocks_done = 0;  // ready for the next launch on the stream
  }
}

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
    switch (threads_) {
      case 128:
        launch<128>(grid, grad, n, head, vectors, stream, accumulate);
        break;
      case 256:
        launch<256>(grid, grad, n, head, vectors, stream, accumulate);
        break;
      case 512:
        launch<512>(grid, grad, n, head, vectors, stream, accumulate);
        break;
      default:
        launch<1024>(grid, grad, n, head, vectors, stream, accumulate);
        break;
    }
    cuda::check_launch("zero::kernels::CudaGradStats<", dtype_traits<Grad>::name, "> (", n, " elements, ", grid,
                       " blocks of ", threads_, " threads)");
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
  template <int Threads, class Grad>
  void launch(int grid, const Grad* grad, std::size_t n, std::size_t head, std::size_t vectors, cudaStream_t stream,
              bool accumulate) {
    detail::grad_stats_kernel<Threads, Grad><<<grid, Threads, 0, stream>>>(
        grad, n, head, vectors, partial_sum_, partial_flag_, blocks_done_, device_result_, accumulate);
  }

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
