// Device communicators: the sweep of bench_comm (bench/comm_bench.hpp) over
// device memory. comm::LocalDevice with 2 and 4 ranks sharing GPU 0, and
// comm::Nccl with one rank per visible GPU (ncclCommInitAll, one thread per
// rank) when there are at least two; the probe is a kernel moving each
// row's traffic in its shape (comm_bench.hpp) by the same ranks, beside each row.
//
//   bench_comm_cuda [--comm all|local_device|nccl] [--ranks N ...] [--min BYTES] [--max BYTES] [--json]
// Without a CUDA device it exits 77 (SKIP).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "../comm_bench.hpp"
#include "zero/comm/local_device.hpp"
#include "zero/comm/reduce.cuh"  // the reduction kernel LocalDevice launches (header-only in a .cu file)
#include "zero/cuda/check.hpp"
#include "zero/cuda/stream.hpp"
#if defined(ZERO_BENCH_WITH_NCCL)
#include "zero/comm/nccl.hpp"
#endif

namespace {

using namespace zero::bench::comm;

// The probe's streams: outputs[o][i] = XOR over k of inputs[k][i].
inline constexpr int kFoldStreams = 16;
struct FoldArgs {
  const uint4* inputs[kFoldStreams];
  uint4* outputs[kFoldStreams];
  int n_in, n_out;
  std::size_t words;
};
__global__ void fold_kernel(FoldArgs a) {
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.words;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    uint4 x = a.inputs[0][i];
    for (int k = 1; k < a.n_in; ++k) {
      const uint4 y = a.inputs[k][i];
      x.x ^= y.x;
      x.y ^= y.y;
      x.z ^= y.z;
      x.w ^= y.w;
    }
    for (int o = 0; o < a.n_out; ++o) a.outputs[o][i] = x;
  }
}

// Device buffers of the calling thread's device, zeroed; probes and waits on
// the thread's current stream (the rank's, under LocalDevice::run).
struct DeviceMemory {
  std::vector<void*> owned;
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    for (void* p : owned) cudaFree(p);
  }
  void* alloc(std::size_t bytes) {
    void* p = nullptr;
    ZERO_CUDA_CHECK(cudaMalloc(&p, bytes));
    owned.push_back(p);
    ZERO_CUDA_CHECK(cudaMemset(p, 0, bytes));
    ZERO_CUDA_CHECK(cudaDeviceSynchronize());
    return p;
  }
  // The probe (comm_bench.hpp): 16-byte words, a grid-stride loop. `stream`
  // is the host's cache hint; device stores need none.
  static void fold(void* const* outputs, int n_out, const void* const* inputs, int n_in, std::size_t bytes,
                   bool /*stream*/) {
    zero::require(n_in <= kFoldStreams && n_out <= kFoldStreams && bytes % sizeof(uint4) == 0,
                  "bench_comm_cuda's probe takes at most ", kFoldStreams, " streams of whole 16-byte words");
    FoldArgs a{};
    for (int k = 0; k < n_in; ++k) a.inputs[k] = static_cast<const uint4*>(inputs[k]);
    for (int o = 0; o < n_out; ++o) a.outputs[o] = static_cast<uint4*>(outputs[o]);
    a.n_in = n_in;
    a.n_out = n_out;
    a.words = bytes / sizeof(uint4);
    const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>((a.words + 255) / 256, 4096));
    fold_kernel<<<blocks, 256, 0, zero::cuda::current_stream()>>>(a);
    ZERO_CUDA_CHECK(cudaGetLastError());
  }
  static constexpr int store_kinds = 1;  // fold ignores `stream`
  static void sync() { ZERO_CUDA_CHECK(cudaStreamSynchronize(zero::cuda::current_stream())); }
};

std::vector<Row> run_local_device(const Options& o) {
  std::vector<Row> rows;
  for (int ranks : o.ranks.empty() ? std::vector<int>{2, 4} : o.ranks) {
    zero::comm::LocalGroup group(ranks);
    zero::comm::LocalDevice::run(group, [&](zero::comm::LocalDevice& c) {
      DeviceMemory mem;
      auto mine = sweep(c, mem, "local_device", o);
      if (c.rank() == 0) rows.insert(rows.end(), mine.begin(), mine.end());
    });
  }
  return rows;
}

#if defined(ZERO_BENCH_WITH_NCCL)
std::vector<Row> run_nccl(const Options& o, int devices) {
  std::vector<Row> rows;
  if (devices < 2) {
    std::fprintf(stderr, "comm::Nccl: %d GPU(s); NCCL needs one GPU per rank, so it is measured with 2 or more\n",
                 devices);
    return rows;
  }
  std::vector<int> list(static_cast<std::size_t>(devices));
  for (int d = 0; d < devices; ++d) list[static_cast<std::size_t>(d)] = d;
  std::vector<ncclComm_t> comms(static_cast<std::size_t>(devices));
  const ncclResult_t r = ncclCommInitAll(comms.data(), devices, list.data());
  if (r != ncclSuccess) throw zero::BackendError(std::string("ncclCommInitAll: ") + ncclGetErrorString(r));
  std::vector<std::string> errors(static_cast<std::size_t>(devices));
  std::vector<std::thread> threads;
  for (int d = 0; d < devices; ++d) {
    threads.emplace_back([&, d] {
      try {
        ZERO_CUDA_CHECK(cudaSetDevice(d));
        zero::comm::Nccl c(comms[static_cast<std::size_t>(d)]);
        DeviceMemory mem;
        auto mine = sweep(c, mem, "nccl", o);
        if (d == 0) rows = std::move(mine);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(d)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (ncclComm_t c : comms) ncclCommDestroy(c);
  for (const auto& e : errors)
    if (!e.empty()) throw zero::CommError("comm::Nccl: " + e);
  return rows;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Options o;
  const std::string comm = parse_command_line(argc, argv, o, {"all", "local_device", "nccl"});
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device (%s)\n", status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
    return 77;
  }
  try {
    std::vector<Row> rows;
    if (comm != "nccl") rows = run_local_device(o);
#if defined(ZERO_BENCH_WITH_NCCL)
    if (comm != "local_device") {
      const auto more = run_nccl(o, devices);
      rows.insert(rows.end(), more.begin(), more.end());
    }
#else
    if (comm != "local_device") std::fprintf(stderr, "comm::Nccl: not built (no nccl.h)\n");
#endif
    print(rows, o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_comm_cuda: %s\n", e.what());
    return 1;
  }
  return 0;
}
