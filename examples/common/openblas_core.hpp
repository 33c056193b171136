// Why: two settings of the host's math libraries that can only be made in the
// environment, before the libraries load -- so the program sets them and
// executes itself again (first thing in main(), before any thread exists):
//
// - OpenBLAS 0.3.21 (Debian 12) does not recognise recent Intel server cores
//   (Sapphire and Emerald Rapids report models it has no entry for) and falls
//   back to its Prescott (SSE3) kernels: sgemm runs about 3x slower than with
//   the AVX-512 (SkylakeX) or AVX2 (Haswell) kernels the CPU can run.
//   OpenBLAS reads OPENBLAS_CORETYPE once, when it loads.
// - OpenMP's threads spin for a while at every barrier and at the end of
//   every parallel loop (libgomp: about 300,000 spins). On cores shared with
//   other work, a spinning thread burns the time slices the thread it waits
//   for needs: the GPT trainer on 2 busy cores ran 2.5x slower than with
//   OMP_WAIT_POLICY=passive, which makes waiting threads sleep. Its cost, a
//   wake-up of a few microseconds per parallel loop, is small beside loops of
//   tens of microseconds and more.
#pragma once

#include <cblas.h>
#include <unistd.h>

#include <cstdlib>
#include <strings.h>

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
// and OMP_WAIT_POLICY=passive where the user has set neither (nor libgomp's
// GOMP_SPINCOUNT), and executes the program again if it set one; does nothing
// off Linux.
inline void tune_host_math_libraries(char** argv) {
#if defined(__linux__)
  bool changed = false;
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr) {
    if (const char* core = better_openblas_core()) changed |= setenv("OPENBLAS_CORETYPE", core, 1) == 0;
  }
  if (std::getenv("OMP_WAIT_POLICY") == nullptr && std::getenv("GOMP_SPINCOUNT") == nullptr)
    changed |= setenv("OMP_WAIT_POLICY", "passive", 1) == 0;
  if (changed) execv("/proc/self/exe", argv);  // returns only if it failed: go on as loaded
#else
  (void)argv;
#endif
}

}  // namespace zero::examples
