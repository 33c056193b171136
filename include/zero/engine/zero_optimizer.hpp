// Why: this is the one type users see. It owns the partitioned model state of
// one rank (parameters, gradients, fp32 master, optimizer state, each kept
// whole or as this rank's 1/N according to the stage), drives the
// collectives of the ZeRO stages through any Communicator, and runs the fused
// step on the backend. All buffers are allocated once at finalize(); the
// steady-state step allocates nothing.
//
// Per micro-batch, per unit (a layer), the caller:
//   const auto* w = opt.acquire_unit(u);   // stage 3: gathers the unit
//   ... forward with w ...; opt.release_unit(u);
// and in backward, in reverse unit order:
//   opt.acquire_unit(u); auto* g = opt.grad_buffer(u); ... write dL/dw into g ...
//   opt.grad_ready(u); opt.release_unit(u);
// then opt.step(), which steps the optimizer every grad_accumulation_steps
// micro-batches. Collective calls (finalize, set_param, acquire_unit at
// stage 3, grad_ready, step, gather_*) must be made by every rank in the same
// order; each names itself (comm::ApiCall, a thread-local name in a scope),
// so that a communicator's error says which call each rank was in.
//
// Ranks never silently disagree. finalize() compares the layout, precision,
// optimizer, stage and every Options field across ranks; set_param() compares
// a fingerprint of the values (it detects rather than broadcasting rank 0's
// values, as DDP does: a rank-dependent initialisation is a bug worth
// hearing about, and detection moves 8 bytes per rank instead of the
// parameter); step() re-validates hyper() and compares a fingerprint of the
// update rule with this step's hyper-parameters across ranks, carried in the
// step's control all-reduce with the overflow flags, so a mismatch costs no
// extra collective. Each is an error on every rank naming the ranks that differ.
//
// On a GPU whose communicator has a stream of its own, communication
// overlaps compute: gradient buckets are reduced and stage-3 units gathered
// on the communicator's stream while the caller's kernels go on, and the
// compute stream waits only where it reads their results (Ops<Cuda>::Overlap).
#pragma once

#include "zero/config.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "zero/backend/host.hpp"
#include "zero/backend/pieced_buffer.hpp"
#include "zero/comm/any_communicator.hpp"
#include "zero/comm/communicator.hpp"
#include "zero/engine/agreement.hpp"
#include "zero/engine/buffer_sizes.hpp"
#include "zero/engine/comm_channel.hpp"
#include "zero/engine/gradient_reducer.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/loss_scaler.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/param_gatherer.hpp"
#include "zero/engine/rank_checks.hpp"
#include "zero/engine/reports.hpp"
#include "zero/engine/stage_plan.hpp"
#include "zero/engine/state_store.hpp"
#include "zero/engine/step_control.hpp"
#include "zero/engine/update_worker.hpp"
#include "zero/error.hpp"
#include "zero/kernels/fused_step.hpp"
#include "zero/optim/policy.hpp"
#include "zero/policies.hpp"

namespace zero {

namespace checkpoint {
// Saves and loads a ZeroOptimizer's state: zero/checkpoint/optimizer_io.hpp
// (needs nlohmann-json and xxHash), included only by programs that checkpoint.
template <class Opt>
struct OptimizerIo;
// The Io of save/load/load_hf once its header is included; without it, this
// static_assert instead of "invalid use of incomplete type". (Named through
// the member template's parameter: checked where a call is compiled.)
template <class Io>
struct IncludedIo {
  static_assert(requires { sizeof(Io); },
                "opt.save, opt.load and opt.load_hf need #include \"zero/checkpoint/optimizer_io.hpp\" (which needs "
                "nlohmann-json and xxHash: apt install nlohmann-json3-dev libxxhash-dev)");
  using type = Io;
};
template <class Io>
using Included = typename IncludedIo<Io>::type;
// A save still being written in the background (save(dir, {.async = true})):
// the optimizer completes it (collective) at wait_save(), at the next save
// or load, and when it is destroyed.
class BackgroundSave {
 public:
  virtual ~BackgroundSave() = default;
  virtual void finish() = 0;
};
}  // namespace checkpoint

struct StepResult {
  bool stepped = false;         // the optimizer updated the parameters
  bool skipped_overflow = false;  // fp16: inf/NaN in the gradients; nothing was updated
  bool accumulating = false;    // a micro-batch before the accumulation boundary
  double grad_norm = 0.0;       // global L2 norm of the unscaled, averaged gradient (before clipping)
  double loss_scale = 1.0;      // the scale that was in effect for this step
};

template <PrecisionPolicy Precision, optim::Policy Optimizer, StagePolicy Stage, OffloadPolicy Offload = offload::None,
          BackendPolicy Backend = backend::Host>
class ZeroOptimizer {
  static_assert(!(std::is_same_v<Offload, offload::Cpu> && !Backend::device),
                "zero::ZeroOptimizer: offload::Cpu moves optimizer state from GPU memory to the host, but with "
                "backend::Host it is already in host memory; use offload::None (or offload::Nvme to move it to disk)");
  static_assert(!(Offload::to_host && Stage::value == 0),
                "zero::ZeroOptimizer: ZeRO-Offload moves this rank's partition of the optimizer state to the host; "
                "stage 0 has no partition: use stage<1> or higher with offload::Cpu/Nvme");

 public:
  using precision_policy = Precision;
  using optimizer_policy = Optimizer;
  using offload_policy = Offload;
  using backend_policy = Backend;
  using param_type = typename Precision::param_type;
  using grad_type = typename Precision::grad_type;
  using Hyper = typename Optimizer::Hyper;
  static constexpr int stage = Stage::value;
  // What this stage shards, and when it reduces and gathers (stage_plan.hpp).
  static constexpr StagePlan rules = stage_plan(stage);
  static constexpr int state_slots = Optimizer::state_slots;

 private:
  using Ops = backend::Ops<Backend>;
  template <class T>
  using Buffer = typename Ops::template Buffer<T>;
  // The update runs on the host, beside the backend's memory (ZeRO-Offload).
  static constexpr bool offloaded = Offload::to_host;
  // Offloaded from device memory: the owned gradient is copied to the host
  // for the CPU update and the 16-bit parameters staged back (backend::Host
  // with offload::Nvme updates straight from and into its own buffers).
  static constexpr bool host_staging = offloaded && Backend::device;
  // The store hands out its master only in passing (offload::Nvme's window):
  // fp32 parameters are then staged like 16-bit ones instead of uploaded
  // from the master.
  static constexpr bool stage_params = host_staging && (Precision::mixed || std::is_same_v<Offload, offload::Nvme>);
  // fp32 training: the parameters are their own master weights, unless the
  // master moves to the host and the device keeps a working copy.
  static constexpr bool separate_master = Precision::mixed || offloaded;
  // What runs the update: the backend, or the CPU when offloaded.
  using UpdateOps = std::conditional_t<offloaded, backend::Ops<backend::Host>, Ops>;
  // Host staging of the offloaded update (empty types without offload).
  template <class T>
  using OffloadBuffer = typename std::conditional_t<offloaded, Ops, backend::Ops<backend::Host>>::template PinnedBuffer<T>;
  // Owner of the master weights and optimizer state, in the tier the offload
  // policy chose (engine/state_store.hpp).
  using StateStore = typename StateStoreFor<Offload, Optimizer, Backend>::type;

 public:
  template <comm::Communicator Comm>
  ZeroOptimizer(Comm& communicator, Hyper hyper, Options options = {})
      : comm_(communicator),
        hyper_(hyper),
        options_(options),
        layout_(comm_->size()),
        control_(options.loss_scale, Precision::loss_scaling) {
    hyper_.validate();
    options_.validate();
  }

  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;
  // Completes a background save (collective: every rank destroys its
  // optimizer). While an exception unwinds, it only waits for this rank's
  // file, and the checkpoint stays incomplete (no manifest), so the previous
  // one is what a resume finds. A destructor cannot throw: a failure is
  // printed to stderr; call wait_save() first to get it as an exception.
  ~ZeroOptimizer() {
    const comm::ApiCall api_call("~ZeroOptimizer");
    if (!background_save_) return;
    try {
      if (std::uncaught_exceptions() <= unwinding_at_start_) wait_save();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "zero: rank %d: the background checkpoint save failed: %s\n", rank(), e.what());
    }
  }

  // ---- Registration ----------------------------------------------------
  UnitId add_unit(std::string name) { return layout_.add_unit(std::move(name)); }
  // `shape` (optional, e.g. {out, in}) must hold `numel` elements; the
  // optimizer stores every parameter flat, checkpoints and the Hugging Face
  // export keep the shape.
  ParamId add_param(UnitId unit, std::string name, std::size_t numel, Shape shape = {}) {
    return layout_.add_param(unit, std::move(name), numel, std::move(shape));
  }

  // Collective. Checks that all ranks registered the same layout, then
  // allocates every buffer the run will use.
  void finalize();

  const Layout& layout() const { return layout_; }
  int rank() const { return comm_->rank(); }
  int ranks() const { return comm_->size(); }

  // ---- Values ------------------------------------------------------------
  // Collective. Sets a parameter from fp32 host values (numel of them). Every
  // rank must pass the same values (each keeps what its stage needs of
  // them); a rank whose values differ from rank 0's makes it a CommError on
  // every rank. Stage 3: the unit must not be acquired.
  void set_param(ParamId p, const float* values);

  // Collective: the full fp32 master weights / low-precision parameters
  // (padded layout, Layout::padded_total() elements) into host memory.
  // Counted as control traffic, not as model traffic.
  void gather_masters(float* out);
  void gather_params(param_type* out);
  // A parameter's values as fp32 from the gathered masters (collective).
  std::vector<float> master_values(ParamId p);

  // ---- Forward / backward ------------------------------------------------
  // The unit's parameters (padded flat buffer; a parameter starts at
  // layout().param(p).offset). Stage 3: collective, gathers the unit (and
  // prefetches the next ones) into the gather arena.
  const param_type* acquire_unit(UnitId u);
  // Stage 3: frees the unit's room in the gather arena. Other stages: nothing.
  void release_unit(UnitId u);
  // Pointer to parameter p inside its unit's parameters (after finalize();
  // stage 3: the unit must be acquired, not merely prefetched).
  const param_type* param_data(ParamId p) const;

  // Where this micro-batch's gradient of unit u goes (padded flat layout,
  // same offsets as the parameters). Overwrite it: accumulation across
  // micro-batches is the optimizer's job. For fp16 the gradient is of the
  // scaled loss (loss * loss_scale()).
  grad_type* grad_buffer(UnitId u);
  // Collective: unit u's gradient is complete. Stage 2/3 reduce-scatter it now.
  void grad_ready(UnitId u);

  // ---- Step --------------------------------------------------------------
  // Collective. Call once per micro-batch; steps every grad_accumulation_steps
  // (stage 3: with no unit acquired). Each step validates hyper() and checks
  // that every rank set the same values.
  StepResult step();

  // Blocks until everything the optimizer enqueued, compute and
  // communication, has finished (before timing a step, say). On the host
  // there is nothing to wait for.
  void synchronize() {
    if (update_pending_) worker_.wait();
    comm_.join();
    Ops::synchronize();
  }
  // Options::delayed_update: lands the update still running in the
  // background (waits for it, copies its parameters to the device, and at
  // stages 1-2 all-gathers them: collective). Call it before evaluating the
  // model; gather_*, master_values, set_param and step() call it themselves.
  // Without a pending update it does nothing.
  void wait_update() {
    const comm::ApiCall api_call("wait_update");
    require_finalized("wait_update");
    land_update();
  }

  // ---- Checkpoints (#include "zero/checkpoint/optimizer_io.hpp") ----------
  // Collective. Writes this run's state into directory `dir` (one
  // safetensors file per rank, a manifest last; docs/checkpoint-format.md).
  // With {.async = true} it returns once this rank's state is copied to host
  // memory and writes in the background; the checkpoint exists once
  // wait_save(), the next save or load, or the destructor completes it.
  template <class Io = checkpoint::OptimizerIo<ZeroOptimizer>>
  void save(const std::string& dir, typename checkpoint::Included<Io>::SaveOptions options = {}) {
    Io::save(*this, dir, std::move(options));
  }
  // Collective. Completes a background save: waits for this rank's file,
  // confirms every rank's, writes the manifest. Nothing pending: nothing.
  void wait_save() {
    const comm::ApiCall api_call("wait_save");
    if (!background_save_) return;
    auto pending = std::move(background_save_);  // a failure is reported once, not again by the destructor
    pending->finish();
  }
  // Collective. Loads a checkpoint saved by any number of ranks at any stage
  // and offload tier (the same optimizer and model); `path` is a checkpoint
  // directory or a root holding step-* checkpoints (the newest complete one).
  template <class Io = checkpoint::OptimizerIo<ZeroOptimizer>>
  auto load(const std::string& path) {
    return checkpoint::Included<Io>::load(*this, path);
  }
  // Collective. Sets every parameter from a Hugging Face safetensors file set
  // (a .safetensors file, a model.safetensors.index.json, or a directory
  // holding either), by name: a missing name, or a shape other than the
  // registered one (or another element count, for a parameter registered
  // flat), is an error on every rank before any parameter changes. The
  // optimizer state and the step counter are left as they are.
  template <class Io = checkpoint::OptimizerIo<ZeroOptimizer>>
  void load_hf(const std::string& path) {
    checkpoint::Included<Io>::load_hf(*this, path);
  }

  double loss_scale() const { return control_.scaler().scale(); }
  // e.g. hyper().lr = schedule(step), the same on every rank (checked at the step)
  Hyper& hyper() { return hyper_; }
  const Options& options() const { return options_; }
  std::int64_t step_count() const { return steps_; }

  MemoryReport memory_report() const { return memory_; }
  // Offload from a device: the split of the steps' time (OffloadTimes).
  OffloadTimes offload_times() const { return offload_times_; }
  void reset_offload_times() { offload_times_ = {}; }
  CommReport comm_report() const {
    CommReport r;
    r.rank = rank();
    r.ranks = ranks();
    r.stage = stage;
    r.steps = static_cast<std::uint64_t>(steps_ - steps_at_reset_);
    r.counters = comm_->counters();
    return r;
  }
  void reset_comm_counters() {
    comm_->reset_counters();
    steps_at_reset_ = steps_;
  }

 private:
  template <class>
  friend struct checkpoint::OptimizerIo;

  // The range of elements of unit u that this rank updates: its shard, or the
  // whole unit at stage 0 (every rank updates everything).
  std::size_t update_begin(const UnitInfo& u) const {
    return rules.states_sharded ? static_cast<std::size_t>(rank()) * u.shard : 0;
  }
  std::size_t update_size(const UnitInfo& u) const { return rules.states_sharded ? u.shard : u.padded; }
  // Offset of unit u's updated range in the model-state store's owned elements.
  std::size_t state_offset(const UnitInfo& u) const { return rules.states_sharded ? u.shard_offset : u.full_offset; }

  // This rank's updated range of unit u in the parameters and the gradient.
  param_type* param_ptr(const UnitInfo& u) {
    if constexpr (rules.params_sharded)
      return params_.data() + u.shard_offset;
    else
      return params_.data() + u.full_offset + update_begin(u);
  }
  grad_type* grad_ptr(const UnitInfo& u) {
    if constexpr (rules.grads_sharded)
      return reducer_.accumulator() + u.shard_offset;
    else
      return reducer_.accumulator() + u.full_offset + update_begin(u);
  }
  // Where the update reads unit u's owned gradient: the gradient buffer, or
  // its host copy when offloaded.
  grad_type* update_grad(const UnitInfo& u) { return update_grad(u, host_grad_set_); }
  grad_type* update_grad(const UnitInfo& u, std::size_t host_set) {
    if constexpr (host_staging)
      return host_grads_.data() + host_set * owned_total() + state_offset(u);
    else
      return grad_ptr(u);
  }
  // The update of every unit with `args` (gradient scale, scalars, rounding
  // set). upload_each: copy each unit's new parameters to the device as it
  // finishes (offload without delay); otherwise land_update() copies them.
  using StepArgs = kernels::FusedStepArgs<Optimizer, grad_type, param_type>;
  // host_set: the host gradient set it reads (offload).
  void update_units(StepArgs args, bool upload_each, std::size_t host_set);
  // Offload: unit u's updated parameters, host to device (async).
  void upload_updated(const UnitInfo& u);
  // After the parameters changed: stage 3 drops its gathered copies, stages
  // 1-2 all-gather the updated shards (collective).
  void publish_params();
  // Delayed update: waits for the background update and publishes it.
  void land_update();
  // Elements this rank updates (the store's owned elements).
  std::size_t owned_total() const { return rules.states_sharded ? layout_.shard_total() : layout_.padded_total(); }
  // Unit u's updated range of the fp32 master into backend memory `dst`:
  // from the store, or from the parameters when they are their own master.
  void copy_master(const UnitInfo& u, float* dst);

  void require_finalized(const char* what) const {
    require(finalized_, what, ": call finalize() after registering the parameters and before training");
  }
  void require_unit(UnitId u, const char* what) const {
    require(u.index < layout_.units().size(), what, ": unit id ", u.index, " does not exist (",
            layout_.units().size(), " units)");
  }

  // Events of the channel: one per gradient staging set (the reducer's
  // first two), then the gatherer's (one per gather slot, a unit the arena
  // holds).
  static constexpr std::size_t first_slot_event = 2;
  // This micro-batch's place in the accumulation window.
  bool first_micro() const { return micro_ == 0; }
  bool last_micro() const { return micro_ == options_.grad_accumulation_steps - 1; }
  // Offload at stages 2-3: where the reducer copies each finished shard (the
  // host gradient set the next update reads).
  void aim_final_copies() {
    if constexpr (host_staging && rules.reduce_scatter_on_flush)
      reducer_.copy_final_shards_to(host_grads_.data() + host_grad_set_ * owned_total());
  }

  // Collective: every unit, padded, into host memory `out`, from each rank's
  // updated range of it (fill(u, dst) writes that range into backend memory).
  template <class T, class Fill>
  void gather_units(T* out, Fill fill);

  // A buffer of n elements for finalize(). An overflowing size or a failed
  // allocation becomes an error naming the buffer, its bytes, this rank and
  // `lower_it` (the option or stage that makes it smaller).
  template <class T>
  Buffer<T> allocate(std::size_t n, const char* what, const std::string& lower_it) {
    return allocate_as<Buffer<T>>(n, what, lower_it);
  }
  // The same for any buffer type (the store's, page-locked host buffers).
  template <class Buf>
  Buf allocate_as(std::size_t n, const char* what, const std::string& lower_it);
  // How a host buffer of n elements, laid out as whole copies of the owned
  // range, is cut into page-locked pieces: never inside a unit's owned range,
  // which the engine copies whole (backend/pieced_buffer.hpp).
  backend::PiecePlan piece_plan(std::size_t n) const {
    backend::PiecePlan plan;
    plan.piece_bytes = options_.pinned_piece_bytes;
    const std::size_t owned = owned_total();
    if (owned == 0 || n % owned != 0) return plan;
    for (std::size_t set = 0; set < n / owned; ++set)
      for (const auto& u : layout_.units()) plan.range_ends.push_back(set * owned + state_offset(u) + update_size(u));
    return plan;
  }
  // Collective: every rank's values, rank-major, through a backend buffer
  // (collectives take backend memory), counted as control traffic.
  std::vector<std::uint64_t> all_gather_control(const std::vector<std::uint64_t>& mine);
  // Checks at finalize() that every rank agrees on the settings (agreement.hpp, rank_checks.hpp).
  void check_agreement();
  void account_memory();

  detail::CommChannel<Ops> comm_;  // the communicator, and on a GPU the lane its collectives run on
  Hyper hyper_;
  Options options_;
  Layout layout_;
  bool finalized_ = false;

  // Model state (see memory_report for which are whole and which are shards).
  Buffer<param_type> params_;
  StateStore store_;  // fp32 master (mixed precision) and optimizer state
  // Offload: the owned gradient's host copy (the update reads it there) and
  // the 16-bit parameters the CPU writes before they are copied to the device.
  OffloadBuffer<grad_type> host_grads_;
  OffloadBuffer<param_type> host_params_;
  std::vector<const float*> updated_master_;  // fp32 offload: where each unit's updated master is
  // Delayed update: the host gradient is double-buffered (the background
  // update reads one set while the next step's shards arrive in the other).
  std::size_t host_grad_set_ = 0;
  bool update_pending_ = false;
  StepArgs pending_args_{};
  std::size_t pending_set_ = 0;
  detail::UpdateWorker worker_;
  detail::GradientReducer<Ops, grad_type> reducer_;  // gradients: staging, buckets, reductions, accumulator
  detail::StepControl<Ops> control_;                 // the step's decision: norm, overflow, loss scale, clipping
  detail::ParamGatherer<Ops, param_type> gatherer_;  // stage 3: where gathered units live (param_gatherer.hpp)

  int micro_ = 0;             // micro-batch index within the accumulation window
  std::int64_t steps_ = 0;
  std::int64_t steps_at_reset_ = 0;
  MemoryReport memory_{};
  std::unique_ptr<checkpoint::BackgroundSave> background_save_;  // an asynchronous save in flight
  int unwinding_at_start_ = std::uncaught_exceptions();          // exceptions in flight when constructed
  OffloadTimes offload_times_{};
  using Clock = std::chrono::steady_clock;
  static double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }
};

// ============================================================================

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::finalize() {
  const comm::ApiCall api_call("finalize");  // names this call in communicator errors (as every collective call)
  require(!finalized_, "ZeroOptimizer::finalize() called twice");
  layout_.finalize(sizeof(float));  // fp32 masters, states and reduction staging are the widest
  const std::size_t gather_slots = rules.params_sharded ? static_cast<std::size_t>(options_.prefetch_units) + 1 : 0;
  comm_.open(first_slot_event + gather_slots);
  check_agreement();
  // Sizes from the rule the planner shares (engine/buffer_sizes.hpp).
  const BufferSizes sizes = buffer_sizes(
      layout_, BufferSpec{rules, separate_master, sizeof(grad_type), state_slots, comm_.overlaps()}, options_);

  // What makes each buffer smaller, for the out-of-memory message.
  constexpr const char* shard_params = "stage 3 shards the parameters: use stage<3> or more ranks";
  constexpr const char* shard_grads = "stages 2 and 3 shard the gradients: use stage<2> or higher, or more ranks";
  constexpr const char* shard_states =
      "stages 1-3 shard the master weights and optimizer state: use stage<1> or higher, or more ranks";
  constexpr const char* fewer_units = "lower Options::bucket_bytes (a bucket holds at least one unit), or split "
                                      "the largest unit";
  params_ = allocate<param_type>(sizes.params, "parameters", rules.params_sharded ? "more ranks" : shard_params);
  typename detail::GradientReducer<Ops, grad_type>::Buffers grad_buffers;
  grad_buffers.accumulator =
      allocate<grad_type>(sizes.grads, "gradients", rules.grads_sharded ? "more ranks" : shard_grads);
  if constexpr (requires { store_.configure(options_.nvme, 0); }) store_.configure(options_.nvme, rank());
  // (a generic lambda, not an explicit template one: nvcc 13 refuses those in
  // a member of a class template with default arguments)
  store_.allocate(sizes.state_per_slot, separate_master, [&](auto buffer_type, std::size_t n, const char* what) {
    using Buf = typename decltype(buffer_type)::type;
    return allocate_as<Buf>(n, what, rules.states_sharded ? "more ranks" : shard_states);
  });
  require(!options_.delayed_update || host_staging,
          "Options::delayed_update overlaps the CPU update of offload with the next step's work on the device; it "
          "needs offload::Cpu or offload::Nvme with a device backend (backend::Cuda); clear the option otherwise");
  if constexpr (host_staging) {
    host_grads_ = allocate_as<OffloadBuffer<grad_type>>(
        checked_mul(sizes.state_per_slot, std::size_t{options_.delayed_update ? 2u : 1u}, "the host gradient"),
        options_.delayed_update ? "host copies of the owned gradient (two: delayed update)"
                                : "host copy of the owned gradient",
        "more ranks");
    updated_master_.assign(layout_.units().size(), nullptr);
    if constexpr (stage_params)
      host_params_ = allocate_as<OffloadBuffer<param_type>>(sizes.state_per_slot, "host staging of the parameters",
                                                            "more ranks");
  }
  grad_buffers.staging = allocate<grad_type>(sizes.grad_staging, "gradient staging (one bucket)", fewer_units);
  grad_buffers.staging_fp32 = allocate<float>(sizes.reduce_staging_fp32, "fp32 reduction staging",
                                              "Options::reduce_dtype = ReduceDType::same_as_grad needs none; or " +
                                                  std::string(fewer_units));
  grad_buffers.shard_staging = allocate<grad_type>(sizes.shard_staging, "reduce-scatter staging", fewer_units);
  reducer_.bind(std::move(grad_buffers), sizes.buckets, rules, gradients_in_place(rules, options_),
                sizes.staging_sets, layout_, comm_);
  aim_final_copies();
  if constexpr (rules.params_sharded) {
    gatherer_.bind(allocate<param_type>(sizes.gather_slots, "stage-3 gather arena",
                                        "lower Options::prefetch_units (the arena holds the prefetch_units + 1 "
                                        "largest units), or split the largest units"),
                   sizes.gather_slot_count, layout_, params_.data(), comm_, options_.prefetch_units, first_slot_event);
  }
  control_.bind(sizes.control, comm_);
  account_memory();
  finalized_ = true;
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
template <class Buf>
Buf ZeroOptimizer<P, O, S, F, B>::allocate_as(std::size_t n, const char* what, const std::string& lower_it) {
  using T = std::remove_pointer_t<decltype(std::declval<Buf&>().data())>;
  constexpr bool in_backend = std::is_same_v<Buf, Buffer<T>>;
  const char* where = in_backend && B::device ? "device" : "host";
  checked_mul(n, sizeof(T), "finalize(): the ", what, " (", n, " elements)");
  auto failed = [&](const char* why) { return detail::allocation_error(rank(), what, n, sizeof(T), where, why, lower_it); };
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

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
std::vector<std::uint64_t> ZeroOptimizer<P, O, S, F, B>::all_gather_control(const std::vector<std::uint64_t>& mine) {
  // A transient buffer, as gather_units': finalize() and set_param are not
  // the steady-state step, and memory_report() then lists only what stays.
  const std::size_t k = mine.size();
  Buffer<std::uint64_t> exchange(k * static_cast<std::size_t>(ranks()));
  std::vector<std::uint64_t> all(exchange.size());
  comm_.communicate([&] {
    std::uint64_t* slot = exchange.data() + static_cast<std::size_t>(rank()) * k;
    Ops::upload(slot, mine.data(), k);
    comm_->all_gather(slot, exchange.data(), k, DType::u64, true);
    Ops::download(all.data(), exchange.data(), all.size());
  });
  return all;
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::check_agreement() {
  const std::vector<AgreedSetting> settings = detail::agreed_engine_settings(
      layout_, options_, {stage, O::name, P::mixed, dtype_traits<param_type>::dtype, F::name});
  std::vector<std::uint64_t> mine;
  for (const auto& setting : settings) mine.push_back(setting.value);
  const std::vector<std::uint64_t> all = all_gather_control(mine);
  std::string differ = describe_disagreement(settings, all, ranks());
  // Which parameter differs: a second exchange, only when the layouts differ.
  const std::string which = detail::layout_disagreement(layout_, all, mine.size(), ranks(),
                                                        [this](const auto& v) { return all_gather_control(v); });
  if (!which.empty()) differ += "; " + which;
  if (!differ.empty())
    throw CommError(detail::concat(
        "ZeroOptimizer::finalize() on rank ", rank(), ": the ranks were built or configured differently: ", differ,
        ". Every rank must add the same units and parameters, with the same names, sizes and order, and use the "
        "same precision, optimizer, stage and Options."));
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::account_memory() {
  MemoryReport m;
  m.rank = rank();
  m.ranks = ranks();
  m.stage = stage;
  m.padded_elements = layout_.padded_total();
  m.param_elements = layout_.param_total();
  auto in_backend = [](std::uint64_t bytes) {
    PlacedBytes p;
    (B::device ? p.device : p.host) = bytes;
    return p;
  };
  m.placed.params = in_backend(params_.bytes());
  m.placed.grads = in_backend(reducer_.accumulator_bytes());
  m.placed.grads.host += host_grads_.bytes();
  m.placed.master = store_.master_bytes();
  m.placed.optimizer_states = store_.state_bytes();
  m.placed.communication_buffers =
      in_backend(reducer_.staging_bytes() + gatherer_.arena_bytes());
  m.placed.communication_buffers.host += host_params_.bytes();
  if constexpr (requires { store_.window_bytes(); }) m.placed.communication_buffers.host += store_.window_bytes();
  m.params = m.placed.params.total();
  m.grads = m.placed.grads.total();
  m.master = m.placed.master.total();
  m.optimizer_states = m.placed.optimizer_states.total();
  m.padding = MemoryReport::padding_share(m.param_elements, m.padded_elements, m.model_states());
  m.communication_buffers = m.placed.communication_buffers.total();
  memory_ = m;
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::set_param(ParamId id, const float* values) {
  const comm::ApiCall api_call("set_param");
  require_finalized("set_param");
  land_update();
  require(id.index < layout_.params().size(), "set_param: parameter id ", id.index, " does not exist");
  const ParamInfo& p = layout_.param(id);
  const UnitInfo& u = layout_.units()[p.unit];
  if constexpr (rules.params_sharded) {
    // A gathered copy of the unit would keep the old values: a prefetched one
    // is dropped below; one in use cannot be.
    require(!gatherer_.is_acquired(p.unit), "set_param('", p.name, "'): unit '", u.name,
            "' is acquired; release_unit() it before setting its parameters");
  }
  // Collective: ranks that pass different values would each keep their own
  // part of them (a model no rank has); compare fingerprints instead.
  const std::vector<std::uint64_t> all = all_gather_control({hash_floats(values, p.numel)});
  std::string differ;
  for (int r = 1; r < ranks(); ++r)
    if (all[static_cast<std::size_t>(r)] != all[0]) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  if (!differ.empty())
    throw CommError(detail::concat("set_param('", p.name, "') on rank ", rank(), ": rank(s) ", differ,
                                   " passed values that differ from rank 0's; every rank must pass the same values "
                                   "(initialise from the same seed on every rank, or load the same checkpoint)"));
  if constexpr (rules.params_sharded) gatherer_.drop(p.unit);
  comm_.join();  // communication in flight may still read the parameters
  // The part of the parameter inside this rank's updated range of the unit.
  const std::size_t begin = update_begin(u), end = begin + update_size(u);
  const std::size_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.numel);
  if (lo < hi) {
    const float* owned = values + (lo - p.offset);
    if (store_.owns_master()) store_.import_values(StateSlot{}, state_offset(u) + (lo - begin), owned, hi - lo);
    if constexpr (rules.params_sharded) {  // stages 0-2: the full copy below covers it
      // Converted on the host, then uploaded (values are fp32 host memory).
      std::vector<param_type> low(hi - lo);
      for (std::size_t i = 0; i < low.size(); ++i) low[i] = from_float<param_type>(owned[i]);
      Ops::upload(param_ptr(u) + (lo - begin), low.data(), low.size());
    }
  }
  if constexpr (rules.params_whole()) {
    // Every rank holds the full parameters.
    std::vector<param_type> low(p.numel);
    for (std::size_t i = 0; i < p.numel; ++i) low[i] = from_float<param_type>(values[i]);
    Ops::upload(params_.data() + u.full_offset + p.offset, low.data(), low.size());
  }
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::gather_masters(float* out) {
  const comm::ApiCall api_call("gather_masters");
  require_finalized("gather_masters");
  land_update();
  gather_units(out, [this](const UnitInfo& u, float* dst) { copy_master(u, dst); });
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::copy_master(const UnitInfo& u, float* dst) {
  if (store_.owns_master()) {
    std::vector<float> host(update_size(u));  // values leave the store through host memory
    store_.export_values(StateSlot{}, state_offset(u), host.data(), host.size());
    Ops::upload(dst, host.data(), host.size());
  } else if constexpr (std::is_same_v<param_type, float>) {
    Ops::copy(dst, param_ptr(u), update_size(u));
  }
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::gather_params(param_type* out) {
  const comm::ApiCall api_call("gather_params");
  require_finalized("gather_params");
  land_update();
  if constexpr (rules.params_whole()) {
    Ops::download(out, params_.data(), layout_.padded_total());
  } else {
    gather_units(out, [this](const UnitInfo& u, param_type* dst) { Ops::copy(dst, param_ptr(u), u.shard); });
  }
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
template <class T, class Fill>
void ZeroOptimizer<P, O, S, F, B>::gather_units(T* out, Fill fill) {
  // One unit at a time through a backend buffer (collectives take backend memory).
  Buffer<T> unit_buffer(layout_.max_unit());
  comm_.communicate([&] {
    for (const auto& u : layout_.units()) {
      T* mine = unit_buffer.data() + update_begin(u);
      fill(u, mine);
      if (rules.states_sharded) comm_->all_gather(mine, unit_buffer.data(), u.shard, dtype_traits<T>::dtype, true);
      Ops::download(out + u.full_offset, unit_buffer.data(), u.padded);
    }
  });
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
std::vector<float> ZeroOptimizer<P, O, S, F, B>::master_values(ParamId id) {
  const comm::ApiCall api_call("master_values");
  std::vector<float> all(layout_.padded_total());
  gather_masters(all.data());
  const ParamInfo& p = layout_.param(id);
  const std::size_t start = layout_.units()[p.unit].full_offset + p.offset;
  return std::vector<float>(all.begin() + static_cast<std::ptrdiff_t>(start),
                            all.begin() + static_cast<std::ptrdiff_t>(start + p.numel));
}

// ---- Forward / backward -------------------------------------------------------

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
auto ZeroOptimizer<P, O, S, F, B>::acquire_unit(UnitId id) -> const param_type* {
  const comm::ApiCall api_call("acquire_unit");
  require_finalized("acquire_unit");
  require_unit(id, "acquire_unit");
  const UnitInfo& u = layout_.units()[id.index];
  if constexpr (rules.params_whole())
    return params_.data() + u.full_offset;
  else
    return gatherer_.acquire(id.index, reducer_.in_backward());
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::release_unit(UnitId id) {
  require_unit(id, "release_unit");
  if constexpr (rules.params_sharded) gatherer_.release(id.index);
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
auto ZeroOptimizer<P, O, S, F, B>::param_data(ParamId id) const -> const param_type* {
  require_finalized("param_data");
  require(id.index < layout_.params().size(), "param_data: parameter id ", id.index, " does not exist (",
          layout_.params().size(), " parameters)");
  const ParamInfo& p = layout_.param(id);
  const UnitInfo& u = layout_.units()[p.unit];
  if constexpr (rules.params_whole()) {
    return params_.data() + u.full_offset + p.offset;
  } else {
    // Acquired, not merely prefetched: acquire_unit waited for the gather.
    const param_type* unit = gatherer_.acquired_data(p.unit);
    require(unit != nullptr, "param_data('", p.name, "'): acquire_unit('", u.name,
            "') first (stage 3 keeps only shards; a prefetched unit may still be being gathered)");
    return unit + p.offset;
  }
}

// ---- Gradients -----------------------------------------------------------------

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
auto ZeroOptimizer<P, O, S, F, B>::grad_buffer(UnitId id) -> grad_type* {
  const comm::ApiCall api_call("grad_buffer");
  require_finalized("grad_buffer");
  require_unit(id, "grad_buffer");
  return reducer_.hand_out(id.index, first_micro(), last_micro());
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::grad_ready(UnitId id) {
  const comm::ApiCall api_call("grad_ready");
  require_finalized("grad_ready");
  require_unit(id, "grad_ready");
  reducer_.ready(id.index, first_micro(), last_micro());
}

// ---- Step ------------------------------------------------------------------------

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
StepResult ZeroOptimizer<P, O, S, F, B>::step() {
  const comm::ApiCall api_call("step");
  require_finalized("step");
  const auto& units = layout_.units();
  reducer_.require_all_ready();
  if constexpr (rules.params_sharded) {
    // The update changes every shard: a gathered copy in use would go stale.
    if (micro_ + 1 == options_.grad_accumulation_steps)
      if (const auto held = gatherer_.any_acquired())
        throw InvalidArgument(detail::concat("step(): unit '", units[*held].name,
                                             "' is still acquired; release_unit() every unit before the step that "
                                             "updates them"));
  }
  reducer_.end_micro_batch(first_micro(), last_micro());
  StepResult result;
  result.loss_scale = control_.scaler().scale();
  if (++micro_ < options_.grad_accumulation_steps) {
    result.accumulating = true;
    return result;
  }
  micro_ = 0;
  comm_.join();   // the step reads the reduced gradients
  land_update();  // delayed update: the previous step's, before this one

  // Stage 1 reduce-scatters the accumulated gradient now, in place.
  reducer_.reduce_at_step();

  if constexpr (host_staging) {
    // The owned gradient goes to the host (stages 2-3 sent each shard as its
    // bucket was reduced; stage 1 sends its pieces now), where the CPU reads
    // it: the step's one wait for the device.
    if constexpr (!rules.reduce_scatter_on_flush)
      for (const auto& u : units) Ops::download_async(update_grad(u), grad_ptr(u), update_size(u));
    const auto waiting = Clock::now();
    Ops::synchronize();
    offload_times_.device_wait_seconds += seconds_since(waiting);
  }
  [[maybe_unused]] const auto norm_pass = Clock::now();
  // Global gradient statistics: squared norm and inf/NaN over the owned range,
  // where the update reads it. One pass where the owned gradient is
  // contiguous (stage 0: all of it; stages 2-3: the shard buffer; offload:
  // its host copy); stage 1's owned pieces are interleaved in the device
  // buffer: one pass per unit, added in unit order on the backend (on a GPU,
  // on the device), and brought to the host once.
  kernels::GradStats stats;
  if constexpr (rules.reduce_scatter_at_step) {
    stats = UpdateOps::grad_stats_pieces(units.size(), [&](std::size_t i) {
      return std::pair<const grad_type*, std::size_t>(update_grad(units[i]), update_size(units[i]));
    });
  } else {
    stats = UpdateOps::grad_stats(update_grad(units.front()), owned_total());
  }
  if constexpr (host_staging) offload_times_.cpu_update_seconds += seconds_since(norm_pass);
  // The hyper-parameters may have changed since the last step (a schedule):
  // validated here, and their fingerprint compared across ranks below.
  std::string invalid_hyper;  // allocates only when there is a message
  typename O::Scalars scalars{};
  try {
    hyper_.validate();
    scalars = O::prepare(hyper_, steps_ + 1);
  } catch (const InvalidArgument& e) {
    invalid_hyper = e.what();
  }
  // One control all-reduce decides: the global norm, overflow (fp16 skips),
  // the ranks' hyper-parameters agreeing (errors on every rank otherwise).
  const auto decision = control_.decide(
      stats.sum_squares, detail::step_report<O>(invalid_hyper.empty() ? &scalars : nullptr, stats.non_finite),
      invalid_hyper, {steps_ + 1, rules.norm_needs_all_reduce(), rules.states_sharded, &options_});
  if (decision.skip) {
    result.skipped_overflow = true;
    return result;
  }
  result.grad_norm = decision.grad_norm;

  ++steps_;
  kernels::FusedStepArgs<O, grad_type, param_type> args;
  args.grad_scale = decision.grad_scale;
  args.scalars = scalars;
  args.rounding = StochasticRounding{options_.stochastic_rounding, options_.seed, static_cast<std::uint64_t>(steps_)};
  if (offloaded && options_.delayed_update && steps_ > options_.delayed_update_warmup) {
    // Step t's update runs in the background; step t+1's shards arrive in
    // the other host gradient set meanwhile.
    pending_args_ = args;
    pending_set_ = host_grad_set_;
    update_pending_ = true;
    worker_.start([](void* self) {
      auto* opt = static_cast<ZeroOptimizer*>(self);
      opt->update_units(opt->pending_args_, false, opt->pending_set_);
    }, this);
    host_grad_set_ ^= 1;
    aim_final_copies();
  } else {
    update_units(args, true, host_grad_set_);
    publish_params();
  }
  result.stepped = true;
  return result;
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::update_units(StepArgs args, bool upload_each, std::size_t host_set) {
  const auto& units = layout_.units();
  [[maybe_unused]] const auto started = Clock::now();
  const simd::ScopedHostThreads update_threads(offloaded ? options_.offload_threads : 0);
  for (const auto& u : units) {
    args.grad = update_grad(u, host_set);
    if constexpr (!separate_master)
      args.master = param_ptr(u);  // fp32: the parameters are the master
    else if constexpr (stage_params)
      args.param = host_params_.data() + state_offset(u);
    else if constexpr (!host_staging)
      args.param = param_ptr(u);  // (fp32 on backend::Host with offload::Nvme: the store copies the master in)
    args.n = update_size(u);
    // Stochastic rounding draws from (seed, step, element id): the id is the
    // unit's index and the position in the unit, which no rank count or stage
    // changes (the padded full offset does), so copies do not depend on N.
    args.global_offset = (static_cast<std::uint64_t>(&u - units.data()) << 40) + update_begin(u);
    store_.update(state_offset(u), args);
    if constexpr (host_staging) {
      updated_master_[static_cast<std::size_t>(&u - units.data())] = args.master;
      // The unit's new parameters go to the device while the CPU updates the
      // next unit. The host buffers are next written after the next step's
      // synchronize(), which this copy precedes.
      if (upload_each) upload_updated(u);
    }
  }
  if constexpr (host_staging) {
    offload_times_.cpu_update_seconds += seconds_since(started);
    ++offload_times_.steps;
  }
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::upload_updated(const UnitInfo& u) {
  if constexpr (host_staging) {
    if constexpr (stage_params)
      Ops::upload_async(param_ptr(u), host_params_.data() + state_offset(u), update_size(u));
    else  // fp32: the device's working copy is the master itself
      Ops::upload_async(param_ptr(u), updated_master_[static_cast<std::size_t>(&u - layout_.units().data())],
                        update_size(u));
  }
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::publish_params() {
  // Stage 3: the shards changed, so every gathered copy is stale (none is in
  // use: step() checked); acquire_unit gathers the updated values.
  if constexpr (rules.params_sharded) gatherer_.drop_all();
  // Stages 1 and 2: every rank needs the full updated parameters again.
  if constexpr (rules.all_gather_after_step) {
    comm_.communicate([&] {
      for (const auto& u : layout_.units()) {
        param_type* full = params_.data() + u.full_offset;
        comm_->all_gather(full + update_begin(u), full, u.shard, dtype_traits<param_type>::dtype, false);
      }
    });
  }
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::land_update() {
  if (!update_pending_) return;
  update_pending_ = false;
  worker_.wait();  // rethrows what the update threw
  for (const auto& u : layout_.units()) upload_updated(u);
  publish_params();
  // The next background update writes the host parameters these copies read.
  Ops::synchronize();
}

}  // namespace zero
