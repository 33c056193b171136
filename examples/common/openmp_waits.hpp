// Why: OpenMP's threads spin for a while at every barrier and at the end of
// every parallel loop (libgomp: about 300,000 spins). On cores shared with
// other work, a spinning thread burns the time slices the thread it waits
// for needs: the GPT trainer on 2 busy cores ran 2.5x slower than with
// OMP_WAIT_POLICY=passive, which makes waiting threads sleep, and the disk
// tier's I/O thread lost its core to the update's idle threads. The cost, a
// wake-up of a few microseconds per parallel loop, is small beside loops of
// tens of microseconds and more. The runtime reads the policy once, when it
// loads, so a program sets it and executes itself again, first thing in
// main(), before any thread exists. No BLAS here: the benchmarks use it too.
#pragma once

#include <unistd.h>

#include <cstdlib>

namespace zero::examples {

// Sets OMP_WAIT_POLICY=passive where the user has set no policy (nor
// libgomp's GOMP_SPINCOUNT); whether it changed the environment.
inline bool ask_passive_openmp_waits() {
  return std::getenv("OMP_WAIT_POLICY") == nullptr && std::getenv("GOMP_SPINCOUNT") == nullptr &&
         setenv("OMP_WAIT_POLICY", "passive", 1) == 0;
}

// Executes the program again, for libraries that read the environment as
// they load. Returns only if that failed: the program goes on as loaded.
inline void execute_again(char** argv) {
#if defined(__linux__)
  execv("/proc/self/exe", argv);
#else
  (void)argv;
#endif
}

// Call first thing in main(): passive OpenMP waits (see the top of this file).
inline void use_passive_openmp_waits(char** argv) {
  if (ask_passive_openmp_waits()) execute_again(argv);
}

}  // namespace zero::examples
