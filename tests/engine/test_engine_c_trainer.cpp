// A trainer written in plain C style (c_style_trainer.h: parameters of one
// kind stacked across layers, a tied embedding written at both ends of
// backward, += accumulation), fitted with per-layer units over its own
// memory (c_trainer_fit.hpp), trains at every stage to the losses of stage
// 0, and at stage 3 holds at most 0.6 of stage 0's memory per rank at 2
// ranks: the optimizer's buffers plus the trainer's arrays as resident at
// their fullest. The MPI suite runs the same fit over processes.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

#include "c_trainer_fit.hpp"

namespace {

using zero::test::CTrainerRun;

template <int S>
CTrainerRun train(int ranks, const CtConfig& model, int steps) {
  std::vector<CTrainerRun> runs(static_cast<std::size_t>(ranks));
  zero::comm::LocalGroup group(ranks);
  group.run([&](zero::comm::Local& c) {
    runs[static_cast<std::size_t>(c.rank())] =
        zero::test::run_c_trainer<S>(c, model, steps, zero::test::c_trainer_options());
  });
  for (const auto& r : runs) REQUIRE(r.masters == runs[0].masters);  // the ranks agree
  return runs[0];
}

double memory_of(const CTrainerRun& r) { return static_cast<double>(r.memory.total() + r.peak_resident); }

}  // namespace

TEST_CASE("A C-style trainer with stacked parameters and a tied embedding trains at every stage as at stage 0",
          "[engine][fit]") {
  const CtConfig model = zero::test::c_trainer_model(16);
  constexpr int steps = 8;
  const CTrainerRun s0 = train<0>(2, model, steps);
  const CTrainerRun s1 = train<1>(2, model, steps);
  const CTrainerRun s2 = train<2>(2, model, steps);
  const CTrainerRun s3 = train<3>(2, model, steps);
  // It learns (the loss falls), and every stage follows stage 0's losses and
  // parameters within fp32 rounding of the reductions.
  CHECK(s0.losses.back() < s0.losses.front() - 1.0);
  for (const CTrainerRun* s : {&s1, &s2, &s3}) {
    INFO("stage " << (s == &s1 ? 1 : s == &s2 ? 2 : 3));
    for (int k = 0; k < steps; ++k) CHECK(std::abs(s->losses[k] - s0.losses[k]) <= 1e-5 * std::abs(s0.losses[k]));
    double worst = 0;
    for (std::size_t i = 0; i < s0.masters.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::abs(s->masters[i] - s0.masters[i])));
    CHECK(worst <= 1e-5);
  }
  // Evaluation on rank 0 alone with the parameters held whole: no
  // collective, and at stage 3 the loss of stage 0.
  for (const CTrainerRun* s : {&s0, &s3}) {
    CHECK(s->eval_collectives == 0);
    CHECK(std::abs(s->eval_loss - s0.eval_loss) <= 1e-6 * std::abs(s0.eval_loss));
  }
  CHECK(s0.eval_loss < s0.losses.front() - 1.0);  // an unseen batch: it generalises
  // One rank over the whole batch: the same model, summed in another order.
  const CTrainerRun one = train<0>(1, model, steps);
  for (int k = 0; k < steps; ++k) CHECK(std::abs(one.losses[k] - s0.losses[k]) <= 1e-4 * std::abs(s0.losses[k]));

  // Memory per rank: the optimizer's buffers and the trainer's arrays at
  // their fullest. Stage 0 keeps the trainer's arrays whole beside its own
  // copies; stage 3 keeps shards, one or two units' slices and slots.
  std::printf("C-style trainer, 2 ranks, bytes per rank (optimizer + trainer's arrays at peak):\n");
  for (const auto& [name, run] : {std::pair{"stage 0", &s0}, {"stage 1", &s1}, {"stage 2", &s2}, {"stage 3", &s3}})
    std::printf("  %s: %llu + %llu = %.0f (%.3f of stage 0)\n", name,
                static_cast<unsigned long long>(run->memory.total()),
                static_cast<unsigned long long>(run->peak_resident), memory_of(*run), memory_of(*run) / memory_of(s0));
  CHECK(memory_of(s3) <= 0.6 * memory_of(s0));
  CHECK(memory_of(s2) < memory_of(s1));
  CHECK(memory_of(s1) < memory_of(s0));

  // Stage 3 gathers each block twice per step (forward, backward) and the
  // tied embedding once per use (lookup, output layer): the output layer's
  // acquire prefetches nothing, since backward goes on from the last block,
  // and the embedding prefetched at the end of the first backward (whose
  // lookup gradient needs no weights) is learned to be in vain: once.
  const auto all_gathers = s3.comm.counters.calls[static_cast<std::size_t>(zero::comm::Collective::all_gather)];
  CHECK(all_gathers == static_cast<std::uint64_t>(steps) * (2 * static_cast<std::uint64_t>(model.L) + 2) + 1);
}
