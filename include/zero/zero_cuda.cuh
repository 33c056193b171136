// The CUDA umbrella header: everything in zero/zero.hpp plus the device
// pieces (CUDA backend, fused kernels, in-process device ranks). Include it
// from .cu files compiled by nvcc; host-only code keeps including
// zero/zero.hpp, which needs only a C++20 compiler.
//
// The NCCL communicator is not included here even where nccl.h is visible:
// at -O2 and above the host compiler speculatively devirtualises the stream
// watchers' poll() (cuda/stream.cuh) to the one override it can see, so a
// translation unit that merely includes zero/comm/nccl.cuh references NCCL's
// functions and must link -lnccl. Include it yourself where you use comm::Nccl.
#pragma once

#if !defined(__CUDACC__)
#error "zero/zero_cuda.cuh is the CUDA umbrella: compile with nvcc, or include zero/zero.hpp for host-only code"
#endif

#include "zero/config.hpp"

#include "zero/zero.hpp"

#include "zero/backend/cuda.cuh"
#include "zero/comm/local_device.cuh"
#include "zero/comm/reduce.cuh"
#include "zero/cuda/check.cuh"
#include "zero/cuda/device.cuh"
#include "zero/cuda/exact_math.cuh"
#include "zero/cuda/stream.cuh"
#include "zero/kernels/cuda_elementwise.cuh"
#include "zero/kernels/cuda_launch.cuh"
#include "zero/kernels/cuda_step.cuh"
