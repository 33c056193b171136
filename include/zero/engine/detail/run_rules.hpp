// Why: which runs are refused was written five times (ZeroOptimizer's
// static_asserts, the engine's constructor and finalize(), zero::Config,
// the schedule and the planner), and the copies had begun to differ in what
// they refused, not only in their words. Each rule is stated here once: what
// breaks it (a predicate over the run's description and its Options) and
// what to say (the problem and the fix). A caller adds its own voice, the
// name it speaks as and how its reader spells a setting (a template
// argument, an Options field, a config file's key or a flag), and picks
// nothing else: every caller runs the same list.
//
// The static_asserts cannot print a computed message (C++20 takes a string
// literal), so they test the same predicates (rule_broken) and keep their
// literal words; tests/runtime/test_config.cpp holds those words to these.
#pragma once

#include "zero/compiler.hpp"

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "zero/engine/detail/disk_window.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/run_shape.hpp"
#include "zero/error.hpp"

namespace zero {

enum class RunRule : std::uint8_t {
  stage_exists,                 // stages 0-3
  offload_needs_partition,      // offload moves a partition: stage >= 1
  cpu_offload_needs_device,     // offload::Cpu moves state off a device
  remainder_master_needs_bf16,  // Options::master = remainder: bf16 parameters
  bf16_copy_options,            // rounding options of bf16 copies need bf16 copies
  zeropp_stage,                 // hpZ and qwZ at stage 3, qgZ at stages 1-3
  delayed_update_needs_offload_from_device,
  released_pages_need_host,     // Options::release_memory_pages: host memory only
  disk_window,                  // offload::Nvme's window holds three chunks
  params_on_disk,               // Options::param_place = disk: stage 3, backend::Host
};

// In the order they are checked: the run's shape first, then its Options.
inline constexpr std::array all_run_rules{
    RunRule::stage_exists,       RunRule::offload_needs_partition,
    RunRule::cpu_offload_needs_device, RunRule::remainder_master_needs_bf16,
    RunRule::bf16_copy_options,  RunRule::zeropp_stage,
    RunRule::delayed_update_needs_offload_from_device, RunRule::released_pages_need_host,
    RunRule::disk_window,        RunRule::params_on_disk};

// The rules a run's shape alone breaks (no Options): constant expressions,
// for ZeroOptimizer's static_asserts. Any other rule: false.
constexpr bool shape_breaks(RunRule rule, const RunShape& run) {
  switch (rule) {
    case RunRule::stage_exists: return run.stage.stage < 0 || run.stage.stage > 3;
    case RunRule::offload_needs_partition: return run.offloaded() && !run.stage.states_sharded;
    case RunRule::cpu_offload_needs_device: return run.offload == OffloadTier::cpu && !run.device_backend;
    default: return false;
  }
}

// Who speaks, and how its reader spells what the rules name.
struct Voice {
  const char* who;  // the first words of every message: "zero::ZeroOptimizer", "zero::Config", "plan"
  // true: as C++ names them (stage<1>, offload::Cpu, backend::Host,
  // Options::master); false: as values (stage 1, offload cpu, the host
  // backend, master), as zero::Config and its files and flags do.
  bool types = true;
  // Where a config file and the command line set each setting, after the fix.
  bool config_keys = false;

  std::string stage(int s) const { return types ? detail::concat("stage<", s, ">") : detail::concat("stage ", s); }
  std::string tier(OffloadTier t) const {
    if (!types) return detail::concat("offload ", name(t));
    return t == OffloadTier::none ? "offload::None" : t == OffloadTier::cpu ? "offload::Cpu" : "offload::Nvme";
  }
  std::string offloading_tiers() const { return types ? "offload::Cpu/Nvme" : "offload cpu/nvme"; }
  std::string host_backend() const { return types ? "backend::Host" : "the host backend"; }
  std::string precision(PrecisionChoice p) const {
    if (!types) return detail::concat("precision ", name(p));
    return p == PrecisionChoice::fp32 ? "precision::Full<float>"
                                      : detail::concat("precision::Mixed<", name(p), ">");
  }
  // An option with its value: "Options::master is remainder" or "master remainder".
  std::string option_is(const char* field, const char* value) const {
    return types ? detail::concat("Options::", field, " is ", value) : detail::concat(field, " ", value);
  }
  std::string option(const char* field) const { return types ? detail::concat("Options::", field) : field; }
  std::string option_set(const char* field, const char* value) const {
    return types ? detail::concat("Options::", field, " = ", value) : detail::concat(field, " ", value);
  }
  // " (\"key\" in a config file, --flag on the command line)", for Config's voice.
  std::string keys(const char* where) const { return config_keys ? detail::concat(" (", where, ")") : ""; }
};

// What is wrong with `run` and `options` by `rule`, in `voice`'s words
// (without its name), or "" where the rule holds.
inline std::string rule_problem(RunRule rule, const RunShape& run, const Options& options, const Voice& voice) {
  using detail::concat;
  if (shape_breaks(rule, run)) switch (rule) {
      case RunRule::stage_exists:
        return concat(voice.stage(run.stage.stage), " is not a ZeRO stage: ZeRO has stages 0, 1, 2 and 3",
                      voice.keys("\"stage\" in a config file, --stage on the command line"));
      case RunRule::offload_needs_partition:
        return concat(voice.tier(run.offload), ": ZeRO-Offload moves this rank's partition of the optimizer state to "
                      "the host; stage 0 has no partition: use ", voice.stage(1), " or higher with ",
                      voice.offloading_tiers(),
                      voice.types ? " (offload needs stage >= 1)" : " (or offload none at stage 0)");
      case RunRule::cpu_offload_needs_device:
        return concat(voice.tier(OffloadTier::cpu), " moves optimizer state from GPU memory to the host, but with ",
                      voice.host_backend(), " it is already in host memory; use ", voice.tier(OffloadTier::none),
                      " (or ", voice.tier(OffloadTier::nvme), " to move it to disk)");
      default: break;
    }
  switch (rule) {
    case RunRule::remainder_master_needs_bf16:
      if (options.master != MasterWeights::remainder || run.precision == PrecisionChoice::bf16) return "";
      return concat(voice.types ? "Options::master is remainder: the remainder master" : "master remainder",
                    " keeps the fp32 master as the bf16 parameters plus 16 bits, but the precision is ",
                    name(run.precision), ": use ", voice.precision(PrecisionChoice::bf16), ", or ",
                    voice.option_set("master", "fp32"), " (",
                    run.mixed() ? "an fp16 value's upper bits are not an fp32 value's"
                                : "fp32 training keeps no master apart from its parameters",
                    ")", voice.keys("\"master\" in a config file, --master on the command line"));
    case RunRule::bf16_copy_options: {
      const std::string copies = bf16_copy_option_problem(options, run.precision);
      return copies.empty() ? "" : concat(voice.types ? "Options::" : "", copies);
    }
    case RunRule::zeropp_stage: {
      const std::string zeropp = zeropp_stage_problem(options.hpz, options.qwz, options.qgz, run.stage.stage);
      return zeropp.empty() ? ""
                            : concat(voice.types ? "Options::" : "", zeropp,
                                     voice.keys("\"hpz\", \"qwz\" and \"qgz\" in a config file, --hpz, --qwz and "
                                                "--qgz on the command line"));
    }
    case RunRule::delayed_update_needs_offload_from_device:
      if (!options.delayed_update || run.offload_host_staging()) return "";
      return concat(voice.option("delayed_update"), " overlaps the CPU update of offload with the next step's work "
                    "on the device; it needs ", voice.offloading_tiers(), " with a device backend (backend::Cuda); "
                    "clear the option otherwise");
    case RunRule::released_pages_need_host:
      if (!options.release_memory_pages || !run.device_backend) return "";
      return concat(voice.option("release_memory_pages"), " hands the pages of your host arrays back to the "
                    "operating system; with a device backend your memory is the device's: clear the option");
    case RunRule::disk_window:
      if (run.offload != OffloadTier::nvme) return "";
      return offload::disk_window_problem(options.nvme.window_bytes,
                                          run.state_slots < 0 ? std::nullopt : std::optional<int>(run.state_slots),
                                          master_element_bytes(options.master), state_element_bytes(options.states),
                                          name(options.master), name(options.states), run.optimizer);
    case RunRule::params_on_disk:
      if (options.param_place != ParamPlace::disk) return "";
      if (!run.stage.params_sharded)
        return concat(voice.option_is("param_place", "disk"), " keeps stage 3's parameter and gradient shards on disk "
                      "between their uses; at ", voice.stage(run.stage.stage), " every rank holds the parameters whole and uses "
                      "them all at once: use ", voice.stage(3), ", or ", voice.option_set("param_place", "device"),
                      voice.keys("\"param_place\" in a config file, --param-place on the command line"));
      if (run.device_backend)
        return concat(voice.option_is("param_place", "disk"), " is built for ", voice.host_backend(), " so far (its "
                      "pages are the backend's memory, read from the file directly); with a device backend keep ",
                      voice.option_set("param_place", "device"), " and move the state with ",
                      voice.tier(OffloadTier::nvme));
      return "";
    default: return "";
  }
}

// The first rule of `rules` that `run` and `options` break, as
// "<who>: <problem>", or "".
template <class Rules = decltype(all_run_rules)>
std::string run_problem(const RunShape& run, const Options& options, const Voice& voice,
                        const Rules& rules = all_run_rules) {
  for (const RunRule rule : rules)
    if (std::string problem = rule_problem(rule, run, options, voice); !problem.empty())
      return detail::concat(voice.who, ": ", problem);
  return "";
}

// Throws zero::InvalidArgument with run_problem's words, if any.
template <class Rules = decltype(all_run_rules)>
void require_run(const RunShape& run, const Options& options, const Voice& voice,
                 const Rules& rules = all_run_rules) {
  if (std::string problem = run_problem(run, options, voice, rules); !problem.empty())
    throw InvalidArgument(std::move(problem));
}

}  // namespace zero
