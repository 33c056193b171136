// Why: Adam and AdamW exactly as torch.optim (1.13) computes them, so that a
// model trained with zero matches one trained with PyTorch: bias corrections
// in double on the host, eps added after dividing sqrt(v) by sqrt(1-beta2^t),
// AdamW's decay applied to the weight before the moment update, Adam's L2
// term added to the gradient. Every product is rounded on its own, as ATen's
// portable CPU kernels do, which makes the result independent of whether the
// compiler would have fused it (see zero/math.hpp). Golden test:
// tests/optim/test_optim_golden.cpp.
#pragma once

#include "zero/compiler.hpp"

#include <array>
#include <cmath>
#include <cstdint>

#include "zero/error.hpp"
#include "zero/math.hpp"
#include "zero/optim/policy.hpp"

namespace zero::optim {

// Doubles, like the Python floats torch.optim receives: 1 - beta2 must be
// computed from 0.999, not from its float rounding, to match PyTorch. An
// aggregate, so `AdamW::Hyper{.lr = 3e-4, .weight_decay = 0.1}` works; Adam
// and AdamW differ only in weight_decay's default (torch.optim's: 0 and
// 1e-2), which is why the default is a template argument rather than a
// constructor (a constructor would make it no aggregate), given as a type
// (Clang 14 and nvcc take no double template argument).
struct AdamDefaults {
  static constexpr double weight_decay = 0.0;  // torch.optim.Adam's
};
struct AdamWDefaults {
  static constexpr double weight_decay = 1e-2;  // torch.optim.AdamW's
};

template <class Defaults>
struct BasicAdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = Defaults::weight_decay;

  // By name, as a config file's optimizer.params sets them (zero/runtime/hyper_fields.hpp).
  static constexpr auto fields() {
    using H = BasicAdamHyper;
    using F = HyperField<H>;
    return std::array{F{"lr", &H::lr}, F{"beta1", &H::beta1}, F{"beta2", &H::beta2}, F{"eps", &H::eps},
                      F{"weight_decay", &H::weight_decay}};
  }

  void validate() const {
    require(std::isfinite(lr) && lr >= 0.0, "Adam hyper-parameter 'lr' is ", lr,
            "; it must be a finite number >= 0");
    require(beta1 >= 0.0 && beta1 < 1.0, "Adam hyper-parameter 'beta1' is ", beta1, "; it must be in [0, 1)");
    require(beta2 >= 0.0 && beta2 < 1.0, "Adam hyper-parameter 'beta2' is ", beta2, "; it must be in [0, 1)");
    require(std::isfinite(eps) && eps > 0.0, "Adam hyper-parameter 'eps' is ", eps,
            "; it must be a finite number > 0 (1e-8 is usual)");
    require(std::isfinite(weight_decay) && weight_decay >= 0.0, "Adam hyper-parameter 'weight_decay' is ",
            weight_decay, "; it must be a finite number >= 0");
  }
};
using AdamHyper = BasicAdamHyper<AdamDefaults>;

struct AdamScalars {
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float step_size;              // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  float eps;
  float weight_decay;  // Adam: L2 coefficient added to the gradient
  float decay;         // AdamW: 1 - lr * weight_decay, applied to the weight
};

namespace detail {

template <class Defaults>
AdamScalars adam_scalars(const BasicAdamHyper<Defaults>& h, std::int64_t step) {
  require(step >= 1, "optimizer step number is ", step, "; steps count from 1");
  // As torch: Python doubles, rounded to float where they meet the tensors.
  const double bias_correction1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  AdamScalars s{};
  s.beta1 = static_cast<float>(h.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.step_size = static_cast<float>(h.lr / bias_correction1);
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  s.eps = static_cast<float>(h.eps);
  s.weight_decay = static_cast<float>(h.weight_decay);
  s.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  return s;
}

// The moment updates and the step shared by Adam and AdamW.
template <class V>
ZERO_HOST_DEVICE ZERO_FORCE_INLINE void adam_moments_and_step(const AdamScalars& s, V& w, const V& g, V* state) {
  using namespace zero::math;
  V& m = state[0];
  V& v = state[1];
  m = mul(m, s.beta1) + mul(s.one_minus_beta1, g);          // exp_avg.mul_(b1).add_(g, alpha=1-b1)
  v = mul(v, s.beta2) + mul(mul(s.one_minus_beta2, g), g);  // exp_avg_sq.mul_(b2).addcmul_(g, g, value=1-b2)
  const V denom = div(sqrt(v), s.bias_correction2_sqrt) + s.eps;
  w = w + div(mul(-s.step_size, m), denom);                 // param.addcdiv_(m, denom, value=-step_size)
}

}  // namespace detail

// Adam (Kingma & Ba), with optional L2 weight decay added to the gradient.
struct Adam {
  static constexpr const char* name = "adam";
  static constexpr int state_slots = 2;
  static constexpr const char* state_names[] = {"exp_avg", "exp_avg_sq"};  // torch.optim.Adam's
  static constexpr StateValues state_values[] = {StateValues::any_sign, StateValues::non_negative};
  using Hyper = AdamHyper;
  using Scalars = AdamScalars;

  static Scalars prepare(const Hyper& h, std::int64_t step) { return detail::adam_scalars(h, step); }

  template <class V>
  ZERO_HOST_DEVICE static void update(const Scalars& s, V& w, const V& grad, V* state) {
    using namespace zero::math;
    V g = grad;
    if (s.weight_decay != 0.0f) g = g + mul(s.weight_decay, w);  // grad.add(param, alpha=wd)
    detail::adam_moments_and_step(s, w, g, state);
  }
};

// AdamW (Loshchilov & Hutter): weight decay decoupled from the gradient.
struct AdamW {
  static constexpr const char* name = "adamw";
  static constexpr int state_slots = 2;
  static constexpr const char* state_names[] = {"exp_avg", "exp_avg_sq"};
  static constexpr StateValues state_values[] = {StateValues::any_sign, StateValues::non_negative};
  using Hyper = BasicAdamHyper<AdamWDefaults>;
  using Scalars = AdamScalars;

  static Scalars prepare(const Hyper& h, std::int64_t step) { return detail::adam_scalars(h, step); }

  template <class V>
  ZERO_HOST_DEVICE static void update(const Scalars& s, V& w, const V& grad, V* state) {
    using namespace zero::math;
    if (s.weight_decay != 0.0f) w = mul(w, s.decay);  // param.mul_(1 - lr*wd)
    detail::adam_moments_and_step(s, w, grad, state);
  }
};

}  // namespace zero::optim
