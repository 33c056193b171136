// The engine over Open MPI: real processes (run under `mpirun -np 4`), the
// same equivalence criterion as the in-process tests, and the collectives of
// comm::Mpi checked element by element for every element type.
#define CATCH_CONFIG_RUNNER
#include "c_trainer_fit.hpp"
#include "engine_harness.hpp"
#include "rank_divergence.hpp"
#include "zero/comm/mpi.hpp"

namespace {

// A rank that fails ends the job within a minute (comm::Mpi's timeout), not
// at the test's own timeout.
zero::comm::Mpi& world() {
  static zero::comm::Mpi comm(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60)});
  return comm;
}

template <class T>
std::vector<T> values(int rank, std::size_t n, int salt) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(static_cast<int>((i * 7 + rank * 13 + salt) % 17) - 8) * 0.25f;
    if constexpr (std::is_same_v<T, double>)
      v[i] = x;
    else
      v[i] = zero::from_float<T>(x);
  }
  return v;
}

template <class T>
constexpr zero::DType dtype_of() {
  if constexpr (std::is_same_v<T, double>)
    return zero::DType::f64;
  else
    return zero::dtype_traits<T>::dtype;
}

template <class T>
void check_collectives() {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  const std::size_t count = 67;
  constexpr zero::DType dt = dtype_of<T>();
  // all_reduce: the sum over ranks of each rank's values (exact: small multiples of 1/4).
  auto buf = values<T>(r, count * n, 1);
  c.all_reduce(buf.data(), buf.size(), dt, zero::comm::ReduceOp::sum, false);
  for (std::size_t i = 0; i < buf.size(); ++i) {
    float want = 0;
    for (int s = 0; s < n; ++s) want += zero::to_float(values<T>(s, count * n, 1)[i]);
    REQUIRE(zero::to_float(buf[i]) == want);
  }
  // reduce_scatter, out of place and in place.
  const auto send = values<T>(r, count * n, 2);
  std::vector<T> recv(count);
  c.reduce_scatter(send.data(), recv.data(), count, dt);
  auto inplace = send;
  c.reduce_scatter(inplace.data(), inplace.data() + r * count, count, dt);
  for (std::size_t i = 0; i < count; ++i) {
    float want = 0;
    for (int s = 0; s < n; ++s) want += zero::to_float(values<T>(s, count * n, 2)[r * count + i]);
    REQUIRE(zero::to_float(recv[i]) == want);
    REQUIRE(zero::to_float(inplace[r * count + i]) == want);
  }
  // all_gather, out of place and in place.
  const auto mine = values<T>(r, count, 3);
  std::vector<T> all(count * n);
  c.all_gather(mine.data(), all.data(), count, dt, false);
  std::vector<T> all2(count * n);
  std::copy(mine.begin(), mine.end(), all2.begin() + r * count);
  c.all_gather(all2.data() + r * count, all2.data(), count, dt, false);
  for (int s = 0; s < n; ++s)
    for (std::size_t i = 0; i < count; ++i) {
      REQUIRE(zero::to_float(all[s * count + i]) == zero::to_float(values<T>(s, count, 3)[i]));
      REQUIRE(zero::to_float(all2[s * count + i]) == zero::to_float(values<T>(s, count, 3)[i]));
    }
  // all_to_all: block j of each rank's send (values salted by j) goes to rank j.
  std::vector<T> scattered(count * n), exchanged(count * n);
  for (int j = 0; j < n; ++j) {
    const auto block = values<T>(r, count, 10 + j);
    std::copy(block.begin(), block.end(), scattered.begin() + j * count);
  }
  const auto before = c.counters();
  c.all_to_all(scattered.data(), exchanged.data(), count, dt);
  for (int s = 0; s < n; ++s)
    for (std::size_t i = 0; i < count; ++i)
      REQUIRE(zero::to_float(exchanged[s * count + i]) == zero::to_float(values<T>(s, count, 10 + r)[i]));
  // A direct exchange: a block to each other rank, none across on one node.
  constexpr auto a2a = static_cast<std::size_t>(zero::comm::Collective::all_to_all);
  const std::uint64_t block_bytes = count * sizeof(T);
  CHECK(c.counters().sent[a2a] - before.sent[a2a] == block_bytes * (n - 1));
  CHECK(c.counters().received[a2a] - before.received[a2a] == block_bytes * (n - 1));
  CHECK(c.counters().calls[a2a] - before.calls[a2a] == 1);
  CHECK(c.counters().across[a2a] - before.across[a2a] == 0);
}

// All-to-all of bytes (qgZ's quantized payloads): element i of the block
// rank s sends to rank j is a byte of (s, j, i); count 0 moves nothing.
void check_all_to_all_bytes() {
  auto& c = world();
  const int n = c.size(), r = c.rank();
  const auto byte = [](int s, int j, std::size_t i) { return static_cast<unsigned char>(29 * s + 7 * j + 3 * i + 200); };
  for (const std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}}) {
    CAPTURE(count);
    std::vector<unsigned char> send(count * n), recv(count * n + 8, 0xEE);
    for (int j = 0; j < n; ++j)
      for (std::size_t i = 0; i < count; ++i) send[j * count + i] = byte(r, j, i);
    c.all_to_all(send.data(), recv.data(), count, zero::DType::u8);
    for (int s = 0; s < n; ++s)
      for (std::size_t i = 0; i < count; ++i) REQUIRE(recv[s * count + i] == byte(s, r, i));
    for (std::size_t i = count * n; i < recv.size(); ++i) REQUIRE(recv[i] == 0xEE);
  }
  std::vector<unsigned char> buf(2 * n);
  CHECK_THROWS_WITH(c.all_to_all(buf.data(), buf.data() + 1, 1, zero::DType::u8),
                    Catch::Contains("comm::Mpi: all_to_all's send and recv buffers overlap"));
}

template <int S, class Precision, class Optimizer>
void check_equivalence(int accumulation, double clip) {
  INFO("stage " << S << ", accumulation " << accumulation << ", clip " << clip);
  using Opt = zero::ZeroOptimizer<Precision, Optimizer, zero::stage<S>, zero::offload::None, zero::backend::Host>;
  typename Optimizer::Hyper hyper;
  hyper.lr = 0.01;
  zero::Options options;
  options.grad_accumulation_steps = accumulation;
  options.clip_norm = clip;
  options.loss_scale.initial_scale = 256;
  zero::test::TrainSpec spec;
  spec.steps = 5;
  spec.parts = world().size();
  const auto got = zero::test::train<Opt>(world(), hyper, options, spec);
  const auto want = zero::test::reference_train<Precision, Optimizer>(spec.parts, hyper, options, spec.steps);
  zero::test::require_equivalent<typename Opt::param_type>(got, want);
  // Model traffic per step as in the in-process runs.
  const double phi = static_cast<double>(got.memory.padded_elements), n = world().size();
  const double per_step = (S == 3 ? 3 : 2) * phi * (n - 1) / n * sizeof(typename Opt::grad_type) * accumulation;
  if (S >= 2 || S == 0) CHECK(got.comm.sent_per_step() >= per_step / accumulation);
}

}  // namespace

TEST_CASE("comm::Mpi collectives are exact for every element type", "[mpi][comm]") {
  REQUIRE(world().size() >= 2);
  check_collectives<float>();
  check_collectives<zero::bf16>();
  check_collectives<zero::fp16>();
  check_collectives<double>();
  check_all_to_all_bytes();
}

TEST_CASE("comm::Mpi takes its timeout from Options and refuses one that is not positive", "[mpi][comm]") {
  CHECK(world().options().timeout == std::chrono::seconds(60));
  CHECK_THROWS_WITH(zero::comm::Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::milliseconds(0)}),
                    Catch::Contains("comm::Mpi::Options::timeout is 0 ms; it must be positive"));
}

TEST_CASE("comm::Mpi on nodes: the launcher's count, Options::ranks_per_node, node() and across()", "[mpi][comm][topology]") {
  // mpirun on one machine: Open MPI's environment says one node of every rank.
  CHECK(world().topology() == zero::comm::Topology::one_node(world().size()));
  REQUIRE(world().size() % 2 == 0);
  zero::comm::Mpi two(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60), .ranks_per_node = 2});
  const int r = two.rank(), n = two.size();
  CHECK(two.topology().nodes() == n / 2);
  // node(): this rank and its neighbour; across(): the ranks of the same parity.
  double x = r + 1;
  two.node().all_reduce(&x, 1, zero::DType::f64, zero::comm::ReduceOp::sum, false);
  CHECK(x == (r / 2 * 2 + 1) + (r / 2 * 2 + 2));
  x = r + 1;
  two.across().all_reduce(&x, 1, zero::DType::f64, zero::comm::ReduceOp::sum, false);
  double want = 0;
  for (int s = r % 2; s < n; s += 2) want += s + 1;
  CHECK(x == want);
  CHECK(two.node().rank() == r % 2);
  CHECK(two.across().rank() == r / 2);
  CHECK(two.node().counters().total_across() == 0);
  CHECK(two.across().counters().total_across() == two.across().counters().total_sent());
  // A flat collective: the last rank of each node sends across.
  std::vector<float> buf(256, 1.0f);
  two.all_reduce(buf.data(), buf.size(), zero::DType::f32, zero::comm::ReduceOp::sum, false);
  CHECK(two.counters().total_across() == (r % 2 == 1 ? two.counters().total_sent() : 0));
  CHECK(two.counters().total_sent() > 0);
  // all_to_all: of a rank's n - 1 blocks, the n - 2 for the other nodes cross;
  // in node() none, in across() all.
  constexpr auto a2a = static_cast<std::size_t>(zero::comm::Collective::all_to_all);
  std::vector<float> send(3 * static_cast<std::size_t>(n)), recv(send.size());
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < 3; ++i) send[3 * j + i] = static_cast<float>(100 * r + 10 * j + i);
  two.all_to_all(send.data(), recv.data(), 3, zero::DType::f32);
  for (int s = 0; s < n; ++s)
    for (int i = 0; i < 3; ++i) CHECK(recv[3 * s + i] == static_cast<float>(100 * s + 10 * r + i));
  CHECK(two.counters().sent[a2a] == 12u * (n - 1));
  CHECK(two.counters().across[a2a] == 12u * (n - 2));
  two.node().all_to_all(send.data(), recv.data(), 3, zero::DType::f32);
  // node(): block j of its send went to node rank j, i.e. to rank r / 2 * 2 + j.
  for (int s = 0; s < 2; ++s)
    for (int i = 0; i < 3; ++i) CHECK(recv[3 * s + i] == static_cast<float>(100 * (r / 2 * 2 + s) + 10 * (r % 2) + i));
  CHECK(two.node().counters().sent[a2a] == 12u);
  CHECK(two.node().counters().across[a2a] == 0);
  two.across().all_to_all(send.data(), recv.data(), 3, zero::DType::f32);
  for (int s = 0; s < n / 2; ++s)
    for (int i = 0; i < 3; ++i) CHECK(recv[3 * s + i] == static_cast<float>(100 * (2 * s + r % 2) + 10 * (r / 2) + i));
  CHECK(two.across().counters().sent[a2a] == 12u * (n / 2 - 1));
  CHECK(two.across().counters().across[a2a] == two.across().counters().sent[a2a]);
  CHECK_THROWS_WITH(zero::comm::Mpi(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60), .ranks_per_node = 3}),
                    Catch::Contains("comm::Mpi::Options::ranks_per_node is 3, which does not divide"));
}

TEST_CASE("The engine over MPI matches the single-process reference", "[mpi][engine][equivalence]") {
  check_equivalence<0, zero::precision::Mixed<zero::bf16>, zero::optim::AdamW>(1, 0.0);
  check_equivalence<1, zero::precision::Full<float>, zero::optim::Sgd>(2, 0.05);
  check_equivalence<2, zero::precision::Mixed<zero::fp16>, zero::optim::Adam>(3, 0.05);
  check_equivalence<3, zero::precision::Mixed<zero::bf16>, zero::optim::AdamW>(2, 0.0);
  check_equivalence<3, zero::precision::Full<float>, zero::optim::Adam>(1, 0.05);
}

TEST_CASE("A C-style trainer fitted per layer over its own memory trains at every stage as at stage 0, over MPI",
          "[mpi][engine][fit]") {
  // (test_engine_c_trainer.cpp: the same fit over in-process ranks, with the memory it takes)
  const CtConfig model = zero::test::c_trainer_model(16);
  constexpr int steps = 6;
  const auto options = zero::test::c_trainer_options();
  const auto s0 = zero::test::run_c_trainer<0>(world(), model, steps, options);
  const decltype(s0) others[] = {zero::test::run_c_trainer<1>(world(), model, steps, options),
                                 zero::test::run_c_trainer<2>(world(), model, steps, options),
                                 zero::test::run_c_trainer<3>(world(), model, steps, options)};
  CHECK(s0.losses.back() < s0.losses.front() - 0.5);
  for (const auto& s : others) {
    for (int k = 0; k < steps; ++k) CHECK(std::abs(s.losses[k] - s0.losses[k]) <= 1e-5 * std::abs(s0.losses[k]));
    double worst = 0;
    for (std::size_t i = 0; i < s0.masters.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::abs(s.masters[i] - s0.masters[i])));
    CHECK(worst <= 1e-5);
  }
  const auto memory = [](const zero::test::CTrainerRun& r) { return r.memory.total() + r.peak_resident; };
  CHECK(static_cast<double>(memory(others[2])) <= 0.6 * static_cast<double>(memory(s0)));
}

TEST_CASE("Ranks that take different paths get an error naming each rank's exchange, never mixed values, over MPI",
          "[mpi][engine][errors]") {
  // (test_engine_errors.cpp: the same scenarios over in-process ranks)
  namespace dv = zero::test::divergence;
  for (dv::Scenario scenario : dv::scenarios) {
    INFO("rank " << world().rank() << ": " << dv::name(scenario));
    const dv::Outcome o = dv::run(world(), scenario);
    CHECK(o.other_error == "");
    for (const auto& word : dv::expected_words(scenario)) CHECK_THAT(o.error, Catch::Contains(word));
    for (double sum : o.sums) {
      INFO("an acquired unit sums to " << sum << " (a: 1024, b: 2048)");
      CHECK((sum == 1024.0 || sum == 2048.0));
    }
  }
}

TEST_CASE("comm::Mpi refuses calls that differ in kind or size on every rank, naming each", "[mpi][comm][errors]") {
  auto& c = world();
  std::vector<float> send(8 * static_cast<std::size_t>(c.size())), recv(send.size());
  std::string message;
  try {
    const zero::comm::ApiCall call("step");
    if (c.rank() == 1)
      c.all_gather(send.data(), recv.data(), 8, zero::DType::f32, false);
    else
      c.all_reduce(send.data(), 4, zero::DType::f32, zero::comm::ReduceOp::sum, false);
  } catch (const zero::CommError& e) {
    message = e.what();
  }
  CHECK_THAT(message, Catch::Contains("rank 1 called all_gather #"));
  CHECK_THAT(message, Catch::Contains("(8 elements of fp32 per rank) in step() while rank 0 called all_reduce #"));
  CHECK_THAT(message, Catch::Contains("(4 elements of fp32) in step()"));
  // The communicator is usable again: every rank stopped at the same check.
  std::vector<float> one(1, 1.0f);
  c.all_reduce(one.data(), 1, zero::DType::f32, zero::comm::ReduceOp::sum, false);
  CHECK(one[0] == static_cast<float>(c.size()));
}

int main(int argc, char** argv) {
  zero::comm::MpiRuntime mpi(&argc, &argv);
  Catch::Session session;
  int rc = session.applyCommandLine(argc, argv);
  if (rc == 0) rc = session.run();
  // Every rank must agree on success: a failure on any rank fails all.
  int failed = rc != 0 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return failed ? 1 : 0;
}
