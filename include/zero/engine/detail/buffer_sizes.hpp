// Why: how many elements each of the optimizer's buffers holds follows from
// the layout, the stage, the precision, the optimizer's state count, the
// offload tier and a few Options. ZeroOptimizer::finalize() allocates exactly
// these sizes, and the planner (engine/plan.hpp, through engine/detail/schedule.hpp,
// which adds where each buffer lives and what each step sends) predicts
// memory from them without allocating, so the two cannot drift apart by a
// rule written twice. memory_report() stays measured from the real buffers,
// so a test still sees any disagreement between what is planned and what is
// held.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "zero/engine/layout.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/run_shape.hpp"
#include "zero/engine/stage_rules.hpp"
#include "zero/engine/detail/state_blocks.hpp"
#include "zero/quant/symmetric.hpp"
#include "zero/error.hpp"
#include "zero/engine/detail/disk_window.hpp"

namespace zero {

// Stages 0 and 1 take the caller's gradient straight into the full gradient
// buffer (no staging, no copy) without accumulation, or with it when the
// caller adds into its gradients (GradWrites::accumulate: the accumulator
// is zeroed at the window's start, and backward's += sums the micro-batches).
inline bool gradients_in_place(const StageRules& stage, const Options& options) {
  return !stage.grads_sharded &&
         (options.grad_accumulation_steps == 1 || options.grad_writes == GradWrites::accumulate);
}

// Gradient staging sets: one bucket each. Overwriting backward fills one
// bucket at a time (a second set lets it fill the next while the last is
// reduced, when communication overlaps compute); accumulating backward may
// keep Options::live_buckets of them live at once, plus one being reduced.
inline std::size_t staging_set_count(const Options& options, bool overlap) {
  const std::size_t reducing = overlap ? 1 : 0;
  if (options.grad_writes == GradWrites::accumulate) return static_cast<std::size_t>(options.live_buckets) + reducing;
  return 1 + reducing;
}

// Gradient buckets: runs of consecutive units whose reductions are launched
// together. Backward hands gradients over from the last unit to the first, so
// units are packed in that order, each bucket taking units while their
// gradients fit in Options::bucket_bytes; a unit larger than that gets a
// bucket of its own. A bucket's staging holds its units back to back in
// layout order, so the staging is sized by the largest bucket's bytes, not by
// a unit count times the largest unit (with a large embedding beside small
// blocks, that would make every slot an embedding).
struct GradientBuckets {
  struct Bucket {
    std::size_t first_unit = 0, units = 0;  // units [first_unit, first_unit + units)
    std::size_t elements = 0;               // padded elements of its units
    std::size_t shard_elements = 0;         // of their shards
  };
  std::vector<Bucket> buckets;            // in the order backward fills them
  std::vector<std::size_t> bucket_of;     // per unit: its bucket
  std::vector<std::size_t> offset;        // per unit: first element in its bucket's staging
  std::vector<std::size_t> shard_offset;  // per unit: first element of its shard in the bucket's shard staging
  std::size_t max_elements = 0, max_shard_elements = 0, max_units = 0;  // over the buckets

  const Bucket& of(std::size_t unit) const { return buckets[bucket_of[unit]]; }
};

// The bucket size in effect: Options::bucket_bytes, or for 0 (automatic)
// 32 MiB, and at stages 2-3 at most a quarter of the gradient per staging
// set. Then, with N >= 2 ranks, the shard (1/N), the staging (a quarter) and
// its reduce-scatter results (a quarter of 1/N) stay at 7/8 of the whole
// gradient or less, unless one unit is larger than that (a bucket holds at
// least one: gradient_saving_note says so).
inline std::size_t effective_bucket_bytes(const Layout& layout, const StageRules& stage, std::size_t grad_bytes,
                                          std::size_t staging_sets, const Options& options) {
  if (options.bucket_bytes != 0) return options.bucket_bytes;
  if (!stage.grads_sharded) return default_bucket_bytes;
  const std::size_t quarter = layout.padded_total() * grad_bytes / (4 * staging_sets);
  return std::max<std::size_t>(1, std::min(default_bucket_bytes, quarter));
}

inline GradientBuckets gradient_buckets(const Layout& layout, std::size_t grad_bytes, std::size_t bucket_bytes) {
  const auto& units = layout.units();
  GradientBuckets g;
  g.bucket_of.assign(units.size(), 0);
  g.offset.assign(units.size(), 0);
  g.shard_offset.assign(units.size(), 0);
  std::size_t bytes = 0;  // of the bucket being filled
  for (std::size_t i = units.size(); i-- > 0;) {
    const std::size_t unit_bytes = checked_mul(units[i].padded, grad_bytes, "the gradient of unit '", units[i].name, "'");
    if (g.buckets.empty() || checked_add(bytes, unit_bytes, "a gradient bucket") > bucket_bytes) {
      g.buckets.emplace_back();
      bytes = 0;
    }
    auto& b = g.buckets.back();
    b.first_unit = i;
    ++b.units;
    b.elements += units[i].padded;
    b.shard_elements += units[i].shard;
    bytes += unit_bytes;
    g.bucket_of[i] = g.buckets.size() - 1;
  }
  for (const auto& b : g.buckets) {
    const UnitInfo& first = units[b.first_unit];
    for (std::size_t i = b.first_unit; i < b.first_unit + b.units; ++i) {
      g.offset[i] = units[i].full_offset - first.full_offset;
      g.shard_offset[i] = units[i].shard_offset - first.shard_offset;
    }
    g.max_elements = std::max(g.max_elements, b.elements);
    g.max_shard_elements = std::max(g.max_shard_elements, b.shard_elements);
    g.max_units = std::max(g.max_units, b.units);
  }
  return g;
}

// Stage 3's gather arena: at most prefetch_units + 1 units are held at once
// (acquired or prefetched), so an arena of the prefetch_units + 1 largest
// units' elements holds any set of them; ParamGatherer places each unit
// against an end of the arena, which for up to two units always fits (see
// arena_place).
inline std::size_t gather_arena_elements(const Layout& layout, std::size_t slots) {
  std::vector<std::size_t> sizes;
  for (const auto& u : layout.units()) sizes.push_back(u.padded);
  const std::size_t k = std::min(slots, sizes.size());
  std::partial_sort(sizes.begin(), sizes.begin() + static_cast<std::ptrdiff_t>(k), sizes.end(), std::greater<>());
  std::size_t total = 0;
  for (std::size_t i = 0; i < k; ++i) total = checked_add(total, sizes[i], "finalize(): the stage-3 gather arena");
  return total;
}

// Elements of every buffer one rank allocates at finalize().
struct BufferSizes {
  // Model state.
  std::size_t params = 0;          // low-precision (or fp32) parameters: whole, or the shard at stage 3
  std::size_t grads = 0;           // gradient accumulator: whole, or the shard at stages 2-3
  std::size_t master = 0;          // fp32 master (0 when fp32 parameters are their own master)
  std::size_t state_per_slot = 0;  // each optimizer-state slot, in Options::states' format
  // Communication buffers.
  GradientBuckets buckets;         // which units are reduced together, and where each is staged
  std::size_t staging_sets = 1;    // buckets staged at once (staging_set_count)
  std::size_t bucket_bytes = 0;    // the bucket size in effect (effective_bucket_bytes)
  std::size_t grad_staging = 0;    // gradient type: where the caller writes a unit's gradient
  std::size_t reduce_staging_fp32 = 0;  // fp32: 16-bit gradients widened to reduce in fp32
  std::size_t shard_staging = 0;   // gradient type: a reduce-scatter's result before accumulation
  std::size_t gather_slots = 0;    // stage 3, parameter type: the arena of the (prefetch + 1) largest units
  std::size_t gather_slot_count = 0;  // units the arena holds at once (prefetch + 1)
  std::size_t hpz_secondary = 0;   // stage 3 with Options::hpz, parameter type: every unit's hpz_part
  // Options::hpz_int8 instead, bytes: every unit's part as an int8 payload,
  // and the node's payloads of the largest part (what a gather inside the
  // node receives).
  std::size_t hpz_int8_secondary = 0;
  std::size_t hpz_int8_staging = 0;
  std::size_t qwz_staging = 0;     // stage 3 with Options::qwz, bytes: every rank's int8 payload of the largest shard
  // Options::qgz (engine/detail/quantized_reducer.hpp): bytes of the payloads sent
  // and received (twice every rank's payload of the largest shard); fp32
  // sums (the node's partial sum of a shard per node, and the result); and
  // with error feedback the fp32 residuals (every unit's padded elements
  // when a node has several ranks, and 1/ranks_per_node of them when there
  // are several nodes).
  std::size_t qgz_payloads = 0;
  std::size_t qgz_sums = 0;
  std::size_t qgz_residuals = 0;
  std::size_t control = 0;         // doubles: the step's [sum of squares, one report per rank]
  std::size_t max_unit = 0;        // largest padded unit
  std::size_t max_shard = 0;       // largest shard
  // Offload (RunShape::offload), host memory. From a device backend: the
  // owned gradient's host copy the CPU update reads (gradient type, one set
  // per step in flight: two with Options::delayed_update) and the parameters
  // the CPU writes before they are copied to the device (parameter type;
  // offload_stages_params). offload::Nvme: the window the state streams
  // through (fp32), and the swap file on disk (bytes: whole records, so at
  // least the owned master and state).
  std::size_t host_grad_sets = 0;
  std::size_t host_grads = 0;
  std::size_t host_params = 0;
  std::size_t disk_window = 0;
  std::size_t disk_chunk = 0;       // elements of one array per chunk of the window
  std::size_t swap_file_bytes = 0;
  // Options::param_place = disk (stage 3): the pages the parameter shards
  // are read into (parameter type, shard_page_count of the largest record)
  // and their file (bytes: every unit's record, shard_record_bytes); the
  // gradient's shards the same in a file of their own (gradient type).
  std::size_t param_pages = 0;
  std::size_t param_file_bytes = 0;
  std::size_t grad_pages = 0;
  std::size_t grad_file_bytes = 0;
};

// `layout` must be finalized (its padding decides every size).
inline BufferSizes buffer_sizes(const Layout& layout, const RunShape& run, const Options& options) {
  require(layout.finalized(), "buffer_sizes: finalize the layout first");
  BufferSizes s;
  const std::size_t full = layout.padded_total(), shard = layout.shard_total();
  const std::size_t owned = run.stage.states_sharded ? shard : full;
  s.params = run.stage.params_sharded ? shard : full;
  s.grads = run.stage.grads_sharded ? shard : full;
  s.master = run.separate_master() ? owned : 0;
  s.state_per_slot = owned;

  s.max_unit = layout.max_unit();
  for (const auto& u : layout.units()) s.max_shard = std::max(s.max_shard, u.shard);
  s.staging_sets = staging_set_count(options, run.overlap);
  s.bucket_bytes = effective_bucket_bytes(layout, run.stage, run.element_bytes(), s.staging_sets, options);
  s.buckets = gradient_buckets(layout, run.element_bytes(), s.bucket_bytes);
  // Products of a set count and a bucket size: checked, a huge bucket must not wrap.
  auto sets = [](std::size_t count, std::size_t per_set, const char* what) {
    return checked_mul(count, per_set, "finalize(): the ", what, " (", count, " sets)");
  };
  const std::size_t bucket = s.buckets.max_elements;
  if (!gradients_in_place(run.stage, options))
    s.grad_staging = sets(s.staging_sets, bucket, "gradient staging");
  // Stage 1 widens one unit at a time at step(); the others a whole staged
  // bucket. qgZ reduces in fp32 by itself, into its own sums.
  if (options.qgz) {
    const std::size_t ranks = static_cast<std::size_t>(layout.ranks());
    const std::size_t per_node = run.ranks_per_node == 0 ? ranks : static_cast<std::size_t>(run.ranks_per_node);
    const std::size_t nodes = ranks / per_node;
    const quant::Format format{options.qgz_bits, options.qgz_block};
    s.qgz_payloads = checked_mul(2 * ranks, format.payload_bytes(s.max_shard), "finalize(): qgZ's payloads");
    s.qgz_sums = (nodes + 1) * s.max_shard;
    if (options.qgz_error_feedback)
      s.qgz_residuals = (per_node > 1 ? full : 0) + (nodes > 1 ? full / per_node : 0);
  }
  if (options.reduce_dtype == ReduceDType::fp32 && run.element_bytes() != 4 && !options.qgz)
    s.reduce_staging_fp32 = run.stage.reduce_scatter_at_step
                                ? s.max_unit
                                : sets(s.staging_sets, bucket, "fp32 reduction staging");
  if (run.stage.reduce_scatter_on_flush && !options.qgz)
    s.shard_staging = sets(s.staging_sets, s.buckets.max_shard_elements, "reduce-scatter staging");
  if (run.stage.params_sharded) {
    s.gather_slot_count = static_cast<std::size_t>(options.prefetch_units) + 1;
    s.gather_slots = gather_arena_elements(layout, s.gather_slot_count);
    std::size_t largest_part = 0;  // bytes, with hpz_int8
    for (const auto& u : layout.units()) {
      if (!options.hpz) break;
      const std::size_t part = hpz_part(u.padded, run.ranks_per_node, layout.ranks());
      if (!options.hpz_int8) {
        s.hpz_secondary += part;
        continue;
      }
      const std::size_t bytes = hpz_int8_part_bytes(part, u.shard, options.qwz_block, options.qwz);
      s.hpz_int8_secondary += bytes;
      largest_part = std::max(largest_part, bytes);
    }
    if (options.hpz && options.hpz_int8)
      s.hpz_int8_staging =
          checked_mul(static_cast<std::size_t>(run.ranks_per_node == 0 ? layout.ranks() : run.ranks_per_node),
                      largest_part, "finalize(): hpZ's int8 staging");
    if (options.qwz)
      s.qwz_staging = checked_mul(static_cast<std::size_t>(layout.ranks()),
                                  quant::Format{8, options.qwz_block}.payload_bytes(s.max_shard), "finalize(): qwZ's payloads");
  }
  s.control = 1 + static_cast<std::size_t>(layout.ranks()) * (options.check_replicas ? 2 : 1);
  if (run.offload_host_staging()) {
    s.host_grad_sets = options.delayed_update ? 2 : 1;
    s.host_grads = checked_mul(owned, s.host_grad_sets, "finalize(): the host gradient");
    if (run.offload_stages_params()) s.host_params = owned;
  }
  if (run.offload == OffloadTier::nvme) {
    const std::size_t window = options.nvme.window_bytes;
    const std::size_t mb = master_element_bytes(options.master), sb = state_element_bytes(options.states);
    s.disk_chunk = offload::disk_chunk_elements(window, run.state_slots, owned, mb, sb);
    s.disk_window = offload::disk_window_elements(window, run.state_slots, owned, mb, sb);
    // Chunks end before a block of 8-bit state they would cut: this rank's
    // (another rank's shard boundaries cut a few blocks elsewhere).
    const StateBlocks blocks = options.states == StateFormat::blockwise8 && run.state_slots > 0
                                   ? StateBlocks::build(Ownership{run.stage, run.rank, &layout}, options.state_block,
                                                        options.state_fp32_below)
                                   : StateBlocks{};
    const std::size_t records = offload::disk_chunk_starts(s.disk_chunk, owned, blocks).size() - 1;
    s.swap_file_bytes = offload::disk_records_bytes(records, s.disk_chunk, run.state_slots, mb, sb);
  }
  if (options.param_place == ParamPlace::disk && run.stage.params_sharded) {
    const std::size_t eb = run.element_bytes();
    s.param_pages = offload::shard_page_count(options.prefetch_units) * offload::shard_record_bytes(s.max_shard, eb) / eb;
    for (const auto& u : layout.units()) s.param_file_bytes += offload::shard_record_bytes(u.shard, eb);
    // (gradients are of the parameters' type: the precision policies say so)
    s.grad_pages = s.param_pages;
    s.grad_file_bytes = s.param_file_bytes;
  }
  return s;
}

// Stages 2-3 shard the gradient, but the buckets' staging holds whole
// units: where the shard and the staging together are no smaller than
// stage 0's whole gradient (a small model inside one default bucket, or one
// unit for the whole model), the stage saves no gradient memory. The one
// line finalize() prints on rank 0 and the planner prints then, or "" (also
// below 1 MiB of gradient, where there is nothing worth saving).
inline std::string gradient_saving_note(const BufferSizes& s, const RunShape& run, const Layout& layout,
                                        const Options& options) {
  if (!run.stage.grads_sharded || layout.ranks() < 2) return "";
  const std::uint64_t gb = run.element_bytes();
  const std::uint64_t whole = gb * layout.padded_total();
  const std::uint64_t shard = gb * s.grads;
  const std::uint64_t staging = gb * (s.grad_staging + s.shard_staging) + 4 * s.reduce_staging_fp32;
  if (shard + staging < whole || whole < (std::uint64_t{1} << 20)) return "";
  auto mib = [](std::uint64_t b) {
    char text[32];
    std::snprintf(text, sizeof text, "%.2f MiB", static_cast<double>(b) / 1048576.0);
    return std::string(text);
  };
  return detail::concat("zero: stage ", run.stage.stage, " holds ", mib(shard + staging), " of gradients per rank (a 1/",
                layout.ranks(), " shard, ", mib(shard), ", and staging for ", s.staging_sets, " bucket(s) of up to ",
                s.buckets.max_units, " unit(s), ", mib(staging), "), no less than stage 0's whole gradient (",
                mib(whole), "): ", options.bucket_bytes == 0 ? "register smaller units (a bucket holds at least one; "
                "Options::bucket_bytes is automatic)" : detail::concat("lower Options::bucket_bytes (now ",
                options.bucket_bytes, ") below the gradient's size, or register smaller units (a bucket holds at "
                "least one)"));
}

}  // namespace zero
