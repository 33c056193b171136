// fp16 dynamic loss scaling: an inf injected into one rank's gradient skips
// the step on every rank, halves the scale, and updates nothing.
#include "engine_harness.hpp"

namespace {

template <int S>
void check_overflow_skip(int ranks, int bad_rank) {
  INFO("stage " << S << ", ranks " << ranks << ", inf on rank " << bad_rank);
  using Opt = zero::ZeroOptimizer<zero::precision::Mixed<zero::fp16>, zero::optim::AdamW, zero::stage<S>,
                                  zero::offload::None, zero::backend::Host>;
  zero::Options options;
  options.loss_scale.initial_scale = 256;
  zero::test::TrainSpec spec;
  spec.parts = ranks;
  spec.steps = 1;
  const auto one_step = zero::test::train_local<Opt>(ranks, {}, options, spec);

  spec.steps = 3;
  spec.tamper = [bad_rank](int rank, int step, int micro, std::size_t unit, void* g) {
    if (rank == bad_rank && step == 2 && micro == 0 && unit == 1)
      static_cast<zero::fp16*>(g)[3] = zero::from_float<zero::fp16>(std::numeric_limits<float>::infinity());
  };
  // Rank results agree bit for bit (train_local checks), so every rank skipped.
  spec.steps = 2;
  const auto skipped = zero::test::train_local<Opt>(ranks, {}, options, spec);
  REQUIRE(skipped.steps.size() == 2);
  CHECK(skipped.steps[0].stepped);
  CHECK(skipped.steps[1].skipped_overflow);
  CHECK_FALSE(skipped.steps[1].stepped);
  CHECK(skipped.steps[1].loss_scale == 256);
  // Nothing was updated by the skipped step.
  CHECK(skipped.masters == one_step.masters);
  CHECK(skipped.params == one_step.params);

  spec.steps = 3;
  const auto after = zero::test::train_local<Opt>(ranks, {}, options, spec);
  CHECK(after.steps[2].stepped);
  CHECK(after.steps[2].loss_scale == 128);  // halved
}

}  // namespace

TEST_CASE("An inf on one rank skips the step on all ranks and halves the loss scale", "[engine][fp16]") {
  check_overflow_skip<0>(3, 1);
  check_overflow_skip<1>(4, 3);
  check_overflow_skip<2>(2, 0);
  check_overflow_skip<3>(4, 2);
}

TEST_CASE("The loss scaler grows after a clean interval and honours hysteresis and the minimum", "[engine][fp16]") {
  zero::LossScaleOptions o;
  o.initial_scale = 1024;
  o.growth_interval = 3;
  o.hysteresis = 2;
  o.min_scale = 256;
  zero::DynamicLossScaler s(o, true);
  CHECK_FALSE(s.update(false));
  CHECK_FALSE(s.update(false));
  CHECK_FALSE(s.update(false));
  CHECK(s.scale() == 2048);
  CHECK(s.update(true));  // first overflow: tolerated by hysteresis
  CHECK(s.scale() == 2048);
  CHECK(s.update(true));  // second: back off
  CHECK(s.scale() == 1024);
  for (int i = 0; i < 10; ++i) s.update(true);
  CHECK(s.scale() == 256);  // never below the minimum
  zero::DynamicLossScaler off(o, false);
  CHECK_FALSE(off.update(true));
  CHECK(off.scale() == 1);
}

TEST_CASE("bf16 and fp32 gradients with inf are an error, not a silent skip", "[engine][errors]") {
  using Opt = zero::ZeroOptimizer<zero::precision::Mixed<zero::bf16>, zero::optim::Adam, zero::stage<2>,
                                  zero::offload::None, zero::backend::Host>;
  zero::test::TrainSpec spec;
  spec.parts = 2;
  spec.steps = 1;
  spec.tamper = [](int rank, int, int, std::size_t unit, void* g) {
    if (rank == 1 && unit == 0) static_cast<zero::bf16*>(g)[0] = zero::from_float<zero::bf16>(NAN);
  };
  REQUIRE_THROWS_WITH(zero::test::train_local<Opt>(2, {}, {}, spec), Catch::Contains("inf or NaN"));
}
