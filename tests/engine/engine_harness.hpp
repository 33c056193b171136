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

// The equivalence criterion of the ZeRO design (see reference.hpp).
template <class ParamT>
inline void require_equivalent(const RunResult& got, const RunResult& want) {
  REQUIRE(got.masters.size() == want.masters.size());
  const Mismatch m = mismatch<ParamT>(got, want);
  CHECK(m.master_relative <= 1e-5);
  CHECK(m.param_ulps <= 1);
}

}  // namespace zero::test
