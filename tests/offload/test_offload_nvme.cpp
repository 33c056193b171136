// Why: offload::Nvme keeps the master and optimizer state in swap files and
// streams them through a small host window. It must train bit for bit like
// the state kept in memory (same fused step, chunk by chunk), on the Host
// backend and on a device backend, keep its peak memory near the window
// however large the state, leave no files behind, and turn every disk fault
// into an error naming the file that stops training instead of going on with
// partial state.
#include <catch2/catch.hpp>

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "engine_harness.hpp"
#include "late_copies.hpp"
#include "zero/engine/detail/schedule.hpp"
#include "zero/offload/disk_state_store.hpp"

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kUnderAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kUnderAddressSanitizer = true;
#else
constexpr bool kUnderAddressSanitizer = false;
#endif
#else
constexpr bool kUnderAddressSanitizer = false;
#endif

namespace fs = std::filesystem;
using zero::bf16;
using zero::fp16;
using namespace zero::precision;
using zero::optim::Adam;
using zero::optim::AdamW;
using zero::optim::Sgd;

// A fresh directory under /tmp (a real disk here: O_DIRECT), removed after.
struct TempDir {
  fs::path path;
  TempDir() {
    char name[] = "/tmp/zero-nvme-test-XXXXXX";
    REQUIRE(::mkdtemp(name) != nullptr);
    path = name;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::size_t files() const {
    return static_cast<std::size_t>(std::distance(fs::directory_iterator(path), fs::directory_iterator()));
  }
};

// A window of three chunks of 1024 elements: the test model spans several.
zero::Options nvme_options(const zero::test::Variant& v, const std::string& dir, int state_slots) {
  zero::Options o = v.options();
  o.nvme.directory = dir;
  o.nvme.window_bytes = std::size_t{3} * 4096 * static_cast<std::size_t>(1 + state_slots);
  return o;
}

using zero::test::Config;
using Configs = std::tuple<Config<1, Mixed<bf16>, AdamW>, Config<1, Full<float>, Sgd>, Config<2, Mixed<fp16>, Adam>,
                           Config<2, Full<float>, AdamW>, Config<3, Mixed<bf16>, Sgd>, Config<3, Full<float>, Adam>>;

template <class Opt>
zero::test::RunResult train_ranks(int ranks, const zero::Options& options, int steps, bool exact_gathers = true) {
  std::vector<zero::test::RunResult> results(static_cast<std::size_t>(ranks));
  zero::comm::LocalGroup group(ranks);
  zero::test::TrainSpec spec;
  spec.steps = steps;
  spec.parts = ranks;
  spec.check_acquired = exact_gathers;  // (qwZ's gathers are quantized)
  group.run([&](zero::comm::Local& c) {
    zero::test::late_copies() = {};
    results[static_cast<std::size_t>(c.rank())] =
        zero::test::train<Opt>(c, zero::test::test_hyper<typename Opt::optimizer_policy>(), options, spec);
  });
  return results[0];
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("offload::Nvme trains bit for bit like state in memory", "[offload][nvme]", Configs) {
  using P = typename TestType::Precision;
  using O = typename TestType::Optimizer;
  constexpr int S = TestType::stage;
  using HostNvme = zero::ZeroOptimizer<P, O, zero::stage<S>, zero::offload::Nvme, zero::backend::Host>;
  using HostNone = zero::ZeroOptimizer<P, O, zero::stage<S>, zero::offload::None, zero::backend::Host>;
  using DeviceNvme = zero::ZeroOptimizer<P, O, zero::stage<S>, zero::offload::Nvme, zero::backend::LateCopies>;
  const zero::test::Variant variants[] = {
      {"accumulate 2 + clip, one unit per bucket", 2, 0.05, zero::ReduceDType::same_as_grad,
       zero::test::one_unit_bucket},
      {"whole model per bucket", 1, 0.0, zero::ReduceDType::same_as_grad, zero::test::whole_model_bucket}};
  for (const int ranks : {1, 2, 4}) {
    for (const auto& v : variants) {
      INFO("stage " << S << ", " << ranks << " rank(s), " << v.name);
      TempDir dir;
      const zero::Options options = nvme_options(v, dir.path.string(), O::state_slots);
      const auto want = train_ranks<HostNone>(ranks, options, 3);
      const auto on_host = train_ranks<HostNvme>(ranks, options, 3);
      CHECK(on_host.masters == want.masters);
      CHECK(on_host.params == want.params);
      // Master and state are on disk, the window on the host.
      const std::uint64_t owned_fp32 = want.memory.optimizer_states / O::state_slots;  // bytes of one array
      CHECK(on_host.memory.placed.master.disk == owned_fp32);
      CHECK(on_host.memory.placed.optimizer_states.disk == want.memory.optimizer_states);
      CHECK(on_host.memory.placed.master.host + on_host.memory.placed.master.device == 0);
      const auto on_device = train_ranks<DeviceNvme>(ranks, options, 3);
      CHECK(on_device.masters == want.masters);
      CHECK(on_device.params == want.params);
      CHECK(dir.files() == 0);  // every swap file removed with its optimizer
    }
  }
}

TEST_CASE("offload::Nvme: peak memory stays near the window while the state is many times it",
          "[offload][nvme][memory]") {
  // In a child process, so its peak resident memory (VmHWM) is this run's.
  TempDir dir;
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    int code = 0;
    try {
      using Opt = zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<1>, zero::offload::Nvme, zero::backend::Host>;
      constexpr std::size_t params = 48, per_param = std::size_t{1} << 18;  // 12.6 M parameters
      zero::Options options;
      options.nvme.directory = dir.path.string();
      options.nvme.window_bytes = std::size_t{6} << 20;
      auto hwm = [] {
        std::ifstream status("/proc/self/status");
        std::string line;
        while (std::getline(status, line))
          if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
        return 0ull;
      };
      const unsigned long long before = hwm();
      zero::comm::LocalGroup group(1);
      group.run([&](zero::comm::Local& c) {
        Opt opt(c, zero::test::test_hyper<AdamW>(), options);
        std::vector<zero::ParamId> ids;
        for (std::size_t p = 0; p < params; ++p)
          ids.push_back(opt.add_param(opt.add_unit("u" + std::to_string(p)), "w" + std::to_string(p), per_param));
        opt.finalize();
        std::vector<float> values(per_param);
        for (std::size_t p = 0; p < params; ++p) {
          for (std::size_t i = 0; i < per_param; ++i) values[i] = zero::test::init_value(p, i);
          opt.set_param(ids[p], values.data());
        }
        for (int step = 0; step < 2; ++step) {
          for (std::size_t u = params; u-- > 0;) {
            bf16* g = opt.grad_buffer(zero::UnitId{u});
            for (std::size_t i = 0; i < per_param; ++i) g[i] = zero::from_float<bf16>(0.001f * (i % 5));
            opt.grad_ready(zero::UnitId{u});
          }
          opt.step();
        }
        const zero::MemoryReport m = opt.memory_report();
        const unsigned long long grew = hwm() - before;
        const unsigned long long state = m.placed.master.disk + m.placed.optimizer_states.disk;
        const unsigned long long in_memory = m.placed.total().host;  // parameters, gradient, window
        std::printf("offload::Nvme: state %.1f MiB on disk, window %.1f MiB, host buffers %.1f MiB, peak grew by "
                    "%.1f MiB\n",
                    state / 1048576.0, options.nvme.window_bytes / 1048576.0, in_memory / 1048576.0,
                    grew / 1048576.0);
        // Everything resident is what the report lists in host memory plus
        // this test's own vectors and the runtime (16 MiB); the state is not.
        // (AddressSanitizer's shadow memory and quarantine add their own:
        // there only the state's absence is checked.)
        const bool bounded = kUnderAddressSanitizer ? grew < state
                                                    : grew <= in_memory + (16u << 20) && grew < state / 2;
        if (!(state >= 10 * options.nvme.window_bytes && bounded)) code = 1;
      });
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      code = 2;
    }
    std::fflush(stdout);
    std::_Exit(code);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(dir.files() == 0);
}

namespace {
using OneRank = zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<2>, zero::offload::Nvme, zero::backend::Host>;

// One rank, two units, a step; `between` runs after the first step.
template <class Between>
std::vector<std::string> run_with_fault(const zero::Options& options, Between between) {
  std::vector<std::string> errors;
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& c) {
    try {
      OneRank opt(c, zero::test::test_hyper<AdamW>(), options);
      opt.add_param(opt.add_unit("a"), "w", 5000);
      opt.add_param(opt.add_unit("b"), "v", 7000);
      opt.finalize();
      auto step = [&] {
        for (std::size_t u = 2; u-- > 0;) {
          bf16* g = opt.grad_buffer(zero::UnitId{u});
          for (std::size_t i = 0; i < opt.layout().units()[u].numel; ++i) g[i] = zero::from_float<bf16>(0.01f);
          opt.grad_ready(zero::UnitId{u});
        }
        opt.step();
      };
      step();
      between();
      for (int k = 0; k < 2; ++k) {
        try {
          step();
        } catch (const zero::Error& e) {
          errors.push_back(e.what());
        }
      }
    } catch (const zero::Error& e) {
      errors.push_back(e.what());
    }
  });
  return errors;
}
}  // namespace

TEST_CASE("offload::Nvme: disk faults are errors naming the file, and training stops", "[offload][nvme][errors]") {
  TempDir dir;
  zero::Options options;
  options.nvme.directory = dir.path.string();
  options.nvme.window_bytes = 3 * 4096 * 3;  // 1024-element chunks: each step reads and writes the file
  SECTION("a missing directory") {
    options.nvme.directory = (dir.path / "missing").string();
    const auto errors = run_with_fault(options, [] {});
    REQUIRE(errors.size() == 1);
    CHECK_THAT(errors[0], Catch::Contains("missing"));
  }
  SECTION("no directory at all") {
    options.nvme.directory.clear();
    const auto errors = run_with_fault(options, [] {});
    REQUIRE(errors.size() == 1);
    CHECK_THAT(errors[0], Catch::Contains("Options::nvme.directory"));
  }
  SECTION("the swap file truncated underneath") {
    const auto errors = run_with_fault(options, [&] {
      for (const auto& f : fs::directory_iterator(dir.path)) fs::resize_file(f.path(), 4096);
    });
    REQUIRE(errors.size() == 2);
    CHECK_THAT(errors[0], Catch::Contains(dir.path.string()) && Catch::Contains("zero-swap"));
    // Every later step refuses instead of training on partial state.
    CHECK_THAT(errors[1], Catch::Contains("failed earlier"));
  }
  SECTION("the swap file changed underneath") {
    const auto errors = run_with_fault(options, [&] {
      for (const auto& f : fs::directory_iterator(dir.path)) {
        std::fstream file(f.path(), std::ios::in | std::ios::out | std::ios::binary);
        file.seekp(100);
        file.put('\x7f');
      }
    });
    REQUIRE(errors.size() == 2);
    CHECK_THAT(errors[0], Catch::Contains("zero-swap"));
  }
  CHECK(dir.files() == 0);
}

TEST_CASE("offload::Nvme: option errors name Options::nvme, and the window's minimum is the one checked",
          "[offload][nvme][errors]") {
  TempDir dir;
  zero::Options options;
  options.nvme.directory = dir.path.string();
  // The disk options are checked by the swap file's own code, which named
  // them zero::offload::DiskOptions::..., a struct the engine's users never set.
  options.nvme.block_bytes = 1000;
  auto errors = run_with_fault(options, [] {});
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0], Catch::StartsWith("Options::nvme.block_bytes = 1000 is not a positive multiple of 4096") &&
                            !Catch::Contains("DiskOptions"));
  options.nvme.block_bytes = std::size_t{1} << 20;
  options.nvme.queue_depth = 0;
  errors = run_with_fault(options, [] {});
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0], Catch::StartsWith("Options::nvme.queue_depth = 0 is outside 1..4096"));
  options.nvme.queue_depth = 16;
  options.nvme.directory = (dir.path / "missing").string();
  errors = run_with_fault(options, [] {});
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0], Catch::Contains("or set Options::nvme.directory to an existing directory"));
  options.nvme.directory = dir.path.string();
  // The window: 12 KiB passes the options' check (no optimizer has fewer
  // arrays), AdamW's three arrays need 36 KiB, and the message says so
  // (it asked for "64 MiB or more" while accepting 12 KiB).
  options.nvme.window_bytes = std::size_t{3} * 4096 - 1;
  CHECK_THROWS_WITH(options.validate(),
                    Catch::StartsWith("Options::nvme.window_bytes is 12287 (master fp32, states fp32); the window "
                                      "holds three chunks") &&
                        Catch::Contains("it must be at least 3 x 1024 x (4 + 4 x the optimizer's state slots) bytes: "
                                        "12 KiB without state slots, 24 KiB for one, 36 KiB for two (Adam's)"));
  options.nvme.window_bytes = std::size_t{3} * 4096;
  CHECK_NOTHROW(options.validate());
  errors = run_with_fault(options, [] {});
  REQUIRE(errors.size() == 1);
  CHECK(errors[0] == "offload::Nvme: Options::nvme.window_bytes is 12288 (adamw, master fp32, states fp32); the "
                     "window holds three chunks (read ahead, update, write behind) of whole 4 KiB blocks of every "
                     "array, so a chunk is at least 1024 elements (one block of the narrowest array's 4-byte "
                     "elements), and an element takes 4 bytes of master and 4 of each state slot (2 here): it must be "
                     "at least 36864 bytes (36 KiB); 64 MiB (the default) streams well");
  options.nvme.window_bytes = std::size_t{3} * 4096 * 3;
  CHECK(run_with_fault(options, [] {}).empty());
  CHECK(dir.files() == 0);
}

// The least window follows the formats, not the slots alone: a chunk is one
// 4 KiB block of the narrowest array, and every array holds as many
// elements. The messages said "36 KiB for Adam" and "chunks of at least 4
// KiB" whatever the formats, where 8-bit states with an fp32 master need 72.
TEST_CASE("offload::Nvme: the window's minimum and its messages follow the master's and the states' formats",
          "[offload][nvme][errors]") {
  using zero::MasterWeights;
  using zero::StateFormat;
  struct Case {
    MasterWeights master;
    StateFormat states;
    std::size_t chunk, adam_kib;  // the least chunk (elements) and AdamW's least window
  };
  for (const Case c : {Case{MasterWeights::fp32, StateFormat::fp32, 1024, 36},
                       Case{MasterWeights::fp32, StateFormat::bf16, 2048, 48},
                       Case{MasterWeights::fp32, StateFormat::blockwise8, 4096, 72},
                       Case{MasterWeights::remainder, StateFormat::fp32, 2048, 60},
                       Case{MasterWeights::remainder, StateFormat::bf16, 2048, 36},
                       Case{MasterWeights::remainder, StateFormat::blockwise8, 4096, 48}}) {
    INFO("master " << zero::name(c.master) << ", states " << zero::name(c.states));
    const std::size_t mb = zero::master_element_bytes(c.master), sb = zero::state_element_bytes(c.states);
    const std::size_t least = zero::offload::disk_least_window_bytes(AdamW::state_slots, mb, sb);
    REQUIRE(least == c.adam_kib * 1024);
    const std::string rule = zero::offload::disk_window_rule(AdamW::state_slots, mb, sb);
    CHECK_THAT(rule, Catch::Contains("a chunk is at least " + std::to_string(c.chunk) + " elements") &&
                         Catch::EndsWith("it must be at least " + std::to_string(least) + " bytes (" +
                                         std::to_string(c.adam_kib) + " KiB)"));
    // Options::validate, which does not know the optimizer: the figure for two slots is AdamW's.
    zero::Options options;
    options.master = c.master;
    options.states = c.states;
    options.nvme.window_bytes = zero::offload::disk_least_window_bytes(0, mb, sb) - 1;
    CHECK_THROWS_WITH(options.validate(), Catch::Contains(std::to_string(c.adam_kib) + " KiB for two (Adam's)"));
    options.nvme.window_bytes = least - 1;
    CHECK_NOTHROW(options.validate());
    // The planner's schedule says the same as the store.
    const zero::RunShape run{.stage = zero::stage_rules(2),
                             .offload = zero::OffloadTier::nvme,
                             .precision = zero::PrecisionChoice::bf16,
                             .state_slots = AdamW::state_slots};
    CHECK_THROWS_WITH(zero::require_valid_schedule(run, options), Catch::EndsWith(rule));
    options.nvme.window_bytes = least;
    CHECK_NOTHROW(zero::require_valid_schedule(run, options));
  }
  // The store at finalize: 8-bit states with an fp32 master, a window that
  // held AdamW's fp32 arrays (36 KiB, then 48 KiB: what the options let through).
  TempDir dir;
  zero::Options options;
  options.nvme.directory = dir.path.string();
  options.states = StateFormat::blockwise8;
  options.nvme.window_bytes = std::size_t{36} << 10;
  CHECK_THROWS_WITH(options.validate(), Catch::Contains("48 KiB without state slots, 60 KiB for one, 72 KiB for two"));
  options.nvme.window_bytes = std::size_t{48} << 10;
  auto errors = run_with_fault(options, [] {});
  REQUIRE(errors.size() == 1);
  CHECK(errors[0] == "offload::Nvme: Options::nvme.window_bytes is 49152 (adamw, master fp32, states blockwise8); "
                     "the window holds three chunks (read ahead, update, write behind) of whole 4 KiB blocks of every "
                     "array, so a chunk is at least 4096 elements (one block of the narrowest array's 1-byte "
                     "elements), and an element takes 4 bytes of master and 1 of each state slot (2 here): it must be "
                     "at least 73728 bytes (72 KiB); 64 MiB (the default) streams well");
  options.nvme.window_bytes = std::size_t{72} << 10;
  CHECK(run_with_fault(options, [] {}).empty());
  CHECK(dir.files() == 0);
}

// A checkpoint's import comes a unit and a slot at a time
// (checkpoint/optimizer_io.hpp). Each record it changes is written when its
// window slot is reused, not after every call, so loading writes the state
// about once per slot instead of once per unit and slot; and what was
// imported reads back exactly, from the window or from the file.
TEST_CASE("offload::Nvme: an import writes a record when it leaves the window, not after every call",
          "[offload][nvme]") {
  TempDir dir;
  zero::NvmeOptions nvme;
  nvme.directory = dir.path.string();
  nvme.window_bytes = std::size_t{3} * 4096 * 3;  // 1024-element records
  zero::offload::DiskStateStore<AdamW> store;
  store.configure(nvme, 0);
  constexpr std::size_t owned = 10 * 1024 + 300, piece = 100;
  store.allocate(owned, zero::MasterWeights::fp32, zero::StateFormat::fp32, zero::StateBlocks{});
  const std::size_t records = (owned + store.chunk_elements() - 1) / store.chunk_elements();
  REQUIRE(records >= 10);
  const std::uint64_t record_bytes = store.chunk_elements() * 3 * sizeof(float);
  std::vector<float> values[3];
  for (int a = 0; a < 3; ++a) {
    values[a].resize(owned);
    for (std::size_t i = 0; i < owned; ++i) values[a][i] = static_cast<float>(a * 100000 + static_cast<int>(i)) * 0.25f;
  }
  auto slot = [](int a) { return a == 0 ? zero::StateSlot{} : zero::StateSlot{a - 1}; };
  for (int a = 0; a < 3; ++a)  // slot by slot, as a checkpoint's arrays are read
    for (std::size_t at = 0; at < owned; at += piece)
      store.import_values(slot(a), at, values[a].data() + at, std::min(piece, owned - at), static_cast<float*>(nullptr));
  // Once per slot at most (each pass over the records evicts them all);
  // written after every call it was a record per piece and slot, and two
  // for a piece across records: 348 records here.
  CHECK(store.swap().bytes_written() <= 3 * records * record_bytes);
  // And at least every record a pass evicted went to the file (a pass
  // leaves at most the window's three behind).
  CHECK(store.swap().bytes_written() >= (3 * records - 3 * 3) * record_bytes);
  for (int a = 0; a < 3; ++a) {
    std::vector<float> back(owned, -1.0f);
    store.export_values(slot(a), 0, back.data(), owned, static_cast<const float*>(nullptr));
    CHECK(back == values[a]);
  }
}

namespace {
using ParamConfigs = std::tuple<Config<3, Mixed<bf16>, AdamW>, Config<3, Full<float>, Adam>, Config<3, Mixed<fp16>, Sgd>>;
}  // namespace

// Options::param_place = disk: stage 3's shards in a file, a few units' pages in
// memory. Nothing but where they live may change: every precision,
// optimizer and rank count trains to the same bits as the shards in memory,
// with the state in memory's tier or on disk, with prefetch from none to
// more than the model has, and with ZeRO++'s gathers.
TEMPLATE_LIST_TEST_CASE("Options::param_place = disk trains bit for bit like shards in memory", "[offload][nvme][params]",
                        ParamConfigs) {
  using P = typename TestType::Precision;
  using O = typename TestType::Optimizer;
  using HostNvme = zero::ZeroOptimizer<P, O, zero::stage<3>, zero::offload::Nvme, zero::backend::Host>;
  using HostNone = zero::ZeroOptimizer<P, O, zero::stage<3>, zero::offload::None, zero::backend::Host>;
  const zero::test::Variant variants[] = {
      {"accumulate 2 + clip, one unit per bucket, no prefetch", 2, 0.05, zero::ReduceDType::same_as_grad,
       zero::test::one_unit_bucket, 0},
      {"whole model per bucket, prefetch 1", 1, 0.0, zero::ReduceDType::same_as_grad, zero::test::whole_model_bucket,
       1},
      {"prefetch 3", 1, 0.0, zero::ReduceDType::same_as_grad, zero::test::whole_model_bucket, 3}};
  for (const int ranks : {1, 2, 4}) {
    for (const auto& v : variants) {
      INFO("stage 3, " << ranks << " rank(s), " << v.name);
      TempDir dir;
      zero::Options options = nvme_options(v, dir.path.string(), O::state_slots);
      const auto want = train_ranks<HostNone>(ranks, options, 3);
      options.param_place = zero::ParamPlace::disk;
      const auto state_on_disk_too = train_ranks<HostNvme>(ranks, options, 3);
      CHECK(state_on_disk_too.masters == want.masters);
      CHECK(state_on_disk_too.params == want.params);
      // The shards on disk, a few pages of them in memory.
      const zero::PlacedBytes& params = state_on_disk_too.memory.placed.params;
      CHECK(params.disk == want.memory.placed.params.host);
      CHECK(params.host > 0);
      CHECK(params.device == 0);
      CHECK(dir.files() == 0);  // the parameter file removed with its optimizer
    }
  }
  SECTION("with ZeRO++'s hpZ and qwZ, and with a remainder master") {
    for (const bool remainder : {false, true}) {
      if (remainder && !std::is_same_v<P, Mixed<bf16>>) continue;
      TempDir dir;
      zero::Options options = nvme_options(zero::test::Variant{"zeropp"}, dir.path.string(), O::state_slots);
      options.hpz = options.qwz = !remainder;
      if (remainder) {
        options.master = zero::MasterWeights::remainder;
        options.nvme.window_bytes = std::size_t{64} << 10;  // a chunk of 2048 2-byte remainders at least
      }
      const auto want = train_ranks<HostNvme>(4, options, 3, !options.qwz);
      options.param_place = zero::ParamPlace::disk;
      const auto got = train_ranks<HostNvme>(4, options, 3, !options.qwz);
      CHECK(got.masters == want.masters);
      CHECK(got.params == want.params);
    }
  }
}

TEST_CASE("Options::param_place = disk: refused where it cannot work, in the words of the one who refuses",
          "[offload][nvme][params][errors]") {
  TempDir dir;
  zero::Options options;
  options.nvme.directory = dir.path.string();
  options.param_place = zero::ParamPlace::disk;
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& c) {
    {  // stage 2 keeps the parameters whole
      zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<2>, zero::offload::Nvme, zero::backend::Host> opt(
          c, zero::test::test_hyper<AdamW>(), options);
      opt.add_param(opt.add_unit("a"), "w", 100);
      CHECK_THROWS_WITH(opt.finalize(), Catch::Contains("Options::param_place is disk") &&
                                            Catch::Contains("use stage<3>") && Catch::Contains("param_place = device"));
    }
    {  // without the disk tier's store in the type
      zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<3>, zero::offload::None, zero::backend::Host> opt(
          c, zero::test::test_hyper<AdamW>(), options);
      opt.add_param(opt.add_unit("a"), "w", 100);
      CHECK_THROWS_WITH(opt.finalize(), Catch::Contains("Options::param_place = disk") &&
                                            Catch::Contains("offload::Nvme") &&
                                            Catch::Contains("disk_state_store.hpp"));
    }
    {  // a device backend: not built yet
      zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<3>, zero::offload::Nvme, zero::backend::LateCopies> opt(
          c, zero::test::test_hyper<AdamW>(), options);
      opt.add_param(opt.add_unit("a"), "w", 100);
      CHECK_THROWS_WITH(opt.finalize(), Catch::Contains("is built for backend::Host so far"));
    }
  });
  // The planner and zero::Config say the same, in their voices.
  zero::Config config;
  config.stage = 2;
  config.options.param_place = zero::ParamPlace::disk;
  CHECK_THROWS_WITH(config.validate(false), Catch::Contains("zero::Config") && Catch::Contains("param_place disk") &&
                                                Catch::Contains("--param-place on the command line"));
}

TEST_CASE("Options::param_place = disk: the planner's rows equal memory_report() to the byte",
          "[offload][nvme][params][plan]") {
  TempDir dir;
  zero::Options options;
  options.nvme.directory = dir.path.string();
  options.nvme.window_bytes = std::size_t{3} * 4096 * 3;
  options.param_place = zero::ParamPlace::disk;
  options.prefetch_units = 2;
  for (const int ranks : {1, 3}) {
    INFO(ranks << " rank(s)");
    std::vector<zero::MemoryReport> reports(static_cast<std::size_t>(ranks));
    zero::comm::LocalGroup group(ranks);
    zero::Layout layout(ranks);
    group.run([&](zero::comm::Local& c) {
      zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<3>, zero::offload::Nvme, zero::backend::Host> opt(
          c, zero::test::test_hyper<AdamW>(), options);
      const std::size_t sizes[] = {3000, 70000, 12345, 5};
      for (std::size_t u = 0; u < 4; ++u)
        opt.add_param(opt.add_unit("u" + std::to_string(u)), "w" + std::to_string(u), sizes[u]);
      opt.finalize();
      reports[static_cast<std::size_t>(c.rank())] = opt.memory_report();
      if (c.rank() == 0) layout = opt.layout();
    });
    for (int r = 0; r < ranks; ++r) {
      const zero::RunShape run{.stage = zero::stage_rules(3),
                               .offload = zero::OffloadTier::nvme,
                               .precision = zero::PrecisionChoice::bf16,
                               .rank = static_cast<std::size_t>(r)};
      const zero::Schedule s = zero::schedule(layout, run, options);
      const zero::MemoryReport::Placement want = s.placement();
      CHECK(reports[static_cast<std::size_t>(r)].placed.params == want.params);
      CHECK(want.params.disk == s.sizes.params * 2);
      CHECK(want.params.host == zero::offload::shard_page_count(2) *
                                    zero::offload::shard_record_bytes(s.sizes.max_shard, 2));
      CHECK(s.line("param_file_padding").disk + want.params.disk == s.sizes.param_file_bytes);
      // The gradient's shards follow them, to a file of their own.
      CHECK(reports[static_cast<std::size_t>(r)].placed.grads == want.grads);
      CHECK(want.grads.disk == s.sizes.grads * 2);
      CHECK(want.grads.host == want.params.host);
      CHECK(s.line("grad_file_padding").disk + want.grads.disk == s.sizes.grad_file_bytes);
    }
  }
}

// Four units of `numel` parameters each, finalized and set to 0.5: the
// parameter file's records, for the fault tests to overwrite.
template <class Opt>
void four_units_set(Opt& opt, std::size_t numel) {
  for (std::size_t u = 0; u < 4; ++u)
    opt.add_param(opt.add_unit("u" + std::to_string(u)), "w" + std::to_string(u), numel);
  opt.finalize();
  const std::vector<float> values(numel, 0.5f);
  for (std::size_t p = 0; p < 4; ++p) opt.set_param(zero::ParamId{p}, values.data());
}

TEST_CASE("Options::param_place = disk: a parameter file changed underneath is an error naming it, not wrong weights",
          "[offload][nvme][params][errors]") {
  TempDir dir;
  zero::Options options;
  options.nvme.directory = dir.path.string();
  options.nvme.window_bytes = std::size_t{3} * 4096 * 3;
  options.param_place = zero::ParamPlace::disk;
  std::vector<std::string> errors;
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& c) {
    zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<3>, zero::offload::Nvme, zero::backend::Host> opt(
        c, zero::test::test_hyper<AdamW>(), options);
    // Four units of 8 KiB: with one unit read ahead, pages for three.
    four_units_set(opt, 4096);
    // Corrupt every parameter record on disk: the next read of each must fail.
    for (const auto& entry : fs::directory_iterator(dir.path)) {
      std::fstream f(entry.path(), std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(100);
      f.write("garbage", 7);
      f.seekp(8192 + 100);
      f.write("garbage", 7);
    }
    for (int k = 0; k < 2; ++k) {
      try {
        for (std::size_t u = 0; u < 4; ++u) {
          opt.acquire_unit(zero::UnitId{u});
          opt.release_unit(zero::UnitId{u});
        }
      } catch (const zero::Error& e) {
        errors.push_back(e.what());
      }
    }
  });
  REQUIRE(errors.size() == 2);  // and the second call fails too: no silent recovery
  CHECK_THAT(errors[0], Catch::Contains(dir.path.string()));
  CHECK(dir.files() == 0);
}

TEST_CASE("Options::param_place = disk: a fault in one rank's file is an error on every rank", "[offload][nvme][params][errors]") {
  TempDir dir;
  zero::Options options;
  options.nvme.directory = dir.path.string();
  options.nvme.window_bytes = std::size_t{3} * 4096 * 3;
  options.param_place = zero::ParamPlace::disk;
  std::vector<std::string> errors(2);
  zero::comm::LocalGroup group(2);
  try {
    group.run([&](zero::comm::Local& c) {
      zero::ZeroOptimizer<Mixed<bf16>, AdamW, zero::stage<3>, zero::offload::Nvme, zero::backend::Host> opt(
          c, zero::test::test_hyper<AdamW>(), options);
      four_units_set(opt, 8192);
      c.barrier();
      // Rank 1's records of every file it has (parameters, gradient, state)
      // overwritten underneath; rank 0's files are intact.
      if (c.rank() == 1)
        for (const auto& entry : fs::directory_iterator(dir.path)) {
          if (entry.path().filename().string().find("-r1-") == std::string::npos) continue;
          std::fstream f(entry.path(), std::ios::in | std::ios::out | std::ios::binary);
          for (std::size_t at = 100; at < fs::file_size(entry.path()); at += 8192) {
            f.seekp(static_cast<std::streamoff>(at));
            f.write("garbage", 7);
          }
        }
      c.barrier();
      try {
        for (std::size_t u = 0; u < 4; ++u) {
          opt.acquire_unit(zero::UnitId{u});
          opt.release_unit(zero::UnitId{u});
        }
      } catch (const zero::Error& e) {
        errors[static_cast<std::size_t>(c.rank())] = e.what();
        throw;
      }
    });
  } catch (const zero::Error&) {
  }
  INFO("rank 0: " << errors[0] << "\nrank 1: " << errors[1]);
  // Rank 1 names its file; rank 0, waiting in the gather, names rank 1.
  CHECK_THAT(errors[1], Catch::Contains(dir.path.string()) && Catch::Contains("zero-swap-r1-"));
  CHECK_THAT(errors[0], Catch::Contains("rank 1"));
  CHECK(dir.files() == 0);
}

TEST_CASE("Options::param_place = disk: the pages read what the last step used next, and give back what was written",
          "[offload][nvme][params][parts]") {
  TempDir dir;
  zero::Options options;
  options.nvme.directory = dir.path.string();
  options.prefetch_units = 2;  // four pages
  zero::Layout layout(1);
  for (std::size_t u = 0; u < 7; ++u)
    layout.add_param(layout.add_unit("u" + std::to_string(u)), "w" + std::to_string(u), 1000 + 3000 * (u % 3));
  layout.finalize(sizeof(float));
  zero::offload::DiskShardPages<bf16> pages(options, 0, layout);
  auto value = [](std::size_t u, std::size_t i, int step) { return zero::from_float<bf16>(float(u * 7 + i % 13 + step)); };
  auto use = [&](std::size_t u, int step) {  // reads the last step's values, writes this step's
    bf16* v = pages.fetch(u);
    const std::size_t n = layout.units()[u].shard;
    bool same = true;
    for (std::size_t i = 0; i < n; ++i) same = same && zero::to_float(v[i]) == zero::to_float(value(u, i, step - 1));
    for (std::size_t i = 0; i < n; ++i) v[i] = value(u, i, step);
    pages.written(u);
    return same;
  };
  for (std::size_t u = 0; u < 7; ++u) {  // "step 0": the values set
    bf16* v = pages.fetch(u);
    for (std::size_t i = 0; i < layout.units()[u].shard; ++i) v[i] = value(u, i, 0);
    pages.written(u);
  }
  pages.end_step();
  // A step's order: forward up, backward down, the update up.
  std::vector<std::size_t> order;
  for (std::size_t u = 0; u < 7; ++u) order.push_back(u);
  for (std::size_t u = 7; u-- > 0;) order.push_back(u);
  for (int step = 1; step <= 3; ++step) {
    INFO("step " << step);
    const auto before = pages.counts();
    bool same = true;
    for (std::size_t k = 0; k < order.size(); ++k) {
      const std::size_t u = order[k];
      // Read-only uses, then the update's: each unit changes once a step.
      if (k < 14) {
        const bf16* v = pages.fetch(u);
        same = same && zero::to_float(v[5]) == zero::to_float(value(u, 5, step - 1));
      }
    }
    for (std::size_t u = 0; u < 7; ++u) same = use(u, step) && same;
    pages.end_step();
    CHECK(same);
    const auto after = pages.counts();
    CHECK(after.fetches - before.fetches == 21);
    // Step 1 follows step 0's order (the values set, alone), so it reads on
    // demand; step 2 follows step 1's, but its first unit was not read ahead
    // (step 1 did not end as steps do); from step 3 on nothing is read on
    // demand: what the read-ahead reads is what is used next, and it never
    // gives up the page of a unit about to be used.
    if (step == 2) CHECK(after.read_on_demand - before.read_on_demand <= 1);
    if (step == 3) CHECK(after.read_on_demand - before.read_on_demand == 0);
  }
  CHECK(pages.page_bytes() == 4 * zero::offload::shard_record_bytes(7000, 2));
}

TEST_CASE("Options::param_place = disk: gradient pages claim what backward overwrites and read ahead what the update "
          "reads", "[offload][nvme][params][parts]") {
  TempDir dir;
  zero::Options options;
  options.nvme.directory = dir.path.string();
  options.prefetch_units = 2;
  zero::Layout layout(1);
  for (std::size_t u = 0; u < 6; ++u)
    layout.add_param(layout.add_unit("u" + std::to_string(u)), "w" + std::to_string(u), 500 + 2000 * (u % 2));
  layout.finalize(sizeof(float));
  zero::offload::DiskShardPages<float> pages(options, 0, layout);
  const auto value = [](std::size_t u, std::size_t i, int step, int micro) { return float(u * 100 + i % 7 + step * 3 + micro); };
  for (int step = 1; step <= 4; ++step) {
    INFO("step " << step);
    const auto before = pages.counts();
    // Two micro-batches of backward (units from the last): the first
    // overwrites each shard (a claim), the second adds to it (a fetch).
    for (int micro = 0; micro < 2; ++micro)
      for (std::size_t u = 6; u-- > 0;) {
        float* g = micro == 0 ? pages.claim(u) : pages.fetch(u);
        for (std::size_t i = 0; i < layout.units()[u].shard; ++i)
          g[i] = micro == 0 ? value(u, i, step, 0) : g[i] + value(u, i, step, 1);
        pages.written(u);
      }
    // The update reads every shard, from the first unit.
    bool sums = true;
    for (std::size_t u = 0; u < 6; ++u) {
      const float* g = pages.fetch(u);
      for (std::size_t i = 0; i < layout.units()[u].shard; ++i)
        sums = sums && g[i] == value(u, i, step, 0) + value(u, i, step, 1);
    }
    pages.end_step();
    CHECK(sums);
    const auto after = pages.counts();
    CHECK(after.claims - before.claims == 6);
    CHECK(after.fetches - before.fetches == 12);
    // Once the order is known, nothing waits for a read it could have
    // started earlier, and no claimed shard is read: each step reads the
    // second micro-batch's six shards and the update's, at most (pages that
    // still hold a shard need no read).
    if (step >= 3) {
      CHECK(after.read_on_demand - before.read_on_demand == 0);
      CHECK(after.reads - before.reads <= 12);
    }
  }
}
