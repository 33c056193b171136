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

#include "zero/compiler.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "zero/engine/layout.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/detail/ownership.hpp"
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

// How many ways the ranks' owned ranges cut each unit, and so its 8-bit
// blocks: N ranks at stages 1-3 own a shard each; stage 0 (every rank
// updates whole units), or one rank, cuts none, so the blocks are the same
// whatever the rank count.
inline std::uint64_t block_cuts(std::uint64_t ranks, std::uint64_t stage) { return stage == 0 ? 1 : ranks; }

class StateBlocks {
 public:
  StateBlocks() = default;

  // The runs of this rank's owned elements (layout finalized). `block` is
  // Options::state_block, which Options::validate checks only with
  // blockwise8 states: checked here again, where it is divided by and where
  // the disk tier's chunks must hold a whole block, so that options made
  // for another format can never reach this arithmetic unchecked.
  static StateBlocks build(const Ownership& own, std::size_t block, std::size_t fp32_below) {
    require(allowed_state_block(block), "StateBlocks: Options::state_block is ", block, ", but 8-bit block-wise "
            "states need blocks of ", state_block_rule, " elements (2048 by default; Options::validate checks it only "
            "where Options::states is blockwise8)");
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
    for (auto it = run_holding(offset); it != runs_.end() && it->begin < offset + n; ++it) visit(*it);
  }

  // Where a piece of the owned elements that is updated on its own (a
  // chunk of the disk tier's window, offload/disk_state_store.hpp) may
  // begin at or before owned element e: the first element of the block
  // holding e, or e where no 8-bit block holds e past its first element.
  // A block is quantized with one absmax, from all its values, so it is
  // updated in one piece.
  std::size_t piece_start_at_or_before(std::size_t e) const {
    const auto it = run_holding(e);
    if (it == runs_.end() || !it->blockwise || e <= it->begin) return e;
    const quant::PhasedBlocks geometry = blocks_of(*it);
    return it->begin + geometry.begin(geometry.of(e - it->begin));
  }
  quant::PhasedBlocks blocks_of(const StateRun& run) const { return {run.length, block_, run.phase}; }

  // The 8-bit step over owned elements [offset, offset + args.n) (`Args`:
  // kernels::FusedStepArgs), one fused step per piece of a run (the run's
  // elements in the range): `args.part` of the piece with its block size
  // and its first block's phase set, handed to `step(args_of_piece, piece)`,
  // which points its state slots at the piece's codes and absmax, or fp32
  // values, and runs it. A block is quantized from all its values at once,
  // so a piece holds whole blocks: `who` names the store in the error where
  // an update cuts one.
  struct Piece {
    std::size_t begin = 0;        // first owned element
    bool blockwise = false;
    std::size_t at = 0;           // its first value in its packed array (codes, or fp32 values)
    std::size_t first_block = 0;  // blockwise: its first block's absmax in the packed absmax
  };
  template <class Args, class Step>
  void step_pieces(const char* who, std::size_t offset, const Args& args, Step&& step) const {
    each_run(offset, args.n, [&](const StateRun& run) {
      const std::size_t from = std::max(offset, run.begin), to = std::min(offset + args.n, run.end());
      const std::size_t into_run = from - run.begin;
      Args part = args.part(from - offset, to - from);
      part.block = static_cast<std::uint32_t>(block_);
      part.block_phase = static_cast<std::uint32_t>((run.phase + into_run) % block_);
      const bool whole_blocks = (into_run == 0 || part.block_phase == 0) &&
                                (to == run.end() || (run.phase + (to - run.begin)) % block_ == 0);
      require(!run.blockwise || whole_blocks, who, ": an update of owned elements [", offset, ", ", offset + args.n,
              ") cuts a block of the 8-bit state's run [", run.begin, ", ", run.end(), ") (blocks of ", block_,
              "); updates are whole units");
      const std::size_t first_block = run.blockwise ? run.first_block + blocks_of(run).of(into_run) : 0;
      step(part, Piece{from, run.blockwise, run.at + into_run, first_block});
    });
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

  // The first run that ends after owned element e.
  std::vector<StateRun>::const_iterator run_holding(std::size_t e) const {
    return std::upper_bound(runs_.begin(), runs_.end(), e, [](std::size_t o, const StateRun& r) { return o < r.end(); });
  }

  std::size_t block_ = 0;
  std::vector<StateRun> runs_;
  std::size_t coded_ = 0, blocks_ = 0, fp32_ = 0;
};

// The blocks of a blockwise run that its owned elements [lo, hi) touch,
// whole: blocks [first, last] of the run, elements [from, to) of the run.
struct TouchedBlocks {
  std::size_t first = 0, last = 0;
  std::size_t from = 0, to = 0;

  TouchedBlocks(const quant::PhasedBlocks& run, std::size_t run_begin, std::size_t lo, std::size_t hi)
      : first(run.of(lo - run_begin)), last(run.of(hi - run_begin - 1)), from(run.begin(first)), to(run.end(last)) {}
};

// Values of a blockwise run's owned elements [lo, hi) out of its blocks
// (`out`, the value of lo first), or into them (`in`): `codes` holds the
// codes of the touched blocks' elements [from, to) and `absmax` their
// absmax, in host memory, wherever the store keeps them. An import
// requantizes each touched block whole, the block's other values as they
// were, so any range may be imported; values read back from such a block
// (a checkpoint) give it back bit for bit (quant::requantize_block). Both
// state stores (engine/detail/state_store.hpp, offload/disk_state_store.hpp) move
// 8-bit state through here.
inline void blockwise_run_values(const StateRun& run, const quant::PhasedBlocks& geometry, const TouchedBlocks& touched,
                                 std::size_t lo, std::size_t hi, const float* code, std::uint8_t* codes,
                                 float* absmax, const float* in, float* out) {
  std::vector<float> whole(touched.to - touched.from);
  for (std::size_t b = touched.first; b <= touched.last; ++b) {
    const std::size_t begin = geometry.begin(b) - touched.from, end = geometry.end(b) - touched.from;
    quant::dequantize_block(codes + begin, end - begin, code, absmax[b - touched.first], whole.data() + begin);
  }
  const std::size_t at = (lo - run.begin) - touched.from;
  if (in == nullptr) {
    std::copy(whole.begin() + at, whole.begin() + at + (hi - lo), out);
    return;
  }
  std::copy(in, in + (hi - lo), whole.begin() + at);
  for (std::size_t b = touched.first; b <= touched.last; ++b) {
    const std::size_t begin = geometry.begin(b) - touched.from, end = geometry.end(b) - touched.from;
    absmax[b - touched.first] = quant::requantize_block(whole.data() + begin, end - begin, code, codes + begin);
  }
}

}  // namespace zero
