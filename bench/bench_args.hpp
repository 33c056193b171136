// Why: the step benchmarks (host and CUDA) take the same kind of command
// line; one parser gives them the same flags, the same K/M/G counts and the
// same exit code 2 with a usage line on anything unexpected.
#pragma once

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace zero::bench {

// Walks argv: while (args.next()) { if (args.is("--n")) n = args.count(); ... else args.usage(); }
class Args {
 public:
  Args(int argc, char** argv, const char* usage) : argc_(argc), argv_(argv), usage_(usage) {}

  bool next() { return ++i_ < argc_; }
  bool is(const char* flag) const { return std::strcmp(argv_[i_], flag) == 0; }

  // The flag's value.
  const char* value() {
    if (i_ + 1 >= argc_) {
      std::fprintf(stderr, "%s needs a value\n", argv_[i_]);
      std::exit(2);
    }
    return argv_[++i_];
  }
  // A positive whole number, or one with a K, M or G suffix (powers of 1024).
  std::size_t count() {
    const char* flag = argv_[i_];
    const char* s = value();
    char* end = nullptr;
    const double v = std::strtod(s, &end);
    double scale = 1.0;
    if (*end == 'k' || *end == 'K') scale = 1024.0, ++end;
    if (*end == 'm' || *end == 'M') scale = 1024.0 * 1024.0, ++end;
    if (*end == 'g' || *end == 'G') scale = 1024.0 * 1024.0 * 1024.0, ++end;
    if (end == s || *end != '\0' || !(v * scale >= 1.0)) {
      std::fprintf(stderr, "%s %s: expected a positive count such as 67108864 or 64M\n", flag, s);
      std::exit(2);
    }
    return static_cast<std::size_t>(v * scale);
  }
  // A whole number >= 1.
  int positive() {
    const char* flag = argv_[i_];
    const char* s = value();
    char* end = nullptr;
    const long v = std::strtol(s, &end, 10);
    if (end == s || *end != '\0' || v < 1 || v > 1000000) {
      std::fprintf(stderr, "%s %s: expected a whole number >= 1\n", flag, s);
      std::exit(2);
    }
    return static_cast<int>(v);
  }

  [[noreturn]] void usage() const {
    std::fprintf(stderr, "%s: unknown argument %s\nusage: %s %s\n", argv_[0], argv_[i_], argv_[0], usage_);
    std::exit(2);
  }

 private:
  int argc_;
  char** argv_;
  const char* usage_;
  int i_ = 0;
};

}  // namespace zero::bench
