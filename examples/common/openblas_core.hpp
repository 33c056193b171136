// Why: two settings of the host's math libraries that can only be made in the
// environment, before the libraries load -- so the program sets them and
// executes itself again (first thing in main(), before any thread exists):
//
// - OpenBLAS 0.3.21 (Debian 12) does not recognise recent Intel server cores
//   (Sapphire and Emerald Rapids report models it has no entry for) and falls
//   back to its Prescott (SSE3) kernels: sgemm runs about 3x slower than with
//   the AVX-512 (SkylakeX) or AVX2 (Haswell) kernels the CPU can run.
//   OpenBLAS reads OPENBLAS_CORETYPE once, when it loads.
// - OpenMP's threads spin at every barrier: OMP_WAIT_POLICY=passive (see
//   common/openmp_waits.hpp).
#pragma once

#include <cblas.h>
#include <strings.h>

#include <cstdlib>

#include "common/openmp_waits.hpp"

namespace zero::examples {

// The OpenBLAS core type to ask for, or null to leave OpenBLAS's choice: it
// chose a core other than Prescott, or the CPU has no better one.
inline const char* better_openblas_core() {
#if defined(OPENBLAS_VERSION) && defined(__x86_64__)
  const char* core = openblas_get_corename();
  if (core == nullptr || strcasecmp(core, "prescott") != 0) return nullptr;
  return __builtin_cpu_supports("avx512f") ? "SkylakeX" : __builtin_cpu_supports("avx2") ? "Haswell" : nullptr;
#else
  return nullptr;
#endif
}

// Call first thing in main(). Sets OPENBLAS_CORETYPE (see better_openblas_core)
// and OMP_WAIT_POLICY=passive (ask_passive_openmp_waits) where the user has
// set neither, and executes the program again if it set one; does nothing
// off Linux.
inline void tune_host_math_libraries(char** argv) {
#if defined(__linux__)
  bool changed = false;
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr) {
    if (const char* core = better_openblas_core()) changed |= setenv("OPENBLAS_CORETYPE", core, 1) == 0;
  }
  changed |= ask_passive_openmp_waits();
  if (changed) execute_again(argv);
#else
  (void)argv;
#endif
}

}  // namespace zero::examples
