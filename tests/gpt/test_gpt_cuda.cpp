// The GPT example on the GPU (GptModel<CudaCompute>, examples/gpt/gpt_cuda.hpp)
// held to the same PyTorch fixture as the host model (test_gpt_model.cpp):
// logits, loss and every parameter's gradient within 1e-5 relative (as
// gpt_fixture.hpp defines it), with and without activation checkpointing.
// Its own harness (tests/cuda/check_harness.hpp): GPU machines have no
// Catch2. Exits 77 (skip) without a CUDA device; CI only compiles it.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "../cuda/check_harness.hpp"
#include "gpt/gpt_cuda.hpp"
#include "gpt_fixture.hpp"

#ifndef ZERO_GPT_FIXTURE
#error "define ZERO_GPT_FIXTURE as the path of tests/gpt/gpt_fixture.bin"
#endif

namespace {

using gpt::fixture::kTolerance;
using gpt::fixture::relative_error;

void check_on_device(const gpt::fixture::Fixture& fx, bool checkpoint) {
  const int passed = zero::test::g_passed, failed = zero::test::g_failed;
  gpt::CudaGpt model(fx.config, fx.batch, checkpoint);
  gpt::CudaCompute& dev = model.compute();
  const gpt::fixture::FormulaWeights weights{fx.config};
  std::vector<gpt::DeviceArray<float>> params, grads;
  for (int u = 0; u < model.num_units(); ++u) {
    const gpt::UnitSpec& spec = model.units()[static_cast<std::size_t>(u)];
    std::vector<float> host(spec.numel, 0.0f);
    for (std::size_t k = 0; k < spec.params.size(); ++k) weights(u, static_cast<int>(k), host.data() + spec.offsets[k]);
    params.emplace_back(spec.numel);
    grads.emplace_back(spec.numel);
    // On the thread's zero stream, after the zero-fill that DeviceArray's
    // constructor enqueued there: a plain cudaMemcpy runs on the legacy
    // default stream, which does not wait for that non-blocking stream, so
    // the fill could land after the weights and zero them.
    zero::backend::Ops<zero::backend::Cuda>::upload(params.back().data(), host.data(), spec.numel);
  }
  const gpt::ParamHooks param_hooks{[&](int u) -> const float* { return params[static_cast<std::size_t>(u)].data(); },
                                    {}};
  const gpt::GradHooks grad_hooks{[&](int u) { return grads[static_cast<std::size_t>(u)].data(); }, {}};

  const float loss = model.loss(fx.tokens.data(), fx.targets.data(), fx.batch, param_hooks);
  CHECK(std::fabs(loss - fx.loss) <= kTolerance * std::fabs(fx.loss), zero::test::fmt("loss %.9g, torch %.9g", loss, fx.loss));
  std::vector<float> logits(fx.logits.size());
  dev.download(logits.data(), model.logits(), logits.size());
  const double logit_error = relative_error(logits.data(), fx.logits.data(), logits.size());
  CHECK(logit_error <= kTolerance, zero::test::fmt("logits: relative error %.3g", logit_error));

  const float loss2 = model.forward_backward(fx.tokens.data(), fx.targets.data(), fx.batch, param_hooks, grad_hooks,
                                             1.0f / static_cast<float>(fx.tokens.size()));
  CHECK(std::fabs(loss2 - fx.loss) <= kTolerance * std::fabs(fx.loss), zero::test::fmt("loss %.9g", loss2));
  for (int u = 0; u < model.num_units(); ++u) {
    const gpt::UnitSpec& spec = model.units()[static_cast<std::size_t>(u)];
    std::vector<float> host(spec.numel);
    dev.download(host.data(), grads[static_cast<std::size_t>(u)].data(), spec.numel);
    for (std::size_t k = 0; k < spec.params.size(); ++k) {
      const std::vector<float>& want = fx.grads[static_cast<std::size_t>(u)][k];
      const double err = relative_error(host.data() + spec.offsets[k], want.data(), want.size());
      CHECK(err <= kTolerance, zero::test::fmt("gradient of %s: relative error %.3g", spec.params[k].name.c_str(), err));
    }
  }
  zero::test::section(checkpoint ? "GPT on CUDA vs PyTorch, checkpointing" : "GPT on CUDA vs PyTorch", passed, failed);
}

}  // namespace

int main(int argc, char** argv) {
  zero::test::TestArgs args;
  if (!zero::test::parse_test_args(argc, argv, {"model"}, false, args)) return 2;
  if (zero::test::no_cuda_device()) return 77;
  try {
    const gpt::fixture::Fixture fx = gpt::fixture::load(ZERO_GPT_FIXTURE);
    check_on_device(fx, false);
    check_on_device(fx, true);
  } catch (const std::exception& e) {
    CHECK(false, std::string("uncaught exception: ") + e.what());
  }
  std::printf("%d passed, %d failed\n", zero::test::g_passed, zero::test::g_failed);
  return zero::test::g_failed == 0 ? 0 : 1;
}
