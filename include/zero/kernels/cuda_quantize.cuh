// Why: ZeRO++ quantizes on the device that holds the values: qwZ a stage-3
// shard before the all-gather and every rank's payload after it, qgZ the
// gradient pieces before each all-to-all and their sums after. The
// per-element code is quant/symmetric.hpp's, shared with the host loops of
// kernels/host_quantize.hpp, so a GPU and the host produce the same payload bytes and the same
// values from it. Quantize: one thread block per quantization block of a
// piece (its largest magnitude is a block-wide reduction, then each thread
// codes its elements, int4 two at a time); dequantize and the sum: a
// grid-stride loop, one element per thread and iteration, the sum adding
// the payloads in their order as the host does.
#pragma once

#if !defined(__CUDACC__)
#error "zero/kernels/cuda_quantize.cuh holds CUDA kernels: include it from a .cu file compiled by nvcc"
#endif

#include "zero/compiler.hpp"

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
    quantize_kernel(const T* x, float* residual, quant::Pieces pieces, quant::Format f, std::uint8_t* payload) {
  cuda::require_exact_float_flags();
  __shared__ std::int32_t partial[quantize_threads];
  const std::size_t n = pieces.elements, per_piece = f.blocks(n);
  const int levels = f.levels();
  for (std::size_t g = blockIdx.x; g < pieces.count * per_piece; g += gridDim.x) {
    const std::size_t k = g / per_piece, b = g % per_piece;
    const T* xk = x + k * pieces.stride;
    float* rk = residual != nullptr ? residual + k * pieces.stride : nullptr;
    const quant::PayloadView p = quant::PayloadView::at(payload + k * pieces.payload_stride, n, f);
    const std::size_t begin = b * f.block, end = f.block_end(b, n);
    std::int32_t largest = 0;
    for (std::size_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const std::int32_t m = quant::magnitude_bits(quant::fed(xk, rk, i));
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
    const float inverse = quant::symmetric_inverse(absmax, levels);
    const float scale = quant::symmetric_scale(absmax, levels);
    if (f.bits == 8) {
      for (std::size_t i = begin + threadIdx.x; i < end; i += blockDim.x)
        quant::quantize_int8_at(xk, rk, i, inverse, scale, p.codes);
    } else {  // begin is even: one thread per byte of two codes
      for (std::size_t i = begin + 2 * threadIdx.x; i < end; i += 2 * blockDim.x)
        quant::quantize_int4_at(xk, rk, i, end, inverse, scale, p.codes);
    }
    if (threadIdx.x == 0) p.scales[b] = scale;
    __syncthreads();  // partial[] is reused by the next block
  }
}

template <class T>
__global__ void dequantize_kernel(const std::uint8_t* payload, quant::Pieces pieces, quant::Format f, T* out) {
  cuda::require_exact_float_flags();
  const std::size_t n = pieces.elements, total = pieces.count * n;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t j = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < total; j += stride) {
    const std::size_t k = j / n, i = j % n;
    const quant::ConstPayloadView p = quant::ConstPayloadView::at(payload + k * pieces.payload_stride, n, f);
    out[k * pieces.stride + i] = from_float<T>(quant::symmetric_value(quant::code_at(p.codes, i, f.bits),
                                                                      p.scales[i / f.block]));
  }
}

template <class Out>
__global__ void dequantize_sum_kernel(const std::uint8_t* payloads, std::size_t count,
                                      std::size_t payload_stride, std::size_t n, quant::Format f, Out* out) {
  cuda::require_exact_float_flags();
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float sum = 0.0f;
    for (std::size_t k = 0; k < count; ++k) {
      const quant::ConstPayloadView p = quant::ConstPayloadView::at(payloads + k * payload_stride, n, f);
      const float v = quant::symmetric_value(quant::code_at(p.codes, i, f.bits), p.scales[i / f.block]);
      sum = k == 0 ? v : __fadd_rn(sum, v);
    }
    out[i] = sum;
  }
}

inline void check_format(const quant::Format& f, const char* who) {
  const char* problem = f.problem();
  require(problem == nullptr, who, ": ", problem != nullptr ? problem : "");
}

}  // namespace detail

// The launchers of cuda_launchers.hpp (documented there).
template <class T>
void cuda_quantize(const T* x, float* residual, const quant::Pieces& pieces, const quant::Format& format,
                   void* payload, cudaStream_t stream) {
  static_assert(StorageType<T>, "cuda_quantize: float, bf16 or fp16");
  detail::check_format(format, "cuda_quantize");
  const std::size_t blocks = pieces.count * format.blocks(pieces.elements);
  if (blocks == 0) return;
  const unsigned grid = static_cast<unsigned>(blocks < 65535 ? blocks : 65535);
  detail::quantize_kernel<T><<<grid, detail::quantize_threads, 0, stream>>>(
      x, residual, pieces, format, static_cast<std::uint8_t*>(payload));
  cuda::check_launch("zero::kernels::cuda_quantize<", dtype_traits<T>::name, "> (", pieces.count, " pieces of ",
                     pieces.elements, " elements, int", format.bits, " blocks of ", format.block, ")");
}

template <class T>
void cuda_dequantize(const void* payload, const quant::Pieces& pieces, const quant::Format& format, T* out,
                     cudaStream_t stream) {
  static_assert(StorageType<T>, "cuda_dequantize: float, bf16 or fp16");
  detail::check_format(format, "cuda_dequantize");
  const std::size_t total = pieces.count * pieces.elements;
  if (total == 0) return;
  const auto kernel = detail::dequantize_kernel<T>;
  const detail::GridShape grid = detail::grid_for(kernel, CudaLaunch{}, total, "cuda_dequantize");
  kernel<<<grid.blocks, grid.threads, 0, stream>>>(static_cast<const std::uint8_t*>(payload), pieces, format, out);
  cuda::check_launch("zero::kernels::cuda_dequantize<", dtype_traits<T>::name, "> (", pieces.count, " pieces of ",
                     pieces.elements, " elements)");
}

template <class Out>
void cuda_dequantize_sum(const void* payloads, std::size_t count, std::size_t payload_stride, std::size_t n,
                         const quant::Format& format, Out* out, cudaStream_t stream) {
  static_assert(std::is_same_v<Out, float>, "cuda_dequantize_sum: the sum is fp32");
  detail::check_format(format, "cuda_dequantize_sum");
  if (n == 0 || count == 0) return;
  const auto kernel = detail::dequantize_sum_kernel<Out>;
  const detail::GridShape grid = detail::grid_for(kernel, CudaLaunch{}, n, "cuda_dequantize_sum");
  kernel<<<grid.blocks, grid.threads, 0, stream>>>(static_cast<const std::uint8_t*>(payloads), count, payload_stride,
                                                   n, format, out);
  cuda::check_launch("zero::kernels::cuda_dequantize_sum (", count, " payloads of ", n, " elements)");
}

}  // namespace zero::kernels
