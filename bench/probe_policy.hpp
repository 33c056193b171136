// Why: the optimizer step is memory-bound, so its speed limit is the
// bandwidth of its own access pattern. This policy runs through the very same
// fused kernel (same arrays, element types, vector width, threads) but does
// trivial arithmetic, so its time is that limit measured in the same run: a
// ratio to it survives a noisy machine, where absolute times do not.
#pragma once

#include <cstdint>

#include "zero/compiler.hpp"

namespace zero::bench {

template <int Slots>
struct ProbePolicy {
  static constexpr const char* name = "probe";
  static constexpr int state_slots = Slots;
  struct Hyper {
    double lr = 0.0;
    void validate() const {}
  };
  struct Scalars {
    float lr;
  };
  static Scalars prepare(const Hyper& h, std::int64_t) { return Scalars{static_cast<float>(h.lr)}; }

  // Reads and writes every array the real rule does (the gradient too, even
  // with no state slots); one add each.
  template <class V>
  ZERO_HOST_DEVICE static void update(const Scalars& s, V& w, const V& g, V* state) {
    w = w + g;
    for (int k = 0; k < Slots; ++k) state[k] = state[k] + s.lr;
  }
};

}  // namespace zero::bench
