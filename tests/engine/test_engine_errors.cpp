// Bad input gets a clear error naming the problem and the fix; a rank that
// disagrees or fails never leaves the others hanging.
#include <algorithm>
#include <initializer_list>

#include "engine_harness.hpp"
#include "rank_divergence.hpp"

namespace {
using Opt3 = zero::ZeroOptimizer<zero::precision::Mixed<zero::bf16>, zero::optim::AdamW, zero::stage<3>,
                                 zero::offload::None, zero::backend::Host>;
using Opt1 = zero::ZeroOptimizer<zero::precision::Full<float>, zero::optim::Sgd, zero::stage<1>, zero::offload::None,
                                 zero::backend::Host>;
}  // namespace

TEST_CASE("Ranks that register different layouts all get a clear error", "[engine][errors]") {
  for (int ranks : {2, 4}) {
    std::vector<std::string> messages(static_cast<std::size_t>(ranks));
    zero::comm::LocalGroup group(ranks);
    group.run([&](zero::comm::Local& c) {
      Opt3 opt(c, {});
      const auto u = opt.add_unit("layer0");
      opt.add_param(u, "w", c.rank() == ranks - 1 ? 101 : 100);  // the last rank differs
      try {
        opt.finalize();
      } catch (const zero::CommError& e) {
        messages[static_cast<std::size_t>(c.rank())] = e.what();
      }
    });
    for (const auto& m : messages) {
      CHECK_THAT(m, Catch::Contains("registered different parameter layouts"));
      CHECK_THAT(m, Catch::Contains(ranks == 2 ? "rank(s) 1 differ" : "rank(s) 3 differ"));
    }
  }
}

TEST_CASE("Zero-sized, duplicate and late parameters are rejected", "[engine][errors]") {
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& c) {
    Opt1 opt(c, {});
    const auto u = opt.add_unit("layer");
    REQUIRE_THROWS_WITH(opt.add_param(u, "empty", 0), Catch::Contains("'empty' has 0 elements"));
    opt.add_param(u, "w", 10);
    REQUIRE_THROWS_WITH(opt.add_param(u, "w", 10), Catch::Contains("already exists"));
    REQUIRE_THROWS_WITH(opt.add_param(zero::UnitId{7}, "x", 10), Catch::Contains("does not exist"));
    REQUIRE_THROWS_WITH(opt.add_unit("layer"), Catch::Contains("already exists"));
    opt.add_unit("empty_unit");
    REQUIRE_THROWS_WITH(opt.finalize(), Catch::Contains("unit 'empty_unit' has no parameters"));
  });
  group.run([&](zero::comm::Local& c) {
    Opt1 opt(c, {});
    REQUIRE_THROWS_WITH(opt.grad_buffer(zero::UnitId{0}), Catch::Contains("call finalize()"));
    const auto u = opt.add_unit("layer");
    opt.add_param(u, "w", 10);
    opt.finalize();
    REQUIRE_THROWS_WITH(opt.add_param(u, "late", 3), Catch::Contains("after finalize()"));
    REQUIRE_THROWS_WITH(opt.step(), Catch::Contains("has no gradient in this micro-batch"));
    REQUIRE_THROWS_WITH(opt.grad_ready(u), Catch::Contains("call grad_buffer() for this unit"));
  });
}

TEST_CASE("Thousands of parameters of every size partition correctly", "[engine][layout]") {
  zero::Layout layout(7);
  std::vector<zero::ParamId> ids;
  for (int u = 0; u < 40; ++u) {
    // (names built with += : g++ 12 gives a false -Wrestrict on "literal" + std::string)
    std::string unit_name = "unit";
    unit_name += std::to_string(u);
    const auto unit = layout.add_unit(unit_name);
    for (int p = 0; p < 60; ++p) {
      std::string name = unit_name;
      name += '_';
      name += std::to_string(p);
      ids.push_back(layout.add_param(unit, name, 1 + static_cast<std::size_t>(u * 60 + p) % 97));
    }
  }
  layout.finalize();
  std::size_t shard_sum = 0, full = 0;
  for (const auto& u : layout.units()) {
    CHECK(u.padded == u.shard * 7);
    CHECK(u.shard % 64 == 0);
    CHECK(u.padded >= u.numel);
    CHECK(u.full_offset == full);
    CHECK(u.shard_offset == shard_sum);
    full += u.padded;
    shard_sum += u.shard;
    // Parameters do not overlap and start 16-byte aligned.
    std::size_t end = 0;
    for (std::size_t p : u.params) {
      const auto& info = layout.params()[p];
      CHECK(info.offset >= end);
      CHECK(info.offset % 8 == 0);
      end = info.offset + info.numel;
    }
  }
  CHECK(layout.padded_total() == full);
  CHECK(layout.shard_total() * 7 == full);
  CHECK(layout.params().size() == 2400);
}

TEST_CASE("Options are validated with the field named", "[engine][errors]") {
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& c) {
    zero::Options o;
    o.grad_accumulation_steps = 0;
    REQUIRE_THROWS_WITH(Opt1(c, {}, o), Catch::Contains("grad_accumulation_steps"));
    o = {};
    o.loss_scale.backoff_factor = 2;
    REQUIRE_THROWS_WITH(Opt1(c, {}, o), Catch::Contains("backoff_factor"));
    zero::optim::Sgd::Hyper h;
    h.lr = -1;
    REQUIRE_THROWS_WITH(Opt1(c, h), Catch::Contains("'lr'"));
  });
}

TEST_CASE("A rank that stops calling collectives fails the group instead of hanging", "[engine][errors][comm]") {
  zero::comm::LocalGroup::Options o;
  o.timeout = std::chrono::milliseconds(300);
  zero::comm::LocalGroup group(3, o);
  REQUIRE_THROWS_WITH(group.run([&](zero::comm::Local& c) {
                        if (c.rank() != 1) c.barrier();  // rank 1 skips it
                      }),
                      Catch::Contains("same collective calls in the same order"));
  // A rank that throws releases the others with a message naming it.
  REQUIRE_THROWS_WITH(group.run([&](zero::comm::Local& c) {
                        if (c.rank() == 2) throw zero::InvalidArgument("bad batch on rank 2");
                        c.barrier();
                      }),
                      Catch::Contains("bad batch on rank 2"));
}

TEST_CASE("Stage 3 holds at most prefetch + 1 units at once", "[engine][errors]") {
  zero::comm::LocalGroup group(2);
  group.run([&](zero::comm::Local& c) {
    zero::Options o;
    o.prefetch_units = 0;
    Opt3 opt(c, {}, o);
    const auto a = opt.add_unit("a");
    opt.add_param(a, "a.w", 10);
    const auto b = opt.add_unit("b");
    opt.add_param(b, "b.w", 10);
    opt.finalize();
    opt.acquire_unit(a);
    REQUIRE_THROWS_WITH(opt.acquire_unit(b), Catch::Contains("release_unit()"));
    opt.release_unit(a);
    REQUIRE_THROWS_WITH(opt.release_unit(a), Catch::Contains("not acquired"));
    REQUIRE_THROWS_WITH(opt.param_data(zero::ParamId{0}), Catch::Contains("acquire_unit('a') first"));
  });
}

TEST_CASE("Ranks in different collective calls get an error naming each rank's call", "[engine][errors][comm]") {
  using Opt2 = zero::ZeroOptimizer<zero::precision::Full<float>, zero::optim::Sgd, zero::stage<2>,
                                   zero::offload::None, zero::backend::Host>;
  std::vector<std::string> messages(2);
  zero::comm::LocalGroup group(2);
  group.run([&](zero::comm::Local& c) {
    Opt2 opt(c, {});
    const auto u = opt.add_unit("layer0");
    opt.add_param(u, "w", 1000);
    opt.finalize();
    try {
      if (c.rank() == 0) {
        std::vector<float> masters(opt.layout().padded_total());
        opt.gather_masters(masters.data());
      } else {
        std::fill_n(opt.grad_buffer(u), 1000, typename Opt2::grad_type{});  // assigned, as overwrite needs
        opt.grad_ready(u);  // the unit's bucket is complete: reduce-scattered now
      }
    } catch (const zero::CommError& e) {
      messages[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  for (const auto& m : messages)
    CHECK_THAT(m, Catch::Contains("rank 1 reduce-scatters the gradient of unit 'layer0' (exchange #2 of the "
                                  "optimizer) with reduce_scatter(512 x fp32) in grad_ready() while rank 0 gathers "
                                  "the values of unit 'layer0' (exchange #2 of the optimizer) with all_gather(512 x "
                                  "fp32) in gather_masters()"));
}

TEST_CASE("A rank that returns or throws fails the others' collectives at once, not after the timeout",
          "[engine][errors][comm]") {
  zero::comm::LocalGroup::Options o;
  o.timeout = std::chrono::minutes(2);  // far longer than the test: the rank leaving is what ends the wait
  zero::comm::LocalGroup group(3, o);
  const auto started = std::chrono::steady_clock::now();
  for (const bool throws : {false, true}) {
    std::vector<std::string> messages(3);
    auto run = [&] {
      group.run([&](zero::comm::Local& c) {
        Opt1 opt(c, {});
        const auto u = opt.add_unit("layer0");
        opt.add_param(u, "w", 100);
        opt.finalize();
        std::fill_n(opt.grad_buffer(u), 100, typename Opt1::grad_type{});  // assigned, as overwrite needs
        opt.grad_ready(u);
        if (c.rank() == 1) {
          if (throws) throw zero::InvalidArgument("bad batch on rank 1");
          return;  // skips the step
        }
        try {
          opt.step();
        } catch (const zero::CommError& e) {
          messages[static_cast<std::size_t>(c.rank())] = e.what();
        }
      });
    };
    if (throws) {
      CHECK_THROWS_WITH(run(), "bad batch on rank 1");
      CHECK_THAT(messages[0], Catch::Contains("rank 1 left (threw: bad batch on rank 1) while rank 0 waits in "));
    } else {
      CHECK_NOTHROW(run());
      CHECK_THAT(messages[0], Catch::Contains("rank 1 returned while rank 0 waits in "));
    }
    CHECK_THAT(messages[0], Catch::Contains(" in step()"));
    CHECK_THAT(messages[2], Catch::Contains(" in step()"));
  }
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(60));
}

TEST_CASE("Ranks whose layouts differ get the first differing parameter named, and how", "[engine][errors]") {
  struct Param {
    const char* unit;
    const char* name;
    std::size_t numel;
    zero::Shape shape;
  };
  using Params = std::vector<Param>;
  // Rank 0 registers `base`; rank 1 `other`.
  const Params base = {{"a", "a.w", 10, {2, 5}}, {"a", "a.b", 5, {}}, {"b", "b.w", 20, {}}};
  const struct {
    Params other;
    const char* expected;
  } cases[] = {
      {{{"a", "a.v", 10, {2, 5}}, {"a", "a.b", 5, {}}, {"b", "b.w", 20, {}}},
       "parameter #0 of unit 'a' is 'a.w' on rank 0 and 'a.v' on rank 1 (a different name)"},
      {{{"a", "a.b", 5, {}}, {"a", "a.w", 10, {2, 5}}, {"b", "b.w", 20, {}}},
       "parameter 'a.w' is parameter #0 of unit 'a' on rank 0 but parameter #1 of unit 'a' on rank 1 (registered in "
       "another order)"},
      {{{"a", "a.w", 10, {2, 5}}, {"a", "a.b", 6, {}}, {"b", "b.w", 20, {}}},
       "parameter 'a.b' has 5 elements on rank 0 and 6 on rank 1 (a different size)"},
      {{{"a", "a.w", 10, {5, 2}}, {"a", "a.b", 5, {}}, {"b", "b.w", 20, {}}},
       "parameter 'a.w' has shape [2, 5] on rank 0 and [5, 2] on rank 1 (a different shape)"},
      {{{"a", "a.w", 10, {}}, {"a", "a.b", 5, {}}, {"b", "b.w", 20, {}}},
       "parameter 'a.w' has shape [2, 5] on rank 0 and none (flat) on rank 1 (a different shape)"},
      {{{"a", "a.w", 10, {2, 5}}, {"b", "a.b", 5, {}}, {"b", "b.w", 20, {}}},
       "unit 'a' has 2 parameters on rank 0 and 1 on rank 1; parameter 'a.b' (#1 of the unit on rank 0) is "
       "parameter #0 of unit 'b' on rank 1 (another unit)"},
      {{{"a", "a.w", 10, {2, 5}}, {"a", "a.b", 5, {}}, {"c", "b.w", 20, {}}},
       "unit #1 is 'b' on rank 0 and 'c' on rank 1 (a different unit name or order)"},
      {{{"a", "a.w", 10, {2, 5}}, {"a", "a.b", 5, {}}},
       "unit #1 'b' exists on rank 0, not on rank 1 (2 units on rank 0, 1 on rank 1)"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> messages(2);
    zero::comm::LocalGroup group(2);
    group.run([&](zero::comm::Local& comm) {
      Opt1 opt(comm, {});
      std::vector<std::string> units;
      for (const Param& p : comm.rank() == 0 ? base : c.other) {
        if (std::find(units.begin(), units.end(), p.unit) == units.end()) {
          units.push_back(p.unit);
          opt.add_unit(p.unit);
        }
        const auto u = static_cast<std::size_t>(std::find(units.begin(), units.end(), p.unit) - units.begin());
        opt.add_param(zero::UnitId{u}, p.name, p.numel, p.shape);
      }
      try {
        opt.finalize();
      } catch (const zero::CommError& e) {
        messages[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    INFO(c.expected);
    for (const auto& m : messages) {
      CHECK_THAT(m, Catch::Contains("registered different parameter layouts"));
      CHECK_THAT(m, Catch::Contains(std::string("the first difference in the layouts: ") + c.expected));
    }
    auto after_rank = [](const std::string& m) { return m.substr(std::min(m.size(), m.find(": the ranks"))); };
    CHECK(after_rank(messages[0]) == after_rank(messages[1]));  // every rank says the same
  }
}

TEST_CASE("Names a checkpoint or a safetensors file cannot hold are refused at add_param and add_unit",
          "[engine][errors][names]") {
  zero::Layout layout(2);
  const auto u = layout.add_unit("layer");
  using zero::InvalidArgument;
  using Catch::Matchers::Message;
  // Before, each was accepted and failed at the first save or export (the
  // invalid UTF-8 with the JSON library's type_error.316, naming nothing).
  REQUIRE_THROWS_MATCHES(layout.add_param(u, "", 4), InvalidArgument,
                         Message("add_param: the parameter name is empty; checkpoints and Hugging Face exports find "
                                 "each parameter by its name: give it one (e.g. \"fc1.weight\")"));
  REQUIRE_THROWS_MATCHES(layout.add_param(u, "__metadata__", 4), InvalidArgument,
                         Message("add_param: the parameter name '__metadata__' is reserved by safetensors (its "
                                 "header's metadata entry): rename the parameter"));
  REQUIRE_THROWS_MATCHES(layout.add_param(u, "fc\xff.weight", 4), InvalidArgument,
                         Message("add_param: the parameter name 'fc\\xFF.weight' is not valid UTF-8 (byte 2): "
                                 "checkpoints and safetensors files store names as JSON strings, which must be "
                                 "UTF-8; rename the parameter (or convert the name to UTF-8)"));
  // UTF-8's forms JSON writers refuse: overlong, a surrogate, past U+10FFFF, cut short.
  for (const char* bad : {"\xC0\xAF", "\xE0\x80\xAF", "\xED\xA0\x80", "\xF4\x90\x80\x80", "w\xE2\x82"})
    CHECK_THROWS_WITH(layout.add_param(u, bad, 4), Catch::Contains("is not valid UTF-8"));
  REQUIRE_THROWS_WITH(layout.add_unit("block\x80"), Catch::Contains("add_unit: the unit name 'block\\x80' is not "
                                                                     "valid UTF-8 (byte 5)"));
  CHECK(layout.params().empty());
  CHECK(layout.units().size() == 1);
  // Any UTF-8 is a name: accented, CJK, 4-byte characters, '/' and spaces.
  for (const char* good : {"caf\xC3\xA9.w", "\xE5\xB1\x82.bias", "emoji\xF0\x9F\x98\x80", "a/b c", "__metadata__x"})
    CHECK_NOTHROW(layout.add_param(u, good, 4));
  CHECK_NOTHROW(layout.add_unit("__metadata__"));  // a unit name is only part of a tensor's name
}

TEST_CASE("Ranks that take different paths get an error naming each rank's exchange, never mixed values",
          "[engine][errors][comm]") {
  namespace dv = zero::test::divergence;
  for (int ranks : {2, 3}) {
    for (dv::Scenario scenario : dv::scenarios) {
      INFO(ranks << " ranks: " << dv::name(scenario));
      std::vector<dv::Outcome> outcomes(static_cast<std::size_t>(ranks));
      zero::comm::LocalGroup group(ranks);
      group.run([&](zero::comm::Local& c) { outcomes[static_cast<std::size_t>(c.rank())] = dv::run(c, scenario); });
      for (const auto& o : outcomes) {
        CHECK(o.other_error == "");
        for (const auto& word : dv::expected_words(scenario)) CHECK_THAT(o.error, Catch::Contains(word));
        for (double sum : o.sums) {
          INFO("an acquired unit sums to " << sum << " (a: 1024, b: 2048)");
          CHECK((sum == 1024.0 || sum == 2048.0));
        }
      }
    }
  }
}

namespace {
// One step of loss |w|^2 / 2 (gradient w) over `units`, backward in the
// order given, each unit's parameters `numel` elements.
template <class Opt>
void half_square_step(Opt& opt, std::initializer_list<zero::UnitId> units, std::size_t numel) {
  for (const zero::UnitId u : units) {
    const float* w = opt.acquire_unit(u);
    std::copy_n(w, numel, opt.grad_buffer(u));
    opt.grad_ready(u);
    opt.release_unit(u);
  }
  opt.step();
}
}  // namespace

TEST_CASE("An update that makes the parameters non-finite is the error, not the gradients a forward on them makes",
          "[engine][errors]") {
  // loss = |w|^2 / 2 (gradient w) with SGD at lr 1e30: step 1 moves w to
  // -1e30, step 2 to inf, and step 3's gradients are inf.
  auto run = [](auto stage) {
    constexpr int S = decltype(stage)::value;
    using Opt = zero::ZeroOptimizer<zero::precision::Full<float>, zero::optim::Sgd, zero::stage<S>,
                                    zero::offload::None, zero::backend::Host>;
    std::vector<std::string> messages(2);
    zero::comm::LocalGroup group(2);
    group.run([&](zero::comm::Local& c) {
      zero::optim::Sgd::Hyper h;
      h.lr = 1e30;
      Opt opt(c, h);
      const auto u = opt.add_unit("layer");
      opt.add_param(u, "layer.w", 64);
      opt.finalize();
      const std::vector<float> ones(64, 1.0f);
      opt.set_param(zero::ParamId{0}, ones.data());
      try {
        for (int step = 0; step < 4; ++step) half_square_step(opt, {u}, 64);
      } catch (const zero::InvalidArgument& e) {
        messages[static_cast<std::size_t>(c.rank())] = e.what();
      }
    });
    for (const auto& m : messages) {
      INFO("stage " << S);
      CHECK_THAT(m, Catch::Contains("step 3: the parameters are already inf or NaN ('layer.w'["));
      CHECK_THAT(m, Catch::Contains("the update of step 2 made them so; the learning rate is 1e+30 now"));
    }
  };
  run(std::integral_constant<int, 1>{});
  run(std::integral_constant<int, 3>{});
}

namespace {

// comm::Local whose rank `victim` finds one bit flipped in what its
// all_gather number `at` (counted on that rank from 1) received, at element
// `element` of the gathered buffer: a bit flipped on the link or in memory.
class FlippingLocal {
 public:
  FlippingLocal(zero::comm::Local& c, int victim, int at, std::size_t element)
      : c_(c), victim_(victim), at_(at), element_(element) {}
  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  void all_reduce(void* b, std::size_t n, zero::DType t, zero::comm::ReduceOp op, bool control) {
    c_.all_reduce(b, n, t, op, control);
  }
  void reduce_scatter(const void* s, void* r, std::size_t n, zero::DType t) { c_.reduce_scatter(s, r, n, t); }
  void all_gather(const void* s, void* r, std::size_t n, zero::DType t, bool control) {
    c_.all_gather(s, r, n, t, control);
    if (!control && c_.rank() == victim_ && ++gathers_ == at_) static_cast<unsigned char*>(r)[element_ * 4 + 1] ^= 4;
  }
  void broadcast(void* b, std::size_t n, zero::DType t, int root) { c_.broadcast(b, n, t, root); }
  void barrier() { c_.barrier(); }
  const zero::comm::ByteCounters& counters() const { return c_.counters(); }
  void reset_counters() { c_.reset_counters(); }

 private:
  zero::comm::Local& c_;
  int victim_, at_;
  int gathers_ = 0;
  std::size_t element_;
};

// Three ranks train units a and b (loss |w|^2 / 2) for three steps; rank 1's
// second parameter all_gather gets a flipped bit. Returns each rank's error.
template <int S>
std::vector<std::string> train_with_a_flipped_bit(bool check) {
  using Opt = zero::ZeroOptimizer<zero::precision::Full<float>, zero::optim::Sgd, zero::stage<S>,
                                  zero::offload::None, zero::backend::Host>;
  std::vector<std::string> messages(3);
  zero::comm::LocalGroup group(3);
  group.run([&](zero::comm::Local& local) {
    FlippingLocal c(local, 1, 2, 5);
    zero::Options o;
    o.check_replicas = check;
    o.prefetch_units = 0;
    Opt opt(c, {}, o);
    const zero::UnitId units[] = {opt.add_unit("a"), opt.add_unit("b")};
    opt.add_param(units[0], "a.w", 96);
    opt.add_param(units[1], "b.w", 96);
    opt.finalize();
    try {
      for (int step = 0; step < 3; ++step) half_square_step(opt, {units[1], units[0]}, 96);
    } catch (const zero::CommError& e) {
      messages[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  return messages;
}

}  // namespace

TEST_CASE("Options::check_replicas names the rank whose copy of a unit differs, before anything is updated",
          "[engine][errors][replicas]") {
  // Stage 3: rank 1's second gather (unit 'a' in step 1's backward order b, a) is corrupted.
  for (const auto& m : train_with_a_flipped_bit<3>(true)) {
    CHECK_THAT(m, Catch::Contains("step 1: Options::check_replicas: the gathered copy (acquire_unit) of unit 'a' on "
                                  "rank(s) 1 differs from the bytes the other 2 ranks hold"));
    CHECK_THAT(m, Catch::Contains("silent data corruption). Nothing was updated"));
  }
  // Stage 1: the second gather is step 1's publication of unit 'b': found at step 2.
  for (const auto& m : train_with_a_flipped_bit<1>(true))
    CHECK_THAT(m, Catch::Contains("step 2: Options::check_replicas: the parameters after the last update of unit 'b' "
                                  "on rank(s) 1 differs from the bytes the other 2 ranks hold"));
  // Without the option the same runs end without a word.
  for (const auto& m : train_with_a_flipped_bit<3>(false)) CHECK(m == "");
  for (const auto& m : train_with_a_flipped_bit<1>(false)) CHECK(m == "");
}

TEST_CASE("Ranks may differ in the 8-bit states' settings only where the states are not 8-bit", "[engine][errors]") {
  for (const auto states : {zero::StateFormat::fp32, zero::StateFormat::blockwise8}) {
    std::vector<std::string> messages(2);
    zero::comm::LocalGroup group(2);
    group.run([&](zero::comm::Local& c) {
      zero::Options o;
      o.states = states;
      o.state_block = c.rank() == 0 ? 256 : 2048;
      o.state_fp32_below = c.rank() == 0 ? 100 : 4096;
      Opt3 opt(c, {}, o);
      opt.add_param(opt.add_unit("layer"), "layer.w", 100);
      try {
        opt.finalize();
      } catch (const zero::CommError& e) {
        messages[static_cast<std::size_t>(c.rank())] = e.what();
      }
    });
    for (const auto& m : messages) {
      if (states == zero::StateFormat::fp32) {
        CHECK(m == "");  // nothing reads them
      } else {
        CHECK_THAT(m, Catch::Contains("Options::state_block"));
        CHECK_THAT(m, Catch::Contains("Options::state_fp32_below"));
      }
    }
  }
}
