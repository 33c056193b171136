// Why: in-process ranks sharing one GPU (comm::LocalDevice) reduce their
// buffers with a kernel, and the result must be the bits of the host
// communicator's reduction (zero/comm/reduce.hpp), whatever the thread
// timing: the same rank order, fp32 accumulation for 16-bit types, one
// rounding. It lives beside that host twin, in the communicators' layer,
// since it is their reduction; its kernel is a grid-stride loop on the launch
// shape of zero/kernels/cuda_launch.cuh.
#pragma once

#if !defined(__CUDACC__)
#error "zero/comm/reduce.cuh holds a CUDA kernel: include it from a .cu file compiled by nvcc"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "zero/cuda/check.cuh"
#include "zero/cuda/exact_math.cuh"
#include "zero/error.hpp"
#include "zero/kernels/cuda_launch.cuh"
#include "zero/precision/convert.hpp"
#include "zero/precision/types.hpp"

namespace zero::comm::detail {

// Most inputs one cuda_reduce call sums (they travel as kernel parameters).
inline constexpr int cuda_reduce_max_inputs = 64;

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

// As combine() in zero/comm/reduce.hpp: a + b, or the larger (the second on ties and NaN).
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
  cuda::require_exact_float_flags();
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
  const kernels::detail::GridShape grid = kernels::detail::grid_for(kernel, kernels::CudaLaunch{}, n, "cuda_reduce");
  kernel<<<grid.blocks, grid.threads, 0, stream>>>(static_cast<T*>(out), in, inputs, n, sum);
}

// out[i] = inputs[0][i] op ... op inputs[k-1][i] for i < n, in that order
// (the bits of reduce() in zero/comm/reduce.hpp), enqueued on `stream`. `out` may
// alias an input. All pointers must be device-accessible from the current
// device; at most cuda_reduce_max_inputs inputs.
inline void cuda_reduce(DType t, void* out, const void* const* inputs, int k, std::size_t n, ReduceOp op,
                        cudaStream_t stream) {
  require(k >= 1 && k <= cuda_reduce_max_inputs, "cuda_reduce: ", k, " inputs; it sums 1 to ",
          cuda_reduce_max_inputs, " buffers per call");
  if (n == 0) return;
  ReduceInputs in{};
  for (int i = 0; i < k; ++i) in.at[i] = inputs[i];
  const bool sum = op == ReduceOp::sum;
  switch (t) {
    case DType::f32: launch_reduce<float>(out, in, k, n, sum, stream); break;
    case DType::f16: launch_reduce<fp16>(out, in, k, n, sum, stream); break;
    case DType::bf16: launch_reduce<bf16>(out, in, k, n, sum, stream); break;
    case DType::f64: launch_reduce<double>(out, in, k, n, sum, stream); break;
    case DType::u64: launch_reduce<std::uint64_t>(out, in, k, n, sum, stream); break;
  }
  cuda::check_launch("zero::comm::detail::cuda_reduce<", dtype_name(t), "> (", k, " inputs, ", n, " elements)");
}

}  // namespace zero::comm::detail
