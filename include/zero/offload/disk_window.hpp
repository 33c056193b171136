// Why: how much host memory offload::Nvme's window takes, and how large its
// swap file is, follow from Options::nvme.window_bytes, the optimizer's state
// count and the owned elements. The disk store (disk_state_store.hpp)
// allocates from these functions, and the schedule (engine/buffer_sizes.hpp,
// engine/schedule.hpp) predicts from them, so the planner reads the window
// from the very option the store reads. Arithmetic only: no liburing here.
#pragma once

#include "zero/config.hpp"

#include <algorithm>
#include <cstddef>

#include "zero/error.hpp"
#include "zero/offload/aligned_buffer.hpp"

namespace zero::offload {

// Chunks the window holds at once: read ahead, update, write behind.
inline constexpr std::size_t disk_window_chunks = 3;

// The least Options::nvme.window_bytes: three chunks of one 4 KiB block for
// each array (the master and every state slot); a smaller window would be
// silently exceeded.
inline constexpr std::size_t disk_least_window_bytes(int state_slots) {
  return disk_window_chunks * disk_alignment * (1 + static_cast<std::size_t>(state_slots));
}

// Elements per chunk for a window of `window_bytes` (three records of
// 1 + state_slots arrays): a multiple of 1024 (4 KiB of fp32), at least one
// block, no more than the owned elements need.
inline std::size_t disk_chunk_elements(std::size_t window_bytes, int state_slots, std::size_t owned) {
  constexpr std::size_t block = disk_alignment / sizeof(float);
  const std::size_t per_element = disk_window_chunks * sizeof(float) * (1 + static_cast<std::size_t>(state_slots));
  std::size_t c = window_bytes / per_element / block * block;
  c = std::max(c, block);
  return std::min(c, std::max(block, (owned + block - 1) / block * block));
}

// fp32 elements of the host window: three records of chunk elements for the
// master and each state slot. At most window_bytes once that is at least
// the least window (three 4 KiB blocks per array); smaller when the owned
// elements need less.
inline std::size_t disk_window_elements(std::size_t window_bytes, int state_slots, std::size_t owned) {
  const std::size_t arrays = 1 + static_cast<std::size_t>(state_slots);
  return checked_mul(disk_window_chunks * arrays, disk_chunk_elements(window_bytes, state_slots, owned),
                     "offload::Nvme: the host window");
}

// Bytes of the swap file: whole records (a chunk of every array), at least
// one; a record is a multiple of 4096 bytes, as O_DIRECT needs.
inline std::size_t disk_swap_file_bytes(std::size_t window_bytes, int state_slots, std::size_t owned) {
  const std::size_t chunk = disk_chunk_elements(window_bytes, state_slots, owned);
  const std::size_t chunks = std::max<std::size_t>((owned + chunk - 1) / chunk, 1);
  const std::size_t record = checked_mul(chunk * sizeof(float), 1 + static_cast<std::size_t>(state_slots),
                                         "offload::Nvme: a swap-file record");
  return checked_mul(chunks, record, "offload::Nvme: the swap file");
}

}  // namespace zero::offload
