// Why: the parameters had no owner: a bare buffer that the gatherer, the
// update, set_param, the checkpoint writer and the step's publication each
// addressed with their own offsets. The store owns them as the state store
// owns master and state: whole on every rank at stages 0-2, this rank's
// shard of every unit at stage 3, with the verbs the others use: a unit's
// values or shard, a prefetch ahead of a gather, the notice that a unit was
// written, and what it holds for the memory report. Today the values live
// in the backend's memory, so prefetch and written do nothing; a placement
// off the device (parameters on demand: host memory or disk) is another
// store behind the same verbs, its rows and its registration.
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>
#include <cstdint>
#include <utility>

#include "zero/comm/communicator.hpp"
#include "zero/engine/detail/buffer_sizes.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/detail/part_rows.hpp"
#include "zero/engine/run_shape.hpp"

namespace zero {

// The parameters: whole, or this rank's shard at stage 3.
inline BufferRow parameter_row(const RunShape& run, const BufferSizes& z) {
  return {"parameters", "params", ReportedAs::params, backend_place(run), z.params, run.element_bytes(),
          shard_it(run.stage.params_sharded, "stage 3 shards the parameters: use stage<3> or more ranks")};
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

  // At finalize(): parameter_row's buffer, laid out by `layout` (whole, or
  // the shards at UnitInfo::shard_offset when `sharded`).
  void bind(Buffer values, const Layout& layout, bool sharded) {
    values_ = std::move(values);
    layout_ = &layout;
    sharded_ = sharded;
  }

  // Every value in layout order: the whole parameters, or every unit's shard.
  T* data() { return values_.data(); }
  const T* data() const { return values_.data(); }
  // Unit u's values (whole), or its shard (stage 3).
  T* unit(std::size_t u) { return values_.data() + offset(u); }
  const T* unit(std::size_t u) const { return values_.data() + offset(u); }

  // Stage 3: unit u is about to be gathered (its shard read) ahead of use.
  void prefetch(std::size_t) const {}
  // Unit u's values changed (the update, set_param, a load): written where
  // they live.
  void written(std::size_t) {}

  std::uint64_t bytes() const { return values_.bytes(); }

 private:
  std::size_t offset(std::size_t u) const {
    const UnitInfo& info = layout_->units()[u];
    return sharded_ ? info.shard_offset : info.full_offset;
  }

  Buffer values_;
  const Layout* layout_ = nullptr;
  bool sharded_ = false;
};

}  // namespace detail
}  // namespace zero
