// Why: the one type users name. ZeroOptimizer<Precision, Optimizer, Stage,
// Offload, Backend> composes the policies into a type whose nonsense
// combinations do not compile (the static_asserts below), and is a thin
// typed layer over the engine, which is compiled once per precision,
// optimizer and backend and takes the stage and the offload tier as values
// (engine/engine.hpp: the protocol, the parts and every call). Programs that
// choose the stage, tier, precision or optimizer at run time use
// zero::make_optimizer(comm, config) instead (zero/runtime/make_optimizer.hpp):
// the same engine behind a handle with the same calls (the few that differ,
// and how: zero/runtime/any_optimizer.hpp).
//
// Every call of the engine is a call of this type: add_unit, add_param,
// finalize, set_param, acquire_unit, release_unit, grad_buffer, grad_ready,
// step, gather_masters, save, load, memory_report, comm_report, ...
//
// On a GPU whose communicator has a stream of its own, communication
// overlaps compute: gradient buckets are reduced and stage-3 units gathered
// on the communicator's stream while the caller's kernels go on, and the
// compute stream waits only where it reads their results (Ops<Cuda>::Overlap).
#pragma once

#include "zero/compiler.hpp"

#include <type_traits>

#include "zero/engine/engine.hpp"
#include "zero/engine/detail/run_rules.hpp"
#include "zero/engine/run_shape.hpp"
#include "zero/engine/stage_rules.hpp"
#include "zero/engine/detail/state_store.hpp"
#include "zero/optim/policy.hpp"
#include "zero/policies.hpp"

namespace zero {

template <PrecisionPolicy Precision, optim::Policy Optimizer, StagePolicy Stage, OffloadPolicy Offload = offload::None,
          BackendPolicy Backend = backend::Host>
class ZeroOptimizer : public detail::Engine<Precision, Optimizer, Backend> {
  // The rules of engine/detail/run_rules.hpp that the types alone break; the
  // engine refuses the same runs chosen at run time, in the rules' words
  // (a static_assert's message must be a literal).
  static constexpr RunShape shape_of_types{.stage = stage_rules(Stage::value),
                                           .offload = offload_tier<Offload>(),
                                           .device_backend = Backend::device};
  static_assert(!shape_breaks(RunRule::cpu_offload_needs_device, shape_of_types),
                "zero::ZeroOptimizer: offload::Cpu moves optimizer state from GPU memory to the host, but with "
                "backend::Host it is already in host memory; use offload::None (or offload::Nvme to move it to disk)");
  static_assert(!shape_breaks(RunRule::offload_needs_partition, shape_of_types),
                "zero::ZeroOptimizer: ZeRO-Offload moves this rank's partition of the optimizer state to the host; "
                "stage 0 has no partition: use stage<1> or higher with offload::Cpu/Nvme");
  using Engine = detail::Engine<Precision, Optimizer, Backend>;
  // offload::Nvme: the store of zero/offload/disk_state_store.hpp (a
  // static_assert names the include when it is missing); otherwise none.
  using DiskTier = typename detail::DiskTierOf<Offload>::type;

 public:
  using offload_policy = Offload;
  static constexpr int stage = Stage::value;
  // What this stage shards, and when it reduces and gathers (stage_rules.hpp).
  static constexpr StageRules rules = stage_rules(stage);
  static constexpr OffloadTier tier = offload_tier<Offload>();

  template <comm::Communicator Comm>
  ZeroOptimizer(Comm& communicator, typename Engine::Hyper hyper, Options options = {})
      : Engine(communicator, stage, tier, hyper, options,
               DiskTier::template maker<Optimizer, typename Precision::grad_type, typename Precision::param_type>()) {}
};

}  // namespace zero
