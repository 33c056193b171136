// Why: besides the fused step, the engine needs two small device passes:
// converting between storage types and accumulating a gradient shard across
// micro-batches. Each must give the same bits as its host twin
// (Ops<Host>::convert and ::accumulate): every element is converted with the
// same round-to-nearest-even functions (zero/precision/convert.hpp), summed
// in fp32 and rounded once. (The reduction of in-process device ranks is the
// communicators' own: zero/comm/reduce.cuh, beside its host twin.) They are
// memory-bound one-liners: grid-stride loops with 64-bit indices, one element
// per thread and iteration, on the launch shape of zero/kernels/cuda_launch.hpp.
#pragma once

#if !defined(__CUDACC__)
#error "zero/kernels/cuda_elementwise.cuh holds CUDA kernels: include it from a .cu file compiled by nvcc"
#endif

#include "zero/compiler.hpp"

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "zero/cuda/check.hpp"
#include "zero/cuda/exact_math.cuh"
#include "zero/error.hpp"
#include "zero/kernels/cuda_launch.hpp"
#include "zero/kernels/cuda_launchers.hpp"
#include "zero/precision/convert.hpp"
#include "zero/precision/types.hpp"

namespace zero::kernels {

namespace detail {

template <class To, class From>
__global__ void convert_kernel(To* dst, const From* src, std::size_t n) {
  cuda::require_exact_float_flags();
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = from_float<To>(to_float(src[i]));
}

// dst = round_T(float(dst) + float(src)): one fp32 add, one rounding.
template <class T, class S>
__global__ void accumulate_kernel(T* dst, const S* src, std::size_t n) {
  cuda::require_exact_float_flags();
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = from_float<T>(__fadd_rn(to_float(dst[i]), to_float(src[i])));
}

}  // namespace detail

// The launchers of cuda_launchers.hpp (documented there).
template <class To, class From>
void cuda_convert(To* dst, const From* src, std::size_t n, cudaStream_t stream) {
  static_assert(StorageType<To> && StorageType<From>, "cuda_convert: float, bf16 or fp16");
  if (n == 0) return;
  if constexpr (std::is_same_v<To, float> && std::is_same_v<From, float>) {
    if (dst != src) ZERO_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDefault, stream));
    return;
  } else {
    const auto kernel = detail::convert_kernel<To, From>;
    const detail::GridShape grid = detail::grid_for(kernel, CudaLaunch{}, n, "cuda_convert");
    kernel<<<grid.blocks, grid.threads, 0, stream>>>(dst, src, n);
    cuda::check_launch("zero::kernels::cuda_convert<", dtype_traits<To>::name, ", ", dtype_traits<From>::name, "> (",
                       n, " elements)");
  }
}

template <class T, class S>
void cuda_accumulate(T* dst, const S* src, std::size_t n, cudaStream_t stream) {
  static_assert(StorageType<T> && StorageType<S>, "cuda_accumulate: float, bf16 or fp16");
  if (n == 0) return;
  const auto kernel = detail::accumulate_kernel<T, S>;
  const detail::GridShape grid = detail::grid_for(kernel, CudaLaunch{}, n, "cuda_accumulate");
  kernel<<<grid.blocks, grid.threads, 0, stream>>>(dst, src, n);
  cuda::check_launch("zero::kernels::cuda_accumulate<", dtype_traits<T>::name, ", ", dtype_traits<S>::name, "> (", n,
                     " elements)");
}

}  // namespace zero::kernels
