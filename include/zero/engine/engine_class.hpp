// Why: the class detail::Engine, its members and its short calls, apart from
// its long ones (engine_setup.hpp, engine_step.hpp, engine_values.hpp), so
// that each of those files includes this one and none includes another:
// engine.hpp brings them all, and is what the rest of the library and users
// include. What the engine is: engine.hpp.
#pragma once

#include "zero/compiler.hpp"

#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "zero/backend/host.hpp"
#include "zero/comm/communicator.hpp"
#include "zero/engine/detail/comm_channel.hpp"
#include "zero/engine/detail/gradient_reducer.hpp"
#include "zero/engine/held_whole.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/loss_scaler.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/detail/own_memory.hpp"
#include "zero/engine/detail/ownership.hpp"
#include "zero/engine/detail/param_gatherer.hpp"
#include "zero/engine/detail/param_store.hpp"
#include "zero/engine/reports.hpp"
#include "zero/engine/detail/run_rules.hpp"
#include "zero/engine/run_shape.hpp"
#include "zero/engine/stage_rules.hpp"
#include "zero/engine/detail/state_store.hpp"
#include "zero/engine/detail/replica_check.hpp"
#include "zero/engine/detail/step_control.hpp"
#include "zero/engine/detail/update_pipeline.hpp"
#include "zero/error.hpp"
#include "zero/optim/policy.hpp"
#include "zero/policies.hpp"

namespace zero {

namespace checkpoint {
// Saves and loads an engine's state: zero/checkpoint/optimizer_io.hpp (needs
// nlohmann-json and xxHash), included only by programs that checkpoint.
template <class Opt>
struct OptimizerIo;
// The checkpoint layer of one engine: the one caller of the engine's view of
// its state for checkpoints (private to the engine, a friend of it).
template <class Opt>
struct EngineIo;
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
  bool stepped = false;           // the optimizer updated the parameters
  bool skipped_overflow = false;  // fp16: inf/NaN in the gradients; nothing was updated
  bool accumulating = false;      // a micro-batch before the accumulation boundary
  double grad_norm = 0.0;         // global L2 norm of the unscaled, averaged gradient (before clipping)
  double loss_scale = 1.0;        // the scale that was in effect for this step
};

namespace detail {

template <PrecisionPolicy Precision, optim::Policy Optimizer, BackendPolicy Backend>
class Engine {
 public:
  using engine_type = Engine;
  using precision_policy = Precision;
  using optimizer_policy = Optimizer;
  using backend_policy = Backend;
  using param_type = typename Precision::param_type;
  using grad_type = typename Precision::grad_type;
  using Hyper = typename Optimizer::Hyper;
  static constexpr int state_slots = Optimizer::state_slots;
  using DiskMaker = DiskStoreMaker<Optimizer, grad_type, param_type>;

  // The stage and the offload tier are checked here by the rules
  // ZeroOptimizer's static_asserts test (engine/detail/run_rules.hpp); `disk` makes
  // offload nvme's store (null: the program was built without
  // zero/offload/disk_state_store.hpp).
  template <comm::Communicator Comm>
  Engine(Comm& communicator, int stage, OffloadTier offload, Hyper hyper, Options options = {},
         DiskMaker disk = {})
      : comm_(communicator),
        run_(checked(stage, offload, options, disk)),
        disk_(disk),
        hyper_(hyper),
        options_(options),
        layout_(comm_->size()),
        control_(options.loss_scale, Precision::loss_scaling) {
    hyper_.validate();
    options_.validate();
  }

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  // Completes a background save (collective: every rank destroys its
  // optimizer). While an exception unwinds, it only waits for this rank's
  // file, and the checkpoint stays incomplete (no manifest), so the previous
  // one is what a resume finds. A destructor cannot throw: a failure is
  // printed to stderr; call wait_save() first to get it as an exception.
  ~Engine() {
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
  // Your own memory (docs/tutorial.md): parameter p lives for your model at
  // `values` (its numel elements, e.g. one layer's slice of a stacked array)
  // and backward adds its gradient (+=) at `grads`; either may be null.
  // The engine copies the parameters there whenever they change (stage 3:
  // at acquire_unit) and takes the gradient from there when the unit is
  // final (grad_ready, or step()), zeroing it for the next micro-batch.
  void use_memory(ParamId p, param_type* values, grad_type* grads);
  // Collective. Checks that all ranks registered the same layout, then
  // allocates every buffer the run will use (engine_setup.hpp).
  void finalize();

  const Layout& layout() const { return layout_; }
  int rank() const { return comm_->rank(); }
  int ranks() const { return comm_->size(); }
  // What the rules, the buffer sizes and the schedule read of this run
  // (engine/run_shape.hpp); the communicator's overlap is known from finalize().
  const RunShape& shape() const { return run_; }
  int stage() const { return run_.stage.stage; }

  // ---- Values (engine_values.hpp) ----------------------------------------
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
  const param_type* acquire_unit(UnitId id) {
    const comm::ApiCall api_call("acquire_unit");
    require_finalized("acquire_unit");
    require_unit(id, "acquire_unit");
    if (run_.stage.params_whole()) return params_.unit(id.index);
    if (whole_.size() != 0) return whole_.data() + layout_.units()[id.index].full_offset;  // hold_whole(): local
    const param_type* unit = gatherer_.acquire(id.index, reducer_.in_backward());
    if (replicas_.enabled()) record_replica(id.index, unit);
    own_.write_values(layout_, id.index, unit);
    return unit;
  }
  // Stage 3: frees the unit's room in the gather arena. Other stages: nothing.
  void release_unit(UnitId id) {
    require_unit(id, "release_unit");
    if (!run_.stage.params_sharded || whole_.size() != 0) return;
    gatherer_.release(id.index);
    own_.release_values(layout_, id.index);
  }
  // Collective at stage 3: the parameters gathered once into a whole copy
  // that stays until the returned scope ends (docs/tutorial.md, "Evaluation
  // and generation at stage 3"); meanwhile acquire_unit and release_unit are
  // local, so one rank may evaluate or generate alone, and your memory
  // (use_memory) holds every parameter. step() and set_param() refuse to run
  // while the scope lives (an error saying to end it first): they would
  // change parameters the copy holds, and a wait could never end, since the
  // scope ends on this rank's thread. Other stages: the parameters are whole
  // already; nothing.
  [[nodiscard]] HeldWhole hold_whole();
  // Pointer to parameter p inside its unit's parameters (after finalize();
  // stage 3: the unit must be acquired, not merely prefetched).
  const param_type* param_data(ParamId id) const;

  // Where this micro-batch's gradient of unit u goes (padded flat layout,
  // same offsets as the parameters). Options::grad_writes says how backward
  // writes it: overwrite (the default) assigns every element, one unit at a
  // time; accumulate gets a zeroed buffer to add into, for any unit, at any
  // time, as often as needed. Accumulation across micro-batches is the
  // optimizer's job either way. For fp16 the gradient is of the scaled loss
  // (loss * loss_scale()).
  grad_type* grad_buffer(UnitId id) {
    const comm::ApiCall api_call("grad_buffer");
    require_finalized("grad_buffer");
    require_unit(id, "grad_buffer");
    require(!own_.grads_of(id.index), "grad_buffer('", unit_of(id.index).name, "'): this unit's gradient is in your "
            "memory (use_memory); backward adds into that, and grad_ready() takes it");
    return reducer_.hand_out(id.index, first_micro(), last_micro());
  }
  // Collective: unit u's gradient is complete (final for this micro-batch).
  // Stage 2/3 reduce-scatter it with its bucket. With GradWrites::accumulate
  // it is optional: step() makes every unit final.
  void grad_ready(UnitId id) {
    const comm::ApiCall api_call("grad_ready");
    require_finalized("grad_ready");
    require_unit(id, "grad_ready");
    if (own_.grads_of(id.index)) take_own_grads(id.index);
    reducer_.ready(id.index, first_micro(), last_micro());
  }

  // ---- Step --------------------------------------------------------------
  // Collective. Call once per micro-batch; steps every grad_accumulation_steps
  // (stage 3: with no unit acquired). Each step validates hyper() and checks
  // that every rank set the same values.
  StepResult step();

  // Blocks until everything the optimizer enqueued, compute and
  // communication, has finished (before timing a step, say).
  void synchronize() {
    update_.wait();
    comm_.join();
    Ops::synchronize();
  }
  // Options::delayed_update: lands the update still running in the
  // background (waits for it, copies its parameters to the device, and at
  // stages 1-2 all-gathers them: collective). Call it before evaluating the
  // model; gather_*, master_values, set_param and step() call it themselves.
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
  template <class Io = checkpoint::OptimizerIo<Engine>>
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
  template <class Io = checkpoint::OptimizerIo<Engine>>
  auto load(const std::string& path) {
    return checkpoint::Included<Io>::load(*this, path);
  }
  // Collective. Sets every parameter from a Hugging Face safetensors file set
  // (a .safetensors file, a model.safetensors.index.json, or a directory
  // holding either), by name: a missing name, or a shape other than the
  // registered one (or another element count, for a parameter registered
  // flat), is an error on every rank before any parameter changes. The
  // optimizer state and the step counter are left as they are.
  template <class Io = checkpoint::OptimizerIo<Engine>>
  void load_hf(const std::string& path) {
    checkpoint::Included<Io>::load_hf(*this, path);
  }

  // Collective: the mean over the ranks of a value each passes (the loss of
  // its micro-batch, an accuracy), for logging; counted as control traffic.
  double mean_over_ranks(double value);

  double loss_scale() const { return control_.scaler().scale(); }
  // e.g. hyper().lr = schedule(step), the same on every rank (checked at the step)
  Hyper& hyper() { return hyper_; }
  const Hyper& hyper() const { return hyper_; }
  const Options& options() const { return options_; }
  std::int64_t step_count() const { return steps_; }

  MemoryReport memory_report() const { return memory_; }
  // Offload from a device: the split of the steps' time (OffloadTimes).
  OffloadTimes offload_times() const { return update_.times(); }
  void reset_offload_times() { update_.times() = {}; }
  CommReport comm_report() const;
  void reset_comm_counters() {
    comm_->reset_counters_with_splits();
    steps_at_reset_ = steps_;
  }

 private:
  using Ops = backend::Ops<Backend>;
  template <class T>
  using Buffer = typename Ops::template Buffer<T>;

  // ---- The state as the checkpoint layer sees it (engine_values.hpp) -------
  // Out of the user's sight: checkpoint::EngineIo (optimizer_io.hpp) alone
  // calls these, as a friend; save(), load() and load_hf() are the doors.
  template <class>
  friend struct checkpoint::EngineIo;
  // Which elements of each unit this rank owns, and where they sit.
  Ownership ownership() const { return Ownership{run_.stage, static_cast<std::size_t>(rank()), &layout_}; }
  // `count` elements of this rank's owned range of unit `unit`, from element
  // `local` of that range, between the engine and host memory: the
  // parameters (param_type), or a slot of the state store (fp32; the master
  // slot reads and writes the parameters when fp32 keeps no separate master).
  void read_params(std::size_t unit, std::size_t local, std::size_t count, param_type* host);
  void write_params(std::size_t unit, std::size_t local, std::size_t count, const param_type* host);
  void read_state(StateSlot slot, std::size_t unit, std::size_t local, std::size_t count, float* host);
  void write_state(StateSlot slot, std::size_t unit, std::size_t local, std::size_t count, const float* host);
  // Whether the store keeps the fp32 master apart from the parameters.
  bool separate_master() const { return update_.separate_master(); }
  // The master is the bf16 parameters plus remainders (Options::master): a
  // master written through write_state() writes this rank's owned
  // parameters too, which then follow the master and nothing else.
  bool remainder_master() const { return update_.remainder_master(); }
  // A 16-bit parameter copy of an fp32 value, rounded as the step rounds
  // (to nearest even, or half away from zero: Options::round_ties_away).
  param_type rounded_copy(float value) const;
  // Between optimizer steps, with nothing in flight: a background save
  // completed, the delayed update landed, the device idle.
  void settle(const char* what);
  // Stage 3: the first unit acquired (a load must not replace its values).
  std::optional<std::size_t> acquired_unit() const { return gatherer_.any_acquired(); }
  // After a load: the step counter and the loss scaler, then the parameters
  // published (stages 1-2 all-gather them: collective).
  void restore_progress(std::int64_t steps, DynamicLossScaler::State scaler);
  DynamicLossScaler::State loss_scaler_state() const { return control_.scaler().state(); }
  // Collective: every rank's values, rank-major, through a backend buffer
  // (collectives take backend memory), counted as control traffic.
  std::vector<std::uint64_t> all_gather_control(const std::vector<std::uint64_t>& mine);
  // An asynchronous save in flight, completed by wait_save().
  void adopt_background_save(std::unique_ptr<checkpoint::BackgroundSave> save) { background_save_ = std::move(save); }


  // The run's shape from the types and the communicator, refused by the
  // rules known at construction (the others wait for finalize()).
  RunShape checked(int stage, OffloadTier offload, const Options& options, DiskMaker disk) const;
  static constexpr Voice voice{"zero::ZeroOptimizer"};

  const UnitInfo& unit_of(std::size_t index) const { return layout_.units()[index]; }
  // This rank's updated range of unit u's parameters (its shard at stage 3;
  // with Options::param_place = disk, valid until another unit's).
  param_type* param_ptr(const UnitInfo& u) { return params_.updated_range(u, ownership()); }
  // After the parameters changed: stage 3 drops its gathered copies, stages
  // 1-2 all-gather the updated shards (collective).
  void publish_params();
  // Options::check_replicas: unit u's copy (its padded elements at `values`)
  // fingerprinted; at the step, ranks whose fingerprints differ named
  // (engine_step.hpp).
  void record_replica(std::size_t unit, const param_type* values);
  [[noreturn]] void blame_replicas();
  // step(): inf or NaN gradients without loss scaling; blames the last update
  // when the parameters are already non-finite (engine_step.hpp).
  [[noreturn]] void blame_non_finite(const NonFiniteGradients& gradients_error);
  // Your own memory: the unit's gradient into the reducer's buffer for it
  // (added where that sums micro-batches in place).
  void take_own_grads(std::size_t unit);
  // Your own memory, stages 0-2: every viewed parameter after a change.
  void write_own_values();
  // Delayed update: waits for the background update and publishes it.
  void land_update() {
    if (!update_.land()) return;
    publish_params();
    Ops::synchronize();  // the next background update writes the host parameters these copies read
  }

  void require_finalized(const char* what) const {
    require(finalized_, what, ": call finalize() after registering the parameters and before training");
  }
  void require_unit(UnitId u, const char* what) const {
    require(u.index < layout_.units().size(), what, ": unit id ", u.index, " does not exist (",
            layout_.units().size(), " units)");
  }

  // Events of the channel: one per gradient staging set (the reducer's
  // first ones: as many as it may use with overlap), then the gatherer's
  // (one per gather slot).
  std::size_t first_slot_event() const { return staging_set_count(options_, true); }
  bool first_micro() const { return micro_ == 0; }
  bool last_micro() const { return micro_ == options_.grad_accumulation_steps - 1; }
  // Offload at stages 2-3: the reducer copies each finished shard to the
  // host gradient set the next update reads.
  void aim_final_copies() {
    if (run_.stage.reduce_scatter_on_flush && update_.host_staging())
      reducer_.copy_final_shards_to(update_.final_shard_copies());
  }

  // Collective: every unit, padded, into host memory `out`, from each rank's
  // updated range of it (fill(u, dst) writes that range into backend memory).
  template <class T, class Fill>
  void gather_units(T* out, Fill fill);

  // A part's row (engine/detail/part_rows.hpp) as a buffer, for finalize(); an
  // overflowing size or a failed allocation becomes an error naming the
  // buffer, its bytes, this rank and what makes it smaller. Any buffer type:
  // the backend's, the store's, page-locked host buffers.
  template <class Buf>
  Buf allocate_as(const BufferRow& row);
  template <class T>
  Buffer<T> allocate(const BufferRow& row) {
    return allocate_as<Buffer<T>>(row);
  }
  backend::PieceCuts piece_cuts(std::size_t n) const;
  void check_agreement();
  void account_memory();

  CommChannel<Ops> comm_;  // the communicator, and on a GPU the lane its collectives run on
  RunShape run_;
  DiskMaker disk_;
  Hyper hyper_;
  Options options_;
  Layout layout_;
  bool finalized_ = false;

  ParamStore<Ops, param_type> params_;              // whole, or this rank's shards at stage 3
  Buffer<param_type> whole_;                        // stage 3, while hold_whole()'s scope lives
  GradientReducer<Ops, grad_type> reducer_;         // gradients: staging, buckets, reductions, accumulator
  StepControl<Ops> control_;                        // the step's decision: norm, overflow, loss scale, clipping
  ReplicaFingerprints replicas_;                    // Options::check_replicas: this rank's copies since the last step
  std::vector<param_type> replica_host_;            // ... a unit's copy brought to the host, where it is not there
  ParamGatherer<Ops, param_type> gatherer_;         // stage 3: where gathered units live
  UpdatePipeline<Precision, Optimizer, Backend> update_;  // the tier's store, host staging, delayed update
  OwnMemory<Ops, param_type, grad_type, !Backend::device> own_;  // parameters in your memory (use_memory)

  int micro_ = 0;  // micro-batch index within the accumulation window
  std::int64_t steps_ = 0;
  std::int64_t steps_at_reset_ = 0;
  MemoryReport memory_{};
  std::unique_ptr<checkpoint::BackgroundSave> background_save_;  // an asynchronous save in flight
  int unwinding_at_start_ = std::uncaught_exceptions();          // exceptions in flight when constructed
};

}  // namespace detail
}  // namespace zero
