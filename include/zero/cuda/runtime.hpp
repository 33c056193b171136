// Why: the library's CUDA code is in two kinds of header. Those named .hpp
// (this folder, backend/cuda.hpp, comm/local_device.hpp, comm/nccl.hpp,
// kernels/cuda_launch.hpp, kernels/cuda_launchers.hpp,
// kernels/cuda_grad_stats.hpp) are host code on the
// CUDA runtime API: any C++20 compiler takes them, given the toolkit's
// headers, so the engine on backend::Cuda compiles at the host compiler's
// speed. Those named .cuh hold kernels and need nvcc; they define the
// launchers that kernels/cuda_launchers.hpp declares (zero/zero_cuda.cuh
// says how a build provides them). Every .hpp of the first kind includes the
// runtime through this header, which says what is missing when it is.
#pragma once

#include "zero/compiler.hpp"

#if !__has_include(<cuda_runtime.h>)
#error "zero's CUDA headers need the CUDA toolkit's headers: add its include folder (e.g. -I/usr/local/cuda/include) and link -lcudart (nvcc does both)"
#endif

#include <cuda_runtime.h>
