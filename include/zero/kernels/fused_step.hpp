// Why: the whole optimizer step is one pass over a contiguous shard, on host
// and device alike: read the gradient in its storage type, multiply by one
// combined scale (1/loss_scale times the clip coefficient), update the fp32
// master weights and the optimizer state, and write the low-precision copy.
// Any extra pass would double the memory traffic of a memory-bound step.
// This header holds what both kernels share: the argument block and the
// per-element body, so the host and CUDA kernels cannot drift apart.
#pragma once

#include "zero/config.hpp"

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "zero/math.hpp"
#include "zero/optim/policy.hpp"
#include "zero/precision/convert.hpp"
#include "zero/precision/remainder.hpp"
#include "zero/precision/stochastic.hpp"
#include "zero/precision/types.hpp"

namespace zero::kernels {

// Everything one fused step over one shard needs. Param == float means fp32
// training: the master is the parameter and no copy is written.
template <optim::Policy Opt, StorageType Grad, StorageType Param>
struct FusedStepArgs {
  static constexpr int slots = Opt::state_slots;
  // The fp32 master may be kept as the bf16 copy plus a 16-bit remainder
  // (zero/precision/remainder.hpp): bf16 parameters only.
  static constexpr bool can_split_master = std::is_same_v<Param, bf16>;

  float* master = nullptr;                          // fp32 master weights, n elements (null with `remainder`)
  // The master as `param` (read and written) plus these n remainders;
  // nearest-even and stochastic rounding do not apply (the copy is the
  // master's rounding half away from zero).
  std::uint16_t* remainder = nullptr;
  const Grad* grad = nullptr;                       // gradient shard, n elements
  float* state[slots > 0 ? slots : 1] = {};         // slot k: n fp32 values
  Param* param = nullptr;                           // low-precision copy (ignored for fp32)
  std::size_t n = 0;
  float grad_scale = 1.0f;                          // (1 / loss_scale) * clip coefficient
  typename Opt::Scalars scalars{};
  // bf16/fp16 copies: stochastic rounding instead of nearest-even when enabled.
  // The random stream depends on (seed, step, global index) only, so it is the
  // same whichever rank or device updates the element.
  StochasticRounding rounding{};
  std::uint64_t global_offset = 0;                  // id of element 0; element i draws with id global_offset + i
  // bf16 copies rounded to nearest with ties away from zero (as the
  // remainder master rounds them; Options::round_ties_away).
  bool ties_away = false;
  // The state in bf16 (Options::states): slot k's n values, read as fp32 and
  // written back rounded, to nearest even or (state_rounding.enabled)
  // stochastically; `state` is then unused. All slots or none.
  bf16* state16[slots > 0 ? slots : 1] = {};
  StochasticRounding state_rounding{};

  ZERO_HOST_DEVICE bool states_in_bf16() const { return slots > 0 && state16[0] != nullptr; }
};

// A bf16 state value. Stochastic rounding draws for (element id, slot):
// the slot in bits 58 and up of the id (an element id, a unit's index << 40
// plus the position, stays below 2^58 for fewer than 2^18 units), so no
// slot shares a stream with another or with the copies.
ZERO_HOST_DEVICE ZERO_FORCE_INLINE bf16 rounded_state(const StochasticRounding& r, float v, std::uint64_t id, int k) {
  if (r.enabled) return stochastic_round<bf16>(v, r, id ^ (static_cast<std::uint64_t>(k + 1) << 58));
  return from_float<bf16>(v);
}

// The 16-bit copy of an updated master value, as the arguments ask.
template <optim::Policy Opt, class Grad, class Param>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE Param rounded_copy(const FusedStepArgs<Opt, Grad, Param>& a, float w,
                                                      std::size_t i) {
  if (a.rounding.enabled) return stochastic_round<Param>(w, a.rounding, a.global_offset + i);
  return nearest_copy<Param>(w, a.ties_away);
}

// One element. Shared by the host scalar loop and the CUDA kernel.
template <optim::Policy Opt, class Grad, class Param>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE void fused_step_element(const FusedStepArgs<Opt, Grad, Param>& a, std::size_t i) {
  constexpr int slots = Opt::state_slots;
  float w;
  if constexpr (FusedStepArgs<Opt, Grad, Param>::can_split_master)
    w = a.remainder != nullptr ? join_master(a.param[i], a.remainder[i]) : a.master[i];
  else
    w = a.master[i];
  const float g = zero::math::mul(to_float(a.grad[i]), a.grad_scale);
  float st[slots > 0 ? slots : 1];
  const bool s16 = a.states_in_bf16();
  for (int k = 0; k < slots; ++k) st[k] = s16 ? to_float(a.state16[k][i]) : a.state[k][i];
  Opt::update(a.scalars, w, g, st);
  for (int k = 0; k < slots; ++k) {
    if (s16)
      a.state16[k][i] = rounded_state(a.state_rounding, st[k], a.global_offset + i, k);
    else
      a.state[k][i] = st[k];
  }
  if constexpr (FusedStepArgs<Opt, Grad, Param>::can_split_master) {
    if (a.remainder != nullptr) {
      split_master(w, a.param[i], a.remainder[i]);
      return;
    }
  }
  a.master[i] = w;
  if constexpr (!std::is_same_v<Param, float>) a.param[i] = rounded_copy(a, w, i);
}

// Squared L2 norm and non-finite detection of a gradient shard (raw values,
// before any scaling): the two numbers the step needs before it can run
// (clip coefficient, fp16 overflow skip).
struct GradStats {
  double sum_squares = 0.0;
  bool non_finite = false;

  GradStats& operator+=(const GradStats& o) {
    sum_squares += o.sum_squares;
    non_finite = non_finite || o.non_finite;
    return *this;
  }
};

}  // namespace zero::kernels
