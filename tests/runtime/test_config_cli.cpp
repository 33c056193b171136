// The example programs' shared flags for a zero::Config
// (examples/common/cli.hpp): --config FILE first, then only the flags the
// command line gives, wherever --config stands; errors as CLI11 errors.
#include <catch2/catch.hpp>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "common/cli.hpp"

using zero::Config;
using zero::OffloadTier;
using zero::PrecisionChoice;

namespace {

struct TempFile {
  std::filesystem::path path;
  explicit TempFile(const std::string& text) {
    path = std::filesystem::temp_directory_path() / ("zero_test_config_cli_" + std::to_string(::getpid()) + ".json");
    std::ofstream(path) << text;
  }
  ~TempFile() { std::filesystem::remove(path); }
};

// `config` after parsing `line` (without the program name).
Config parsed(const std::string& line, Config config = {}, const zero::examples::ConfigChoices& accepted = {}) {
  CLI::App app("test");
  zero::examples::add_config_options(app, config, accepted);
  app.parse(line, false);
  return config;
}

}  // namespace

TEST_CASE("--config is read first; the flags given override it, the others keep the file's", "[runtime][cli]") {
  const TempFile file(R"({"stage": 2, "precision": "fp16", "optimizer": {"type": "sgd"},
                          "offload": {"tier": "nvme", "directory": "/from/file", "window_bytes": 1048576}})");
  const std::string config = " --config " + file.path.string();

  Config c = parsed("--stage 1" + config);  // before --config on the line, and still the flag wins
  CHECK(c.stage == 1);
  CHECK(c.precision == PrecisionChoice::fp16);
  CHECK(c.optimizer == "sgd");
  CHECK(c.offload == OffloadTier::nvme);
  CHECK(c.options.nvme.directory == "/from/file");
  CHECK(c.options.nvme.window_bytes == std::size_t{1} << 20);

  c = parsed(config.substr(1) + " --precision bf16 --optimizer adam --offload none --nvme-dir /flag "
                                "--nvme-window-mib 8");
  CHECK(c.stage == 2);
  CHECK(c.precision == PrecisionChoice::bf16);
  CHECK(c.optimizer == "adam");
  CHECK(c.offload == OffloadTier::none);
  CHECK(c.options.nvme.directory == "/flag");
  CHECK(c.options.nvme.window_bytes == std::size_t{8} << 20);

  // Without --config: the program's own values, then the flags.
  Config preset;
  preset.options.bucket_bytes = 4096;
  preset.stage = 0;
  c = parsed("--offload cpu", preset);
  CHECK(c.stage == 0);
  CHECK(c.offload == OffloadTier::cpu);
  CHECK(c.options.bucket_bytes == 4096);
  // With it: what the file does not set keeps the program's value.
  c = parsed(config.substr(1), preset);
  CHECK(c.stage == 2);
  CHECK(c.options.bucket_bytes == 4096);
  CHECK(parsed("") == Config{});
}

TEST_CASE("A bad file or flag is a CLI11 error naming it", "[runtime][cli]") {
  const TempFile typo(R"({"stgae": 2})");
  try {
    (void)parsed("--config " + typo.path.string());
    FAIL("no error");
  } catch (const CLI::ValidationError& e) {
    CHECK_THAT(e.what(), Catch::Contains("--config: zero config file '" + typo.path.string() +
                                         "': unknown key 'stgae' (did you mean 'stage'?)"));
  }
  CHECK_THROWS_AS(parsed("--config /no/such/zero/config.json"), CLI::ValidationError);
  CHECK_THROWS_AS(parsed("--precision bf17"), CLI::ValidationError);
  CHECK_THROWS_AS(parsed("--stage 4"), CLI::ValidationError);
  CHECK_THROWS_AS(parsed("--offload gpu"), CLI::ValidationError);
  CHECK_THROWS_AS(parsed("--optimizer lion"), CLI::ValidationError);
  zero::examples::ConfigChoices with_lion;
  with_lion.optimizers.push_back("lion");
  CHECK(parsed("--optimizer lion", {}, with_lion).optimizer == "lion");
}

TEST_CASE("check_config_options: the library's checks and the program's choices, whatever set them",
          "[runtime][cli]") {
  using zero::examples::check_config_options;
  const auto message = [](const Config& c, bool device, const zero::examples::ConfigChoices& accepted = {}) {
    try {
      check_config_options(c, device, accepted);
    } catch (const CLI::ValidationError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  Config c;
  CHECK(message(c, false) == "(accepted)");
  c.offload = OffloadTier::cpu;
  CHECK_THAT(message(c, false), Catch::Contains("with the host backend it is already in host memory"));
  CHECK(message(c, true) == "(accepted)");
  c.stage = 0;
  CHECK_THAT(message(c, true), Catch::Contains("stage 0 has no partition"));

  // A file can name what the flags' checks would refuse.
  const TempFile file(R"({"optimizer": {"type": "lion"}, "offload": {"tier": "nvme", "directory": "/d"}})");
  c = parsed("--config " + file.path.string());
  zero::examples::ConfigChoices built;
  built.offload_tiers = {"none"};
  CHECK_THAT(message(c, false, built), Catch::Contains("--optimizer lion: this program has these optimizers "
                                                       "(--optimizer, optimizer.type in --config): adamw, adam, sgd"));
  built.optimizers.push_back("lion");
  CHECK_THAT(message(c, false, built), Catch::Contains("--offload nvme: this program was built with these offload "
                                                       "tiers (--offload, offload.tier in --config): none"));
}

TEST_CASE("The Options flags, found by their keys in Options::fields(), each set their field", "[runtime][cli]") {
  Config want;
  auto& o = want.options;
  o.master = zero::MasterWeights::remainder;
  o.states = zero::StateFormat::blockwise8;
  o.hpz = o.hpz_int8 = o.qwz = o.qgz = o.qgz_error_feedback = o.check_replicas = true;
  o.qgz_bits = 8;
  o.qgz_block = 512;
  o.nvme.directory = "/d";
  o.nvme.window_bytes = std::size_t{8} << 20;
  CHECK(parsed("--master remainder --states blockwise8 --hpz --hpz-int8 --qwz --qgz --qgz-bits 8 --qgz-block 512 "
               "--qgz-feedback --check-replicas --nvme-dir /d --nvme-window-mib 8") == want);
  CHECK_THROWS_AS(parsed("--states fp8"), CLI::ValidationError);
  CHECK_THROWS_AS(parsed("--qgz-bits 5"), CLI::ValidationError);
  CHECK_THROWS_AS(parsed("--nvme-window-mib 0"), CLI::ValidationError);
  CHECK_THROWS_AS(parsed("--qgz-block many"), CLI::ParseError);
}
