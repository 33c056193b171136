// Why: O_DIRECT moves bytes between the disk and user memory without the page
// cache, so the kernel demands that the buffer, the file offset and the size
// are multiples of the logical block size. 4096 covers every disk sold today
// (512-byte and 4K-native alike); page-aligned pinned CUDA memory meets it
// too. This is the host memory callers of DiskSwap use where they have none.
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>
#include <cstdint>

#include "zero/backend/host_buffer.hpp"
#include "zero/engine/detail/disk_window.hpp"  // disk_alignment

namespace zero::offload {

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
using AlignedBuffer = backend::AlignedHostBuffer<T, disk_alignment>;

}  // namespace zero::offload
