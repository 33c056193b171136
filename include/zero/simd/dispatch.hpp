// Why: a header-only library cannot know the user's -march. Each host kernel
// is a "body" (a struct with a static template run<Isa>(...)) compiled once
// per instruction set behind target attributes; `flatten` on the entry, and
// ZERO_FLATTEN on every level below it (compiler.hpp: Clang inlines one level
// at a time), pull the body and every helper it calls into that one
// function, so all of it is compiled for that instruction set. The choice is made once at run time from CPUID, and
// can be forced with ZERO_HOST_ISA=portable|avx2|avx512 (tests and benches use
// it to compare the paths).
#pragma once

#include "zero/compiler.hpp"

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "zero/error.hpp"
#include "zero/simd/pack.hpp"

#if ZERO_HAS_OPENMP
#include <omp.h>
#endif

namespace zero::simd {

// The instruction set that no packs are used for: bodies run their scalar loop.
struct Scalar {
  static constexpr int width = 1;
  static constexpr const char* name = "portable";
};

enum class IsaLevel { portable, avx2, avx512 };

inline const char* isa_name(IsaLevel l) {
  return l == IsaLevel::avx512 ? "avx512" : (l == IsaLevel::avx2 ? "avx2" : "portable");
}

inline IsaLevel detect_isa_from_cpu() {
#if ZERO_HOST_SIMD_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma"))
    return IsaLevel::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return IsaLevel::avx2;
#endif
  return IsaLevel::portable;
}

namespace detail {

inline IsaLevel parse_isa(const std::string& name, const char* source) {
  if (name == "portable") return IsaLevel::portable;
  if (name == "avx2") return IsaLevel::avx2;
  if (name == "avx512") return IsaLevel::avx512;
  throw InvalidArgument(std::string(source) + "='" + name +
                        "' is not one of portable, avx2, avx512; unset it to use the best the CPU has");
}

inline IsaLevel checked_isa(IsaLevel want, const char* source) {
  const IsaLevel best = detect_isa_from_cpu();
  if (static_cast<int>(want) > static_cast<int>(best))
    throw InvalidArgument(std::string(source) + " asks for " + isa_name(want) + " but this CPU supports at most " +
                          isa_name(best) + "; choose a lower level");
  return want;
}

inline std::atomic<int>& isa_setting() {
  static std::atomic<int> level{[] {
    const char* forced = std::getenv("ZERO_HOST_ISA");
    if (forced == nullptr || *forced == '\0') return static_cast<int>(detect_isa_from_cpu());
    return static_cast<int>(checked_isa(parse_isa(forced, "ZERO_HOST_ISA"), "ZERO_HOST_ISA"));
  }()};
  return level;
}

}  // namespace detail

// The instruction set the host kernels use: the best the CPU has, or the one
// named by the environment variable ZERO_HOST_ISA, or the last force_isa().
inline IsaLevel active_isa() { return static_cast<IsaLevel>(detail::isa_setting().load(std::memory_order_relaxed)); }

// Makes every later host kernel use `level` (tests and benchmarks compare the
// paths with it). Throws if the CPU lacks it.
inline void force_isa(IsaLevel level) {
  detail::isa_setting().store(static_cast<int>(detail::checked_isa(level, "force_isa")), std::memory_order_relaxed);
}

// Every level this CPU can run, lowest first.
inline std::vector<IsaLevel> supported_isas() {
  std::vector<IsaLevel> out;
  for (int l = 0; l <= static_cast<int>(detect_isa_from_cpu()); ++l) out.push_back(static_cast<IsaLevel>(l));
  return out;
}

namespace detail {

#if ZERO_HOST_SIMD_X86
template <class Body, class... Args>
__attribute__((flatten, target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2,bmi,bmi2"))) void run_avx512(
    Args&&... args) {
  Body::template run<Avx512>(static_cast<Args&&>(args)...);
}
template <class Body, class... Args>
__attribute__((flatten, target("avx2,fma,f16c,bmi,bmi2"))) void run_avx2(Args&&... args) {
  Body::template run<Avx2>(static_cast<Args&&>(args)...);
}
#endif

}  // namespace detail

// Runs Body::run<Isa>(args...) compiled for the instruction set `level`.
template <class Body, class... Args>
void dispatch(IsaLevel level, Args&&... args) {
#if ZERO_HOST_SIMD_X86
  switch (level) {
    case IsaLevel::avx512:
      detail::run_avx512<Body>(static_cast<Args&&>(args)...);
      return;
    case IsaLevel::avx2:
      detail::run_avx2<Body>(static_cast<Args&&>(args)...);
      return;
    case IsaLevel::portable:
      break;
  }
#endif
  (void)level;
  Body::template run<Scalar>(static_cast<Args&&>(args)...);
}

// The threads host kernels use: OpenMP's (OMP_NUM_THREADS), or 1 without
// OpenMP, at most max_host_threads (bodies keep per-thread results in arrays
// of that size, so kernels allocate nothing).
inline constexpr int max_host_threads = 256;
inline int host_threads() {
#if ZERO_HAS_OPENMP
  const int t = omp_get_max_threads();
  return t < max_host_threads ? t : max_host_threads;
#else
  return 1;
#endif
}

// For its lifetime, host kernels started on this thread use `threads`
// threads (0: leave OpenMP's choice). The offloaded update runs under one,
// sized by Options::offload_threads.
class ScopedHostThreads {
 public:
  explicit ScopedHostThreads(int threads) {
#if ZERO_HAS_OPENMP
    if (threads <= 0) return;
    before_ = omp_get_max_threads();
    omp_set_num_threads(threads);
#else
    (void)threads;
#endif
  }
  ~ScopedHostThreads() {
#if ZERO_HAS_OPENMP
    if (before_ > 0) omp_set_num_threads(before_);
#endif
  }
  ScopedHostThreads(const ScopedHostThreads&) = delete;
  ScopedHostThreads& operator=(const ScopedHostThreads&) = delete;

 private:
  int before_ = 0;
};

// Splits n items into one contiguous range per thread, cut between grains of
// `grain` items, and runs Body::run<Isa>(args..., thread, begin, end) on
// each; threaded when the items cover `elements` >= 2^15 elements. Thread
// t < host_threads(), so bodies can keep per-thread partial results in an
// array of that size.
template <class Body, class... Args>
void parallel_dispatch_grains(std::size_t n, std::size_t grain, std::size_t elements, const Args&... args) {
  const std::size_t blocks = (n + grain - 1) / grain;
  // Small arrays are not worth waking threads for.
  const int threads = elements < (std::size_t{1} << 15) ? 1 : host_threads();
  const IsaLevel level = active_isa();  // outside the parallel region: it may throw
  auto run_part = [&](int t, int nt) {
    std::size_t begin = blocks * static_cast<std::size_t>(t) / static_cast<std::size_t>(nt) * grain;
    std::size_t end = blocks * static_cast<std::size_t>(t + 1) / static_cast<std::size_t>(nt) * grain;
    if (end > n) end = n;
    if (begin > n) begin = n;
    dispatch<Body>(level, args..., t, begin, end);
  };
#if ZERO_HAS_OPENMP
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    run_part(omp_get_thread_num(), omp_get_num_threads());
    return;
  }
#else
  (void)threads;
#endif
  run_part(0, 1);
}

// [0, n) of elements, cut on multiples of 64 (packs and cache lines stay
// aligned).
template <class Body, class... Args>
void parallel_dispatch(std::size_t n, const Args&... args) {
  parallel_dispatch_grains<Body>(n, 64, n, args...);
}

}  // namespace zero::simd
