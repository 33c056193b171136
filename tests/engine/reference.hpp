// The single-process reference the engine tests hold ZeroOptimizer to, with
// no test framework (so the Catch2-free CUDA tests share it): a small model
// of odd-sized parameters, a deterministic gradient generator whose per-rank
// parts sum exactly in every storage type (so an N-rank run and a 1-rank run
// on the whole batch see the same gradients, and only the order of
// reductions can differ), the engine's semantics written plainly
// (reference_train), and the ULP distance the equivalence criterion uses.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "zero/zero.hpp"

namespace zero::test {

struct ParamSpec {
  std::string unit, name;
  std::size_t numel;
};

// Units of different sizes; parameters smaller than N, not divisible by N,
// and a unit that is a single element.
inline const std::vector<ParamSpec>& test_model() {
  static const std::vector<ParamSpec> model = {
      {"embed", "embed.table", 37}, {"embed", "embed.scale", 1}, {"mlp", "mlp.w", 129},
      {"mlp", "mlp.b", 6},          {"head", "head.w", 5},       {"head", "head.b", 3},
      {"tiny", "tiny.x", 1}};
  return model;
}

inline std::uint64_t mix(std::uint64_t z) { return zero::detail::mix64(z); }

// The initial value of element i of parameter p (same on every rank).
inline float init_value(std::size_t p, std::size_t i) {
  const std::uint64_t h = mix(p * 0x10001u + i + 12345u);
  return static_cast<float>(static_cast<double>(h >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

// Part `part` of the global batch's gradient for element i of parameter p at
// (step, micro). Multiples of 2^-6 with |k| <= 8: any sum over up to 7 parts
// and 3 micro-batches has at most 8 significant bits, so it is exact in bf16,
// fp16 and fp32 whatever the order of summation.
inline float grad_part(int part, std::size_t p, std::size_t i, int step, int micro) {
  const std::uint64_t h = mix((static_cast<std::uint64_t>(part) << 48) ^ (static_cast<std::uint64_t>(step) << 36) ^
                              (static_cast<std::uint64_t>(micro) << 30) ^ (p << 20) ^ i);
  return static_cast<float>(static_cast<int>(h % 17u) - 8) * 0.015625f;
}

struct RunResult {
  std::vector<float> masters;     // per parameter element, model order
  std::vector<float> params;      // low-precision copies as fp32
  std::vector<StepResult> steps;  // every step() result of the last micro-batch
  MemoryReport memory;
  CommReport comm;
};

// The engine's semantics written plainly for one process, with no
// partitioning, no communicator and no engine code: sum every part and
// micro-batch of the gradient, unscale, average, clip as
// torch.nn.utils.clip_grad_norm_, and apply the optimizer's per-element rule.
// The independent reference the engine is held to.
template <class Precision, class Optimizer>
RunResult reference_train(int parts, const typename Optimizer::Hyper& hyper, const Options& options, int steps) {
  using G = typename Precision::grad_type;
  using PT = typename Precision::param_type;
  const auto& model = test_model();
  std::vector<float> w;
  std::vector<std::size_t> owner, index;
  for (std::size_t p = 0; p < model.size(); ++p)
    for (std::size_t i = 0; i < model[p].numel; ++i) {
      w.push_back(init_value(p, i));
      owner.push_back(p);
      index.push_back(i);
    }
  const std::size_t n = w.size();
  std::vector<std::vector<float>> state(Optimizer::state_slots, std::vector<float>(n, 0.0f));
  const double loss_scale = Precision::loss_scaling ? options.loss_scale.initial_scale : 1.0;
  const double divisor = static_cast<double>(parts) * options.grad_accumulation_steps;
  RunResult out;
  for (int step = 1; step <= steps; ++step) {
    std::vector<float> g(n, 0.0f);
    for (std::size_t k = 0; k < n; ++k) {
      float sum = 0;  // exact: see grad_part
      for (int micro = 0; micro < options.grad_accumulation_steps; ++micro)
        for (int part = 0; part < parts; ++part)
          sum += grad_part(part, owner[k], index[k], step, micro) * static_cast<float>(loss_scale);
      g[k] = to_float(from_float<G>(sum));
    }
    double sum_squares = 0;
    for (float x : g) sum_squares += static_cast<double>(x) * x;
    const double unscale = 1.0 / (loss_scale * divisor);
    const double norm = std::sqrt(sum_squares) * unscale;
    const double clip = options.clip_norm > 0 && norm > 0 ? std::min(1.0, options.clip_norm / (norm + 1e-6)) : 1.0;
    const float grad_scale = static_cast<float>(unscale * clip);
    const auto scalars = Optimizer::prepare(hyper, step);
    for (std::size_t k = 0; k < n; ++k) {
      float st[Optimizer::state_slots > 0 ? Optimizer::state_slots : 1];
      for (int s = 0; s < Optimizer::state_slots; ++s) st[s] = state[s][k];
      Optimizer::update(scalars, w[k], zero::math::mul(g[k], grad_scale), st);
      for (int s = 0; s < Optimizer::state_slots; ++s) state[s][k] = st[s];
    }
    StepResult r;
    r.stepped = true;
    r.grad_norm = norm;
    out.steps.push_back(r);
  }
  out.masters = w;
  for (float x : w) out.params.push_back(to_float(from_float<PT>(x)));
  return out;
}

// ULP distance between two values of a 16-bit or 32-bit float type.
template <class T>
inline std::int64_t ulp_distance(float a, float b) {
  auto ordered = [](float x) -> std::int64_t {
    std::int64_t bits;
    if constexpr (std::is_same_v<T, float>) {
      std::int32_t u;
      std::memcpy(&u, &x, 4);
      bits = u;
      if (bits < 0) bits = std::int64_t{INT32_MIN} - bits;
    } else {
      const std::uint16_t u = from_float<T>(x).bits;
      bits = (u & 0x8000u) ? -static_cast<std::int64_t>(u & 0x7fffu) : static_cast<std::int64_t>(u);
    }
    return bits;
  };
  const std::int64_t d = ordered(a) - ordered(b);
  return d < 0 ? -d : d;
}

}  // namespace zero::test
