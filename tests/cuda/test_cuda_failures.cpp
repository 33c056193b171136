// Why: the CUDA failure paths found by reading the code (issue 7) must be
// proven on a GPU, each by a check that fails on the code as it was:
//   group     an exception inside an NCCL group (a timeout noticed between
//             group_begin and group_end, or a bad argument) ends the group,
//             so the abort is not merely queued and this thread's later NCCL
//             calls do not join a stale group;
//   stats     CudaGradStats' constructor waits through the watched path, so a
//             stream that will never drain is a CommError there, not a hang;
//   devices   one thread alternating between two GPUs keeps one grad_stats
//             workspace per device and allocates nothing once both exist
//             (needs two GPUs; reported as not run with one).
// (That --use_fast_math / -ftz=true fails the build is checked at compile
// time: tests/cuda/check_fast_math.sh.)
//
// Self-contained (GPU machines may lack Catch2): tests/cuda/check_harness.hpp,
// a closing "N passed, M failed" line, exit 77 (skip) without a CUDA device.
//
//   test_cuda_failures [--only group|stats|devices]
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "zero/zero_cuda.hpp"

#if defined(ZERO_TEST_WITH_NCCL)
#include "nccl_one_rank.hpp"
#include "zero/comm/nccl.hpp"
#endif

#include "blocked_stream.hpp"
#include "check_harness.hpp"

namespace {

using DeviceOps = zero::backend::Ops<zero::backend::Cuda>;
using HostOps = zero::backend::Ops<zero::backend::Host>;
using zero::test::BlockedStream;
using zero::test::fmt;
using zero::test::g_failed;
using zero::test::g_passed;
using zero::test::section;
using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

// ---- group: an exception inside an NCCL group ends it ------------------------------------

#if defined(ZERO_TEST_WITH_NCCL)

// Whether this thread is inside an NCCL group: ncclGroupEnd outside one is
// ncclInvalidUsage (and changes nothing); inside one it ends it.
bool thread_in_nccl_group() { return ncclGroupEnd() != ncclInvalidUsage; }

void group_tests() {
  const int p0 = g_passed, f0 = g_failed;
  try {
    ZERO_CUDA_CHECK(cudaSetDevice(0));
    DeviceOps::Buffer<float> x(16);
    std::vector<float> ones(16, 1.0f);
    DeviceOps::upload(x.data(), ones.data(), ones.size());

    {
      // A bad argument inside a group: the group ends, what it held runs, the
      // communicator stays usable.
      ncclComm_t comm = zero::test::one_rank_comm();
      {
        zero::comm::Nccl nccl(comm);
        nccl.group_begin();
        nccl.all_reduce(x.data(), 16, zero::DType::f32);
        CHECK_THROWS(nccl.broadcast(x.data(), 16, zero::DType::f32, 5), zero::InvalidArgument, "not a rank");
        CHECK(!thread_in_nccl_group(), "an exception inside a group ends the NCCL group");
        nccl.wait();
        CHECK(!nccl.aborted(), "a bad argument does not abort the communicator");
        nccl.all_reduce(x.data(), 16, zero::DType::f32);
        std::vector<float> back(16);
        DeviceOps::download(back.data(), x.data(), back.size());
        CHECK(back == ones, "the communicator still works after an error inside a group");
        CHECK_THROWS(nccl.group_end(), zero::InvalidArgument, "an exception inside a group ends the group itself");
      }
      ncclCommDestroy(comm);
    }

    {
      // A timeout noticed inside a group (the collective before it sits behind
      // a kernel that does not finish): CommError, and the group is ended
      // before the abort.
      zero::comm::Nccl::Options options;
      options.timeout = std::chrono::milliseconds(300);
      BlockedStream blocked(DeviceOps::stream(), std::chrono::seconds(3));
      zero::comm::Nccl nccl(zero::test::one_rank_comm(), DeviceOps::stream(), options);
      nccl.all_reduce(x.data(), 0, zero::DType::bf16);  // all_reduce #1: behind the blocked kernel
      nccl.group_begin();
      nccl.all_reduce(x.data(), 16, zero::DType::f32);
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      CHECK_THROWS(nccl.all_reduce(x.data(), 16, zero::DType::f32), zero::CommError,
                   "all_reduce #1 (0 elements of bf16) did not finish within 300 ms");
      CHECK(nccl.aborted(), "the timed-out communicator is aborted");
      CHECK(!thread_in_nccl_group(), "the timeout ended the NCCL group before aborting");
      blocked.release();
      // The aborted ncclComm_t was freed by ncclCommAbort: not destroyed here.
      // (While an aborted Nccl exists every watched wait throws: it goes first.)
    }
    {
      // ... and a new communicator on this thread runs its collectives at once.
      ncclComm_t fresh = zero::test::one_rank_comm();
      {
        zero::comm::Nccl::Options patient;
        patient.timeout = std::chrono::seconds(20);
        zero::comm::Nccl next(fresh, patient);
        const auto start = clock_type::now();
        next.all_reduce(x.data(), 16, zero::DType::f32, zero::ReduceOp::sum, true);  // waits for the result
        CHECK(seconds_since(start) < 10.0, "a later collective on this thread runs at once, not in a stale group");
        std::vector<float> back(16);
        DeviceOps::download(back.data(), x.data(), back.size());
        CHECK(back == ones, "a later communicator on this thread computes");
      }
      ncclCommDestroy(fresh);
    }
  } catch (const std::exception& e) {
    CHECK(false, std::string("group: exception: ") + e.what());
  }
  section("an exception inside an NCCL group ends the group", p0, f0);
}

#endif  // ZERO_TEST_WITH_NCCL

// ---- stats: CudaGradStats' constructor waits watched ---------------------------------------

// Stands in for comm::Nccl's watcher, which needs a peer that can die (two
// GPUs): past a deadline it does what Nccl does on a timeout, releasing the
// stuck work (ncclCommAbort releases NCCL's kernels) and throwing CommError.
class DeadPeerWatcher final : public zero::cuda::StreamWatcher {
 public:
  DeadPeerWatcher(BlockedStream& blocked, std::chrono::milliseconds after)
      : blocked_(blocked), deadline_(clock_type::now() + after) {
    zero::cuda::register_watcher(this);
  }
  DeadPeerWatcher(const DeadPeerWatcher&) = delete;
  DeadPeerWatcher& operator=(const DeadPeerWatcher&) = delete;
  ~DeadPeerWatcher() { zero::cuda::unregister_watcher(this); }

  void poll() override {
    if (clock_type::now() < deadline_) return;
    blocked_.release();
    throw zero::CommError("test watcher: the peer is presumed dead");
  }

 private:
  BlockedStream& blocked_;
  clock_type::time_point deadline_;
};

void stats_tests() {
  const int p0 = g_passed, f0 = g_failed;
  try {
    ZERO_CUDA_CHECK(cudaSetDevice(0));
    DeviceOps::synchronize();
    {
      // The thread's stream is blocked for 8 s; the watcher gives up after 0.3 s.
      BlockedStream blocked(DeviceOps::stream(), std::chrono::seconds(8));
      DeadPeerWatcher watcher(blocked, std::chrono::milliseconds(300));
      const auto start = clock_type::now();
      CHECK_THROWS(zero::kernels::CudaGradStats stats, zero::CommError, "the peer is presumed dead");
      const double waited = seconds_since(start);
      std::printf("  CudaGradStats constructor behind a blocked stream: %.2f s (watcher 0.3 s, release 8 s)\n",
                  waited);
      CHECK(waited < 4.0, fmt("the constructor waited %.2f s: a wait outside the watched path", waited));
    }
    {
      // Built normally, it serves a stream other than the one it was zeroed on.
      zero::kernels::CudaGradStats stats;
      cudaStream_t other = nullptr;
      ZERO_CUDA_CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
      std::vector<float> g(4099);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(static_cast<int>(i % 13) - 6) * 0.5f;
      DeviceOps::Buffer<float> dg(g.size());
      DeviceOps::upload(dg.data(), g.data(), g.size());
      const auto got = stats.compute(dg.data(), g.size(), other);
      const auto want = HostOps::grad_stats(g.data(), g.size());
      CHECK(got.sum_squares == want.sum_squares && !got.non_finite,
            fmt("stats on another stream: %.17g vs host %.17g", got.sum_squares, want.sum_squares));
      ZERO_CUDA_CHECK(cudaStreamDestroy(other));
    }
  } catch (const std::exception& e) {
    CHECK(false, std::string("stats: exception: ") + e.what());
  }
  section("CudaGradStats waits only through the watched path", p0, f0);
}

// ---- devices: one grad_stats workspace per device ------------------------------------------

void device_tests() {
  const int p0 = g_passed, f0 = g_failed;
  int devices = 0;
  ZERO_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (devices < 2) {
    std::printf("  one workspace per device: NOT RUN, it needs 2 GPUs and this machine has %d\n", devices);
    section("grad_stats keeps one workspace per device", p0, f0);
    return;
  }
  // On a thread of its own: a fresh thread-local workspace, and this
  // thread's current device and stream are left alone.
  std::thread worker([&] {
    try {
      constexpr std::size_t n = 5000;
      cudaStream_t streams[2] = {};
      std::vector<DeviceOps::Buffer<float>> grads;
      std::vector<std::vector<float>> host(2, std::vector<float>(n));
      for (int d = 0; d < 2; ++d) {
        ZERO_CUDA_CHECK(cudaSetDevice(d));
        ZERO_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[d], cudaStreamNonBlocking));
        DeviceOps::set_stream(streams[d]);
        for (std::size_t i = 0; i < n; ++i) host[d][i] = static_cast<float>((i * (d + 3)) % 11) - 5.0f;
        grads.emplace_back(n);
        DeviceOps::upload(grads.back().data(), host[d].data(), n);
      }
      std::uint64_t after_first_round = 0;
      bool right = true;
      for (int round = 0; round < 5; ++round) {
        for (int d = 0; d < 2; ++d) {
          ZERO_CUDA_CHECK(cudaSetDevice(d));
          DeviceOps::set_stream(streams[d]);
          const auto got = DeviceOps::grad_stats(grads[static_cast<std::size_t>(d)].data(), n);
          right = right && got.sum_squares == HostOps::grad_stats(host[d].data(), n).sum_squares;
        }
        if (round == 0) after_first_round = DeviceOps::allocation_count();
      }
      const std::uint64_t later = DeviceOps::allocation_count() - after_first_round;
      CHECK(right, "grad_stats on each device matches the host");
      CHECK(later == 0, fmt("alternating between two GPUs allocated %llu device buffers after the first round",
                            static_cast<unsigned long long>(later)));
      DeviceOps::reset_stream();
      grads.clear();
      for (int d = 0; d < 2; ++d) {
        ZERO_CUDA_CHECK(cudaSetDevice(d));
        ZERO_CUDA_CHECK(cudaStreamDestroy(streams[d]));
      }
    } catch (const std::exception& e) {
      CHECK(false, std::string("devices: exception: ") + e.what());
    }
  });
  worker.join();
  section("grad_stats keeps one workspace per device", p0, f0);
}

}  // namespace

int main(int argc, char** argv) {
  zero::test::TestArgs args;
  if (!zero::test::parse_test_args(argc, argv, {"group", "stats", "devices"}, false, args)) return 2;
  const auto runs = [&](const char* group) { return args.runs(group); };
  if (zero::test::no_cuda_device()) return 77;
  const auto start = clock_type::now();
  try {
    if (runs("stats")) stats_tests();
    if (runs("devices")) device_tests();
#if defined(ZERO_TEST_WITH_NCCL)
    if (runs("group")) group_tests();  // last: it aborts a communicator
#else
    if (runs("group")) std::printf("NCCL groups: not built (no nccl.h)\n");
#endif
  } catch (const std::exception& e) {
    CHECK(false, std::string("uncaught exception: ") + e.what());
  }
  std::printf("%.1f s\n", seconds_since(start));
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
