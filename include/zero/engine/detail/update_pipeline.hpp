// Why: after the step's decision, the update itself depends only on where
// the fp32 master and optimizer state live (the offload tier), not on the
// stage: with the backend (offload none: the backend's fused step), in host
// memory (cpu: the host fused step on this rank's owned gradient, copied to
// the host), or on disk behind a window (nvme). This part owns that: the
// tier's state store (one interface, AnyStateStore, for all three), the host
// copies of the owned gradient and of the updated 16-bit parameters, the
// copies between host and device, and the delayed update of ZeRO-Offload
// (step t's update in the background while step t+1's gradients arrive in
// the other host gradient set). It issues no collective: publishing the
// updated parameters (stages 1-2 all-gather them) is the engine's.
//
// Contract: configure() then allocate() at finalize(); per step,
// gradients_to_host(), grad_stats(), then update() (true: the parameters
// are updated now; false: in the background until land()).
#pragma once

#include "zero/compiler.hpp"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "zero/backend/host.hpp"
#include "zero/backend/ops.hpp"
#include "zero/engine/detail/part_rows.hpp"
#include "zero/engine/detail/buffer_sizes.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/detail/ownership.hpp"
#include "zero/engine/detail/param_store.hpp"
#include "zero/engine/detail/shard_pages.hpp"
#include "zero/engine/reports.hpp"
#include "zero/engine/run_shape.hpp"
#include "zero/engine/detail/state_store.hpp"
#include "zero/engine/detail/update_worker.hpp"
#include "zero/error.hpp"
#include "zero/kernels/fused_step.hpp"
#include "zero/optim/policy.hpp"
#include "zero/policies.hpp"
#include "zero/simd/dispatch.hpp"

namespace zero::detail {

// The update's host buffers when it is offloaded from a device
// (engine/detail/part_rows.hpp), sized by buffer_sizes(): the owned gradient's
// host copies the CPU update reads, and the parameters it writes before
// they are copied to the device.
struct UpdateRows {
  BufferRow host_grads, host_params;
  BufferRows list() const { return {host_grads, host_params}; }
};
inline UpdateRows update_rows(const RunShape& run, const BufferSizes& z) {
  const std::string smaller = smaller_owned(run);
  UpdateRows r;
  r.host_grads = {z.host_grad_sets == 2 ? "host copies of the owned gradient (two: delayed update)"
                                        : "host copy of the owned gradient",
                  "grads", ReportedAs::grads, Place::host, z.host_grads, run.element_bytes(), smaller};
  r.host_params = {"host staging of the parameters", "param_staging", ReportedAs::communication_buffers, Place::host,
                   z.host_params, run.element_bytes(), smaller};
  return r;
}

template <PrecisionPolicy Precision, optim::Policy Optimizer, BackendPolicy Backend>
class UpdatePipeline {
 public:
  using Ops = backend::Ops<Backend>;
  using HostOps = backend::Ops<backend::Host>;
  using param_type = typename Precision::param_type;
  using grad_type = typename Precision::grad_type;
  using StepArgs = kernels::FusedStepArgs<Optimizer, grad_type, param_type>;
  using Store = AnyStateStore<Optimizer, grad_type, param_type>;
  template <class T>
  using Buffer = typename Ops::template Buffer<T>;
  // Whether the backend can offload: page-locked host buffers and
  // asynchronous copies (backend/ops.hpp); the engine refuses offload from
  // a device backend without them.
  static constexpr bool can_offload = backend::OffloadOps<Ops>;
  // Host staging of an offloaded update from a device (page-locked).
  template <class T>
  using Pinned = typename std::conditional_t<can_offload, Ops, HostOps>::template PinnedBuffer<T>;

  // What the tier implies (before allocate()): the run shape's rules
  // (engine/run_shape.hpp), so the planner and the engine read the same ones.
  void configure(const RunShape& run, const Options& options) {
    tier_ = run.offload;
    offloaded_ = run.offloaded();
    host_staging_ = can_offload && run.offload_host_staging();
    stage_params_ = host_staging_ && run.offload_stages_params();
    separate_master_ = run.separate_master();
    master_format_ = separate_master_ ? options.master : MasterWeights::fp32;
    ties_away_ = options.copies_round_ties_away();
    delayed_ = options.delayed_update;
    delayed_warmup_ = options.delayed_update_warmup;
    threads_ = offloaded_ ? options.offload_threads : 0;
  }
  // The update runs on the host beside the backend's memory (ZeRO-Offload).
  bool offloaded() const { return offloaded_; }
  // Offloaded from device memory: the owned gradient is copied to the host
  // for the CPU update and the 16-bit parameters staged back (backend::Host
  // with offload nvme updates straight from and into its own buffers).
  bool host_staging() const { return host_staging_; }
  // fp32 training: the parameters are their own master weights, unless the
  // master moves to the host and the device keeps a working copy.
  bool separate_master() const { return separate_master_; }

  // The store and host buffers, by their rows (state_rows, update_rows).
  // `allocate(std::type_identity<Buf>{}, row)` is the engine's allocator (an
  // error naming the buffer on failure); `disk` makes the nvme tier's store.
  template <class Allocate>
  void allocate(const Ownership& own, const StateRows& state, const UpdateRows& host, ParamStore<Ops, param_type>& params,
                grad_type* grads, const Options& options, int rank,
                DiskStoreMaker<Optimizer, grad_type, param_type> disk, Allocate&& allocate) {
    own_ = own;
    params_ = &params;
    grads_ = grads;
    const std::size_t owned = own.owned_total();
    auto array_store = [&]<class S>(std::type_identity<S>) {
      auto model = std::make_unique<StoreModel<S, Optimizer, grad_type, param_type>>();
      model->store.allocate(owned, master_format_, options.states, state, allocate);
      store_ = std::move(model);
    };
    switch (tier_) {
      case OffloadTier::none:
        array_store(std::type_identity<ArrayStateStore<Optimizer, Ops, Buffer, Backend::device>>{});
        break;
      case OffloadTier::cpu:
        if constexpr (Backend::device && can_offload)  // (refused otherwise when the engine was made)
          array_store(std::type_identity<ArrayStateStore<Optimizer, HostOps, Pinned, false>>{});
        break;
      case OffloadTier::nvme: store_ = disk.state(options, rank, owned, state.blocks); break;
    }
    if (!host_staging_) return;
    host_grads_ = allocate(std::type_identity<Pinned<grad_type>>{}, host.host_grads);
    updated_master_.assign(own.layout->units().size(), nullptr);
    if (stage_params_) host_params_ = allocate(std::type_identity<Pinned<param_type>>{}, host.host_params);
  }

  Store& store() { return *store_; }
  const Store& store() const { return *store_; }
  // Options::param_place = disk: the owned gradient's shards are in the
  // reducer's pages, read one unit at a time (GradientReducer::bind_pages).
  void read_grads_from(ShardPages<grad_type>* pages) { grad_pages_ = pages; }

  // Where the update reads unit u's owned gradient: the accumulator, or its
  // host copy (in host gradient set `set`) when offloaded from a device.
  grad_type* update_grad(const UnitInfo& u) { return update_grad(u, host_grad_set_); }
  grad_type* update_grad(const UnitInfo& u, std::size_t set) {
    if (host_staging_) return host_grads_.data() + set * own_.owned_total() + own_.state_offset(u);
    if (grad_pages_ != nullptr) return grad_pages_->fetch(own_.layout->index_of(u));
    return grads_ + own_.grad_offset(u);
  }
  // Offload at stages 2-3: where the reducer copies each finished shard
  // (the host gradient set the next update reads); null otherwise.
  grad_type* final_shard_copies() {
    return host_staging_ ? host_grads_.data() + host_grad_set_ * own_.owned_total() : nullptr;
  }

  // Offload from a device: the owned gradient to the host (stage 1 sends it
  // now; stages 2-3 sent each shard as its bucket was reduced), then the
  // step's one wait for the device.
  void gradients_to_host(bool shards_sent) {
    if (!host_staging_) return;
    if constexpr (can_offload)
      if (!shards_sent)
        for (const auto& u : own_.layout->units())
          Ops::download_async(update_grad(u), grads_ + own_.grad_offset(u), own_.update_size(u));
    const auto waiting = Clock::now();
    Ops::synchronize();
    times_.device_wait_seconds += seconds_since(waiting);
  }

  // Squared norm and inf/NaN over the owned gradient, where the update reads
  // it: one pass where it is contiguous (stage 0: all of it; stage 2: the
  // shard buffer; offload: its host copy); by units (`pieces`) where stage
  // 1's owned pieces are interleaved in the accumulator, and at stage 3,
  // whose shards may be paged (the reducer then takes each unit's as it is
  // final, GradientReducer::shard_stats(), and the sums must be the same):
  // one pass per unit, added in unit order on the backend (on a GPU, on the
  // device), brought to the host once.
  kernels::GradStats grad_stats(bool pieces) {
    const auto started = Clock::now();
    const auto& units = own_.layout->units();
    auto stats_on = [&]<class On>(std::type_identity<On>) {
      if (pieces)
        return On::grad_stats_pieces(units.size(), [&](std::size_t i) {
          return std::pair<const grad_type*, std::size_t>(update_grad(units[i]), own_.update_size(units[i]));
        });
      return On::grad_stats(update_grad(units.front()), own_.owned_total());
    };
    const kernels::GradStats stats =
        offloaded_ ? stats_on(std::type_identity<HostOps>{}) : stats_on(std::type_identity<Ops>{});
    if (host_staging_) times_.cpu_update_seconds += seconds_since(started);
    return stats;
  }

  // The update of step `step` with `args` (gradient scale, scalars,
  // rounding). Returns true when the parameters are updated (offload: their
  // copies to the device enqueued); false when the update runs in the
  // background (delayed update, after the warm-up), to be landed by land().
  bool update(const StepArgs& args, std::int64_t step) {
    if (offloaded_ && delayed_ && step > delayed_warmup_) {
      pending_args_ = args;
      pending_set_ = host_grad_set_;
      pending_ = true;
      worker_.start([this] { update_units(pending_args_, false, pending_set_); });
      host_grad_set_ ^= 1;  // the next step's shards arrive in the other set
      return false;
    }
    update_units(args, true, host_grad_set_);
    return true;
  }
  // The background update: waits for it (rethrowing what it threw) and
  // copies its parameters to the device. True if there was one (the caller
  // then publishes the parameters and synchronizes).
  bool land() {
    if (!pending_) return false;
    pending_ = false;
    worker_.wait();
    for (const auto& u : own_.layout->units()) upload_updated(u);
    return true;
  }
  void wait() {
    if (pending_) worker_.wait();
  }

  // Unit u's updated range of the fp32 master into backend memory `dst`:
  // from the store, or from the parameters when they are their own master.
  void copy_master(const UnitInfo& u, float* dst) {
    const std::size_t n = own_.update_size(u);
    if (store_->owns_master()) {
      std::vector<float> host(n);  // values leave the store through host memory
      export_master(u, 0, host.data(), n);
      Ops::upload(dst, host.data(), n);
    } else if constexpr (std::is_same_v<param_type, float>) {
      Ops::copy(dst, owned_params(u), n);
    }
  }
  // Owned elements [local, local + n) of unit u's updated range of the
  // master, from and to fp32 host values. A remainder master is split with
  // the bf16 copy the update reads (and, offloaded from a device, the
  // device's parameters follow it here; otherwise that copy is the device's).
  void import_master(const UnitInfo& u, std::size_t local, const float* host, std::size_t n) {
    param_type* copy = update_copy(u) + local;
    store_->import_values(StateSlot{}, own_.state_offset(u) + local, host, n, copy);
    if constexpr (can_offload)
      if (stage_params_ && master_format_ == MasterWeights::remainder)
        Ops::upload(owned_params(u) + local, copy, n);
  }
  void export_master(const UnitInfo& u, std::size_t local, float* host, std::size_t n) {
    store_->export_values(StateSlot{}, own_.state_offset(u) + local, host, n, update_copy(u) + local);
  }
  // The master is the bf16 copy plus a remainder (Options::master).
  bool remainder_master() const { return master_format_ == MasterWeights::remainder; }
  // The 16-bit copies are rounded half away from zero.
  bool copies_round_ties_away() const { return ties_away_; }

  // Bytes for memory_report(): the host gradient copies, the parameter
  // staging and the disk window.
  std::uint64_t host_grad_bytes() const { return host_grads_.bytes(); }
  std::uint64_t host_staging_bytes() const { return host_params_.bytes() + store_->window_bytes(); }
  OffloadTimes& times() { return times_; }
  const OffloadTimes& times() const { return times_; }

 private:
  using Clock = std::chrono::steady_clock;
  static double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }

  // The update of every unit, reading host gradient set `set`. upload_each:
  // copy each unit's new parameters to the device as it finishes (offload
  // without delay); otherwise land() copies them.
  void update_units(StepArgs args, bool upload_each, std::size_t set) {
    const auto& units = own_.layout->units();
    const auto started = Clock::now();
    const simd::ScopedHostThreads update_threads(threads_);
    for (const auto& u : units) {
      const std::size_t index = own_.layout->index_of(u);
      args.grad = update_grad(u, set);
      if (!separate_master_) {
        if constexpr (std::is_same_v<param_type, float>)
          args.master = owned_params(u);  // fp32: the parameters are the master
      } else if (stage_params_ || !host_staging_) {
        args.param = update_copy(u);  // (fp32 on backend::Host with nvme: the store copies the master in)
      }
      args.ties_away = ties_away_;
      args.n = own_.update_size(u);
      // Stochastic rounding draws from (seed, step, element id): the id is
      // the unit's index and the position in the unit, which no rank count
      // or stage changes (the padded full offset does), so copies do not
      // depend on N.
      args.global_offset = (static_cast<std::uint64_t>(index) << 40) + own_.update_begin(u);
      store_->update(own_.state_offset(u), args);
      if (!host_staging_) {
        params_->written(index);
      } else {  // (the parameters change once uploaded)
        updated_master_[index] = args.master;
        // The unit's new parameters go to the device while the CPU updates
        // the next unit. The host buffers are next written after the next
        // step's synchronize(), which this copy precedes.
        if (upload_each) upload_updated(u);
      }
    }
    if (host_staging_) {
      times_.cpu_update_seconds += seconds_since(started);
      ++times_.steps;
    }
  }

  // Where the update reads and writes unit u's owned 16-bit parameters: the
  // host staging (offloaded from a device) or the parameters themselves.
  param_type* update_copy(const UnitInfo& u) {
    return stage_params_ ? host_params_.data() + own_.state_offset(u) : owned_params(u);
  }
  // This rank's updated range of unit u's parameters, where the parameter
  // store keeps them (with Options::param_place = disk: valid until another
  // unit's).
  param_type* owned_params(const UnitInfo& u) { return params_->updated_range(u, own_); }

  // Offload: unit u's updated parameters, host to device (async).
  void upload_updated(const UnitInfo& u) {
    if constexpr (can_offload) {
      if (!host_staging_) return;
      const std::size_t index = own_.layout->index_of(u);
      param_type* dst = owned_params(u);
      if (stage_params_)
        Ops::upload_async(dst, host_params_.data() + own_.state_offset(u), own_.update_size(u));
      else if constexpr (std::is_same_v<param_type, float>)  // fp32: the device's working copy is the master itself
        Ops::upload_async(dst, updated_master_[index], own_.update_size(u));
      params_->written(index);
    }
  }

  OffloadTier tier_ = OffloadTier::none;
  bool offloaded_ = false, host_staging_ = false, stage_params_ = false, separate_master_ = false;
  bool delayed_ = false, ties_away_ = false;
  MasterWeights master_format_ = MasterWeights::fp32;
  int delayed_warmup_ = 0, threads_ = 0;
  Ownership own_{};
  ParamStore<Ops, param_type>* params_ = nullptr;
  grad_type* grads_ = nullptr;
  ShardPages<grad_type>* grad_pages_ = nullptr;  // Options::param_place = disk: the reducer's

  std::unique_ptr<Store> store_;  // fp32 master (mixed precision, offload) and optimizer state
  Pinned<grad_type> host_grads_;  // offload: the owned gradient's host copy (two sets with the delayed update)
  Pinned<param_type> host_params_;          // offload: the parameters the CPU writes, before they go to the device
  std::vector<const float*> updated_master_;  // fp32 offload: where each unit's updated master is
  std::size_t host_grad_set_ = 0;
  bool pending_ = false;
  StepArgs pending_args_{};
  std::size_t pending_set_ = 0;
  UpdateWorker worker_;
  OffloadTimes times_{};
};

}  // namespace zero::detail
