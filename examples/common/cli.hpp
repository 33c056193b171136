// Why: the example programs (the trainers, the zero_plan planner) take the
// same ZeRO choices on their command lines. One place names those options,
// checks their values, and makes --help and errors read the same in every
// program: CLI11's format, --help listing each option with its default,
// exit 0 for --help and 2 for any bad command line.
#pragma once

#include <CLI/CLI.hpp>

#include "common/choices.hpp"

#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

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

inline const std::vector<std::string> kPrecisions{"fp32", "bf16", "fp16"};
inline const std::vector<std::string> kOptimizers{"adamw", "adam", "sgd"};

// --stage 0..3, --precision fp32|bf16|fp16, --optimizer adamw|adam|sgd.
inline void add_zero_options(CLI::App& app, ZeroChoices& choices) {
  app.add_option("--stage", choices.stage,
                 "ZeRO stage: 0 plain data parallel, 1 shards optimizer states, 2 also gradients, 3 also parameters")
      ->check(CLI::Range(0, 3))
      ->capture_default_str();
  app.add_option("--precision", choices.precision,
                 "parameters and gradients: fp32, or bf16/fp16 with fp32 master weights")
      ->check(CLI::IsMember(kPrecisions))
      ->capture_default_str();
  app.add_option("--optimizer", choices.optimizer, "optimizer (torch.optim semantics)")
      ->check(CLI::IsMember(kOptimizers))
      ->capture_default_str();
}

// --nvme-window-mib: Options::nvme.window_bytes in MiB (nvme_window_bytes()),
// for the trainers and the planner alike.
inline void add_nvme_window_option(CLI::App& app, double& mib) {
  app.add_option("--nvme-window-mib", mib, "host memory --offload nvme streams the state through (MiB)")
      ->check(kPositive)
      ->capture_default_str();
}

// --offload, one of `tiers` (those this program was built with, the first
// the default), --nvme-dir DIR and --nvme-window-mib; checked together.
inline void add_offload_options(CLI::App& app, ZeroChoices& choices, std::vector<std::string> tiers) {
  app.add_option("--offload", choices.offload,
                 "where the fp32 master weights and optimizer state live: none (with the parameters), nvme (swap "
                 "files under --nvme-dir, streamed through a host window; stages 1-3)")
      ->check(CLI::IsMember(std::move(tiers)))
      ->capture_default_str();
  app.add_option("--nvme-dir", choices.nvme_dir, "directory for --offload nvme's swap files (a fast local disk)");
  add_nvme_window_option(app, choices.nvme_window_mib);
}
// The checks between them and --stage (from app.callback()).
inline void check_offload_choices(const ZeroChoices& choices) {
  if (choices.offload == "none") return;
  if (choices.stage == 0)
    throw CLI::ValidationError("--offload " + choices.offload,
                               "needs --stage 1, 2 or 3: stage 0 has no partition of the optimizer state to offload");
  if (choices.offload == "nvme" && choices.nvme_dir.empty())
    throw CLI::ValidationError("--offload nvme", "needs --nvme-dir DIR, a directory on a fast local disk");
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
