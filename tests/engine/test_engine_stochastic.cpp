// Stochastic rounding of the bf16 parameter copies through the engine: the
// random bits depend on (seed, step, global element index) only, so the copies
// are the same for any number of ranks and stage, and each is one of the two
// bf16 neighbours of its fp32 master.
#include <bit>
#include <cstdint>

#include "engine_harness.hpp"

namespace {

// `ranks` ranks, or (whole_batch) one rank summing all their gradient parts.
template <int S>
zero::test::RunResult run(int ranks, std::uint64_t seed, bool whole_batch = false) {
  using Opt = zero::ZeroOptimizer<zero::precision::Mixed<zero::bf16>, zero::optim::AdamW, zero::stage<S>,
                                  zero::offload::None, zero::backend::Host>;
  zero::Options options;
  options.stochastic_rounding = true;
  options.seed = seed;
  options.gradient_divisor = ranks;
  zero::test::TrainSpec spec;
  spec.parts = ranks;
  spec.steps = 4;
  spec.sum_all_parts = whole_batch;
  return zero::test::train_local<Opt>(whole_batch ? 1 : ranks, zero::test::test_hyper<zero::optim::AdamW>(), options,
                                      spec);
}

bool is_neighbour(float master, float copy) {
  const zero::bf16 down{static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(master) >> 16)};
  const zero::bf16 up{static_cast<std::uint16_t>(down.bits + 1)};
  const zero::bf16 got = zero::from_float<zero::bf16>(copy);
  return got == down || got == up;
}

}  // namespace

TEST_CASE("Stochastic rounding of parameter copies does not depend on ranks or stage", "[engine][rounding]") {
  const auto one = run<0>(4, 7, true);
  for (const auto& other : {run<1>(4, 7), run<2>(4, 7), run<3>(4, 7)}) {
    CHECK(other.masters == one.masters);  // no clipping: the reductions are exact
    CHECK(other.params == one.params);
  }
  CHECK(run<3>(7, 7).params == run<2>(7, 7, true).params);
  std::size_t rounded_up = 0, not_nearest = 0;
  for (std::size_t i = 0; i < one.masters.size(); ++i) {
    REQUIRE(is_neighbour(one.masters[i], one.params[i]));
    const float nearest = zero::to_float(zero::from_float<zero::bf16>(one.masters[i]));
    not_nearest += one.params[i] != nearest;
    rounded_up += std::fabs(one.params[i]) > std::fabs(one.masters[i]);
  }
  // Random, not nearest: some copies round away from the nearest neighbour,
  // and both directions occur.
  CHECK(not_nearest > 0);
  CHECK(rounded_up > 0);
  CHECK(rounded_up < one.masters.size());
  // Another seed gives other bits.
  CHECK(run<2>(4, 8).params != one.params);
}

TEST_CASE("Stochastic rounding is refused where the parameter copies are not bf16", "[engine][rounding][errors]") {
  using namespace zero;
  comm::LocalGroup group(1);
  group.run([&](comm::Local& c) {
    Options options;
    options.stochastic_rounding = true;
    using Fp16 = ZeroOptimizer<precision::Mixed<fp16>, optim::AdamW, stage<1>, offload::None, backend::Host>;
    using Fp32 = ZeroOptimizer<precision::Full<float>, optim::AdamW, stage<1>, offload::None, backend::Host>;
    CHECK_THROWS_WITH(Fp16(c, {}, options), Catch::Contains("Options::stochastic_rounding is on, but the precision is "
                                                            "fp16") &&
                                                Catch::Contains("turn stochastic_rounding off"));
    CHECK_THROWS_WITH(Fp32(c, {}, options),
                      Catch::Contains("Options::stochastic_rounding is on, but the precision is fp32"));
  });
}
