// Why: which buffers one rank holds, which collectives it makes and which
// combinations are refused follow from a few facts about a run that are not
// Options: the stage, the offload tier, the precision, where the backend's
// memory is, the optimizer's state slots, and what the communicator says
// (overlap, ranks per node, this rank). The engine knows them from its types
// and its communicator, the planner from its question, zero::Config from a
// file. Written down as one value, built by field name, every one of them
// hands the same description to the rules (engine/detail/run_rules.hpp), the buffer
// sizes (engine/detail/buffer_sizes.hpp) and the schedule (engine/detail/schedule.hpp), and
// a new fact is one new field, not a field in three structs.
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>

#include "zero/engine/stage_rules.hpp"

namespace zero {

struct RunShape {
  StageRules stage = stage_rules(0);
  OffloadTier offload = OffloadTier::none;
  // The parameters' and gradients' type (the engine keeps both in one).
  PrecisionChoice precision = PrecisionChoice::bf16;
  // The backend's memory is a device's (backend::Cuda); false: backend::Host,
  // where every buffer but the disk tier's is host memory.
  bool device_backend = false;
  // Optimizer-state slots (Adam: m and v; SGD: momentum; SGD made with
  // momentum 0: none; -1: not known yet, as for zero::Config before its
  // optimizer is looked up), and the optimizer's name for messages (may be
  // null).
  int state_slots = 2;
  const char* optimizer = nullptr;
  // Communication on a stream of its own (comm::Nccl on GPUs): gradient
  // staging is double-buffered. Host communicators do not overlap.
  bool overlap = false;
  // comm::Topology (0: one node of every rank): hpZ's copy and node collectives.
  int ranks_per_node = 0;
  // Whose buffers: ranks differ only with 8-bit block-wise states, by the
  // blocks their shard boundaries cut and the small parameters they own
  // (engine/detail/state_blocks.hpp), and on the disk tier by a swap-file record.
  std::size_t rank = 0;
  // Stage 3: acquire_unit() calls per unit and micro-batch, each a gather:
  // the documented training loop acquires every unit once in forward and
  // once in backward (engine/engine.hpp).
  int acquires_per_micro_batch = 2;

  constexpr bool mixed() const { return precision != PrecisionChoice::fp32; }
  // Bytes of a parameter or gradient element.
  constexpr std::size_t element_bytes() const { return mixed() ? 2 : 4; }
  constexpr bool offloaded() const { return offload != OffloadTier::none; }
  // An fp32 master beside the parameters: mixed precision, or any offload
  // (the backend then keeps a working copy while the master leaves it).
  constexpr bool separate_master() const { return mixed() || offloaded(); }
  // Offloaded from a device: the owned gradient is copied to the host for
  // the CPU update and the updated parameters staged back (backend::Host
  // with offload::Nvme updates straight from and into its own buffers).
  constexpr bool offload_host_staging() const { return offloaded() && device_backend; }
  // The parameters the CPU writes are staged in host memory, then copied to
  // the device: 16-bit parameters (mixed precision keeps parameters and
  // gradients in one type), and fp32 ones under offload::Nvme (its master is
  // in the window only in passing); fp32 ones under offload::Cpu are
  // uploaded from the master itself.
  constexpr bool offload_stages_params() const {
    return offload_host_staging() && (mixed() || offload == OffloadTier::nvme);
  }
};

}  // namespace zero
