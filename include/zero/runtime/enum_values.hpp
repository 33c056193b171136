// Why: a configuration file and a command line both spell an enum setting by
// its name(), and both read Options' fields from the field table whatever
// their type; one overload per enum, found by the field's type, lets either
// reader take any enum field without naming it. Plain C++: the command line
// needs no JSON library.
#pragma once

#include "zero/compiler.hpp"

#include "zero/runtime/config.hpp"

namespace zero::detail {

// The values, in the order messages list them, of each enum a setting names.
constexpr const auto& all_values_of(PrecisionChoice) { return all_precisions; }
constexpr const auto& all_values_of(OffloadTier) { return all_offload_tiers; }
constexpr const auto& all_values_of(ReduceDType) { return all_reduce_dtypes; }
constexpr const auto& all_values_of(GradWrites) { return all_grad_writes; }
constexpr const auto& all_values_of(MasterWeights) { return all_master_weights; }
constexpr const auto& all_values_of(StateFormat) { return all_state_formats; }
constexpr const auto& all_values_of(ParamPlace) { return all_param_places; }

}  // namespace zero::detail
