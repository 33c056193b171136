// Why: besides the fused step, the engine needs three small device passes:
// converting between storage types, accumulating a gradient shard across
// micro-batches, and (for in-process ranks sharing one GPU) summing the ranks'
// buffers. Each must give the same bits as its host twin (Ops<Host>::convert
// and ::accumulate, zero::comm::detail::reduce): every element is converted
// with the same round-to-nearest-even functions (zero/precision/convert.hpp),
// summed in fp32 for 16-bit types in a fixed order, and rounded once. They are
// memory-bound one-liners: grid-stride loops with 64-bit indices, one element
// per thread and iteration, on the launch shape of zero/kernels/cuda_launch.cuh.
#pragma once

#if !defined(__CUDACC__)
#error "zero/kernels/cuda_elementwise.cuh holds CUDA kernels: include it from a .cu file compiled by nvcc"
#endif

#include "zero/config.hpp"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "zero/comm/communicator.hpp"
#include "zero/cuda/check.cuh"
#include "zero/error.hpp"
#include "zero/kernels/cuda_launch.cuh"
#include "zero/precision/convert.hpp"
#include "zero/precision/types.hpp"

namespace zero::kernels {

// Most inputs one cuda_reduce call sums (they travel as kernel parameters).
inline constexpr int cuda_reduce_max_inputs = 64;

namespace detail {

template <class To, class From>
__global__ void convert_kernel(To* dst, const From* src, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = from_float<To>(to_float(src[i]));
}

// dst = round_T(float(dst) + float(src)): one fp32 add, one rounding.
template <class T, class S>
__global__ void accumulate_kernel(T* dst, const S* src, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = from_float<T>(__fadd_rn(to_float(dst[i]), to_float(src[i])));
}

struct ReduceInputs {
  const void* at[cuda_reduce_max_inputs];
};

template <class T>
using ReduceAcc = std::conditional_t<is_low_precision_v<T>, float, T>;

template <class T>
__device__ __forceinline__ ReduceAcc<T> reduce_load(const void* p, std::size_t i) {
  if constexpr (is_low_precision_v<T>)
    return to_float(static_cast<const T*>(p)[i]);
  else
    return static_cast<const T*>(p)[i];
}

// As zero::comm::detail::combine: a + b, or the larger (the second on ties and NaN).
template <class A>
__device__ __forceinline__ A reduce_combine(A a, A b, bool sum) {
  if (sum) {
    if constexpr (std::is_same_v<A, float>)
      return __fadd_rn(a, b);
    else if constexpr (std::is_same_v<A, double>)
      return __dadd_rn(a, b);
    else
      return a + b;
  }
  return a > b ? a : b;
}

// out[i] = in[0][i] op in[1][i] op ... in rank order, accumulated in fp32 for
// 16-bit types and rounded once. Each element is read from every input before
// it is written, so out may alias any input.
template <class T>
__global__ void reduce_kernel(T* out, const ReduceInputs in, int inputs, std::size_t n, bool sum) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    ReduceAcc<T> acc = reduce_load<T>(in.at[0], i);
    for (int k = 1; k < inputs; ++k) acc = reduce_combine(acc, reduce_load<T>(in.at[k], i), sum);
    if constexpr (is_low_precision_v<T>)
      out[i] = from_float<T>(acc);
    else
      out[i] = acc;
  }
}

template <class T>
void launch_reduce(void* out, const ReduceInputs& in, int inputs, std::size_t n, bool sum, cudaStream_t stream) {
  const auto kernel = reduce_kernel<T>;
  const GridShape grid = grid_for(kernel, CudaLaunch{}, n, "cuda_reduce");
  kernel<<<grid.blocks, grid.threads, 0, stream>>>(static_cast<T*>(out), in, inputs, n, sum);
}

}  // namespace detail

// dst[i] = To(src[i]) for i < n (round to nearest even), enqueued on `stream`.
template <StorageType To, StorageType From>
void cuda_convert(To* dst, const From* src, std::size_t n, cudaStream_t stream) {
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

// dst[i] = T(float(dst[i]) + float(src[i])) for i < n, enqueued on `stream`.
template <StorageType T, StorageType S>
void cuda_accumulate(T* dst, const S* src, std::size_t n, cudaStream_t stream) {
  if (n == 0) return;
  const auto kernel = detail::accumulate_kernel<T, S>;
  const detail::GridShape grid = detail::grid_for(kernel, CudaLaunch{}, n, "cuda_accumulate");
  kernel<<<grid.blocks, grid.threads, 0, stream>>>(dst, src, n);
  cuda::check_launch("zero::kernels::cuda_accumulate<", dtype_traits<T>::name, ", ", dtype_traits<S>::name, "> (", n,
                     " elements)");
}

// out[i] = inputs[0][i] op ... op inputs[k-1][i] for i < n, in that order
// (the bits of zero::comm::detail::reduce), enqueued on `stream`. `out` may
// alias an input. All pointers must be device-accessible from the current
// device; at most cuda_reduce_max_inputs inputs.
inline void cuda_reduce(DType t, void* out, const void* const* inputs, int k, std::size_t n, comm::ReduceOp op,
                        cudaStream_t stream) {
  require(k >= 1 && k <= cuda_reduce_max_inputs, "cuda_reduce: ", k, " inputs; it sums 1 to ",
          cuda_reduce_max_inputs, " buffers per call");
  if (n == 0) return;
  detail::ReduceInputs in{};
  for (int i = 0; i < k; ++i) in.at[i] = inputs[i];
  const bool sum = op == comm::ReduceOp::sum;
  switch (t) {
    case DType::f32: detail::launch_reduce<float>(out, in, k, n, sum, stream); break;
    case DType::f16: detail::launch_reduce<fp16>(out, in, k, n, sum, stream); break;
    case DType::bf16: detail::launch_reduce<bf16>(out, in, k, n, sum, stream); break;
    case DType::f64: detail::launch_reduce<double>(out, in, k, n, sum, stream); break;
    case DType::u64: detail::launch_reduce<std::uint64_t>(out, in, k, n, sum, stream); break;
  }
  cuda::check_launch("zero::kernels::cuda_reduce<", dtype_name(t), "> (", k, " inputs, ", n, " elements)");
}

}  // namespace zero::kernels
