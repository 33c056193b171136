// Why: the example programs take the ZeRO choices from --config FILE and
// their command lines into a zero::Config (common/cli.hpp,
// add_config_options) and add their own settings (the schedule's learning
// rate, seed, clipping, accumulation); zero::make_optimizer then builds the
// engine it names, so a training loop is compiled once, not once per
// optimizer type. This is that one step, and the offload tiers each program
// was built with.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "zero/error.hpp"
#include "zero/runtime/make_optimizer.hpp"
#if defined(ZERO_EXAMPLE_HAVE_DISK_TIER)
#include "zero/offload/disk_state_store.hpp"
#endif

namespace zero::examples {

// The run's Config: what --config and the ZeRO flags gave (common/cli.hpp,
// add_config_options), with the learning rate `lr` of the program's
// schedule, SGD's momentum 0.9 (the examples' setting) unless the file set
// it, and `options` (the program's own: seed, clipping, accumulation)
// applied by `apply`.
template <class Apply>
zero::Config example_config(zero::Config config, double lr, Apply&& apply) {
  config.hyper["lr"] = lr;
  if (config.optimizer == "sgd" && !config.hyper.contains("momentum")) config.hyper["momentum"] = 0.9;
  apply(config.options);
  return config;
}

// The optimizer `config` names on Backend, with the disk tier where this
// program was built with it (ZERO_EXAMPLE_HAVE_DISK_TIER).
template <class Backend, class Comm>
std::unique_ptr<zero::AnyOptimizer> make_example_optimizer(Comm& comm, const zero::Config& config) {
#if defined(ZERO_EXAMPLE_HAVE_DISK_TIER)
  return zero::make_optimizer<Backend, zero::offload::Nvme>(comm, config);
#else
  return zero::make_optimizer<Backend>(comm, config);
#endif
}

// The offload tiers this program was built with, for --offload: cpu where
// it computes on a device, nvme with the disk tier.
inline std::vector<std::string> built_offload_tiers(bool device = false) {
  std::vector<std::string> tiers{"none"};
  if (device) tiers.push_back("cpu");
#if defined(ZERO_EXAMPLE_HAVE_DISK_TIER)
  tiers.push_back("nvme");
#endif
  return tiers;
}

}  // namespace zero::examples
