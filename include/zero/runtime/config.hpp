// Why: the compile-time API picks precision, optimizer, stage and offload
// tier as template arguments; a program that takes them from a file or a
// command line needs them as values first. zero::Config is that value: what
// zero::make_optimizer(comm, config) turns into a running optimizer, what a
// JSON file (zero/runtime/config_json.hpp, docs/configuration.md) and the
// example programs' flags fill in. Its checks say the same as the
// static_asserts of the compile-time API (zero/policies.hpp,
// zero/engine/zero_optimizer.hpp), so a combination is refused in the same
// words whichever way it was chosen. Plain C++: no JSON library needed.
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "zero/engine/options.hpp"
#include "zero/engine/detail/run_rules.hpp"
#include "zero/engine/run_shape.hpp"
#include "zero/engine/stage_rules.hpp"
#include "zero/error.hpp"

namespace zero {

// Every value of each enum a configuration names, in the order messages list them.
inline constexpr PrecisionChoice all_precisions[] = {PrecisionChoice::fp32, PrecisionChoice::bf16,
                                                     PrecisionChoice::fp16};
inline constexpr OffloadTier all_offload_tiers[] = {OffloadTier::none, OffloadTier::cpu, OffloadTier::nvme};
inline constexpr ReduceDType all_reduce_dtypes[] = {ReduceDType::same_as_grad, ReduceDType::fp32};
inline constexpr GradWrites all_grad_writes[] = {GradWrites::overwrite, GradWrites::accumulate};
inline constexpr MasterWeights all_master_weights[] = {MasterWeights::fp32, MasterWeights::remainder};
inline constexpr StateFormat all_state_formats[] = {StateFormat::fp32, StateFormat::bf16, StateFormat::bf16_stochastic,
                                                   StateFormat::blockwise8};
inline constexpr ParamPlace all_param_places[] = {ParamPlace::device, ParamPlace::disk};

namespace detail {
// The value whose name() is `text`, if any: names are defined once, by name().
template <class E, std::size_t N>
constexpr std::optional<E> parse_by_name(std::string_view text, const E (&values)[N]) {
  for (const E v : values)
    if (text == name(v)) return v;
  return std::nullopt;
}
// "fp32, bf16, fp16".
template <class E, std::size_t N>
std::string names_of(const E (&values)[N]) {
  std::string out;
  for (const E v : values) out += (out.empty() ? "" : ", ") + std::string(name(v));
  return out;
}
}  // namespace detail

inline std::optional<PrecisionChoice> parse_precision(std::string_view text) {
  return detail::parse_by_name(text, all_precisions);
}
inline std::optional<OffloadTier> parse_offload(std::string_view text) {
  return detail::parse_by_name(text, all_offload_tiers);
}
inline std::optional<ReduceDType> parse_reduce_dtype(std::string_view text) {
  return detail::parse_by_name(text, all_reduce_dtypes);
}
inline std::optional<GradWrites> parse_grad_writes(std::string_view text) {
  return detail::parse_by_name(text, all_grad_writes);
}
inline std::optional<MasterWeights> parse_master_weights(std::string_view text) {
  return detail::parse_by_name(text, all_master_weights);
}
inline std::optional<StateFormat> parse_state_format(std::string_view text) {
  return detail::parse_by_name(text, all_state_formats);
}

struct Config {
  PrecisionChoice precision = PrecisionChoice::bf16;
  // A registered optimizer's name (adamw, adam, sgd, or a user's own).
  std::string optimizer = "adamw";
  // Hyper-parameters by field name (lr, beta1, ...; bools as 0/1); one not
  // set keeps the policy's default (zero/runtime/hyper_fields.hpp).
  std::map<std::string, double> hyper;
  int stage = 3;
  OffloadTier offload = OffloadTier::none;
  // Everything else, incl. options.nvme (the disk tier's directory and streaming).
  Options options;

  bool operator==(const Config&) const = default;

  // Checks what needs no optimizer's policy (the hyper-parameters are
  // checked by hyper_from, the optimizer's name by whoever looks it up):
  // every rule of engine/detail/run_rules.hpp, the disk tier's directory and
  // options.validate(). Throws zero::InvalidArgument naming the setting as
  // a config file and the command line spell it.
  void validate(bool device_backend) const {
    require(!optimizer.empty(), "zero::Config: the optimizer's name is empty: set optimizer.type in a config file "
            "(--optimizer on the command line) to adamw, adam, sgd or a registered optimizer's name");
    // The state slots are the optimizer's, unknown until it is looked up:
    // the disk window is held to the least of any, and the store holds it
    // to the optimizer's at finalize().
    const RunShape run{.stage = stage_rules(stage),
                       .offload = offload,
                       .precision = precision,
                       .device_backend = device_backend,
                       .state_slots = -1};
    require_run(run, options, Voice{"zero::Config", false, true});
    require(offload != OffloadTier::nvme || !options.nvme.directory.empty(),
            "zero::Config: offload nvme keeps the optimizer state in swap files and needs a directory for them, on "
            "a fast local disk: set offload.directory in a config file (--nvme-dir on the command line, "
            "options.nvme.directory in code)");
    options.validate();
  }
};

}  // namespace zero
