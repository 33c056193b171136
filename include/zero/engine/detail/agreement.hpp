// Why: ZeRO partitions by position and every rank runs the same collectives,
// so ranks that were built or configured differently (another precision,
// accumulation count, reduce type) would not fail: they would exchange
// mismatched buffers and train on garbage. At finalize() every rank
// describes itself as a short list of named 64-bit values; the lists are
// all-gathered and compared, and a difference is an error on every rank that
// names the setting, rank 0's value and the ranks that differ. Fnv1a is the
// one hash the engine uses for such fingerprints (layouts, values, settings).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "zero/error.hpp"
#include "zero/precision/stochastic.hpp"

namespace zero {

// 64-bit FNV-1a: cheap, byte-order independent for the same bytes, and good
// enough to tell configurations apart (not a cryptographic hash).
class Fnv1a {
 public:
  explicit Fnv1a(std::uint64_t salt = 0) : h_(0xcbf29ce484222325ull ^ salt) {}
  Fnv1a& add(const void* data, std::size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < n; ++i) h_ = (h_ ^ p[i]) * 0x100000001b3ull;
    return *this;
  }
  Fnv1a& add(const std::string& s) { return add(s.data(), s.size() + 1); }  // with the terminator: "ab"+"c" != "a"+"bc"
  template <class T>
  Fnv1a& add_value(const T& v) {
    return add(&v, sizeof v);
  }
  std::uint64_t value() const { return h_; }

 private:
  std::uint64_t h_;
};

// A fingerprint of n fp32 values (their bits), 8 bytes per mixing step so
// that a large parameter hashes at memory speed.
inline std::uint64_t hash_floats(const float* values, std::size_t n) {
  std::uint64_t h = detail::mix64(n);
  std::size_t i = 0;
  for (; i + 2 <= n; i += 2) {
    std::uint64_t word;
    std::memcpy(&word, values + i, sizeof word);
    h = detail::mix64(h ^ word);
  }
  if (i < n) {
    std::uint32_t last;
    std::memcpy(&last, values + i, sizeof last);
    h = detail::mix64(h ^ last);
  }
  return h;
}

// A name of up to 8 characters as 64 bits that short_text() turns back into
// the name on any rank; a longer name becomes its hash.
inline std::uint64_t short_text_code(const char* text) {
  const std::size_t n = std::strlen(text);
  if (n > 8) return Fnv1a().add(text, n).value() | 0x80;  // a byte no printable name has
  std::uint64_t v = 0;
  std::memcpy(&v, text, n);
  return v;
}
inline std::string short_text(std::uint64_t code, const char* otherwise) {
  char bytes[9] = {};
  std::memcpy(bytes, &code, 8);
  for (char c : bytes)
    if (c != 0 && (c < 0x20 || c > 0x7e)) return otherwise;
  return bytes;
}

// One setting every rank must agree on: what it is, this rank's value as 64
// bits, and how to print a value of it (rank 0's, which may not be this one).
struct AgreedSetting {
  std::string what;
  std::uint64_t value;
  std::function<std::string(std::uint64_t)> show;
};

// `all` holds every rank's values, rank-major (all[r * settings.size() + i]).
// Returns "" when every rank agrees with rank 0, else one clause per setting
// that differs: "<what>: rank 0 has <value>, rank(s) 1, 3 have <value on the first of them>".
inline std::string describe_disagreement(const std::vector<AgreedSetting>& settings,
                                         const std::vector<std::uint64_t>& all, int ranks) {
  const std::size_t k = settings.size();
  std::string out;
  for (std::size_t i = 0; i < k; ++i) {
    std::string list;
    int first = -1;
    for (int r = 1; r < ranks; ++r)
      if (all[static_cast<std::size_t>(r) * k + i] != all[i]) {
        list += (list.empty() ? "" : ", ") + std::to_string(r);
        if (first < 0) first = r;
      }
    if (first < 0) continue;
    out += detail::concat(out.empty() ? "" : "; ", settings[i].what, ": rank 0 has ", settings[i].show(all[i]),
                          ", rank(s) ", list, " differ (rank ", first, " has ",
                          settings[i].show(all[static_cast<std::size_t>(first) * k + i]), ")");
  }
  return out;
}

}  // namespace zero
