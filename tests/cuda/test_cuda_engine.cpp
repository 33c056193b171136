// Why: the engine on backend::Cuda must train exactly like the host engine:
// for every stage, precision, optimizer and N ranks, the parameters must
// match the single-process reference (tests/engine/reference.hpp) with the
// design's criterion (masters within 1e-5 relative, floor 0.1; low-precision
// copies within one ulp). N ranks share one GPU through comm::LocalDevice;
// comm::Nccl runs with one rank (NCCL cannot put two ranks on one GPU). The
// building blocks are held to their host twins bit for bit (Ops<Cuda>
// convert/accumulate, LocalDevice collectives), the reports to the ZeRO
// formulas, steady-state steps to allocating nothing, and a collective that
// never finishes to a CommError instead of a hang.
//
// Self-contained (GPU machines may lack Catch2): a tiny CHECK harness, a
// closing "N passed, M failed" line, exit 77 (skip) without a CUDA device.
//
//   test_cuda_engine [--quick] [--only ops|collectives|engine|offload|reports|alloc|nccl]
//     --quick (or ZERO_CUDA_TEST_QUICK=1, as the cuda-memcheck setup sets):
//     the equivalence runs only with 2 ranks and accumulation + clipping.
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../engine/reference.hpp"
#include "zero/zero_cuda.hpp"
#if defined(ZERO_PRECOMPILED_CUDA_ENGINES)  // compiled once for the build: src/zero_engines_cuda.cpp
#include "zero/runtime/precompiled.hpp"
ZERO_EXTERN_ENGINES(::zero::backend::Cuda)
#endif

#if defined(ZERO_TEST_WITH_NCCL)
#include <unistd.h>

#include "nccl_one_rank.hpp"
#include "zero/comm/nccl.hpp"
#endif

#include "blocked_stream.hpp"
#include "check_harness.hpp"

namespace {

using zero::bf16;
using zero::fp16;
using DeviceOps = zero::backend::Ops<zero::backend::Cuda>;
using HostOps = zero::backend::Ops<zero::backend::Host>;
using zero::test::RunResult;

// ---- harness: tests/cuda/check_harness.hpp ----------------------------
using zero::test::bits_of;
using zero::test::fmt;
using zero::test::g_failed;
using zero::test::g_passed;
using zero::test::section;
bool g_quick = false;

template <class T>
const char* type_name() {
  return zero::dtype_traits<T>::name;
}

// Bitwise equal, except that any two fp32 NaNs match (fp32 NaN payloads of an
// add differ between x86 and the GPU; 16-bit NaNs are canonical on both).
template <class T>
bool same_bits(T a, T b) {
  if constexpr (std::is_same_v<T, float>) {
    if (std::isnan(a) && std::isnan(b)) return true;
  }
  return bits_of(a) == bits_of(b);
}

template <class T>
T from_bits(std::uint32_t u) {
  if constexpr (std::is_same_v<T, float>) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else {
    return T{static_cast<std::uint16_t>(u)};
  }
}

// A device array for tests (not an engine buffer: not counted).
template <class T>
struct DeviceArray {
  T* p = nullptr;
  std::size_t n = 0;
  explicit DeviceArray(std::size_t count) : n(count) {
    ZERO_CUDA_CHECK(cudaMalloc(&p, (count ? count : 1) * sizeof(T)));
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(p); }
  void put(const std::vector<T>& v) { DeviceOps::upload(p, v.data(), v.size()); }
  std::vector<T> get() const {
    std::vector<T> v(n);
    DeviceOps::download(v.data(), p, n);
    return v;
  }
};

// ---- Ops<Cuda>: same bits as Ops<Host> --------------------------------------------

// Every 16-bit pattern, then fp32 patterns of every class (zeros, subnormals,
// normals near each 16-bit type's rounding boundaries, inf, NaN).
template <class T>
std::vector<T> test_values(std::size_t n_random) {
  std::vector<T> v;
  if constexpr (!std::is_same_v<T, float>) {
    for (std::uint32_t u = 0; u < 65536; ++u) v.push_back(T{static_cast<std::uint16_t>(u)});
  } else {
    const std::uint32_t special[] = {0u, 0x80000000u, 1u, 0x007fffffu, 0x00800000u, 0x33800000u, 0x33000001u,
                                     0x387fe000u, 0x38800000u, 0x477fe000u, 0x477ff000u, 0x477fefffu, 0x7f7fffffu,
                                     0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x3f808000u,
                                     0x3f818000u, 0x3f80ffffu, 0xbf808001u};
    for (std::uint32_t u : special) v.push_back(from_bits<float>(u));
    for (std::size_t i = 0; i < n_random; ++i)
      v.push_back(from_bits<float>(static_cast<std::uint32_t>(zero::detail::mix64(i * 7919u + 17u))));
  }
  return v;
}

template <class To, class From>
void check_convert() {
  const std::vector<From> src = test_values<From>(200000);
  const std::size_t n = src.size();
  std::vector<To> want(n);
  HostOps::convert(want.data(), src.data(), n);
  DeviceArray<From> d_src(n);
  DeviceArray<To> d_dst(n);
  d_src.put(src);
  DeviceOps::convert(d_dst.p, d_src.p, n);
  const std::vector<To> got = d_dst.get();
  std::size_t bad = 0, first = n;
  for (std::size_t i = 0; i < n; ++i)
    if (!same_bits(got[i], want[i])) {
      if (bad++ == 0) first = i;
    }
  CHECK(bad == 0, fmt("convert %s -> %s: %zu of %zu differ from Ops<Host>, first at %zu (src bits %08x: device %08x, "
                      "host %08x)",
                      type_name<From>(), type_name<To>(), bad, n, first, first < n ? static_cast<unsigned>(bits_of(src[first])) : 0u,
                      first < n ? static_cast<unsigned>(bits_of(got[first])) : 0u,
                      first < n ? static_cast<unsigned>(bits_of(want[first])) : 0u));
}

template <class T, class S>
void check_accumulate() {
  // Finite values of both types, paired so that sums land on rounding ties.
  const std::size_t n = 300001;
  std::vector<T> dst(n);
  std::vector<S> src(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t h = zero::detail::mix64(i + 99);
    const float a = static_cast<float>(static_cast<std::int64_t>(h >> 40) - (1 << 23)) * std::ldexp(1.0f, -20 + static_cast<int>(i % 13));
    const float b = i % 5 == 0 ? -a : static_cast<float>(static_cast<std::int32_t>(h & 0xffffff) - (1 << 23)) *
                                          std::ldexp(1.0f, -24 + static_cast<int>(i % 7));
    dst[i] = zero::from_float<T>(a);
    src[i] = zero::from_float<S>(b);
  }
  for (const bool overwrite : {false, true}) {
    std::vector<T> want = dst;
    HostOps::accumulate(want.data(), src.data(), n, overwrite);
    DeviceArray<T> d_dst(n);
    DeviceArray<S> d_src(n);
    d_dst.put(dst);
    d_src.put(src);
    DeviceOps::accumulate(d_dst.p, d_src.p, n, overwrite);
    const std::vector<T> got = d_dst.get();
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) bad += !same_bits(got[i], want[i]);
    CHECK(bad == 0, fmt("accumulate %s += %s (overwrite %d): %zu of %zu differ from Ops<Host>", type_name<T>(),
                        type_name<S>(), overwrite ? 1 : 0, bad, n));
  }
}

void ops_tests() {
  const int p0 = g_passed, f0 = g_failed;
  try {
    check_convert<float, fp16>();
    check_convert<float, bf16>();
    check_convert<fp16, float>();
    check_convert<bf16, float>();
    check_convert<fp16, bf16>();
    check_convert<bf16, fp16>();
    check_convert<fp16, fp16>();
    check_accumulate<float, float>();
    check_accumulate<bf16, bf16>();
    check_accumulate<fp16, fp16>();
    check_accumulate<bf16, float>();
    check_accumulate<fp16, float>();

    // Buffers: zero-filled, counted, move-only; copy/zero/upload/download round trip.
    const std::uint64_t before = DeviceOps::allocation_count();
    DeviceOps::Buffer<bf16> a(1000);
    DeviceOps::Buffer<bf16> empty(0);
    CHECK(DeviceOps::allocation_count() == before + 1 && empty.data() == nullptr,
          "a non-empty buffer counts once, an empty one not at all");
    std::vector<bf16> host(1000, bf16{0x1234});
    DeviceOps::download(host.data(), a.data(), host.size());
    bool zeroed = true;
    for (bf16 x : host) zeroed = zeroed && x.bits == 0;
    CHECK(zeroed, "new buffers are zero-filled");
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = bf16{static_cast<std::uint16_t>(i * 37)};
    DeviceOps::upload(a.data(), host.data(), host.size());
    DeviceOps::Buffer<bf16> b = std::move(a);
    CHECK(a.data() == nullptr && a.size() == 0 && b.size() == 1000, "a moved-from buffer is empty");
    DeviceOps::Buffer<bf16> c(1000);
    DeviceOps::copy(c.data() + 10, b.data() + 20, 500);
    DeviceOps::zero(c.data() + 100, 50);
    std::vector<bf16> back(1000);
    DeviceOps::download(back.data(), c.data(), back.size());
    bool ok = true;
    for (std::size_t i = 0; i < 1000; ++i) {
      const std::uint16_t want = i >= 10 && i < 510 && !(i >= 100 && i < 150) ? host[i + 10].bits : 0;
      ok = ok && back[i].bits == want;
    }
    CHECK(ok, "copy, zero, upload and download move the right elements");

    // grad_stats: the host's answer on the same data; no allocation after the first call.
    std::vector<float> g(12345);
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(static_cast<int>(i % 17) - 8) * 0.25f;
    DeviceArray<float> dg(g.size());
    dg.put(g);
    const auto want = HostOps::grad_stats(g.data(), g.size());
    auto got = DeviceOps::grad_stats(dg.p, g.size());
    CHECK(got.sum_squares == want.sum_squares && !got.non_finite,
          fmt("grad_stats %.17g vs host %.17g", got.sum_squares, want.sum_squares));
    g[777] = INFINITY;
    dg.put(g);
    const std::uint64_t allocs = DeviceOps::allocation_count();
    got = DeviceOps::grad_stats(dg.p + 700, 100);
    CHECK(got.non_finite, "grad_stats sees an inf");
    CHECK(DeviceOps::allocation_count() == allocs, "grad_stats allocates no buffer");
    // grad_stats_pieces: ranges added on the device in order, as the host adds them (to the bit), and an
    // inf in any piece seen; empty pieces are skipped.
    const std::size_t starts[] = {0, 3000, 3000, 9001}, sizes[] = {1234, 0, 5000, 777};
    auto pieces_of = [&](const float* base) {
      return [base, &starts, &sizes](std::size_t i) { return std::pair<const float*, std::size_t>(base + starts[i], sizes[i]); };
    };
    g[777] = 0.5f;
    dg.put(g);
    const auto want_pieces = HostOps::grad_stats_pieces(4, pieces_of(g.data()));
    got = DeviceOps::grad_stats_pieces(4, pieces_of(dg.p));
    CHECK(got.sum_squares == want_pieces.sum_squares && !got.non_finite,
          fmt("grad_stats_pieces %.17g vs host %.17g", got.sum_squares, want_pieces.sum_squares));
    g[9500] = NAN;
    dg.put(g);
    CHECK(DeviceOps::grad_stats_pieces(4, pieces_of(dg.p)).non_finite, "grad_stats_pieces sees a NaN in the last piece");
    CHECK(DeviceOps::allocation_count() == allocs, "grad_stats_pieces allocates no buffer");
  } catch (const std::exception& e) {
    CHECK(false, std::string("Ops<Cuda>: exception: ") + e.what());
  }
  section("Ops<Cuda> against Ops<Host>", p0, f0);
}

// ---- LocalDevice collectives: the bits of the host Local ----------------------------

template <class T>
T element(int rank, std::size_t i, int salt) {
  const std::uint64_t h = zero::detail::mix64((static_cast<std::uint64_t>(rank) << 40) ^ (i * 31u) ^ salt);
  if constexpr (std::is_same_v<T, std::uint64_t>) {
    return h;
  } else if constexpr (std::is_same_v<T, double>) {
    return static_cast<double>(static_cast<std::int64_t>(h >> 11) - (std::int64_t{1} << 52)) * 1e-10;
  } else {
    // Not exact in the type: the order and width of the sum show in the bits.
    return zero::from_float<T>(static_cast<float>(static_cast<std::int64_t>(h >> 40) - (1 << 23)) * 1.37e-5f);
  }
}

template <class T>
void collectives_for(int ranks) {
  constexpr zero::DType dt = [] {
    if constexpr (std::is_same_v<T, std::uint64_t>)
      return zero::DType::u64;
    else if constexpr (std::is_same_v<T, double>)
      return zero::DType::f64;
    else
      return zero::dtype_traits<T>::dtype;
  }();
  const std::size_t block = 1031;  // odd: chunks of all_reduce split unevenly
  const std::size_t full = block * static_cast<std::size_t>(ranks);
  // Host expectations from the host reduction (zero::comm::detail::reduce).
  std::vector<std::vector<T>> inputs(static_cast<std::size_t>(ranks), std::vector<T>(full));
  for (int r = 0; r < ranks; ++r)
    for (std::size_t i = 0; i < full; ++i) inputs[r][i] = element<T>(r, i, 1);
  std::vector<const void*> in_ptrs;
  for (auto& v : inputs) in_ptrs.push_back(v.data());
  std::vector<T> sum(full), max(full);
  zero::comm::detail::reduce(dt, sum.data(), in_ptrs.data(), ranks, 0, full, zero::comm::ReduceOp::sum);
  zero::comm::detail::reduce(dt, max.data(), in_ptrs.data(), ranks, 0, full, zero::comm::ReduceOp::max);

  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  zero::comm::LocalGroup::Options lo;
  lo.timeout = std::chrono::seconds(60);
  zero::comm::LocalGroup group(ranks, lo);
  zero::comm::LocalDevice::run(group, [&](zero::comm::LocalDevice& c) {
    const int r = c.rank();
    std::string& err = errors[static_cast<std::size_t>(r)];
    auto expect = [&](const std::vector<T>& got, const T* want, std::size_t n, const char* what) {
      for (std::size_t i = 0; i < n; ++i)
        if (!same_bits(got[i], want[i])) {
          if (err.empty()) err = fmt("rank %d: %s differs at %zu", r, what, i);
          return;
        }
    };
    DeviceArray<T> buf(full), out(block);
    // all_reduce sum and max (in place), after a kernel-free upload on this rank's stream.
    for (const auto op : {zero::comm::ReduceOp::sum, zero::comm::ReduceOp::max}) {
      buf.put(inputs[static_cast<std::size_t>(r)]);
      c.all_reduce(buf.p, full, dt, op, false);
      expect(buf.get(), op == zero::comm::ReduceOp::sum ? sum.data() : max.data(), full, "all_reduce");
    }
    // reduce_scatter, out of place and in place.
    buf.put(inputs[static_cast<std::size_t>(r)]);
    c.reduce_scatter(buf.p, out.p, block, dt);
    expect(out.get(), sum.data() + static_cast<std::size_t>(r) * block, block, "reduce_scatter");
    c.reduce_scatter(buf.p, buf.p + static_cast<std::size_t>(r) * block, block, dt);
    std::vector<T> in_place = buf.get();
    expect(std::vector<T>(in_place.begin() + static_cast<std::ptrdiff_t>(r * block),
                          in_place.begin() + static_cast<std::ptrdiff_t>((r + 1) * block)),
           sum.data() + static_cast<std::size_t>(r) * block, block, "in-place reduce_scatter");
    // all_gather, out of place and in place: block r of rank r's input.
    std::vector<T> gathered(full);
    for (int s = 0; s < ranks; ++s)
      std::copy(inputs[s].begin() + static_cast<std::ptrdiff_t>(s * block),
                inputs[s].begin() + static_cast<std::ptrdiff_t>((s + 1) * block),
                gathered.begin() + static_cast<std::ptrdiff_t>(s * block));
    std::vector<T> mine(inputs[r].begin() + static_cast<std::ptrdiff_t>(r * block),
                        inputs[r].begin() + static_cast<std::ptrdiff_t>((r + 1) * block));
    out.put(mine);
    c.all_gather(out.p, buf.p, block, dt, false);
    expect(buf.get(), gathered.data(), full, "all_gather");
    buf.put(std::vector<T>(full, T{}));
    DeviceOps::upload(buf.p + static_cast<std::size_t>(r) * block, mine.data(), block);
    c.all_gather(buf.p + static_cast<std::size_t>(r) * block, buf.p, block, dt, true);
    expect(buf.get(), gathered.data(), full, "in-place all_gather");
    // broadcast from the last rank.
    buf.put(inputs[static_cast<std::size_t>(r)]);
    c.broadcast(buf.p, full, dt, ranks - 1);
    expect(buf.get(), inputs[static_cast<std::size_t>(ranks - 1)].data(), full, "broadcast");
    // all_to_all: block j of rank s's send lands in block s of rank j's recv.
    std::vector<T> scattered(full), exchanged(full);
    for (std::size_t i = 0; i < full; ++i) scattered[i] = element<T>(r, i, 5);
    for (int s = 0; s < ranks; ++s)
      for (std::size_t i = 0; i < block; ++i)
        exchanged[static_cast<std::size_t>(s) * block + i] = element<T>(s, static_cast<std::size_t>(r) * block + i, 5);
    DeviceArray<T> a2a_send(full);
    a2a_send.put(scattered);
    c.all_to_all(a2a_send.p, buf.p, block, dt);
    expect(buf.get(), exchanged.data(), full, "all_to_all");
    c.barrier();
    // Byte counts: the ring model, as Local counts them.
    zero::comm::ByteCounters want;
    want.count_all_reduce(full * sizeof(T), ranks);
    want.count_all_reduce(full * sizeof(T), ranks);
    want.count_reduce_scatter(full * sizeof(T), ranks);
    want.count_reduce_scatter(full * sizeof(T), ranks);
    want.count_all_gather(full * sizeof(T), ranks);
    want.count_all_gather(full * sizeof(T), ranks, true);
    want.count_broadcast(full * sizeof(T), ranks);
    want.count_all_to_all(block * sizeof(T), c.topology(), r);  // (a direct exchange, not a ring)
    if (c.counters().sent != want.sent || c.counters().received != want.received || c.counters().calls != want.calls)
      if (err.empty()) err = fmt("rank %d: byte counters differ from the ring model", r);
  });
  for (int r = 0; r < ranks; ++r)
    CHECK(errors[static_cast<std::size_t>(r)].empty(),
          fmt("LocalDevice %d ranks, %s: %s", ranks, zero::dtype_name(dt), errors[static_cast<std::size_t>(r)].c_str()));
}

void collective_tests() {
  const int p0 = g_passed, f0 = g_failed;
  try {
    for (int ranks : {1, 2, 3, 4}) {
      collectives_for<float>(ranks);
      collectives_for<bf16>(ranks);
      collectives_for<fp16>(ranks);
      collectives_for<double>(ranks);
      collectives_for<std::uint64_t>(ranks);
    }
    // A rank that fails releases the others from their collective with a CommError.
    std::string other;
    zero::comm::LocalGroup::Options lo;
    lo.timeout = std::chrono::seconds(60);
    zero::comm::LocalGroup group(3, lo);
    CHECK_THROWS(zero::comm::LocalDevice::run(group,
                                              [&](zero::comm::LocalDevice& c) {
                                                if (c.rank() == 1) throw zero::InvalidArgument("rank 1 gives up");
                                                DeviceArray<float> b(8);
                                                try {
                                                  c.all_reduce(b.p, 8, zero::DType::f32);
                                                } catch (const zero::CommError& e) {
                                                  if (c.rank() == 0) other = e.what();
                                                  throw;
                                                }
                                              }),
                 zero::InvalidArgument, "rank 1 gives up");
    CHECK(other.find("rank 1 failed") != std::string::npos, "rank 0 is told that rank 1 failed: " + other);
  } catch (const std::exception& e) {
    CHECK(false, std::string("LocalDevice: exception: ") + e.what());
  }
  section("LocalDevice collectives against Local", p0, f0);
}

// ---- the engine on the GPU -------------------------------------------------------------

// The shared training loop (tests/engine/reference.hpp): gradients are made
// on the host and uploaded into grad_buffer through Ops<Cuda>.
template <class Opt, class Comm>
RunResult train_device(Comm& comm, const typename Opt::Hyper& hyper, const zero::Options& options, int steps,
                       int parts, bool sum_all_parts) {
  zero::test::TrainSpec spec;
  spec.steps = steps;
  spec.parts = parts;
  spec.sum_all_parts = sum_all_parts;
  return zero::test::train<Opt>(comm, hyper, options, spec);
}

// A compute stream apart from the communicator's, current for its lifetime:
// the engine then overlaps (Ops<Cuda>::Overlap) and every missing event
// between the two streams is a race this test can catch.
struct SeparateComputeStream {
  cudaStream_t compute = nullptr;
  std::optional<zero::cuda::CurrentStreamScope> scope;
  SeparateComputeStream() {
    ZERO_CUDA_CHECK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
    scope.emplace(compute);
  }
  ~SeparateComputeStream() {
    cudaStreamSynchronize(compute);
    scope.reset();
    cudaStreamDestroy(compute);
  }
};

// `ranks` ranks on one GPU; rank 0's result, after checking that every rank
// ended with the same bits. `overlap`: the engine computes on a stream of its
// own, the communicator enqueues on the rank's stream.
template <class Opt>
RunResult train_local_device(int ranks, const typename Opt::Hyper& hyper, const zero::Options& options, int steps,
                             int parts, bool sum_all_parts, const std::string& label, bool overlap = false) {
  std::vector<RunResult> results(static_cast<std::size_t>(ranks));
  zero::comm::LocalGroup::Options lo;
  lo.timeout = std::chrono::seconds(120);
  zero::comm::LocalGroup group(ranks, lo);
  zero::comm::LocalDevice::run(group, [&](zero::comm::LocalDevice& c) {
    std::optional<SeparateComputeStream> compute;
    if (overlap) compute.emplace();
    results[static_cast<std::size_t>(c.rank())] = train_device<Opt>(c, hyper, options, steps, parts, sum_all_parts);
  });
  for (int r = 1; r < ranks; ++r) {
    const bool same = results[r].masters == results[0].masters &&
                      std::memcmp(results[r].params.data(), results[0].params.data(),
                                  results[0].params.size() * sizeof(float)) == 0;
    CHECK(same, label + fmt(": rank %d ended with different parameters than rank 0", r));
  }
  return results[0];
}

// The equivalence criterion of tests/engine/engine_harness.hpp.
template <class ParamT>
void check_equivalent(const RunResult& got, const RunResult& want, const std::string& label) {
  if (!CHECK(got.masters.size() == want.masters.size() && got.params.size() == want.params.size(),
             label + fmt(": %zu masters vs %zu", got.masters.size(), want.masters.size())))
    return;
  const zero::test::Mismatch m = zero::test::mismatch<ParamT>(got, want);
  CHECK(m.master_relative <= 1e-5, label + fmt(": masters differ by %.3g relative (limit 1e-5)", m.master_relative));
  CHECK(m.param_ulps <= 1, label + fmt(": low-precision copies differ by %lld ulp (limit 1)",
                                       static_cast<long long>(m.param_ulps)));
}

template <class P>
const char* precision_name() {
  if constexpr (!P::mixed) return "fp32";
  return zero::dtype_traits<typename P::param_type>::name;
}

template <int S, class P, class O>
void equivalence_config() {
  using Opt = zero::ZeroOptimizer<P, O, zero::stage<S>, zero::offload::None, zero::backend::Cuda>;
  const auto hyper = zero::test::test_hyper<O>();
  struct DeviceVariant {
    zero::test::Variant v;
    bool overlap;  // compute and communication on separate streams
  };
  using zero::ReduceDType;
  using zero::test::one_unit_bucket;
  using zero::test::whole_model_bucket;
  const DeviceVariant variants[] = {
      {{"plain", 1, 0.0, ReduceDType::same_as_grad, whole_model_bucket}, false},
      {{"accumulate 3 + clip", 3, 0.05, ReduceDType::same_as_grad, whole_model_bucket}, false},
      // every unit its own bucket: both staging sets in use
      {{"overlap, accumulate 2, one unit per bucket", 2, 0.0, ReduceDType::same_as_grad, one_unit_bucket}, true}};
  for (const int ranks : {1, 2, 4}) {
    std::uint64_t plain_comm_buffers = 0;
    for (const auto& [v, overlap] : variants) {
      if (g_quick && (ranks != 2 || v.accumulation == 1)) continue;
      const std::string label =
          fmt("stage %d %s %s, %d rank(s), %s", S, precision_name<P>(), O::name, ranks, v.name);
      try {
        const zero::Options options = v.options();
        const int steps = 5;
        const RunResult got = train_local_device<Opt>(ranks, hyper, options, steps, ranks, false, label, overlap);
        if (!overlap && v.accumulation == 1) plain_comm_buffers = got.memory.communication_buffers;
        // Two staging sets when overlapping (stages 2 and 3 always stage).
        if (overlap && S >= 2 && plain_comm_buffers != 0)
          CHECK(got.memory.communication_buffers > plain_comm_buffers,
                label + fmt(": %llu bytes of communication buffers, no more than without overlap (%llu)",
                            static_cast<unsigned long long>(got.memory.communication_buffers),
                            static_cast<unsigned long long>(plain_comm_buffers)));
        const RunResult want = zero::test::reference_train<P, O>(ranks, hyper, options, steps);
        if (CHECK(got.steps.size() == want.steps.size(), label + ": number of steps")) {
          for (std::size_t i = 0; i < got.steps.size(); ++i) {
            CHECK(got.steps[i].stepped, label + fmt(": step %zu did not step", i + 1));
            const double a = got.steps[i].grad_norm, b = want.steps[i].grad_norm;
            CHECK(std::fabs(a - b) <= 1e-9 * std::max(std::fabs(b), 1e-300),
                  label + fmt(": step %zu grad norm %.17g, reference %.17g", i + 1, a, b));
          }
        }
        check_equivalent<typename Opt::param_type>(got, want, label);
        // One rank summing every part of the batch trains the same way.
        if (ranks > 1 && !g_quick) {
          zero::Options single = options;
          single.gradient_divisor = static_cast<double>(ranks * v.accumulation);
          const RunResult one = train_local_device<Opt>(1, hyper, single, steps, ranks, true, label + " (1 rank, whole batch)");
          check_equivalent<typename Opt::param_type>(one, want, label + " (1 rank, whole batch)");
        }
        std::size_t moved = 0, k = 0;
        const auto& model = zero::test::test_model();
        for (std::size_t p = 0; p < model.size(); ++p)
          for (std::size_t i = 0; i < model[p].numel; ++i, ++k) moved += got.masters[k] != zero::test::init_value(p, i);
        CHECK(moved > k * 9 / 10, label + fmt(": only %zu of %zu parameters moved", moved, k));
      } catch (const std::exception& e) {
        CHECK(false, label + ": exception: " + e.what());
      }
    }
  }
}

template <int S>
void equivalence_stage() {
  using namespace zero::precision;
  using zero::optim::Adam;
  using zero::optim::AdamW;
  using zero::optim::Sgd;
  const int p0 = g_passed, f0 = g_failed;
  equivalence_config<S, Full<float>, Adam>();
  equivalence_config<S, Full<float>, AdamW>();
  equivalence_config<S, Full<float>, Sgd>();
  equivalence_config<S, Mixed<bf16>, Adam>();
  equivalence_config<S, Mixed<bf16>, AdamW>();
  equivalence_config<S, Mixed<bf16>, Sgd>();
  equivalence_config<S, Mixed<fp16>, Adam>();
  equivalence_config<S, Mixed<fp16>, AdamW>();
  equivalence_config<S, Mixed<fp16>, Sgd>();
  section(fmt("engine equivalence, stage %d (9 configs x N %s)", S, g_quick ? "2" : "1,2,4").c_str(), p0, f0);
}

// ---- ZeRO-Offload: the CPU update beside the GPU (tests/engine/test_engine_offload.cpp) ----

// offload::Cpu on the GPU trains bit for bit like offload::None (the host
// fused step rounds as the device's), with and without a separate compute
// stream; the device holds what memory_report() places there, measured with
// cudaMemGetInfo around finalize() (cudaMalloc rounds each buffer up to its
// granularity, so the measurement may exceed the report by that much).
template <int S, class P, class O>
void offload_config() {
  using Offloaded = zero::ZeroOptimizer<P, O, zero::stage<S>, zero::offload::Cpu, zero::backend::Cuda>;
  using Resident = zero::ZeroOptimizer<P, O, zero::stage<S>, zero::offload::None, zero::backend::Cuda>;
  const auto hyper = zero::test::test_hyper<O>();
  for (const int ranks : {1, 2, 4}) {
    for (const bool overlap : {false, true}) {
      if (g_quick && ranks != 2) continue;
      const std::string label = fmt("offload::Cpu stage %d %s %s, %d rank(s)%s", S, precision_name<P>(), O::name,
                                    ranks, overlap ? ", overlap" : "");
      try {
        zero::test::Variant v{"accumulate 2 + clip, one unit per bucket", 2, 0.05,
                              zero::ReduceDType::same_as_grad, zero::test::one_unit_bucket};
        const zero::Options options = v.options();
        const RunResult got = train_local_device<Offloaded>(ranks, hyper, options, 4, ranks, false, label, overlap);
        const RunResult want = train_local_device<Resident>(ranks, hyper, options, 4, ranks, false, label, overlap);
        CHECK(got.masters == want.masters, label + ": fp32 masters differ from the run without offload");
        CHECK(got.params == want.params, label + ": parameters differ from the run without offload");
      } catch (const std::exception& e) {
        CHECK(false, label + ": exception: " + e.what());
      }
    }
  }
}

void offload_tests() {
  using namespace zero::precision;
  const int p0 = g_passed, f0 = g_failed;
  offload_config<1, Mixed<bf16>, zero::optim::AdamW>();
  offload_config<2, Mixed<fp16>, zero::optim::Adam>();
  offload_config<2, Full<float>, zero::optim::Sgd>();
  offload_config<3, Mixed<bf16>, zero::optim::Adam>();
  // Device memory: 64 Mi parameters at stage 2 on one rank, bf16 + AdamW;
  // then where the step's time goes (bench/gpu_check.sh copies these lines
  // into its summary).
  try {
    using Opt = zero::ZeroOptimizer<Mixed<bf16>, zero::optim::AdamW, zero::stage<2>, zero::offload::Cpu,
                                    zero::backend::Cuda>;
    using Ops = zero::backend::Ops<zero::backend::Cuda>;
    zero::comm::LocalGroup group(1);
    zero::comm::LocalDevice::run(group, [&](zero::comm::LocalDevice& c) {
      std::size_t free_before = 0, free_after = 0, free_stepped = 0, total = 0;
      Opt opt(c, zero::test::test_hyper<zero::optim::AdamW>());
      std::vector<zero::UnitId> units;
      for (int u = 0; u < 8; ++u) {
        units.push_back(opt.add_unit("u" + std::to_string(u)));
        opt.add_param(units.back(), "w" + std::to_string(u), std::size_t{8} << 20);
      }
      ZERO_CUDA_CHECK(cudaDeviceSynchronize());
      ZERO_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
      opt.finalize();
      ZERO_CUDA_CHECK(cudaDeviceSynchronize());
      ZERO_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
      const zero::MemoryReport m = opt.memory_report();
      const double measured = static_cast<double>(free_before - free_after);
      const double reported = static_cast<double>(m.placed.total().device);
      std::printf("offload::Cpu stage 2, 64 Mi bf16 parameters: device memory %.1f MiB measured, %.1f MiB "
                  "reported (host %.1f MiB)\n",
                  measured / 1048576.0, reported / 1048576.0, static_cast<double>(m.placed.total().host) / 1048576.0);
      CHECK(measured >= reported && measured <= reported + 64.0 * 1048576.0,
            fmt("offload::Cpu device memory: %.0f bytes measured, %.0f reported", measured, reported));
      CHECK(m.placed.master.device == 0 && m.placed.optimizer_states.device == 0,
            "offload::Cpu keeps no master or optimizer state on the device");

      // Steps: a warm-up, then `steps` timed on the caller's clock around
      // grad_ready, step() and synchronize(), against the engine's split.
      const int steps = g_quick ? 2 : 5;
      const std::size_t unit_elements = opt.layout().unit(units.front()).padded;
      std::vector<bf16> host_grad(unit_elements, zero::from_float<bf16>(1e-3f));
      double total_seconds = 0;
      for (int step = 0; step <= steps; ++step) {
        if (step == 1) {
          opt.reset_offload_times();
          total_seconds = 0;
        }
        const auto t0 = std::chrono::steady_clock::now();
        for (auto it = units.rbegin(); it != units.rend(); ++it) {
          Ops::upload(opt.grad_buffer(*it), host_grad.data(), host_grad.size());
          opt.grad_ready(*it);
        }
        opt.step();
        opt.synchronize();
        total_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      ZERO_CUDA_CHECK(cudaMemGetInfo(&free_stepped, &total));
      const zero::OffloadTimes t = opt.offload_times();
      // The same bytes moved alone: the owned gradient down, the parameters up.
      const std::size_t owned = opt.layout().shard_total();
      zero::backend::CudaBuffer<bf16> device(owned);
      zero::backend::CudaPinnedBuffer<bf16> host(owned);
      auto timed = [&](auto copy) {
        Ops::synchronize();
        const auto t0 = std::chrono::steady_clock::now();
        copy();
        Ops::synchronize();
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      };
      const double down = timed([&] { Ops::download_async(host.data(), device.data(), owned); });
      const double up = timed([&] { Ops::upload_async(device.data(), host.data(), owned); });
      const double per = 1e3 / steps;
      std::printf("offload::Cpu step split (stage 2, 64 Mi bf16, AdamW, %d steps): %.2f ms per step = GPU wait %.2f "
                  "+ CPU update %.2f + rest %.2f (control all-reduce, uploads not hidden, all-gather); the same "
                  "transfers alone: gradient down %.2f ms, parameters up %.2f ms (%.1f / %.1f GB/s); device memory "
                  "after the steps %.1f MiB above before finalize()\n",
                  steps, total_seconds * per, t.device_wait_seconds * per, t.cpu_update_seconds * per,
                  (total_seconds - t.device_wait_seconds - t.cpu_update_seconds) * per, down * 1e3, up * 1e3,
                  owned * 2.0 / down / 1e9, owned * 2.0 / up / 1e9,
                  static_cast<double>(free_before - free_stepped) / 1048576.0);
      CHECK(t.steps == static_cast<std::uint64_t>(steps), fmt("offload times counted %llu steps, not %d",
                                                             static_cast<unsigned long long>(t.steps), steps));
      CHECK(t.device_wait_seconds >= 0 && t.cpu_update_seconds > 0 &&
                t.device_wait_seconds + t.cpu_update_seconds <= total_seconds,
            "offload times: the GPU wait and the CPU update fit inside the steps' time");
      CHECK(free_stepped + 64.0 * 1048576.0 >= free_after,
            "offload::Cpu: the steps allocate no device memory beyond the first step's workspaces");
    });
  } catch (const std::exception& e) {
    CHECK(false, std::string("offload::Cpu device memory: exception: ") + e.what());
  }
  section("ZeRO-Offload (offload::Cpu) against no offload", p0, f0);
}

// ---- reports: the ZeRO paper's formulas (tests/engine/test_engine_reports.cpp) ----------

template <int S>
void reports_for(int n) {
  using P = zero::precision::Mixed<bf16>;
  using O = zero::optim::Adam;
  using Opt = zero::ZeroOptimizer<P, O, zero::stage<S>, zero::offload::None, zero::backend::Cuda>;
  const std::string label = fmt("reports stage %d, %d rank(s)", S, n);
  try {
    const RunResult r = train_local_device<Opt>(n, O::Hyper{}, zero::Options{}, 3, n, false, label);
    const std::uint64_t phi = r.memory.padded_elements, N = static_cast<std::uint64_t>(n);
    CHECK(phi % (N * 64) == 0, label);
    const std::uint64_t expected = zero::test::zero_paper_model_state_bytes(S, phi, N);
    CHECK(r.memory.model_states() == expected,
          label + fmt(": model states %llu bytes, formula %llu", static_cast<unsigned long long>(r.memory.model_states()),
                      static_cast<unsigned long long>(expected)));
    CHECK(r.memory.master == 4 * (S == 0 ? phi : phi / N), label + ": master bytes");
    CHECK(r.memory.optimizer_states == 8 * (S == 0 ? phi : phi / N), label + ": optimizer state bytes");
    CHECK(r.memory.padding < r.memory.model_states(), label + ": padding");
    // Stages 0 and 1 without accumulation take gradients in place: no staging.
    CHECK((r.memory.communication_buffers > 0) == (S >= 2), label + ": communication buffers");
    const std::uint64_t elements = zero::test::zero_paper_traffic_elements(S, phi, N);
    CHECK(r.comm.steps == 3, label + ": steps counted");
    const double want = 2.0 * static_cast<double>(elements);
    CHECK(std::fabs(r.comm.sent_per_step() - want) <= 1e-9 * std::max(want, 1.0),
          label + fmt(": sent %.1f bytes per step, formula %.1f", r.comm.sent_per_step(), want));
    CHECK(std::fabs(r.comm.received_per_step() - want) <= 1e-9 * std::max(want, 1.0),
          label + fmt(": received %.1f bytes per step, formula %.1f", r.comm.received_per_step(), want));
    CHECK(r.comm.control_sent() < 64 * r.comm.steps, label + ": control traffic is a few bytes per step");
  } catch (const std::exception& e) {
    CHECK(false, label + ": exception: " + e.what());
  }
}

void report_tests() {
  const int p0 = g_passed, f0 = g_failed;
  for (int n : {1, 2, 4}) {
    reports_for<0>(n);
    reports_for<1>(n);
    reports_for<2>(n);
    reports_for<3>(n);
  }
  section("memory and communication reports (bf16 Adam)", p0, f0);
}

// ---- steady-state steps allocate nothing (tests/engine/test_engine_alloc.cpp) -----------

template <int S, class P>
void no_allocation(int ranks) {
  using Opt = zero::ZeroOptimizer<P, zero::optim::AdamW, zero::stage<S>, zero::offload::None, zero::backend::Cuda>;
  const std::string label = fmt("allocation stage %d %s, %d ranks", S, precision_name<P>(), ranks);
  std::atomic<long> buffers_during_steps{-1};
  try {
    zero::comm::LocalGroup::Options lo;
    lo.timeout = std::chrono::seconds(60);
    zero::comm::LocalGroup group(ranks, lo);
    zero::comm::LocalDevice::run(group, [&](zero::comm::LocalDevice& c) {
      Opt opt(c, {}, zero::test::steady_state_options());
      zero::test::SteadyStateRun<Opt> run(opt);
      run.micro_batch();  // warm-up: the thread's grad-stats workspace, launch-shape caches
      run.micro_batch();
      c.barrier();
      const auto buffers = DeviceOps::allocation_count();
      c.barrier();
      for (int i = 0; i < 6; ++i) run.micro_batch();
      c.barrier();
      if (c.rank() == 0) buffers_during_steps = static_cast<long>(DeviceOps::allocation_count() - buffers);
      c.barrier();
    });
  } catch (const std::exception& e) {
    CHECK(false, label + ": exception: " + e.what());
  }
  CHECK(buffers_during_steps == 0, label + fmt(": %ld device buffers allocated in steady-state steps",
                                                buffers_during_steps.load()));
}

void allocation_tests() {
  const int p0 = g_passed, f0 = g_failed;
  no_allocation<0, zero::precision::Mixed<bf16>>(2);
  no_allocation<1, zero::precision::Full<float>>(3);
  no_allocation<2, zero::precision::Mixed<fp16>>(4);
  no_allocation<3, zero::precision::Mixed<bf16>>(4);
  section("steady-state steps allocate no device buffer", p0, f0);
}

// ---- NCCL with one rank --------------------------------------------------------------------

#if defined(ZERO_TEST_WITH_NCCL)

using zero::test::one_rank_comm;

template <int S, class P, class O>
void nccl_engine(zero::comm::Nccl& nccl, const char* how, zero::ReduceDType reduce) {
  using Opt = zero::ZeroOptimizer<P, O, zero::stage<S>, zero::offload::None, zero::backend::Cuda>;
  const std::string label = fmt("Nccl (%s) stage %d %s %s, reduce in %s", how, S, precision_name<P>(), O::name,
                                reduce == zero::ReduceDType::fp32 ? "fp32" : "grad type");
  try {
    zero::Options options;
    options.grad_accumulation_steps = 2;
    options.clip_norm = 0.05;
    options.loss_scale.initial_scale = 256;
    options.reduce_dtype = reduce;
    const auto hyper = zero::test::test_hyper<O>();
    const RunResult got = train_device<Opt>(nccl, hyper, options, 4, 1, false);
    const RunResult want = zero::test::reference_train<P, O>(1, hyper, options, 4);
    check_equivalent<typename Opt::param_type>(got, want, label);
    CHECK(got.comm.counters.total_sent() == 0, label + ": one rank sends nothing");
    CHECK(got.comm.counters.calls[static_cast<std::size_t>(S == 3 ? zero::comm::Collective::all_gather
                                                                  : zero::comm::Collective::reduce_scatter)] > 0,
          label + ": collectives are counted");
  } catch (const std::exception& e) {
    CHECK(false, label + ": exception: " + e.what());
  }
}

void nccl_tests() {
  const int p0 = g_passed, f0 = g_failed;
  try {
    ZERO_CUDA_CHECK(cudaSetDevice(0));
    DeviceOps::reset_stream();
    {
      // An adopted communicator (ncclCommInitAll, one rank on device 0).
      ncclComm_t comm = one_rank_comm();
      {
        zero::comm::Nccl nccl(comm);  // a stream of its own: the engine overlaps
        CHECK(nccl.rank() == 0 && nccl.size() == 1 && nccl.stream() != DeviceOps::stream(), "adopted communicator");
        nccl_engine<2, zero::precision::Mixed<bf16>, zero::optim::AdamW>(nccl, "adopted", zero::ReduceDType::same_as_grad);
        nccl_engine<3, zero::precision::Mixed<fp16>, zero::optim::Adam>(nccl, "adopted", zero::ReduceDType::fp32);
        nccl_engine<3, zero::precision::Full<float>, zero::optim::Sgd>(nccl, "adopted", zero::ReduceDType::same_as_grad);
        nccl_engine<2, zero::precision::Mixed<fp16>, zero::optim::Sgd>(nccl, "adopted", zero::ReduceDType::same_as_grad);
      }
      {
        // On the compute stream itself: nothing overlaps, the same results.
        zero::comm::Nccl nccl(comm, DeviceOps::stream());
        CHECK(nccl.stream() == DeviceOps::stream(), "communicator on the compute stream");
        nccl_engine<2, zero::precision::Mixed<bf16>, zero::optim::AdamW>(nccl, "compute stream",
                                                                         zero::ReduceDType::same_as_grad);
        nccl_engine<3, zero::precision::Mixed<fp16>, zero::optim::Adam>(nccl, "compute stream", zero::ReduceDType::fp32);
      }
      {
        zero::comm::Nccl nccl(comm);

        // Every element type, a group, and the byte counters of one rank.
        DeviceArray<double> d(4);
        d.put({1.0, -2.0, 3.5, 0.25});
        nccl.group_begin();
        nccl.all_reduce(d.p, 4, zero::DType::f64, zero::comm::ReduceOp::sum, true);
        nccl.all_gather(d.p, d.p, 4, zero::DType::u64, false);
        nccl.broadcast(d.p, 4, zero::DType::f64, 0);
        nccl.group_end();
        const auto back = d.get();
        CHECK(back[0] == 1.0 && back[1] == -2.0 && back[2] == 3.5 && back[3] == 0.25, "one rank: data unchanged");
        // all_to_all of one rank: its own block, copied on the communicator's
        // stream (alone, and inside a group).
        DeviceArray<double> exchanged(4), again(4);
        nccl.all_to_all(d.p, exchanged.p, 4, zero::DType::f64);
        nccl.group_begin();
        nccl.all_to_all(exchanged.p, again.p, 4, zero::DType::u8);  // the first 4 bytes
        nccl.group_end();
        nccl.wait();
        CHECK(exchanged.get() == back, "one rank: all_to_all copies its own block");
        CHECK(std::memcmp(again.get().data(), back.data(), 4) == 0, "one rank: all_to_all of u8 inside a group");
        CHECK(nccl.counters().calls[static_cast<std::size_t>(zero::comm::Collective::all_to_all)] == 2 &&
                  nccl.counters().sent[static_cast<std::size_t>(zero::comm::Collective::all_to_all)] == 0,
              "one rank: all_to_all counted, no bytes");
        // node() and across() of one rank: ncclCommSplit once each, one-rank
        // communicators on the parent's stream (hpZ's and qgZ's).
        zero::comm::Nccl& node = nccl.node();
        zero::comm::Nccl& across = nccl.across();
        CHECK(node.size() == 1 && node.rank() == 0 && across.size() == 1 && node.stream() == nccl.stream() &&
                  &node == &nccl.node() && &across == &nccl.across(),
              "one rank: node() and across() split once, on the parent's stream");
        DeviceArray<double> gathered(4), moved(4);
        node.all_gather(d.p, gathered.p, 4, zero::DType::f64, false);
        across.all_to_all(gathered.p, moved.p, 4, zero::DType::f64);
        node.wait();
        across.wait();
        CHECK(moved.get() == back, "one rank: a gather on node() and an all_to_all on across()");
        for (zero::DType t : {zero::DType::f32, zero::DType::f16, zero::DType::bf16}) {
          DeviceArray<float> f(64);
          nccl.all_reduce(f.p, 32, t, zero::comm::ReduceOp::max, false);
          nccl.reduce_scatter(f.p, f.p, 32, t);
        }
        nccl.barrier();
        nccl.wait();
        CHECK(nccl.counters().total_sent() == 0 && nccl.counters().calls[0] > 0, "one rank: calls counted, no bytes");
      }
      ncclCommDestroy(comm);
    }
    {
      // Bootstrap through a unique-id file (one rank: rank 0 writes, joins and removes it).
      const std::string path = fmt("/tmp/zero_test_nccl_id_%d", static_cast<int>(getpid()));
      zero::comm::Nccl nccl = zero::comm::Nccl::from_unique_id_file(path, 0, 1, std::chrono::seconds(60));
      CHECK(nccl.size() == 1, "unique-id file bootstrap");
      CHECK(access(path.c_str(), F_OK) != 0, "rank 0 removes the id file once every rank joined");
      nccl_engine<2, zero::precision::Mixed<bf16>, zero::optim::Adam>(nccl, "unique-id file",
                                                                       zero::ReduceDType::same_as_grad);
      zero::comm::Nccl moved = std::move(nccl);
      nccl_engine<3, zero::precision::Mixed<bf16>, zero::optim::Sgd>(moved, "unique-id file, moved",
                                                                     zero::ReduceDType::fp32);
    }
    // A rank whose id file never appears gets a clear error, not a hang.
    CHECK_THROWS(zero::comm::Nccl::from_unique_id_file("/tmp/zero_test_nccl_no_such_file", 1, 2,
                                                       std::chrono::milliseconds(300)),
                 zero::CommError, "which rank 0 writes");

    // A collective that does not finish within the timeout: abort and CommError
    // naming it, through wait() and through a host wait of the backend. (The
    // collective has no elements, so NCCL has nothing in flight when aborted;
    // what cannot finish is the stream ahead of it.)
    for (const bool through_backend : {false, true}) {
      ncclComm_t comm = one_rank_comm();
      zero::comm::Nccl::Options options;
      options.timeout = std::chrono::milliseconds(300);
      zero::comm::Nccl nccl(comm, DeviceOps::stream(), options);
      DeviceArray<float> f(16);
      nccl.all_reduce(f.p, 16, zero::DType::f32);
      nccl.wait();
      zero::test::BlockedStream blocked(DeviceOps::stream(), std::chrono::seconds(3));
      nccl.all_reduce(f.p, 0, zero::DType::bf16);
      const auto start = std::chrono::steady_clock::now();
      if (through_backend) {
        std::vector<float> host(16);
        CHECK_THROWS(DeviceOps::download(host.data(), f.p, 16), zero::CommError, "all_reduce #2 (0 elements of bf16)");
      } else {
        CHECK_THROWS(nccl.wait(), zero::CommError, "all_reduce #2 (0 elements of bf16) did not finish within 300 ms");
      }
      // (Without the timeout the wait would simply return once the stream is
      // released; ncclCommAbort itself may wait for the device until then.)
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf("  Nccl timeout via %s: CommError after %.2f s (timeout 0.3 s, stream released after 3 s)\n",
                  through_backend ? "Ops<Cuda>::download" : "Nccl::wait", waited);
      CHECK(nccl.aborted(), "the communicator is aborted");
      CHECK_THROWS(nccl.all_reduce(f.p, 16, zero::DType::f32), zero::CommError, "rank 0 of 1");
      // The aborted ncclComm_t was freed by ncclCommAbort: not destroyed here.
    }
  } catch (const std::exception& e) {
    CHECK(false, std::string("Nccl: exception: ") + e.what());
  }
  section("comm::Nccl, one rank", p0, f0);
}

#endif  // ZERO_TEST_WITH_NCCL

}  // namespace

int main(int argc, char** argv) {
  zero::test::TestArgs args;
  if (!zero::test::parse_test_args(argc, argv, {"ops", "collectives", "engine", "offload", "reports", "alloc", "nccl"}, true,
                                   args))
    return 2;
  g_quick = args.quick;
  const auto runs = [&](const char* group) { return args.runs(group); };
  if (zero::test::no_cuda_device()) return 77;
  const auto start = std::chrono::steady_clock::now();
  try {
    cudaDeviceProp prop{};
    ZERO_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device 0: %s, compute capability %d.%d, %d SMs%s\n", prop.name, prop.major, prop.minor,
                prop.multiProcessorCount, g_quick ? " (quick)" : "");
    if (runs("ops")) ops_tests();
    if (runs("collectives")) collective_tests();
    if (runs("engine")) {
      equivalence_stage<0>();
      equivalence_stage<1>();
      equivalence_stage<2>();
      equivalence_stage<3>();
    }
    if (runs("offload")) offload_tests();
    if (runs("reports")) report_tests();
    if (runs("alloc")) allocation_tests();
#if defined(ZERO_TEST_WITH_NCCL)
    if (runs("nccl")) nccl_tests();  // last: its timeout test aborts communicators
#else
    if (runs("nccl")) std::printf("comm::Nccl: not built (no nccl.h)\n");
#endif
  } catch (const std::exception& e) {
    CHECK(false, std::string("uncaught exception: ") + e.what());
  }
  std::printf("%.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
