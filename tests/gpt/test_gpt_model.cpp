// The GPT example's forward and backward (examples/gpt/gpt_model.hpp) held to
// PyTorch 1.13: tests/gpt/make_gpt_fixture.py runs the same tiny model in
// float64 on one batch and stores the logits, the loss and every parameter's
// gradient. Weights and tokens come from a formula both sides compute.
// Tolerance and error measure: tests/gpt/gpt_fixture.hpp.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gpt/gpt_flops.hpp"
#include "gpt/gpt_host.hpp"
#include "gpt_fixture.hpp"
#include "gpt/gpt_zero.hpp"
#include "gpt/text_corpus.hpp"
#include "zero/zero.hpp"

#ifndef ZERO_GPT_FIXTURE
#error "define ZERO_GPT_FIXTURE as the path of tests/gpt/gpt_fixture.bin"
#endif

namespace {

using gpt::fixture::Fixture;
using gpt::fixture::FormulaWeights;
using gpt::fixture::kTolerance;
using gpt::fixture::relative_error;

const Fixture& fixture() {
  static const Fixture fx = gpt::fixture::load(ZERO_GPT_FIXTURE);
  return fx;
}

// The model with every unit resident in packed host buffers.
struct HostRun {
  gpt::Gpt model;
  std::vector<std::vector<float>> params, grads;

  HostRun(const Fixture& fx, int batch, bool checkpoint) : HostRun(fx.config, batch, checkpoint) {}
  HostRun(const gpt::Config& config, int batch, bool checkpoint) : model(config, batch, checkpoint) {
    const FormulaWeights weights{config};
    for (int u = 0; u < model.num_units(); ++u) {
      const gpt::UnitSpec& spec = model.units()[static_cast<std::size_t>(u)];
      params.emplace_back(spec.numel);
      grads.emplace_back(spec.numel, NAN);
      for (std::size_t k = 0; k < spec.params.size(); ++k)
        weights(u, static_cast<int>(k), params.back().data() + spec.offsets[k]);
    }
  }
  gpt::ParamHooks param_hooks() {
    return {[this](int u) -> const float* { return params[static_cast<std::size_t>(u)].data(); }, {}};
  }
  gpt::GradHooks grad_hooks() {
    return {[this](int u) { return grads[static_cast<std::size_t>(u)].data(); }, {}};
  }
  const float* grad(int u, int k) const {
    return grads[static_cast<std::size_t>(u)].data() + model.units()[static_cast<std::size_t>(u)].offsets[static_cast<std::size_t>(k)];
  }
};

// Every parameter's gradient against the fixture; got(u, k) points at ours.
template <class Got>
void check_gradients(const Fixture& fx, Got&& got) {
  const auto units = gpt::describe_units(fx.config);
  for (std::size_t u = 0; u < units.size(); ++u)
    for (std::size_t k = 0; k < units[u].params.size(); ++k) {
      const std::vector<float>& want = fx.grads[u][k];
      const double err = relative_error(got(static_cast<int>(u), static_cast<int>(k)), want.data(), want.size());
      INFO("gradient of " << units[u].params[k].name << ": relative error " << err);
      CHECK(err <= kTolerance);
    }
}

}  // namespace

TEST_CASE("GPT forward matches PyTorch: logits and loss", "[gpt][model]") {
  const Fixture& fx = fixture();
  for (bool checkpoint : {false, true}) {
    INFO("checkpoint activations " << checkpoint);
    HostRun run(fx, fx.batch, checkpoint);
    const float loss = run.model.loss(fx.tokens.data(), fx.targets.data(), fx.batch, run.param_hooks());
    CHECK(std::fabs(loss - fx.loss) <= kTolerance * std::fabs(fx.loss));
    const double err = relative_error(run.model.logits(), fx.logits.data(), fx.logits.size());
    INFO("logits: relative error " << err);
    CHECK(err <= kTolerance);
  }
}

TEST_CASE("GPT backward matches PyTorch: every parameter's gradient", "[gpt][model]") {
  const Fixture& fx = fixture();
  const std::size_t tokens = fx.tokens.size();
  std::vector<std::vector<float>> plain;
  for (bool checkpoint : {false, true}) {
    INFO("checkpoint activations " << checkpoint);
    HostRun run(fx, fx.batch, checkpoint);
    const float loss = run.model.forward_backward(fx.tokens.data(), fx.targets.data(), fx.batch, run.param_hooks(),
                                                  run.grad_hooks(), 1.0f / static_cast<float>(tokens));
    CHECK(std::fabs(loss - fx.loss) <= kTolerance * std::fabs(fx.loss));
    check_gradients(fx, [&](int u, int k) { return run.grad(u, k); });
    // Recomputing a block repeats the same arithmetic: the same bits.
    if (!checkpoint)
      plain = run.grads;
    else
      for (std::size_t u = 0; u < plain.size(); ++u)
        CHECK(std::memcmp(plain[u].data(), run.grads[u].data(), plain[u].size() * sizeof(float)) == 0);
  }
}

TEST_CASE("GPT staged tokens: one copy for several micro-batches, the loss summed until read", "[gpt][model]") {
  const Fixture& fx = fixture();
  REQUIRE(fx.batch == 2);
  const std::size_t T = static_cast<std::size_t>(fx.config.context);
  // Each sequence alone through the host-pointer pass (which reads its loss)...
  HostRun one(fx, 1, false);
  double want = 0.0;
  std::vector<std::vector<float>> want_grads;
  for (std::size_t s = 0; s < 2; ++s) {
    want += static_cast<double>(one.model.forward_backward(fx.tokens.data() + s * T, fx.targets.data() + s * T, 1,
                                                            one.param_hooks(), one.grad_hooks(), 1.0f)) *
            static_cast<double>(T);
    if (s == 1) want_grads = one.grads;
  }
  // ...and both staged at once, run as two micro-batches, the loss read once.
  HostRun staged(fx, 1, false);
  const auto tokens = staged.model.stage(fx.tokens.data(), fx.targets.data(), 2);
  staged.model.forward_backward(tokens.at(0), 1, staged.param_hooks(), staged.grad_hooks(), 1.0f);
  staged.model.forward_backward(tokens.at(1), 1, staged.param_hooks(), staged.grad_hooks(), 1.0f);
  CHECK_THROWS_WITH(staged.model.loss(fx.tokens.data(), fx.targets.data(), 1, staged.param_hooks()),
                    Catch::Contains("call take_loss_sum() first"));
  const auto taken = staged.model.take_loss_sum();
  CHECK(taken.tokens == 2 * T);
  CHECK(std::fabs(taken.sum - want) <= 1e-6 * std::fabs(want));
  CHECK(staged.model.take_loss_sum().tokens == 0);  // read: the total starts again
  for (std::size_t u = 0; u < want_grads.size(); ++u)  // the second micro-batch's gradients, bit for bit
    CHECK(std::memcmp(want_grads[u].data(), staged.grads[u].data(), want_grads[u].size() * sizeof(float)) == 0);
  // Ids are checked on the host before they are staged.
  std::vector<std::uint8_t> bad(fx.tokens.begin(), fx.tokens.begin() + static_cast<std::ptrdiff_t>(T));
  bad[3] = static_cast<std::uint8_t>(fx.config.vocab);
  CHECK_THROWS_WITH(staged.model.stage(bad.data(), nullptr, 1), Catch::Contains("not below the vocabulary size"));
}

TEST_CASE("GPT FLOPs per token and MFU (gpt_flops.hpp)", "[gpt][flops]") {
  // 6 N + 12 L C T, N = V C (tied head) + L (12 C^2 + 13 C) + 2 C (ln_f): a
  // block holds 4C^2 (qkv, proj) + 8C^2 (MLP) weights, 3C + C + 4C + C biases
  // and 4C LayerNorm parameters; the position embeddings are not counted.
  for (const gpt::Config c : {gpt::Config{85, 128, 128, 4, 4}, gpt::Config{65, 256, 384, 6, 6}}) {
    const double V = c.vocab, C = c.width, L = c.layers, T = c.context;
    const double n = V * C + L * (12 * C * C + 13 * C) + 2 * C;
    CHECK(gpt::flops_per_token(c) == 6 * n + 12 * L * C * T);
  }
  CHECK(gpt::flops_per_token(gpt::Config{85, 128, 128, 4, 4}) == 5611776.0);  // by hand: 6 x 804224 + 786432
  // The table: the most specific row first (an H100 PCIe is not an SXM).
  CHECK(gpt::peak_throughput("NVIDIA H200", 132, 1.98, 9, 0).fp32_tflops == 66.9);
  CHECK(gpt::peak_throughput("NVIDIA H200", 132, 1.98, 9, 0).bf16_tensor_tflops == 989.4);
  CHECK(gpt::peak_throughput("NVIDIA H100 PCIe", 114, 1.755, 9, 0).fp32_tflops == 51.2);
  CHECK(gpt::peak_throughput("NVIDIA H100 80GB HBM3", 132, 1.98, 9, 0).fp32_tflops == 66.9);
  CHECK(gpt::peak_throughput("NVIDIA A100-SXM4-80GB", 108, 1.41, 8, 0).bf16_tensor_tflops == 312.0);
  // Not in the table: SMs x clock x the architecture's lanes (Hopper: 128 fp32 FMAs per SM and clock).
  const gpt::PeakThroughput guess = gpt::peak_throughput("Some Hopper", 100, 2.0, 9, 0);
  CHECK(std::fabs(guess.fp32_tflops - 100 * 2.0e9 * 128 * 2 / 1e12) < 1e-9);
  CHECK(guess.source.find("estimated") != std::string::npos);
  CHECK(gpt::peak_throughput("Some Turing", 40, 1.5, 7, 5).fp32_tflops == 0.0);
  CHECK(std::fabs(gpt::mfu(1e6, 5e6, 50.0) - 0.1) < 1e-12);  // 5e12 FLOP/s of 50 TFLOPS
  CHECK(gpt::mfu(1e6, 5e6, 0.0) == 0.0);
}

// The host cuts large products into tiles by shape and sums gradients over
// rows in order (gpt_host.hpp): the threads change the speed, not the bits.
// The model is large enough for its products to be cut (the fixture's is not).
TEST_CASE("GPT on the host: the same bits on 1, 2 and 3 threads", "[gpt][model]") {
  const gpt::Config config{85, 64, 64, 2, 2};
  const int batch = 8;
  std::vector<std::uint8_t> tokens(static_cast<std::size_t>(batch) * config.context), targets(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<std::uint8_t>((i * 37 + i / 7) % 85);
    targets[i] = static_cast<std::uint8_t>((i * 11 + 3) % 85);
  }
  std::vector<std::vector<float>> one_thread;
  float one_thread_loss = 0.0f;
  for (int threads : {1, 2, 3}) {
    INFO(threads << " threads");
    const zero::simd::ScopedHostThreads scope(threads);
    HostRun run(config, batch, false);
    const float loss = run.model.forward_backward(tokens.data(), targets.data(), batch, run.param_hooks(),
                                                  run.grad_hooks(), 1.0f / static_cast<float>(tokens.size()));
    if (threads == 1) {
      one_thread = run.grads;
      one_thread_loss = loss;
      continue;
    }
    CHECK(std::fabs(loss - one_thread_loss) <= 1e-6f * one_thread_loss);  // a double sum over the threads' rows
    for (std::size_t u = 0; u < one_thread.size(); ++u) {
      INFO("unit " << run.model.units()[u].name);
      CHECK(std::memcmp(one_thread[u].data(), run.grads[u].data(), one_thread[u].size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("GPT activation checkpointing keeps block inputs only", "[gpt][model]") {
  const gpt::Config config{85, 128, 128, 4, 4};
  const int batch = 8;
  const gpt::ActivationBytes full = gpt::Gpt::plan_activation_bytes(config, batch, false);
  const gpt::ActivationBytes ckpt = gpt::Gpt::plan_activation_bytes(config, batch, true);
  const gpt::Gpt model(config, batch, true);
  CHECK(model.activation_bytes().total() == ckpt.total());  // the plan is what the arena holds
  // Saved: L + 1 residual inputs and one block's set instead of L sets.
  const std::size_t N = static_cast<std::size_t>(batch) * 128, C = 128;
  const std::size_t block = 4 * (N * C * 4 + N * 4 + N * 3 * C + static_cast<std::size_t>(batch) * 4 * 128 * 128 +
                                 N * 8 * C);
  CHECK(full.saved - ckpt.saved == 3 * block);
  CHECK(full.scratch == ckpt.scratch);
}

TEST_CASE("GPT corpus: vocabulary, split and unigram entropy", "[gpt][data]") {
  const gpt::TextCorpus c = gpt::make_corpus("abracadabra!", 0.5);
  CHECK(c.vocab_size() == 6);  // ! a b c d r
  CHECK(c.train_size == 6);
  CHECK(c.decode(c.tokens.data(), c.tokens.size()) == "abracadabra!");
  // a:5 b:2 r:2 c:1 d:1 !:1 of 12
  const double h = -(5.0 / 12 * std::log(5.0 / 12) + 2 * (2.0 / 12 * std::log(2.0 / 12)) + 3 * (1.0 / 12 * std::log(1.0 / 12)));
  CHECK(std::fabs(c.unigram_entropy() - h) < 1e-12);
  CHECK_THROWS_WITH(gpt::load_corpus("/nonexistent/devil.dict.dz", 16), Catch::Contains("apt-get install dict-devil"));
}

namespace {

// Through zero::ZeroOptimizer with 2 in-process ranks, each one sequence of
// the fixture's batch. SGD with lr = 2^16 and no momentum makes one step
// w - lr g, so g = (w_before - w_after) / lr recovers the averaged gradient
// (lr large, so |lr g| dominates w and the subtraction keeps g's digits).
template <int Stage>
void check_through_optimizer(bool checkpoint) {
  using Opt = zero::ZeroOptimizer<zero::precision::Full<float>, zero::optim::Sgd, zero::stage<Stage>>;
  const Fixture& fx = fixture();
  REQUIRE(fx.batch == 2);
  constexpr double lr = 65536.0;
  const FormulaWeights weights{fx.config};
  const auto units = gpt::describe_units(fx.config);
  std::vector<std::vector<std::vector<float>>> recovered(units.size());
  std::vector<float> losses(2);
  zero::comm::LocalGroup group(2);
  group.run([&](zero::comm::Local& comm) {
    zero::optim::Sgd::Hyper hyper;
    hyper.lr = lr;
    Opt opt(comm, hyper);
    gpt::Gpt model(fx.config, 1, checkpoint);
    gpt::ZeroBinding<Opt, gpt::Gpt> binding(opt, model);
    opt.finalize();
    binding.adopt_layout();
    binding.set_params(weights);
    const std::size_t T = static_cast<std::size_t>(fx.config.context);
    const std::size_t first = static_cast<std::size_t>(comm.rank()) * T;
    losses[static_cast<std::size_t>(comm.rank())] =
        model.forward_backward(fx.tokens.data() + first, fx.targets.data() + first, 1, binding.param_hooks(),
                               binding.grad_hooks(), 1.0f / static_cast<float>(T));
    opt.step();
    for (std::size_t u = 0; u < units.size(); ++u)
      for (std::size_t k = 0; k < units[u].params.size(); ++k) {
        std::vector<float> after = opt.master_values(binding.params()[u][k]);  // collective
        if (comm.rank() != 0) continue;
        std::vector<float> before(after.size());
        weights(static_cast<int>(u), static_cast<int>(k), before.data());
        for (std::size_t i = 0; i < after.size(); ++i)
          after[i] = static_cast<float>((static_cast<double>(before[i]) - after[i]) / lr);
        recovered[u].push_back(std::move(after));
      }
  });
  // The mean over ranks of each rank's mean loss is the batch's mean loss.
  const double loss = (static_cast<double>(losses[0]) + losses[1]) / 2.0;
  CHECK(std::fabs(loss - fx.loss) <= kTolerance * std::fabs(fx.loss));
  check_gradients(fx, [&](int u, int k) { return recovered[static_cast<std::size_t>(u)][static_cast<std::size_t>(k)].data(); });
}

}  // namespace

TEST_CASE("GPT through ZeroOptimizer, 2 ranks: the gradients PyTorch computes", "[gpt][zero]") {
  SECTION("stage 0") { check_through_optimizer<0>(false); }
  SECTION("stage 3") { check_through_optimizer<3>(false); }
  SECTION("stage 3, activation checkpointing") { check_through_optimizer<3>(true); }
}

// The host's linear layers run on blocks of rows, with dW and db summed from
// per-block partials (gpt_host.hpp); the fixture's products are too small to
// be cut. 300 rows x 64 inputs x 256 outputs is past the cut's threshold (4
// blocks of 75 rows): every output against a double-precision reference.
TEST_CASE("GPT on the host: linear layers cut into blocks of rows match double math", "[gpt][model]") {
  const std::size_t N = 300;
  const int I = 64, O = 256;
  auto value = [](std::size_t i, double f) { return static_cast<float>(std::sin(static_cast<double>(i) * f)); };
  std::vector<float> in(N * I), w(static_cast<std::size_t>(O) * I), b(O), residual(N * O), dout(N * O);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = value(i, 0.37);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.2f * value(i, 0.11);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = value(i, 0.7);
  for (std::size_t i = 0; i < residual.size(); ++i) residual[i] = value(i, 0.013);
  for (std::size_t i = 0; i < dout.size(); ++i) dout[i] = value(i, 0.029);
  auto gelu = [](double x) { return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); };
  auto error = [](const std::vector<float>& got, const std::vector<double>& want) {
    return relative_error(got.data(), want.data(), want.size());
  };
  gpt::HostCompute host;

  // Forward: out = in W^T + b + residual, g = gelu(out).
  std::vector<float> out(N * O), g(N * O);
  host.linear_forward(in.data(), w.data(), b.data(), residual.data(), N, I, O, out.data(), g.data());
  std::vector<double> want_out(N * O), want_g(N * O);
  for (std::size_t n = 0; n < N; ++n)
    for (int o = 0; o < O; ++o) {
      double s = static_cast<double>(b[o]) + residual[n * O + o];
      for (int i = 0; i < I; ++i) s += static_cast<double>(in[n * I + i]) * w[static_cast<std::size_t>(o) * I + i];
      want_out[n * O + o] = s;
      want_g[n * O + o] = gelu(static_cast<float>(s));
    }
  CHECK(error(out, want_out) <= kTolerance);
  CHECK(error(g, want_g) <= kTolerance);

  // Backward through a layer whose input is gelu(pre): din = d(loss)/d(pre).
  std::vector<float> pre(N * I);
  for (std::size_t i = 0; i < pre.size(); ++i) pre[i] = 2.0f * value(i, 0.05);
  std::vector<float> dw(w.size()), db(O), din(N * I);
  host.linear_backward(dout.data(), in.data(), w.data(), N, I, O, dw.data(), db.data(), din.data(), pre.data());
  std::vector<double> want_dw(w.size(), 0.0), want_db(O, 0.0), want_din(N * I, 0.0);
  const double h = 1e-4;  // central difference of the double GELU: independent of gpt_ops.hpp's derivative
  for (std::size_t n = 0; n < N; ++n) {
    for (int o = 0; o < O; ++o) {
      want_db[o] += dout[n * O + o];
      for (int i = 0; i < I; ++i) {
        want_dw[static_cast<std::size_t>(o) * I + i] += static_cast<double>(dout[n * O + o]) * in[n * I + i];
        want_din[n * I + i] += static_cast<double>(dout[n * O + o]) * w[static_cast<std::size_t>(o) * I + i];
      }
    }
    for (int i = 0; i < I; ++i) {
      const double x = pre[n * I + i];
      want_din[n * I + i] *= (gelu(x + h) - gelu(x - h)) / (2.0 * h);
    }
  }
  CHECK(error(dw, want_dw) <= kTolerance);
  CHECK(error(db, want_db) <= kTolerance);
  CHECK(error(din, want_din) <= kTolerance);
}
