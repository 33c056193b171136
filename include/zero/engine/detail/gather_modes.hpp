// Why: stage 3 gathers a unit in one of four ways, and they used to be woven
// into one function of ParamGatherer. They are two independent choices,
// each made once when the gatherer is bound:
// - how a unit travels over every rank (WireGather): as it is, or as every
//   rank's int8 payload of its shard (Options::qwz, ZeRO++'s quantized
//   weights: quant/symmetric.hpp's codes and one fp32 scale per block; the
//   same values on every rank, within half a step of the parameters);
// - what a rank keeps of a gathered unit for the later gathers inside its
//   node (NodeCopy, Options::hpz, ZeRO++'s hierarchical partitioning):
//   nothing, part node_rank of the unit's node_size parts, or that part as
//   int8 payloads (Options::hpz_int8: half the memory and bytes; with qwZ
//   the part is forward's own payloads of its shards, so backward
//   dequantizes exactly what forward did). The parts are copies of the same
//   values, so a unit gathered inside the node is the same bit for bit; they
//   go stale exactly when a gathered copy does (drop, drop_all).
// The gatherer (param_gatherer.hpp) owns the arena and the slots and calls
// these; they issue the collectives.
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>
#include <cstdint>
#include <utility>
#include <variant>
#include <vector>

#include "zero/comm/any_communicator.hpp"
#include "zero/engine/detail/comm_channel.hpp"
#include "zero/engine/layout.hpp"
#include "zero/error.hpp"
#include "zero/precision/types.hpp"
#include "zero/quant/symmetric.hpp"

namespace zero::detail {

// A unit over every rank: this rank's shard to its position in `dst` (the
// unit's padded elements), then an all_gather fills the rest.
template <class Ops, class T>
class WireGather {
 public:
  template <class E>
  using Buffer = typename Ops::template Buffer<E>;

  // Options::qwz: room for every rank's payload of the largest shard, and
  // the elements per scale.
  void bind_qwz(Buffer<std::uint8_t> payloads, std::size_t block) {
    payloads_ = std::move(payloads);
    block_ = block;
  }
  std::size_t qwz_block() const { return block_; }  // 0: the unit travels as it is
  std::uint64_t payload_bytes() const { return payloads_.bytes(); }
  // qwZ: rank r's payload of the last unit gathered, as it travelled.
  const std::uint8_t* payload_of(std::size_t rank, std::size_t bytes) const { return payloads_.data() + rank * bytes; }

  void gather(CommChannel<Ops>& channel, const UnitInfo& u, const T* shard, T* dst) {
    const auto rank = static_cast<std::size_t>(channel.rank());
    if (block_ == 0) {
      T* mine = dst + rank * u.shard;
      Ops::copy(mine, shard, u.shard);
      channel->all_gather(mine, dst, u.shard, dtype_traits<T>::dtype, false);
      return;
    }
    const quant::Format format{8, block_};
    const quant::Pieces one = quant::Pieces::one(u.shard, format);
    std::uint8_t* all = payloads_.data();
    std::uint8_t* mine = all + rank * one.payload_stride;
    Ops::quantize(shard, nullptr, one, format, mine);
    channel->all_gather(mine, all, one.payload_stride, DType::u8, false);
    // Every rank's payload, back to back, into every rank's shard.
    Ops::dequantize(all, quant::Pieces{static_cast<std::size_t>(channel.size()), u.shard, u.shard, one.payload_stride},
                    format, dst);
  }

 private:
  Buffer<std::uint8_t> payloads_;
  std::size_t block_ = 0;
};

// What a rank keeps of a gathered unit for later gathers inside its node.
template <class Ops, class T>
class NodeCopy {
 public:
  template <class E>
  using Buffer = typename Ops::template Buffer<E>;

  // Options::hpz: every unit's part (in unit order: engine/layout.hpp's
  // hpz_part), and the node's ranks.
  void bind_parts(Buffer<T> parts, const Layout& layout, comm::AnyCommunicator& node) {
    Parts p{std::move(parts)};
    bind(layout, node, p.values.size(), [&](std::size_t u) { return part_of(u); });
    mode_ = std::move(p);
  }
  // Options::hpz_int8 instead: the parts as int8 payloads of blocks of
  // `block` (in unit order), and room for the node's payloads of the
  // largest; `qwz`: the wire's payloads (their parts are kept as they
  // travelled), or null.
  void bind_int8_parts(Buffer<std::uint8_t> parts, Buffer<std::uint8_t> node_payloads, std::size_t block,
                       const WireGather<Ops, T>* qwz, const Layout& layout, comm::AnyCommunicator& node) {
    Int8Parts p{std::move(parts), std::move(node_payloads), block, qwz};
    bind(layout, node, p.payloads.size(), [&](std::size_t u) {
      return hpz_int8_part_bytes(part_of(u), layout.units()[u].shard, block, qwz != nullptr);
    });
    mode_ = std::move(p);
  }
  bool any() const { return !std::holds_alternative<std::monostate>(mode_); }
  std::uint64_t secondary_bytes() const {
    return std::visit([](const auto& m) -> std::uint64_t { return secondary_of(m); }, mode_);
  }
  std::uint64_t payload_bytes() const {
    const auto* p = std::get_if<Int8Parts>(&mode_);
    return p ? p->node_payloads.bytes() : 0;
  }

  // Unit u's part holds its current values: a gather inside the node will do.
  bool holds(std::size_t unit) const { return any() && valid_[unit]; }
  // After a gather over every rank into `dst`: keep this rank's part.
  void keep(std::size_t unit, const T* dst) {
    if (!any()) return;
    const std::size_t part = part_of(unit);
    const T* mine = dst + static_cast<std::size_t>(node_->rank()) * part;
    if (auto* p = std::get_if<Parts>(&mode_)) {
      Ops::copy(p->values.data() + offset_[unit], mine, part);
    } else if (auto* q = std::get_if<Int8Parts>(&mode_)) {
      std::uint8_t* to = q->payloads.data() + offset_[unit];
      if (q->qwz != nullptr) {
        // The payloads of this rank's part's shards, as the wire moved them.
        const std::size_t bytes = hpz_int8_part_bytes(part, layout_->units()[unit].shard, q->block, true);
        Ops::copy(to, q->qwz->payload_of(static_cast<std::size_t>(node_->rank()), bytes), bytes);
      } else {
        const quant::Format format{8, q->block};
        Ops::quantize(mine, nullptr, quant::Pieces::one(part, format), format, to);
      }
    }
    valid_[unit] = true;
  }
  // Unit u whole into `dst` from the node's parts (holds(u) must be true).
  void gather(std::size_t unit, T* dst, std::size_t world) {
    const UnitInfo& u = layout_->units()[unit];
    const std::size_t part = part_of(unit);
    if (auto* p = std::get_if<Parts>(&mode_)) {
      T* mine = dst + static_cast<std::size_t>(node_->rank()) * part;
      Ops::copy(mine, p->values.data() + offset_[unit], part);
      node_->all_gather(mine, dst, part, dtype_traits<T>::dtype, false);
      return;
    }
    auto& q = std::get<Int8Parts>(mode_);
    // With qwZ the node's parts are every shard's payload, in rank order.
    const quant::Format format{8, q.block};
    const bool qwz = q.qwz != nullptr;
    const std::size_t piece = qwz ? u.shard : part;
    const std::size_t pieces = qwz ? world : static_cast<std::size_t>(node_->size());
    node_->all_gather(q.payloads.data() + offset_[unit], q.node_payloads.data(),
                      hpz_int8_part_bytes(part, u.shard, q.block, qwz), DType::u8, false);
    Ops::dequantize(q.node_payloads.data(), quant::Pieces{pieces, piece, piece, format.payload_bytes(piece)}, format,
                    dst);
  }
  void drop(std::size_t unit) {
    if (any()) valid_[unit] = false;
  }
  void drop_all() { valid_.assign(valid_.size(), false); }

 private:
  struct Parts {
    Buffer<T> values;
  };
  struct Int8Parts {
    Buffer<std::uint8_t> payloads;
    Buffer<std::uint8_t> node_payloads;
    std::size_t block = 0;
    const WireGather<Ops, T>* qwz = nullptr;
  };
  static std::uint64_t secondary_of(const std::monostate&) { return 0; }
  static std::uint64_t secondary_of(const Parts& p) { return p.values.bytes(); }
  static std::uint64_t secondary_of(const Int8Parts& p) { return p.payloads.bytes(); }

  // Where each unit's part starts (`size(unit)`: its part's elements or
  // bytes), checked against the copy's `total`.
  template <class Size>
  void bind(const Layout& layout, comm::AnyCommunicator& node, std::size_t total, Size&& size) {
    layout_ = &layout;
    node_ = &node;
    offset_.assign(layout.units().size(), 0);
    valid_.assign(layout.units().size(), false);
    std::size_t offset = 0;
    for (std::size_t u = 0; u < offset_.size(); ++u) {
      offset_[u] = offset;
      offset += size(u);
    }
    require(offset == total, "ParamGatherer: the hpZ copy holds ", total, ", the units' parts ", offset);
  }
  std::size_t part_of(std::size_t unit) const {
    return hpz_part(layout_->units()[unit].padded, node_->size(), layout_->ranks());
  }

  std::variant<std::monostate, Parts, Int8Parts> mode_;
  const Layout* layout_ = nullptr;
  comm::AnyCommunicator* node_ = nullptr;
  std::vector<std::size_t> offset_;  // per unit: its part's first element (Parts) or byte (Int8Parts)
  std::vector<bool> valid_;          // per unit: the part holds the current values
};

}  // namespace zero::detail
