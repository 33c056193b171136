// The twelve built-in engines on backend::Cuda, with make_optimizer's handles,
// compiled once per build by the host compiler (zero/runtime/precompiled.hpp
// says why): one precision per compile, ZERO_ENGINES_PRECISION = fp32, bf16
// or fp16, so the three compile side by side. The engine is host code on the
// CUDA runtime (zero/zero_cuda.hpp); its kernels are nvcc's, in
// src/zero_kernels_cuda.cu, linked beside. Files that use them write, after
// their includes (zero_cuda.hpp or zero_cuda.cuh among them):
//   #include "zero/runtime/precompiled.hpp"
//   ZERO_EXTERN_ENGINES(zero::backend::Cuda)
//   ZERO_EXTERN_HANDLES(zero::backend::Cuda)   // where make_optimizer.hpp is included
// (examples/gpt/gpt_train_cuda.cpp, tests/cuda/test_cuda_engine.cpp).
#include "zero/zero_cuda.hpp"
#include "zero/runtime/make_optimizer.hpp"
#include "zero/runtime/precompiled.hpp"

ZERO_INSTANTIATE_ENGINES(ZERO_PRECISION_POLICY(ZERO_ENGINES_PRECISION), ::zero::backend::Cuda)
ZERO_INSTANTIATE_HANDLES(ZERO_PRECISION_POLICY(ZERO_ENGINES_PRECISION), ::zero::backend::Cuda)
