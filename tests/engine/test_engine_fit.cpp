// What fitting a trainer someone else wrote takes from the engine.
// Options::grad_writes: how a trainer's backward writes its gradients.
// accumulate: a backward that adds (+=) into zeroed buffers, reaches a tied
// unit at both ends of the pass, keeps several units' gradients live and
// leaves a unit for step() to finish trains bit for bit like one that
// assigns each unit's gradient once (the default, overwrite), at every stage,
// rank count, accumulation count, bucket size and precision. overwrite: a
// backward that adds or skips elements is an error at the first micro-batch,
// not stale gradients.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "engine_harness.hpp"
#include "reference.hpp"
#include "zero/zero.hpp"

namespace {

using zero::GradWrites;
using zero::Options;
using zero::test::RunResult;
using zero::test::TrainSpec;

template <int S, class Precision>
using Opt = zero::ZeroOptimizer<Precision, zero::optim::AdamW, zero::stage<S>, zero::offload::None,
                                zero::backend::Host>;

template <int S, class Precision>
void adding_backward_matches_assigning_one() {
  for (const int ranks : {1, 2, 3})
    for (const int accumulation : {1, 3})
      for (const std::size_t bucket : {zero::test::one_unit_bucket, zero::test::whole_model_bucket}) {
        INFO("stage " << S << ", " << ranks << " ranks, accumulation " << accumulation << ", bucket_bytes "
                      << bucket);
        Options o;
        o.grad_accumulation_steps = accumulation;
        o.bucket_bytes = bucket;
        o.loss_scale.initial_scale = 256;  // the scaled test gradients stay inside fp16's range
        o.clip_norm = 1.0;
        TrainSpec spec;
        spec.steps = 3;
        spec.check_acquired = true;
        const RunResult assigned = zero::test::train_local<Opt<S, Precision>>(ranks, {}, o, spec);
        o.grad_writes = GradWrites::accumulate;
        spec.adds_into_gradients = true;
        const RunResult added = zero::test::train_local<Opt<S, Precision>>(ranks, {}, o, spec);
        REQUIRE(added.masters == assigned.masters);
        REQUIRE(std::memcmp(added.params.data(), assigned.params.data(), assigned.params.size() * 4) == 0);
        REQUIRE(added.steps.size() == assigned.steps.size());
        for (std::size_t k = 0; k < added.steps.size(); ++k) CHECK(added.steps[k].grad_norm == assigned.steps[k].grad_norm);
        // The same reductions move the same bytes (stage 3 gathers the tied
        // unit once more, for its use at the start of backward).
        for (const auto c : {zero::comm::Collective::all_reduce, zero::comm::Collective::reduce_scatter}) {
          const auto k = static_cast<std::size_t>(c);
          CHECK(added.comm.counters.sent[k] == assigned.comm.counters.sent[k]);
          CHECK(added.comm.counters.calls[k] == assigned.comm.counters.calls[k]);
        }
        // Stages 0-1 take added gradients in the accumulator itself, with
        // accumulation steps too: no staging at all.
        const std::uint64_t added_staging = added.memory.placed.communication_buffers.total();
        const std::uint64_t assigned_staging = assigned.memory.placed.communication_buffers.total();
        if (S <= 1 && accumulation == 1) CHECK(added_staging == assigned_staging);
        if (S <= 1 && accumulation > 1) CHECK(added_staging < assigned_staging);
      }
}

}  // namespace

TEST_CASE("A backward that adds into its gradients trains exactly like one that assigns them", "[engine][grad_writes]") {
  using zero::precision::Full;
  using zero::precision::Mixed;
  adding_backward_matches_assigning_one<0, Full<float>>();
  adding_backward_matches_assigning_one<1, Mixed<zero::bf16>>();
  adding_backward_matches_assigning_one<2, Mixed<zero::fp16>>();
  adding_backward_matches_assigning_one<3, Full<float>>();
  adding_backward_matches_assigning_one<3, Mixed<zero::bf16>>();
  adding_backward_matches_assigning_one<2, Full<float>>();
  adding_backward_matches_assigning_one<1, Mixed<zero::fp16>>();
  adding_backward_matches_assigning_one<0, Mixed<zero::bf16>>();
}

namespace {

// Runs f on an optimizer of two units ("a": 300 elements, "b": 10) and
// returns the message it threw.
template <int S, class Precision>
std::string error_of(const Options& options, const std::function<void(Opt<S, Precision>&)>& f) {
  zero::comm::LocalGroup group(1);
  std::string message;
  group.run([&](zero::comm::Local& c) {
    Opt<S, Precision> opt(c, {}, options);
    opt.add_param(opt.add_unit("a"), "a.w", 300);
    opt.add_param(opt.add_unit("b"), "b.w", 10);
    opt.finalize();
    try {
      f(opt);
    } catch (const zero::InvalidArgument& e) {
      message = e.what();
    }
  });
  return message;
}

// Up to two micro-batches, each a step, in which `write(unit, g)` writes unit
// b's then unit a's gradient: fp16 refuses its marker only when it is seen
// twice running (the first step is skipped as an overflow), the other
// precisions at the first sight.
template <int S, class Precision, class Write>
auto two_micro_batches(Write write) {
  return [write](Opt<S, Precision>& opt) {
    for (int k = 0; k < 2; ++k) {
      for (const zero::UnitId u : {zero::UnitId{1}, zero::UnitId{0}}) {
        opt.acquire_unit(u);
        write(u, opt.grad_buffer(u));
        opt.grad_ready(u);
        opt.release_unit(u);
      }
      const auto result = opt.step();
      CHECK(result.skipped_overflow == (k == 0));  // reached only by fp16: its first sight of the marker skips
    }
  };
}

template <int S, class Precision>
void overwrite_catches_adding_and_skipping() {
  using G = typename Precision::grad_type;
  INFO("stage " << S);
  // An adding backward (+=) on what unit b's buffer holds.
  auto adds = two_micro_batches<S, Precision>([](zero::UnitId u, G* g) {
    for (int i = 0; i < (u.index == 1 ? 10 : 300); ++i)
      g[i] = u.index == 1 ? zero::from_float<G>(zero::to_float(g[i]) + 0.25f) : zero::from_float<G>(0.5f);
  });
  const std::string added = error_of<S, Precision>({}, adds);
  // bf16's NaN marker comes back from to_float/from_float as the canonical NaN.
  CHECK_THAT(added, Catch::Contains(std::is_same_v<G, zero::bf16>
                                        ? "grad_ready('b'): 10 of 10 gradient elements (the first: 'b.w'[0]) hold inf "
                                          "or NaN in the run's first micro-batch: either backward added (+=) to the "
                                          "marker"
                                        : "grad_ready('b'): 10 of 10 gradient elements (the first: 'b.w'[0]) were not "
                                          "assigned in the run's first micro-batch"));
  CHECK_THAT(added, Catch::Contains("Options::grad_writes = GradWrites::accumulate"));
  // A backward that leaves one element of unit a alone.
  auto skips = two_micro_batches<S, Precision>([](zero::UnitId u, G* g) {
    for (int i = 0; i < (u.index == 1 ? 10 : 300); ++i)
      if (u.index == 1 || i != 123) g[i] = zero::from_float<G>(0.5f);
  });
  // Both are right with accumulate (zeroed buffers), and so is assigning
  // every element with overwrite: no error, at the first step or later.
  auto three_steps = [](auto write) {
    return [write](Opt<S, Precision>& opt) {
      for (int k = 0; k < 3; ++k) {
        for (const zero::UnitId u : {zero::UnitId{1}, zero::UnitId{0}}) {
          opt.acquire_unit(u);
          G* g = opt.grad_buffer(u);
          for (std::size_t i = 0; i < opt.layout().unit(u).padded; ++i) write(g[i]);
          opt.grad_ready(u);
          opt.release_unit(u);
        }
        opt.step();
      }
    };
  };
  Options accumulate;
  accumulate.grad_writes = GradWrites::accumulate;
  CHECK(error_of<S, Precision>(accumulate, three_steps([](G& g) {
          g = zero::from_float<G>(zero::to_float(g) + 0.5f);
        })).empty());
  CHECK(error_of<S, Precision>({}, three_steps([](G& g) { g = zero::from_float<G>(0.5f); })).empty());
}

}  // namespace

TEST_CASE("overwrite: a backward that adds into its gradients or skips an element fails at the first micro-batch",
          "[engine][grad_writes]") {
  overwrite_catches_adding_and_skipping<0, zero::precision::Full<float>>();
  overwrite_catches_adding_and_skipping<1, zero::precision::Mixed<zero::bf16>>();
  overwrite_catches_adding_and_skipping<2, zero::precision::Mixed<zero::fp16>>();
  overwrite_catches_adding_and_skipping<3, zero::precision::Full<float>>();
}

TEST_CASE("overwrite: no gradient a correct backward computes is taken for the unwritten-gradient marker",
          "[engine][grad_writes]") {
  // fp16: a scaled gradient that rounds to 65504 (fp16's largest value, the
  // marker) at the initial scale of 65536: the first step is skipped as an
  // overflow would be, the later ones update; nothing is refused.
  using F16 = zero::precision::Mixed<zero::fp16>;
  std::vector<bool> skipped;
  const std::string fp16_error = error_of<2, F16>({}, [&](Opt<2, F16>& opt) {
    for (int k = 0; k < 3; ++k) {
      const auto scaled = zero::from_float<zero::fp16>(0.99951171875f * static_cast<float>(opt.loss_scale()));
      for (const zero::UnitId u : {zero::UnitId{1}, zero::UnitId{0}}) {
        zero::fp16* g = opt.grad_buffer(u);
        std::fill_n(g, opt.layout().unit(u).numel, scaled);
        opt.grad_ready(u);
      }
      skipped.push_back(opt.step().skipped_overflow);
    }
  });
  CHECK(fp16_error == "");
  CHECK(skipped == std::vector<bool>{true, false, false});
  // fp32 and bf16: their largest finite values (the old markers) are gradients like any other.
  auto assigns = [](auto value) {
    return [value](auto& opt) {
      for (const zero::UnitId u : {zero::UnitId{1}, zero::UnitId{0}}) {
        auto* g = opt.grad_buffer(u);
        std::fill_n(g, opt.layout().unit(u).numel, value);
        opt.grad_ready(u);
      }
    };
  };
  CHECK(error_of<1, zero::precision::Full<float>>({}, assigns(std::numeric_limits<float>::max())) == "");
  CHECK(error_of<3, zero::precision::Mixed<zero::bf16>>({}, assigns(zero::bf16{0x7F7F})) == "");
}

TEST_CASE("accumulate: a gradient after its grad_ready, and more live buckets than allowed, are errors naming the fix",
          "[engine][grad_writes]") {
  using P = zero::precision::Full<float>;
  const zero::UnitId a{0}, b{1};
  Options o;
  o.grad_writes = GradWrites::accumulate;
  o.bucket_bytes = 1;  // a bucket per unit
  CHECK_THAT((error_of<2, P>(o,
                             [&](Opt<2, P>& opt) {
                               opt.grad_buffer(b);
                               opt.grad_ready(b);
                               opt.grad_buffer(b);
                             })),
             Catch::Contains("grad_buffer('b') after grad_ready('b') in this micro-batch"));
  o.live_buckets = 1;
  // The tied unit "a" (the last bucket in backward's order) is live from the
  // start; "b" needs a second bucket.
  const std::string live = error_of<2, P>(o, [&](Opt<2, P>& opt) {
    opt.grad_buffer(a);
    opt.grad_buffer(b);
  });
  CHECK_THAT(live, Catch::Contains("grad_buffer('b'): 1 gradient buckets are live already (the oldest holds unit 'a')"));
  CHECK_THAT(live, Catch::Contains("raise Options::live_buckets"));
  // With two, the same order works and trains.
  o.live_buckets = 2;
  CHECK((error_of<2, P>(o, [&](Opt<2, P>& opt) {
          opt.grad_buffer(a);
          opt.grad_buffer(b);
          opt.grad_ready(b);
          opt.step();
        }).empty()));
}

TEST_CASE("mean_over_ranks: each rank's value averaged, as control traffic", "[engine][fit]") {
  zero::comm::LocalGroup group(3);
  group.run([](zero::comm::Local& c) {
    Opt<2, zero::precision::Full<float>> opt(c, {});
    opt.add_param(opt.add_unit("a"), "a.w", 10);
    opt.finalize();
    opt.reset_comm_counters();
    const double mean = opt.mean_over_ranks(1.5 * (c.rank() + 1));  // 1.5, 3, 4.5
    CHECK(mean == 3.0);
    const auto& counters = opt.comm_report().counters;
    CHECK(counters.calls[static_cast<std::size_t>(zero::comm::Collective::control)] == 1);
  });
}

TEST_CASE("use_memory and hold_whole: misuse is an error naming the fix", "[engine][fit]") {
  using P = zero::precision::Full<float>;
  zero::comm::LocalGroup group(1);
  group.run([](zero::comm::Local& c) {
    std::vector<float> values(20), grads(20);
    {
      // Half a unit's gradients in the caller's memory.
      Opt<2, P> opt(c, {});
      const auto u = opt.add_unit("a");
      opt.use_memory(opt.add_param(u, "a.w", 10), values.data(), grads.data());
      opt.use_memory(opt.add_param(u, "a.b", 10), values.data() + 10, nullptr);
      CHECK_THROWS_WITH(opt.finalize(), Catch::Contains("finalize(): unit 'a' has 1 of its 2 parameters' gradients "
                                                        "in your memory (use_memory)"));
    }
    Opt<3, P> opt(c, {});
    const auto u = opt.add_unit("a");
    const auto w = opt.add_param(u, "a.w", 10);
    opt.use_memory(w, values.data(), grads.data());
    CHECK_THROWS_WITH(opt.use_memory(zero::ParamId{5}, nullptr, nullptr), Catch::Contains("does not exist"));
    opt.finalize();
    CHECK_THROWS_WITH(opt.use_memory(w, values.data(), nullptr), Catch::Contains("call it before finalize()"));
    CHECK_THROWS_WITH(opt.grad_buffer(u), Catch::Contains("this unit's gradient is in your memory (use_memory)"));
    // The values reach the caller's memory at acquire_unit; held whole, at once.
    std::vector<float> init(10);
    for (int i = 0; i < 10; ++i) init[static_cast<std::size_t>(i)] = 0.5f * static_cast<float>(i);
    opt.set_param(w, init.data());
    std::fill(values.begin(), values.end(), -1.0f);
    {
      zero::HeldWhole whole = opt.hold_whole();
      CHECK(std::equal(init.begin(), init.end(), values.begin()));
      // Refused, not waited for (engine.hpp): the scope ends on this thread.
      CHECK_THROWS_WITH(opt.step(), Catch::Contains("step(): the parameters are held whole (hold_whole()); end that "
                                                    "scope"));
      CHECK_THROWS_WITH(opt.set_param(w, init.data()),
                        Catch::Contains("set_param(): the parameters are held whole (hold_whole()); end that scope "
                                        "first"));
      CHECK_THROWS_WITH(opt.hold_whole(), Catch::Contains("held whole already"));
      // Held whole, every parameter's values are there, acquired or not
      // (the layout names each parameter's unit as the calls take it).
      static_assert(std::is_same_v<decltype(zero::ParamInfo::unit), zero::UnitId>);
      CHECK(std::equal(init.begin(), init.end(), opt.param_data(w)));
      CHECK(opt.acquire_unit(opt.layout().param(w).unit) == opt.param_data(w));
      opt.release_unit(opt.layout().param(w).unit);
    }
    opt.acquire_unit(u);
    CHECK_THROWS_WITH(opt.hold_whole(), Catch::Contains("hold_whole(): unit 'a' is acquired"));
    opt.release_unit(u);
  });
}
