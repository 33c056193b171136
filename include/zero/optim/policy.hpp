// Why: an optimizer is a policy, not a class hierarchy. The library's fused
// step kernels (host SIMD and CUDA) are templates over the policy, so a
// user's own optimizer (see examples/lion_optimizer.cpp) gets the same fused,
// sharded step (and ZeRO-Offload's, on the host's cores) without touching
// the library. This concept is the
// whole contract; a type that misses a piece fails here with the missing
// requirement named, not deep inside a kernel.
#pragma once

#include "zero/compiler.hpp"

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <type_traits>

namespace zero::optim {

// One hyper-parameter by name, so a configuration file or a command line can
// set it (zero/runtime/hyper_fields.hpp): a double or a bool member of the
// policy's Hyper, or of a base of it.
template <class H>
struct HyperField {
  using hyper_type = H;
  const char* name;
  double H::*number = nullptr;  // exactly one of these two is set
  bool H::*flag = nullptr;
  constexpr HyperField(const char* field_name, double H::*member) : name(field_name), number(member) {}
  constexpr HyperField(const char* field_name, bool H::*member) : name(field_name), flag(member) {}
};

// What `Hyper::fields()` must return where a policy has one: a constexpr
// array of HyperField of Hyper or of a base of it.
template <class H>
concept DescribesHyperFields = requires {
  H::fields()[0].name;
  typename std::remove_cvref_t<decltype(H::fields()[0])>::hyper_type;
  requires std::is_base_of_v<typename std::remove_cvref_t<decltype(H::fields()[0])>::hyper_type, H>;
  { std::size(H::fields()) } -> std::convertible_to<std::size_t>;
};

// What a state slot holds, for the 8-bit state format (Options::states =
// blockwise8, zero/quant/dynamic_code.hpp): values of any sign (stored with
// the signed code, as Adam's first moment) or values never negative (the
// unsigned code, whose sign bit is one more bit of precision, as Adam's
// second moment). A policy says so per slot with
// `static constexpr optim::StateValues state_values[]`; without it every slot
// is `any_sign`, which is right for any values (a non-negative slot then
// loses one bit).
enum class StateValues { any_sign, non_negative };

template <class Opt>
constexpr StateValues state_values(int slot) {
  if constexpr (requires { Opt::state_values[0]; })
    return Opt::state_values[slot];
  else
    return StateValues::any_sign;
}

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
  // Optional: `static constexpr auto fields()` in Hyper, an array of
  // HyperField {name, member pointer}, lets them be set by name (a config
  // file's optimizer.params); without it they are set in code only.
  hyper.validate();
  // Per-step scalars computed once on the host (bias corrections, decay
  // factors) from the hyper-parameters and the 1-based step number, then
  // passed by value to every element.
  { Opt::prepare(hyper, step) } -> std::same_as<typename Opt::Scalars>;
  // The per-element rule, a template over the value type V (float on the
  // device and in scalar loops, a SIMD pack in the host kernels), written with
  // zero::math functions. It must be ZERO_HOST_DEVICE to run on GPUs.
  Opt::update(scalars, w, g, state);
} && std::is_trivially_copyable_v<typename Opt::Scalars> && (Opt::state_slots >= 0) && (Opt::state_slots <= 4) &&
    (!requires { Opt::Hyper::fields(); } || DescribesHyperFields<typename Opt::Hyper>);

}  // namespace zero::optim
