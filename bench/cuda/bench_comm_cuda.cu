// Device communicators: the sweep of bench_comm (bench/comm_bench.hpp) over
// device memory. comm::LocalDevice with 2 and 4 ranks sharing GPU 0, and
// comm::Nccl with one rank per visible GPU (ncclCommInitAll, one thread per
// rank) when there are at least two; the probe is a device-to-device
// cudaMemcpyAsync by the same ranks, of each row's traffic, beside each row.
//
//   bench_comm_cuda [--comm all|local_device|nccl] [--ranks N ...] [--min BYTES] [--max BYTES] [--json]
// Without a CUDA device it exits 77 (SKIP).
#include <cuda_runtime.h>

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "../comm_bench.hpp"
#include "zero/comm/local_device.cuh"
#include "zero/cuda/check.cuh"
#include "zero/cuda/stream.cuh"
#if defined(ZERO_BENCH_WITH_NCCL)
#include "zero/comm/nccl.cuh"
#endif

namespace {

using namespace zero::bench::comm;

// Device buffers of the calling thread's device, zeroed; copies and waits on
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
  static void copy(void* dst, const void* src, std::size_t bytes) {
    ZERO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, zero::cuda::current_stream()));
  }
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
