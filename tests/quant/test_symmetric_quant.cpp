// The symmetric block quantizer of ZeRO++'s qwZ and qgZ
// (quant/symmetric.hpp), against a reference written in double precision
// here: per block the scale absmax / L (L = 127 for int8, 7 for int4), each
// code the nearest integer to x / scale (ties either way: the library rounds
// x * (L / absmax) in fp32, which may land a hair to either side of a tie),
// the value code * scale. For both widths, every storage type, block size
// and length (one element, primes, a partial last block), the codes differ
// from the reference's by at most 1 only at ties and every value is within
// half a step (and T's rounding) of x; zero blocks give scale 0 and codes 0;
// the payload's layout and size are as documented. Then qgZ's parts: error
// feedback (the residual is exactly what was not sent, and over many calls
// the sum of what was sent stays within one step of the sum of the inputs,
// where without it the error grows), the strided pieces, and the fp32 sum of
// payloads in their order.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <vector>

#include "zero/backend/host.hpp"
#include "zero/kernels/host_quantize.hpp"
#include "zero/precision/convert.hpp"
#include "zero/quant/symmetric.hpp"

namespace {

using zero::quant::Format;
using zero::quant::Pieces;

template <class T>
std::vector<T> random_values(std::size_t n, unsigned seed, float spread) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, spread);
  std::vector<T> v(n);
  for (auto& x : v) x = zero::from_float<T>(dist(rng));
  return v;
}

template <class T>
void check_round_trip(std::size_t n, const Format& f, unsigned seed) {
  INFO("n " << n << ", int" << f.bits << " blocks of " << f.block << ", " << zero::dtype_traits<T>::name);
  auto x = random_values<T>(n, seed, 0.02f);
  if (n > 3) x[n / 2] = zero::from_float<T>(0.0f);
  std::vector<unsigned char> payload(f.payload_bytes(n), 0xEE);
  const std::size_t code_bytes = ((f.bits == 4 ? (n + 1) / 2 : n) + 3) / 4 * 4;
  REQUIRE(payload.size() == code_bytes + 4 * ((n + f.block - 1) / f.block));
  const auto p = zero::quant::PayloadView::at(payload.data(), n, f);
  REQUIRE(reinterpret_cast<unsigned char*>(p.scales) == payload.data() + code_bytes);
  zero::quant::host_quantize(x.data(), nullptr, n, f, payload.data());
  std::vector<T> back(n);
  zero::quant::host_dequantize(payload.data(), n, f, back.data());
  const double levels = f.bits == 4 ? 7.0 : 127.0;
  for (std::size_t b = 0; b * f.block < n; ++b) {
    const std::size_t begin = b * f.block, end = std::min(n, begin + f.block);
    double absmax = 0;
    for (std::size_t i = begin; i < end; ++i) absmax = std::max(absmax, std::fabs(double(zero::to_float(x[i]))));
    const double scale = absmax / levels;
    REQUIRE(double(p.scales[b]) == Approx(scale).epsilon(1e-6));
    for (std::size_t i = begin; i < end; ++i) {
      const double xi = zero::to_float(x[i]);
      const double exact = scale > 0 ? xi / scale : 0.0;
      const int code = zero::quant::code_at(p.codes, i, f.bits);
      REQUIRE(std::abs(code) <= levels);
      // The nearest integer, or its neighbour at a tie.
      REQUIRE(std::fabs(exact - code) <= 0.5 + 1e-5);
      // Within half a step, then rounded to T.
      const double v = zero::to_float(back[i]);
      const double t_ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(v), 1e-30)) -
                                               (std::is_same_v<T, float> ? 23 : std::is_same_v<T, zero::bf16> ? 7 : 10));
      REQUIRE(std::fabs(v - xi) <= 0.5 * scale * (1 + 1e-5) + t_ulp);
      REQUIRE(v == double(zero::to_float(zero::from_float<T>(float(code) * p.scales[b]))));
    }
  }
  // An odd int4 length leaves the last byte's high nibble 0.
  if (f.bits == 4 && n % 2 == 1) REQUIRE((p.codes[n / 2] >> 4) == 0);
}

}  // namespace

TEST_CASE("int8 and int4 symmetric blocks: codes, scales and values against a double-precision reference",
          "[quant][qwz][qgz]") {
  for (const int bits : {8, 4})
    for (const std::size_t block : {32, 64, 2048})
      for (const std::size_t n : {1, 2, 7, 31, 97, 2048, 2049, 6151}) {
        const Format f{bits, block};
        check_round_trip<float>(n, f, static_cast<unsigned>(n + block + bits));
        check_round_trip<zero::bf16>(n, f, static_cast<unsigned>(n * 3 + block + bits));
        check_round_trip<zero::fp16>(n, f, static_cast<unsigned>(n * 7 + block + bits));
      }
}

TEST_CASE("symmetric blocks: zeros, the largest element and non-finite blocks", "[quant][qwz][qgz]") {
  for (const int bits : {8, 4}) {
    const Format f{bits, 64};
    const int levels = f.levels();
    std::vector<float> x(100, 0.0f);
    std::vector<unsigned char> payload(f.payload_bytes(x.size()));
    const auto p = zero::quant::PayloadView::at(payload.data(), x.size(), f);
    zero::quant::host_quantize(x.data(), nullptr, x.size(), f, payload.data());
    for (std::size_t i = 0; i < x.size(); ++i) CHECK(zero::quant::code_at(p.codes, i, bits) == 0);
    CHECK(p.scales[0] == 0.0f);
    CHECK(p.scales[1] == 0.0f);
    // The element of largest magnitude is +-L and comes back within an ulp.
    x[3] = -0.75f;
    x[70] = 3.0e-5f;
    x[71] = 1.0e-5f;
    zero::quant::host_quantize(x.data(), nullptr, x.size(), f, payload.data());
    CHECK(zero::quant::code_at(p.codes, 3, bits) == -levels);
    CHECK(zero::quant::code_at(p.codes, 70, bits) == levels);
    CHECK(zero::quant::code_at(p.codes, 71, bits) == (bits == 8 ? 42 : 2));  // 1e-5 / (3e-5 / L): 42.33, 2.33
    std::vector<float> back(x.size());
    zero::quant::host_dequantize(payload.data(), x.size(), f, back.data());
    CHECK(back[3] == Approx(-0.75f).epsilon(1e-6));
    // An infinite block: scale 0, codes 0 (the values are lost, not NaN everywhere).
    x[10] = INFINITY;
    zero::quant::host_quantize(x.data(), nullptr, x.size(), f, payload.data());
    CHECK(p.scales[0] == 0.0f);
    zero::quant::host_dequantize(payload.data(), x.size(), f, back.data());
    for (std::size_t i = 0; i < 64; ++i) CHECK(std::isfinite(back[i]));
  }
}

TEST_CASE("formats refuse what they cannot code", "[quant][qgz]") {
  CHECK(Format{8, 256}.problem() == nullptr);
  CHECK(Format{4, 256}.problem() == nullptr);
  CHECK(std::string(Format{2, 256}.problem()).find("8 (int8 codes) or 4") != std::string::npos);
  CHECK(std::string(Format{4, 33}.problem()).find("even") != std::string::npos);
  CHECK(std::string(Format{8, 0}.problem()).find("at least one element") != std::string::npos);
}

TEST_CASE("error feedback: the residual is what was not sent, and the sent sum tracks the true sum",
          "[quant][qgz]") {
  for (const int bits : {8, 4}) {
    INFO("int" << bits);
    const Format f{bits, 32};
    const std::size_t n = 97;
    std::vector<float> residual(n, 0.0f);
    std::vector<double> sent_sum(n, 0.0), plain_sent_sum(n, 0.0);
    std::vector<double> true_sum(n, 0.0);
    std::vector<unsigned char> payload(f.payload_bytes(n));
    std::vector<float> value(n);
    double worst_fed = 0, worst_plain = 0;
    for (int call = 0; call < 200; ++call) {
      const auto x = random_values<zero::bf16>(n, 1000u + static_cast<unsigned>(call), 0.01f);
      const std::vector<float> before = residual;
      zero::quant::host_quantize(x.data(), residual.data(), n, f, payload.data());
      zero::quant::host_dequantize(payload.data(), n, f, value.data());
      for (std::size_t i = 0; i < n; ++i) {
        // The residual is (x + e) - sent, in fp32.
        REQUIRE(residual[i] == (zero::to_float(x[i]) + before[i]) - value[i]);
        sent_sum[i] += value[i];
        true_sum[i] += zero::to_float(x[i]);
      }
      zero::quant::host_quantize(x.data(), nullptr, n, f, payload.data());
      zero::quant::host_dequantize(payload.data(), n, f, value.data());
      for (std::size_t i = 0; i < n; ++i) plain_sent_sum[i] += value[i];
    }
    for (std::size_t i = 0; i < n; ++i) {
      // What is still owed is the last residual: within half a step of the last block.
      CHECK(std::fabs(true_sum[i] - sent_sum[i] - residual[i]) < 1e-4);
      worst_fed = std::max(worst_fed, std::fabs(true_sum[i] - sent_sum[i]));
      worst_plain = std::max(worst_plain, std::fabs(true_sum[i] - plain_sent_sum[i]));
    }
    // Two hundred calls' errors add up without feedback; with it, one step's remains.
    CHECK(worst_fed * 4 < worst_plain);
  }
}

TEST_CASE("pieces and the fp32 sum of payloads (qgZ's exchanges)", "[quant][qgz]") {
  using Ops = zero::backend::Ops<zero::backend::Host>;
  for (const int bits : {8, 4}) {
    const Format f{bits, 32};
    // Three pieces of 45 elements every 100 values, into payloads 8 bytes apart beyond their size.
    const std::size_t count = 3, n = 45, stride = 100;
    const std::size_t payload_stride = f.payload_bytes(n) + 8;
    const auto x = random_values<float>(stride * count, 77u + static_cast<unsigned>(bits), 1.0f);
    std::vector<unsigned char> payloads(payload_stride * count, 0);
    Ops::quantize(x.data(), nullptr, Pieces{count, n, stride, payload_stride}, f, payloads.data());
    for (std::size_t k = 0; k < count; ++k) {
      std::vector<unsigned char> one(f.payload_bytes(n));
      zero::quant::host_quantize(x.data() + k * stride, nullptr, n, f, one.data());
      CHECK(std::memcmp(one.data(), payloads.data() + k * payload_stride, one.size()) == 0);
    }
    std::vector<float> back(stride * count, -1.0f);
    Ops::dequantize(payloads.data(), Pieces{count, n, stride, payload_stride}, f, back.data());
    CHECK(back[n] == -1.0f);  // between the pieces: untouched
    std::vector<float> sum(n, -1.0f);
    Ops::dequantize_sum(payloads.data(), count, payload_stride, n, f, sum.data());
    for (std::size_t i = 0; i < n; ++i) {
      float expect = back[i];
      for (std::size_t k = 1; k < count; ++k) expect += back[k * stride + i];
      CHECK(sum[i] == expect);  // the payloads' values added in fp32, in order
      double bound = 1e-5;  // half a step of each piece's block, and the fp32 additions
      for (std::size_t k = 0; k < count; ++k)
        bound += 0.5 * (1 + 1e-5) * zero::quant::ConstPayloadView::at(payloads.data() + k * payload_stride, n, f)
                                        .scales[i / f.block];
      CHECK(std::fabs(double(sum[i]) - (double(x[i]) + x[stride + i] + x[2 * stride + i])) <= bound);
    }
  }
}

namespace {

// Every instruction set's loops (zero/kernels/host_quantize.hpp) write the
// portable loop's bytes: codes, scales, residuals, values and sums.
template <class T>
void check_isas_agree(std::size_t n, const Format& f, bool feedback) {
  INFO("n " << n << ", int" << f.bits << " blocks of " << f.block << ", " << zero::dtype_traits<T>::name
            << (feedback ? ", error feedback" : ""));
  auto x = random_values<T>(n, 7, 0.02f);
  for (std::size_t i = 0; i < n; i += 97) x[i] = zero::from_float<T>(0.0f);  // zeros, and a block's extremes
  if (n > 300) {
    x[5] = zero::from_float<T>(std::nanf(""));                               // a NaN (skipped by the maximum)
    for (std::size_t i = 256; i < std::min<std::size_t>(n, 300); ++i) x[i] = zero::from_float<T>(0.0f);
  }
  if (n > 1000) {
    // A block whose largest is 127 (int8's inverse exactly 1) holding ties,
    // which round to even; and a block with an infinity but no NaN.
    const float ties[] = {127.0f, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 126.5f};
    for (std::size_t k = 0; k < std::size(ties); ++k) x[600 + k] = zero::from_float<T>(ties[k]);
    x[900] = zero::from_float<T>(-std::numeric_limits<float>::infinity());
  }
  std::vector<float> start(n);
  for (std::size_t i = 0; i < n; ++i) start[i] = static_cast<float>(static_cast<int>(i % 13) - 6) * 1e-4f;
  struct Result {
    std::vector<unsigned char> payload;
    std::vector<float> residual, sum;
    std::vector<T> back;
  };
  auto run = [&] {
    Result r;
    r.payload.assign(2 * f.payload_bytes(n), 0xEE);
    r.residual = start;
    float* residual = feedback ? r.residual.data() : nullptr;
    zero::quant::host_quantize(x.data(), residual, n, f, r.payload.data());
    zero::quant::host_quantize(x.data(), residual, n, f, r.payload.data() + f.payload_bytes(n));
    r.back.resize(n);
    zero::quant::host_dequantize(r.payload.data(), n, f, r.back.data());
    r.sum.resize(n);
    zero::quant::host_dequantize_sum(r.payload.data(), 2, f.payload_bytes(n), n, f, r.sum.data());
    return r;
  };
  zero::simd::force_isa(zero::simd::IsaLevel::portable);
  const Result portable = run();
  if (n > 1000 && f.bits == 8 && !feedback) {
    // The ties above, rounded half to even (inverse 127 / 127 = 1).
    const std::int8_t expected[] = {127, 0, 2, 2, 0, -2, -2, 126};
    for (std::size_t k = 0; k < std::size(expected); ++k)
      CHECK(static_cast<std::int8_t>(portable.payload[600 + k]) == expected[k]);
  }
  for (const auto isa : zero::simd::supported_isas()) {
    zero::simd::force_isa(isa);
    INFO("isa " << zero::simd::isa_name(isa));
    const Result r = run();
    CHECK(r.payload == portable.payload);
    CHECK(std::memcmp(r.residual.data(), portable.residual.data(), n * sizeof(float)) == 0);
    CHECK(std::memcmp(r.back.data(), portable.back.data(), n * sizeof(T)) == 0);
    CHECK(std::memcmp(r.sum.data(), portable.sum.data(), n * sizeof(float)) == 0);
  }
  zero::simd::force_isa(zero::simd::detect_isa_from_cpu());
}

}  // namespace

TEST_CASE("every instruction set quantizes, dequantizes and sums as the portable loop", "[quant][qwz][qgz]") {
  for (const std::size_t n : {std::size_t{1}, std::size_t{31}, std::size_t{256}, std::size_t{1000}, std::size_t{4133}})
    for (const Format f : {Format{8, 256}, Format{4, 256}, Format{8, 40}, Format{4, 18}})
      for (const bool feedback : {false, true}) {
        check_isas_agree<zero::bf16>(n, f, feedback);
        check_isas_agree<zero::fp16>(n, f, feedback);
        check_isas_agree<float>(n, f, feedback);
      }
}
