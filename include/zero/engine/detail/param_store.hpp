// Why: the parameters had no owner: a bare buffer that the gatherer, the
// update, set_param, the checkpoint writer and the step's publication each
// addressed with their own offsets. The store owns them as the state store
// owns master and state: whole on every rank at stages 0-2, this rank's
// shard of every unit at stage 3, with the verbs the others use: a unit's
// values or shard, the range this rank updates, the notice that a unit was
// written, and what it holds for the memory report.
//
// Where the shards live is Options::param_place. device: in one buffer of the
// backend's memory, so written does nothing. disk: behind ShardPages
// (shard_pages.hpp), a few pages of memory over a file: unit(u) then reads the shard
// into a page unless it is there already (the pages read ahead on their own,
// in the last step's order of uses), written(u) writes the page back.
// A pointer unit(u) returns stays valid until the next unit() of another
// unit: every caller (the gather of one unit, the update of one unit,
// set_param, a checkpoint's range) uses one unit at a time.
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "zero/comm/communicator.hpp"
#include "zero/engine/detail/buffer_sizes.hpp"
#include "zero/engine/detail/ownership.hpp"
#include "zero/engine/detail/part_rows.hpp"
#include "zero/engine/detail/shard_pages.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/reports.hpp"
#include "zero/engine/run_shape.hpp"
#include "zero/error.hpp"

namespace zero {

// The parameters: whole, or this rank's shard at stage 3 (with
// Options::param_place = disk: on disk, with pages in the backend's memory).
struct ParameterRows {
  BufferRow values, pages, file_padding;
  BufferRows list() const { return {values, pages, file_padding}; }
};
inline ParameterRows parameter_rows(const RunShape& run, const BufferSizes& z) {
  const bool disk = z.param_file_bytes != 0;
  ParameterRows r;
  r.values = {"parameters", "params", ReportedAs::params, disk ? Place::disk : backend_place(run), z.params,
              run.element_bytes(),
              disk ? "the shards are on disk: their pages are what memory holds"
                   : shard_it(run.stage.params_sharded, "stage 3 shards the parameters: use stage<3> or more ranks; "
                                                        "or keep them on disk (Options::param_place = disk)")};
  if (!disk) return r;
  r.pages = {"parameter pages (Options::param_place = disk: prefetch_units + 2 of the largest shard)", "params",
             ReportedAs::params, backend_place(run), z.param_pages, run.element_bytes(),
             "lower Options::prefetch_units, or split the largest units"};
  // Every record starts at a 4 KiB boundary of the file.
  r.file_padding = {"parameter file (rounded to whole 4 KiB records)", "param_file_padding", ReportedAs::not_reported,
                    Place::disk, z.param_file_bytes - z.params * run.element_bytes(), 1, ""};
  return r;
}
// Stages 1-2: every rank needs the whole parameters again after the update.
inline CollectiveRows parameter_collectives(const RunShape& run, const CollectiveCounter& count) {
  if (!run.stage.all_gather_after_step) return {};
  return {count.per_unit("parameter all-gather after the update", comm::Collective::all_gather, 1,
                         run.element_bytes(), 1)};
}

namespace detail {

template <class Ops, class T>
class ParamStore {
 public:
  using Buffer = typename Ops::template Buffer<T>;

  // At finalize(), one of the two. bind: the parameter row's buffer, laid
  // out by `layout` (whole, or the shards at UnitInfo::shard_offset when
  // `sharded`). bind_pages: stage 3's shards behind `pages`.
  void bind(Buffer values, const Layout& layout, bool sharded) {
    values_ = std::move(values);
    layout_ = &layout;
    sharded_ = sharded;
  }
  void bind_pages(std::unique_ptr<ShardPages<T>> pages, const Layout& layout) {
    require(pages != nullptr, "ParamStore: no pages");
    pages_ = std::move(pages);
    layout_ = &layout;
    sharded_ = true;
  }
  // The shards are paged (Options::param_place = disk).
  bool paged() const { return pages_ != nullptr; }

  // Every value in layout order (stages 0-2: the whole parameters).
  T* data() {
    require(!paged(), "ParamStore::data(): the shards are paged; use unit()");
    return values_.data();
  }
  const T* data() const { return const_cast<ParamStore*>(this)->data(); }
  // Unit u's values (whole), or its shard (stage 3); paged, valid until the
  // next unit() of another unit.
  T* unit(std::size_t u) { return paged() ? pages_->fetch(u) : values_.data() + offset(u); }
  const T* unit(std::size_t u) const { return const_cast<ParamStore*>(this)->unit(u); }
  // The part of unit u this rank updates (`own`): its shard at stage 3, its
  // updated range of the whole unit otherwise; paged, as unit().
  T* updated_range(const UnitInfo& u, const Ownership& own) {
    return unit(layout_->index_of(u)) + (sharded_ ? 0 : own.update_begin(u));
  }

  // Unit u's values changed (the update, set_param, a load): written where
  // they live.
  void written(std::size_t u) {
    if (paged()) pages_->written(u);
  }
  // The step is over (its order of uses is the next step's read-ahead).
  void end_step() {
    if (paged()) pages_->end_step();
  }

  // What memory_report() shows: the buffer, or the pages and the file.
  PlacedBytes placed(bool device_backend) const { return placed_shards(pages_.get(), values_.bytes(), device_backend); }

 private:
  std::size_t offset(std::size_t u) const {
    const UnitInfo& info = layout_->units()[u];
    return sharded_ ? info.shard_offset : info.full_offset;
  }

  Buffer values_;
  std::unique_ptr<ShardPages<T>> pages_;
  const Layout* layout_ = nullptr;
  bool sharded_ = false;
};

}  // namespace detail
}  // namespace zero
