// Why: on the GPU the optimizer step is one pass over the owned shard, bound
// by memory bandwidth, so the kernel's job is to move bytes: 16-byte loads and
// stores on every array, a grid-stride loop sized to the device, 64-bit
// indices (a shard can exceed 2^31 elements). The arithmetic is NOT written
// here: every element goes through fused_step_element (zero/kernels/
// fused_step.hpp), the same body as the host kernel, so the GPU and the CPU
// produce bit-identical master weights, states and copies (as ZeRO-Offload
// needs: its host step must match; device code built with -ftz=true is
// refused for that, zero/cuda/exact_math.cuh). With 8-bit states each state
// block is one thread block (fused_block_step_kernel): the block's values go
// through blockwise_update_element, the host's per-block body, with the
// block's absmax reduced in shared memory.
// The gradient statistics (squared norm, inf/NaN) are a second, read-only
// pass that the step needs before it can run; it is one launch too (its
// workspace and host side: cuda_grad_stats.hpp). The launchers defined here
// are declared in cuda_launchers.hpp, for host-compiled callers.
#pragma once

#if !defined(__CUDACC__)
#error "zero/kernels/cuda_step.cuh holds CUDA kernels: include it from a .cu file compiled by nvcc"
#endif

#include "zero/compiler.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <cub/block/block_reduce.cuh>
#include <type_traits>

#include "zero/cuda/check.hpp"
#include "zero/cuda/exact_math.cuh"
#include "zero/error.hpp"
#include "zero/kernels/cuda_grad_stats.hpp"
#include "zero/kernels/cuda_launch.hpp"
#include "zero/kernels/cuda_launchers.hpp"
#include "zero/kernels/fused_step.hpp"
#include "zero/optim/policy.hpp"
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
  constexpr bool can_split = FusedStepArgs<Opt, Grad, Param>::can_split_master;
  float w[V];
  Grad g[V];
  float st[S > 0 ? S : 1][V];
  Param p[V];
  std::uint16_t rem[can_split ? V : 1];
  // A remainder master (bf16 only): the copy and the remainder are read in
  // place of the fp32 master, and written back in its place.
  bool split = false;
  if constexpr (can_split) {
    split = a.remainder != nullptr;
    if (split) {
      load_vector<V>(a.param + i, p);
      load_vector<V>(a.remainder + i, rem);
    }
  }
  if (!split) load_vector<V>(a.master + i, w);
  load_vector<V>(a.grad + i, g);
  // bf16 state (Options::states): read and written an element at a time
  // (its vectors need not be whole 16-byte accesses), converted by the
  // per-element body.
  const bool s16 = a.states_in_bf16();
  bf16 st16[S > 0 ? S : 1][V];
#pragma unroll
  for (int k = 0; k < S; ++k) {
    if (s16) {
#pragma unroll
      for (int l = 0; l < V; ++l) st16[k][l] = a.state16[k][i + l];
    } else {
      load_vector<V>(a.state[k] + i, st[k]);
    }
  }

  FusedStepArgs<Opt, Grad, Param> r = a;
  r.master = split ? nullptr : w;
  if constexpr (can_split) r.remainder = split ? rem : nullptr;
  r.grad = g;
#pragma unroll
  for (int k = 0; k < S; ++k) {
    r.state[k] = st[k];
    r.state16[k] = s16 ? st16[k] : nullptr;
  }
  r.param = p;
  r.n = V;
  r.global_offset = a.global_offset + i;
#pragma unroll
  for (int l = 0; l < V; ++l) fused_step_element(r, static_cast<std::size_t>(l));

  if (!split) store_vector<V>(a.master + i, w);
#pragma unroll
  for (int k = 0; k < S; ++k) {
    if (s16) {
#pragma unroll
      for (int l = 0; l < V; ++l) a.state16[k][i + l] = st16[k][l];
    } else {
      store_vector<V>(a.state[k] + i, st[k]);
    }
  }
  if constexpr (!std::is_same_v<Param, float>) store_vector<V>(a.param + i, p);
  if constexpr (can_split)
    if (split) store_vector<V>(a.remainder + i, rem);
}

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

// The 8-bit state step (FusedStepArgs::state8): one thread block per state
// block at a time (grid-stride over them). Its threads update the block's
// elements into shared memory (blockwise_update_element, the host's body),
// reduce each slot's new absmax, and quantize with quant::quantize(), as
// quant::quantize_block does on the host, so codes and absmax match it bit
// for bit.
template <int Threads, class Opt, class Grad, class Param>
__global__ void __launch_bounds__(Threads) fused_block_step_kernel(const FusedStepArgs<Opt, Grad, Param> a) {
  cuda::require_exact_float_flags();
  constexpr int S = Opt::state_slots;
  extern __shared__ float scratch[];  // S x a.block
  using Reduce = cub::BlockReduce<float, Threads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ float shared_absmax;
  const std::size_t blocks = a.block_count();
  for (std::size_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const std::size_t begin = a.block_begin(b), n = a.block_end(b) - begin;
    for (std::size_t i = begin + threadIdx.x; i < begin + n; i += Threads) blockwise_update_element(a, b, i, scratch);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < S; ++k) {
      const float* x = scratch + static_cast<std::size_t>(k) * a.block;
      float most = 0.0f;
      bool bad = false;
      for (std::size_t j = threadIdx.x; j < n; j += Threads) {
        const float v = zero::math::abs(x[j]);
        bad = bad || !(v <= 3.40282347e+38f);
        most = v > most ? v : most;
      }
      const float reduced = Reduce(temp).Reduce(most, [](float l, float r) { return l > r ? l : r; });
      const int any_bad = __syncthreads_or(bad ? 1 : 0);
      if (threadIdx.x == 0) shared_absmax = any_bad ? __uint_as_float(0x7fc00000u) : reduced;
      __syncthreads();
      const float absmax = shared_absmax;
      const bool zeros = any_bad || absmax == 0.0f;  // every code the table's 0.0 (quant::quantize_block)
      const std::uint8_t zero_code = quant::quantize(0.0f, a.code[k]);
      std::uint8_t* q = a.state8[k] + begin;
      for (std::size_t j = threadIdx.x; j < n; j += Threads)
        q[j] = zeros ? zero_code : quant::quantize(zero::math::div(x[j], absmax), a.code[k]);
      if (threadIdx.x == 0) a.absmax[k][b] = absmax;
      __syncthreads();  // temp and shared_absmax are reused by the next slot
    }
  }
}

struct VectorSplit {
  std::size_t head = 0;     // elements before the first aligned vector
  std::size_t vectors = 0;  // whole vectors of V elements after them
};

// The smallest head h < V after which every array is 16-byte aligned; no
// vectors at all when none exists (arrays offset by different amounts).
template <int V, class Opt, class Grad, class Param>
VectorSplit split_vectors(const FusedStepArgs<Opt, Grad, Param>& a) {
  for (std::size_t h = 0; h < static_cast<std::size_t>(V) && h < a.n; ++h) {
    bool ok = (a.master == nullptr || can_align(a.master, h)) && can_align(a.grad, h);
    if constexpr (FusedStepArgs<Opt, Grad, Param>::can_split_master)
      ok = ok && (a.remainder == nullptr || can_align(a.remainder, h));
    for (int k = 0; k < Opt::state_slots; ++k) ok = ok && (a.states_in_bf16() || can_align(a.state[k], h));
    if constexpr (!std::is_same_v<Param, float>) ok = ok && can_align(a.param, h);
    if (ok) return VectorSplit{h, (a.n - h) / static_cast<std::size_t>(V)};
  }
  return VectorSplit{};
}

template <class Opt, class Grad, class Param>
void require_step_pointers(const FusedStepArgs<Opt, Grad, Param>& a) {
  bool split = false;
  if constexpr (FusedStepArgs<Opt, Grad, Param>::can_split_master) split = a.remainder != nullptr;
  require(split || a.master != nullptr,
          "cuda_fused_step: FusedStepArgs::master is null; pass the fp32 master shard (or, with bf16 parameters, "
          "the remainder of a master kept as the parameters plus a remainder)");
  require(!split || !a.rounding.enabled,
          "cuda_fused_step: a remainder master's copy is rounded half away from zero; stochastic rounding does not "
          "apply (turn one off)");
  require(a.grad != nullptr, "cuda_fused_step: FusedStepArgs::grad is null; pass the gradient shard");
  for (int k = 0; k < Opt::state_slots; ++k)
    require(a.state[k] != nullptr || a.state16[k] != nullptr || a.state8[k] != nullptr,
            "cuda_fused_step: FusedStepArgs::state[", k, "] is null; ", Opt::name, " keeps ", Opt::state_slots,
            " fp32 state array(s) of n elements");
  if (a.states_blockwise()) {
    require(a.block >= 1 && a.block <= 4096 && a.block_phase < a.block, "cuda_fused_step: 8-bit states in blocks of ",
            a.block, " elements with phase ", a.block_phase, "; blocks are 1 to 4096 elements, the phase below that");
    for (int k = 0; k < Opt::state_slots; ++k)
      require(a.state8[k] != nullptr && a.absmax[k] != nullptr && a.code[k] != nullptr,
              "cuda_fused_step: 8-bit state slot ", k, " needs its codes, absmax and code table (all slots or none)");
  }
  if constexpr (!std::is_same_v<Param, float>)
    require(a.param != nullptr, "cuda_fused_step: FusedStepArgs::param is null; a ", dtype_traits<Param>::name,
            " step writes the low-precision copy there");
}

}  // namespace detail

// The launchers of cuda_launchers.hpp (documented there).
template <class Opt, class Grad, class Param>
void cuda_fused_step(const FusedStepArgs<Opt, Grad, Param>& args, cudaStream_t stream, const CudaLaunch& launch) {
  static_assert(optim::Policy<Opt>, "cuda_fused_step: Opt is an optimizer policy (zero/optim/policy.hpp)");
  static_assert(StorageType<Grad> && StorageType<Param>, "cuda_fused_step: Grad and Param are float, bf16 or fp16");
  if (args.n == 0) return;
  detail::require_step_pointers(args);
  if (args.states_blockwise()) {
    constexpr int threads = 256;
    const auto kernel = detail::fused_block_step_kernel<threads, Opt, Grad, Param>;
    const std::size_t shared = static_cast<std::size_t>(Opt::state_slots > 0 ? Opt::state_slots : 1) * args.block *
                               sizeof(float);
    if (shared > (std::size_t{48} << 10))
      ZERO_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
    const std::size_t count = args.block_count();
    const unsigned grid = static_cast<unsigned>(count < (std::size_t{1} << 20) ? count : (std::size_t{1} << 20));
    kernel<<<grid, threads, shared, stream>>>(args);
    cuda::check_launch("zero::kernels::cuda_fused_step<", Opt::name, ", ", dtype_traits<Grad>::name, ", ",
                       dtype_traits<Param>::name, "> (8-bit states: ", count, " blocks of ", args.block, ")");
    return;
  }
  constexpr int V = detail::cuda_vector_width<Grad, Param>();
  const auto kernel = detail::fused_step_kernel<V, Opt, Grad, Param>;
  const detail::VectorSplit split = detail::split_vectors<V>(args);
  const std::size_t singles = args.n - split.vectors * static_cast<std::size_t>(V);
  const detail::GridShape grid =
      detail::grid_for(kernel, launch, split.vectors > singles ? split.vectors : singles, "cuda_fused_step");
  kernel<<<grid.blocks, grid.threads, 0, stream>>>(args, split.head, split.vectors);
  cuda::check_launch("zero::kernels::cuda_fused_step<", Opt::name, ", ", dtype_traits<Grad>::name, ", ",
                     dtype_traits<Param>::name, "> (", args.n, " elements, ", grid.blocks, " blocks of ", grid.threads,
                     " threads)");
}

namespace detail {

__device__ __forceinline__ bool is_non_finite(float x) { return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u; }

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

template <class Grad>
void launch_grad_stats(int threads, int grid, const Grad* g, std::size_t n, std::size_t head, std::size_t vectors,
                       const GradStatsWorkspace& w, bool accumulate, cudaStream_t stream) {
  static_assert(StorageType<Grad>, "launch_grad_stats: the gradient is float, bf16 or fp16");
  switch (threads) {
    case 128:
      grad_stats_kernel<128, Grad><<<grid, 128, 0, stream>>>(g, n, head, vectors, w.partial_sum, w.partial_flag,
                                                             w.blocks_done, w.result, accumulate);
      break;
    case 256:
      grad_stats_kernel<256, Grad><<<grid, 256, 0, stream>>>(g, n, head, vectors, w.partial_sum, w.partial_flag,
                                                             w.blocks_done, w.result, accumulate);
      break;
    case 512:
      grad_stats_kernel<512, Grad><<<grid, 512, 0, stream>>>(g, n, head, vectors, w.partial_sum, w.partial_flag,
                                                             w.blocks_done, w.result, accumulate);
      break;
    default:
      grad_stats_kernel<1024, Grad><<<grid, 1024, 0, stream>>>(g, n, head, vectors, w.partial_sum, w.partial_flag,
                                                               w.blocks_done, w.result, accumulate);
      break;
  }
  cuda::check_launch("zero::kernels::CudaGradStats<", dtype_traits<Grad>::name, "> (", n, " elements, ", grid,
                     " blocks of ", threads, " threads)");
}

}  // namespace detail
}  // namespace zero::kernels
