// Why: at stage 3 a rank's shards, of the parameters and of the gradient, are
// used one unit at a time (a gather, a reduction, an update, a checkpoint's
// range), so with Options::param_place = disk they need not all be in
// memory: pages of a few units over the file they live in, filled and
// written back by the implementation (zero/offload/disk_shard_pages.hpp,
// made by the disk tier's maker because it needs liburing). The parameter
// store (param_store.hpp) and the gradient reducer (gradient_reducer.hpp)
// each hold one.
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>
#include <cstdint>

#include "zero/engine/reports.hpp"

namespace zero::detail {

template <class T>
class ShardPages {
 public:
  virtual ~ShardPages() = default;
  // Unit u's shard in a page, read first unless it is there; valid until
  // the next fetch() or claim() of another unit.
  virtual T* fetch(std::size_t unit) = 0;
  // A page for unit u's shard that the caller overwrites whole (a gradient's
  // first micro-batch): nothing is read. Valid as fetch()'s.
  virtual T* claim(std::size_t unit) = 0;
  // The page of unit u (fetched or claimed last) changed: written back
  // where it lives.
  virtual void written(std::size_t unit) = 0;
  // A step is over: its order of fetches and claims is the next step's
  // read-ahead.
  virtual void end_step() = 0;
  // Where the pages and the shards are, for memory_report().
  virtual std::uint64_t page_bytes() const = 0;
  virtual std::uint64_t stored_bytes() const = 0;
};

// What memory_report() shows for shards kept in a buffer of `buffer_bytes`
// in the backend's memory, or behind `pages` (their pages there, the shards
// on disk).
template <class T>
PlacedBytes placed_shards(const ShardPages<T>* pages, std::uint64_t buffer_bytes, bool device_backend) {
  PlacedBytes p;
  (device_backend ? p.device : p.host) = pages != nullptr ? pages->page_bytes() : buffer_bytes;
  if (pages != nullptr) p.disk = pages->stored_bytes();
  return p;
}

}  // namespace zero::detail
