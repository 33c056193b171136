// Why: after a step at stages 0-2 every rank holds the same parameters, and
// at stage 3 every rank's gathered copy of a unit is the same bytes. A flaky
// core, a bad memory module or a bit flipped on a link breaks that without
// an error, and surfaces weeks later as a slow divergence. With
// Options::check_replicas, each rank fingerprints what it published (stages
// 0-2: its whole parameters after the step's update) or gathered (stage 3:
// each unit as acquire_unit() hands it out), and the fingerprint rides the
// next step's control all-reduce (one double per rank more); ranks that
// differ are named with the unit, before that step updates anything
// (Engine::check_replicas). This part owns the fingerprints.
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "zero/precision/stochastic.hpp"

namespace zero::detail {

// A 64-bit fingerprint of `bytes` bytes. Four lanes, each a chain of
// bijections of its state ((x ^ word) * odd, then a shift-xor), so any one
// changed word always changes the result, and the lanes' independent chains
// keep it near memory speed.
inline std::uint64_t fingerprint_bytes(const void* data, std::size_t bytes) {
  constexpr std::uint64_t odd = 0x9E3779B97F4A7C15ull;
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t lane[4] = {odd, odd * 3, odd * 5, odd * 7};
  auto step = [](std::uint64_t x, std::uint64_t w) {
    x = (x ^ w) * odd;
    return x ^ (x >> 29);
  };
  std::size_t i = 0;
  for (; i + 32 <= bytes; i += 32)
    for (int k = 0; k < 4; ++k) {
      std::uint64_t w;
      std::memcpy(&w, p + i + 8 * static_cast<std::size_t>(k), sizeof w);
      lane[k] = step(lane[k], w);
    }
  std::uint64_t tail[4] = {};
  std::memcpy(tail, p + i, bytes - i);
  for (int k = 0; k < 4; ++k) lane[k] = step(lane[k], tail[k]);
  std::uint64_t h = mix64(bytes);
  for (std::uint64_t l : lane) h = mix64(h ^ l);
  return h;
}

// The fingerprints of one rank's copies since the last step's check.
class ReplicaFingerprints {
 public:
  // At finalize(): `units` units; off unless `enabled`.
  void bind(std::size_t units, bool enabled) {
    enabled_ = enabled;
    units_.assign(enabled ? units : 0, 0);
    reset();
  }
  bool enabled() const { return enabled_; }

  // Unit u's copy as this rank holds it now (`bytes` bytes of host memory).
  void record(std::size_t unit, const void* data, std::size_t bytes) {
    const std::uint64_t h = fingerprint_bytes(data, bytes);
    units_[unit] = h;
    // In the order recorded: ranks record the same units in the same order
    // (the collectives that made the copies check that: comm::Purpose).
    combined_ = mix64(combined_ ^ mix64(h + unit));
    ++records_;
  }
  // What rides the control all-reduce: 52 bits, exact in a double (the
  // other ranks add 0 to it), and never 0 once anything was recorded.
  double value() const { return static_cast<double>((combined_ >> 12) | (records_ != 0 ? 1u : 0u)); }
  // Each unit's last fingerprint (0: none recorded), for naming the unit
  // whose copies differ.
  const std::vector<std::uint64_t>& units() const { return units_; }
  // After a step's check: the next one covers what comes after it.
  void reset() {
    combined_ = 0;
    records_ = 0;
  }

 private:
  bool enabled_ = false;
  std::vector<std::uint64_t> units_;
  std::uint64_t combined_ = 0;
  std::uint64_t records_ = 0;
};

}  // namespace zero::detail
