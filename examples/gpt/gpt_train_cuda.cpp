// The GPU part of gpt_train (--backend cuda): builds the ranks, the CUDA
// model (GptModel<CudaCompute>) and the optimizer on backend::Cuda, runs the
// shared training loop (gpt_trainer.hpp), and adds what only a GPU run
// reports: model FLOPs utilisation and device memory against the
// optimizer's memory_report().
//
// Compile time is the budget here (CI has two cores): this file is host code,
// compiled by the host compiler (nvcc compiles only the kernels: the model's
// in gpt_cuda.cu, the library's in src/zero_kernels_cuda.cu). The optimizer
// comes from zero::make_optimizer, which compiles one engine per precision
// and optimizer (twelve) and takes the stage and the offload tier (none, cpu,
// nvme) as values, so every choice the host accepts is built in; the build
// compiles those engines once, apart (src/zero_engines_cuda.cpp, side by
// side with this file), and this file declares them extern.
// Checkpoints (--save, --resume) are the shared loop's, built in where Meson
// found their headers: the optimizer's I/O reads and writes device state
// through backend::Ops, as on the host.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpt/gpt_cuda.hpp"
#include "gpt/gpt_flops.hpp"
#include "gpt/gpt_train_cuda.hpp"
#include "gpt/gpt_trainer.hpp"
#include "common/zero_config.hpp"
#include "zero/zero_cuda.hpp"
#if defined(ZERO_EXAMPLE_HAVE_NCCL)
#include "zero/comm/nccl.hpp"
#endif
#if defined(ZERO_PRECOMPILED_CUDA_ENGINES)  // compiled once, apart: src/zero_engines_cuda.cpp
#include "zero/runtime/precompiled.hpp"
ZERO_EXTERN_ENGINES(::zero::backend::Cuda)
ZERO_EXTERN_HANDLES(::zero::backend::Cuda)
#endif

namespace gpt {
namespace {

struct Device {
  int index = 0;
  std::string name;
  int sms = 0;
  double clock_ghz = 0.0;
  int major = 0, minor = 0;
  std::size_t total_bytes = 0;
};

int device_count() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();  // not sticky: clear it
    throw zero::BackendError(zero::detail::concat(
        "--backend cuda: no CUDA device (cudaGetDeviceCount: ", e == cudaSuccess ? "0 devices" : cudaGetErrorString(e),
        "); run on a machine with an NVIDIA GPU and its driver, or use --backend host"));
  }
  return n;
}

Device describe(int index) {
  cudaDeviceProp prop{};
  ZERO_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  int clock_khz = 0;
  ZERO_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, index));
  return {index, prop.name, prop.multiProcessorCount, clock_khz / 1e6, prop.major, prop.minor, prop.totalGlobalMem};
}

std::size_t free_device_bytes() {
  std::size_t free = 0, total = 0;
  ZERO_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return free;
}

// This process's GPU for --comm nccl: its rank on this node, as launchers
// name it, or the rank itself (one node), over the devices there are.
int nccl_device(int rank, int devices) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"})
    if (const char* v = std::getenv(name)) return std::atoi(v) % devices;
  return rank % devices;
}

// What the lead prints before training, and the MFU note of each speed.
TrainHooks gpu_hooks(const TrainArgs& args, const Device& device, int gpus, const Config& model, bool lead) {
  const PeakThroughput peak = peak_throughput(device.name, device.sms, device.clock_ghz, device.major, device.minor);
  const double fpt = flops_per_token(model);
  const double fp32 = args.peak_tflops > 0.0 ? args.peak_tflops : peak.fp32_tflops;
  if (lead) std::printf("gpu: %s (cc %d.%d, %d SMs, %.2f GHz, %.1f GiB) x %d; %.4g FLOPs/token (6N + 12 L C T); MFU against "
              "%.1f TFLOPS per GPU (%s; the model's products are fp32, TF32 off)%s\n",
              device.name.c_str(), device.major, device.minor, device.sms, device.clock_ghz,
              static_cast<double>(device.total_bytes) / (1 << 30), gpus, fpt, fp32,
              args.peak_tflops > 0.0 ? "--peak-tflops" : (peak.source + " fp32 peak").c_str(),
              peak.bf16_tensor_tflops > 0.0
                  ? zero::detail::concat(", and bf16 tensor MFU against ", peak.bf16_tensor_tflops, " TFLOPS").c_str()
                  : "");
  std::fflush(stdout);
  TrainHooks hooks;
  const double bf16 = peak.bf16_tensor_tflops;
  hooks.rate_note = [=](double tokens_per_second) {
    const double per_gpu = tokens_per_second / gpus;
    char note[96];
    if (bf16 > 0.0)
      std::snprintf(note, sizeof note, "  MFU %.2f%% (bf16 tensor %.3f%%)", 100.0 * mfu(per_gpu, fpt, fp32),
                    100.0 * mfu(per_gpu, fpt, bf16));
    else
      std::snprintf(note, sizeof note, "  MFU %.2f%%", 100.0 * mfu(per_gpu, fpt, fp32));
    return std::string(note);
  };
  return hooks;
}

// After training, on every rank: the device memory the run took since
// `free_before` (all ranks on this GPU) beside what the optimizer and the
// model's arena say they hold.
template <class Comm>
void add_memory_check(TrainHooks& hooks, Comm& comm, std::size_t free_before, int ranks_on_this_gpu) {
  hooks.after_training = [&comm, free_before, ranks_on_this_gpu](const zero::MemoryReport& m,
                                                                  const ActivationBytes& act) {
    comm.barrier();  // every rank on this GPU holds all it will
    if (comm.rank() == 0) {
      const double used =
          (static_cast<double>(free_before) - static_cast<double>(free_device_bytes())) / ranks_on_this_gpu;
      const zero::PlacedBytes placed = m.placed.total();
      const double accounted = static_cast<double>(placed.device + act.total());
      std::printf("device memory per rank: %.2f MiB used (cudaMemGetInfo, %d rank(s) on this GPU); memory_report() "
                  "%.2f MiB on the device (model states %.2f, communication buffers %.2f) + activations %.2f MiB = "
                  "%.2f MiB; the other %.2f MiB: CUDA/cuBLAS/NCCL workspaces, allocation rounding\n",
                  used / 1048576.0, ranks_on_this_gpu, mib(placed.device),
                  mib(m.placed.model_states().device), mib(m.placed.communication_buffers.device), mib(act.total()),
                  mib(static_cast<std::uint64_t>(accounted)), (used - accounted) / 1048576.0);
      std::fflush(stdout);
    }
    comm.barrier();
  };
}

// This rank's run with the optimizer the choices name: every precision,
// optimizer, stage and offload tier (zero::make_optimizer on backend::Cuda:
// one engine per precision and optimizer); the loop itself is compiled once.
double train_rank_on_cuda(zero::comm::AnyCommunicator& comm, const TrainArgs& a, const TextCorpus& corpus,
                          const TrainHooks& hooks) {
  const MakeOptimizer make_optimizer = [&a](zero::comm::AnyCommunicator& c) {
    return zero::examples::make_example_optimizer<zero::backend::Cuda>(c, optimizer_config(a));
  };
  return train_rank<zero::backend::Cuda, CudaGpt>(comm, a, corpus, make_optimizer, hooks);
}

double train_local(const TrainArgs& args, const TextCorpus& corpus) {
  device_count();
  const Device device = describe(0);
  ZERO_CUDA_CHECK(cudaSetDevice(0));
  ZERO_CUDA_CHECK(cudaFree(nullptr));  // the context first: its memory is not the run's
  const std::size_t free_before = free_device_bytes();
  Config shape = args.model;
  shape.vocab = corpus.vocab_size();
  TrainHooks hooks = gpu_hooks(args, device, 1, shape, true);
  double val = 0.0;
  zero::comm::LocalGroup group(args.launch.ranks);
  zero::comm::LocalDevice::run(
      group,
      [&](zero::comm::LocalDevice& comm) {
        TrainHooks mine = hooks;
        add_memory_check(mine, comm, free_before, comm.size());
        const double v = train_rank_on_cuda(*zero::comm::AnyCommunicator::wrap(comm), args, corpus, mine);
        if (comm.rank() == 0) val = v;
      },
      0);
  return val;
}

#if defined(ZERO_EXAMPLE_HAVE_NCCL)
double train_nccl(const TrainArgs& args, const TextCorpus& corpus, const std::vector<unsigned char>& id_bytes) {
  const int devices = device_count();
  const bool from_caller = !id_bytes.empty();
  const bool from_file = !args.nccl_id_file.empty();
  const int rank = from_caller || from_file ? args.nccl_rank : 0;
  const int world = from_caller || from_file ? args.nccl_world : 1;
  const Device device = describe(nccl_device(rank, devices));
  ZERO_CUDA_CHECK(cudaSetDevice(device.index));
  ZERO_CUDA_CHECK(cudaFree(nullptr));
  const std::size_t free_before = free_device_bytes();
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (from_caller) {
    zero::require(id_bytes.size() == sizeof id, "train_on_cuda: the NCCL unique id has ", id_bytes.size(),
                  " bytes, not ", sizeof id);
    std::memcpy(&id, id_bytes.data(), sizeof id);
  } else if (!from_file) {
    for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"})
      if (const char* v = std::getenv(name); v != nullptr && std::atoi(v) > 1)
        throw zero::InvalidArgument(zero::detail::concat(
            "--comm nccl: started by mpirun (", name, "=", v, "), but this gpt_train was built without MPI, which "
            "would carry the NCCL unique id: reconfigure with MPI, or start each rank with --nccl-id-file PATH --rank R "
            "--world W"));
    id = zero::comm::Nccl::new_unique_id();  // one rank
  }
  zero::comm::Nccl comm = from_file ? zero::comm::Nccl::from_unique_id_file(args.nccl_id_file, rank, world)
                                    : zero::comm::Nccl::from_unique_id(id, rank, world);
  Config shape = args.model;
  shape.vocab = corpus.vocab_size();
  TrainHooks hooks = gpu_hooks(args, device, world, shape, rank == 0);
  add_memory_check(hooks, comm, free_before, 1);
  return train_rank_on_cuda(*zero::comm::AnyCommunicator::wrap(comm), args, corpus, hooks);
}
#endif

}  // namespace

double train_on_cuda(const TrainArgs& args, const TextCorpus& corpus, const std::vector<unsigned char>& nccl_id) {
  if (args.launch.comm == "local") return train_local(args, corpus);
#if defined(ZERO_EXAMPLE_HAVE_NCCL)
  return train_nccl(args, corpus, nccl_id);
#else
  (void)nccl_id;
  throw zero::InvalidArgument("--comm nccl: this gpt_train was built without NCCL (nccl.h and libnccl.so; CUDA 13 "
                              "bundles them): reconfigure where they are found");
#endif
}

std::vector<unsigned char> new_nccl_unique_id() {
#if defined(ZERO_EXAMPLE_HAVE_NCCL)
  const ncclUniqueId id = zero::comm::Nccl::new_unique_id();
  const auto* bytes = reinterpret_cast<const unsigned char*>(&id);
  return std::vector<unsigned char>(bytes, bytes + sizeof id);
#else
  throw zero::InvalidArgument("--comm nccl: this gpt_train was built without NCCL");
#endif
}

}  // namespace gpt
