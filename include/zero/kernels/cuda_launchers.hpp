// Why: the engine on backend::Cuda is host code around a handful of kernel
// launches. These are the launchers' declarations, so that a host compiler
// compiles the engine (nearly all of its code and compile time) while nvcc
// compiles only the kernels. The definitions are beside the kernels, in the
// .cuh headers (kernels/cuda_elementwise.cuh, kernels/cuda_step.cuh,
// kernels/cuda_quantize.cuh, comm/reduce.cuh). A program gets them in one of two ways:
//   - a .cu file that includes zero/zero_cuda.cuh sees the definitions and
//     instantiates what it uses (header-only, as any template);
//   - host-compiled files link an object that instantiates them:
//     zero/kernels/cuda_instantiate.cuh has one line per optimizer policy
//     (src/zero_kernels_cuda.cu is the build's, for the built-in policies; a
//     policy of your own needs one .cu line of yours).
// A launcher missing at link time is an undefined reference naming it and
// its types: add its instantiation line.
//
// The launchers' template parameters are plain `class` here and checked in
// their bodies: a redeclaration must repeat a constrained head exactly, and
// these cross compilers (nvcc's host compiler defines them, another may call
// them), so they stay in the form every compiler mangles alike.
#pragma once

#include "zero/cuda/runtime.hpp"

#include <cstddef>

#include "zero/kernels/cuda_launch.hpp"
#include "zero/kernels/fused_step.hpp"
#include "zero/quant/symmetric.hpp"

namespace zero::kernels {

// dst[i] = To(src[i]) for i < n (round to nearest even), enqueued on `stream`.
template <class To, class From>
void cuda_convert(To* dst, const From* src, std::size_t n, cudaStream_t stream);

// dst[i] = T(float(dst[i]) + float(src[i])) for i < n, enqueued on `stream`.
template <class T, class S>
void cuda_accumulate(T* dst, const S* src, std::size_t n, cudaStream_t stream);

// ZeRO++'s payloads (quant/symmetric.hpp), enqueued on `stream`, the bytes
// and values of the host loops: the pieces of x (plus the residual,
// replaced by the new error, where not null) quantized into their payloads;
// payloads back into the pieces of out; and out[0, n) = the fp32 sum of
// `count` payloads of n elements, payload_stride bytes apart.
template <class T>
void cuda_quantize(const T* x, float* residual, const quant::Pieces& pieces, const quant::Format& format,
                   void* payload, cudaStream_t stream);
template <class T>
void cuda_dequantize(const void* payload, const quant::Pieces& pieces, const quant::Format& format, T* out,
                     cudaStream_t stream);
// (Out is float: a template so that it is instantiated, once per program, as the others are.)
template <class Out>
void cuda_dequantize_sum(const void* payloads, std::size_t count, std::size_t payload_stride, std::size_t n,
                         const quant::Format& format, Out* out, cudaStream_t stream);

// One fused optimizer step over a device shard (see FusedStepArgs), enqueued
// on `stream`. Every pointer must be device-accessible; the arrays are used
// 16 bytes at a time when they can all be aligned by skipping the same number
// of leading elements, else element by element. Results are bit-identical to
// host_fused_step on the same inputs. Throws InvalidArgument for a null
// array or a bad launch shape, BackendError when the launch fails.
template <class Opt, class Grad, class Param>
void cuda_fused_step(const FusedStepArgs<Opt, Grad, Param>& args, cudaStream_t stream, const CudaLaunch& launch = {});

namespace detail {

// The device workspace of one gradient-statistics pass (CudaGradStats owns it).
struct GradStatsWorkspace {
  double* partial_sum = nullptr;  // one per block
  int* partial_flag = nullptr;    // one per block
  unsigned int* blocks_done = nullptr;
  GradStats* result = nullptr;
};

// The statistics kernel over g[0, n), `vectors` 16-byte vectors from element
// `head` on, `grid` blocks of `threads` (128, 256, 512 or 1024) threads.
template <class Grad>
void launch_grad_stats(int threads, int grid, const Grad* g, std::size_t n, std::size_t head, std::size_t vectors,
                       const GradStatsWorkspace& workspace, bool accumulate, cudaStream_t stream);

}  // namespace detail
}  // namespace zero::kernels

namespace zero::comm::detail {

// Most inputs one reduction kernel sums (they travel as kernel parameters).
inline constexpr int cuda_reduce_max_inputs = 64;

struct ReduceInputs {
  const void* at[cuda_reduce_max_inputs];
};

// out[i] = in[0][i] op ... op in[inputs-1][i] for i < n (sum, or the
// larger), in rank order: comm/reduce.cuh.
template <class T>
void launch_reduce(void* out, const ReduceInputs& in, int inputs, std::size_t n, bool sum, cudaStream_t stream);

// comm::Nccl's check that every rank made the same call (comm/nccl.hpp):
// `reduced` (device) holds the ranks' minimum of {code, ~code}, which is
// this rank's own pair exactly when every rank's code is `code`. When it is
// not, out[0, bytes) is overwritten with 0xFF bytes (NaN in every floating
// type), so what a mismatched exchange received is never handed on as
// values, and `call` is written to *mismatch (host-mapped memory, polled by
// the host) unless an earlier call is there: comm/reduce.cuh. (Word is
// std::uint64_t: a template so that it is instantiated once per program, as
// the others are.)
template <class Word>
void launch_check_call(const Word* reduced, Word code, void* out, std::size_t bytes, Word call, Word* mismatch,
                       cudaStream_t stream);

}  // namespace zero::comm::detail
