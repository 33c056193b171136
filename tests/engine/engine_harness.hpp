// Shared by the engine tests: a training loop that drives ZeroOptimizer
// exactly as a trainer would, and comparisons (Catch2). The model, the
// gradient generator and the single-process reference they are held to live
// in reference.hpp, which has no test framework.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "reference.hpp"
#include "zero/zero.hpp"

namespace zero::test {

struct TrainSpec {
  int steps = 5;
  int parts = 1;  // parts of the global batch (the N of the run being compared)
  // -1: this rank's own part (an N-rank run); else a single rank summing all parts.
  bool sum_all_parts = false;
  // Called before each grad_ready with (rank, step, micro, unit index, grad
  // buffer); lets a test inject an inf.
  std::function<void(int, int, int, std::size_t, void*)> tamper;
};

// Drives one rank of a ZeroOptimizer through `spec.steps` optimizer steps.
template <class Opt, class Comm>
RunResult train(Comm& comm, const typename Opt::Hyper& hyper, const Options& options, const TrainSpec& spec) {
  using G = typename Opt::grad_type;
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
  RunResult result;
  opt.reset_comm_counters();
  for (int step = 1; step <= spec.steps; ++step) {
    for (int micro = 0; micro < options.grad_accumulation_steps; ++micro) {
      for (const UnitId u : units) {  // forward
        opt.acquire_unit(u);
        opt.release_unit(u);
      }
      for (auto it = units.rbegin(); it != units.rend(); ++it) {  // backward
        opt.acquire_unit(*it);
        G* g = opt.grad_buffer(*it);
        const float scale = static_cast<float>(opt.loss_scale());
        for (std::size_t p : layout.unit(*it).params) {
          const ParamInfo& info = layout.params()[p];
          for (std::size_t i = 0; i < info.numel; ++i) {
            float v = 0;
            if (spec.sum_all_parts)
              for (int part = 0; part < spec.parts; ++part) v += grad_part(part, p, i, step, micro);
            else
              v = grad_part(comm.rank(), p, i, step, micro);
            g[info.offset + i] = from_float<G>(v * scale);
          }
        }
        if (spec.tamper) spec.tamper(comm.rank(), step, micro, it->index, g);
        opt.grad_ready(*it);
        opt.release_unit(*it);
      }
      const StepResult r = opt.step();
      if (micro == options.grad_accumulation_steps - 1) result.steps.push_back(r);
    }
  }
  result.comm = opt.comm_report();
  result.memory = opt.memory_report();
  std::vector<float> masters(layout.padded_total());
  std::vector<typename Opt::param_type> low(layout.padded_total());
  opt.gather_masters(masters.data());
  opt.gather_params(low.data());
  for (const auto& info : layout.params()) {
    const std::size_t start = layout.units()[info.unit].full_offset + info.offset;
    for (std::size_t i = 0; i < info.numel; ++i) {
      result.masters.push_back(masters[start + i]);
      result.params.push_back(to_float(low[start + i]));
    }
  }
  return result;
}

// Runs `ranks` in-process ranks; returns rank 0's result (all ranks are
// checked to agree with it bit for bit).
template <class Opt>
RunResult train_local(int ranks, const typename Opt::Hyper& hyper, const Options& options, TrainSpec spec) {
  std::vector<RunResult> results(static_cast<std::size_t>(ranks));
  comm::LocalGroup group(ranks);
  group.run([&](comm::Local& c) { results[static_cast<std::size_t>(c.rank())] = train<Opt>(c, hyper, options, spec); });
  for (int r = 1; r < ranks; ++r) {
    REQUIRE(results[r].masters == results[0].masters);
    REQUIRE(std::memcmp(results[r].params.data(), results[0].params.data(), results[0].params.size() * 4) == 0);
  }
  return results[0];
}

// The equivalence criterion of the ZeRO design: masters within 1e-5
// relative, low-precision copies at most one unit in the last place apart.
template <class ParamT>
inline void require_equivalent(const RunResult& got, const RunResult& want) {
  REQUIRE(got.masters.size() == want.masters.size());
  double worst = 0;
  std::int64_t worst_ulp = 0;
  for (std::size_t i = 0; i < got.masters.size(); ++i) {
    const double scale = std::max(std::fabs(static_cast<double>(want.masters[i])), 0.1);
    worst = std::max(worst, std::fabs(static_cast<double>(got.masters[i]) - want.masters[i]) / scale);
    worst_ulp = std::max(worst_ulp, ulp_distance<ParamT>(got.params[i], want.params[i]));
  }
  CHECK(worst <= 1e-5);
  CHECK(worst_ulp <= 1);
}

}  // namespace zero::test
