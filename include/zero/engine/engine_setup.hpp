// Why: everything the engine does once, at construction and finalize(): the
// plan's checks (the same words as ZeroOptimizer's static_asserts, for a
// plan chosen at run time), the ranks' agreement on every setting, the
// allocation of every buffer from the sizes the planner shares
// (buffer_sizes.hpp), with errors naming the buffer and what makes it
// smaller, and the memory report built from what was allocated.
// Brought in by engine.hpp.
#pragma once

#include "zero/config.hpp"

#include <cstdint>
#include <cstdio>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "zero/engine/agreement.hpp"
#include "zero/engine/buffer_sizes.hpp"
#include "zero/engine/engine_class.hpp"
#include "zero/engine/rank_checks.hpp"

namespace zero::detail {

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
EnginePlan Engine<P, O, B>::checked(EnginePlan plan, DiskMaker disk) {
  const int stage = plan.rules.stage;
  require(stage >= 0 && stage <= 3, "zero: stage ", stage, " does not exist: ZeRO has stages 0, 1, 2 and 3");
  // The words of ZeroOptimizer's static_asserts (zero_optimizer.hpp).
  require(plan.offload != OffloadTier::cpu || B::device,
          "zero::ZeroOptimizer: offload::Cpu moves optimizer state from GPU memory to the host, but with "
          "backend::Host it is already in host memory; use offload::None (or offload::Nvme to move it to disk)");
  require(plan.offload == OffloadTier::none || !B::device || backend::OffloadOps<Ops>,
          "zero: offload from backend ", B::name, " needs a backend with page-locked host buffers and asynchronous "
          "copies (backend/ops.hpp, OffloadOps)");
  require(plan.offload == OffloadTier::none || stage != 0,
          "zero::ZeroOptimizer: ZeRO-Offload moves this rank's partition of the optimizer state to the host; "
          "stage 0 has no partition: use stage<1> or higher with offload::Cpu/Nvme");
  require(plan.offload != OffloadTier::nvme || disk != nullptr,
          "zero: offload nvme needs its store: #include \"zero/offload/disk_state_store.hpp\" (liburing, "
          "xxhash.h) in the program that makes the optimizer");
  return plan;
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::check_master_format(const Options& options) {
  const char* precision = P::mixed ? dtype_traits<param_type>::name : "fp32";
  require(options.master != MasterWeights::remainder || std::is_same_v<param_type, bf16>,
          "Options::master is remainder, but the parameters are ", precision,
          ": the remainder master is the bf16 parameters plus 16 bits (", P::mixed
              ? "an fp16 value's upper bits are not an fp32 value's; use precision::Mixed<bf16>, or "
                "Options::master = MasterWeights::fp32)"
              : "fp32 training keeps no master apart from its parameters; set Options::master = fp32)");
  const std::string copies = bf16_copy_option_problem(options, precision_choice<P>());
  require(copies.empty(), "ZeroOptimizer: Options::", copies);
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::finalize() {
  const comm::ApiCall api_call("finalize");  // names this call in communicator errors (as every collective call)
  require(!finalized_, "ZeroOptimizer::finalize() called twice");
  const StagePlan& rules = plan_.rules;
  layout_.finalize(sizeof(float));  // fp32 masters, states and reduction staging are the widest
  const std::size_t gather_slots = rules.params_sharded ? static_cast<std::size_t>(options_.prefetch_units) + 1 : 0;
  comm_.open(first_slot_event() + gather_slots);
  check_agreement();
  const std::string zeropp = zeropp_stage_problem(options_.hpz, options_.qwz, options_.qgz, stage());
  require(zeropp.empty(), "ZeroOptimizer: Options::", zeropp);
  // Sizes from the rule the planner shares (engine/buffer_sizes.hpp).
  // fp32 training keeps no master apart from the parameters unless offload
  // moves it to the host (the device then keeps a working copy).
  const bool separate_master = P::mixed || plan_.offload != OffloadTier::none;
  const BufferSpec spec{rules,
                        separate_master,
                        sizeof(grad_type),
                        state_slots,
                        comm_.overlaps(),
                        plan_.offload,
                        B::device,
                        master_element_bytes(options_.master),
                        state_element_bytes(options_.states),
                        comm_->topology().ranks_per_node,
                        static_cast<std::size_t>(rank())};
  const BufferSizes sizes = buffer_sizes(layout_, spec, options_);
  if (const std::string note = gradient_saving_note(sizes, spec, layout_, options_); !note.empty() && rank() == 0)
    std::fprintf(stderr, "%s\n", note.c_str());
  update_.configure(spec, options_);

  // What makes each buffer smaller, for the out-of-memory message.
  const char* shard_params = "stage 3 shards the parameters: use stage<3> or more ranks";
  const char* shard_grads = "stages 2 and 3 shard the gradients: use stage<2> or higher, or more ranks";
  const char* shard_states =
      "stages 1-3 shard the master weights and optimizer state: use stage<1> or higher, or more ranks";
  const std::string fewer_units =
      "lower Options::bucket_bytes (a bucket holds at least one unit), or split the largest unit";
  params_ = allocate<param_type>(sizes.params, "parameters", rules.params_sharded ? "more ranks" : shard_params);
  typename GradientReducer<Ops, grad_type>::Buffers grad_buffers;
  grad_buffers.accumulator =
      allocate<grad_type>(sizes.grads, "gradients", rules.grads_sharded ? "more ranks" : shard_grads);
  require(!options_.delayed_update || update_.host_staging(),
          "Options::delayed_update overlaps the CPU update of offload with the next step's work on the device; it "
          "needs offload::Cpu or offload::Nvme with a device backend (backend::Cuda); clear the option otherwise");
  // (a generic lambda, not an explicit template one: nvcc 13 refuses those in
  // a member of a class template with default arguments)
  update_.allocate(ownership(), sizes, params_.data(), grad_buffers.accumulator.data(), options_, rank(), disk_,
                   [&](auto buffer_type, std::size_t n, const char* what) {
                     using Buf = typename decltype(buffer_type)::type;
                     return allocate_as<Buf>(n, what, rules.states_sharded ? "more ranks" : shard_states);
                   });
  grad_buffers.staging = allocate<grad_type>(sizes.grad_staging, "gradient staging (one bucket)", fewer_units);
  grad_buffers.staging_fp32 =
      allocate<float>(sizes.reduce_staging_fp32, "fp32 reduction staging",
                      "Options::reduce_dtype = ReduceDType::same_as_grad needs none; or " + fewer_units);
  grad_buffers.shard_staging = allocate<grad_type>(sizes.shard_staging, "reduce-scatter staging", fewer_units);
  reducer_.bind(std::move(grad_buffers), sizes.buckets, rules, options_.grad_writes,
                gradients_in_place(rules, options_), sizes.staging_sets, layout_, comm_);
  aim_final_copies();
  if (options_.qgz) {
    // Collective: every rank splits its communicator here, in this order.
    comm::AnyCommunicator& node = comm_->node();
    comm::AnyCommunicator& across = comm_->across();
    typename QuantizedReducer<Ops, grad_type>::Buffers qgz;
    const char* smaller = "turn Options::qgz off, or split the largest unit (the payloads hold every rank's codes of "
                          "its largest shard)";
    qgz.payloads = allocate<std::uint8_t>(sizes.qgz_payloads, "qgZ payloads", smaller);
    qgz.sums = allocate<float>(sizes.qgz_sums, "qgZ fp32 sums", smaller);
    qgz.residuals = allocate<float>(sizes.qgz_residuals, "qgZ error feedback residuals",
                                    "turn Options::qgz_error_feedback off (the residuals are fp32 of every gradient "
                                    "element), or put more ranks on each node");
    reducer_.bind_qgz(std::move(qgz), quant::Format{options_.qgz_bits, options_.qgz_block}, node, across);
  }
  if (rules.params_sharded) {
    gatherer_.bind(allocate<param_type>(sizes.gather_slots, "stage-3 gather arena",
                                        "lower Options::prefetch_units (the arena holds the prefetch_units + 1 "
                                        "largest units), or split the largest units"),
                   sizes.gather_slot_count, layout_, params_.data(), comm_, options_.prefetch_units, first_slot_event());
    if (options_.qwz)  // (before hpZ: an int8 copy keeps qwZ's payloads)
      gatherer_.bind_qwz(allocate<std::uint8_t>(sizes.qwz_staging, "qwZ payloads (every rank's int8 shard)",
                                                "turn Options::qwz off, or lower Options::qwz_block's overhead by "
                                                "splitting the largest unit"),
                         options_.qwz_block);
    if (options_.hpz && options_.hpz_int8)
      gatherer_.bind_hpz_int8(
          allocate<std::uint8_t>(sizes.hpz_int8_secondary, "hpZ secondary copy as int8 blocks",
                                 "turn Options::hpz off, or put more ranks on each node (the copy is 1/ranks_per_node "
                                 "of the parameters)"),
          allocate<std::uint8_t>(sizes.hpz_int8_staging, "hpZ int8 staging (the node's payloads of a part)",
                                 "split the largest unit"),
          options_.qwz_block, comm_->node());
    else if (options_.hpz)
      gatherer_.bind_hpz(allocate<param_type>(sizes.hpz_secondary, "hpZ secondary copy of the parameters",
                                              "turn Options::hpz off, or put more ranks on each node (the copy is "
                                              "1/ranks_per_node of the parameters)"),
                         comm_->node());
  }
  control_.bind(sizes.control, comm_);
  replicas_.bind(layout_.units().size(), options_.check_replicas);
  require(!options_.release_memory_pages || !B::device,
          "Options::release_memory_pages hands the pages of your host arrays back to the operating system; with "
          "backend ", B::name, " your memory is the device's: clear the option");
  own_.bind(layout_, options_.release_memory_pages);
  account_memory();
  finalized_ = true;
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
template <class Buf>
Buf Engine<P, O, B>::allocate_as(std::size_t n, const char* what, const std::string& lower_it) {
  using T = std::remove_pointer_t<decltype(std::declval<Buf&>().data())>;
  constexpr bool in_backend = std::is_same_v<Buf, Buffer<T>>;
  const char* where = in_backend && B::device ? "device" : "host";
  checked_mul(n, sizeof(T), "finalize(): the ", what, " (", n, " elements)");
  auto failed = [&](const char* why) { return allocation_error(rank(), what, n, sizeof(T), where, why, lower_it); };
  Buf buffer;
  try {
    if constexpr (std::is_constructible_v<Buf, std::size_t, const backend::PiecePlan&>)
      buffer = Buf(n, piece_plan(n));  // page-locked in pieces (backend/pieced_buffer.hpp)
    else
      buffer = Buf(n);
  } catch (const std::bad_alloc&) {
    throw failed("out of memory");
  } catch (const BackendError& e) {
    throw failed(e.what());
  }
  if constexpr (!in_backend)
    if (options_.require_pinned_memory && !buffer.page_locked())
      throw failed("page-locking failed and Options::require_pinned_memory is set (raise `ulimit -l`, or clear the "
                   "option to accept pageable memory)");
  return buffer;
}

// How a host buffer of n elements, laid out as whole copies of the owned
// range, is cut into page-locked pieces: never inside a unit's owned range,
// which the engine copies whole (backend/pieced_buffer.hpp).
template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
backend::PiecePlan Engine<P, O, B>::piece_plan(std::size_t n) const {
  backend::PiecePlan plan;
  plan.piece_bytes = options_.pinned_piece_bytes;
  const Ownership own = ownership();
  const std::size_t owned = own.owned_total();
  if (owned == 0 || n % owned != 0) return plan;
  for (std::size_t set = 0; set < n / owned; ++set)
    for (const auto& u : layout_.units()) plan.range_ends.push_back(set * owned + own.state_offset(u) + own.update_size(u));
  return plan;
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
std::vector<std::uint64_t> Engine<P, O, B>::all_gather_control(const std::vector<std::uint64_t>& mine) {
  // A transient buffer, as gather_units': finalize() and set_param are not
  // the steady-state step, and memory_report() then lists only what stays.
  const std::size_t k = mine.size();
  Buffer<std::uint64_t> exchange(k * static_cast<std::size_t>(ranks()));
  std::vector<std::uint64_t> all(exchange.size());
  comm_.communicate([&] {
    std::uint64_t* slot = exchange.data() + static_cast<std::size_t>(rank()) * k;
    Ops::upload(slot, mine.data(), k);
    const auto purpose = comm_.exchange("exchanges control values");
    comm_->all_gather(slot, exchange.data(), k, DType::u64, true);
    Ops::download(all.data(), exchange.data(), all.size());
  });
  return all;
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::check_agreement() {
  const std::vector<AgreedSetting> settings = agreed_engine_settings(
      layout_, options_, {stage(), O::name, P::mixed, dtype_traits<param_type>::dtype, name(plan_.offload)});
  std::vector<std::uint64_t> mine;
  for (const auto& setting : settings) mine.push_back(setting.value);
  const std::vector<std::uint64_t> all = all_gather_control(mine);
  std::string differ = describe_disagreement(settings, all, ranks());
  // Which parameter differs: a second exchange, only when the layouts differ.
  const std::string which =
      layout_disagreement(layout_, all, mine.size(), ranks(), [this](const auto& v) { return all_gather_control(v); });
  if (!which.empty()) differ += "; " + which;
  if (!differ.empty())
    throw CommError(concat(
        "ZeroOptimizer::finalize() on rank ", rank(), ": the ranks were built or configured differently: ", differ,
        ". Every rank must add the same units and parameters, with the same names, sizes and order, and use the "
        "same precision, optimizer, stage and Options."));
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::account_memory() {
  MemoryReport m;
  m.rank = rank();
  m.ranks = ranks();
  m.stage = stage();
  m.padded_elements = layout_.padded_total();
  m.param_elements = layout_.param_total();
  auto in_backend = [](std::uint64_t bytes) {
    PlacedBytes p;
    (B::device ? p.device : p.host) = bytes;
    return p;
  };
  m.placed.params = in_backend(params_.bytes() + gatherer_.secondary_bytes());
  m.placed.grads = in_backend(reducer_.accumulator_bytes());
  m.placed.grads.host += update_.host_grad_bytes();
  m.placed.master = update_.store().master_bytes();
  m.placed.optimizer_states = update_.store().state_bytes();
  m.placed.communication_buffers =
      in_backend(reducer_.staging_bytes() + gatherer_.arena_bytes() + gatherer_.payload_bytes());
  m.placed.communication_buffers.host += update_.host_staging_bytes();
  m.params = m.placed.params.total();
  m.grads = m.placed.grads.total();
  m.master = m.placed.master.total();
  m.optimizer_states = m.placed.optimizer_states.total();
  m.padding = MemoryReport::padding_share(m.param_elements, m.padded_elements, m.model_states());
  m.communication_buffers = m.placed.communication_buffers.total();
  memory_ = m;
}

}  // namespace zero::detail
