// Shared by the engine tests: a training loop that drives ZeroOptimizer
// exactly as a trainer would, and comparisons (Catch2). The model, the
// gradient generator and the single-process reference they are held to live
// in reference.hpp, which has no test framework.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "reference.hpp"
#include "zero/zero.hpp"

namespace zero::test {

// Runs `ranks` in-process ranks; returns rank 0's result (all ranks are
// checked to agree with it bit for bit).
template <class Opt>
RunResult train_local(int ranks, const typename Opt::Hyper& hyper, const Options& options, TrainSpec spec) {
  std::vector<RunResult> results(static_cast<std::size_t>(ranks));
  comm::LocalGroup group(ranks);
  group.run([&](comm::Local& c) { results[static_cast<std::size_t>(c.rank())] = train<Opt>(c, hyper, options, spec); });
  for (int r = 1; r < ranks; ++r) {
    REQUIRE(results[r].masters == results[0].masters);
    REQUIRE(std::memcmp(results[r].params.data(), results[0].params.data(), results[0].params.size() * 4) == 0);
  }
  return results[0];
}

// One optimizer type's choices, for TEMPLATE_LIST_TEST_CASE lists.
template <int S, class P, class O>
struct Config {
  static constexpr int stage = S;
  using Precision = P;
  using Optimizer = O;
};

// comm::Local that shows `seen` each collective and group boundary before
// running it: the tests' window onto what the engine launches, and when.
class WatchedLocal {
 public:
  enum class Event { all_reduce, reduce_scatter, all_gather, broadcast, all_to_all, group_begin, group_end };
  using Watcher = std::function<void(Event, std::size_t count, bool control)>;
  WatchedLocal(comm::Local& c, Watcher seen) : c_(c), seen_(std::move(seen)) {}

  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  void all_reduce(void* b, std::size_t n, DType t, comm::ReduceOp op, bool control) {
    seen_(Event::all_reduce, n, control);
    c_.all_reduce(b, n, t, op, control);
  }
  void reduce_scatter(const void* s, void* r, std::size_t n, DType t) {
    seen_(Event::reduce_scatter, n, false);
    c_.reduce_scatter(s, r, n, t);
  }
  void all_gather(const void* s, void* r, std::size_t n, DType t, bool control) {
    seen_(Event::all_gather, n, control);
    c_.all_gather(s, r, n, t, control);
  }
  void broadcast(void* b, std::size_t n, DType t, int root) {
    seen_(Event::broadcast, n, false);
    c_.broadcast(b, n, t, root);
  }
  void all_to_all(const void* s, void* r, std::size_t n, DType t) {
    seen_(Event::all_to_all, n, false);
    c_.all_to_all(s, r, n, t);
  }
  void barrier() { c_.barrier(); }
  const comm::ByteCounters& counters() const { return c_.counters(); }
  void reset_counters() { c_.reset_counters(); }
  void group_begin() { seen_(Event::group_begin, 0, false); }
  void group_end() { seen_(Event::group_end, 0, false); }

 private:
  comm::Local& c_;
  Watcher seen_;
};

// The equivalence criterion of the ZeRO design (see reference.hpp).
template <class ParamT>
inline void require_equivalent(const RunResult& got, const RunResult& want) {
  REQUIRE(got.masters.size() == want.masters.size());
  const Mismatch m = mismatch<ParamT>(got, want);
  CHECK(m.master_relative <= 1e-5);
  CHECK(m.param_ulps <= 1);
}

}  // namespace zero::test
