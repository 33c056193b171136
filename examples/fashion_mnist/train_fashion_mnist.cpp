// The main job: an MLP 784-256-128-10 trained on Fashion-MNIST with ZeRO, on
// CPU ranks (in-process threads, or MPI processes). Each layer is a unit; the
// optimizer owns every parameter and gradient, the model owns none.
//
//   train_fashion_mnist [--ranks 4] [--comm local|mpi] [--stage 3]
//                       [--precision fp32|bf16|fp16] [--optimizer adamw|adam|sgd]
//                       [--epochs 8] [--batch 256] [--lr 0.002] [--seed 1]
//                       [--data DIR] [--report] [--history-json FILE]
//                       [--save DIR [--save-every K] [--save-async] [--keep-last K]] [--resume DIR]
//
// (--help lists them with their defaults.) Per epoch it prints loss, test
// accuracy, samples/s and model-state bytes per rank; the last line is
// `test_accuracy=<value>`. --report adds the memory and communication reports
// as JSON; --history-json writes the configuration and the per-epoch figures
// as {"config":{...},"epochs":[{"epoch":1,"loss":...},...]} for plots.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "fashion_mnist/idx_dataset.hpp"
#include "fashion_mnist/mlp.hpp"
#include "common/cli.hpp"
#include "common/launch.hpp"
#include "common/openblas_core.hpp"
#include "common/rank_errors.hpp"
#include "common/zero_config.hpp"
#include "zero/zero.hpp"

#if defined(ZERO_EXAMPLE_HAVE_MPI)
#include "zero/comm/mpi.hpp"
#endif
#if defined(ZERO_EXAMPLE_HAVE_CHECKPOINTS)
#include "common/checkpoints.hpp"
#endif

namespace {

struct Args : zero::examples::CheckpointChoices {  // --save, --resume, ... (common/cli.hpp)
  zero::Config zero;  // --config FILE, --stage, --precision, --optimizer, --offload, ... (common/cli.hpp)
  zero::examples::LaunchChoices launch;
  int epochs = 8;
  int batch = 256;
  double lr = 2e-3;
  std::uint64_t seed = 1;
  std::string data = fashion_mnist::kDefaultDataDir;
  bool report = false;
  std::string history_json;  // empty: none
};

void add_options(CLI::App& app, Args& a) {
  zero::examples::add_launch_options(app, a.launch, {"local", "mpi"});
  zero::examples::add_config_options(app, a.zero, {.offload_tiers = zero::examples::built_offload_tiers()});
  app.add_option("--epochs", a.epochs, "passes over the 60000 training images")
      ->check(CLI::Range(1, 10000))
      ->capture_default_str();
  app.add_option("--batch", a.batch, "global batch (split evenly over the ranks)")
      ->check(CLI::Range(1, 60000))
      ->capture_default_str();
  app.add_option("--lr", a.lr, "peak learning rate (cosine decay to 0 over the run)")
      ->check(zero::examples::kPositive)
      ->capture_default_str();
  app.add_option("--seed", a.seed, "initial weights and shuffling (the same on every rank)")->capture_default_str();
  app.add_option("--data", a.data, "folder of the Fashion-MNIST idx files")->type_name("DIR")->capture_default_str();
  app.add_flag("--report", a.report, "print the memory and communication reports as JSON at the end");
  app.add_option("--history-json", a.history_json,
                 "write the configuration and per-epoch loss, test_accuracy, samples_per_s and seconds as JSON")
      ->type_name("FILE");
  zero::examples::add_checkpoint_options(
      app, a, "at the end of every epoch",
      "any --ranks, --stage, --offload; the same --batch, --epochs, --seed, --lr and --optimizer");
  app.callback([&a] {
    zero::examples::check_config_options(a.zero, false, {.offload_tiers = zero::examples::built_offload_tiers()});
    zero::examples::check_checkpoint_choices(a);
    if (a.launch.comm == "local" && a.batch % a.launch.ranks != 0)
      throw CLI::ValidationError("--batch", std::to_string(a.batch) + " is not a multiple of --ranks " +
                                                std::to_string(a.launch.ranks));
  });
}

// One epoch as --history-json records it.
struct EpochRecord {
  int epoch;
  double loss, test_accuracy, samples_per_s, seconds;
};

void write_history(const std::string& path, const Args& a, int ranks, std::size_t parameters,
                   const std::vector<EpochRecord>& epochs) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  zero::require(f != nullptr, "--history-json: cannot write '", path, "': ", std::strerror(errno));
  std::fprintf(f,
               "{\"config\":{\"model\":\"mlp-784-256-128-10\",\"parameters\":%zu,\"ranks\":%d,\"comm\":\"%s\","
               "\"stage\":%d,\"precision\":\"%s\",\"optimizer\":\"%s\",\"epochs\":%d,\"batch\":%d,"
               "\"lr\":%.17g,\"seed\":%llu},\n \"epochs\":[",
               parameters, ranks, a.launch.comm.c_str(), a.zero.stage, zero::name(a.zero.precision),
               a.zero.optimizer.c_str(), a.epochs, a.batch, a.lr, static_cast<unsigned long long>(a.seed));
  for (std::size_t i = 0; i < epochs.size(); ++i) {
    const EpochRecord& e = epochs[i];
    std::fprintf(f, "%s\n  {\"epoch\":%d,\"loss\":%.9g,\"test_accuracy\":%.9g,\"samples_per_s\":%.9g,\"seconds\":%.9g}",
                 i == 0 ? "" : ",", e.epoch, e.loss, e.test_accuracy, e.samples_per_s, e.seconds);
  }
  std::fprintf(f, "]}\n");
  zero::require(std::fclose(f) == 0, "--history-json: writing '", path, "' failed: ", std::strerror(errno));
}

// The optimizer the choices name (zero::make_optimizer: one engine per
// precision and optimizer, whatever the stage and tier), holding the model's
// layers (one unit each, [W][b] adjacent), initialised from the seed: the
// same on every rank. `units` receives the layers' unit ids.
std::unique_ptr<zero::AnyOptimizer> make_mlp_optimizer(zero::comm::AnyCommunicator& comm, const Args& args,
                                                       const fashion_mnist::Mlp& model, std::vector<zero::UnitId>& units) {
  auto opt = zero::examples::make_example_optimizer<zero::backend::Host>(
      comm, zero::examples::example_config(args.zero, args.lr, [&](zero::Options& o) { o.seed = args.seed; }));
  const int layers = model.num_layers();
  std::vector<zero::ParamId> weights;
  for (int l = 0; l < layers; ++l) {
    const auto& shape = model.layers()[static_cast<std::size_t>(l)];
    units.push_back(opt->add_unit("fc" + std::to_string(l)));
    const auto out = static_cast<std::uint64_t>(shape.out), in = static_cast<std::uint64_t>(shape.in);
    weights.push_back(opt->add_param(units.back(), "fc" + std::to_string(l) + ".weight", shape.weight_numel(), {out, in}));
    const auto bias = opt->add_param(units.back(), "fc" + std::to_string(l) + ".bias", static_cast<std::size_t>(shape.out), {out});
    // The model reads [W][b] as one span: the layout must keep them adjacent.
    zero::require(opt->layout().param(bias).offset == shape.bias_offset(),
                  "layer ", l, ": bias does not follow the weight in the unit layout");
  }
  opt->finalize();
  for (int l = 0; l < layers; ++l) {  // same seed on every rank: same initial model
    const auto& shape = model.layers()[static_cast<std::size_t>(l)];
    std::vector<float> init(shape.numel());
    fashion_mnist::Mlp::init_layer(shape, init.data(), args.seed * 1000 + static_cast<std::uint64_t>(l));
    opt->set_param(weights[static_cast<std::size_t>(l)], init.data());
  }
  return opt;
}

// One rank's training run. Every rank runs this in lockstep.
double train_rank(zero::comm::AnyCommunicator& comm, const Args& args, const fashion_mnist::FashionMnist& data) {
  const bool lead = comm.rank() == 0;
  const int ranks = comm.size();
  fashion_mnist::Mlp model;
  std::vector<zero::UnitId> units;
  const std::unique_ptr<zero::AnyOptimizer> optimizer = make_mlp_optimizer(comm, args, model, units);
  zero::AnyOptimizer& opt = *optimizer;
  // The model computes in fp32 whatever the storage (the optimizer's fp32 calls convert one layer at a time).
  const int layers = model.num_layers();
  auto unit = [&](int l) { return units[static_cast<std::size_t>(l)]; };
  // Forward through the layers in order, each layer's unit held for its
  // layer only: stage 3 gathers it in acquire and frees it in release.
  auto forward = [&](const float* images, int n) {
    model.start(images, n);
    for (int l = 0; l < layers; ++l) {
      model.forward(l, opt.acquire_fp32(unit(l)));
      opt.release_unit(unit(l));
    }
  };

  const int local_batch = args.batch / ranks;
  const std::size_t features = data.train.features();
  const std::size_t steps_per_epoch = data.train.count / static_cast<std::size_t>(args.batch);
  const std::size_t total_steps = steps_per_epoch * static_cast<std::size_t>(args.epochs);
  std::vector<std::size_t> order(data.train.count);
  std::mt19937_64 shuffle(args.seed);
  std::vector<float> x(static_cast<std::size_t>(local_batch) * features);
  std::vector<std::uint8_t> y(static_cast<std::size_t>(local_batch));
  std::vector<int> predicted;
  double accuracy = 0;
  zero::CommReport last_train_comm;
  std::vector<EpochRecord> history;

  if (lead)
    std::printf("zero: Fashion-MNIST MLP 784-256-128-10, %d ranks (%s), stage %d, %s, %s, batch %d, %d epochs, "
                "%zu parameters\n",
                ranks, args.launch.comm.c_str(), args.zero.stage, zero::name(args.zero.precision), args.zero.optimizer.c_str(), args.batch,
                args.epochs, model.num_params());

  // This rank's correct test predictions: each rank predicts a slice, the
  // caller sums the counts.
  auto count_correct = [&] {
    const std::size_t per_rank = (data.test.count + static_cast<std::size_t>(ranks) - 1) / static_cast<std::size_t>(ranks);
    const std::size_t begin = std::min(data.test.count, per_rank * static_cast<std::size_t>(comm.rank()));
    const std::size_t end = std::min(data.test.count, begin + per_rank);
    double correct = 0;
    for (std::size_t b = begin; b < data.test.count && b < per_rank * static_cast<std::size_t>(comm.rank() + 1);) {
      const int n = static_cast<int>(std::min<std::size_t>(1000, end - b));
      predicted.resize(static_cast<std::size_t>(n));
      forward(data.test.image(b), n);
      model.predictions(predicted.data());
      for (int i = 0; i < n; ++i) correct += predicted[static_cast<std::size_t>(i)] == data.test.labels[b + static_cast<std::size_t>(i)];
      b += static_cast<std::size_t>(n);
    }
    // Ranks run the same number of forward passes (stage 3 gathers are collective).
    const int my_batches = static_cast<int>((end - begin + 999) / 1000);
    const int max_batches = static_cast<int>((per_rank + 999) / 1000);
    for (int extra = my_batches; extra < max_batches; ++extra) forward(data.test.image(0), 1);
    return correct;
  };

  // Checkpoints: where the run is, what must match to continue it, and the
  // epoch's loss so far. Where the run is counts batches, not the optimizer's
  // steps: fp16 skips the step of a batch whose gradients overflowed, and a
  // resume at the optimizer's step count would train those batches again.
  std::size_t start_step = 0;
  std::size_t batches_done = 0;
  double resumed_loss_mean_sum = 0;  // sum over the epoch's steps so far of the batch-mean loss
#if defined(ZERO_EXAMPLE_HAVE_CHECKPOINTS)
  auto run_identity = [&] {
    return nlohmann::json{{"batch", args.batch}, {"epochs", args.epochs}, {"seed", args.seed}, {"lr", args.lr}};
  };
  if (!args.resume_dir.empty()) {
    const auto loaded = opt.load(args.resume_dir);
    const nlohmann::json& extra = loaded.manifest.run.extra;
    const nlohmann::json identity = run_identity();
    for (const auto& [key, value] : identity.items())
      zero::require(extra.contains(key) && extra[key] == value, "--resume ", loaded.directory.string(),
                    ": the checkpoint was saved by a run with --", key, " ",
                    extra.contains(key) ? extra[key].dump() : std::string("(none)"), ", this run has ", value.dump(),
                    "; resume with the same --batch, --epochs, --seed and --lr");
    const std::int64_t position = zero::examples::resume_position(extra, "batches_done", opt.step_count());
    zero::require(position >= 0 && static_cast<std::size_t>(position) <= total_steps, "--resume ",
                  loaded.directory.string(), ": the checkpoint is at step ", position, ", outside the run's ",
                  total_steps, " steps; is its manifest.json damaged?");
    start_step = static_cast<std::size_t>(position);
    resumed_loss_mean_sum = extra.value("epoch_loss_mean_sum", 0.0);
    if (lead && start_step < total_steps)
      std::printf("resumed from %s at step %zu (epoch %zu)\n", loaded.directory.string().c_str(), start_step,
                  start_step / steps_per_epoch + 1);
    else if (lead)
      std::printf("resumed from %s at step %zu (the last: training is complete)\n", loaded.directory.string().c_str(),
                  start_step);
  }
  double loss_sum = 0;  // this rank's, over the epoch's steps
  zero::examples::CheckpointSaves saves(args, lead);
  auto save = [&] {
    double total = loss_sum;  // the epoch's loss so far, summed over ranks
    comm.all_reduce(&total, 1, zero::DType::f64, zero::comm::ReduceOp::sum, true);
    nlohmann::json extra = run_identity();
    extra["epoch_loss_mean_sum"] = resumed_loss_mean_sum + total / static_cast<double>(ranks);
    zero::examples::record_position(extra, "batches_done", static_cast<std::int64_t>(batches_done), opt.step_count());
    saves.saved(opt.save_step(args.save_dir, saves.options(std::move(extra))));
  };
  auto finish_saves = [&] {
    opt.wait_save();
    saves.finished();
  };
#else
  double loss_sum = 0;
  auto save = [] {};
  auto finish_saves = [] {};
#endif
  for (int epoch = 1; epoch <= args.epochs; ++epoch) {
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::shuffle(order.begin(), order.end(), shuffle);  // same permutation on every rank
    const std::size_t epoch_start = static_cast<std::size_t>(epoch - 1) * steps_per_epoch;
    if (epoch_start + steps_per_epoch <= start_step) continue;  // done before the checkpoint
    opt.reset_comm_counters();
    const auto t0 = std::chrono::steady_clock::now();
    const std::size_t first_step = start_step > epoch_start ? start_step - epoch_start : 0;
    loss_sum = 0;
    if (first_step == 0) resumed_loss_mean_sum = 0;
    for (std::size_t s = first_step; s < steps_per_epoch; ++s) {
      const std::size_t first = s * static_cast<std::size_t>(args.batch) +
                                static_cast<std::size_t>(comm.rank()) * static_cast<std::size_t>(local_batch);
      for (int i = 0; i < local_batch; ++i) {
        const std::size_t idx = order[first + static_cast<std::size_t>(i)];
        std::memcpy(x.data() + static_cast<std::size_t>(i) * features, data.train.image(idx), features * sizeof(float));
        y[static_cast<std::size_t>(i)] = data.train.labels[idx];
      }
      // Cosine decay to zero over the run.
      const double t = static_cast<double>((epoch - 1) * steps_per_epoch + s) / static_cast<double>(total_steps);
      opt.set_lr(args.lr * 0.5 * (1.0 + std::cos(3.141592653589793 * t)));
      forward(x.data(), local_batch);
      // Each rank's gradient is the mean over its slice (the optimizer averages
      // over ranks); fp16 gradients are of the scaled loss.
      loss_sum += model.loss_gradient(y.data(), static_cast<float>(local_batch / opt.loss_scale()));
      // Backward, last layer first. Each layer's gradient goes to the
      // optimizer as soon as it is written (stages 2 and 3 reduce-scatter it
      // while backward goes on); the layer's parameters pass the gradient on
      // to the layer before.
      for (int l = layers - 1; l >= 0; --l) {
        const float* w = opt.acquire_fp32(unit(l));
        model.param_gradient(l, opt.grad_buffer_fp32(unit(l)));
        opt.grad_ready(unit(l));
        if (l > 0) model.input_gradient(l, w);
        opt.release_unit(unit(l));
      }
      opt.step();
      batches_done = epoch_start + s + 1;
      if (!args.save_dir.empty() && args.save_every > 0 && batches_done % args.save_every == 0 &&
          s + 1 < steps_per_epoch)
        save();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    last_train_comm = opt.comm_report();

    double totals[2] = {count_correct(), loss_sum + resumed_loss_mean_sum};  // (each rank adds the mean: totals are means x ranks)
    comm.all_reduce(totals, 2, zero::DType::f64, zero::comm::ReduceOp::sum, true);
    accuracy = totals[0] / static_cast<double>(data.test.count);
    if (lead) {
      const auto mem = opt.memory_report();
      const EpochRecord record{epoch, totals[1] / static_cast<double>(static_cast<std::size_t>(ranks) * steps_per_epoch),
                               accuracy,
                               static_cast<double>((steps_per_epoch - first_step) * static_cast<std::size_t>(args.batch)) / seconds,
                               seconds};
      history.push_back(record);
      std::printf("epoch %d/%d  loss %.4f  test_accuracy %.4f  %.0f samples/s  %.1f s  model states %.2f MiB/rank  "
                  "traffic %.2f MiB/rank/step  lr %.2e\n",
                  epoch, args.epochs, record.loss, accuracy, record.samples_per_s, seconds,
                  static_cast<double>(mem.model_states()) / 1048576.0, last_train_comm.sent_per_step() / 1048576.0,
                  opt.lr());
      std::fflush(stdout);
    }
    if (!args.save_dir.empty()) {
      loss_sum = 0;  // the next epoch starts from nothing
      resumed_loss_mean_sum = 0;
      save();
    }
  }
  if (start_step >= total_steps) {  // resumed after the last step: no epoch ran to measure the model
    double correct = count_correct();
    comm.all_reduce(&correct, 1, zero::DType::f64, zero::comm::ReduceOp::sum, true);
    accuracy = correct / static_cast<double>(data.test.count);
  }
  finish_saves();
  if (lead && !args.history_json.empty()) write_history(args.history_json, args, ranks, model.num_params(), history);
  if (lead && args.report) {
    std::printf("%s\n%s\n", opt.memory_report().to_json().c_str(), last_train_comm.to_json().c_str());
  }
  return accuracy;
}

}  // namespace

int main(int argc, char** argv) {
  // OpenBLAS's AVX-512 kernels on CPUs Debian's OpenBLAS does not recognise,
  // and sleeping OpenMP waits: the default run took 15 s here without, 7.4 s with.
  zero::examples::tune_host_math_libraries(argv);
  try {
    Args args;
    CLI::App app("Trains an MLP 784-256-128-10 on Fashion-MNIST with ZeRO on CPU ranks; prints one line per "
                 "epoch and ends with test_accuracy=<value>.",
                 "train_fashion_mnist");
    add_options(app, args);
    zero::examples::parse_or_exit(app, argc, argv);
    if (!args.history_json.empty()) {  // fail now rather than after training
      std::FILE* f = std::fopen(args.history_json.c_str(), "w");
      if (f == nullptr) zero::examples::fail_option(app, "--history-json", "cannot write '" + args.history_json + "': " + std::strerror(errno));
      std::fclose(f);
    }
    const auto data = fashion_mnist::load_fashion_mnist(args.data);
    fashion_mnist::use_single_threaded_blas();
    zero::examples::Launch launch(app, args.launch, argc, argv);
    const std::optional<double> accuracy = launch.run([&](zero::comm::AnyCommunicator& comm) {
      // The MPI world's size is known only now (--comm local's --ranks is checked with the options).
      if (args.batch % comm.size() != 0)
        zero::examples::fail_option(app, "--batch", std::to_string(args.batch) +
                                                        " is not a multiple of the MPI world size " +
                                                        std::to_string(comm.size()));
      return train_rank(comm, args, data);
    });
    if (!accuracy) return 0;  // an MPI rank but the first
    std::printf("test_accuracy=%.4f\n", *accuracy);
    return 0;
  } catch (const std::exception& e) {
#if defined(ZERO_EXAMPLE_HAVE_MPI)
    zero::comm::abort_mpi_job(e.what());  // in an MPI run: ends every rank, as the others may wait for this one
#endif
    zero::examples::print_error(e.what());
    return 1;
  }
}
