// Why: ZeRO partitions by position, so every rank must agree on where each
// parameter lives. Parameters are grouped into units (a unit is what stage 3
// gathers at once, typically one layer); each unit is one flat buffer padded
// so it splits into N equal shards whose size is a multiple of 64 elements
// (aligned vector loads in any element type). Rank r owns shard r of every
// unit; its owned shards are stored back to back, so the fused step runs over
// one contiguous range. A hash of the layout is compared across ranks at
// finalize: a mismatch is an error on every rank, never silent corruption.
#pragma once

#include "zero/config.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "zero/error.hpp"

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
  std::size_t unit;
  std::size_t offset;  // first element within its unit's flat buffer
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
    require(unit_names_.insert(name).second, "add_unit: a unit named '", name, "' already exists");
    units_.push_back(UnitInfo{std::move(name), {}, 0, 0, 0, 0, 0, {}});
    return UnitId{units_.size() - 1};
  }

  ParamId add_param(UnitId unit, std::string name, std::size_t numel) {
    require(!finalized_, "add_param('", name, "') after finalize(): register every parameter first");
    require(unit.index < units_.size(), "add_param('", name, "'): unit id ", unit.index, " does not exist (",
            units_.size(), " units registered)");
    require(numel > 0, "add_param: parameter '", name, "' has 0 elements; zero-sized parameters cannot be "
            "partitioned: leave them out of the optimizer");
    require(param_names_.insert(name).second, "add_param: a parameter named '", name,
            "' already exists; parameter names must be unique");
    UnitInfo& u = units_[unit.index];
    const std::size_t offset = round_up(u.numel, param_alignment);
    if (offset > u.numel) u.gaps.emplace_back(u.numel, offset);
    params_.push_back(ParamInfo{std::move(name), numel, unit.index, offset});
    u.params.push_back(params_.size() - 1);
    u.numel = offset + numel;
    return ParamId{params_.size() - 1};
  }

  void finalize() {
    require(!finalized_, "Layout::finalize() called twice");
    require(!units_.empty(), "finalize(): no parameters were registered");
    std::size_t full = 0, shard_total = 0;
    for (UnitInfo& u : units_) {
      require(!u.params.empty(), "finalize(): unit '", u.name, "' has no parameters; remove it or add some");
      u.shard = round_up((u.numel + static_cast<std::size_t>(ranks_) - 1) / static_cast<std::size_t>(ranks_),
                         shard_alignment);
      u.padded = u.shard * static_cast<std::size_t>(ranks_);
      if (u.padded > u.numel) u.gaps.emplace_back(u.numel, u.padded);
      u.full_offset = full;
      u.shard_offset = shard_total;
      full += u.padded;
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

  // FNV-1a over everything that decides positions, plus a caller's salt
  // (optimizer, precision, stage), so that ranks built differently disagree.
  std::uint64_t hash(std::uint64_t salt = 0) const {
    std::uint64_t h = 0xcbf29ce484222325ull ^ salt;
    auto mix = [&h](const void* data, std::size_t n) {
      const auto* p = static_cast<const unsigned char*>(data);
      for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
    };
    for (const auto& u : units_) {
      mix(u.name.data(), u.name.size());
      mix("\0", 1);
      for (std::size_t p : u.params) {
        mix(params_[p].name.data(), params_[p].name.size());
        mix(&params_[p].numel, sizeof params_[p].numel);
      }
    }
    return h;
  }

  // A one-line description of unit u for error messages.
  std::string describe() const {
    std::string s;
    for (const auto& u : units_) s += u.name + "(" + std::to_string(u.numel) + ") ";
    return s;
  }

 private:
  static std::size_t round_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

  int ranks_;
  bool finalized_ = false;
  std::vector<UnitInfo> units_;
  std::vector<ParamInfo> params_;
  std::unordered_set<std::string> unit_names_, param_names_;
  std::size_t padded_total_ = 0, shard_total_ = 0, max_unit_ = 0;
};

}  // namespace zero
