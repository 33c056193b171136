// zero::Config: its JSON file read and written (every key, every error),
// its checks in the words of the compile-time API's static_asserts, and the
// optimizers' hyper-parameters by name against the policies' defaults.
#include <catch2/catch.hpp>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "zero/engine/detail/rank_checks.hpp"
#include "zero/optim/adam.hpp"
#include "zero/optim/sgd.hpp"
#include "zero/runtime/config.hpp"
#include "zero/runtime/config_json.hpp"
#include "zero/runtime/hyper_fields.hpp"

using nlohmann::json;
using zero::Config;
using zero::OffloadTier;
using zero::PrecisionChoice;

namespace {

// Each struct's member count is spelled out: a member added to Options (or
// Config) fails to compile here until it has its row in Options::fields()
// (Config's key in config_keys, zero/runtime/config_json.hpp), its key in
// docs/configuration.md and its value in every_setting_changed() below.
[[maybe_unused]] void members_have_keys(Config& c) {
  [[maybe_unused]] auto& [precision, optimizer, hyper, stage, offload, options] = c;
  [[maybe_unused]] auto& [bucket_bytes, grad_writes, live_buckets, release_memory_pages, prefetch_units, param_place, grad_accumulation_steps, clip_norm, gradient_divisor,
                          loss_scale, reduce_dtype, seed, stochastic_rounding, master, round_ties_away, states, state_block,
                          state_fp32_below, hpz, hpz_int8, qwz, qwz_block, qgz, qgz_bits, qgz_block, qgz_error_feedback,
                          offload_threads,
                          require_pinned_memory, pinned_piece_bytes, delayed_update, delayed_update_warmup, check_replicas,
                          nvme] = c.options;
  [[maybe_unused]] auto& [initial_scale, growth_interval, growth_factor, backoff_factor, hysteresis, min_scale] =
      c.options.loss_scale;
  [[maybe_unused]] auto& [directory, window_bytes, block_bytes, queue_depth, direct] = c.options.nvme;
}

// A Config in which every setting differs from its default.
Config every_setting_changed() {
  Config c;
  c.precision = PrecisionChoice::fp16;
  c.optimizer = "sgd";
  c.hyper = {{"lr", 0.25}, {"momentum", 0.9}, {"nesterov", 1.0}};
  c.stage = 2;
  c.offload = OffloadTier::nvme;
  auto& o = c.options;
  o.bucket_bytes = 12345;
  o.grad_writes = zero::GradWrites::accumulate;
  o.live_buckets = 5;
  o.release_memory_pages = true;
  o.prefetch_units = 3;
  o.param_place = zero::ParamPlace::disk;
  o.grad_accumulation_steps = 4;
  o.clip_norm = 1.5;
  o.gradient_divisor = 8;
  o.loss_scale = {1024.0, 100, 4.0, 0.25, 2, 2.0};
  o.reduce_dtype = zero::ReduceDType::fp32;
  o.seed = 0xFFFFFFFFFFFFFFFFull;  // the largest seed: unsigned 64-bit through JSON
  o.stochastic_rounding = true;
  o.master = zero::MasterWeights::remainder;  // (with fp16 and stochastic rounding invalid: only read and written here)
  o.round_ties_away = true;
  o.states = zero::StateFormat::bf16_stochastic;
  o.state_block = 256;
  o.state_fp32_below = 100;
  o.hpz = true;
  o.hpz_int8 = true;
  o.qwz = true;
  o.qwz_block = 4096;
  o.qgz = true;
  o.qgz_bits = 8;
  o.qgz_block = 512;
  o.qgz_error_feedback = true;
  o.offload_threads = 6;
  o.require_pinned_memory = true;
  o.pinned_piece_bytes = 1 << 20;
  o.delayed_update = true;
  o.delayed_update_warmup = 3;
  o.check_replicas = true;
  o.nvme = {"/scratch/zero", std::size_t{8} << 20, std::size_t{1} << 16, 64, false};
  return c;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const zero::InvalidArgument& e) {
    return e.what();
  }
  return "(no InvalidArgument thrown)";
}
std::string parse_error(const std::string& text) {
  return error_of([&] { (void)zero::config_from_json(json::parse(text)); });
}

std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A file of its own under the system's temporary directory, removed at the end.
struct TempFile {
  std::filesystem::path path;
  explicit TempFile(const std::string& text, const std::string& stem = "zero_test_config") {
    path = std::filesystem::temp_directory_path() / (stem + "_" + std::to_string(::getpid()) + ".json");
    std::ofstream(path) << text;
  }
  ~TempFile() { std::filesystem::remove(path); }
};

}  // namespace

TEST_CASE("to_json and config_from_json round-trip every setting", "[runtime][config]") {
  const Config changed = every_setting_changed();
  // Through text, as a file would carry it.
  const Config back = zero::config_from_json(json::parse(zero::to_json(changed).dump(2)));
  CHECK(back == changed);
  CHECK(back.options.seed == 0xFFFFFFFFFFFFFFFFull);
  CHECK(zero::config_from_json(zero::to_json(Config{})) == Config{});
  // Not the same as the defaults: the round trip is not vacuous.
  CHECK_FALSE(changed == Config{});

  // The keys the documentation promises (docs/configuration.md), as written.
  const json j = zero::to_json(changed);
  CHECK(j["precision"] == "fp16");
  CHECK(j["optimizer"]["type"] == "sgd");
  CHECK(j["optimizer"]["params"]["lr"] == 0.25);
  CHECK(j["stage"] == 2);
  CHECK(j["offload"]["tier"] == "nvme");
  CHECK(j["offload"]["directory"] == "/scratch/zero");
  CHECK(j["offload"]["window_bytes"] == 8u << 20);
  CHECK(j["offload"]["block_bytes"] == 1u << 16);
  CHECK(j["offload"]["queue_depth"] == 64);
  CHECK(j["offload"]["direct"] == false);
  CHECK(j["bucket_bytes"] == 12345);
  CHECK(j["loss_scale"]["hysteresis"] == 2);
  CHECK(j["reduce_dtype"] == "fp32");
  CHECK(j["param_place"] == "disk");
  std::set<std::string> top;
  for (const auto& item : j.items()) top.insert(item.key());
  CHECK(top == std::set<std::string>{"precision", "optimizer", "stage", "offload", "bucket_bytes", "grad_writes",
                                     "live_buckets", "release_memory_pages", "prefetch_units", "param_place",
                                     "grad_accumulation_steps", "clip_norm", "gradient_divisor", "loss_scale",
                                     "reduce_dtype", "seed", "stochastic_rounding", "master", "round_ties_away",
                                     "states", "state_block", "state_fp32_below", "hpz", "hpz_int8", "qwz", "qwz_block", "qgz", "qgz_bits", "qgz_block", "qgz_error_feedback", "offload_threads",
                                     "require_pinned_memory", "pinned_piece_bytes", "delayed_update",
                                     "delayed_update_warmup", "check_replicas"});
}

namespace {

// An aggregate's member count found without its field table: the most
// initializers its braces take, each convertible to any member's type.
struct AnyMember {
  template <class T>
  operator T() const;  // (only named in unevaluated braces)
};
template <class S, class... Given>
constexpr std::size_t member_count() {
  if constexpr (requires { S{Given{}..., AnyMember{}}; }) return member_count<S, Given..., AnyMember>();
  else return sizeof...(Given);
}
template <class S>
constexpr std::size_t row_count = std::tuple_size_v<decltype(S::fields())>;

// Per field of the table, by its key path: a change that sets it alone to
// its value in every_setting_changed().
std::vector<std::pair<std::string, std::function<void(zero::Options&)>>> each_field_changed_alone() {
  std::vector<std::pair<std::string, std::function<void(zero::Options&)>>> changes;
  const zero::Options changed = every_setting_changed().options;
  zero::detail::for_each_option(changed, [&]<class T>(const std::string& key, const T& value, zero::AgreedWhen) {
    changes.emplace_back(key, [key, value](zero::Options& o) {
      zero::detail::for_each_option(o, [&]<class U>(const std::string& k, U& field, zero::AgreedWhen) {
        if constexpr (std::is_same_v<T, U>)
          if (k == key) field = value;
      });
    });
  });
  return changes;
}

// Every value of a JSON object by its key path ("offload.tier").
void flatten(const json& j, const std::string& at, std::map<std::string, json>& out) {
  for (const auto& item : j.items()) {
    if (item.value().is_object()) flatten(item.value(), at + item.key() + ".", out);
    else out[at + item.key()] = item.value();
  }
}

// The names of the settings agreed_engine_settings() gives different values for `a` and `b`.
std::set<std::string> settings_that_differ(const zero::Options& a, const zero::Options& b) {
  const zero::Layout layout(2);
  const zero::detail::EngineIdentity id{2, "adamw", true, zero::DType::bf16, "none"};
  const auto in_a = zero::detail::agreed_engine_settings(layout, a, id);
  const auto in_b = zero::detail::agreed_engine_settings(layout, b, id);
  REQUIRE(in_a.size() == in_b.size());
  std::set<std::string> names;
  for (std::size_t i = 0; i < in_a.size(); ++i)
    if (in_a[i].value != in_b[i].value) names.insert(in_a[i].what);
  return names;
}

}  // namespace

TEST_CASE("Options' field table has a row for every member", "[runtime][config]") {
  // A member without its row would be silently neither read from a file,
  // written, given a flag nor compared across ranks.
  CHECK(row_count<zero::Options> == member_count<zero::Options>());
  CHECK(row_count<zero::LossScaleOptions> == member_count<zero::LossScaleOptions>());
  CHECK(row_count<zero::NvmeOptions> == member_count<zero::NvmeOptions>());
  // The count counts (members_have_keys spells these out).
  CHECK(member_count<zero::Options>() == 33);
  CHECK(member_count<zero::LossScaleOptions>() == 6);
  CHECK(member_count<zero::NvmeOptions>() == 5);
}

TEST_CASE("Each field of the table alone: its key in a file, read back, and compared across ranks or not",
          "[runtime][config]") {
  // Where ranks may differ, written out here as an independent view of the table.
  const std::set<std::string> rank_own{"offload_threads",   "require_pinned_memory", "pinned_piece_bytes",
                                       "param_place",       "nvme.directory",    "nvme.window_bytes",     "nvme.block_bytes",
                                       "nvme.queue_depth",  "nvme.direct"};
  const std::set<std::string> only_with_blockwise8{"state_block", "state_fp32_below"};
  std::map<std::string, json> defaults;
  flatten(zero::to_json(Config{}), "", defaults);
  const auto changes = each_field_changed_alone();
  CHECK(changes.size() == 31 + 6 + 5);  // the members but the two groups, and theirs
  for (const auto& [key, change] : changes) {
    INFO("Options::" << key);
    Config one;
    change(one.options);
    REQUIRE_FALSE(one == Config{});  // every_setting_changed() sets it: the checks below are not vacuous

    std::map<std::string, json> written;
    flatten(zero::to_json(one), "", written);
    std::set<std::string> keys_that_differ;
    for (const auto& [k, v] : written)
      if (defaults.at(k) != v) keys_that_differ.insert(k);
    const std::string file_key = key.starts_with("nvme.") ? "offload." + key.substr(5) : key;
    CHECK(keys_that_differ == std::set<std::string>{file_key});
    CHECK(zero::config_from_json(json::parse(zero::to_json(one).dump())) == one);

    const bool agreed = !rank_own.contains(key) && !only_with_blockwise8.contains(key);
    CHECK(settings_that_differ(one.options, {}) ==
          (agreed ? std::set<std::string>{"Options::" + key} : std::set<std::string>{}));
    if (only_with_blockwise8.contains(key)) {
      zero::Options blockwise8;
      blockwise8.states = zero::StateFormat::blockwise8;
      zero::Options changed = blockwise8;
      change(changed);
      CHECK(settings_that_differ(changed, blockwise8) == std::set<std::string>{"Options::" + key});
    }
  }
}

TEST_CASE("A file sets only the keys it has; integral numbers in exponent form are integers", "[runtime][config]") {
  const Config c = zero::config_from_json(json::parse(
      R"({"stage": 1, "optimizer": {"params": {"lr": 3e-4}}, "bucket_bytes": 5e8, "offload": {"directory": "/d"}})"));
  Config want;
  want.stage = 1;
  want.hyper = {{"lr", 3e-4}};
  want.options.bucket_bytes = 500000000;
  want.options.nvme.directory = "/d";
  CHECK(c == want);
  CHECK(c.optimizer == "adamw");  // the default type
  // true/false for a flag hyper-parameter, kept as 1/0.
  CHECK(zero::config_from_json(json::parse(R"({"optimizer": {"params": {"nesterov": true}}})")).hyper.at("nesterov") ==
        1.0);
}

TEST_CASE("An unknown key names its path, the nearest key and the keys at that level", "[runtime][config]") {
  std::string e = parse_error(R"({"offload": {"tier": "nvme", "windw_bytes": 1}})");
  CHECK_THAT(e, Catch::Contains("zero config: unknown key 'offload.windw_bytes' (did you mean 'window_bytes'?)"));
  CHECK_THAT(e, Catch::Contains("the keys of 'offload' are tier, directory, window_bytes, block_bytes, queue_depth, "
                                "direct"));
  e = parse_error(R"({"stgae": 2})");
  CHECK_THAT(e, Catch::Contains("unknown key 'stgae' (did you mean 'stage'?)"));
  CHECK_THAT(e, Catch::Contains("the top-level keys are precision, optimizer, stage, offload, bucket_bytes"));
  CHECK_THAT(e, Catch::Contains("delayed_update_warmup"));
  // DeepSpeed's schema is not ours, and not half-accepted.
  e = parse_error(R"({"zero_optimization": {"stage": 2}})");
  CHECK_THAT(e, Catch::Contains("unknown key 'zero_optimization'"));
  CHECK_THAT(e, Catch::Contains("docs/configuration.md"));
  e = parse_error(R"({"loss_scale": {"initial_scale_power": 16}})");
  CHECK_THAT(e, Catch::Contains("unknown key 'loss_scale.initial_scale_power' (did you mean 'initial_scale'?); the "
                                "keys of 'loss_scale' are initial_scale, growth_interval"));
  e = parse_error(R"({"optimizer": {"type": "adamw", "betas": [0.9, 0.999]}})");
  CHECK_THAT(e, Catch::Contains("unknown key 'optimizer.betas'; the keys of 'optimizer' are type, params"));
}

TEST_CASE("A value of the wrong type names the key, the type found and the type expected", "[runtime][config]") {
  CHECK_THAT(parse_error(R"({"stage": "2"})"),
             Catch::Contains("'stage' must be an integer in [-2147483648, 2147483647], not string \"2\""));
  CHECK_THAT(parse_error(R"({"stage": 2.5})"), Catch::Contains("'stage' must be an integer"));
  CHECK_THAT(parse_error(R"({"offload": {"direct": 1}})"),
             Catch::Contains("'offload.direct' must be true or false, not number 1"));
  CHECK_THAT(parse_error(R"({"offload": "nvme"})"),
             Catch::Contains("'offload' must be an object {...}, not string \"nvme\""));
  CHECK_THAT(parse_error(R"({"optimizer": "adamw"})"),
             Catch::Contains("'optimizer' must be an object {...}, not string \"adamw\""));
  CHECK_THAT(parse_error(R"({"precision": "bf17"})"),
             Catch::Contains("'precision' must be one of the strings fp32, bf16, fp16, not string \"bf17\""));
  CHECK_THAT(parse_error(R"({"reduce_dtype": "fp16"})"),
             Catch::Contains("'reduce_dtype' must be one of the strings same_as_grad, fp32, not string \"fp16\""));
  CHECK_THAT(parse_error(R"({"offload": {"tier": "gpu"}})"),
             Catch::Contains("'offload.tier' must be one of the strings none, cpu, nvme"));
  CHECK_THAT(parse_error(R"({"bucket_bytes": -1})"),
             Catch::Contains("'bucket_bytes' must be a non-negative integer (at most 18446744073709551615), not "
                             "number -1"));
  CHECK_THAT(parse_error(R"({"offload": {"queue_depth": 1e10}})"),
             Catch::Contains("'offload.queue_depth' must be a non-negative integer (at most 4294967295)"));
  CHECK_THAT(parse_error(R"({"optimizer": {"params": {"lr": "1e-3"}}})"),
             Catch::Contains("'optimizer.params.lr' must be a number (or true/false for a flag), not string"));
  CHECK_THAT(parse_error(R"({"optimizer": {"type": 7}})"), Catch::Contains("'optimizer.type' must be a string"));
  CHECK_THAT(parse_error(R"([1, 2])"), Catch::Contains("a configuration is a JSON object"));
}

TEST_CASE("Config::validate refuses what the compile-time API refuses, in its words", "[runtime][config]") {
  const auto validate = [](Config c, bool device_backend) { return error_of([&] { c.validate(device_backend); }); };
  Config ok;
  CHECK(validate(ok, false) == "(no InvalidArgument thrown)");

  Config c;
  c.stage = 4;
  CHECK_THAT(validate(c, true), Catch::Contains("stage 4 is not a ZeRO stage: ZeRO has stages 0, 1, 2 and 3"));
  c.stage = -1;
  CHECK_THAT(validate(c, true), Catch::Contains("stage -1 is not a ZeRO stage"));

  for (const OffloadTier tier : {OffloadTier::cpu, OffloadTier::nvme}) {
    c = Config{};
    c.stage = 0;
    c.offload = tier;
    c.options.nvme.directory = "/d";
    const std::string e = validate(c, true);
    CHECK_THAT(e, Catch::Contains(std::string("offload ") + zero::name(tier)));
    CHECK_THAT(e, Catch::Contains("ZeRO-Offload moves this rank's partition of the optimizer state to the host; "
                                  "stage 0 has no partition: use stage 1 or higher"));
    c.stage = 1;
    CHECK(validate(c, true) == "(no InvalidArgument thrown)");
  }

  c = Config{};
  c.offload = OffloadTier::cpu;
  CHECK_THAT(validate(c, false), Catch::Contains("offload cpu moves optimizer state from GPU memory to the host, but "
                                                 "with the host backend it is already in host memory; use offload "
                                                 "none (or offload nvme to move it to disk)"));
  CHECK(validate(c, true) == "(no InvalidArgument thrown)");

  c = Config{};
  c.offload = OffloadTier::nvme;
  const std::string e = validate(c, false);
  CHECK_THAT(e, Catch::Contains("offload nvme keeps the optimizer state in swap files and needs a directory"));
  CHECK_THAT(e, Catch::Contains("offload.directory"));
  CHECK_THAT(e, Catch::Contains("--nvme-dir"));
  c.options.nvme.directory = "/scratch";
  CHECK(validate(c, false) == "(no InvalidArgument thrown)");  // the disk tier works with any backend

  c = Config{};
  c.optimizer.clear();
  CHECK_THAT(validate(c, false), Catch::Contains("the optimizer's name is empty"));
  c = Config{};
  c.options.prefetch_units = 99;  // Options::validate() is part of it
  CHECK_THAT(validate(c, false), Catch::Contains("Options::prefetch_units is 99"));

  c = Config{};
  c.options.master = zero::MasterWeights::remainder;
  CHECK(validate(c, false) == "(no InvalidArgument thrown)");  // bf16: the default precision
  c.precision = PrecisionChoice::fp16;
  CHECK_THAT(validate(c, false), Catch::Contains("master remainder keeps the fp32 master as the bf16 parameters") &&
                                     Catch::Contains("the precision is fp16: use precision bf16, or master fp32"));
  c.precision = PrecisionChoice::bf16;
  c.options.stochastic_rounding = true;
  CHECK_THAT(validate(c, false), Catch::Contains("Options::master is remainder and Options::stochastic_rounding is on"));
}

TEST_CASE("Config::validate refuses options that would do nothing, naming the option and the fix",
          "[runtime][config]") {
  const auto validate = [](Config c) { return error_of([&] { c.validate(false); }); };
  // stochastic_rounding rounds bf16 parameter copies: fp16 copies are always
  // rounded to nearest even, and fp32 training keeps none.
  Config c;
  c.options.stochastic_rounding = true;
  CHECK(validate(c) == "(no InvalidArgument thrown)");  // bf16: the default precision
  for (const PrecisionChoice p : {PrecisionChoice::fp16, PrecisionChoice::fp32}) {
    c.precision = p;
    const std::string e = validate(c);
    INFO(e);
    CHECK_THAT(e, Catch::Contains(std::string("zero::Config: stochastic_rounding is on, but the precision is ") +
                                  zero::name(p)));
    CHECK_THAT(e, Catch::Contains("turn stochastic_rounding off, or use precision bf16"));
  }
  // round_ties_away, the other option of the bf16 copies: the same rule, the same words.
  c = Config{};
  c.precision = PrecisionChoice::fp16;
  c.options.round_ties_away = true;
  CHECK_THAT(validate(c), Catch::Contains("round_ties_away is on, but the precision is fp16") &&
                              Catch::Contains("turn round_ties_away off, or use precision bf16"));

  // qgz_error_feedback keeps what qgZ's quantization dropped: nothing without qgz.
  c = Config{};
  c.options.qgz_error_feedback = true;
  CHECK_THAT(validate(c), Catch::Contains("Options::qgz_error_feedback") &&
                              Catch::Contains("but Options::qgz is off: turn qgz on, or qgz_error_feedback off"));
  c.options.qgz = true;
  CHECK(validate(c) == "(no InvalidArgument thrown)");
}

TEST_CASE("state_block is checked with blockwise8 states, the only format that reads it", "[runtime][config]") {
  const auto validate = [](Config c) { return error_of([&] { c.validate(false); }); };
  // The docs present it as a setting of 8-bit states: with any other format
  // a value outside blockwise8's rule is not read, so not refused (it was).
  Config c;
  using zero::StateFormat;
  for (const StateFormat f : {StateFormat::fp32, StateFormat::bf16, StateFormat::bf16_stochastic}) {
    INFO(zero::name(f));
    c.options.states = f;
    for (const std::size_t block : {std::size_t{0}, std::size_t{65}, std::size_t{8192}}) {
      c.options.state_block = block;
      CHECK(validate(c) == "(no InvalidArgument thrown)");
    }
  }
  // From a file too: the key is read whatever the format, and checked with blockwise8.
  const Config from_file = zero::config_from_json(json::parse(R"({"states": "bf16", "state_block": 0})"));
  CHECK(validate(from_file) == "(no InvalidArgument thrown)");
  c.options.states = StateFormat::blockwise8;
  for (const std::size_t block : {std::size_t{0}, std::size_t{65}, std::size_t{8192}}) {
    c.options.state_block = block;
    CHECK_THAT(validate(c), Catch::Contains("Options::state_block is " + std::to_string(block) +
                                            "; it must be a multiple of 64 in [64, 4096]"));
  }
  c.options.state_block = 256;
  CHECK(validate(c) == "(no InvalidArgument thrown)");
}

TEST_CASE("The static_asserts say what Config::validate says", "[runtime][config]") {
  // The compile-time messages live in string literals a run-time check
  // cannot share; these phrases must stay in both (tests/compile checks the
  // compilers print them).
  const std::string engine = read_text(ZERO_SOURCE_DIR "/include/zero/engine/zero_optimizer.hpp");
  const std::string policies = read_text(ZERO_SOURCE_DIR "/include/zero/policies.hpp");
  REQUIRE(!engine.empty());
  CHECK_THAT(engine, Catch::Contains("already in host memory; use offload::None (or offload::Nvme to move it to "
                                     "disk)"));
  CHECK_THAT(engine, Catch::Contains("ZeRO-Offload moves this rank's partition of the optimizer state to the host; "
                                     "\"\n                \"stage 0 has no partition: use stage<1> or higher"));
  CHECK_THAT(policies, Catch::Contains("ZeRO has stages 0, 1, 2 and 3"));
}

TEST_CASE("load_config names the file in every error", "[runtime][config]") {
  {
    const TempFile f(R"({"stage": 1, "offload": {"tier": "cpu"}})");
    const Config c = zero::load_config(f.path.string());
    CHECK(c.stage == 1);
    CHECK(c.offload == OffloadTier::cpu);
  }
  const std::string missing = (std::filesystem::temp_directory_path() / "zero_no_such_config.json").string();
  std::string e = error_of([&] { (void)zero::load_config(missing); });
  CHECK_THAT(e, Catch::Contains("zero config file '" + missing + "' cannot be opened (No such file or directory)"));

  e = error_of([&] { (void)zero::load_config(std::filesystem::temp_directory_path().string()); });
  CHECK_THAT(e, Catch::Contains("is a directory; name a JSON file"));

  {
    // The missing comma after "stage": 2 is found at the string after it,
    // line 3, reported (as nlohmann does) where that string ends.
    const TempFile f("{\n  \"stage\": 2\n  \"precision\": \"bf16\"\n}\n");
    e = error_of([&] { (void)zero::load_config(f.path.string()); });
    CHECK_THAT(e, Catch::Contains("zero config file '" + f.path.string() + "' is not valid JSON: line 3, column 13"));
    CHECK_THAT(e, Catch::Contains("(byte 28): syntax error"));
    CHECK_THAT(e, Catch::Contains("expected '}'"));
  }
  {
    const TempFile f(R"({"offload": {"tier": "nvme", "directory": "/a", "tier": "none"}})");
    e = error_of([&] { (void)zero::load_config(f.path.string()); });
    CHECK_THAT(e, Catch::Contains("zero config file '" + f.path.string() + "': the key 'offload.tier' is given twice"));
  }
  {
    const TempFile f(R"({"stage": 2, "offload": {"tier": "nvme", "direct": "yes"}})");
    e = error_of([&] { (void)zero::load_config(f.path.string()); });
    CHECK_THAT(e, Catch::Contains("zero config file '" + f.path.string() +
                                  "': 'offload.direct' must be true or false"));
  }
  {
    const TempFile f("");
    e = error_of([&] { (void)zero::load_config(f.path.string()); });
    CHECK_THAT(e, Catch::Contains("is not valid JSON: line 1, column 1"));
  }
  {
    // load_config_into: over the caller's values; an error leaves them all.
    Config c;
    c.options.bucket_bytes = 777;
    const TempFile good(R"({"stage": 0})", "zero_test_config_good");
    zero::load_config_into(c, good.path.string());
    CHECK(c.stage == 0);
    CHECK(c.options.bucket_bytes == 777);
    const TempFile bad(R"({"stage": 1, "precision": "fp8"})", "zero_test_config_bad");
    CHECK_THROWS_AS(zero::load_config_into(c, bad.path.string()), zero::InvalidArgument);
    CHECK(c.stage == 0);
  }
}

TEST_CASE("A number beyond a double's range names the file and the key", "[runtime][config]") {
  // nlohmann refuses these while parsing (out_of_range 406), before any key is read.
  const std::pair<std::string, std::string> cases[] = {
      {R"({"stage": 1e400})", "'stage' must be a number a double holds"},
      {R"({"clip_norm": 1e309})", "'clip_norm' must be a number a double holds"},
      {R"({"optimizer": {"type": "sgd", "params": {"lr": 1e400}}})",
       "'optimizer.params.lr' must be a number a double holds"},
      {R"({"stage": 2, "loss_scale": {"initial_scale": 1024, "min_scale": -1e400}})",
       "'loss_scale.min_scale' must be a number a double holds"},
  };
  for (const auto& [text, message] : cases) {
    const TempFile f(text);
    const std::string e = error_of([&] { (void)zero::load_config(f.path.string()); });
    INFO(text);
    CHECK_THAT(e, Catch::Contains("zero config file '" + f.path.string() + "': " + message));
    CHECK_THAT(e, Catch::Contains("docs/configuration.md"));
  }
  const TempFile f(R"({"clip_norm": 1e309})");
  CHECK_THAT(error_of([&] { (void)zero::load_config(f.path.string()); }), Catch::Contains("not 1e309"));
}

TEST_CASE("The example file of docs/configuration.md loads, and the page names every key", "[runtime][config]") {
  const std::string page = read_text(ZERO_SOURCE_DIR "/docs/configuration.md");
  REQUIRE(!page.empty());
  const std::string fence = "```json\n";
  const auto begin = page.find(fence);
  REQUIRE(begin != std::string::npos);
  const auto end = page.find("```", begin + fence.size());
  const TempFile f(page.substr(begin + fence.size(), end - begin - fence.size()));
  const Config c = zero::load_config(f.path.string());
  CHECK_NOTHROW(c.validate(true));
  CHECK(c.stage == 2);
  CHECK(c.offload == OffloadTier::nvme);
  // Every key, nested ones included, has its row in the page's tables.
  const std::function<void(const json&, const std::string&)> documented = [&](const json& j, const std::string& at) {
    for (const auto& item : j.items()) {
      if (at == "optimizer.params.") continue;  // the optimizers' own names, in their section
      const std::string key = at + item.key();
      CHECK_THAT(page, Catch::Contains("| `" + key + "`"));
      if (item.value().is_object()) documented(item.value(), key + ".");
    }
  };
  documented(zero::to_json(every_setting_changed()), "");
}

// --- hyper-parameters by name ---------------------------------------------

namespace {

// Field-by-field, written out here rather than through fields(): an
// independent view of the structs.
template <class D>
bool same(const zero::optim::BasicAdamHyper<D>& a, const zero::optim::BasicAdamHyper<D>& b) {
  return a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps && a.weight_decay == b.weight_decay;
}
bool same(const zero::optim::Sgd::Hyper& a, const zero::optim::Sgd::Hyper& b) {
  return a.lr == b.lr && a.momentum == b.momentum && a.dampening == b.dampening && a.weight_decay == b.weight_decay &&
         a.nesterov == b.nesterov;
}

// For each field: set by name (on top of `base`, where the policy's checks
// need another field), it must equal the default Hyper with that field set by
// hand, and nothing else changed.
template <class O>
void each_field_sets_only_itself(
    const std::vector<std::tuple<std::string, double, std::function<void(typename O::Hyper&)>>>& fields,
    const std::map<std::string, double>& base = {}, std::function<void(typename O::Hyper&)> set_base = {}) {
  std::vector<std::string> names;
  for (const auto& [name, value, set] : fields) {
    names.push_back(name);
    auto values = base;
    values[name] = value;
    typename O::Hyper want{};
    if (set_base) set_base(want);
    set(want);
    INFO(O::name << " field " << name);
    CHECK(same(zero::hyper_from<O>(values), want));
    CHECK(zero::hyper_to_map<O>(want).at(name) == value);
  }
  // The test covers every field the policy lists, in its order.
  CHECK(zero::hyper_field_names<O>() == names);
}

}  // namespace

TEST_CASE("Hyper structs are aggregates: designated initialisers keep the other defaults", "[runtime][hyper]") {
  const zero::optim::AdamW::Hyper adamw{.lr = 3e-4, .weight_decay = 0.0};
  CHECK((adamw.lr == 3e-4 && adamw.beta1 == 0.9 && adamw.beta2 == 0.999 && adamw.eps == 1e-8 &&
         adamw.weight_decay == 0.0));
  const zero::optim::AdamW::Hyper adamw_default{.lr = 3e-4};
  CHECK(adamw_default.weight_decay == 1e-2);  // torch.optim.AdamW's
  const zero::optim::Adam::Hyper adam{.beta2 = 0.95};
  CHECK((adam.lr == 1e-3 && adam.beta2 == 0.95 && adam.weight_decay == 0.0));
  const zero::optim::Sgd::Hyper sgd{.lr = 0.1, .momentum = 0.9, .nesterov = true};
  CHECK((sgd.lr == 0.1 && sgd.momentum == 0.9 && sgd.dampening == 0.0 && sgd.nesterov));
  STATIC_REQUIRE(std::is_aggregate_v<zero::optim::AdamW::Hyper>);
  STATIC_REQUIRE(std::is_aggregate_v<zero::optim::Adam::Hyper>);
  STATIC_REQUIRE(std::is_aggregate_v<zero::optim::Sgd::Hyper>);
}

TEST_CASE("hyper_from starts from each policy's defaults (torch.optim's)", "[runtime][hyper]") {
  using zero::optim::Adam;
  using zero::optim::AdamW;
  using zero::optim::Sgd;
  const auto adamw = zero::hyper_from<AdamW>({});
  CHECK((adamw.lr == 1e-3 && adamw.beta1 == 0.9 && adamw.beta2 == 0.999 && adamw.eps == 1e-8 &&
         adamw.weight_decay == 1e-2));
  const auto adam = zero::hyper_from<Adam>({});
  CHECK((adam.lr == 1e-3 && adam.beta1 == 0.9 && adam.beta2 == 0.999 && adam.eps == 1e-8 && adam.weight_decay == 0));
  const auto sgd = zero::hyper_from<Sgd>({});
  CHECK((sgd.lr == 1e-2 && sgd.momentum == 0 && sgd.dampening == 0 && sgd.weight_decay == 0 && !sgd.nesterov));
  // And back: every field by name, flags as 0/1.
  CHECK(zero::hyper_to_map<AdamW>(adamw) ==
        std::map<std::string, double>{{"lr", 1e-3}, {"beta1", 0.9}, {"beta2", 0.999}, {"eps", 1e-8},
                                      {"weight_decay", 1e-2}});
  CHECK(zero::hyper_to_map<Sgd>(sgd) == std::map<std::string, double>{{"lr", 1e-2}, {"momentum", 0}, {"dampening", 0},
                                                                      {"weight_decay", 0}, {"nesterov", 0}});
}

TEST_CASE("hyper_from: a field set by name changes exactly that field", "[runtime][hyper]") {
  // Adam's and AdamW's Hyper are two types with the same fields.
  auto adam_fields = [](auto hyper) {
    using H = decltype(hyper);
    return std::vector<std::tuple<std::string, double, std::function<void(H&)>>>{
        {"lr", 0.02, [](auto& h) { h.lr = 0.02; }},
        {"beta1", 0.8, [](auto& h) { h.beta1 = 0.8; }},
        {"beta2", 0.95, [](auto& h) { h.beta2 = 0.95; }},
        {"eps", 1e-6, [](auto& h) { h.eps = 1e-6; }},
        {"weight_decay", 0.1, [](auto& h) { h.weight_decay = 0.1; }}};
  };
  each_field_sets_only_itself<zero::optim::Adam>(adam_fields(zero::optim::Adam::Hyper{}));
  each_field_sets_only_itself<zero::optim::AdamW>(adam_fields(zero::optim::AdamW::Hyper{}));
  // Nesterov needs momentum: every SGD field is set over momentum 0.5.
  each_field_sets_only_itself<zero::optim::Sgd>(
      {{"lr", 0.1, [](auto& h) { h.lr = 0.1; }},
       {"momentum", 0.9, [](auto& h) { h.momentum = 0.9; }},
       {"dampening", 0.25, [](auto& h) { h.dampening = 0.25; }},
       {"weight_decay", 1e-4, [](auto& h) { h.weight_decay = 1e-4; }},
       {"nesterov", 1.0, [](auto& h) { h.nesterov = true; }}},
      {{"momentum", 0.5}}, [](auto& h) { h.momentum = 0.5; });
}

namespace {
// A user's policy that does not list its fields: the compile-time API is all it has.
struct Unlisted {
  static constexpr const char* name = "unlisted";
  static constexpr int state_slots = 0;
  struct Hyper {
    double lr = 0.5;
    void validate() const {}
  };
  struct Scalars {
    float lr;
  };
  static Scalars prepare(const Hyper& h, std::int64_t) { return {static_cast<float>(h.lr)}; }
  template <class V>
  static void update(const Scalars&, V&, const V&, V*) {}
};
static_assert(zero::optim::Policy<Unlisted>);
// A fields() of the wrong shape fails the concept, where the policy is named.
struct BadFields : Unlisted {
  struct Hyper : Unlisted::Hyper {
    static constexpr int fields() { return 0; }
  };
};
static_assert(!zero::optim::Policy<BadFields>);
}  // namespace

TEST_CASE("hyper_from: unknown names, flags and policies without fields() are errors that say the fix",
          "[runtime][hyper]") {
  using zero::optim::Sgd;
  const auto error = [](auto f) { return error_of(f); };
  CHECK(error([] { (void)zero::hyper_from<Sgd>({{"beta1", 0.9}}); }) ==
        "optimizer 'sgd' has no hyper-parameter 'beta1'; its hyper-parameters are lr, momentum, dampening, "
        "weight_decay, nesterov");
  CHECK(error([] { (void)zero::hyper_from<zero::optim::AdamW>({{"weight_decy", 0.1}}); }) ==
        "optimizer 'adamw' has no hyper-parameter 'weight_decy' (did you mean 'weight_decay'?); its "
        "hyper-parameters are lr, beta1, beta2, eps, weight_decay");
  CHECK(error([] { (void)zero::hyper_from<Sgd>({{"momentum", 0.9}, {"nesterov", 0.5}}); }) ==
        "optimizer 'sgd' hyper-parameter 'nesterov' is a flag: 0 or 1 (false or true in a config file), not 0.5");
  // The values go through Hyper::validate().
  CHECK_THAT(error([] { (void)zero::hyper_from<zero::optim::Adam>({{"beta1", 1.5}}); }),
             Catch::Contains("Adam hyper-parameter 'beta1' is 1.5; it must be in [0, 1)"));
  CHECK_THAT(error([] { (void)zero::hyper_from<Sgd>({{"nesterov", 1}}); }),
             Catch::Contains("'nesterov' needs momentum > 0"));

  CHECK(zero::hyper_from<Unlisted>({}).lr == 0.5);
  CHECK(zero::hyper_to_map<Unlisted>({}).empty());
  CHECK(zero::hyper_field_names<Unlisted>().empty());
  const std::string e = error([] { (void)zero::hyper_from<Unlisted>({{"lr", 0.1}}); });
  CHECK_THAT(e, Catch::Contains("optimizer 'unlisted' does not list its hyper-parameters, so they cannot be set by "
                                "name (lr): give its Hyper a `static constexpr auto fields()`"));
}
