// Why: values enter and leave the engine in fp32 host memory, whatever the
// stage keeps on this rank and wherever the tier keeps the state: set_param
// (every rank passes the same values; each keeps its part), the gathers of
// the whole model (collective), and the owned ranges the checkpoint layer
// reads and writes through the engine's public view instead of its members;
// and the values in your own memory (use_memory: the copies OwnMemory
// makes), the whole parameters of hold_whole(), and the reports' figures
// across ranks (mean_over_ranks, comm_report). Brought in by engine.hpp.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "zero/engine/engine_class.hpp"
#include "zero/engine/detail/rank_checks.hpp"
#include "zero/precision/convert.hpp"

namespace zero::detail {

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::set_param(ParamId id, const float* values) {
  const comm::ApiCall api_call("set_param");
  require_finalized("set_param");
  require(whole_.size() == 0, "set_param(): the parameters are held whole (hold_whole()); end that scope first");
  land_update();
  require(id.index < layout_.params().size(), "set_param: parameter id ", id.index, " does not exist");
  const ParamInfo& p = layout_.param(id);
  const UnitInfo& u = unit_of(p.unit.index);
  const StageRules& rules = run_.stage;
  // A gathered copy of the unit would keep the old values: a prefetched one
  // is dropped below; one in use cannot be.
  if (rules.params_sharded)
    require(!gatherer_.is_acquired(p.unit.index), "set_param('", p.name, "'): unit '", u.name,
            "' is acquired; release_unit() it before setting its parameters");
  // Collective: ranks that pass different values would each keep their own
  // part of them (a model no rank has); compare fingerprints instead.
  const std::vector<std::uint64_t> all = all_gather_control({hash_floats(values, p.numel)});
  std::string differ;
  for (int r = 1; r < ranks(); ++r)
    if (all[static_cast<std::size_t>(r)] != all[0]) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  if (!differ.empty())
    throw CommError(concat("set_param('", p.name, "') on rank ", rank(), ": rank(s) ", differ,
                           " passed values that differ from rank 0's; every rank must pass the same values "
                           "(initialise from the same seed on every rank, or load the same checkpoint)"));
  if (rules.params_sharded) gatherer_.drop(p.unit.index);
  comm_.join();  // communication in flight may still read the parameters
  // The part of the parameter inside this rank's updated range of the unit.
  const Ownership own = ownership();
  const std::size_t begin = own.update_begin(u), end = begin + own.update_size(u);
  const std::size_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.numel);
  auto to_params = [this](const float* from, std::size_t n, param_type* to) {
    std::vector<param_type> low(n);  // converted on the host, then uploaded (values are fp32 host memory)
    for (std::size_t i = 0; i < n; ++i) low[i] = rounded_copy(from[i]);
    Ops::upload(to, low.data(), n);
  };
  if (lo < hi) {
    const float* owned = values + (lo - p.offset);
    if (update_.store().owns_master()) update_.import_master(u, lo - begin, owned, hi - lo);
    if (rules.params_sharded) to_params(owned, hi - lo, param_ptr(u) + (lo - begin));  // stages 0-2: below
  }
  if (rules.params_whole()) {
    to_params(values, p.numel, params_.unit(p.unit.index) + p.offset);
    own_.write_value(layout_, id.index, params_.unit(p.unit.index));  // your memory (use_memory)
  }
  if (lo < hi || rules.params_whole()) params_.written(p.unit.index);  // (stage 3: where this rank's shard changed)
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::gather_masters(float* out) {
  const comm::ApiCall api_call("gather_masters");
  require_finalized("gather_masters");
  land_update();
  gather_units(out, [this](const UnitInfo& u, float* dst) { update_.copy_master(u, dst); });
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::gather_params(param_type* out) {
  const comm::ApiCall api_call("gather_params");
  require_finalized("gather_params");
  land_update();
  if (run_.stage.params_whole())
    Ops::download(out, params_.data(), layout_.padded_total());
  else
    gather_units(out, [this](const UnitInfo& u, param_type* dst) { Ops::copy(dst, param_ptr(u), u.shard); });
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
template <class T, class Fill>
void Engine<P, O, B>::gather_units(T* out, Fill fill) {
  // One unit at a time through a backend buffer (collectives take backend memory).
  Buffer<T> unit_buffer(layout_.max_unit());
  const Ownership own = ownership();
  comm_.communicate([&] {
    for (std::size_t unit = 0; unit < layout_.units().size(); ++unit) {
      const UnitInfo& u = layout_.units()[unit];
      T* mine = unit_buffer.data() + own.update_begin(u);
      fill(u, mine);
      if (own.rules.states_sharded) {
        const auto purpose = comm_.exchange("gathers the values of", "unit", u.name, unit);
        comm_->all_gather(mine, unit_buffer.data(), u.shard, dtype_traits<T>::dtype, true);
      }
      Ops::download(out + u.full_offset, unit_buffer.data(), u.padded);
    }
  });
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
std::vector<float> Engine<P, O, B>::master_values(ParamId id) {
  const comm::ApiCall api_call("master_values");
  std::vector<float> all(layout_.padded_total());
  gather_masters(all.data());
  const ParamInfo& p = layout_.param(id);
  const std::size_t start = unit_of(p.unit.index).full_offset + p.offset;
  return std::vector<float>(all.begin() + static_cast<std::ptrdiff_t>(start),
                            all.begin() + static_cast<std::ptrdiff_t>(start + p.numel));
}

// ---- The checkpoint layer's view ---------------------------------------------

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::read_params(std::size_t unit, std::size_t local, std::size_t count, param_type* host) {
  Ops::download(host, param_ptr(unit_of(unit)) + local, count);
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::write_params(std::size_t unit, std::size_t local, std::size_t count, const param_type* host) {
  Ops::upload(param_ptr(unit_of(unit)) + local, host, count);
  params_.written(unit);
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::read_state(StateSlot slot, std::size_t unit, std::size_t local, std::size_t count,
                                 float* host) {
  const UnitInfo& u = unit_of(unit);
  if (slot.is_master() && !update_.store().owns_master()) {
    if constexpr (std::is_same_v<param_type, float>) Ops::download(host, param_ptr(u) + local, count);
    return;
  }
  if (slot.is_master())
    update_.export_master(u, local, host, count);
  else
    update_.store().export_values(slot, ownership().state_offset(u) + local, host, count,
                                  static_cast<const param_type*>(nullptr));
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::write_state(StateSlot slot, std::size_t unit, std::size_t local, std::size_t count,
                                  const float* host) {
  const UnitInfo& u = unit_of(unit);
  if (slot.is_master() && !update_.store().owns_master()) {
    if constexpr (std::is_same_v<param_type, float>) {
      Ops::upload(param_ptr(u) + local, host, count);
      params_.written(unit);
    }
    return;
  }
  if (slot.is_master()) {
    update_.import_master(u, local, host, count);  // (a remainder master writes the bf16 copy too)
    params_.written(unit);
  } else
    update_.store().import_values(slot, ownership().state_offset(u) + local, host, count,
                                  static_cast<param_type*>(nullptr));
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
auto Engine<P, O, B>::rounded_copy(float value) const -> param_type {
  return nearest_copy<param_type>(value, update_.copies_round_ties_away());
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::settle(const char* what) {
  require(finalized_, what, ": call finalize() first");
  require(micro_ == 0, what, ": call it between optimizer steps, not within a gradient-accumulation window");
  wait_save();
  land_update();
  synchronize();
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::restore_progress(std::int64_t steps, DynamicLossScaler::State scaler) {
  steps_ = steps;
  steps_at_reset_ = steps;
  control_.scaler().restore(scaler);
  reducer_.forget_qgz_residuals();  // never saved: a loaded run starts without them, as a resumed one does
  publish_params();
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::use_memory(ParamId p, param_type* values, grad_type* grads) {
  require(!finalized_, "use_memory: call it before finalize()");
  require(p.index < layout_.params().size(), "use_memory: parameter id ", p.index, " does not exist");
  own_.add(layout_, p.index, values, grads);
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::take_own_grads(std::size_t unit) {
  grad_type* g = reducer_.hand_out(unit, first_micro(), last_micro());
  own_.take_grads(layout_, unit, g, !reducer_.adds_across_micro_batches() || first_micro());
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::write_own_values() {
  if (!own_.any() || !run_.stage.params_whole()) return;
  for (std::size_t u = 0; u < layout_.units().size(); ++u)
    own_.write_values(layout_, u, params_.unit(u));
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
HeldWhole Engine<P, O, B>::hold_whole() {
  const comm::ApiCall api_call("hold_whole");
  require_finalized("hold_whole");
  if (!run_.stage.params_sharded) return {};
  require(whole_.size() == 0, "hold_whole(): the parameters are held whole already; end that scope first");
  if (const auto held = gatherer_.any_acquired())
    throw InvalidArgument(concat("hold_whole(): unit '", unit_of(*held).name,
                                 "' is acquired; release_unit() every unit before holding the parameters whole"));
  land_update();
  // (Held only while the scope lives: not one of the run's rows.)
  whole_ = allocate<param_type>(BufferRow{"whole parameters (hold_whole)", "", ReportedAs::not_reported,
                                          backend_place(run_), layout_.padded_total(), sizeof(param_type),
                                          "evaluate without hold_whole (acquire_unit gathers a unit at a time, on "
                                          "every rank)"});
  comm_.communicate([&] {
    for (std::size_t u = 0; u < layout_.units().size(); ++u)
      gatherer_.gather_unit(u, whole_.data() + unit_of(u).full_offset);
  });
  for (std::size_t u = 0; u < layout_.units().size(); ++u)
    own_.write_values(layout_, u, whole_.data() + unit_of(u).full_offset);
  return HeldWhole([this] {
    Ops::synchronize();  // nothing may still read the copy
    whole_ = Buffer<param_type>();
    for (std::size_t u = 0; u < layout_.units().size(); ++u) own_.release_values(layout_, u);
  });
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
double Engine<P, O, B>::mean_over_ranks(double value) {
  const comm::ApiCall api_call("mean_over_ranks");
  require_finalized("mean_over_ranks");
  return control_.mean_over_ranks(value);
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
CommReport Engine<P, O, B>::comm_report() const {
  CommReport r;
  r.rank = rank();
  r.ranks = ranks();
  r.stage = stage();
  r.steps = static_cast<std::uint64_t>(steps_ - steps_at_reset_);
  r.ranks_per_node = comm_->topology().ranks_per_node;
  r.counters = comm_->counters_with_splits();
  return r;
}

}  // namespace zero::detail
