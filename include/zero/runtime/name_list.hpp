// Why: a run-time setting is found by its name (a config file's key, an
// optimizer's hyper-parameter), so a misspelled name is the commonest mistake
// there is. Every "unknown name" error lists the names that would have been
// accepted, and the nearest of them when the name looks like a typo of it,
// in the same words.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace zero::detail {

// "a, b, c".
template <class Names>
std::string join_names(const Names& names) {
  std::string out;
  for (const auto& n : names) {
    if (!out.empty()) out += ", ";
    out += n;
  }
  return out;
}

// Edits that turn `a` into `b`: insertions, deletions, substitutions and
// swaps of two neighbouring letters ("stgae" is one edit from "stage").
inline std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// " (did you mean 'stage'?)" when one of `names` is within a typo of
// `name` (a third of its letters, at least one), else "".
template <class Names>
std::string did_you_mean(std::string_view name, const Names& names) {
  std::string best;
  std::size_t best_distance = std::max<std::size_t>(1, name.size() / 3) + 1;
  for (const auto& candidate : names) {
    const std::size_t d = edit_distance(name, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  }
  return best.empty() ? std::string{} : " (did you mean '" + best + "'?)";
}

}  // namespace zero::detail
