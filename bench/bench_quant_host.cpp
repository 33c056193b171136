// qwZ's host quantizer (quant/symmetric.hpp) against the bandwidth of its
// own access pattern: quantize reads a shard of 16-bit (or fp32) parameters
// and writes one byte per element plus a scale per block; dequantize reads
// the bytes and writes the parameters. Each probe moves the same bytes with
// trivial arithmetic (a shift: the parameter's high byte, and back), on one
// thread as the engine's gather calls it, timed interleaved with the real
// loop in this run, fastest of the repetitions; the figure is the ratio.
//
// And the 8-bit optimizer states' code lookups (zero/simd/code_lookup.hpp,
// the dynamic code of quant/dynamic_code.hpp): decoding and encoding a
// block of 2048 in L1, one thread, per instruction set, each figure as a
// ratio to AVX2's gathers measured in the same run.
//
//   bench_quant_host [--n N (K/M/G suffixes)] [--reps R] [--json]
#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bench_args.hpp"
#include "zero/precision/convert.hpp"
#include "zero/kernels/host_quantize.hpp"
#include "zero/quant/symmetric.hpp"
#include "zero/simd/code_lookup.hpp"
#include "zero/simd/dispatch.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

template <class F>
double seconds(F&& f) {
  const auto t0 = clock_type::now();
  f();
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

template <class T>
void run(const char* label, std::size_t n, std::size_t block, int reps, bool json) {
  std::vector<T> x(n), back(n);
  for (std::size_t i = 0; i < n; ++i) x[i] = zero::from_float<T>(0.001f * static_cast<float>(i % 977) - 0.4f);
  const zero::quant::Format format{8, block};
  std::vector<unsigned char> payload(format.payload_bytes(n));
  const auto p = zero::quant::PayloadView::at(payload.data(), n, format);
  // The probes: the same bytes read and written, a shift each (the
  // parameter's high byte as the code, and back).
  using Bits = std::conditional_t<sizeof(T) == 2, std::uint16_t, std::uint32_t>;
  constexpr int shift = 8 * (sizeof(T) - 1);
  auto probe_in = [&] {
    const auto* bits = reinterpret_cast<const Bits*>(x.data());
    for (std::size_t i = 0; i < n; ++i) p.codes[i] = static_cast<std::uint8_t>(bits[i] >> shift);
    for (std::size_t b = 0; b * block < n; ++b) p.scales[b] = 1.0f;
  };
  auto probe_out = [&] {
    auto* bits = reinterpret_cast<Bits*>(back.data());
    for (std::size_t i = 0; i < n; ++i)
      bits[i] = static_cast<Bits>(static_cast<Bits>(p.codes[i]) << shift);
  };
  auto quantize = [&] { zero::quant::host_quantize(x.data(), nullptr, n, format, payload.data()); };
  auto dequantize = [&] { zero::quant::host_dequantize(payload.data(), n, format, back.data()); };
  quantize(), probe_in(), dequantize(), probe_out();  // warm up (page faults, frequency)
  std::vector<double> q, qp, d, dp;
  for (int r = 0; r < reps; ++r) {
    q.push_back(seconds(quantize));
    qp.push_back(seconds(probe_in));
    d.push_back(seconds(dequantize));
    dp.push_back(seconds(probe_out));
  }
  auto fastest = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
  const double bytes = static_cast<double>(n * sizeof(T) + payload.size());
  struct Row {
    const char* what;
    double t, tp;
  };
  for (const Row& row : {Row{"quantize", fastest(q), fastest(qp)}, Row{"dequantize", fastest(d), fastest(dp)}}) {
    const char* what = row.what;
    const double t = row.t, tp = row.tp;
    if (json)
      std::printf("{\"bench\":\"quant_host\",\"config\":\"%s_%s\",\"n\":%zu,\"block\":%zu,\"seconds\":%.6f,"
                  "\"probe_seconds\":%.6f,\"gb_per_s\":%.3f,\"ratio_to_probe\":%.4f}\n",
                  what, label, n, block, t, tp, bytes / t / 1e9, tp / t);
    else
      std::printf("%-10s %-5s n=%zu block=%zu  %.2f ms  %.2f GB/s  probe %.2f ms  ratio to probe %.3f\n", what, label,
                  n, block, t * 1e3, bytes / t / 1e9, tp * 1e3, tp / t);
  }
  std::fflush(stdout);
}

#if ZERO_HOST_SIMD_X86
// One block of Adam's first moment (the signed table), decoded or encoded
// `times` times.
struct DecodeBody {
  template <class Isa>
  static void run(const std::uint8_t* q, std::size_t n, float* out, std::size_t times) {
    for (std::size_t t = 0; t < times; ++t) zero::simd::decode_codes<Isa>(q, n, zero::quant::dynamic_code_signed.data(), 0.5f, out);
  }
};
struct EncodeBody {
  template <class Isa>
  static void run(const float* x, std::size_t n, std::uint8_t* q, std::size_t times) {
    for (std::size_t t = 0; t < times; ++t)
      zero::simd::encode_codes<Isa>(x, n, 1.0f, zero::quant::nearest_code_signed(), zero::quant::code_segments_for(zero::quant::dynamic_code_signed.data()), q);
  }
};

void run_codes(std::size_t n, int reps, bool json) {
  constexpr std::size_t block = 2048;
  const std::size_t times = n / block > 0 ? n / block : 1;
  std::vector<std::uint8_t> q(block);
  std::vector<float> x(block), out(block);
  std::uint32_t state = 12345;
  for (std::size_t i = 0; i < block; ++i) {  // states over six decades, both signs; the largest is the absmax
    state = state * 1664525u + 1013904223u;
    const float v = std::ldexp(static_cast<float>(state % 1000 + 1) * 1e-3f, -static_cast<int>((state >> 10) % 20));
    x[i] = (state >> 31) ? -v : v;
    q[i] = static_cast<std::uint8_t>(state >> 16);
  }
  x[0] = 1.0f;
  const auto isas = zero::simd::supported_isas();
  if (isas.back() == zero::simd::IsaLevel::portable) return;
  struct Times {
    double decode = 1e30, encode = 1e30;
  };
  std::vector<Times> best(isas.size());
  // With VBMI, AVX-512 decodes through byte permutes; its float-permute
  // decoder (CPUs without VBMI) is timed beside it.
  const bool vbmi = isas.back() == zero::simd::IsaLevel::avx512 && zero::simd::detail::has_avx512_vbmi();
  double float_permutes = 1e30;
  for (int r = 0; r < reps; ++r) {
    for (std::size_t k = 0; k < isas.size(); ++k) {
      best[k].decode = std::min(best[k].decode, seconds([&] { zero::simd::dispatch<DecodeBody>(isas[k], q.data(), block, out.data(), times); }));
      best[k].encode = std::min(best[k].encode, seconds([&] { zero::simd::dispatch<EncodeBody>(isas[k], x.data(), block, q.data(), times); }));
    }
    if (vbmi)
      float_permutes = std::min(float_permutes, seconds([&] {
                                  for (std::size_t t = 0; t < times; ++t)
                                    zero::simd::detail::decode_codes_avx512(q.data(), block, zero::quant::dynamic_code_signed.data(),
                                                                            0.5f, out.data());
                                }));
  }
  const std::size_t avx2 = 1;  // supported_isas() lists portable, avx2, avx512
  const double values = static_cast<double>(times * block);
  auto print = [&](const char* name, bool encode, double t) {
    const double peer = avx2 < isas.size() ? (encode ? best[avx2].encode : best[avx2].decode) : t;
    if (json)
      std::printf("{\"bench\":\"quant_host\",\"config\":\"dynamic8_%s_%s\",\"values\":%.0f,\"seconds\":%.6f,"
                  "\"ns_per_value\":%.4f,\"speedup_over_avx2_gathers\":%.3f}\n",
                  encode ? "encode" : "decode", name, values, t, t / values * 1e9, peer / t);
    else
      std::printf("dynamic8 %-6s %-14s %.3f ns/value  %.2fx avx2's gathers\n", encode ? "encode" : "decode", name,
                  t / values * 1e9, peer / t);
  };
  for (std::size_t k = 0; k < isas.size(); ++k) {
    print(zero::simd::isa_name(isas[k]), false, best[k].decode);
    print(zero::simd::isa_name(isas[k]), true, best[k].encode);
  }
  if (vbmi) print("avx512-no-vbmi", false, float_permutes);
  std::fflush(stdout);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  std::size_t n = std::size_t{16} << 20;
  int reps = 9;
  bool json = false;
  zero::bench::Args args(argc, argv, "[--n ELEMENTS (K/M/G suffixes)] [--reps R] [--json]");
  while (args.next()) {
    if (args.is("--n"))
      n = args.count();
    else if (args.is("--reps"))
      reps = args.positive();
    else if (args.is("--json"))
      json = true;
    else
      args.usage();
  }
  run<zero::bf16>("bf16", n, 256, reps, json);
  run<zero::fp16>("fp16", n, 256, reps, json);
  run<float>("fp32", n, 256, reps, json);
#if ZERO_HOST_SIMD_X86
  run_codes(n, reps, json);
#endif
  return 0;
}
