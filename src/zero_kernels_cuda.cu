// The library's CUDA kernels for the built-in optimizers, compiled once per
// build by nvcc: the launchers that host-compiled CUDA code calls
// (zero/kernels/cuda_launchers.hpp), among them the engines of
// src/zero_engines_cuda.cpp. The only file of the library's own build that
// nvcc compiles; a program with an optimizer policy of its own adds
// ZERO_INSTANTIATE_CUDA_STEP(ItsPolicy) in a .cu file of its own.
#include "zero/kernels/cuda_instantiate.cuh"
#include "zero/optim/adam.hpp"
#include "zero/optim/sgd.hpp"

ZERO_INSTANTIATE_CUDA_KERNELS()
ZERO_INSTANTIATE_CUDA_STEP(::zero::optim::Adam)
ZERO_INSTANTIATE_CUDA_STEP(::zero::optim::AdamW)
ZERO_INSTANTIATE_CUDA_STEP(::zero::optim::Sgd)
ZERO_INSTANTIATE_CUDA_STEP(::zero::optim::PlainSgd)
