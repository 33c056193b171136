// Why: 8-bit block-wise optimizer state (Options::states = blockwise8) is
// quantized per block of a parameter, so where the blocks fall has to be
// decided once, from the layout, and agreed on by the step, imports,
// exports and the memory report. The rule, as bitsandbytes applies it to a
// tensor: a parameter's blocks start at its first element, every
// Options::state_block elements; parameters under Options::state_fp32_below
// elements (biases, norms), alignment gaps and shard padding keep fp32
// state. A rank owns a contiguous range of every unit (ownership.hpp), which
// may start or end inside a block: that block is cut there, and each rank
// keeps its piece as a block of its own (one absmax each). So the blocks of
// stages 1-3 are the same at one rank count, and stage 0's (whole units) are
// those of one rank; a different rank count cuts a few blocks elsewhere,
// which a checkpoint's conversion on load handles (docs/lean-states.md).
//
// Coordinates are the state store's owned elements (state_store.hpp). The
// owned range is cut into runs, each stored one way: a blockwise run's codes
// are packed with the other blockwise runs' (one byte per element) and its
// blocks' absmax likewise; an fp32 run's values are packed with the other
// fp32 runs'. No run crosses a unit, so a unit's update is whole runs.
#pragma once

#include "zero/config.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "zero/engine/layout.hpp"
#include "zero/engine/ownership.hpp"
#include "zero/error.hpp"
#include "zero/quant/dynamic_code.hpp"

namespace zero {

struct StateRun {
  std::size_t begin = 0;   // first owned element
  std::size_t length = 0;  // elements
  bool blockwise = false;
  std::size_t at = 0;              // the run's first value in its packed array (codes, or fp32 values)
  std::size_t first_block = 0;     // blockwise: its first block's absmax in the packed absmax
  std::uint32_t phase = 0;         // blockwise: elements of its first block before the run starts
  std::size_t blocks = 0;          // blockwise: absmax values

  std::size_t end() const { return begin + length; }
};

class StateBlocks {
 public:
  StateBlocks() = default;

  // The runs of this rank's owned elements (layout finalized).
  static StateBlocks build(const Ownership& own, std::size_t block, std::size_t fp32_below) {
    require(block >= 1, "StateBlocks: a block of 0 elements");
    StateBlocks s;
    s.block_ = block;
    const Layout& layout = *own.layout;
    for (const UnitInfo& u : layout.units()) {
      const std::size_t first = own.update_begin(u), last = first + own.update_size(u);  // unit coordinates
      const std::size_t base = own.state_offset(u);
      std::size_t cursor = first;
      auto plain = [&](std::size_t until) {
        if (until > cursor) s.add_plain(base + (cursor - first), until - cursor);
        cursor = std::max(cursor, until);
      };
      for (std::size_t p : u.params) {
        const ParamInfo& param = layout.params()[p];
        if (param.numel < fp32_below) continue;
        const std::size_t lo = std::max(param.offset, first), hi = std::min(param.offset + param.numel, last);
        if (lo >= hi) continue;
        plain(lo);
        s.add_blockwise(base + (lo - first), hi - lo, static_cast<std::uint32_t>((lo - param.offset) % block));
        cursor = hi;
      }
      plain(last);
    }
    return s;
  }

  std::size_t block() const { return block_; }
  const std::vector<StateRun>& runs() const { return runs_; }
  std::size_t coded_elements() const { return coded_; }  // one byte each per slot
  std::size_t blocks() const { return blocks_; }         // one fp32 absmax each per slot
  std::size_t fp32_elements() const { return fp32_; }    // four bytes each per slot
  // Bytes of one state slot.
  std::uint64_t slot_bytes() const {
    return static_cast<std::uint64_t>(coded_) + 4 * static_cast<std::uint64_t>(blocks_) +
           4 * static_cast<std::uint64_t>(fp32_);
  }

  // The runs that overlap owned elements [offset, offset + n), in order.
  template <class Visit>
  void each_run(std::size_t offset, std::size_t n, Visit&& visit) const {
    auto it = std::upper_bound(runs_.begin(), runs_.end(), offset,
                               [](std::size_t o, const StateRun& r) { return o < r.end(); });
    for (; it != runs_.end() && it->begin < offset + n; ++it) visit(*it);
  }

 private:
  void add_plain(std::size_t begin, std::size_t length) {
    runs_.push_back(StateRun{begin, length, false, fp32_, 0, 0, 0});
    fp32_ += length;
  }
  void add_blockwise(std::size_t begin, std::size_t length, std::uint32_t phase) {
    const std::size_t blocks = quant::PhasedBlocks{length, block_, phase}.count();
    runs_.push_back(StateRun{begin, length, true, coded_, blocks_, phase, blocks});
    coded_ += length;
    blocks_ += blocks;
  }

  std::size_t block_ = 0;
  std::vector<StateRun> runs_;
  std::size_t coded_ = 0, blocks_ = 0, fp32_ = 0;
};

}  // namespace zero
