// The CUDA umbrella for host-compiled files: everything in zero/zero.hpp plus
// the CUDA backend, its streams and device checks, and in-process device
// ranks (comm::LocalDevice), all host code. g++ or clang++ compiles it given
// the CUDA toolkit's headers (-I/usr/local/cuda/include; link -lcudart), so
// the engine on backend::Cuda, the bulk of a GPU program's code, compiles at
// the host compiler's speed. Its kernel launches are declared, not defined
// (zero/kernels/cuda_launchers.hpp): link an object that defines them, one
// .cu file compiled by nvcc:
//
//   // my_kernels.cu
//   #include "zero/kernels/cuda_instantiate.cuh"
//   ZERO_INSTANTIATE_CUDA_KERNELS()               // casts, statistics, reductions, ZeRO++'s quantizer
//   ZERO_INSTANTIATE_CUDA_STEP(zero::optim::AdamW) // each optimizer you use
//
// (the build's src/zero_kernels_cuda.cu is that file for the built-in
// optimizers). A .cu file may instead include zero/zero_cuda.cuh, which adds
// the definitions: header-only, at nvcc's speed.
//
// The NCCL communicator is not included here even where nccl.h is visible:
// at -O2 and above the host compiler speculatively devirtualises the stream
// watchers' poll() (cuda/stream.hpp) to the one override it can see, so a
// translation unit that merely includes zero/comm/nccl.hpp references NCCL's
// functions and must link -lnccl. Include it yourself where you use comm::Nccl.
#pragma once

#include "zero/compiler.hpp"

#include "zero/zero.hpp"

#include "zero/backend/cuda.hpp"
#include "zero/comm/local_device.hpp"
#include "zero/cuda/check.hpp"
#include "zero/cuda/device.hpp"
#include "zero/cuda/runtime.hpp"
#include "zero/cuda/stream.hpp"
#include "zero/kernels/cuda_grad_stats.hpp"
#include "zero/kernels/cuda_launch.hpp"
#include "zero/kernels/cuda_launchers.hpp"
