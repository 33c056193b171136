// Why: an optimizer is a policy, not a class hierarchy. The library's fused
// step kernels (host SIMD and CUDA) are templates over the policy, so a
// user's own optimizer (see examples/lion_optimizer.cpp) gets the same fused,
// sharded step (and, once ZeRO-Offload lands, the offloaded one) without
// touching the library. This concept is the
// whole contract; a type that misses a piece fails here with the missing
// requirement named, not deep inside a kernel.
#pragma once

#include "zero/config.hpp"

#include <concepts>
#include <cstdint>
#include <type_traits>

namespace zero::optim {

template <class Opt>
concept Policy = requires(const typename Opt::Hyper& hyper, const typename Opt::Scalars& scalars, float& w,
                          const float& g, float* state, std::int64_t step) {
  // A short lower-case name for reports and checkpoints: "adamw".
  { Opt::name } -> std::convertible_to<const char*>;
  // fp32 values kept per parameter (Adam: m and v; Sgd: the momentum buffer).
  // Optional: `static constexpr const char* state_names[]`, one per slot,
  // names them in checkpoints ("exp_avg"); without it they are "state0"...
  { Opt::state_slots } -> std::convertible_to<int>;
  // Runtime hyper-parameters; validate() throws zero::InvalidArgument naming the field.
  hyper.validate();
  // Per-step scalars computed once on the host (bias corrections, decay
  // factors) from the hyper-parameters and the 1-based step number, then
  // passed by value to every element.
  { Opt::prepare(hyper, step) } -> std::same_as<typename Opt::Scalars>;
  // The per-element rule, a template over the value type V (float on the
  // device and in scalar loops, a SIMD pack in the host kernels), written with
  // zero::math functions. It must be ZERO_HOST_DEVICE to run on GPUs.
  Opt::update(scalars, w, g, state);
} && std::is_trivially_copyable_v<typename Opt::Scalars> && (Opt::state_slots >= 0) && (Opt::state_slots <= 4);

}  // namespace zero::optim
