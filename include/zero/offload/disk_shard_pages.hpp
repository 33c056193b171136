// Why: at stage 3 a rank's parameter and gradient shards are used one unit
// at a time (a gather, a reduction, an update, a checkpoint's range), yet
// they were all kept in memory. With Options::param_place = disk each kind
// lives in a file beside the disk tier's swap file (ZeRO-Infinity's
// parameter offload), and a rank keeps pages for Options::prefetch_units + 2
// units of it: the unit in use, the one being written behind it, and the
// units read ahead. What to read ahead is what the last step used next: the
// order of a step's fetches and claims is recorded and replayed, so a
// training loop that uses its units in the same order every step (every
// loop does) finds each shard read, or in flight, when it asks for it. A
// claim (a gradient's first micro-batch, which overwrites the shard) reads
// nothing, so the units the last step claimed are not read ahead either.
// The reads and writes are DiskSwap's (io_uring, O_DIRECT, a checksum per
// record, every fault an error naming the file): they run in the kernel
// while the caller computes, so this class needs no thread.
//
// One record per unit, its shard from a 4 KiB boundary
// (engine/detail/disk_window.hpp: shard_record_bytes, which the planner
// reads too). Not thread-safe: the engine calls it from one thread.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "zero/engine/detail/disk_window.hpp"
#include "zero/engine/detail/shard_pages.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/options.hpp"
#include "zero/error.hpp"
#include "zero/offload/aligned_buffer.hpp"
#include "zero/offload/disk_swap.hpp"

namespace zero::offload {

template <class T>
class DiskShardPages final : public zero::detail::ShardPages<T> {
 public:
  // This rank's shard of every unit of `layout` (finalized), in a file under
  // options.nvme.directory; pages for shard_page_count(prefetch_units).
  DiskShardPages(const Options& options, int rank, const Layout& layout) : layout_(&layout) {
    std::size_t file = 0, largest = disk_alignment;
    for (const UnitInfo& u : layout.units()) {
      offsets_.push_back(file);
      const std::size_t record = shard_record_bytes(u.shard, sizeof(T));
      file += record;
      largest = std::max(largest, record);
      stored_ += u.shard * sizeof(T);
    }
    swap_ = std::make_unique<DiskSwap>(std::max(file, disk_alignment), disk_options(options.nvme), rank);
    pages_.resize(shard_page_count(options.prefetch_units));
    for (Page& p : pages_) p.values = AlignedBuffer<T>(largest / sizeof(T));
    page_of_.assign(layout.units().size(), none);
    ahead_ = static_cast<std::size_t>(options.prefetch_units);
  }
  DiskShardPages(const DiskShardPages&) = delete;
  DiskShardPages& operator=(const DiskShardPages&) = delete;

  T* fetch(std::size_t unit) override {
    std::size_t p = page_of_[unit];
    ++counts_.fetches;
    if (p == none) {
      ++counts_.read_on_demand;
      p = take_page(unit);
      start_read(p, unit);
    }
    return use(p, unit, true);
  }
  T* claim(std::size_t unit) override {
    ++counts_.claims;
    const std::size_t p = page_of_[unit];
    return use(p == none ? take_page(unit) : p, unit, false);
  }
  void written(std::size_t unit) override {
    const std::size_t p = page_of_[unit];
    require(p != none, "DiskShardPages::written(", unit, "): the unit is not in a page (fetch or claim it first)");
    Page& page = pages_[p];
    swap_->wait(page.ticket);
    page.ticket = swap_->write(offsets_[unit], page.values.data(), record_bytes(unit));
  }
  void end_step() override {
    last_step_.swap(this_step_);
    this_step_.clear();
  }
  std::uint64_t page_bytes() const override {
    std::uint64_t b = 0;
    for (const Page& p : pages_) b += p.values.bytes();
    return b;
  }
  std::uint64_t stored_bytes() const override { return stored_; }

  // Fetches, those that found their unit in no page (its read started
  // only then: with a loop that repeats its order, one per step at most),
  // claims, and records read (on demand and ahead).
  struct Counts {
    std::uint64_t fetches = 0, read_on_demand = 0, claims = 0, reads = 0;
  };
  const Counts& counts() const { return counts_; }

 private:
  static constexpr std::size_t none = static_cast<std::size_t>(-1);
  // A step's fetches are recorded up to this many (a loop that never calls
  // step() keeps no longer a record).
  static constexpr std::size_t max_recorded = std::size_t{1} << 20;

  struct Page {
    AlignedBuffer<T> values;
    std::size_t unit = none;
    Ticket ticket{};         // its read or write in flight, if any
    std::uint64_t used = 0;  // when it was last fetched or read into
  };

  std::size_t record_bytes(std::size_t unit) const {
    return shard_record_bytes(layout_->units()[unit].shard, sizeof(T));
  }

  // Page p, which holds `unit`, handed to the caller: its read landed, or
  // its write behind ended (the caller may change it). `reads`: a fetch (a
  // claim overwrites), as the next step's read-ahead will know.
  T* use(std::size_t p, std::size_t unit, bool reads) {
    Page& page = pages_[p];
    swap_->wait(page.ticket);
    page.ticket = Ticket{};
    page.used = ++clock_;
    last_ = p;
    read_ahead_after(unit, reads);
    return page.values.data();
  }

  // A page for `unit`: a free one, else the least recently used of those
  // whose unit is not about to be used (upcoming_), else of any, but never
  // the last fetched (whose values a caller may hold).
  std::size_t take_page(std::size_t unit) {
    std::size_t victim = none;
    for (std::size_t p = 0; p < pages_.size() && victim == none; ++p)
      if (pages_[p].unit == none) victim = p;
    for (const bool spare_upcoming : {true, false}) {
      if (victim != none) break;
      for (std::size_t p = 0; p < pages_.size(); ++p) {
        if (p == last_ || (spare_upcoming && upcoming(pages_[p].unit))) continue;
        if (victim == none || pages_[p].used < pages_[victim].used) victim = p;
      }
    }
    Page& page = pages_[victim];
    if (page.unit != none) {
      swap_->wait(page.ticket);  // its write behind (or an unused read) must end first
      page_of_[page.unit] = none;
    }
    page.unit = unit;
    page.used = ++clock_;
    page_of_[unit] = victim;
    return victim;
  }

  void start_read(std::size_t p, std::size_t unit) {
    ++counts_.reads;
    pages_[p].ticket = swap_->read(offsets_[unit], pages_[p].values.data(), record_bytes(unit));
  }

  // Where the last step used `unit` at this point of its order, the units
  // it fetched next are read now (past its end: the step's first ones, for
  // the next step begins as it did), and their pages spared; those it
  // claimed next are only spared. A use is recorded as unit * 2 + reads.
  void read_ahead_after(std::size_t unit, bool reads) {
    const std::size_t at = this_step_.size();
    const std::size_t entry = unit * 2 + (reads ? 1 : 0);
    if (at < max_recorded) this_step_.push_back(entry);
    upcoming_.clear();
    const std::size_t n = last_step_.size();
    if (at >= n || last_step_[at] != entry) return;
    for (std::size_t k = 1; k <= ahead_ && k < n; ++k) upcoming_.push_back(last_step_[(at + k) % n]);
    for (const std::size_t next : upcoming_) {
      const std::size_t u = next / 2;
      if (next % 2 == 0 || u == unit || page_of_[u] != none) continue;
      start_read(take_page(u), u);
    }
  }
  bool upcoming(std::size_t unit) const {
    return std::any_of(upcoming_.begin(), upcoming_.end(), [&](std::size_t entry) { return entry / 2 == unit; });
  }

  const Layout* layout_;
  std::vector<std::size_t> offsets_;  // each unit's record in the file
  std::vector<Page> pages_;
  // After the pages: destroyed first, it waits for the kernel's transfers
  // from and into them.
  std::unique_ptr<DiskSwap> swap_;
  std::vector<std::size_t> page_of_;  // each unit's page, or none
  std::size_t last_ = none;           // the page fetched last
  std::uint64_t clock_ = 0;
  std::size_t ahead_ = 1;
  std::vector<std::size_t> this_step_, last_step_;  // uses (unit * 2 + reads) in their order
  std::vector<std::size_t> upcoming_;              // the uses after the last one, read ahead or spared
  std::uint64_t stored_ = 0;
  Counts counts_;
};

}  // namespace zero::offload
