// memory_report() and comm_report() against the ZeRO paper's formulas, with
// Φ the padded element count, for N in {1, 2, 4, 7}.
#include "engine_harness.hpp"

namespace {

template <int S, class Precision = zero::precision::Mixed<zero::bf16>, class Optimizer = zero::optim::Adam>
zero::test::RunResult run(int ranks, int steps = 2) {
  using Opt = zero::ZeroOptimizer<Precision, Optimizer, zero::stage<S>, zero::offload::None, zero::backend::Host>;
  zero::test::TrainSpec spec;
  spec.steps = steps;
  spec.parts = ranks;
  return zero::test::train_local<Opt>(ranks, typename Optimizer::Hyper{}, zero::Options{}, spec);
}

template <int S>
void check_mixed_adam(int n) {
  INFO("stage " << S << ", ranks " << n);
  const auto r = run<S>(n, 3);
  const std::uint64_t phi = r.memory.padded_elements, N = static_cast<std::uint64_t>(n);
  REQUIRE(phi % (N * 64) == 0);
  const std::uint64_t expected = zero::test::zero_paper_model_state_bytes(S, phi, N);
  CHECK(r.memory.model_states() == expected);
  CHECK(r.memory.master == 4 * (S == 0 ? phi : phi / N));
  CHECK(r.memory.optimizer_states == 8 * (S == 0 ? phi : phi / N));
  CHECK(r.memory.padding < r.memory.model_states());
  // Stages 0 and 1 without accumulation take gradients in place: no staging.
  CHECK((r.memory.communication_buffers > 0) == (S >= 2));

  // Bytes of model traffic per step (2-byte gradients and parameters).
  const std::uint64_t elements = zero::test::zero_paper_traffic_elements(S, phi, N);
  CHECK(r.comm.steps == 3);
  CHECK(r.comm.sent_per_step() == Approx(2.0 * static_cast<double>(elements)));
  CHECK(r.comm.received_per_step() == Approx(2.0 * static_cast<double>(elements)));
  // Control: one all-reduce of 1 + N doubles per step (the squared norm, then
  // each rank's report: overflow flag and hyper-parameter fingerprint).
  CHECK(r.comm.control_sent() == r.comm.steps * 2 * zero::comm::ByteCounters::ring_share(8 * (1 + N), n));
}

}  // namespace

TEST_CASE("Memory and communication per rank follow the ZeRO formulas (mixed-precision Adam)",
          "[engine][reports]") {
  for (int n : {1, 2, 4, 7}) {
    check_mixed_adam<0>(n);
    check_mixed_adam<1>(n);
    check_mixed_adam<2>(n);
    check_mixed_adam<3>(n);
  }
}

TEST_CASE("fp32 parameters are their own master weights", "[engine][reports]") {
  const auto r = run<2, zero::precision::Full<float>, zero::optim::Sgd>(4);
  const std::uint64_t phi = r.memory.padded_elements;
  CHECK(r.memory.master == 0);
  CHECK(r.memory.params == 4 * phi);
  CHECK(r.memory.grads == 4 * phi / 4);
  CHECK(r.memory.optimizer_states == 4 * phi / 4);  // one momentum buffer
}

TEST_CASE("Reports print as JSON", "[engine][reports]") {
  const auto r = run<3>(2);
  CHECK(r.memory.to_json().find("\"model_states_bytes\":") != std::string::npos);
  CHECK(r.comm.to_json().find("\"all_gather_sent_bytes\":") != std::string::npos);
}
