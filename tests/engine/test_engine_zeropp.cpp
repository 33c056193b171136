// ZeRO++ on the engine (issue 22). hpZ (Options::hpz): a stage-3 run with the
// secondary copy gives the parameters and master weights of the same run
// without it bit for bit, for every precision, node shape (ranks per node
// 1, 2, 4 of 2, 4 and 8 ranks), accumulation, prefetch and both ways of
// writing gradients; every acquire_unit hands out exactly the gathered
// parameters; what crosses nodes falls as the schedule says; the copy costs
// the parameters / ranks_per_node; a stage other than 3 is refused with the
// setting's name. qwZ (Options::qwz): every gathered unit is the shards
// through int8 blocks, the same on every rank, within half a step of each
// block's scale, for every precision and unit size; the bytes sent are the
// payloads'.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine_harness.hpp"
#include "zero/quant/symmetric.hpp"
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

namespace {

// Stage 3 with qwZ on 4 ranks (2 nodes of 2), with or without hpZ: every
// acquired unit is each rank's shard through the int8 blocks (within half
// a step of its block's scale, and the same on every rank), and each gather
// over every rank sends (N-1) payloads of a shard.
template <class P>
void check_qwz_gathers(bool hpz) {
  using Opt = Stage3<P>;
  using T = typename Opt::param_type;
  constexpr int ranks = 4;
  const std::vector<std::size_t> sizes = {1, 7, 37, 4099, 10007};  // one element, primes, shards across blocks
  constexpr std::size_t block = 64;
  std::vector<std::vector<std::vector<float>>> acquired(ranks);  // per rank, unit
  std::vector<std::vector<T>> exact(ranks);
  std::vector<zero::CommReport> reports(ranks);
  std::vector<std::size_t> shards(sizes.size());
  zero::comm::LocalGroup::Options group_options;
  group_options.ranks_per_node = 2;
  zero::comm::LocalGroup group(ranks, group_options);
  group.run([&](zero::comm::Local& c) {
    zero::Options options;
    options.qwz = true;
    options.qwz_block = block;
    options.hpz = hpz;
    Opt opt(c, AdamW::Hyper{}, options);
    std::vector<zero::UnitId> units;
    std::vector<zero::ParamId> params;
    for (std::size_t u = 0; u < sizes.size(); ++u) {
      units.push_back(opt.add_unit("u" + std::to_string(u)));
      params.push_back(opt.add_param(units.back(), "w" + std::to_string(u), sizes[u]));
    }
    opt.finalize();
    std::mt19937 rng(7);
    std::normal_distribution<float> dist(0.0f, 0.05f);
    for (std::size_t u = 0; u < sizes.size(); ++u) {
      std::vector<float> v(sizes[u]);
      for (auto& x : v) x = dist(rng);
      v[0] = u % 2 == 0 ? 0.3f : -0.3f;  // (the same on every rank: one seed)
      opt.set_param(params[u], v.data());
    }
    const auto r = static_cast<std::size_t>(c.rank());
    exact[r].resize(opt.layout().padded_total());
    opt.gather_params(exact[r].data());
    opt.reset_comm_counters();
    acquired[r].resize(sizes.size());
    for (int pass = 0; pass < 2; ++pass)  // forward, then backward (from hpZ's copy with hpz)
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        const std::size_t u = pass == 0 ? k : sizes.size() - 1 - k;
        const T* unit = opt.acquire_unit(units[u]);
        const auto& info = opt.layout().unit(units[u]);
        std::vector<float> values(info.padded);
        for (std::size_t i = 0; i < info.padded; ++i) values[i] = zero::to_float(unit[i]);
        if (pass == 1) REQUIRE(values == acquired[r][u]);  // backward sees what forward saw
        acquired[r][u] = values;
        if (r == 0) shards[u] = info.shard;
        opt.release_unit(units[u]);
      }
    reports[r] = opt.comm_report();
  });
  std::size_t offset = 0;
  for (std::size_t u = 0; u < sizes.size(); ++u) {
    INFO("unit of " << sizes[u] << " elements, " << (hpz ? "with" : "without") << " hpZ");
    const std::size_t shard = shards[u], padded = shard * ranks;
    for (int r = 1; r < ranks; ++r) REQUIRE(acquired[r][u] == acquired[0][u]);  // every rank the same values
    for (std::size_t s = 0; s < ranks; ++s)
      for (std::size_t b = 0; b * block < shard; ++b) {
        const std::size_t begin = s * shard + b * block, end = std::min(s * shard + shard, begin + block);
        double absmax = 0;
        for (std::size_t i = begin; i < end; ++i)
          absmax = std::max(absmax, std::fabs(double(zero::to_float(exact[0][offset + i]))));
        for (std::size_t i = begin; i < end; ++i) {
          const double x = zero::to_float(exact[0][offset + i]), v = acquired[0][u][i];
          const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(v), 1e-30)) -
                                                 (std::is_same_v<T, float> ? 23 : std::is_same_v<T, bf16> ? 7 : 10));
          REQUIRE(std::fabs(v - x) <= absmax / 127.0 / 2 * (1 + 1e-5) + ulp);
        }
      }
    offset += padded;
  }
  // Bytes: each gather over every rank sends (N-1) payloads of the shard.
  std::uint64_t payloads = 0;
  for (const std::size_t shard : shards) payloads += zero::quant::int8_payload_bytes(shard, block);
  const auto sent = reports[0].counters.sent[static_cast<std::size_t>(zero::comm::Collective::all_gather)];
  const std::uint64_t over_all = (ranks - 1) * payloads * (hpz ? 1 : 2);
  if (!hpz) CHECK(sent == over_all);
  // With hpZ backward gathers the node's two halves of each unit (16-bit).
  std::uint64_t inside = 0;
  for (const std::size_t shard : shards) inside += shard * ranks / 2 * sizeof(T);
  if (hpz) CHECK(sent == over_all + inside);
}

}  // namespace

TEMPLATE_TEST_CASE("qwZ: stage 3 gathers int8 blocks; every rank gets the same parameters within half a step",
                   "[engine][zeropp][qwz]", Full<float>, Mixed<bf16>, Mixed<fp16>) {
  check_qwz_gathers<TestType>(false);
  check_qwz_gathers<TestType>(true);
}
