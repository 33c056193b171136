// Why: OpenBLAS 0.3.21 (Debian 12) does not recognise recent Intel server
// cores (Sapphire and Emerald Rapids report models it has no entry for) and
// falls back to its Prescott (SSE3) kernels: sgemm runs about 3x slower than
// with the AVX-512 (SkylakeX) or AVX2 (Haswell) kernels the CPU can run.
// OpenBLAS reads OPENBLAS_CORETYPE once, when the library loads, so the fix
// must come before the program starts: set it and execute the program again.
#pragma once

#include <cblas.h>
#include <unistd.h>

#include <cstdlib>
#include <strings.h>

namespace zero::examples {

// Call first thing in main(). Does nothing when OPENBLAS_CORETYPE is set,
// when OpenBLAS picked a core other than Prescott, or off x86-64 Linux.
inline void use_openblas_kernels_for_this_cpu(char** argv) {
#if defined(OPENBLAS_VERSION) && defined(__x86_64__) && defined(__linux__)
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  const char* core = openblas_get_corename();
  if (core == nullptr || strcasecmp(core, "prescott") != 0) return;
  const char* better = __builtin_cpu_supports("avx512f") ? "SkylakeX" : __builtin_cpu_supports("avx2") ? "Haswell" : nullptr;
  if (better == nullptr) return;
  setenv("OPENBLAS_CORETYPE", better, 1);
  execv("/proc/self/exe", argv);  // returns only if it failed: go on with Prescott
#else
  (void)argv;
#endif
}

}  // namespace zero::examples
