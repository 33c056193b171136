// ZeRO++ on the engine (issue 22). hpZ (Options::hpz): a stage-3 run with the
// secondary copy gives the parameters and master weights of the same run
// without it bit for bit, for every precision, node shape (ranks per node
// 1, 2, 4 of 2, 4 and 8 ranks), accumulation, prefetch and both ways of
// writing gradients; every acquire_unit hands out exactly the gathered
// parameters; what crosses nodes falls as the schedule says; the copy costs
// the parameters / ranks_per_node; a stage other than 3 is refused with the
// setting's name.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "engine_harness.hpp"
#include "zero/zero.hpp"

namespace {

using zero::bf16;
using zero::fp16;
using namespace zero::precision;
using zero::optim::AdamW;

template <class P>
using Stage3 = zero::ZeroOptimizer<P, AdamW, zero::stage<3>, zero::offload::None, zero::backend::Host>;

// Every rank's result of `ranks` in-process ranks, `per_node` to a node.
template <class Opt>
std::vector<zero::test::RunResult> train_on_nodes(int ranks, int per_node, const zero::Options& options,
                                                  const zero::test::TrainSpec& spec) {
  std::vector<zero::test::RunResult> results(static_cast<std::size_t>(ranks));
  zero::comm::LocalGroup::Options group_options;
  group_options.ranks_per_node = per_node;
  zero::comm::LocalGroup group(ranks, group_options);
  typename Opt::Hyper hyper;
  hyper.lr = 0.01;
  group.run([&](zero::comm::Local& c) {
    results[static_cast<std::size_t>(c.rank())] = zero::test::train<Opt>(c, hyper, options, spec);
  });
  return results;
}

void require_same_bits(const zero::test::RunResult& a, const zero::test::RunResult& b) {
  REQUIRE(a.masters.size() == b.masters.size());
  REQUIRE(std::memcmp(a.masters.data(), b.masters.data(), a.masters.size() * sizeof(float)) == 0);
  REQUIRE(a.params.size() == b.params.size());
  REQUIRE(std::memcmp(a.params.data(), b.params.data(), a.params.size() * sizeof(float)) == 0);
  REQUIRE(a.steps.size() == b.steps.size());
  for (std::size_t i = 0; i < a.steps.size(); ++i) {
    REQUIRE(a.steps[i].stepped == b.steps[i].stepped);
    REQUIRE(a.steps[i].grad_norm == b.steps[i].grad_norm);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("hpZ: stage 3 with the secondary copy is stage 3 without it, bit for bit", "[engine][zeropp][hpz]",
                   Full<float>, Mixed<bf16>, Mixed<fp16>) {
  using Opt = Stage3<TestType>;
  struct Shape {
    int ranks, per_node;
  };
  struct Variant {
    const char* name;
    int accumulation, prefetch;
    bool adds;  // GradWrites::accumulate
  };
  const Shape shapes[] = {{2, 1}, {4, 2}, {8, 2}, {8, 4}};
  const Variant variants[] = {{"defaults", 1, 1, false},
                              {"accumulate 3, no prefetch", 3, 0, false},
                              {"accumulate 2, prefetch 2, gradients added", 2, 2, true}};
  for (const auto& shape : shapes)
    for (const auto& v : variants) {
      INFO(shape.ranks << " ranks, " << shape.per_node << " per node, " << v.name);
      zero::Options options;
      options.grad_accumulation_steps = v.accumulation;
      options.prefetch_units = v.prefetch;
      options.loss_scale.initial_scale = 256;
      if (v.adds) options.grad_writes = zero::GradWrites::accumulate;
      zero::test::TrainSpec spec;
      spec.steps = 3;
      spec.parts = shape.ranks;
      spec.check_acquired = true;  // every acquire_unit returns exactly gather_params()' values
      spec.adds_into_gradients = v.adds;
      const auto plain = train_on_nodes<Opt>(shape.ranks, shape.per_node, options, spec);
      options.hpz = true;
      const auto hpz = train_on_nodes<Opt>(shape.ranks, shape.per_node, options, spec);
      std::uint64_t plain_across = 0, hpz_across = 0;
      for (int r = 0; r < shape.ranks; ++r) {
        INFO("rank " << r);
        const auto& a = plain[static_cast<std::size_t>(r)];
        const auto& b = hpz[static_cast<std::size_t>(r)];
        require_same_bits(a, b);
        // The copy: 1/per_node of the padded parameters.
        const std::uint64_t copy =
            b.memory.padded_elements / static_cast<std::uint64_t>(shape.per_node) * sizeof(typename Opt::param_type);
        CHECK(b.memory.placed.params.host == a.memory.placed.params.host + copy);
        CHECK(b.comm.ranks_per_node == shape.per_node);
        plain_across += a.comm.counters.total_across();
        hpz_across += b.comm.counters.total_across();
        // The same bytes leave each rank for the reduce-scatters; the gathers
        // after the first of each step stay in the node (the loop acquires
        // every unit twice a micro-batch; the one that adds into its
        // gradients acquires the tied unit 0 once more).
        using zero::comm::Collective;
        const auto gathers = static_cast<std::size_t>(Collective::all_gather);
        CHECK(b.comm.counters.across[static_cast<std::size_t>(Collective::reduce_scatter)] ==
              a.comm.counters.across[static_cast<std::size_t>(Collective::reduce_scatter)]);
        if (!v.adds)
          CHECK(b.comm.counters.across[gathers] * 2 * static_cast<std::uint64_t>(v.accumulation) ==
                a.comm.counters.across[gathers]);
        CHECK(b.comm.counters.across[gathers] * 2 * static_cast<std::uint64_t>(v.accumulation) <=
              a.comm.counters.across[gathers]);
      }
      CHECK(hpz_across < plain_across);
    }
}

TEST_CASE("hpZ is a stage-3 option: other stages refuse it by name", "[engine][zeropp][hpz]") {
  zero::Options options;
  options.hpz = true;
  zero::comm::LocalGroup(2).run([&](zero::comm::Local& c) {
    using Opt = zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<2>, zero::offload::None, zero::backend::Host>;
    Opt opt(c, AdamW::Hyper{}, options);
    opt.add_param(opt.add_unit("u"), "w", 64);
    CHECK_THROWS_WITH(opt.finalize(), Catch::Contains("Options::hpz keeps a secondary copy of stage 3's gathered "
                                                      "parameters inside each node; at stage 2 the parameters are "
                                                      "whole on every rank: use stage 3, or turn hpz off"));
  });
  zero::Config config;
  config.stage = 1;
  config.options.hpz = true;
  CHECK_THROWS_WITH(config.validate(false), Catch::Contains("zero::Config: hpz keeps a secondary copy"));
}
