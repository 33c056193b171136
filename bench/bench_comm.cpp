// Host communicators: all-reduce, reduce-scatter, all-gather and broadcast
// of fp32 and bf16 buffers from 4 KiB to 256 MiB, with nccl-tests' algorithm
// and bus bandwidth and the ratio to the memory limit (bench/comm_bench.hpp).
//
//   bench_comm [--ranks N ...] [--min BYTES] [--max BYTES] [--json]     comm::Local, 2 and 4 ranks (threads)
//   mpirun -np 2 bench_comm --comm mpi [--json]                         comm::Mpi, one rank per process
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "comm_bench.hpp"
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "zero/comm/local.hpp"
#if defined(ZERO_BENCH_WITH_MPI)
#include "zero/comm/mpi.hpp"
#endif

namespace {

using namespace zero::bench::comm;

// Host buffers, zero-filled by the rank that uses them (so their pages are
// real, and local to it), in whole cache lines (the probe's streams start on
// one, as the communicators' pieces do).
struct HostMemory {
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  std::vector<std::unique_ptr<void, Free>> owned;
  void* alloc(std::size_t bytes) {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    owned.emplace_back(p);
    std::memset(p, 0, bytes);
    return p;
  }
  static void fold(void* const* outputs, int n_out, const void* const* inputs, int n_in, std::size_t bytes,
                   bool stream) {
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f") && bytes % 64 == 0) return fold_avx512(outputs, n_out, inputs, n_in, bytes, stream);
#endif
    (void)stream;
    const std::size_t words = bytes / sizeof(std::uint64_t);
    for (std::size_t i = 0; i < words; ++i) {
      std::uint64_t x = static_cast<const std::uint64_t*>(inputs[0])[i];
      for (int k = 1; k < n_in; ++k) x ^= static_cast<const std::uint64_t*>(inputs[k])[i];
      for (int o = 0; o < n_out; ++o) static_cast<std::uint64_t*>(outputs[o])[i] = x;
    }
  }
  static constexpr int store_kinds = 2;  // plain and non-temporal (fold's `stream`)
  static void sync() {}

#if defined(__x86_64__)
  // A cache line at a time: the widest loads and stores, as the reduction's packs.
  __attribute__((target("avx512f"))) static void fold_avx512(void* const* outputs, int n_out,
                                                             const void* const* inputs, int n_in, std::size_t bytes,
                                                             bool stream) {
    for (std::size_t i = 0; i < bytes; i += 64) {
      __m512i x = _mm512_loadu_si512(static_cast<const char*>(inputs[0]) + i);
      for (int k = 1; k < n_in; ++k) x = _mm512_xor_si512(x, _mm512_loadu_si512(static_cast<const char*>(inputs[k]) + i));
      for (int o = 0; o < n_out; ++o) {
        char* p = static_cast<char*>(outputs[o]) + i;
        if (stream && reinterpret_cast<std::uintptr_t>(p) % 64 == 0)
          _mm512_stream_si512(reinterpret_cast<__m512i*>(p), x);
        else
          _mm512_storeu_si512(p, x);
      }
    }
    if (stream) _mm_sfence();
  }
#endif
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
