// Why: the whole optimizer step is one pass over a contiguous shard, on host
// and device alike: read the gradient in its storage type, multiply by one
// combined scale (1/loss_scale times the clip coefficient), update the fp32
// master weights and the optimizer state, and write the low-precision copy.
// Any extra pass would double the memory traffic of a memory-bound step.
// This header holds what both kernels share: the argument block and the
// per-element body, so the host and CUDA kernels cannot drift apart.
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "zero/math.hpp"
#include "zero/optim/policy.hpp"
#include "zero/precision/convert.hpp"
#include "zero/precision/remainder.hpp"
#include "zero/precision/stochastic.hpp"
#include "zero/precision/types.hpp"
#include "zero/quant/dynamic_code.hpp"

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
  // The state in 8 bits, block-wise (Options::states = blockwise8;
  // zero/quant/dynamic_code.hpp): slot k's value of element i is
  // code[k][state8[k][i]] times absmax[k][b], b the block of i. Block b
  // covers elements [b * block - block_phase, (b + 1) * block - block_phase)
  // cut to [0, n): a range that starts inside a parameter's block (where a
  // shard begins) has a short first block. The step updates a block, then
  // quantizes it again with its new absmax. All slots or none; `state` and
  // `state16` are then unused.
  std::uint8_t* state8[slots > 0 ? slots : 1] = {};
  float* absmax[slots > 0 ? slots : 1] = {};
  const float* code[slots > 0 ? slots : 1] = {};
  std::uint32_t block = 0;
  std::uint32_t block_phase = 0;

  // The same step over elements [d, d + count) of these: the arrays the
  // caller fills (gradient, copy, master or remainder where given) advanced
  // by d, and the stochastic-rounding ids with them. A store then points the
  // state, and a master it keeps itself, at its own part.
  ZERO_HOST_DEVICE FusedStepArgs part(std::size_t d, std::size_t count) const {
    FusedStepArgs p = *this;
    p.n = count;
    p.grad = grad + d;
    p.global_offset = global_offset + d;
    if (master != nullptr) p.master = master + d;
    if (remainder != nullptr) p.remainder = remainder + d;
    if (param != nullptr) p.param = param + d;
    return p;
  }

  ZERO_HOST_DEVICE bool states_in_bf16() const { return slots > 0 && state16[0] != nullptr; }
  ZERO_HOST_DEVICE bool states_blockwise() const { return slots > 0 && state8[0] != nullptr; }
  ZERO_HOST_DEVICE quant::PhasedBlocks blocks() const { return {n, block, block_phase}; }
  ZERO_HOST_DEVICE std::size_t block_count() const { return blocks().count(); }
  ZERO_HOST_DEVICE std::size_t block_begin(std::size_t b) const { return blocks().begin(b); }
  ZERO_HOST_DEVICE std::size_t block_end(std::size_t b) const { return blocks().end(b); }
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

// Element i's update with its state given as fp32 values `st` (read and
// written back by the caller in its storage format): the master read and
// written as the arguments keep it, the copy written.
template <optim::Policy Opt, class Grad, class Param>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE void fused_update_element(const FusedStepArgs<Opt, Grad, Param>& a, std::size_t i,
                                                             float* st) {
  float w;
  if constexpr (FusedStepArgs<Opt, Grad, Param>::can_split_master)
    w = a.remainder != nullptr ? join_master(a.param[i], a.remainder[i]) : a.master[i];
  else
    w = a.master[i];
  const float g = zero::math::mul(to_float(a.grad[i]), a.grad_scale);
  Opt::update(a.scalars, w, g, st);
  if constexpr (FusedStepArgs<Opt, Grad, Param>::can_split_master) {
    if (a.remainder != nullptr) {
      split_master(w, a.param[i], a.remainder[i]);
      return;
    }
  }
  a.master[i] = w;
  if constexpr (!std::is_same_v<Param, float>) a.param[i] = rounded_copy(a, w, i);
}

// One element, its state in fp32 or bf16. Shared by the host scalar loop and
// the CUDA kernel.
template <optim::Policy Opt, class Grad, class Param>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE void fused_step_element(const FusedStepArgs<Opt, Grad, Param>& a, std::size_t i) {
  constexpr int slots = Opt::state_slots;
  float st[slots > 0 ? slots : 1];
  const bool s16 = a.states_in_bf16();
  for (int k = 0; k < slots; ++k) st[k] = s16 ? to_float(a.state16[k][i]) : a.state[k][i];
  fused_update_element(a, i, st);
  for (int k = 0; k < slots; ++k) {
    if (s16)
      a.state16[k][i] = rounded_state(a.state_rounding, st[k], a.global_offset + i, k);
    else
      a.state[k][i] = st[k];
  }
}

// Element i of block b of an 8-bit state step: its state dequantized, the
// update, and the new fp32 values into scratch[k * a.block + (i - begin)]
// (quantized once the block's new absmax is known: fused_step_block's
// second pass). Shared by the host scalar loop and the CUDA kernel.
template <optim::Policy Opt, class Grad, class Param>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE void blockwise_update_element(const FusedStepArgs<Opt, Grad, Param>& a,
                                                                 std::size_t b, std::size_t i, float* scratch) {
  constexpr int slots = Opt::state_slots;
  float st[slots > 0 ? slots : 1];
  for (int k = 0; k < slots; ++k) st[k] = quant::dequantize(a.state8[k][i], a.code[k], a.absmax[k][b]);
  fused_update_element(a, i, st);
  const std::size_t at = i - a.block_begin(b);
  for (int k = 0; k < slots; ++k) scratch[static_cast<std::size_t>(k) * a.block + at] = st[k];
}

// Block b of an 8-bit state step, serially: every element's update, then
// each slot quantized with its block's new absmax (quant::quantize_block:
// a block with a non-finite value reads back as NaN). `scratch` holds
// slots x block floats. The host's scalar path and the tests' reference.
template <optim::Policy Opt, class Grad, class Param>
ZERO_HOST_DEVICE inline void fused_step_block(const FusedStepArgs<Opt, Grad, Param>& a, std::size_t b,
                                              float* scratch) {
  const std::size_t begin = a.block_begin(b), end = a.block_end(b);
  for (std::size_t i = begin; i < end; ++i) blockwise_update_element(a, b, i, scratch);
  for (int k = 0; k < Opt::state_slots; ++k)
    a.absmax[k][b] = quant::quantize_block(scratch + static_cast<std::size_t>(k) * a.block, end - begin, a.code[k],
                                           a.state8[k] + begin);
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
