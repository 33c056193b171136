// Why: the trainer and the tests wire the GPT to an optimizer the same way:
// one optimizer unit per model unit (embeddings, each block, the final
// LayerNorm), the model adopting the optimizer's padded layout, and hooks
// that hand the model each unit's parameters (acquire, all-gathered at
// stage 3) and take its gradients (grad_buffer, grad_ready). The model
// computes in fp32: with zero::AnyOptimizer (zero::make_optimizer) the hooks
// use its fp32 calls, which convert one unit at a time with the backend's
// own conversion whatever the storage; a ZeroOptimizer type is taken as it
// is when it stores fp32.
#pragma once

#include <string>
#include <type_traits>
#include <vector>

#include "gpt/gpt_model.hpp"
#include "zero/runtime/any_optimizer.hpp"
#include "zero/zero.hpp"

namespace gpt {

template <class Opt, class Model>
class ZeroBinding {
  // zero::AnyOptimizer: the fp32 calls; a ZeroOptimizer: its own fp32 buffers.
  static constexpr bool any = std::is_same_v<Opt, zero::AnyOptimizer>;

 public:
  // Registers the model's units and parameters; call before opt.finalize().
  ZeroBinding(Opt& opt, Model& model) : opt_(opt), model_(model) {
    for (const UnitSpec& u : model.units()) {
      units_.push_back(opt.add_unit(u.name));
      params_.emplace_back();
      for (const ParamSpec& p : u.params)
        params_.back().push_back(opt.add_param(units_.back(), p.name, p.numel, p.shape));
    }
  }

  // After opt.finalize(): the model reads parameters at the optimizer's offsets.
  void adopt_layout() {
    const zero::Layout& layout = opt_.layout();
    for (std::size_t u = 0; u < units_.size(); ++u) {
      std::vector<std::size_t> offsets;
      for (zero::ParamId p : params_[u]) offsets.push_back(layout.param(p).offset);
      model_.set_layout(static_cast<int>(u), std::move(offsets), layout.unit(units_[u]).padded);
    }
  }

  // Collective: sets every parameter from fill(unit, k, out), which writes
  // parameter k of unit `unit` (the same values on every rank).
  template <class Fill>
  void set_params(Fill&& fill) {
    std::vector<float> values;
    for (std::size_t u = 0; u < units_.size(); ++u)
      for (std::size_t k = 0; k < params_[u].size(); ++k) {
        values.assign(model_.units()[u].params[k].numel, 0.0f);
        fill(static_cast<int>(u), static_cast<int>(k), values.data());
        opt_.set_param(params_[u][k], values.data());
      }
  }

  // Unit u's parameters as fp32 (stage 3: all-gathered), valid until release(u).
  const float* acquire(int u) {
    if constexpr (any) {
      return opt_.acquire_fp32(unit(u));
    } else {
      static_assert(std::is_same_v<typename Opt::param_type, float>,
                    "gpt::ZeroBinding: a 16-bit ZeroOptimizer stores what the fp32 model cannot read; use "
                    "zero::make_optimizer's AnyOptimizer, whose fp32 calls convert");
      return opt_.acquire_unit(unit(u));
    }
  }
  void release(int u) { opt_.release_unit(unit(u)); }
  // Where backward writes unit u's fp32 gradient / it is written.
  float* grad_buffer(int u) {
    if constexpr (any)
      return opt_.grad_buffer_fp32(unit(u));
    else
      return opt_.grad_buffer(unit(u));
  }
  void grad_ready(int u) { opt_.grad_ready(unit(u)); }

  ParamHooks param_hooks() {
    return ParamHooks{[this](int u) { return acquire(u); }, [this](int u) { release(u); }};
  }
  GradHooks grad_hooks() {
    return GradHooks{[this](int u) { return grad_buffer(u); }, [this](int u) { grad_ready(u); }};
  }

  const std::vector<std::vector<zero::ParamId>>& params() const { return params_; }

 private:
  zero::UnitId unit(int u) const { return units_[static_cast<std::size_t>(u)]; }

  Opt& opt_;
  Model& model_;
  std::vector<zero::UnitId> units_;
  std::vector<std::vector<zero::ParamId>> params_;
};

}  // namespace gpt
