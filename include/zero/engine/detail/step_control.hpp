// Why: whether and how a step updates is decided from every rank's view at
// once: the global gradient norm (stages 1-3 each hold a shard of it),
// whether any rank found inf/NaN, and whether every rank set the same valid
// hyper-parameters. This part owns that decision: the control buffers, the
// step's one control all_reduce of [sum of squares, one report per rank]
// (1 + N doubles, counted as control traffic), the checks of the reports
// (an error on every rank, rank_checks.hpp), the loss scaler and the
// clipping factor. It knows nothing of the optimizer's type: the engine
// brings this rank's report (step_report<Optimizer>).
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "zero/backend/host.hpp"
#include "zero/comm/communicator.hpp"
#include "zero/engine/detail/comm_channel.hpp"
#include "zero/engine/detail/part_rows.hpp"
#include "zero/engine/loss_scaler.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/detail/rank_checks.hpp"

namespace zero::detail {

// Host memory for the step's control values: page-locked where the backend
// has such memory (a copy from it need not wait), else plain host memory.
// The step's control values (engine/detail/part_rows.hpp): on the backend, and
// their host copy (page-locked where the backend has such memory).
inline BufferRows control_rows(const RunShape& run, const BufferSizes& z) {
  return {{"control values", "control", ReportedAs::not_reported, backend_place(run), z.control, sizeof(double), ""},
          {"control values (host copy)", "control", ReportedAs::not_reported, Place::host, z.control, sizeof(double),
           ""}};
}
// One control all-reduce decides the step: the squared norm and one report
// per rank (hyper-parameter fingerprint, inf/NaN and invalid flags).
inline CollectiveRows control_collectives(const BufferSizes& z, int ranks) {
  const auto ring = [ranks](std::uint64_t bytes) { return comm::ByteCounters::ring_share(bytes, ranks); };
  return {{"control all-reduce at the step (norm, one report per rank)", comm::Collective::control, 1,
           2 * ring(z.control), 2 * ring(z.control * sizeof(double))}};
}

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

template <class Ops>
class StepControl {
 public:
  StepControl() = default;
  StepControl(const LossScaleOptions& loss_scale, bool loss_scaling) : scaler_(loss_scale, loss_scaling) {}

  // At finalize(): the buffers for the control values (1 + ranks, and ranks
  // more with Options::check_replicas: BufferSizes::control).
  void bind(std::size_t values, CommChannel<Ops>& channel) {
    control_ = typename Ops::template Buffer<double>(values);
    control_host_ = typename ControlHostBuffer<Ops>::type(values);
    channel_ = &channel;
  }

  DynamicLossScaler& scaler() { return scaler_; }
  const DynamicLossScaler& scaler() const { return scaler_; }

  // What a step is to do.
  struct Context {
    std::int64_t step;           // the step being taken (1-based)
    bool norm_needs_all_reduce;  // stages 1-3: sum_squares is this rank's share
    bool states_sharded;         // each rank checks only the gradient it owns
    const Options* options;      // clip_norm, gradient_divisor, grad_accumulation_steps
    // Options::check_replicas: this rank's ReplicaFingerprints::value(), which
    // rides the all-reduce (one slot per rank after the reports); else nullptr.
    const double* replica = nullptr;
  };
  struct Decision {
    bool skip = false;       // fp16 overflow: nothing is updated, every rank skips
    double grad_norm = 0.0;  // global L2 norm of the unscaled, averaged gradient (before clipping)
    float grad_scale = 1.0f; // what the update multiplies each gradient by: clip / (loss scale x divisor)
    bool replicas_differ = false;  // Options::check_replicas: a rank's fingerprint differs from rank 0's
  };

  // Collective. `sum_squares`: of the gradient this rank checked; `report`:
  // step_report<Optimizer>() of this rank (its hyper-parameters' fingerprint
  // and flags); `invalid_hyper`: this rank's validation error, or empty.
  // Throws on every rank where rank_checks.hpp says so.
  Decision decide(double sum_squares, std::uint64_t report, const std::string& invalid_hyper, const Context& ctx) {
    auto& comm = *channel_;
    const int rank = comm.rank(), ranks = comm.size();
    double* control = control_host_.data();
    const std::size_t control_size = control_host_.size();
    // Summed: stages 1-3 add the owned shards' squared norms in slot 0 (stage
    // 0 computed its norm from the whole reduced gradient); slot 1 + r
    // carries rank r's report, the other ranks add 0.
    std::fill(control, control + control_size, 0.0);
    if (ctx.norm_needs_all_reduce) control[0] = sum_squares;
    control[1 + static_cast<std::size_t>(rank)] = static_cast<double>(report);
    double* replicas = control + 1 + static_cast<std::size_t>(ranks);
    if (ctx.replica != nullptr) replicas[rank] = *ctx.replica;
    // Up from page-locked memory without a host wait where the backend can
    // (the gradient statistics were the step's one wait before the
    // all-reduce); the all-reduce's lane starts after the copy, and the
    // download waits for both.
    if constexpr (requires { ControlHostBuffer<Ops>::async; })
      Ops::upload_async(control_.data(), control, control_size);
    else
      Ops::upload(control_.data(), control, control_size);
    comm.communicate([&] {
      const auto purpose = comm.exchange("all-reduces the step's gradient norm and checks");
      comm->all_reduce(control_.data(), control_size, DType::f64, comm::ReduceOp::sum, true);
      Ops::download(control, control_.data(), control_size);
    });
    if (ctx.norm_needs_all_reduce) sum_squares = control[0];
    const StepReports reports{rank, ranks, ctx.step, control + 1, scaler_.enabled(), ctx.states_sharded};
    bool overflow = false;
    for (int r = 0; r < ranks; ++r) overflow = overflow || (reports.report(r) & report_non_finite) != 0;
    check_step_reports(reports, invalid_hyper, overflow);

    Decision d;
    if (ctx.replica != nullptr)
      for (int r = 1; r < ranks; ++r) d.replicas_differ = d.replicas_differ || replicas[r] != replicas[0];
    const double scale = scaler_.scale();
    if (scaler_.update(overflow)) {
      d.skip = true;
      return d;
    }
    const Options& o = *ctx.options;
    const double divisor = o.gradient_divisor > 0
                               ? o.gradient_divisor
                               : static_cast<double>(ranks) * static_cast<double>(o.grad_accumulation_steps);
    const double unscale = 1.0 / (scale * divisor);
    d.grad_norm = std::sqrt(sum_squares) * unscale;
    double clip = 1.0;
    if (o.clip_norm > 0 && d.grad_norm > 0)
      clip = std::min(1.0, o.clip_norm / (d.grad_norm + 1e-6));  // as torch.nn.utils.clip_grad_norm_
    d.grad_scale = static_cast<float>(unscale * clip);
    return d;
  }

  // Collective: the mean over the ranks of one value each (a loss), through
  // the control buffer (a device's memory where the communicator needs it).
  double mean_over_ranks(double value) {
    auto& comm = *channel_;
    double* host = control_host_.data();
    host[0] = value;
    Ops::upload(control_.data(), host, 1);
    comm.communicate([&] {
      const auto purpose = comm.exchange("all-reduces a value over the ranks (mean_over_ranks)");
      comm->all_reduce(control_.data(), 1, DType::f64, comm::ReduceOp::sum, true);
      Ops::download(host, control_.data(), 1);
    });
    return host[0] / static_cast<double>(comm.size());
  }

 private:
  DynamicLossScaler scaler_;
  typename Ops::template Buffer<double> control_;
  typename ControlHostBuffer<Ops>::type control_host_;
  CommChannel<Ops>* channel_ = nullptr;
};

}  // namespace zero::detail
