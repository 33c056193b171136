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
// It reads the stage as a value (StageRules), not a type.
//
// Contract, per micro-batch, by Options::grad_writes:
//   overwrite   hand_out(u) then ready(u) for every unit, one unit at a time;
//               the caller assigns every element (checked in the run's
//               first micro-batch, against a marker the buffer is filled with);
//   accumulate  hand_out(u) for any unit, in any order, as often as needed
//               (zeroed when first handed out), ready(u) once it is final;
// a bucket is reduced once its last unit is ready (a staging set per open
// bucket). At the step, finish_units() and end_micro_batch() reduce the rest.
//
// With Options::qgz every reduce-scatter (stages 1-3) is QuantizedReducer's
// two quantized all-to-alls instead, unit by unit, summed in fp32.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "zero/comm/communicator.hpp"
#include "zero/engine/detail/buffer_sizes.hpp"
#include "zero/engine/detail/part_rows.hpp"
#include "zero/engine/detail/comm_channel.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/reports.hpp"
#include "zero/engine/detail/quantized_reducer.hpp"
#include "zero/engine/detail/shard_pages.hpp"
#include "zero/engine/stage_rules.hpp"
#include "zero/error.hpp"
#include "zero/kernels/fused_step.hpp"
#include "zero/precision/convert.hpp"
#include "zero/precision/types.hpp"

namespace zero::detail {

// GradWrites::overwrite, the run's first micro-batch: a handed-out gradient
// buffer is filled with a marker that a backward which assigns every element
// replaces, and one that forgets an element, or adds (+=) into it, keeps;
// check() names the first element still marked. No gradient a correct
// backward computes is refused:
//   - fp32 and bf16: the marker is a quiet NaN with a payload no arithmetic
//     produces (arithmetic on numbers makes the default NaN; on a NaN it
//     passes that NaN's payload on, so x86's `g += x` keeps the marker).
//     Adding to it through a conversion or on a GPU makes the canonical NaN
//     instead, so where nothing skips a non-finite gradient (no loss scaling)
//     an inf or NaN is refused here too, naming the element and both causes
//     (the step would refuse it anyway). Under loss scaling (the fp32 adapter
//     of an fp16 run) only the marker's own bits count: an inf or NaN there
//     may be an overflow, which the step skips.
//   - fp16: a NaN may be an overflow the loss scaler skips, and conversions
//     make every NaN the canonical one, so the marker is fp16's largest
//     finite value, 65504, which adding anything below 16 keeps, and which a
//     scaled gradient may also round to. So a micro-batch that shows it is
//     not refused: its step is skipped as an overflow (the scale halves,
//     nothing is updated) and the next micro-batch is checked again, where
//     the marker is refused. A gradient that rounded to 65504 is below it at
//     half the scale.
// Also the fp32 adapter's (zero/runtime/make_optimizer.hpp) over its own
// fp32 buffer.
template <class Ops, class G>
class UnwrittenCheck {
 public:
  // A micro-batch that shows fp16's marker is a suspicion, not an error (above).
  static constexpr bool tolerates_once = std::is_same_v<G, fp16>;

  // `loss_scaled`: an inf or NaN gradient may be an overflow (see above).
  void fill(G* g, std::size_t n, bool loss_scaled = tolerates_once) {
    loss_scaled_ = loss_scaled;
    host_.assign(n, marker());
    Ops::upload(g, host_.data(), n);
  }
  // Throws when unit u's gradient `g` holds marked elements; returns true
  // when it holds fp16's marker in the first micro-batch that shows it (the
  // step must be skipped and the next micro-batch checked again).
  bool check(const Layout& layout, const UnitInfo& u, const G* g) {
    host_.resize(u.padded);
    Ops::download(host_.data(), g, u.padded);
    const G m = marker();
    // Of each kind: how many, and the first (its parameter and index).
    struct Found {
      std::size_t count = 0;
      const ParamInfo* param = nullptr;
      std::size_t index = 0;
      void add(const ParamInfo& p, std::size_t i) {
        if (count++ != 0) return;
        param = &p;
        index = i;
      }
    } unassigned, non_finite;
    std::size_t elements = 0;
    for (const std::size_t p : u.params) {
      const ParamInfo& info = layout.params()[p];
      elements += info.numel;
      for (std::size_t i = 0; i < info.numel; ++i) {
        const G& x = host_[info.offset + i];
        if (std::memcmp(&x, &m, sizeof(G)) == 0)
          unassigned.add(info, i);
        else if (!loss_scaled_ && !std::isfinite(to_float(x)))
          non_finite.add(info, i);
      }
    }
    if (unassigned.count == 0 && non_finite.count == 0) return false;
    if (tolerates_once && !seen_before_) {
      seen_now_ = true;
      return true;
    }
    const Found& named = unassigned.count != 0 ? unassigned : non_finite;
    const std::string what = concat("grad_ready('", u.name, "'): ", named.count, " of ", elements,
                                    " gradient elements (the first: '", named.param->name, "'[", named.index, "])");
    const char* fix = "With Options::grad_writes = overwrite (the default) backward must assign (=) every element; a "
                      "backward that adds into its gradients (+=) or leaves some alone needs Options::grad_writes = "
                      "GradWrites::accumulate, which hands out zeroed buffers";
    if (unassigned.count == 0)
      throw InvalidArgument(concat(
          what, " hold inf or NaN in the run's first micro-batch: either backward added (+=) to the marker "
          "grad_buffer() filled them with (a NaN), or it computed inf or NaN itself, which with bf16/fp32 no loss "
          "scaling skips (check the loss and the learning rate). ", fix));
    throw InvalidArgument(concat(what, " were not assigned in the run's first micro-batch: ", marker_words(), ". ",
                                 fix));
  }
  // The micro-batch is over: whether it showed fp16's marker (then the next
  // one is checked too, and refuses it).
  bool micro_batch_over() {
    seen_before_ = seen_before_ || seen_now_;
    return std::exchange(seen_now_, false);
  }
  // The check is over: its host copy goes.
  void release() { std::vector<G>().swap(host_); }

 private:
  static G marker() {
    if constexpr (std::is_same_v<G, float>)
      return std::bit_cast<float>(std::uint32_t{0x7FE5A5A5});  // quiet NaN, payload 0x65A5A5
    else if constexpr (std::is_same_v<G, bf16>)
      return bf16{0x7FE5};  // quiet NaN, payload 0x25
    else
      return fp16{0x7BFF};  // 65504
  }
  static const char* marker_words() {
    if constexpr (tolerates_once)
      return "in two micro-batches running they hold the marker grad_buffer() filled them with (65504, fp16's "
             "largest value, which adding (+=) anything below 16 keeps; the first time, the step was skipped as an "
             "overflow in case a scaled gradient had rounded to it)";
    else
      return "they still hold the marker grad_buffer() filled them with (a NaN of its own)";
  }

  std::vector<G> host_;  // a unit's values on the host
  bool loss_scaled_ = tolerates_once;
  bool seen_now_ = false;      // fp16's marker, in this micro-batch
  bool seen_before_ = false;   // ... in an earlier one: refused now
};

// The reducer's buffers for a run (engine/detail/part_rows.hpp): the gradient
// accumulator and the buckets' staging, sized by buffer_sizes(). With
// Options::param_place = disk the accumulator's shards are on disk, read into
// pages (and the file's records padded to 4 KiB).
struct GradientRows {
  BufferRow accumulator, pages, file_padding, staging, staging_fp32, shard_staging;
  BufferRows list() const { return {accumulator, pages, file_padding, staging, staging_fp32, shard_staging}; }
};
inline GradientRows gradient_rows(const RunShape& run, const BufferSizes& z) {
  const Place at = backend_place(run);
  const std::uint64_t eb = run.element_bytes();
  const std::string fewer_units =
      "lower Options::bucket_bytes (a bucket holds at least one unit), or split the largest unit";
  constexpr auto comm = ReportedAs::communication_buffers;
  const bool disk = z.grad_file_bytes != 0;
  GradientRows r;
  r.accumulator = {"gradients", "grads", ReportedAs::grads, disk ? Place::disk : at, z.grads, eb,
                   disk ? "the shards are on disk: their pages are what memory holds"
                        : shard_it(run.stage.grads_sharded, "stages 2 and 3 shard the gradients: use stage<2> or "
                                                            "higher, or more ranks")};
  if (disk) {
    r.pages = {"gradient pages (Options::param_place = disk: prefetch_units + 2 of the largest shard)", "grads",
               ReportedAs::grads, at, z.grad_pages, eb, "lower Options::prefetch_units, or split the largest units"};
    r.file_padding = {"gradient file (rounded to whole 4 KiB records)", "grad_file_padding", ReportedAs::not_reported,
                      Place::disk, z.grad_file_bytes - z.grads * eb, 1, ""};
  }
  r.staging = {"gradient staging (one bucket)", "gradient_staging", comm, at, z.grad_staging, eb, fewer_units};
  r.staging_fp32 = {"fp32 reduction staging", "reduce_staging_fp32", comm, at, z.reduce_staging_fp32, 4,
                    "Options::reduce_dtype = ReduceDType::same_as_grad needs none; or " + fewer_units};
  r.shard_staging = {"reduce-scatter staging", "shard_staging", comm, at, z.shard_staging, eb, fewer_units};
  return r;
}
// The gradient reductions per step, as the stage rules decide: stage 0
// all-reduces on the last micro-batch, stages 2-3 reduce-scatter as each
// bucket fills (every micro-batch), stage 1 once at the step; qgZ's
// all-to-alls instead of a reduce-scatter. Gradients travel in fp32 when
// Options::reduce_dtype asks and they are 16-bit.
inline CollectiveRows reduction_collectives(const RunShape& run, const CollectiveCounter& count) {
  using comm::Collective;
  const Options& options = count.options;
  const std::uint64_t reduce_bytes = options.reduce_dtype == ReduceDType::fp32 ? 4 : run.element_bytes();
  CollectiveRows rows;
  if (run.stage.all_reduce_on_flush)
    rows.push_back(count.per_unit("gradient all-reduce on the last micro-batch", Collective::all_reduce, 1,
                                  reduce_bytes, 2));
  if (run.stage.reduce_scatter_on_flush && options.qgz)
    for (const CollectiveRow& c : qgz_collectives(count, count.micro_batches(), false)) rows.push_back(c);
  if (run.stage.reduce_scatter_on_flush && !options.qgz)
    rows.push_back(count.per_unit("gradient reduce-scatter as each bucket fills, every micro-batch",
                                  Collective::reduce_scatter, count.micro_batches(), reduce_bytes, 1));
  if (run.stage.reduce_scatter_at_step && options.qgz)
    for (const CollectiveRow& c : qgz_collectives(count, 1, true)) rows.push_back(c);
  if (run.stage.reduce_scatter_at_step && !options.qgz)
    rows.push_back(count.per_unit("gradient reduce-scatter at the step", Collective::reduce_scatter, 1, reduce_bytes,
                                  1));
  return rows;
}

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
  // (gradients_in_place); `sets` staging sets (staging_set_count), staging
  // set s's event is s on the channel.
  void bind(Buffers buffers, GradientBuckets buckets, StageRules rules, GradWrites writes, bool in_place,
            std::size_t sets, const Layout& layout, CommChannel<Ops>& channel) {
    b_ = std::move(buffers);
    buckets_ = std::move(buckets);
    rules_ = rules;
    writes_ = writes;
    in_place_ = in_place;
    sets_ = sets;
    layout_ = &layout;
    channel_ = &channel;
    const std::size_t n_buckets = buckets_.buckets.size();
    set_of_.assign(n_buckets, closed);
    pending_.assign(n_buckets, {});
    for (std::size_t b = 0; b < n_buckets; ++b) pending_[b].reserve(buckets_.buckets[b].units);
    open_.reserve(sets);
    free_sets_.resize(sets);
    for (std::size_t i = 0; i < sets; ++i) free_sets_[i] = i;
    free_head_ = 0;
    free_count_ = sets;
    ready_this_micro_.assign(layout.units().size(), false);
    handed_this_micro_.assign(layout.units().size(), false);
    check_writes_ = writes == GradWrites::overwrite;
  }

  // Options::qgz, after bind(): reduce-scatters go through it.
  void bind_qgz(typename QuantizedReducer<Ops, G>::Buffers buffers, const quant::Format& format,
                comm::AnyCommunicator& node, comm::AnyCommunicator& across) {
    qgz_.bind(std::move(buffers), format, *layout_, node, across);
  }
  // After a load: qgZ's error feedback starts again from nothing.
  void forget_qgz_residuals() { qgz_.forget_residuals(); }

  // The gradient buffer: whole (stages 0-1) or this rank's shards (2-3);
  // empty where the shards are paged.
  G* accumulator() { return b_.accumulator.data(); }

  // Options::param_place = disk, after bind() (stages 2-3, with no
  // accumulator buffer): the shards are kept in `pages`. Each reduction
  // claims its unit's page (the window's first micro-batch overwrites it) or
  // fetches it (the next ones add), and writes it back; on the window's last
  // micro-batch the shard's statistics are taken there, while it is in
  // memory, so the step need not read every shard again (shard_stats()).
  void bind_pages(std::unique_ptr<ShardPages<G>> pages) {
    require(pages != nullptr && rules_.reduce_scatter_on_flush && b_.accumulator.size() == 0,
            "GradientReducer::bind_pages: pages are for the shards of stages 2-3, in place of the accumulator");
    pages_ = std::move(pages);
    unit_stats_.assign(layout_->units().size(), {});
  }
  // The shards are paged: read them through pages().
  bool paged() const { return pages_ != nullptr; }
  ShardPages<G>* pages() { return pages_.get(); }
  // Paged: the owned gradient's squared norm and inf/NaN, each unit's taken
  // as its shard was final and added in unit order (what
  // Ops::grad_stats_pieces returns over the shards in memory).
  kernels::GradStats shard_stats() const {
    kernels::GradStats total;
    for (const kernels::GradStats& s : unit_stats_) total += s;
    return total;
  }
  // What memory_report() shows for the gradient: the buffer, or the pages
  // and the file.
  PlacedBytes placed(bool device_backend) const {
    return placed_shards(pages_.get(), b_.accumulator.bytes(), device_backend);
  }
  // A step is over (its order of uses is the next step's read-ahead).
  void end_step() {
    if (paged()) pages_->end_step();
  }
  std::uint64_t staging_bytes() const {
    return b_.staging.bytes() + b_.staging_fp32.bytes() + b_.shard_staging.bytes() + qgz_.bytes();
  }
  // Where finished shards are also copied, asynchronously, on the window's
  // last micro-batch (stages 2-3 with offload: the host copy the CPU update
  // reads, unit u's shard at u.shard_offset), or nullptr.
  void copy_final_shards_to(G* host) { final_copy_ = host; }
  // Whether fp16's marker was first seen in this step's micro-batches
  // (UnwrittenCheck): the step is skipped as an overflow. Asked once per step.
  bool take_marker_seen() { return std::exchange(marker_in_window_, false); }
  // A unit was ready in this micro-batch: backward is under way (stage 3
  // prefetches downwards then).
  bool in_backward() const { return in_backward_; }
  // The buffer handed out is the accumulator, which sums the window's
  // micro-batches as backward adds into it (GradWrites::accumulate, stages 0-1).
  bool adds_across_micro_batches() const { return in_place_ && writes_ == GradWrites::accumulate; }

  // Where this micro-batch's gradient of unit u goes. `first`/`last`: this
  // micro-batch's place in the accumulation window.
  G* hand_out(std::size_t unit, bool first, bool last) {
    const UnitInfo& u = layout_->units()[unit];
    if (writes_ == GradWrites::overwrite) {
      // (a branch, not require(): the message names the unit handed out, which
      // exists only when the check fails)
      if (handed_unit_ >= 0 && handed_unit_ != static_cast<int>(unit))
        throw InvalidArgument(concat(
            "grad_buffer('", u.name, "'): the gradient of unit '",
            layout_->units()[static_cast<std::size_t>(handed_unit_)].name,
            "' was handed out but grad_ready() was not called for it; finish one unit's backward before the next, or "
            "set Options::grad_writes = GradWrites::accumulate to keep several units' gradients live at once"));
      if (handed_unit_ >= 0) return where(unit);  // handed out again, before its grad_ready
      // A unit of another bucket (backward out of the usual order): the
      // pending part of the open one is reduced first.
      if (!open_.empty() && open_.front() != buckets_.bucket_of[unit]) flush(open_.front(), first, last);
    } else {
      require(!ready_this_micro_[unit], "grad_buffer('", u.name, "') after grad_ready('", u.name,
              "') in this micro-batch: grad_ready() says the gradient is final (it may be reduced already); call "
              "it once, after the unit's last gradient write");
      if (handed_this_micro_[unit]) return where(unit);
    }
    const std::size_t b = buckets_.bucket_of[unit];
    if (set_of_[b] == closed) open(b, u);
    G* g = where(unit);
    if (writes_ == GradWrites::accumulate) {
      // In place, the accumulator sums the window's micro-batches: zeroed on the first.
      if (!in_place_ || first) Ops::zero(g, u.padded);
    } else if (check_writes_) {
      unwritten_.fill(g, u.padded);
    }
    handed_this_micro_[unit] = true;
    if (writes_ == GradWrites::overwrite) handed_unit_ = static_cast<int>(unit);
    return g;
  }

  // Unit u's gradient is written (final, for accumulate); a bucket whose
  // units are all ready is reduced now (while the caller's backward goes on,
  // on a GPU), the rest at the step.
  void ready(std::size_t unit, bool first, bool last) {
    const UnitInfo& u = layout_->units()[unit];
    require(!ready_this_micro_[unit], "grad_ready('", u.name,
            "') twice in one micro-batch; call step() after each micro-batch");
    if (writes_ == GradWrites::overwrite)
      require(handed_unit_ == static_cast<int>(unit), "grad_ready('", u.name,
              "'): call grad_buffer() for this unit and write its gradient first");
    else if (!handed_this_micro_[unit])
      hand_out(unit, first, last);  // no gradient in this micro-batch: zeros
    G* g = where(unit);
    for (const auto& [b, e] : u.gaps) Ops::zero(g + b, e - b);
    if (check_writes_ && unwritten_.check(*layout_, u, g)) marker_in_window_ = true;
    const std::size_t b = buckets_.bucket_of[unit];
    pending_[b].push_back(Pending{unit, g});
    ready_this_micro_[unit] = true;
    handed_unit_ = -1;
    in_backward_ = true;
    if (writes_ == GradWrites::overwrite) {
      if (pending_[b].size() == buckets_.buckets[b].units) flush(b, first, last);
      return;
    }
    // Accumulate: complete buckets are reduced in backward's order, whatever
    // order their units became final in, so every rank launches the same
    // collectives in the same order.
    while (next_flush_ < pending_.size() && pending_[next_flush_].size() == buckets_.buckets[next_flush_].units)
      flush(next_flush_++, first, last);
  }

  // At step(), before end_micro_batch(): the units not yet final become
  // final, in backward's order (the same on every rank: their reductions
  // are collectives). supply(u) puts a unit's gradient in place where the
  // caller's memory holds it (the engine's use_memory) and says whether it
  // did. Overwrite: every other unit must have had its gradient in this
  // micro-batch. Accumulate: the others are zeros.
  template <class Supply>
  void finish_units(bool first, bool last, Supply&& supply) {
    const auto& units = layout_->units();
    if (writes_ == GradWrites::overwrite) {
      for (std::size_t i = units.size(); i-- > 0;)
        if (!ready_this_micro_[i] && supply(i)) ready(i, first, last);
      for (std::size_t i = 0; i < units.size(); ++i)
        require(ready_this_micro_[i], "step(): unit '", units[i].name,
                "' has no gradient in this micro-batch; call grad_buffer()/grad_ready() for every unit before "
                "step()");
      return;
    }
    for (std::size_t k = next_flush_; k < buckets_.buckets.size(); ++k) {
      const auto& bucket = buckets_.buckets[k];
      for (std::size_t i = bucket.first_unit + bucket.units; i-- > bucket.first_unit;)
        if (!ready_this_micro_[i]) {
          supply(i);
          ready(i, first, last);
        }
    }
  }
  // The micro-batch is over (finish_units ran): the pending buckets are
  // reduced.
  void end_micro_batch(bool first, bool last) {
    while (!open_.empty()) flush(open_.front(), first, last);
    std::fill(ready_this_micro_.begin(), ready_this_micro_.end(), false);
    std::fill(handed_this_micro_.begin(), handed_this_micro_.end(), false);
    next_flush_ = 0;
    in_backward_ = false;
    // The first micro-batch is checked, the steady state is not; after one
    // that showed fp16's marker, the next one is checked too.
    if (check_writes_ && !unwritten_.micro_batch_over()) {
      check_writes_ = false;
      unwritten_.release();
    }
  }

  // Launches the reductions of bucket b's ready units and closes it (its
  // staging set is free again once they have run).
  void flush(std::size_t b, bool first, bool last) {
    auto& pending = pending_[b];
    const std::size_t set = set_of_[b];
    close(b);
    if (pending.empty()) return;
    constexpr DType gdt = dtype_traits<G>::dtype;
    const bool in_fp32 = b_.staging_fp32.size() != 0;
    auto wide = [&](const Pending& p) { return b_.staging_fp32.data() + staging_offset(set, p.unit); };
    auto& comm = *channel_;
    // All of it on the communication lane (no-op without overlap), after the
    // backward that wrote these gradients; the caller's backward of the next
    // units goes on meanwhile.
    auto lane = comm.lane();
    // Three phases, so that a communicator may launch the bucket's
    // collectives as one group: what they read is prepared first, what reads
    // their results runs after.
    if (!rules_.reduce_scatter_on_flush) {
      // Keep the whole gradient; stage 0 all-reduces it on the last micro-batch.
      const bool all_reduce = rules_.all_reduce_on_flush && last;
      for (const Pending& p : pending) {
        const UnitInfo& u = layout_->units()[p.unit];
        G* acc = b_.accumulator.data() + u.full_offset;
        if (p.written != acc) Ops::accumulate(acc, p.written, u.padded, first);
        if (all_reduce && in_fp32) Ops::convert(wide(p), acc, u.padded);
      }
      if (all_reduce) {
        comm->group_begin();
        for (const Pending& p : pending) {
          const UnitInfo& u = layout_->units()[p.unit];
          const auto purpose = comm.exchange("all-reduces the gradient of", "unit", u.name, p.unit);
          if (in_fp32)
            comm->all_reduce(wide(p), u.padded, DType::f32, comm::ReduceOp::sum, false);
          else
            comm->all_reduce(b_.accumulator.data() + u.full_offset, u.padded, gdt, comm::ReduceOp::sum, false);
        }
        comm->group_end();
        if (in_fp32)
          for (const Pending& p : pending) {
            const UnitInfo& u = layout_->units()[p.unit];
            Ops::convert(b_.accumulator.data() + u.full_offset, wide(p), u.padded);
          }
      }
    } else if (qgz_.bound()) {
      // Stages 2 and 3 with qgZ: unit by unit (each reduction's all-to-alls
      // wait for its quantization), the fp32 shard accumulated.
      for (const Pending& p : pending) {
        const UnitInfo& u = layout_->units()[p.unit];
        const auto purpose = comm.exchange("exchanges the quantized gradient of", "unit", u.name, p.unit);
        const float* sum = qgz_.reduce(p.unit, p.written);
        G* acc = shard_of(p.unit, first);
        Ops::accumulate(acc, sum, u.shard, first);
        shard_done(p.unit, acc, last);
      }
    } else {
      // Stages 2 and 3: reduce-scatter, keep only this rank's shard.
      const std::size_t r = static_cast<std::size_t>(comm.rank());
      if (in_fp32)
        for (const Pending& p : pending) Ops::convert(wide(p), p.written, layout_->units()[p.unit].padded);
      comm->group_begin();
      for (const Pending& p : pending) {
        const UnitInfo& u = layout_->units()[p.unit];
        const auto purpose = comm.exchange("reduce-scatters the gradient of", "unit", u.name, p.unit);
        if (in_fp32)
          comm->reduce_scatter(wide(p), wide(p) + r * u.shard, u.shard, DType::f32);
        else
          comm->reduce_scatter(p.written, b_.shard_staging.data() + shard_staging_offset(set, p.unit), u.shard, gdt);
      }
      comm->group_end();
      for (const Pending& p : pending) {
        const UnitInfo& u = layout_->units()[p.unit];
        G* acc = shard_of(p.unit, first);
        if (in_fp32)
          Ops::accumulate(acc, wide(p) + r * u.shard, u.shard, first);
        else
          Ops::accumulate(acc, b_.shard_staging.data() + shard_staging_offset(set, p.unit), u.shard, first);
        shard_done(p.unit, acc, last);
      }
    }
    comm.mark(staging_event(set));
    pending.clear();
  }

  // Stage 1, at the step: reduce-scatters the accumulated whole gradient of
  // every unit in place (this rank's shard of the sum lands at its position).
  void reduce_at_step() {
    if (!rules_.reduce_scatter_at_step) return;
    constexpr DType gdt = dtype_traits<G>::dtype;
    auto& comm = *channel_;
    const std::size_t r = static_cast<std::size_t>(comm.rank());
    comm.communicate([&] {
      for (std::size_t unit = 0; unit < layout_->units().size(); ++unit) {
        const UnitInfo& u = layout_->units()[unit];
        G* g = b_.accumulator.data() + u.full_offset;
        G* mine = g + r * u.shard;
        const auto purpose = comm.exchange("reduce-scatters the gradient of", "unit", u.name, unit);
        if (qgz_.bound()) {
          Ops::convert(mine, qgz_.reduce(unit, g), u.shard);
        } else if (b_.staging_fp32.size() != 0) {
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
  static constexpr std::size_t closed = ~std::size_t{0};
  static constexpr std::size_t staging_event(std::size_t set) { return set; }

  // Stages 2-3: where unit `unit`'s shard is summed, in the accumulator or
  // in a page (claimed on the window's first micro-batch, which overwrites it).
  G* shard_of(std::size_t unit, bool first) {
    if (!paged()) return b_.accumulator.data() + layout_->units()[unit].shard_offset;
    return first ? pages_->claim(unit) : pages_->fetch(unit);
  }
  // The shard at `acc` is summed: offload copies it to the host once final;
  // a page is written back (its statistics taken first, once final).
  void shard_done(std::size_t unit, const G* acc, bool last) {
    const UnitInfo& u = layout_->units()[unit];
    if constexpr (requires(G* d, const G* s, std::size_t n) { Ops::download_async(d, s, n); })
      if (last && final_copy_ != nullptr) Ops::download_async(final_copy_ + u.shard_offset, acc, u.shard);
    if (!paged()) return;
    if (last) unit_stats_[unit] = Ops::grad_stats(acc, u.shard);
    pages_->written(unit);
  }

  // Where unit u is staged in staging set `set` (its bucket's units lie
  // back to back; a set holds the largest bucket), and its shard's
  // reduce-scatter result.
  std::size_t staging_offset(std::size_t set, std::size_t u) const {
    return set * buckets_.max_elements + buckets_.offset[u];
  }
  std::size_t shard_staging_offset(std::size_t set, std::size_t u) const {
    return set * buckets_.max_shard_elements + buckets_.shard_offset[u];
  }
  // Where unit u's gradient is written: the accumulator in place, else its
  // place in its open bucket's staging set.
  G* where(std::size_t unit) {
    if (in_place_) return b_.accumulator.data() + layout_->units()[unit].full_offset;
    return b_.staging.data() + staging_offset(set_of_[buckets_.bucket_of[unit]], unit);
  }
  // Bucket b takes the staging set freed longest ago; the caller's writes
  // into it wait for that set's last reduction.
  void open(std::size_t b, const UnitInfo& u) {
    if (free_count_ == 0) {
      const GradientBuckets::Bucket& first = buckets_.buckets[open_.front()];
      throw InvalidArgument(concat(
          "grad_buffer('", u.name, "'): ", open_.size(), " gradient buckets are live already (the oldest holds unit '",
          layout_->units()[first.first_unit + first.units - 1].name, "'", first.units > 1 ? " and others" : "",
          "); with Options::grad_writes = accumulate a bucket stays live until each of its units is final "
          "(grad_ready()) and the buckets before it in backward's order are reduced: call grad_ready() for each unit "
          "once its gradient is final, or raise Options::live_buckets (at the cost of one bucket's staging each)"));
    }
    const std::size_t set = free_sets_[free_head_];
    free_head_ = (free_head_ + 1) % sets_;
    --free_count_;
    set_of_[b] = set;
    open_.push_back(b);
    if (!in_place_) channel_->wait(staging_event(set));
  }
  void close(std::size_t b) {
    free_sets_[(free_head_ + free_count_) % sets_] = set_of_[b];
    ++free_count_;
    set_of_[b] = closed;
    open_.erase(std::find(open_.begin(), open_.end(), b));
  }

  struct Pending {
    std::size_t unit;
    G* written;  // where the caller wrote the gradient
  };

  Buffers b_;
  GradientBuckets buckets_;  // units whose reductions are launched together (buffer_sizes.hpp)
  StageRules rules_{};
  GradWrites writes_ = GradWrites::overwrite;
  bool in_place_ = false;
  std::size_t sets_ = 1;
  const Layout* layout_ = nullptr;
  CommChannel<Ops>* channel_ = nullptr;
  std::vector<std::size_t> set_of_;              // per bucket: its staging set while open, else `closed`
  std::vector<std::vector<Pending>> pending_;    // per bucket: ready but not yet reduced (capacity reserved)
  std::vector<std::size_t> open_;                // open buckets, oldest first
  std::size_t next_flush_ = 0;                   // accumulate: the next bucket to reduce, in backward's order
  std::vector<std::size_t> free_sets_;           // a ring of the free staging sets, freed longest ago first
  std::size_t free_head_ = 0, free_count_ = 0;
  int handed_unit_ = -1;                         // overwrite: the unit whose gradient is handed out
  std::vector<bool> ready_this_micro_;           // ready() seen for each unit in this micro-batch
  std::vector<bool> handed_this_micro_;          // hand_out() seen for each unit in this micro-batch
  bool in_backward_ = false;
  bool check_writes_ = false;                    // overwrite, first micro-batch: markers are checked
  bool marker_in_window_ = false;                // fp16's marker seen in this step's micro-batches: it is skipped
  UnwrittenCheck<Ops, G> unwritten_;
  G* final_copy_ = nullptr;
  QuantizedReducer<Ops, G> qgz_;  // Options::qgz (bind_qgz), else unbound
  std::unique_ptr<ShardPages<G>> pages_;     // Options::param_place = disk (bind_pages), else null
  std::vector<kernels::GradStats> unit_stats_;  // paged: each unit's shard's, from its last reduction
};

}  // namespace zero::detail
