// Why: what ZeroOptimizer checks across ranks (its settings at finalize(),
// the step's reports) and the error it gives for a failed allocation depend
// on a few values of its type (stage, names, flags), not on the type itself.
// Written once here as plain functions taking those values, they are
// compiled once per program instead of once per optimizer type: a program
// that chooses among its 36 or 63 types at run time compiles this code once.
#pragma once

#include "zero/config.hpp"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "zero/engine/agreement.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/options.hpp"
#include "zero/error.hpp"
#include "zero/precision/types.hpp"

namespace zero::detail {

// The type choices of one optimizer, as values.
struct EngineIdentity {
  int stage;
  const char* optimizer;  // Optimizer::name
  bool mixed;             // Precision::mixed
  DType param_dtype;
  const char* offload;  // Offload::name
};

// What every rank must agree on (see agreement.hpp), checked at finalize().
inline std::vector<AgreedSetting> agreed_engine_settings(const Layout& layout, const Options& options,
                                                         const EngineIdentity& id) {
  auto number = [](std::uint64_t v) { return std::to_string(v); };
  auto real = [](std::uint64_t v) { return concat(std::bit_cast<double>(v)); };
  auto bits = [](double d) { return std::bit_cast<std::uint64_t>(d); };
  auto flag = [](std::uint64_t v) -> std::string { return v ? "true" : "false"; };
  // Values that are hashes print this rank's text when they match it.
  auto mine_or = [](std::uint64_t mine, std::string text, std::string other) {
    return [=](std::uint64_t v) { return v == mine ? text : other; };
  };
  const std::uint64_t layout_hash = layout.hash();
  const std::uint64_t precision = (id.mixed ? 0x100u : 0u) | static_cast<std::uint64_t>(id.param_dtype);
  const auto& ls = options.loss_scale;
  return {
      {"the parameter layout (ranks registered different parameter layouts)", layout_hash,
       mine_or(layout_hash, concat(layout.units().size(), " units: ", layout.describe()), "another layout")},
      {"the precision", precision,
       [](std::uint64_t v) {
         return concat(v & 0x100u ? "Mixed<" : "Full<", dtype_name(static_cast<DType>(v & 0xffu)), ">");
       }},
      {"the optimizer", short_text_code(id.optimizer), [](std::uint64_t v) { return short_text(v, "another optimizer"); }},
      {"the ZeRO stage", static_cast<std::uint64_t>(id.stage), number},
      {"the offload tier", short_text_code(id.offload), [](std::uint64_t v) { return short_text(v, "another tier"); }},
      {"Options::grad_accumulation_steps", static_cast<std::uint64_t>(options.grad_accumulation_steps), number},
      {"Options::reduce_dtype", static_cast<std::uint64_t>(options.reduce_dtype),
       [](std::uint64_t v) -> std::string { return v == 0 ? "same_as_grad" : "fp32"; }},
      {"Options::bucket_bytes", options.bucket_bytes, number},
      {"Options::prefetch_units", static_cast<std::uint64_t>(options.prefetch_units), number},
      {"Options::clip_norm", bits(options.clip_norm), real},
      {"Options::gradient_divisor", bits(options.gradient_divisor), real},
      {"Options::loss_scale.initial_scale", bits(ls.initial_scale), real},
      {"Options::loss_scale.growth_interval", static_cast<std::uint64_t>(ls.growth_interval), number},
      {"Options::loss_scale.growth_factor", bits(ls.growth_factor), real},
      {"Options::loss_scale.backoff_factor", bits(ls.backoff_factor), real},
      {"Options::loss_scale.hysteresis", static_cast<std::uint64_t>(ls.hysteresis), number},
      {"Options::loss_scale.min_scale", bits(ls.min_scale), real},
      {"Options::stochastic_rounding", options.stochastic_rounding ? 1u : 0u, flag},
      {"Options::seed", options.seed, number},
      {"Options::delayed_update", options.delayed_update ? 1u : 0u, flag},
      {"Options::delayed_update_warmup", static_cast<std::uint64_t>(options.delayed_update_warmup), number},
  };
}

// The step's control all-reduce carries one report per rank, an integer
// below 2^53 (exact in a double, and the other ranks add 0 to it): a
// fingerprint of the update rule with this step's hyper-parameters, and two flags.
inline constexpr std::uint64_t report_non_finite = 1, report_invalid_hyper = 2;

// This rank's report. Keyed by the optimizer alone: the stage, precision and
// offload tier do not change it.
template <class Optimizer>
std::uint64_t step_report(const typename Optimizer::Scalars* scalars, bool non_finite) {
  std::uint64_t fingerprint = 0;
  if (scalars != nullptr) {
    // The update rule run on fixed probes: what the kernels will compute, for
    // any policy (hashing the Scalars' bytes would also hash their padding).
    // The probes make each built-in hyper-parameter move a result: a weight
    // for decay, a state for momenta, a tiny second moment for eps.
    struct Probe {
      float w, g, state;
    };
    constexpr Probe probes[] = {{0.75f, 0.5f, 0.25f}, {0.0f, 0.0f, 1e-30f}, {-1.5f, -0.125f, 2.0f}};
    Fnv1a h;
    for (const Probe& p : probes) {
      float w = p.w, state[4] = {p.state, p.state, p.state, p.state};
      Optimizer::update(*scalars, w, p.g, state);
      h.add_value(w).add(state, sizeof state);
    }
    fingerprint = h.value() >> 13;  // 51 bits, so the report stays below 2^53
  }
  return fingerprint << 2 | (scalars == nullptr ? report_invalid_hyper : 0) | (non_finite ? report_non_finite : 0);
}

// The step's reports after the control all-reduce, as the step sees them.
struct StepReports {
  int rank;
  int ranks;
  std::int64_t step;      // the step being taken (1-based)
  const double* reports;  // reports[r]: rank r's report
  bool loss_scaling;      // Precision::loss_scaling: an overflow skips the step
  bool states_sharded;    // each rank checks only the gradient it owns
  std::uint64_t report(int r) const { return static_cast<std::uint64_t>(reports[r]); }
};

// Throws on every rank when a rank's hyper-parameters are invalid or differ
// from rank 0's, or a gradient holds inf/NaN without loss scaling to skip it.
inline void check_step_reports(const StepReports& s, const std::string& invalid_hyper, bool overflow) {
  auto ranks_where = [&](auto&& pred) {
    std::string list;
    for (int r = 0; r < s.ranks; ++r)
      if (pred(s.report(r))) list += (list.empty() ? "" : ", ") + std::to_string(r);
    return list;
  };
  if (!invalid_hyper.empty())
    throw InvalidArgument(concat("step() on rank ", s.rank, ", step ", s.step, ": ", invalid_hyper,
                                 " (checked at every step: set valid values in hyper() before step())"));
  const std::string invalid = ranks_where([](std::uint64_t v) { return (v & report_invalid_hyper) != 0; });
  if (!invalid.empty())
    throw InvalidArgument(concat("step() on rank ", s.rank, ", step ", s.step, ": the hyper-parameters of rank(s) ",
                                 invalid, " are invalid (their error names the field); nothing was updated"));
  const std::uint64_t rank0 = s.report(0) >> 2;
  const std::string differ = ranks_where([&](std::uint64_t v) { return (v >> 2) != rank0; });
  if (!differ.empty())
    throw CommError(concat(
        "step() on rank ", s.rank, ", step ", s.step, ": the hyper-parameters of rank(s) ", differ,
        " differ from rank 0's (a learning-rate schedule computed from a rank-local counter?); every rank must set "
        "the same hyper() values before each step(); nothing was updated"));
  if (overflow && !s.loss_scaling) {
    // Each rank checks the summed gradient of what it updates, so this names
    // the owner of the bad element; the backward that made it may be any rank's.
    const std::string where =
        !s.states_sharded ? std::string("found by every rank: stage 0 checks the whole all-reduced gradient")
                          : "found by rank(s) " + ranks_where([](std::uint64_t v) { return (v & report_non_finite) != 0; }) +
                                " in the summed gradient of the parameters they own";
    throw InvalidArgument(concat("step() on rank ", s.rank, ", step ", s.step, ": the gradients contain inf or NaN (",
                                 where,
                                 "); with bf16/fp32 there is no loss scaling to absorb it: check the loss and the "
                                 "learning rate"));
  }
}

// finalize()'s error for a buffer it could not allocate: the buffer, its
// size, the rank, why, and `lower_it` (the option or stage that makes it smaller).
inline OutOfMemory allocation_error(int rank, const char* what, std::size_t n, std::size_t element_bytes,
                                    const char* where, const char* why, const std::string& lower_it) {
  return OutOfMemory(concat("ZeroOptimizer::finalize() on rank ", rank, ": could not allocate the ", what, " (",
                            n * element_bytes, " bytes: ", n, " elements of ", element_bytes, " bytes) in ", where,
                            " memory: ", why, ". To make it smaller: ", lower_it));
}

}  // namespace zero::detail
