// Why: stage 3 keeps only this rank's shard of every unit's parameters, so a
// unit must be whole while forward or backward computes with it and gone
// again afterwards. This part owns where gathered units live: one arena with
// room for the Options::prefetch_units + 1 largest units, the slots placed in
// it, which are acquired, and the prefetch of the next units in the
// direction of the pass. It issues one collective, the all_gather of a unit's
// shards, on the communication lane (CommChannel), each marked by its slot's
// event so that compute waits only for the unit it acquires. It reads the
// parameter shards and never writes them; the engine tells it when they
// changed (drop_all after a step or load, drop after set_param).
//
// How a unit travels and what a rank keeps of it for gathers inside its
// node (ZeRO++'s qwZ and hpZ) are the two choices of gather_modes.hpp,
// made once at bind. It reads the shards from the parameter store
// (param_store.hpp).
//
// Contract: acquire(u) is collective (every rank acquires the same units in
// the same order); release(u) frees the unit's room at once; a unit acquired
// and not released keeps its values until released.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "zero/engine/detail/comm_channel.hpp"
#include "zero/engine/detail/gather_modes.hpp"
#include "zero/engine/detail/param_store.hpp"
#include "zero/engine/detail/part_rows.hpp"
#include "zero/engine/layout.hpp"
#include "zero/error.hpp"
#include "zero/precision/types.hpp"
#include "zero/quant/symmetric.hpp"

namespace zero::detail {

// Stage 3's gather buffers for a run (engine/detail/part_rows.hpp), sized by
// buffer_sizes(): the arena, and the ZeRO++ copies and payloads.
struct GatherRows {
  BufferRow arena, hpz_secondary, hpz_int8_secondary, hpz_int8_staging, qwz_payloads;
  BufferRows list() const { return {arena, hpz_secondary, hpz_int8_secondary, hpz_int8_staging, qwz_payloads}; }
};
inline GatherRows gather_rows(const RunShape& run, const BufferSizes& z) {
  const Place at = backend_place(run);
  const std::uint64_t eb = run.element_bytes();
  constexpr auto comm = ReportedAs::communication_buffers;
  const char* hpz_smaller =
      "turn Options::hpz off, or put more ranks on each node (the copy is 1/ranks_per_node of the parameters)";
  GatherRows r;
  r.arena = {"stage-3 gather arena", "gather_slots", comm, at, z.gather_slots, eb,
             "lower Options::prefetch_units (the arena holds the prefetch_units + 1 largest units), or split the "
             "largest units"};
  r.hpz_secondary = {"hpZ secondary copy (1/ranks_per_node of every unit)", "params", ReportedAs::params, at,
                     z.hpz_secondary, eb, hpz_smaller};
  r.hpz_int8_secondary = {"hpZ secondary copy as int8 blocks (1/ranks_per_node of every unit)", "params",
                          ReportedAs::params, at, z.hpz_int8_secondary, 1, hpz_smaller};
  r.hpz_int8_staging = {"hpZ int8 staging (the node's payloads of a part)", "hpz_int8_staging", comm, at,
                        z.hpz_int8_staging, 1, "split the largest unit"};
  r.qwz_payloads = {"qwZ payloads (every rank's int8 codes and scales of a shard)", "qwz_staging", comm, at,
                    z.qwz_staging, 1, "turn Options::qwz off, or lower Options::qwz_block's overhead by splitting the "
                                      "largest unit"};
  return r;
}
// Stage 3's parameter gathers per step: every acquire_unit() gathers the
// unit (`run.acquires_per_micro_batch` per micro-batch), as int8 payloads
// with qwZ; with hpZ only a unit's first acquire after a step gathers over
// every rank, keeping the node's secondary copy, and the later ones gather
// inside the node.
inline CollectiveRows gather_collectives(const RunShape& run, const CollectiveCounter& count) {
  if (!run.stage.params_sharded) return {};
  using comm::Collective;
  const Options& options = count.options;
  const std::uint64_t eb = run.element_bytes();
  const std::uint64_t gathers = count.micro_batches() * static_cast<std::uint64_t>(run.acquires_per_micro_batch);
  if (!options.hpz)
    return {count.per_unit(options.qwz ? "parameter all-gather of int8 codes and scales (qwZ) at every acquire_unit "
                                         "(forward and backward, every micro-batch)"
                                       : "parameter all-gather at every acquire_unit (forward and backward, every "
                                         "micro-batch)",
                           Collective::all_gather, gathers, eb, 1, RankGroup::all, options.qwz)};
  return {count.per_unit(options.qwz ? "parameter all-gather of int8 codes and scales (qwZ) at a unit's first "
                                       "acquire_unit after a step, keeping hpZ's secondary copy"
                                     : "parameter all-gather at a unit's first acquire_unit after a step, keeping "
                                       "hpZ's secondary copy",
                         Collective::all_gather, 1, eb, 1, RankGroup::all, options.qwz),
          count.per_unit(options.hpz_int8 ? "hpZ all-gather inside the node of int8 codes and scales at every later "
                                            "acquire_unit (backward, further micro-batches)"
                                          : "hpZ all-gather inside the node at every later acquire_unit (backward, "
                                            "further micro-batches)",
                         Collective::all_gather, gathers - 1, eb, 1, RankGroup::node, options.hpz_int8)};
}

template <class Ops, class T>
class ParamGatherer {
 public:
  template <class E>
  using Buffer = typename Ops::template Buffer<E>;
  // The most units the arena holds (prefetch_units is at most 16).
  static constexpr std::size_t max_slots = 17;

  // At finalize(), stage 3 only: the arena and its slot count, the
  // parameter store (its shards), and slot s's event first_event + s on the
  // channel. Everything stays valid for the engine's lifetime.
  void bind(Buffer<T> arena, std::size_t slots, const Layout& layout, ParamStore<Ops, T>& params,
            CommChannel<Ops>& channel, int prefetch_units, std::size_t first_event) {
    require(slots <= max_slots, "ParamGatherer: ", slots, " slots, at most ", max_slots);
    arena_ = std::move(arena);
    slot_unit_.assign(slots, npos);
    slot_offset_.assign(slots, 0);
    slot_in_use_.assign(slots, false);
    slot_prefetched_.assign(slots, none);
    for (auto& v : vain_) v.assign(layout.units().size(), false);
    layout_ = &layout;
    params_ = &params;
    channel_ = &channel;
    prefetch_units_ = prefetch_units;
    first_event_ = first_event;
  }
  std::uint64_t arena_bytes() const { return arena_.bytes(); }
  // Options::qwz, after bind(): room for every rank's payload of the
  // largest shard, and the elements per scale.
  void bind_qwz(Buffer<std::uint8_t> payloads, std::size_t block) { wire_.bind_qwz(std::move(payloads), block); }
  // Options::hpz, after bind() (and bind_qwz): the secondary copy (every
  // unit's part, in unit order: engine/layout.hpp's hpz_part) and the
  // node's ranks.
  void bind_hpz(Buffer<T> secondary, comm::AnyCommunicator& node) {
    node_copy_.bind_parts(std::move(secondary), *layout_, node);
  }
  // Options::hpz_int8 instead: the parts as int8 payloads of blocks of
  // `block` (in unit order), and room for the node's payloads of the largest.
  void bind_hpz_int8(Buffer<std::uint8_t> secondary, Buffer<std::uint8_t> node_payloads, std::size_t block,
                     comm::AnyCommunicator& node) {
    node_copy_.bind_int8_parts(std::move(secondary), std::move(node_payloads), block,
                               wire_.qwz_block() != 0 ? &wire_ : nullptr, *layout_, node);
  }
  std::uint64_t secondary_bytes() const { return node_copy_.secondary_bytes(); }
  std::uint64_t payload_bytes() const { return wire_.payload_bytes() + node_copy_.payload_bytes(); }

  // Collective: unit u whole, gathered now unless held already, and the next
  // prefetch_units units in the pass's direction (backward: downwards)
  // gathered into free room while the caller computes with it.
  const T* acquire(std::size_t unit, bool backward) {
    // The unit forward ended with, acquired again right after: backward
    // begins there (the engine learns of backward only at the first
    // grad_ready, after this acquire), so the unit below is prefetched.
    backward = backward || unit == last_acquired_;
    int slot = find_slot(unit);
    if (slot < 0) slot = gather_into_slot(unit, true, none);
    if (slot < 0) {  // (a branch, not require(): the message lists the acquired units)
      std::string held;
      for (std::size_t s = 0; s < slot_unit_.size(); ++s)
        if (slot_in_use_[s]) held += (held.empty() ? "'" : ", '") + layout_->units()[slot_unit_[s]].name + "'";
      throw InvalidArgument(concat("acquire_unit('", layout_->units()[unit].name,
                                   "'): the stage-3 gather arena (room for the ", slot_unit_.size(),
                                   " largest units, Options::prefetch_units + 1) is taken by the acquired unit(s) ",
                                   held, "; release_unit() the units you are done with, or raise "
                                         "Options::prefetch_units"));
    }
    const std::size_t s = static_cast<std::size_t>(slot);
    slot_in_use_[s] = true;
    slot_prefetched_[s] = none;
    vain_[backward ? 1 : 0][unit] = false;  // needed right here: worth prefetching again
    // A unit acquired against the pass's direction (a tied weight used again
    // at the far end, as a language model's output layer is its input
    // embedding) prefetches nothing: the pass goes on from where it was, and
    // the unit next to it would be gathered in vain.
    const bool against = last_acquired_ != npos && (backward ? unit > last_acquired_ : unit < last_acquired_);
    if (!against) prefetch_after(unit, backward);
    last_acquired_ = unit;
    channel_->wait(first_event_ + s);
    return arena_.data() + slot_offset_[s];
  }
  // Frees unit u's room (only shards stay resident).
  void release(std::size_t unit) {
    const int slot = find_slot(unit);
    require(slot >= 0 && slot_in_use_[static_cast<std::size_t>(slot)], "release_unit('",
            layout_->units()[unit].name, "'): the unit is not acquired");
    slot_unit_[static_cast<std::size_t>(slot)] = npos;
    slot_in_use_[static_cast<std::size_t>(slot)] = false;
  }
  // Unit u's gathered values if it is acquired (not merely prefetched: a
  // prefetch may still be in flight), else nullptr.
  const T* acquired_data(std::size_t unit) const {
    const int slot = find_slot(unit);
    if (slot < 0 || !slot_in_use_[static_cast<std::size_t>(slot)]) return nullptr;
    return arena_.data() + slot_offset_[static_cast<std::size_t>(slot)];
  }
  bool is_acquired(std::size_t unit) const { return acquired_data(unit) != nullptr; }
  // An acquired unit, if any (for the errors of calls that need none).
  std::optional<std::size_t> any_acquired() const {
    for (std::size_t s = 0; s < slot_unit_.size(); ++s)
      if (slot_in_use_[s]) return slot_unit_[s];
    return std::nullopt;
  }

  // Unit u's shards gathered into `dst` (its padded elements): from the
  // node's copy once it holds the unit (hpZ), else over every rank, keeping
  // the node's part. Enqueued where the caller runs it (a slot's gather runs
  // on the communication lane; so does Engine::hold_whole's).
  void gather_unit(std::size_t unit, T* dst) {
    const UnitInfo& u = layout_->units()[unit];
    const auto purpose = channel_->exchange("gathers", "unit", u.name, unit);
    if (node_copy_.holds(unit)) return node_copy_.gather(unit, dst, static_cast<std::size_t>(channel_->size()));
    wire_.gather(*channel_, u, params_->unit(unit), dst);
    node_copy_.keep(unit, dst);
  }
  // The micro-batch is over: the next acquire starts a forward pass.
  void end_micro_batch() { last_acquired_ = npos; }
  // The shards changed: every gathered copy is stale (none may be acquired).
  void drop_all() {
    for (std::size_t s = 0; s < slot_unit_.size(); ++s) drop_slot(s);
    node_copy_.drop_all();
  }
  // Unit u's shards changed: a prefetched copy of it is dropped (it must not
  // be acquired).
  void drop(std::size_t unit) {
    node_copy_.drop(unit);
    const int slot = find_slot(unit);
    if (slot < 0) return;
    slot_unit_[static_cast<std::size_t>(slot)] = npos;
    slot_prefetched_[static_cast<std::size_t>(slot)] = none;
  }

 private:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  static constexpr int none = -1;  // slot_prefetched_: acquired (or empty) since its gather

  // A prefetched unit nobody acquired before it was dropped was gathered in
  // vain: it is not prefetched in that direction again (say, a tied
  // embedding at the end of a backward whose lookup needs no weights),
  // until it is acquired in that direction.
  void drop_slot(std::size_t s) {
    if (slot_unit_[s] != npos && slot_prefetched_[s] != none) vain_[slot_prefetched_[s]][slot_unit_[s]] = true;
    slot_unit_[s] = npos;
    slot_prefetched_[s] = none;
  }

  // Makes room: the slot's unit is dropped without being marked in vain.
  void evict_slot(std::size_t s) {
    slot_unit_[s] = npos;
    slot_prefetched_[s] = none;
  }

  int find_slot(std::size_t unit) const {
    for (std::size_t s = 0; s < slot_unit_.size(); ++s)
      if (slot_unit_[s] == unit) return static_cast<int>(s);
    return -1;
  }

  // Where in the arena a unit of n elements fits now, or npos; `ends_only`:
  // against an end of the arena, or nowhere.
  std::size_t arena_place(std::size_t n, bool ends_only) const {
    // The held units' ranges, sorted (no allocation).
    std::array<std::pair<std::size_t, std::size_t>, max_slots> held{};
    std::size_t count = 0;
    for (std::size_t s = 0; s < slot_unit_.size(); ++s)
      if (slot_unit_[s] != npos)
        held[count++] = {slot_offset_[s], slot_offset_[s] + layout_->units()[slot_unit_[s]].padded};
    std::sort(held.begin(), held.begin() + static_cast<std::ptrdiff_t>(count));
    // A unit goes against an end of the arena where it can: then two units
    // always fit (each sits at an end, leaving the rest to the other, and the
    // arena holds the two largest). Otherwise into the smallest gap it fits.
    const std::size_t capacity = arena_.size();
    std::size_t best = npos, best_gap = npos;
    for (std::size_t i = 0; i <= count; ++i) {
      const std::size_t begin = i == 0 ? 0 : held[i - 1].second, end = i == count ? capacity : held[i].first;
      if (end - begin < n) continue;
      if (begin == 0) return 0;
      if (end == capacity) return end - n;
      if (!ends_only && end - begin < best_gap) {
        best = begin;
        best_gap = end - begin;
      }
    }
    return best;
  }

  // Gathers `unit` into a free slot of the arena and returns the slot, or -1
  // when no slot or no room is free. may_evict: make room by dropping
  // prefetched units no one acquired (acquire; a prefetch only uses room
  // that is free). `prefetched`: the direction of the prefetch (0 forward, 1
  // backward), or none for an acquire.
  int gather_into_slot(std::size_t unit, bool may_evict, int prefetched) {
    const UnitInfo& u = layout_->units()[unit];
    auto free_slot = [&] { return find_slot(npos); };
    // An acquired unit stays where it is until released, so it goes against
    // an end: with at most one other unit acquired (at the other end, or
    // gone), the arena of the two largest units always has room for it. A
    // prefetch may take a gap in the middle; it is made room for.
    std::size_t offset = free_slot() >= 0 ? arena_place(u.padded, may_evict) : npos;
    if (offset == npos && may_evict) {
      // Prefetched units no one acquired make room (gathered again when
      // acquired, and not counted as gathered in vain: they were displaced,
      // not unused); a gather still in flight into their range is ordered
      // before the one below on the communication lane.
      for (std::size_t s = 0; s < slot_unit_.size(); ++s)
        if (!slot_in_use_[s]) evict_slot(s);
      offset = arena_place(u.padded, true);
      if (offset == npos) offset = arena_place(u.padded, false);
    }
    const int slot = free_slot();
    if (slot < 0 || offset == npos) return -1;
    const std::size_t si = static_cast<std::size_t>(slot);
    {
      // On the communication lane; acquire waits for the slot's event.
      auto lane = channel_->lane();
      gather_unit(unit, arena_.data() + offset);
      channel_->mark(first_event_ + si);
    }
    slot_unit_[si] = unit;
    slot_offset_[si] = offset;
    slot_prefetched_[si] = prefetched;
    return slot;
  }

  // Forward walks units upwards, backward downwards; gather the next ones
  // while slots are free (on a GPU this overlaps with the current unit).
  void prefetch_after(std::size_t unit, bool backward) {
    const long n_units = static_cast<long>(layout_->units().size());
    const long dir = backward ? -1 : 1;
    for (int k = 1; k <= prefetch_units_; ++k) {
      const long next = static_cast<long>(unit) + dir * k;
      if (next < 0 || next >= n_units) break;
      if (find_slot(static_cast<std::size_t>(next)) >= 0 || vain_[backward ? 1 : 0][static_cast<std::size_t>(next)])
        continue;
      if (gather_into_slot(static_cast<std::size_t>(next), false, backward ? 1 : 0) < 0) break;
    }
  }

  Buffer<T> arena_;
  std::vector<std::size_t> slot_unit_;    // unit held by each slot, or npos
  std::vector<std::size_t> slot_offset_;  // where the slot's unit lies in the arena
  std::vector<bool> slot_in_use_;         // acquired and not yet released
  std::vector<int> slot_prefetched_;      // prefetched (direction) and not acquired since, or none
  std::array<std::vector<bool>, 2> vain_;  // per direction (forward, backward) and unit: a prefetch gone to waste
  const Layout* layout_ = nullptr;
  ParamStore<Ops, T>* params_ = nullptr;
  CommChannel<Ops>* channel_ = nullptr;
  int prefetch_units_ = 0;
  std::size_t first_event_ = 0;
  std::size_t last_acquired_ = npos;  // in this micro-batch: the pass's direction
  WireGather<Ops, T> wire_;     // plain, or qwZ's payloads
  NodeCopy<Ops, T> node_copy_;  // hpZ's parts of every unit, or none
};

}  // namespace zero::detail
