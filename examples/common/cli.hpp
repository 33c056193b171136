// Why: the example programs (the trainers, the zero_plan planner) take the
// same ZeRO choices on their command lines. One place names those options,
// checks their values, and makes --help and errors read the same in every
// program: CLI11's format, --help listing each option with its default,
// exit 0 for --help and 2 for any bad command line.
#pragma once

#include <CLI/CLI.hpp>

#include "common/choices.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "zero/runtime/config.hpp"
#include "zero/runtime/enum_values.hpp"
#include "zero/runtime/name_list.hpp"
// --config FILE needs nlohmann-json (header-only); without it the option is
// there and says what to install.
#if __has_include(<nlohmann/json.hpp>)
#include "zero/runtime/config_json.hpp"
#define ZERO_EXAMPLE_HAVE_CONFIG_FILES 1
#endif

namespace zero::examples {

// A finite number > 0 (CLI::PositiveNumber would print its range up to DBL_MAX in full).
inline const CLI::Validator kPositive(
    [](std::string& text) -> std::string {
      double value = 0;
      if (!CLI::detail::lexical_cast(text, value) || !(value > 0) || !std::isfinite(value))
        return text + " is not a number > 0";
      return {};
    },
    "POSITIVE", "POSITIVE");

// The names of a zero enum's values, as the command line spells them.
template <class E, std::size_t N>
std::vector<std::string> names_of(const E (&values)[N]) {
  std::vector<std::string> names;
  for (const E v : values) names.emplace_back(zero::name(v));
  return names;
}
inline const std::vector<std::string> kPrecisions = names_of(zero::all_precisions);
inline const std::vector<std::string> kOptimizers{"adamw", "adam", "sgd"};
inline const std::vector<std::string> kOffloadTiers = names_of(zero::all_offload_tiers);

// The help of the ZeRO flags (add_config_options; --nvme-window-mib for the planner too).
inline const char* const kStageHelp =
    "ZeRO stage: 0 plain data parallel, 1 shards optimizer states, 2 also gradients, 3 also parameters";
inline const char* const kPrecisionHelp = "parameters and gradients: fp32, or bf16/fp16 with fp32 master weights";
inline const char* const kOptimizerHelp = "optimizer (torch.optim semantics)";
inline const char* const kNvmeDirHelp = "directory for --offload nvme's swap files (a fast local disk)";
inline const char* const kNvmeWindowHelp = "host memory --offload nvme streams the state through";

// --nvme-window-mib: Options::nvme.window_bytes in MiB (nvme_window_bytes()),
// for the trainers and the planner alike.
inline void add_nvme_window_option(CLI::App& app, double& mib) {
  app.add_option("--nvme-window-mib", mib, kNvmeWindowHelp)
      ->check(kPositive)
      ->capture_default_str();
}

// The Options fields the programs take as flags, each found by its key in
// the field table (zero::Options::fields(); a nested one as "nvme.directory"),
// whose member's type makes the flag: a bool a switch that turns it on, an
// enum one of its names, a number or a text a value.
struct OptionFlag {
  const char* key;
  const char* help;
  const char* flag = nullptr;  // when it is not "--" and the key with dashes
  std::optional<CLI::Validator> check = {};
  bool in_mib = false;  // a byte count, given in MiB
};
inline const OptionFlag kOptionFlags[] = {
    {.key = "master",
     .help = "how the fp32 master weights of bf16 parameters are kept: fp32 (4 bytes per parameter), remainder (the "
             "bf16 parameters plus 16 bits: 2 bytes, the same values bit for bit; copies rounded half away from "
             "zero)"},
    {.key = "states",
     .help = "how the optimizer state (Adam's m and v) is stored: fp32 (4 bytes per value), bf16 (2: rounded to "
             "nearest), bf16_stochastic (2: rounded stochastically), blockwise8 (1: 8-bit codes with an fp32 absmax "
             "per block; docs/lean-states.md)"},
    {.key = "hpz",
     .help = "stage 3: keep a secondary copy of each gathered unit sharded inside the node, so backward's gathers "
             "never leave it (ZeRO++ hpZ; the same values bit for bit, 1/ranks-per-node of the parameters more "
             "memory)"},
    {.key = "hpz_int8",
     .help = "with --hpz: keep the secondary copy as int8 blocks (half its memory and of the gathers inside the "
             "node; backward's parameters within half a step of their block's scale)"},
    {.key = "qwz",
     .help = "stage 3: gather the parameters over every rank as int8 codes with one fp32 scale per block (ZeRO++ "
             "qwZ): about half the bytes of 16-bit parameters, values within half a step of their block's scale"},
    {.key = "qgz",
     .help = "stages 1-3: reduce-scatter the gradients as two all-to-alls of block-quantized codes, inside the node "
             "and then across nodes, summed in fp32 (ZeRO++ qgZ): 1/ranks-per-node of the unit's int4 size crosses "
             "nodes"},
    {.key = "qgz_bits", .help = "--qgz's gradient codes: 4 (int4) or 8 (int8) bits", .check = CLI::IsMember({4, 8})},
    {.key = "qgz_block", .help = "--qgz's elements per fp32 scale (even, 32 to 1048576)"},
    {.key = "qgz_error_feedback",
     .help = "--qgz with error feedback: what each quantization drops is added to the next step's gradient (fp32 "
             "residuals: 4 bytes x (1 + 1/ranks-per-node) per parameter and rank)",
     .flag = "--qgz-feedback"},
    {.key = "check_replicas",
     .help = "compare a fingerprint of every rank's parameters (stage 3: of each gathered unit) at each step, and "
             "name a rank whose bytes differ (silent data corruption)"},
    {.key = "param_place",
     .help = "stage 3: where the parameter and gradient shards live between uses: device (the backend's memory, all "
             "of them) or disk (files under --nvme-dir, read into a few units' pages ahead of use; needs the disk "
             "tier)"},
    {.key = "nvme.directory", .help = kNvmeDirHelp, .flag = "--nvme-dir"},
    {.key = "nvme.window_bytes", .help = kNvmeWindowHelp, .flag = "--nvme-window-mib", .check = kPositive,
     .in_mib = true},
};

// Adds `flag`'s option over its field of `options`; a key the field table
// does not have is a mistake in kOptionFlags, refused on the first run.
inline void add_option_flag(CLI::App& app, zero::Options& options, const OptionFlag& flag) {
  bool found = false;
  zero::detail::for_each_option(options, [&]<class T>(const std::string& key, T& value, zero::AgreedWhen) {
    if (key != flag.key) return;
    found = true;
    std::string name = flag.flag != nullptr ? flag.flag : "--" + key;
    if (flag.flag == nullptr) std::replace(name.begin(), name.end(), '_', '-');
    CLI::Option* option = nullptr;
    if constexpr (std::is_same_v<T, bool>) {
      option = app.add_flag_function(name, [&value](std::int64_t) { value = true; }, flag.help);
    } else if constexpr (std::is_enum_v<T>) {
      option = app.add_option_function<std::string>(
                      name, [&value](const std::string& text) {
                        value = *zero::detail::parse_by_name(text, zero::detail::all_values_of(T{}));
                      },
                      flag.help)
                   ->check(CLI::IsMember(names_of(zero::detail::all_values_of(T{}))))
                   ->default_str(zero::name(value));
    } else if constexpr (std::is_same_v<T, std::string>) {
      option = app.add_option(name, value, flag.help);
    } else if constexpr (std::is_integral_v<T>) {
      if (flag.in_mib)
        option = app.add_option_function<double>(
                        name, [&value](double mib) { value = static_cast<T>(nvme_window_bytes(mib)); }, flag.help)
                     ->default_str(std::to_string(value >> 20));
      else
        option = app.add_option_function<T>(name, [&value](T v) { value = v; }, flag.help)
                     ->default_str(std::to_string(value));
    } else {
      option = app.add_option(name, value, flag.help)->capture_default_str();
    }
    if (flag.check) option->check(*flag.check);
  });
  if (!found)
    throw std::logic_error(std::string("kOptionFlags names '") + flag.key +
                           "', which zero::Options::fields() does not list");
}

// What a program takes in a zero::Config beyond what the library checks:
// the optimizers it can build and the offload tiers it was built with.
struct ConfigChoices {
  std::vector<std::string> optimizers = kOptimizers;
  std::vector<std::string> offload_tiers = kOffloadTiers;
};

// The ZeRO choices as one zero::Config (zero/runtime/config.hpp), from a
// file and the command line: --config FILE (a JSON file, docs/configuration.md),
// then --stage, --precision, --optimizer, --offload and kOptionFlags' flags
// (--master, --states, the ZeRO++ flags --hpz, --hpz-int8, --qwz, --qgz,
// --qgz-bits, --qgz-block and --qgz-feedback, --check-replicas,
// --nvme-dir DIR, --nvme-window-mib MIB).
//
// Contract: after app.parse(), `config` holds what it held before, with
// every setting FILE has replaced (zero::load_config_into: keys FILE does not
// have keep their value), then each of these flags that the command line
// gives replaced, wherever on the line --config stands; a flag not given
// leaves the file's value. (CLI11 runs option callbacks after the whole line
// is read, in the order the options were added; --config is added first.)
// `config` must outlive app.parse(). A file that cannot be read, is not
// JSON, or holds an unknown key or a value of the wrong type is a
// CLI::ValidationError naming --config and the key (parse_or_exit: exit 2).
// The settings are checked together by check_config_options, which the
// program calls from app.callback().
inline void add_config_options(CLI::App& app, zero::Config& config, const ConfigChoices& accepted = {}) {
  app.add_option_function<std::string>(
         "--config",
         [&config](const std::string& path) {
#if defined(ZERO_EXAMPLE_HAVE_CONFIG_FILES)
           try {
             zero::load_config_into(config, path);
           } catch (const zero::Error& e) {
             throw CLI::ValidationError("--config", e.what());
           }
#else
           (void)config;
           throw CLI::ValidationError("--config " + path, "this build reads no configuration files: install "
                                                          "nlohmann-json3-dev and reconfigure");
#endif
         },
         "a JSON file of ZeRO settings (docs/configuration.md), read first: the options below override it")
      ->type_name("FILE");
  app.add_option("--stage", config.stage, kStageHelp)->check(CLI::Range(0, 3))->capture_default_str();
  app.add_option_function<std::string>(
         "--precision", [&config](const std::string& text) { config.precision = *zero::parse_precision(text); },
         kPrecisionHelp)
      ->check(CLI::IsMember(kPrecisions))
      ->default_str(zero::name(config.precision));
  app.add_option("--optimizer", config.optimizer, kOptimizerHelp)
      ->check(CLI::IsMember(accepted.optimizers))
      ->capture_default_str();
  app.add_option_function<std::string>(
         "--offload", [&config](const std::string& text) { config.offload = *zero::parse_offload(text); },
         "where the fp32 master weights and optimizer state live: none (with the parameters), cpu (page-locked "
         "host memory, updated by the CPU; GPU backends, stages 1-3), nvme (swap files under --nvme-dir, streamed "
         "through a host window; stages 1-3)")
      ->check(CLI::IsMember(accepted.offload_tiers))
      ->default_str(zero::name(config.offload));
  for (const OptionFlag& flag : kOptionFlags) add_option_flag(app, config.options, flag);
}

// Checks the settings together (zero::Config::validate: the stage, offload
// against the stage and the backend, the disk tier's directory, the
// Options) and against the program's choices, whether they came from the
// file or a flag; for app.callback(), after add_config_options. Throws
// CLI::ValidationError with the library's message.
inline void check_config_options(const zero::Config& config, bool device_backend, const ConfigChoices& accepted = {}) {
  const auto refuse_unless_in = [](const std::vector<std::string>& names, const std::string& value,
                                   const std::string& option, const std::string& what) {
    for (const auto& n : names)
      if (n == value) return;
    throw CLI::ValidationError(option + " " + value, "this program " + what + ": " + zero::detail::join_names(names));
  };
  refuse_unless_in(accepted.optimizers, config.optimizer, "--optimizer",
                   "has these optimizers (--optimizer, optimizer.type in --config)");
  refuse_unless_in(accepted.offload_tiers, zero::name(config.offload), "--offload",
                   "was built with these offload tiers (--offload, offload.tier in --config)");
  try {
    config.validate(device_backend);
  } catch (const zero::InvalidArgument& e) {
    throw CLI::ValidationError(e.what());
  }
}

// --ranks N (in-process ranks; 1..max_ranks) and --comm, one of `comms`
// (the communicators this program was built with, the first the default).
inline void add_launch_options(CLI::App& app, LaunchChoices& choices, std::vector<std::string> comms,
                               int max_ranks = 64) {
  app.add_option("--ranks", choices.ranks, "data-parallel ranks (threads of this process with --comm local)")
      ->check(CLI::Range(1, max_ranks))
      ->capture_default_str();
  app.add_option("--comm", choices.comm, "communicator: local = ranks as threads, mpi = the processes of mpirun")
      ->check(CLI::IsMember(std::move(comms)))
      ->capture_default_str();
  app.add_option("--ranks-per-node", choices.ranks_per_node,
                 "ranks per node, ranks filling nodes in order (a divisor of the rank count): what comm_report counts "
                 "as crossing nodes, and the node --hpz gathers inside; --comm local simulates the nodes; 0: one node "
                 "(local), Open MPI's own count (mpi)")
      ->check(CLI::Range(0, max_ranks))
      ->capture_default_str();
}

// --save DIR, --save-every K, --save-async, --keep-last K and --resume DIR.
// For their help: `saved_at` says where the program saves besides every
// --save-every steps ("after the last step"), `resume_rule` what a resumed
// run may change and what it must keep.
inline void add_checkpoint_options(CLI::App& app, CheckpointChoices& choices, const std::string& saved_at,
                                   const std::string& resume_rule) {
  app.add_option("--save", choices.save_dir,
                 "write a checkpoint to DIR/step-<step> " + saved_at + " (and every --save-every steps)")
      ->type_name("DIR");
  app.add_option("--save-every", choices.save_every, "also checkpoint every K optimizer steps (needs --save)")
      ->check(CLI::Range(1, 1 << 30));
  app.add_flag("--save-async", choices.save_async,
               "write checkpoints in the background: training goes on once the state is copied to memory; each "
               "completes at the next save or at the end of the run");
  app.add_option("--keep-last", choices.keep_last, "keep only the K newest complete checkpoints in --save DIR")
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--resume", choices.resume_dir,
                 "continue from the newest complete checkpoint in DIR (" + resume_rule + ")")
      ->type_name("DIR");
}
// The checks between them (from app.callback()). A program built without
// checkpoints (no ZERO_EXAMPLE_HAVE_CHECKPOINTS: Meson found no nlohmann-json
// or xxHash) refuses --save and --resume.
inline void check_checkpoint_choices(const CheckpointChoices& choices) {
#if !defined(ZERO_EXAMPLE_HAVE_CHECKPOINTS)
  if (!choices.save_dir.empty() || !choices.resume_dir.empty())
    throw CLI::ValidationError("--save/--resume", "this build has no checkpoints (install nlohmann-json3-dev and "
                                                  "libxxhash-dev, then reconfigure)");
#endif
  for (const auto& [set, option] : {std::pair{choices.save_every > 0, "--save-every"},
                                    std::pair{choices.save_async, "--save-async"},
                                    std::pair{choices.keep_last > 0, "--keep-last"}})
    if (set && choices.save_dir.empty()) throw CLI::ValidationError(option, "needs --save DIR");
}

// Parses the command line, or ends the program: --help prints the options
// and exits 0, a bad command line prints CLI11's message and exits 2. Checks
// that span options belong in app.callback(), throwing CLI::ValidationError.
inline void parse_or_exit(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e) == 0 ? 0 : 2);
  }
}

// For a problem with an option found after parsing (say, against the MPI
// world size): the same message format and exit code as a parse error.
[[noreturn]] inline void fail_option(CLI::App& app, const std::string& option, const std::string& problem) {
  app.exit(CLI::ValidationError(option, problem));
  std::exit(2);
}

}  // namespace zero::examples
