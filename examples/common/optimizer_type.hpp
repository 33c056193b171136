// Why: a program that takes the ZeRO choices at run time (--stage,
// --precision, --optimizer) must still name one ZeroOptimizer type per
// combination at compile time. This maps the choices onto that type once, for
// every example program, instead of each spelling out the same switch.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "common/choices.hpp"
#include "zero/zero.hpp"
#if defined(ZERO_EXAMPLE_HAVE_DISK_TIER)
#include "zero/offload/disk_state_store.hpp"
#endif

namespace zero::examples {

// Calls run.template operator()<Opt>() with
// Opt = ZeroOptimizer<precision, optimizer, stage<S>, Offload, Backend> as the
// choices name them, and returns its result. All 36 combinations are
// instantiated: run must compile for each.
template <class Offload, class Backend, class Run>
decltype(auto) with_optimizer_type(const ZeroChoices& choices, Run&& run) {
  auto with_stage = [&]<class Precision, class Optimizer>() -> decltype(auto) {
    switch (choices.stage) {
      case 0:
        if constexpr (!Offload::to_host)
          return run.template operator()<ZeroOptimizer<Precision, Optimizer, stage<0>, Offload, Backend>>();
        else  // a type that does not exist (check_offload_choices refuses it first)
          throw InvalidArgument(zero::detail::concat("offload::", Offload::name, " needs stage 1, 2 or 3"));
      case 1: return run.template operator()<ZeroOptimizer<Precision, Optimizer, stage<1>, Offload, Backend>>();
      case 2: return run.template operator()<ZeroOptimizer<Precision, Optimizer, stage<2>, Offload, Backend>>();
      default: return run.template operator()<ZeroOptimizer<Precision, Optimizer, stage<3>, Offload, Backend>>();
    }
  };
  auto with_precision = [&]<class Optimizer>() -> decltype(auto) {
    if (choices.precision == "fp32") return with_stage.template operator()<precision::Full<float>, Optimizer>();
    if (choices.precision == "bf16") return with_stage.template operator()<precision::Mixed<bf16>, Optimizer>();
    return with_stage.template operator()<precision::Mixed<fp16>, Optimizer>();
  };
  if (choices.optimizer == "adamw") return with_precision.template operator()<optim::AdamW>();
  if (choices.optimizer == "adam") return with_precision.template operator()<optim::Adam>();
  return with_precision.template operator()<optim::Sgd>();
}

// As with_optimizer_type, with the offload tier chosen too: none, or nvme
// where this program was built with the disk tier (ZERO_EXAMPLE_HAVE_DISK_TIER).
template <class Backend, class Run>
decltype(auto) with_offload_and_optimizer_type(const ZeroChoices& choices, Run&& run) {
#if defined(ZERO_EXAMPLE_HAVE_DISK_TIER)
  if (choices.offload == "nvme") return with_optimizer_type<offload::Nvme, Backend>(choices, run);
#endif
  require(choices.offload == "none", "--offload ", choices.offload, " is not built into this program");
  return with_optimizer_type<offload::None, Backend>(choices, run);
}

// The offload tiers this program was built with, for --offload.
inline std::vector<std::string> built_offload_tiers() {
#if defined(ZERO_EXAMPLE_HAVE_DISK_TIER)
  return {"none", "nvme"};
#else
  return {"none"};
#endif
}

}  // namespace zero::examples
