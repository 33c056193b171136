// Why: the trainer and the tests wire the GPT to a zero::ZeroOptimizer the
// same way: one optimizer unit per model unit (embeddings, each block, the
// final LayerNorm), the model adopting the optimizer's padded layout, and
// hooks that hand the model each unit's parameters (acquire_unit, all-
// gathered at stage 3) and take its gradients (grad_buffer, grad_ready).
// The model computes in fp32; with bf16/fp16 storage the hooks convert one
// unit at a time into a float copy (the model holds at most one unit at
// once), with the backend's own conversion (Ops<B>::convert: the CUDA kernel
// on a GPU, so the copy never leaves the device).
#pragma once

#include <string>
#include <type_traits>
#include <vector>

#include "gpt/gpt_model.hpp"
#include "zero/zero.hpp"

namespace gpt {

template <class Opt, class Model>
class ZeroBinding {
  using P = typename Opt::param_type;
  using G = typename Opt::grad_type;
  using Ops = zero::backend::Ops<typename Opt::backend_policy>;
  static constexpr bool convert = !std::is_same_v<P, float>;

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
    if constexpr (convert) {
      wide_params_ = Wide(layout.max_unit());
      wide_grads_ = Wide(layout.max_unit());
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
    const P* p = opt_.acquire_unit(unit(u));
    if constexpr (convert) {
      Ops::convert(wide_params_.data(), p, numel(u));
      return wide_params_.data();
    } else {
      return p;
    }
  }
  void release(int u) { opt_.release_unit(unit(u)); }
  // Where backward writes unit u's fp32 gradient / it is written.
  // (16-bit storage: the optimizer's buffer is handed out all the same; that
  // is where the engine flushes or waits for the previous bucket.)
  float* grad_buffer(int u) {
    G* g = opt_.grad_buffer(unit(u));
    if constexpr (convert)
      return wide_grads_.data();
    else
      return g;
  }
  void grad_ready(int u) {
    if constexpr (convert) Ops::convert(opt_.grad_buffer(unit(u)), wide_grads_.data(), numel(u));
    opt_.grad_ready(unit(u));
  }

  ParamHooks param_hooks() {
    return ParamHooks{[this](int u) { return acquire(u); }, [this](int u) { release(u); }};
  }
  GradHooks grad_hooks() {
    return GradHooks{[this](int u) { return grad_buffer(u); }, [this](int u) { grad_ready(u); }};
  }

  const std::vector<std::vector<zero::ParamId>>& params() const { return params_; }

 private:
  zero::UnitId unit(int u) const { return units_[static_cast<std::size_t>(u)]; }
  std::size_t numel(int u) const { return model_.units()[static_cast<std::size_t>(u)].numel; }

  Opt& opt_;
  Model& model_;
  std::vector<zero::UnitId> units_;
  std::vector<std::vector<zero::ParamId>> params_;
  using Wide = typename Ops::template Buffer<float>;
  Wide wide_params_, wide_grads_;  // one unit in fp32, in backend memory (16-bit storage only)
};

}  // namespace gpt
