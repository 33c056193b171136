// Why: a failed CUDA call is almost always reported far from its cause (an
// earlier asynchronous launch, a bad pointer, an exhausted device), so every
// runtime call the library makes is wrapped: the exception says which call,
// where, and what the runtime said, and it is a zero::BackendError, so a
// caller catches one type for every backend. Device code never uses this:
// kernels cannot throw.
#pragma once

#include "zero/compiler.hpp"

#include "zero/cuda/runtime.hpp"

#include "zero/error.hpp"

namespace zero::cuda {
namespace detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  throw BackendError(zero::detail::concat(file, ":", line, ": CUDA call '", call, "' failed: ",
                                          cudaGetErrorName(status), " (", cudaGetErrorString(status), ")"));
}

}  // namespace detail

// Throws BackendError naming the kernel (the streamed parts of `what`, built
// only on failure so that a launch allocates nothing) if the launch just made
// on this thread failed: a bad configuration, no kernel image for this GPU, or
// an error left by an earlier asynchronous call.
template <class... What>
inline void check_launch(const What&... what) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess)
    throw BackendError(zero::detail::concat("launch of ", what..., " failed: ", cudaGetErrorName(status), " (",
                                            cudaGetErrorString(status),
                                            "); if it says no kernel image is available, rebuild with this "
                                            "GPU's architecture in -Dgpu_arch"));
}

}  // namespace zero::cuda

// Evaluates a CUDA runtime call once and throws zero::BackendError with
// file:line, the call's text and the runtime's message when it fails.
#define ZERO_CUDA_CHECK(call)                                                                     \
  do {                                                                                            \
    const cudaError_t zero_cuda_check_status_ = (call);                                           \
    if (zero_cuda_check_status_ != cudaSuccess)                                                   \
      ::zero::cuda::detail::throw_cuda_error(zero_cuda_check_status_, #call, __FILE__, __LINE__); \
  } while (0)
