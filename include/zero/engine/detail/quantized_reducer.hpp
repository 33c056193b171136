// Why: across nodes the gradient reduce-scatter is the last full-size
// transfer of stage 3 once hpZ and qwZ have cut the gathers, about the
// unit's 16-bit size per rank per step. ZeRO++'s qgZ replaces it with two
// all-to-alls of block-quantized gradients, one inside the node and one
// across nodes, so that what crosses is 1/ranks_per_node of the unit in
// int4 or int8 codes. This part is that reduction; GradientReducer calls it
// in place of the communicator's reduce_scatter when Options::qgz is on.
//
// With L ranks per node and M nodes (comm::Topology: rank r is place
// r % L of node r / L), rank r must end with shard r of the sum over every
// rank. Shard s = m * L + l belongs to place l of node m, so:
//   1. inside the node, each rank quantizes the shards of every place l
//      (m * L + l for every node m: a strided run, quant::Pieces) and sends
//      them to its node-mate at place l (node().all_to_all); each rank
//      dequantizes what its L node-mates sent and sums it in fp32: the
//      node's partial sums of its own place's shards, one per node;
//   2. across nodes, it quantizes those M partial sums and sends partial m
//      to its place on node m (across().all_to_all); the M partials that
//      come back, summed in fp32, are shard r of the whole sum.
// One node skips step 2, one rank per node step 1 (its gradient is its
// node's sum, widened to fp32 unquantized). DeepSpeed instead falls back to
// a plain reduce-scatter when a tensor's size does not divide; here shards
// are whole by the layout's padding, so every unit size and rank count takes
// this path.
//
// Error feedback (Options::qgz_error_feedback): each quantization adds the
// residual that the previous one of the same values left and keeps the new
// one (quant/symmetric.hpp), for step 1 per gradient element and for step 2
// per node partial, so that a step's dropped fraction is sent in the next.
//
// All of it runs on the communication lane, in order (each unit's steps
// use the same buffers; the lane runs them one after another).
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "zero/comm/any_communicator.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/detail/part_rows.hpp"
#include "zero/error.hpp"
#include "zero/precision/types.hpp"
#include "zero/quant/symmetric.hpp"

namespace zero::detail {

// qgZ's buffers for a run (engine/detail/part_rows.hpp), sized by buffer_sizes().
struct QgzRows {
  BufferRow payloads, sums, residuals;
  BufferRows list() const { return {payloads, sums, residuals}; }
};
inline QgzRows qgz_rows(const RunShape& run, const BufferSizes& z) {
  const Place at = backend_place(run);
  constexpr auto comm = ReportedAs::communication_buffers;
  const char* smaller = "turn Options::qgz off, or split the largest unit (the payloads hold every rank's codes of its "
                        "largest shard)";
  QgzRows r;
  r.payloads = {"qgZ payloads (every rank's codes and scales of a shard, sent and received)", "qgz_payloads", comm, at,
                z.qgz_payloads, 1, smaller};
  r.sums = {"qgZ fp32 sums (the node's partial sums and the shard)", "qgz_sums", comm, at, z.qgz_sums, 4, smaller};
  r.residuals = {"qgZ error feedback residuals (fp32)", "qgz_residuals", comm, at, z.qgz_residuals, 4,
                 "turn Options::qgz_error_feedback off (the residuals are fp32 of every gradient element), or put more "
                 "ranks on each node"};
  return r;
}
// qgZ's reductions per step: `times` per unit, each an all-to-all inside
// the node of every node's shards at each place (when a node has several
// ranks) and one across nodes of the node's partial sums (when there are
// several nodes), all as payloads; `at_step`: stage 1's, at the step,
// rather than as each bucket fills.
inline CollectiveRows qgz_collectives(const CollectiveCounter& count, std::uint64_t times, bool at_step) {
  const quant::Format format{count.options.qgz_bits, count.options.qgz_block};
  const auto per_node = static_cast<std::uint64_t>(count.topology.ranks_per_node);
  const auto nodes = static_cast<std::uint64_t>(count.topology.nodes());
  CollectiveRow inside{"", comm::Collective::all_to_all}, between{"", comm::Collective::all_to_all};
  inside.group = RankGroup::node;
  between.group = RankGroup::across;
  for (const auto& u : count.layout.units()) {
    const std::uint64_t payload = format.payload_bytes(u.shard);
    inside.calls += times;
    inside.elements += times * (per_node - 1) * nodes * u.shard;
    inside.bytes += times * (per_node - 1) * nodes * payload;
    between.calls += times;
    between.elements += times * (nodes - 1) * u.shard;
    between.bytes += times * (nodes - 1) * payload;
  }
  CollectiveRows rows;
  if (per_node > 1) {
    inside.name = at_step ? "qgZ gradient all-to-all inside the node at the step (codes and scales of each node's "
                            "shards)"
                          : "qgZ gradient all-to-all inside the node as each bucket fills, every micro-batch (codes "
                            "and scales of each node's shards)";
    rows.push_back(inside);
  }
  if (nodes > 1) {
    between.name = at_step ? "qgZ all-to-all across nodes of the node's partial sums at the step (codes and scales)"
                           : "qgZ all-to-all across nodes of the node's partial sums as each bucket fills, every "
                             "micro-batch (codes and scales)";
    rows.push_back(between);
  }
  return rows;
}

template <class Ops, class G>
class QuantizedReducer {
 public:
  template <class E>
  using Buffer = typename Ops::template Buffer<E>;

  // The buffers finalize() allocated (BufferSizes::qgz_*).
  struct Buffers {
    Buffer<std::uint8_t> payloads;  // what is sent, then what arrives: every rank's payload of the largest shard each
    Buffer<float> sums;             // the node's partial sums (one shard per node), then the result
    Buffer<float> residuals;        // error feedback: step 1's per padded element, then step 2's per node partial
  };

  void bind(Buffers buffers, const quant::Format& format, const Layout& layout, comm::AnyCommunicator& node,
            comm::AnyCommunicator& across) {
    b_ = std::move(buffers);
    format_ = format;
    layout_ = &layout;
    node_ = &node;
    across_ = &across;
    const std::size_t per_node = static_cast<std::size_t>(node.size()), nodes = static_cast<std::size_t>(across.size());
    require(per_node * nodes == static_cast<std::size_t>(layout.ranks()), "qgZ: ", per_node, " ranks per node on ",
            nodes, " nodes are not the ", layout.ranks(), " ranks the layout is sharded over");
    // Where each unit's residuals start: step 1's at the unit's full offset,
    // step 2's after all of step 1's (none where a step does not run).
    const bool feedback = b_.residuals.size() != 0;
    const std::size_t first = feedback && per_node > 1 ? layout.padded_total() : 0;
    node_residual_.assign(layout.units().size(), 0);
    std::size_t offset = first;
    for (std::size_t u = 0; u < node_residual_.size(); ++u) {
      node_residual_[u] = offset;
      offset += hpz_part(layout.units()[u].padded, node.size(), layout.ranks());
    }
    const std::size_t needed = feedback ? (nodes > 1 ? offset : first) : 0;
    require(b_.residuals.size() == needed, "qgZ: the error feedback residuals hold ", b_.residuals.size(),
            " elements, the units need ", needed);
    forget_residuals();  // (allocations are not zeroed)
  }
  bool bound() const { return node_ != nullptr; }
  // Error feedback's residuals to zero (after a load: they are not saved).
  void forget_residuals() {
    if (b_.residuals.size() != 0) Ops::zero(b_.residuals.data(), b_.residuals.size());
  }
  std::uint64_t bytes() const { return b_.payloads.bytes() + b_.sums.bytes() + b_.residuals.bytes(); }

  // Collective over every rank: unit `unit`'s gradient g[0, padded) on
  // every rank becomes this rank's shard of their sum, in fp32, at the
  // returned address (valid until the next call).
  const float* reduce(std::size_t unit, const G* g) {
    const UnitInfo& u = layout_->units()[unit];
    const std::size_t per_node = static_cast<std::size_t>(node_->size());
    const std::size_t nodes = static_cast<std::size_t>(across_->size());
    const std::size_t shard = u.shard, q = format_.payload_bytes(shard);
    const bool feedback = b_.residuals.size() != 0;
    std::uint8_t* sent = b_.payloads.data();
    std::uint8_t* arrived = sent + per_node * nodes * q;
    float* partial = b_.sums.data();  // nodes shards: the node's sum of each node's shard at this rank's place
    // 1. Inside the node.
    if (per_node == 1) {
      Ops::convert(partial, g, u.padded);  // shard m of this one-rank node is node m's
    } else {
      for (std::size_t place = 0; place < per_node; ++place)
        Ops::quantize(g + place * shard, feedback ? b_.residuals.data() + u.full_offset + place * shard : nullptr,
                      quant::Pieces{nodes, shard, per_node * shard, q}, format_, sent + place * nodes * q);
      node_->all_to_all(sent, arrived, nodes * q, DType::u8);
      // From node-mate j, its pieces for this place: node m's at j * nodes * q + m * q.
      for (std::size_t m = 0; m < nodes; ++m)
        Ops::dequantize_sum(arrived + m * q, per_node, nodes * q, shard, format_, partial + m * shard);
    }
    if (nodes == 1) return partial;
    // 2. Across nodes: partial m to this place on node m.
    float* result = partial + nodes * shard;
    Ops::quantize(partial, feedback ? b_.residuals.data() + node_residual_[unit] : nullptr,
                  quant::Pieces{nodes, shard, shard, q}, format_, sent);
    across_->all_to_all(sent, arrived, q, DType::u8);
    Ops::dequantize_sum(arrived, nodes, q, shard, format_, result);
    return result;
  }

 private:
  Buffers b_;
  quant::Format format_{};
  const Layout* layout_ = nullptr;
  comm::AnyCommunicator* node_ = nullptr;
  comm::AnyCommunicator* across_ = nullptr;
  std::vector<std::size_t> node_residual_;  // per unit: where its step-2 residuals start
};

}  // namespace zero::detail
