// zero::make_optimizer: the engine a zero::Config names behind AnyOptimizer
// trains exactly as the ZeroOptimizer type of the same choices (masters,
// parameters, reports, bit for bit), its fp32 calls convert as the element
// type's own conversion does, and a bad config is an error naming the
// setting and the fix.
#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include "zero/offload/disk_state_store.hpp"
#include "zero/runtime/make_optimizer.hpp"
#include "zero/zero.hpp"

namespace {

// Three units of odd sizes (alignment gaps and tails inside).
const std::vector<std::vector<std::size_t>> kModel = {{37, 5}, {130}, {17, 3, 64}};

struct Outcome {
  std::vector<float> masters;
  std::vector<float> params;  // as fp32
  zero::MemoryReport memory;
  zero::comm::ByteCounters counters;
  std::int64_t steps = 0;
};

float init_value(std::size_t unit, std::size_t param, std::size_t i) {
  return 0.01f * static_cast<float>((unit * 131 + param * 17 + i * 7) % 23) - 0.1f;
}
// The gradient of element i of a unit: a function of the parameter (so the
// trajectory depends on the update) and of the rank and step.
float grad_value(float w, std::size_t i, int rank, int step) {
  return 0.125f * w + 0.001f * static_cast<float>((static_cast<int>(i) * 3 + rank * 5 + step) % 11) - 0.005f;
}

// Registers kModel, sets it, trains `steps` micro-batches through `unit_io`:
// (opt, unit) -> {params as fp32 pointer, write fp32 gradient}.
template <class Opt, class Acquire, class Write>
Outcome train(Opt& opt, int steps, Acquire&& acquire, Write&& write_grad) {
  std::vector<zero::UnitId> units;
  std::vector<std::vector<zero::ParamId>> params(kModel.size());
  for (std::size_t u = 0; u < kModel.size(); ++u) {
    units.push_back(opt.add_unit("unit" + std::to_string(u)));
    for (std::size_t p = 0; p < kModel[u].size(); ++p)
      params[u].push_back(opt.add_param(units[u], "u" + std::to_string(u) + ".p" + std::to_string(p), kModel[u][p]));
  }
  opt.finalize();
  for (std::size_t u = 0; u < kModel.size(); ++u)
    for (std::size_t p = 0; p < kModel[u].size(); ++p) {
      std::vector<float> v(kModel[u][p]);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = init_value(u, p, i);
      opt.set_param(params[u][p], v.data());
    }
  const zero::Layout& layout = opt.layout();
  for (int step = 0; step < steps; ++step) {
    std::vector<std::vector<float>> seen(kModel.size());
    for (std::size_t u = 0; u < kModel.size(); ++u) {  // forward
      const float* w = acquire(opt, units[u]);
      seen[u].assign(w, w + layout.units()[u].numel);
      opt.release_unit(units[u]);
    }
    for (std::size_t u = kModel.size(); u-- > 0;) {  // backward
      acquire(opt, units[u]);
      std::vector<float> g(layout.units()[u].padded, 0.0f);
      for (std::size_t i = 0; i < seen[u].size(); ++i) g[i] = grad_value(seen[u][i], i, opt.rank(), step);
      write_grad(opt, units[u], g);
      opt.grad_ready(units[u]);
      opt.release_unit(units[u]);
    }
    opt.step();
  }
  Outcome out;
  out.masters.resize(layout.padded_total());
  opt.gather_masters(out.masters.data());
  out.memory = opt.memory_report();
  out.counters = opt.comm_report().counters;
  out.steps = opt.step_count();
  return out;
}

// A typed ZeroOptimizer, its element type converted by hand (zero::to_float / from_float).
template <class Opt>
Outcome train_typed(zero::comm::Local& c, const typename Opt::Hyper& hyper, const zero::Options& options, int steps) {
  using T = typename Opt::param_type;
  Opt opt(c, hyper, options);
  std::vector<float> wide;
  Outcome out = train(
      opt, steps,
      [&](Opt& o, zero::UnitId u) {
        const T* p = o.acquire_unit(u);
        wide.resize(o.layout().units()[u.index].padded);
        for (std::size_t i = 0; i < wide.size(); ++i) wide[i] = zero::to_float(p[i]);
        return static_cast<const float*>(wide.data());
      },
      [&](Opt& o, zero::UnitId u, const std::vector<float>& g) {
        T* dst = o.grad_buffer(u);
        const auto& info = o.layout().units()[u.index];
        for (std::size_t i = 0; i < info.numel; ++i) dst[i] = zero::from_float<T>(g[i]);
      });
  std::vector<T> params(opt.layout().padded_total());
  opt.gather_params(params.data());
  for (const T v : params) out.params.push_back(zero::to_float(v));
  return out;
}

// The same choices through make_optimizer and its fp32 calls; `after`
// gets the optimizer once trained.
Outcome train_any(zero::comm::Local& c, const zero::Config& config, int steps,
                  const std::function<void(zero::AnyOptimizer&)>& after = {}) {
  auto opt = zero::make_optimizer<zero::backend::Host, zero::offload::Nvme>(c, config);
  Outcome out = train(
      *opt, steps, [](zero::AnyOptimizer& o, zero::UnitId u) { return o.acquire_fp32(u); },
      [](zero::AnyOptimizer& o, zero::UnitId u, const std::vector<float>& g) {
        float* dst = o.grad_buffer_fp32(u);
        std::memcpy(dst, g.data(), o.layout().units()[u.index].numel * sizeof(float));
      });
  out.params.resize(opt->layout().padded_total());
  opt->gather_params_fp32(out.params.data());
  if (after) after(*opt);
  return out;
}

void require_same(const Outcome& a, const Outcome& b) {
  REQUIRE(a.steps == b.steps);
  REQUIRE(a.masters.size() == b.masters.size());
  REQUIRE(std::memcmp(a.masters.data(), b.masters.data(), a.masters.size() * sizeof(float)) == 0);
  REQUIRE(a.params.size() == b.params.size());
  REQUIRE(std::memcmp(a.params.data(), b.params.data(), a.params.size() * sizeof(float)) == 0);
  CHECK(a.memory.to_json() == b.memory.to_json());
  CHECK(a.counters.sent == b.counters.sent);  // per collective kind, bytes and calls
  CHECK(a.counters.received == b.counters.received);
  CHECK(a.counters.calls == b.counters.calls);
}

template <class Precision, int Stage, class Offload>
void compare(zero::PrecisionChoice precision, const std::string& dir) {
  using Opt = zero::ZeroOptimizer<Precision, zero::optim::AdamW, zero::stage<Stage>, Offload>;
  zero::Config config;
  config.precision = precision;
  config.optimizer = "adamw";
  config.hyper["lr"] = 1e-2;
  config.stage = Stage;
  config.offload = zero::offload_tier<Offload>();
  config.options.grad_accumulation_steps = 2;
  config.options.bucket_bytes = 256;
  config.options.nvme.directory = dir;
  typename Opt::Hyper hyper;
  hyper.lr = 1e-2;
  INFO("stage " << Stage << ", " << zero::name(precision) << ", offload " << zero::name(config.offload));
  const int ranks = 3;
  std::vector<Outcome> typed(ranks), any(ranks);
  zero::comm::LocalGroup group(ranks);
  group.run([&](zero::comm::Local& c) { typed[c.rank()] = train_typed<Opt>(c, hyper, config.options, 6); });
  group.run([&](zero::comm::Local& c) { any[c.rank()] = train_any(c, config, 6); });
  for (int r = 0; r < ranks; ++r) require_same(typed[r], any[r]);
  REQUIRE(typed[0].steps == 3);
}

std::string temp_dir() {
  const auto dir = std::filesystem::temp_directory_path() / ("zero_make_optimizer_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

template <class Thrown>
std::string error_of(const zero::Config& config) {
  zero::comm::LocalGroup group(1);
  std::string what;
  group.run([&](zero::comm::Local& c) {
    try {
      auto opt = zero::make_optimizer<zero::backend::Host>(c, config);
    } catch (const Thrown& e) {
      what = e.what();
    }
  });
  return what;
}

}  // namespace

TEST_CASE("make_optimizer trains as the ZeroOptimizer type of the same choices, bit for bit", "[runtime]") {
  const std::string dir = temp_dir();
  using F32 = zero::precision::Full<float>;
  using B16 = zero::precision::Mixed<zero::bf16>;
  using F16 = zero::precision::Mixed<zero::fp16>;
  using zero::PrecisionChoice;
  compare<F32, 0, zero::offload::None>(PrecisionChoice::fp32, dir);
  compare<B16, 0, zero::offload::None>(PrecisionChoice::bf16, dir);
  compare<F32, 1, zero::offload::None>(PrecisionChoice::fp32, dir);
  compare<F16, 1, zero::offload::None>(PrecisionChoice::fp16, dir);
  compare<B16, 2, zero::offload::None>(PrecisionChoice::bf16, dir);
  compare<F16, 2, zero::offload::None>(PrecisionChoice::fp16, dir);
  compare<F32, 3, zero::offload::None>(PrecisionChoice::fp32, dir);
  compare<B16, 3, zero::offload::None>(PrecisionChoice::bf16, dir);
  compare<F32, 1, zero::offload::Nvme>(PrecisionChoice::fp32, dir);
  compare<B16, 2, zero::offload::Nvme>(PrecisionChoice::bf16, dir);
  compare<F16, 3, zero::offload::Nvme>(PrecisionChoice::fp16, dir);
  std::filesystem::remove_all(dir);
}

TEST_CASE("make_optimizer: what it made, typed views and hyper-parameters by name", "[runtime]") {
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& c) {
    zero::Config config;
    config.precision = zero::PrecisionChoice::bf16;
    config.optimizer = "sgd";
    config.hyper = {{"lr", 0.5}, {"momentum", 0.9}};
    config.stage = 2;
    auto opt = zero::make_optimizer(c, config);
    CHECK(opt->stage() == 2);
    CHECK(opt->param_dtype() == zero::DType::bf16);
    CHECK(std::string(opt->optimizer_name()) == "sgd");
    CHECK(opt->lr() == 0.5);
    CHECK(opt->hyper_value("momentum") == 0.9);
    opt->set_lr(0.25);
    CHECK(opt->lr() == 0.25);
    CHECK_THROWS_WITH(opt->hyper_value("beta1"), Catch::Contains("no hyper-parameter 'beta1'"));
    const auto u = opt->add_unit("u");
    opt->add_param(u, "w", 10);
    opt->finalize();
    CHECK(opt->acquire_unit_as<zero::bf16>(u) != nullptr);
    opt->release_unit(u);
    CHECK_THROWS_WITH(opt->acquire_unit_as<float>(u), Catch::Contains("keeps its parameters and gradients in bf16"));
  });
}

// torch.optim.SGD keeps no momentum buffer at momentum 0; neither does
// "sgd" made with momentum 0 (optim::PlainSgd). Before, the handle kept a
// 4-byte slot per parameter that nothing read, and reported it.
TEST_CASE("make_optimizer: sgd made with momentum 0 keeps no momentum buffer", "[runtime]") {
  const std::string dir = temp_dir() + "/plain_sgd";
  using F32 = zero::precision::Full<float>;
  zero::Config config;
  config.precision = zero::PrecisionChoice::fp32;
  config.optimizer = "sgd";
  config.hyper = {{"lr", 0.1}, {"weight_decay", 0.01}};
  config.stage = 1;
  const int ranks = 2;
  std::vector<Outcome> plain(ranks), kept(ranks);
  zero::comm::LocalGroup group(ranks);
  const zero::optim::Sgd::Hyper hyper{.lr = 0.1, .weight_decay = 0.01};
  group.run([&](zero::comm::Local& c) {
    kept[c.rank()] =
        train_typed<zero::ZeroOptimizer<F32, zero::optim::Sgd, zero::stage<1>>>(c, hyper, config.options, 4);
  });
  group.run([&](zero::comm::Local& c) {
    plain[c.rank()] = train_any(c, config, 4, [&](zero::AnyOptimizer& o) {
      CHECK_THROWS_WITH(o.set_hyper("momentum", 0.9), Catch::Contains("keeps no momentum buffer"));
      CHECK(o.hyper_value("momentum") == 0.0);
      o.save(dir);
    });
  });
  for (int r = 0; r < ranks; ++r) {
    // The same steps as the slot-keeping policy at momentum 0, bit for bit.
    REQUIRE(plain[r].masters.size() == kept[r].masters.size());
    CHECK(std::memcmp(plain[r].masters.data(), kept[r].masters.data(), plain[r].masters.size() * sizeof(float)) == 0);
    CHECK(plain[r].params == kept[r].params);
    // fp32 parameters are their own master: the state was the whole optimizer-only memory.
    const zero::MemoryReport& p = plain[r].memory;
    const zero::MemoryReport& k = kept[r].memory;
    CHECK(p.optimizer_states == 0);
    CHECK(k.optimizer_states == 4 * (k.padded_elements / ranks));
    CHECK(p.params == k.params);
    CHECK(p.grads == k.grads);
  }
  // Its checkpoint holds no momentum: a run with momentum cannot resume
  // from it, and says why; a run made as it was resumes.
  auto add_model = [](zero::AnyOptimizer& o) {
    for (std::size_t u = 0; u < kModel.size(); ++u) {
      const auto unit = o.add_unit("unit" + std::to_string(u));
      for (std::size_t p = 0; p < kModel[u].size(); ++p)
        o.add_param(unit, "u" + std::to_string(u) + ".p" + std::to_string(p), kModel[u][p]);
    }
    o.finalize();
  };
  group.run([&](zero::comm::Local& c) {
    zero::Config with_momentum = config;
    with_momentum.hyper["momentum"] = 0.9;
    auto opt = zero::make_optimizer(c, with_momentum);
    add_model(*opt);
    CHECK_THROWS_WITH(opt->load(dir), Catch::Contains("has no state slot 'momentum'") &&
                                          Catch::Contains("SGD made with momentum 0 keeps no 'momentum'"));
    auto same = zero::make_optimizer(c, config);
    add_model(*same);
    same->load(dir);
    CHECK(same->step_count() == 4);
    std::vector<float> masters(same->layout().padded_total());
    same->gather_masters(masters.data());
    CHECK(std::memcmp(masters.data(), plain[c.rank()].masters.data(), masters.size() * sizeof(float)) == 0);
  });
  std::filesystem::remove_all(dir);
}

// The README says the handle has ZeroOptimizer's calls: gather_params and
// param_data were missing. Untyped, typed (checked) and fp32, as the
// handle's other calls, and the same values as the typed optimizer's.
template <class Precision, int Stage>
void check_gather_params_and_param_data(zero::PrecisionChoice precision) {
  using T = typename Precision::param_type;
  using Opt = zero::ZeroOptimizer<Precision, zero::optim::AdamW, zero::stage<Stage>>;
  INFO("stage " << Stage << ", " << zero::name(precision));
  zero::Config config;
  config.precision = precision;
  config.stage = Stage;
  // Code written against ZeroOptimizer's calls compiles against the handle:
  // register, set, gather, and point at a parameter inside its acquired unit.
  auto use = [](auto& opt, std::vector<T>& gathered, std::vector<T>& in_unit) {
    const auto u = opt.add_unit("u");
    opt.add_param(u, "u.a", 37);
    const auto b = opt.add_param(u, "u.b", 70);
    opt.finalize();
    std::vector<float> values(70);
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.03125f * static_cast<float>(i) - 1.0f;
    opt.set_param(b, values.data());
    gathered.resize(opt.layout().padded_total());
    opt.gather_params(gathered.data());
    opt.acquire_unit(u);
    const auto* p = opt.param_data(b);
    in_unit.assign(static_cast<const T*>(p), static_cast<const T*>(p) + 70);
    opt.release_unit(u);
  };
  const int ranks = 2;
  std::vector<std::vector<T>> typed_all(ranks), typed_b(ranks), any_all(ranks), any_b(ranks);
  zero::comm::LocalGroup group(ranks);
  group.run([&](zero::comm::Local& c) {
    Opt typed(c, {});
    use(typed, typed_all[c.rank()], typed_b[c.rank()]);
    auto any = zero::make_optimizer(c, config);
    use(*any, any_all[c.rank()], any_b[c.rank()]);

    const zero::ParamId b{1};
    const auto u = zero::UnitId{0};
    const std::size_t offset = any->layout().param(b).offset;
    // Typed forms: the element type checked, as acquire_unit_as.
    std::vector<T> as(any->layout().padded_total());
    any->gather_params_as<T>(as.data());
    CHECK(as == any_all[c.rank()]);
    std::vector<float> wide(any->layout().padded_total());
    any->gather_params_fp32(wide.data());
    for (std::size_t i = 0; i < wide.size(); ++i) REQUIRE(wide[i] == zero::to_float(as[i]));
    if constexpr (std::is_same_v<T, float>) {
      CHECK_THROWS_WITH(any->gather_params_as<zero::bf16>(reinterpret_cast<zero::bf16*>(wide.data())),
                        Catch::Contains("gather_params_as<bf16>: this optimizer keeps its parameters and gradients "
                                        "in fp32"));
    } else {
      CHECK_THROWS_WITH(any->gather_params_as<float>(wide.data()),
                        Catch::Contains("gather_params_as<fp32>: this optimizer keeps its parameters and gradients in "
                                        "bf16; use that type, or the fp32 calls (acquire_fp32, param_data_fp32, "
                                        "grad_buffer_fp32, gather_params_fp32)"));
      CHECK_THROWS_WITH(any->param_data_as<float>(b), Catch::Contains("param_data_as<fp32>"));
    }
    // param_data_fp32 points into acquire_fp32's copy of the unit, at every
    // precision, and only while that copy is valid.
    CHECK_THROWS_WITH(any->param_data_fp32(b), Catch::Contains("param_data_fp32('u.b'): acquire_fp32('u') first"));
    const float* unit = any->acquire_fp32(u);
    const float* p = any->param_data_fp32(b);
    CHECK(p == unit + offset);
    const T* stored = any->param_data_as<T>(b);
    CHECK(static_cast<const void*>(stored) == any->param_data(b));
    if constexpr (std::is_same_v<T, float>) CHECK(p == stored);  // fp32 storage: the engine's own buffer
    for (std::size_t i = 0; i < 70; ++i) {
      REQUIRE(stored[i] == any_b[c.rank()][i]);
      REQUIRE(p[i] == zero::to_float(stored[i]));
    }
    any->release_unit(u);
    CHECK_THROWS_WITH(any->param_data_fp32(b), Catch::Contains("acquire_fp32('u') first"));
    CHECK_THROWS_WITH(any->param_data_fp32(zero::ParamId{7}), Catch::Contains("parameter id 7 does not exist"));
    if (Stage == 3) {
      CHECK_THROWS_WITH(any->param_data(b), Catch::Contains("acquire_unit('u') first"));
    }
  });
  for (int r = 0; r < ranks; ++r) {
    CHECK(typed_all[r] == any_all[r]);
    CHECK(typed_b[r] == any_b[r]);
  }
}

TEST_CASE("make_optimizer: gather_params and param_data, untyped, typed and fp32, as ZeroOptimizer's",
          "[runtime]") {
  using zero::PrecisionChoice;
  check_gather_params_and_param_data<zero::precision::Full<float>, 0>(PrecisionChoice::fp32);
  check_gather_params_and_param_data<zero::precision::Full<float>, 3>(PrecisionChoice::fp32);
  check_gather_params_and_param_data<zero::precision::Mixed<zero::bf16>, 1>(PrecisionChoice::bf16);
  check_gather_params_and_param_data<zero::precision::Mixed<zero::bf16>, 3>(PrecisionChoice::bf16);
}

TEST_CASE("make_optimizer: the fp32 calls over 16-bit storage check an overwriting backward too", "[runtime]") {
  for (const auto precision : {zero::PrecisionChoice::bf16, zero::PrecisionChoice::fp32}) {
    INFO(zero::name(precision));
    zero::comm::LocalGroup group(1);
    group.run([&](zero::comm::Local& c) {
      zero::Config config;
      config.precision = precision;
      auto opt = zero::make_optimizer(c, config);
      const auto u = opt->add_unit("u");
      opt->add_param(u, "w", 10);
      opt->finalize();
      // A backward that adds into the fp32 gradient it is handed, in the first micro-batch.
      float* g = opt->grad_buffer_fp32(u);
      std::vector<float> host(10);
      zero::backend::Ops<zero::backend::Host>::download(host.data(), g, 10);
      for (std::size_t i = 0; i < 10; ++i) g[i] = host[i] + 1.0f;  // g += 1 (backend::Host: host memory)
      CHECK_THROWS_WITH(opt->grad_ready(u), Catch::Contains("grad_ready('u'): 10 of 10 gradient elements (the first: "
                                                            "'w'[0]) were not assigned"));
    });
  }
  // And with accumulate, the fp32 calls over 16-bit storage are refused with the way out.
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& c) {
    zero::Config config;
    config.precision = zero::PrecisionChoice::bf16;
    config.options.grad_writes = zero::GradWrites::accumulate;
    auto opt = zero::make_optimizer(c, config);
    const auto u = opt->add_unit("u");
    opt->add_param(u, "w", 10);
    opt->finalize();
    CHECK_THROWS_WITH(opt->grad_buffer_fp32(u), Catch::Contains("needs Options::grad_writes = overwrite; with "
                                                                "accumulate, add into grad_buffer_as<bf16>()"));
  });
}

TEST_CASE("make_optimizer: state_block is read by 8-bit states alone, not by other formats or checkpoints",
          "[runtime]") {
  // Outside blockwise8's rule: refused before with fp32 states, which never
  // read it; a checkpoint's manifest says fp32, with no block.
  const std::string dir = temp_dir();
  zero::Config config;
  config.options.nvme.directory = dir;
  for (const std::size_t block : {std::size_t{0}, std::size_t{65}})
    for (const auto tier : {zero::OffloadTier::none, zero::OffloadTier::nvme}) {
      INFO("state_block " << block << ", offload " << zero::name(tier));
      config.options.state_block = block;
      config.offload = tier;
      const std::string checkpoint = dir + "/checkpoint_" + std::to_string(block) + "_" + zero::name(tier);
      zero::comm::LocalGroup group(2);
      group.run([&](zero::comm::Local& c) {
        const Outcome trained = train_any(c, config, 2, [&](zero::AnyOptimizer& opt) {
          opt.save(checkpoint);
          const zero::checkpoint::RunState run = opt.load(checkpoint).manifest.run;
          CHECK(run.step == 2);
          CHECK(run.state_format == "fp32");
          CHECK(run.state_block == 0);
        });
        CHECK(trained.steps == 2);
      });
    }
  config.options.states = zero::StateFormat::blockwise8;
  CHECK_THAT(error_of<zero::InvalidArgument>(config), Catch::Contains("Options::state_block is 65; it must be"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("make_optimizer: a bad config names the setting and the fix", "[runtime]") {
  zero::Config config;
  config.stage = 2;
  config.optimizer = "lamb";
  CHECK_THAT(error_of<zero::InvalidArgument>(config),
             Catch::Contains("optimizer 'lamb' is not one this program knows (adamw, adam, sgd)") &&
                 Catch::Contains("make_optimizer<Backend, MyPolicy>"));
  config.optimizer = "adamw";
  config.offload = zero::OffloadTier::nvme;
  config.options.nvme.directory = "/tmp";
  CHECK_THAT(error_of<zero::InvalidArgument>(config),
             Catch::Contains("offload nvme needs its store") && Catch::Contains("zero::offload::Nvme"));
  config.offload = zero::OffloadTier::cpu;
  CHECK_THAT(error_of<zero::InvalidArgument>(config), Catch::Contains("host"));
  config.offload = zero::OffloadTier::none;
  config.stage = 4;
  CHECK_THAT(error_of<zero::InvalidArgument>(config), Catch::Contains("stage"));
}
