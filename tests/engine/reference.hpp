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
#include <functional>
#include <stdexcept>
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


// Hyper-parameters the equivalence tests train with: weight decay on, and
// SGD with Nesterov momentum so every term of each rule is exercised.
template <class O>
typename O::Hyper test_hyper() {
  typename O::Hyper h;
  h.lr = 0.01;
  h.weight_decay = 0.01;
  if constexpr (std::is_same_v<O, zero::optim::Sgd>) {
    h.momentum = 0.9;
    h.nesterov = true;
  }
  return h;
}

// How far a run is from the reference: the largest relative difference of
// the fp32 masters (relative to max(|reference|, 0.1), so values crossing
// zero do not dominate) and the largest ulp distance of the low-precision
// copies. The ZeRO design's criterion: <= 1e-5 and <= 1.
struct Mismatch {
  double master_relative = 0;
  std::int64_t param_ulps = 0;
};

template <class ParamT>
inline Mismatch mismatch(const RunResult& got, const RunResult& want) {
  Mismatch m;
  const std::size_t n = std::min(got.masters.size(), want.masters.size());
  for (std::size_t i = 0; i < n; ++i) {
    const double scale = std::max(std::fabs(static_cast<double>(want.masters[i])), 0.1);
    m.master_relative = std::max(m.master_relative, std::fabs(static_cast<double>(got.masters[i]) - want.masters[i]) / scale);
    m.param_ulps = std::max(m.param_ulps, ulp_distance<ParamT>(got.params[i], want.params[i]));
  }
  return m;
}

// The ZeRO paper's model-state bytes per rank for mixed-precision Adam
// (2-byte parameters and gradients, K = 12 bytes of fp32 master, m and v),
// with phi the padded element count, and the model traffic per step in
// elements: 2 phi (N-1)/N for stages 0-2, 3 phi (N-1)/N for stage 3.
inline std::uint64_t zero_paper_model_state_bytes(int stage, std::uint64_t phi, std::uint64_t n) {
  const std::uint64_t k = 12;
  switch (stage) {
    case 0: return (2 + 2 + k) * phi;
    case 1: return (2 + 2) * phi + k * phi / n;
    case 2: return 2 * phi + (2 + k) * phi / n;
    default: return (2 + 2 + k) * phi / n;
  }
}
inline std::uint64_t zero_paper_traffic_elements(int stage, std::uint64_t phi, std::uint64_t n) {
  return (stage == 3 ? 3 : 2) * phi * (n - 1) / n;
}

struct TrainSpec {
  int steps = 5;
  int parts = 1;  // parts of the global batch (the N of the run being compared)
  // false: this rank's own part (an N-rank run); true: one rank summing all parts.
  bool sum_all_parts = false;
  // Called before each grad_ready with (rank, step, micro, unit index, the
  // host copy of the unit's gradient); lets a test inject an inf.
  std::function<void(int, int, int, std::size_t, void*)> tamper;
  // Every acquire_unit must return exactly the parameters gather_params()
  // gave after set_param and after the last step (catches a stage-3 gather,
  // or a stage 1/2 all-gather, read before it completed).
  bool check_acquired = false;
  // Backward as a trainer that adds into its gradients (+=) writes them, for
  // Options::grad_writes = accumulate: unit 0 is a tied weight that gets
  // half of its gradient at the start of backward and the rest at the end,
  // every other unit gets its gradient in two halves (grad_buffer twice),
  // and unit 0 is left for step() to make final.
  bool adds_into_gradients = false;
};

// The steady-state allocation tests' run (host and CUDA): three units of
// 1000, 1077 and 1154 elements, two micro-batches per step with clipping, and
// micro-batches whose gradients arrive through the backend's upload. Every
// buffer it needs is allocated before the first micro-batch.
inline Options steady_state_options() {
  Options o;
  o.grad_accumulation_steps = 2;
  o.clip_norm = 1.0;
  return o;
}

template <class Opt>
class SteadyStateRun {
 public:
  explicit SteadyStateRun(Opt& opt) : opt_(opt) {
    for (int u = 0; u < 3; ++u) {
      units_.push_back(opt_.add_unit("u" + std::to_string(u)));
      opt_.add_param(units_.back(), "w" + std::to_string(u), static_cast<std::size_t>(1000 + 77 * u));
    }
    opt_.finalize();
    host_.resize(opt_.layout().max_unit());
  }

  void micro_batch() {
    using G = typename Opt::grad_type;
    for (const UnitId u : units_) {
      opt_.acquire_unit(u);
      opt_.release_unit(u);
    }
    for (auto it = units_.rbegin(); it != units_.rend(); ++it) {
      opt_.acquire_unit(*it);
      G* g = opt_.grad_buffer(*it);
      const std::size_t n = opt_.layout().unit(*it).numel;
      for (std::size_t i = 0; i < n; ++i) host_[i] = from_float<G>(0.01f * static_cast<float>(i % 7));
      backend::Ops<typename Opt::backend_policy>::upload(g, host_.data(), n);
      opt_.grad_ready(*it);
      opt_.release_unit(*it);
    }
    opt_.step();
  }

 private:
  Opt& opt_;
  std::vector<UnitId> units_;
  std::vector<typename Opt::grad_type> host_;
};

// One way of running the engine in the equivalence tests.
inline constexpr std::size_t whole_model_bucket = std::size_t{32} << 20, one_unit_bucket = 1;
struct Variant {
  const char* name;
  int accumulation = 1;
  double clip = 0.0;
  ReduceDType reduce = ReduceDType::same_as_grad;
  std::size_t bucket_bytes = whole_model_bucket;
  int prefetch = 1;

  Options options() const {
    Options o;
    o.grad_accumulation_steps = accumulation;
    o.clip_norm = clip;
    o.reduce_dtype = reduce;
    o.bucket_bytes = bucket_bytes;
    o.prefetch_units = prefetch;
    o.loss_scale.initial_scale = 256;  // keeps the scaled test gradients inside fp16's range
    return o;
  }
};

// This micro-batch's gradient of element i of parameter p on `rank`, as the
// trainer writes it (scaled by the loss scale).
template <class G>
G gradient_value(const TrainSpec& spec, int rank, std::size_t p, std::size_t i, int step, int micro, float scale) {
  float v = 0;
  if (spec.sum_all_parts)
    for (int part = 0; part < spec.parts; ++part) v += grad_part(part, p, i, step, micro);
  else
    v = grad_part(rank, p, i, step, micro);
  return from_float<G>(v * scale);
}

// TrainSpec::adds_into_gradients: one micro-batch's backward, adding into
// the buffers grad_buffer() hands out (read back, add, write: the buffer
// may be a device's).
template <class Opt, class Acquire>
void backward_adding(Opt& opt, int rank, const std::vector<UnitId>& units, const TrainSpec& spec, int step,
                     int micro, Acquire acquire) {
  using G = typename Opt::grad_type;
  using Ops = backend::Ops<typename Opt::backend_policy>;
  const Layout& layout = opt.layout();
  const float scale = static_cast<float>(opt.loss_scale());
  // Adds elements [begin, end) of each of unit u's parameters' gradients.
  auto add = [&](UnitId u, double begin, double end) {
    const UnitInfo& unit = layout.unit(u);
    G* g = opt.grad_buffer(u);
    std::vector<G> host(unit.padded);
    Ops::download(host.data(), g, unit.padded);
    for (std::size_t p : unit.params) {
      const ParamInfo& info = layout.params()[p];
      const auto from = static_cast<std::size_t>(begin * static_cast<double>(info.numel));
      const auto to = static_cast<std::size_t>(end * static_cast<double>(info.numel));
      for (std::size_t i = from; i < to; ++i)
        host[info.offset + i] = from_float<G>(to_float(host[info.offset + i]) +
                                              to_float(gradient_value<G>(spec, rank, p, i, step, micro, scale)));
    }
    Ops::upload(g, host.data(), unit.padded);
  };
  acquire(units.front());  // the tied weight's first use in backward (a language model's output layer)
  add(units.front(), 0.0, 0.5);
  opt.release_unit(units.front());
  for (std::size_t k = units.size(); k-- > 1;) {
    acquire(units[k]);
    add(units[k], 0.0, 0.5);
    add(units[k], 0.5, 1.0);
    opt.grad_ready(units[k]);
    opt.release_unit(units[k]);
  }
  acquire(units.front());  // its use as the input embedding; step() makes it final
  add(units.front(), 0.5, 1.0);
  opt.release_unit(units.front());
}

// Drives one rank of a ZeroOptimizer through `spec.steps` optimizer steps,
// exactly as a trainer would. Gradients are made on the host and uploaded
// through the optimizer's backend (a copy on Host, host-to-device on CUDA).
template <class Opt, class Comm>
RunResult train(Comm& comm, const typename Opt::Hyper& hyper, const Options& options, const TrainSpec& spec) {
  using G = typename Opt::grad_type;
  using Ops = backend::Ops<typename Opt::backend_policy>;
  Opt opt(comm, hyper, options);
  const auto& model = test_model();
  std::vector<UnitId> units;
  std::vector<std::string> unit_names;
  std::vector<ParamId> ids;
  for (const auto& p : model) {
    if (unit_names.empty() || unit_names.back() != p.unit) {
      units.push_back(opt.add_unit(p.unit));
      unit_names.push_back(p.unit);
    }
    ids.push_back(opt.add_param(units.back(), p.name, p.numel));
  }
  opt.finalize();
  for (std::size_t p = 0; p < model.size(); ++p) {
    std::vector<float> v(model[p].numel);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = init_value(p, i);
    opt.set_param(ids[p], v.data());
  }
  const Layout& layout = opt.layout();
  using P = typename Opt::param_type;
  std::vector<P> expected, seen;
  auto snapshot = [&] {
    if (!spec.check_acquired) return;
    expected.resize(layout.padded_total());
    opt.gather_params(expected.data());
  };
  auto acquire = [&](UnitId u, const char* pass, int step) {
    const P* got = opt.acquire_unit(u);
    if (!spec.check_acquired) return;
    const UnitInfo& info = layout.unit(u);
    seen.resize(info.padded);
    Ops::download(seen.data(), got, info.padded);
    if (std::memcmp(seen.data(), expected.data() + info.full_offset, info.padded * sizeof(P)) != 0)
      throw std::runtime_error(zero::detail::concat("rank ", comm.rank(), ", step ", step, ", ", pass, ": acquire_unit('",
                                              info.name, "') returned parameters other than the gathered ones"));
  };
  snapshot();
  RunResult result;
  opt.reset_comm_counters();
  for (int step = 1; step <= spec.steps; ++step) {
    for (int micro = 0; micro < options.grad_accumulation_steps; ++micro) {
      for (const UnitId u : units) {  // forward
        acquire(u, "forward", step);
        opt.release_unit(u);
      }
      if (spec.adds_into_gradients) {
        backward_adding(opt, comm.rank(), units, spec, step, micro, [&](UnitId u) { acquire(u, "backward", step); });
        const StepResult r = opt.step();
        if (micro == options.grad_accumulation_steps - 1) result.steps.push_back(r);
        if (r.stepped) snapshot();
        continue;
      }
      for (auto it = units.rbegin(); it != units.rend(); ++it) {  // backward
        acquire(*it, "backward", step);
        G* g = opt.grad_buffer(*it);
        const float scale = static_cast<float>(opt.loss_scale());
        const UnitInfo& unit = layout.unit(*it);
        std::vector<G> host(unit.padded, from_float<G>(0.0f));
        for (std::size_t p : unit.params) {
          const ParamInfo& info = layout.params()[p];
          for (std::size_t i = 0; i < info.numel; ++i)
            host[info.offset + i] = gradient_value<G>(spec, comm.rank(), p, i, step, micro, scale);
        }
        if (spec.tamper) spec.tamper(comm.rank(), step, micro, it->index, host.data());
        Ops::upload(g, host.data(), host.size());
        opt.grad_ready(*it);
        opt.release_unit(*it);
      }
      const StepResult r = opt.step();
      if (micro == options.grad_accumulation_steps - 1) result.steps.push_back(r);
      if (r.stepped) snapshot();
    }
  }
  result.comm = opt.comm_report();
  result.memory = opt.memory_report();
  std::vector<float> masters(layout.padded_total());
  std::vector<typename Opt::param_type> low(layout.padded_total());
  opt.gather_masters(masters.data());
  opt.gather_params(low.data());
  for (const auto& info : layout.params()) {
    const std::size_t start = layout.unit(info.unit).full_offset + info.offset;
    for (std::size_t i = 0; i < info.numel; ++i) {
      result.masters.push_back(masters[start + i]);
      result.params.push_back(to_float(low[start + i]));
    }
  }
  return result;
}

}  // namespace zero::test
