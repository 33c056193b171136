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
// payloads'. qgZ (Options::qgz): at stages 1-3, int4 and int8, every node
// shape (one node, one rank per node, 2 and 4 per node) and unit size, each
// reduced gradient is the exact sum within the bound of its two
// quantizations (computed here in double from the inputs), and not exactly
// it; with error feedback the sum over steps of what was applied stays
// within one step's error of the true sum, where without it the errors add
// up; the stage refusal names the option.
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

// One unit of one parameter per size, finalized, with values drawn from
// normal(0, 0.05) by `seed` (the same on every rank); `marked`: each unit's
// first value +-0.3, so that blocks differ in scale.
template <class Opt>
std::vector<zero::UnitId> units_with_values(Opt& opt, const std::vector<std::size_t>& sizes, unsigned seed,
                                            bool marked) {
  std::vector<zero::UnitId> units;
  std::vector<zero::ParamId> params;
  for (std::size_t u = 0; u < sizes.size(); ++u) {
    units.push_back(opt.add_unit("u" + std::to_string(u)));
    params.push_back(opt.add_param(units.back(), "w" + std::to_string(u), sizes[u]));
  }
  opt.finalize();
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  for (std::size_t u = 0; u < sizes.size(); ++u) {
    std::vector<float> v(sizes[u]);
    for (auto& x : v) x = dist(rng);
    if (marked) v[0] = u % 2 == 0 ? 0.3f : -0.3f;
    opt.set_param(params[u], v.data());
  }
  return units;
}

// `pieces` runs of `piece` elements of exact[] came back as got(i) through
// int8 blocks of `block` counted from each run's start: each value within
// half a step of its block (absmax / 127 / 2) and T's rounding. Returns how
// many moved.
template <class T, class Got>
std::size_t require_within_half_step(const T* exact, Got got, std::size_t pieces, std::size_t piece,
                                     std::size_t block) {
  std::size_t moved = 0;
  for (std::size_t p = 0; p < pieces; ++p)
    for (std::size_t b = 0; b * block < piece; ++b) {
      const std::size_t begin = p * piece + b * block, end = std::min(p * piece + piece, begin + block);
      double absmax = 0;
      for (std::size_t i = begin; i < end; ++i) absmax = std::max(absmax, std::fabs(double(zero::to_float(exact[i]))));
      for (std::size_t i = begin; i < end; ++i) {
        const double x = zero::to_float(exact[i]), v = got(i);
        const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(v), 1e-30)) -
                                               (std::is_same_v<T, float> ? 23 : std::is_same_v<T, bf16> ? 7 : 10));
        REQUIRE(std::fabs(v - x) <= absmax / 127.0 / 2 * (1 + 1e-5) + ulp);
        moved += v != x;
      }
    }
  return moved;
}

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
    const std::vector<zero::UnitId> units = units_with_values(opt, sizes, 7, true);
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
    const std::vector<float>& got = acquired[0][u];
    require_within_half_step(exact[0].data() + offset, [&](std::size_t i) { return double(got[i]); }, ranks, shard,
                             block);
    offset += padded;
  }
  // Bytes: each gather over every rank sends (N-1) payloads of the shard.
  std::uint64_t payloads = 0;
  for (const std::size_t shard : shards) payloads += zero::quant::Format{8, block}.payload_bytes(shard);
  const auto sent = reports[0].counters.sent[static_cast<std::size_t>(zero::comm::Collective::all_gather)];
  const std::uint64_t over_all = (ranks - 1) * payloads * (hpz ? 1 : 2);
  if (!hpz) CHECK(sent == over_all);
  // With hpZ backward gathers the node's two halves of each unit (16-bit).
  std::uint64_t inside = 0;
  for (const std::size_t shard : shards) inside += shard * ranks / 2 * sizeof(T);
  if (hpz) CHECK(sent == over_all + inside);
}

// hpZ with the secondary copy as int8 blocks (Options::hpz_int8), 4 ranks
// as 2 nodes of 2. Without qwZ: forward's gathers (over every rank, 16-bit)
// are the parameters bit for bit; backward's (inside the node, from the int8
// copy) are within half a step of each block of the node's parts, the same
// on the node's ranks; the node's gathers send (2-1) payloads of a part.
// With qwZ: the copy is forward's payloads of the part's shards, so
// backward gets forward's values bit for bit.
template <class P>
void check_hpz_int8(bool qwz) {
  using Opt = Stage3<P>;
  using T = typename Opt::param_type;
  constexpr int ranks = 4, per_node = 2;
  const std::vector<std::size_t> sizes = {1, 7, 37, 4099, 10007};
  constexpr std::size_t block = 64;
  std::vector<std::vector<std::vector<T>>> forward(ranks), backward(ranks);  // per rank, unit
  std::vector<std::vector<T>> exact(ranks);
  std::vector<zero::CommReport> reports(ranks);
  std::vector<std::size_t> padded(sizes.size()), offsets(sizes.size());
  zero::comm::LocalGroup::Options group_options;
  group_options.ranks_per_node = per_node;
  zero::comm::LocalGroup group(ranks, group_options);
  group.run([&](zero::comm::Local& c) {
    zero::Options options;
    options.hpz = options.hpz_int8 = true;
    options.qwz = qwz;
    options.qwz_block = block;
    Opt opt(c, AdamW::Hyper{}, options);
    const std::vector<zero::UnitId> units = units_with_values(opt, sizes, 11, false);
    const auto r = static_cast<std::size_t>(c.rank());
    exact[r].resize(opt.layout().padded_total());
    opt.gather_params(exact[r].data());
    opt.reset_comm_counters();
    forward[r].resize(sizes.size());
    backward[r].resize(sizes.size());
    for (int pass = 0; pass < 2; ++pass)
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        const std::size_t u = pass == 0 ? k : sizes.size() - 1 - k;
        const T* unit = opt.acquire_unit(units[u]);
        const auto& info = opt.layout().unit(units[u]);
        (pass == 0 ? forward : backward)[r][u].assign(unit, unit + info.padded);
        if (r == 0) {
          padded[u] = info.padded;
          offsets[u] = info.full_offset;
        }
        opt.release_unit(units[u]);
      }
    reports[r] = opt.comm_report();
  });
  std::uint64_t inside = 0, over_all = 0;
  const zero::quant::Format format{8, block};
  for (std::size_t u = 0; u < sizes.size(); ++u) {
    INFO("unit of " << sizes[u] << " elements, " << (qwz ? "with" : "without") << " qwZ");
    const std::size_t part = padded[u] / per_node, shard = padded[u] / ranks;
    inside += qwz ? part / shard * format.payload_bytes(shard) : format.payload_bytes(part);
    over_all += qwz ? (ranks - 1) * format.payload_bytes(shard) : shard * (ranks - 1) * sizeof(T);
    if (qwz) {
      // Backward dequantizes forward's own payloads (forward's bounds: the qwZ test above).
      for (int r = 0; r < ranks; ++r) REQUIRE(backward[r][u] == forward[r][u]);
      continue;
    }
    for (int r = 0; r < ranks; ++r) {
      REQUIRE(std::memcmp(forward[r][u].data(), exact[0].data() + offsets[u], padded[u] * sizeof(T)) == 0);
      // The node's ranks dequantize the same payloads.
      REQUIRE(std::memcmp(backward[r][u].data(), backward[r - r % per_node][u].data(), padded[u] * sizeof(T)) == 0);
    }
    const std::vector<T>& got = backward[0][u];
    const std::size_t moved = require_within_half_step(
        exact[0].data() + offsets[u], [&](std::size_t i) { return double(zero::to_float(got[i])); }, per_node, part,
        block);
    if (sizes[u] > 100) CHECK(moved > 0);  // quantized, not copied
  }
  // Bytes: forward over every rank (16-bit, or qwZ's payloads), backward
  // inside the node as payloads of the parts.
  const auto sent = reports[0].counters.sent[static_cast<std::size_t>(zero::comm::Collective::all_gather)];
  CHECK(sent == over_all + (per_node - 1) * inside);
}

}  // namespace

TEMPLATE_TEST_CASE("hpZ int8: the secondary copy as int8 blocks; forward exact, backward within half a step",
                   "[engine][zeropp][hpz]", Full<float>, Mixed<bf16>, Mixed<fp16>) {
  check_hpz_int8<TestType>(false);
  check_hpz_int8<TestType>(true);
}

TEMPLATE_TEST_CASE("qwZ: stage 3 gathers int8 blocks; every rank gets the same parameters within half a step",
                   "[engine][zeropp][qwz]", Full<float>, Mixed<bf16>, Mixed<fp16>) {
  check_qwz_gathers<TestType>(false);
  check_qwz_gathers<TestType>(true);
}

namespace {

// qgZ's reduction through the engine: plain SGD with lr 1 and a divisor of
// 1 leaves each parameter at minus the sum of every rank's gradients, so the
// parameters after `steps` steps from zero are the applied sums. Each rank's
// gradient of element i of unit u at step t is a fixed function of (rank,
// unit, i, t), so the exact sum is computed here in double.
double qgz_gradient(int rank, std::size_t unit, std::size_t i, int step) {
  const auto h = static_cast<double>((static_cast<std::size_t>(rank + 1) * 7919 + unit * 104729 + i * 2654435761u +
                                      static_cast<std::size_t>(step) * 40503) % 1000003);
  return (h / 1000003.0 - 0.5) * (1.0 + 0.25 * rank) * 0.01;
}

struct QgzRun {
  std::vector<std::vector<float>> params;  // per unit, its elements after the steps
  std::vector<std::size_t> shards;         // per unit, the layout's shard
};

template <int Stage>
QgzRun run_qgz(int ranks, int per_node, const std::vector<std::size_t>& sizes, const zero::Options& options,
               int steps) {
  using Opt = zero::ZeroOptimizer<Full<float>, zero::optim::Sgd, zero::stage<Stage>, zero::offload::None,
                                  zero::backend::Host>;
  QgzRun run;
  run.params.resize(sizes.size());
  zero::comm::LocalGroup::Options group_options;
  group_options.ranks_per_node = per_node;
  zero::comm::LocalGroup group(ranks, group_options);
  zero::optim::Sgd::Hyper hyper;
  hyper.lr = 1.0;
  group.run([&](zero::comm::Local& c) {
    Opt opt(c, hyper, options);
    std::vector<zero::UnitId> units;
    for (std::size_t u = 0; u < sizes.size(); ++u) {
      units.push_back(opt.add_unit("u" + std::to_string(u)));
      opt.add_param(units.back(), "w" + std::to_string(u), sizes[u]);
    }
    opt.finalize();
    for (int t = 0; t < steps; ++t) {
      for (std::size_t k = units.size(); k-- > 0;) {
        opt.acquire_unit(units[k]);
        float* g = opt.grad_buffer(units[k]);
        for (std::size_t i = 0; i < sizes[k]; ++i) g[i] = static_cast<float>(qgz_gradient(c.rank(), k, i, t));
        opt.grad_ready(units[k]);
        opt.release_unit(units[k]);
      }
      opt.step();
    }
    std::vector<float> all(opt.layout().padded_total());
    opt.gather_params(all.data());
    if (c.rank() == 0)
      for (std::size_t u = 0; u < sizes.size(); ++u) {
        const auto& info = opt.layout().units()[u];
        run.shards.push_back(info.shard);
        run.params[u].assign(all.begin() + static_cast<std::ptrdiff_t>(info.full_offset),
                             all.begin() + static_cast<std::ptrdiff_t>(info.full_offset + sizes[u]));
      }
  });
  return run;
}

// One step: every element within the two quantizations' bound of the exact
// sum, and (int4 and several ranks) not all of them exact.
template <int Stage>
void check_qgz_step(int ranks, int per_node, int bits) {
  const std::vector<std::size_t> sizes = {1, 7, 37, 4099, 10007};  // one element, primes, shards across blocks
  zero::Options options;
  options.qgz = true;
  options.qgz_bits = bits;
  options.qgz_block = 64;
  options.gradient_divisor = 1.0;
  INFO("stage " << Stage << ", " << ranks << " ranks, " << per_node << " per node, int" << bits);
  const QgzRun run = run_qgz<Stage>(ranks, per_node, sizes, options, 1);
  const int nodes = ranks / per_node;
  const double levels = bits == 4 ? 7.0 : 127.0;
  const auto block = options.qgz_block;
  std::size_t inexact = 0;
  for (std::size_t u = 0; u < sizes.size(); ++u) {
    const std::size_t shard = run.shards[u];
    auto g = [&](int r, std::size_t i) { return i < sizes[u] ? qgz_gradient(r, u, i, 0) : 0.0; };
    for (std::size_t i = 0; i < sizes[u]; ++i) {
      // The quantization block of element i inside its shard.
      const std::size_t first = i / shard * shard + (i % shard) / block * block;
      const std::size_t last = std::min(first + block, i / shard * shard + shard);
      double step1 = 0, node_max = 0, exact = 0;
      for (int m = 0; m < nodes; ++m) {
        double node_absmax = 0;
        for (std::size_t j = first; j < last; ++j) {
          double node_sum = 0;
          for (int l = 0; l < per_node; ++l) node_sum += g(m * per_node + l, j);
          node_absmax = std::max(node_absmax, std::fabs(node_sum));
        }
        node_max = std::max(node_max, node_absmax);
      }
      if (per_node > 1)
        for (int r = 0; r < ranks; ++r) {
          double absmax = 0;
          for (std::size_t j = first; j < last; ++j) absmax = std::max(absmax, std::fabs(g(r, j)));
          step1 += 0.5 * absmax / levels;
        }
      for (int r = 0; r < ranks; ++r) exact += g(r, i);
      // Step 2 quantizes partial sums that step 1 moved by up to its bound.
      const double step2 = nodes > 1 ? nodes * 0.5 * (node_max + step1) / levels : 0.0;
      const double bound = (step1 + step2) * (1 + 1e-4) + 1e-6 * (1 + std::fabs(exact));
      const double applied = -double(run.params[u][i]);
      INFO("unit " << u << " (" << sizes[u] << " elements), element " << i);
      REQUIRE(std::fabs(applied - exact) <= bound);
      inexact += std::fabs(applied - exact) > 1e-6 * (1 + std::fabs(exact));
    }
  }
  if (bits == 4 && ranks > 1) CHECK(inexact > 0);
}

}  // namespace

TEST_CASE("qgZ: every reduced gradient is the sum within its quantizations' bound, for every node shape and unit "
          "size", "[engine][zeropp][qgz]") {
  struct Shape {
    int ranks, per_node;
  };
  // One node; one rank per node (no step 1); 2 and 4 to a node.
  for (const Shape shape : {Shape{2, 2}, Shape{4, 1}, Shape{2, 1}, Shape{4, 2}, Shape{8, 2}, Shape{8, 4}})
    for (const int bits : {4, 8}) {
      check_qgz_step<3>(shape.ranks, shape.per_node, bits);
      check_qgz_step<2>(shape.ranks, shape.per_node, bits);
    }
  check_qgz_step<1>(4, 2, 4);
  check_qgz_step<1>(8, 4, 8);
}

TEST_CASE("qgZ error feedback: the applied sum over steps stays within one step's error of the true sum",
          "[engine][zeropp][qgz]") {
  const std::vector<std::size_t> sizes = {37, 4099};
  constexpr int steps = 24;
  for (const int per_node : {1, 2}) {
    INFO(per_node << " per node");
    zero::Options options;
    options.qgz = true;
    options.qgz_bits = 4;
    options.qgz_block = 64;
    options.gradient_divisor = 1.0;
    const QgzRun plain = run_qgz<3>(4, per_node, sizes, options, steps);
    options.qgz_error_feedback = true;
    const QgzRun fed = run_qgz<3>(4, per_node, sizes, options, steps);
    double worst_plain = 0, worst_fed = 0, largest = 0;
    for (std::size_t u = 0; u < sizes.size(); ++u)
      for (std::size_t i = 0; i < sizes[u]; ++i) {
        double exact = 0;
        for (int t = 0; t < steps; ++t)
          for (int r = 0; r < 4; ++r) exact += qgz_gradient(r, u, i, t);
        worst_plain = std::max(worst_plain, std::fabs(-double(plain.params[u][i]) - exact));
        worst_fed = std::max(worst_fed, std::fabs(-double(fed.params[u][i]) - exact));
        for (int t = 0; t < steps; ++t)
          for (int r = 0; r < 4; ++r) largest = std::max(largest, std::fabs(qgz_gradient(r, u, i, t)));
      }
    INFO("worst error over " << steps << " steps: " << worst_plain << " without feedback, " << worst_fed << " with");
    // What is still owed is the last residuals: half a step (int4: 1/14 of
    // a block's largest value, a residual included) of each of the 4 ranks'
    // gradients and of each node's partial sum (at most 4 gradients).
    CHECK(worst_fed <= 8 * 1.25 * largest / 14.0);
    CHECK(worst_fed * 2 < worst_plain);
  }
}

TEST_CASE("qgZ is a stage 1-3 option: stage 0 refuses it by name", "[engine][zeropp][qgz]") {
  zero::Options options;
  options.qgz = true;
  zero::comm::LocalGroup(2).run([&](zero::comm::Local& c) {
    using Opt = zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<0>, zero::offload::None, zero::backend::Host>;
    Opt opt(c, AdamW::Hyper{}, options);
    opt.add_param(opt.add_unit("u"), "w", 64);
    CHECK_THROWS_WITH(opt.finalize(), Catch::Contains("Options::qgz quantizes the gradient reduce-scatter of stages "
                                                      "1-3; stage 0 all-reduces whole gradients"));
  });
  options.qgz_bits = 5;
  CHECK_THROWS_WITH(options.validate(), Catch::Contains("Options::qgz_bits is 5; qgZ's gradient codes are 4 bits"));
  options.qgz_bits = 4;
  options.qgz_block = 33;
  CHECK_THROWS_WITH(options.validate(), Catch::Contains("Options::qgz_block is 33; it must be even"));
  zero::Options int8_alone;
  int8_alone.hpz_int8 = true;
  CHECK_THROWS_WITH(int8_alone.validate(), Catch::Contains("Options::hpz_int8 keeps hpZ's secondary copy as int8 "
                                                           "blocks, but Options::hpz is off"));
}
