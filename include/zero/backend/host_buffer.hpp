// Why: the host keeps two kinds of owning arrays, the engine's buffers
// (64-byte aligned, for the vector loads of the host kernels) and the disk
// tier's (4096-byte aligned and sized, as O_DIRECT demands). They differ only
// in the alignment, so they are one template here, and every one of them is
// counted, so that a test can prove the steady-state step allocates nothing.
#pragma once

#include "zero/compiler.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

namespace zero::backend {

namespace detail {
inline std::atomic<std::uint64_t>& host_allocations() {
  static std::atomic<std::uint64_t> n{0};
  return n;
}
}  // namespace detail

// Owning, zero-initialised host array of n T whose address is a multiple of
// Alignment and whose allocation is rounded up to one (bytes_padded(), all of
// it usable). Move-only.
template <class T, std::size_t Alignment>
class AlignedHostBuffer {
  static_assert(Alignment >= alignof(T) && (Alignment & (Alignment - 1)) == 0,
                "AlignedHostBuffer: the alignment must be a power of two, at least the element's");

 public:
  static constexpr std::size_t alignment = Alignment;

  AlignedHostBuffer() = default;
  explicit AlignedHostBuffer(std::size_t n) : n_(n) {
    if (n == 0) return;
    if (n > (static_cast<std::size_t>(-1) - Alignment) / sizeof(T)) throw std::bad_alloc();  // bytes would wrap
    padded_ = (n * sizeof(T) + Alignment - 1) / Alignment * Alignment;
    data_ = static_cast<T*>(std::aligned_alloc(Alignment, padded_));
    if (data_ == nullptr) throw std::bad_alloc();
    std::memset(static_cast<void*>(data_), 0, padded_);
    detail::host_allocations().fetch_add(1, std::memory_order_relaxed);
  }
  AlignedHostBuffer(AlignedHostBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), n_(std::exchange(o.n_, 0)), padded_(std::exchange(o.padded_, 0)) {}
  AlignedHostBuffer& operator=(AlignedHostBuffer&& o) noexcept {
    if (this != &o) {
      std::free(data_);
      data_ = std::exchange(o.data_, nullptr);
      n_ = std::exchange(o.n_, 0);
      padded_ = std::exchange(o.padded_, 0);
    }
    return *this;
  }
  AlignedHostBuffer(const AlignedHostBuffer&) = delete;
  AlignedHostBuffer& operator=(const AlignedHostBuffer&) = delete;
  ~AlignedHostBuffer() { std::free(data_); }

  T* data() { return data_; }
  const T* data() const { return data_; }
  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }
  std::size_t size() const { return n_; }
  std::size_t bytes() const { return n_ * sizeof(T); }
  // The allocation: bytes() rounded up to the alignment.
  std::size_t bytes_padded() const { return padded_; }
  // As a backend's PinnedBuffer: host memory is all the host backend has.
  bool page_locked() const { return true; }

 private:
  T* data_ = nullptr;
  std::size_t n_ = 0;
  std::size_t padded_ = 0;
};

// The engine's host buffers: 64-byte aligned (a cache line, an AVX-512 vector).
template <class T>
using HostBuffer = AlignedHostBuffer<T, 64>;

}  // namespace zero::backend
