// The planner (zero/engine/plan.hpp, which prints the schedule of
// zero/engine/detail/schedule.hpp) against real optimizers: for every stage,
// precision and offload tier (none and nvme on backend::Host; cpu and nvme on
// a device backend that keeps its "device" memory on the host,
// late_copies.hpp), rank count and buffer-sizing option below, a
// ZeroOptimizer on comm::Local trains two steps of the planned model, and its
// memory_report() (measured from its buffers, split by place), comm_report()
// (the communicator's byte and call counters) and the swap files on disk must
// equal the plan to the byte.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "engine_harness.hpp"
#include "late_copies.hpp"
#include "zero/engine/plan.hpp"
#include "zero/zero.hpp"
#if defined(ZERO_TEST_DISK_TIER)
#include "zero/offload/disk_state_store.hpp"
#endif

namespace {

namespace fs = std::filesystem;
using zero::bf16;
using zero::fp16;
using namespace zero::precision;
using zero::optim::AdamW;
using zero::optim::Sgd;
namespace plan = zero::plan;
using zero::backend::Host;
using zero::backend::LateCopies;
using zero::offload::Cpu;
using zero::offload::None;
using zero::offload::Nvme;

template <int S, class P, class O, class F = None, class B = Host>
using Opt = zero::ZeroOptimizer<P, O, zero::stage<S>, F, B>;

// The types of two type lists, one after the other.
template <class A, class B>
struct Concat;
template <class... A, class... B>
struct Concat<std::tuple<A...>, std::tuple<B...>> {
  using type = std::tuple<A..., B...>;
};

// Every stage meets every precision, with AdamW but for SGD (one state slot)
// at stage 2 in bf16; the offload tiers from stage 1.
template <class F, class B>
using OffloadedTypes = std::tuple<Opt<1, Full<float>, AdamW, F, B>, Opt<1, Mixed<bf16>, AdamW, F, B>,
                                  Opt<1, Mixed<fp16>, AdamW, F, B>, Opt<2, Full<float>, AdamW, F, B>,
                                  Opt<2, Mixed<bf16>, Sgd, F, B>, Opt<2, Mixed<fp16>, AdamW, F, B>,
                                  Opt<3, Full<float>, AdamW, F, B>, Opt<3, Mixed<bf16>, AdamW, F, B>,
                                  Opt<3, Mixed<fp16>, AdamW, F, B>>;
using ResidentTypes =
    Concat<std::tuple<Opt<0, Full<float>, AdamW>, Opt<0, Mixed<bf16>, AdamW>, Opt<0, Mixed<fp16>, AdamW>>,
           OffloadedTypes<None, Host>>::type;
using CpuTypes = OffloadedTypes<Cpu, LateCopies>;
// Master and state in device memory (8-bit states: the code tables too).
using DeviceResidentTypes =
    std::tuple<Opt<1, Mixed<bf16>, AdamW, None, LateCopies>, Opt<3, Mixed<fp16>, Sgd, None, LateCopies>>;
#if defined(ZERO_TEST_DISK_TIER)
// On the host backend the update reads and writes the backend's own buffers;
// from a device, the gradient and parameters are staged in host memory (fp32
// parameters too: the master is in the window only in passing). Three of
// the device's, one per stage and precision.
using NvmeTypes =
    Concat<OffloadedTypes<Nvme, Host>,
           std::tuple<Opt<1, Full<float>, AdamW, Nvme, LateCopies>, Opt<2, Mixed<fp16>, Sgd, Nvme, LateCopies>,
                      Opt<3, Mixed<bf16>, AdamW, Nvme, LateCopies>>>::type;
#endif

// A fresh directory for the swap files, removed after (a real disk: O_DIRECT).
struct TempDir {
  fs::path path;
  TempDir() {
    char name[] = "/tmp/zero-plan-test-XXXXXX";
    REQUIRE(::mkdtemp(name) != nullptr);
    path = name;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

struct Measured {
  zero::MemoryReport memory;
  zero::CommReport comm;
  std::uint64_t swap_file_bytes = 0;  // this rank's swap files, as the filesystem sizes them
};

// Registers `model` and trains `steps` optimizer steps on `ranks` in-process
// ranks with the documented loop (forward: acquire/release every unit;
// backward in reverse: acquire, write the gradient, grad_ready, release),
// then lands a delayed update, so every step's traffic is counted.
// `ranks_per_node`: the ranks' simulated nodes (0: one node).
template <class O>
std::vector<Measured> measure(const plan::Model& model, int ranks, const zero::Options& options, int steps,
                              int ranks_per_node = 0) {
  using Ops = zero::backend::Ops<typename O::backend_policy>;
  std::vector<Measured> out(static_cast<std::size_t>(ranks));
  zero::comm::LocalGroup::Options group_options;
  group_options.ranks_per_node = ranks_per_node;
  zero::comm::LocalGroup group(ranks, group_options);
  group.run([&](zero::comm::Local& comm) {  // (no Catch2 assertions on these threads)
    zero::test::late_copies() = {};
    O opt(comm, typename O::Hyper{}, options);
    std::vector<zero::UnitId> units;
    for (const auto& u : model.units) {
      units.push_back(opt.add_unit(u.name));
      for (std::size_t i = 0; i < u.params.size(); ++i)
        opt.add_param(units.back(), u.name + "." + std::to_string(i), u.params[i]);
    }
    opt.finalize();
    opt.reset_comm_counters();
    using G = typename O::grad_type;
    std::vector<G> grad(opt.layout().max_unit());
    for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = zero::from_float<G>(0.0078125f * static_cast<float>(i % 5));
    for (int step = 0; step < steps; ++step)
      for (int micro = 0; micro < options.grad_accumulation_steps; ++micro) {
        for (const auto u : units) {
          opt.acquire_unit(u);
          opt.release_unit(u);
        }
        for (auto it = units.rbegin(); it != units.rend(); ++it) {
          opt.acquire_unit(*it);
          Ops::upload(opt.grad_buffer(*it), grad.data(), opt.layout().unit(*it).numel);
          opt.grad_ready(*it);
          opt.release_unit(*it);
        }
        opt.step();
      }
    opt.wait_update();
    Measured& m = out[static_cast<std::size_t>(comm.rank())];
    m.memory = opt.memory_report();
    m.comm = opt.comm_report();
    if (!options.nvme.directory.empty()) {
      const std::string mine = "zero-swap-r" + std::to_string(comm.rank()) + "-";
      for (const auto& f : fs::directory_iterator(options.nvme.directory))
        if (f.path().filename().string().starts_with(mine)) m.swap_file_bytes += fs::file_size(f.path());
    }
  });
  return out;
}

// What each rank sent to another node, by kind of collective, and what all
// ranks did together, against the plan (comm/topology.hpp's counting rule).
void check_across_nodes(const plan::Plan& p, const std::vector<Measured>& measured, int steps) {
  using zero::comm::Collective;
  const zero::comm::Topology topology = p.scenario.topology();
  std::uint64_t all_ranks = 0, busiest = 0;
  for (const auto& [m, c, swap_file] : measured) {
    INFO("rank " << c.rank << " of " << topology.ranks << ", " << topology.ranks_per_node << " per node");
    CHECK(c.ranks_per_node == topology.ranks_per_node);
    for (const Collective kind : {Collective::all_reduce, Collective::reduce_scatter, Collective::all_gather,
                                  Collective::all_to_all, Collective::control}) {
      INFO(zero::comm::collective_name(kind));
      CHECK(c.counters.across[static_cast<std::size_t>(kind)] ==
            static_cast<std::uint64_t>(steps) * p.schedule.across(kind, topology, c.rank));
    }
    const auto across = static_cast<std::uint64_t>(c.across_per_step());
    CHECK(c.across_per_step() == static_cast<double>(across));
    all_ranks += across;
    busiest = std::max(busiest, across);
  }
  CHECK(all_ranks == p.comm.across_all_ranks);
  CHECK(busiest == p.comm.across_busiest_rank);
  CHECK((topology.nodes() > 1 && p.comm.bytes_sent > 0) == (all_ranks > 0));
}

struct Variant {
  const char* name;
  int accumulation;
  std::size_t bucket_bytes;
  int prefetch;
  zero::ReduceDType reduce;
  bool delayed_update;    // where the optimizer can (offload from a device), from the first step
  std::size_t windows;    // offload::Nvme's window in least windows (0: the 64 MiB default)
  zero::GradWrites writes = zero::GradWrites::overwrite;
  int live_buckets = 2;
  // bf16 parameters: the master as the parameters plus a remainder
  // (MasterWeights::remainder; the other precisions keep an fp32 master).
  bool remainder = false;
  bool hpz = false;  // stage 3 only (Options::hpz): the secondary copy and the gathers inside the node
  std::size_t qwz_block = 0;  // stage 3 only: Options::qwz with blocks of this many elements (0: off)
  int qgz_bits = 0;           // stages 1-3: Options::qgz with codes of this many bits (0: off)
  bool qgz_feedback = false;  // Options::qgz_error_feedback
  bool hpz_int8 = false;      // Options::hpz_int8
  // Options::states blockwise8 with blocks of this many elements, every
  // parameter of 4 or more elements 8-bit (0: fp32 states). Ranks' blocks
  // differ where their shard boundaries cut them: each rank against the
  // plan of its own buffers.
  std::size_t state_block = 0;
};

// Units of unequal sizes, parameters that leave alignment gaps, a unit of one
// element: padding everywhere.
plan::Model odd_model() {
  plan::Model m;
  m.units = {{"embed", {37, 1}}, {"mlp", {129, 6}}, {"head", {5, 3}}, {"tiny", {1}}};
  return m;
}

zero::PlacedBytes placed(const plan::Line& l) { return {l.device, l.host, l.disk}; }

// Every stage's buffers, traffic and calls of optimizer type O, planned and
// measured, for each model, rank count and variant.
template <class O>
void check_plan_against_optimizers() {
  constexpr bool device_offload = O::offload_policy::to_host && O::backend_policy::device;
  constexpr bool nvme = std::is_same_v<typename O::offload_policy, Nvme>;
  using zero::ReduceDType;
  const Variant variants[] = {
      {"defaults", 1, std::size_t{32} << 20, 1, ReduceDType::same_as_grad, false, 0},
      {"one unit per bucket, accumulate 2, no prefetch, delayed update, the least window", 2, 1, 0,
       ReduceDType::same_as_grad, true, 1},
      {"3 KiB buckets, accumulate 3, prefetch 2, reduce in fp32, 3 least windows, remainder master (bf16)", 3,
       3072, 2, ReduceDType::fp32, false, 3, zero::GradWrites::overwrite, 2, true},
      {"one unit per bucket, prefetch 2, reduce in fp32, delayed update", 1, 1, 2, ReduceDType::fp32, true, 0},
      {"gradients added: one unit per bucket, accumulate 2, 3 live buckets, reduce in fp32", 2, 1, 1,
       ReduceDType::fp32, false, 0, zero::GradWrites::accumulate, 3},
      {"gradients added: whole-model bucket, accumulate 3", 3, std::size_t{32} << 20, 1, ReduceDType::same_as_grad,
       true, 0, zero::GradWrites::accumulate},
      // (Not with the delayed update: the step after the first keeps the
      // parameters the first step's micro-batches gathered, so its gathers
      // all stay inside the node, and two steps average below the plan's
      // steady state of one gather over every rank per unit and step.)
      {"hpZ: one unit per bucket, accumulate 2, prefetch 2", 2, 1, 2, ReduceDType::same_as_grad, false, 0,
       zero::GradWrites::overwrite, 2, false, true},
      {"qwZ, blocks of 32: defaults", 1, std::size_t{32} << 20, 1, ReduceDType::same_as_grad, false, 0,
       zero::GradWrites::overwrite, 2, false, false, 32},
      {"hpZ and qwZ, blocks of 2048: accumulate 2, prefetch 0", 2, std::size_t{32} << 20, 0, ReduceDType::same_as_grad,
       false, 0, zero::GradWrites::overwrite, 2, false, true, 2048},
      {"qgZ int4 with error feedback: one unit per bucket, accumulate 2, reduce in fp32", 2, 1, 1, ReduceDType::fp32,
       false, 0, zero::GradWrites::overwrite, 2, false, false, 0, 4, true},
      {"hpZ, qwZ and qgZ int8, gradients added: accumulate 2", 2, std::size_t{32} << 20, 1, ReduceDType::same_as_grad,
       false, 0, zero::GradWrites::accumulate, 2, false, true, 256, 8},
      {"hpZ as int8 blocks of 64: accumulate 3, prefetch 2", 3, std::size_t{32} << 20, 2, ReduceDType::same_as_grad,
       false, 0, zero::GradWrites::overwrite, 2, false, true, 0, 0, false, true},
      {"8-bit states in blocks of 64: defaults", 1, std::size_t{32} << 20, 1, ReduceDType::same_as_grad, false, 0,
       zero::GradWrites::overwrite, 2, false, false, 0, 0, false, false, 64},
      {"8-bit states in blocks of 192, remainder master (bf16): one unit per bucket, the least window", 1, 1, 1,
       ReduceDType::same_as_grad, false, 1, zero::GradWrites::overwrite, 2, true, false, 0, 0, false, false, 192},
  };
  const plan::Model models[] = {odd_model(), plan::gpt_model(2, 24, 11, 5)};
  constexpr int steps = 2;
  // Ranks whose plan's total differed from rank 0's (8-bit states,
  // stages 1-3: the test must see some).
  int ranks_differed = 0;
  for (const auto& model : models)
    for (const int ranks : {1, 2, 3, 4, 7})
      for (const auto& v : variants) {
        if ((v.hpz || v.qwz_block != 0) && O::stage != 3) continue;
        if (v.qgz_bits != 0 && O::stage == 0) continue;
        INFO("stage " << O::stage << ", " << plan::name(plan::precision_of<typename O::precision_policy>()) << ", "
                      << O::optimizer_policy::name << ", offload " << O::offload_policy::name << ", backend "
                      << O::backend_policy::name << ", " << ranks << " rank(s), " << v.name << ", model "
                      << model.units.size() << " units");
        zero::Options options;
        options.grad_accumulation_steps = v.accumulation;
        options.bucket_bytes = v.bucket_bytes;
        options.prefetch_units = v.prefetch;
        options.reduce_dtype = v.reduce;
        options.grad_writes = v.writes;
        options.live_buckets = v.live_buckets;
        options.delayed_update = device_offload && v.delayed_update;
        options.delayed_update_warmup = 0;
        constexpr bool bf16_params = std::is_same_v<typename O::param_type, zero::bf16>;
        if (bf16_params && v.remainder) options.master = zero::MasterWeights::remainder;
        options.hpz = v.hpz;
        options.hpz_int8 = v.hpz_int8;
        if (v.hpz_int8) options.qwz_block = 64;
        options.qwz = v.qwz_block != 0;
        if (options.qwz) options.qwz_block = v.qwz_block;
        options.qgz = v.qgz_bits != 0;
        if (options.qgz) options.qgz_bits = v.qgz_bits;
        options.qgz_error_feedback = v.qgz_feedback;
        if (v.state_block != 0) {
          if (O::state_slots == 0) continue;
          options.states = zero::StateFormat::blockwise8;
          options.state_block = v.state_block;
          options.state_fp32_below = 4;
        }
        std::optional<TempDir> dir;
        if constexpr (nvme) {
          dir.emplace();
          options.nvme.directory = dir->path.string();
          if (v.windows != 0)
            options.nvme.window_bytes =
                v.windows * zero::offload::disk_least_window_bytes(
                                O::state_slots, zero::master_element_bytes(options.master),
                                zero::state_element_bytes(options.states));
        }
        // Host communicators do not overlap: one staging set. Two and four
        // ranks as two nodes.
        plan::Scenario config = plan::scenario_for<O>(model, ranks, options, false);
        config.ranks_per_node = ranks == 2 ? 1 : ranks == 4 ? 2 : ranks;
        config.nodes = ranks / config.ranks_per_node;
        const plan::Plan p = plan::make_plan(config);
        const auto measured = measure<O>(model, ranks, config.options, steps, config.ranks_per_node);
        check_across_nodes(p, measured, steps);
        const std::uint64_t control_bytes = (1 + static_cast<std::uint64_t>(ranks)) * sizeof(double);
        // The plan of each rank's buffers, and the default's: each line and
        // place the largest of any rank's.
        std::vector<plan::Plan> of_rank;
        for (int r = 0; r < ranks; ++r) {
          plan::Scenario rank_config = config;
          rank_config.rank = r;
          of_rank.push_back(config.ranks_differ() ? plan::make_plan(rank_config) : p);
          ranks_differed += of_rank.back().total.total() != of_rank.front().total.total();
        }
        CHECK(p.rank == (config.ranks_differ() ? -1 : 0));
        for (const plan::Line& l : p.lines) {
          INFO("line " << l.name);
          plan::Line largest{l.name};
          for (const plan::Plan& r : of_rank) largest = zero::plan::detail::largest(largest, r.line(l.name));
          CHECK(placed(l) == placed(largest));
        }
        for (const auto& [m, c, swap_file] : measured) {
          INFO("rank " << m.rank);
          const plan::Plan& mine = of_rank[static_cast<std::size_t>(m.rank)];
          CHECK(mine.param_elements == m.param_elements);
          CHECK(mine.padded_elements == m.padded_elements);
          // Every line of memory_report(), by place.
          CHECK(mine.placed.params == m.placed.params);
          CHECK(mine.placed.grads == m.placed.grads);
          CHECK(mine.placed.master == m.placed.master);
          CHECK(mine.placed.optimizer_states == m.placed.optimizer_states);
          CHECK(mine.placed.communication_buffers == m.placed.communication_buffers);
          CHECK(placed(mine.line("params")) == m.placed.params);
          CHECK(placed(mine.line("grads")) == m.placed.grads);
          CHECK(placed(mine.line("master")) == m.placed.master);
          CHECK(placed(mine.line("optimizer_states")) == m.placed.optimizer_states);
          CHECK(mine.line("padding").total() == m.padding);
          CHECK(mine.model_states() == m.model_states());
          CHECK(mine.communication_buffers() == m.communication_buffers);
          // The backend keeps everything but the disk tier's in host memory,
          // or holds the parameters on the device.
          CHECK((O::backend_policy::device ? m.placed.params.device : m.placed.params.host) > 0);
          // What memory_report() leaves out: the step's control values (on
          // the backend and their host copy), and the swap files' rounding
          // to whole records, which the files on disk show.
          CHECK(mine.line("control").total() == 2 * control_bytes);
          CHECK(mine.line("control").host >= control_bytes);
          CHECK(swap_file == m.placed.master.disk + m.placed.optimizer_states.disk + mine.line("swap_padding").disk);
          CHECK(nvme == (swap_file > 0));
          zero::PlacedBytes planned_total{mine.total.device, mine.total.host, mine.total.disk};
          zero::PlacedBytes reported_total = m.placed.total();
          reported_total += placed(mine.line("control"));
          reported_total += placed(mine.line("swap_padding"));
          CHECK(planned_total == reported_total);

          REQUIRE(c.steps == steps);
          CHECK(c.sent_per_step() == static_cast<double>(p.comm.bytes_sent));
          CHECK(c.received_per_step() == static_cast<double>(p.comm.bytes_received));
          // Named capture: Clang 14 cannot capture a structured binding.
          auto per_step = [&counters = c.counters, steps](const auto& field, zero::comm::Collective k) {
            return field(counters)[static_cast<std::size_t>(k)] / static_cast<std::uint64_t>(steps);
          };
          auto sent = [](const zero::comm::ByteCounters& b) { return b.sent; };
          auto calls = [](const zero::comm::ByteCounters& b) { return b.calls; };
          using zero::comm::Collective;
          CHECK(per_step(sent, Collective::all_reduce) == p.comm.all_reduce_bytes);
          CHECK(per_step(sent, Collective::reduce_scatter) == p.comm.reduce_scatter_bytes);
          CHECK(per_step(sent, Collective::all_gather) == p.comm.all_gather_bytes);
          CHECK(per_step(sent, Collective::all_to_all) == p.comm.all_to_all_bytes);
          CHECK(per_step(sent, Collective::control) == p.comm.control_bytes);
          CHECK(per_step(calls, Collective::all_reduce) == p.comm.all_reduce_calls);
          CHECK(per_step(calls, Collective::reduce_scatter) == p.comm.reduce_scatter_calls);
          CHECK(per_step(calls, Collective::all_gather) == p.comm.all_gather_calls);
          CHECK(per_step(calls, Collective::all_to_all) == p.comm.all_to_all_calls);
          CHECK(per_step(calls, Collective::control) == p.comm.control_calls);
          CHECK((p.comm.all_to_all_calls > 0) == (options.qgz && ranks > 1));
          if (options.qgz) CHECK(p.comm.reduce_scatter_calls == 0);
          CHECK(c.counters.calls[static_cast<std::size_t>(Collective::broadcast)] == 0);
        }
      }
  CHECK((ranks_differed > 0) == (O::stage >= 1 && O::state_slots > 0));
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("the planner's bytes and traffic equal what real optimizers allocate and send",
                        "[engine][plan]", ResidentTypes) {
  check_plan_against_optimizers<TestType>();
}

TEMPLATE_LIST_TEST_CASE("In device memory: the planner's bytes by place and traffic equal the optimizer's",
                        "[engine][plan]", DeviceResidentTypes) {
  check_plan_against_optimizers<TestType>();
}

TEMPLATE_LIST_TEST_CASE("offload::Cpu: the planner's bytes by place and traffic equal the optimizer's",
                        "[engine][plan][offload]", CpuTypes) {
  check_plan_against_optimizers<TestType>();
}

#if defined(ZERO_TEST_DISK_TIER)
TEMPLATE_LIST_TEST_CASE("offload::Nvme: the planner's bytes by place, swap files and traffic equal the optimizer's",
                        "[engine][plan][offload][nvme]", NvmeTypes) {
  check_plan_against_optimizers<TestType>();
}
#endif

#if defined(ZERO_TEST_DISK_TIER)
TEST_CASE("8-bit states on disk: each rank's swap file as the plan of its rank says, the default plan the largest",
          "[engine][plan][offload][nvme][states]") {
  using O = Opt<3, Mixed<bf16>, AdamW, Nvme, Host>;
  // Chunks of 4096 elements that end before a block of 192 they would cut:
  // rank 0's 8064 owned elements are two records, rank 1's three (its
  // shard boundaries cut the blocks elsewhere).
  plan::Model model;
  model.units = {{"a", {5911, 4079}}, {"b", {6007}}};
  zero::Options options;
  options.master = zero::MasterWeights::remainder;
  options.states = zero::StateFormat::blockwise8;
  options.state_block = 192;
  options.state_fp32_below = 4;
  TempDir dir;
  options.nvme.directory = dir.path.string();
  options.nvme.window_bytes = zero::offload::disk_least_window_bytes(2, 2, 1);
  const plan::Scenario config = plan::scenario_for<O>(model, 2, options, false);
  const auto measured = measure<O>(model, 2, options, 2, 2);
  std::vector<plan::Plan> of_rank;
  for (int r = 0; r < 2; ++r) {
    plan::Scenario mine = config;
    mine.rank = r;
    of_rank.push_back(plan::make_plan(mine));
    INFO("rank " << r);
    REQUIRE(of_rank[static_cast<std::size_t>(r)].sizes.disk_chunk == 4096);
    CHECK(of_rank[static_cast<std::size_t>(r)].total.disk == measured[static_cast<std::size_t>(r)].swap_file_bytes);
  }
  const std::uint64_t record = 4096 * 4;  // remainder 2, codes 1 + 1
  CHECK(measured[0].swap_file_bytes == 2 * record);
  CHECK(measured[1].swap_file_bytes == 3 * record);
  const plan::Plan largest = plan::make_plan(config);
  CHECK(largest.rank == -1);
  CHECK(largest.total.disk == 3 * record);
  CHECK(largest.sizes.swap_file_bytes == 3 * record);
}
#endif

using StageTypes = std::tuple<Opt<0, Mixed<bf16>, AdamW>, Opt<1, Mixed<bf16>, AdamW>, Opt<2, Mixed<fp16>, AdamW>,
                              Opt<3, Mixed<bf16>, AdamW>>;

TEMPLATE_LIST_TEST_CASE("bytes across nodes: the planner's equal each rank's comm_report() for 2, 4 and 8 ranks on "
                        "nodes of 1, 2 and 4", "[engine][plan][topology]", StageTypes) {
  using O = TestType;
  for (const int ranks : {2, 4, 8})
    for (const int per_node : {1, 2, 4}) {
      if (per_node >= ranks) continue;
      INFO("stage " << O::stage << ", " << ranks << " ranks, " << per_node << " per node");
      plan::Scenario config = plan::scenario_for<O>(odd_model(), ranks, zero::Options{}, false);
      config.ranks_per_node = per_node;
      config.nodes = ranks / per_node;
      const plan::Plan p = plan::make_plan(config);
      check_across_nodes(p, measure<O>(config.model, ranks, config.options, 2, per_node), 2);
      // A ring over every rank crosses once per node: each node's last rank
      // sends all it sends across.
      CHECK(p.comm.across_busiest_rank == p.comm.bytes_sent);
      CHECK(p.comm.across_all_ranks == static_cast<std::uint64_t>(config.nodes) * p.comm.bytes_sent);
      if constexpr (O::stage == 3) {
        // hpZ: backward's gathers stay in the node; each rank sends as much.
        config.options.hpz = true;
        const plan::Plan h = plan::make_plan(config);
        check_across_nodes(h, measure<O>(config.model, ranks, config.options, 2, per_node), 2);
        CHECK(h.comm.bytes_sent < p.comm.bytes_sent);
        CHECK(h.comm.across_all_ranks * 3 == p.comm.across_all_ranks * 2);  // 3 ring passes of which 1 stays inside
      }
      if constexpr (O::stage >= 1) {
        // qgZ, alone and (stage 3) with every combination of hpZ and qwZ, int4 and int8.
        // (hpZ's copy in 16 bits with int4 codes, as int8 blocks with int8 codes.)
        for (int combination = 0; combination < (O::stage == 3 ? 8 : 2); ++combination) {
          config.options.qgz = true;
          config.options.qgz_bits = combination % 2 == 0 ? 4 : 8;
          config.options.hpz = (combination & 2) != 0;
          config.options.hpz_int8 = config.options.hpz && config.options.qgz_bits == 8;
          config.options.qwz = (combination & 4) != 0;
          INFO("qgZ int" << config.options.qgz_bits << (config.options.hpz ? ", hpZ" : "")
                         << (config.options.hpz_int8 ? " int8" : "") << (config.options.qwz ? ", qwZ" : ""));
          const plan::Plan q = plan::make_plan(config);
          check_across_nodes(q, measure<O>(config.model, ranks, config.options, 2, per_node), 2);
          CHECK(q.comm.across_all_ranks < p.comm.across_all_ranks);
        }
        config.options = zero::Options{};
      }
    }
}

TEST_CASE("ZeRO++: with hpZ, qwZ and qgZ, stage 3 sends at most a quarter of its bytes across nodes",
          "[engine][plan][topology][zeropp]") {
  using O = Opt<3, Mixed<bf16>, AdamW>;
  {
    // Units of whole blocks (a unit of a handful of elements would send a
    // scale per few codes: the formula's overheads, not its shares).
    plan::Model model;
    model.units = {{"a", {8192}}, {"b", {4096, 4096}}, {"c", {16384}}};
    for (const int ranks : {4, 8})
      for (const int per_node : {2, 4}) {
        if (per_node >= ranks) continue;
        INFO(ranks << " ranks, " << per_node << " per node");
        plan::Scenario config = plan::scenario_for<O>(model, ranks, zero::Options{}, false);
        config.ranks_per_node = per_node;
        config.nodes = ranks / per_node;
        const plan::Plan plain = plan::make_plan(config);
        config.options.hpz = config.options.qwz = config.options.qgz = true;
        const plan::Plan all = plan::make_plan(config);
        check_across_nodes(all, measure<O>(model, ranks, config.options, 2, per_node), 2);
        INFO("across nodes per step, all ranks: " << all.comm.across_all_ranks << " of " << plain.comm.across_all_ranks);
        CHECK(all.comm.across_all_ranks * 4 <= plain.comm.across_all_ranks);
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
      plan::Scenario c;
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

TEST_CASE("offload moves master and states off the device: the figures by hand", "[engine][plan][offload]") {
  // Four units of 65536 elements on 4 ranks: no padding, 65536 owned elements.
  plan::Scenario c;
  c.model = plan::uniform_model(4 * 1024 * 64, 4);
  c.ranks_per_node = 4;
  c.stage = 2;
  const std::uint64_t shard = 1024 * 64;
  const plan::Plan none = plan::make_plan(c);
  c.offload = plan::Offload::cpu;
  const plan::Plan cpu = plan::make_plan(c);
  // The device keeps its bf16 parameters and accumulates the bf16 gradient
  // shard; the host holds fp32 master, m and v, the shard's copy the CPU
  // update reads and the bf16 parameters it writes (ZeRO-Offload).
  CHECK(cpu.line("params").device == none.line("params").device);
  CHECK(placed(cpu.line("grads")) == zero::PlacedBytes{2 * shard, 2 * shard, 0});
  CHECK(placed(cpu.line("master")) == zero::PlacedBytes{0, 4 * shard, 0});
  CHECK(placed(cpu.line("optimizer_states")) == zero::PlacedBytes{0, 8 * shard, 0});
  CHECK(placed(cpu.line("param_staging")) == zero::PlacedBytes{0, 2 * shard, 0});
  CHECK(cpu.total.device == none.total.device - 12 * shard);
  c.options.delayed_update = true;  // a second host gradient set
  CHECK(plan::make_plan(c).line("grads").host == 4 * shard);
  c.options.delayed_update = false;

  // The disk tier (ZeRO-Infinity): master and states on disk, streamed
  // through the window of Options::nvme.window_bytes. At the 64 MiB default
  // a chunk would be 1820 x 1024 elements, more than the 65536 owned: one
  // chunk of 65536, the window three records of 3 arrays of it, and a swap
  // file of exactly the owned state.
  c.offload = plan::Offload::nvme;
  const plan::Plan nvme = plan::make_plan(c);
  CHECK(placed(nvme.line("master")) == zero::PlacedBytes{0, 0, 4 * shard});
  CHECK(placed(nvme.line("optimizer_states")) == zero::PlacedBytes{0, 0, 8 * shard});
  CHECK(placed(nvme.line("grads")) == zero::PlacedBytes{2 * shard, 2 * shard, 0});
  CHECK(nvme.line("param_staging").host == 2 * shard);
  CHECK(nvme.line("nvme_window").host == 3 * 3 * 65536 * 4);
  CHECK(nvme.line("swap_padding").disk == 0);
  CHECK(nvme.total.disk == 12 * shard);
  // A 1 MiB window: chunks of 28 x 1024 elements (1 MiB / 36 bytes, in
  // whole 4 KiB blocks), three of them for 65536 elements, so the swap file
  // is 3 x 28672 x 12 bytes.
  c.options.nvme.window_bytes = std::size_t{1} << 20;
  const plan::Plan small = plan::make_plan(c);
  CHECK(small.line("nvme_window").host == 3 * 3 * 28672 * 4);
  CHECK(small.line("swap_padding").disk == 3 * 28672 * 12 - 12 * shard);
  CHECK(small.sizes.disk_chunk == 28672);
  // On backend::Host nothing is staged: the update reads and writes the
  // backend's own buffers, all in host memory.
  c.device_backend = false;
  const plan::Plan host = plan::make_plan(c);
  CHECK(placed(host.line("params")) == zero::PlacedBytes{0, none.line("params").device, 0});
  CHECK(placed(host.line("grads")) == zero::PlacedBytes{0, 2 * shard, 0});
  CHECK(host.line("param_staging").total() == 0);
  CHECK(host.total.device == 0);
  // The wire does not change.
  CHECK(cpu.comm.bytes_sent == none.comm.bytes_sent);
  CHECK(nvme.comm.bytes_sent == none.comm.bytes_sent);

  // What the engine refuses, the planner refuses.
  c.offload = plan::Offload::cpu;
  CHECK_THROWS_WITH(plan::make_plan(c), Catch::Contains("backend::Host"));
  c.offload = plan::Offload::nvme;
  c.options.delayed_update = true;
  CHECK_THROWS_WITH(plan::make_plan(c), Catch::Contains("delayed_update"));
  c.options.delayed_update = false;
  c.options.nvme.window_bytes = 3 * 4096 * 3 - 1;
  CHECK_THROWS_WITH(plan::make_plan(c), Catch::Contains("window_bytes") && Catch::Contains("36864"));
  c.options.nvme.window_bytes = 3 * 4096 * 3;
  CHECK_NOTHROW(plan::make_plan(c));
  c.stage = 0;
  CHECK_THROWS_WITH(plan::make_plan(c), Catch::Contains("stage >= 1"));
}

TEST_CASE("the disk window and the swap file, by hand", "[engine][plan][offload]") {
  using zero::offload::disk_chunk_elements;
  using zero::offload::disk_swap_file_bytes;
  using zero::offload::disk_window_elements;
  const std::size_t window = std::size_t{64} << 20;
  // Adam (2 slots): 3 chunks x 3 arrays x 4 bytes = 36 bytes per chunk
  // element; 64 MiB / 36 = 1864135, in whole blocks of 1024: 1820 blocks.
  CHECK(disk_chunk_elements(window, 2, 10'000'000) == 1820 * 1024);
  CHECK(disk_window_elements(window, 2, 10'000'000) == 9 * 1820 * 1024);
  // 10^7 elements in chunks of 1863680: 6 records of 3 arrays.
  CHECK(disk_swap_file_bytes(window, 2, 10'000'000) == 6u * 1863680 * 12);
  // SGD (1 slot): 24 bytes per chunk element, 2730 blocks.
  CHECK(disk_chunk_elements(window, 1, 10'000'000) == 2730 * 1024);
  // Few owned elements: one block of 1024, not the window's worth.
  CHECK(disk_window_elements(window, 2, 1000) == 9 * 1024);
  CHECK(disk_swap_file_bytes(window, 2, 1000) == 1024 * 12);
  CHECK(disk_swap_file_bytes(window, 2, 0) == 1024 * 12);  // one record at least
  CHECK(zero::offload::disk_least_window_bytes(2) == 36864);
  CHECK(zero::offload::disk_least_window_bytes(1) == 24576);
  // A remainder master (2 bytes) beside Adam's two states: 10 bytes per
  // element, 30 per chunk element; 64 MiB / 30 = 2236962, in whole blocks
  // of 2048 (the remainders' 4 KiB): 1092 blocks.
  CHECK(disk_chunk_elements(window, 2, 10'000'000, 2) == 1092 * 2048);
  CHECK(disk_window_elements(window, 2, 10'000'000, 2) == 3 * 1092 * 2048 * 10 / 4);
  CHECK(disk_swap_file_bytes(window, 2, 10'000'000, 2) == 5u * 1092 * 2048 * 10);  // 5 records of 2236416
  CHECK(disk_swap_file_bytes(window, 2, 1000, 2) == 2048 * 10);
  CHECK(zero::offload::disk_least_window_bytes(2, 2) == 3 * 2048 * 10);
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

TEST_CASE("stages 2-3 say when their buckets defeat the gradient's sharding, and the planner says it too",
          "[engine][plan]") {
  using Opt = zero::ZeroOptimizer<Full<float>, AdamW, zero::stage<2>, zero::offload::None, zero::backend::Host>;
  zero::Options options;
  options.bucket_bytes = std::size_t{32} << 20;
  // 4 units of 1 Mi elements, 16 MiB of fp32 gradient: one 32 MiB bucket holds all of it, so the 1/2
  // shard plus the staging (the bucket and its reduce-scatter result) is twice stage 0's gradient.
  const plan::Model model = plan::uniform_model(std::uint64_t{4} << 20, 4);
  const std::string note = plan::make_plan(plan::scenario_for<Opt>(model, 2, options, false)).schedule.gradient_note;
  CHECK(note == "zero: stage 2 holds 32.00 MiB of gradients per rank (a 1/2 shard, 8.00 MiB, and staging for 1 "
                "bucket(s) of up to 4 unit(s), 24.00 MiB), no less than stage 0's whole gradient (16.00 MiB): lower "
                "Options::bucket_bytes (now 33554432) below the gradient's size, or register smaller units (a bucket "
                "holds at least one)");
  // A bucket per unit saves: 8 + 4 + 2 MiB against 16.
  options.bucket_bytes = std::size_t{4} << 20;
  CHECK(plan::make_plan(plan::scenario_for<Opt>(model, 2, options, false)).schedule.gradient_note.empty());
  // The automatic bucket (the default) saves by itself: a quarter of the gradient per staging set, with
  // overlap too (two sets). Eight units of 2 MiB: 4 MiB buckets of two units, or 2 MiB ones of one.
  const plan::Model eight = plan::uniform_model(std::uint64_t{4} << 20, 8);
  for (const bool overlap : {false, true}) {
    const plan::Plan automatic = plan::make_plan(plan::scenario_for<Opt>(eight, 2, zero::Options{}, overlap));
    CHECK(automatic.schedule.gradient_note.empty());
    CHECK(automatic.sizes.bucket_bytes == (std::size_t{4} << 20) / (overlap ? 2 : 1));
    CHECK(automatic.sizes.buckets.max_units == (overlap ? 1u : 2u));
  }
  // One unit for the whole model cannot save, whatever the bucket; one rank has nothing to save.
  const std::string whole = plan::make_plan(plan::scenario_for<Opt>(plan::uniform_model(std::uint64_t{4} << 20, 1), 2,
                                                                   zero::Options{}, false))
                              .schedule.gradient_note;
  CHECK_THAT(whole, Catch::Contains("register smaller units (a bucket holds at least one; Options::bucket_bytes is "
                                    "automatic)"));
  CHECK(plan::make_plan(plan::scenario_for<Opt>(model, 1, zero::Options{}, false)).schedule.gradient_note.empty());
}
