// Why: ZeRO-Offload's pipeline runs on a GPU, which CI lacks: the owned
// gradient shard leaves for the host as its bucket is reduced, the host waits
// once, the CPU updates unit by unit and each unit's parameters go back while
// the next is updated. So this test runs the engine on a backend whose
// asynchronous copies run as late as stream order allows (late_copies.hpp):
// a host read of a download_async destination without the engine's wait
// reads the previous step's gradient, and training departs from the run
// without offload, which it must otherwise match bit for bit (the CPU's
// fused step rounds exactly as the backend's).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine_harness.hpp"
#include "late_copies.hpp"


namespace {

using zero::test::Config;

using zero::bf16;
using zero::fp16;
using namespace zero::precision;
using zero::optim::Adam;
using zero::optim::AdamW;
using zero::optim::Sgd;
// Every stage meets every precision and every optimizer (a Latin square).
using Configs = std::tuple<Config<1, Full<float>, Adam>, Config<1, Mixed<bf16>, AdamW>, Config<1, Mixed<fp16>, Sgd>,
                           Config<2, Full<float>, AdamW>, Config<2, Mixed<bf16>, Sgd>, Config<2, Mixed<fp16>, Adam>,
                           Config<3, Full<float>, Sgd>, Config<3, Mixed<bf16>, Adam>, Config<3, Mixed<fp16>, AdamW>>;

template <class Opt>
zero::test::RunResult train_ranks(int ranks, const typename Opt::Hyper& hyper, const zero::Options& options,
                                  const zero::test::TrainSpec& spec, std::size_t* deferred) {
  std::vector<zero::test::RunResult> results(static_cast<std::size_t>(ranks));
  std::vector<std::size_t> late(results.size()), left(results.size());
  zero::comm::LocalGroup group(ranks);
  group.run([&](zero::comm::Local& c) {  // (no Catch2 assertions on these threads)
    zero::test::late_copies() = {};
    const auto r = static_cast<std::size_t>(c.rank());
    results[r] = zero::test::train<Opt>(c, hyper, options, spec);
    late[r] = zero::test::late_copies().ran_late;
    left[r] = zero::test::late_copies().pending.size();
  });
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r);
    CHECK(left[static_cast<std::size_t>(r)] == 0);  // nothing was left queued
    REQUIRE(results[static_cast<std::size_t>(r)].masters == results[0].masters);
  }
  if (deferred != nullptr) *deferred = late[0];
  return results[0];
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("offload::Cpu trains bit for bit like no offload, through late copies", "[engine][offload]",
                        Configs) {
  using P = typename TestType::Precision;
  using O = typename TestType::Optimizer;
  using Offloaded = zero::ZeroOptimizer<P, O, zero::stage<TestType::stage>, zero::offload::Cpu,
                                        zero::backend::LateCopies>;
  using Resident = zero::ZeroOptimizer<P, O, zero::stage<TestType::stage>, zero::offload::None,
                                       zero::backend::LateCopies>;
  const auto hyper = zero::test::test_hyper<O>();
  using zero::ReduceDType;
  using zero::test::one_unit_bucket;
  using zero::test::whole_model_bucket;
  const zero::test::Variant variants[] = {
      {"one unit per bucket, accumulate 3 + clip", 3, 0.05, ReduceDType::same_as_grad, one_unit_bucket},
      {"whole model per bucket", 1, 0.0, ReduceDType::same_as_grad, whole_model_bucket},
      {"one unit per bucket, reduce in fp32, accumulate 2", 2, 0.0, ReduceDType::fp32, one_unit_bucket}};
  for (const int ranks : {1, 2, 4}) {
    for (const auto& v : variants) {
      INFO("stage " << TestType::stage << ", " << ranks << " rank(s), " << v.name);
      zero::Options options = v.options();
      options.offload_threads = 1 + ranks % 2;  // the host update's thread count is the option's
      zero::test::TrainSpec spec;
      spec.steps = 3;
      spec.parts = ranks;
      spec.check_acquired = true;
      std::size_t late = 0;
      const auto got = train_ranks<Offloaded>(ranks, hyper, options, spec, &late);
      const auto want = train_ranks<Resident>(ranks, hyper, options, spec, nullptr);
      // The copies really were late: queued and run only when forced.
      CHECK(late > 0);
      CHECK(got.masters == want.masters);
      CHECK(got.params == want.params);
      REQUIRE(got.steps.size() == want.steps.size());
      for (std::size_t i = 0; i < got.steps.size(); ++i) {
        CHECK(got.steps[i].stepped == want.steps[i].stepped);
        CHECK(got.steps[i].grad_norm == want.steps[i].grad_norm);
      }
      // And both are the ZeRO semantics of the single-process reference.
      zero::test::require_equivalent<typename Offloaded::param_type>(
          got, zero::test::reference_train<P, O>(ranks, hyper, options, spec.steps));
    }
  }
}

TEST_CASE("offload::Cpu: memory_report() places master and state on the host, as the planner says",
          "[engine][offload][plan]") {
  using Opt = zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<2>, zero::offload::Cpu, zero::backend::LateCopies>;
  const std::size_t ranks = 4, units = 4, unit_elements = 4 * 64 * 16;  // divisible: no padding
  std::vector<zero::MemoryReport> reports(ranks);
  zero::comm::LocalGroup group(static_cast<int>(ranks));
  group.run([&](zero::comm::Local& c) {
    Opt opt(c, zero::test::test_hyper<AdamW>());
    for (std::size_t u = 0; u < units; ++u)
      opt.add_param(opt.add_unit("u" + std::to_string(u)), "w" + std::to_string(u), unit_elements);
    opt.finalize();
    reports[static_cast<std::size_t>(c.rank())] = opt.memory_report();
  });
  const std::uint64_t phi = units * unit_elements, shard = phi / ranks;
  for (const auto& m : reports) {
    INFO("rank " << m.rank);
    // Device model state of stage 2 with offload: the bf16 parameters (2Φ)
    // and the bf16 gradient shard the device accumulates (2Φ/N).
    CHECK(m.placed.model_states().device == 2 * phi + 2 * phi / ranks);
    CHECK(m.placed.params == zero::PlacedBytes{2 * phi, 0, 0});
    CHECK(m.placed.grads == zero::PlacedBytes{2 * shard, 2 * shard, 0});
    CHECK(m.placed.master == zero::PlacedBytes{0, 4 * shard, 0});
    CHECK(m.placed.optimizer_states == zero::PlacedBytes{0, 8 * shard, 0});
    CHECK(m.placed.communication_buffers.host == 2 * shard);  // the bf16 parameters' host staging
    CHECK(m.model_states() == m.placed.model_states().total());
    CHECK(m.total() == m.placed.total().total());
    // The planner predicts every line to the byte.
    zero::plan::Model model;
    for (std::size_t u = 0; u < units; ++u) model.units.push_back({"u" + std::to_string(u), {unit_elements}});
    zero::plan::Scenario config = zero::plan::scenario_for<Opt>(model, static_cast<int>(ranks), {}, false);
    config.offload = zero::plan::Offload::cpu;
    const zero::plan::Plan plan = zero::plan::make_plan(config);
    for (const auto& [line, placed] : {std::pair{"params", m.placed.params}, std::pair{"grads", m.placed.grads},
                                       std::pair{"master", m.placed.master},
                                       std::pair{"optimizer_states", m.placed.optimizer_states}}) {
      INFO(line);
      CHECK(plan.line(line).device == placed.device);
      CHECK(plan.line(line).host == placed.host);
      CHECK(plan.line(line).disk == placed.disk);
    }
    CHECK(plan.communication_buffers() == m.communication_buffers);
  }
}

TEST_CASE("offload::Cpu: ranks that disagree on the offload tier are an error at finalize()", "[engine][offload]") {
  using Offloaded = zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<2>, zero::offload::Cpu,
                                        zero::backend::LateCopies>;
  using Resident = zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<2>, zero::offload::None,
                                       zero::backend::LateCopies>;
  std::vector<std::string> errors(2);
  zero::comm::LocalGroup group(2);
  group.run([&](zero::comm::Local& c) {
    auto build = [&](auto& opt) {
      opt.add_param(opt.add_unit("u"), "w", 1000);
      try {
        opt.finalize();
      } catch (const zero::CommError& e) {
        errors[static_cast<std::size_t>(c.rank())] = e.what();
      }
    };
    if (c.rank() == 0) {
      Offloaded opt(c, zero::test::test_hyper<AdamW>());
      build(opt);
    } else {
      Resident opt(c, zero::test::test_hyper<AdamW>());
      build(opt);
    }
  });
  for (const auto& e : errors) CHECK_THAT(e, Catch::Contains("the offload tier") && Catch::Contains("rank"));
}

// ---- The delayed parameter update ------------------------------------------------------------

namespace {

// What a delayed-update run saw and ended with.
struct SeenRun {
  std::vector<std::vector<float>> seen;  // per step: the parameters its micro-batches computed with (padded, fp32)
  std::vector<float> masters;            // at the end (padded)
};

// Trains `steps` steps in which the gradient depends on the parameters
// (g = w/4 + a rank- and step-dependent part), so which parameters a
// micro-batch sees changes the result. `lagged`: the reference. The optimizer
// updates in place and the test computes each step's gradient from the
// parameters a delayed update would have shown: those after step t-2 once
// step t-1 was past the warm-up, after step t-1 before.
template <class Opt>
SeenRun train_seen(int ranks, const zero::Options& options, bool lagged, int steps) {
  using G = typename Opt::grad_type;
  using PT = typename Opt::param_type;
  using Ops = zero::backend::Ops<typename Opt::backend_policy>;
  std::vector<SeenRun> runs(static_cast<std::size_t>(ranks));
  zero::comm::LocalGroup group(ranks);
  group.run([&](zero::comm::Local& c) {
    SeenRun& run = runs[static_cast<std::size_t>(c.rank())];
    Opt opt(c, zero::test::test_hyper<typename Opt::optimizer_policy>(), options);
    const std::size_t sizes[] = {300, 517};
    std::vector<zero::UnitId> units;
    std::vector<zero::ParamId> params;
    for (std::size_t u = 0; u < 2; ++u) {
      units.push_back(opt.add_unit("unit" + std::to_string(u)));
      params.push_back(opt.add_param(units.back(), "w" + std::to_string(u), sizes[u]));
    }
    opt.finalize();
    for (std::size_t p = 0; p < 2; ++p) {
      std::vector<float> v(sizes[p]);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = zero::test::init_value(p, i);
      opt.set_param(params[p], v.data());
    }
    const zero::Layout& layout = opt.layout();
    auto gathered = [&] {
      std::vector<PT> low(layout.padded_total());
      opt.gather_params(low.data());
      std::vector<float> all(low.size());
      for (std::size_t i = 0; i < low.size(); ++i) all[i] = zero::to_float(low[i]);
      return all;
    };
    std::vector<std::vector<float>> history;  // reference: the parameters after each step
    if (lagged) history.push_back(gathered());
    std::vector<float> current(layout.padded_total());
    std::vector<PT> unit_params(layout.max_unit());
    std::vector<G> grad(layout.max_unit());
    for (int t = 1; t <= steps; ++t) {
      for (int m = 0; m < options.grad_accumulation_steps; ++m) {
        for (const zero::UnitId u : units) {  // forward: what the device holds now
          const zero::UnitInfo& info = layout.unit(u);
          Ops::download(unit_params.data(), opt.acquire_unit(u), info.padded);
          for (std::size_t i = 0; i < info.padded; ++i) current[info.full_offset + i] = zero::to_float(unit_params[i]);
          opt.release_unit(u);
        }
        const bool delayed = t - 1 > options.delayed_update_warmup;
        const std::vector<float>& basis =
            !lagged ? current : history[static_cast<std::size_t>(delayed ? t - 2 : t - 1)];
        if (m == 0) run.seen.push_back(basis);
        for (auto it = units.rbegin(); it != units.rend(); ++it) {  // backward
          const zero::UnitInfo& info = layout.unit(*it);
          opt.acquire_unit(*it);
          G* g = opt.grad_buffer(*it);
          for (std::size_t i = 0; i < info.padded; ++i)
            grad[i] = zero::from_float<G>(0.25f * basis[info.full_offset + i] +
                                          zero::test::grad_part(c.rank(), it->index, i, t, m));
          Ops::upload(g, grad.data(), info.padded);
          opt.grad_ready(*it);
          opt.release_unit(*it);
        }
        opt.step();
      }
      if (lagged) history.push_back(gathered());
    }
    opt.wait_update();
    run.masters.resize(layout.padded_total());
    opt.gather_masters(run.masters.data());
  });
  for (int r = 1; r < ranks; ++r) REQUIRE(runs[static_cast<std::size_t>(r)].masters == runs[0].masters);
  return runs[0];
}

using DelayConfigs = std::tuple<Config<1, Mixed<bf16>, AdamW>, Config<2, Full<float>, Adam>,
                                Config<3, Mixed<bf16>, Sgd>>;

}  // namespace

TEMPLATE_LIST_TEST_CASE("the delayed update equals an update applied one step late, bit for bit",
                        "[engine][offload][delayed]", DelayConfigs) {
  using Opt = zero::ZeroOptimizer<typename TestType::Precision, typename TestType::Optimizer,
                                  zero::stage<TestType::stage>, zero::offload::Cpu, zero::backend::LateCopies>;
  for (const int ranks : {1, 2}) {
    for (const int accumulation : {1, 2}) {
      INFO("stage " << TestType::stage << ", " << ranks << " rank(s), accumulation " << accumulation);
      zero::Options options;
      options.grad_accumulation_steps = accumulation;
      options.bucket_bytes = 1;  // one unit per bucket: shards leave for the host during backward
      options.delayed_update = true;
      options.delayed_update_warmup = 2;
      const int steps = 7;
      const SeenRun delayed = train_seen<Opt>(ranks, options, false, steps);
      zero::Options in_place = options;
      in_place.delayed_update = false;
      const SeenRun reference = train_seen<Opt>(ranks, in_place, true, steps);
      REQUIRE(delayed.seen.size() == reference.seen.size());
      for (std::size_t t = 0; t < delayed.seen.size(); ++t) {
        INFO("step " << t + 1);
        CHECK(delayed.seen[t] == reference.seen[t]);
      }
      CHECK(delayed.masters == reference.masters);
      // The delay is real: from step warm-up + 2 on, the parameters seen lag
      // those an in-place run would have used.
      const SeenRun plain = train_seen<Opt>(ranks, in_place, false, steps);
      CHECK(plain.seen[3] != delayed.seen[3]);
      CHECK(plain.masters != delayed.masters);
    }
  }
}

TEST_CASE("the delayed update needs offload", "[engine][offload][delayed][errors]") {
  using Opt = zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<2>, zero::offload::None, zero::backend::LateCopies>;
  std::string error;
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& c) {
    zero::Options options;
    options.delayed_update = true;
    Opt opt(c, zero::test::test_hyper<AdamW>(), options);
    opt.add_param(opt.add_unit("u"), "w", 100);
    try {
      opt.finalize();
    } catch (const zero::Error& e) {
      error = e.what();
    }
  });
  CHECK_THAT(error, Catch::Contains("delayed_update") && Catch::Contains("offload::Cpu"));
}

namespace {

struct StatsRun {
  std::size_t fetches = 0;  // gradient statistics brought to the host, over every step (LateCopies)
  // Host waits from the start of each step() to its control all-reduce, summed over the steps.
  std::size_t waits_before_control = 0;
  double grad_norm = 0.0;   // of the last step
};

// Five units of unequal size on 2 ranks, 3 steps; the backward of the documented loop.
template <int S, class Backend>
StatsRun count_stats_fetches() {
  using Opt = zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<S>, zero::offload::None, Backend>;
  constexpr int steps = 3;
  StatsRun out;
  zero::comm::LocalGroup group(2);
  group.run([&](zero::comm::Local& local) {
    std::size_t step_start = 0, waits = 0;
    using Event = zero::test::WatchedLocal::Event;
    zero::test::WatchedLocal c(local, [&](Event e, std::size_t, bool control) {
      if (e == Event::all_reduce && control) waits += zero::test::late_copies().host_waits - step_start;
    });
    Opt opt(c, zero::test::test_hyper<AdamW>(), {});
    std::vector<zero::UnitId> units;
    for (std::size_t u = 0; u < 5; ++u) {
      units.push_back(opt.add_unit("u" + std::to_string(u)));
      opt.add_param(units.back(), "w" + std::to_string(u), 100 + 37 * u);
    }
    opt.finalize();
    const std::size_t before = zero::test::late_copies().stats_fetches;
    zero::StepResult last;
    for (int step = 0; step < steps; ++step) {
      for (auto it = units.rbegin(); it != units.rend(); ++it) {
        opt.acquire_unit(*it);
        bf16* g = opt.grad_buffer(*it);
        for (std::size_t i = 0; i < opt.layout().unit(*it).numel; ++i)
          g[i] = zero::from_float<bf16>(0.01f * static_cast<float>((i * 5 + it->index + static_cast<std::size_t>(step)) % 11) - 0.05f);
        opt.grad_ready(*it);
        opt.release_unit(*it);
      }
      step_start = zero::test::late_copies().host_waits;
      last = opt.step();
    }
    if (c.rank() == 0) out = {zero::test::late_copies().stats_fetches - before, waits, last.grad_norm};
  });
  return out;
}

template <int S>
void check_one_fetch_per_step() {
  INFO("stage " << S);
  const StatsRun device = count_stats_fetches<S, zero::backend::LateCopies>();
  CHECK(device.fetches == 3);
  // ... and that is the only wait between the last backward and the control
  // all-reduce (its values go up from page-locked memory without one).
  CHECK(device.waits_before_control == 3);
  // Added on the backend in unit order, as the host adds them: the same norm to the bit.
  CHECK(device.grad_norm == count_stats_fetches<S, zero::backend::Host>().grad_norm);
  CHECK(device.grad_norm > 0.0);
}

}  // namespace

TEST_CASE("a step waits for the device once before its control all-reduce, at every stage", "[engine][offload]") {
  // Stage 1's owned gradient is one piece per unit (interleaved with the
  // other ranks' pieces); on a device its statistics used to come to the
  // host piece by piece, a wait for the stream each, and the control values
  // went up with a blocking copy.
  check_one_fetch_per_step<0>();
  check_one_fetch_per_step<1>();
  check_one_fetch_per_step<2>();
  check_one_fetch_per_step<3>();
}

// ---- Page-locked host buffers in pieces (backend/pieced_buffer.hpp) ---------

TEST_CASE("cut_pieces cuts between ranges, never above the piece size", "[engine][offload][pinned]") {
  using zero::backend::Piece;
  zero::backend::PieceCuts cuts;
  cuts.piece_bytes = 8192;  // 2048 floats
  cuts.range_ends = {1000, 2000, 2048, 3000, 9000, 9500};
  // 1000 + 1000 + 48 fill the first piece exactly; the range 3000..9000 is
  // larger than a piece and is cut at piece size; 9500..10000 is the tail.
  const std::vector<Piece> want = {{0, 2048}, {2048, 3000}, {3000, 5048}, {5048, 7096}, {7096, 9000}, {9000, 10000}};
  CHECK(zero::backend::cut_pieces(10000, sizeof(float), cuts) == want);

  // Random ranges: the pieces cover the buffer in order, none is above the
  // limit, and a range that fits in a piece is inside one.
  std::uint64_t seed = 12345;
  auto next = [&seed](std::uint64_t bound) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return (seed >> 33) % bound;
  };
  for (int trial = 0; trial < 200; ++trial) {
    const std::size_t element = trial % 2 == 0 ? 4 : 2;
    cuts.piece_bytes = 4096 * (1 + next(8));
    cuts.range_ends.clear();
    std::size_t at = 0;
    for (std::size_t r = next(30); r > 0; --r) cuts.range_ends.push_back(at += next(5000));
    const std::size_t n = at + next(3000);
    const auto pieces = zero::backend::cut_pieces(n, element, cuts);
    INFO("trial " << trial);
    std::size_t covered = 0;
    for (const Piece& p : pieces) {
      CHECK(p.begin == covered);
      CHECK(p.end > p.begin);
      CHECK((p.end - p.begin) * element <= cuts.piece_bytes);
      covered = p.end;
    }
    CHECK(covered == n);
    std::size_t begin = 0;
    for (std::size_t end : cuts.range_ends) {
      if ((end - begin) * element <= cuts.piece_bytes && end > begin) {
        const auto holder = std::find_if(pieces.begin(), pieces.end(), [&](const Piece& p) { return p.end > begin; });
        REQUIRE(holder != pieces.end());
        CHECK(holder->begin <= begin);
        CHECK(holder->end >= end);
      }
      begin = end;
    }
  }
  cuts.piece_bytes = 100;
  CHECK_THROWS_WITH(zero::backend::cut_pieces(10, 4, cuts), Catch::Contains("below one 4 KiB page"));
}

TEST_CASE("PiecedBuffer locks each piece, and falls back to pageable memory when one is refused",
          "[engine][offload][pinned]") {
  using Buffer = zero::backend::PiecedBuffer<float, zero::test::LoggingLocker>;
  zero::test::LockLog& log = zero::test::lock_log();
  log = {};
  zero::backend::PieceCuts cuts;
  cuts.piece_bytes = 4096;
  {
    Buffer b(3000, cuts);  // 1024 + 1024 + 952 floats
    CHECK(b.page_locked());
    REQUIRE(log.locked.size() == 3);
    CHECK(log.locked[0] == std::make_pair(static_cast<const void*>(b.data()), std::size_t{4096}));
    CHECK(log.locked[2] == std::make_pair(static_cast<const void*>(b.data() + 2048), std::size_t{952 * 4}));
    for (std::size_t i = 0; i < b.size(); ++i) REQUIRE(b.data()[i] == 0.0f);
    CHECK(log.unlocked.empty());
  }
  CHECK(log.unlocked.size() == 3);  // released, every piece unlocked
  log = {};
  log.refuse_after = 2;  // the third piece is refused
  {
    Buffer b(3000, cuts);
    CHECK_FALSE(b.page_locked());
    CHECK(log.unlocked.size() == 2);  // the two locked pieces are given back at once
    b.data()[2999] = 1.0f;            // and the memory is there, pageable
  }
  CHECK(log.unlocked.size() == 2);  // nothing more to unlock
  log = {};
}

TEST_CASE("offload::Cpu: host buffers are page-locked in pieces cut between units", "[engine][offload][pinned]") {
  using Opt = zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<2>, zero::offload::Cpu, zero::backend::LateCopies>;
  const std::vector<std::size_t> unit_elements = {700, 1300, 2000, 400, 1024, 1900};
  zero::Options options;
  options.pinned_piece_bytes = 8192;  // 2048 floats or 4096 bf16: several pieces, no unit larger
  std::vector<std::size_t> range_ends;
  zero::test::LockLog log;
  std::size_t unlocked_after = 0;
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& c) {
    zero::test::lock_log() = {};
    {
      Opt opt(c, zero::test::test_hyper<AdamW>(), options);
      for (std::size_t u = 0; u < unit_elements.size(); ++u)
        opt.add_param(opt.add_unit(zero::detail::concat("u", u)), zero::detail::concat("w", u), unit_elements[u]);
      opt.finalize();
      for (const auto& u : opt.layout().units()) range_ends.push_back(u.full_offset + u.padded);  // one rank: all owned
      log = zero::test::lock_log();
    }
    unlocked_after = zero::test::lock_log().unlocked.size();
  });
  const std::size_t owned = range_ends.back();
  // Buffers are runs of adjacent pieces: the fp32 master and two AdamW
  // states (4 bytes each), the host gradient and parameters (bf16).
  std::vector<std::vector<std::pair<const char*, std::size_t>>> buffers;
  for (const auto& [p, bytes] : log.locked) {
    const char* at = static_cast<const char*>(p);
    if (buffers.empty() || buffers.back().back().first + buffers.back().back().second != at) buffers.emplace_back();
    buffers.back().emplace_back(at, bytes);
  }
  // Besides those, one small buffer: the step's control values, page-locked
  // so that their upload need not wait.
  auto bytes_of = [](const std::vector<std::pair<const char*, std::size_t>>& pieces) {
    std::size_t bytes = 0;
    for (const auto& piece : pieces) bytes += piece.second;
    return bytes;
  };
  const auto control = std::partition(buffers.begin(), buffers.end(), [&](const auto& pieces) {
    return bytes_of(pieces) == owned * 4 || bytes_of(pieces) == owned * 2;
  });
  REQUIRE(buffers.end() - control == 1);
  CHECK(bytes_of(*control) < 1024);
  buffers.erase(control, buffers.end());
  REQUIRE(buffers.size() == 5);
  std::size_t total = 0, fp32 = 0, bf16s = 0;
  for (const auto& pieces : buffers) {
    const std::size_t bytes = bytes_of(pieces);
    total += bytes;
    const std::size_t element = bytes / owned;
    (element == 4 ? fp32 : bf16s) += 1;
    // Every cut is between two units' ranges, and no piece is above the limit.
    for (const auto& piece : pieces) {
      INFO("buffer of " << bytes << " bytes, piece at +" << piece.first - pieces.front().first);
      CHECK(piece.second <= options.pinned_piece_bytes);
      const std::size_t end = static_cast<std::size_t>(piece.first + piece.second - pieces.front().first) / element;
      CHECK(std::find(range_ends.begin(), range_ends.end(), end) != range_ends.end());
    }
  }
  CHECK(fp32 == 3);
  CHECK(bf16s == 2);
  CHECK(total == owned * (4 * 3 + 2 + 2));  // master + 2 states in fp32, gradient and parameters in bf16
  CHECK(unlocked_after == log.locked.size());
}

TEST_CASE("offload::Cpu: offload_times() splits each step into the device wait and the CPU update",
          "[engine][offload][times]") {
  using Opt = zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<2>, zero::offload::Cpu, zero::backend::LateCopies>;
  zero::Options options;
  options.grad_accumulation_steps = 2;
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& c) {  // (Catch2 assertions on this one rank's thread only)
    Opt opt(c, zero::test::test_hyper<AdamW>(), options);
    const zero::UnitId unit = opt.add_unit("u");
    opt.add_param(unit, "w", 4096);
    opt.finalize();
    const std::vector<bf16> grad(opt.layout().unit(unit).padded, zero::from_float<bf16>(0.01f));
    auto micro_batch = [&] {
      std::copy(grad.begin(), grad.end(), opt.grad_buffer(unit));
      opt.grad_ready(unit);
      return opt.step();
    };
    CHECK(micro_batch().accumulating);
    CHECK(opt.offload_times().steps == 0);  // an accumulating micro-batch is no step
    CHECK(micro_batch().stepped);
    micro_batch();
    micro_batch();
    opt.synchronize();
    const zero::OffloadTimes t = opt.offload_times();
    CHECK(t.steps == 2);
    CHECK(t.device_wait_seconds >= 0);
    CHECK(t.cpu_update_seconds > 0);
    opt.reset_offload_times();
    CHECK(opt.offload_times().steps == 0);
    CHECK(opt.offload_times().cpu_update_seconds == 0);
  });
}
