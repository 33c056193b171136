// Ranks that take different paths through the optimizer (a rank-dependent
// branch, an expert that received no tokens, generation that ends at
// different lengths) must all get a CommError naming each rank's exchange,
// and none may be handed mixed values: with two units of equal size, the
// collectives agree in kind and size, and a communicator that pairs them by
// size and order alone hands every rank half of one unit's shards and half of
// the other's. One body per scenario, run over comm::Local
// (test_engine_errors.cpp) and comm::Mpi (test_engine_mpi.cpp). Even ranks
// take one path, odd ranks the other. No test framework here: the callers
// check the outcomes (Catch2's assertions are not for rank threads).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "zero/zero.hpp"

namespace zero::test::divergence {

enum class Scenario {
  swapped_order,         // even ranks acquire unit a then b, odd ranks b then a
  one_more_acquire,      // odd ranks acquire a once more before all acquire b
  different_buckets,     // even ranks finish a's gradient first, odd ranks b's (one bucket each)
  step_while_gathering,  // after backward, even ranks step() while odd ranks acquire a
};
inline constexpr Scenario scenarios[] = {Scenario::swapped_order, Scenario::one_more_acquire,
                                         Scenario::different_buckets, Scenario::step_while_gathering};
inline const char* name(Scenario s) {
  switch (s) {
    case Scenario::swapped_order: return "units acquired in different orders";
    case Scenario::one_more_acquire: return "one rank acquires once more";
    case Scenario::different_buckets: return "different buckets reduced at once";
    case Scenario::step_while_gathering: return "a step on one rank while another gathers";
  }
  return "?";
}

// What one rank saw.
struct Outcome {
  std::string error;         // the CommError's message, or empty if none was thrown
  std::string other_error;   // any other exception's message
  std::vector<double> sums;  // the sum of each unit an acquire_unit() handed out (1024 or 2048 when unmixed)
};

inline constexpr std::size_t unit_elements = 1024;

// Units a (all 1.0) and b (all 2.0), equal in size.
template <class Opt>
void add_units(Opt& opt) {
  for (const char* name : {"a", "b"}) opt.add_param(opt.add_unit(name), std::string(name) + ".w", unit_elements);
}

template <class Comm>
Outcome run(Comm& c, Scenario scenario) {
  using Stage3 = ZeroOptimizer<precision::Full<float>, optim::Sgd, stage<3>, offload::None, backend::Host>;
  using Stage2 = ZeroOptimizer<precision::Full<float>, optim::Sgd, stage<2>, offload::None, backend::Host>;
  const bool odd = c.rank() % 2 == 1;
  const UnitId a{0}, b{1};
  Outcome out;
  auto acquire = [&](auto& opt, UnitId u) {
    const float* values = opt.acquire_unit(u);
    double sum = 0;
    for (std::size_t i = 0; i < unit_elements; ++i) sum += values[i];
    out.sums.push_back(sum);
    opt.release_unit(u);
  };
  // Both units' gradients (ones), in the given order.
  auto backward = [&](auto& opt, UnitId first, UnitId second) {
    for (UnitId u : {first, second}) {
      float* g = opt.grad_buffer(u);
      for (std::size_t i = 0; i < unit_elements; ++i) g[i] = 1.0f;
      opt.grad_ready(u);
    }
  };
  try {
    Options options;
    options.prefetch_units = 0;  // every acquire gathers: the exchanges are exactly the calls below
    // One unit per bucket: each unit's gradient is reduced as soon as it is ready.
    options.bucket_bytes = unit_elements * sizeof(float);
    if (scenario == Scenario::different_buckets) {
      Stage2 opt(c, {}, options);
      add_units(opt);
      opt.finalize();
      backward(opt, odd ? b : a, odd ? a : b);
      opt.step();
      return out;
    }
    Stage3 opt(c, {}, options);
    add_units(opt);
    opt.finalize();
    const std::vector<float> ones(unit_elements, 1.0f), twos(unit_elements, 2.0f);
    opt.set_param(ParamId{0}, ones.data());
    opt.set_param(ParamId{1}, twos.data());
    switch (scenario) {
      case Scenario::swapped_order:
        acquire(opt, odd ? b : a);
        acquire(opt, odd ? a : b);
        break;
      case Scenario::one_more_acquire:
        acquire(opt, a);
        if (odd) acquire(opt, a);
        acquire(opt, b);
        break;
      case Scenario::step_while_gathering:
        backward(opt, b, a);
        if (odd)
          acquire(opt, a);
        else
          opt.step();
        break;
      case Scenario::different_buckets: break;
    }
  } catch (const CommError& e) {
    out.error = e.what();
  } catch (const std::exception& e) {
    out.other_error = e.what();
  }
  return out;
}

// What every rank's message must name: each path's exchange.
inline std::vector<std::string> expected_words(Scenario scenario) {
  switch (scenario) {
    case Scenario::swapped_order: return {"gathers unit 'a'", "gathers unit 'b'", "in acquire_unit()"};
    case Scenario::one_more_acquire: return {"gathers unit 'a'", "gathers unit 'b'", "in acquire_unit()"};
    case Scenario::different_buckets:
      return {"reduce-scatters the gradient of unit 'a'", "reduce-scatters the gradient of unit 'b'",
              "in grad_ready()"};
    case Scenario::step_while_gathering:
      return {"all-reduces the step's gradient norm and checks", "in step()", "gathers unit 'a'",
              "in acquire_unit()"};
  }
  return {};
}

}  // namespace zero::test::divergence
