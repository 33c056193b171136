// Lean optimizer states (docs/lean-states.md).
//
// The remainder master. A remainder master (Options::master = MasterWeights::remainder)
// promises the fp32 master bit for bit in 2 bytes per parameter instead of 4.
// Its bf16 copy is the master rounded half away from zero, so the reference
// is an fp32-master run whose copies are rounded the same way
// (Options::round_ties_away): the two must agree in every master and every
// copy after every step, for every stage, tier, optimizer and rank count.
// The gradients here are computed from the bf16 copies (a quadratic pull
// towards a target, plus each rank's noise), so a copy that differs in one
// bit changes the trajectory; and the initial values include exact ties
// above even copies, which rounding to even would break.
//
// bf16 states (Options::states). One rank is held to a plain loop written
// here (torch.optim's rule, zero::optim's golden-tested update, on fp32
// values whose state is rounded to bf16 after every step); every stage and
// tier on 2 and 4 ranks to stage 0 without offload on as many, bit for bit.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine_harness.hpp"
#include "late_copies.hpp"
#include "zero/checkpoint/optimizer_io.hpp"
#include "zero/engine/plan.hpp"
#include "zero/offload/disk_state_store.hpp"

namespace {

namespace fs = std::filesystem;
using zero::bf16;
using zero::MasterWeights;

struct TempDir {
  fs::path path;
  TempDir() {
    std::string t = (fs::temp_directory_path() / "zero-remainder-XXXXXX").string();
    path = mkdtemp(t.data());
  }
  ~TempDir() { fs::remove_all(path); }
};

using Model = std::vector<std::pair<const char*, std::vector<std::size_t>>>;

// The model every run trains: units with a one-element parameter, primes and
// a tail past a SIMD pack, unless a test trains another (UsingModel).
const Model*& model_in_use() {
  static const Model primes = {{"embed", {1, 6}}, {"mlp", {1021}}, {"head", {4099, 3}}};
  static const Model* m = &primes;
  return m;
}
const Model& model() { return *model_in_use(); }
struct UsingModel {
  const Model* saved = model_in_use();
  explicit UsingModel(const Model& m) { model_in_use() = &m; }
  ~UsingModel() { model_in_use() = saved; }
  UsingModel(const UsingModel&) = delete;
  UsingModel& operator=(const UsingModel&) = delete;
};

float init_value(std::size_t p, std::size_t i) {
  const float x = std::sin(0.37f * static_cast<float>(i) + 1.3f * static_cast<float>(p)) * 0.5f;
  std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  if (i % 7 == 3) bits = (bits & 0xfffe0000u) | 0x8000u;  // a tie above an even copy
  return std::bit_cast<float>(bits);
}

// The gradient of element i of parameter p, from its bf16 copy: a pull
// towards a target plus each rank's noise.
bf16 gradient(bf16 copy, std::size_t p, std::size_t i, int rank, int step) {
  const float w = zero::to_float(copy);
  const float target = std::cos(0.11f * static_cast<float>(i + 13 * p));
  const float noise = 0.01f * std::sin(static_cast<float>(i * 3 + 7 * rank + 31 * step));
  return zero::from_float<bf16>(w - target + noise);
}

struct Trace {
  std::vector<std::vector<std::uint32_t>> masters;  // after set_param, then after each step (bits)
  std::vector<std::vector<std::uint16_t>> copies;
  zero::MemoryReport memory;
};

// `steps` steps from the initial values, or from the checkpoint at `resume`;
// with `save` the state after step `save_at` goes there.
template <class Opt>
Trace train(zero::comm::Local& comm, const zero::Options& options, int steps, const std::string& resume = "",
            const std::string& save = "", int save_at = 0) {
  using Ops = zero::backend::Ops<typename Opt::backend_policy>;
  typename Opt::Hyper hyper = zero::test::test_hyper<typename Opt::optimizer_policy>();
  Opt opt(comm, hyper, options);
  std::vector<zero::UnitId> units;
  std::vector<zero::ParamId> ids;
  for (const auto& [unit, sizes] : model()) {
    units.push_back(opt.add_unit(unit));
    for (std::size_t k = 0; k < sizes.size(); ++k)
      ids.push_back(opt.add_param(units.back(), std::string(unit) + ".w" + std::to_string(k), sizes[k]));
  }
  opt.finalize();
  for (std::size_t p = 0; p < ids.size(); ++p) {
    std::vector<float> v(opt.layout().params()[p].numel);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = init_value(p, i);
    opt.set_param(ids[p], v.data());
  }
  int first = 1;
  if (!resume.empty()) first = static_cast<int>(opt.load(resume).manifest.run.step) + 1;
  const zero::Layout& layout = opt.layout();
  Trace trace;
  auto record = [&] {
    std::vector<float> m(layout.padded_total());
    std::vector<bf16> c(layout.padded_total());
    opt.gather_masters(m.data());
    opt.gather_params(c.data());
    trace.masters.emplace_back();
    trace.copies.emplace_back();
    for (const auto& info : layout.params()) {
      const std::size_t start = layout.unit(info.unit).full_offset + info.offset;
      for (std::size_t i = 0; i < info.numel; ++i) {
        trace.masters.back().push_back(std::bit_cast<std::uint32_t>(m[start + i]));
        trace.copies.back().push_back(c[start + i].bits);
      }
    }
  };
  record();
  if (!save.empty() && save_at == first - 1) opt.save(save);
  std::vector<bf16> values, grads;
  for (int step = first; step <= steps; ++step) {
    for (const zero::UnitId u : units) {  // forward
      opt.acquire_unit(u);
      opt.release_unit(u);
    }
    for (auto it = units.rbegin(); it != units.rend(); ++it) {  // backward: gradients of the copies
      const zero::UnitInfo& unit = layout.unit(*it);
      const bf16* held = opt.acquire_unit(*it);
      values.resize(unit.padded);
      Ops::download(values.data(), held, unit.padded);
      grads.assign(unit.padded, bf16{});
      for (std::size_t p : unit.params) {
        const zero::ParamInfo& info = layout.params()[p];
        for (std::size_t i = 0; i < info.numel; ++i)
          grads[info.offset + i] = gradient(values[info.offset + i], p, i, comm.rank(), step);
      }
      Ops::upload(opt.grad_buffer(*it), grads.data(), unit.padded);
      opt.grad_ready(*it);
      opt.release_unit(*it);
    }
    opt.step();
    record();
    if (!save.empty() && step == save_at) opt.save(save);
  }
  trace.memory = opt.memory_report();
  return trace;
}

// The first element where two runs differ, or -1 (a failure prints one
// number, not two vectors of thousands).
template <class T>
long first_difference(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return static_cast<long>(std::min(a.size(), b.size()));
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return static_cast<long>(i);
  return -1;
}

// Steps 0..steps of `t` have the masters and copies of `reference`'s steps
// from..from + steps, bit for bit.
void check_same_steps(const Trace& t, const Trace& reference, std::size_t steps, std::size_t from = 0) {
  REQUIRE(t.masters.size() > steps);
  REQUIRE(reference.masters.size() > from + steps);
  for (std::size_t s = 0; s <= steps; ++s) {
    INFO("step " << s << " (the reference's " << from + s << ")");
    CHECK(first_difference(t.masters[s], reference.masters[from + s]) == -1);
    CHECK(first_difference(t.copies[s], reference.copies[from + s]) == -1);
  }
}

template <class Opt>
Trace run(int ranks, const zero::Options& options, int steps, const std::string& resume = "",
          const std::string& save = "", int save_at = 0) {
  std::vector<Trace> traces(static_cast<std::size_t>(ranks));
  zero::comm::LocalGroup group(ranks);
  group.run([&](zero::comm::Local& c) {
    zero::test::late_copies() = {};
    traces[static_cast<std::size_t>(c.rank())] = train<Opt>(c, options, steps, resume, save, save_at);
  });
  for (int r = 1; r < ranks; ++r)
    for (std::size_t s = 0; s < traces[0].masters.size(); ++s)
      REQUIRE(first_difference(traces[static_cast<std::size_t>(r)].masters[s], traces[0].masters[s]) == -1);
  return traces[0];
}

zero::Options with_master(zero::Options o, MasterWeights m) {
  o.master = m;
  o.round_ties_away = m == MasterWeights::fp32;  // the reference rounds its copies as the remainder does
  return o;
}

// Every step's masters and copies, remainder against fp32; and the memory:
// the master line is 2 bytes per owned element where it was 4.
template <class Opt>
void check_bitwise(int ranks, zero::Options options) {
  INFO(Opt::optimizer_policy::name << ", stage " << Opt::stage << ", offload " << Opt::offload_policy::name
                                   << ", backend " << Opt::backend_policy::name << ", " << ranks << " rank(s)");
  constexpr int steps = 4;
  std::optional<TempDir> dir;
  if constexpr (std::is_same_v<typename Opt::offload_policy, zero::offload::Nvme>) {
    dir.emplace();
    options.nvme.directory = dir->path.string();
    options.nvme.window_bytes = 3 * zero::offload::disk_least_window_bytes(Opt::state_slots, 2);  // several chunks
  }
  const Trace fp32 = run<Opt>(ranks, with_master(options, MasterWeights::fp32), steps);
  const Trace rem = run<Opt>(ranks, with_master(options, MasterWeights::remainder), steps);
  REQUIRE(rem.masters.size() == steps + 1);
  check_same_steps(rem, fp32, steps);
  // set_param kept every value exactly, ties included.
  std::vector<std::uint32_t> initial;
  std::size_t p = 0;
  for (const auto& [unit, sizes] : model())
    for (const std::size_t n : sizes) {
      for (std::size_t i = 0; i < n; ++i) initial.push_back(std::bit_cast<std::uint32_t>(init_value(p, i)));
      ++p;
    }
  CHECK(first_difference(rem.masters[0], initial) == -1);
  // 2 bytes per owned element where the fp32 master had 4; nothing else moved.
  CHECK(rem.memory.placed.master.total() * 2 == fp32.memory.placed.master.total());
  CHECK(rem.memory.placed.optimizer_states == fp32.memory.placed.optimizer_states);
  CHECK(rem.memory.placed.params == fp32.memory.placed.params);
  CHECK(rem.memory.placed.grads == fp32.memory.placed.grads);
}

template <class O, int S>
void check_every_tier() {
  using namespace zero;
  using P = precision::Mixed<bf16>;
  for (const int ranks : {1, 2, 4}) {
    check_bitwise<ZeroOptimizer<P, O, stage<S>, offload::None, backend::Host>>(ranks, {});
    if constexpr (S >= 1) {
      Options options;
      options.bucket_bytes = 1;  // one unit per bucket
      check_bitwise<ZeroOptimizer<P, O, stage<S>, offload::Nvme, backend::Host>>(ranks, options);
      check_bitwise<ZeroOptimizer<P, O, stage<S>, offload::Cpu, backend::LateCopies>>(ranks, options);
    }
  }
}

}  // namespace


// One test case per stage, each for every optimizer.
#define ZERO_REMAINDER_TEST(S)                                                                        \
  TEST_CASE("A remainder master trains bit for bit like an fp32 master, stage " #S, "[engine][remainder]") { \
    check_every_tier<zero::optim::AdamW, S>();                                                        \
    check_every_tier<zero::optim::Adam, S>();                                                         \
    check_every_tier<zero::optim::Sgd, S>();                                                          \
  }
ZERO_REMAINDER_TEST(0)
ZERO_REMAINDER_TEST(1)
ZERO_REMAINDER_TEST(2)
ZERO_REMAINDER_TEST(3)

TEST_CASE("A remainder master's memory: 14 bytes per parameter for bf16 AdamW, as the planner says",
          "[engine][remainder]") {
  using namespace zero;
  using P = precision::Mixed<bf16>;
  for (const int ranks : {1, 4}) {
    auto check = [&]<class Opt>(std::type_identity<Opt>, std::uint64_t bytes_per_padded_element_times_n) {
      INFO("stage " << Opt::stage << ", " << ranks << " rank(s)");
      Options options;
      options.master = MasterWeights::remainder;
      const Trace t = run<Opt>(ranks, options, 1);
      plan::Model m;
      for (const auto& [unit, sizes] : model()) m.units.push_back({unit, sizes});
      const plan::Plan planned = plan::make_plan(plan::scenario_for<Opt>(m, ranks, options, false));
      CHECK(planned.placed.master == t.memory.placed.master);
      CHECK(planned.model_states() == t.memory.model_states());
      // params 2 + grads 2 + remainder 2 + m and v 8, whole (stage 0) or 1/N (stage 3).
      CHECK(t.memory.placed.model_states().total() * static_cast<std::uint64_t>(ranks) ==
            bytes_per_padded_element_times_n * planned.padded_elements);
      CHECK(planned.paper_model_state_bytes ==
            (Opt::stage == 0 ? 14 * planned.param_elements
                             : 14 * planned.param_elements / static_cast<std::uint64_t>(ranks)));
    };
    check(std::type_identity<ZeroOptimizer<P, optim::AdamW, stage<0>, offload::None, backend::Host>>{},
          14 * static_cast<std::uint64_t>(ranks));
    check(std::type_identity<ZeroOptimizer<P, optim::AdamW, stage<3>, offload::None, backend::Host>>{}, 14);
  }
}

TEST_CASE("A remainder master resumes bit for bit, and checkpoints move between master formats",
          "[engine][remainder][checkpoint]") {
  using namespace zero;
  using Opt = ZeroOptimizer<precision::Mixed<bf16>, optim::AdamW, stage<2>, offload::None, backend::Host>;
  const Options remainder = with_master({}, MasterWeights::remainder), fp32 = with_master({}, MasterWeights::fp32);
  const Trace straight = run<Opt>(2, remainder, 6);
  TempDir dir;
  const std::string at3 = (dir.path / "step3").string();
  run<Opt>(2, remainder, 3, "", at3, 3);
  // The same format: the rest of the trajectory, bit for bit.
  const Trace resumed = run<Opt>(2, remainder, 6, at3);
  REQUIRE(resumed.masters.size() == 4);
  CHECK(first_difference(resumed.masters[0], straight.masters[3]) == -1);
  CHECK(first_difference(resumed.copies[0], straight.copies[3]) == -1);
  CHECK(first_difference(resumed.masters[3], straight.masters[6]) == -1);
  CHECK(first_difference(resumed.copies[3], straight.copies[6]) == -1);
  // Into an fp32 master that rounds its copies the same way: the same.
  const Trace into_fp32 = run<Opt>(2, fp32, 6, at3);
  CHECK(first_difference(into_fp32.masters[3], straight.masters[6]) == -1);
  CHECK(first_difference(into_fp32.copies[3], straight.copies[6]) == -1);
  // From an fp32 master whose copies were rounded to even, saved before
  // the first step (the initial ties are there): the remainder master takes
  // the fp32 values exactly, and its copies are its own rounding of them,
  // not the file's.
  Options even;
  const std::string even_at0 = (dir.path / "even0").string();
  const Trace even_run = run<Opt>(2, even, 0, "", even_at0, 0);
  const Trace loaded = run<Opt>(2, remainder, 0, even_at0);
  CHECK(first_difference(loaded.masters[0], even_run.masters[0]) == -1);
  std::size_t ties = 0, wrong = 0;
  for (std::size_t i = 0; i < loaded.copies[0].size(); ++i) {
    wrong += loaded.copies[0][i] != bf16_ties_away(std::bit_cast<float>(loaded.masters[0][i])).bits;
    ties += loaded.copies[0][i] != even_run.copies[0][i];
  }
  CHECK(wrong == 0);
  CHECK(ties > 0);
}

TEST_CASE("A remainder master is refused where it cannot be exact", "[engine][remainder][errors]") {
  using namespace zero;
  comm::LocalGroup group(1);
  group.run([&](comm::Local& c) {
    Options options;
    options.master = MasterWeights::remainder;
    using Fp16 = ZeroOptimizer<precision::Mixed<fp16>, optim::AdamW, stage<1>, offload::None, backend::Host>;
    using Fp32 = ZeroOptimizer<precision::Full<float>, optim::AdamW, stage<1>, offload::None, backend::Host>;
    using Bf16 = ZeroOptimizer<precision::Mixed<bf16>, optim::AdamW, stage<1>, offload::None, backend::Host>;
    CHECK_THROWS_WITH(Fp16(c, {}, options), Catch::Contains("Options::master is remainder") &&
                                                Catch::Contains("fp16") && Catch::Contains("Mixed<bf16>"));
    CHECK_THROWS_WITH(Fp32(c, {}, options),
                      Catch::Contains("Options::master is remainder") && Catch::Contains("fp32 training"));
    options.stochastic_rounding = true;
    CHECK_THROWS_WITH(Bf16(c, {}, options), Catch::Contains("stochastic") && Catch::Contains("remainder"));
    Config config;
    config.precision = PrecisionChoice::fp16;
    config.options.master = MasterWeights::remainder;
    CHECK_THROWS_WITH(config.validate(false), Catch::Contains("master remainder") && Catch::Contains("fp16"));
  });
}

namespace {

// One rank's training written plainly: fp32 masters, bf16 copies rounded to
// nearest even, the state stored in bf16 (rounded to nearest even after
// every update), the optimizer's per-element rule. No engine code.
template <class O>
Trace plain_bf16_states(int steps) {
  std::vector<float> w;
  std::vector<std::size_t> param, index;
  std::size_t p = 0;
  for (const auto& [unit, sizes] : model())
    for (const std::size_t n : sizes) {
      for (std::size_t i = 0; i < n; ++i) {
        w.push_back(init_value(p, i));
        param.push_back(p);
        index.push_back(i);
      }
      ++p;
    }
  std::vector<std::vector<bf16>> state(O::state_slots, std::vector<bf16>(w.size(), bf16{0}));
  const auto hyper = zero::test::test_hyper<O>();
  Trace t;
  auto record = [&] {
    t.masters.emplace_back();
    t.copies.emplace_back();
    for (const float x : w) {
      t.masters.back().push_back(std::bit_cast<std::uint32_t>(x));
      t.copies.back().push_back(zero::from_float<bf16>(x).bits);
    }
  };
  record();
  for (int step = 1; step <= steps; ++step) {
    const auto scalars = O::prepare(hyper, step);
    for (std::size_t e = 0; e < w.size(); ++e) {
      const float g = zero::to_float(gradient(zero::from_float<bf16>(w[e]), param[e], index[e], 0, step));
      float st[O::state_slots > 0 ? O::state_slots : 1];
      for (int k = 0; k < O::state_slots; ++k) st[k] = zero::to_float(state[k][e]);
      O::update(scalars, w[e], g, st);
      for (int k = 0; k < O::state_slots; ++k) state[k][e] = zero::from_float<bf16>(st[k]);
    }
    record();
  }
  return t;
}

// One rank at stage 0 with `options` against `plain` after every step, bit
// for bit; and the same run with fp32 states is another one at the end (the
// format matters). Returns both runs.
template <class O>
std::pair<Trace, Trace> check_one_rank_against_plain(const zero::Options& options, const Trace& plain, int steps) {
  using namespace zero;
  using Opt = ZeroOptimizer<precision::Mixed<bf16>, O, stage<0>, offload::None, backend::Host>;
  Trace one = run<Opt>(1, options, steps);
  check_same_steps(one, plain, static_cast<std::size_t>(steps));
  Options fp32 = options;
  fp32.states = StateFormat::fp32;
  Trace full = run<Opt>(1, fp32, steps);
  CHECK(first_difference(full.masters[steps], plain.masters[steps]) != -1);
  return {std::move(one), std::move(full)};
}

template <class O, int S>
void check_bf16_states_every_tier(const Trace& stage0, int ranks, zero::Options options) {
  using namespace zero;
  using P = precision::Mixed<bf16>;
  auto same = [&]<class Opt>(std::type_identity<Opt>) {
    INFO(O::name << ", stage " << S << ", offload " << Opt::offload_policy::name << ", " << ranks << " rank(s)");
    std::optional<TempDir> dir;
    if constexpr (std::is_same_v<typename Opt::offload_policy, offload::Nvme>) {
      dir.emplace();
      options.nvme.directory = dir->path.string();
      options.nvme.window_bytes = 3 * offload::disk_least_window_bytes(Opt::state_slots, 4, 2);
    }
    const Trace t = run<Opt>(ranks, options, static_cast<int>(stage0.masters.size()) - 1);
    check_same_steps(t, stage0, stage0.masters.size() - 1);
  };
  same(std::type_identity<ZeroOptimizer<P, O, stage<S>, offload::None, backend::Host>>{});
  if constexpr (S >= 1) {
    same(std::type_identity<ZeroOptimizer<P, O, stage<S>, offload::Nvme, backend::Host>>{});
    same(std::type_identity<ZeroOptimizer<P, O, stage<S>, offload::Cpu, backend::LateCopies>>{});
  }
}

template <class O>
void check_bf16_states() {
  using namespace zero;
  using P = precision::Mixed<bf16>;
  constexpr int steps = 4;
  Options options;
  options.states = StateFormat::bf16;
  options.bucket_bytes = 1;
  {
    INFO(O::name << ": one rank against the plain loop");
    const auto [one, full] = check_one_rank_against_plain<O>(options, plain_bf16_states<O>(steps), steps);
    CHECK(one.memory.placed.optimizer_states.total() * 2 == full.memory.placed.optimizer_states.total());
  }
  for (const auto format : {StateFormat::bf16, StateFormat::bf16_stochastic})
    for (const auto master : {MasterWeights::fp32, MasterWeights::remainder})
      for (const int ranks : {2, 4}) {
        INFO(name(format) << " states, " << name(master) << " master");
        Options o = options;
        o.states = format;
        o.master = master;
        const Trace stage0 = run<ZeroOptimizer<P, O, stage<0>, offload::None, backend::Host>>(ranks, o, steps);
        check_bf16_states_every_tier<O, 1>(stage0, ranks, o);
        check_bf16_states_every_tier<O, 2>(stage0, ranks, o);
        check_bf16_states_every_tier<O, 3>(stage0, ranks, o);
      }
}

}  // namespace

TEST_CASE("bf16 states: the plain loop on one rank, every stage and tier alike on more", "[engine][states]") {
  check_bf16_states<zero::optim::AdamW>();
  check_bf16_states<zero::optim::Adam>();
  check_bf16_states<zero::optim::Sgd>();
}

TEST_CASE("bf16 states with a remainder master: 10 bytes per parameter for bf16 AdamW, as the planner says",
          "[engine][states]") {
  using namespace zero;
  using Opt = ZeroOptimizer<precision::Mixed<bf16>, optim::AdamW, stage<0>, offload::None, backend::Host>;
  Options options;
  options.master = MasterWeights::remainder;
  options.states = StateFormat::bf16;
  const Trace t = run<Opt>(1, options, 1);
  plan::Model m;
  for (const auto& [unit, sizes] : model()) m.units.push_back({unit, sizes});
  const plan::Plan planned = plan::make_plan(plan::scenario_for<Opt>(m, 1, options, false));
  CHECK(planned.placed.optimizer_states == t.memory.placed.optimizer_states);
  CHECK(planned.model_states() == t.memory.model_states());
  // params 2 + grads 2 + remainder 2 + m and v 2 + 2.
  CHECK(t.memory.placed.model_states().total() == 10 * planned.padded_elements);
  CHECK(planned.paper_model_state_bytes == 10 * planned.param_elements);
}

TEST_CASE("bf16 states resume bit for bit; fp32 states load into them rounded", "[engine][states][checkpoint]") {
  using namespace zero;
  using Opt = ZeroOptimizer<precision::Mixed<bf16>, optim::AdamW, stage<3>, offload::None, backend::Host>;
  Options bf16_states;
  bf16_states.states = StateFormat::bf16_stochastic;
  const Trace straight = run<Opt>(2, bf16_states, 6);
  TempDir dir;
  const std::string at3 = (dir.path / "step3").string();
  run<Opt>(2, bf16_states, 3, "", at3, 3);
  const Trace resumed = run<Opt>(2, bf16_states, 6, at3);
  CHECK(first_difference(resumed.masters[3], straight.masters[6]) == -1);
  CHECK(first_difference(resumed.copies[3], straight.copies[6]) == -1);
  // An fp32-state checkpoint: the load rounds the state, the run goes on.
  const std::string fp32_at3 = (dir.path / "fp32").string();
  run<Opt>(2, Options{}, 3, "", fp32_at3, 3);
  const Trace from_fp32 = run<Opt>(2, bf16_states, 6, fp32_at3);
  REQUIRE(from_fp32.masters.size() == 4);
  const Trace fp32_straight = run<Opt>(2, Options{}, 6);
  CHECK(first_difference(from_fp32.masters[0], fp32_straight.masters[3]) == -1);
  CHECK(first_difference(from_fp32.masters[3], fp32_straight.masters[6]) != -1);
}

// 8-bit block-wise states (Options::states = blockwise8). One rank is held to
// a plain loop of the paper's rule written here: per parameter, blocks from
// its first element; dequantize, update (zero::optim's golden-tested rule),
// quantize each block with its new absmax (quant:: functions, held bit for
// bit to the Python reference in tests/quant); small parameters in fp32.
// The engine's path is another: the runs of engine/detail/state_blocks.hpp, the
// host SIMD step and its bucket lookup instead of the search. More ranks:
// stages 1-3 (the same shards, so the same blocks) and offload cpu agree bit
// for bit; a checkpoint resumes bit for bit.
namespace {

template <class O>
Trace plain_blockwise8_states(int steps, std::size_t block, std::size_t fp32_below) {
  using namespace zero;
  struct Param {
    std::vector<float> w;
    std::vector<float> fp32[O::state_slots > 0 ? O::state_slots : 1];
    std::vector<std::uint8_t> codes[O::state_slots > 0 ? O::state_slots : 1];
    std::vector<float> absmax[O::state_slots > 0 ? O::state_slots : 1];
  };
  std::vector<Param> params;
  const float* code[O::state_slots > 0 ? O::state_slots : 1] = {};
  for (int k = 0; k < O::state_slots; ++k)
    code[k] = quant::code_for(optim::state_values<O>(k) == optim::StateValues::non_negative);
  for (const auto& [unit, sizes] : model())
    for (const std::size_t n : sizes) {
      Param p;
      for (std::size_t i = 0; i < n; ++i) p.w.push_back(init_value(params.size(), i));
      for (int k = 0; k < O::state_slots; ++k) {
        if (n < fp32_below) {
          p.fp32[k].assign(n, 0.0f);
        } else {
          p.codes[k].assign(n, quant::quantize(0.0f, code[k]));
          p.absmax[k].assign(quant::block_count(n, block), 0.0f);
        }
      }
      params.push_back(std::move(p));
    }
  const auto hyper = zero::test::test_hyper<O>();
  Trace t;
  auto record = [&] {
    t.masters.emplace_back();
    t.copies.emplace_back();
    for (const Param& p : params)
      for (const float x : p.w) {
        t.masters.back().push_back(std::bit_cast<std::uint32_t>(x));
        t.copies.back().push_back(zero::from_float<bf16>(x).bits);
      }
  };
  record();
  for (int step = 1; step <= steps; ++step) {
    const auto scalars = O::prepare(hyper, step);
    for (std::size_t pi = 0; pi < params.size(); ++pi) {
      Param& p = params[pi];
      const std::size_t n = p.w.size();
      const bool quantized = n >= fp32_below;
      std::vector<float> updated[O::state_slots > 0 ? O::state_slots : 1];
      for (int k = 0; k < O::state_slots; ++k) updated[k].resize(n);
      for (std::size_t i = 0; i < n; ++i) {
        const float g = zero::to_float(gradient(zero::from_float<bf16>(p.w[i]), pi, i, 0, step));
        float st[O::state_slots > 0 ? O::state_slots : 1];
        for (int k = 0; k < O::state_slots; ++k)
          st[k] = quantized ? quant::dequantize(p.codes[k][i], code[k], p.absmax[k][i / block]) : p.fp32[k][i];
        O::update(scalars, p.w[i], g, st);
        for (int k = 0; k < O::state_slots; ++k) updated[k][i] = st[k];
      }
      for (int k = 0; k < O::state_slots; ++k) {
        if (quantized)
          quant::quantize_blockwise(updated[k].data(), n, block, code[k], p.codes[k].data(), p.absmax[k].data());
        else
          p.fp32[k] = updated[k];
      }
    }
    record();
  }
  return t;
}

template <class O>
void check_blockwise8_states() {
  using namespace zero;
  using P = precision::Mixed<bf16>;
  constexpr int steps = 4;
  Options options;
  options.states = StateFormat::blockwise8;
  options.state_block = 64;        // parameters of 1021 and 4099 elements: many blocks, short last ones
  options.state_fp32_below = 100;  // the parameters of 1, 3 and 6 elements stay fp32
  options.bucket_bytes = 1;
  {
    INFO(O::name << ": one rank against the plain loop");
    check_one_rank_against_plain<O>(
        options, plain_blockwise8_states<O>(steps, options.state_block, options.state_fp32_below), steps);
  }
  for (const auto master : {MasterWeights::fp32, MasterWeights::remainder})
    for (const int ranks : {2, 4}) {
      INFO(name(master) << " master, " << ranks << " ranks");
      Options o = options;
      o.master = master;
      const Trace stage1 = run<ZeroOptimizer<P, O, stage<1>, offload::None, backend::Host>>(ranks, o, steps);
      auto same = [&]<class Opt>(std::type_identity<Opt>) {
        INFO("stage " << Opt::stage << ", offload " << Opt::offload_policy::name);
        check_same_steps(run<Opt>(ranks, o, steps), stage1, steps);
      };
      same(std::type_identity<ZeroOptimizer<P, O, stage<2>, offload::None, backend::Host>>{});
      same(std::type_identity<ZeroOptimizer<P, O, stage<3>, offload::None, backend::Host>>{});
      same(std::type_identity<ZeroOptimizer<P, O, stage<1>, offload::Cpu, backend::LateCopies>>{});
      same(std::type_identity<ZeroOptimizer<P, O, stage<3>, offload::Cpu, backend::LateCopies>>{});
      TempDir dir;
      Options on_disk = o;
      on_disk.nvme.directory = dir.path.string();
      on_disk.nvme.window_bytes = offload::disk_least_window_bytes(O::state_slots, master_element_bytes(master), 1);
      check_same_steps(run<ZeroOptimizer<P, O, stage<1>, offload::Nvme, backend::Host>>(ranks, on_disk, steps),
                       stage1, steps);
      check_same_steps(run<ZeroOptimizer<P, O, stage<3>, offload::Nvme, backend::Host>>(ranks, on_disk, steps),
                       stage1, steps);
    }
}

}  // namespace

TEST_CASE("8-bit states: the paper's rule on one rank, stages 1-3 and offload alike on more", "[engine][states]") {
  check_blockwise8_states<zero::optim::AdamW>();
  check_blockwise8_states<zero::optim::Adam>();
  check_blockwise8_states<zero::optim::Sgd>();
}

// The disk tier streams the owned elements in chunks of 4096 or more; a
// chunk that would cut a block of 8-bit state ends before it, since a block
// is quantized from all its values at once.
TEST_CASE("8-bit states on disk: chunks end before a block they would cut", "[engine][states][nvme]") {
  using namespace zero;
  Layout layout(1);
  const UnitId a = layout.add_unit("a");
  layout.add_param(a, "a.w", 1021);
  const UnitId b = layout.add_unit("b");
  layout.add_param(b, "b.w", 9000);
  layout.add_param(b, "b.bias", 3);
  const UnitId c = layout.add_unit("c");
  layout.add_param(c, "c.w", 5000);
  layout.finalize(2);
  const StateBlocks blocks = StateBlocks::build(Ownership{stage_rules(1), 0, &layout}, 192, 1000);
  const std::size_t owned = layout.padded_total();
  const auto starts = offload::disk_chunk_starts(4096, owned, blocks);
  REQUIRE(starts.front() == 0);
  REQUIRE(starts.back() == owned);
  bool shortened = false;
  for (std::size_t i = 1; i + 1 < starts.size(); ++i) {
    INFO("chunk " << i << " begins at owned element " << starts[i]);
    CHECK(starts[i] > starts[i - 1]);
    CHECK(starts[i] - starts[i - 1] <= 4096);
    CHECK(starts[i] - starts[i - 1] > 4096 - 192);  // a block is 192 elements at most
    shortened |= starts[i] - starts[i - 1] < 4096;
    // No blockwise run holds the boundary past one of its blocks' first element.
    for (const StateRun& run : blocks.runs()) {
      if (!run.blockwise || starts[i] <= run.begin || starts[i] >= run.end()) continue;
      CHECK((run.phase + (starts[i] - run.begin)) % 192 == 0);
    }
  }
  CHECK(shortened);  // 192 does not divide 4096: the chunks had blocks to keep whole
  // Without 8-bit blocks the chunks are every 4096 elements.
  const auto plain = offload::disk_chunk_starts(4096, owned, StateBlocks{});
  CHECK(plain.size() == (owned + 4095) / 4096 + 1);
  CHECK(plain[1] == 4096);
  // A chunk smaller than a block is refused, naming the options to change.
  CHECK_THROWS_WITH(offload::disk_chunk_starts(64, owned, blocks),
                    Catch::Contains("Options::nvme.window_bytes") && Catch::Contains("Options::state_block"));
}

// Options::validate checks state_block only with blockwise8 states (the docs
// present it as their setting), so the blocks check it where they are cut:
// options validated with another format never reach this arithmetic
// unchecked, here through a schedule asked for 8-bit states.
TEST_CASE("8-bit blocks check Options::state_block themselves", "[engine][states]") {
  using namespace zero;
  Layout layout(1);
  layout.add_param(layout.add_unit("a"), "a.w", 5000);
  layout.finalize(2);
  for (const std::size_t block : {std::size_t{0}, std::size_t{100}, std::size_t{8192}}) {
    INFO("state_block " << block);
    CHECK_THROWS_WITH(StateBlocks::build(Ownership{stage_rules(1), 0, &layout}, block, 1000),
                      Catch::StartsWith("StateBlocks: Options::state_block is " + std::to_string(block) +
                                        ", but 8-bit block-wise states need blocks of a multiple of 64 in [64, "
                                        "4096] elements"));
    Options options;  // fp32 states: the block is not checked
    options.state_block = block;
    CHECK_NOTHROW(options.validate());
    options.states = StateFormat::blockwise8;
    const RunShape run{.stage = stage_rules(1)};
    CHECK_THROWS_WITH(schedule(layout, run, options), Catch::Contains("Options::state_block is " +
                                                                       std::to_string(block)));
  }
  CHECK(StateBlocks::build(Ownership{stage_rules(1), 0, &layout}, 4096, 1000).block() == 4096);
}

TEST_CASE("8-bit states on disk: bit for bit as in memory, the codes on disk and a third of the bytes",
          "[engine][states][nvme]") {
  using namespace zero;
  using P = precision::Mixed<bf16>;
  using O = optim::AdamW;
  constexpr int steps = 4;
  Options options;
  options.states = StateFormat::blockwise8;
  options.state_block = 192;  // the disk's chunks of 4096 cut the 4099-element parameter's blocks
  options.state_fp32_below = 100;
  options.bucket_bytes = 1;
  plan::Model m;
  for (const auto& [unit, sizes] : model()) m.units.push_back({unit, sizes});
  for (const auto master : {MasterWeights::fp32, MasterWeights::remainder})
    for (const int ranks : {1, 2}) {
      INFO(name(master) << " master, " << ranks << " rank(s)");
      Options o = options;
      o.master = master;
      const Trace memory = run<ZeroOptimizer<P, O, stage<1>, offload::None, backend::Host>>(ranks, o, steps);
      TempDir dir;
      o.nvme.directory = dir.path.string();
      o.nvme.window_bytes = offload::disk_least_window_bytes(O::state_slots, master_element_bytes(master), 1);
      using OnDisk = ZeroOptimizer<P, O, stage<1>, offload::Nvme, backend::Host>;
      const Trace disk = run<OnDisk>(ranks, o, steps);
      check_same_steps(disk, memory, steps);
      // One code per owned element and slot on disk; the absmax and the small
      // parameters' fp32 state in host memory; as the planner says (of
      // rank 0, whose report the trace keeps).
      plan::Scenario config = plan::scenario_for<OnDisk>(m, ranks, o, false);
      config.rank = 0;
      const plan::Plan planned = plan::make_plan(config);
      CHECK(planned.placed.optimizer_states == disk.memory.placed.optimizer_states);
      CHECK(planned.placed.master == disk.memory.placed.master);
      // On disk: the master's 4 or 2 bytes and two 1-byte codes per owned
      // element, where fp32 states took 12 or 10; in host memory a small part.
      const std::uint64_t owned = disk.memory.placed.master.disk / master_element_bytes(master);
      CHECK(disk.memory.placed.master.disk + disk.memory.placed.optimizer_states.disk ==
            owned * (master_element_bytes(master) + 2));
      CHECK(disk.memory.placed.optimizer_states.host > 0);
      CHECK(disk.memory.placed.optimizer_states.host * 4 < memory.memory.placed.optimizer_states.total());
    }
  // Resumes bit for bit from a checkpoint, on disk as in memory.
  TempDir dir, saved;
  Options o = options;
  o.nvme.directory = dir.path.string();
  o.nvme.window_bytes = offload::disk_least_window_bytes(O::state_slots, 4, 1);
  using OnDisk = ZeroOptimizer<P, O, stage<3>, offload::Nvme, backend::Host>;
  const Trace straight = run<OnDisk>(2, o, 6);
  const std::string at3 = (saved.path / "step3").string();
  run<OnDisk>(2, o, 3, "", at3, 3);
  const Trace resumed = run<OnDisk>(2, o, 6, at3);
  REQUIRE(resumed.masters.size() == 4);
  check_same_steps(resumed, straight, 3, 3);
  // ...and the straight run is the same run's in memory.
  const Trace in_memory = run<ZeroOptimizer<P, O, stage<3>, offload::None, backend::Host>>(2, options, 6);
  check_same_steps(straight, in_memory, 6);
}

TEST_CASE("8-bit states on disk: a chunk that cuts a run begun inside a block, bit for bit as in memory",
          "[engine][states][nvme]") {
  using namespace zero;
  using P = precision::Mixed<bf16>;
  using O = optim::AdamW;
  // Two ranks, blocks of 192, chunks of 4096: rank 1's shard of unit "a"
  // begins inside a block of its first parameter, and its second chunk
  // begins inside that run (at a block's first element, elements after the
  // run's first), so the piece's first block has phase 0 where the run's
  // has not; rank 1 has three records, rank 0 two.
  const Model cut = {{"a", {5911, 4079}}, {"b", {6007}}};
  const UsingModel using_cut(cut);
  Options options = with_master(Options{}, MasterWeights::remainder);
  options.states = StateFormat::blockwise8;
  options.state_block = 192;
  options.state_fp32_below = 4;
  options.bucket_bytes = 1;
  auto same_on_disk = [&]<int S>() {
    INFO("stage " << S);
    const Trace memory = run<ZeroOptimizer<P, O, stage<S>, offload::None, backend::Host>>(2, options, 3);
    TempDir dir;
    Options o = options;
    o.nvme.directory = dir.path.string();
    o.nvme.window_bytes = offload::disk_least_window_bytes(O::state_slots, 2, 1);
    check_same_steps(run<ZeroOptimizer<P, O, stage<S>, offload::Nvme, backend::Host>>(2, o, 3), memory, 3);
  };
  same_on_disk.operator()<1>();
  same_on_disk.operator()<3>();
}

TEST_CASE("8-bit states with a remainder master: the bytes the planner and the formula say", "[engine][states]") {
  using namespace zero;
  using Opt = ZeroOptimizer<precision::Mixed<bf16>, optim::AdamW, stage<3>, offload::None, backend::Host>;
  Options options;
  options.master = MasterWeights::remainder;
  options.states = StateFormat::blockwise8;
  options.state_block = 256;
  plan::Model m;
  for (const auto& [unit, sizes] : model()) m.units.push_back({unit, sizes});
  for (const int ranks : {1, 2}) {
    INFO(ranks << " rank(s)");
    const Trace t = run<Opt>(ranks, options, 1);
    plan::Scenario config = plan::scenario_for<Opt>(m, ranks, options, false);
    config.rank = 0;  // whose report the trace keeps
    const plan::Plan planned = plan::make_plan(config);
    CHECK(planned.placed.optimizer_states == t.memory.placed.optimizer_states);
    CHECK(planned.model_states() == t.memory.model_states());
    CHECK(planned.paper_k == 2 + 2);  // remainder 2, m and v 1 + 1
  }
  // One rank, by hand: the 4099-element parameter is 4099 codes and 17
  // blocks per slot; everything else (1 + 6 + 1021 + 3 elements, the gaps
  // and the padding) is fp32.
  const Trace one = run<Opt>(1, options, 1);
  plan::Plan planned = plan::make_plan(plan::scenario_for<Opt>(m, 1, options, false));
  const std::uint64_t padded = planned.padded_elements;
  CHECK(one.memory.placed.optimizer_states.total() == 2 * (4099 + 4 * 17 + 4 * (padded - 4099)));
}

TEST_CASE("8-bit states resume bit for bit", "[engine][states][checkpoint]") {
  using namespace zero;
  using Opt = ZeroOptimizer<precision::Mixed<bf16>, optim::AdamW, stage<3>, offload::None, backend::Host>;
  Options options;
  options.states = StateFormat::blockwise8;
  options.state_block = 64;
  options.state_fp32_below = 100;
  const Trace straight = run<Opt>(2, options, 6);
  TempDir dir;
  const std::string at3 = (dir.path / "step3").string();
  run<Opt>(2, options, 3, "", at3, 3);
  const Trace resumed = run<Opt>(2, options, 6, at3);
  REQUIRE(resumed.masters.size() == 4);
  check_same_steps(resumed, straight, 3, 3);
}

TEST_CASE("A load that changes the state's format says so; one that keeps it says nothing", "[engine][states][checkpoint]") {
  using namespace zero;
  checkpoint::RunState saved;
  saved.world_size = 2;
  saved.stage = 3;
  saved.state_format = "blockwise8";
  saved.state_block = 2048;
  saved.state_fp32_below = 4096;
  Options run;
  run.states = StateFormat::blockwise8;
  CHECK(checkpoint::state_conversion_line(saved, run, 2, 3).empty());
  CHECK(checkpoint::state_conversion_line(saved, run, 2, 1).empty());  // stages 1-3 cut the same blocks
  const std::string other_ranks = checkpoint::state_conversion_line(saved, run, 4, 3);
  CHECK(other_ranks.find("converted on load (each block quantized afresh)") != std::string::npos);
  CHECK(other_ranks.find("2 rank(s)") != std::string::npos);
  CHECK(!checkpoint::state_conversion_line(saved, run, 2, 0).empty());  // stage 0 keeps whole units
  // Stage 0, and one rank at any stage, keep whole units at any rank count:
  // the same blocks, nothing converted.
  saved.stage = 0;
  CHECK(checkpoint::state_conversion_line(saved, run, 4, 0).empty());
  CHECK(checkpoint::state_conversion_line(saved, run, 1, 2).empty());
  CHECK(!checkpoint::state_conversion_line(saved, run, 2, 1).empty());
  saved.world_size = 1;
  saved.stage = 3;
  CHECK(checkpoint::state_conversion_line(saved, run, 3, 0).empty());
  CHECK(!checkpoint::state_conversion_line(saved, run, 3, 1).empty());
  saved.world_size = 2;
  run.state_block = 256;
  CHECK(checkpoint::state_conversion_line(saved, run, 2, 3).find("blocks of 256") != std::string::npos);
  run.states = StateFormat::fp32;  // fp32 holds the saved values exactly
  CHECK(checkpoint::state_conversion_line(saved, run, 4, 0).empty());
  run.states = StateFormat::bf16;
  CHECK(checkpoint::state_conversion_line(saved, run, 2, 3).find("each value rounded to bf16") != std::string::npos);
  saved.state_format = "";  // a manifest from before the format was recorded: fp32
  CHECK(checkpoint::state_conversion_line(saved, run, 2, 3).find("saved as fp32") != std::string::npos);
  saved.state_format = "bf16_stochastic";
  CHECK(checkpoint::state_conversion_line(saved, run, 2, 3).empty());
}
