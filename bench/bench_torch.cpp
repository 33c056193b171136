// The LibTorch adapter's cost beside LibTorch's own optimizer, measured in
// one run on the same model, data and thread count: a training step of the
// torch::nn GPT (examples/torch_gpt/torch_gpt.hpp) with torch::optim::AdamW,
// and with the library's AdamW through zero::integrations::TorchModule on one
// rank (stage 0; in-process). Forward + backward is the same code in both;
// the figures are the optimizer's part (AdamW::step against TorchModule::step,
// which takes each .grad, steps and zeroes the gradients) and the whole step,
// as medians over the trials, with their ratios. Run with OMP_WAIT_POLICY
// set to compare the OpenMP wait policies (unset, it asks for passive).
//
//   build/bench/bench_torch [--width 256] [--layers 4] [--steps 20] [--trials 5]
#include "zero/integrations/torch.hpp"

#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/openmp_waits.hpp"
#include "torch_gpt/torch_gpt.hpp"
#include "zero/comm/local.hpp"
#include "zero/runtime/make_optimizer.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Times {
  double forward_backward = 0, optimizer = 0;  // seconds per step
};

int arg(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  // Passive OpenMP waits, as the trainers ask: LibTorch's and the library's
  // loops run in OpenMP teams of different threads (the caller's, the
  // optimizer's update thread), and threads spinning in one team take the
  // cores the other needs (the whole step measured 1.6x slower without).
  zero::examples::use_passive_openmp_waits(argv);
  torch_gpt::GptShape shape{.vocab = 85, .context = 64, .width = arg(argc, argv, "--width", 256), .heads = 4,
                            .layers = arg(argc, argv, "--layers", 4)};
  const int steps = arg(argc, argv, "--steps", 20), trials = arg(argc, argv, "--trials", 5), batch = 8;
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  torch::manual_seed(1);
  const auto idx = torch::randint(shape.vocab, {batch, shape.context}, torch::kLong);
  const auto targets = torch::randint(shape.vocab, {batch, shape.context}, torch::kLong);

  // One trial of `steps` steps; `step` runs the optimizer's part.
  auto measure = [&](torch_gpt::Gpt& model, auto&& step) {
    Times t;
    for (int k = 0; k < steps; ++k) {
      const auto t0 = Clock::now();
      model->loss(idx, targets).backward();
      t.forward_backward += seconds_since(t0);
      const auto t1 = Clock::now();
      step();
      t.optimizer += seconds_since(t1);
    }
    t.forward_backward /= steps;
    t.optimizer /= steps;
    return t;
  };

  std::vector<double> torch_opt, zero_opt, torch_all, zero_all;
  std::int64_t parameters = 0;
  for (int trial = 0; trial < trials; ++trial) {
    {
      torch::manual_seed(7);
      torch_gpt::Gpt model(shape);
      parameters = 0;
      for (const auto& p : model->parameters()) parameters += p.numel();
      torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
      const Times t = measure(model, [&] {
        adamw.step();
        adamw.zero_grad();
      });
      torch_opt.push_back(t.optimizer);
      torch_all.push_back(t.forward_backward + t.optimizer);
    }
    {
      torch::manual_seed(7);
      torch_gpt::Gpt model(shape);
      zero::comm::LocalGroup group(1, {.threads_per_rank = threads});
      group.run([&](zero::comm::Local& comm) {
        at::set_num_threads(threads);
        zero::Config config;
        config.precision = zero::PrecisionChoice::fp32;
        config.stage = 0;
        config.hyper = {{"lr", 1e-3}, {"weight_decay", 0.1}};
        config.options.grad_writes = zero::GradWrites::accumulate;
        auto opt = zero::make_optimizer<zero::backend::Host>(comm, config);
        zero::integrations::TorchModule zt(*opt, *model);
        const Times t = measure(model, [&] { zt.step(); });
        zero_opt.push_back(t.optimizer);
        zero_all.push_back(t.forward_backward + t.optimizer);
      });
    }
  }
  const double to = median(torch_opt), zo = median(zero_opt), ta = median(torch_all), za = median(zero_all);
  std::printf("GPT %d layers, width %d, context %d, batch %d: %lld parameters; %d threads; %d steps x %d trials "
              "(medians)\n",
              shape.layers, shape.width, shape.context, batch, static_cast<long long>(parameters), threads, steps,
              trials);
  std::printf("optimizer part:  torch::optim::AdamW %.3f ms, zero (TorchModule::step) %.3f ms: %.2fx faster\n",
              to * 1e3, zo * 1e3, to / zo);
  std::printf("whole step:      torch::optim::AdamW %.3f ms, zero %.3f ms: %.2fx faster\n", ta * 1e3, za * 1e3,
              ta / za);
  return 0;
}
