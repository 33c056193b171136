// Why: everything the engine does once, at construction and finalize(): the
// run's checks (engine/detail/run_rules.hpp, the rules ZeroOptimizer's
// static_asserts test, for a run chosen at run time), the ranks' agreement
// on every setting, the allocation of each part's rows (part_rows.hpp, the
// rows the planner lists), with errors naming the buffer and what makes it
// smaller, and the memory report built from what was allocated.
// Brought in by engine.hpp.
#pragma once

#include "zero/compiler.hpp"

#include <cstdint>
#include <cstdio>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "zero/engine/detail/agreement.hpp"
#include "zero/engine/detail/part_rows.hpp"
#include "zero/engine/detail/buffer_sizes.hpp"
#include "zero/engine/engine_class.hpp"
#include "zero/engine/detail/rank_checks.hpp"

namespace zero::detail {

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
RunShape Engine<P, O, B>::checked(int stage, OffloadTier offload, const Options& options, DiskMaker disk) const {
  const RunShape run{.stage = stage_rules(stage),
                     .offload = offload,
                     .precision = precision_choice<P>(),
                     .device_backend = B::device,
                     .state_slots = state_slots,
                     .optimizer = O::name,
                     .ranks_per_node = comm_->topology().ranks_per_node,
                     .rank = static_cast<std::size_t>(rank())};
  // The rules of the run's types and of the master's format now; those of
  // the ZeRO++ options, the delayed update and the released pages at
  // finalize() (their errors have always come from there); the disk
  // window's from offload::Nvme's store, which names the optimizer.
  constexpr RunRule at_construction[] = {RunRule::stage_exists, RunRule::offload_needs_partition,
                                         RunRule::cpu_offload_needs_device, RunRule::remainder_master_needs_bf16,
                                         RunRule::bf16_copy_options};
  require_run(run, options, voice, at_construction);
  // What only the engine knows: its backend's abilities and the program's includes.
  require(offload == OffloadTier::none || !B::device || backend::OffloadOps<Ops>,
          "zero: offload from backend ", B::name, " needs a backend with page-locked host buffers and asynchronous "
          "copies (backend/ops.hpp, OffloadOps)");
  require(offload != OffloadTier::nvme || disk.state != nullptr,
          "zero: offload nvme needs its store: #include \"zero/offload/disk_state_store.hpp\" (liburing, "
          "xxhash.h) in the program that makes the optimizer");
  return run;
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::finalize() {
  const comm::ApiCall api_call("finalize");  // names this call in communicator errors (as every collective call)
  require(!finalized_, "ZeroOptimizer::finalize() called twice");
  const StageRules& rules = run_.stage;
  layout_.finalize(sizeof(float));  // fp32 masters, states and reduction staging are the widest
  const std::size_t gather_slots = rules.params_sharded ? static_cast<std::size_t>(options_.prefetch_units) + 1 : 0;
  comm_.open(first_slot_event() + gather_slots);
  run_.overlap = comm_.overlaps();
  check_agreement();
  constexpr RunRule at_finalize[] = {RunRule::zeropp_stage, RunRule::delayed_update_needs_offload_from_device,
                                     RunRule::released_pages_need_host, RunRule::params_on_disk};
  require_run(run_, options_, voice, at_finalize);
  // Sizes from the rule the planner shares (engine/detail/buffer_sizes.hpp).
  const BufferSizes sizes = buffer_sizes(layout_, run_, options_);
  if (const std::string note = gradient_saving_note(sizes, run_, layout_, options_); !note.empty() && rank() == 0)
    std::fprintf(stderr, "%s\n", note.c_str());
  update_.configure(run_, options_);

  // Each part's rows (engine/detail/part_rows.hpp), allocated here and handed to
  // the part; the planner's schedule lists the same rows.
  const bool shards_on_disk = options_.param_place == ParamPlace::disk;
  if (shards_on_disk) {
    require(disk_.params != nullptr && disk_.grads != nullptr,
            "ZeroOptimizer::finalize(): Options::param_place = disk keeps the parameter and gradient shards in files, "
            "with the disk tier's store: #include \"zero/offload/disk_state_store.hpp\" (liburing, xxhash.h) and name "
            "offload::Nvme (ZeroOptimizer<..., offload::Nvme, ...>, or make_optimizer<Backend, offload::Nvme>)");
    params_.bind_pages(disk_.params(options_, rank(), layout_), layout_);
  } else {
    params_.bind(allocate<param_type>(parameter_rows(run_, sizes).values), layout_, rules.params_sharded);
  }
  const GradientRows grad_rows = gradient_rows(run_, sizes);
  typename GradientReducer<Ops, grad_type>::Buffers grad_buffers;
  if (!shards_on_disk) grad_buffers.accumulator = allocate<grad_type>(grad_rows.accumulator);
  grad_buffers.staging = allocate<grad_type>(grad_rows.staging);
  grad_buffers.staging_fp32 = allocate<float>(grad_rows.staging_fp32);
  grad_buffers.shard_staging = allocate<grad_type>(grad_rows.shard_staging);
  // (a generic lambda, not an explicit template one: nvcc 13 refuses those in
  // a member of a class template with default arguments)
  update_.allocate(ownership(), state_rows(run_, options_, layout_, sizes), update_rows(run_, sizes), params_,
                   grad_buffers.accumulator.data(), options_, rank(), disk_,
                   [&](auto buffer_type, const BufferRow& row) {
                     return allocate_as<typename decltype(buffer_type)::type>(row);
                   });
  reducer_.bind(std::move(grad_buffers), sizes.buckets, rules, options_.grad_writes,
                gradients_in_place(rules, options_), sizes.staging_sets, layout_, comm_);
  if (shards_on_disk) {
    reducer_.bind_pages(disk_.grads(options_, rank(), layout_));
    update_.read_grads_from(reducer_.pages());
  }
  aim_final_copies();
  if (options_.qgz) {
    // Collective: every rank splits its communicator here, in this order.
    comm::AnyCommunicator& node = comm_->node();
    comm::AnyCommunicator& across = comm_->across();
    const QgzRows rows = qgz_rows(run_, sizes);
    typename QuantizedReducer<Ops, grad_type>::Buffers qgz;
    qgz.payloads = allocate<std::uint8_t>(rows.payloads);
    qgz.sums = allocate<float>(rows.sums);
    qgz.residuals = allocate<float>(rows.residuals);
    reducer_.bind_qgz(std::move(qgz), quant::Format{options_.qgz_bits, options_.qgz_block}, node, across);
  }
  if (rules.params_sharded) {
    const GatherRows gather = gather_rows(run_, sizes);
    gatherer_.bind(allocate<param_type>(gather.arena), sizes.gather_slot_count, layout_, params_, comm_,
                   options_.prefetch_units, first_slot_event());
    if (options_.qwz)  // (before hpZ: an int8 copy keeps qwZ's payloads)
      gatherer_.bind_qwz(allocate<std::uint8_t>(gather.qwz_payloads), options_.qwz_block);
    if (options_.hpz && options_.hpz_int8)
      gatherer_.bind_hpz_int8(allocate<std::uint8_t>(gather.hpz_int8_secondary),
                              allocate<std::uint8_t>(gather.hpz_int8_staging), options_.qwz_block, comm_->node());
    else if (options_.hpz)
      gatherer_.bind_hpz(allocate<param_type>(gather.hpz_secondary), comm_->node());
  }
  control_.bind(control_rows(run_, sizes).front().elements, comm_);
  replicas_.bind(layout_.units().size(), options_.check_replicas);
  own_.bind(layout_, options_.release_memory_pages);
  account_memory();
  finalized_ = true;
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
template <class Buf>
Buf Engine<P, O, B>::allocate_as(const BufferRow& row) {
  using T = std::remove_pointer_t<decltype(std::declval<Buf&>().data())>;
  constexpr bool in_backend = std::is_same_v<Buf, Buffer<T>>;
  const char* where = in_backend && B::device ? "device" : "host";
  const char* what = row.name;
  require(row.element_bytes == sizeof(T), "finalize(): the row of the ", what, " has ", row.element_bytes,
          "-byte elements, but its buffer's are ", sizeof(T), " bytes (a part's rows and its buffers differ)");
  require(row.elements <= SIZE_MAX, "finalize(): the ", what, " has ", row.elements, " elements, more than memory can address");
  const auto n = static_cast<std::size_t>(row.elements);
  checked_mul(n, sizeof(T), "finalize(): the ", what, " (", n, " elements)");
  auto failed = [&](const char* why) { return allocation_error(rank(), what, n, sizeof(T), where, why, row.smaller); };
  Buf buffer;
  try {
    if constexpr (std::is_constructible_v<Buf, std::size_t, const backend::PieceCuts&>)
      buffer = Buf(n, piece_cuts(n));  // page-locked in pieces (backend/pieced_buffer.hpp)
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
backend::PieceCuts Engine<P, O, B>::piece_cuts(std::size_t n) const {
  backend::PieceCuts cuts;
  cuts.piece_bytes = options_.pinned_piece_bytes;
  const Ownership own = ownership();
  const std::size_t owned = own.owned_total();
  if (owned == 0 || n % owned != 0) return cuts;
  for (std::size_t set = 0; set < n / owned; ++set)
    for (const auto& u : layout_.units()) cuts.range_ends.push_back(set * owned + own.state_offset(u) + own.update_size(u));
  return cuts;
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
      layout_, options_, {stage(), O::name, P::mixed, dtype_traits<param_type>::dtype, name(run_.offload)});
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
  m.placed.params = params_.placed(B::device);
  m.placed.params += in_backend(gatherer_.secondary_bytes());
  m.placed.grads = reducer_.placed(B::device);
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
