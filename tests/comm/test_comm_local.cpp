// comm::Local: every collective gives the bits of an independent scalar
// reference (fp32 sum or max in rank order, rounded once) for every element
// type, rank count and length (SIMD body and scalar tail); ranks that make
// different calls all get a CommError naming both calls instead of reading
// each other's buffers out of bounds; a missing rank still ends in a timeout.
// AnyCommunicator (the erasure the optimizer holds) keeps a communicator's
// device stream, also around a communicator that is already erased.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "zero/comm/any_communicator.hpp"
#include "zero/comm/local.hpp"

namespace {

using zero::DType;
using zero::comm::ReduceOp;

// Rank r's input, element i, as the type of `t`, stored in a byte buffer.
std::vector<unsigned char> make_input(DType t, std::size_t count, int rank) {
  std::vector<unsigned char> out(count * zero::dtype_bytes(t));
  std::mt19937 rng(static_cast<unsigned>(1000 * rank + 7));
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  for (std::size_t i = 0; i < count; ++i) {
    const float v = dist(rng);
    unsigned char* p = out.data() + i * zero::dtype_bytes(t);
    switch (t) {
      case DType::f32: std::memcpy(p, &v, 4); break;
      case DType::f16: { const auto h = zero::from_float<zero::fp16>(v); std::memcpy(p, &h, 2); break; }
      case DType::bf16: { const auto h = zero::from_float<zero::bf16>(v); std::memcpy(p, &h, 2); break; }
      case DType::f64: { const double d = static_cast<double>(v) * 1.000000001; std::memcpy(p, &d, 8); break; }
      case DType::u64: { const std::uint64_t u = rng() % 100000; std::memcpy(p, &u, 8); break; }
      case DType::u8: *p = static_cast<unsigned char>(rng()); break;
    }
  }
  return out;
}

// Element i of op over the inputs, in rank order; 16-bit types summed in fp32
// and rounded once. Written out per type, sharing nothing with the library
// but the scalar conversions.
std::vector<unsigned char> reference(DType t, const std::vector<std::vector<unsigned char>>& in, std::size_t begin,
                                     std::size_t count, ReduceOp op) {
  const std::size_t b = zero::dtype_bytes(t);
  std::vector<unsigned char> out(count * b);
  auto fold = [&](auto load, auto store) {
    for (std::size_t i = 0; i < count; ++i) {
      auto acc = load(in[0].data() + (begin + i) * b);
      for (std::size_t k = 1; k < in.size(); ++k) {
        const auto x = load(in[k].data() + (begin + i) * b);
        acc = op == ReduceOp::sum ? acc + x : (acc > x ? acc : x);
      }
      store(out.data() + i * b, acc);
    }
  };
  auto load_as = [](auto tag) {
    return [](const unsigned char* p) {
      decltype(tag) x;
      std::memcpy(&x, p, sizeof x);
      return zero::to_float(x);
    };
  };
  auto store_as = [](auto tag) {
    return [](unsigned char* p, float f) {
      const auto x = zero::from_float<decltype(tag)>(f);
      std::memcpy(p, &x, sizeof x);
    };
  };
  auto raw_load = [](auto tag) {
    return [](const unsigned char* p) {
      decltype(tag) x;
      std::memcpy(&x, p, sizeof x);
      return x;
    };
  };
  auto raw_store = [](auto tag) {
    return [](unsigned char* p, decltype(tag) x) { std::memcpy(p, &x, sizeof x); };
  };
  switch (t) {
    case DType::f32: fold(raw_load(float{}), raw_store(float{})); break;
    case DType::f16: fold(load_as(zero::fp16{}), store_as(zero::fp16{})); break;
    case DType::bf16: fold(load_as(zero::bf16{}), store_as(zero::bf16{})); break;
    case DType::f64: fold(raw_load(double{}), raw_store(double{})); break;
    case DType::u64: fold(raw_load(std::uint64_t{}), raw_store(std::uint64_t{})); break;
    case DType::u8: break;  // bytes are gathered, never reduced
  }
  return out;
}

// Runs fn on `ranks` ranks; each rank's CommError message (empty if none).
std::vector<std::string> comm_errors(int ranks, const std::function<void(zero::comm::Local&)>& fn) {
  std::vector<std::string> messages(static_cast<std::size_t>(ranks));
  zero::comm::LocalGroup::Options o;
  o.timeout = std::chrono::milliseconds(2000);
  zero::comm::LocalGroup group(ranks, o);
  group.run([&](zero::comm::Local& c) {
    try {
      fn(c);
    } catch (const zero::CommError& e) {
      messages[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  return messages;
}

}  // namespace

TEST_CASE("comm::Local collectives give the bits of a rank-order reference", "[comm][local]") {
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::f64, DType::u64}) {
    for (int ranks : {1, 2, 3, 4, 5}) {
      // 100003: a rank's block spans several of the pieces that running
      // threads share (256 KiB each), ending mid-pack.
      for (std::size_t per_rank : {std::size_t{1}, std::size_t{13}, std::size_t{64}, std::size_t{1003}, std::size_t{100003}}) {
        CAPTURE(zero::dtype_name(t), ranks, per_rank);
        const std::size_t b = zero::dtype_bytes(t), full = per_rank * static_cast<std::size_t>(ranks);
        std::vector<std::vector<unsigned char>> inputs;
        for (int r = 0; r < ranks; ++r) inputs.push_back(make_input(t, full, r));
        const auto sum = reference(t, inputs, 0, full, ReduceOp::sum);
        const auto max = reference(t, inputs, 0, full, ReduceOp::max);
        std::vector<std::vector<unsigned char>> got_sum(ranks), got_max(ranks), got_rs(ranks), got_rs_inplace(ranks),
            got_ag(ranks), got_ag_inplace(ranks), got_bc(ranks);
        zero::comm::LocalGroup group(ranks);
        group.run([&](zero::comm::Local& c) {
          const auto r = static_cast<std::size_t>(c.rank());
          got_sum[r] = inputs[r];
          c.all_reduce(got_sum[r].data(), full, t, ReduceOp::sum);
          got_max[r] = inputs[r];
          c.all_reduce(got_max[r].data(), full, t, ReduceOp::max);
          got_rs[r].assign(per_rank * b, 0);
          c.reduce_scatter(inputs[r].data(), got_rs[r].data(), per_rank, t);
          std::vector<unsigned char> in_place = inputs[r];
          c.reduce_scatter(in_place.data(), in_place.data() + r * per_rank * b, per_rank, t);
          got_rs_inplace[r].assign(in_place.begin() + static_cast<std::ptrdiff_t>(r * per_rank * b),
                                   in_place.begin() + static_cast<std::ptrdiff_t>((r + 1) * per_rank * b));
          // All-gather each rank's block r of its own input, out of place.
          got_ag[r].assign(full * b, 0);
          c.all_gather(inputs[r].data() + r * per_rank * b, got_ag[r].data(), per_rank, t);
          // In place: each rank's block r of its own input is already in place.
          got_ag_inplace[r] = inputs[r];
          c.all_gather(got_ag_inplace[r].data() + r * per_rank * b, got_ag_inplace[r].data(), per_rank, t);
          got_bc[r] = inputs[r];
          c.broadcast(got_bc[r].data(), full, t, ranks - 1);
        });
        std::vector<unsigned char> gathered;
        for (int r = 0; r < ranks; ++r)
          gathered.insert(gathered.end(), inputs[r].begin() + static_cast<std::ptrdiff_t>(r * per_rank * b),
                          inputs[r].begin() + static_cast<std::ptrdiff_t>((r + 1) * per_rank * b));
        for (int r = 0; r < ranks; ++r) {
          CAPTURE(r);
          CHECK(got_sum[r] == sum);
          CHECK(got_max[r] == max);
          const auto block = reference(t, inputs, static_cast<std::size_t>(r) * per_rank, per_rank, ReduceOp::sum);
          CHECK(got_rs[r] == block);
          CHECK(got_rs_inplace[r] == block);
          CHECK(got_ag[r] == gathered);
          CHECK(got_ag_inplace[r] == gathered);
          CHECK(got_bc[r] == inputs[ranks - 1]);
        }
      }
    }
  }
}

TEST_CASE("comm::Local ranks that make different calls all get an error naming both", "[comm][local][errors]") {
  // Each rank's buffers fit its own call only: without the check, the ranks
  // would read each other's buffers out of bounds.
  SECTION("different kinds, counts and types") {
    const auto messages = comm_errors(2, [](zero::comm::Local& c) {
      if (c.rank() == 0) {
        std::vector<zero::bf16> send(512), recv(1024);
        c.all_gather(send.data(), recv.data(), 512, DType::bf16);
      } else {
        std::vector<float> send(2048), recv(1024);
        c.reduce_scatter(send.data(), recv.data(), 1024, DType::f32);
      }
    });
    for (const auto& m : messages)
      CHECK_THAT(m, Catch::Contains("rank 1 called reduce_scatter(1024 x fp32) while rank 0 called all_gather(512 x bf16)"));
  }
  SECTION("different element counts") {
    const auto messages = comm_errors(3, [](zero::comm::Local& c) {
      std::vector<float> buf(c.rank() == 2 ? 4096 : 1024, 1.0f);
      c.all_reduce(buf.data(), buf.size(), DType::f32);
    });
    for (const auto& m : messages)
      CHECK_THAT(m, Catch::Contains("rank 2 called all_reduce(4096 x fp32, sum) while rank 0 called all_reduce(1024 x fp32, sum)"));
  }
  SECTION("different element types") {
    const auto messages = comm_errors(2, [](zero::comm::Local& c) {
      std::vector<double> buf(1000, 1.0);
      c.all_reduce(buf.data(), buf.size(), c.rank() == 0 ? DType::f64 : DType::bf16);
    });
    for (const auto& m : messages)
      CHECK_THAT(m, Catch::Contains("rank 1 called all_reduce(1000 x bf16, sum) while rank 0 called all_reduce(1000 x f64, sum)"));
  }
  SECTION("different operations, roots, and a barrier against a collective") {
    auto messages = comm_errors(2, [](zero::comm::Local& c) {
      float x = 1.0f;
      c.all_reduce(&x, 1, DType::f32, c.rank() == 0 ? ReduceOp::sum : ReduceOp::max);
    });
    for (const auto& m : messages) CHECK_THAT(m, Catch::Contains("rank 1 called all_reduce(1 x fp32, max)"));
    messages = comm_errors(3, [](zero::comm::Local& c) {
      std::vector<float> buf(8);
      c.broadcast(buf.data(), buf.size(), DType::f32, c.rank() == 1 ? 1 : 0);
    });
    for (const auto& m : messages) CHECK_THAT(m, Catch::Contains("rank 1 called broadcast(8 x fp32, root 1)"));
    messages = comm_errors(2, [](zero::comm::Local& c) {
      std::vector<float> buf(8);
      c.barrier();  // matched
      if (c.rank() == 0)
        c.barrier();
      else
        c.all_reduce(buf.data(), buf.size(), DType::f32);
    });
    for (const auto& m : messages)
      CHECK_THAT(m, Catch::Contains("rank 1 called all_reduce(8 x fp32, sum) while rank 0 called barrier()"));
  }
}

TEST_CASE("comm::Local turns a rank missing from a collective into a timeout error", "[comm][local][errors]") {
  const auto messages = comm_errors(3, [](zero::comm::Local& c) {
    std::vector<float> buf(256, 1.0f);
    c.all_reduce(buf.data(), buf.size(), DType::f32);
    // Rank 2 stops calling (without leaving: that is reported at once) past the timeout.
    if (c.rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    const zero::comm::ApiCall call("step");
    if (c.rank() != 2) c.all_reduce(buf.data(), buf.size(), DType::f32);
  });
  CHECK_THAT(messages[0], Catch::Contains("waited more than 2000 ms in all_reduce in step()"));
  CHECK_THAT(messages[1], Catch::Contains("waited more than 2000 ms in all_reduce in step()"));
  CHECK(messages[2].empty());
}

TEST_CASE("Streamed (non-temporal) outputs hold the same bits at any alignment", "[comm][local]") {
  // Local streams the outputs of collectives larger than the cache; here the
  // reduction and the copy are asked to stream directly, with outputs at
  // offsets that share their misalignment and ones that do not.
  const std::size_t count = 4099;
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    const std::size_t b = zero::dtype_bytes(t);
    std::vector<std::vector<unsigned char>> inputs;
    for (int r = 0; r < 3; ++r) inputs.push_back(make_input(t, count, r));
    const auto sum = reference(t, inputs, 0, count, ReduceOp::sum);
    for (std::size_t shift0 : {std::size_t{0}, b, 7 * b}) {
      for (std::size_t shift1 : {shift0, shift0 + b}) {
        CAPTURE(zero::dtype_name(t), shift0, shift1);
        std::vector<unsigned char> out0(count * b + 64 + shift0), out1(count * b + 64 + shift1);
        void* const outputs[2] = {out0.data() + shift0, out1.data() + shift1};
        const void* const ins[3] = {inputs[0].data(), inputs[1].data(), inputs[2].data()};
        zero::comm::detail::reduce(t, zero::comm::detail::ReduceArgs{outputs, 2, ins, 3, 0, count, true}, ReduceOp::sum);
        CHECK(std::memcmp(outputs[0], sum.data(), sum.size()) == 0);
        CHECK(std::memcmp(outputs[1], sum.data(), sum.size()) == 0);
        zero::comm::detail::copy(outputs, 2, inputs[2].data(), count * b, true);
        CHECK(std::memcmp(outputs[0], inputs[2].data(), count * b) == 0);
        CHECK(std::memcmp(outputs[1], inputs[2].data(), count * b) == 0);
      }
    }
    // In place (every output is an input), asked to stream: plain stores
    // (the lines were just read), the same bits.
    CAPTURE(zero::dtype_name(t));
    std::vector<std::vector<unsigned char>> buffers = inputs;
    void* const in_place[3] = {buffers[0].data(), buffers[1].data(), buffers[2].data()};
    zero::comm::detail::reduce(t, zero::comm::detail::ReduceArgs{in_place, 3, in_place, 3, 0, count, true}, ReduceOp::sum);
    for (const auto& buffer : buffers) CHECK(buffer == sum);
  }
}

namespace {

// One rank with a device stream, as comm::LocalDevice and comm::Nccl have.
class StreamedRank {
 public:
  explicit StreamedRank(void* stream) : stream_(stream) {}
  int rank() const { return 0; }
  int size() const { return 1; }
  void all_reduce(void*, std::size_t, DType, ReduceOp, bool) {}
  void reduce_scatter(const void*, void*, std::size_t, DType) {}
  void all_gather(const void*, void*, std::size_t, DType, bool) {}
  void broadcast(void*, std::size_t, DType, int) {}
  void barrier() {}
  const zero::comm::ByteCounters& counters() const { return counters_; }
  void reset_counters() {}
  void* stream() const { return stream_; }

 private:
  void* stream_;
  zero::comm::ByteCounters counters_;
};

}  // namespace

TEST_CASE("AnyCommunicator keeps the device stream, also around an AnyCommunicator", "[comm]") {
  // The optimizer overlaps communication on the communicator's stream
  // (stream_handle()); a trainer that erases its communicator before handing
  // it to the optimizer must not lose it.
  int marker = 0;
  StreamedRank streamed(&marker);
  const auto once = zero::comm::AnyCommunicator::wrap(streamed);
  CHECK(once->stream_handle() == &marker);
  const auto twice = zero::comm::AnyCommunicator::wrap(*once);
  CHECK(twice->stream_handle() == &marker);
  zero::comm::LocalGroup(1).run([](zero::comm::Local& c) {  // a host communicator has none
    CHECK(zero::comm::AnyCommunicator::wrap(*zero::comm::AnyCommunicator::wrap(c))->stream_handle() == nullptr);
  });
}

TEST_CASE("comm::Local names the library call each rank was in when their calls differ", "[comm][local][errors]") {
  const auto messages = comm_errors(2, [](zero::comm::Local& c) {
    std::uint64_t word = 7, words[2] = {};
    std::vector<float> send(2048), recv(1024);
    if (c.rank() == 0) {
      const zero::comm::ApiCall call("save");
      const zero::comm::ApiCall inner("set_param");  // the outermost call is named: the one the user made
      c.all_gather(&word, words, 1, DType::u64);
    } else {
      const zero::comm::ApiCall call("step");
      c.reduce_scatter(send.data(), recv.data(), 1024, DType::f32);
    }
  });
  for (const auto& m : messages)
    CHECK_THAT(m, Catch::Contains("rank 1 called reduce_scatter(1024 x fp32) in step() while rank 0 called "
                                  "all_gather(1 x u64) in save()"));
  // Scopes nest (the outermost names the call) and put the name back.
  CHECK(zero::comm::ApiCall::current() == nullptr);
  {
    const zero::comm::ApiCall outer("load_hf");
    {
      const zero::comm::ApiCall inner("set_param");
      CHECK(std::string(zero::comm::ApiCall::current()) == "load_hf");
    }
    CHECK(std::string(zero::comm::ApiCall::current()) == "load_hf");
  }
  CHECK(zero::comm::ApiCall::current() == nullptr);
}

TEST_CASE("comm::Local fails the collectives that wait for a rank that returned or threw at once", "[comm][local][errors]") {
  // A timeout far longer than the test may take: what ends the wait is the
  // rank leaving, not the timeout.
  zero::comm::LocalGroup::Options o;
  o.timeout = std::chrono::minutes(2);
  zero::comm::LocalGroup group(3, o);
  std::vector<std::string> messages(3);
  const auto started = std::chrono::steady_clock::now();
  SECTION("a rank that returns") {
    group.run([&](zero::comm::Local& c) {
      try {
        c.barrier();
        if (c.rank() == 1) return;  // skips the step the others make
        const zero::comm::ApiCall call("step");
        float x = 1.0f;
        c.all_reduce(&x, 1, DType::f32);
      } catch (const zero::CommError& e) {
        messages[static_cast<std::size_t>(c.rank())] = e.what();
      }
    });
    CHECK_THAT(messages[0], Catch::Contains("comm::Local: rank 1 returned while rank 0 waits in all_reduce in step()"));
    CHECK_THAT(messages[2], Catch::Contains("comm::Local: rank 1 returned while rank 2 waits in all_reduce in step()"));
    CHECK_THAT(messages[0], Catch::Contains("same collective calls in the same order"));
    CHECK(messages[1].empty());
  }
  SECTION("a rank that throws, before or after the others wait") {
    for (const bool before : {false, true}) {
      const auto threw = [&] {
        group.run([&](zero::comm::Local& c) {
          if (c.rank() == 1) {
            if (!before) std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the others wait already
            throw std::runtime_error("bad batch on rank 1");
          }
          if (before) std::this_thread::sleep_for(std::chrono::milliseconds(50));  // rank 1 has left already
          try {
            const zero::comm::ApiCall call("finalize");
            c.barrier();
          } catch (const zero::CommError& e) {
            messages[static_cast<std::size_t>(c.rank())] = e.what();
          }
        });
      };
      CHECK_THROWS_WITH(threw(), "bad batch on rank 1");  // the first exception, rethrown by run()
      CHECK_THAT(messages[0], Catch::Contains("comm::Local: rank 1 left (threw: bad batch on rank 1) while rank 0 "
                                              "waits in barrier in finalize()"));
      CHECK_THAT(messages[2], Catch::Contains("rank 1 left (threw: bad batch on rank 1) while rank 2 waits"));
    }
  }
  SECTION("ranks that all return after their last collective are no error") {
    REQUIRE_NOTHROW(group.run([&](zero::comm::Local& c) {
      c.barrier();
      if (c.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the others have returned
    }));
    // and the group runs again
    REQUIRE_NOTHROW(group.run([&](zero::comm::Local& c) { c.barrier(); }));
  }
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(30));
}

TEST_CASE("comm::Local on simulated nodes: bytes across nodes, and the node and across communicators", "[comm][local][topology]") {
  // The counting rule (comm/topology.hpp): in a ring in rank order, rank r's
  // sends cross nodes exactly when r is the last rank of its node. The split
  // communicators hold the right ranks: a sum over node() is the node's
  // ranks' sum, over across() that of the ranks at the same place on every node.
  for (const auto& shape : {std::pair{2, 1}, {4, 2}, {8, 2}, {8, 4}, {4, 4}}) {
    const int ranks = shape.first, per_node = shape.second;  // (Clang 14 captures no structured binding)
    CAPTURE(ranks, per_node);
    zero::comm::LocalGroup::Options o;
    o.ranks_per_node = per_node;
    zero::comm::LocalGroup group(ranks, o);
    const int nodes = ranks / per_node;
    std::vector<zero::comm::ByteCounters> flat(static_cast<std::size_t>(ranks)), node(flat), across(flat);
    std::vector<double> node_sums(flat.size()), across_sums(flat.size());
    group.run([&](zero::comm::Local& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      std::vector<float> send(1000 * static_cast<std::size_t>(ranks), 1.0f), recv(1000);
      c.reduce_scatter(send.data(), recv.data(), 1000, DType::f32);
      c.all_gather(recv.data(), send.data(), 1000, DType::f32);
      flat[r] = c.counters();
      double x = c.rank() + 1;
      c.node().all_reduce(&x, 1, DType::f64);
      node_sums[r] = x;
      x = c.rank() + 1;
      c.across().all_reduce(&x, 1, DType::f64);
      across_sums[r] = x;
      std::vector<float> part(64 * static_cast<std::size_t>(c.node().size()));
      c.node().all_gather(part.data() + 64 * static_cast<std::size_t>(c.node().rank()), part.data(), 64, DType::f32);
      node[r] = c.node().counters();
      across[r] = c.across().counters();
    });
    std::uint64_t across_total = 0;
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      const auto i = static_cast<std::size_t>(r);
      const bool last_of_node = r % per_node == per_node - 1;
      const std::uint64_t ring = 2 * zero::comm::ByteCounters::ring_share(1000 * 4 * static_cast<std::uint64_t>(ranks), ranks);
      CHECK(flat[i].total_sent() == ring);
      CHECK(flat[i].total_across() == (nodes > 1 && last_of_node ? ring : 0));
      across_total += flat[i].total_across();
      // node(): ranks [node * per_node, node * per_node + per_node) summed
      const int first = r / per_node * per_node;
      CHECK(node_sums[i] == per_node * (first + 1) + per_node * (per_node - 1) / 2.0);
      // across(): ranks r % per_node + k * per_node summed
      double want = 0;
      for (int k = 0; k < nodes; ++k) want += r % per_node + k * per_node + 1;
      CHECK(across_sums[i] == want);
      CHECK(node[i].total_across() == 0);  // inside a node nothing crosses
      CHECK(node[i].calls[static_cast<std::size_t>(zero::comm::Collective::all_gather)] == 1);
      CHECK(across[i].total_across() == across[i].total_sent());  // across nodes everything does
      CHECK((nodes == 1 ? across[i].total_sent() == 0 : across[i].total_sent() > 0));
    }
    // Summed over ranks: one crossing link per node.
    CHECK(across_total == (nodes > 1 ? static_cast<std::uint64_t>(nodes) * 2 *
                                           zero::comm::ByteCounters::ring_share(1000 * 4 * static_cast<std::uint64_t>(ranks), ranks)
                                     : 0));
  }
}

TEST_CASE("comm::Local's node communicator fails at once when a rank of its node throws", "[comm][local][topology][errors]") {
  zero::comm::LocalGroup::Options o;
  o.timeout = std::chrono::minutes(2);
  o.ranks_per_node = 2;
  zero::comm::LocalGroup group(4, o);
  std::vector<std::string> messages(4);
  const auto started = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(group.run([&](zero::comm::Local& c) {
    auto& node = c.node();
    if (c.rank() == 3) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // rank 2 waits already
      throw std::runtime_error("bad batch on rank 3");
    }
    try {
      node.barrier();
    } catch (const zero::CommError& e) {
      messages[static_cast<std::size_t>(c.rank())] = e.what();
    }
  }), "bad batch on rank 3");
  CHECK(messages[0].empty());  // node 0 is whole
  CHECK_THAT(messages[2], Catch::Contains("comm::Local (node communicator): rank 3 left (threw: bad batch on rank 3) "
                                          "while rank 2 waits in barrier"));
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(30));
  // A setting that does not divide the ranks into nodes names itself.
  zero::comm::LocalGroup::Options bad;
  bad.ranks_per_node = 3;
  CHECK_THROWS_WITH(zero::comm::LocalGroup(4, bad),
                    Catch::Contains("comm::LocalGroup::Options::ranks_per_node is 3, which does not divide 4 ranks"));
  // Erased, a communicator keeps its topology and splits; one without
  // node() and across() is one node and says it cannot split.
  group.run([](zero::comm::Local& c) {
    const auto erased = zero::comm::AnyCommunicator::wrap(c);
    CHECK(erased->topology() == c.topology());
    CHECK(erased->node().size() == 2);
    CHECK(erased->across().rank() == c.rank() / 2);
  });
  int marker = 0;
  StreamedRank streamed(&marker);
  const auto erased = zero::comm::AnyCommunicator::wrap(streamed);
  CHECK(erased->topology().nodes() == 1);
  CHECK_THROWS_WITH(erased->node(), Catch::Contains("this communicator has no node() and across()"));
}

TEST_CASE("comm::Local gathers u8 payloads byte for byte and refuses to reduce them", "[comm][local]") {
  zero::comm::LocalGroup group(3);
  std::vector<std::vector<unsigned char>> got(3);
  std::vector<std::string> refused(3);
  group.run([&](zero::comm::Local& c) {
    std::vector<unsigned char> mine(13), all(39);
    for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = static_cast<unsigned char>(31 * c.rank() + 7 * i + 200);
    c.all_gather(mine.data(), all.data(), mine.size(), DType::u8);
    got[static_cast<std::size_t>(c.rank())] = all;
    try {
      c.all_reduce(all.data(), all.size(), DType::u8);
    } catch (const zero::InvalidArgument& e) {
      refused[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  for (int r = 0; r < 3; ++r) {
    for (int s = 0; s < 3; ++s)
      for (std::size_t i = 0; i < 13; ++i)
        CHECK(got[r][13 * s + i] == static_cast<unsigned char>(31 * s + 7 * i + 200));
    CHECK_THAT(refused[r], Catch::Contains("a reduction (all_reduce or reduce_scatter) of DType::u8"));
  }
  CHECK(zero::dtype_bytes(DType::u8) == 1);
}

namespace {

// Element i of the block that rank `sender` sends to rank `to`, as the bytes
// of type `t`: distinct per (sender, to) for up to 8 ranks, so a block that
// lands in the wrong place (or from the wrong rank) shows.
void put_element(DType t, unsigned char* p, int sender, int to, std::size_t i) {
  switch (t) {
    case DType::f32: {
      const float v = static_cast<float>(1000 * sender + 10 * to) + static_cast<float>(i);
      std::memcpy(p, &v, 4);
      break;
    }
    case DType::bf16: {  // raw bits: exponent never all ones, so never a NaN
      const auto v = static_cast<std::uint16_t>((sender << 10) | (to << 6) | static_cast<int>(i % 64));
      std::memcpy(p, &v, 2);
      break;
    }
    case DType::u8: *p = static_cast<unsigned char>(29 * sender + 7 * to + 3 * static_cast<int>(i) + 200); break;
    default: FAIL("put_element: no pattern for " << zero::dtype_name(t));
  }
}

// `ranks` blocks of `count` elements, block k holding the pattern that
// put_element gives from sender pair(k).first to receiver pair(k).second.
template <class Pair>
std::vector<unsigned char> pattern_blocks(DType t, std::size_t count, int ranks, Pair pair) {
  const std::size_t b = zero::dtype_bytes(t);
  std::vector<unsigned char> blocks(static_cast<std::size_t>(ranks) * count * b);
  for (int k = 0; k < ranks; ++k)
    for (std::size_t i = 0; i < count; ++i)
      put_element(t, blocks.data() + (static_cast<std::size_t>(k) * count + i) * b, pair(k).first, pair(k).second, i);
  return blocks;
}

// Rank `rank`'s send buffer of an all_to_all of `count` elements over `ranks`.
std::vector<unsigned char> all_to_all_send(DType t, std::size_t count, int rank, int ranks) {
  return pattern_blocks(t, count, ranks, [rank](int j) { return std::pair{rank, j}; });
}

// What rank `rank` must receive: block i from rank i, that rank's block `rank`.
std::vector<unsigned char> all_to_all_want(DType t, std::size_t count, int rank, int ranks) {
  return pattern_blocks(t, count, ranks, [rank](int s) { return std::pair{s, rank}; });
}

constexpr auto a2a = static_cast<std::size_t>(zero::comm::Collective::all_to_all);

}  // namespace

TEST_CASE("comm::Local all_to_all sends block j to rank j, and counts a direct exchange", "[comm][local][all_to_all]") {
  for (int ranks : {1, 2, 3, 4, 8}) {
    // Two simulated nodes or more where the ranks pair up: the blocks for the
    // other nodes' ranks cross, those for the own node's do not.
    const int per_node = ranks >= 4 ? 2 : ranks;
    for (DType t : {DType::f32, DType::u8, DType::bf16}) {
      for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}}) {
        CAPTURE(ranks, per_node, zero::dtype_name(t), count);
        const std::size_t b = zero::dtype_bytes(t), block = count * b;
        const std::size_t canary = 16;  // bytes after recv that nobody may write
        zero::comm::LocalGroup::Options o;
        o.ranks_per_node = per_node;
        zero::comm::LocalGroup group(ranks, o);
        std::vector<std::vector<unsigned char>> got(static_cast<std::size_t>(ranks));
        std::vector<zero::comm::ByteCounters> counters(got.size());
        group.run([&](zero::comm::Local& c) {
          const auto r = static_cast<std::size_t>(c.rank());
          const auto send = all_to_all_send(t, count, c.rank(), ranks);
          got[r].assign(send.size() + canary, 0xEE);
          c.all_to_all(send.data(), got[r].data(), count, t);
          counters[r] = c.counters();
        });
        std::uint64_t across_total = 0;
        for (int r = 0; r < ranks; ++r) {
          CAPTURE(r);
          const auto i = static_cast<std::size_t>(r);
          const auto want = all_to_all_want(t, count, r, ranks);
          CHECK(std::vector<unsigned char>(got[i].begin(), got[i].begin() + static_cast<std::ptrdiff_t>(want.size())) ==
                want);
          CHECK(std::vector<unsigned char>(got[i].begin() + static_cast<std::ptrdiff_t>(want.size()), got[i].end()) ==
                std::vector<unsigned char>(canary, 0xEE));
          // b(N-1) each way; of the sends, the blocks for the N - per_node ranks on other nodes cross.
          CHECK(counters[i].sent[a2a] == block * static_cast<std::uint64_t>(ranks - 1));
          CHECK(counters[i].received[a2a] == block * static_cast<std::uint64_t>(ranks - 1));
          CHECK(counters[i].across[a2a] == block * static_cast<std::uint64_t>(ranks - per_node));
          CHECK(counters[i].calls[a2a] == 1);
          CHECK(counters[i].total_sent() == counters[i].sent[a2a]);  // counted under all_to_all only
          CHECK(counters[i].total_across() == counters[i].across[a2a]);
          across_total += counters[i].across[a2a];
        }
        // Summed over the ranks: every block between two nodes, once.
        CHECK(across_total == block * static_cast<std::uint64_t>(ranks) * static_cast<std::uint64_t>(ranks - per_node));
      }
    }
  }
}

TEST_CASE("comm::Local all_to_all in the node and across communicators", "[comm][local][all_to_all][topology]") {
  // node(): the ranks of one node, nothing crosses; across(): one rank per
  // node, everything does.
  for (const auto& shape : {std::pair{4, 2}, {8, 2}, {8, 4}, {4, 4}, {4, 1}}) {
    const int ranks = shape.first, per_node = shape.second;  // (Clang 14 captures no structured binding)
    const int nodes = ranks / per_node;
    const std::size_t count = 7;
    for (DType t : {DType::f32, DType::u8}) {
      CAPTURE(ranks, per_node, zero::dtype_name(t));
      const std::size_t block = count * zero::dtype_bytes(t);
      zero::comm::LocalGroup::Options o;
      o.ranks_per_node = per_node;
      zero::comm::LocalGroup group(ranks, o);
      std::vector<std::vector<unsigned char>> node_got(static_cast<std::size_t>(ranks)), across_got(node_got);
      std::vector<zero::comm::ByteCounters> node(node_got.size()), across(node_got.size());
      group.run([&](zero::comm::Local& c) {
        const auto r = static_cast<std::size_t>(c.rank());
        zero::comm::Local& in_node = c.node();
        zero::comm::Local& over = c.across();
        auto send = all_to_all_send(t, count, in_node.rank(), in_node.size());
        node_got[r].assign(send.size(), 0);
        in_node.all_to_all(send.data(), node_got[r].data(), count, t);
        send = all_to_all_send(t, count, over.rank(), over.size());
        across_got[r].assign(send.size(), 0);
        over.all_to_all(send.data(), across_got[r].data(), count, t);
        node[r] = in_node.counters();
        across[r] = over.counters();
      });
      for (int r = 0; r < ranks; ++r) {
        CAPTURE(r);
        const auto i = static_cast<std::size_t>(r);
        CHECK(node_got[i] == all_to_all_want(t, count, r % per_node, per_node));
        CHECK(across_got[i] == all_to_all_want(t, count, r / per_node, nodes));
        CHECK(node[i].sent[a2a] == block * static_cast<std::uint64_t>(per_node - 1));
        CHECK(node[i].received[a2a] == node[i].sent[a2a]);
        CHECK(node[i].across[a2a] == 0);
        CHECK(node[i].calls[a2a] == 1);
        CHECK(across[i].sent[a2a] == block * static_cast<std::uint64_t>(nodes - 1));
        CHECK(across[i].received[a2a] == across[i].sent[a2a]);
        CHECK(across[i].across[a2a] == across[i].sent[a2a]);
        CHECK(across[i].calls[a2a] == 1);
      }
    }
  }
}

TEST_CASE("comm::Local all_to_all refuses overlapping buffers and names a mismatched call", "[comm][local][all_to_all][errors]") {
  zero::comm::LocalGroup group(3);
  std::vector<std::string> refused(3), apart(3);
  group.run([&](zero::comm::Local& c) {
    std::vector<float> buf(2 * 3 * 5);
    try {
      c.all_to_all(buf.data(), buf.data() + 5, 5, DType::f32);  // recv starts inside send
    } catch (const zero::InvalidArgument& e) {
      refused[static_cast<std::size_t>(c.rank())] = e.what();
    }
    try {
      c.all_to_all(buf.data(), buf.data(), 5, DType::f32);  // "in place"
    } catch (const zero::InvalidArgument& e) {
      apart[static_cast<std::size_t>(c.rank())] = e.what();
    }
    c.all_to_all(buf.data(), buf.data() + 15, 5, DType::f32);  // adjacent halves: apart
    c.all_to_all(buf.data(), buf.data(), 0, DType::f32);       // nothing to overlap
  });
  for (int r = 0; r < 3; ++r) {
    CHECK_THAT(refused[r], Catch::Contains("comm::Local: all_to_all's send and recv buffers overlap (60 bytes each, "
                                           "recv starts 20 bytes after the other)"));
    CHECK_THAT(refused[r], Catch::Contains("no in-place form: pass a recv buffer apart from send"));
    CHECK_THAT(apart[r], Catch::Contains("send and recv buffers overlap"));
  }
  const auto messages = comm_errors(2, [](zero::comm::Local& c) {
    std::vector<float> send(14), recv(14);
    const zero::comm::ApiCall call("step");
    if (c.rank() == 0)
      c.all_to_all(send.data(), recv.data(), 7, DType::f32);
    else
      c.all_gather(send.data(), recv.data(), 7, DType::f32);
  });
  for (const auto& m : messages)
    CHECK_THAT(m, Catch::Contains("rank 1 called all_gather(7 x fp32) in step() while rank 0 called "
                                  "all_to_all(7 x fp32) in step()"));
}

TEST_CASE("ByteCounters and messages know all_to_all", "[comm][all_to_all]") {
  using zero::comm::Collective;
  CHECK(zero::comm::collective_kinds == 6);
  CHECK(std::string(zero::comm::collective_name(Collective::all_to_all)) == "all_to_all");
  CHECK(std::string(zero::comm::collective_name(Collective::control)) == "control");
  CHECK(zero::comm::describe_collective("all_to_all", 3, 7, DType::u8) == "all_to_all #3 (7 elements of u8 per rank)");
  // 8 ranks on 2 nodes of 4: 7 blocks out, 4 of them to the other node.
  zero::comm::ByteCounters c;
  c.count_all_to_all(100, zero::comm::Topology{8, 4}, 5);
  CHECK(c.sent[a2a] == 700);
  CHECK(c.received[a2a] == 700);
  CHECK(c.across[a2a] == 400);
  CHECK(c.calls[a2a] == 1);
  c.count_all_to_all(100, zero::comm::Topology::one_node(8), 0);
  CHECK(c.across[a2a] == 400);
  CHECK(c.sent[a2a] == 1400);
  // add(): all of a collective's sends cross, or none, as before.
  c.add(Collective::broadcast, 10, 10, true);
  c.add(Collective::broadcast, 10, 10);
  CHECK(c.across[static_cast<std::size_t>(Collective::broadcast)] == 10);
  c.add_with_across(Collective::all_reduce, 10, 10, 3);
  CHECK(c.across[static_cast<std::size_t>(Collective::all_reduce)] == 3);
  CHECK(c.total_across() == 413);
}

namespace {

// A communicator of the contract's required calls and all_to_all,
// counting what it was asked (one rank: recv is send).
class ExchangingRank : public StreamedRank {
 public:
  ExchangingRank() : StreamedRank(nullptr) {}
  void all_to_all(const void* send, void* recv, std::size_t count, DType t) {
    std::memcpy(recv, send, count * zero::dtype_bytes(t));
    ++exchanges;
  }
  int exchanges = 0;
};

}  // namespace

TEST_CASE("AnyCommunicator forwards all_to_all, and refuses it for a communicator without one", "[comm][all_to_all]") {
  ExchangingRank exchanging;
  const float send[3] = {1.0f, 2.0f, 3.0f};
  float recv[3] = {};
  const auto once = zero::comm::AnyCommunicator::wrap(exchanging);
  const auto twice = zero::comm::AnyCommunicator::wrap(*once);
  twice->all_to_all(send, recv, 3, DType::f32);
  CHECK(exchanging.exchanges == 1);
  CHECK(recv[2] == 3.0f);
  // Over real ranks, with the counters read through the erasure (node() too).
  zero::comm::LocalGroup::Options o;
  o.ranks_per_node = 2;
  zero::comm::LocalGroup group(4, o);
  std::vector<std::vector<unsigned char>> got(4);
  std::vector<zero::comm::ByteCounters> counters(4), with_splits(4);
  group.run([&](zero::comm::Local& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const auto erased = zero::comm::AnyCommunicator::wrap(c);
    const auto mine = all_to_all_send(DType::bf16, 7, c.rank(), 4);
    got[r].assign(mine.size(), 0);
    erased->all_to_all(mine.data(), got[r].data(), 7, DType::bf16);
    counters[r] = erased->counters();
    std::vector<unsigned char> node_send(2 * 7 * 2), node_recv(node_send.size());
    erased->node().all_to_all(node_send.data(), node_recv.data(), 7, DType::bf16);
    with_splits[r] = erased->counters_with_splits();
  });
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(got[r] == all_to_all_want(DType::bf16, 7, r, 4));
    CHECK(counters[r].sent[a2a] == 3 * 14);
    CHECK(counters[r].across[a2a] == 2 * 14);
    CHECK(with_splits[r].sent[a2a] == 3 * 14 + 14);
    CHECK(with_splits[r].calls[a2a] == 2);
  }
  // StreamedRank has the required calls only.
  StreamedRank plain(nullptr);
  const auto erased = zero::comm::AnyCommunicator::wrap(plain);
  CHECK_THROWS_AS(erased->all_to_all(send, recv, 3, DType::f32), zero::InvalidArgument);
  CHECK_THROWS_WITH(erased->all_to_all(send, recv, 3, DType::f32),
                    Catch::Contains("this communicator type does not provide all_to_all(send, recv, count, dtype), "
                                    "which Options::qgz") &&
                        Catch::Contains("or turn Options::qgz off"));
}
