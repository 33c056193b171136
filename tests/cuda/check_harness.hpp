// Why: the GPU machine has no Catch2, so the CUDA tests use this small
// harness: CHECK counts and reports, CHECK_THROWS checks the exception type
// and message, fmt builds messages, and the program prints the plain
// `N passed, M failed` line that CI reads. One copy for every CUDA test.
#pragma once

#include <cstdarg>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <exception>
#include <string>

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
  if constexpr (sizeof(T) == 8) {
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
