// Why: a configuration names hyper-parameters as text ("lr", "beta1"), the
// compiled optimizer takes a policy's Hyper struct. The policy describes its
// fields once (Hyper::fields(), zero/optim/policy.hpp), and these two
// functions read and write any policy's Hyper through that description, so a
// user's own optimizer is configurable by name as soon as it lists its
// fields, and a name no policy field has is an error, not a setting that is
// silently dropped.
#pragma once

#include "zero/compiler.hpp"

#include <map>
#include <string>
#include <vector>

#include "zero/error.hpp"
#include "zero/optim/policy.hpp"
#include "zero/runtime/name_list.hpp"

namespace zero {

// The names Hyper::fields() lists, in its order; none without fields().
template <optim::Policy O>
std::vector<std::string> hyper_field_names() {
  std::vector<std::string> names;
  if constexpr (optim::DescribesHyperFields<typename O::Hyper>)
    for (const auto& field : O::Hyper::fields()) names.emplace_back(field.name);
  return names;
}

// The policy's default Hyper with each named field set to its value (a bool
// field takes 0 or 1), then validated. An unknown name, a flag that is not 0
// or 1, or a name for a policy that does not list its fields throws
// InvalidArgument; so does Hyper::validate().
template <optim::Policy O>
typename O::Hyper hyper_from(const std::map<std::string, double>& values) {
  using Hyper = typename O::Hyper;
  Hyper hyper{};
  if constexpr (optim::DescribesHyperFields<Hyper>) {
    for (const auto& [key, value] : values) {
      bool found = false;
      for (const auto& field : Hyper::fields()) {
        if (key != field.name) continue;
        found = true;
        if (field.number != nullptr) {
          hyper.*field.number = value;
        } else {
          require(value == 0.0 || value == 1.0, "optimizer '", O::name, "' hyper-parameter '", key,
                  "' is a flag: 0 or 1 (false or true in a config file), not ", value);
          hyper.*field.flag = value != 0.0;
        }
      }
      if (!found) {
        const auto names = hyper_field_names<O>();
        throw InvalidArgument(detail::concat("optimizer '", O::name, "' has no hyper-parameter '", key, "'",
                                             detail::did_you_mean(key, names), "; its hyper-parameters are ",
                                             detail::join_names(names)));
      }
    }
  } else {
    if (!values.empty()) {
      std::vector<std::string> given;
      for (const auto& entry : values) given.push_back(entry.first);
      throw InvalidArgument(detail::concat(
          "optimizer '", O::name, "' does not list its hyper-parameters, so they cannot be set by name (",
          detail::join_names(given), "): give its Hyper a `static constexpr auto fields()` returning "
          "std::array{zero::optim::HyperField<Hyper>{\"lr\", &Hyper::lr}, ...} (docs/custom-optimizer.md), or "
          "set them in code"));
    }
  }
  hyper.validate();
  return hyper;
}

// Every field of `hyper` by name (bools as 0 or 1); empty for a policy
// without fields().
template <optim::Policy O>
std::map<std::string, double> hyper_to_map(const typename O::Hyper& hyper) {
  std::map<std::string, double> values;
  if constexpr (optim::DescribesHyperFields<typename O::Hyper>)
    for (const auto& field : O::Hyper::fields())
      values[field.name] = field.number != nullptr ? hyper.*field.number : (hyper.*field.flag ? 1.0 : 0.0);
  return values;
}

}  // namespace zero
