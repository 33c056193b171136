// The CUDA umbrella for .cu files compiled by nvcc: zero/zero_cuda.hpp (the
// library and its CUDA host code) plus the kernels and the definitions of
// their launchers, so that a .cu file needs nothing else linked (header-only,
// as any template). Host-compiled files include zero/zero_cuda.hpp instead
// and link the launchers from one .cu file (zero/zero_cuda.hpp says how).
#pragma once

#if !defined(__CUDACC__)
#error "zero/zero_cuda.cuh holds CUDA kernels: compile with nvcc, or include zero/zero_cuda.hpp (host code) and link the kernels (see there)"
#endif

#include "zero/compiler.hpp"

#include "zero/zero_cuda.hpp"

#include "zero/comm/reduce.cuh"
#include "zero/cuda/exact_math.cuh"
#include "zero/kernels/cuda_elementwise.cuh"
#include "zero/kernels/cuda_quantize.cuh"
#include "zero/kernels/cuda_step.cuh"
