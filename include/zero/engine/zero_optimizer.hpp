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
// order.
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
#include "zero/engine/layout.hpp"
#include "zero/engine/loss_scaler.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/rank_checks.hpp"
#include "zero/engine/reports.hpp"
#include "zero/engine/stage_plan.hpp"
#include "zero/engine/state_store.hpp"
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

namespace detail {
// Host memory for the step's control values: page-locked where the backend
// has such memory (a copy from it need not wait), else plain host memory.
template <class Ops>
struct ControlHostBuffer {
  using type = backend::HostBuffer<double>;
};
template <class Ops>
  requires requires(double* d, const double* s, std::size_t n) {
    typename Ops::template PinnedBuffer<double>;
    Ops::upload_async(d, s, n);
  }
struct ControlHostBuffer<Ops> {
  using type = typename Ops::template PinnedBuffer<double>;
  static constexpr bool async = true;
};
}  // namespace detail

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
      : comm_(comm::AnyCommunicator::wrap(communicator)),
        hyper_(hyper),
        options_(options),
        layout_(comm_->size()),
        scaler_(options.loss_scale, Precision::loss_scaling) {
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
    overlap_.join();
    Ops::synchronize();
  }
  // Options::delayed_update: lands the update still running in the
  // background (waits for it, copies its parameters to the device, and at
  // stages 1-2 all-gathers them: collective). Call it before evaluating the
  // model; gather_*, master_values, set_param and step() call it themselves.
  // Without a pending update it does nothing.
  void wait_update() {
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

  double loss_scale() const { return scaler_.scale(); }
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
      return grads_.data() + u.shard_offset;
    else
      return grads_.data() + u.full_offset + update_begin(u);
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

  // Runs f with the communicator's stream current, ordered after the compute
  // work so far; the compute stream then waits for it (f's results are read next).
  template <class F>
  void communicate(F&& f) {
    {
      auto lane = comm_lane();
      f();
    }
    overlap_.join();
  }
  // The communication lane (Ops::Overlap), after checking that the
  // communicator still enqueues where it did at finalize().
  [[nodiscard]] typename Ops::Overlap::Lane comm_lane() {
    require(comm_->stream_handle() == comm_stream_,
            "ZeroOptimizer: the communicator's stream changed after finalize() (was the communicator reassigned?); "
            "keep the communicator the optimizer was built with alive and unchanged while the optimizer is used");
    return overlap_.lane();
  }
  // Events of Ops::Overlap: one per gradient staging set, one per gather slot
  // (a unit the arena holds).
  static constexpr std::size_t staging_event(std::size_t set) { return set; }
  static constexpr std::size_t slot_event(std::size_t slot) { return 2 + slot; }
  // With overlap, two staging sets: the caller writes one bucket while the
  // previous one is reduced.
  std::size_t staging_sets() const { return overlap_.active() ? 2 : 1; }
  // Where unit u's gradient is staged in the current set (its bucket's units
  // lie back to back; a set holds the largest bucket), and its shard's
  // reduce-scatter result.
  std::size_t staging_offset(std::size_t u) const {
    return set_ * buckets_.max_elements + buckets_.offset[u];
  }
  std::size_t shard_staging_offset(std::size_t u) const {
    return set_ * buckets_.max_shard_elements + buckets_.shard_offset[u];
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
  void zero_gaps(const UnitInfo& u, grad_type* staging);
  // Stages 0 and 1 without accumulation take the caller's gradient straight
  // into the full gradient buffer (no staging, no copy).
  bool takes_gradients_in_place() const { return gradients_in_place(rules, options_); }
  // Launches the reductions of every pending gradient (see grad_ready).
  void flush_gradients();
  // The ranks' reports after the step's control all-reduce (rank_checks.hpp).
  detail::StepReports step_reports() const {
    return {rank(), ranks(), steps_ + 1, control_host_.data() + 1, Precision::loss_scaling, rules.states_sharded};
  }
  // Stage 3: gathers `unit` into a free slot of the arena and returns the
  // slot, or -1 when no slot or no room is free. may_evict: make room by
  // dropping prefetched units no one acquired (acquire_unit; a prefetch
  // only uses room that is free).
  int gather_into_slot(std::size_t unit, bool may_evict);
  // Where in the gather arena a unit of n elements fits now, or npos.
  std::size_t arena_place(std::size_t n) const;
  int find_slot(std::size_t unit) const;
  void prefetch_after(std::size_t unit);

  std::unique_ptr<comm::AnyCommunicator> comm_;
  Hyper hyper_;
  Options options_;
  Layout layout_;
  DynamicLossScaler scaler_;
  bool finalized_ = false;

  // Model state (see memory_report for which are whole and which are shards).
  Buffer<param_type> params_;
  Buffer<grad_type> grads_;
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
  // Communication buffers, each set holding the largest gradient bucket.
  Buffer<grad_type> grad_staging_;          // where the caller writes a unit's gradient
  Buffer<float> reduce_staging_fp32_;       // a bucket widened to fp32, when reducing 16-bit gradients in fp32
  Buffer<grad_type> shard_staging_;         // a bucket's reduce-scatter results before accumulation
  GradientBuckets buckets_;                 // units whose reductions are launched together (buffer_sizes.hpp)
  std::size_t set_ = 0;                     // the staging set the current bucket uses
  typename Ops::Overlap overlap_;
  void* comm_stream_ = nullptr;             // the communicator's stream at finalize()
  struct Pending {
    std::size_t unit;
    grad_type* written;  // where the caller wrote the gradient
  };
  std::vector<Pending> pending_;            // gradients ready but not yet reduced, all of one bucket (capacity reserved)
  grad_type* handed_ = nullptr;             // the buffer grad_buffer() handed out
  Buffer<param_type> gather_slots_;         // stage 3: the arena the gathered units share
  // The step's control all-reduce, in backend memory and its host copy: the
  // squared norm, then one report per rank (see detail::step_report).
  Buffer<double> control_;
  typename detail::ControlHostBuffer<Ops>::type control_host_;
  std::vector<std::size_t> slot_unit_;      // unit held by each slot, or npos
  std::vector<std::size_t> slot_offset_;    // where the slot's unit lies in the arena
  std::vector<bool> slot_in_use_;           // acquired and not yet released
  int staging_unit_ = -1;                   // unit whose gradient buffer is handed out

  int micro_ = 0;             // micro-batch index within the accumulation window
  bool backward_phase_ = false;
  std::vector<bool> reduced_this_micro_;  // grad_ready seen for each unit in this micro-batch
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

  static constexpr std::size_t npos = static_cast<std::size_t>(-1);
};

// ============================================================================

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::finalize() {
  require(!finalized_, "ZeroOptimizer::finalize() called twice");
  layout_.finalize(sizeof(float));  // fp32 masters, states and reduction staging are the widest
  const std::size_t gather_slots = rules.params_sharded ? static_cast<std::size_t>(options_.prefetch_units) + 1 : 0;
  comm_stream_ = comm_->stream_handle();
  overlap_ = typename Ops::Overlap(comm_stream_, slot_event(gather_slots));
  check_agreement();
  // Sizes from the rule the planner shares (engine/buffer_sizes.hpp).
  const BufferSizes sizes = buffer_sizes(
      layout_, BufferSpec{rules, separate_master, sizeof(grad_type), state_slots, overlap_.active()}, options_);

  // What makes each buffer smaller, for the out-of-memory message.
  constexpr const char* shard_params = "stage 3 shards the parameters: use stage<3> or more ranks";
  constexpr const char* shard_grads = "stages 2 and 3 shard the gradients: use stage<2> or higher, or more ranks";
  constexpr const char* shard_states =
      "stages 1-3 shard the master weights and optimizer state: use stage<1> or higher, or more ranks";
  constexpr const char* fewer_units = "lower Options::bucket_bytes (a bucket holds at least one unit), or split "
                                      "the largest unit";
  params_ = allocate<param_type>(sizes.params, "parameters", rules.params_sharded ? "more ranks" : shard_params);
  grads_ = allocate<grad_type>(sizes.grads, "gradients", rules.grads_sharded ? "more ranks" : shard_grads);
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
  buckets_ = sizes.buckets;
  grad_staging_ = allocate<grad_type>(sizes.grad_staging, "gradient staging (one bucket)", fewer_units);
  reduce_staging_fp32_ = allocate<float>(sizes.reduce_staging_fp32, "fp32 reduction staging",
                                         "Options::reduce_dtype = ReduceDType::same_as_grad needs none; or " +
                                             std::string(fewer_units));
  shard_staging_ = allocate<grad_type>(sizes.shard_staging, "reduce-scatter staging", fewer_units);
  pending_.reserve(buckets_.max_units);
  if constexpr (rules.params_sharded) {
    gather_slots_ = allocate<param_type>(sizes.gather_slots, "stage-3 gather arena",
                                         "lower Options::prefetch_units (the arena holds the prefetch_units + 1 "
                                         "largest units), or split the largest units");
    slot_unit_.assign(sizes.gather_slot_count, npos);
    slot_offset_.assign(sizes.gather_slot_count, 0);
    slot_in_use_.assign(sizes.gather_slot_count, false);
  }
  control_ = Buffer<double>(sizes.control);
  control_host_ = typename detail::ControlHostBuffer<Ops>::type(sizes.control);
  reduced_this_micro_.assign(layout_.units().size(), false);
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
  communicate([&] {
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
  const std::string differ = describe_disagreement(settings, all_gather_control(mine), ranks());
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
  m.placed.grads = in_backend(grads_.bytes());
  m.placed.grads.host += host_grads_.bytes();
  m.placed.master = store_.master_bytes();
  m.placed.optimizer_states = store_.state_bytes();
  m.placed.communication_buffers =
      in_backend(grad_staging_.bytes() + reduce_staging_fp32_.bytes() + shard_staging_.bytes() + gather_slots_.bytes());
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
  require_finalized("set_param");
  land_update();
  require(id.index < layout_.params().size(), "set_param: parameter id ", id.index, " does not exist");
  const ParamInfo& p = layout_.param(id);
  const UnitInfo& u = layout_.units()[p.unit];
  if constexpr (rules.params_sharded) {
    // A gathered copy of the unit would keep the old values: a prefetched one
    // is dropped below; one in use cannot be.
    const int slot = find_slot(p.unit);
    require(slot < 0 || !slot_in_use_[static_cast<std::size_t>(slot)], "set_param('", p.name, "'): unit '", u.name,
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
  if constexpr (rules.params_sharded) {
    const int slot = find_slot(p.unit);
    if (slot >= 0) slot_unit_[static_cast<std::size_t>(slot)] = npos;
  }
  overlap_.join();  // communication in flight may still read the parameters
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
  communicate([&] {
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
  std::vector<float> all(layout_.padded_total());
  gather_masters(all.data());
  const ParamInfo& p = layout_.param(id);
  const std::size_t start = layout_.units()[p.unit].full_offset + p.offset;
  return std::vector<float>(all.begin() + static_cast<std::ptrdiff_t>(start),
                            all.begin() + static_cast<std::ptrdiff_t>(start + p.numel));
}

// ---- Stage 3 gather arena ----------------------------------------------------

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
int ZeroOptimizer<P, O, S, F, B>::find_slot(std::size_t unit) const {
  for (std::size_t s = 0; s < slot_unit_.size(); ++s)
    if (slot_unit_[s] == unit) return static_cast<int>(s);
  return -1;
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
std::size_t ZeroOptimizer<P, O, S, F, B>::arena_place(std::size_t n) const {
  // The held units' ranges, sorted (at most prefetch_units + 1 <= 17: no allocation).
  std::array<std::pair<std::size_t, std::size_t>, 17> held{};
  std::size_t count = 0;
  for (std::size_t s = 0; s < slot_unit_.size(); ++s)
    if (slot_unit_[s] != npos) held[count++] = {slot_offset_[s], slot_offset_[s] + layout_.units()[slot_unit_[s]].padded};
  std::sort(held.begin(), held.begin() + static_cast<std::ptrdiff_t>(count));
  // A unit goes against an end of the arena where it can: then two units
  // always fit (each sits at an end, leaving the rest to the other, and the
  // arena holds the two largest). Otherwise into the smallest gap it fits.
  const std::size_t capacity = gather_slots_.size();
  std::size_t best = npos, best_gap = npos;
  for (std::size_t i = 0; i <= count; ++i) {
    const std::size_t begin = i == 0 ? 0 : held[i - 1].second, end = i == count ? capacity : held[i].first;
    if (end - begin < n) continue;
    if (begin == 0) return 0;
    if (end == capacity) return end - n;
    if (end - begin < best_gap) {
      best = begin;
      best_gap = end - begin;
    }
  }
  return best;
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
int ZeroOptimizer<P, O, S, F, B>::gather_into_slot(std::size_t unit, bool may_evict) {
  const UnitInfo& u = layout_.units()[unit];
  auto free_slot = [&] { return find_slot(npos); };
  std::size_t offset = free_slot() >= 0 ? arena_place(u.padded) : npos;
  if (offset == npos && may_evict) {
    // Prefetched units no one acquired make room (gathered again when
    // acquired); a gather still in flight into their range is ordered before
    // the one below on the communication lane.
    for (std::size_t s = 0; s < slot_unit_.size(); ++s)
      if (!slot_in_use_[s]) slot_unit_[s] = npos;
    offset = arena_place(u.padded);
  }
  const int slot = free_slot();
  if (slot < 0 || offset == npos) return -1;
  const std::size_t si = static_cast<std::size_t>(slot);
  param_type* dst = gather_slots_.data() + offset;
  // In place: this rank's shard goes to its position, then the gather fills the rest.
  param_type* mine = dst + static_cast<std::size_t>(rank()) * u.shard;
  {
    // On the communication stream; acquire_unit waits for the slot's event.
    auto lane = comm_lane();
    Ops::copy(mine, params_.data() + u.shard_offset, u.shard);
    comm_->all_gather(mine, dst, u.shard, dtype_traits<param_type>::dtype, false);
    overlap_.mark(slot_event(si));
  }
  slot_unit_[si] = unit;
  slot_offset_[si] = offset;
  return slot;
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::prefetch_after(std::size_t unit) {
  // Forward walks units upwards, backward downwards; gather the next ones
  // while slots are free (on a GPU this overlaps with the current unit).
  const long n_units = static_cast<long>(layout_.units().size());
  const long dir = backward_phase_ ? -1 : 1;
  for (int k = 1; k <= options_.prefetch_units; ++k) {
    const long next = static_cast<long>(unit) + dir * k;
    if (next < 0 || next >= n_units) break;
    if (find_slot(static_cast<std::size_t>(next)) >= 0) continue;
    if (gather_into_slot(static_cast<std::size_t>(next), false) < 0) break;
  }
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
auto ZeroOptimizer<P, O, S, F, B>::acquire_unit(UnitId id) -> const param_type* {
  require_finalized("acquire_unit");
  require_unit(id, "acquire_unit");
  const UnitInfo& u = layout_.units()[id.index];
  if constexpr (rules.params_whole()) {
    return params_.data() + u.full_offset;
  } else {
    int slot = find_slot(id.index);
    if (slot < 0) slot = gather_into_slot(id.index, true);
    if (slot < 0) {  // (a branch, not require(): the message lists the acquired units)
      std::string held;
      for (std::size_t s = 0; s < slot_unit_.size(); ++s)
        if (slot_in_use_[s]) held += (held.empty() ? "'" : ", '") + layout_.units()[slot_unit_[s]].name + "'";
      throw InvalidArgument(detail::concat(
          "acquire_unit('", u.name, "'): the stage-3 gather arena (room for the ", slot_unit_.size(),
          " largest units, Options::prefetch_units + 1) is taken by the acquired unit(s) ", held,
          "; release_unit() the units you are done with, or raise Options::prefetch_units"));
    }
    slot_in_use_[static_cast<std::size_t>(slot)] = true;
    prefetch_after(id.index);  // gathered while the caller computes with this unit
    overlap_.wait(slot_event(static_cast<std::size_t>(slot)));
    return gather_slots_.data() + slot_offset_[static_cast<std::size_t>(slot)];
  }
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::release_unit(UnitId id) {
  require_unit(id, "release_unit");
  if constexpr (rules.params_sharded) {
    const int slot = find_slot(id.index);
    require(slot >= 0 && slot_in_use_[static_cast<std::size_t>(slot)], "release_unit('",
            layout_.units()[id.index].name, "'): the unit is not acquired");
    // Freed at once: only shards stay resident.
    slot_unit_[static_cast<std::size_t>(slot)] = npos;
    slot_in_use_[static_cast<std::size_t>(slot)] = false;
  }
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
    const int slot = find_slot(p.unit);
    require(slot >= 0 && slot_in_use_[static_cast<std::size_t>(slot)], "param_data('", p.name, "'): acquire_unit('",
            u.name, "') first (stage 3 keeps only shards; a prefetched unit may still be being gathered)");
    return gather_slots_.data() + slot_offset_[static_cast<std::size_t>(slot)] + p.offset;
  }
}

// ---- Gradients -----------------------------------------------------------------

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
auto ZeroOptimizer<P, O, S, F, B>::grad_buffer(UnitId id) -> grad_type* {
  require_finalized("grad_buffer");
  require_unit(id, "grad_buffer");
  // (a branch, not require(): the message names the unit handed out, which
  // exists only when the check fails)
  if (staging_unit_ >= 0 && staging_unit_ != static_cast<int>(id.index))
    throw InvalidArgument(detail::concat(
        "grad_buffer('", layout_.units()[id.index].name, "'): the gradient of unit '",
        layout_.units()[static_cast<std::size_t>(staging_unit_)].name,
        "' was handed out but grad_ready() was not called for it; finish one unit's backward before the next"));
  if (staging_unit_ < 0) {  // not handed out yet (grad_buffer may be called again for the same unit)
    const UnitInfo& u = layout_.units()[id.index];
    // A unit of another bucket (backward out of the usual order): the pending
    // part of the current bucket is reduced first.
    if (!pending_.empty() && buckets_.bucket_of[pending_.front().unit] != buckets_.bucket_of[id.index])
      flush_gradients();
    if (takes_gradients_in_place()) {
      handed_ = grads_.data() + u.full_offset;
    } else {
      // A new bucket reuses a staging set: its previous bucket must be reduced.
      if (pending_.empty()) overlap_.wait(staging_event(set_));
      handed_ = grad_staging_.data() + staging_offset(id.index);
    }
    staging_unit_ = static_cast<int>(id.index);
  }
  return handed_;
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::zero_gaps(const UnitInfo& u, grad_type* staging) {
  for (const auto& [b, e] : u.gaps) Ops::zero(staging + b, e - b);
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::grad_ready(UnitId id) {
  require_finalized("grad_ready");
  require_unit(id, "grad_ready");
  require(staging_unit_ == static_cast<int>(id.index), "grad_ready('", layout_.units()[id.index].name,
          "'): call grad_buffer() for this unit and write its gradient first");
  require(!reduced_this_micro_[id.index], "grad_ready('", layout_.units()[id.index].name,
          "') twice in one micro-batch; call step() after each micro-batch");
  const UnitInfo& u = layout_.units()[id.index];
  zero_gaps(u, handed_);
  pending_.push_back(Pending{id.index, handed_});
  // A complete bucket is reduced now (while the caller's backward goes on, on
  // a GPU); the last one when step() is called.
  if (pending_.size() == buckets_.of(id.index).units) flush_gradients();
  reduced_this_micro_[id.index] = true;
  staging_unit_ = -1;
  backward_phase_ = true;
}

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
void ZeroOptimizer<P, O, S, F, B>::flush_gradients() {
  if (pending_.empty()) return;
  const bool first = micro_ == 0;
  const bool last = micro_ == options_.grad_accumulation_steps - 1;
  constexpr DType gdt = dtype_traits<grad_type>::dtype;
  const bool in_fp32 = reduce_staging_fp32_.size() != 0;
  auto wide = [&](const Pending& p) { return reduce_staging_fp32_.data() + staging_offset(p.unit); };
  // All of it on the communication stream (no-op without overlap), after the
  // backward that wrote these gradients; the caller's backward of the next
  // units goes on meanwhile.
  auto lane = comm_lane();
  // Three phases, so that a communicator may launch the bucket's collectives
  // as one group: what they read is prepared first, what reads their results
  // runs after.
  if constexpr (!rules.reduce_scatter_on_flush) {
    // Keep the whole gradient; stage 0 all-reduces it on the last micro-batch.
    const bool all_reduce = rules.all_reduce_on_flush && last;
    for (const Pending& p : pending_) {
      const UnitInfo& u = layout_.units()[p.unit];
      grad_type* acc = grads_.data() + u.full_offset;
      if (p.written != acc) Ops::accumulate(acc, p.written, u.padded, first);
      if (all_reduce && in_fp32) Ops::convert(wide(p), acc, u.padded);
    }
    if (all_reduce) {
      comm_->group_begin();
      for (const Pending& p : pending_) {
        const UnitInfo& u = layout_.units()[p.unit];
        if (in_fp32)
          comm_->all_reduce(wide(p), u.padded, DType::f32, comm::ReduceOp::sum, false);
        else
          comm_->all_reduce(grads_.data() + u.full_offset, u.padded, gdt, comm::ReduceOp::sum, false);
      }
      comm_->group_end();
      if (in_fp32)
        for (const Pending& p : pending_) {
          const UnitInfo& u = layout_.units()[p.unit];
          Ops::convert(grads_.data() + u.full_offset, wide(p), u.padded);
        }
    }
  } else {
    // Stages 2 and 3: reduce-scatter, keep only this rank's shard.
    const std::size_t r = static_cast<std::size_t>(rank());
    if (in_fp32)
      for (const Pending& p : pending_) Ops::convert(wide(p), p.written, layout_.units()[p.unit].padded);
    comm_->group_begin();
    for (const Pending& p : pending_) {
      const UnitInfo& u = layout_.units()[p.unit];
      if (in_fp32)
        comm_->reduce_scatter(wide(p), wide(p) + r * u.shard, u.shard, DType::f32);
      else
        comm_->reduce_scatter(p.written, shard_staging_.data() + shard_staging_offset(p.unit), u.shard, gdt);
    }
    comm_->group_end();
    for (const Pending& p : pending_) {
      const UnitInfo& u = layout_.units()[p.unit];
      grad_type* acc = grads_.data() + u.shard_offset;
      if (in_fp32)
        Ops::accumulate(acc, wide(p) + r * u.shard, u.shard, first);
      else
        Ops::accumulate(acc, shard_staging_.data() + shard_staging_offset(p.unit), u.shard, first);
      // Offload: the finished shard leaves for the host while backward goes on.
      if constexpr (host_staging)
        if (last) Ops::download_async(update_grad(u), acc, u.shard);
    }
  }
  overlap_.mark(staging_event(set_));
  set_ = (set_ + 1) % staging_sets();
  pending_.clear();
}

// ---- Step ------------------------------------------------------------------------

template <PrecisionPolicy P, optim::Policy O, StagePolicy S, OffloadPolicy F, BackendPolicy B>
StepResult ZeroOptimizer<P, O, S, F, B>::step() {
  require_finalized("step");
  const auto& units = layout_.units();
  for (std::size_t i = 0; i < units.size(); ++i)
    require(reduced_this_micro_[i], "step(): unit '", units[i].name,
            "' has no gradient in this micro-batch; call grad_buffer()/grad_ready() for every unit before step()");
  if constexpr (rules.params_sharded) {
    // The update changes every shard: a gathered copy in use would go stale.
    if (micro_ + 1 == options_.grad_accumulation_steps)
      for (std::size_t s = 0; s < slot_unit_.size(); ++s)
        if (slot_in_use_[s])  // (slot_unit_[s] names a unit only when the slot is in use)
          throw InvalidArgument(detail::concat("step(): unit '", units[slot_unit_[s]].name,
                                               "' is still acquired; release_unit() every unit before the step that "
                                               "updates them"));
  }
  flush_gradients();
  std::fill(reduced_this_micro_.begin(), reduced_this_micro_.end(), false);
  backward_phase_ = false;
  StepResult result;
  result.loss_scale = scaler_.scale();
  if (++micro_ < options_.grad_accumulation_steps) {
    result.accumulating = true;
    return result;
  }
  micro_ = 0;
  overlap_.join();  // the step reads the reduced gradients
  land_update();    // delayed update: the previous step's, before this one

  // Stage 1 reduce-scatters the accumulated gradient now, in place.
  if constexpr (rules.reduce_scatter_at_step) {
    constexpr DType gdt = dtype_traits<grad_type>::dtype;
    communicate([&] {
      for (const auto& u : units) {
        grad_type* g = grads_.data() + u.full_offset;
        grad_type* mine = g + static_cast<std::size_t>(rank()) * u.shard;
        if (reduce_staging_fp32_.size() != 0) {
          float* wide = reduce_staging_fp32_.data();
          Ops::convert(wide, g, u.padded);
          float* wmine = wide + static_cast<std::size_t>(rank()) * u.shard;
          comm_->reduce_scatter(wide, wmine, u.shard, DType::f32);
          Ops::convert(mine, wmine, u.shard);
        } else {
          comm_->reduce_scatter(g, mine, u.shard, gdt);
        }
      }
    });
  }

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
  // One control all-reduce (summed): stages 1-3 add the owned shards' squared
  // norms in slot 0 (stage 0 computed its norm from the whole reduced
  // gradient); slot 1 + r carries rank r's report, the other ranks add 0.
  double* control = control_host_.data();
  const std::size_t control_size = control_host_.size();
  std::fill(control, control + control_size, 0.0);
  if constexpr (rules.norm_needs_all_reduce()) control[0] = stats.sum_squares;
  control[1 + static_cast<std::size_t>(rank())] =
      static_cast<double>(detail::step_report<O>(invalid_hyper.empty() ? &scalars : nullptr, stats.non_finite));
  // Up from page-locked memory without a host wait where the backend can (the
  // statistics above were the step's one wait before the all-reduce); the
  // all-reduce's lane starts after the copy, and the download waits for both.
  if constexpr (requires { detail::ControlHostBuffer<Ops>::async; })
    Ops::upload_async(control_.data(), control, control_size);
  else
    Ops::upload(control_.data(), control, control_size);
  communicate([&] {
    comm_->all_reduce(control_.data(), control_size, DType::f64, comm::ReduceOp::sum, true);
    Ops::download(control, control_.data(), control_size);
  });
  if constexpr (rules.norm_needs_all_reduce()) stats.sum_squares = control[0];
  const detail::StepReports reports = step_reports();
  bool overflow = false;
  for (int r = 0; r < ranks(); ++r)
    overflow = overflow || (reports.report(r) & detail::report_non_finite) != 0;
  detail::check_step_reports(reports, invalid_hyper, overflow);
  const double scale = scaler_.scale();
  if (scaler_.update(overflow)) {
    result.skipped_overflow = true;
    return result;
  }

  const double divisor = options_.gradient_divisor > 0
                             ? options_.gradient_divisor
                             : static_cast<double>(ranks()) * static_cast<double>(options_.grad_accumulation_steps);
  const double unscale = 1.0 / (scale * divisor);
  result.grad_norm = std::sqrt(stats.sum_squares) * unscale;
  double clip = 1.0;
  if (options_.clip_norm > 0 && result.grad_norm > 0)
    clip = std::min(1.0, options_.clip_norm / (result.grad_norm + 1e-6));  // as torch.nn.utils.clip_grad_norm_

  ++steps_;
  kernels::FusedStepArgs<O, grad_type, param_type> args;
  args.grad_scale = static_cast<float>(unscale * clip);
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
  if constexpr (rules.params_sharded) std::fill(slot_unit_.begin(), slot_unit_.end(), npos);
  // Stages 1 and 2: every rank needs the full updated parameters again.
  if constexpr (rules.all_gather_after_step) {
    communicate([&] {
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
