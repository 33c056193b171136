// Why this header exists: one place decides which compiler features the rest
// of the library may use, so that everything that is not device code compiles
// with a plain C++20 host compiler (CI has no GPU) and the same inline
// functions serve host and device when nvcc compiles them.
#pragma once

// Every header includes this one first, so that an older language mode stops
// here with the fix instead of at the first concept or requires-clause.
#if __cplusplus < 202002L
#error "zero needs C++20: compile with -std=c++20 (g++, clang++ or nvcc)"
#endif

#if defined(__CUDACC__)
#define ZERO_HOST_DEVICE __host__ __device__
#define ZERO_DEVICE __device__
#define ZERO_COMPILING_WITH_NVCC 1
#else
#define ZERO_HOST_DEVICE
#define ZERO_DEVICE
#define ZERO_COMPILING_WITH_NVCC 0
#endif

// True inside the device pass of nvcc, where host-only facilities (exceptions,
// OpenMP, x86 intrinsics) must not appear.
#if defined(__CUDA_ARCH__)
#define ZERO_DEVICE_PASS 1
#else
#define ZERO_DEVICE_PASS 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define ZERO_FORCE_INLINE inline __attribute__((always_inline))
#define ZERO_RESTRICT __restrict__
#else
#define ZERO_FORCE_INLINE inline
#define ZERO_RESTRICT
#endif

// Host SIMD kernels with run-time ISA dispatch need GCC/Clang on x86-64 and a
// host-only translation unit: nvcc's front end does not accept the target
// attributes they use, so .cu files fall back to the portable loop (which is
// what a CUDA translation unit needs anyway: the device does the heavy step).
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(__CUDACC__) && !defined(ZERO_DISABLE_HOST_SIMD)
#define ZERO_HOST_SIMD_X86 1
#else
#define ZERO_HOST_SIMD_X86 0
#endif

#if defined(_OPENMP)
#define ZERO_HAS_OPENMP 1
#else
#define ZERO_HAS_OPENMP 0
#endif

#define ZERO_STRINGIFY_IMPL(x) #x
#define ZERO_STRINGIFY(x) ZERO_STRINGIFY_IMPL(x)
