// Why: which elements of a unit this rank updates, and where they sit in
// each buffer, is the one piece of arithmetic every part of the engine (and
// the checkpoint layer) shares: stage 0 updates every unit whole, stages 1-3
// this rank's shard; the parameters and gradients keep the whole unit or
// only the shard, according to the stage. Named once here, from the stage
// as a value (StageRules), so no caller re-derives it.
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>

#include "zero/engine/layout.hpp"
#include "zero/engine/stage_rules.hpp"

namespace zero {

struct Ownership {
  StageRules rules{};
  std::size_t rank = 0;
  const Layout* layout = nullptr;

  // The range of unit u's elements this rank updates: its shard, or the
  // whole unit at stage 0 (every rank updates everything).
  std::size_t update_begin(const UnitInfo& u) const { return rules.states_sharded ? rank * u.shard : 0; }
  std::size_t update_size(const UnitInfo& u) const { return rules.states_sharded ? u.shard : u.padded; }
  // Offset of that range in the state store's owned elements (the ranges
  // of every unit laid end to end).
  std::size_t state_offset(const UnitInfo& u) const { return rules.states_sharded ? u.shard_offset : u.full_offset; }
  // Elements this rank updates (the store's owned elements).
  std::size_t owned_total() const { return rules.states_sharded ? layout->shard_total() : layout->padded_total(); }
  // Offset of that range in the parameter buffer (the shard at stage 3, the
  // whole model otherwise) and in the gradient accumulator (the shard at
  // stages 2-3).
  std::size_t param_offset(const UnitInfo& u) const {
    return rules.params_sharded ? u.shard_offset : u.full_offset + update_begin(u);
  }
  std::size_t grad_offset(const UnitInfo& u) const {
    return rules.grads_sharded ? u.shard_offset : u.full_offset + update_begin(u);
  }
};

}  // namespace zero
