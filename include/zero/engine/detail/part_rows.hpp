// Why: a buffer used to be described twice, once where finalize() allocated
// it (its name and what makes it smaller, for the out-of-memory error) and
// once where the planner's schedule listed it (its name again, its place and
// its line), and the names had begun to differ; the collectives were counted
// in one long function far from the parts that make them. Now each part of
// the engine lists its own rows from the run's shape and sizes: the buffers
// it holds and the collectives it makes per step (the reducer in
// gradient_reducer.hpp and quantized_reducer.hpp, the gatherer in
// param_gatherer.hpp, the state tiers in state_store.hpp, the update
// pipeline, the step control, the parameter store in param_store.hpp).
// finalize() allocates each buffer row and hands it to its part; the
// planner's schedule (engine/detail/schedule.hpp) is the rows' concatenation.
#pragma once

#include "zero/compiler.hpp"

#include <cstdint>
#include <string>
#include <vector>

#include "zero/comm/communicator.hpp"
#include "zero/comm/topology.hpp"
#include "zero/engine/detail/buffer_sizes.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/run_shape.hpp"

namespace zero {

// ---- Buffers ----------------------------------------------------------------

enum class Place { device, host, disk };

// The memory_report() line that counts a buffer (not_reported: the step's
// control values and the swap file's rounding to whole records).
enum class ReportedAs { params, grads, master, optimizer_states, communication_buffers, not_reported };

struct BufferRow {
  const char* name = "";  // in finalize()'s allocation errors and the planner's listing
  const char* line = "";  // the planner's line that holds it (docs/planner.md)
  ReportedAs reported = ReportedAs::not_reported;
  Place place = Place::host;
  std::uint64_t elements = 0;
  std::uint64_t element_bytes = 0;
  // What makes it smaller, for finalize()'s out-of-memory error.
  std::string smaller;

  std::uint64_t bytes() const { return elements * element_bytes; }
};

using BufferRows = std::vector<BufferRow>;

// Where the backend's buffers are.
constexpr Place backend_place(const RunShape& run) { return run.device_backend ? Place::device : Place::host; }

// Where master and state live (engine/detail/state_store.hpp,
// offload/disk_state_store.hpp): the backend's memory, page-locked host
// memory, or the swap file.
constexpr Place store_place(const RunShape& run) {
  return run.offload == OffloadTier::none  ? backend_place(run)
         : run.offload == OffloadTier::cpu ? Place::host
                                           : Place::disk;
}

// What makes a buffer smaller where a stage would shard it.
inline std::string shard_it(bool sharded, const char* stage_that_does) {
  return sharded ? "more ranks" : stage_that_does;
}
// The same for what is sized by the owned elements: master, state, and the
// update's host copies.
inline std::string smaller_owned(const RunShape& run) {
  return shard_it(run.stage.states_sharded,
                  "stages 1-3 shard the master weights and optimizer state: use stage<1> or higher, or more ranks");
}

// ---- Collectives ------------------------------------------------------------

// Which ranks a collective runs over: every rank, the ranks of this rank's
// node, or the ranks at its place on every node (comm::Topology; node() and
// across() of a communicator).
enum class RankGroup : std::uint8_t { all, node, across };

// One kind of collective a part makes, per optimizer step and rank, as the
// communicators count it (comm/communicator.hpp: a ring moves B(N-1)/N per
// reduce-scatter or all-gather of a B-byte buffer, twice that per
// all-reduce); each unit is a call of its own.
struct CollectiveRow {
  const char* name;  // what it moves, and when
  comm::Collective kind;
  std::uint64_t calls = 0;
  std::uint64_t elements = 0;  // sent by this rank (= received)
  std::uint64_t bytes = 0;     // sent by this rank (= received)
  RankGroup group = RankGroup::all;

  // The bytes of these that rank `rank` sends to another node
  // (comm/topology.hpp's counting rule: a ring over every rank crosses at
  // the last rank of each node; nothing sent inside a node crosses,
  // everything sent across nodes does).
  std::uint64_t across(const comm::Topology& topology, int rank) const {
    switch (group) {
      case RankGroup::all: return topology.ring_send_crosses(rank) ? bytes : 0;
      case RankGroup::node: return 0;
      case RankGroup::across: return bytes;
    }
    return 0;
  }
  // Summed over every rank: what the links between nodes carry.
  std::uint64_t across_all_ranks(const comm::Topology& topology) const {
    const auto nodes = static_cast<std::uint64_t>(topology.nodes());
    switch (group) {
      case RankGroup::all: return nodes > 1 ? nodes * bytes : 0;
      case RankGroup::node: return 0;
      case RankGroup::across: return static_cast<std::uint64_t>(topology.ranks) * bytes;
    }
    return 0;
  }
};

using CollectiveRows = std::vector<CollectiveRow>;

// What a part needs to count its collectives: the layout's units, the
// ranks' topology and the Options.
struct CollectiveCounter {
  const Layout& layout;
  comm::Topology topology;
  const Options& options;

  std::uint64_t micro_batches() const { return static_cast<std::uint64_t>(options.grad_accumulation_steps); }
  int ranks_in(RankGroup group) const {
    return group == RankGroup::node ? topology.ranks_per_node : group == RankGroup::across ? topology.nodes()
                                                                                           : layout.ranks();
  }
  // `times` calls per unit and step, each moving the whole padded unit
  // (`passes`: 2 for an all-reduce, which reduces and then distributes).
  // `group`: over which ranks; `int8`: the unit travels as every rank's
  // int8 payload of its part (its shard over every rank, hpZ's part inside
  // the node; quant/symmetric.hpp, blocks of qwz_block).
  CollectiveRow per_unit(const char* name, comm::Collective kind, std::uint64_t times, std::uint64_t element_bytes,
                         std::uint64_t passes, RankGroup group = RankGroup::all, bool int8 = false) const {
    const int ranks = ranks_in(group);
    CollectiveRow c{name, kind};
    c.group = group;
    for (const auto& u : layout.units()) {
      // (hpZ's int8 parts with qwZ are their shards' payloads: engine/layout.hpp.)
      const std::size_t part = u.padded / static_cast<std::size_t>(ranks);
      const std::uint64_t bytes =
          int8 ? static_cast<std::uint64_t>(ranks) *
                     hpz_int8_part_bytes(part, u.shard, options.qwz_block, options.qwz || group == RankGroup::all)
               : u.padded * element_bytes;
      c.calls += times;
      c.elements += times * passes * comm::ByteCounters::ring_share(u.padded, ranks);
      c.bytes += times * passes * comm::ByteCounters::ring_share(bytes, ranks);
    }
    return c;
  }
};

}  // namespace zero
