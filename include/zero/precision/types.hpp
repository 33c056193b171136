// Why: user tensors already live in CUDA's __half / __nv_bfloat16 (or raw
// 16-bit buffers on the host). Our storage types are plain 16-bit structs with
// the same size, alignment and bit layout, so a pointer to either can be
// reinterpreted without copies, and they are usable from g++-only code.
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace zero {

// IEEE 754 binary16: 1 sign, 5 exponent, 10 mantissa bits.
struct fp16 {
  std::uint16_t bits;
  friend constexpr bool operator==(fp16 a, fp16 b) { return a.bits == b.bits; }
};

// bfloat16: the upper half of an IEEE binary32 (1 sign, 8 exponent, 7 mantissa).
struct bf16 {
  std::uint16_t bits;
  friend constexpr bool operator==(bf16 a, bf16 b) { return a.bits == b.bits; }
};

using fp32 = float;

static_assert(sizeof(fp16) == 2 && alignof(fp16) == 2, "fp16 must match __half's layout");
static_assert(sizeof(bf16) == 2 && alignof(bf16) == 2, "bf16 must match __nv_bfloat16's layout");
static_assert(std::is_trivially_copyable_v<fp16> && std::is_trivially_copyable_v<bf16>);

// Element type tags understood by every communicator (NCCL, MPI, Local) so
// that headers which describe buffers need not include nccl.h or mpi.h.
// f64 and u64 are for the engine's own control messages (norms, hashes).
// u8: bytes that collectives move but never reduce (quantized payloads:
// codes and their scales, ZeRO++'s qwZ).
enum class DType : std::uint8_t { f32, f16, bf16, f64, u64, u8 };

// How a reduction combines the ranks' elements: with DType, all that code
// which describes a collective needs, without including a communicator.
// zero::comm::ReduceOp names the same type.
enum class ReduceOp : std::uint8_t { sum, max };

template <class T>
struct dtype_traits;  // primary left undefined: only the three storage types are element types

template <>
struct dtype_traits<float> {
  static constexpr DType dtype = DType::f32;
  static constexpr std::size_t bytes = 4;
  static constexpr const char* name = "fp32";
};
template <>
struct dtype_traits<fp16> {
  static constexpr DType dtype = DType::f16;
  static constexpr std::size_t bytes = 2;
  static constexpr const char* name = "fp16";
};
template <>
struct dtype_traits<bf16> {
  static constexpr DType dtype = DType::bf16;
  static constexpr std::size_t bytes = 2;
  static constexpr const char* name = "bf16";
};

template <class T>
concept StorageType = requires { dtype_traits<T>::dtype; };

template <class T>
inline constexpr bool is_low_precision_v = std::is_same_v<T, fp16> || std::is_same_v<T, bf16>;

inline constexpr std::size_t dtype_bytes(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f16:
    case DType::bf16: return 2;
    case DType::f64:
    case DType::u64: return 8;
    case DType::u8: return 1;
  }
  return 0;
}
inline constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "fp32";
    case DType::f16: return "fp16";
    case DType::bf16: return "bf16";
    case DType::f64: return "f64";
    case DType::u64: return "u64";
    case DType::u8: return "u8";
  }
  return "?";
}

}  // namespace zero
