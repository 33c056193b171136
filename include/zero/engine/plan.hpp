// Why: "will my model fit, and what will it cost?" should be answered before
// anyone rents GPUs. The planner computes, per rank, the bytes of every
// buffer ZeroOptimizer would allocate for a model, a rank count, a stage, a
// precision, an optimizer and the Options that size buffers, split by where
// they would live (device, host, disk), and the bytes each rank sends and
// receives per optimizer step, counted as the communicators count them. It
// allocates nothing: it runs the engine's own layout (engine/layout.hpp) and
// buffer-size rules (engine/buffer_sizes.hpp) on a description of the model.
// tests/engine/test_engine_plan.cpp holds it to memory_report() and
// comm_report() of real optimizers, to the byte. examples/plan/zero_plan.cpp
// is its command line.
//
// Offload (offload::Cpu / offload::Nvme) is not implemented in the engine
// yet; for it the planner follows the ZeRO-Offload and ZeRO-Infinity papers:
// the fp32 master, the optimizer states and the owned gradient shard live in
// host memory (Cpu), or master and states on disk behind a pinned host window
// of a few shards (Nvme); 16-bit parameters stay on the device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "zero/comm/communicator.hpp"
#include "zero/engine/buffer_sizes.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/reports.hpp"
#include "zero/error.hpp"
#include "zero/precision/types.hpp"

namespace zero::plan {

enum class Precision { fp32, bf16, fp16 };
enum class Offload { none, cpu, nvme };

inline const char* name(Precision p) {
  switch (p) {
    case Precision::fp32: return "fp32";
    case Precision::bf16: return "bf16";
    case Precision::fp16: return "fp16";
  }
  return "?";
}
inline const char* name(Offload o) {
  switch (o) {
    case Offload::none: return "none";
    case Offload::cpu: return "cpu";
    case Offload::nvme: return "nvme";
  }
  return "?";
}
// Bytes of a parameter or gradient element (the engine keeps both in one type).
inline std::size_t element_bytes(Precision p) { return p == Precision::fp32 ? 4 : 2; }

// The planner's name for a precision policy (zero/policies.hpp).
template <class PrecisionPolicy>
constexpr Precision precision_of() {
  if constexpr (!PrecisionPolicy::mixed) return Precision::fp32;
  else if constexpr (std::is_same_v<typename PrecisionPolicy::param_type, bf16>) return Precision::bf16;
  else return Precision::fp16;
}

// A model as the engine sees it: units (what stage 3 gathers at once), each a
// list of parameter sizes in registration order (each parameter starts on an
// aligned boundary, so the split matters for padding).
struct Unit {
  std::string name;
  std::vector<std::size_t> params;
};
struct Model {
  std::string description;
  std::vector<Unit> units;

  std::uint64_t param_count() const {
    std::uint64_t n = 0;
    for (const auto& u : units)
      for (std::size_t p : u.params) n += p;
    return n;
  }
};

// A GPT-2-style decoder: one unit for the embeddings (tokens V x D, learned
// positions C x D), one per block, one for the final LayerNorm; the output
// projection is tied to the token embedding. A block is
//   LayerNorm (2D) + attention QKV (3D^2 + 3D) + attention output (D^2 + D)
//   + LayerNorm (2D) + MLP up (4D^2 + 4D) + MLP down (4D^2 + D) = 12D^2 + 13D.
// Heads split D without changing any count.
inline Model gpt_model(std::size_t layers, std::size_t width, std::size_t vocab, std::size_t context) {
  require(layers >= 1 && width >= 1 && vocab >= 1 && context >= 1,
          "gpt_model: layers, width, vocab and context must all be >= 1");
  const std::size_t d = width;
  Model m;
  m.description = "GPT: " + std::to_string(layers) + " layers, width " + std::to_string(d) + ", vocab " +
                  std::to_string(vocab) + ", context " + std::to_string(context);
  m.units.push_back(Unit{"embed", {vocab * d, context * d}});
  for (std::size_t l = 0; l < layers; ++l)
    m.units.push_back(Unit{"block" + std::to_string(l),
                           {d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d}});
  m.units.push_back(Unit{"final_norm", {d, d}});
  return m;
}

// `params` elements in `units` units of (nearly) equal size, one parameter each.
inline Model uniform_model(std::uint64_t params, std::size_t units) {
  require(units >= 1 && params >= units, "uniform_model: need at least one parameter per unit (", params,
          " parameters, ", units, " units)");
  Model m;
  m.description = std::to_string(params) + " parameters in " + std::to_string(units) + " equal unit(s)";
  for (std::size_t u = 0; u < units; ++u) {
    const std::uint64_t begin = params * u / units, end = params * (u + 1) / units;
    m.units.push_back(Unit{"unit" + std::to_string(u), {static_cast<std::size_t>(end - begin)}});
  }
  return m;
}

struct Config {
  Model model;
  int ranks_per_node = 1;
  int nodes = 1;
  int stage = 0;
  Precision precision = Precision::bf16;
  std::string optimizer = "adamw";
  int state_slots = 2;  // fp32 arrays per parameter: Adam/AdamW 2, SGD 1 (kept even without momentum)
  Offload offload = Offload::none;
  Options options{};
  // Communication on a stream of its own (comm::Nccl's default on GPUs):
  // gradient staging is double-buffered. Host communicators do not overlap.
  bool overlap = true;
  // Nvme: owned shards of master + states staged in pinned host memory at once.
  std::size_t nvme_window_shards = 2;

  int ranks() const { return ranks_per_node * nodes; }

  void validate() const {
    require(!model.units.empty(), "plan: the model has no units");
    require(ranks_per_node >= 1 && nodes >= 1, "plan: ranks per node and nodes must be >= 1");
    require(stage >= 0 && stage <= 3, "plan: stage must be 0, 1, 2 or 3, got ", stage);
    require(state_slots >= 0 && state_slots <= 4, "plan: state_slots must be in [0, 4]");
    require(offload == Offload::none || stage >= 1,
            "plan: offload moves this rank's partition of the optimizer state; stage 0 has none: use stage >= 1");
    require(nvme_window_shards >= 1, "plan: the NVMe host window needs at least one shard");
    options.validate();
  }
};

// The configuration of an optimizer type (precision, optimizer, stage) on
// `ranks` ranks of one node, as ZeroOptimizer<...> would run it.
template <class Opt>
Config config_for(Model model, int ranks, const Options& options, bool overlap) {
  Config c;
  c.model = std::move(model);
  c.ranks_per_node = ranks;
  c.stage = Opt::stage;
  c.precision = precision_of<typename Opt::precision_policy>();
  c.optimizer = Opt::optimizer_policy::name;
  c.state_slots = Opt::state_slots;
  c.options = options;
  c.overlap = overlap;
  return c;
}

// One kind of buffer, in bytes per rank by where it lives.
struct Line {
  std::string name;
  std::uint64_t device = 0, host = 0, disk = 0;
  std::uint64_t total() const { return device + host + disk; }
};

// Model traffic per optimizer step and rank (control messages apart), as the
// communicators count it: a ring moves B(N-1)/N per reduce-scatter or
// all-gather of a B-byte buffer, twice that per all-reduce.
struct CommVolume {
  std::uint64_t elements = 0;  // elements sent (= received)
  std::uint64_t bytes_sent = 0, bytes_received = 0;
  std::uint64_t all_reduce_bytes = 0, reduce_scatter_bytes = 0, all_gather_bytes = 0;
  std::uint64_t control_bytes = 0;  // the step control all-reduce: norm and one report per rank
};

struct Plan {
  Config config;
  std::uint64_t param_elements = 0;   // Φ
  std::uint64_t padded_elements = 0;  // Φ with the layout's padding
  BufferSizes sizes;
  // Model states first (params, grads, master, optimizer_states), then
  // "padding" (the share of those four that is padding: included in them, not
  // added to the total), then the communication buffers.
  std::vector<Line> lines;
  Line total{"total"};
  std::uint64_t paper_model_state_bytes = 0;  // the ZeRO paper's formula, with Φ unpadded
  std::uint64_t paper_comm_elements = 0;      // 2Φ(N-1)/N (stages 0-2) or 3Φ(N-1)/N (stage 3)
  CommVolume comm;

  const Line& line(const std::string& n) const {
    for (const auto& l : lines)
      if (l.name == n) return l;
    throw Error("plan: no line named '" + n + "'");
  }
  // Bytes of the four model-state lines, all tiers.
  std::uint64_t model_states() const {
    return line("params").total() + line("grads").total() + line("master").total() +
           line("optimizer_states").total();
  }
  // Bytes of the lines memory_report() counts as communication buffers (the
  // control doubles and the NVMe window are not among them).
  std::uint64_t communication_buffers() const {
    return line("gradient_staging").total() + line("reduce_staging_fp32").total() + line("shard_staging").total() +
           line("gather_slots").total() + line("param_staging").total();
  }
};

// "(2+2+K)Φ" and friends for this configuration's byte sizes.
inline std::string paper_formula(int stage, std::size_t p, std::size_t g, std::size_t k) {
  const std::string ps = std::to_string(p), gs = std::to_string(g), ks = std::to_string(k);
  switch (stage) {
    case 0: return "(" + ps + "+" + gs + "+" + ks + ")Φ";
    case 1: return "(" + ps + "+" + gs + ")Φ + " + ks + "Φ/N";
    case 2: return ps + "Φ + (" + gs + "+" + ks + ")Φ/N";
    default: return "(" + ps + "+" + gs + "+" + ks + ")Φ/N";
  }
}

inline Plan make_plan(const Config& config) {
  config.validate();
  const int n = config.ranks();
  const std::uint64_t N = static_cast<std::uint64_t>(n);
  Layout layout(n);
  for (const auto& u : config.model.units) {
    const UnitId id = layout.add_unit(u.name);
    for (std::size_t i = 0; i < u.params.size(); ++i) layout.add_param(id, u.name + "." + std::to_string(i), u.params[i]);
  }
  layout.finalize();

  Plan plan;
  plan.config = config;
  plan.param_elements = layout.param_total();
  plan.padded_elements = layout.padded_total();
  const std::size_t pb = element_bytes(config.precision), gb = pb;
  const bool mixed = config.precision != Precision::fp32;
  const bool offload = config.offload != Offload::none;
  const BufferSizes s =
      buffer_sizes(layout, BufferSpec{stage_plan(config.stage), mixed, gb, config.state_slots, config.overlap},
                   config.options);
  plan.sizes = s;
  const StagePlan rules = stage_plan(config.stage);
  const std::uint64_t owned = rules.states_sharded ? layout.shard_total() : layout.padded_total();

  // Model states. Offloaded: the gradient still accumulates on the device
  // (whole at stage 1, the owned shard at stages 2-3: one add per
  // micro-batch at device bandwidth instead of a transfer), and the owned
  // shard's host copy is what the CPU update reads; the fp32 master (fp32
  // training too: the device copy is the working parameters) and states
  // leave the device.
  Line params{"params"}, grads{"grads"}, master{"master"}, states{"optimizer_states"};
  params.device = s.params * pb;
  if (!offload) {
    grads.device = s.grads * gb;
    master.device = s.master * 4;
    states.device = s.state_per_slot * 4 * static_cast<std::uint64_t>(config.state_slots);
  } else {
    grads.device = s.grads * gb;
    grads.host = owned * gb * (config.options.delayed_update ? 2 : 1);  // two sets: one per step in flight
    const std::uint64_t m = owned * 4, st = owned * 4 * static_cast<std::uint64_t>(config.state_slots);
    if (config.offload == Offload::cpu) {
      master.host = m;
      states.host = st;
    } else {
      master.disk = m;
      states.disk = st;
    }
  }
  Line padding{"padding"};
  auto pad = [&](std::uint64_t bytes) {
    return MemoryReport::padding_share(plan.param_elements, plan.padded_elements, bytes);
  };
  padding.device = pad(params.device + grads.device + master.device + states.device);
  padding.host = pad(params.host + grads.host + master.host + states.host);
  padding.disk = pad(params.disk + grads.disk + master.disk + states.disk);

  // Communication buffers (device memory, as the engine allocates them).
  Line staging{"gradient_staging"}, wide{"reduce_staging_fp32"}, shard{"shard_staging"}, slots{"gather_slots"},
      control{"control"};
  staging.device = s.grad_staging * gb;
  wide.device = s.reduce_staging_fp32 * 4;
  shard.device = s.shard_staging * gb;
  slots.device = s.gather_slots * pb;
  control.device = s.control * sizeof(double);
  // Offloaded mixed precision: the CPU writes the 16-bit parameters into
  // host staging, whence they are copied to the device unit by unit.
  Line param_staging{"param_staging"};
  if (offload && mixed) param_staging.host = owned * pb;
  plan.lines = {params, grads, master, states, padding, staging, wide, shard, slots, param_staging, control};
  if (config.offload == Offload::nvme) {
    // Pinned host window: shards of master + states in flight to and from disk.
    Line window{"nvme_window"};
    window.host = config.nvme_window_shards * s.max_shard * 4 * (1 + static_cast<std::uint64_t>(config.state_slots));
    plan.lines.push_back(window);
  }
  for (const auto& l : plan.lines) {
    if (l.name == "padding") continue;  // included in the model-state lines
    plan.total.device += l.device;
    plan.total.host += l.host;
    plan.total.disk += l.disk;
  }

  // The paper: p and g bytes per parameter and gradient, K of optimizer state
  // (fp32 master when mixed, plus the fp32 state arrays).
  const std::uint64_t phi = plan.param_elements;
  const std::uint64_t k = (mixed ? 4 : 0) + 4 * static_cast<std::uint64_t>(config.state_slots);
  switch (config.stage) {
    case 0: plan.paper_model_state_bytes = (pb + gb + k) * phi; break;
    case 1: plan.paper_model_state_bytes = (pb + gb) * phi + k * phi / N; break;
    case 2: plan.paper_model_state_bytes = pb * phi + (gb + k) * phi / N; break;
    default: plan.paper_model_state_bytes = (pb + gb + k) * phi / N; break;
  }
  plan.paper_comm_elements = (config.stage == 3 ? 3 : 2) * phi * (N - 1) / N;

  // Communication per optimizer step, collective by collective as the engine
  // issues them (each unit on its own), with the training loop of
  // zero_optimizer.hpp: every micro-batch acquires each unit in forward and
  // again in backward. Gradients travel in fp32 when reduce_dtype is fp32.
  const std::uint64_t rb = (config.options.reduce_dtype == ReduceDType::fp32) ? 4 : gb;
  const std::uint64_t micro = static_cast<std::uint64_t>(config.options.grad_accumulation_steps);
  CommVolume& c = plan.comm;
  auto ring = [n](std::uint64_t bytes) { return comm::ByteCounters::ring_share(bytes, n); };
  for (const auto& u : layout.units()) {
    const std::uint64_t full = u.padded;
    switch (config.stage) {
      case 0:  // all-reduce on the last micro-batch
        c.all_reduce_bytes += 2 * ring(full * rb);
        c.elements += 2 * ring(full);
        break;
      case 1:  // reduce-scatter at the step, all-gather the updated parameters
        c.reduce_scatter_bytes += ring(full * rb);
        c.all_gather_bytes += ring(full * pb);
        c.elements += 2 * ring(full);
        break;
      case 2:  // reduce-scatter every micro-batch, all-gather after the step
        c.reduce_scatter_bytes += micro * ring(full * rb);
        c.all_gather_bytes += ring(full * pb);
        c.elements += (micro + 1) * ring(full);
        break;
      default:  // every micro-batch: gather in forward and backward, reduce-scatter
        c.reduce_scatter_bytes += micro * ring(full * rb);
        c.all_gather_bytes += 2 * micro * ring(full * pb);
        c.elements += 3 * micro * ring(full);
        break;
    }
  }
  c.bytes_sent = c.bytes_received = c.all_reduce_bytes + c.reduce_scatter_bytes + c.all_gather_bytes;
  // The step's control all-reduce (every stage): the squared norm and one
  // report per rank (hyper-parameter fingerprint, inf/NaN and invalid flags).
  c.control_bytes = 2 * ring((1 + static_cast<std::size_t>(config.ranks())) * sizeof(double));
  return plan;
}

// The planner's JSON: {"config":{...},"lines":[...],"total":{...},
// "paper":{"model_state_bytes":B},"comm":{...}} (docs/ plots read it).
inline std::string to_json(const Plan& p) {
  const Config& c = p.config;
  std::ostringstream o;
  auto tiers = [&o](const Line& l) {
    o << "\"device\":" << l.device << ",\"host\":" << l.host << ",\"disk\":" << l.disk;
  };
  o << "{\"config\":{\"params\":" << p.param_elements << ",\"ranks\":" << c.ranks() << ",\"stage\":" << c.stage
    << ",\"offload\":\"" << name(c.offload) << "\",\"precision\":\"" << name(c.precision) << "\",\"optimizer\":\""
    << c.optimizer << "\",\"ranks_per_node\":" << c.ranks_per_node << ",\"nodes\":" << c.nodes
    << ",\"units\":" << c.model.units.size() << ",\"padded_elements\":" << p.padded_elements
    << ",\"state_slots\":" << c.state_slots << ",\"bucket_bytes\":" << c.options.bucket_bytes
    << ",\"prefetch_units\":" << c.options.prefetch_units
    << ",\"grad_accumulation_steps\":" << c.options.grad_accumulation_steps << ",\"reduce_dtype\":\""
    << (c.options.reduce_dtype == ReduceDType::fp32 ? "fp32" : "same_as_grad") << "\",\"overlap\":"
    << (c.overlap ? "true" : "false") << "},\"lines\":[";
  for (std::size_t i = 0; i < p.lines.size(); ++i) {
    o << (i ? "," : "") << "{\"name\":\"" << p.lines[i].name << "\",";
    tiers(p.lines[i]);
    o << "}";
  }
  o << "],\"total\":{";
  tiers(p.total);
  o << "},\"paper\":{\"model_state_bytes\":" << p.paper_model_state_bytes << "},\"comm\":{\"elements_per_step\":"
    << p.comm.elements << ",\"bytes_sent_per_step\":" << p.comm.bytes_sent
    << ",\"bytes_received_per_step\":" << p.comm.bytes_received << "}}";
  return o.str();
}

}  // namespace zero::plan
