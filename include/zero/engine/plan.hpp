// Why: "will my model fit, and what will it cost?" should be answered before
// anyone rents GPUs. The planner computes, per rank, the bytes of every
// buffer ZeroOptimizer would allocate for a model, a rank count, a stage, a
// precision, an optimizer, an offload tier (none, cpu, nvme), a backend
// (device or host) and the Options that size buffers, split by where they
// would live (device, host, disk), and the bytes each rank sends and
// receives per optimizer step, counted as the communicators count them. It
// allocates nothing: it runs the engine's own layout (engine/layout.hpp) and
// schedule (engine/detail/schedule.hpp: the buffer sizes finalize() allocates, their
// places, and the collectives the stage rules make) on a description of the
// model; this file only names lines and adds them up.
// tests/engine/test_engine_plan.cpp holds it to memory_report() and
// comm_report() of real optimizers, every stage x tier x precision, to the
// byte. examples/plan/zero_plan.cpp is its command line.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "zero/comm/communicator.hpp"
#include "zero/engine/detail/buffer_sizes.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/reports.hpp"
#include "zero/engine/detail/run_rules.hpp"
#include "zero/engine/run_shape.hpp"
#include "zero/engine/detail/schedule.hpp"
#include "zero/engine/stage_rules.hpp"
#include "zero/engine/detail/state_blocks.hpp"
#include "zero/error.hpp"
#include "zero/precision/types.hpp"

namespace zero::plan {

using Precision = PrecisionChoice;  // (the planner's names for the plan's values: engine/stage_rules.hpp)
using Offload = OffloadTier;
using zero::name;  // of a Precision and an Offload
// Bytes of a parameter or gradient element (the engine keeps both in one type).
inline std::size_t element_bytes(Precision p) { return RunShape{.precision = p}.element_bytes(); }

// The planner's name for a precision policy (zero/policies.hpp).
template <class PrecisionPolicy>
constexpr Precision precision_of() {
  return precision_choice<PrecisionPolicy>();
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

// What the planner is asked: a model on some ranks, with a stage, a
// precision, an optimizer, a tier, a backend and the Options that size
// buffers. (A zero::Config is a run to make; a scenario only to weigh.)
struct Scenario {
  Model model;
  int ranks_per_node = 1;
  int nodes = 1;
  int stage = 0;
  Precision precision = Precision::bf16;
  std::string optimizer = "adamw";
  int state_slots = 2;  // state slots per parameter: Adam/AdamW 2, SGD 1, SGD made with momentum 0 none
  Offload offload = Offload::none;
  // The backend's memory is a device's (backend::Cuda); false: backend::Host,
  // where every buffer but the disk tier's is host memory.
  bool device_backend = true;
  // Options that size buffers: the buckets and their staging (bucket_bytes,
  // grad_writes, live_buckets, grad_accumulation_steps, reduce_dtype), stage
  // 3's arena (prefetch_units), the state formats (master, states,
  // state_block, state_fp32_below), ZeRO++ (hpz*, qwz*, qgz*),
  // delayed_update (two host gradient sets) and nvme.window_bytes (the disk
  // tier's host window).
  Options options{};
  // Communication on a stream of its own (comm::Nccl's default on GPUs):
  // gradient staging is double-buffered. Host communicators, and
  // backend::Host, do not overlap.
  bool overlap = true;
  // Whose buffers the plan shows. Ranks differ only with 8-bit block-wise
  // states (Options::states), by the blocks their shard boundaries cut and
  // the small parameters each owns, and on the disk tier by a swap-file
  // record; -1: each line and place the largest of any rank's, what every
  // rank's memory must fit.
  int rank = -1;

  int ranks() const { return ranks_per_node * nodes; }
  comm::Topology topology() const { return comm::Topology{ranks(), ranks_per_node}; }

  // The run this asks about (engine/run_shape.hpp), as the schedule reads it.
  RunShape run_shape() const {
    return RunShape{.stage = stage_rules(stage),
                    .offload = offload,
                    .precision = precision,
                    .device_backend = device_backend,
                    .state_slots = state_slots,
                    .optimizer = optimizer.c_str(),
                    .overlap = overlap,
                    .ranks_per_node = ranks_per_node,
                    .rank = rank < 0 ? 0 : static_cast<std::size_t>(rank)};
  }
  // Whether ranks' buffers can differ (Scenario::rank).
  bool ranks_differ() const {
    return options.states == StateFormat::blockwise8 && state_slots > 0 &&
           block_cuts(static_cast<std::uint64_t>(ranks()), static_cast<std::uint64_t>(stage)) > 1;
  }

  void validate() const {
    require(!model.units.empty(), "plan: the model has no units");
    require(ranks_per_node >= 1 && nodes >= 1, "plan: ranks per node and nodes must be >= 1");
    require(rank >= -1 && rank < ranks(), "plan: rank ", rank, " of ", ranks(),
            " rank(s); give one from 0, or -1 for the largest of any rank's buffers");
    require(state_slots >= 0 && state_slots <= 4, "plan: state_slots must be in [0, 4]");
    options.validate();
    require_run(run_shape(), options, Voice{"plan"});
  }
};

// The configuration of an optimizer type (precision, optimizer, stage,
// offload tier, backend) on `ranks` ranks of one node, as ZeroOptimizer<...>
// would run it.
template <class Opt>
Scenario scenario_for(Model model, int ranks, const Options& options, bool overlap) {
  Scenario c;
  c.model = std::move(model);
  c.ranks_per_node = ranks;
  c.stage = Opt::stage;
  c.precision = precision_of<typename Opt::precision_policy>();
  c.optimizer = Opt::optimizer_policy::name;
  c.state_slots = Opt::state_slots;
  c.offload = offload_tier<typename Opt::offload_policy>();
  c.device_backend = Opt::backend_policy::device;
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
  std::uint64_t all_to_all_bytes = 0;  // Options::qgz's exchanges (its reduce-scatters)
  std::uint64_t control_bytes = 0;  // the step control all-reduce: norm and one report per rank
  // Collective calls per step (one per unit each time; comm_report()'s calls).
  std::uint64_t all_reduce_calls = 0, reduce_scatter_calls = 0, all_gather_calls = 0, all_to_all_calls = 0;
  std::uint64_t control_calls = 0;
  // Of bytes_sent, what leaves the node (comm/topology.hpp's counting rule):
  // summed over every rank (what the links between nodes carry), and by the
  // rank that sends the most across (the last rank of a node).
  std::uint64_t across_all_ranks = 0, across_busiest_rank = 0;
};

// The planner's lines, in the order it prints them: the model states
// (params, grads, master, optimizer_states), "padding" (the share of those
// four that is padding: included in them, not added to the total), the
// communication buffers, and what memory_report() does not count (control,
// swap_padding). Each is the sum of the schedule's buffers of that name.
inline constexpr const char* model_state_lines[] = {"params", "grads", "master", "optimizer_states"};
inline constexpr const char* buffer_lines[] = {
    "gradient_staging", "reduce_staging_fp32", "shard_staging", "gather_slots", "qwz_staging",  "qgz_payloads",
    "qgz_sums",         "qgz_residuals",       "hpz_int8_staging", "param_staging", "nvme_window", "control",
    "swap_padding"};

struct Plan {
  Scenario scenario;
  // Whose buffers (Scenario::rank), or -1 where ranks differ and Scenario::rank
  // is -1: then each line and place is the largest of any rank's, and
  // `schedule` is rank 0's.
  int rank = 0;
  std::uint64_t param_elements = 0;   // Φ
  std::uint64_t padded_elements = 0;  // Φ with the layout's padding
  Schedule schedule;                  // every buffer and collective (engine/detail/schedule.hpp)
  BufferSizes sizes;                  // = schedule.sizes (swap_file_bytes the largest where rank is -1)
  std::vector<Line> lines;            // model_state_lines, "padding", buffer_lines
  Line total{"total"};
  // memory_report().placed of the planned optimizer (its other lines are
  // these added up, and padding).
  MemoryReport::Placement placed;
  std::uint64_t paper_model_state_bytes = 0;  // the ZeRO paper's formula, with Φ unpadded
  std::uint64_t paper_k = 0;  // its K: optimizer-state bytes per parameter (master and state slots)
  std::uint64_t paper_comm_elements = 0;      // 2Φ(N-1)/N (stages 0-2) or 3Φ(N-1)/N (stage 3)
  CommVolume comm;

  const Line& line(const std::string& n) const {
    for (const auto& l : lines)
      if (l.name == n) return l;
    throw Error("plan: no line named '" + n + "'");
  }
  // Bytes of the four model-state lines, all tiers.
  std::uint64_t model_states() const { return placed.model_states().total(); }
  // Bytes memory_report() counts as communication buffers: staging,
  // the gather arena, the offload host staging and window (not the control
  // values).
  std::uint64_t communication_buffers() const { return placed.communication_buffers.total(); }
};

// The paper's model-state bytes per parameter: p + g + K split into what
// every rank keeps whole and what it keeps 1/N of, as the stage rules shard.
struct PaperShares {
  std::uint64_t whole = 0, sharded = 0;
};
inline PaperShares paper_shares(const StageRules& stage, std::uint64_t p, std::uint64_t g, std::uint64_t k) {
  PaperShares s;
  (stage.params_sharded ? s.sharded : s.whole) += p;
  (stage.grads_sharded ? s.sharded : s.whole) += g;
  (stage.states_sharded ? s.sharded : s.whole) += k;
  return s;
}

// "(2+2+K)Φ" and friends for this configuration's byte sizes.
inline std::string paper_formula(int stage, std::size_t p, std::size_t g, std::size_t k) {
  const StageRules rules = stage_rules(stage);
  std::string whole, sharded;
  int whole_terms = 0, sharded_terms = 0;
  auto term = [&](bool is_sharded, std::size_t bytes) {
    std::string& to = is_sharded ? sharded : whole;
    to += (to.empty() ? "" : "+") + std::to_string(bytes);
    ++(is_sharded ? sharded_terms : whole_terms);
  };
  term(rules.params_sharded, p);
  term(rules.grads_sharded, g);
  term(rules.states_sharded, k);
  auto group = [](const std::string& t, int terms) { return terms > 1 ? "(" + t + ")" : t; };
  std::string f;
  if (whole_terms) f = group(whole, whole_terms) + "Φ";
  if (sharded_terms) f += (f.empty() ? "" : " + ") + group(sharded, sharded_terms) + "Φ/N";
  return f;
}

// memory_report()'s padding (its share of all model-state bytes) split by
// place in proportion to the bytes there, so the parts add up to it exactly:
// each part rounded down, the rest (a byte or two) to the largest place.
inline PlacedBytes split_padding(std::uint64_t padding, const PlacedBytes& states) {
  PlacedBytes p;
  const double total = static_cast<double>(states.total());
  if (total == 0) return p;
  std::uint64_t given = 0;
  auto share = [&](std::uint64_t bytes) {
    const auto part = static_cast<std::uint64_t>(static_cast<double>(padding) * (static_cast<double>(bytes) / total));
    const std::uint64_t kept = std::min(part, padding - given);
    given += kept;
    return kept;
  };
  p.device = share(states.device);
  p.host = share(states.host);
  p.disk = share(states.disk);
  const std::uint64_t rest = padding - given;
  if (states.device >= states.host && states.device >= states.disk) p.device += rest;
  else if (states.host >= states.disk) p.host += rest;
  else p.disk += rest;
  return p;
}

namespace detail {
// One rank's lines (model_state_lines, "padding", buffer_lines) from its
// schedule and memory_report().placed.
inline std::vector<Line> plan_lines(const Schedule& s, const MemoryReport::Placement& placed,
                                    std::uint64_t param_elements, std::uint64_t padded_elements) {
  std::vector<Line> lines;
  auto line = [&](const char* name) {
    const PlacedBytes b = s.line(name);
    return Line{name, b.device, b.host, b.disk};
  };
  for (const char* name : model_state_lines) lines.push_back(line(name));
  const PlacedBytes states = placed.model_states();
  const PlacedBytes padding =
      split_padding(MemoryReport::padding_share(param_elements, padded_elements, states.total()), states);
  lines.push_back(Line{"padding", padding.device, padding.host, padding.disk});
  for (const char* name : buffer_lines) lines.push_back(line(name));
  return lines;
}
inline PlacedBytes largest(const PlacedBytes& a, const PlacedBytes& b) {
  return {std::max(a.device, b.device), std::max(a.host, b.host), std::max(a.disk, b.disk)};
}
inline Line largest(const Line& a, const Line& b) {
  const PlacedBytes l = largest(PlacedBytes{a.device, a.host, a.disk}, PlacedBytes{b.device, b.host, b.disk});
  return Line{a.name, l.device, l.host, l.disk};
}
}  // namespace detail

inline Plan make_plan(const Scenario& scenario) {
  scenario.validate();
  const int n = scenario.ranks();
  const std::uint64_t N = static_cast<std::uint64_t>(n);
  Layout layout(n);
  for (const auto& u : scenario.model.units) {
    const UnitId id = layout.add_unit(u.name);
    for (std::size_t i = 0; i < u.params.size(); ++i) layout.add_param(id, u.name + "." + std::to_string(i), u.params[i]);
  }
  layout.finalize(sizeof(float));  // as ZeroOptimizer::finalize()

  Plan plan;
  plan.scenario = scenario;
  plan.param_elements = layout.param_total();
  plan.padded_elements = layout.padded_total();
  RunShape run = scenario.run_shape();
  plan.schedule = schedule(layout, run, scenario.options);
  plan.sizes = plan.schedule.sizes;
  plan.placed = plan.schedule.placement();
  plan.lines = detail::plan_lines(plan.schedule, plan.placed, plan.param_elements, plan.padded_elements);
  plan.rank = static_cast<int>(run.rank);
  if (scenario.rank < 0 && scenario.ranks_differ()) {
    // Each line and place the largest of any rank's: what every rank's
    // memory must fit (one rank may hold the most host memory, another
    // the largest swap file).
    plan.rank = -1;
    for (run.rank = 1; run.rank < N; ++run.rank) {
      const Schedule other = schedule(layout, run, scenario.options);
      const MemoryReport::Placement placed = other.placement();
      const std::vector<Line> lines = detail::plan_lines(other, placed, plan.param_elements, plan.padded_elements);
      for (std::size_t i = 0; i < lines.size(); ++i) plan.lines[i] = detail::largest(plan.lines[i], lines[i]);
      for (auto part : {&MemoryReport::Placement::params, &MemoryReport::Placement::grads,
                        &MemoryReport::Placement::master, &MemoryReport::Placement::optimizer_states,
                        &MemoryReport::Placement::communication_buffers})
        plan.placed.*part = detail::largest(plan.placed.*part, placed.*part);
      plan.sizes.swap_file_bytes = std::max(plan.sizes.swap_file_bytes, other.sizes.swap_file_bytes);
    }
  }
  for (const auto& l : plan.lines) {
    if (l.name == "padding") continue;  // included in the model-state lines
    plan.total.device += l.device;
    plan.total.host += l.host;
    plan.total.disk += l.disk;
  }

  // The paper: p and g bytes per parameter and gradient, K of optimizer state
  // (fp32 master when mixed, plus the fp32 state arrays), each term whole or
  // 1/N as the stage shards it.
  const std::uint64_t phi = plan.param_elements;
  const std::uint64_t pb = run.element_bytes();
  // (A remainder master adds 2 bytes: its other 2 are the parameter's.)
  const std::uint64_t master_k = run.mixed() ? master_element_bytes(scenario.options.master) : 0;
  const std::uint64_t k =
      master_k + state_element_bytes(scenario.options.states) * static_cast<std::uint64_t>(scenario.state_slots);
  const PaperShares shares = paper_shares(run.stage, pb, pb, k);
  plan.paper_model_state_bytes = shares.whole * phi + shares.sharded * phi / N;
  plan.paper_k = k;
  plan.paper_comm_elements = (run.stage.params_sharded ? 3 : 2) * phi * (N - 1) / N;

  // Communication per optimizer step: the schedule's collectives.
  using comm::Collective;
  const Schedule& sched = plan.schedule;
  CommVolume& c = plan.comm;
  c.all_reduce_bytes = sched.bytes(Collective::all_reduce);
  c.reduce_scatter_bytes = sched.bytes(Collective::reduce_scatter);
  c.all_gather_bytes = sched.bytes(Collective::all_gather);
  c.all_to_all_bytes = sched.bytes(Collective::all_to_all);
  c.control_bytes = sched.bytes(Collective::control);
  c.all_reduce_calls = sched.calls(Collective::all_reduce);
  c.reduce_scatter_calls = sched.calls(Collective::reduce_scatter);
  c.all_gather_calls = sched.calls(Collective::all_gather);
  c.all_to_all_calls = sched.calls(Collective::all_to_all);
  c.control_calls = sched.calls(Collective::control);
  constexpr Collective model_kinds[] = {Collective::all_reduce, Collective::reduce_scatter, Collective::all_gather,
                                        Collective::all_to_all};
  for (const Collective kind : model_kinds) c.elements += sched.elements(kind);
  c.bytes_sent = c.bytes_received = c.all_reduce_bytes + c.reduce_scatter_bytes + c.all_gather_bytes + c.all_to_all_bytes;
  const comm::Topology topology = scenario.topology();
  for (const Collective kind : model_kinds) {
    c.across_all_ranks += sched.across_all_ranks(kind, topology);
    c.across_busiest_rank += sched.across(kind, topology, topology.ranks_per_node - 1);
  }
  return plan;
}

// The planner's JSON (its scenario under "config", as files have it):
// {"config":{...},"lines":[...],"total":{...},
// "paper":{"model_state_bytes":B},"comm":{...}} (docs/ plots read it).
inline std::string to_json(const Plan& p) {
  const Scenario& c = p.scenario;
  std::ostringstream o;
  auto tiers = [&o](const Line& l) {
    o << "\"device\":" << l.device << ",\"host\":" << l.host << ",\"disk\":" << l.disk;
  };
  o << "{\"config\":{\"params\":" << p.param_elements << ",\"ranks\":" << c.ranks() << ",\"stage\":" << c.stage
    << ",\"offload\":\"" << name(c.offload) << "\",\"precision\":\"" << name(c.precision) << "\",\"optimizer\":\""
    << c.optimizer << "\",\"ranks_per_node\":" << c.ranks_per_node << ",\"nodes\":" << c.nodes
    << ",\"units\":" << c.model.units.size() << ",\"padded_elements\":" << p.padded_elements
    << ",\"state_slots\":" << c.state_slots << ",\"bucket_bytes\":" << p.sizes.bucket_bytes
    << ",\"grad_writes\":\"" << name(c.options.grad_writes) << "\",\"live_buckets\":" << c.options.live_buckets
    << ",\"prefetch_units\":" << c.options.prefetch_units
    << ",\"grad_accumulation_steps\":" << c.options.grad_accumulation_steps << ",\"reduce_dtype\":\""
    << (c.options.reduce_dtype == ReduceDType::fp32 ? "fp32" : "same_as_grad") << "\",\"overlap\":"
    << (c.overlap ? "true" : "false") << ",\"backend\":\"" << (c.device_backend ? "device" : "host")
    << "\",\"delayed_update\":" << (c.options.delayed_update ? "true" : "false")
    << ",\"nvme_window_bytes\":" << c.options.nvme.window_bytes << ",\"master\":\"" << name(c.options.master)
    << "\",\"states\":\"" << name(c.options.states) << "\",\"state_block\":" << c.options.state_block
    << ",\"state_fp32_below\":" << c.options.state_fp32_below << ",\"rank\":" << p.rank << ",\"hpz\":" << (c.options.hpz ? "true" : "false")
    << ",\"hpz_int8\":" << (c.options.hpz_int8 ? "true" : "false")
    << ",\"qwz\":" << (c.options.qwz ? "true" : "false") << ",\"qwz_block\":" << c.options.qwz_block
    << ",\"qgz\":" << (c.options.qgz ? "true" : "false") << ",\"qgz_bits\":" << c.options.qgz_bits
    << ",\"qgz_block\":" << c.options.qgz_block
    << ",\"qgz_error_feedback\":" << (c.options.qgz_error_feedback ? "true" : "false")
    << "},\"lines\":[";
  for (std::size_t i = 0; i < p.lines.size(); ++i) {
    o << (i ? "," : "") << "{\"name\":\"" << p.lines[i].name << "\",";
    tiers(p.lines[i]);
    o << "}";
  }
  o << "],\"total\":{";
  tiers(p.total);
  o << "},\"paper\":{\"model_state_bytes\":" << p.paper_model_state_bytes << "},\"comm\":{\"elements_per_step\":"
    << p.comm.elements << ",\"bytes_sent_per_step\":" << p.comm.bytes_sent
    << ",\"bytes_received_per_step\":" << p.comm.bytes_received << ",\"all_to_all_bytes_per_step\":" << p.comm.all_to_all_bytes
    << ",\"across_nodes_bytes_per_step_all_ranks\":" << p.comm.across_all_ranks
    << ",\"across_nodes_bytes_per_step_busiest_rank\":" << p.comm.across_busiest_rank << "}}";
  return o.str();
}

}  // namespace zero::plan
