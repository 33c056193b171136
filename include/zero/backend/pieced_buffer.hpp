// Why: offloaded model state lives in page-locked host memory, and a large
// model's shard of it runs to tens of GiB. Page-locking that as one piece
// asks the driver for one huge pinned mapping, which can fail on systems
// with room for the memory itself, and a failure then costs the whole
// buffer at once. So the buffer is one contiguous range of ordinary memory,
// which the engine addresses as one array (a unit's range at its offset, one
// norm pass over the whole gradient), page-locked piece by piece, each piece
// well below 4 GiB. The pieces are cut between the ranges the engine copies
// whole (each unit's owned range), so no copy crosses from one piece into the
// next unless a single range is larger than a piece.
//
// The cutting is a pure function (cut_pieces) and the buffer a template
// over the page-locking calls, so both are tested on the host with a
// logging locker (tests/engine/late_copies.hpp); the CUDA backend instantiates it with
// cudaHostRegister/cudaHostUnregister (backend/cuda.hpp).
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>
#include <vector>

#include "zero/error.hpp"

namespace zero::backend {

// The default largest piece: 1 GiB, a quarter of the 4 GiB where drivers
// and 32-bit sizes start to bite.
inline constexpr std::size_t default_pinned_piece_bytes = std::size_t{1} << 30;

// How a pieced buffer is cut: no piece above `piece_bytes`, and cuts only at
// the ends of `range_ends` (element offsets, increasing, the last at most the
// buffer's size) where possible.
struct PieceCuts {
  std::size_t piece_bytes = default_pinned_piece_bytes;
  std::vector<std::size_t> range_ends;
};

// One piece: elements [begin, end).
struct Piece {
  std::size_t begin = 0, end = 0;
  bool operator==(const Piece&) const = default;
};

// Cuts n elements of `element_bytes` into pieces of at most cuts.piece_bytes
// (rounded down to whole 4 KiB pages and whole elements), each made of whole
// ranges; a range larger than a piece gets pieces of its own, cut at piece
// size (the only case where a range spans pieces). Elements after the last
// range end form a range of their own.
inline std::vector<Piece> cut_pieces(std::size_t n, std::size_t element_bytes, const PieceCuts& cuts) {
  require(element_bytes >= 1 && element_bytes <= 4096, "cut_pieces: element size ", element_bytes,
          " is outside 1..4096 bytes");
  require(cuts.piece_bytes >= 4096, "the pinned piece size ", cuts.piece_bytes,
          " bytes is below one 4 KiB page; use 1 GiB (zero::backend::default_pinned_piece_bytes)");
  // Pieces end on page boundaries (page-locking works in pages) where the
  // element size allows, else on element boundaries.
  const std::size_t per_page = 4096 % element_bytes == 0 ? 4096 / element_bytes : 1;
  const std::size_t limit = cuts.piece_bytes / element_bytes / per_page * per_page;
  std::vector<Piece> pieces;
  std::size_t begin = 0, end = 0;  // the piece being filled: [begin, end)
  auto close = [&] {
    if (end > begin) pieces.push_back({begin, end});
    begin = end;
  };
  std::size_t previous = 0;
  auto add_range = [&](std::size_t range_end) {
    require(range_end >= previous && range_end <= n, "cut_pieces: range end ", range_end,
            " is not increasing within the buffer's ", n, " elements");
    if (range_end - begin > limit) close();                  // the range does not fit beside what is there
    while (range_end - begin > limit) end = begin + limit, close();  // a range larger than a piece
    end = range_end;
    previous = range_end;
  };
  for (std::size_t e : cuts.range_ends) add_range(e);
  if (previous < n) add_range(n);
  close();
  return pieces;
}

// What page-locks host memory, as the CUDA backend does it:
//   static bool lock(void* p, std::size_t bytes);  // false: could not (the reason is the locker's to keep)
//   static void unlock(void* p);                    // of a pointer lock() accepted
//   static const char* last_error();                // why the last lock() failed
// The memory itself comes from std::aligned_alloc (page-aligned), zero-filled.
template <class Locker>
concept PageLocker = requires(void* p, std::size_t n) {
  { Locker::lock(p, n) } -> std::same_as<bool>;
  Locker::unlock(p);
  { Locker::last_error() } -> std::convertible_to<const char*>;
};

// n zero-filled elements of T in one contiguous range, page-locked in the
// pieces cut_pieces cuts. Where a piece cannot be locked (a low
// `ulimit -l`, a container's limit) the pieces locked so far are released
// and the whole buffer stays pageable, with a one-line warning;
// page_locked() says which (the engine refuses pageable memory when
// Options::require_pinned_memory is set). Move-only.
template <class T, PageLocker Locker>
class PiecedBuffer {
 public:
  PiecedBuffer() = default;
  // Cut at cuts.piece_bytes only (no ranges to respect).
  explicit PiecedBuffer(std::size_t n) : PiecedBuffer(n, PieceCuts{}) {}
  PiecedBuffer(std::size_t n, const PieceCuts& cuts) : n_(n) {
    if (n == 0) return;
    if (n > (static_cast<std::size_t>(-1) - 4095) / sizeof(T)) throw std::bad_alloc();  // bytes would wrap
    const std::size_t bytes = (n * sizeof(T) + 4095) / 4096 * 4096;
    pieces_ = cut_pieces(n, sizeof(T), cuts);
    data_ = static_cast<T*>(std::aligned_alloc(4096, bytes));
    if (data_ == nullptr) throw std::bad_alloc();
    std::memset(static_cast<void*>(data_), 0, bytes);
    for (std::size_t k = 0; k < pieces_.size(); ++k) {
      if (Locker::lock(data_ + pieces_[k].begin, (pieces_[k].end - pieces_[k].begin) * sizeof(T))) continue;
      std::fprintf(stderr,
                   "zero: warning: could not page-lock %zu bytes of host memory for offloaded state (piece %zu of "
                   "%zu, %s); using pageable memory, whose transfers are slower and synchronous (raise `ulimit -l`, "
                   "or set Options::require_pinned_memory to make this an error)\n",
                   (pieces_[k].end - pieces_[k].begin) * sizeof(T), k + 1, pieces_.size(), Locker::last_error());
      unlock_first(k);
      return;
    }
    locked_ = true;
  }
  PiecedBuffer(PiecedBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), n_(std::exchange(o.n_, 0)), pieces_(std::move(o.pieces_)),
        locked_(std::exchange(o.locked_, false)) {}
  PiecedBuffer& operator=(PiecedBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      n_ = std::exchange(o.n_, 0);
      pieces_ = std::move(o.pieces_);
      locked_ = std::exchange(o.locked_, false);
    }
    return *this;
  }
  PiecedBuffer(const PiecedBuffer&) = delete;
  PiecedBuffer& operator=(const PiecedBuffer&) = delete;
  ~PiecedBuffer() { release(); }

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return n_; }
  std::size_t bytes() const { return n_ * sizeof(T); }
  bool page_locked() const { return locked_; }
  // The pieces it was cut into (locked or not), in elements.
  const std::vector<Piece>& pieces() const { return pieces_; }

 private:
  void unlock_first(std::size_t count) noexcept {
    for (std::size_t k = 0; k < count; ++k) Locker::unlock(data_ + pieces_[k].begin);
  }
  // Unlocking (cudaHostUnregister) waits for copies still reading the memory.
  void release() noexcept {
    if (data_ == nullptr) return;
    if (locked_) unlock_first(pieces_.size());
    std::free(data_);
    data_ = nullptr;
    n_ = 0;
    pieces_.clear();
    locked_ = false;
  }

  T* data_ = nullptr;
  std::size_t n_ = 0;
  std::vector<Piece> pieces_;
  bool locked_ = false;
};

}  // namespace zero::backend
