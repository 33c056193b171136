// Why: how much host memory offload::Nvme's window takes, and how large its
// swap file is, follow from Options::nvme.window_bytes, the optimizer's state
// count and the owned elements. The disk store (disk_state_store.hpp)
// allocates from these functions, and the schedule (engine/detail/buffer_sizes.hpp,
// engine/detail/schedule.hpp) predicts from them, so the planner reads the window
// from the very option the store reads. Arithmetic only: no liburing here.
// It sits with the engine, below the disk tier's store (offload/), because
// the planner sizes the window before any store exists; the names stay in
// zero::offload, the tier's own.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "zero/error.hpp"

namespace zero::offload {

// Alignment of every offset, size and buffer address DiskSwap accepts:
// O_DIRECT's logical block (offload/aligned_buffer.hpp says why 4096).
inline constexpr std::size_t disk_alignment = 4096;

// Options::param_place = disk (engine/detail/shard_pages.hpp): each unit's
// shard is one record of its file (the parameters' or the gradient's), from a
// 4 KiB boundary, and read into one of a few pages of the largest record: the
// unit in use, the one written behind it, and Options::prefetch_units read
// ahead.
inline constexpr std::size_t shard_record_bytes(std::size_t shard_elements, std::size_t element_bytes) {
  return (shard_elements * element_bytes + disk_alignment - 1) / disk_alignment * disk_alignment;
}
inline constexpr std::size_t shard_page_count(int prefetch_units) {
  return static_cast<std::size_t>(prefetch_units) + 2;
}

// Chunks the window holds at once: read ahead, update, write behind.
inline constexpr std::size_t disk_window_chunks = 3;

// A record holds, for each of its chunk's elements, the master
// (`master_bytes`: 4 for fp32, 2 for a remainder master's remainders) and
// every state slot (`state_bytes` each: 4 for fp32, 2 for bf16, 1 for 8-bit codes), array
// after array; each array of a record is a whole number of 4 KiB blocks
// (O_DIRECT), so a chunk is a multiple of 4096 / (the narrowest array's
// element) elements.
inline constexpr std::size_t disk_record_element_bytes(int state_slots, std::size_t master_bytes,
                                                       std::size_t state_bytes = 4) {
  return master_bytes + state_bytes * static_cast<std::size_t>(state_slots);
}
inline constexpr std::size_t disk_chunk_block(std::size_t master_bytes, std::size_t state_bytes = 4) {
  return disk_alignment / std::min(master_bytes, state_bytes);
}

// The least Options::nvme.window_bytes: three chunks of one block for each
// array (the master and every state slot); a smaller window would be
// silently exceeded. (With 8-bit states that least chunk, 4096 elements of
// 1-byte codes, holds a whole block: Options::state_block is at most 4096.)
inline constexpr std::size_t disk_least_window_bytes(int state_slots, std::size_t master_bytes = 4,
                                                     std::size_t state_bytes = 4) {
  return disk_window_chunks * disk_chunk_block(master_bytes, state_bytes) *
         disk_record_element_bytes(state_slots, master_bytes, state_bytes);
}

// The rule behind disk_least_window_bytes in the run's own numbers, for the
// message of every place that checks the window (Options::validate, the
// planner's schedule, the store at finalize, zero_plan's flags). The least
// chunk is one 4 KiB block of the narrowest array, and every array holds as
// many elements, so the figure follows the master's and the states'
// formats, not the slots alone: a fixed "12 KiB per array" held only for
// fp32 master and states (8-bit states with an fp32 master need 72 KiB for
// Adam, not 36). `state_slots`: the optimizer's, or nullopt where it is not
// known yet (Options::validate), which gives the figure per slot count.
inline std::string disk_window_rule(std::optional<int> state_slots, std::size_t master_bytes,
                                    std::size_t state_bytes) {
  using zero::detail::concat;
  const std::size_t block = disk_chunk_block(master_bytes, state_bytes);
  auto kib = [&](int slots) { return disk_least_window_bytes(slots, master_bytes, state_bytes) / 1024; };
  const std::string rule =
      concat("the window holds three chunks (read ahead, update, write behind) of whole 4 KiB blocks of every array, "
             "so a chunk is at least ", block, " elements (one block of the narrowest array's ",
             std::min(master_bytes, state_bytes), "-byte elements), and an element takes ", master_bytes,
             " bytes of master and ", state_bytes, " of each state slot");
  if (state_slots)
    return concat(rule, " (", *state_slots, " here): it must be at least ",
                  disk_least_window_bytes(*state_slots, master_bytes, state_bytes), " bytes (", kib(*state_slots),
                  " KiB)");
  return concat(rule, ": it must be at least ", disk_window_chunks, " x ", block, " x (", master_bytes, " + ",
                state_bytes, " x the optimizer's state slots) bytes: ", kib(0), " KiB without state slots, ", kib(1),
                " KiB for one, ", kib(2), " KiB for two (Adam's)");
}

// What is wrong with a window of `window_bytes`, or "": the words of every
// place that checks it. `master` and `states` name the formats (their
// element bytes decide the least window), `optimizer` the optimizer where
// it is known (null: not named).
inline std::string disk_window_problem(std::size_t window_bytes, std::optional<int> state_slots,
                                       std::size_t master_bytes, std::size_t state_bytes, const char* master,
                                       const char* states, const char* optimizer = nullptr) {
  if (window_bytes >= disk_least_window_bytes(state_slots.value_or(0), master_bytes, state_bytes)) return "";
  return zero::detail::concat("Options::nvme.window_bytes is ", window_bytes, " (", optimizer ? optimizer : "",
                              optimizer ? ", " : "", "master ", master, ", states ", states, "); ",
                              disk_window_rule(state_slots, master_bytes, state_bytes));
}
// What a window should be, after disk_window_problem's words.
inline constexpr const char* disk_window_advice = "; 64 MiB (the default) streams well";

// Elements per chunk for a window of `window_bytes` (three records): a
// multiple of the block (1024 elements with fp32 master and states), at
// least one block, no more than the owned elements need.
inline std::size_t disk_chunk_elements(std::size_t window_bytes, int state_slots, std::size_t owned,
                                       std::size_t master_bytes = 4, std::size_t state_bytes = 4) {
  const std::size_t block = disk_chunk_block(master_bytes, state_bytes);
  const std::size_t per_element =
      disk_window_chunks * disk_record_element_bytes(state_slots, master_bytes, state_bytes);
  std::size_t c = window_bytes / per_element / block * block;
  c = std::max(c, block);
  return std::min(c, std::max(block, (owned + block - 1) / block * block));
}

// fp32 elements of the host window: three records of chunk elements. At
// most window_bytes once that is at least the least window (three blocks
// per array); smaller when the owned elements need less.
inline std::size_t disk_window_elements(std::size_t window_bytes, int state_slots, std::size_t owned,
                                        std::size_t master_bytes = 4, std::size_t state_bytes = 4) {
  const std::size_t chunk = disk_chunk_elements(window_bytes, state_slots, owned, master_bytes, state_bytes);
  // (a chunk is a multiple of 1024 elements: the bytes are whole floats)
  return checked_mul(disk_window_chunks * disk_record_element_bytes(state_slots, master_bytes, state_bytes), chunk,
                     "offload::Nvme: the host window") /
         sizeof(float);
}

// Where each chunk of the owned elements begins, and `owned` last (at least
// one chunk): every `chunk` elements, except where a chunk must end
// earlier. `blocks.piece_start_at_or_before(e)` says where a piece of the
// owned elements that is updated on its own may begin at or before owned
// element e: with 8-bit block-wise states, a block's first element
// (StateBlocks, engine/detail/state_blocks.hpp; one without 8-bit runs cuts
// anywhere), so a chunk that would cut a block ends before it and holds
// fewer than `chunk` elements.
template <class Blocks>
std::vector<std::size_t> disk_chunk_starts(std::size_t chunk, std::size_t owned, const Blocks& blocks) {
  std::vector<std::size_t> starts{0};
  while (owned - starts.back() > chunk) {
    const std::size_t from = starts.back(), next = blocks.piece_start_at_or_before(from + chunk);
    require(next > from && next <= from + chunk, "offload::Nvme: a chunk of ", chunk,
            " elements from owned element ", from, " holds no whole block of the 8-bit state; raise "
            "Options::nvme.window_bytes or lower Options::state_block");
    starts.push_back(next);
  }
  starts.push_back(owned);
  return starts;
}

// Bytes of the swap file: `records` whole records (a chunk of every array;
// disk_chunk_starts' chunks), a record a multiple of 4096 bytes, as
// O_DIRECT needs.
inline std::size_t disk_records_bytes(std::size_t records, std::size_t chunk, int state_slots,
                                      std::size_t master_bytes = 4, std::size_t state_bytes = 4) {
  const std::size_t record = checked_mul(chunk, disk_record_element_bytes(state_slots, master_bytes, state_bytes),
                                         "offload::Nvme: a swap-file record");
  return checked_mul(records, record, "offload::Nvme: the swap file");
}
// The swap file of chunks every `chunk` elements (no 8-bit blocks to keep
// whole): at least one record.
inline std::size_t disk_swap_file_bytes(std::size_t window_bytes, int state_slots, std::size_t owned,
                                        std::size_t master_bytes = 4, std::size_t state_bytes = 4) {
  const std::size_t chunk = disk_chunk_elements(window_bytes, state_slots, owned, master_bytes, state_bytes);
  const std::size_t chunks = std::max<std::size_t>((owned + chunk - 1) / chunk, 1);
  return disk_records_bytes(chunks, chunk, state_slots, master_bytes, state_bytes);
}

}  // namespace zero::offload
