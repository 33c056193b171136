// Host communicators: all-reduce, reduce-scatter, all-gather and broadcast
// of fp32 and bf16 buffers from 4 KiB to 256 MiB, with nccl-tests' algorithm
// and bus bandwidth and the ratio to the memory limit (bench/comm_bench.hpp).
//
//   bench_comm [--ranks N ...] [--min BYTES] [--max BYTES] [--json]     comm::Local, 2 and 4 ranks (threads)
//   mpirun -np 2 bench_comm --comm mpi [--json]                         comm::Mpi, one rank per process
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm_bench.hpp"
#include "zero/comm/local.hpp"
#if defined(ZERO_BENCH_WITH_MPI)
#include "zero/comm/mpi.hpp"
#endif

namespace {

using namespace zero::bench::comm;

// Host buffers, zero-filled by the rank that uses them (so their pages are
// real, and local to it).
struct HostMemory {
  std::vector<std::unique_ptr<unsigned char[]>> owned;
  void* alloc(std::size_t bytes) {
    owned.emplace_back(new unsigned char[bytes]);
    std::memset(owned.back().get(), 0, bytes);
    return owned.back().get();
  }
  static void copy(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }
  static void sync() {}
};

std::vector<Row> run_local(const Options& o) {
  std::vector<Row> rows;
  for (int ranks : o.ranks.empty() ? std::vector<int>{2, 4} : o.ranks) {
    zero::comm::LocalGroup group(ranks);
    group.run([&](zero::comm::Local& c) {
      HostMemory mem;
      auto mine = sweep(c, mem, "local", o);
      if (c.rank() == 0) rows.insert(rows.end(), mine.begin(), mine.end());
    });
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  const std::string comm = parse_command_line(argc, argv, o, {"local", "mpi"});
  if (comm == "local") {
    print(run_local(o), o);
    return 0;
  }
#if defined(ZERO_BENCH_WITH_MPI)
  zero::comm::MpiRuntime runtime(&argc, &argv);
  zero::comm::Mpi c;
  if (!o.ranks.empty() && (o.ranks.size() != 1 || o.ranks[0] != c.size())) {
    if (c.rank() == 0) std::fprintf(stderr, "--comm mpi: the ranks are mpirun's -np (%d); drop --ranks\n", c.size());
    return 2;
  }
  HostMemory mem;
  const auto rows = sweep(c, mem, "mpi", o);
  if (c.rank() == 0) print(rows, o);
  return 0;
#else
  std::fprintf(stderr, "--comm mpi: this bench_comm was built without MPI (Meson did not find it)\n");
  return 2;
#endif
}
