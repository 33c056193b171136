// Why: host-compiled files call the library's kernels through the launchers
// that zero/kernels/cuda_launchers.hpp declares; one .cu file compiled by
// nvcc defines them, for the types a program uses, with the lines below:
//
//   #include "zero/kernels/cuda_instantiate.cuh"
//   ZERO_INSTANTIATE_CUDA_KERNELS()               // casts, statistics, reductions, ZeRO++'s quantizer
//   ZERO_INSTANTIATE_CUDA_STEP(zero::optim::AdamW) // once per optimizer policy
//
// The step is instantiated for every gradient and parameter type pair
// (float, bf16, fp16), so one line serves every precision policy and the
// fp32 gradient buffer over 16-bit parameters. The launchers are templates,
// so the linker keeps one copy of each: compile every .cu file that
// instantiates or uses them with the same -gencode list, or a launch may
// resolve to a copy without this GPU's code ("no kernel image").
#pragma once

#if !defined(__CUDACC__)
#error "zero/kernels/cuda_instantiate.cuh instantiates CUDA kernels: compile the file that includes it with nvcc"
#endif

#include "zero/compiler.hpp"

#include <cstdint>

#include "zero/comm/reduce.cuh"
#include "zero/kernels/cuda_elementwise.cuh"
#include "zero/kernels/cuda_launchers.hpp"
#include "zero/kernels/cuda_quantize.cuh"
#include "zero/kernels/cuda_step.cuh"
#include "zero/precision/types.hpp"

#define ZERO_DETAIL_CUDA_PAIR(X, A) X(A, float) X(A, ::zero::bf16) X(A, ::zero::fp16)
#define ZERO_DETAIL_CUDA_PAIRS(X) \
  ZERO_DETAIL_CUDA_PAIR(X, float) ZERO_DETAIL_CUDA_PAIR(X, ::zero::bf16) ZERO_DETAIL_CUDA_PAIR(X, ::zero::fp16)
#define ZERO_DETAIL_CUDA_CONVERT(To, From) \
  template void ::zero::kernels::cuda_convert<To, From>(To*, const From*, std::size_t, cudaStream_t);
#define ZERO_DETAIL_CUDA_ACCUMULATE(T, S) \
  template void ::zero::kernels::cuda_accumulate<T, S>(T*, const S*, std::size_t, cudaStream_t);
#define ZERO_DETAIL_CUDA_GRAD_STATS(Grad)                           \
  template void ::zero::kernels::detail::launch_grad_stats<Grad>(   \
      int, int, const Grad*, std::size_t, std::size_t, std::size_t, \
      const ::zero::kernels::detail::GradStatsWorkspace&, bool, cudaStream_t);
#define ZERO_DETAIL_CUDA_QUANTIZE(T)                                                                          \
  template void ::zero::kernels::cuda_quantize<T>(const T*, float*, const ::zero::quant::Pieces&,                  \
                                                  const ::zero::quant::Format&, void*, cudaStream_t);            \
  template void ::zero::kernels::cuda_dequantize<T>(const void*, const ::zero::quant::Pieces&,                     \
                                                    const ::zero::quant::Format&, T*, cudaStream_t);
#define ZERO_DETAIL_CUDA_REDUCE(T)                                                                            \
  template void ::zero::comm::detail::launch_reduce<T>(void*, const ::zero::comm::detail::ReduceInputs&, int, \
                                                       std::size_t, bool, cudaStream_t);

// The casts, accumulation, gradient statistics, ZeRO++'s quantize/dequantize and LocalDevice's reduction,
// for every storage type, and comm::Nccl's call check.
#define ZERO_INSTANTIATE_CUDA_KERNELS()                                                       \
  ZERO_DETAIL_CUDA_PAIRS(ZERO_DETAIL_CUDA_CONVERT)                                            \
  ZERO_DETAIL_CUDA_PAIRS(ZERO_DETAIL_CUDA_ACCUMULATE)                                         \
  ZERO_DETAIL_CUDA_GRAD_STATS(float)                                                          \
  ZERO_DETAIL_CUDA_GRAD_STATS(::zero::bf16)                                                   \
  ZERO_DETAIL_CUDA_GRAD_STATS(::zero::fp16)                                                   \
  ZERO_DETAIL_CUDA_QUANTIZE(float)                                                            \
  ZERO_DETAIL_CUDA_QUANTIZE(::zero::bf16)                                                     \
  ZERO_DETAIL_CUDA_QUANTIZE(::zero::fp16)                                                     \
  template void ::zero::kernels::cuda_dequantize_sum<float>(const void*, std::size_t, std::size_t, std::size_t, \
                                                            const ::zero::quant::Format&, float*, cudaStream_t); \
  ZERO_DETAIL_CUDA_REDUCE(float)                                                              \
  ZERO_DETAIL_CUDA_REDUCE(double)                                                             \
  ZERO_DETAIL_CUDA_REDUCE(::zero::bf16)                                                       \
  ZERO_DETAIL_CUDA_REDUCE(::zero::fp16)                                                       \
  ZERO_DETAIL_CUDA_REDUCE(std::uint64_t)                                                      \
  template void ::zero::comm::detail::launch_check_call<std::uint64_t>(                         \
      const std::uint64_t*, std::uint64_t, void*, std::size_t, std::uint64_t, std::uint64_t*, cudaStream_t);

// The fused step of optimizer policy `Optimizer` for every gradient and parameter type.
#define ZERO_DETAIL_CUDA_STEP_PAIR(Grad, Param, Optimizer)                         \
  template void ::zero::kernels::cuda_fused_step<Optimizer, Grad, Param>(          \
      const ::zero::kernels::FusedStepArgs<Optimizer, Grad, Param>&, cudaStream_t, \
      const ::zero::kernels::CudaLaunch&);
#define ZERO_INSTANTIATE_CUDA_STEP(Optimizer)                      \
  ZERO_DETAIL_CUDA_STEP_PAIR(float, float, Optimizer)              \
  ZERO_DETAIL_CUDA_STEP_PAIR(float, ::zero::bf16, Optimizer)       \
  ZERO_DETAIL_CUDA_STEP_PAIR(float, ::zero::fp16, Optimizer)       \
  ZERO_DETAIL_CUDA_STEP_PAIR(::zero::bf16, ::zero::bf16, Optimizer) \
  ZERO_DETAIL_CUDA_STEP_PAIR(::zero::fp16, ::zero::fp16, Optimizer)
