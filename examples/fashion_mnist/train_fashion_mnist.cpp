// The main job: an MLP 784-256-128-10 trained on Fashion-MNIST with ZeRO, on
// CPU ranks (in-process threads, or MPI processes). Each layer is a unit; the
// optimizer owns every parameter and gradient, the model owns none.
//
//   train_fashion_mnist [--ranks 4] [--comm local|mpi] [--stage 3]
//                       [--precision fp32|bf16|fp16] [--optimizer adamw|adam|sgd]
//                       [--epochs 8] [--batch 256] [--lr 0.002] [--seed 1]
//                       [--data DIR] [--report]
//
// Per epoch it prints loss, test accuracy, samples/s and model-state bytes per
// rank; the last line is `test_accuracy=<value>`. --report adds the memory and
// communication reports as JSON.
#include <algorithm>
#include <chrono>
#include <thread>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fashion_mnist/idx_dataset.hpp"
#include "fashion_mnist/mlp.hpp"
#include "zero/zero.hpp"

#if defined(ZERO_EXAMPLE_HAVE_MPI)
#include "zero/comm/mpi.hpp"
#endif

namespace {

struct Args {
  int ranks = 4;
  std::string comm = "local";
  int stage = 3;
  std::string precision = "bf16";
  std::string optimizer = "adamw";
  int epochs = 8;
  int batch = 256;
  double lr = 2e-3;
  std::uint64_t seed = 1;
  std::string data = fashion_mnist::kDefaultDataDir;
  bool report = false;
};

[[noreturn]] void usage(const char* argv0, const std::string& problem) {
  std::fprintf(stderr,
               "%s%s"
               "usage: %s [--ranks N] [--comm local|mpi] [--stage 0..3] [--precision fp32|bf16|fp16]\n"
               "          [--optimizer adamw|adam|sgd] [--epochs E] [--batch B] [--lr X] [--seed S]\n"
               "          [--data DIR] [--report]\n",
               problem.c_str(), problem.empty() ? "" : "\n", argv0);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(argv[0], "error: " + k + " needs a value");
      return argv[++i];
    };
    auto number = [&](const std::string& v) {
      char* end = nullptr;
      const double d = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0') usage(argv[0], "error: " + k + " expects a number, got '" + v + "'");
      return d;
    };
    if (k == "--ranks") a.ranks = static_cast<int>(number(value()));
    else if (k == "--comm") a.comm = value();
    else if (k == "--stage") a.stage = static_cast<int>(number(value()));
    else if (k == "--precision") a.precision = value();
    else if (k == "--optimizer") a.optimizer = value();
    else if (k == "--epochs") a.epochs = static_cast<int>(number(value()));
    else if (k == "--batch") a.batch = static_cast<int>(number(value()));
    else if (k == "--lr") a.lr = number(value());
    else if (k == "--seed") a.seed = static_cast<std::uint64_t>(number(value()));
    else if (k == "--data") a.data = value();
    else if (k == "--report") a.report = true;
    else if (k == "--help" || k == "-h") usage(argv[0], "");
    else usage(argv[0], "error: unknown option '" + k + "'");
  }
  if (a.comm != "local" && a.comm != "mpi") usage(argv[0], "error: --comm must be local or mpi");
  if (a.stage < 0 || a.stage > 3) usage(argv[0], "error: --stage must be 0, 1, 2 or 3");
  if (a.precision != "fp32" && a.precision != "bf16" && a.precision != "fp16")
    usage(argv[0], "error: --precision must be fp32, bf16 or fp16");
  if (a.optimizer != "adamw" && a.optimizer != "adam" && a.optimizer != "sgd")
    usage(argv[0], "error: --optimizer must be adamw, adam or sgd");
  if (a.epochs < 1) usage(argv[0], "error: --epochs must be >= 1");
  if (a.ranks < 1 || a.ranks > 64) usage(argv[0], "error: --ranks must be in [1, 64]");
  if (a.batch < a.ranks || a.batch % a.ranks != 0)
    usage(argv[0], "error: --batch must be a multiple of the number of ranks");
  if (!(a.lr > 0)) usage(argv[0], "error: --lr must be > 0");
  return a;
}

// One rank's training run. Every rank runs this in lockstep.
template <class Opt, class Comm>
double train_rank(Comm& comm, const Args& args, const fashion_mnist::FashionMnist& data) {
  using P = typename Opt::param_type;
  using G = typename Opt::grad_type;
  const bool lead = comm.rank() == 0;
  const int ranks = comm.size();
  fashion_mnist::Mlp model;
  const int layers = model.num_layers();

  typename Opt::Hyper hyper;
  hyper.lr = args.lr;
  if constexpr (std::is_same_v<typename Opt::optimizer_policy, zero::optim::Sgd>) hyper.momentum = 0.9;
  zero::Options options;
  options.seed = args.seed;
  Opt opt(comm, hyper, options);

  std::vector<zero::UnitId> units;
  std::vector<zero::ParamId> weights;
  for (int l = 0; l < layers; ++l) {
    const auto& shape = model.layers()[static_cast<std::size_t>(l)];
    units.push_back(opt.add_unit("fc" + std::to_string(l)));
    weights.push_back(opt.add_param(units.back(), "fc" + std::to_string(l) + ".weight", shape.weight_numel()));
    const auto bias = opt.add_param(units.back(), "fc" + std::to_string(l) + ".bias", static_cast<std::size_t>(shape.out));
    // The model reads [W][b] as one span: the layout must keep them adjacent.
    zero::require(opt.layout().param(bias).offset == shape.bias_offset(),
                  "layer ", l, ": bias does not follow the weight in the unit layout");
  }
  opt.finalize();
  for (int l = 0; l < layers; ++l) {  // same seed on every rank: same initial model
    const auto& shape = model.layers()[static_cast<std::size_t>(l)];
    std::vector<float> init(shape.numel());
    fashion_mnist::Mlp::init_layer(shape, init.data(), args.seed * 1000 + static_cast<std::uint64_t>(l));
    opt.set_param(weights[static_cast<std::size_t>(l)], init.data());
  }

  // fp32 reads the optimizer's buffers directly; 16-bit precisions compute in
  // fp32 on converted copies of one layer at a time.
  constexpr bool convert = !std::is_same_v<P, float>;
  std::vector<std::vector<float>> wide(static_cast<std::size_t>(layers));
  for (int l = 0; l < layers; ++l) wide[static_cast<std::size_t>(l)].resize(model.layers()[static_cast<std::size_t>(l)].numel());
  fashion_mnist::ParamHooks params{
      [&](int l) -> const float* {
        const P* p = opt.acquire_unit(units[static_cast<std::size_t>(l)]);
        if constexpr (convert) {
          auto& w = wide[static_cast<std::size_t>(l)];
          for (std::size_t i = 0; i < w.size(); ++i) w[i] = zero::to_float(p[i]);
          return w.data();
        } else {
          return p;
        }
      },
      [&](int l) { opt.release_unit(units[static_cast<std::size_t>(l)]); }};
  std::vector<float> grad_wide(model.num_params());
  fashion_mnist::GradHooks grads{
      [&](int l) -> float* {
        G* g = opt.grad_buffer(units[static_cast<std::size_t>(l)]);
        if constexpr (convert)
          return grad_wide.data();
        else
          return g;
      },
      [&](int l) {
        const auto u = units[static_cast<std::size_t>(l)];
        if constexpr (convert) {
          G* g = opt.grad_buffer(u);
          const std::size_t n = model.layers()[static_cast<std::size_t>(l)].numel();
          for (std::size_t i = 0; i < n; ++i) g[i] = zero::from_float<G>(grad_wide[i]);
        }
        opt.grad_ready(u);
      }};

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

  if (lead)
    std::printf("zero: Fashion-MNIST MLP 784-256-128-10, %d ranks (%s), stage %d, %s, %s, batch %d, %d epochs, "
                "%zu parameters\n",
                ranks, args.comm.c_str(), Opt::stage, args.precision.c_str(), args.optimizer.c_str(), args.batch,
                args.epochs, model.num_params());
  for (int epoch = 1; epoch <= args.epochs; ++epoch) {
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::shuffle(order.begin(), order.end(), shuffle);  // same permutation on every rank
    opt.reset_comm_counters();
    const auto t0 = std::chrono::steady_clock::now();
    double loss_sum = 0;
    for (std::size_t s = 0; s < steps_per_epoch; ++s) {
      const std::size_t first = s * static_cast<std::size_t>(args.batch) +
                                static_cast<std::size_t>(comm.rank()) * static_cast<std::size_t>(local_batch);
      for (int i = 0; i < local_batch; ++i) {
        const std::size_t idx = order[first + static_cast<std::size_t>(i)];
        std::memcpy(x.data() + static_cast<std::size_t>(i) * features, data.train.image(idx), features * sizeof(float));
        y[static_cast<std::size_t>(i)] = data.train.labels[idx];
      }
      // Cosine decay to zero over the run.
      const double t = static_cast<double>((epoch - 1) * steps_per_epoch + s) / static_cast<double>(total_steps);
      opt.hyper().lr = args.lr * 0.5 * (1.0 + std::cos(3.141592653589793 * t));
      // Each rank's gradient is the mean over its slice (the optimizer averages
      // over ranks); fp16 gradients are of the scaled loss.
      const float divisor = static_cast<float>(local_batch / opt.loss_scale());
      loss_sum += model.forward_backward(x.data(), y.data(), local_batch, params, grads, divisor);
      opt.step();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    last_train_comm = opt.comm_report();

    // Test accuracy: each rank predicts a slice, the counts are summed.
    const std::size_t per_rank = (data.test.count + static_cast<std::size_t>(ranks) - 1) / static_cast<std::size_t>(ranks);
    const std::size_t begin = std::min(data.test.count, per_rank * static_cast<std::size_t>(comm.rank()));
    const std::size_t end = std::min(data.test.count, begin + per_rank);
    double correct = 0;
    for (std::size_t b = begin; b < data.test.count && b < per_rank * static_cast<std::size_t>(comm.rank() + 1);) {
      const int n = static_cast<int>(std::min<std::size_t>(1000, end - b));
      predicted.resize(static_cast<std::size_t>(n));
      model.predict(data.test.image(b), n, params, predicted.data());
      for (int i = 0; i < n; ++i) correct += predicted[static_cast<std::size_t>(i)] == data.test.labels[b + static_cast<std::size_t>(i)];
      b += static_cast<std::size_t>(n);
    }
    // Ranks run the same number of predict calls (stage 3 gathers are collective).
    const int my_batches = static_cast<int>((end - begin + 999) / 1000);
    const int max_batches = static_cast<int>((per_rank + 999) / 1000);
    for (int extra = my_batches; extra < max_batches; ++extra) model.predict(data.test.image(0), 1, params, predicted.data());
    double totals[2] = {correct, loss_sum};
    comm.all_reduce(totals, 2, zero::DType::f64, zero::comm::ReduceOp::sum, true);
    accuracy = totals[0] / static_cast<double>(data.test.count);
    if (lead) {
      const auto mem = opt.memory_report();
      std::printf("epoch %d/%d  loss %.4f  test_accuracy %.4f  %.0f samples/s  %.1f s  model states %.2f MiB/rank  "
                  "traffic %.2f MiB/rank/step  lr %.2e\n",
                  epoch, args.epochs, totals[1] / static_cast<double>(ranks * steps_per_epoch), accuracy,
                  static_cast<double>(steps_per_epoch * static_cast<std::size_t>(args.batch)) / seconds, seconds,
                  static_cast<double>(mem.model_states()) / 1048576.0, last_train_comm.sent_per_step() / 1048576.0,
                  opt.hyper().lr);
      std::fflush(stdout);
    }
  }
  if (lead && args.report) {
    std::printf("%s\n%s\n", opt.memory_report().to_json().c_str(), last_train_comm.to_json().c_str());
  }
  return accuracy;
}

// Maps the runtime choices onto the optimizer types (each is its own instantiation).
template <class Comm>
double dispatch(Comm& comm, const Args& a, const fashion_mnist::FashionMnist& data) {
  auto with_stage = [&]<class Precision, class Optimizer>() -> double {
    switch (a.stage) {
#define ZERO_EXAMPLE_STAGE(S)                                                                                  \
  case S:                                                                                                      \
    return train_rank<zero::ZeroOptimizer<Precision, Optimizer, zero::stage<S>, zero::offload::None,           \
                                          zero::backend::Host>>(comm, a, data);
      ZERO_EXAMPLE_STAGE(0)
      ZERO_EXAMPLE_STAGE(1)
      ZERO_EXAMPLE_STAGE(2)
      ZERO_EXAMPLE_STAGE(3)
#undef ZERO_EXAMPLE_STAGE
    }
    return 0;
  };
  auto with_precision = [&]<class Optimizer>() -> double {
    if (a.precision == "fp32") return with_stage.template operator()<zero::precision::Full<float>, Optimizer>();
    if (a.precision == "bf16") return with_stage.template operator()<zero::precision::Mixed<zero::bf16>, Optimizer>();
    return with_stage.template operator()<zero::precision::Mixed<zero::fp16>, Optimizer>();
  };
  if (a.optimizer == "adamw") return with_precision.template operator()<zero::optim::AdamW>();
  if (a.optimizer == "adam") return with_precision.template operator()<zero::optim::Adam>();
  return with_precision.template operator()<zero::optim::Sgd>();
}

}  // namespace

int main(int argc, char** argv) {
  try {
#if defined(ZERO_EXAMPLE_HAVE_MPI)
    std::unique_ptr<zero::comm::MpiRuntime> mpi_runtime;
#endif
    Args args = parse(argc, argv);
    const auto data = fashion_mnist::load_fashion_mnist(args.data);
    fashion_mnist::use_single_threaded_blas();
    double accuracy = 0;
    if (args.comm == "local") {
      zero::comm::LocalGroup group(args.ranks);
      group.run([&](zero::comm::Local& comm) {
        const double acc = dispatch(comm, args, data);
        if (comm.rank() == 0) accuracy = acc;
      });
    } else {
#if defined(ZERO_EXAMPLE_HAVE_MPI)
      mpi_runtime = std::make_unique<zero::comm::MpiRuntime>(&argc, &argv);
      zero::comm::Mpi comm;
      args.ranks = comm.size();
#if ZERO_HAS_OPENMP
      // Processes on one machine share its cores: split them, as LocalGroup does for threads.
      omp_set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / comm.size()));
#endif
      if (args.batch % comm.size() != 0) usage(argv[0], "error: --batch must be a multiple of the MPI world size");
      accuracy = dispatch(comm, args, data);
      if (comm.rank() != 0) return 0;
#else
      usage(argv[0], "error: this build has no MPI support (install libopenmpi-dev and reconfigure)");
#endif
    }
    std::printf("test_accuracy=%.4f\n", accuracy);
    return 0;
  } catch (const std::exception& e) {
#if defined(ZERO_EXAMPLE_HAVE_MPI)
    zero::comm::abort_mpi_job(e.what());  // in an MPI run: ends every rank, as the others may wait for this one
#endif
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
