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
#include "zero/precision/stochastic.hpp"
#include "zero/precision/types.hpp"

namespace zero::kernels {

// Everything one fused step over one shard needs. Param == float means fp32
// training: the master is the parameter and no copy is written.
template <optim::Policy Opt, StorageType Grad, StorageType Param>
struct FusedStepArgs {
  static constexpr int slots = Opt::state_slots;

  float* master = nullptr;                          // fp32 master weights, n elements
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
};

// One element. Shared by the host scalar loop and the CUDA kernel.
template <optim::Policy Opt, class Grad, class Param>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE void fused_step_element(const FusedStepArgs<Opt, Grad, Param>& a, std::size_t i) {
  constexpr int slots = Opt::state_slots;
  float w = a.master[i];
  const float g = zero::math::mul(to_float(a.grad[i]), a.grad_scale);
  float st[slots > 0 ? slots : 1];
  for (int k = 0; k < slots; ++k) st[k] = a.state[k][i];
  Opt::update(a.scalars, w, g, st);
  a.master[i] = w;
  for (int k = 0; k < slots; ++k) a.state[k][i] = st[k];
  if constexpr (!std::is_same_v<Param, float>) {
    a.param[i] = a.rounding.enabled ? stochastic_round<Param>(w, a.rounding, a.global_offset + i) : from_float<Param>(w);
  }
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
