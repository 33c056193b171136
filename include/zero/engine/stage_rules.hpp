// Why: what distinguishes the four ZeRO stages is a handful of decisions
// (what is sharded, when gradients are reduced, when parameters are
// gathered). Named once here, the engine, the buffer sizes and the planner
// read like the stage table of docs/design.md instead of repeating
// `stage >= 2` in thirty places, and an engine change that touches one
// decision touches one name.
#pragma once

#include "zero/compiler.hpp"

#include <type_traits>

#include "zero/policies.hpp"

namespace zero {

struct StageRules {
  int stage = 0;
  // Master weights and optimizer state hold this rank's 1/N of every unit
  // (stages 1-3); stage 0 keeps and updates everything on every rank.
  bool states_sharded = false;
  // The gradient buffer holds only the owned shard (stages 2-3).
  bool grads_sharded = false;
  // The parameters are a shard; a unit is gathered on acquire_unit (stage 3).
  bool params_sharded = false;
  // Gradient reduction: stage 0 all-reduces the full gradient when the last
  // micro-batch's bucket is flushed; stages 2-3 reduce-scatter every bucket
  // as it fills (accumulating the owned shard); stage 1 accumulates the full
  // gradient and reduce-scatters it once, at the step.
  bool all_reduce_on_flush = false;
  bool reduce_scatter_on_flush = false;
  bool reduce_scatter_at_step = false;
  // After the update, every rank needs the full parameters again (stages 1-2).
  bool all_gather_after_step = false;

  // The gradient norm is a sum over owned shards, completed across ranks by
  // the step's control all-reduce (stage 0 reduced the whole gradient already).
  constexpr bool norm_needs_all_reduce() const { return states_sharded; }
  // Where the parameters live on every rank in full (stages 0-2).
  constexpr bool params_whole() const { return !params_sharded; }
};

// Where the fp32 master weights and optimizer state live: with the backend
// (none), in page-locked host memory updated by the CPU (cpu, ZeRO-Offload;
// a device backend only), or on disk behind a host window (nvme,
// ZeRO-Infinity). The policies offload::None/Cpu/Nvme name these tiers at
// compile time; the engine, the planner and zero::Config take them as values.
enum class OffloadTier { none, cpu, nvme };

constexpr const char* name(OffloadTier t) {
  switch (t) {
    case OffloadTier::none: return "none";
    case OffloadTier::cpu: return "cpu";
    case OffloadTier::nvme: return "nvme";
  }
  return "?";
}

// The precision policy as a value: precision::Full<float>,
// precision::Mixed<bf16>, precision::Mixed<fp16>.
enum class PrecisionChoice { fp32, bf16, fp16 };

constexpr const char* name(PrecisionChoice p) {
  switch (p) {
    case PrecisionChoice::fp32: return "fp32";
    case PrecisionChoice::bf16: return "bf16";
    case PrecisionChoice::fp16: return "fp16";
  }
  return "?";
}

template <class Precision>
constexpr PrecisionChoice precision_choice() {
  if constexpr (!Precision::mixed) return PrecisionChoice::fp32;
  else if constexpr (std::is_same_v<typename Precision::param_type, bf16>) return PrecisionChoice::bf16;
  else return PrecisionChoice::fp16;
}

// The tier of an offload policy (zero/policies.hpp).
template <class OffloadPolicy>
constexpr OffloadTier offload_tier() {
  if constexpr (std::is_same_v<OffloadPolicy, offload::Cpu>) return OffloadTier::cpu;
  else if constexpr (std::is_same_v<OffloadPolicy, offload::Nvme>) return OffloadTier::nvme;
  else return OffloadTier::none;
}

constexpr StageRules stage_rules(int stage) {
  StageRules p;
  p.stage = stage;
  p.states_sharded = stage >= 1;
  p.grads_sharded = stage >= 2;
  p.params_sharded = stage == 3;
  p.all_reduce_on_flush = stage == 0;
  p.reduce_scatter_on_flush = stage >= 2;
  p.reduce_scatter_at_step = stage == 1;
  p.all_gather_after_step = stage == 1 || stage == 2;
  return p;
}

}  // namespace zero
