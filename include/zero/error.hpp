// Why: every failure the library reports is a zero::Error, so a caller can
// catch one type; each message names the parameter (and rank, where there is
// one) and says how to fix it. Device code never throws: kernels report
// through flags that host code turns into these exceptions.
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace zero {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A value the user passed is outside what the algorithm accepts.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// The ranks disagree (layout, options) or a collective failed.
class CommError : public Error {
 public:
  using Error::Error;
};

// A CUDA, NCCL or MPI call failed.
class BackendError : public Error {
 public:
  using Error::Error;
};

// A checkpoint or safetensors file set cannot be written or read: the message
// names the file and the problem (missing, truncated, checksum mismatch, a
// header that contradicts itself, a manifest of another model or optimizer).
class CheckpointError : public Error {
 public:
  using Error::Error;
};

// A buffer could not be allocated; the message names the buffer, its bytes,
// the rank and the option or stage that makes it smaller.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// A file operation failed (the disk tier's swap files: a full disk, a short
// read, a file changed underneath); the message names the file, the byte
// offset, the size, the cause and what to do.
class IoError : public Error {
 public:
  using Error::Error;
};

namespace detail {

template <class... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}

}  // namespace detail

// Throws InvalidArgument built from the streamed parts when `condition` fails.
template <class... Parts>
inline void require(bool condition, Parts&&... parts) {
  if (!condition) throw InvalidArgument(detail::concat(std::forward<Parts>(parts)...));
}

// a + b and a * b for sizes, or an InvalidArgument naming `what` when the
// result does not fit in std::size_t (a size that wrapped would make buffers
// too small, or a divisor zero).
namespace detail {
inline constexpr const char* size_overflow = " does not fit in 64 bits; the parameter is too large to partition";
}  // namespace detail
template <class... Parts>
inline std::size_t checked_add(std::size_t a, std::size_t b, Parts&&... what) {
  std::size_t r;
  require(!__builtin_add_overflow(a, b, &r), std::forward<Parts>(what)..., ": the size ", a, " + ", b,
          detail::size_overflow);
  return r;
}
template <class... Parts>
inline std::size_t checked_mul(std::size_t a, std::size_t b, Parts&&... what) {
  std::size_t r;
  require(!__builtin_mul_overflow(a, b, &r), std::forward<Parts>(what)..., ": the size ", a, " x ", b,
          detail::size_overflow);
  return r;
}

}  // namespace zero
