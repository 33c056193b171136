// Why: what ZeroOptimizer checks across ranks (its settings at finalize(),
// the step's reports) and the error it gives for a failed allocation depend
// on a few values of the engine and its plan (stage, tier, names, flags),
// not on its type. Written once here as plain functions taking those values,
// they are compiled once per program instead of once per engine (twelve per
// backend for the built-in precisions and optimizers).
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "zero/engine/detail/agreement.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/options.hpp"
#include "zero/error.hpp"
#include "zero/precision/types.hpp"

namespace zero::detail {

inline std::string hex64(std::uint64_t v) {
  char text[19];
  std::snprintf(text, sizeof text, "0x%016llx", static_cast<unsigned long long>(v));
  return text;
}

// The type choices of one optimizer, as values.
struct EngineIdentity {
  int stage;
  const char* optimizer;  // Optimizer::name
  bool mixed;             // Precision::mixed
  DType param_dtype;
  const char* offload;  // name(OffloadTier) of the plan
};

// An option's value as the 64 bits ranks exchange, and how a value is
// printed: by its name for an enum, true/false for a flag.
template <class T>
std::uint64_t agreed_bits(T value) {
  if constexpr (std::is_same_v<T, double>) return std::bit_cast<std::uint64_t>(value);
  else if constexpr (std::is_same_v<T, bool>) return value ? 1u : 0u;
  else return static_cast<std::uint64_t>(value);
}
template <class T>
std::function<std::string(std::uint64_t)> agreed_text() {
  using Text = std::string;
  if constexpr (std::is_same_v<T, double>) return [](std::uint64_t v) { return concat(std::bit_cast<double>(v)); };
  else if constexpr (std::is_same_v<T, bool>) return [](std::uint64_t v) -> Text { return v ? "true" : "false"; };
  else if constexpr (std::is_enum_v<T>) return [](std::uint64_t v) -> Text { return name(static_cast<T>(v)); };
  else return [](std::uint64_t v) { return std::to_string(v); };
}

// What every rank must agree on (see agreement.hpp), checked at finalize():
// the type choices, then each option Options::fields() says ranks agree on,
// 0 where its condition does not hold.
inline std::vector<AgreedSetting> agreed_engine_settings(const Layout& layout, const Options& options,
                                                         const EngineIdentity& id) {
  const std::uint64_t layout_hash = layout.hash();
  const std::uint64_t precision = (id.mixed ? 0x100u : 0u) | static_cast<std::uint64_t>(id.param_dtype);
  std::vector<AgreedSetting> settings{
      // (the fingerprint: what differs is named by layout_disagreement)
      {"the parameter layout (ranks registered different parameter layouts)", layout_hash,
       [](std::uint64_t v) { return concat("fingerprint ", hex64(v)); }},
      {"the precision", precision,
       [](std::uint64_t v) {
         return concat(v & 0x100u ? "Mixed<" : "Full<", dtype_name(static_cast<DType>(v & 0xffu)), ">");
       }},
      {"the optimizer", short_text_code(id.optimizer), [](std::uint64_t v) { return short_text(v, "another optimizer"); }},
      {"the ZeRO stage", static_cast<std::uint64_t>(id.stage), agreed_text<int>()},
      {"the offload tier", short_text_code(id.offload), [](std::uint64_t v) { return short_text(v, "another tier"); }},
  };
  for_each_option(options, [&]<class T>(const std::string& key, const T& value, AgreedWhen agreed) {
    if constexpr (std::is_arithmetic_v<T> || std::is_enum_v<T>)  // (text is a rank's own: options.hpp asserts it)
      if (agreed != rank_own)
        settings.push_back({"Options::" + key, agreed(options) ? agreed_bits(value) : 0, agreed_text<T>()});
  });
  return settings;
}

// ---- Which parameter differs between two ranks' layouts ----------------------
// The layout fingerprint says that ranks differ, not where. Only when it
// differs (finalize() is about to fail) every rank all-gathers its whole
// layout, words of 64 bits: per unit its name and parameters, per parameter
// its name, size and shape; then rank 0's is compared with the first
// differing rank's, and the first parameter that differs is named with how.

// A layout as words: [units] then per unit [name][params] and per parameter
// [name][numel][dims][d...]; a name is [bytes] then its bytes, 8 per word.
inline std::vector<std::uint64_t> layout_words(const Layout& layout) {
  std::vector<std::uint64_t> w{layout.units().size()};
  auto text = [&](const std::string& s) {
    w.push_back(s.size());
    for (std::size_t i = 0; i < s.size(); i += 8) {
      std::uint64_t word = 0;
      std::memcpy(&word, s.data() + i, std::min<std::size_t>(8, s.size() - i));
      w.push_back(word);
    }
  };
  for (const UnitInfo& u : layout.units()) {
    text(u.name);
    w.push_back(u.params.size());
    for (std::size_t p : u.params) {
      const ParamInfo& info = layout.params()[p];
      text(info.name);
      w.push_back(info.numel);
      w.push_back(info.shape.size());
      w.insert(w.end(), info.shape.begin(), info.shape.end());
    }
  }
  return w;
}

// What layout_words() wrote, read back (what compare_layouts needs of a rank's layout).
struct LayoutText {
  struct Param {
    std::string name;
    std::uint64_t numel;
    Shape shape;
  };
  struct Unit {
    std::string name;
    std::vector<Param> params;
  };
  std::vector<Unit> units;

  static LayoutText read(const std::uint64_t* w, std::size_t n) {
    std::size_t at = 0;
    auto next = [&]() -> std::uint64_t { return at < n ? w[at++] : 0; };
    auto text = [&] {
      const std::uint64_t bytes = std::min<std::uint64_t>(next(), 8 * (n - std::min(at, n)));
      std::string s(bytes, '\0');
      for (std::size_t i = 0; i < bytes; i += 8) {
        const std::uint64_t word = next();
        std::memcpy(s.data() + i, &word, std::min<std::size_t>(8, bytes - i));
      }
      return s;
    };
    LayoutText t;
    for (std::uint64_t units = next(); units-- > 0 && at < n;) {
      Unit u{text(), {}};
      for (std::uint64_t params = next(); params-- > 0 && at < n;) {
        Param p{text(), next(), {}};
        for (std::uint64_t dims = next(); dims-- > 0 && at < n;) p.shape.push_back(next());
        u.params.push_back(std::move(p));
      }
      t.units.push_back(std::move(u));
    }
    return t;
  }
  // (unit index, position in it) of parameter `name`, or {-1, -1}.
  std::pair<long, long> find(const std::string& name) const {
    for (std::size_t u = 0; u < units.size(); ++u)
      for (std::size_t p = 0; p < units[u].params.size(); ++p)
        if (units[u].params[p].name == name) return {static_cast<long>(u), static_cast<long>(p)};
    return {-1, -1};
  }
};

// The first difference between rank 0's layout `a` and rank r's `b`, e.g.
// "parameter 'w' has 100 elements on rank 0, 101 on rank 1 (a different size)".
inline std::string compare_layouts(const LayoutText& a, const LayoutText& b, int r) {
  const std::string on_r = concat(" on rank ", r);
  auto shape = [](const Shape& s) { return s.empty() ? std::string("none (flat)") : shape_text(s); };
  auto where = [&](const LayoutText& t, std::pair<long, long> at) {
    return concat("parameter #", at.second, " of unit '", t.units[static_cast<std::size_t>(at.first)].name, "'");
  };
  for (std::size_t u = 0; u < std::max(a.units.size(), b.units.size()); ++u) {
    if (u >= b.units.size())
      return concat("unit #", u, " '", a.units[u].name, "' exists on rank 0, not", on_r, " (", a.units.size(),
                    " units on rank 0, ", b.units.size(), on_r, ")");
    if (u >= a.units.size())
      return concat("unit #", u, " '", b.units[u].name, "' exists", on_r, ", not on rank 0 (", a.units.size(),
                    " units on rank 0, ", b.units.size(), on_r, ")");
    const LayoutText::Unit &ua = a.units[u], &ub = b.units[u];
    if (ua.name != ub.name)
      return concat("unit #", u, " is '", ua.name, "' on rank 0 and '", ub.name, "'", on_r, " (a different unit name or order)");
    for (std::size_t p = 0; p < std::max(ua.params.size(), ub.params.size()); ++p) {
      const long up = static_cast<long>(u), pp = static_cast<long>(p);
      if (p >= ua.params.size() || p >= ub.params.size()) {
        const bool on_a = p < ua.params.size();
        const LayoutText::Param& extra = on_a ? ua.params[p] : ub.params[p];
        const auto other = (on_a ? b : a).find(extra.name);
        return concat("unit '", ua.name, "' has ", ua.params.size(), " parameters on rank 0 and ", ub.params.size(),
                      on_r, "; parameter '", extra.name, "' (#", p, " of the unit ", on_a ? "on rank 0" : on_r.substr(1),
                      ") is ",
                      other.first < 0 ? std::string("missing") : where(on_a ? b : a, other),
                      on_a ? on_r : std::string(" on rank 0"),
                      other.first < 0 ? " (a missing parameter)" : " (another unit)");
      }
      const LayoutText::Param &pa = ua.params[p], &pb = ub.params[p];
      if (pa.name != pb.name) {
        const auto b_has_a = b.find(pa.name);
        if (b_has_a.first >= 0)
          return concat("parameter '", pa.name, "' is ", where(a, {up, pp}), " on rank 0 but ", where(b, b_has_a), on_r,
                        b_has_a.first == up ? " (registered in another order)" : " (added to another unit)");
        return concat(where(a, {up, pp}), " is '", pa.name, "' on rank 0 and '", pb.name, "'", on_r,
                      " (a different name)");
      }
      if (pa.numel != pb.numel)
        return concat("parameter '", pa.name, "' has ", pa.numel, " elements on rank 0 and ", pb.numel, on_r,
                      " (a different size)");
      if (pa.shape != pb.shape)
        return concat("parameter '", pa.name, "' has shape ", shape(pa.shape), " on rank 0 and ", shape(pb.shape), on_r,
                      " (a different shape)");
    }
  }
  return "no difference in names, sizes, shapes or order";  // a hash collision of two different layouts' words
}

// At finalize(), after the settings' exchange (`all`, rank-major, k values
// per rank, the layout fingerprint first: agreed_engine_settings): "" when
// every rank's fingerprint matches rank 0's; otherwise (collective: every
// rank sees the same fingerprints, so all take this path) the layouts are
// all-gathered through `all_gather` (this rank's words in, every rank's out)
// and the first difference between rank 0 and the first differing rank is described.
inline std::string layout_disagreement(const Layout& layout, const std::vector<std::uint64_t>& all, std::size_t k,
                                       int ranks,
                                       const std::function<std::vector<std::uint64_t>(const std::vector<std::uint64_t>&)>&
                                           all_gather) {
  int first = -1;
  for (int r = 1; r < ranks && first < 0; ++r)
    if (all[static_cast<std::size_t>(r) * k] != all[0]) first = r;
  if (first < 0) return "";
  std::vector<std::uint64_t> mine = layout_words(layout);
  const std::vector<std::uint64_t> sizes = all_gather({mine.size()});
  std::uint64_t longest = 0;
  for (std::uint64_t n : sizes) longest = std::max(longest, n);
  mine.resize(longest, 0);
  const std::vector<std::uint64_t> words = all_gather(mine);
  auto of = [&](int r) {
    return LayoutText::read(words.data() + static_cast<std::size_t>(r) * longest, sizes[static_cast<std::size_t>(r)]);
  };
  return concat("the first difference in the layouts: ", compare_layouts(of(0), of(first), first));
}

// The step's control all-reduce carries one report per rank, an integer
// below 2^53 (exact in a double, and the other ranks add 0 to it): a
// fingerprint of the update rule with this step's hyper-parameters, and two flags.
inline constexpr std::uint64_t report_non_finite = 1, report_invalid_hyper = 2;

// This rank's report. Keyed by the optimizer alone: the stage, precision and
// offload tier do not change it.
template <class Optimizer>
std::uint64_t step_report(const typename Optimizer::Scalars* scalars, bool non_finite) {
  std::uint64_t fingerprint = 0;
  if (scalars != nullptr) {
    // The update rule run on fixed probes: what the kernels will compute, for
    // any policy (hashing the Scalars' bytes would also hash their padding).
    // The probes make each built-in hyper-parameter move a result: a weight
    // for decay, a state for momenta, a tiny second moment for eps.
    struct Probe {
      float w, g, state;
    };
    constexpr Probe probes[] = {{0.75f, 0.5f, 0.25f}, {0.0f, 0.0f, 1e-30f}, {-1.5f, -0.125f, 2.0f}};
    Fnv1a h;
    for (const Probe& p : probes) {
      float w = p.w, state[4] = {p.state, p.state, p.state, p.state};
      Optimizer::update(*scalars, w, p.g, state);
      h.add_value(w).add(state, sizeof state);
    }
    fingerprint = h.value() >> 13;  // 51 bits, so the report stays below 2^53
  }
  return fingerprint << 2 | (scalars == nullptr ? report_invalid_hyper : 0) | (non_finite ? report_non_finite : 0);
}

// The step's reports after the control all-reduce, as the step sees them.
struct StepReports {
  int rank;
  int ranks;
  std::int64_t step;      // the step being taken (1-based)
  const double* reports;  // reports[r]: rank r's report
  bool loss_scaling;      // Precision::loss_scaling: an overflow skips the step
  bool states_sharded;    // each rank checks only the gradient it owns
  std::uint64_t report(int r) const { return static_cast<std::uint64_t>(reports[r]); }
};

// The step's error for inf or NaN gradients that no loss scaling skips: a
// type of its own, so that the engine can look for the cause first (an
// update that made the parameters non-finite: Engine::blame_non_finite).
class NonFiniteGradients : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

// Throws on every rank when a rank's hyper-parameters are invalid or differ
// from rank 0's, or a gradient holds inf/NaN without loss scaling to skip it.
inline void check_step_reports(const StepReports& s, const std::string& invalid_hyper, bool overflow) {
  auto ranks_where = [&](auto&& pred) {
    std::string list;
    for (int r = 0; r < s.ranks; ++r)
      if (pred(s.report(r))) list += (list.empty() ? "" : ", ") + std::to_string(r);
    return list;
  };
  if (!invalid_hyper.empty())
    throw InvalidArgument(concat("step() on rank ", s.rank, ", step ", s.step, ": ", invalid_hyper,
                                 " (checked at every step: set valid values in hyper() before step())"));
  const std::string invalid = ranks_where([](std::uint64_t v) { return (v & report_invalid_hyper) != 0; });
  if (!invalid.empty())
    throw InvalidArgument(concat("step() on rank ", s.rank, ", step ", s.step, ": the hyper-parameters of rank(s) ",
                                 invalid, " are invalid (their error names the field); nothing was updated"));
  const std::uint64_t rank0 = s.report(0) >> 2;
  const std::string differ = ranks_where([&](std::uint64_t v) { return (v >> 2) != rank0; });
  if (!differ.empty())
    throw CommError(concat(
        "step() on rank ", s.rank, ", step ", s.step, ": the hyper-parameters of rank(s) ", differ,
        " differ from rank 0's (a learning-rate schedule computed from a rank-local counter?); every rank must set "
        "the same hyper() values before each step(); nothing was updated"));
  if (overflow && !s.loss_scaling) {
    // Each rank checks the summed gradient of what it updates, so this names
    // the owner of the bad element; the backward that made it may be any rank's.
    const std::string where =
        !s.states_sharded ? std::string("found by every rank: stage 0 checks the whole all-reduced gradient")
                          : "found by rank(s) " + ranks_where([](std::uint64_t v) { return (v & report_non_finite) != 0; }) +
                                " in the summed gradient of the parameters they own";
    throw NonFiniteGradients(concat("step() on rank ", s.rank, ", step ", s.step, ": the gradients contain inf or NaN (",
                                 where,
                                 "); with bf16/fp32 there is no loss scaling to absorb it: check the loss and the "
                                 "learning rate"));
  }
}

// finalize()'s error for a buffer it could not allocate: the buffer, its
// size, the rank, why, and `lower_it` (the option or stage that makes it smaller).
inline OutOfMemory allocation_error(int rank, const char* what, std::size_t n, std::size_t element_bytes,
                                    const char* where, const char* why, const std::string& lower_it) {
  return OutOfMemory(concat("ZeroOptimizer::finalize() on rank ", rank, ": could not allocate the ", what, " (",
                            n * element_bytes, " bytes: ", n, " elements of ", element_bytes, " bytes) in ", where,
                            " memory: ", why, ". To make it smaller: ", lower_it));
}

}  // namespace zero::detail
