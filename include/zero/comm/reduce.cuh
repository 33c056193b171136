// Why: the communicators' kernels. In-process ranks sharing one GPU
// (comm::LocalDevice) reduce their buffers with a kernel, and the result
// must be the bits of the host communicator's reduction (zero/comm/reduce.hpp), whatever the thread
// timing: the same rank order, fp32 accumulation for 16-bit types, one
// rounding. It lives beside that host twin, in the communicators' layer,
// since it is their reduction; its kernel is a grid-stride loop on the launch
// shape of zero/kernels/cuda_launch.hpp. Also comm::Nccl's check that every
// rank made the same call, which runs on the device so that the host never
// waits for it.
#pragma once

#if !defined(__CUDACC__)
#error "zero/comm/reduce.cuh holds a CUDA kernel: include it from a .cu file compiled by nvcc"
#endif

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

namespace zero::comm::detail {

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

// The launcher of cuda_launchers.hpp; comm::LocalDevice calls it (through cuda_reduce).
template <class T>
void launch_reduce(void* out, const ReduceInputs& in, int inputs, std::size_t n, bool sum, cudaStream_t stream) {
  const auto kernel = reduce_kernel<T>;
  const kernels::detail::GridShape grid = kernels::detail::grid_for(kernel, kernels::CudaLaunch{}, n, "cuda_reduce");
  kernel<<<grid.blocks, grid.threads, 0, stream>>>(static_cast<T*>(out), in, inputs, n, sum);
}


// comm::Nccl's call check: nothing when every rank made this rank's call;
// else the mismatch is reported to the host and the exchange's output
// poisoned (see launch_check_call in cuda_launchers.hpp).
template <class Word>
__global__ void check_call_kernel(const Word* reduced, Word code, unsigned char* out, std::size_t bytes, Word call,
                                  Word* mismatch) {
  if (reduced[0] == code && reduced[1] == ~code) return;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    volatile Word* flag = mismatch;
    if (*flag == 0) *flag = call;  // the first mismatch is the one to report (kernels of one stream run in order)
    __threadfence_system();
  }
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < bytes; i += stride)
    out[i] = 0xFF;
}

template <class Word>
void launch_check_call(const Word* reduced, Word code, void* out, std::size_t bytes, Word call, Word* mismatch,
                       cudaStream_t stream) {
  const auto kernel = check_call_kernel<Word>;
  const kernels::detail::GridShape grid =
      kernels::detail::grid_for(kernel, kernels::CudaLaunch{}, bytes > 0 ? bytes : 1, "comm::Nccl call check");
  kernel<<<grid.blocks, grid.threads, 0, stream>>>(reduced, code, static_cast<unsigned char*>(out), bytes, call,
                                                   mismatch);
}

}  // namespace zero::comm::detail
