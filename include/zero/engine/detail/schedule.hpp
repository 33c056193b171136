// Why: what one rank of a run holds and sends follows from the stage rules
// (engine/stage_rules.hpp), the offload tier, whether the backend is a device,
// the element sizes and the Options, and nothing else. The schedule derives
// it in one place: every buffer ZeroOptimizer::finalize() allocates, with its
// elements and its place (device, host or disk), as the rows each part lists
// and finalize() allocates (engine/detail/part_rows.hpp), and every collective of
// a step with its calls and bytes, from the stage rules' decisions (which
// collective, when), never from the stage number. The
// planner (engine/plan.hpp) is this schedule printed; tests hold it to real
// optimizers' memory_report() and comm_report(), to the byte.
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "zero/comm/communicator.hpp"
#include "zero/comm/topology.hpp"
#include "zero/engine/detail/buffer_sizes.hpp"
#include "zero/engine/detail/gradient_reducer.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/detail/param_gatherer.hpp"
#include "zero/engine/detail/param_store.hpp"
#include "zero/engine/detail/part_rows.hpp"
#include "zero/engine/detail/quantized_reducer.hpp"
#include "zero/engine/reports.hpp"
#include "zero/engine/detail/run_rules.hpp"
#include "zero/engine/run_shape.hpp"
#include "zero/engine/detail/state_store.hpp"
#include "zero/engine/detail/step_control.hpp"
#include "zero/engine/detail/update_pipeline.hpp"
#include "zero/error.hpp"

namespace zero {

struct Schedule {
  BufferSizes sizes;
  BufferRows buffers;          // every part's rows that hold elements, in the order finalize() allocates them
  CollectiveRows collectives;  // every part's, in the order a step makes them
  std::string gradient_note;   // gradient_saving_note(): what finalize() prints, or ""

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
  std::uint64_t calls(comm::Collective kind) const { return sum(kind, &CollectiveRow::calls); }
  std::uint64_t elements(comm::Collective kind) const { return sum(kind, &CollectiveRow::elements); }
  std::uint64_t bytes(comm::Collective kind) const { return sum(kind, &CollectiveRow::bytes); }
  // Per step: the bytes of one kind that rank `rank` sends to another node,
  // and that all ranks together do.
  std::uint64_t across(comm::Collective kind, const comm::Topology& topology, int rank) const {
    return sum(kind, [&](const CollectiveRow& c) { return c.across(topology, rank); });
  }
  std::uint64_t across_all_ranks(comm::Collective kind, const comm::Topology& topology) const {
    return sum(kind, [&](const CollectiveRow& c) { return c.across_all_ranks(topology); });
  }

 private:
  static void add(PlacedBytes& p, const BufferRow& b) {
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

// What the engine refuses, refused here in the planner's words: every rule
// of engine/detail/run_rules.hpp (the engine checks the disk window in its store).
inline void require_valid_schedule(const RunShape& run, const Options& options) {
  require_run(run, options, Voice{"schedule"});
  require(run.acquires_per_micro_batch >= 1, "schedule: acquires_per_micro_batch must be >= 1");
}

// `layout` must be finalized (its padding decides every size).
inline Schedule schedule(const Layout& layout, const RunShape& run, const Options& options) {
  require_valid_schedule(run, options);
  require(run.rank < static_cast<std::size_t>(layout.ranks()), "schedule: rank ", run.rank, " of a layout of ",
          layout.ranks(), " rank(s); ranks count from 0");
  Schedule s;
  s.sizes = buffer_sizes(layout, run, options);
  const BufferSizes& z = s.sizes;
  s.gradient_note = gradient_saving_note(z, run, layout, options);

  // ---- Buffers: each part's rows, in the order finalize() allocates them ----
  const BufferRows parts[] = {parameter_rows(run, z).list(),
                              detail::gradient_rows(run, z).list(),
                              state_rows(run, options, layout, z).list(),
                              detail::update_rows(run, z).list(),
                              detail::qgz_rows(run, z).list(),
                              detail::gather_rows(run, z).list(),
                              detail::control_rows(run, z)};
  for (const BufferRows& rows : parts)
    for (const BufferRow& row : rows)
      if (row.elements != 0) s.buffers.push_back(row);

  // ---- Collectives: each part's, in the order a step makes them ----
  const CollectiveCounter count{layout, comm::Topology::checked(layout.ranks(), run.ranks_per_node,
                                                                "schedule: ranks_per_node"),
                                options};
  const CollectiveRows steps[] = {detail::gather_collectives(run, count), detail::reduction_collectives(run, count),
                                  detail::control_collectives(z, layout.ranks()), parameter_collectives(run, count)};
  for (const CollectiveRows& rows : steps)
    for (const CollectiveRow& row : rows) s.collectives.push_back(row);
  return s;
}

}  // namespace zero
