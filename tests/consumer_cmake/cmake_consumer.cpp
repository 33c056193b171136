// Uses zero the way a CMake project does: find_package(zero) and zero::zero.
// Two ranks train w on the loss 0.5 * c_r * |w|^2 (c_r = rank + 1) with plain
// SGD at stage 3: the gradient averaged over ranks is 1.5 * w, so after k
// steps w = w0 * (1 - 1.5 * lr)^k, computed here in double precision.
#include <cmath>
#include <cstdio>
#include <vector>

#include "zero/zero.hpp"

int main() {
  using Opt = zero::ZeroOptimizer<zero::precision::Full<float>, zero::optim::Sgd, zero::stage<3>,
                                  zero::offload::None, zero::backend::Host>;
  constexpr int kRanks = 2, kSteps = 3;
  constexpr std::size_t kNumel = 1000;  // not a multiple of the shard alignment: padding is exercised
  constexpr double kLr = 0.1;
  std::vector<float> w0(kNumel);
  for (std::size_t i = 0; i < kNumel; ++i) w0[i] = 0.01f * static_cast<float>(i) - 3.0f;

  double worst = 0;  // largest relative error against the closed form (rank 0)
  zero::comm::LocalGroup group(kRanks);
  group.run([&](zero::comm::Local& comm) {
    zero::optim::Sgd::Hyper hyper;
    hyper.lr = kLr;
    Opt opt(comm, hyper);
    const auto unit = opt.add_unit("layer");
    const auto w = opt.add_param(unit, "w", kNumel);
    opt.finalize();
    opt.set_param(w, w0.data());
    const float c = static_cast<float>(comm.rank() + 1);
    for (int step = 0; step < kSteps; ++step) {
      const float* p = opt.acquire_unit(unit) + opt.layout().param(w).offset;
      float* g = opt.grad_buffer(unit) + opt.layout().param(w).offset;
      for (std::size_t i = 0; i < kNumel; ++i) g[i] = c * p[i];
      opt.grad_ready(unit);
      opt.release_unit(unit);
      opt.step();
    }
    const auto values = opt.master_values(w);
    if (comm.rank() != 0) return;
    const double factor = std::pow(1.0 - 1.5 * kLr, kSteps);
    for (std::size_t i = 0; i < kNumel; ++i) {
      const double expected = static_cast<double>(w0[i]) * factor;
      const double error = std::abs(values[i] - expected) / std::max(1e-3, std::abs(expected));
      if (!(error <= worst)) worst = std::isnan(error) ? INFINITY : error;
    }
  });
  const bool ok = worst <= 1e-5;
  std::printf("cmake consumer: %d ranks, stage 3 SGD, %d steps: worst relative error %.2e against "
              "w0 * (1 - 1.5 lr)^k: %s\n", kRanks, kSteps, worst, ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
