// A character-level GPT trained on The Devil's Dictionary with ZeRO, on CPU
// ranks (in-process threads, or MPI processes). The optimizer owns every
// parameter; the model (gpt_model.hpp) is cut into units: the embeddings,
// each transformer block, the final LayerNorm.
//
//   gpt_train [--ranks 4] [--comm local|mpi] [--stage 3] [--precision fp32|bf16|fp16]
//             [--optimizer adamw|adam|sgd] [--layers 4] [--width 128] [--heads 4]
//             [--context 128] [--micro-batch 8] [--grad-accum 1] [--lr 6e-3] [--warmup 30]
//             [--min-lr 6e-4] [--clip 1] [--seed 1] [--steps 400] [--eval-every 100]
//             [--checkpoint-activations] [--sample 200] [--data FILE] [--report]
//             [--save DIR [--save-every K] [--save-async] [--keep-last K]] [--resume DIR]
//
// (--help lists them with their defaults.) Every --eval-every steps it prints
// the training loss, the validation loss (nats per character), tokens/s and
// the model-state bytes per rank; at the end a generated sample, the
// validation loss beside the corpus' unigram entropy, and last
// `val_loss=<value>`.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/cli.hpp"
#include "common/openblas_core.hpp"
#include "common/optimizer_type.hpp"
#include "gpt/gpt_host.hpp"
#include "gpt/gpt_zero.hpp"
#include "gpt/text_corpus.hpp"
#include "zero/zero.hpp"

#if defined(ZERO_EXAMPLE_HAVE_CHECKPOINTS)
#include "common/checkpoints.hpp"
#include "zero/checkpoint/optimizer_io.hpp"
#endif
#if defined(ZERO_EXAMPLE_HAVE_MPI)
#include "zero/comm/mpi.hpp"
#endif

namespace {

struct Args : zero::examples::CheckpointChoices {  // --save, --resume, ... (common/cli.hpp)
  zero::examples::ZeroChoices zero = [] {
    zero::examples::ZeroChoices z;
    z.stage = 3;
    z.precision = "fp32";
    return z;
  }();
  zero::examples::LaunchChoices launch;
  std::string backend = "host";
  gpt::Config model;
  int micro_batch = 8;
  int grad_accum = 1;
  double lr = 6e-3;
  int warmup = 30;
  double min_lr = 6e-4;
  double clip = 1.0;
  std::uint64_t seed = 1;
  int steps = 400;
  int eval_every = 100;
  bool checkpoint_activations = false;
  int sample = 200;
  std::string data = gpt::kDefaultCorpus;
  bool report = false;
};

void add_options(CLI::App& app, Args& a) {
  zero::examples::add_launch_options(app, a.launch, {"local", "mpi"});
  app.add_option("--backend", a.backend, "where the model runs (cuda: not in this version)")
      ->check(CLI::IsMember({"host"}))
      ->capture_default_str();
  zero::examples::add_zero_options(app, a.zero);
  app.add_option("--layers", a.model.layers, "transformer blocks")->check(CLI::Range(1, 256))->capture_default_str();
  app.add_option("--width", a.model.width, "embedding width")->check(CLI::Range(1, 65536))->capture_default_str();
  app.add_option("--heads", a.model.heads, "attention heads (divide --width)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--context", a.model.context, "characters per training window")
      ->check(CLI::Range(1, 8192))
      ->capture_default_str();
  app.add_option("--micro-batch", a.micro_batch, "windows per rank per micro-batch")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--grad-accum", a.grad_accum, "micro-batches per optimizer step")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--lr", a.lr, "peak learning rate")->check(zero::examples::kPositive)->capture_default_str();
  app.add_option("--warmup", a.warmup, "steps of linear warm-up to --lr")
      ->check(CLI::Range(0, 1 << 30))
      ->capture_default_str();
  app.add_option("--min-lr", a.min_lr, "learning rate at the last step (cosine decay from --lr)")
      ->check(CLI::Range(0.0, 1e9))
      ->capture_default_str();
  app.add_option("--clip", a.clip, "global gradient-norm clipping (0: off)")
      ->check(CLI::Range(0.0, 1e30))
      ->capture_default_str();
  app.add_option("--seed", a.seed, "initial weights, data order and sampling (the same on every rank)")
      ->capture_default_str();
  app.add_option("--steps", a.steps, "optimizer steps")->check(CLI::Range(1, 1 << 30))->capture_default_str();
  app.add_option("--eval-every", a.eval_every, "steps between validation losses (and after the last step)")
      ->check(CLI::Range(1, 1 << 30))
      ->capture_default_str();
  app.add_flag("--checkpoint-activations", a.checkpoint_activations,
               "keep only each block's input and recompute the block in backward");
  app.add_option("--sample", a.sample, "characters generated at the end")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  app.add_option("--data", a.data, "the text (gzip, dictzip or plain)")->type_name("FILE")->capture_default_str();
  app.add_flag("--report", a.report, "print the memory and communication reports as JSON at the end");
  zero::examples::add_checkpoint_options(app, a, "after the last step",
                                         "any --ranks, --stage; the same model, --seed, --steps and schedule");
  app.callback([&a] {
    zero::examples::check_checkpoint_choices(a);
    if (a.model.width % a.model.heads != 0)
      throw CLI::ValidationError("--heads", std::to_string(a.model.heads) + " does not divide --width " +
                                                std::to_string(a.model.width));
    if (a.min_lr > a.lr)
      throw CLI::ValidationError("--min-lr", "is above --lr; the decay ends at --min-lr");
  });
}

// Linear warm-up, then cosine decay to min_lr at the last step.
double learning_rate(const Args& a, int step) {
  if (step < a.warmup) return a.lr * static_cast<double>(step + 1) / static_cast<double>(a.warmup);
  const int span = std::max(1, a.steps - 1 - a.warmup);
  const double t = std::min(1.0, static_cast<double>(step - a.warmup) / static_cast<double>(span));
  return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1.0 + std::cos(3.141592653589793 * t));
}

// The validation windows (consecutive, stride --context) are dealt round-robin
// to the ranks; every rank runs the same number of forward passes (stage 3
// gathers are collective), a rank without windows left running a discarded one.
template <class Comm>
double validation_loss(Comm& comm, gpt::Gpt& model, const gpt::ParamHooks& params, const gpt::TextCorpus& corpus) {
  const std::size_t T = static_cast<std::size_t>(model.config().context);
  const std::size_t windows = (corpus.validation_size() - 1) / T;
  const std::size_t ranks = static_cast<std::size_t>(comm.size()), rank = static_cast<std::size_t>(comm.rank());
  const std::size_t mine = windows / ranks + (rank < windows % ranks ? 1 : 0);
  const std::size_t most = (windows + ranks - 1) / ranks;
  const std::size_t B = static_cast<std::size_t>(model.max_batch());
  const std::size_t rounds = (most + B - 1) / B;
  std::vector<std::uint8_t> x(B * T), y(B * T);
  double totals[2] = {0.0, 0.0};  // sum of token losses, tokens
  const std::uint8_t* val = corpus.validation();
  for (std::size_t r = 0, next = 0; r < rounds; ++r) {
    const std::size_t n = std::min(B, mine - std::min(mine, next));
    const std::size_t batch = std::max<std::size_t>(n, 1);
    for (std::size_t i = 0; i < batch; ++i) {
      const std::size_t w = n == 0 ? 0 : (next + i) * ranks + rank;  // this rank's (next+i)-th window
      std::copy(val + w * T, val + w * T + T, x.begin() + static_cast<std::ptrdiff_t>(i * T));
      std::copy(val + w * T + 1, val + w * T + T + 1, y.begin() + static_cast<std::ptrdiff_t>(i * T));
    }
    const double loss = model.loss(x.data(), y.data(), static_cast<int>(batch), params);
    if (n > 0) {
      totals[0] += loss * static_cast<double>(n * T);
      totals[1] += static_cast<double>(n * T);
    }
    next += n;
  }
  comm.all_reduce(totals, 2, zero::DType::f64, zero::comm::ReduceOp::sum, true);
  return totals[0] / totals[1];
}

// `length` characters continuing `prompt`, sampled at temperature 0.8 by rank
// 0 and shared with the others (every rank runs every forward pass).
template <class Comm>
std::string generate(Comm& comm, gpt::Gpt& model, const gpt::ParamHooks& params, const gpt::TextCorpus& corpus,
                     std::vector<std::uint8_t> text, int length, std::uint64_t seed) {
  const std::size_t T = static_cast<std::size_t>(model.config().context);
  const int V = model.config().vocab;
  std::mt19937_64 gen(seed);
  std::vector<std::uint8_t> window(T, 0);
  std::vector<double> weights(static_cast<std::size_t>(V));
  const std::size_t prompt = text.size();
  for (int c = 0; c < length; ++c) {
    const std::size_t len = std::min(T, text.size());
    std::fill(window.begin(), window.end(), std::uint8_t{0});
    std::copy(text.end() - static_cast<std::ptrdiff_t>(len), text.end(), window.begin());
    model.loss(window.data(), nullptr, 1, params);  // causal: positions after len - 1 do not matter
    const float* z = model.logits() + (len - 1) * static_cast<std::size_t>(V);
    const float top = *std::max_element(z, z + V);
    for (int v = 0; v < V; ++v) weights[static_cast<std::size_t>(v)] = std::exp((z[v] - top) / 0.8);
    double next = comm.rank() == 0 ? static_cast<double>(std::discrete_distribution<int>(weights.begin(), weights.end())(gen)) : 0.0;
    comm.all_reduce(&next, 1, zero::DType::f64, zero::comm::ReduceOp::sum, true);
    text.push_back(static_cast<std::uint8_t>(next));
  }
  return corpus.decode(text.data() + prompt, text.size() - prompt);
}

double mib(std::uint64_t bytes) { return static_cast<double>(bytes) / 1048576.0; }

// One rank's run; every rank runs this in lockstep. Returns the final validation loss.
template <class Opt, class Comm>
double train_rank(Comm& comm, const Args& args, const gpt::TextCorpus& corpus) {
  const bool lead = comm.rank() == 0;
  const int ranks = comm.size();
  gpt::Config config = args.model;
  config.vocab = corpus.vocab_size();
  gpt::Gpt model(config, args.micro_batch, args.checkpoint_activations);

  typename Opt::Hyper hyper;
  hyper.lr = learning_rate(args, 0);
  if constexpr (std::is_same_v<typename Opt::optimizer_policy, zero::optim::Sgd>) hyper.momentum = 0.9;
  zero::Options options;
  options.seed = args.seed;
  options.clip_norm = args.clip;
  options.grad_accumulation_steps = args.grad_accum;
  Opt opt(comm, hyper, options);
  gpt::ZeroBinding<Opt, gpt::Gpt> binding(opt, model);
  opt.finalize();
  binding.adopt_layout();
  binding.set_params([&](int u, int k, float* out) { model.init_param(u, k, out, args.seed); });
  const gpt::ParamHooks params = binding.param_hooks();
  const gpt::GradHooks grads = binding.grad_hooks();

  const std::size_t T = static_cast<std::size_t>(config.context);
  const std::size_t B = static_cast<std::size_t>(args.micro_batch);
  const double tokens_per_step =
      static_cast<double>(B * T) * static_cast<double>(ranks) * static_cast<double>(args.grad_accum);
  const double entropy = corpus.unigram_entropy();
  if (lead) {
    const gpt::ActivationBytes act = model.activation_bytes();
    const gpt::ActivationBytes other = gpt::Gpt::plan_activation_bytes(config, args.micro_batch, !args.checkpoint_activations);
    const gpt::ActivationBytes& with = args.checkpoint_activations ? act : other;
    const gpt::ActivationBytes& without = args.checkpoint_activations ? other : act;
    std::printf("zero: GPT %d layers, width %d, %d heads, context %d, vocab %d: %zu parameters; %d ranks (%s), stage %d, "
                "%s, %s\n",
                config.layers, config.width, config.heads, config.context, config.vocab, model.num_params(), ranks,
                args.launch.comm.c_str(), Opt::stage, args.zero.precision.c_str(), args.zero.optimizer.c_str());
    std::printf("data: %s, %zu characters (%zu train, %zu validation), unigram entropy %.4f nats/char\n",
                args.data.c_str(), corpus.tokens.size(), corpus.train_size, corpus.validation_size(), entropy);
    std::printf("batch: %zu windows x %zu characters x %d ranks x %d micro-batches = %.0f tokens/step, %d steps\n", B,
                T, ranks, args.grad_accum, tokens_per_step, args.steps);
    std::printf("activations per rank (arena): %.2f MiB with checkpointing, %.2f MiB without (saved %.2f / %.2f MiB, "
                "scratch %.2f MiB); this run: %s\n",
                mib(with.total()), mib(without.total()), mib(with.saved), mib(without.saved), mib(with.scratch),
                args.checkpoint_activations ? "checkpointing" : "no checkpointing");
    std::fflush(stdout);
  }

  // Checkpoints: the optimizer's state and step count, and what must match
  // for the run to continue where it was (the learning-rate schedule is a
  // function of the step; the data order is replayed below).
  int first_step = 0;
#if defined(ZERO_EXAMPLE_HAVE_CHECKPOINTS)
  auto run_identity = [&] {
    return nlohmann::json{{"trainer", "gpt"},           {"seed", args.seed},         {"steps", args.steps},
                          {"micro_batch", args.micro_batch}, {"grad_accum", args.grad_accum}, {"lr", args.lr},
                          {"warmup", args.warmup},       {"min_lr", args.min_lr}};
  };
  if (!args.resume_dir.empty()) {
    const auto loaded = zero::checkpoint::OptimizerIo<Opt>::load(opt, args.resume_dir);
    const nlohmann::json& extra = loaded.manifest.run.extra;
    const nlohmann::json identity = run_identity();  // (items() refers to it)
    for (const auto& [key, value] : identity.items())
      zero::require(extra.contains(key) && extra[key] == value, "--resume ", loaded.directory.string(),
                    ": the checkpoint was saved by a run with ", key, " ",
                    extra.contains(key) ? extra[key].dump() : std::string("(none)"), ", this run has ", value.dump(),
                    "; resume with the same --seed, --steps, --micro-batch, --grad-accum, --lr, --warmup and --min-lr");
    first_step = static_cast<int>(opt.step_count());
    zero::require(first_step <= args.steps, "--resume ", loaded.directory.string(), ": the checkpoint is at step ",
                  first_step, ", past --steps ", args.steps);
    if (lead) std::printf("resumed from %s at step %d\n", loaded.directory.string().c_str(), first_step);
  }
  zero::examples::CheckpointSaves saves(args, lead);
  auto save = [&] {
    saves.saved(zero::checkpoint::OptimizerIo<Opt>::save_step(opt, args.save_dir, saves.options(run_identity())));
  };
  auto finish_saves = [&] {  // --save-async: completes the last save
    opt.wait_save();
    saves.finished();
  };
#else
  auto save = [] {};
  auto finish_saves = [] {};
#endif

  // Each rank draws its own windows from the training split; a resumed run
  // replays the draws of the steps before its checkpoint, so (on the same
  // ranks) it sees the windows an uninterrupted run would.
  std::mt19937_64 draw(args.seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(comm.rank()) + 1);
  std::uniform_int_distribution<std::size_t> start(0, corpus.train_size - T - 1);
  for (std::size_t k = 0; k < static_cast<std::size_t>(first_step) * args.grad_accum * B; ++k) start(draw);
  std::vector<std::uint8_t> x(B * T), y(B * T);
  double train_sum = 0.0, train_seconds = 0.0;
  int train_count = 0, interval_steps = 0;
  double val = 0.0;
  auto interval_start = std::chrono::steady_clock::now();
  for (int step = first_step; step < args.steps; ++step) {
    opt.hyper().lr = learning_rate(args, step);
    for (int micro = 0; micro < args.grad_accum; ++micro) {
      for (std::size_t i = 0; i < B; ++i) {
        const std::size_t s = start(draw);
        std::copy(corpus.train() + s, corpus.train() + s + T, x.begin() + static_cast<std::ptrdiff_t>(i * T));
        std::copy(corpus.train() + s + 1, corpus.train() + s + T + 1, y.begin() + static_cast<std::ptrdiff_t>(i * T));
      }
      // The gradient of the mean loss over this micro-batch (the optimizer
      // averages over ranks and micro-batches); fp16's is of the scaled loss.
      const float grad_scale = static_cast<float>(opt.loss_scale() / static_cast<double>(B * T));
      train_sum += model.forward_backward(x.data(), y.data(), static_cast<int>(B), params, grads, grad_scale);
      ++train_count;
      opt.step();
    }
    ++interval_steps;
    const bool last = step + 1 == args.steps;
    if ((step + 1) % args.eval_every == 0 || last) {
      const auto now = std::chrono::steady_clock::now();
      const double seconds = std::chrono::duration<double>(now - interval_start).count();
      train_seconds += seconds;
      double totals[2] = {train_sum, static_cast<double>(train_count)};
      comm.all_reduce(totals, 2, zero::DType::f64, zero::comm::ReduceOp::sum, true);
      val = validation_loss(comm, model, params, corpus);
      if (lead) {
        std::printf("step %d/%d  train_loss %.4f  val_loss %.4f nats/char  %.0f tokens/s  model states %.3f MiB/rank  "
                    "lr %.2e  %.1f s\n",
                    step + 1, args.steps, totals[0] / totals[1], val, tokens_per_step * interval_steps / seconds,
                    mib(opt.memory_report().model_states()), opt.hyper().lr, train_seconds);
        std::fflush(stdout);
      }
      train_sum = 0.0;
      train_count = 0;
      interval_steps = 0;
    }
    if ((step + 1) % args.eval_every == 0 || last)
      interval_start = std::chrono::steady_clock::now();  // evaluation is not training time
    if (!args.save_dir.empty() && (last || (args.save_every > 0 && (step + 1) % args.save_every == 0))) {
      const auto before = std::chrono::steady_clock::now();
      save();
      interval_start += std::chrono::steady_clock::now() - before;  // nor is saving
    }
  }
  finish_saves();
  // With --resume at the last step, no evaluation ran: the loss of the model as loaded.
  if (first_step == args.steps) val = validation_loss(comm, model, params, corpus);
  const int steps_run = std::max(1, args.steps - first_step);
  const double total_tokens = tokens_per_step * static_cast<double>(steps_run);
  std::vector<std::uint8_t> prompt(corpus.validation(), corpus.validation() + std::min<std::size_t>(T / 2, 64));
  const std::string sample = generate(comm, model, params, corpus, prompt, args.sample, args.seed);
  if (lead) {
    std::printf("training: %.1f s, %.0f tokens/s, %.1f ms/step\n", train_seconds, total_tokens / train_seconds,
                1e3 * train_seconds / steps_run);
    std::printf("sample (prompt from the validation text, then %d generated characters):\n%s[%s]\n", args.sample,
                corpus.decode(prompt.data(), prompt.size()).c_str(), sample.c_str());
    if (args.report) std::printf("%s\n%s\n", opt.memory_report().to_json().c_str(), opt.comm_report().to_json().c_str());
    std::printf("validation loss %.4f nats/char, unigram entropy %.4f nats/char\n", val, entropy);
  }
  return val;
}

template <class Comm>
double dispatch(Comm& comm, const Args& a, const gpt::TextCorpus& corpus) {
  return zero::examples::with_optimizer_type<zero::offload::None, zero::backend::Host>(
      a.zero, [&]<class Opt>() { return train_rank<Opt>(comm, a, corpus); });
}

// OpenBLAS's thread count is process-wide: the cores over the ranks that share them.
void set_blas_threads(int ranks_sharing_cores) {
#if defined(OPENBLAS_VERSION)
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  openblas_set_num_threads(std::max(1, cores / ranks_sharing_cores));
#else
  (void)ranks_sharing_cores;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  zero::examples::use_openblas_kernels_for_this_cpu(argv);
  try {
#if defined(ZERO_EXAMPLE_HAVE_MPI)
    std::unique_ptr<zero::comm::MpiRuntime> mpi_runtime;
#endif
    Args args;
    CLI::App app("Trains a character-level GPT on The Devil's Dictionary with ZeRO on CPU ranks; prints the losses "
                 "every --eval-every steps and ends with val_loss=<value>.",
                 "gpt_train");
    add_options(app, args);
    zero::examples::parse_or_exit(app, argc, argv);
    const gpt::TextCorpus corpus = gpt::load_corpus(args.data, args.model.context);
    double val = 0;
    if (args.launch.comm == "local") {
      set_blas_threads(args.launch.ranks);
      zero::comm::LocalGroup group(args.launch.ranks);
      group.run([&](zero::comm::Local& comm) {
        const double v = dispatch(comm, args, corpus);
        if (comm.rank() == 0) val = v;
      });
    } else {
#if defined(ZERO_EXAMPLE_HAVE_MPI)
      mpi_runtime = std::make_unique<zero::comm::MpiRuntime>(&argc, &argv);
      zero::comm::Mpi comm;
      args.launch.ranks = comm.size();
      set_blas_threads(comm.size());
#if ZERO_HAS_OPENMP
      omp_set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / comm.size()));
#endif
      val = dispatch(comm, args, corpus);
      if (comm.rank() != 0) return 0;
#else
      zero::examples::fail_option(app, "--comm", "mpi: this build has no MPI support (install libopenmpi-dev and reconfigure)");
#endif
    }
    std::printf("val_loss=%.4f\n", val);
    return 0;
  } catch (const std::exception& e) {
#if defined(ZERO_EXAMPLE_HAVE_MPI)
    zero::comm::abort_mpi_job(e.what());
#endif
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
