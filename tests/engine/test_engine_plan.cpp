// The planner (zero/engine/plan.hpp) against real optimizers: for every
// stage, precision, optimizer, rank count and buffer-sizing option below, a
// ZeroOptimizer on comm::Local trains two steps of the planned model, and its
// memory_report() (measured from its buffers) and comm_report() (the
// communicator's byte counters) must equal the plan to the byte.
#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "engine_harness.hpp"
#include "zero/engine/plan.hpp"
#include "zero/zero.hpp"

namespace {

using zero::bf16;
using zero::fp16;
using namespace zero::precision;
using zero::optim::AdamW;
using zero::optim::Sgd;
namespace plan = zero::plan;

template <int S, class P, class O>
struct Config {
  static constexpr int stage = S;
  using Precision = P;
  using Optimizer = O;
};
using Configs = std::tuple<Config<0, Full<float>, Sgd>, Config<0, Mixed<bf16>, AdamW>, Config<1, Mixed<fp16>, AdamW>,
                           Config<1, Full<float>, Sgd>, Config<2, Mixed<bf16>, Sgd>, Config<2, Full<float>, AdamW>,
                           Config<3, Mixed<bf16>, AdamW>, Config<3, Mixed<fp16>, Sgd>>;

struct Measured {
  zero::MemoryReport memory;
  zero::CommReport comm;
};

// Registers `model` and trains `steps` optimizer steps on `ranks` in-process
// ranks with the documented loop (forward: acquire/release every unit;
// backward in reverse: acquire, write the gradient, grad_ready, release).
template <class Opt>
std::vector<Measured> measure(const plan::Model& model, int ranks, const zero::Options& options, int steps) {
  std::vector<Measured> out(static_cast<std::size_t>(ranks));
  zero::comm::LocalGroup group(ranks);
  group.run([&](zero::comm::Local& comm) {  // (no Catch2 assertions on these threads)
    Opt opt(comm, typename Opt::Hyper{}, options);
    std::vector<zero::UnitId> units;
    for (const auto& u : model.units) {
      units.push_back(opt.add_unit(u.name));
      for (std::size_t i = 0; i < u.params.size(); ++i)
        opt.add_param(units.back(), u.name + "." + std::to_string(i), u.params[i]);
    }
    opt.finalize();
    opt.reset_comm_counters();
    using G = typename Opt::grad_type;
    for (int step = 0; step < steps; ++step)
      for (int micro = 0; micro < options.grad_accumulation_steps; ++micro) {
        for (const auto u : units) {
          opt.acquire_unit(u);
          opt.release_unit(u);
        }
        for (auto it = units.rbegin(); it != units.rend(); ++it) {
          opt.acquire_unit(*it);
          G* g = opt.grad_buffer(*it);
          const std::size_t n = opt.layout().unit(*it).numel;
          for (std::size_t i = 0; i < n; ++i) g[i] = zero::from_float<G>(0.0078125f * static_cast<float>(i % 5));
          opt.grad_ready(*it);
          opt.release_unit(*it);
        }
        opt.step();
      }
    out[static_cast<std::size_t>(comm.rank())] = {opt.memory_report(), opt.comm_report()};
  });
  return out;
}

struct Variant {
  const char* name;
  int accumulation;
  std::size_t bucket_bytes;
  int prefetch;
  zero::ReduceDType reduce;
};

// Units of unequal sizes, parameters that leave alignment gaps, a unit of one
// element: padding everywhere.
plan::Model odd_model() {
  plan::Model m;
  m.units = {{"embed", {37, 1}}, {"mlp", {129, 6}}, {"head", {5, 3}}, {"tiny", {1}}};
  return m;
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("the planner's bytes and traffic equal what real optimizers allocate and send",
                        "[engine][plan]", Configs) {
  using Opt = zero::ZeroOptimizer<typename TestType::Precision, typename TestType::Optimizer,
                                  zero::stage<TestType::stage>, zero::offload::None, zero::backend::Host>;
  using zero::ReduceDType;
  const Variant variants[] = {
      {"defaults", 1, std::size_t{32} << 20, 1, ReduceDType::same_as_grad},
      {"one unit per bucket, accumulate 2, no prefetch", 2, 1, 0, ReduceDType::same_as_grad},
      {"3 KiB buckets, accumulate 3, prefetch 2, reduce in fp32", 3, 3072, 2, ReduceDType::fp32},
      {"one unit per bucket, prefetch 2, reduce in fp32", 1, 1, 2, ReduceDType::fp32},
  };
  const plan::Model models[] = {odd_model(), plan::gpt_model(2, 24, 11, 5)};
  constexpr int steps = 2;
  for (const auto& model : models)
    for (const int ranks : {1, 2, 3, 4, 7})
      for (const auto& v : variants) {
        INFO("stage " << TestType::stage << ", " << plan::name(plan::precision_of<typename TestType::Precision>()) << ", " << TestType::Optimizer::name << ", " << ranks << " rank(s), " << v.name
                      << ", model " << model.units.size() << " units");
        zero::Options options;
        options.grad_accumulation_steps = v.accumulation;
        options.bucket_bytes = v.bucket_bytes;
        options.prefetch_units = v.prefetch;
        options.reduce_dtype = v.reduce;
        // Host communicators do not overlap: one staging set.
        const plan::Config config = plan::config_for<Opt>(model, ranks, options, false);
        const plan::Plan p = plan::make_plan(config);
        const auto measured = measure<Opt>(model, ranks, config.options, steps);
        for (const auto& [m, c] : measured) {
          INFO("rank " << m.rank);
          CHECK(p.param_elements == m.param_elements);
          CHECK(p.padded_elements == m.padded_elements);
          CHECK(p.line("params").device == m.params);
          CHECK(p.line("grads").device == m.grads);
          CHECK(p.line("master").device == m.master);
          CHECK(p.line("optimizer_states").device == m.optimizer_states);
          CHECK(p.line("padding").device == m.padding);
          CHECK(p.communication_buffers() == m.communication_buffers);
          // The step's control doubles (1 + N) are the one allocation memory_report() leaves out.
          CHECK(p.line("control").device == (1 + static_cast<std::size_t>(ranks)) * sizeof(double));
          CHECK(p.total.device == m.total() + p.line("control").device);
          CHECK(p.total.host == 0);
          CHECK(p.total.disk == 0);

          REQUIRE(c.steps == steps);
          CHECK(c.sent_per_step() == static_cast<double>(p.comm.bytes_sent));
          CHECK(c.received_per_step() == static_cast<double>(p.comm.bytes_received));
          // Named capture: Clang 14 cannot capture a structured binding.
          auto per_step = [&counters = c.counters, steps](zero::comm::Collective k) {
            return counters.sent[static_cast<std::size_t>(k)] / static_cast<std::uint64_t>(steps);
          };
          CHECK(per_step(zero::comm::Collective::all_reduce) == p.comm.all_reduce_bytes);
          CHECK(per_step(zero::comm::Collective::reduce_scatter) == p.comm.reduce_scatter_bytes);
          CHECK(per_step(zero::comm::Collective::all_gather) == p.comm.all_gather_bytes);
          CHECK(per_step(zero::comm::Collective::control) == p.comm.control_bytes);
        }
      }
}

TEST_CASE("the planner follows the ZeRO paper's formulas where the paper is exact", "[engine][plan]") {
  // GPT-2 small (124M): its published parameter count.
  const plan::Model gpt2 = plan::gpt_model(12, 768, 50257, 1024);
  CHECK(gpt2.param_count() == 124439808u);
  CHECK(gpt2.units.size() == 14u);

  // Units that split evenly into aligned shards: no padding, so the plan's
  // model states are the paper's (2+2+K)Φ, (2+2)Φ+KΦ/N, 2Φ+(2+K)Φ/N, (2+2+K)Φ/N
  // with K = 12 for mixed-precision Adam, and the traffic 2Φ or 3Φ (N-1)/N.
  for (int stage = 0; stage <= 3; ++stage)
    for (const int n : {1, 2, 4, 8}) {
      INFO("stage " << stage << ", N " << n);
      plan::Config c;
      c.model = plan::uniform_model(8 * 1024 * 64, 8);
      c.ranks_per_node = n;
      c.stage = stage;
      const plan::Plan p = plan::make_plan(c);
      const std::uint64_t phi = 8 * 1024 * 64, N = static_cast<std::uint64_t>(n);
      REQUIRE(p.padded_elements == phi);
      const std::uint64_t expected[] = {16 * phi, 4 * phi + 12 * phi / N, 2 * phi + 14 * phi / N, 16 * phi / N};
      CHECK(p.model_states() == expected[stage]);
      CHECK(p.paper_model_state_bytes == expected[stage]);
      CHECK(p.line("padding").device == 0);
      CHECK(p.comm.elements == (stage == 3 ? 3 : 2) * phi * (N - 1) / N);
      CHECK(p.comm.bytes_sent == 2 * p.comm.elements);
    }
}

TEST_CASE("offload moves master, states and the gradient shard off the device", "[engine][plan]") {
  plan::Config c;
  c.model = plan::uniform_model(4 * 1024 * 64, 4);
  c.ranks_per_node = 4;
  c.stage = 2;
  const std::uint64_t shard = 1024 * 64;
  const plan::Plan none = plan::make_plan(c);
  c.offload = plan::Offload::cpu;
  const plan::Plan cpu = plan::make_plan(c);
  c.offload = plan::Offload::nvme;
  const plan::Plan nvme = plan::make_plan(c);
  // The device keeps its 16-bit parameters and accumulates the bf16
  // gradient shard; the host holds fp32 master, m, v, the shard's copy the
  // CPU update reads and the bf16 parameters it writes (ZeRO-Offload), or the
  // disk holds master and states behind a host window of two unit shards
  // (ZeRO-Infinity).
  CHECK(cpu.line("params").device == none.line("params").device);
  CHECK(cpu.line("grads").device == 2 * shard);
  CHECK(cpu.line("grads").host == 2 * shard);
  CHECK(cpu.line("master").host == 4 * shard);
  CHECK(cpu.line("optimizer_states").host == 8 * shard);
  CHECK(cpu.line("param_staging").host == 2 * shard);
  CHECK(cpu.total.device == none.total.device - 12 * shard);
  CHECK(nvme.line("master").disk == 4 * shard);
  CHECK(nvme.line("optimizer_states").disk == 8 * shard);
  CHECK(nvme.line("nvme_window").host == 2 * (shard / 4) * 12);
  CHECK(nvme.total.disk == 12 * shard);
  // The wire does not change.
  CHECK(cpu.comm.bytes_sent == none.comm.bytes_sent);
  c.stage = 0;
  CHECK_THROWS_WITH(plan::make_plan(c), Catch::Contains("stage >= 1"));
}

namespace {

struct UnequalRun {
  zero::MemoryReport memory;
  std::vector<std::vector<std::size_t>> groups;  // of the last step
  std::vector<float> masters;
  bool arena_holds_every_pair = true;
};

// One large embedding, eight blocks, a small final norm, each one parameter
// (2 ranks pad units to 128 elements: 1024, 8 x 384, 128), trained with the
// GPT's hook order: forward 0..9, the tied head acquires the embedding again,
// backward 9..0 (the embedding's gradient without a new acquire).
template <class Opt>
UnequalRun train_unequal(const zero::Options& options) {
  const std::vector<std::size_t> sizes = {1000, 300, 300, 300, 300, 300, 300, 300, 300, 10};
  UnequalRun out;
  zero::comm::LocalGroup group(2);
  group.run([&](zero::comm::Local& local) {
    // How the engine groups its reductions: the shard elements of each
    // reduce-scatter, per group, in launch order.
    std::vector<std::vector<std::size_t>> groups;
    bool in_group = false;
    using Event = zero::test::WatchedLocal::Event;
    zero::test::WatchedLocal comm(local, [&](Event e, std::size_t n, bool) {
      if (e == Event::group_begin) groups.emplace_back();
      if (e == Event::reduce_scatter && in_group) groups.back().push_back(n);
      if (e == Event::group_begin || e == Event::group_end) in_group = e == Event::group_begin;
    });
    Opt opt(comm, typename Opt::Hyper{}, options);
    std::vector<zero::UnitId> units;
    for (std::size_t u = 0; u < sizes.size(); ++u) {
      units.push_back(opt.add_unit("u" + std::to_string(u)));
      opt.add_param(units.back(), "w" + std::to_string(u), sizes[u]);
    }
    opt.finalize();
    auto value = [](std::size_t u, std::size_t i) { return static_cast<float>(u * 1000 + i) * 0.25f; };
    for (std::size_t u = 0; u < sizes.size(); ++u) {
      std::vector<float> v(sizes[u]);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = value(u, i);
      opt.set_param(zero::ParamId{u}, v.data());
    }
    // Any two units held at once, and a third acquired after the first is
    // released, read their own values (the arena holds the two largest units
    // and puts each against an end, so no pair is refused or overlaps).
    auto holds = [&](std::size_t u) {
      const float* p = opt.acquire_unit(units[u]);
      for (std::size_t i = 0; i < sizes[u]; ++i)
        if (p[i] != value(u, i)) return false;
      return true;
    };
    auto still = [&](std::size_t u) {
      const float* p = opt.param_data(zero::ParamId{u});
      for (std::size_t i = 0; i < sizes[u]; ++i)
        if (p[i] != value(u, i)) return false;
      return true;
    };
    const bool pairs = options.prefetch_units >= 1;  // (room for two units)
    for (std::size_t a = 0; a < sizes.size() && pairs; ++a)
      for (std::size_t b = 0; b < sizes.size(); ++b)
        for (std::size_t c = 0; c < sizes.size(); ++c) {
          if (a == b || b == c || a == c) continue;
          bool ok = holds(a) && holds(b) && still(a);
          opt.release_unit(units[a]);
          ok = holds(c) && still(b) && ok;
          opt.release_unit(units[b]);
          opt.release_unit(units[c]);
          if (!ok) out.arena_holds_every_pair = false;
        }
    for (int step = 0; step < 2; ++step) {
      groups.clear();
      for (const auto u : units) {
        opt.acquire_unit(u);
        opt.release_unit(u);
      }
      opt.acquire_unit(units[0]);  // the tied head
      opt.release_unit(units[0]);
      for (std::size_t u = sizes.size(); u-- > 0;) {
        if (u > 0) opt.acquire_unit(units[u]);
        float* g = opt.grad_buffer(units[u]);
        for (std::size_t i = 0; i < sizes[u]; ++i) g[i] = 0.001f * static_cast<float>((i * 7 + u) % 13) - 0.006f;
        opt.grad_ready(units[u]);
        if (u > 0) opt.release_unit(units[u]);
      }
      opt.step();
    }
    std::vector<float> masters(opt.layout().padded_total());
    opt.gather_masters(masters.data());
    if (comm.rank() == 0) out = {opt.memory_report(), groups, masters, out.arena_holds_every_pair};
  });
  return out;
}

}  // namespace

TEST_CASE("units of unequal size: gradient buckets and the gather arena are sized in bytes", "[engine][plan]") {
  using Opt = zero::ZeroOptimizer<Full<float>, AdamW, zero::stage<3>, zero::offload::None, zero::backend::Host>;
  // Padded units (elements): embedding 1024, blocks 8 x 384, norm 128; shards half of that.
  // Buckets of 1536 elements (6 KiB of fp32), filled in backward order:
  //   {norm, b8, b7, b6} 1280, {b5, b4, b3, b2} 1536, {b1, embedding} 1408.
  // Sized by the largest unit (4 KiB), a bucket would hold one unit, and each
  // slot, staging or gather, an embedding.
  zero::Options options;
  options.bucket_bytes = 1536 * 4;
  const UnequalRun run = train_unequal<Opt>(options);
  const std::vector<std::vector<std::size_t>> expected_groups = {
      {64, 192, 192, 192}, {192, 192, 192, 192}, {192, 512}};
  CHECK(run.groups == expected_groups);  // 3 launches for 10 units
  const std::uint64_t staging = 1536 * 4, shard_staging = 768 * 4, arena = (1024 + 384) * 4;
  CHECK(run.memory.communication_buffers == staging + shard_staging + arena);
  CHECK(run.arena_holds_every_pair);

  // The same training with every unit alone in its bucket and nothing
  // prefetched: the grouping changes when reductions launch, not a bit of the result.
  zero::Options alone = options;
  alone.bucket_bytes = 1;
  alone.prefetch_units = 0;
  const UnequalRun single = train_unequal<Opt>(alone);
  CHECK(single.groups.size() == 10);
  CHECK(single.memory.communication_buffers == (1024 + 512 + 1024) * 4);
  CHECK(single.masters == run.masters);
}
