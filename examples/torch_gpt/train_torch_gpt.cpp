// Trains the torch::nn GPT of torch_gpt.hpp (LibTorch, autograd) with ZeRO:
// the model is LibTorch's, the optimizer the library's, fitted by
// zero::integrations::TorchModule (one module replica per rank). Ranks are
// threads of this process (--comm local) or the processes of mpirun
// (--comm mpi). Character level, on The Devil's Dictionary (apt dict-devil).
//
//   train_torch_gpt [--ranks 2] [--comm local|mpi] [--stage 3] [--steps 200] [--eval-every 50]
//   mpirun -np 2 train_torch_gpt --comm mpi --stage 3
//
// Prints the losses every --eval-every steps (validation on rank 0 with the
// parameters held whole), a sample of generated text, and ends with
// val_loss=<value>.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/cli.hpp"
#include "common/launch.hpp"
#include "common/openmp_waits.hpp"
#include "common/rank_errors.hpp"
#include "gpt/text_corpus.hpp"
#include "torch_gpt/torch_gpt.hpp"
#include "zero/comm/any_communicator.hpp"
#include "zero/comm/local.hpp"
#include "zero/integrations/torch.hpp"
#include "zero/runtime/make_optimizer.hpp"
#if defined(ZERO_EXAMPLE_HAVE_MPI)
#include "zero/comm/mpi.hpp"
#endif

namespace {

struct Args {
  zero::Config config;
  zero::examples::LaunchChoices launch;
  torch_gpt::GptShape shape;
  int batch = 16;  // windows per rank per step
  int steps = 200;
  int eval_every = 50;
  int warmup = 10;
  double lr = 5e-3, min_lr = 5e-4;
  int seed = 1;
  int sample = 120;
  std::string data = gpt::kDefaultCorpus;
};

void add_options(CLI::App& app, Args& a) {
  // The module's tensors take the precision's storage type (bf16/fp16: the
  // optimizer keeps the fp32 master weights).
  a.config.precision = zero::PrecisionChoice::fp32;
  a.config.optimizer = "adamw";  // (zero::Config's default; --optimizer sgd trains as torch::optim::SGD)
  a.config.stage = 3;
  a.config.hyper["weight_decay"] = 0.1;
  zero::examples::add_config_options(app, a.config,
                                     {.optimizers = {"adamw", "adam", "sgd"}, .offload_tiers = {"none"}});
  zero::examples::add_launch_options(app, a.launch, {
    "local",
#if defined(ZERO_EXAMPLE_HAVE_MPI)
        "mpi"
#endif
  });
  a.launch.ranks = 2;
  app.add_option("--layers", a.shape.layers, "transformer blocks")->check(CLI::Range(1, 64))->capture_default_str();
  app.add_option("--width", a.shape.width, "model width")->check(CLI::Range(8, 4096))->capture_default_str();
  app.add_option("--heads", a.shape.heads, "attention heads (divide --width)")->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--context", a.shape.context, "characters per window")->check(CLI::Range(2, 1024))
      ->capture_default_str();
  app.add_option("--batch", a.batch, "windows per rank per step")->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_option("--steps", a.steps, "optimizer steps")->check(CLI::Range(1, 1 << 24))->capture_default_str();
  app.add_option("--eval-every", a.eval_every, "steps between evaluations")->check(CLI::Range(1, 1 << 24))
      ->capture_default_str();
  app.add_option("--warmup", a.warmup, "steps of linear learning-rate warm-up")->check(CLI::Range(0, 1 << 24))
      ->capture_default_str();
  app.add_option("--lr", a.lr, "peak learning rate (cosine decay to --min-lr)")->capture_default_str();
  app.add_option("--min-lr", a.min_lr, "final learning rate")->capture_default_str();
  app.add_option("--seed", a.seed, "initialisation and data order")->capture_default_str();
  app.add_option("--sample", a.sample, "characters of text to generate at the end (0: none)")
      ->check(CLI::Range(0, 100000))->capture_default_str();
  app.add_option("--data", a.data, "the corpus (dictzip or gzip text)")->capture_default_str();
  app.callback([&a] {
    if (a.shape.width % a.shape.heads != 0)
      throw CLI::ValidationError("--heads", std::to_string(a.shape.heads) + " does not divide --width " +
                                            std::to_string(a.shape.width));
    if (a.config.precision == zero::PrecisionChoice::fp16)
      throw CLI::ValidationError("--precision fp16", "LibTorch's CPU kernels have no fp16 LayerNorm (\"not "
                                                     "implemented for 'Half'\"): use bf16 or fp32");
    zero::examples::check_config_options(a.config, false, {.optimizers = {"adamw", "adam", "sgd"},
                                                           .offload_tiers = {"none"}});
  });
}

// The tensors' type for the optimizer's storage type.
torch::ScalarType module_dtype(zero::PrecisionChoice precision) {
  return precision == zero::PrecisionChoice::bf16   ? torch::kBFloat16
         : precision == zero::PrecisionChoice::fp16 ? torch::kFloat16
                                                    : torch::kFloat32;
}

// A rank's replica, from --seed: every rank's starts equal.
torch_gpt::Gpt make_replica(const Args& a) {
  torch::manual_seed(static_cast<std::uint64_t>(a.seed));
  torch_gpt::Gpt model(a.shape);
  model->to(module_dtype(a.config.precision));
  return model;
}

double learning_rate(const Args& a, int step) {
  if (step < a.warmup) return a.lr * (step + 1) / a.warmup;
  const double t = static_cast<double>(step - a.warmup) / std::max(1, a.steps - a.warmup);
  return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + std::cos(M_PI * t));
}

// `count` windows of context + 1 characters from text[0, size), at random.
std::pair<torch::Tensor, torch::Tensor> windows(const std::uint8_t* text, std::size_t size, int count, int context,
                                                std::mt19937_64& rng) {
  auto idx = torch::empty({count, context}, torch::kLong), targets = torch::empty({count, context}, torch::kLong);
  auto i = idx.accessor<std::int64_t, 2>(), t = targets.accessor<std::int64_t, 2>();
  std::uniform_int_distribution<std::size_t> start(0, size - static_cast<std::size_t>(context) - 1);
  for (int b = 0; b < count; ++b) {
    const std::size_t s = start(rng);
    for (int c = 0; c < context; ++c) {
      i[b][c] = text[s + static_cast<std::size_t>(c)];
      t[b][c] = text[s + static_cast<std::size_t>(c) + 1];
    }
  }
  return {idx, targets};
}

// The validation loss over fixed windows (the same every evaluation).
double validation_loss(torch_gpt::Gpt& model, const torch_gpt::UnitCall& call, const gpt::TextCorpus& corpus,
                       int context) {
  torch::NoGradGuard no_grad;
  std::mt19937_64 rng(12345);
  const auto [idx, targets] = windows(corpus.validation(), corpus.validation_size(), 64, context, rng);
  return model->loss(idx, targets, call).item<double>();
}

std::string generate(torch_gpt::Gpt& model, const torch_gpt::UnitCall& call, const gpt::TextCorpus& corpus,
                     int count, int context, int seed) {
  torch::NoGradGuard no_grad;
  std::vector<std::int64_t> ids{corpus.token_of[static_cast<unsigned char>('A')] >= 0
                                    ? corpus.token_of[static_cast<unsigned char>('A')]
                                    : 0};
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(seed));
  for (int k = 0; k < count; ++k) {
    const std::size_t from = ids.size() > static_cast<std::size_t>(context) ? ids.size() - context : 0;
    auto idx = torch::tensor(std::vector<std::int64_t>(ids.begin() + static_cast<std::ptrdiff_t>(from), ids.end()))
                   .unsqueeze(0);
    auto logits = model->forward(idx, call).select(1, idx.size(1) - 1).to(torch::kFloat32);
    ids.push_back(torch::multinomial(torch::softmax(logits / 0.8, -1), 1, false, gen).item<std::int64_t>());
  }
  std::vector<std::uint8_t> bytes(ids.begin(), ids.end());
  return corpus.decode(bytes.data(), bytes.size());
}

double train_rank(zero::comm::AnyCommunicator& comm, const Args& a, const gpt::TextCorpus& corpus,
                  torch_gpt::Gpt& model) {
  const int rank = comm.rank();
  zero::Config config = a.config;
  config.hyper["lr"] = a.lr;
  config.options.grad_writes = zero::GradWrites::accumulate;  // autograd adds into .grad
  auto opt = zero::make_optimizer<zero::backend::Host>(comm, config);
  zero::integrations::TorchModule zt(*opt, *model);
  // The model was made before the adapter, so its forward takes the call
  // that runs each unit (torch_gpt.hpp; the identity by default): here the
  // adapter's, which at stage 3 gathers the unit around it (the pattern of
  // docs/tutorial.md, "LibTorch").
  const torch_gpt::UnitCall call = [&zt](const std::string& unit, torch::Tensor x, const torch_gpt::UnitFn& f,
                                         bool reads) { return zt.run(unit, std::move(x), f, reads); };
  if (rank == 0) {
    std::int64_t n = 0;
    for (const auto& p : model->parameters()) n += p.numel();
    std::printf("zero + LibTorch: GPT %d layers, width %d, %d heads, context %d, vocab %d: %lld parameters in %zu "
                "units; %d ranks (%s), stage %d, %s, %s\n",
                a.shape.layers, a.shape.width, a.shape.heads, a.shape.context, a.shape.vocab,
                static_cast<long long>(n), zt.unit_names().size(), comm.size(), a.launch.comm.c_str(),
                config.stage, zero::name(config.precision), config.optimizer.c_str());
    std::printf("data: %s, unigram entropy %.4f nats/char\n", a.data.c_str(), corpus.unigram_entropy());
    const zero::MemoryReport m = opt->memory_report();
    std::printf("optimizer memory per rank: %.2f MiB of model states (%.2f MiB at stage 0), %.2f MiB of buffers\n",
                m.model_states() / 1048576.0,
                16.0 * static_cast<double>(m.padded_elements) / 1048576.0, m.communication_buffers / 1048576.0);
    std::fflush(stdout);
  }
  std::mt19937_64 rng(static_cast<std::uint64_t>(a.seed) * 1000003u + static_cast<std::uint64_t>(rank));
  double train_sum = 0, val = 0;
  int train_count = 0;
  for (int step = 0; step < a.steps; ++step) {
    opt->set_hyper("lr", learning_rate(a, step));
    const auto [idx, targets] = windows(corpus.train(), corpus.train_size, a.batch, a.shape.context, rng);
    auto loss = model->loss(idx, targets, call);
    // fp16: the gradient of the scaled loss (step() unscales it, and skips
    // a step whose gradients overflowed); bf16 and fp32 scale by 1.
    (opt->loss_scale() == 1.0 ? loss : loss * opt->loss_scale()).backward();
    zt.step();
    train_sum += loss.item<double>();
    ++train_count;
    if ((step + 1) % a.eval_every == 0 || step + 1 == a.steps) {
      const double train = opt->mean_over_ranks(train_sum / train_count);
      {
        // Rank 0 evaluates alone: the parameters whole in its module until
        // the scope ends (a collective gather at stage 3).
        zero::HeldWhole whole = zt.hold_whole();
        if (rank == 0) val = validation_loss(model, call, corpus, a.shape.context);
      }
      if (rank == 0) {
        std::printf("step %d/%d  lr %.2e  train_loss %.4f  val_loss %.4f nats/char\n", step + 1, a.steps,
                    learning_rate(a, step), train, val);
        std::fflush(stdout);
      }
      train_sum = 0;
      train_count = 0;
    }
  }
  if (a.sample > 0) {
    zero::HeldWhole whole = zt.hold_whole();
    if (rank == 0)
      std::printf("sample: %s\n", generate(model, call, corpus, a.sample, a.shape.context, a.seed).c_str());
  }
  return val;
}

}  // namespace

int main(int argc, char** argv) {
  zero::examples::use_passive_openmp_waits(argv);  // LibTorch's OpenMP threads share the cores with the ranks
  try {
    Args args;
    CLI::App app("Trains a character-level GPT written with LibTorch (torch::nn, autograd) with ZeRO's optimizer on "
                 "CPU ranks; prints the losses every --eval-every steps and ends with val_loss=<value>.",
                 "train_torch_gpt");
    add_options(app, args);
    zero::examples::parse_or_exit(app, argc, argv);
    const gpt::TextCorpus corpus = gpt::load_corpus(args.data, args.shape.context);
    args.shape.vocab = corpus.vocab_size();
    const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    // A replica per rank of this process (--ranks threads, or the one MPI
    // rank), made here one after another: torch's generator is global.
    const int replicas = args.launch.comm == "local" ? args.launch.ranks : 1;
    std::vector<torch_gpt::Gpt> models;
    for (int r = 0; r < replicas; ++r) models.push_back(make_replica(args));
    zero::examples::Launch launch(app, args.launch, argc, argv);
    const std::optional<double> val = launch.run([&](zero::comm::AnyCommunicator& comm) {
      at::set_num_threads(std::max(1, cores / comm.size()));
      const std::size_t replica = args.launch.comm == "local" ? static_cast<std::size_t>(comm.rank()) : 0;
      return train_rank(comm, args, corpus, models[replica]);
    });
    if (!val) return 0;  // an MPI rank but the first
    std::printf("val_loss=%.4f\n", *val);
    return 0;
  } catch (const std::exception& e) {
#if defined(ZERO_EXAMPLE_HAVE_MPI)
    zero::comm::abort_mpi_job(e.what());
#endif
    zero::examples::print_error(e.what());
    return 1;
  }
}
