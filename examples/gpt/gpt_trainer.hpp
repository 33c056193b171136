// Why: the GPT trainer runs on CPU ranks (gpt_train.cpp) and on GPUs
// (gpt_train_cuda.cpp, with the kernels of gpt_cuda.cu), and both must train the same way: the
// same learning-rate schedule, data draws, evaluation, printing and
// checkpoint identity. This is that loop, written once over the model
// (GptModel<HostCompute> or GptModel<CudaCompute>) and compiled once per
// backend: it reaches the optimizer through zero::AnyOptimizer (made by
// zero::make_optimizer from the run's zero::Config: one engine per precision
// and optimizer, whatever the stage and offload tier) and the communicator
// through comm::AnyCommunicator, not as template parameters. Each side only
// makes its optimizer on its backend and adds what is its own (a GPU run's
// MFU and device memory, through TrainHooks).
//
// Token ids go where the model computes once per optimizer step (all the
// step's micro-batches in one copy); the training loss stays there until an
// evaluation reads it, and generation downloads one row of logits per
// character.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/choices.hpp"
#include "common/zero_config.hpp"
#include "gpt/gpt_model.hpp"
#include "gpt/gpt_zero.hpp"
#include "gpt/text_corpus.hpp"
#include "zero/zero.hpp"

#if defined(ZERO_EXAMPLE_HAVE_CHECKPOINTS)
#include "common/checkpoints.hpp"
#endif

namespace gpt {

// The command line of gpt_train (gpt_train.cpp parses it).
struct TrainArgs : zero::examples::CheckpointChoices {  // --save, --resume, ... (common/choices.hpp)
  zero::Config zero = [] {  // --config FILE, --stage, --precision, ... (common/cli.hpp)
    zero::Config z;
    z.stage = 3;
    z.precision = zero::PrecisionChoice::fp32;
    return z;
  }();
  zero::examples::LaunchChoices launch;
  std::string backend = "host";
  Config model;
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
  std::string data = kDefaultCorpus;
  bool report = false;
  // GPU runs (--backend cuda).
  double peak_tflops = 0.0;  // MFU's peak (0: from the device's name)
  std::string nccl_id_file;  // --comm nccl bootstrapped through this file (empty: MPI, or one rank)
  int nccl_rank = 0, nccl_world = 1;
};

// Linear warm-up, then cosine decay to min_lr at the last step.
inline double learning_rate(const TrainArgs& a, int step) {
  if (step < a.warmup) return a.lr * static_cast<double>(step + 1) / static_cast<double>(a.warmup);
  const int span = std::max(1, a.steps - 1 - a.warmup);
  const double t = std::min(1.0, static_cast<double>(step - a.warmup) / static_cast<double>(span));
  return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1.0 + std::cos(3.141592653589793 * t));
}

inline double mib(std::uint64_t bytes) { return static_cast<double>(bytes) / 1048576.0; }

// What one side adds to the shared loop (either may be empty). Called on
// every rank; the lead prints.
struct TrainHooks {
  // Appended to each progress line and the final speed line, given the
  // tokens/s just measured (a GPU run: its MFU).
  std::function<std::string(double tokens_per_second)> rate_note;
  // After the last step, every unit allocated (a GPU run: device memory
  // against the optimizer's report). Collective.
  std::function<void(const zero::MemoryReport&, const ActivationBytes&)> after_training;
};

// Sums a few doubles over the ranks. Collectives take backend memory (device
// memory on a GPU), so the values travel through a small buffer there.
template <class Ops>
class RankSum {
 public:
  explicit RankSum(zero::comm::AnyCommunicator& comm) : comm_(comm), buffer_(kMax) {}
  void operator()(double* values, std::size_t n) {
    zero::require(n <= kMax, "RankSum: ", n, " values; at most ", kMax);
    Ops::upload(buffer_.data(), values, n);
    comm_.all_reduce(buffer_.data(), n, zero::DType::f64, zero::comm::ReduceOp::sum, true);
    Ops::download(values, buffer_.data(), n);
  }

 private:
  static constexpr std::size_t kMax = 4;
  zero::comm::AnyCommunicator& comm_;
  typename Ops::template Buffer<double> buffer_;
};

// The validation windows (consecutive, stride --context) are dealt round-robin
// to the ranks; every rank runs the same number of forward passes (stage 3
// gathers are collective), a rank without windows left running one without
// targets (no loss).
template <class Model, class Sum>
double validation_loss(Sum& sum, int rank, int ranks, Model& model, const ParamHooks& params,
                       const TextCorpus& corpus) {
  const std::size_t T = static_cast<std::size_t>(model.config().context);
  const std::size_t windows = (corpus.validation_size() - 1) / T;
  const std::size_t n_ranks = static_cast<std::size_t>(ranks), me = static_cast<std::size_t>(rank);
  const std::size_t mine = windows / n_ranks + (me < windows % n_ranks ? 1 : 0);
  const std::size_t most = (windows + n_ranks - 1) / n_ranks;
  const std::size_t B = static_cast<std::size_t>(model.max_batch());
  const std::size_t rounds = (most + B - 1) / B;
  std::vector<std::uint8_t> x(B * T), y(B * T);
  const std::uint8_t* val = corpus.validation();
  for (std::size_t r = 0, next = 0; r < rounds; ++r) {
    const std::size_t n = std::min(B, mine - std::min(mine, next));
    const std::size_t batch = std::max<std::size_t>(n, 1);
    for (std::size_t i = 0; i < batch; ++i) {
      const std::size_t w = n == 0 ? 0 : (next + i) * n_ranks + me;  // this rank's (next+i)-th window
      std::copy(val + w * T, val + w * T + T, x.begin() + static_cast<std::ptrdiff_t>(i * T));
      std::copy(val + w * T + 1, val + w * T + T + 1, y.begin() + static_cast<std::ptrdiff_t>(i * T));
    }
    model.forward(model.stage(x.data(), n > 0 ? y.data() : nullptr, batch), static_cast<int>(batch), params);
    next += n;
  }
  const auto taken = model.take_loss_sum();
  double totals[2] = {taken.sum, static_cast<double>(taken.tokens)};
  sum(totals, 2);
  return totals[0] / totals[1];
}

// `length` characters continuing `prompt`, sampled at temperature 0.8 by rank
// 0 and shared with the others (every rank runs every forward pass).
template <class Model, class Sum>
std::string generate(Sum& sum, int rank, Model& model, const ParamHooks& params, const TextCorpus& corpus,
                     std::vector<std::uint8_t> text, int length, std::uint64_t seed) {
  const std::size_t T = static_cast<std::size_t>(model.config().context);
  const int V = model.config().vocab;
  std::mt19937_64 gen(seed);
  std::vector<std::uint8_t> window(T, 0);
  std::vector<float> z(static_cast<std::size_t>(V));
  std::vector<double> weights(static_cast<std::size_t>(V));
  const std::size_t prompt = text.size();
  for (int c = 0; c < length; ++c) {
    const std::size_t len = std::min(T, text.size());
    std::fill(window.begin(), window.end(), std::uint8_t{0});
    std::copy(text.end() - static_cast<std::ptrdiff_t>(len), text.end(), window.begin());
    model.forward(model.stage(window.data(), nullptr, 1), 1, params);  // causal: positions after len - 1 do not matter
    model.compute().download(z.data(), model.logits() + (len - 1) * static_cast<std::size_t>(V), z.size());
    const float top = *std::max_element(z.begin(), z.end());
    for (int v = 0; v < V; ++v) weights[static_cast<std::size_t>(v)] = std::exp((z[static_cast<std::size_t>(v)] - top) / 0.8);
    double next = rank == 0 ? static_cast<double>(std::discrete_distribution<int>(weights.begin(), weights.end())(gen)) : 0.0;
    sum(&next, 1);
    text.push_back(static_cast<std::uint8_t>(next));
  }
  return corpus.decode(text.data() + prompt, text.size() - prompt);
}

// The run's zero::Config: the command line's choices, the schedule's first
// learning rate, and the trainer's options.
inline zero::Config optimizer_config(const TrainArgs& args) {
  return zero::examples::example_config(args.zero, learning_rate(args, 0), [&](zero::Options& o) {
    o.seed = args.seed;
    o.clip_norm = args.clip;
    o.grad_accumulation_steps = args.grad_accum;
  });
}

// Makes this rank's optimizer on a side's backend from optimizer_config(args):
// zero::examples::make_example_optimizer<Backend>(comm, config).
using MakeOptimizer = std::function<std::unique_ptr<zero::AnyOptimizer>(zero::comm::AnyCommunicator&)>;

// One rank's run; every rank runs this in lockstep. Returns the final
// validation loss. Model: GptModel<Compute> built on this rank's thread;
// Backend: where it computes (zero::backend::Host or Cuda).
template <class Backend, class Model>
double train_rank(zero::comm::AnyCommunicator& comm, const TrainArgs& args, const TextCorpus& corpus,
                  const MakeOptimizer& make_optimizer, const TrainHooks& hooks = {}) {
  const bool lead = comm.rank() == 0;
  const int ranks = comm.size();
  Config config = args.model;
  config.vocab = corpus.vocab_size();
  Model model(config, args.micro_batch, args.checkpoint_activations);
  RankSum<zero::backend::Ops<Backend>> sum(comm);
  const std::unique_ptr<zero::AnyOptimizer> optimizer = make_optimizer(comm);
  zero::AnyOptimizer& opt = *optimizer;
  // One optimizer unit per model unit, set to the model's initial weights from --seed.
  ZeroBinding<zero::AnyOptimizer, Model> binding(opt, model);
  opt.finalize();
  binding.adopt_layout();
  binding.set_params([&](int u, int k, float* out) { model.init_param(u, k, out, args.seed); });
  const ParamHooks params = binding.param_hooks();
  const GradHooks grads = binding.grad_hooks();

  const std::size_t T = static_cast<std::size_t>(config.context);
  const std::size_t B = static_cast<std::size_t>(args.micro_batch);
  const std::size_t A = static_cast<std::size_t>(args.grad_accum);
  const double tokens_per_step = static_cast<double>(B * T) * static_cast<double>(ranks) * static_cast<double>(A);
  const double entropy = corpus.unigram_entropy();
  auto note = [&](double tokens_per_second) { return hooks.rate_note ? hooks.rate_note(tokens_per_second) : ""; };
  if (lead) {
    const ActivationBytes act = model.activation_bytes();
    const ActivationBytes other = Model::plan_activation_bytes(config, args.micro_batch, !args.checkpoint_activations);
    const ActivationBytes& with = args.checkpoint_activations ? act : other;
    const ActivationBytes& without = args.checkpoint_activations ? other : act;
    std::printf("zero: GPT %d layers, width %d, %d heads, context %d, vocab %d: %zu parameters; %d ranks (%s), stage %d, "
                "%s, %s, backend %s\n",
                config.layers, config.width, config.heads, config.context, config.vocab, model.num_params(), ranks,
                args.launch.comm.c_str(), args.zero.stage, zero::name(args.zero.precision), args.zero.optimizer.c_str(),
                args.backend.c_str());
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

  // Checkpoints: the optimizer's state, the steps trained, and what must
  // match for the run to continue where it was (the learning-rate schedule is
  // a function of the step; the data order is replayed below). The steps
  // trained are the trainer's count, not the optimizer's: fp16 takes no
  // optimizer step when the gradients overflow, and a resume at the
  // optimizer's step count would train those steps' windows again.
  int first_step = 0;
#if defined(ZERO_EXAMPLE_HAVE_CHECKPOINTS)
  auto run_identity = [&] {
    return nlohmann::json{{"trainer", "gpt"},           {"seed", args.seed},         {"steps", args.steps},
                          {"micro_batch", args.micro_batch}, {"grad_accum", args.grad_accum}, {"lr", args.lr},
                          {"warmup", args.warmup},       {"min_lr", args.min_lr}};
  };
  if (!args.resume_dir.empty()) {
    const auto loaded = opt.load(args.resume_dir);
    const nlohmann::json& extra = loaded.manifest.run.extra;
    const nlohmann::json identity = run_identity();  // (items() refers to it)
    for (const auto& [key, value] : identity.items())
      zero::require(extra.contains(key) && extra[key] == value, "--resume ", loaded.directory.string(),
                    ": the checkpoint was saved by a run with ", key, " ",
                    extra.contains(key) ? extra[key].dump() : std::string("(none)"), ", this run has ", value.dump(),
                    "; resume with the same --seed, --steps, --micro-batch, --grad-accum, --lr, --warmup and --min-lr");
    const std::int64_t position = zero::examples::resume_position(extra, "steps_done", opt.step_count());
    zero::require(position >= 0 && position <= args.steps, "--resume ", loaded.directory.string(),
                  ": the checkpoint is at step ", position, ", past --steps ", args.steps);
    first_step = static_cast<int>(position);
    if (lead) std::printf("resumed from %s at step %d\n", loaded.directory.string().c_str(), first_step);
  }
  zero::examples::CheckpointSaves saves(args, lead);
  auto save = [&](int steps_done) {
    nlohmann::json extra = run_identity();
    zero::examples::record_position(extra, "steps_done", steps_done, opt.step_count());
    saves.saved(opt.save_step(args.save_dir, saves.options(std::move(extra))));
  };
  auto finish_saves = [&] {  // --save-async: completes the last save
    opt.wait_save();
    saves.finished();
  };
#else
  zero::require(args.save_dir.empty() && args.resume_dir.empty(),
                "--save/--resume: this part of gpt_train was built without checkpoints");
  auto save = [](int) {};
  auto finish_saves = [] {};
#endif

  // Each rank draws its own windows from the training split; a resumed run
  // replays the draws of the steps before its checkpoint, so (on the same
  // ranks) it sees the windows an uninterrupted run would.
  std::mt19937_64 draw(args.seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(comm.rank()) + 1);
  std::uniform_int_distribution<std::size_t> start(0, corpus.train_size - T - 1);
  for (std::size_t k = 0; k < static_cast<std::size_t>(first_step) * A * B; ++k) start(draw);
  std::vector<std::uint8_t> x(A * B * T), y(A * B * T);  // the step's micro-batches, back to back
  double train_seconds = 0.0;
  int interval_steps = 0;
  double val = 0.0;
  auto interval_start = std::chrono::steady_clock::now();
  for (int step = first_step; step < args.steps; ++step) {
    opt.set_lr(learning_rate(args, step));
    for (std::size_t i = 0; i < A * B; ++i) {
      const std::size_t s = start(draw);
      std::copy(corpus.train() + s, corpus.train() + s + T, x.begin() + static_cast<std::ptrdiff_t>(i * T));
      std::copy(corpus.train() + s + 1, corpus.train() + s + T + 1, y.begin() + static_cast<std::ptrdiff_t>(i * T));
    }
    const auto tokens = model.stage(x.data(), y.data(), A * B);  // one copy per step
    for (std::size_t micro = 0; micro < A; ++micro) {
      // The gradient of the mean loss over this micro-batch (the optimizer
      // averages over ranks and micro-batches); fp16's is of the scaled loss.
      const float grad_scale = static_cast<float>(opt.loss_scale() / static_cast<double>(B * T));
      model.forward_backward(tokens.at(micro * B), static_cast<int>(B), params, grads, grad_scale);
      opt.step();
    }
    ++interval_steps;
    const bool last = step + 1 == args.steps;
    if ((step + 1) % args.eval_every == 0 || last) {
      const auto train = model.take_loss_sum();  // waits for the interval's work
      const auto now = std::chrono::steady_clock::now();
      const double seconds = std::chrono::duration<double>(now - interval_start).count();
      train_seconds += seconds;
      double totals[2] = {train.sum, static_cast<double>(train.tokens)};
      sum(totals, 2);
      val = validation_loss(sum, comm.rank(), ranks, model, params, corpus);
      if (lead) {
        const double rate = tokens_per_step * interval_steps / seconds;
        std::printf("step %d/%d  train_loss %.4f  val_loss %.4f nats/char  %.0f tokens/s%s  model states %.3f MiB/rank  "
                    "lr %.2e  %.1f s\n",
                    step + 1, args.steps, totals[0] / totals[1], val, rate, note(rate).c_str(),
                    mib(opt.memory_report().model_states()), opt.lr(), train_seconds);
        std::fflush(stdout);
      }
      interval_steps = 0;
      interval_start = std::chrono::steady_clock::now();  // evaluation is not training time
    }
    if (!args.save_dir.empty() && (last || (args.save_every > 0 && (step + 1) % args.save_every == 0))) {
      const auto before = std::chrono::steady_clock::now();
      save(step + 1);
      interval_start += std::chrono::steady_clock::now() - before;  // nor is saving
    }
  }
  finish_saves();
  // With --resume at the last step, no evaluation ran: the loss of the model as loaded.
  if (first_step == args.steps) val = validation_loss(sum, comm.rank(), ranks, model, params, corpus);
  if (hooks.after_training) hooks.after_training(opt.memory_report(), model.activation_bytes());
  const int steps_run = std::max(1, args.steps - first_step);
  const double total_tokens = tokens_per_step * static_cast<double>(steps_run);
  std::vector<std::uint8_t> prompt(corpus.validation(), corpus.validation() + std::min<std::size_t>(T / 2, 64));
  const std::string sample = generate(sum, comm.rank(), model, params, corpus, prompt, args.sample, args.seed);
  // --report: also what all ranks sent, and sent across nodes, summed over
  // the ranks (one more control all-reduce, after the report is taken): what
  // a link between nodes carried, to hold against its own counters
  // (bench/zeropp_link.sh).
  const zero::CommReport comm_report = opt.comm_report();
  double all_ranks[2] = {static_cast<double>(comm_report.counters.total_sent()),
                         static_cast<double>(comm_report.counters.total_across())};
  if (args.report) sum(all_ranks, 2);
  if (lead) {
    const double rate = train_seconds > 0.0 ? total_tokens / train_seconds : 0.0;
    std::printf("training: %.1f s, %.0f tokens/s%s, %.1f ms/step\n", train_seconds, rate, note(rate).c_str(),
                1e3 * train_seconds / steps_run);
    std::printf("sample (prompt from the validation text, then %d generated characters):\n%s[%s]\n", args.sample,
                corpus.decode(prompt.data(), prompt.size()).c_str(), sample.c_str());
    if (args.report)
      std::printf("%s\n%s\n{\"report\":\"communication_all_ranks\",\"ranks\":%d,\"sent_bytes\":%.0f,"
                  "\"across_nodes_sent_bytes\":%.0f}\n",
                  opt.memory_report().to_json().c_str(), comm_report.to_json().c_str(), ranks, all_ranks[0],
                  all_ranks[1]);
    std::printf("validation loss %.4f nats/char, unigram entropy %.4f nats/char\n", val, entropy);
  }
  return val;
}

}  // namespace gpt
