// Host fused-step benchmark: parameters/s, bytes/s and the ratio to the
// bandwidth limit of the same access pattern (ProbePolicy through the same
// kernel, same threads, timed interleaved with the real step in this run).
// bf16_remainder_adamw keeps the master as the bf16 copy plus a remainder
// (Options::master = remainder), bf16_remainder_bf16states_adamw also the
// state in bf16 (Options::states = bf16): their probes run the same paths.
// bf16_remainder_8bit_adamw keeps the state in 8-bit blocks of 2048
// (Options::states = blockwise8): its probe is a loop over the same arrays
// and bytes (one byte per state value read and written, the remainder and
// copy, the gradient) that adds 1 to each, since the probe policy through
// the block step would still quantize.
//
//   bench_step_host [--n N (K/M/G suffixes)] [--reps R] [--json] [--isa portable|avx2|avx512]
//                   [--only LABEL-PART]   (only the configurations whose label contains it)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bench_args.hpp"
#include "probe_policy.hpp"
#include "zero/kernels/host_step.hpp"
#include "zero/optim/adam.hpp"
#include "zero/optim/sgd.hpp"
#include "zero/quant/dynamic_code.hpp"

namespace {

struct Options {
  std::size_t n = std::size_t{64} << 20;
  int reps = 9;
  bool json = false;
  const char* only = nullptr;  // run only the configurations whose label contains this
};

enum class States { fp32, bf16, blockwise8 };
constexpr std::size_t kBlock = zero::quant::default_block;

// Owns the arrays of one configuration, first-touched by the threads that
// will use them (so pages land where the kernel runs).
template <class Grad, class Param, int Slots>
struct Buffers {
  std::size_t n;
  std::vector<float> master;
  std::vector<std::uint16_t> remainder;  // instead of the master, when given
  std::vector<Grad> grad;
  std::vector<std::vector<float>> state;
  std::vector<std::vector<zero::bf16>> state16;  // instead of `state`, when given
  std::vector<std::vector<std::uint8_t>> codes;  // 8-bit states instead of `state`, when given
  std::vector<std::vector<float>> absmax;
  std::vector<Param> param;
  Buffers(std::size_t elements, bool remainders, States states)
      : n(elements), master(remainders ? 0 : n, 0.5f), remainder(remainders ? n : 0, 0),
        grad(n, zero::from_float<Grad>(0.01f)),
        state(states == States::fp32 ? Slots : 0, std::vector<float>(n, 0.0f)),
        state16(states == States::bf16 ? Slots : 0, std::vector<zero::bf16>(n, zero::bf16{0})),
        codes(states == States::blockwise8 ? Slots : 0, std::vector<std::uint8_t>(n, 0)),
        absmax(states == States::blockwise8 ? Slots : 0, std::vector<float>(zero::quant::block_count(n, kBlock), 0.0f)),
        param(std::is_same_v<Param, float> ? 0 : n, zero::from_float<Param>(0.5f)) {}
};

template <class Opt, class Grad, class Param, int Slots>
double time_step(Buffers<Grad, Param, Slots>& b, const typename Opt::Hyper& hyper, int step) {
  zero::kernels::FusedStepArgs<Opt, Grad, Param> args;
  args.master = b.master.empty() ? nullptr : b.master.data();
  if constexpr (zero::kernels::FusedStepArgs<Opt, Grad, Param>::can_split_master)
    args.remainder = b.remainder.empty() ? nullptr : b.remainder.data();
  args.grad = b.grad.data();
  for (int k = 0; k < Slots; ++k) {
    if (!b.codes.empty()) {
      args.state8[k] = b.codes[k].data();
      args.absmax[k] = b.absmax[k].data();
      args.code[k] = zero::quant::code_for(zero::optim::state_values<Opt>(k) == zero::optim::StateValues::non_negative);
      args.block = kBlock;
    } else if (b.state16.empty()) {
      args.state[k] = b.state[k].data();
    } else {
      args.state16[k] = b.state16[k].data();
    }
  }
  args.param = b.param.empty() ? nullptr : b.param.data();
  args.n = b.n;
  args.scalars = Opt::prepare(hyper, step);
  const auto t0 = std::chrono::steady_clock::now();
  zero::kernels::host_fused_step(args);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The 8-bit step's probe: its arrays and bytes, one add each, a block of
// the step's at a time (threads as the kernel's), each array in a loop of
// its own within the block so that each is vectorized (one loop over all of
// them through an array of code pointers was compiled scalar, about half
// the memory's speed).
template <class Grad, class Param, int Slots>
double time_byte_probe(Buffers<Grad, Param, Slots>& b) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto n = static_cast<std::int64_t>(b.n);
  constexpr auto block = static_cast<std::int64_t>(kBlock);
  std::uint16_t* const rest = b.remainder.data();
  std::uint16_t* const copy = reinterpret_cast<std::uint16_t*>(b.param.data());
  const std::uint16_t* const grad = reinterpret_cast<const std::uint16_t*>(b.grad.data());
  std::uint8_t* codes[Slots > 0 ? Slots : 1] = {};
  for (int k = 0; k < Slots; ++k) codes[k] = b.codes[k].data();
#pragma omp parallel for num_threads(zero::simd::host_threads())
  for (std::int64_t first = 0; first < n; first += block) {
    const std::int64_t last = std::min(first + block, n);
    for (std::int64_t i = first; i < last; ++i) rest[i] = static_cast<std::uint16_t>(rest[i] + grad[i]);
    for (std::int64_t i = first; i < last; ++i) copy[i] = static_cast<std::uint16_t>(copy[i] + 1);
    for (int k = 0; k < Slots; ++k) {
      std::uint8_t* const q = codes[k];
      for (std::int64_t i = first; i < last; ++i) q[i] = static_cast<std::uint8_t>(q[i] + 1);
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Noise on a shared machine only ever adds time, so the fastest of the
// interleaved repetitions is the best estimate of each kernel's speed.
double fastest(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

template <class Opt, class Grad, class Param>
void run(const char* label, const typename Opt::Hyper& hyper, const Options& o, bool remainder = false,
         States states = States::fp32) {
  if (o.only != nullptr && std::strstr(label, o.only) == nullptr) return;
  constexpr int slots = Opt::state_slots;
  using Probe = zero::bench::ProbePolicy<slots>;
  Buffers<Grad, Param, slots> b(o.n, remainder, states);
  auto time_probe = [&](int step) {
    if constexpr (std::is_same_v<Param, zero::bf16> && sizeof(Grad) == 2)
      if (states == States::blockwise8) return time_byte_probe(b);
    return time_step<Probe>(b, typename Probe::Hyper{}, step);
  };
  // Warm up both (page faults, frequency), then alternate so drift hits both.
  time_step<Opt>(b, hyper, 1);
  time_probe(1);
  std::vector<double> real, probe;
  for (int r = 0; r < o.reps; ++r) {
    real.push_back(time_step<Opt>(b, hyper, r + 2));
    probe.push_back(time_probe(r + 2));
  }
  const double t = fastest(real), tp = fastest(probe);
  // Read and written: the master (4, or a 2-byte remainder and the copy's
  // 2 read back) and the states; read: the gradient; written: the copy.
  // (8-bit states: the absmax, 4 bytes per 2048 values, is left out.)
  const double master_bytes = remainder ? 2.0 * 2 + sizeof(Param) : 4.0 * 2;
  const double state_bytes = states == States::blockwise8 ? 1.0 : states == States::bf16 ? 2.0 : 4.0;
  const double bytes_per_param =
      master_bytes + state_bytes * slots * 2 + sizeof(Grad) + (std::is_same_v<Param, float> ? 0 : sizeof(Param));
  const double params_per_s = static_cast<double>(o.n) / t;
  const double gbs = params_per_s * bytes_per_param / 1e9;
  const double ratio = tp / t;
  const char* isa = zero::simd::isa_name(zero::simd::active_isa());
  const int threads = zero::simd::host_threads();
  if (o.json) {
    std::printf(
        "{\"bench\":\"step_host\",\"config\":\"%s\",\"n\":%zu,\"isa\":\"%s\",\"threads\":%d,\"seconds\":%.6f,"
        "\"probe_seconds\":%.6f,\"params_per_s\":%.4e,\"bytes_per_param\":%.0f,\"gb_per_s\":%.3f,\"ratio_to_probe\":%.4f}\n",
        label, o.n, isa, threads, t, tp, params_per_s, bytes_per_param, gbs, ratio);
  } else {
    std::printf("%-32s n=%zu isa=%s threads=%d  %.2f ms/step  %.3e params/s  %.2f GB/s (%.0f B/param)  probe %.2f ms  "
                "ratio to probe %.3f\n",
                label, o.n, isa, threads, t * 1e3, params_per_s, gbs, bytes_per_param, tp * 1e3, ratio);
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  zero::bench::Args args(argc, argv, "[--n PARAMS (K/M/G suffixes)] [--reps R] [--json] [--isa portable|avx2|avx512] [--only LABEL-PART]");
  while (args.next()) {
    if (args.is("--n"))
      o.n = args.count();
    else if (args.is("--reps"))
      o.reps = args.positive();
    else if (args.is("--json"))
      o.json = true;
    else if (args.is("--only"))
      o.only = args.value();
    else if (args.is("--isa"))
      zero::simd::force_isa(zero::simd::detail::parse_isa(args.value(), "--isa"));
    else
      args.usage();
  }
  zero::optim::AdamW::Hyper adamw;
  zero::optim::Sgd::Hyper sgd;
  sgd.momentum = 0.9;
  run<zero::optim::AdamW, float, float>("fp32_adamw", adamw, o);
  run<zero::optim::AdamW, zero::bf16, zero::bf16>("bf16_mixed_adamw", adamw, o);
  run<zero::optim::AdamW, zero::bf16, zero::bf16>("bf16_remainder_adamw", adamw, o, true);
  run<zero::optim::AdamW, zero::bf16, zero::bf16>("bf16_remainder_bf16states_adamw", adamw, o, true, States::bf16);
  run<zero::optim::AdamW, zero::bf16, zero::bf16>("bf16_remainder_8bit_adamw", adamw, o, true, States::blockwise8);
  run<zero::optim::Sgd, float, float>("fp32_sgd_momentum", sgd, o);
  return 0;
}
