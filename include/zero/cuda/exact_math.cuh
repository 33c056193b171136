// Why: the library promises that its device step gives the bits of the host
// step and of PyTorch. The update rules round every operation explicitly
// (zero/math.hpp: __fmul_rn, __fdiv_rn, __fsqrt_rn), so -fmad, -prec-div and
// -prec-sqrt change nothing; but -ftz=true, which --use_fast_math implies,
// makes even those intrinsics flush subnormal inputs and results to zero
// (mul.rn.ftz.f32, div.rn.ftz.f32, ...), and a step near the bottom of the
// float range then differs from the host's.
//
// So a translation unit whose device code is built with -ftz=true does not
// build, unless it defines ZERO_ALLOW_FAST_MATH (accepting that the device
// results may differ from the host's and PyTorch's in subnormal values).
// nvcc 13 defines no preprocessor macro for either flag (not
// __USE_FAST_MATH__, and __CUDA_FTZ only under -cuda), so #error cannot see
// them. What can is __nvvm_reflect("__CUDA_FTZ"), the query libdevice uses to
// pick its flushing variants: the compiler folds it to the flag's value, also
// at -G. Every library kernel calls require_exact_float_flags() first; under
// -ftz=true it keeps a call to a device function that exists nowhere, whose
// name is the error message, and ptxas (or nvlink with -rdc) stops with
//   Unresolved extern function 'zero_error_...remove_it_or_define_ZERO_ALLOW_FAST_MATH'
// Without the flag the call is folded away and costs nothing.
#pragma once

#if !defined(__CUDACC__)
#error "zero/cuda/exact_math.cuh is device code: include it from a .cu file compiled by nvcc"
#endif

#if !defined(ZERO_ALLOW_FAST_MATH)
extern "C" __device__ int __nvvm_reflect(const char*);
// Declared, never defined: see above.
extern "C" __device__ void
zero_error_device_code_built_with_ftz_true_or_use_fast_math_flushes_subnormals_so_results_differ_from_the_host_and_pytorch_remove_it_or_define_ZERO_ALLOW_FAST_MATH();
#endif

namespace zero::cuda {

// Fails the build of the calling kernel under -ftz=true / --use_fast_math
// (see above); nothing otherwise.
__device__ __forceinline__ void require_exact_float_flags() {
#if !defined(ZERO_ALLOW_FAST_MATH) && defined(__CUDA_ARCH__)
  if (__nvvm_reflect("__CUDA_FTZ") != 0)
    zero_error_device_code_built_with_ftz_true_or_use_fast_math_flushes_subnormals_so_results_differ_from_the_host_and_pytorch_remove_it_or_define_ZERO_ALLOW_FAST_MATH();
#endif
}

}  // namespace zero::cuda
