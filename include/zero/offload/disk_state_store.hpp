// Why: ZeRO-Infinity's disk tier. The fp32 master and the optimizer state of
// this rank's shard live in a swap file on a fast disk (zero/offload/
// disk_swap.hpp) and pass through a small host window, so a run can hold
// optimizer state many times the host memory it is given. The update streams
// through the window in chunks: while the CPU updates chunk k, chunk k+1 is
// read and chunk k-1 written, so the step runs at the disk's pace, not at the
// sum of disk and CPU time.
//
// Include this header (it needs liburing and xxhash.h) before naming
// ZeroOptimizer<..., offload::Nvme, ...>; Options::nvme says where the files
// go and how large the window is.
//
// On disk, chunk c of the owned elements is one record: its master, then
// each state slot, C elements each, at byte c * record_bytes. The master is
// C floats, or C 16-bit remainders (MasterWeights::remainder: its bf16 copy
// is the engine's parameters, which the update reads and writes in place);
// each state slot C floats, or C bf16 values (StateFormat::bf16*).
// A record is a multiple of 4096 bytes (O_DIRECT), and the window is three
// records.
#pragma once

#include "zero/config.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>

#include "zero/backend/host.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/reports.hpp"
#include "zero/engine/state_store.hpp"
#include "zero/engine/update_worker.hpp"
#include "zero/error.hpp"
#include "zero/kernels/fused_step.hpp"
#include "zero/offload/aligned_buffer.hpp"
#include "zero/offload/disk_swap.hpp"
#include "zero/offload/disk_window.hpp"

namespace zero::offload {

template <optim::Policy Optimizer>
class DiskStateStore {
 public:
  static constexpr int state_slots = Optimizer::state_slots;
  static constexpr int arrays = 1 + state_slots;  // master, then the state slots
  static constexpr int window_slots = static_cast<int>(disk_window_chunks);  // read ahead, update, write behind

  // Creates the swap file for `owned` elements (the master always: it lives
  // on disk) and the window, 4 KiB aligned for O_DIRECT, which is why this
  // store allocates its own memory instead of taking the engine's buffers.
  void allocate(std::size_t owned, MasterWeights format, StateFormat states) {
    require(!options_.directory.empty(),
            "offload::Nvme: Options::nvme.directory is empty; name a directory on a fast local disk for the swap "
            "files of the master weights and optimizer state");
    require(states != StateFormat::blockwise8,
            "offload::Nvme: Options::states is blockwise8, which the disk tier does not stream yet; use bf16 states "
            "(half the bytes) with offload nvme, or blockwise8 with offload none or cpu");
    // Three chunks of at least one 4 KiB block per array; a smaller window
    // would be silently exceeded.
    master_format_ = format;
    state_format_ = states;
    const std::size_t mb = master_bytes_each(), sb = state_bytes_each();
    const std::size_t least = disk_least_window_bytes(state_slots, mb, sb);
    require(options_.window_bytes >= least, "offload::Nvme: Options::nvme.window_bytes is ", options_.window_bytes,
            "; the window holds three chunks of at least 4 KiB for each of the ", arrays, " arrays (the master and ",
            state_slots, " state slot(s) of ", Optimizer::name, "): it must be at least ", least,
            " bytes; 64 MiB (the default) streams well");
    owned_ = owned;
    chunk_ = disk_chunk_elements(options_.window_bytes, state_slots, owned, mb, sb);
    chunks_ = (owned + chunk_ - 1) / chunk_;
    record_floats_ = chunk_ * disk_record_element_bytes(state_slots, mb, sb) / sizeof(float);
    DiskOptions disk;
    disk.directory = options_.directory;
    disk.block_bytes = options_.block_bytes;
    disk.queue_depth = options_.queue_depth;
    disk.direct = options_.direct;
    disk.option_names = "Options::nvme.";  // what the engine's users set
    // Sized by disk_window.hpp, which the planner's schedule reads too.
    swap_ = std::make_unique<DiskSwap>(disk_swap_file_bytes(options_.window_bytes, state_slots, owned, mb, sb),
                                       disk, rank_);
    window_ = AlignedBuffer<float>(disk_window_elements(options_.window_bytes, state_slots, owned, mb, sb));
    if (!io_) io_ = std::make_unique<zero::detail::UpdateWorker>();
    for (Slot& s : slots_) s = Slot{};
  }
  // Before allocate(): the run's options and this rank.
  void configure(const NvmeOptions& options, int rank) {
    options_ = options;
    rank_ = rank;
  }
  bool owns_master() const { return true; }
  const DiskSwap& swap() const { return *swap_; }
  std::size_t chunk_elements() const { return chunk_; }

  // A remainder master is split with (joined from) the bf16 copy at `copy`.
  template <class Param>
  void import_values(StateSlot slot, std::size_t offset, const float* host, std::size_t n, Param* copy) {
    if (slot.is_master() && remainder()) {
      if constexpr (std::is_same_v<Param, bf16>)
        transfer(slot, offset, n, [&](void* stored, std::size_t done, std::size_t count) {
          auto* rest = static_cast<std::uint16_t*>(stored);
          for (std::size_t i = 0; i < count; ++i) split_master(host[done + i], copy[done + i], rest[i]);
          return true;
        });
      return;
    }
    if (!slot.is_master() && bf16_states()) {
      transfer(slot, offset, n, [&](void* stored, std::size_t done, std::size_t count) {
        auto* low = static_cast<bf16*>(stored);
        for (std::size_t i = 0; i < count; ++i) low[i] = from_float<bf16>(host[done + i]);
        return true;
      });
      return;
    }
    transfer(slot, offset, n, [&](void* stored, std::size_t done, std::size_t count) {
      std::memcpy(stored, host + done, count * sizeof(float));
      return true;
    });
  }
  template <class Param>
  void export_values(StateSlot slot, std::size_t offset, float* host, std::size_t n, const Param* copy) {
    if (slot.is_master() && remainder()) {
      if constexpr (std::is_same_v<Param, bf16>)
        transfer(slot, offset, n, [&](void* stored, std::size_t done, std::size_t count) {
          const auto* rest = static_cast<const std::uint16_t*>(stored);
          for (std::size_t i = 0; i < count; ++i) host[done + i] = join_master(copy[done + i], rest[i]);
          return false;
        });
      return;
    }
    if (!slot.is_master() && bf16_states()) {
      transfer(slot, offset, n, [&](void* stored, std::size_t done, std::size_t count) {
        const auto* low = static_cast<const bf16*>(stored);
        for (std::size_t i = 0; i < count; ++i) host[done + i] = to_float(low[i]);
        return false;
      });
      return;
    }
    transfer(slot, offset, n, [&](void* stored, std::size_t done, std::size_t count) {
      std::memcpy(host + done, stored, count * sizeof(float));
      return false;
    });
  }

  // The fused step over owned elements [offset, offset + args.n), chunk by
  // chunk through the window (calls come in increasing offset order within a
  // step, as the engine walks its units). fp32 parameters (Param = float)
  // get the updated master copied into args.param when it is given, since
  // the master's window slot is reused.
  template <class Grad, class Param>
  void update(std::size_t offset, kernels::FusedStepArgs<Optimizer, Grad, Param>& args) {
    require(offset <= owned_ && args.n <= owned_ - offset, "offload::Nvme: update of owned elements [", offset, ", ",
            offset + args.n, ") outside this rank's ", owned_);
    const std::size_t end = offset + args.n;
    for (std::size_t c = offset / chunk_; c * chunk_ < end; ++c) {
      const int s = resident(c);
      prefetch(c + 1);
      const std::size_t lo = std::max(offset, c * chunk_), hi = std::min(end, (c + 1) * chunk_);
      const std::size_t at = lo - c * chunk_, skip = lo - offset;
      kernels::FusedStepArgs<Optimizer, Grad, Param> part = args.part(skip, hi - lo);
      if constexpr (kernels::FusedStepArgs<Optimizer, Grad, Param>::can_split_master) {
        if (remainder()) {
          part.master = nullptr;
          part.remainder = remainders(s) + at;
        } else {
          part.master = array(s, 0) + at;
        }
      } else {
        part.master = array(s, 0) + at;
      }
      for (int k = 0; k < state_slots; ++k) {
        if (bf16_states())
          part.state16[k] = reinterpret_cast<bf16*>(array(s, 1 + k)) + at;
        else
          part.state[k] = array(s, 1 + k) + at;
      }
      compute_while_io([&] { backend::Ops<backend::Host>::fused_step(part); });
      if constexpr (std::is_same_v<Param, float>)
        if (args.param != nullptr) std::memcpy(part.param, part.master, part.n * sizeof(float));
      slots_[s].dirty = true;
      // Written behind as soon as the update has passed the chunk's end.
      if (hi == std::min(owned_, (c + 1) * chunk_)) write_back(s);
    }
  }

  PlacedBytes master_bytes() const { return {0, 0, static_cast<std::uint64_t>(owned_) * master_bytes_each()}; }
  PlacedBytes state_bytes() const {
    return {0, 0, static_cast<std::uint64_t>(owned_) * state_bytes_each() * static_cast<std::uint64_t>(state_slots)};
  }
  // The host window (not model state: it holds three chunks in passing).
  std::uint64_t window_bytes() const { return window_.bytes(); }

 private:
  static constexpr std::size_t none = static_cast<std::size_t>(-1);
  struct Slot {
    std::size_t chunk = none;
    Ticket io{};         // the read or write in flight on it
    bool dirty = false;  // updated since read: must be written before reuse
    std::uint64_t used = 0;
  };

  // Runs `compute` while a second thread drives the swap's ring: as the
  // requests in flight complete it hands the disk the next ones queued (the
  // read ahead, the write behind) and checks their checksums, so the disk
  // never waits for the update to finish. Without it the ring only moves
  // when this thread calls the swap, and an update longer than the
  // queue_depth requests in flight at its start leaves the disk idle.
  // The worker stops at the first completion after the update ends, not
  // when the queue is empty: waiting for the queue to drain emptied the ring
  // at every chunk (the last requests of a chunk ran with ever fewer in
  // flight, then the next chunk's refilled it), 450-600 ms of I/O time per
  // step where the probe moved the same bytes in 390-450.
  // The swap is called by one thread at a time: the worker's start() and
  // wait() order its calls before and after this thread's.
  template <class Compute>
  void compute_while_io(Compute&& compute) {
    if (swap_->poll()) {  // nothing queued or in flight
      compute();
      return;
    }
    computing_.store(true, std::memory_order_relaxed);
    io_->start([this] {
      while (computing_.load(std::memory_order_acquire) && !swap_->wait_some()) {
      }
    });
    struct Done {  // however compute() ends, the worker stops at its next completion
      std::atomic<bool>& flag;
      ~Done() { flag.store(false, std::memory_order_release); }
    };
    try {
      Done done{computing_};
      compute();
    } catch (...) {
      try {
        io_->wait();
      } catch (...) {  // the update's error is the one to report
      }
      throw;
    }
    io_->wait();  // rethrows an I/O error
  }

  bool remainder() const { return master_format_ == MasterWeights::remainder; }
  bool bf16_states() const { return state_format_ != StateFormat::fp32; }
  std::size_t master_bytes_each() const { return master_element_bytes(master_format_); }
  std::size_t state_bytes_each() const { return state_element_bytes(state_format_); }
  std::size_t record_bytes() const { return record_floats_ * sizeof(float); }
  // Array a of window slot `slot`: 0 the master, 1 + k state slot k (a
  // chunk is a multiple of 2048 elements where an array is 2-byte: whole floats).
  float* array(int slot, int a) {
    const std::size_t master_floats = chunk_ * master_bytes_each() / sizeof(float);
    const std::size_t state_floats = chunk_ * state_bytes_each() / sizeof(float);
    return window_.data() + static_cast<std::size_t>(slot) * record_floats_ +
           (a == 0 ? 0 : master_floats + static_cast<std::size_t>(a - 1) * state_floats);
  }
  std::uint16_t* remainders(int slot) { return reinterpret_cast<std::uint16_t*>(array(slot, 0)); }
  // The slot holding chunk c, read in and with no transfer on it in flight
  // (the update may modify it).
  int resident(std::size_t c) {
    int s = find(c);
    if (s < 0) {
      s = victim(none);
      start_read(s, c);
    }
    swap_->wait(slots_[s].io);
    slots_[s].used = ++clock_;
    return s;
  }
  // Starts reading chunk c into a free slot unless it is there already.
  void prefetch(std::size_t c) {
    if (c >= chunks_ || find(c) >= 0) return;
    start_read(victim(c - 1), c);
  }
  void start_read(int s, std::size_t c) {
    Slot& slot = slots_[s];
    swap_->wait(slot.io);  // its write-behind
    slot.chunk = c;
    slot.dirty = false;
    slot.io = swap_->read(c * record_bytes(), array(s, 0), record_bytes());
  }
  void write_back(int s) {
    Slot& slot = slots_[s];
    slot.io = swap_->write(slot.chunk * record_bytes(), array(s, 0), record_bytes());
    slot.dirty = false;
  }
  int find(std::size_t c) const {
    for (int s = 0; s < window_slots; ++s)
      if (slots_[s].chunk == c) return s;
    return -1;
  }
  // The least recently used slot other than the one holding `keep`,
  // written back first if it holds changes.
  int victim(std::size_t keep) {
    int best = -1;
    for (int s = 0; s < window_slots; ++s) {
      if (keep != none && slots_[s].chunk == keep) continue;
      if (best < 0 || slots_[s].used < slots_[best].used) best = s;
    }
    if (slots_[best].dirty) {
      swap_->wait(slots_[best].io);
      write_back(best);
    }
    return best;
  }
  // Owned elements [offset, offset + n) of one array, chunk by chunk:
  // visit(stored, done, count) reads or fills them and returns whether it
  // changed them (they are then written back at once).
  template <class Visit>
  void transfer(StateSlot slot, std::size_t offset, std::size_t n, Visit&& visit) {
    require(offset <= owned_ && n <= owned_ - offset, "offload::Nvme: owned elements [", offset, ", ", offset + n,
            ") are outside this rank's ", owned_);
    require(slot.is_master() || (slot.index >= 0 && slot.index < state_slots), "offload::Nvme: the optimizer has ",
            state_slots, " state slot(s), not slot ", slot.index);
    const int a = slot.is_master() ? 0 : 1 + slot.index;
    for (std::size_t c = offset / chunk_; n != 0 && c * chunk_ < offset + n; ++c) {
      const int s = resident(c);
      const std::size_t lo = std::max(offset, c * chunk_), hi = std::min(offset + n, (c + 1) * chunk_);
      const std::size_t bytes = a == 0 ? master_bytes_each() : state_bytes_each();
      void* stored = reinterpret_cast<char*>(array(s, a)) + (lo - c * chunk_) * bytes;
      if (visit(stored, lo - offset, hi - lo)) {
        write_back(s);
        swap_->wait(slots_[s].io);
      }
    }
  }

  NvmeOptions options_{};
  int rank_ = 0;
  std::size_t owned_ = 0, chunk_ = 0, chunks_ = 0, record_floats_ = 0;
  MasterWeights master_format_ = MasterWeights::fp32;  // remainder: array 0 holds 16-bit remainders
  StateFormat state_format_ = StateFormat::fp32;        // bf16*: arrays 1.. hold bf16
  std::unique_ptr<DiskSwap> swap_;
  AlignedBuffer<float> window_;
  std::array<Slot, window_slots> slots_{};
  std::uint64_t clock_ = 0;
  std::unique_ptr<zero::detail::UpdateWorker> io_;  // drives the swap during the update
  std::atomic<bool> computing_{false};               // the update runs: io_ keeps driving the swap
};

}  // namespace zero::offload

// What the engine is handed for the disk tier (engine/state_store.hpp).
#define ZERO_HAVE_DISK_TIER 1
namespace zero::offload {
struct DiskTier {
  template <optim::Policy Optimizer, class Grad, class Param>
  static std::unique_ptr<AnyStateStore<Optimizer, Grad, Param>> make(const Options& options, int rank,
                                                                      std::size_t owned);
  template <optim::Policy Optimizer, class Grad, class Param>
  static constexpr DiskStoreMaker<Optimizer, Grad, Param> maker() {
    return &make<Optimizer, Grad, Param>;
  }
};
// (Outside the class, so not inline: an `extern template` of it,
// zero/runtime/precompiled.hpp, keeps the store out of the files that name it.)
template <optim::Policy Optimizer, class Grad, class Param>
std::unique_ptr<AnyStateStore<Optimizer, Grad, Param>> DiskTier::make(const Options& options, int rank,
                                                                       std::size_t owned) {
  auto model = std::make_unique<StoreModel<DiskStateStore<Optimizer>, Optimizer, Grad, Param>>();
  model->store.configure(options.nvme, rank);
  model->store.allocate(owned, options.master, options.states);
  return model;
}
}  // namespace zero::offload
namespace zero::detail {
template <>
struct DiskTierOf<offload::Nvme> {
  using type = offload::DiskTier;
};
}  // namespace zero::detail

#if defined(ZERO_PRECOMPILED_DISK_TIER)  // compiled once elsewhere (zero/runtime/precompiled.hpp)
#include "zero/runtime/precompiled.hpp"
ZERO_EXTERN_DISK_STORES()
#endif
