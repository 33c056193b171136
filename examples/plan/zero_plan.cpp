// zero_plan: will my model fit, and what will it cost? Before renting GPUs,
// prints per rank the bytes of every buffer zero::ZeroOptimizer would
// allocate (parameters, gradients, fp32 master, optimizer states,
// communication buffers, padding), split by device / host / disk, and the
// bytes each rank sends and receives per optimizer step, beside the ZeRO
// paper's formulas. The figures come from zero/engine/plan.hpp, which runs the
// engine's own layout and schedule (engine/detail/schedule.hpp: buffer sizes, their
// places, the collectives of a step) for every offload tier
// (tests/engine/test_engine_plan.cpp holds them to real optimizers' reports,
// to the byte). The disk tier's window is --nvme-window-mib, the option the
// trainers take (common/cli.hpp).
//
//   zero_plan --params 7B --units 32 --ranks-per-node 8 --stage 3
//   zero_plan --layers 32 --width 4096 --vocab 50257 --context 2048 --nodes 2 --device-memory 80G
//   zero_plan --unit-sizes 1000,1077,37+1 --stage 2 --json
//   zero_plan --params 20B --units 48 --ranks-per-node 8 --stage 3 --offload nvme --nvme-window-mib 256
#include <CLI/CLI.hpp>

#include <cctype>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "zero/engine/plan.hpp"

namespace {

namespace plan = zero::plan;

// A number with an optional suffix, in powers of `base`: counts of
// parameters in powers of 1000 ("7B", "1.5M", "350K"), bytes in powers of
// 1024 ("80G", "80GiB", "512M").
struct Scale {
  double base;
  const char* suffixes;  // the i-th stands for base^(i+1)
  const char* what;      // for the error message
};
constexpr Scale count_scale{1000, "KMBT", "a count; write a positive number with an optional K/M/B/T suffix (powers "
                                          "of 1000), e.g. 7B or 350M"};
constexpr Scale byte_scale{1024, "KMGT", "a size; write a positive number of bytes with an optional K/M/G/T suffix "
                                         "(powers of 1024), e.g. 80G or 512M"};

std::uint64_t parse_scaled(const std::string& text, const std::string& option, const Scale& scale) {
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string rest = text.substr(used);
  if (&scale == &byte_scale) {
    if (rest.ends_with("iB")) rest.resize(rest.size() - 2);        // 80GiB
    else if (rest.ends_with("B")) rest.resize(rest.size() - 1);    // 80GB (read as GiB), 4096B
  }
  if (!rest.empty()) {
    const char* at = rest.size() == 1 ? std::strchr(scale.suffixes, std::toupper(rest[0])) : nullptr;
    if (at == nullptr || *at == '\0') used = 0;
    else value *= std::pow(scale.base, static_cast<double>(at - scale.suffixes + 1));
  }
  const double n = std::round(value);
  if (used == 0 || !(n >= 1) || n > 1e18)
    throw CLI::ValidationError(option, "'" + text + "' is not " + scale.what);
  return static_cast<std::uint64_t>(n);
}

// "1000,1077,37+1": one unit per comma, its parameters joined by '+'.
plan::Model parse_units(const std::string& text) {
  plan::Model m;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    plan::Unit u{"unit" + std::to_string(m.units.size()), {}};
    std::size_t p = start;
    while (p <= comma) {
      const std::size_t plus = std::min(text.find('+', p), comma);
      u.params.push_back(static_cast<std::size_t>(parse_scaled(text.substr(p, plus - p), "--unit-sizes", count_scale)));
      p = plus + 1;
    }
    m.units.push_back(std::move(u));
    start = comma + 1;
  }
  m.description = std::to_string(m.units.size()) + " unit(s) as listed";
  return m;
}

// n in the largest of `units` (powers of `base`) that keeps it >= 1.
template <std::size_t K>
std::string scaled_text(std::uint64_t n, double base, const char* const (&units)[K]) {
  double v = static_cast<double>(n);
  std::size_t i = 0;
  for (; v >= base && i + 1 < K; ++i) v /= base;
  char s[32];
  std::snprintf(s, sizeof s, i == 0 ? "%.0f%s" : "%.2f%s", v, units[i]);
  return s;
}
// Binary units; a dash for nothing in tables (`dash`), "0 B" in sentences.
std::string bytes_text(std::uint64_t b, bool dash = true) {
  static const char* const units[] = {" B", " KiB", " MiB", " GiB", " TiB", " PiB"};
  return b == 0 && dash ? "-" : scaled_text(b, 1024, units);
}
std::string count_text(std::uint64_t n) {
  static const char* const units[] = {"", " K", " M", " B", " T"};
  return scaled_text(n, 1000, units);
}

void print_table(const plan::Plan& p) {
  const plan::Scenario& c = p.scenario;
  const std::size_t pb = plan::element_bytes(c.precision);
  const std::uint64_t k = p.paper_k;  // the master's and the state's formats decide it (plan.hpp)
  std::printf("model: %s; %s parameters (%llu; %llu with padding) in %zu unit(s)\n", c.model.description.c_str(),
              count_text(p.param_elements).c_str(), static_cast<unsigned long long>(p.param_elements),
              static_cast<unsigned long long>(p.padded_elements), c.model.units.size());
  std::printf("run: %d rank(s) (%d per node x %d node(s)), stage %d, %s, %s (K = %llu bytes/parameter: master %s, "
              "states %s), offload %s, %s backend\n",
              c.ranks(), c.ranks_per_node, c.nodes, c.stage, plan::name(c.precision), c.optimizer.c_str(),
              static_cast<unsigned long long>(k), zero::name(c.options.master), zero::name(c.options.states),
              plan::name(c.offload), c.device_backend ? "device" : "host");
  const zero::GradientBuckets& buckets = p.sizes.buckets;
  std::printf("options: bucket %s (%zu bucket(s) of up to %zu unit(s), the largest %s; %zu staging set(s)), "
              "gradients %s, prefetch %d, accumulation %d, reduce in %s, overlap %s\n\n",
              bytes_text(p.sizes.bucket_bytes).c_str(), buckets.buckets.size(), buckets.max_units,
              bytes_text(buckets.max_elements * pb).c_str(), p.sizes.staging_sets,
              c.options.grad_writes == zero::GradWrites::accumulate ? "added (accumulate)" : "assigned (overwrite)",
              c.options.prefetch_units, c.options.grad_accumulation_steps,
              c.options.reduce_dtype == zero::ReduceDType::fp32 ? "fp32" : plan::name(c.precision),
              c.overlap ? "on" : "off");
  if (!p.schedule.gradient_note.empty()) std::printf("%s\n\n", p.schedule.gradient_note.c_str());
  if (p.rank < 0)
    std::printf("each line the largest of any rank's (ranks differ by the 8-bit blocks their shards cut; --rank R "
                "prints rank R's)\n");
  else if (c.ranks_differ())
    std::printf("rank %d's buffers (--rank; ranks differ by the 8-bit blocks their shards cut)\n", p.rank);
  std::printf("%-28s %14s %14s %14s\n", "per rank", "device", "host", "disk");
  for (const auto& l : p.lines) {
    if (l.total() == 0 && l.name != "params") continue;
    const std::string label = l.name == "padding" ? "  (padding, included above)" : "  " + l.name;
    std::printf("%-28s %14s %14s %14s\n", label.c_str(), bytes_text(l.device).c_str(), bytes_text(l.host).c_str(),
                bytes_text(l.disk).c_str());
  }
  std::printf("%-28s %14s %14s %14s\n\n", "total", bytes_text(p.total.device).c_str(), bytes_text(p.total.host).c_str(),
              bytes_text(p.total.disk).c_str());
  const std::string hpz_copy =
      c.options.hpz ? " and the hpZ copy of " + bytes_text(p.sizes.hpz_secondary * pb) + " (--hpz)" : "";
  std::printf("model states: %s per rank; ZeRO paper %s = %s (Φ = %s, K = %llu, N = %d; the difference is padding%s)\n",
              bytes_text(p.model_states()).c_str(), plan::paper_formula(c.stage, pb, pb, k).c_str(),
              bytes_text(p.paper_model_state_bytes).c_str(), count_text(p.param_elements).c_str(),
              static_cast<unsigned long long>(k), c.ranks(), hpz_copy.c_str());
  const std::string all_to_all =
      c.options.qgz ? ", all-to-all " + bytes_text(p.comm.all_to_all_bytes) + " (--qgz's reduce-scatters)" : "";
  std::printf("communication per step and rank: %s elements, %s sent, %s received (all-reduce %s, reduce-scatter %s, "
              "all-gather %s%s; control %llu B)\n",
              count_text(p.comm.elements).c_str(), bytes_text(p.comm.bytes_sent).c_str(),
              bytes_text(p.comm.bytes_received).c_str(), bytes_text(p.comm.all_reduce_bytes).c_str(),
              bytes_text(p.comm.reduce_scatter_bytes).c_str(), bytes_text(p.comm.all_gather_bytes).c_str(),
              all_to_all.c_str(), static_cast<unsigned long long>(p.comm.control_bytes));
  std::printf("  ZeRO paper: %sΦ(N-1)/N = %s elements per step%s\n", c.stage == 3 ? "3" : "2",
              count_text(p.paper_comm_elements).c_str(),
              c.options.grad_accumulation_steps > 1 && c.stage >= 2
                  ? " (for one micro-batch; reduce-scatters here run every micro-batch)"
                  : "");
  if (c.nodes > 1)
    std::printf("  across nodes per step: %s sent by each node's last rank (its ring link leaves the node; the "
                "node's other ranks' ring links stay inside it%s), %s by all %d ranks together (what the links "
                "between nodes carry), %s per rank on average\n",
                bytes_text(p.comm.across_busiest_rank).c_str(),
                c.options.qgz ? "; with --qgz every rank also sends its node's partial sums across" : "",
                bytes_text(p.comm.across_all_ranks).c_str(), c.ranks(),
                bytes_text(p.comm.across_all_ranks / static_cast<std::uint64_t>(c.ranks())).c_str());
  if (c.offload == plan::Offload::cpu)
    std::printf("offload cpu: fp32 master and states in page-locked host memory, updated by the CPU; the owned "
                "gradient's host copy%s\n",
                c.options.delayed_update ? " (two sets: delayed update)" : "");
  if (c.offload == plan::Offload::nvme)
    std::printf("offload nvme: %s master and %s states in swap files (%s per rank, whole records of up to %zu "
                "elements), streamed through a %s host window (--nvme-window-mib)\n",
                zero::name(c.options.master), zero::name(c.options.states),
                bytes_text(p.sizes.swap_file_bytes, false).c_str(), p.sizes.disk_chunk,
                bytes_text(p.line("nvme_window").host, false).c_str());
  if (c.options.param_place == zero::ParamPlace::disk)
    std::printf("parameters and gradients on disk: %s of parameter shards and %s of gradient shards, a file per "
                "rank each (%s and %s with their 4 KiB records), each read into %s of pages (--prefetch-units + 2 of "
                "the largest shard)\n",
                bytes_text(p.line("params").disk, false).c_str(), bytes_text(p.line("grads").disk, false).c_str(),
                bytes_text(p.sizes.param_file_bytes, false).c_str(), bytes_text(p.sizes.grad_file_bytes, false).c_str(),
                bytes_text(p.sizes.param_pages * pb, false).c_str());
  std::printf("not counted: activations, your framework's workspace, the CUDA context and NCCL's own buffers\n");
}

struct Limits {
  std::optional<std::uint64_t> device, host;
  bool given() const { return device || host; }
  bool fit(const plan::Plan& p) const {
    return (!device || p.total.device <= *device) && (!host || p.total.host <= *host);
  }
};

std::string footprint(const plan::Plan& p) {
  std::string s = bytes_text(p.total.device, false) + " device";
  if (p.total.host) s += ", " + bytes_text(p.total.host) + " host";
  return s;
}

// One line: fits or not, by how much, and what would make it fit.
void print_verdict(std::FILE* out, const plan::Plan& p, const Limits& limits) {
  const plan::Scenario& c = p.scenario;
  std::string over;
  auto describe = [&](const char* where, std::uint64_t need, std::optional<std::uint64_t> have) {
    if (!have) return;
    const std::string part = bytes_text(need, false) + " of " + bytes_text(*have) + " " + where + " memory";
    if (need <= *have)
      over += (over.empty() ? "" : "; ") + part + " (" + bytes_text(*have - need) + " left)";
    else
      over += (over.empty() ? "" : "; ") + std::string("needs ") + part + " (" + bytes_text(need - *have) + " over)";
  };
  describe("device", p.total.device, limits.device);
  describe("host", p.total.host, limits.host);
  if (limits.fit(p)) {
    std::fprintf(out, "verdict: fits: %s, before activations\n", over.c_str());
    return;
  }
  std::vector<std::string> fixes;
  for (int s = c.stage + 1; s <= 3; ++s) {
    plan::Scenario t = c;
    t.stage = s;
    const plan::Plan q = plan::make_plan(t);
    if (limits.fit(q)) {
      fixes.push_back("--stage " + std::to_string(s) + " (" + footprint(q) + ")");
      break;
    }
  }
  for (const plan::Offload o : {plan::Offload::cpu, plan::Offload::nvme}) {
    if (c.offload == o || (c.offload == plan::Offload::nvme && o == plan::Offload::cpu)) continue;
    if (o == plan::Offload::cpu && !c.device_backend) continue;  // the host backend's state is in host memory
    bool found = false;
    for (int s = std::max(c.stage, 1); s <= 3 && !found; ++s) {
      plan::Scenario t = c;
      t.stage = s;
      t.offload = o;
      const plan::Plan q = plan::make_plan(t);
      if (limits.fit(q)) {
        fixes.push_back((s != c.stage ? "--stage " + std::to_string(s) + " " : std::string()) + "--offload " +
                        plan::name(o) + " (" + footprint(q) + ")");
        found = true;
      }
    }
    if (found) break;
  }
  // More nodes: at this stage, else at stage 3 (stage 0 keeps everything
  // whole, and stages 1-2 keep whole parameters: more ranks may not help).
  for (const int s : {c.stage, 3}) {
    bool found = false;
    for (int nodes = c.nodes * 2; s >= 1 && nodes <= c.nodes * 4096 && !found; nodes *= 2) {
      plan::Scenario t = c;
      t.stage = s;
      t.nodes = nodes;
      const plan::Plan q = plan::make_plan(t);
      if (limits.fit(q)) {
        fixes.push_back((s != c.stage ? "--stage " + std::to_string(s) + " " : std::string()) + "--nodes " +
                        std::to_string(nodes) + " (" + std::to_string(q.scenario.ranks()) + " ranks, " + footprint(q) +
                        ")");
        found = true;
      }
    }
    if (found) break;
  }
  std::string advice;
  for (const auto& f : fixes) advice += (advice.empty() ? "" : ", or ") + f;
  std::fprintf(out, "verdict: does not fit: %s; %s\n", over.c_str(),
              advice.empty() ? "no higher stage, offload tier or node count up to 4096x makes it fit"
                             : ("would fit with " + advice).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"zero_plan: memory per rank and communication per step of zero::ZeroOptimizer, before a run.\n"
               "Give the model as --params (with --units), as a GPT shape (--layers --width --vocab --context), or "
               "as --unit-sizes.\nOffload: cpu puts the fp32 master and optimizer states in host memory (the CPU "
               "updates them), nvme in swap files on disk behind a host window of --nvme-window-mib.\nNot counted: "
               "activations and framework workspace."};
  app.option_defaults()->always_capture_default();

  std::string params_text, unit_sizes;
  std::size_t units = 1, layers = 0, width = 0, vocab = 0, context = 0, heads = 0;
  auto* params_opt = app.add_option("--params", params_text, "Parameter count, K/M/B/T suffixes (7B, 350M)");
  app.add_option("--units", units,
                 "With --params: split into this many equal units (layers). The largest units size the stage-3 "
                 "gather arena, the largest bucket of whole units the gradient staging")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 24))
      ->needs(params_opt);
  auto* layers_opt = app.add_option("--layers", layers, "GPT shape: transformer blocks (one unit each)");
  auto* width_opt = app.add_option("--width", width, "GPT shape: model width D (a block has 12D^2+13D parameters)");
  auto* vocab_opt = app.add_option("--vocab", vocab, "GPT shape: vocabulary (token embedding V x D, tied output)");
  auto* context_opt = app.add_option("--context", context, "GPT shape: context length (learned positions C x D)");
  app.add_option("--heads", heads, "GPT shape: attention heads (must divide --width; counts do not change)");
  auto* unit_sizes_opt = app.add_option(
      "--unit-sizes", unit_sizes, "Units as listed: comma-separated unit sizes, '+' between a unit's parameters "
                                  "(1000,1077,37+1)");
  for (auto* o : {layers_opt, width_opt, vocab_opt, context_opt}) {
    o->excludes(params_opt)->excludes(unit_sizes_opt);
    for (auto* other : {layers_opt, width_opt, vocab_opt, context_opt})
      if (other != o) o->needs(other);
  }
  params_opt->excludes(unit_sizes_opt);

  plan::Scenario config;
  config.stage = 3;
  app.add_option("--ranks-per-node", config.ranks_per_node, "Ranks (GPUs) per node")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--nodes", config.nodes, "Nodes; the data-parallel degree N = ranks per node x nodes")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--stage", config.stage, "ZeRO stage: 0 data parallel, 1 optimizer states, 2 + gradients, "
                                          "3 + parameters")
      ->check(CLI::Range(0, 3));
  std::string offload = "none", precision = "bf16", optimizer = "adamw", reduce = "grad", backend = "cuda";
  app.add_option("--offload", offload, "Where master and optimizer states live: none (with the parameters), cpu "
                                       "(host memory; needs --backend cuda), nvme (disk, behind a host window)")
      ->check(CLI::IsMember({"none", "cpu", "nvme"}));
  app.add_option("--backend", backend, "Where the model runs: cuda (GPUs: device memory) or host (CPU ranks: every "
                                       "buffer in host memory)")
      ->check(CLI::IsMember({"cuda", "host"}));
  app.add_option("--precision", precision, "fp32, or bf16/fp16 parameters and gradients with fp32 master")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--optimizer", optimizer, "adam, adamw (2 fp32 states) or sgd (1: the momentum buffer; none "
                                           "with --momentum 0)")
      ->check(CLI::IsMember({"adam", "adamw", "sgd"}));
  double momentum = 0.9;
  app.add_option("--momentum", momentum, "SGD's momentum (the trainers' default 0.9); 0 keeps no momentum buffer, "
                                         "as torch.optim.SGD")
      ->check(CLI::Range(0.0, 1e300));
  std::string bucket_text = "auto";
  app.add_option("--bucket-bytes", bucket_text, "Options::bucket_bytes: gradient bucket, K/M/G suffixes (powers of "
                                                "1024), or auto (the default: 32M, at stages 2-3 at most a quarter "
                                                "of the gradient per staging set)");
  std::string grad_writes = "overwrite";
  app.add_option("--grad-writes", grad_writes, "Options::grad_writes: overwrite (backward assigns one unit's gradient at a "
                                               "time) or accumulate (adds into zeroed buffers of any units: stages 0-1 "
                                               "need no staging, stages 2-3 stage --live-buckets buckets)")
      ->check(CLI::IsMember({"overwrite", "accumulate"}));
  app.add_option("--live-buckets", config.options.live_buckets, "Options::live_buckets (with --grad-writes accumulate)")
      ->check(CLI::Range(1, 64));
  app.add_option("--prefetch-units", config.options.prefetch_units, "Options::prefetch_units (the stage-3 gather "
                                                                    "arena holds this + 1 of the largest units)")
      ->check(CLI::Range(0, 16));
  app.add_option_function<std::string>(
         "--param-place",
         [&](const std::string& text) {
           config.options.param_place = *zero::detail::parse_by_name(text, zero::all_param_places);
         },
         "Options::param_place: where stage 3 keeps the parameter and gradient shards between uses: device (the "
         "backend's memory) or disk (files, with pages for --prefetch-units + 2 units of each in memory)")
      ->check(CLI::IsMember({"device", "disk"}));
  app.add_option("--grad-accumulation", config.options.grad_accumulation_steps,
                 "Options::grad_accumulation_steps: micro-batches per step")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--reduce-dtype", reduce, "Options::reduce_dtype: grad (the gradient type) or fp32")
      ->check(CLI::IsMember({"grad", "fp32"}));
  app.add_flag("--overlap,!--no-overlap", config.overlap,
               "Communication on its own stream (default on, as comm::Nccl on GPUs): gradient staging double-buffered; "
               "--no-overlap for host communicators (Local, Mpi); --backend host never overlaps");
  double nvme_window_mib = static_cast<double>(zero::Options{}.nvme.window_bytes) / 1048576.0;  // the trainers' default
  zero::examples::add_nvme_window_option(app, nvme_window_mib);
  app.add_flag("--delayed-update", config.options.delayed_update,
               "Options::delayed_update (offload with --backend cuda): the owned gradient's host copy is two sets");
  std::string device_text, host_text;
  app.add_option("--device-memory", device_text, "Device memory per rank (80G): print whether it fits");
  app.add_option("--host-memory", host_text, "Host memory per rank (512G): print whether it fits");
  std::string master = "fp32";
  app.add_option("--master", master, "Options::master: how bf16 parameters' fp32 master is kept: fp32 (4 bytes per "
                                     "parameter) or remainder (the bf16 parameters plus 16 bits: 2 bytes, exact)")
      ->check(CLI::IsMember(zero::examples::names_of(zero::all_master_weights)));
  std::string states = "fp32";
  app.add_option("--states", states, "Options::states: the optimizer state's storage: fp32 (4 bytes per value), "
                                     "bf16 / bf16_stochastic (2) or blockwise8 (1, and an fp32 absmax per block)")
      ->check(CLI::IsMember(zero::examples::names_of(zero::all_state_formats)));
  app.add_option("--state-block", config.options.state_block,
                 "Options::state_block: --states blockwise8's elements per block")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--state-fp32-below", config.options.state_fp32_below,
                 "Options::state_fp32_below: --states blockwise8 keeps fp32 state for parameters of fewer elements")
      ->capture_default_str();
  app.add_option("--rank", config.rank,
                 "Whose buffers to print: ranks differ only with --states blockwise8 (by the blocks their shards cut, "
                 "and on the disk tier by a swap-file record); -1, the default: each line the largest of any rank's")
      ->capture_default_str();
  app.add_flag("--hpz", config.options.hpz,
               "Options::hpz (stage 3): backward's gathers inside the node from a secondary copy of 1/ranks-per-node "
               "of the parameters (ZeRO++ hpZ)");
  app.add_flag("--hpz-int8", config.options.hpz_int8,
               "Options::hpz_int8: hpZ's secondary copy as int8 blocks of Options::qwz_block (256) elements");
  app.add_flag("--qwz", config.options.qwz,
               "Options::qwz (stage 3): parameter gathers over every rank as int8 codes with one fp32 scale per block "
               "(ZeRO++ qwZ)");
  app.add_flag("--qgz", config.options.qgz,
               "Options::qgz (stages 1-3): gradient reduce-scatters as an all-to-all of quantized codes inside the "
               "node and one across nodes (ZeRO++ qgZ)");
  app.add_option("--qgz-bits", config.options.qgz_bits, "Options::qgz_bits: 4 or 8")
      ->check(CLI::IsMember({4, 8}))
      ->capture_default_str();
  app.add_option("--qgz-block", config.options.qgz_block, "Options::qgz_block: elements per fp32 scale")
      ->capture_default_str();
  app.add_flag("--qgz-feedback", config.options.qgz_error_feedback,
               "Options::qgz_error_feedback: fp32 residuals carried to the next step");
  bool json = false;
  app.add_flag("--json", json, "Machine-readable output (schema in docs)");

  Limits limits;
  try {
    app.parse(argc, argv);
    if (!params_text.empty()) {
      config.model = plan::uniform_model(parse_scaled(params_text, "--params", count_scale), units);
      config.model.description = "--params " + params_text + " in " + std::to_string(units) + " equal unit(s)";
    } else if (layers_opt->count() > 0) {
      if (heads != 0 && width % heads != 0)
        throw CLI::ValidationError("--heads", std::to_string(heads) + " does not divide --width " +
                                                  std::to_string(width));
      if (layers < 1 || width < 1 || vocab < 1 || context < 1)
        throw CLI::ValidationError("--layers/--width/--vocab/--context", "each must be >= 1");
      config.model = plan::gpt_model(layers, width, vocab, context);
    } else if (!unit_sizes.empty()) {
      config.model = parse_units(unit_sizes);
    } else {
      throw CLI::RequiredError("a model: give --params, a GPT shape (--layers --width --vocab --context) or "
                               "--unit-sizes");
    }
    if (offload != "none" && config.stage == 0)
      throw CLI::ValidationError("--offload", "moves this rank's partition of the optimizer state, and stage 0 has "
                                              "none: use --stage 1, 2 or 3");
    if (offload == "cpu" && backend == "host")
      throw CLI::ValidationError("--offload cpu", "moves the optimizer state from device memory to the host; with "
                                                  "--backend host it is there already: use --offload none or nvme");
    if (config.options.delayed_update && (offload == "none" || backend == "host"))
      throw CLI::ValidationError("--delayed-update", "overlaps the CPU update of offload with the device's next "
                                                     "step: it needs --offload cpu or nvme with --backend cuda");
    config.offload = offload == "cpu" ? plan::Offload::cpu : offload == "nvme" ? plan::Offload::nvme
                                                                                : plan::Offload::none;
    config.device_backend = backend == "cuda";
    if (!config.device_backend) config.overlap = false;  // backend::Host has no stream to overlap on
    config.options.nvme.window_bytes = zero::examples::nvme_window_bytes(nvme_window_mib);
    config.precision = precision == "fp32" ? plan::Precision::fp32 : precision == "fp16" ? plan::Precision::fp16
                                                                                         : plan::Precision::bf16;
    config.optimizer = optimizer;
    config.state_slots = optimizer != "sgd" ? 2 : momentum != 0.0 ? 1 : 0;  // optim::Sgd or optim::PlainSgd
    config.options.bucket_bytes = bucket_text == "auto" ? 0 : parse_scaled(bucket_text, "--bucket-bytes", byte_scale);
    config.options.reduce_dtype = reduce == "fp32" ? zero::ReduceDType::fp32 : zero::ReduceDType::same_as_grad;
    config.options.grad_writes = grad_writes == "accumulate" ? zero::GradWrites::accumulate : zero::GradWrites::overwrite;
    config.options.master = *zero::parse_master_weights(master);
    if (config.options.master == zero::MasterWeights::remainder && config.precision != plan::Precision::bf16)
      throw CLI::ValidationError("--master remainder", "keeps the fp32 master as the bf16 parameters plus 16 bits: "
                                                       "use --precision bf16, or --master fp32");
    config.options.states = *zero::parse_state_format(states);
    const std::string zeropp =
        zero::zeropp_stage_problem(config.options.hpz, config.options.qwz, config.options.qgz, config.stage);
    if (!zeropp.empty()) throw CLI::ValidationError("--stage", zeropp);
    const std::size_t master_bytes = zero::master_element_bytes(config.options.master),
                      state_bytes = zero::state_element_bytes(config.options.states);
    if (config.offload == plan::Offload::nvme &&
        config.options.nvme.window_bytes <
            zero::offload::disk_least_window_bytes(config.state_slots, master_bytes, state_bytes))
      throw CLI::ValidationError("--nvme-window-mib", "is too small for --optimizer " + optimizer + ", --master " +
                                                      master + " and --states " + states + ": " +
                                                      zero::offload::disk_window_rule(config.state_slots, master_bytes,
                                                                                      state_bytes));
    if (!device_text.empty()) limits.device = parse_scaled(device_text, "--device-memory", byte_scale);
    if (!host_text.empty()) limits.host = parse_scaled(host_text, "--host-memory", byte_scale);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "zero_plan: %s\nRun zero_plan --help for the options and their defaults.\n", e.what());
    return 2;
  }

  try {
    const plan::Plan p = plan::make_plan(config);
    if (json) {
      std::puts(plan::to_json(p).c_str());
    } else {
      print_table(p);
    }
    // With --json the verdict goes to stderr, so stdout stays one JSON document.
    if (limits.given()) print_verdict(json ? stderr : stdout, p, limits);
  } catch (const zero::Error& e) {
    std::fprintf(stderr, "zero_plan: %s\n", e.what());
    return 2;
  }
  return 0;
}
