// Why: how many elements each of the optimizer's buffers holds follows from
// the layout, the stage, the precision, the optimizer's state count and a few
// Options. ZeroOptimizer::finalize() allocates exactly these sizes, and the
// planner (engine/plan.hpp) predicts memory from them without allocating, so
// the two cannot drift apart by a rule written twice. memory_report() stays
// measured from the real buffers, so a test still sees any disagreement
// between what is planned and what is held.
#pragma once

#include <algorithm>
#include <cstddef>

#include "zero/engine/layout.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/stage_plan.hpp"

namespace zero {

// What of the optimizer's type and run decides its buffer sizes.
struct BufferSpec {
  StagePlan stage = stage_plan(0);
  bool separate_master = true;   // mixed precision: an fp32 master beside the 16-bit parameters
  std::size_t grad_bytes = 2;    // bytes per gradient element (2 for bf16/fp16, 4 for fp32)
  int state_slots = 2;           // fp32 optimizer-state arrays (Adam: m and v; SGD: momentum)
  bool overlap = false;          // communication overlaps compute: gradient staging double-buffered
};

// Stages 0 and 1 without accumulation take the caller's gradient straight
// into the full gradient buffer (no staging, no copy).
inline bool gradients_in_place(const StagePlan& stage, const Options& options) {
  return !stage.grads_sharded && options.grad_accumulation_steps == 1;
}

// Elements of every buffer one rank allocates at finalize().
struct BufferSizes {
  // Model state.
  std::size_t params = 0;          // low-precision (or fp32) parameters: whole, or the shard at stage 3
  std::size_t grads = 0;           // gradient accumulator: whole, or the shard at stages 2-3
  std::size_t master = 0;          // fp32 master (0 when fp32 parameters are their own master)
  std::size_t state_per_slot = 0;  // each optimizer-state array (fp32)
  // Communication buffers.
  std::size_t bucket_units = 1;    // units whose reductions are launched together
  std::size_t staging_sets = 1;    // 2 when double-buffered
  std::size_t grad_staging = 0;    // gradient type: where the caller writes a unit's gradient
  std::size_t reduce_staging_fp32 = 0;  // fp32: 16-bit gradients widened to reduce in fp32
  std::size_t shard_staging = 0;   // gradient type: a reduce-scatter's result before accumulation
  std::size_t gather_slots = 0;    // stage 3, parameter type: (prefetch + 1) whole units
  std::size_t gather_slot_count = 0;
  std::size_t control = 0;         // doubles: the step's [sum of squares, one report per rank]
  std::size_t max_unit = 0;        // largest padded unit
  std::size_t max_shard = 0;       // largest shard
};

// `layout` must be finalized (its padding decides every size).
inline BufferSizes buffer_sizes(const Layout& layout, const BufferSpec& spec, const Options& options) {
  require(layout.finalized(), "buffer_sizes: finalize the layout first");
  BufferSizes s;
  const std::size_t full = layout.padded_total(), shard = layout.shard_total();
  const std::size_t owned = spec.stage.states_sharded ? shard : full;
  s.params = spec.stage.params_sharded ? shard : full;
  s.grads = spec.stage.grads_sharded ? shard : full;
  s.master = spec.separate_master ? owned : 0;
  s.state_per_slot = owned;

  s.max_unit = layout.max_unit();
  for (const auto& u : layout.units()) s.max_shard = std::max(s.max_shard, u.shard);
  // A bucket: as many units as fit in Options::bucket_bytes (at least one).
  s.bucket_units = std::clamp<std::size_t>(
      options.bucket_bytes / checked_mul(s.max_unit, spec.grad_bytes, "the largest unit's gradient"), 1,
      layout.units().size());
  s.staging_sets = spec.overlap ? 2 : 1;
  const std::size_t staged = s.staging_sets * s.bucket_units;
  // Products of a slot count and a unit size: checked, a huge unit must not wrap.
  auto slots = [](std::size_t count, std::size_t per_slot, const char* what) {
    return checked_mul(count, per_slot, "finalize(): the ", what, " (", count, " slots)");
  };
  if (!gradients_in_place(spec.stage, options)) s.grad_staging = slots(staged, s.max_unit, "gradient staging");
  // Stage 1 widens one unit at a time at step(); the others a whole staged bucket.
  if (options.reduce_dtype == ReduceDType::fp32 && spec.grad_bytes != 4)
    s.reduce_staging_fp32 =
        slots(spec.stage.reduce_scatter_at_step ? 1 : staged, s.max_unit, "fp32 reduction staging");
  if (spec.stage.reduce_scatter_on_flush) s.shard_staging = slots(staged, s.max_shard, "reduce-scatter staging");
  if (spec.stage.params_sharded) {
    s.gather_slot_count = static_cast<std::size_t>(options.prefetch_units) + 1;
    s.gather_slots = slots(s.gather_slot_count, s.max_unit, "stage-3 gather slots");
  }
  s.control = 1 + static_cast<std::size_t>(layout.ranks());
  return s;
}

}  // namespace zero
