// Why: between backward and the update every rank's gradients must become
// their sum, and which part of the sum a rank keeps is what the stages are
// about. This part owns that path: where the caller writes a unit's gradient
// (the staging of its bucket, or the accumulator itself where no staging is
// needed), the buckets whose reductions are launched together, the fp32
// widening of 16-bit gradients, and the accumulator across micro-batches
// (the whole gradient at stages 0-1, this rank's shard at stages 2-3). Its
// collectives, all on the communication lane (CommChannel):
//   stage 0     all_reduce of each bucket, on the window's last micro-batch;
//   stage 1     reduce_scatter of every unit, once, at the step (reduce_at_step);
//   stages 2-3  reduce_scatter of each bucket as it fills, every micro-batch.
// It reads the stage as a value (StagePlan), not a type.
//
// Contract, per micro-batch: hand_out(u) then ready(u) for every unit, one
// unit at a time (a complete bucket is reduced as it fills); at the step,
// require_all_ready() and end_micro_batch() reduce what is pending.
#pragma once

#include "zero/config.hpp"

#include <cstddef>
#include <vector>

#include "zero/comm/communicator.hpp"
#include "zero/engine/buffer_sizes.hpp"
#include "zero/engine/comm_channel.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/stage_plan.hpp"
#include "zero/error.hpp"
#include "zero/precision/types.hpp"

namespace zero::detail {

template <class Ops, class G>
class GradientReducer {
 public:
  template <class E>
  using Buffer = typename Ops::template Buffer<E>;

  // The buffers finalize() allocated (sizes from buffer_sizes.hpp).
  struct Buffers {
    Buffer<G> accumulator;       // whole (stages 0-1) or this rank's shard of every unit (2-3)
    Buffer<G> staging;           // where the caller writes a unit's gradient, per staging set
    Buffer<float> staging_fp32;  // 16-bit gradients widened to reduce in fp32 (empty: reduce as they are)
    Buffer<G> shard_staging;     // a bucket's reduce-scatter results before accumulation
  };

  // At finalize(). `in_place`: the caller writes into the accumulator
  // (gradients_in_place); `sets` staging sets (2 with overlap); staging set
  // s's event is s on the channel.
  void bind(Buffers buffers, GradientBuckets buckets, StagePlan plan, bool in_place, std::size_t sets,
            const Layout& layout, CommChannel<Ops>& channel) {
    b_ = std::move(buffers);
    buckets_ = std::move(buckets);
    plan_ = plan;
    in_place_ = in_place;
    sets_ = sets;
    layout_ = &layout;
    channel_ = &channel;
    pending_.reserve(buckets_.max_units);
    ready_this_micro_.assign(layout.units().size(), false);
  }

  G* accumulator() { return b_.accumulator.data(); }
  std::uint64_t accumulator_bytes() const { return b_.accumulator.bytes(); }
  std::uint64_t staging_bytes() const {
    return b_.staging.bytes() + b_.staging_fp32.bytes() + b_.shard_staging.bytes();
  }
  // Where finished shards are also copied, asynchronously, on the window's
  // last micro-batch (stages 2-3 with offload: the host copy the CPU update
  // reads, unit u's shard at u.shard_offset), or nullptr.
  void copy_final_shards_to(G* host) { final_copy_ = host; }
  // A unit was ready in this micro-batch: backward is under way (stage 3
  // prefetches downwards then).
  bool in_backward() const { return in_backward_; }

  // Where this micro-batch's gradient of unit u goes. `first`/`last`: this
  // micro-batch's place in the accumulation window (a unit of another bucket
  // flushes the pending part of the current one first).
  G* hand_out(std::size_t unit, bool first, bool last) {
    // (a branch, not require(): the message names the unit handed out, which
    // exists only when the check fails)
    if (handed_unit_ >= 0 && handed_unit_ != static_cast<int>(unit))
      throw InvalidArgument(concat(
          "grad_buffer('", layout_->units()[unit].name, "'): the gradient of unit '",
          layout_->units()[static_cast<std::size_t>(handed_unit_)].name,
          "' was handed out but grad_ready() was not called for it; finish one unit's backward before the next"));
    if (handed_unit_ < 0) {  // not handed out yet (grad_buffer may be called again for the same unit)
      const UnitInfo& u = layout_->units()[unit];
      // A unit of another bucket (backward out of the usual order): the
      // pending part of the current bucket is reduced first.
      if (!pending_.empty() && buckets_.bucket_of[pending_.front().unit] != buckets_.bucket_of[unit])
        flush(first, last);
      if (in_place_) {
        handed_ = b_.accumulator.data() + u.full_offset;
      } else {
        // A new bucket reuses a staging set: its previous bucket must be reduced.
        if (pending_.empty()) channel_->wait(staging_event(set_));
        handed_ = b_.staging.data() + staging_offset(unit);
      }
      handed_unit_ = static_cast<int>(unit);
    }
    return handed_;
  }

  // Unit u's gradient is written; a complete bucket is reduced now (while
  // the caller's backward goes on, on a GPU), the last one at the step.
  void ready(std::size_t unit, bool first, bool last) {
    const UnitInfo& u = layout_->units()[unit];
    require(handed_unit_ == static_cast<int>(unit), "grad_ready('", u.name,
            "'): call grad_buffer() for this unit and write its gradient first");
    require(!ready_this_micro_[unit], "grad_ready('", u.name,
            "') twice in one micro-batch; call step() after each micro-batch");
    for (const auto& [b, e] : u.gaps) Ops::zero(handed_ + b, e - b);
    pending_.push_back(Pending{unit, handed_});
    if (pending_.size() == buckets_.of(unit).units) flush(first, last);
    ready_this_micro_[unit] = true;
    handed_unit_ = -1;
    in_backward_ = true;
  }

  // At step(): every unit must have had its gradient in this micro-batch.
  void require_all_ready() const {
    const auto& units = layout_->units();
    for (std::size_t i = 0; i < units.size(); ++i)
      require(ready_this_micro_[i], "step(): unit '", units[i].name,
              "' has no gradient in this micro-batch; call grad_buffer()/grad_ready() for every unit before step()");
  }
  // The micro-batch is over (require_all_ready held): the pending bucket is
  // reduced.
  void end_micro_batch(bool first, bool last) {
    flush(first, last);
    std::fill(ready_this_micro_.begin(), ready_this_micro_.end(), false);
    in_backward_ = false;
  }

  // Launches the reductions of every pending gradient.
  void flush(bool first, bool last) {
    if (pending_.empty()) return;
    constexpr DType gdt = dtype_traits<G>::dtype;
    const bool in_fp32 = b_.staging_fp32.size() != 0;
    auto wide = [&](const Pending& p) { return b_.staging_fp32.data() + staging_offset(p.unit); };
    auto& comm = *channel_;
    // All of it on the communication lane (no-op without overlap), after the
    // backward that wrote these gradients; the caller's backward of the next
    // units goes on meanwhile.
    auto lane = comm.lane();
    // Three phases, so that a communicator may launch the bucket's
    // collectives as one group: what they read is prepared first, what reads
    // their results runs after.
    if (!plan_.reduce_scatter_on_flush) {
      // Keep the whole gradient; stage 0 all-reduces it on the last micro-batch.
      const bool all_reduce = plan_.all_reduce_on_flush && last;
      for (const Pending& p : pending_) {
        const UnitInfo& u = layout_->units()[p.unit];
        G* acc = b_.accumulator.data() + u.full_offset;
        if (p.written != acc) Ops::accumulate(acc, p.written, u.padded, first);
        if (all_reduce && in_fp32) Ops::convert(wide(p), acc, u.padded);
      }
      if (all_reduce) {
        comm->group_begin();
        for (const Pending& p : pending_) {
          const UnitInfo& u = layout_->units()[p.unit];
          if (in_fp32)
            comm->all_reduce(wide(p), u.padded, DType::f32, comm::ReduceOp::sum, false);
          else
            comm->all_reduce(b_.accumulator.data() + u.full_offset, u.padded, gdt, comm::ReduceOp::sum, false);
        }
        comm->group_end();
        if (in_fp32)
          for (const Pending& p : pending_) {
            const UnitInfo& u = layout_->units()[p.unit];
            Ops::convert(b_.accumulator.data() + u.full_offset, wide(p), u.padded);
          }
      }
    } else {
      // Stages 2 and 3: reduce-scatter, keep only this rank's shard.
      const std::size_t r = static_cast<std::size_t>(comm.rank());
      if (in_fp32)
        for (const Pending& p : pending_) Ops::convert(wide(p), p.written, layout_->units()[p.unit].padded);
      comm->group_begin();
      for (const Pending& p : pending_) {
        const UnitInfo& u = layout_->units()[p.unit];
        if (in_fp32)
          comm->reduce_scatter(wide(p), wide(p) + r * u.shard, u.shard, DType::f32);
        else
          comm->reduce_scatter(p.written, b_.shard_staging.data() + shard_staging_offset(p.unit), u.shard, gdt);
      }
      comm->group_end();
      for (const Pending& p : pending_) {
        const UnitInfo& u = layout_->units()[p.unit];
        G* acc = b_.accumulator.data() + u.shard_offset;
        if (in_fp32)
          Ops::accumulate(acc, wide(p) + r * u.shard, u.shard, first);
        else
          Ops::accumulate(acc, b_.shard_staging.data() + shard_staging_offset(p.unit), u.shard, first);
        // Offload: the finished shard leaves for the host while backward goes on.
        if constexpr (requires(G* d, const G* s, std::size_t n) { Ops::download_async(d, s, n); })
          if (last && final_copy_ != nullptr) Ops::download_async(final_copy_ + u.shard_offset, acc, u.shard);
      }
    }
    comm.mark(staging_event(set_));
    set_ = (set_ + 1) % sets_;
    pending_.clear();
  }

  // Stage 1, at the step: reduce-scatters the accumulated whole gradient of
  // every unit in place (this rank's shard of the sum lands at its position).
  void reduce_at_step() {
    if (!plan_.reduce_scatter_at_step) return;
    constexpr DType gdt = dtype_traits<G>::dtype;
    auto& comm = *channel_;
    const std::size_t r = static_cast<std::size_t>(comm.rank());
    comm.communicate([&] {
      for (const auto& u : layout_->units()) {
        G* g = b_.accumulator.data() + u.full_offset;
        G* mine = g + r * u.shard;
        if (b_.staging_fp32.size() != 0) {
          float* wide = b_.staging_fp32.data();
          Ops::convert(wide, g, u.padded);
          float* wmine = wide + r * u.shard;
          comm->reduce_scatter(wide, wmine, u.shard, DType::f32);
          Ops::convert(mine, wmine, u.shard);
        } else {
          comm->reduce_scatter(g, mine, u.shard, gdt);
        }
      }
    });
  }

 private:
  static constexpr std::size_t staging_event(std::size_t set) { return set; }
  // Where unit u's gradient is staged in the current set (its bucket's units
  // lie back to back; a set holds the largest bucket), and its shard's
  // reduce-scatter result.
  std::size_t staging_offset(std::size_t u) const { return set_ * buckets_.max_elements + buckets_.offset[u]; }
  std::size_t shard_staging_offset(std::size_t u) const {
    return set_ * buckets_.max_shard_elements + buckets_.shard_offset[u];
  }

  struct Pending {
    std::size_t unit;
    G* written;  // where the caller wrote the gradient
  };

  Buffers b_;
  GradientBuckets buckets_;  // units whose reductions are launched together (buffer_sizes.hpp)
  StagePlan plan_{};
  bool in_place_ = false;
  std::size_t sets_ = 1;
  const Layout* layout_ = nullptr;
  CommChannel<Ops>* channel_ = nullptr;
  std::size_t set_ = 0;                   // the staging set the current bucket uses
  std::vector<Pending> pending_;          // ready but not yet reduced, all of one bucket (capacity reserved)
  G* handed_ = nullptr;                   // the buffer hand_out() returned
  int handed_unit_ = -1;                  // unit whose gradient buffer is handed out
  std::vector<bool> ready_this_micro_;    // ready() seen for each unit in this micro-batch
  bool in_backward_ = false;
  G* final_copy_ = nullptr;
};

}  // namespace zero::detail
