// Why: stage 3 keeps only this rank's shard of every unit's parameters, so a
// unit must be whole while forward or backward computes with it and gone
// again afterwards. This part owns where gathered units live: one arena with
// room for the Options::prefetch_units + 1 largest units, the slots placed in
// it, which are acquired, and the prefetch of the next units in the
// direction of the pass. It issues one collective, the all_gather of a unit's
// shards, on the communication lane (CommChannel), each marked by its slot's
// event so that compute waits only for the unit it acquires. It reads the
// engine's parameter shards and never writes them; the engine tells it when
// they changed (drop_all after a step or load, drop after set_param).
//
// Options::hpz (ZeRO++'s hierarchical partitioning): the first gather of a
// unit after its shards changed also leaves this rank a secondary copy of
// part node_rank of the unit's node_size parts, and every later gather of it
// (backward, the next micro-batches, hold_whole) is an all_gather of those
// parts inside the node (the communicator's node()), which nothing crosses.
// The parts are copies of the same values, so the unit is the same bit for
// bit; the copies go stale exactly when a gathered copy does (drop_all, drop).
// With Options::hpz_int8 each part is kept as int8 payloads instead
// (quant/symmetric.hpp), gathered inside the node as payloads and
// dequantized: half the memory and bytes. With qwZ too the part is the
// forward gather's own payloads of its shards, so backward dequantizes
// exactly what forward did; without it, the part quantized on its own
// (values within half a step of the parameters).
//
// Options::qwz (ZeRO++'s quantized weights): a gather over every rank sends
// each shard as its int8 payload (quant/symmetric.hpp: codes and one fp32
// scale per block of the shard) into the payload staging, and every rank
// dequantizes all payloads into the unit: the same values on every rank,
// within half a quantization step of the parameters.
//
// Contract: acquire(u) is collective (every rank acquires the same units in
// the same order); release(u) frees the unit's room at once; a unit acquired
// and not released keeps its values until released.
#pragma once

#include "zero/config.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "zero/engine/comm_channel.hpp"
#include "zero/engine/layout.hpp"
#include "zero/error.hpp"
#include "zero/precision/types.hpp"
#include "zero/quant/symmetric.hpp"

namespace zero::detail {

template <class Ops, class T>
class ParamGatherer {
 public:
  template <class E>
  using Buffer = typename Ops::template Buffer<E>;
  // The most units the arena holds (prefetch_units is at most 16).
  static constexpr std::size_t max_slots = 17;

  // At finalize(), stage 3 only: the arena and its slot count, the shards
  // (this rank's unit shards, at UnitInfo::shard_offset), and slot s's event
  // first_event + s on the channel. Everything stays valid for the engine's
  // lifetime.
  void bind(Buffer<T> arena, std::size_t slots, const Layout& layout, const T* shards, CommChannel<Ops>& channel,
            int prefetch_units, std::size_t first_event) {
    require(slots <= max_slots, "ParamGatherer: ", slots, " slots, at most ", max_slots);
    arena_ = std::move(arena);
    slot_unit_.assign(slots, npos);
    slot_offset_.assign(slots, 0);
    slot_in_use_.assign(slots, false);
    slot_prefetched_.assign(slots, none);
    for (auto& v : vain_) v.assign(layout.units().size(), false);
    layout_ = &layout;
    shards_ = shards;
    channel_ = &channel;
    prefetch_units_ = prefetch_units;
    first_event_ = first_event;
  }
  std::uint64_t arena_bytes() const { return arena_.bytes(); }
  // Options::hpz, after bind(): the secondary copy (every unit's part, in
  // unit order: engine/layout.hpp's hpz_part) and the node's ranks.
  void bind_hpz(Buffer<T> secondary, comm::AnyCommunicator& node) {
    secondary_ = std::move(secondary);
    bind_parts(node, secondary_.size(), [&](std::size_t unit) { return hpz_part_of(unit); });
  }
  // Options::hpz_int8 instead: the parts as int8 payloads of blocks of
  // `block` (in unit order), and room for the node's payloads of the largest.
  // (After bind_qwz, where qwZ is on.)
  void bind_hpz_int8(Buffer<std::uint8_t> secondary, Buffer<std::uint8_t> node_payloads, std::size_t block,
                     comm::AnyCommunicator& node) {
    secondary_int8_ = std::move(secondary);
    node_payloads_ = std::move(node_payloads);
    hpz_block_ = block;
    bind_parts(node, secondary_int8_.size(), [&](std::size_t unit) {
      return hpz_int8_part_bytes(hpz_part_of(unit), layout_->units()[unit].shard, block, qwz_block_ != 0);
    });
  }
  std::uint64_t secondary_bytes() const { return secondary_.bytes() + secondary_int8_.bytes(); }
  // Options::qwz, after bind(): room for every rank's payload of the
  // largest shard, and the elements per scale.
  void bind_qwz(Buffer<std::uint8_t> payloads, std::size_t block) {
    payloads_ = std::move(payloads);
    qwz_block_ = block;
  }
  std::uint64_t payload_bytes() const { return payloads_.bytes() + node_payloads_.bytes(); }

  // Collective: unit u whole, gathered now unless held already, and the next
  // prefetch_units units in the pass's direction (backward: downwards)
  // gathered into free room while the caller computes with it.
  const T* acquire(std::size_t unit, bool backward) {
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

  // Unit u's shards gathered into `dst` (its padded elements), in place:
  // this rank's shard goes to its position, then the all_gather fills the
  // rest. Enqueued where the caller runs it (a slot's gather runs on the
  // communication lane; so does Engine::hold_whole's).
  // With hpZ, from the node's secondary parts once it has them.
  void gather_unit(std::size_t unit, T* dst) {
    const UnitInfo& u = layout_->units()[unit];
    const auto purpose = channel_->exchange("gathers", "unit", u.name, unit);
    if (node_ != nullptr && secondary_valid_[unit]) {
      const std::size_t part = hpz_part_of(unit);
      if (hpz_block_ != 0) {
        // With qwZ the node's parts are every shard's payload, in rank order.
        const quant::Format format{8, hpz_block_};
        const bool qwz = qwz_block_ != 0;
        const std::size_t piece = qwz ? u.shard : part;
        const std::size_t pieces = qwz ? static_cast<std::size_t>(channel_->size())
                                       : static_cast<std::size_t>(node_->size());
        const std::size_t payload = format.payload_bytes(piece);
        node_->all_gather(secondary_int8_.data() + secondary_offset_[unit], node_payloads_.data(),
                          hpz_int8_part_bytes(part, u.shard, hpz_block_, qwz), DType::u8, false);
        Ops::dequantize(node_payloads_.data(), quant::Pieces{pieces, piece, piece, payload}, format, dst);
        return;
      }
      T* mine = dst + static_cast<std::size_t>(node_->rank()) * part;
      Ops::copy(mine, secondary_.data() + secondary_offset_[unit], part);
      node_->all_gather(mine, dst, part, dtype_traits<T>::dtype, false);
      return;
    }
    if (qwz_block_ != 0) {
      const quant::Format format{8, qwz_block_};
      const quant::Pieces one = quant::Pieces::one(u.shard, format);
      std::uint8_t* all = payloads_.data();
      std::uint8_t* mine = all + static_cast<std::size_t>(channel_->rank()) * one.payload_stride;
      Ops::quantize(shards_ + u.shard_offset, nullptr, one, format, mine);
      (*channel_)->all_gather(mine, all, one.payload_stride, DType::u8, false);
      // Every rank's payload, back to back, into every rank's shard.
      Ops::dequantize(all, quant::Pieces{static_cast<std::size_t>(channel_->size()), u.shard, u.shard,
                                         one.payload_stride}, format, dst);
    } else {
      T* mine = dst + static_cast<std::size_t>(channel_->rank()) * u.shard;
      Ops::copy(mine, shards_ + u.shard_offset, u.shard);
      (*channel_)->all_gather(mine, dst, u.shard, dtype_traits<T>::dtype, false);
    }
    if (node_ != nullptr) {
      const std::size_t part = hpz_part_of(unit);
      const T* mine = dst + static_cast<std::size_t>(node_->rank()) * part;
      if (hpz_block_ != 0 && qwz_block_ != 0) {
        // The payloads of this rank's part's shards, as forward's gather moved them.
        const std::size_t bytes = hpz_int8_part_bytes(part, u.shard, qwz_block_, true);
        Ops::copy(secondary_int8_.data() + secondary_offset_[unit],
                  payloads_.data() + static_cast<std::size_t>(node_->rank()) * bytes, bytes);
      } else if (hpz_block_ != 0) {
        const quant::Format format{8, hpz_block_};
        Ops::quantize(mine, nullptr, quant::Pieces::one(part, format), format,
                      secondary_int8_.data() + secondary_offset_[unit]);
      } else {
        Ops::copy(secondary_.data() + secondary_offset_[unit], mine, part);
      }
      secondary_valid_[unit] = true;
    }
  }
  // The micro-batch is over: the next acquire starts a forward pass.
  void end_micro_batch() { last_acquired_ = npos; }
  // The shards changed: every gathered copy is stale (none may be acquired).
  void drop_all() {
    for (std::size_t s = 0; s < slot_unit_.size(); ++s) drop_slot(s);
    secondary_valid_.assign(secondary_valid_.size(), false);
  }
  // Unit u's shards changed: a prefetched copy of it is dropped (it must not
  // be acquired).
  void drop(std::size_t unit) {
    if (node_ != nullptr) secondary_valid_[unit] = false;
    const int slot = find_slot(unit);
    if (slot < 0) return;
    slot_unit_[static_cast<std::size_t>(slot)] = npos;
    slot_prefetched_[static_cast<std::size_t>(slot)] = none;
  }

 private:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  static constexpr int none = -1;  // slot_prefetched_: acquired (or empty) since its gather

  // Where each unit's part of the secondary copy starts (`size(unit)`: its
  // part's elements or bytes), checked against the copy's `total`.
  template <class Size>
  void bind_parts(comm::AnyCommunicator& node, std::size_t total, Size&& size) {
    node_ = &node;
    secondary_offset_.assign(layout_->units().size(), 0);
    secondary_valid_.assign(layout_->units().size(), false);
    std::size_t offset = 0;
    for (std::size_t u = 0; u < secondary_offset_.size(); ++u) {
      secondary_offset_[u] = offset;
      offset += size(u);
    }
    require(offset == total, "ParamGatherer: the hpZ copy holds ", total, ", the units' parts ", offset);
  }

  std::size_t hpz_part_of(std::size_t unit) const {
    return hpz_part(layout_->units()[unit].padded, node_->size(), layout_->ranks());
  }

  // A prefetched unit nobody acquired before it was dropped was gathered in
  // vain: it is not prefetched in that direction again (say, a tied
  // embedding at the end of a backward whose lookup needs no weights),
  // until it is acquired in that direction.
  void drop_slot(std::size_t s) {
    if (slot_unit_[s] != npos && slot_prefetched_[s] != none) vain_[slot_prefetched_[s]][slot_unit_[s]] = true;
    slot_unit_[s] = npos;
    slot_prefetched_[s] = none;
  }

  int find_slot(std::size_t unit) const {
    for (std::size_t s = 0; s < slot_unit_.size(); ++s)
      if (slot_unit_[s] == unit) return static_cast<int>(s);
    return -1;
  }

  // Where in the arena a unit of n elements fits now, or npos.
  std::size_t arena_place(std::size_t n) const {
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
      if (end - begin < best_gap) {
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
    std::size_t offset = free_slot() >= 0 ? arena_place(u.padded) : npos;
    if (offset == npos && may_evict) {
      // Prefetched units no one acquired make room (gathered again when
      // acquired); a gather still in flight into their range is ordered
      // before the one below on the communication lane.
      for (std::size_t s = 0; s < slot_unit_.size(); ++s)
        if (!slot_in_use_[s]) drop_slot(s);
      offset = arena_place(u.padded);
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
  const T* shards_ = nullptr;
  CommChannel<Ops>* channel_ = nullptr;
  int prefetch_units_ = 0;
  std::size_t first_event_ = 0;
  std::size_t last_acquired_ = npos;  // in this micro-batch: the pass's direction
  // Options::hpz (bind_hpz): none without it.
  Buffer<T> secondary_;
  comm::AnyCommunicator* node_ = nullptr;
  std::vector<std::size_t> secondary_offset_;  // per unit: its part in secondary_ (elements) or secondary_int8_ (bytes)
  // Options::hpz_int8 (bind_hpz_int8): hpz_block_ 0 without it.
  Buffer<std::uint8_t> secondary_int8_;
  Buffer<std::uint8_t> node_payloads_;
  std::size_t hpz_block_ = 0;
  std::vector<bool> secondary_valid_;          // per unit: the part holds the current values
  // Options::qwz (bind_qwz): every rank's payload; qwz_block_ 0 without qwZ.
  Buffer<std::uint8_t> payloads_;
  std::size_t qwz_block_ = 0;
};

}  // namespace zero::detail
