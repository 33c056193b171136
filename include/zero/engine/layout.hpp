// Why: ZeRO partitions by position, so every rank must agree on where each
// parameter lives. Parameters are grouped into units (a unit is what stage 3
// gathers at once, typically one layer); each unit is one flat buffer padded
// so it splits into N equal shards whose size is a multiple of 64 elements
// (aligned vector loads in any element type). Rank r owns shard r of every
// unit; its owned shards are stored back to back, so the fused step runs over
// one contiguous range. A hash of the layout is compared across ranks at
// finalize: a mismatch is an error on every rank, never silent corruption.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "zero/engine/detail/agreement.hpp"
#include "zero/error.hpp"
#include "zero/names.hpp"
#include "zero/quant/symmetric.hpp"
#include "zero/shape.hpp"

namespace zero {

struct ParamId {
  std::size_t index;
};
struct UnitId {
  std::size_t index;
};

struct ParamInfo {
  std::string name;
  std::size_t numel;
  UnitId unit;         // what acquire_unit(), grad_buffer() and the rest take
  std::size_t offset;  // first element within its unit's flat buffer
  // As registered (e.g. {out, in}), or empty: flat. The optimizer stores
  // every parameter flat; checkpoints and the Hugging Face export keep it.
  Shape shape = {};
};

struct UnitInfo {
  std::string name;
  std::vector<std::size_t> params;
  std::size_t numel = 0;         // parameter elements plus alignment gaps
  std::size_t padded = 0;        // ranks * shard
  std::size_t shard = 0;         // elements each rank owns
  std::size_t full_offset = 0;   // start in the full flat buffer (sum of previous padded sizes)
  std::size_t shard_offset = 0;  // start in a rank's owned range (sum of previous shards)
  // [begin, end) element ranges inside the padded unit that belong to no
  // parameter: alignment gaps and the tail. Kept zero in gradient buffers.
  std::vector<std::pair<std::size_t, std::size_t>> gaps;
};

class Layout {
 public:
  static constexpr std::size_t shard_alignment = 64;  // elements
  static constexpr std::size_t param_alignment = 8;   // elements: 16 bytes of a 16-bit type

  explicit Layout(int ranks) : ranks_(ranks) { require(ranks >= 1, "Layout: ranks must be >= 1, got ", ranks); }

  UnitId add_unit(std::string name) {
    require(!finalized_, "add_unit('", name, "') after finalize(): register every unit and parameter first");
    require(!name.empty(), "add_unit: the unit name is empty; give each unit a name (e.g. the layer's)");
    require_utf8_name("add_unit", "unit", name);  // unit names are part of every checkpoint tensor's name
    require(unit_names_.insert(name).second, "add_unit: a unit named '", name, "' already exists");
    units_.push_back(UnitInfo{std::move(name), {}, 0, 0, 0, 0, 0, {}});
    return UnitId{units_.size() - 1};
  }

  // `shape`, when given, must hold exactly `numel` elements. `name` must be
  // one a checkpoint and a Hugging Face export can hold (require_saveable_name).
  ParamId add_param(UnitId unit, std::string name, std::size_t numel, Shape shape = {}) {
    require_saveable_name("add_param", "parameter", name);
    require(!finalized_, "add_param('", name, "') after finalize(): register every parameter first");
    require(unit.index < units_.size(), "add_param('", name, "'): unit id ", unit.index, " does not exist (",
            units_.size(), " units registered)");
    require(numel > 0, "add_param: parameter '", name, "' has 0 elements; zero-sized parameters cannot be "
            "partitioned: leave them out of the optimizer");
    if (!shape.empty()) {
      std::uint64_t product = 1;
      bool overflow = false;
      for (std::uint64_t d : shape) overflow = overflow || __builtin_mul_overflow(product, d, &product);
      require(!overflow && product == numel, "add_param: parameter '", name, "' has ", numel, " elements but its shape ",
              shape_text(shape), " holds ", overflow ? std::string("more than 2^64") : std::to_string(product),
              "; give the shape of exactly those elements (or none: flat)");
    }
    require(param_names_.insert(name).second, "add_param: a parameter named '", name,
            "' already exists; parameter names must be unique");
    UnitInfo& u = units_[unit.index];
    const std::size_t offset = round_up(u.numel, param_alignment, "add_param('", name, "')");
    const std::size_t end = checked_add(offset, numel, "add_param('", name, "', ", numel, " elements) in unit '",
                                        u.name, "'");
    if (offset > u.numel) u.gaps.emplace_back(u.numel, offset);
    params_.push_back(ParamInfo{std::move(name), numel, unit, offset, std::move(shape)});
    u.params.push_back(params_.size() - 1);
    u.numel = end;
    return ParamId{params_.size() - 1};
  }

  // element_bytes: the largest element any per-element buffer of the layout
  // holds; every buffer's size in bytes must fit in std::size_t.
  void finalize(std::size_t element_bytes = 1) {
    require(!finalized_, "Layout::finalize() called twice");
    require(!units_.empty(), "finalize(): no parameters were registered");
    std::size_t full = 0, shard_total = 0;
    for (UnitInfo& u : units_) {
      require(!u.params.empty(), "finalize(): unit '", u.name, "' has no parameters; remove it or add some");
      const std::size_t n = static_cast<std::size_t>(ranks_);
      // Rounded up as numel/n + (remainder != 0): numel + n - 1 could wrap.
      const std::size_t per_rank = u.numel / n + (u.numel % n != 0 ? 1 : 0);
      const std::string what = "finalize(): " + describe_unit(u);
      u.shard = round_up(per_rank, shard_alignment, what);
      u.padded = checked_mul(u.shard, n, what, " padded for ", ranks_, " ranks");
      if (u.padded > u.numel) u.gaps.emplace_back(u.numel, u.padded);
      u.full_offset = full;
      u.shard_offset = shard_total;
      full = checked_add(full, u.padded, what, " after the units before it");
      checked_mul(full, element_bytes, what, " in bytes (", element_bytes, " per element)");
      shard_total += u.shard;
      max_unit_ = std::max(max_unit_, u.padded);
    }
    padded_total_ = full;
    shard_total_ = shard_total;
    finalized_ = true;
  }

  bool finalized() const { return finalized_; }
  int ranks() const { return ranks_; }
  const std::vector<UnitInfo>& units() const { return units_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  const UnitInfo& unit(UnitId u) const { return units_.at(u.index); }
  // The index of `u`, one of units().
  std::size_t index_of(const UnitInfo& u) const { return static_cast<std::size_t>(&u - units_.data()); }
  const ParamInfo& param(ParamId p) const { return params_.at(p.index); }

  // Φ: elements of the full flat buffer, padding included.
  std::size_t padded_total() const { return padded_total_; }
  // Elements that belong to parameters.
  std::size_t param_total() const {
    std::size_t t = 0;
    for (const auto& p : params_) t += p.numel;
    return t;
  }
  // Φ / N: elements each rank owns.
  std::size_t shard_total() const { return shard_total_; }
  std::size_t max_unit() const { return max_unit_; }

  // A hash of everything that decides positions (names, sizes, order) and
  // of the shapes (which checkpoints and exports record).
  std::uint64_t hash() const {
    Fnv1a h;
    for (const auto& u : units_) {
      h.add(u.name);
      for (std::size_t p : u.params) {
        h.add(params_[p].name).add_value(params_[p].numel).add_value(params_[p].shape.size());
        for (std::uint64_t d : params_[p].shape) h.add_value(d);
      }
    }
    return h.value();
  }

  // A one-line description of unit u for error messages.
  std::string describe() const {
    std::string s;
    for (const auto& u : units_) s += u.name + "(" + std::to_string(u.numel) + ") ";
    return s;
  }

 private:
  template <class... What>
  static std::size_t round_up(std::size_t x, std::size_t a, What&&... what) {
    return checked_mul(x / a + (x % a != 0 ? 1 : 0), a, std::forward<What>(what)...);
  }
  // "unit 'u' (largest parameter 'w', 123 elements)": what an overflow names.
  std::string describe_unit(const UnitInfo& u) const {
    std::size_t largest = u.params.front();
    for (std::size_t p : u.params)
      if (params_[p].numel > params_[largest].numel) largest = p;
    return detail::concat("unit '", u.name, "' (", u.numel, " elements; largest parameter '", params_[largest].name,
                          "', ", params_[largest].numel, " elements)");
  }

  int ranks_;
  bool finalized_ = false;
  std::vector<UnitInfo> units_;
  std::vector<ParamInfo> params_;
  std::unordered_set<std::string> unit_names_, param_names_;
  std::size_t padded_total_ = 0, shard_total_ = 0, max_unit_ = 0;
};

// Options::hpz's secondary copy of a unit of `padded` elements: the node's
// ranks_per_node ranks each keep a part of padded / ranks_per_node (whole
// shards: ranks_per_node divides the rank count, which divides `padded`).
inline std::size_t hpz_part(std::size_t padded, int ranks_per_node, int ranks) {
  return padded / static_cast<std::size_t>(ranks_per_node == 0 ? ranks : ranks_per_node);
}

// Options::hpz_int8: the bytes of one rank's part of `part` elements (whole
// shards of `shard`): with qwZ the forward gather's payloads of those
// shards, else the part's own payload; int8 blocks of `block` elements.
inline std::size_t hpz_int8_part_bytes(std::size_t part, std::size_t shard, std::size_t block, bool qwz) {
  const quant::Format format{8, block};
  return qwz ? part / shard * format.payload_bytes(shard) : format.payload_bytes(part);
}

}  // namespace zero
