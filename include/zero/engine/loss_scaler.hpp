// Why: fp16 gradients underflow unless the loss is scaled up, and overflow if
// it is scaled too far. The scaler raises the scale after a run of clean steps
// and backs off on overflow; every rank sees the same overflow flag (it is
// all-reduced), so all ranks skip the same steps and keep the same scale.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>

#include "zero/engine/options.hpp"

namespace zero {

class DynamicLossScaler {
 public:
  DynamicLossScaler() = default;
  DynamicLossScaler(const LossScaleOptions& o, bool enabled)
      : options_(o), enabled_(enabled), scale_(enabled ? o.initial_scale : 1.0), hysteresis_left_(o.hysteresis) {}

  double scale() const { return scale_; }
  bool enabled() const { return enabled_; }

  // What a checkpoint keeps, so a resumed run scales as the interrupted one would.
  struct State {
    double scale = 1.0;
    int clean_steps = 0;      // overflow-free steps since the scale last changed
    int hysteresis_left = 1;  // overflows still tolerated before backing off
  };
  State state() const { return {scale_, clean_steps_, hysteresis_left_}; }
  void restore(const State& s) {
    scale_ = s.scale;
    clean_steps_ = s.clean_steps;
    hysteresis_left_ = s.hysteresis_left;
  }

  // Records the outcome of one step. Returns true if the step must be skipped.
  bool update(bool overflow) {
    if (!enabled_) return false;
    if (overflow) {
      clean_steps_ = 0;
      if (--hysteresis_left_ <= 0) {
        scale_ = std::max(options_.min_scale, scale_ * options_.backoff_factor);
        hysteresis_left_ = options_.hysteresis;
      }
      return true;
    }
    if (++clean_steps_ >= options_.growth_interval) {
      scale_ *= options_.growth_factor;
      clean_steps_ = 0;
      hysteresis_left_ = options_.hysteresis;
    }
    return false;
  }

 private:
  LossScaleOptions options_{};
  bool enabled_ = false;
  double scale_ = 1.0;
  int clean_steps_ = 0;
  int hysteresis_left_ = 1;
};

}  // namespace zero
