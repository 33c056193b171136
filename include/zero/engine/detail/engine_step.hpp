// Why: the step, in the order the protocol runs it: the gradients' last
// reductions (GradientReducer), the owned gradient to where the update reads
// it and its statistics (UpdatePipeline), one control all-reduce that
// decides the norm, overflow and the ranks' agreement (StepControl), the
// update (UpdatePipeline), and the updated parameters published to every
// rank (all-gather at stages 1-2; stage 3 drops its gathered copies).
// Brought in by engine.hpp.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "zero/engine/engine_class.hpp"
#include "zero/engine/detail/rank_checks.hpp"

namespace zero::detail {

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
StepResult Engine<P, O, B>::step() {
  const comm::ApiCall api_call("step");
  require_finalized("step");
  require(whole_.size() == 0, "step(): the parameters are held whole (hold_whole()); end that scope before the "
          "step that changes them");
  const StageRules& rules = run_.stage;
  // The units grad_ready did not make final are now; those in your own
  // memory (use_memory) from there.
  reducer_.finish_units(first_micro(), last_micro(), [this](std::size_t u) {
    if (!own_.grads_of(u)) return false;
    take_own_grads(u);
    return true;
  });
  if (rules.params_sharded && micro_ + 1 == options_.grad_accumulation_steps) {
    // The update changes every shard: a gathered copy in use would go stale.
    if (const auto held = gatherer_.any_acquired())
      throw InvalidArgument(concat("step(): unit '", unit_of(*held).name,
                                   "' is still acquired; release_unit() every unit before the step that "
                                   "updates them"));
  }
  reducer_.end_micro_batch(first_micro(), last_micro());
  if (rules.params_sharded) gatherer_.end_micro_batch();
  StepResult result;
  result.loss_scale = control_.scaler().scale();
  if (++micro_ < options_.grad_accumulation_steps) {
    result.accumulating = true;
    return result;
  }
  micro_ = 0;
  comm_.join();   // the step reads the reduced gradients
  land_update();  // delayed update: the previous step's, before this one

  reducer_.reduce_at_step();  // stage 1 reduce-scatters the accumulated gradient now, in place
  update_.gradients_to_host(rules.reduce_scatter_on_flush);
  // (stage 3 sums the units' shares in unit order, as paged shards must)
  const kernels::GradStats stats = reducer_.paged() ? reducer_.shard_stats()
                                                    : update_.grad_stats(rules.reduce_scatter_at_step ||
                                                                         rules.params_sharded);
  // fp16's unwritten-gradient marker seen for the first time counts as an
  // overflow: the step is skipped, on every rank (GradientReducer's UnwrittenCheck).
  const bool non_finite = stats.non_finite || reducer_.take_marker_seen();

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
  const double replica = replicas_.value();
  const auto decision = [&] {
    try {
      return control_.decide(stats.sum_squares,
                             step_report<O>(invalid_hyper.empty() ? &scalars : nullptr, non_finite), invalid_hyper,
                             {steps_ + 1, rules.norm_needs_all_reduce(), rules.states_sharded, &options_,
                              replicas_.enabled() ? &replica : nullptr});
    } catch (const NonFiniteGradients& e) {
      blame_non_finite(e);
    }
  }();
  if (decision.replicas_differ) blame_replicas();
  replicas_.reset();
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
  args.state_rounding = StochasticRounding{options_.states == StateFormat::bf16_stochastic, options_.seed,
                                           static_cast<std::uint64_t>(steps_)};
  if (update_.update(args, steps_))
    publish_params();
  else
    aim_final_copies();  // the delayed update reads one host set; the next shards go to the other
  result.stepped = true;
  return result;
}

// The step found inf or NaN in the gradients and nothing skips them (every
// rank is here: the reports said so to all). When the parameters themselves
// are already non-finite, the gradients are only what a forward on them
// computed: the last update made them so (a learning rate far too large),
// and that is the error. One control exchange finds the first non-finite
// parameter element any rank owns; reading the owned parameters costs a
// pass over them, on this error's path only.
template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::blame_non_finite(const NonFiniteGradients& gradients_error) {
  const Ownership own = ownership();
  std::vector<std::uint64_t> mine = {0, 0, 0};  // found, parameter, element
  std::vector<param_type> host;
  for (std::size_t unit = 0; unit < layout_.units().size() && mine[0] == 0; ++unit) {
    const UnitInfo& u = layout_.units()[unit];
    host.resize(own.update_size(u));
    Ops::download(host.data(), param_ptr(u), host.size());
    const std::size_t begin = own.update_begin(u);  // the owned range's place in the padded unit
    for (const std::size_t p : u.params) {
      const ParamInfo& info = layout_.params()[p];
      const std::size_t lo = std::max(info.offset, begin), hi = std::min(info.offset + info.numel, begin + host.size());
      for (std::size_t i = lo; i < hi; ++i)
        if (!std::isfinite(to_float(host[i - begin]))) {
          mine = {1, p, i - info.offset};
          break;
        }
      if (mine[0] != 0) break;
    }
  }
  const std::vector<std::uint64_t> all = all_gather_control(mine);
  for (int r = 0; r < ranks(); ++r) {
    const std::uint64_t* found = all.data() + 3 * static_cast<std::size_t>(r);
    if (found[0] == 0) continue;
    const ParamInfo& info = layout_.params()[found[1]];
    std::string lr;
    if constexpr (requires { hyper_.lr; }) lr = concat("; the learning rate is ", hyper_.lr, " now");
    throw InvalidArgument(concat(
        "step() on rank ", rank(), ", step ", steps_ + 1, ": the parameters are already inf or NaN ('", info.name,
        "'[", found[2], "], held by rank ", r, "), so the gradients are too: ",
        steps_ == 0 ? std::string("no update ran yet, so they were so from the start (set_param, or your "
                                  "initialisation)")
                    : concat("the update of step ", steps_, " made them so", lr,
                             ": lower it (or check the other hyper-parameters); the gradients are only what a "
                             "forward on those parameters computes"),
        "; nothing was updated"));
  }
  throw gradients_error;
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::publish_params() {
  // (The update told the parameter store of each unit it wrote.)
  // Stage 3: the shards changed, so every gathered copy is stale (none is in
  // use: step() checked); acquire_unit gathers the updated values.
  if (run_.stage.params_sharded) gatherer_.drop_all();
  // Stages 1 and 2: every rank needs the full updated parameters again.
  if (run_.stage.all_gather_after_step) {
    const Ownership own = ownership();
    comm_.communicate([&] {
      for (std::size_t unit = 0; unit < layout_.units().size(); ++unit) {
        const UnitInfo& u = layout_.units()[unit];
        const auto purpose = comm_.exchange("gathers the updated parameters of", "unit", u.name, unit);
        param_type* full = params_.unit(unit);
        comm_->all_gather(full + own.update_begin(u), full, u.shard, dtype_traits<param_type>::dtype, false);
      }
    });
  }
  write_own_values();  // stages 0-2: your memory gets the new values
  // Stages 0-2: every rank now holds the same parameters, checked at the next step.
  if (replicas_.enabled() && !run_.stage.params_sharded)
    for (std::size_t unit = 0; unit < layout_.units().size(); ++unit)
      record_replica(unit, params_.unit(unit));
  params_.end_step();  // this step's order of uses: the next one's read-ahead
  reducer_.end_step();
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::record_replica(std::size_t unit, const param_type* values) {
  const std::size_t n = layout_.units()[unit].padded;
  const param_type* host = values;
  if constexpr (!std::is_same_v<B, backend::Host>) {  // device memory: brought to the host first
    replica_host_.resize(n);
    Ops::download(replica_host_.data(), values, n);
    host = replica_host_.data();
  }
  replicas_.record(unit, host, n * sizeof(param_type));
}

// Options::check_replicas: the step's control all-reduce found a rank whose
// copies' fingerprint differs from rank 0's (every rank knows it). One
// control exchange of each unit's last fingerprint names the unit, and the
// ranks that differ from the most ranks (with two, both are named).
template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
void Engine<P, O, B>::blame_replicas() {
  const std::size_t k = layout_.units().size();
  const std::vector<std::uint64_t> all = all_gather_control(replicas_.units());
  const int n = ranks();
  for (std::size_t unit = 0; unit < k; ++unit) {
    auto of = [&](int r) { return all[static_cast<std::size_t>(r) * k + unit]; };
    // The fingerprint most ranks hold (rank 0's on a tie).
    int most = 0, most_count = 0;
    for (int r = 0; r < n; ++r) {
      int count = 0;
      for (int s = 0; s < n; ++s) count += of(s) == of(r) ? 1 : 0;
      if (count > most_count) {
        most = r;
        most_count = count;
      }
    }
    if (most_count == n) continue;
    std::string differ;
    for (int r = 0; r < n; ++r)
      if (of(r) != of(most)) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
    const std::string who =
        most_count * 2 > n
            ? concat("on rank(s) ", differ, " differs from the bytes the other ", most_count, " ranks hold")
            : concat("differs between the ranks (rank(s) ", differ, " against rank ", most,
                     "; no majority, so which is wrong cannot be told)");
    throw CommError(concat(
        "step() on rank ", rank(), ", step ", steps_ + 1, ": Options::check_replicas: the ",
        run_.stage.params_sharded ? "gathered copy (acquire_unit)" : "parameters after the last update",
        " of unit '", layout_.units()[unit].name, "' ", who,
        "; the ranks computed or received them the same way, so a bit changed where it should not have (memory, a "
        "core, or the link: silent data corruption). Nothing was updated; check those ranks' machines, and resume "
        "from the last checkpoint"));
  }
  throw CommError(concat("step() on rank ", rank(), ", step ", steps_ + 1, ": Options::check_replicas: the ranks' "
                         "fingerprints of their copies differ, but no unit's last copy does (a unit gathered twice "
                         "differed the first time); nothing was updated; check the machines, and resume from the "
                         "last checkpoint"));
}

template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
auto Engine<P, O, B>::param_data(ParamId id) const -> const param_type* {
  require_finalized("param_data");
  require(id.index < layout_.params().size(), "param_data: parameter id ", id.index, " does not exist (",
          layout_.params().size(), " parameters)");
  const ParamInfo& p = layout_.param(id);
  const UnitInfo& u = unit_of(p.unit.index);
  if (run_.stage.params_whole()) return params_.data() + u.full_offset + p.offset;
  // Stage 3 inside hold_whole(): every unit is in the whole copy (acquire_unit hands it out from there).
  if (whole_.size() != 0) return whole_.data() + u.full_offset + p.offset;
  // Acquired, not merely prefetched: acquire_unit waited for the gather.
  const param_type* unit = gatherer_.acquired_data(p.unit.index);
  require(unit != nullptr, "param_data('", p.name, "'): acquire_unit('", u.name,
          "') first (stage 3 keeps only shards; a prefetched unit may still be being gathered)");
  return unit + p.offset;
}

}  // namespace zero::detail
