// Why: SGD exactly as torch.optim.SGD (1.13): L2 decay added to the gradient,
// the momentum buffer initialised to the first gradient (no dampening on step
// 1), dampening on later steps, Nesterov look-ahead on request.
//
// Two policies, one rule: Sgd keeps the momentum buffer (4 bytes per
// parameter in fp32 states); PlainSgd is SGD made with momentum 0, which,
// like torch.optim.SGD, keeps no buffer at all. A state slot is a
// compile-time property of a policy (the fused kernels, the stores and the
// checkpoint layout are built around it), so "no buffer" is a policy of its
// own rather than a run-time flag; make_optimizer and the configuration pick
// PlainSgd for "sgd" with momentum 0 by themselves.
#pragma once

#include "zero/compiler.hpp"

#include <array>
#include <cmath>
#include <cstdint>

#include "zero/error.hpp"
#include "zero/math.hpp"
#include "zero/optim/policy.hpp"

namespace zero::optim {

namespace detail {
template <bool KeepsMomentum>
struct SgdSlots {  // the momentum buffer
  static constexpr int state_slots = 1;
  static constexpr const char* state_names[] = {"momentum"};
};
template <>
struct SgdSlots<false> {  // momentum 0: nothing kept
  static constexpr int state_slots = 0;
};
}  // namespace detail

template <bool KeepsMomentum>
struct SgdPolicy : detail::SgdSlots<KeepsMomentum> {
  static constexpr const char* name = "sgd";  // one optimizer to configurations and checkpoints

  struct Hyper {  // doubles, like the Python floats torch.optim receives
    double lr = 1e-2;
    double momentum = 0.0;
    double dampening = 0.0;
    double weight_decay = 0.0;
    bool nesterov = false;

    // By name, as a config file's optimizer.params sets them (zero/runtime/hyper_fields.hpp).
    static constexpr auto fields() {
      using F = HyperField<Hyper>;
      return std::array{F{"lr", &Hyper::lr}, F{"momentum", &Hyper::momentum}, F{"dampening", &Hyper::dampening},
                        F{"weight_decay", &Hyper::weight_decay}, F{"nesterov", &Hyper::nesterov}};
    }

    void validate() const {
      require(std::isfinite(lr) && lr >= 0.0, "SGD hyper-parameter 'lr' is ", lr, "; it must be a finite number >= 0");
      require(std::isfinite(momentum) && momentum >= 0.0, "SGD hyper-parameter 'momentum' is ", momentum,
              "; it must be a finite number >= 0");
      require(KeepsMomentum || momentum == 0.0, "SGD hyper-parameter 'momentum' is ", momentum,
              ", but this SGD was made with momentum 0 and keeps no momentum buffer (zero::optim::PlainSgd); "
              "make the optimizer with momentum > 0 from the start (zero::optim::Sgd) to use momentum");
      require(std::isfinite(dampening) && dampening >= 0.0 && dampening <= 1.0,
              "SGD hyper-parameter 'dampening' is ", dampening, "; it must be in [0, 1]");
      require(std::isfinite(weight_decay) && weight_decay >= 0.0, "SGD hyper-parameter 'weight_decay' is ",
              weight_decay, "; it must be a finite number >= 0");
      require(!nesterov || (momentum > 0.0 && dampening == 0.0),
              "SGD hyper-parameter 'nesterov' needs momentum > 0 and dampening == 0 (as torch.optim.SGD); set "
              "momentum or turn nesterov off");
    }
  };

  struct Scalars {
    float lr;
    float momentum;
    float one_minus_dampening;
    float weight_decay;
    bool nesterov;
    bool first_step;  // the buffer starts as a copy of the first gradient
  };

  static Scalars prepare(const Hyper& h, std::int64_t step) {
    require(step >= 1, "optimizer step number is ", step, "; steps count from 1");
    return Scalars{static_cast<float>(h.lr), static_cast<float>(h.momentum), static_cast<float>(1.0 - h.dampening),
                   static_cast<float>(h.weight_decay), h.nesterov, step == 1};
  }

  template <class V>
  ZERO_HOST_DEVICE static void update(const Scalars& s, V& w, const V& grad, V* state) {
    using namespace zero::math;
    V d = grad;
    if (s.weight_decay != 0.0f) d = d + mul(s.weight_decay, w);  // d_p.add(param, alpha=wd)
    if constexpr (KeepsMomentum) {
      if (s.momentum != 0.0f) {
        V& buf = state[0];
        // buf = clone(d_p) on the first step, else buf.mul_(momentum).add_(d_p, alpha=1-dampening)
        buf = s.first_step ? d : mul(buf, s.momentum) + mul(s.one_minus_dampening, d);
        d = s.nesterov ? d + mul(s.momentum, buf) : buf;  // d_p.add(buf, alpha=momentum)
      }
    }
    w = w + mul(-s.lr, d);  // param.add_(d_p, alpha=-lr)
  }
};

// SGD with a momentum buffer (momentum may still be set to 0 later: the buffer stays).
using Sgd = SgdPolicy<true>;
// SGD made with momentum 0: no state at all, as torch.optim.SGD keeps none.
using PlainSgd = SgdPolicy<false>;

}  // namespace zero::optim
