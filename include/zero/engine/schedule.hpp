// Why: what one rank of a run holds and sends follows from the stage plan
// (engine/stage_plan.hpp), the offload tier, whether the backend is a device,
// the element sizes and the Options, and nothing else. The schedule derives
// it in one place: every buffer ZeroOptimizer::finalize() allocates, with its
// elements and its place (device, host or disk), from the sizes finalize()
// itself allocates (engine/buffer_sizes.hpp, engine/disk_window.hpp), and
// every collective of a step with its calls and bytes, from the stage plan's
// decisions (which collective, when), never from the stage number. The
// planner (engine/plan.hpp) is this schedule printed; tests hold it to real
// optimizers' memory_report() and comm_report(), to the byte.
#pragma once

#include "zero/config.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "zero/comm/communicator.hpp"
#include "zero/engine/buffer_sizes.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/ownership.hpp"
#include "zero/engine/reports.hpp"
#include "zero/engine/stage_plan.hpp"
#include "zero/engine/state_blocks.hpp"
#include "zero/error.hpp"
#include "zero/policies.hpp"
#include "zero/quant/dynamic_code.hpp"

namespace zero {

// What of an optimizer's type and run decides its schedule.
struct ScheduleSpec {
  StagePlan stage = stage_plan(0);
  OffloadTier offload = OffloadTier::none;
  bool device_backend = true;      // backend::Cuda; false: backend::Host (everything in host memory)
  std::size_t element_bytes = 2;   // a parameter or gradient element (one type): 2 mixed precision, 4 fp32
  int state_slots = 2;             // optimizer-state slots (Adam: m and v; SGD: momentum)
  bool overlap = false;            // communication on a stream of its own: gradient staging double-buffered
  // Stage 3: acquire_unit() calls per unit and micro-batch, each a gather:
  // the documented training loop acquires every unit once in forward and
  // once in backward (engine/engine.hpp).
  int acquires_per_micro_batch = 2;
  // How the master of 16-bit parameters is kept (Options::master is the
  // engine's; the schedule reads it from here).
  MasterWeights master = MasterWeights::fp32;
  StateFormat states = StateFormat::fp32;  // (Options::states)
  int ranks_per_node = 0;  // comm::Topology (0: one node of every rank): hpZ's copy and node collectives
  // Whose buffers: ranks differ only with 8-bit block-wise states, by the
  // blocks their shard boundaries cut and the small parameters they own
  // (engine/state_blocks.hpp), and on the disk tier by a swap-file record.
  std::size_t rank = 0;

  bool mixed() const { return element_bytes != 4; }  // 16-bit parameters beside an fp32 master
};

// The spec of the optimizer type Opt (a ZeroOptimizer); `overlap`: whether
// its communicator runs on a stream of its own (comm::Nccl on GPUs).
template <class Opt>
constexpr ScheduleSpec schedule_spec_for(bool overlap) {
  ScheduleSpec s;
  s.stage = Opt::rules;
  s.offload = offload_tier<typename Opt::offload_policy>();
  s.device_backend = Opt::backend_policy::device;
  s.element_bytes = sizeof(typename Opt::param_type);
  s.state_slots = Opt::state_slots;
  s.overlap = overlap;
  return s;
}

enum class Place { device, host, disk };

// The memory_report() line that counts a buffer (not_reported: the step's
// control values and the swap file's rounding to whole records).
enum class ReportedAs { params, grads, master, optimizer_states, communication_buffers, not_reported };

struct ScheduledBuffer {
  const char* name;  // as finalize() names it in its allocation errors
  const char* line;  // the planner's line that holds it (docs/planner.md)
  ReportedAs reported;
  Place place;
  std::uint64_t elements = 0;
  std::uint64_t element_bytes = 0;
  std::uint64_t bytes() const { return elements * element_bytes; }
};

// One kind of collective the step makes, per optimizer step and rank, as the
// communicators count it (comm/communicator.hpp: a ring moves B(N-1)/N per
// reduce-scatter or all-gather of a B-byte buffer, twice that per
// all-reduce); each unit is a call of its own.
// Which ranks a collective runs over: every rank, the ranks of this rank's
// node, or the ranks at its place on every node (comm::Topology; node() and
// across() of a communicator).
enum class RankGroup : std::uint8_t { all, node, across };

struct ScheduledCollective {
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

struct Schedule {
  BufferSizes sizes;
  std::vector<ScheduledBuffer> buffers;          // in the order finalize() allocates them
  std::vector<ScheduledCollective> collectives;  // in the order a step makes them
  std::string gradient_note;                     // gradient_saving_note(): what finalize() prints, or ""

  // Bytes of the buffers on one of the planner's lines, by place.
  PlacedBytes line(std::string_view name) const {
    PlacedBytes p;
    for (const auto& b : buffers)
      if (name == b.line) add(p, b);
    return p;
  }
  // memory_report().placed of an optimizer built on this schedule.
  MemoryReport::Placement placement() const {
    MemoryReport::Placement m;
    for (const auto& b : buffers) {
      switch (b.reported) {
        case ReportedAs::params: add(m.params, b); break;
        case ReportedAs::grads: add(m.grads, b); break;
        case ReportedAs::master: add(m.master, b); break;
        case ReportedAs::optimizer_states: add(m.optimizer_states, b); break;
        case ReportedAs::communication_buffers: add(m.communication_buffers, b); break;
        case ReportedAs::not_reported: break;
      }
    }
    return m;
  }
  // Per step: calls, elements and bytes sent (= received) of one kind.
  std::uint64_t calls(comm::Collective kind) const { return sum(kind, &ScheduledCollective::calls); }
  std::uint64_t elements(comm::Collective kind) const { return sum(kind, &ScheduledCollective::elements); }
  std::uint64_t bytes(comm::Collective kind) const { return sum(kind, &ScheduledCollective::bytes); }
  // Per step: the bytes of one kind that rank `rank` sends to another node,
  // and that all ranks together do.
  std::uint64_t across(comm::Collective kind, const comm::Topology& topology, int rank) const {
    return sum(kind, [&](const ScheduledCollective& c) { return c.across(topology, rank); });
  }
  std::uint64_t across_all_ranks(comm::Collective kind, const comm::Topology& topology) const {
    return sum(kind, [&](const ScheduledCollective& c) { return c.across_all_ranks(topology); });
  }

 private:
  static void add(PlacedBytes& p, const ScheduledBuffer& b) {
    (b.place == Place::device ? p.device : b.place == Place::host ? p.host : p.disk) += b.bytes();
  }
  // Over the collectives of one kind: a field, or what `of` says of each.
  template <class Of>
  std::uint64_t sum(comm::Collective kind, Of of) const {
    std::uint64_t s = 0;
    for (const auto& c : collectives)
      if (c.kind == kind) s += std::invoke(of, c);
    return s;
  }
};

// The combinations ZeroOptimizer refuses (at compile time or at finalize()),
// refused here with the planner's words.
inline void require_valid_schedule(const ScheduleSpec& spec, const Options& options) {
  const bool offloaded = spec.offload != OffloadTier::none;
  require(!offloaded || spec.stage.states_sharded,
          "schedule: offload moves this rank's partition of the optimizer state; stage 0 has none: use stage >= 1");
  require(spec.offload != OffloadTier::cpu || spec.device_backend,
          "schedule: offload::Cpu moves the optimizer state from device memory to the host, but with backend::Host "
          "it is in host memory already; use offload none (or nvme, to move it to disk)");
  require(!options.delayed_update || (offloaded && spec.device_backend),
          "schedule: Options::delayed_update overlaps the CPU update of offload with the next step's work on the "
          "device; it needs offload cpu or nvme with a device backend; clear the option otherwise");
  const std::size_t master_bytes = master_element_bytes(spec.master), state_bytes = state_element_bytes(spec.states);
  const std::size_t least_window = offload::disk_least_window_bytes(spec.state_slots, master_bytes, state_bytes);
  require(spec.offload != OffloadTier::nvme || options.nvme.window_bytes >= least_window,
          "schedule: Options::nvme.window_bytes is ", options.nvme.window_bytes, " (master ", name(spec.master),
          ", states ", name(spec.states), "); ",
          offload::disk_window_rule(spec.state_slots, master_bytes, state_bytes));
  const std::string zeropp = zeropp_stage_problem(options.hpz, options.qwz, options.qgz, spec.stage.stage);
  require(zeropp.empty(), "schedule: Options::", zeropp);
  require(spec.master == MasterWeights::fp32 || spec.element_bytes == 2,
          "schedule: Options::master is remainder, but the parameters are fp32: the remainder master is bf16 "
          "parameters plus 16 bits");
  require(spec.element_bytes == 2 || spec.element_bytes == 4, "schedule: element_bytes is ", spec.element_bytes,
          "; parameters and gradients are 2 bytes (bf16, fp16) or 4 (fp32)");
  require(spec.acquires_per_micro_batch >= 1, "schedule: acquires_per_micro_batch must be >= 1");
}

// `layout` must be finalized (its padding decides every size).
inline Schedule schedule(const Layout& layout, const ScheduleSpec& spec, const Options& options) {
  require_valid_schedule(spec, options);
  require(spec.rank < static_cast<std::size_t>(layout.ranks()), "schedule: rank ", spec.rank, " of a layout of ",
          layout.ranks(), " rank(s); ranks count from 0");
  const StagePlan& stage = spec.stage;
  const bool offloaded = spec.offload != OffloadTier::none;
  Schedule s;
  // fp32 training keeps no master of its own unless the master leaves the
  // backend (the backend then holds a working copy): as finalize().
  const bool separate_master = spec.mixed() || offloaded;
  // (even where there is no master of its own: the disk tier's records need its size)
  const std::size_t master_bytes = master_element_bytes(spec.master);
  const std::size_t state_bytes = state_element_bytes(spec.states);
  const BufferSpec buffer_spec{stage,        separate_master, spec.element_bytes, spec.state_slots,
                               spec.overlap, spec.offload,    spec.device_backend, master_bytes,
                               state_bytes,  spec.ranks_per_node, spec.rank};
  s.sizes = buffer_sizes(layout, buffer_spec, options);
  const BufferSizes& z = s.sizes;
  const std::uint64_t eb = spec.element_bytes;
  s.gradient_note = gradient_saving_note(z, buffer_spec, layout, options);

  // ---- Buffers ----
  const Place backend = spec.device_backend ? Place::device : Place::host;
  // The store of master and state (engine/state_store.hpp,
  // offload/disk_state_store.hpp): the backend's memory, page-locked host
  // memory, or the swap file.
  const Place store = spec.offload == OffloadTier::none  ? backend
                      : spec.offload == OffloadTier::cpu ? Place::host
                                                         : Place::disk;
  auto add = [&](const char* name, const char* line, ReportedAs reported, Place place, std::uint64_t elements,
                 std::uint64_t element_bytes) {
    if (elements != 0) s.buffers.push_back({name, line, reported, place, elements, element_bytes});
  };
  add("parameters", "params", ReportedAs::params, backend, z.params, eb);
  add("gradients", "grads", ReportedAs::grads, backend, z.grads, eb);
  add(master_bytes == 2 ? "fp32 master remainders" : "fp32 master weights", "master", ReportedAs::master, store,
      z.master, master_bytes);
  if (spec.states == StateFormat::blockwise8 && spec.state_slots > 0) {
    // This rank's runs (engine/state_blocks.hpp): another rank's differ by
    // the blocks its shard boundaries cut and the small parameters it owns.
    // The disk tier keeps a code for every owned element in its records
    // (those of fp32 runs unused) and the absmax and fp32 runs in host
    // memory (offload/disk_state_store.hpp).
    const StateBlocks blocks = StateBlocks::build(Ownership{stage, spec.rank, &layout}, options.state_block,
                                                  options.state_fp32_below);
    const bool disk = spec.offload == OffloadTier::nvme;
    for (int k = 0; k < spec.state_slots; ++k) {
      add("optimizer state (8-bit codes)", "optimizer_states", ReportedAs::optimizer_states, store,
          disk ? z.state_per_slot : blocks.coded_elements(), 1);
      add("optimizer state (block absmax)", "optimizer_states", ReportedAs::optimizer_states,
          disk ? Place::host : store, blocks.blocks(), 4);
      add("optimizer state (fp32, small parameters)", "optimizer_states", ReportedAs::optimizer_states,
          disk ? Place::host : store, blocks.fp32_elements(), 4);
      // A device's step reads the slot's code table from device memory.
      if (store == Place::device)
        add("optimizer state (8-bit code table)", "optimizer_states", ReportedAs::optimizer_states, store,
            static_cast<std::uint64_t>(quant::code_size), 4);
    }
  } else {
    for (int k = 0; k < spec.state_slots; ++k)
      add(state_bytes == 2 ? "optimizer state (bf16)" : "optimizer state", "optimizer_states",
          ReportedAs::optimizer_states, store, z.state_per_slot, state_bytes);
  }
  add(z.host_grad_sets == 2 ? "host copies of the owned gradient (two: delayed update)"
                            : "host copy of the owned gradient",
      "grads", ReportedAs::grads, Place::host, z.host_grads, eb);
  add("host staging of the parameters", "param_staging", ReportedAs::communication_buffers, Place::host,
      z.host_params, eb);
  add("gradient staging (one bucket)", "gradient_staging", ReportedAs::communication_buffers, backend, z.grad_staging,
      eb);
  add("fp32 reduction staging", "reduce_staging_fp32", ReportedAs::communication_buffers, backend,
      z.reduce_staging_fp32, 4);
  add("reduce-scatter staging", "shard_staging", ReportedAs::communication_buffers, backend, z.shard_staging, eb);
  add("stage-3 gather arena", "gather_slots", ReportedAs::communication_buffers, backend, z.gather_slots, eb);
  add("hpZ secondary copy (1/ranks_per_node of every unit)", "params", ReportedAs::params, backend,
      z.hpz_secondary, eb);
  add("hpZ secondary copy as int8 blocks (1/ranks_per_node of every unit)", "params", ReportedAs::params, backend,
      z.hpz_int8_secondary, 1);
  add("hpZ int8 staging (the node's payloads of a part)", "hpz_int8_staging", ReportedAs::communication_buffers,
      backend, z.hpz_int8_staging, 1);
  add("qwZ payloads (every rank's int8 codes and scales of a shard)", "qwz_staging",
      ReportedAs::communication_buffers, backend, z.qwz_staging, 1);
  add("qgZ payloads (every rank's codes and scales of a shard, sent and received)", "qgz_payloads",
      ReportedAs::communication_buffers, backend, z.qgz_payloads, 1);
  add("qgZ fp32 sums (the node's partial sums and the shard)", "qgz_sums", ReportedAs::communication_buffers, backend,
      z.qgz_sums, 4);
  add("qgZ error feedback residuals (fp32)", "qgz_residuals", ReportedAs::communication_buffers, backend,
      z.qgz_residuals, 4);
  // The step's control values, on the backend and their host copy (page-
  // locked where the backend has such memory).
  add("control values", "control", ReportedAs::not_reported, backend, z.control, sizeof(double));
  add("control values (host copy)", "control", ReportedAs::not_reported, Place::host, z.control, sizeof(double));
  add("offload::Nvme host window", "nvme_window", ReportedAs::communication_buffers, Place::host, z.disk_window, 4);
  if (spec.offload == OffloadTier::nvme) {
    // The swap file holds whole records: what the owned master and state
    // leave of the last one is on disk too.
    const std::uint64_t state =
        static_cast<std::uint64_t>(z.state_per_slot) *
        offload::disk_record_element_bytes(spec.state_slots, master_bytes, state_bytes);
    add("swap file (rounded to whole records)", "swap_padding", ReportedAs::not_reported, Place::disk,
        z.swap_file_bytes - state, 1);
  }

  // ---- Collectives per optimizer step ----
  const int n = layout.ranks();
  const comm::Topology topology = comm::Topology::checked(n, spec.ranks_per_node, "schedule: ranks_per_node");
  auto ring = [n](std::uint64_t bytes) { return comm::ByteCounters::ring_share(bytes, n); };
  const std::uint64_t micro = static_cast<std::uint64_t>(options.grad_accumulation_steps);
  // Gradients travel in fp32 when reduce_dtype asks and they are 16-bit.
  const std::uint64_t reduce_bytes = options.reduce_dtype == ReduceDType::fp32 ? 4 : eb;
  // `times` calls per unit and step, each moving the whole padded unit
  // (`passes`: 2 for an all-reduce, which reduces and then distributes).
  // `group`: over which ranks (RankGroup); `int8`: the unit travels as every
  // rank's int8 payload of its part (its shard over every rank, hpZ's part
  // inside the node; quant/symmetric.hpp, blocks of qwz_block).
  auto per_unit = [&](const char* name, comm::Collective kind, std::uint64_t times, std::uint64_t element_bytes,
                      std::uint64_t passes, RankGroup group = RankGroup::all, bool int8 = false) {
    const int ranks = group == RankGroup::node ? topology.ranks_per_node
                      : group == RankGroup::across ? topology.nodes()
                                                   : n;
    ScheduledCollective c{name, kind};
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
    s.collectives.push_back(c);
  };
  using comm::Collective;
  const std::uint64_t gathers = micro * static_cast<std::uint64_t>(spec.acquires_per_micro_batch);
  if (stage.params_sharded && !options.hpz)
    per_unit(options.qwz ? "parameter all-gather of int8 codes and scales (qwZ) at every acquire_unit (forward and "
                           "backward, every micro-batch)"
                         : "parameter all-gather at every acquire_unit (forward and backward, every micro-batch)",
             Collective::all_gather, gathers, eb, 1, RankGroup::all, options.qwz);
  if (stage.params_sharded && options.hpz) {
    per_unit(options.qwz ? "parameter all-gather of int8 codes and scales (qwZ) at a unit's first acquire_unit after "
                           "a step, keeping hpZ's secondary copy"
                         : "parameter all-gather at a unit's first acquire_unit after a step, keeping hpZ's "
                           "secondary copy",
             Collective::all_gather, 1, eb, 1, RankGroup::all, options.qwz);
    per_unit(options.hpz_int8 ? "hpZ all-gather inside the node of int8 codes and scales at every later "
                                "acquire_unit (backward, further micro-batches)"
                              : "hpZ all-gather inside the node at every later acquire_unit (backward, further "
                                "micro-batches)",
             Collective::all_gather, gathers - 1, eb, 1, RankGroup::node, options.hpz_int8);
  }
  if (stage.all_reduce_on_flush)
    per_unit("gradient all-reduce on the last micro-batch", Collective::all_reduce, 1, reduce_bytes, 2);
  // qgZ (engine/quantized_reducer.hpp): `times` reductions per unit and
  // step, each an all-to-all inside the node of every node's shards at each
  // place (when a node has several ranks) and one across nodes of the node's
  // partial sums (when there are several nodes), all as payloads.
  const quant::Format qgz_format{options.qgz_bits, options.qgz_block};
  auto qgz_per_unit = [&](std::uint64_t times) {
    const auto per_node = static_cast<std::uint64_t>(topology.ranks_per_node);
    const auto nodes = static_cast<std::uint64_t>(topology.nodes());
    ScheduledCollective inside{"", Collective::all_to_all}, between{"", Collective::all_to_all};
    inside.group = RankGroup::node;
    between.group = RankGroup::across;
    for (const auto& u : layout.units()) {
      const std::uint64_t payload = qgz_format.payload_bytes(u.shard);
      inside.calls += times;
      inside.elements += times * (per_node - 1) * nodes * u.shard;
      inside.bytes += times * (per_node - 1) * nodes * payload;
      between.calls += times;
      between.elements += times * (nodes - 1) * u.shard;
      between.bytes += times * (nodes - 1) * payload;
    }
    if (per_node > 1) {
      inside.name = stage.reduce_scatter_at_step
                        ? "qgZ gradient all-to-all inside the node at the step (codes and scales of each node's shards)"
                        : "qgZ gradient all-to-all inside the node as each bucket fills, every micro-batch (codes "
                          "and scales of each node's shards)";
      s.collectives.push_back(inside);
    }
    if (nodes > 1) {
      between.name = stage.reduce_scatter_at_step
                         ? "qgZ all-to-all across nodes of the node's partial sums at the step (codes and scales)"
                         : "qgZ all-to-all across nodes of the node's partial sums as each bucket fills, every "
                           "micro-batch (codes and scales)";
      s.collectives.push_back(between);
    }
  };
  if (stage.reduce_scatter_on_flush && options.qgz) qgz_per_unit(micro);
  if (stage.reduce_scatter_on_flush && !options.qgz)
    per_unit("gradient reduce-scatter as each bucket fills, every micro-batch", Collective::reduce_scatter, micro,
             reduce_bytes, 1);
  if (stage.reduce_scatter_at_step && options.qgz) qgz_per_unit(1);
  if (stage.reduce_scatter_at_step && !options.qgz)
    per_unit("gradient reduce-scatter at the step", Collective::reduce_scatter, 1, reduce_bytes, 1);
  // One control all-reduce decides the step: the squared norm and one report
  // per rank (hyper-parameter fingerprint, inf/NaN and invalid flags).
  s.collectives.push_back({"control all-reduce at the step (norm, one report per rank)", Collective::control, 1,
                           2 * ring(z.control), 2 * ring(z.control * sizeof(double))});
  if (stage.all_gather_after_step)
    per_unit("parameter all-gather after the update", Collective::all_gather, 1, eb, 1);
  return s;
}

}  // namespace zero
