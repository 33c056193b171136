// Stochastic rounding to bf16 is there so that updates smaller than half a
// bf16 unit survive in expectation. These tests hold it to what that needs:
// it is a pure function of (seed, step, index) (so every rank, thread split
// and device agrees), it only ever picks one of the two neighbours, and the
// mean of many roundings converges on the exact value at the rate the
// binomial distribution allows, where round-to-nearest stays biased.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "zero/kernels/host_convert.hpp"
#include "zero/precision/convert.hpp"
#include "zero/precision/stochastic.hpp"
#include "zero/precision/types.hpp"
#include "zero/simd/dispatch.hpp"

using zero::bf16;
using zero::fp16;
using zero::StochasticRounding;

namespace {

// How many standard errors a mean may stray from its expectation. Each test
// makes a few hundred such comparisons; with z = 5 the chance that a correct
// implementation fails any of them is below 1e-4.
constexpr double kZ = 5.0;

StochasticRounding stochastic(std::uint64_t seed, std::uint64_t step) {
  StochasticRounding r;
  r.enabled = true;
  r.seed = seed;
  r.step = step;
  return r;
}

std::uint16_t sr_bits(float x, const StochasticRounding& r, std::uint64_t index) {
  return zero::stochastic_round<bf16>(x, r, index).bits;
}

double value_of(std::uint16_t bf16_bits) { return static_cast<double>(zero::to_float(bf16{bf16_bits})); }

float float_of(std::uint32_t bits) { return std::bit_cast<float>(bits); }

// The bf16 neighbours of a finite float x, found by value: `toward` is the
// bf16 nearest x on the side of zero (x itself when representable), `away`
// the next bf16 further from zero (infinity past the largest finite bf16).
struct Neighbours {
  std::uint16_t toward;
  std::uint16_t away;
};

Neighbours neighbours_of(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint16_t t = static_cast<std::uint16_t>(u >> 16);  // truncation: candidate, checked below
  const Neighbours n{t, static_cast<std::uint16_t>(t + 1)};
  const double ax = std::fabs(static_cast<double>(x));
  REQUIRE(std::fabs(value_of(n.toward)) <= ax);
  REQUIRE(std::fabs(value_of(n.away)) > ax);
  REQUIRE(std::signbit(value_of(n.toward)) == std::signbit(x));
  REQUIRE(std::signbit(value_of(n.away)) == std::signbit(x));
  return n;
}

}  // namespace

TEST_CASE("Stochastic rounding is a pure function of seed, step and index", "[precision][stochastic]") {
  constexpr std::uint64_t n = 1u << 14;
  // Halfway between 1 and its bf16 successor: each rounding is a fair coin, so
  // two independent streams agree on about half of the indices.
  const float half_way = float_of(0x3f808000u);
  const StochasticRounding a = stochastic(42, 7);

  std::uint64_t ups = 0;
  std::uint64_t differ_seed = 0;
  std::uint64_t differ_step = 0;
  for (std::uint64_t i = 0; i < n; ++i) {
    const std::uint16_t r = sr_bits(half_way, a, i);
    REQUIRE(r == sr_bits(half_way, a, i));                   // same inputs, same bits
    REQUIRE(r == sr_bits(half_way, stochastic(42, 7), i));   // from a fresh but equal state
    ups += r == 0x3f81 ? 1 : 0;
    differ_seed += r != sr_bits(half_way, stochastic(43, 7), i) ? 1 : 0;
    differ_step += r != sr_bits(half_way, stochastic(42, 8), i) ? 1 : 0;
  }
  // Each count is Binomial(n, 1/2) if the streams behave as independent coins.
  const double mean = n / 2.0;
  const double bound = kZ * std::sqrt(n * 0.25);
  INFO("ups " << ups << ", differ by seed " << differ_seed << ", differ by step " << differ_step << ", of " << n);
  CHECK(std::fabs(static_cast<double>(ups) - mean) <= bound);
  CHECK(std::fabs(static_cast<double>(differ_seed) - mean) <= bound);
  CHECK(std::fabs(static_cast<double>(differ_step) - mean) <= bound);
}

TEST_CASE("Stochastic rounding yields one of the two bf16 neighbours, exact values unchanged",
          "[precision][stochastic]") {
  std::mt19937 gen(2024);
  const StochasticRounding r = stochastic(1234, 99);
  std::uint64_t tested = 0;
  while (tested < 20000) {
    const std::uint32_t u = static_cast<std::uint32_t>(gen());
    if ((u & 0x7f800000u) == 0x7f800000u) continue;  // inf and NaN: tested separately
    ++tested;
    const float x = float_of(u);
    const Neighbours nb = neighbours_of(x);
    bool saw_away = false;
    for (std::uint64_t i = 0; i < 64; ++i) {
      const std::uint16_t got = sr_bits(x, r, tested * 64 + i);
      if (got != nb.toward && got != nb.away) {
        FAIL("x = " << x << " (0x" << std::hex << u << ") rounded to 0x" << got << ", neighbours 0x" << nb.toward
                    << " and 0x" << nb.away);
      }
      saw_away = saw_away || got == nb.away;
    }
    if ((u & 0xffffu) == 0) {
      REQUIRE_FALSE(saw_away);  // representable: never moved
    }
  }

  // Zeros and representable values, across the range.
  for (const std::uint32_t u : {0x00000000u, 0x80000000u, 0x3f800000u, 0xbf800000u, 0x00010000u, 0x80010000u,
                                0x7f7f0000u, 0xff7f0000u}) {
    for (std::uint64_t i = 0; i < 1000; ++i) REQUIRE(sr_bits(float_of(u), r, i) == (u >> 16));
  }
}

TEST_CASE("Stochastic rounding is unbiased where round-to-nearest is not", "[precision][stochastic]") {
  constexpr std::uint64_t n = 1u << 16;  // roundings averaged per value
  std::mt19937 gen(7);
  // Lower neighbours across the range: subnormal bf16, around 1, large, and
  // negative ones (where "up" means away from zero).
  std::vector<std::uint16_t> lows = {0x0001, 0x0042, 0x007f, 0x0080, 0x3f80, 0x3fff, 0x4b00, 0x7f00, 0x7f7e,
                                     0x8001, 0xbf80, 0xc2aa, 0xff00};
  for (int k = 0; k < 24; ++k) {
    std::uint16_t b = static_cast<std::uint16_t>(gen());
    if ((b & 0x7f80u) == 0x7f80u || (b & 0x7fffu) == 0x7f7fu) b = 0x3c12;  // keep both neighbours finite
    lows.push_back(b);
  }
  // Position between the neighbours, in 1/65536 of the gap (the finest step a
  // float has there): the extremes, simple fractions and random ones.
  std::vector<std::uint32_t> fractions = {1, 2, 0x1000, 0x4000, 0x5555, 0x8000, 0xaaab, 0xc000, 0xffff};
  for (int k = 0; k < 6; ++k) fractions.push_back(1 + static_cast<std::uint32_t>(gen() % 0xffffu));

  std::uint64_t biased_nearest = 0;
  std::uint64_t cases = 0;
  for (const std::uint16_t low : lows) {
    for (const std::uint32_t frac : fractions) {
      const std::uint32_t u = (std::uint32_t{low} << 16) | frac;
      const float x = float_of(u);
      const Neighbours nb = neighbours_of(x);
      REQUIRE(nb.toward == low);
      const double lo = value_of(nb.toward);
      const double hi = value_of(nb.away);
      const double gap = hi - lo;  // signed: negative for negative x
      const double p = (static_cast<double>(x) - lo) / gap;  // probability of rounding away from zero
      REQUIRE(p == Approx(frac / 65536.0).epsilon(1e-12));

      const StochasticRounding r = stochastic(0x5eed0000u + cases, cases % 5);
      double sum = 0.0;  // exact: n values of one binade, each with 8 significant bits
      for (std::uint64_t i = 0; i < n; ++i) {
        const std::uint16_t got = sr_bits(x, r, i);
        REQUIRE((got == nb.toward || got == nb.away));
        sum += value_of(got);
      }
      const double mean = sum / static_cast<double>(n);
      // Each rounding is lo + gap * Bernoulli(p): the mean's standard error is
      // |gap| * sqrt(p (1 - p) / n).
      const double se = std::fabs(gap) * std::sqrt(p * (1.0 - p) / static_cast<double>(n));
      const double bound = kZ * se + 1e-12 * std::fabs(gap);
      INFO("x = " << x << " (0x" << std::hex << u << std::dec << "), p = " << p << ", mean " << mean << ", se " << se);
      CHECK(std::fabs(mean - static_cast<double>(x)) <= bound);

      // Round-to-nearest is off by min(p, 1 - p) gaps for every rounding; for p
      // away from 0, 1/2 and 1 that is many standard errors.
      const double nearest_error = std::fabs(value_of(zero::from_float<bf16>(x).bits) - static_cast<double>(x));
      CHECK(nearest_error == Approx(std::min(p, 1.0 - p) * std::fabs(gap)).epsilon(1e-9));
      if (p >= 1.0 / 16 && p <= 15.0 / 16 && p != 0.5) {
        CHECK(nearest_error > 4 * bound);
        ++biased_nearest;
      }
      ++cases;
    }
  }
  CHECK(cases == lows.size() * fractions.size());
  CHECK(biased_nearest > cases / 2);
}

TEST_CASE("Many updates below half a bf16 unit survive stochastic rounding in expectation",
          "[precision][stochastic]") {
  // M independent weights start at 1 and receive T updates of 2^-12 each, a
  // 32nd of bf16's unit at 1: round-to-nearest never moves them.
  constexpr int chains = 1024;
  constexpr int steps = 1024;
  const float delta = std::ldexp(1.0f, -12);
  double sum = 0.0;
  float nearest = 1.0f;
  for (int c = 0; c < chains; ++c) {
    bf16 w = zero::from_float<bf16>(1.0f);
    for (int t = 0; t < steps; ++t) {
      const float exact = zero::to_float(w) + delta;  // exact in fp32
      w = zero::stochastic_round<bf16>(exact, stochastic(77, static_cast<std::uint64_t>(t)),
                                       static_cast<std::uint64_t>(c));
    }
    sum += static_cast<double>(zero::to_float(w));
  }
  for (int t = 0; t < steps; ++t) nearest = zero::to_float(zero::from_float<bf16>(nearest + delta));
  // Unbiased steps make w a martingale plus the drift: E[w_T] = 1 + T*delta.
  // Each step adds variance p(1-p) ulp^2 <= ulp^2 / 4 with ulp <= 2^-6 below
  // 4, so Var[w_T] <= T * 2^-12 / 4, and the mean over M chains has standard
  // error at most sqrt(that / M).
  const double expected = 1.0 + steps * static_cast<double>(delta);
  const double se = std::sqrt(steps * std::ldexp(1.0, -12) / 4.0 / chains);
  const double mean = sum / chains;
  INFO("mean " << mean << ", expected " << expected << ", se bound " << se);
  CHECK(std::fabs(mean - expected) <= kZ * se);
  CHECK(nearest == 1.0f);
  CHECK(expected - nearest > 3 * kZ * se);  // nearest is stuck, many standard errors away
}

TEST_CASE("Stochastic rounding of infinities, NaNs and the ends of the range", "[precision][stochastic]") {
  const StochasticRounding r = stochastic(9, 3);
  const float inf = std::numeric_limits<float>::infinity();
  for (std::uint64_t i = 0; i < 4096; ++i) {
    REQUIRE(sr_bits(inf, r, i) == 0x7f80);
    REQUIRE(sr_bits(-inf, r, i) == 0xff80);
    for (const std::uint32_t nan : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fffffffu, 0xffffffffu, 0x7f80ffffu})
      REQUIRE(sr_bits(float_of(nan), r, i) == 0x7fff);  // canonical, as with nearest, never inf
  }
  // Above the largest finite bf16 the upper neighbour is infinity: a value a
  // quarter of the way there overflows about a quarter of the time.
  const float beyond = float_of(0x7f7f4000u);
  std::uint64_t overflow = 0;
  constexpr std::uint64_t n = 1u << 14;
  for (std::uint64_t i = 0; i < n; ++i) {
    const std::uint16_t got = sr_bits(beyond, r, i);
    REQUIRE((got == 0x7f7f || got == 0x7f80));
    overflow += got == 0x7f80 ? 1 : 0;
  }
  CHECK(std::fabs(static_cast<double>(overflow) - n * 0.25) <= kZ * std::sqrt(n * 0.25 * 0.75));
  // The smallest subnormal fp32 rounds up to the smallest subnormal bf16 with
  // probability 2^-16 and never below zero.
  for (std::uint64_t i = 0; i < 1000; ++i) {
    const std::uint16_t got = sr_bits(std::numeric_limits<float>::denorm_min(), r, i);
    REQUIRE((got == 0x0000 || got == 0x0001));
  }
  // fp16 and fp32 keep round-to-nearest.
  for (const float x : {1.0f + std::ldexp(1.0f, -11), 65520.0f, 3.14159f, -2.5e-6f}) {
    CHECK(zero::stochastic_round<fp16>(x, r, 1).bits == zero::from_float<fp16>(x).bits);
    CHECK(std::bit_cast<std::uint32_t>(zero::stochastic_round<float>(x, r, 1)) == std::bit_cast<std::uint32_t>(x));
  }
}

namespace {

struct IsaGuard {
  zero::simd::IsaLevel saved = zero::simd::active_isa();
  ~IsaGuard() { zero::simd::force_isa(saved); }
};

std::vector<float> random_floats(std::size_t n, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = dist(gen);
  if (n > 3) {
    v[0] = std::numeric_limits<float>::infinity();
    v[1] = std::numeric_limits<float>::quiet_NaN();
    v[2] = -0.0f;
  }
  return v;
}

}  // namespace

TEST_CASE("host_convert_stochastic is the element-wise rounding at global indices, for any split",
          "[precision][stochastic][convert]") {
  IsaGuard guard;
  const StochasticRounding r = stochastic(31337, 12);
  constexpr std::uint64_t offset = 1000003;
  for (const zero::simd::IsaLevel isa : zero::simd::supported_isas()) {
    zero::simd::force_isa(isa);
    INFO("isa " << zero::simd::isa_name(isa));
    for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{17}, std::size_t{32769},
                                (std::size_t{1} << 20) + 5}) {
      INFO("n " << n);
      const std::vector<float> src = random_floats(n, static_cast<std::uint32_t>(n + 1));
      std::vector<bf16> got(n + 1, bf16{0x5a5a});
      zero::kernels::host_convert_stochastic(src.data(), got.data(), n, r, offset);
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < n; ++i)
        wrong += got[i].bits != zero::stochastic_round<bf16>(src[i], r, offset + i).bits ? 1 : 0;
      CHECK(wrong == 0);
      CHECK(got[n].bits == 0x5a5a);

      // Two shards converted separately (as two ranks would) give the same bits.
      if (n > 1) {
        const std::size_t cut = n / 3 + 1;
        std::vector<bf16> split(n);
        zero::kernels::host_convert_stochastic(src.data(), split.data(), cut, r, offset);
        zero::kernels::host_convert_stochastic(src.data() + cut, split.data() + cut, n - cut, r, offset + cut);
        std::size_t differ = 0;
        for (std::size_t i = 0; i < n; ++i) differ += split[i].bits != got[i].bits ? 1 : 0;
        CHECK(differ == 0);
      }

#if defined(_OPENMP)
      // One thread instead of all of them: the same bits.
      const int threads = omp_get_max_threads();
      omp_set_num_threads(1);
      std::vector<bf16> single(n);
      zero::kernels::host_convert_stochastic(src.data(), single.data(), n, r, offset);
      omp_set_num_threads(threads);
      std::size_t differ = 0;
      for (std::size_t i = 0; i < n; ++i) differ += single[i].bits != got[i].bits ? 1 : 0;
      CHECK(differ == 0);
#endif

      // Not enabled: round-to-nearest, as host_convert. fp16: always nearest.
      StochasticRounding off = r;
      off.enabled = false;
      std::vector<bf16> nearest(n), plain(n);
      zero::kernels::host_convert_stochastic(src.data(), nearest.data(), n, off, offset);
      zero::kernels::host_convert(src.data(), plain.data(), n);
      std::vector<fp16> half_sr(n), half_plain(n);
      zero::kernels::host_convert_stochastic(src.data(), half_sr.data(), n, r, offset);
      zero::kernels::host_convert(src.data(), half_plain.data(), n);
      std::size_t differ_nearest = 0;
      for (std::size_t i = 0; i < n; ++i) {
        differ_nearest += nearest[i].bits != plain[i].bits ? 1 : 0;
        differ_nearest += half_sr[i].bits != half_plain[i].bits ? 1 : 0;
      }
      CHECK(differ_nearest == 0);
      // And stochastic does differ from nearest on random data (about half the
      // elements whose dropped bits are not zero).
      if (n > 1000) {
        std::size_t moved = 0;
        for (std::size_t i = 0; i < n; ++i) moved += got[i].bits != plain[i].bits ? 1 : 0;
        CHECK(moved > n / 8);
      }
    }
  }
}
