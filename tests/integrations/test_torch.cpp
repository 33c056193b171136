// The LibTorch adapter (zero/integrations/torch.hpp) against LibTorch itself
// and against the stage formulas, on the torch::nn GPT of the example
// (examples/torch_gpt/torch_gpt.hpp), with comm::Local ranks:
//   - one rank, stage 0: the parameters after 10 steps against
//     torch::optim::AdamW's on the same model and data (bit for bit with
//     --bitwise, which meson runs under ATEN_CPU_CAPABILITY=default);
//   - 2 and 4 ranks: stages 1-3 train to stage 0's losses and parameters
//     (fp32 reduction rounding), and stage 0 to one rank on the whole batch;
//   - memory per rank: the report's model states against the formulas of
//     docs/zero-math.md (fp32, AdamW: 4+4+8 bytes per element, the
//     partitioned lines divided by the ranks), stage 3 under 0.6 of stage 0;
//   - the adapter over a ZeroOptimizer type trains as over make_optimizer's;
//   - a bf16 module with precision bf16: stages agree, it learns, memory
//     follows the mixed-precision formulas;
//   - two accumulated micro-batches train as one of both (stages 0, 3);
//   - a frozen parameter stays the module's and unchanged, the rest trains
//     as torch::optim::AdamW trains it (stage 3);
//   - the tutorial's pattern (a model whose forward takes the adapter's
//     call, made before the adapter) with SGD and momentum at stage 3, one
//     rank: torch::optim::SGD's parameters (bit for bit with --bitwise);
//   - misuse: a 16-bit precision, the overwrite gradient contract, a .grad
//     replaced (zero_grad), a stage-3 forward outside run(): each refused
//     with its fix;
//   - the module changing under the adapter, each refused with its fix
//     before the optimizer touches memory the module may have freed:
//     zero_grad(true) before a backward through zt.run (which used to read
//     and zero the freed .grad: heap-use-after-free under AddressSanitizer),
//     a parameter's storage replaced (set_data, as torch::load does; at
//     stage 3 the gather wrote into the freed storage), a second step()
//     without a backward, a parameter registered or unfrozen after the
//     adapter was made; LibTorch 1.13's zero_grad() (in place) still
//     accepted.
// A plain program (LibTorch's headers need g++ in C++20: tests/integrations/
// meson.build; under -Dtest_sanitizers with address, g++'s AddressSanitizer);
// exit 1 on the first failed check.
// First: the adapter's header stands alone.
#include "zero/integrations/torch.hpp"

#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "torch_gpt/torch_gpt.hpp"
#include "zero/comm/local.hpp"
#include "zero/runtime/make_optimizer.hpp"
#include "zero/zero.hpp"

namespace {

int failures = 0;

#define EXPECT(cond, ...)                                               \
  do {                                                                 \
    if (!(cond)) {                                                     \
      std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);      \
      std::printf(__VA_ARGS__);                                        \
      std::printf("\n");                                               \
      ++failures;                                                      \
    }                                                                  \
  } while (0)

using torch_gpt::Gpt;
using torch_gpt::GptShape;
using Adapter = zero::integrations::TorchModule<zero::AnyOptimizer>;

const GptShape kShape{.vocab = 23, .context = 12, .width = 32, .heads = 2, .layers = 2};
constexpr int kGlobalBatch = 8;
constexpr double kLr = 3e-3, kWeightDecay = 0.1;

// The global batch of step k: token windows and their next tokens, from a
// text with structure to learn (each token mostly follows from the one
// before: t' = 3t + 1 mod vocab, one in four replaced at random), the same
// on every rank and stage.
struct Batch {
  torch::Tensor idx, targets;
  // Part `k` of `parts` equal parts (rank k's slice, or micro-batch k).
  Batch part(int k, int parts) const {
    const int size = kGlobalBatch / parts;
    return {idx.slice(0, k * size, (k + 1) * size), targets.slice(0, k * size, (k + 1) * size)};
  }
};
Batch batch_of(int step) {
  torch::Generator gen = at::detail::createCPUGenerator(1000 + step);
  auto text = torch::empty({kGlobalBatch, kShape.context + 1}, torch::kLong);
  const auto noise = torch::randint(kShape.vocab, {kGlobalBatch, kShape.context + 1}, gen, torch::kLong);
  const auto coin = torch::randint(4, {kGlobalBatch, kShape.context + 1}, gen, torch::kLong);
  auto t = text.accessor<std::int64_t, 2>();
  const auto n = noise.accessor<std::int64_t, 2>();
  const auto c = coin.accessor<std::int64_t, 2>();
  for (int b = 0; b < kGlobalBatch; ++b) {
    t[b][0] = n[b][0];
    for (int i = 1; i <= kShape.context; ++i) t[b][i] = c[b][i] == 0 ? n[b][i] : (3 * t[b][i - 1] + 1) % kShape.vocab;
  }
  return {text.slice(1, 0, kShape.context).contiguous(), text.slice(1, 1, kShape.context + 1).contiguous()};
}

Gpt make_model() {
  torch::manual_seed(7);
  return Gpt(kShape);
}

zero::Config config_of(int stage, bool release_pages = false,
                       zero::PrecisionChoice precision = zero::PrecisionChoice::fp32) {
  zero::Config c;
  c.options.release_memory_pages = release_pages;
  c.precision = precision;
  c.optimizer = "adamw";
  c.stage = stage;
  c.hyper = {{"lr", kLr}, {"weight_decay", kWeightDecay}};
  c.options.grad_writes = zero::GradWrites::accumulate;
  return c;
}

// The adapter's call: each unit through run(), so stage 3 gathers it.
template <class Optimizer>
torch_gpt::UnitCall unit_call(zero::integrations::TorchModule<Optimizer>& zt) {
  return [&zt](const std::string& unit, torch::Tensor x, const torch_gpt::UnitFn& f, bool reads) {
    return zt.run(unit, std::move(x), f, reads);
  };
}

struct Run {
  std::vector<double> losses;      // mean over ranks, per step
  std::vector<float> masters;      // every parameter after the last step (gathered)
  zero::MemoryReport memory;       // rank 0's
  std::size_t units = 0, params = 0;
};

// `ranks` ranks at `stage`, `steps` steps: rank r trains on its slice of each
// global batch.
Run train(int ranks, int stage, int steps, bool release_pages = false,
          zero::PrecisionChoice precision = zero::PrecisionChoice::fp32) {
  std::vector<Gpt> models;
  for (int r = 0; r < ranks; ++r) {
    models.push_back(make_model());  // the same values on every rank
    if (precision == zero::PrecisionChoice::bf16) models.back()->to(torch::kBFloat16);
  }
  Run out;
  zero::comm::LocalGroup group(ranks);
  group.run([&](zero::comm::Local& comm) {
    at::set_num_threads(1);
    const int r = comm.rank();
    auto opt = zero::make_optimizer<zero::backend::Host>(comm, config_of(stage, release_pages, precision));
    Adapter zt(*opt, *models[static_cast<std::size_t>(r)]);
    // Stages 0-2: each parameter tensor is a view of the optimizer's
    // resident parameters (no copy, no second copy held).
    if (stage < 3) {
      const auto& params = opt->layout().params();
      for (const auto& named : models[static_cast<std::size_t>(r)]->named_parameters()) {
        std::size_t id = 0;
        while (id < params.size() && params[id].name != named.key()) ++id;
        EXPECT(id < params.size(), "parameter '%s' is not registered", named.key().c_str());
        if (id == params.size()) continue;
        const zero::UnitId u = params[id].unit;
        const auto* resident = static_cast<const char*>(opt->acquire_unit(u)) +
                               params[id].offset * named.value().element_size();  // resident: no collective
        opt->release_unit(u);
        EXPECT(named.value().data_ptr() == resident,
               "stage %d: '%s' is not a view of the optimizer's parameters", stage, named.key().c_str());
      }
    }
    std::vector<double> losses;
    for (int k = 0; k < steps; ++k) {
      const Batch b = batch_of(k).part(r, ranks);
      auto loss = models[static_cast<std::size_t>(r)]->loss(b.idx, b.targets, unit_call(zt));
      loss.backward();
      zt.step();
      losses.push_back(opt->mean_over_ranks(loss.item<double>()));
    }
    std::vector<float> masters(opt->layout().padded_total());
    opt->gather_masters(masters.data());
    if (r == 0) {
      out.losses = losses;
      out.masters = std::move(masters);
      out.memory = opt->memory_report();
      out.units = zt.unit_names().size();
      out.params = zt.param_count();
    }
  });
  return out;
}

void compare_with_torch(Gpt& ours, Gpt& theirs, bool bitwise, const char* what);
void compare_parameters(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& t, bool bitwise,
                        double tolerance, const char* what, const char* theirs);

// torch::optim::AdamW on `theirs`, `steps` steps of the whole batch, on a
// thread of its own with one intra-op thread (the summation order of ours).
void train_with_torch_adamw(Gpt& theirs, int steps) {
  std::thread([&] {
    at::set_num_threads(1);
    torch::optim::AdamW adamw(theirs->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(kWeightDecay));
    for (int k = 0; k < steps; ++k) {
      const Batch b = batch_of(k);
      adamw.zero_grad();
      theirs->loss(b.idx, b.targets).backward();
      adamw.step();
    }
  }).join();
}

void one_rank_against_torch_adamw(bool bitwise) {
  constexpr int steps = 10;
  Gpt ours = make_model();
  Gpt theirs = make_model();
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& comm) {
    at::set_num_threads(1);
    auto opt = zero::make_optimizer<zero::backend::Host>(comm, config_of(0));
    Adapter zt(*opt, *ours);
    for (int k = 0; k < steps; ++k) {
      const Batch b = batch_of(k);
      ours->loss(b.idx, b.targets).backward();  // stages 0-2: the model's own forward, unchanged
      zt.step();
    }
  });
  train_with_torch_adamw(theirs, steps);
  compare_with_torch(ours, theirs, bitwise, "one rank, stage 0, 10 AdamW steps");
}

// Parameters of `ours` (trained here) against `theirs` (torch::optim::AdamW).
void compare_with_torch(Gpt& ours, Gpt& theirs, bool bitwise, const char* what) {
  // With its AVX2/AVX-512 kernels LibTorch updates the moments with fused
  // multiply-adds (m*beta1 + g*(1-beta1) rounded once): an ulp apart from
  // the second step on, which Adam's normalisation amplifies where v is
  // near zero. Within a hundredth of one step's size.
  compare_parameters(ours->parameters(), theirs->parameters(), bitwise, 0.01 * kLr, what, "torch::optim::AdamW");
}

// Parameters `a` (trained here) against `t` (trained by LibTorch's `theirs`):
// equal bit for bit where `bitwise`, else within `tolerance`.
void compare_parameters(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& t, bool bitwise,
                        double tolerance, const char* what, const char* theirs) {
  EXPECT(a.size() == t.size(), "parameter lists differ");
  std::int64_t elements = 0, equal = 0;
  double worst = 0, worst_relative = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const float* x = a[i].data_ptr<float>();
    const float* y = t[i].data_ptr<float>();
    for (std::int64_t e = 0; e < a[i].numel(); ++e) {
      ++elements;
      equal += std::memcmp(&x[e], &y[e], sizeof(float)) == 0 ? 1 : 0;
      const double d = std::abs(static_cast<double>(x[e]) - y[e]);
      worst = std::max(worst, d);
      worst_relative = std::max(worst_relative, d / std::max(1e-3, std::abs(static_cast<double>(y[e]))));
    }
  }
  std::printf("%s: %lld of %lld parameters bit for bit equal to %s's; largest difference %.3g (relative %.3g)\n",
              what, static_cast<long long>(equal), static_cast<long long>(elements), theirs, worst, worst_relative);
  if (bitwise) {
    // LibTorch's kernels without fused multiply-adds (ATEN_CPU_CAPABILITY=
    // default): its optimizer's arithmetic is the library's, operation for
    // operation, and so are the gradients (the same autograd).
    EXPECT(equal == elements, "%s: %lld of %lld parameters differ", what, static_cast<long long>(elements - equal),
           static_cast<long long>(elements));
  } else {
    EXPECT(worst <= tolerance, "%s: largest difference %.3g (relative %.3g)", what, worst, worst_relative);
  }
}

// Model states per rank against the formulas of docs/zero-math.md: per
// element of Phi (padded), `low` bytes of parameters and as many of
// gradients, `master` bytes of fp32 master weights (0 where fp32 parameters
// are their own) and 8 of AdamW's m and v, each divided by the ranks where
// the stage partitions it.
void expect_memory_formula(const zero::MemoryReport& m, int ranks, int stage, double low, double master,
                           const char* what) {
  const double phi = static_cast<double>(m.padded_elements), n = ranks;
  const double params = low * phi / (stage >= 3 ? n : 1), grads = low * phi / (stage >= 2 ? n : 1),
               masters = master * phi / (stage >= 1 ? n : 1), states = 8 * phi / (stage >= 1 ? n : 1);
  EXPECT(m.params == params && m.grads == grads && m.master == masters && m.optimizer_states == states,
         "%s, %d ranks, stage %d: params %llu grads %llu master %llu states %llu; formula %g %g %g %g", what, ranks,
         stage, static_cast<unsigned long long>(m.params), static_cast<unsigned long long>(m.grads),
         static_cast<unsigned long long>(m.master), static_cast<unsigned long long>(m.optimizer_states), params, grads,
         masters, states);
}

void stages_agree(int ranks) {
  constexpr int steps = 6;
  const Run one = train(1, 0, steps);
  const Run s0 = train(ranks, 0, steps);
  EXPECT(one.units == 5 && one.params == 2 + 12 * static_cast<std::size_t>(kShape.layers) + 2,
        "units %zu, parameters %zu (wte, wpe, blocks.0, blocks.1, ln_f; the tied output layer once)", one.units,
        one.params);
  EXPECT(s0.losses.back() < s0.losses.front(), "stage 0 does not learn: %g -> %g", s0.losses.front(),
        s0.losses.back());
  for (int k = 0; k < steps; ++k)
    EXPECT(std::abs(s0.losses[k] - one.losses[k]) <= 1e-5 * std::abs(one.losses[k]),
          "%d ranks, step %d: loss %.9g, one rank on the whole batch %.9g", ranks, k, s0.losses[k], one.losses[k]);
  std::vector<Run> runs{s0};
  // Stages 1-3, and stage 3 handing the module's released pages back to the
  // operating system (they come back zero-filled: the next gather refills them).
  for (int stage = 1; stage <= 4; ++stage) {
    const Run s = stage <= 3 ? train(ranks, stage, steps) : train(ranks, 3, steps, true);
    const std::string label = stage <= 3 ? std::to_string(stage) : "3 (release_memory_pages)";
    double worst = 0;
    for (std::size_t i = 0; i < s0.masters.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::abs(s.masters[i] - s0.masters[i])));
    for (int k = 0; k < steps; ++k)
      EXPECT(std::abs(s.losses[k] - s0.losses[k]) <= 1e-6 * std::abs(s0.losses[k]),
            "%d ranks, stage %s, step %d: loss %.9g, stage 0 %.9g", ranks, label.c_str(), k, s.losses[k],
            s0.losses[k]);
    EXPECT(worst <= 1e-6, "%d ranks, stage %s: parameters differ from stage 0's by %.3g", ranks, label.c_str(),
           worst);
    std::printf("%d ranks, stage %s: losses %.6f -> %.6f (stage 0: %.6f -> %.6f), parameters within %.3g\n", ranks,
                label.c_str(), s.losses.front(), s.losses.back(), s0.losses.front(), s0.losses.back(), worst);
    if (stage <= 3) runs.push_back(s);
  }
  // fp32 AdamW: the parameters are their own master.
  for (int stage = 0; stage <= 3; ++stage)
    expect_memory_formula(runs[static_cast<std::size_t>(stage)].memory, ranks, stage, 4, 0, "fp32");
  const double share = static_cast<double>(runs[3].memory.model_states()) / runs[0].memory.model_states();
  std::printf("%d ranks: model states per rank, stage 3 / stage 0 = %.3f\n", ranks, share);
  if (ranks == 2) EXPECT(share <= 0.6, "stage 3 keeps %.3f of stage 0's model states at 2 ranks", share);
}

// A bf16 module (module->to(kBFloat16)) with precision bf16: its tensors
// are the optimizer's bf16 parameters and gradients, the fp32 master
// weights the optimizer's. Stages 1-3 equal stage 0 bit for bit, it learns
// as the fp32 module does (within bf16's rounding), and memory per rank
// follows the mixed-precision formulas (2 + 2 + 4 + 8 bytes per element).
void bf16_module() {
  constexpr int steps = 6, ranks = 2;
  const Run fp32 = train(ranks, 0, steps);
  std::vector<Run> runs;
  for (int stage = 0; stage <= 3; ++stage) runs.push_back(train(ranks, stage, steps, false, zero::PrecisionChoice::bf16));
  const Run& s0 = runs[0];
  EXPECT(s0.losses.back() < s0.losses.front() - 0.1, "bf16 does not learn: %g -> %g", s0.losses.front(),
         s0.losses.back());
  EXPECT(std::abs(s0.losses.back() - fp32.losses.back()) <= 0.05, "bf16 ends at %g, fp32 at %g", s0.losses.back(),
         fp32.losses.back());
  for (int stage = 0; stage <= 3; ++stage) {
    const Run& s = runs[static_cast<std::size_t>(stage)];
    for (int k = 0; k < steps; ++k)
      EXPECT(s.losses[k] == s0.losses[k], "bf16, stage %d, step %d: loss %.9g, stage 0 %.9g", stage, k, s.losses[k],
             s0.losses[k]);
    EXPECT(s.masters == s0.masters, "bf16, stage %d: master weights differ from stage 0's", stage);
    expect_memory_formula(s.memory, ranks, stage, 2, 4, "bf16");
  }
  std::printf("bf16 module, %d ranks: losses %.6f -> %.6f at every stage (fp32 module: %.6f -> %.6f)\n", ranks,
              s0.losses.front(), s0.losses.back(), fp32.losses.front(), fp32.losses.back());
}

// Gradient accumulation: two micro-batches of half the batch per step
// (Options::grad_accumulation_steps = 2; zt.step() after each) train as one
// micro-batch of the whole batch, at stages 0 and 3 (within fp32 rounding:
// the halves are summed in another order).
void accumulation() {
  constexpr int steps = 4;
  const Run whole = train(1, 0, steps);
  for (int stage : {0, 3}) {
    Gpt model = make_model();
    std::vector<float> masters;
    zero::comm::LocalGroup group(1);
    group.run([&](zero::comm::Local& comm) {
      at::set_num_threads(1);
      zero::Config c = config_of(stage);
      c.options.grad_accumulation_steps = 2;
      auto opt = zero::make_optimizer<zero::backend::Host>(comm, c);
      Adapter zt(*opt, *model);
      for (int k = 0; k < steps; ++k) {
        for (int m = 0; m < 2; ++m) {
          const Batch b = batch_of(k).part(m, 2);
          model->loss(b.idx, b.targets, unit_call(zt)).backward();
          const zero::StepResult r = zt.step();
          EXPECT(r.stepped == (m == 1), "stage %d, step %d, micro-batch %d: stepped %d", stage, k, m, r.stepped);
        }
      }
      masters.resize(opt->layout().padded_total());
      opt->gather_masters(masters.data());
    });
    double worst = 0;
    for (std::size_t i = 0; i < masters.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::abs(masters[i] - whole.masters[i])));
    std::printf("one rank, stage %d, 2 micro-batches per step: parameters within %.3g of one whole batch\n", stage,
                worst);
    // (Rounding, amplified by Adam where v is near zero, as against
    // LibTorch's fused kernels: within a hundredth of one step's size.)
    EXPECT(worst <= 0.01 * kLr, "stage %d: accumulated steps differ from whole-batch steps by %.3g", stage, worst);
  }
}

// A frozen parameter (the position embedding, requires_grad false) is not
// the optimizer's: it stays the module's, unchanged, at stage 3 too, while
// the rest trains as torch::optim::AdamW trains it (which skips a parameter
// without a .grad).
void frozen_parameters(bool bitwise) {
  constexpr int steps = 5;
  Gpt ours = make_model(), theirs = make_model();
  for (Gpt* m : {&ours, &theirs}) (*m)->wpe->weight.set_requires_grad(false);
  const torch::Tensor initial = ours->wpe->weight.clone();
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& comm) {
    at::set_num_threads(1);
    auto opt = zero::make_optimizer<zero::backend::Host>(comm, config_of(3));
    Adapter zt(*opt, *ours);
    EXPECT(zt.frozen_params() == std::vector<std::string>{"wpe.weight"} && zt.unit_names().size() == 4,
           "%zu frozen parameters, %zu units", zt.frozen_params().size(), zt.unit_names().size());
    for (int k = 0; k < steps; ++k) {
      const Batch b = batch_of(k);
      ours->loss(b.idx, b.targets, unit_call(zt)).backward();
      zt.step();
    }
    // Stage 3: the module's tensors hold every value while held whole, and
    // keep them after (how a program saves the trained module).
    const zero::HeldWhole whole = zt.hold_whole();
  });
  train_with_torch_adamw(theirs, steps);
  EXPECT(torch::equal(ours->wpe->weight, initial), "the frozen parameter changed");
  compare_with_torch(ours, theirs, bitwise, "one rank, stage 3, wpe frozen, 5 AdamW steps");
}

// The adapter over the compile-time type (ZeroOptimizer, precision::Full<float>)
// trains as over make_optimizer's handle: the same losses, bit for bit.
void typed_optimizer_as_handle() {
  constexpr int steps = 4;
  using Typed = zero::ZeroOptimizer<zero::precision::Full<float>, zero::optim::AdamW, zero::stage<3>,
                                    zero::offload::None, zero::backend::Host>;
  const Run handle = train(2, 3, steps);
  std::vector<Gpt> models{make_model(), make_model()};
  std::vector<double> losses;
  zero::comm::LocalGroup group(2);
  group.run([&](zero::comm::Local& comm) {
    at::set_num_threads(1);
    const int r = comm.rank();
    zero::Options options;
    options.grad_writes = zero::GradWrites::accumulate;
    Typed opt(comm, {.lr = kLr, .weight_decay = kWeightDecay}, options);
    zero::integrations::TorchModule zt(opt, *models[static_cast<std::size_t>(r)]);
    for (int k = 0; k < steps; ++k) {
      const Batch b = batch_of(k).part(r, 2);
      auto loss = models[static_cast<std::size_t>(r)]->loss(b.idx, b.targets, unit_call(zt));
      loss.backward();
      zt.step();
      const double mean = opt.mean_over_ranks(loss.item<double>());
      if (r == 0) losses.push_back(mean);
    }
  });
  for (int k = 0; k < steps; ++k)
    EXPECT(losses[k] == handle.losses[k], "ZeroOptimizer, step %d: loss %.9g, make_optimizer's %.9g", k, losses[k],
           handle.losses[k]);
}

// The tutorial's pattern ("LibTorch"): the model is made before the
// adapter, so its forward takes the call that runs each unit (the identity
// by default: plain LibTorch), and the program passes the adapter's.
using NetFn = std::function<torch::Tensor(torch::Tensor)>;
using NetCall = std::function<torch::Tensor(const std::string& unit, torch::Tensor x, const NetFn& f)>;
torch::Tensor plain_net_call(const std::string&, torch::Tensor x, const NetFn& f) { return f(std::move(x)); }

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(16, 32))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(32, 4))};
  torch::Tensor forward(torch::Tensor x, const NetCall& call = plain_net_call) {
    x = call("fc1", x, [&](torch::Tensor h) { return torch::relu(fc1(h)); });
    return call("fc2", x, [&](torch::Tensor h) { return torch::log_softmax(fc2(h), 1); });
  }
};
TORCH_MODULE(Net);

// Batch k for the Net: 8 inputs of 16 features, each in one of 4 classes.
std::pair<torch::Tensor, torch::Tensor> net_batch(int k) {
  torch::Generator gen = at::detail::createCPUGenerator(2000 + static_cast<std::uint64_t>(k));
  return {torch::randn({8, 16}, gen), torch::randint(4, {8}, gen, torch::kLong)};
}

// The tutorial's pattern at stage 3, one rank, with SGD and momentum (the
// optimizer type stated: the Config's default is AdamW) against
// torch::optim::SGD on the same model and data: bit for bit with --bitwise
// (ATEN_CPU_CAPABILITY=default); with LibTorch's AVX2/AVX-512 kernels its
// add(x, alpha) is a fused multiply-add (the weight decay, the update), one
// rounding fewer.
void tutorial_pattern_sgd(bool bitwise) {
  constexpr int steps = 10;
  constexpr double lr = 0.01, momentum = 0.9, weight_decay = 1e-4;
  torch::manual_seed(3);
  Net ours;
  torch::manual_seed(3);
  Net theirs;
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& comm) {
    at::set_num_threads(1);
    zero::Config config;
    config.precision = zero::PrecisionChoice::fp32;
    config.optimizer = "sgd";
    config.hyper = {{"lr", lr}, {"momentum", momentum}, {"weight_decay", weight_decay}};
    config.stage = 3;
    config.options.grad_writes = zero::GradWrites::accumulate;
    auto opt = zero::make_optimizer<zero::backend::Host>(comm, config);
    Adapter zt(*opt, *ours);
    const NetCall call = [&zt](const std::string& unit, torch::Tensor x, const NetFn& f) {
      return zt.run(unit, std::move(x), f);
    };
    for (int k = 0; k < steps; ++k) {
      const auto [x, y] = net_batch(k);
      torch::nll_loss(ours->forward(x, call), y).backward();
      zt.step();
    }
    const zero::HeldWhole whole = zt.hold_whole();  // stage 3: the values stay in the module's tensors
  });
  std::thread([&] {
    at::set_num_threads(1);
    torch::optim::SGD sgd(theirs->parameters(),
                          torch::optim::SGDOptions(lr).momentum(momentum).weight_decay(weight_decay));
    for (int k = 0; k < steps; ++k) {
      const auto [x, y] = net_batch(k);
      sgd.zero_grad();
      torch::nll_loss(theirs->forward(x), y).backward();
      sgd.step();
    }
  }).join();
  compare_parameters(ours->parameters(), theirs->parameters(), bitwise, 1e-3 * lr,
                     "the tutorial's pattern, one rank, stage 3, 10 SGD steps (momentum 0.9)", "torch::optim::SGD");
}

// `fn` throws a zero::Error whose message holds `words`.
template <class Fn>
void refused(const char* what, Fn&& fn, const char* words) {
  try {
    fn();
    EXPECT(false, "%s: not refused", what);
  } catch (const zero::Error& e) {
    EXPECT(std::strstr(e.what(), words) != nullptr, "%s: message '%s' lacks '%s'", what, e.what(), words);
  } catch (const std::exception& e) {
    EXPECT(false, "%s: refused by another exception than zero::Error: '%s'", what, e.what());
  }
}

void misuse_refused() {
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& comm) {
    refused("bf16", [&] {
      zero::Config c = config_of(0);
      c.precision = zero::PrecisionChoice::bf16;
      auto opt = zero::make_optimizer<zero::backend::Host>(comm, c);
      Gpt m = make_model();
      Adapter zt(*opt, *m);
    }, "convert the module with module->to(torch::kBFloat16)");
    refused("overwrite", [&] {
      zero::Config c = config_of(0);
      c.options.grad_writes = zero::GradWrites::overwrite;
      auto opt = zero::make_optimizer<zero::backend::Host>(comm, c);
      Gpt m = make_model();
      Adapter zt(*opt, *m);
    }, "grad_writes = zero::GradWrites::accumulate");
    refused("zero_grad", [&] {
      auto opt = zero::make_optimizer<zero::backend::Host>(comm, config_of(1));
      Gpt m = make_model();
      Adapter zt(*opt, *m);
      const Batch b = batch_of(0);
      m->loss(b.idx, b.targets).backward();
      for (auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();  // what zero_grad(set_to_none) does
      zt.step();
    }, "is no longer the tensor the optimizer reads");
    refused("stage 3 without run()", [&] {
      auto opt = zero::make_optimizer<zero::backend::Host>(comm, config_of(3));
      Gpt m = make_model();
      Adapter zt(*opt, *m);
      const Batch b = batch_of(0);
      m->loss(b.idx, b.targets).backward();
      zt.step();
    }, "inside run(unit, x, f)");
    refused("unknown unit", [&] {
      auto opt = zero::make_optimizer<zero::backend::Host>(comm, config_of(0));
      Gpt m = make_model();
      Adapter zt(*opt, *m, {.units = {"wte", "blocks"}});
    }, "is in none of the units");
  });
}

// The module changed under the adapter: each refused, naming the parameter
// and the fix, before the optimizer reads or writes memory the module may
// have freed (the adapter holds that memory meanwhile).
void module_changes_refused() {
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& comm) {
    at::set_num_threads(1);
    const Batch b = batch_of(0);
    for (int stage : {0, 3}) {
      // zero_grad(true) (LibTorch 2.x's zero_grad()) sets each .grad to
      // none, freeing the tensor the optimizer reads; backward then makes a
      // new one. The backward through zt.run used to take (read and zero)
      // the freed memory as it left each unit, before step() looked: a
      // crash, or a heap-use-after-free under AddressSanitizer.
      refused(("zero_grad(true), stage " + std::to_string(stage)).c_str(), [&] {
        auto opt = zero::make_optimizer<zero::backend::Host>(comm, config_of(stage));
        Gpt m = make_model();
        Adapter zt(*opt, *m);
        m->zero_grad(/*set_to_none=*/true);
        m->loss(b.idx, b.targets, unit_call(zt)).backward();
        zt.step();
      }, "it was set to none (model->zero_grad(true)");
      // A parameter's storage replaced (set_data; torch::load set_()s each
      // tensor): at stages 0-2 the module computed with values the
      // optimizer never updated, without a word; at stage 3 the gather
      // wrote into the freed storage.
      refused(("storage replaced, stage " + std::to_string(stage)).c_str(), [&] {
        auto opt = zero::make_optimizer<zero::backend::Host>(comm, config_of(stage));
        Gpt m = make_model();
        Adapter zt(*opt, *m);
        {
          torch::NoGradGuard no_grad;
          m->ln_f->weight.set_data(m->ln_f->weight.detach().clone());
        }
        m->loss(b.idx, b.targets, unit_call(zt)).backward();
        zt.step();
      }, "parameter 'ln_f.weight' no longer has the memory the optimizer");
    }
    // What stays accepted: LibTorch 1.13's zero_grad() (set_to_none false)
    // zeroes each .grad in place, keeping the tensor; before the forward
    // it changes nothing.
    for (int stage : {0, 3}) {
      auto opt = zero::make_optimizer<zero::backend::Host>(comm, config_of(stage));
      Gpt m = make_model();
      Adapter zt(*opt, *m);
      try {
        for (int k = 0; k < 2; ++k) {
          m->zero_grad();
          m->loss(b.idx, b.targets, unit_call(zt)).backward();
          zt.step();
        }
      } catch (const std::exception& e) {
        EXPECT(false, "zero_grad() before each forward, stage %d: refused: %s", stage, e.what());
      }
    }
    // A second step() in one micro-batch (and a step() before any
    // backward): stages 0-2 stepped again on zero gradients (momentum and
    // Adam's moments still moving the parameters); stage 3 refused it with
    // another mistake's message.
    for (int stage = 0; stage <= 3; ++stage) {
      refused(("second step, stage " + std::to_string(stage)).c_str(), [&] {
        auto opt = zero::make_optimizer<zero::backend::Host>(comm, config_of(stage));
        Gpt m = make_model();
        Adapter zt(*opt, *m);
        m->loss(b.idx, b.targets, unit_call(zt)).backward();
        zt.step();
        zt.step();
      }, "no parameter's .grad was added into since the last step");
    }
    refused("step before any backward", [&] {
      auto opt = zero::make_optimizer<zero::backend::Host>(comm, config_of(0));
      Gpt m = make_model();
      Adapter zt(*opt, *m);
      zt.step();
    }, "no parameter's .grad was added into since the last step");
    // A parameter registered after the adapter was made, or one frozen
    // then and unfrozen since: the optimizer does not hold it, and it was
    // never trained, without a word.
    refused("a parameter registered after the adapter", [&] {
      auto opt = zero::make_optimizer<zero::backend::Host>(comm, config_of(0));
      Gpt m = make_model();
      Adapter zt(*opt, *m);
      m->ln_f->register_parameter("late", torch::zeros({kShape.width}));
      m->loss(b.idx, b.targets, unit_call(zt)).backward();
      zt.step();
    }, "parameter 'ln_f.late' was registered on the module after the adapter was made");
    refused("a parameter unfrozen after the adapter", [&] {
      auto opt = zero::make_optimizer<zero::backend::Host>(comm, config_of(3));
      Gpt m = make_model();
      m->wpe->weight.set_requires_grad(false);
      Adapter zt(*opt, *m);
      m->wpe->weight.set_requires_grad(true);
      m->loss(b.idx, b.targets, unit_call(zt)).backward();
      zt.step();
    }, "parameter 'wpe.weight' was frozen (requires_grad false) when the adapter was made");
  });
}

}  // namespace

// --bitwise: run with ATEN_CPU_CAPABILITY=default; the parameters must
// then equal torch::optim::AdamW's bit for bit.
int main(int argc, char** argv) {
  const bool bitwise = argc > 1 && std::strcmp(argv[1], "--bitwise") == 0;
  at::set_num_threads(1);
  one_rank_against_torch_adamw(bitwise);
  stages_agree(2);
  stages_agree(4);
  typed_optimizer_as_handle();
  frozen_parameters(bitwise);
  accumulation();
  bf16_module();
  tutorial_pattern_sgd(bitwise);
  misuse_refused();
  module_changes_refused();
  if (failures != 0) {
    std::printf("%d checks failed\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
