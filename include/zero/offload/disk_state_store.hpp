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
// each state slot C floats, C bf16 values (StateFormat::bf16*), or C 8-bit
// codes (StateFormat::blockwise8). A record is a multiple of 4096 bytes
// (O_DIRECT), and the window is three records.
//
// 8-bit states: a chunk ends before a block it would cut (a block is
// quantized with one absmax from all its values, so it is updated in one
// piece: engine/detail/disk_window.hpp), so chunk c begins at the owned element
// the chunk table says, not at c * C. The codes of every owned element are
// on disk (those of the few small parameters that keep fp32 state unused);
// each block's absmax and the small parameters' fp32 state, 0.2% and a few
// elements, stay in host memory, where the step reads them beside the
// window (engine/detail/state_blocks.hpp's runs say which is which).
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "zero/backend/host.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/reports.hpp"
#include "zero/engine/detail/state_blocks.hpp"
#include "zero/engine/detail/state_store.hpp"
#include "zero/engine/detail/update_worker.hpp"
#include "zero/error.hpp"
#include "zero/kernels/fused_step.hpp"
#include "zero/offload/aligned_buffer.hpp"
#include "zero/offload/disk_shard_pages.hpp"
#include "zero/offload/disk_swap.hpp"
#include "zero/engine/detail/disk_window.hpp"

namespace zero::offload {

template <optim::Policy Optimizer>
class DiskStateStore {
 public:
  static constexpr int state_slots = Optimizer::state_slots;
  static constexpr int window_slots = static_cast<int>(disk_window_chunks);  // read ahead, update, write behind

  // Creates the swap file for `owned` elements (the master always: it lives
  // on disk) and the window, 4 KiB aligned for O_DIRECT, which is why this
  // store allocates its own memory instead of taking the engine's buffers.
  // `blocks`: StateFormat::blockwise8's runs of this rank's owned elements
  // (engine/detail/state_blocks.hpp); ignored otherwise.
  void allocate(std::size_t owned, MasterWeights format, StateFormat states, const StateBlocks& blocks) {
    require(!options_.directory.empty(),
            "offload::Nvme: Options::nvme.directory is empty; name a directory on a fast local disk for the swap "
            "files of the master weights and optimizer state");
    // Three chunks of at least one 4 KiB block per array; a smaller window
    // would be silently exceeded.
    master_format_ = format;
    state_format_ = states;
    const std::size_t mb = master_bytes_each(), sb = state_bytes_each();
    const std::string window =
        disk_window_problem(options_.window_bytes, state_slots, mb, sb, name(format), name(states), Optimizer::name);
    require(window.empty(), "offload::Nvme: ", window, disk_window_advice);
    owned_ = owned;
    chunk_ = disk_chunk_elements(options_.window_bytes, state_slots, owned, mb, sb);
    blocks_ = blockwise() ? blocks : StateBlocks{};  // without 8-bit runs, chunks cut anywhere
    if (blockwise()) {
      const std::size_t covered = blocks_.runs().empty() ? 0 : blocks_.runs().back().end();
      require(covered == owned, "offload::Nvme: the 8-bit state's runs cover ", covered, " of ", owned,
              " owned elements");
      for (int k = 0; k < state_slots; ++k) {
        absmax_[k].assign(blocks_.blocks(), 0.0f);
        small_[k].assign(blocks_.fp32_elements(), 0.0f);
        code_[k] = quant::code_for(optim::state_values<Optimizer>(k) == optim::StateValues::non_negative);
      }
    }
    starts_ = disk_chunk_starts(chunk_, owned, blocks_);
    record_floats_ = chunk_ * disk_record_element_bytes(state_slots, mb, sb) / sizeof(float);
    // Sized by disk_window.hpp, which the planner's schedule reads too.
    swap_ = std::make_unique<DiskSwap>(disk_records_bytes(chunks(), chunk_, state_slots, mb, sb),
                                       disk_options(options_), rank_);
    window_ = AlignedBuffer<float>(disk_window_elements(options_.window_bytes, state_slots, owned, mb, sb));
    written_.assign(chunks(), false);
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
    if (!slot.is_master() && blockwise()) {
      blockwise_values(slot, offset, host, nullptr, n);
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
    if (!slot.is_master() && blockwise()) {
      blockwise_values(slot, offset, nullptr, host, n);
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
    using Args = kernels::FusedStepArgs<Optimizer, Grad, Param>;
    require(offset <= owned_ && args.n <= owned_ - offset, "offload::Nvme: update of owned elements [", offset, ", ",
            offset + args.n, ") outside this rank's ", owned_);
    if (args.n == 0) return;
    const std::size_t end = offset + args.n;
    for (std::size_t c = chunk_holding(offset); c < chunks() && starts_[c] < end; ++c) {
      const int s = resident(c);
      prefetch(c + 1);
      const std::size_t lo = std::max(offset, starts_[c]), hi = std::min(end, starts_[c + 1]);
      const std::size_t at = lo - starts_[c];
      Args part = args.part(lo - offset, hi - lo);
      if constexpr (Args::can_split_master) {
        if (remainder()) {
          part.master = nullptr;
          part.remainder = remainders(s) + at;
        } else {
          part.master = array(s, 0) + at;
        }
      } else {
        part.master = array(s, 0) + at;
      }
      compute_while_io([&] {
        if (blockwise()) {
          update_runs(s, c, lo, part);
          return;
        }
        for (int k = 0; k < state_slots; ++k) {
          if (bf16_states())
            part.state16[k] = reinterpret_cast<bf16*>(array(s, 1 + k)) + at;
          else
            part.state[k] = array(s, 1 + k) + at;
        }
        backend::Ops<backend::Host>::fused_step(part);
      });
      if constexpr (std::is_same_v<Param, float>)
        if (args.param != nullptr) std::memcpy(part.param, part.master, part.n * sizeof(float));
      slots_[s].dirty = true;
      // Written behind as soon as the update has passed the chunk's end.
      if (hi == starts_[c + 1]) write_back(s);
    }
  }

  PlacedBytes master_bytes() const { return {0, 0, static_cast<std::uint64_t>(owned_) * master_bytes_each()}; }
  // 8-bit states: the codes on disk, the absmax and small parameters' fp32
  // state in host memory.
  PlacedBytes state_bytes() const {
    PlacedBytes placed{0, 0, static_cast<std::uint64_t>(owned_) * state_bytes_each() * static_cast<std::uint64_t>(state_slots)};
    for (int k = 0; k < state_slots; ++k) placed.host += (absmax_[k].size() + small_[k].size()) * sizeof(float);
    return placed;
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

  // The 8-bit step over chunk c's owned elements [lo, lo + args.n), its
  // record in window slot s: one fused step per piece of a run, each
  // pointed at its codes in the record and its absmax (or, for a small
  // parameter's run, its fp32 state) in host memory. A piece begins at a
  // block's first element (the chunk table cuts no block).
  template <class Args>
  void update_runs(int s, std::size_t c, std::size_t lo, const Args& args) {
    blocks_.step_pieces("offload::Nvme", lo, args, [&](Args& part, const StateBlocks::Piece& piece) {
      for (int k = 0; k < state_slots; ++k) {
        if (piece.blockwise) {
          part.state8[k] = codes(s, k) + (piece.begin - starts_[c]);
          part.absmax[k] = absmax_[k].data() + piece.first_block;
          part.code[k] = code_[k];
        } else {
          part.state[k] = small_[k].data() + piece.at;
        }
      }
      backend::Ops<backend::Host>::fused_step(part);
    });
  }

  // 8-bit state slot values of owned elements [offset, offset + n) from
  // `in` (an import) or to `out`, chunk by chunk: a block's codes are in
  // one chunk's record, its absmax and the fp32 runs in host memory.
  void blockwise_values(StateSlot slot, std::size_t offset, const float* in, float* out, std::size_t n) {
    const bool import = in != nullptr;
    require(offset <= owned_ && n <= owned_ - offset, "offload::Nvme: owned elements [", offset, ", ", offset + n,
            ") are outside this rank's ", owned_);
    require(slot.index >= 0 && slot.index < state_slots, "offload::Nvme: the optimizer has ", state_slots,
            " state slot(s), not slot ", slot.index);
    if (n == 0) return;
    const int k = slot.index;
    for (std::size_t c = chunk_holding(offset); c < chunks() && starts_[c] < offset + n; ++c) {
      const std::size_t lo = std::max(offset, starts_[c]), hi = std::min(offset + n, starts_[c + 1]);
      bool changed = false;
      int s = -1;
      blocks_.each_run(lo, hi - lo, [&](const StateRun& run) {
        const std::size_t from = std::max(lo, run.begin), to = std::min(hi, run.end());
        const float* source = import ? in + (from - offset) : nullptr;
        float* target = import ? nullptr : out + (from - offset);
        if (!run.blockwise) {  // host memory only
          float* values = small_[k].data() + run.at + (from - run.begin);
          if (import)
            std::copy(source, source + (to - from), values);
          else
            std::copy(values, values + (to - from), target);
          return;
        }
        if (s < 0) s = resident(c);
        const quant::PhasedBlocks geometry = blocks_.blocks_of(run);
        const TouchedBlocks touched(geometry, run.begin, from, to);
        blockwise_run_values(run, geometry, touched, from, to, code_[k],
                             codes(s, k) + (run.begin + touched.from - starts_[c]),
                             absmax_[k].data() + run.first_block + touched.first, source, target);
        changed |= import;
      });
      if (changed) slots_[s].dirty = true;  // written when its window slot is reused (victim())
    }
  }

  bool remainder() const { return master_format_ == MasterWeights::remainder; }
  bool blockwise() const { return state_format_ == StateFormat::blockwise8 && state_slots > 0; }
  bool bf16_states() const { return state_format_ == StateFormat::bf16 || state_format_ == StateFormat::bf16_stochastic; }
  std::size_t chunks() const { return starts_.size() - 1; }
  // The chunk holding owned element e (the last one for e == owned).
  std::size_t chunk_holding(std::size_t e) const {
    const auto it = std::upper_bound(starts_.begin() + 1, starts_.end() - 1, e);
    return static_cast<std::size_t>(it - starts_.begin()) - 1;
  }
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
  std::uint8_t* codes(int slot, int k) { return reinterpret_cast<std::uint8_t*>(array(slot, 1 + k)); }
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
    if (c >= chunks() || find(c) >= 0) return;
    start_read(victim(c - 1), c);
  }
  // A chunk never written is not read: its record starts as zeros, and
  // 8-bit codes as the code of 0.0 (as the in-memory store's), so a fresh
  // state exports as +0.0 on every tier.
  void start_read(int s, std::size_t c) {
    Slot& slot = slots_[s];
    swap_->wait(slot.io);  // its write-behind
    slot.chunk = c;
    slot.dirty = false;
    if (written_[c]) {
      slot.io = swap_->read(c * record_bytes(), array(s, 0), record_bytes());
      return;
    }
    slot.io = Ticket{};
    std::memset(array(s, 0), 0, record_bytes());
    if (blockwise())
      for (int k = 0; k < state_slots; ++k) std::memset(codes(s, k), quant::quantize(0.0f, code_[k]), chunk_);
  }
  void write_back(int s) {
    Slot& slot = slots_[s];
    slot.io = swap_->write(slot.chunk * record_bytes(), array(s, 0), record_bytes());
    slot.dirty = false;
    written_[slot.chunk] = true;
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
  // changed them. A changed chunk is written when its window slot is reused
  // (victim()), not at once: a checkpoint's import comes a unit and a slot
  // at a time, and writing the whole record after each wrote every record
  // once per unit and slot it holds.
  template <class Visit>
  void transfer(StateSlot slot, std::size_t offset, std::size_t n, Visit&& visit) {
    require(offset <= owned_ && n <= owned_ - offset, "offload::Nvme: owned elements [", offset, ", ", offset + n,
            ") are outside this rank's ", owned_);
    require(slot.is_master() || (slot.index >= 0 && slot.index < state_slots), "offload::Nvme: the optimizer has ",
            state_slots, " state slot(s), not slot ", slot.index);
    const int a = slot.is_master() ? 0 : 1 + slot.index;
    if (n == 0) return;
    for (std::size_t c = chunk_holding(offset); c < chunks() && starts_[c] < offset + n; ++c) {
      const int s = resident(c);
      const std::size_t lo = std::max(offset, starts_[c]), hi = std::min(offset + n, starts_[c + 1]);
      const std::size_t bytes = a == 0 ? master_bytes_each() : state_bytes_each();
      void* stored = reinterpret_cast<char*>(array(s, a)) + (lo - starts_[c]) * bytes;
      if (visit(stored, lo - offset, hi - lo)) slots_[s].dirty = true;
    }
  }

  NvmeOptions options_{};
  int rank_ = 0;
  std::size_t owned_ = 0, chunk_ = 0, record_floats_ = 0;
  std::vector<std::size_t> starts_;  // chunk c: owned elements [starts_[c], starts_[c + 1]), record c
  std::vector<bool> written_;        // chunk c's record is on disk (else it is read as its fresh state)
  MasterWeights master_format_ = MasterWeights::fp32;  // remainder: array 0 holds 16-bit remainders
  StateFormat state_format_ = StateFormat::fp32;        // bf16*: arrays 1.. hold bf16; blockwise8: codes
  // StateFormat::blockwise8: the runs, and in host memory each slot's block
  // absmax and small parameters' fp32 state, and the code tables.
  StateBlocks blocks_;
  std::vector<float> absmax_[state_slots > 0 ? state_slots : 1];
  std::vector<float> small_[state_slots > 0 ? state_slots : 1];
  const float* code_[state_slots > 0 ? state_slots : 1] = {};
  std::unique_ptr<DiskSwap> swap_;
  AlignedBuffer<float> window_;
  std::array<Slot, window_slots> slots_{};
  std::uint64_t clock_ = 0;
  std::unique_ptr<zero::detail::UpdateWorker> io_;  // drives the swap during the update
  std::atomic<bool> computing_{false};               // the update runs: io_ keeps driving the swap
};

}  // namespace zero::offload

// What the engine is handed for the disk tier (engine/detail/state_store.hpp).
#define ZERO_HAVE_DISK_TIER 1
namespace zero::offload {
struct DiskTier {
  template <optim::Policy Optimizer, class Grad, class Param>
  static std::unique_ptr<AnyStateStore<Optimizer, Grad, Param>> make(const Options& options, int rank,
                                                                      std::size_t owned, const StateBlocks& blocks);
  // Stage 3's parameter or gradient shards (one file each).
  template <class T>
  static std::unique_ptr<zero::detail::ShardPages<T>> make_shards(const Options& options, int rank,
                                                                  const Layout& layout) {
    return std::make_unique<DiskShardPages<T>>(options, rank, layout);
  }
  template <optim::Policy Optimizer, class Grad, class Param>
  static constexpr DiskStoreMaker<Optimizer, Grad, Param> maker() {
    return {&make<Optimizer, Grad, Param>, &make_shards<Param>, &make_shards<Grad>};
  }
};
// (Outside the class, so not inline: an `extern template` of it,
// zero/runtime/precompiled.hpp, keeps the store out of the files that name it.)
template <optim::Policy Optimizer, class Grad, class Param>
std::unique_ptr<AnyStateStore<Optimizer, Grad, Param>> DiskTier::make(const Options& options, int rank,
                                                                       std::size_t owned, const StateBlocks& blocks) {
  auto model = std::make_unique<StoreModel<DiskStateStore<Optimizer>, Optimizer, Grad, Param>>();
  model->store.configure(options.nvme, rank);
  model->store.allocate(owned, options.master, options.states, blocks);
  return model;
}
}  // namespace zero::offload
namespace zero::detail {
template <>
struct DiskTierOf<offload::Nvme> {
  using type = offload::DiskTier;
};
}  // namespace zero::detail

#if defined(ZERO_PRECOMPILED_ENGINES)  // compiled once elsewhere, with the engines (zero/runtime/precompiled.hpp)
#include "zero/runtime/precompiled.hpp"
ZERO_EXTERN_DISK_STORES()
#endif
