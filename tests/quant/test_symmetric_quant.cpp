// The symmetric block quantizer of ZeRO++'s qwZ (quant/symmetric.hpp),
// against a reference written in double precision here: per block the scale
// absmax / 127, each code the nearest integer to x / scale (ties either way:
// the library rounds x * (127 / absmax) in fp32, which may land a hair to
// either side of a tie), the value code * scale. For every storage type,
// block size and length (one element, primes, a partial last block), the
// codes differ from the reference's by at most 1 only at ties and every
// value is within half a step (and T's rounding) of x; zero blocks give
// scale 0 and codes 0; the payload's layout and size are as documented.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "zero/precision/convert.hpp"
#include "zero/quant/symmetric.hpp"

namespace {

template <class T>
std::vector<T> random_values(std::size_t n, unsigned seed, float spread) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, spread);
  std::vector<T> v(n);
  for (auto& x : v) x = zero::from_float<T>(dist(rng));
  return v;
}

template <class T>
void check_round_trip(std::size_t n, std::size_t block, unsigned seed) {
  INFO("n " << n << ", block " << block << ", " << zero::dtype_traits<T>::name);
  auto x = random_values<T>(n, seed, 0.02f);
  if (n > 3) x[n / 2] = zero::from_float<T>(0.0f);
  std::vector<unsigned char> payload(zero::quant::int8_payload_bytes(n, block), 0xEE);
  REQUIRE(payload.size() == (n + 3) / 4 * 4 + 4 * ((n + block - 1) / block));
  const auto p = zero::quant::Int8Payload::at(payload.data(), n);
  REQUIRE(reinterpret_cast<unsigned char*>(p.scales) == payload.data() + (n + 3) / 4 * 4);
  zero::quant::host_quantize_int8(x.data(), n, block, p.codes, p.scales);
  std::vector<T> back(n);
  zero::quant::host_dequantize_int8(p.codes, p.scales, n, block, back.data());
  for (std::size_t b = 0; b * block < n; ++b) {
    const std::size_t begin = b * block, end = std::min(n, begin + block);
    double absmax = 0;
    for (std::size_t i = begin; i < end; ++i) absmax = std::max(absmax, std::fabs(double(zero::to_float(x[i]))));
    const double scale = absmax / 127.0;
    REQUIRE(double(p.scales[b]) == Approx(scale).epsilon(1e-6));
    for (std::size_t i = begin; i < end; ++i) {
      const double xi = zero::to_float(x[i]);
      const double exact = scale > 0 ? xi / scale : 0.0;
      const int code = p.codes[i];
      REQUIRE(std::abs(code) <= 127);
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
}

}  // namespace

TEST_CASE("int8 symmetric blocks: codes, scales and values against a double-precision reference", "[quant][qwz]") {
  for (const std::size_t block : {32, 64, 2048})
    for (const std::size_t n : {1, 2, 7, 31, 97, 2048, 2049, 6151}) {
      check_round_trip<float>(n, block, static_cast<unsigned>(n + block));
      check_round_trip<zero::bf16>(n, block, static_cast<unsigned>(n * 3 + block));
      check_round_trip<zero::fp16>(n, block, static_cast<unsigned>(n * 7 + block));
    }
}

TEST_CASE("int8 symmetric blocks: zeros, the largest element and non-finite blocks", "[quant][qwz]") {
  std::vector<float> x(100, 0.0f);
  std::vector<unsigned char> payload(zero::quant::int8_payload_bytes(x.size(), 64));
  auto p = zero::quant::Int8Payload::at(payload.data(), x.size());
  zero::quant::host_quantize_int8(x.data(), x.size(), 64, p.codes, p.scales);
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(p.codes[i] == 0);
  CHECK(p.scales[0] == 0.0f);
  CHECK(p.scales[1] == 0.0f);
  // The element of largest magnitude is +-127 codes and comes back within an ulp.
  x[3] = -0.75f;
  x[70] = 3.0e-5f;
  x[71] = 1.0e-5f;
  zero::quant::host_quantize_int8(x.data(), x.size(), 64, p.codes, p.scales);
  CHECK(p.codes[3] == -127);
  CHECK(p.codes[70] == 127);
  CHECK(p.codes[71] == 42);  // 1e-5 / (3e-5 / 127) = 42.33
  std::vector<float> back(x.size());
  zero::quant::host_dequantize_int8(p.codes, p.scales, x.size(), 64, back.data());
  CHECK(back[3] == Approx(-0.75f).epsilon(1e-6));
  // An infinite block: scale 0, codes 0 (the values are lost, not NaN everywhere).
  x[10] = INFINITY;
  zero::quant::host_quantize_int8(x.data(), x.size(), 64, p.codes, p.scales);
  CHECK(p.scales[0] == 0.0f);
  zero::quant::host_dequantize_int8(p.codes, p.scales, x.size(), 64, back.data());
  for (std::size_t i = 0; i < 64; ++i) CHECK(std::isfinite(back[i]));
}
