// Misuse that used to train on silently or crash: ranks built or configured
// differently, sizes that overflow, allocations that fail, values and
// hyper-parameters that differ across ranks, stage-3 pointers to units that
// are not acquired, and gathered copies that outlive the update of their
// shards. Each gets a clear error on every rank (or, for stale copies, the
// right values).
#include <array>
#include <optional>

#include "engine_harness.hpp"

// The allocation test asks for more memory than any address space holds; with
// AddressSanitizer that must fail as malloc does (null), not abort.
extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1"; }

namespace {

using zero::backend::Host;
using zero::offload::None;
using zero::precision::Full;
using zero::precision::Mixed;

template <class Precision, class Optimizer, int S>
using Opt = zero::ZeroOptimizer<Precision, Optimizer, zero::stage<S>>;

static_assert(std::is_same_v<Opt<Mixed<zero::bf16>, zero::optim::AdamW, 2>,
                             zero::ZeroOptimizer<Mixed<zero::bf16>, zero::optim::AdamW, zero::stage<2>, None, Host>>,
              "ZeroOptimizer's offload and backend default to offload::None and backend::Host");

zero::comm::LocalGroup::Options quick_timeout() {
  zero::comm::LocalGroup::Options o;
  o.timeout = std::chrono::milliseconds(2000);  // a rank left waiting fails the test instead of hanging it
  return o;
}

// Registers the same two units as every other rank and finalizes; returns
// the CommError's message, or "" when finalize() succeeded.
template <class O>
std::string finalize_error(zero::comm::Local& c, const zero::Options& options) {
  O opt(c, {}, options);
  const auto a = opt.add_unit("a");
  opt.add_param(a, "a.w", 100);
  const auto b = opt.add_unit("b");
  opt.add_param(b, "b.w", 33);
  try {
    opt.finalize();
  } catch (const zero::CommError& e) {
    return e.what();
  }
  return "";
}

// Runs rank 0 as R0 with o0 and every other rank as R1 with o1; returns each
// rank's finalize() error.
template <class R0, class R1>
std::vector<std::string> finalize_errors(int ranks, const zero::Options& o0, const zero::Options& o1) {
  std::vector<std::string> messages(static_cast<std::size_t>(ranks));
  zero::comm::LocalGroup group(ranks, quick_timeout());
  group.run([&](zero::comm::Local& c) {
    messages[static_cast<std::size_t>(c.rank())] =
        c.rank() == 0 ? finalize_error<R0>(c, o0) : finalize_error<R1>(c, o1);
  });
  return messages;
}

void require_every_rank_says(const std::vector<std::string>& messages, const std::string& text) {
  for (std::size_t r = 0; r < messages.size(); ++r) {
    INFO("rank " << r << ": " << messages[r]);
    CHECK_THAT(messages[r], Catch::Contains(text));
  }
}

}  // namespace

TEST_CASE("Ranks built with another precision, optimizer or options fail finalize() on every rank, naming it",
          "[engine][errors][hardening]") {
  using Bf16 = Opt<Mixed<zero::bf16>, zero::optim::AdamW, 2>;
  using Fp16 = Opt<Mixed<zero::fp16>, zero::optim::AdamW, 2>;
  using Adam = Opt<Mixed<zero::bf16>, zero::optim::Adam, 2>;
  const zero::Options defaults;
  require_every_rank_says(finalize_errors<Bf16, Fp16>(2, defaults, defaults),
                          "the precision: rank 0 has Mixed<bf16>, rank(s) 1 differ (rank 1 has Mixed<fp16>)");
  require_every_rank_says(finalize_errors<Bf16, Adam>(3, defaults, defaults),
                          "the optimizer: rank 0 has adamw, rank(s) 1, 2 differ");

  // One Options field changed on ranks 1..: each is named with both values.
  struct Edit {
    std::function<void(zero::Options&)> change;
    const char* expected;
  };
  const Edit edits[] = {
      {[](zero::Options& o) { o.grad_accumulation_steps = 2; },
       "Options::grad_accumulation_steps: rank 0 has 1, rank(s) 1 differ (rank 1 has 2)"},
      {[](zero::Options& o) { o.reduce_dtype = zero::ReduceDType::fp32; },
       "Options::reduce_dtype: rank 0 has same_as_grad, rank(s) 1 differ (rank 1 has fp32)"},
      {[](zero::Options& o) { o.clip_norm = 0.5; },
       "Options::clip_norm: rank 0 has 0, rank(s) 1 differ (rank 1 has 0.5)"},
  };
  for (const Edit& edit : edits) {
    zero::Options changed;
    edit.change(changed);
    require_every_rank_says(finalize_errors<Bf16, Bf16>(2, defaults, changed), edit.expected);
  }
  zero::Options accumulate;
  accumulate.grad_accumulation_steps = 2;
  // Several differences are all named; agreeing ranks pass.
  zero::Options both = accumulate;
  both.prefetch_units = 3;
  const auto messages = finalize_errors<Bf16, Bf16>(2, defaults, both);
  require_every_rank_says(messages, "grad_accumulation_steps");
  require_every_rank_says(messages, "Options::prefetch_units: rank 0 has 1");
  for (const auto& m : finalize_errors<Bf16, Bf16>(3, accumulate, accumulate)) CHECK(m.empty());
}

TEST_CASE("Sizes that overflow name the parameter instead of crashing", "[engine][errors][hardening]") {
  using Fp32 = Opt<Full<float>, zero::optim::Sgd, 1>;
  using Bf16 = Opt<Mixed<zero::bf16>, zero::optim::AdamW, 3>;
  for (int ranks : {1, 2}) {
    zero::comm::LocalGroup group(ranks, quick_timeout());
    group.run([&](zero::comm::Local& c) {
      {  // 2^62 fp32 elements: 2^64 bytes (used to divide by a size that wrapped to 0)
        Fp32 opt(c, {});
        opt.add_param(opt.add_unit("big"), "huge", std::size_t{1} << 62);
        REQUIRE_THROWS_WITH(opt.finalize(), Catch::Contains("unit 'big'") && Catch::Contains("parameter 'huge'") &&
                                                Catch::Contains("does not fit in 64 bits"));
      }
      {  // 2^63 + 64 bf16 elements (used to pass with 128-byte buffers)
        Bf16 opt(c, {});
        opt.add_param(opt.add_unit("small"), "w", 10);
        opt.add_param(opt.add_unit("big"), "huge", (std::size_t{1} << 63) + 64);
        REQUIRE_THROWS_WITH(opt.finalize(), Catch::Contains("parameter 'huge'") &&
                                                Catch::Contains("does not fit in 64 bits"));
      }
      {  // two parameters whose sum wraps inside one unit
        Bf16 opt(c, {});
        const auto u = opt.add_unit("u");
        opt.add_param(u, "first", std::size_t{1} << 63);
        REQUIRE_THROWS_WITH(opt.add_param(u, "second", std::size_t{1} << 63),
                            Catch::Contains("add_param('second'") && Catch::Contains("does not fit in 64 bits"));
      }
    });
  }
}

TEST_CASE("A failed allocation names the buffer, its bytes, the rank and what makes it smaller",
          "[engine][errors][hardening]") {
  // 2^45 fp32 elements: 128 TiB, more than a 47-bit address space holds.
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& c) {
    Opt<Full<float>, zero::optim::Sgd, 0> opt(c, {});
    opt.add_param(opt.add_unit("big"), "huge", std::size_t{1} << 45);
    try {
      opt.finalize();
      FAIL("finalize() allocated 128 TiB");
    } catch (const zero::OutOfMemory& e) {
      const std::string m = e.what();
      CHECK_THAT(m, Catch::Contains("on rank 0: could not allocate the parameters (140737488355328 bytes"));
      CHECK_THAT(m, Catch::Contains("host memory"));
      CHECK_THAT(m, Catch::Contains("stage 3 shards the parameters"));
    }
  });
}

TEST_CASE("set_param with values that differ across ranks is an error on every rank", "[engine][errors][hardening]") {
  auto check = [](auto stage_tag) {
    constexpr int S = decltype(stage_tag)::value;
    INFO("stage " << S);
    std::vector<std::string> messages(3);
    zero::comm::LocalGroup group(3, quick_timeout());
    group.run([&](zero::comm::Local& c) {
      Opt<Mixed<zero::bf16>, zero::optim::AdamW, S> opt(c, {});
      const auto w = opt.add_param(opt.add_unit("u"), "u.w", 300);
      opt.finalize();
      std::vector<float> same(300, 0.5f), mine(300, 0.5f);
      opt.set_param(w, same.data());  // equal values pass
      if (c.rank() == 2) mine[299] = 0.25f;
      try {
        opt.set_param(w, mine.data());
      } catch (const zero::CommError& e) {
        messages[static_cast<std::size_t>(c.rank())] = e.what();
      }
    });
    require_every_rank_says(messages, "set_param('u.w') on rank");
    require_every_rank_says(messages, "rank(s) 2 passed values that differ from rank 0's");
  };
  check(zero::stage<0>{});
  check(zero::stage<1>{});
  check(zero::stage<3>{});
}

namespace {

// Runs one optimizer step on `ranks` ranks of stage S (SGD, fp32), with
// `edit(rank, hyper)` applied after finalize(); returns each rank's error
// from step(), or "" when it stepped.
template <int S, class Optimizer = zero::optim::Sgd>
std::vector<std::string> step_errors(int ranks, std::function<void(int, typename Optimizer::Hyper&)> edit) {
  std::vector<std::string> messages(static_cast<std::size_t>(ranks));
  zero::comm::LocalGroup group(ranks, quick_timeout());
  group.run([&](zero::comm::Local& c) {
    Opt<Full<float>, Optimizer, S> opt(c, {});
    zero::test::SteadyStateRun<decltype(opt)> run(opt);
    run.micro_batch();  // a step with the hyper-parameters of construction
    edit(c.rank(), opt.hyper());
    try {
      run.micro_batch();
    } catch (const zero::Error& e) {
      messages[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  return messages;
}

}  // namespace

TEST_CASE("Hyper-parameters are validated at every step and compared across ranks", "[engine][errors][hardening]") {
  auto all_stages = [](auto&& check) {
    check(std::integral_constant<int, 0>{});
    check(std::integral_constant<int, 1>{});
    check(std::integral_constant<int, 2>{});
    check(std::integral_constant<int, 3>{});
  };
  all_stages([](auto s) {
    constexpr int S = decltype(s)::value;
    INFO("stage " << S);
    // Changed after construction to an invalid value, on every rank.
    auto invalid = step_errors<S>(2, [](int, zero::optim::Sgd::Hyper& h) { h.lr = -0.1; });
    require_every_rank_says(invalid, "'lr' is -0.1");
    // On one rank only: every rank stops.
    invalid = step_errors<S>(3, [](int r, zero::optim::Sgd::Hyper& h) {
      if (r == 1) h.momentum = -1;
    });
    CHECK_THAT(invalid[1], Catch::Contains("'momentum' is -1"));
    CHECK_THAT(invalid[0], Catch::Contains("hyper-parameters of rank(s) 1 are invalid"));
    CHECK_THAT(invalid[2], Catch::Contains("hyper-parameters of rank(s) 1 are invalid"));
    // A schedule computed from a rank-local counter.
    require_every_rank_says(step_errors<S>(3,
                                           [](int r, zero::optim::Sgd::Hyper& h) {
                                             if (r == 2) h.lr *= 0.5;
                                           }),
                            "hyper-parameters of rank(s) 2 differ from rank 0's");
    // The same change on every rank is a schedule, not an error.
    for (const auto& m : step_errors<S>(2, [](int, zero::optim::Sgd::Hyper& h) { h.lr *= 0.5; })) CHECK(m.empty());
  });
  // Every Adam hyper-parameter moves the fingerprint, eps included.
  using AdamHyper = zero::optim::AdamW::Hyper;
  const std::array<std::function<void(AdamHyper&)>, 5> edits = {
      [](AdamHyper& h) { h.lr *= 1.001; },         [](AdamHyper& h) { h.beta1 = 0.8; },
      [](AdamHyper& h) { h.beta2 = 0.99; },        [](AdamHyper& h) { h.eps = 1e-7; },
      [](AdamHyper& h) { h.weight_decay = 0.02; }};
  for (std::size_t i = 0; i < edits.size(); ++i) {
    INFO("AdamW edit " << i);
    require_every_rank_says(step_errors<2, zero::optim::AdamW>(2,
                                                               [&](int r, AdamHyper& h) {
                                                                 if (r == 1) edits[i](h);
                                                               }),
                            "rank(s) 1 differ from rank 0's");
  }
}

TEST_CASE("param_data needs finalize() and, at stage 3, an acquired unit", "[engine][errors][hardening]") {
  zero::comm::LocalGroup group(2, quick_timeout());
  group.run([&](zero::comm::Local& c) {
    Opt<Mixed<zero::bf16>, zero::optim::AdamW, 1> early(c, {});
    early.add_param(early.add_unit("a"), "a.w", 10);
    REQUIRE_THROWS_WITH(early.param_data(zero::ParamId{0}), Catch::Contains("param_data: call finalize()"));

    Opt<Mixed<zero::bf16>, zero::optim::AdamW, 3> opt(c, {});
    const auto a = opt.add_unit("a");
    const auto aw = opt.add_param(a, "a.w", 10);
    const auto b = opt.add_unit("b");
    const auto bw = opt.add_param(b, "b.w", 10);
    REQUIRE_THROWS_WITH(opt.param_data(aw), Catch::Contains("param_data: call finalize()"));
    opt.finalize();
    REQUIRE_THROWS_WITH(opt.param_data(zero::ParamId{9}), Catch::Contains("parameter id 9 does not exist"));
    const auto* unit_a = opt.acquire_unit(a);  // prefetches b
    CHECK(opt.param_data(aw) == unit_a + opt.layout().param(aw).offset);
    REQUIRE_THROWS_WITH(opt.param_data(bw), Catch::Contains("acquire_unit('b') first"));
    opt.release_unit(a);
    REQUIRE_THROWS_WITH(opt.param_data(aw), Catch::Contains("acquire_unit('a') first"));
  });
}

TEST_CASE("The inf/NaN error names the rank(s) that found it", "[engine][errors][hardening]") {
  // Rank 1's backward writes a NaN into element 137 of unit 'mlp' (mlp.b[1]).
  // With 4 ranks the unit's shard is 64 elements, so rank 2 owns it: the rank
  // that checks the summed gradient there finds it.
  auto check = [](auto stage_tag, const std::string& expected) {
    constexpr int S = decltype(stage_tag)::value;
    INFO("stage " << S);
    zero::test::TrainSpec spec;
    spec.steps = 2;
    spec.tamper = [](int rank, int step, int, std::size_t unit, void* host) {
      if (rank == 1 && step == 2 && unit == 1) static_cast<zero::bf16*>(host)[137] = zero::from_float<zero::bf16>(NAN);
    };
    std::vector<std::string> messages(4);
    zero::comm::LocalGroup group(4, quick_timeout());
    group.run([&](zero::comm::Local& c) {
      try {
        zero::test::train<Opt<Mixed<zero::bf16>, zero::optim::AdamW, S>>(c, {}, {}, spec);
      } catch (const zero::InvalidArgument& e) {
        messages[static_cast<std::size_t>(c.rank())] = e.what();
      }
    });
    require_every_rank_says(messages, "step 2: the gradients contain inf or NaN");
    require_every_rank_says(messages, expected);
  };
  check(zero::stage<1>{}, "found by rank(s) 2 in the summed gradient of the parameters they own");
  check(zero::stage<2>{}, "found by rank(s) 2 in the summed gradient of the parameters they own");
  check(zero::stage<3>{}, "found by rank(s) 2 in the summed gradient of the parameters they own");
  check(zero::stage<0>{}, "found by every rank: stage 0 checks the whole all-reduced gradient");
}

namespace {

// The reproduction: 2 ranks, SGD, three units of 256 elements, lr
// 0.1, gradient 1. Backward skips acquire_unit(0) (the first layer's weight
// gradient does not need its weights), while acquire_unit(1) prefetched unit 0.
struct StaleRun {
  using O = Opt<Full<float>, zero::optim::Sgd, 3>;
  static O::Hyper hyper() {
    O::Hyper h;
    h.lr = 0.1;
    return h;
  }
  explicit StaleRun(zero::comm::Local& c) : opt(c, hyper()) {
    for (int u = 0; u < 3; ++u) {
      units.push_back(opt.add_unit("u" + std::to_string(u)));
      params.push_back(opt.add_param(units.back(), "w" + std::to_string(u), 256));
    }
    opt.finalize();
    const std::vector<float> ones(256, 1.0f);
    for (const auto p : params) opt.set_param(p, ones.data());
  }
  void backward_without_first_acquire() {
    for (int u = 2; u >= 0; --u) {
      if (u != 0) opt.acquire_unit(units[u]);  // acquire_unit(u1) prefetches u0
      float* g = opt.grad_buffer(units[u]);
      std::fill(g, g + 256, 1.0f);
      opt.grad_ready(units[u]);
      if (u != 0) opt.release_unit(units[u]);
    }
  }
  std::vector<float> acquired(std::size_t u) {
    const float* w = opt.acquire_unit(units[u]);
    std::vector<float> values(w, w + 256);
    opt.release_unit(units[u]);
    return values;
  }
  O opt;
  std::vector<zero::UnitId> units;
  std::vector<zero::ParamId> params;
};

}  // namespace

TEST_CASE("Stage 3 never hands out a gathered copy older than the step or set_param that changed its shards",
          "[engine][hardening]") {
  zero::comm::LocalGroup group(2, quick_timeout());
  group.run([&](zero::comm::Local& c) {
    StaleRun run(c);
    for (int u = 0; u < 3; ++u) run.acquired(static_cast<std::size_t>(u));  // forward
    run.backward_without_first_acquire();
    REQUIRE(run.opt.step().stepped);
    const std::vector<float> master = run.opt.master_values(run.params[0]);
    CHECK(master[0] == Approx(0.9f));  // 1 - 0.1 * (sum of 2 ranks' gradients 1) / 2
    CHECK(run.acquired(0) == master);

    // set_param after a forward that prefetched the unit.
    run.opt.acquire_unit(run.units[0]);  // prefetches u1
    run.opt.release_unit(run.units[0]);
    const std::vector<float> fresh(256, 0.25f);
    run.opt.set_param(run.params[1], fresh.data());
    CHECK(run.acquired(1) == fresh);

    // A unit still acquired when the step updates it, or when set_param changes it, is an error.
    run.backward_without_first_acquire();
    run.opt.acquire_unit(run.units[2]);
    REQUIRE_THROWS_WITH(run.opt.step(), Catch::Contains("unit 'u2' is still acquired"));
    REQUIRE_THROWS_WITH(run.opt.set_param(run.params[2], fresh.data()), Catch::Contains("unit 'u2' is acquired"));
  });
}
