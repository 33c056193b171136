// Why: ZeRO++'s qwZ quantizes a stage-3 shard before the all-gather and
// dequantizes every rank's payload after it, on the device that holds the
// parameters. The per-element code is quant/symmetric.hpp's, shared with the
// host loops there, so a GPU and the host produce the same payload bytes and
// the same parameters from it. Quantize: one thread block per quantization
// block (its largest magnitude is a block-wide reduction, then each thread
// codes its elements); dequantize: a grid-stride loop, one element per
// thread and iteration.
#pragma once

#if !defined(__CUDACC__)
#error "zero/kernels/cuda_quantize.cuh holds CUDA kernels: include it from a .cu file compiled by nvcc"
#endif

#include "zero/config.hpp"

#include <cstddef>
#include <cstdint>

#include "zero/cuda/check.hpp"
#include "zero/cuda/exact_math.cuh"
#include "zero/error.hpp"
#include "zero/kernels/cuda_launch.hpp"
#include "zero/kernels/cuda_launchers.hpp"
#include "zero/precision/convert.hpp"
#include "zero/quant/symmetric.hpp"

namespace zero::kernels {

namespace detail {

inline constexpr int quantize_threads = 256;

template <class T>
__global__ void __launch_bounds__(quantize_threads)
    quantize_int8_kernel(const T* x, std::size_t n, std::size_t block, std::int8_t* codes, float* scales) {
  cuda::require_exact_float_flags();
  __shared__ std::int32_t partial[quantize_threads];
  const std::size_t blocks = quant::symmetric_blocks(n, block);
  for (std::size_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const std::size_t begin = b * block, end = begin + block < n ? begin + block : n;
    std::int32_t largest = 0;
    for (std::size_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const std::int32_t m = quant::magnitude_bits(to_float(x[i]));
      largest = m > largest ? m : largest;
    }
    partial[threadIdx.x] = largest;
    __syncthreads();
    for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
      if (threadIdx.x < half && partial[threadIdx.x + half] > partial[threadIdx.x])
        partial[threadIdx.x] = partial[threadIdx.x + half];
      __syncthreads();
    }
    const float absmax = quant::magnitude_of(partial[0]);
    const float inverse = quant::symmetric_inverse(absmax, quant::int8_levels);
    for (std::size_t i = begin + threadIdx.x; i < end; i += blockDim.x)
      codes[i] = quant::symmetric_code(to_float(x[i]), inverse);
    if (threadIdx.x == 0) scales[b] = quant::symmetric_scale(absmax, quant::int8_levels);
    __syncthreads();  // partial[] is reused by the next block
  }
}

template <class T>
__global__ void dequantize_int8_kernel(const std::int8_t* codes, const float* scales, std::size_t n, std::size_t block,
                                       T* out) {
  cuda::require_exact_float_flags();
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = from_float<T>(quant::symmetric_value(codes[i], scales[i / block]));
}

}  // namespace detail

// The launchers of cuda_launchers.hpp (documented there).
template <class T>
void cuda_quantize_int8(const T* x, std::size_t n, std::size_t block, void* payload, cudaStream_t stream) {
  static_assert(StorageType<T>, "cuda_quantize_int8: float, bf16 or fp16");
  require(block >= 1, "cuda_quantize_int8: the block must hold at least one element");
  if (n == 0) return;
  const quant::Int8Payload p = quant::Int8Payload::at(payload, n);
  const std::size_t blocks = quant::symmetric_blocks(n, block);
  const unsigned grid = static_cast<unsigned>(blocks < 65535 ? blocks : 65535);
  detail::quantize_int8_kernel<T><<<grid, detail::quantize_threads, 0, stream>>>(x, n, block, p.codes, p.scales);
  cuda::check_launch("zero::kernels::cuda_quantize_int8<", dtype_traits<T>::name, "> (", n, " elements, blocks of ",
                     block, ")");
}

template <class T>
void cuda_dequantize_int8(const void* payload, std::size_t n, std::size_t block, T* out, cudaStream_t stream) {
  static_assert(StorageType<T>, "cuda_dequantize_int8: float, bf16 or fp16");
  require(block >= 1, "cuda_dequantize_int8: the block must hold at least one element");
  if (n == 0) return;
  const quant::Int8Payload p = quant::Int8Payload::at(const_cast<void*>(payload), n);
  const auto kernel = detail::dequantize_int8_kernel<T>;
  const detail::GridShape grid = detail::grid_for(kernel, CudaLaunch{}, n, "cuda_dequantize_int8");
  kernel<<<grid.blocks, grid.threads, 0, stream>>>(p.codes, p.scales, n, block, out);
  cuda::check_launch("zero::kernels::cuda_dequantize_int8<", dtype_traits<T>::name, "> (", n, " elements)");
}

}  // namespace zero::kernels
