// A character-level GPT trained on The Devil's Dictionary with ZeRO, on CPU
// ranks (in-process threads, or MPI processes) or on GPUs. The optimizer owns
// every parameter; the model (gpt_model.hpp) is cut into units: the
// embeddings, each transformer block, the final LayerNorm.
//
//   gpt_train [--backend host|cuda] [--ranks 4] [--comm local|mpi|nccl] [--stage 3]
//             [--precision fp32|bf16|fp16] [--optimizer adamw|adam|sgd] [--layers 4] [--width 128]
//             [--heads 4] [--context 128] [--micro-batch 8] [--grad-accum 1] [--lr 6e-3] [--warmup 30]
//             [--min-lr 6e-4] [--clip 1] [--seed 1] [--steps 400] [--eval-every 100]
//             [--checkpoint-activations] [--sample 200] [--data FILE] [--report]
//             [--save DIR [--save-every K] [--save-async] [--keep-last K]] [--resume DIR]
//             [--peak-tflops X] [--nccl-id-file PATH --rank R --world W]
//
// (--help lists them with their defaults.) Every --eval-every steps it prints
// the training loss, the validation loss (nats per character), tokens/s (and
// on a GPU the model FLOPs utilisation) and the model-state bytes per rank;
// at the end a generated sample, the validation loss beside the corpus'
// unigram entropy, and last `val_loss=<value>`.
//
// The training loop is gpt_trainer.hpp, shared with the GPU part
// (gpt_train_cuda.cpp, built in when the build has CUDA): --backend cuda with
// --comm local runs --ranks ranks on one GPU, with --comm nccl one rank per
// GPU (launched by mpirun, or one process per rank with --nccl-id-file).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/launch.hpp"
#include "common/openblas_core.hpp"
#include "common/rank_errors.hpp"
#include "gpt/gpt_host.hpp"
#include "gpt/gpt_trainer.hpp"
#include "gpt/text_corpus.hpp"
#include "zero/zero.hpp"

#if defined(ZERO_EXAMPLE_HAVE_CUDA)
#include "gpt/gpt_train_cuda.hpp"
#endif
#if defined(ZERO_EXAMPLE_HAVE_MPI)
#include "zero/comm/mpi.hpp"
#endif

namespace {

using Args = gpt::TrainArgs;

#if defined(ZERO_EXAMPLE_HAVE_CUDA) && defined(ZERO_EXAMPLE_HAVE_MPI)
// NCCL_UNIQUE_ID_BYTES (nccl.h is only seen by the CUDA part).
constexpr std::size_t kNcclIdBytes = 128;
#endif

// The checks between --backend, --comm and what the GPU part is built with.
void check_backend_choices(const Args& a) {
  const bool cuda = a.backend == "cuda";
#if !defined(ZERO_EXAMPLE_HAVE_CUDA)
  if (cuda)
    throw CLI::ValidationError("--backend cuda", "this gpt_train was built without CUDA; reconfigure with "
                                                 "-Dcuda=enabled on a machine with nvcc (the CUDA toolkit) and rebuild");
#endif
  if (a.launch.comm == "nccl" && !cuda) throw CLI::ValidationError("--comm nccl", "needs --backend cuda");
  if (cuda && a.launch.comm == "mpi")
    throw CLI::ValidationError("--comm mpi", "--backend cuda communicates with --comm nccl (under mpirun, or with "
                                             "--nccl-id-file) or --comm local (ranks on one GPU)");
  if (!a.nccl_id_file.empty() && a.launch.comm != "nccl")
    throw CLI::ValidationError("--nccl-id-file", "needs --comm nccl --backend cuda");
  if (a.nccl_id_file.empty() && (a.nccl_rank != 0 || a.nccl_world != 1))
    throw CLI::ValidationError("--rank/--world", "go with --nccl-id-file (under mpirun, MPI gives them)");
  if (a.nccl_rank >= a.nccl_world)
    throw CLI::ValidationError("--rank", std::to_string(a.nccl_rank) + " is not below --world " +
                                             std::to_string(a.nccl_world));
  // Every precision, optimizer, stage and tier is built into both parts
  // (zero::make_optimizer); only offload cpu needs a device to offload from.
  if (!cuda && a.zero.offload == zero::OffloadTier::cpu)
    throw CLI::ValidationError("--offload cpu", "moves the optimizer state from GPU memory to the host: it needs "
                                                "--backend cuda (on the host backend the state is in host memory "
                                                "already; --offload nvme moves it to disk)");
  zero::examples::check_config_options(a.zero, cuda, {.offload_tiers = zero::examples::built_offload_tiers(true)});
}

void add_options(CLI::App& app, Args& a) {
  zero::examples::add_launch_options(app, a.launch, {"local", "mpi", "nccl"});
  app.add_option("--backend", a.backend,
                 "where the model runs: host (CPU ranks), cuda (GPUs; --comm local: --ranks ranks on one GPU, "
                 "nccl: one rank per GPU)")
      ->check(CLI::IsMember({"host", "cuda"}))
      ->capture_default_str();
  zero::examples::add_config_options(app, a.zero, {.offload_tiers = zero::examples::built_offload_tiers(true)});
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
  app.add_option("--peak-tflops", a.peak_tflops,
                 "--backend cuda: the GPU's peak TFLOPS for the MFU figure (default: the fp32 peak of the device's "
                 "table row, printed at the start)")
      ->check(zero::examples::kPositive);
  app.add_option("--nccl-id-file", a.nccl_id_file,
                 "--comm nccl without mpirun: rank 0 writes the NCCL unique id to PATH, the others read it (a path "
                 "every rank sees, unique to the job); with --rank and --world")
      ->type_name("PATH");
  app.add_option("--rank", a.nccl_rank, "--nccl-id-file: this process's rank")->check(CLI::Range(0, 1 << 20));
  app.add_option("--world", a.nccl_world, "--nccl-id-file: the number of ranks")->check(CLI::Range(1, 1 << 20));
  app.callback([&a] {
    check_backend_choices(a);  // first: without CUDA in the build, that is the problem to name
    zero::examples::check_checkpoint_choices(a);
    if (a.model.width % a.model.heads != 0)
      throw CLI::ValidationError("--heads", std::to_string(a.model.heads) + " does not divide --width " +
                                                std::to_string(a.model.width));
    if (a.min_lr > a.lr)
      throw CLI::ValidationError("--min-lr", "is above --lr; the decay ends at --min-lr");
  });
}

// One rank's run on the host, with the optimizer --stage, --precision,
// --optimizer and --offload name (zero::make_optimizer).
double train_rank_on_host(zero::comm::AnyCommunicator& comm, const Args& a, const gpt::TextCorpus& corpus) {
  const gpt::MakeOptimizer make_optimizer = [&a](zero::comm::AnyCommunicator& c) {
    return zero::examples::make_example_optimizer<zero::backend::Host>(c, gpt::optimizer_config(a));
  };
  return gpt::train_rank<zero::backend::Host, gpt::Gpt>(comm, a, corpus, make_optimizer);
}

}  // namespace

int main(int argc, char** argv) {
  zero::examples::tune_host_math_libraries(argv);
  try {
    Args args;
    CLI::App app("Trains a character-level GPT on The Devil's Dictionary with ZeRO on CPU ranks or GPUs; prints the losses "
                 "every --eval-every steps and ends with val_loss=<value>.",
                 "gpt_train");
    add_options(app, args);
    zero::examples::parse_or_exit(app, argc, argv);
    const gpt::TextCorpus corpus = gpt::load_corpus(args.data, args.model.context);
    zero::examples::Launch launch(app, args.launch, argc, argv);
    std::optional<double> val;
    if (args.backend == "cuda") {
#if defined(ZERO_EXAMPLE_HAVE_CUDA)
      std::vector<unsigned char> nccl_id;
#if defined(ZERO_EXAMPLE_HAVE_MPI)
      if (args.launch.comm == "nccl" && args.nccl_id_file.empty()) {
        // Under mpirun (or alone): MPI says who is who and carries rank 0's NCCL unique id.
        launch.start_mpi();
        zero::comm::Mpi comm;
        args.nccl_rank = comm.rank();
        args.nccl_world = comm.size();
        std::vector<std::uint64_t> words(kNcclIdBytes / sizeof(std::uint64_t), 0);
        if (comm.rank() == 0) {
          const std::vector<unsigned char> id = gpt::new_nccl_unique_id();
          zero::require(id.size() == kNcclIdBytes, "the NCCL unique id has ", id.size(), " bytes, not ", kNcclIdBytes);
          std::memcpy(words.data(), id.data(), id.size());
        }
        comm.broadcast(words.data(), words.size(), zero::DType::u64, 0);
        const auto* bytes = reinterpret_cast<const unsigned char*>(words.data());
        nccl_id.assign(bytes, bytes + kNcclIdBytes);
      }
#endif
      if (args.launch.comm == "nccl") args.launch.ranks = args.nccl_world;
      val = gpt::train_on_cuda(args, corpus, nccl_id);
      if (args.launch.comm == "nccl" && args.nccl_rank != 0) return 0;
#else
      throw zero::InvalidArgument("--backend cuda: not built (check_backend_choices refuses it first)");
#endif
    } else {
      val = launch.run([&](zero::comm::AnyCommunicator& comm) { return train_rank_on_host(comm, args, corpus); });
      if (!val) return 0;  // an MPI rank but the first
    }
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
