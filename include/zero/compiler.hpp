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

// On every function and lambda between a per-instruction-set entry
// (simd::detail::run_avx512 / run_avx2, zero/simd/dispatch.hpp) and the
// instruction set's helpers. The entry's `flatten` is meant to compile the
// whole call tree into it, for its target: g++'s does; Clang's (through LLVM
// 22 at least) inlines only the calls written in the entry itself, so what
// those call was compiled for baseline x86-64 and called each helper out of
// line (Clang 14: the bf16 AdamW step 10x slower than g++'s). flatten on each
// level carries the inlining down a level at a time. A user's optimizer
// policy needs nothing: its update is called from a level that has it.
// tests/kernels/check_isa_inlined.py holds every engine to it.
//
// ZERO_FLATTEN_INLINE, for a lambda handed to a ZERO_FORCE_INLINE helper
// that calls it: g++ first inlined the lambda's own always-inline callees
// into it, where the helpers' targets do not fit, and kept those calls out
// of line even after flattening the lambda into the entry; always_inline on
// the lambda avoids that. (Not on every level: on the others it made g++
// keep the optimizer's update out of line the same way.)
//
// Only when optimizing: at -O0 nothing is inlined but what is always_inline,
// and Clang 14 there inlined a flattened call to an instruction set's helper
// into a function without that target, which its backend cannot compile
// ("Do not know how to split the result of this operator").
#if ZERO_HOST_SIMD_X86 && defined(__OPTIMIZE__)
#define ZERO_FLATTEN __attribute__((flatten))
#define ZERO_FLATTEN_INLINE __attribute__((always_inline, flatten))
#else
#define ZERO_FLATTEN
#define ZERO_FLATTEN_INLINE
#endif

#if defined(_OPENMP)
#define ZERO_HAS_OPENMP 1
#else
#define ZERO_HAS_OPENMP 0
#endif

#define ZERO_STRINGIFY_IMPL(x) #x
#define ZERO_STRINGIFY(x) ZERO_STRINGIFY_IMPL(x)
