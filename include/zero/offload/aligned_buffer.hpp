// Why: O_DIRECT moves bytes between the disk and user memory without the page
// cache, so the kernel demands that the buffer, the file offset and the size
// are multiples of the logical block size. 4096 covers every disk sold today
// (512-byte and 4K-native alike); page-aligned pinned CUDA memory meets it
// too. This is the host memory callers of DiskSwap use where they have none.
#pragma once

#include "zero/config.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

namespace zero::offload {

// Alignment of every offset, size and buffer address DiskSwap accepts.
inline constexpr std::size_t disk_alignment = 4096;

// n rounded up to a multiple of disk_alignment (n must leave room to round).
inline constexpr std::size_t round_up_to_disk_alignment(std::size_t n) {
  return (n + disk_alignment - 1) / disk_alignment * disk_alignment;
}

inline bool is_disk_aligned(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % disk_alignment == 0;
}

// Owning, zero-initialised host array of n T whose address is a multiple of
// disk_alignment and whose allocation is rounded up to one, so the whole of
// it can go to DiskSwap::read/write (bytes_padded()). Move-only.
template <class T>
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t n) : n_(n) {
    if (n == 0) return;
    if (n > (static_cast<std::size_t>(-1) - disk_alignment) / sizeof(T)) throw std::bad_alloc();  // would wrap
    padded_ = round_up_to_disk_alignment(n * sizeof(T));
    data_ = static_cast<T*>(std::aligned_alloc(disk_alignment, padded_));
    if (data_ == nullptr) throw std::bad_alloc();
    std::memset(static_cast<void*>(data_), 0, padded_);
  }
  AlignedBuffer(AlignedBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), n_(std::exchange(o.n_, 0)), padded_(std::exchange(o.padded_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    if (this != &o) {
      std::free(data_);
      data_ = std::exchange(o.data_, nullptr);
      n_ = std::exchange(o.n_, 0);
      padded_ = std::exchange(o.padded_, 0);
    }
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data_); }

  T* data() { return data_; }
  const T* data() const { return data_; }
  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }
  std::size_t size() const { return n_; }
  std::size_t bytes() const { return n_ * sizeof(T); }
  // The allocation: bytes() rounded up to disk_alignment.
  std::size_t bytes_padded() const { return padded_; }

 private:
  T* data_ = nullptr;
  std::size_t n_ = 0;
  std::size_t padded_ = 0;
};

}  // namespace zero::offload
