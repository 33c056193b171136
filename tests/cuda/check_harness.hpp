// Why: the GPU machine has no Catch2, so the CUDA tests use this small
// harness: CHECK counts and reports, CHECK_THROWS checks the exception type
// and message, fmt builds messages, parse_test_args reads the command line
// every test takes, no_cuda_device says when to skip, and the program prints
// the plain `N passed, M failed` line that CI reads. One copy for every CUDA
// test.
#pragma once

#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <exception>
#include <initializer_list>
#include <string>
#include <type_traits>

namespace zero::test {

inline int g_passed = 0;
inline int g_failed = 0;

inline bool check_impl(bool ok, const char* expr, const char* file, int line, const std::string& context) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    std::printf("FAIL %s:%d: %s%s%s\n", file, line, expr, context.empty() ? "" : " -- ", context.c_str());
    std::fflush(stdout);
  }
  return ok;
}

// The bits of a float, double or 16-bit storage value, for exact comparisons
// and messages.
template <class T>
std::uint64_t bits_of(T x) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<std::uint64_t>(x);
  } else if constexpr (sizeof(T) == 8) {
    std::uint64_t u;
    std::memcpy(&u, &x, 8);
    return u;
  } else if constexpr (sizeof(T) == 4) {
    std::uint32_t u;
    std::memcpy(&u, &x, 4);
    return u;
  } else {
    return x.bits;
  }
}

inline std::string fmt(const char* format, ...) __attribute__((format(printf, 1, 2)));
inline std::string fmt(const char* format, ...) {
  char buffer[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(buffer, sizeof buffer, format, args);
  va_end(args);
  return buffer;
}

// One line per group of checks: its name and how many passed and failed
// since the counts `passed_before` and `failed_before`.
inline void section(const char* name, int passed_before, int failed_before) {
  std::printf("%-52s %5d passed, %d failed\n", name, g_passed - passed_before, g_failed - failed_before);
  std::fflush(stdout);
}

// The command line of a CUDA test: [--quick] [--only GROUP]. --quick (or
// ZERO_CUDA_TEST_QUICK=1, which the cuda-memcheck setup sets) asks for
// smaller runs, in programs that have them.
struct TestArgs {
  bool quick = false;
  std::string only;  // empty: every group
  bool runs(const char* group) const { return only.empty() || only == group; }
};

// Reads argv into `args`; on anything but the program's options and groups,
// prints the usage and returns false (the program then exits 2).
inline bool parse_test_args(int argc, char** argv, std::initializer_list<const char*> groups, bool has_quick,
                            TestArgs& args) {
  std::string list;
  for (const char* g : groups) list += (list.empty() ? "" : "|") + std::string(g);
  const char* quick = std::getenv("ZERO_CUDA_TEST_QUICK");
  args.quick = has_quick && quick != nullptr && *quick != '\0' && std::strcmp(quick, "0") != 0;
  bool ok = true;
  for (int i = 1; i < argc && ok; ++i) {
    if (has_quick && std::strcmp(argv[i], "--quick") == 0) {
      args.quick = true;
    } else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
      args.only = argv[++i];
      ok = ("|" + list + "|").find("|" + args.only + "|") != std::string::npos;
    } else {
      ok = false;
    }
  }
  if (!ok) std::fprintf(stderr, "usage: %s %s[--only %s]\n", argv[0], has_quick ? "[--quick] " : "", list.c_str());
  return ok;
}

// True, after saying why, when this machine has no usable CUDA device: the
// test then exits 77, which Meson reports as SKIP.
inline bool no_cuda_device() {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status == cudaSuccess && devices > 0) return false;
  std::printf("SKIP: no CUDA device (%s)\n", status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
  return true;
}

}  // namespace zero::test

#define CHECK(cond, context) ::zero::test::check_impl(static_cast<bool>(cond), #cond, __FILE__, __LINE__, (context))

// CHECK that `statement` throws `Exception` whose message contains `needle`.
#define CHECK_THROWS(statement, Exception, needle)                                                           \
  do {                                                                                                       \
    std::string zero_test_what_;                                                                             \
    bool zero_test_thrown_ = false;                                                                          \
    try {                                                                                                    \
      statement;                                                                                             \
    } catch (const Exception& e) {                                                                           \
      zero_test_thrown_ = true;                                                                              \
      zero_test_what_ = e.what();                                                                            \
    } catch (const std::exception& e) {                                                                      \
      zero_test_what_ = std::string("other exception: ") + e.what();                                         \
    }                                                                                                        \
    ::zero::test::check_impl(zero_test_thrown_ && zero_test_what_.find(needle) != std::string::npos,         \
                             #statement " throws " #Exception " mentioning '" needle "'", __FILE__, __LINE__, \
                             zero_test_what_);                                                               \
  } while (0)
