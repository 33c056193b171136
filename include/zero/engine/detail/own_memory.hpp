// Why: a trainer someone else wrote keeps its parameters and gradients in
// its own layout (one array per kind of parameter, stacked across layers)
// and its model code reads and writes them there. This part lets such a
// trainer keep that code: a parameter registered over the caller's memory
// (Engine::use_memory: a slice of a larger array, the caller's element type
// being the engine's) is copied there whenever the engine's values change,
// and its gradient is taken from there when the unit is final. It owns the
// list of those views, the copies, and handing their pages back to the
// operating system where asked (host memory only). It issues no collective.
//
// What each stage copies (docs/tutorial.md, "Your own memory"):
//   stages 0-2  every viewed parameter after each change (the step, set_param,
//               a load): one pass over the parameters;
//   stage 3     a unit's viewed parameters at each acquire_unit, from the
//               gathered unit (the caller's slice holds them while acquired);
//   all stages  a unit's viewed gradients into the engine's buffer when the
//               unit is final, then the views are cleared for the next
//               micro-batch's += (zeroed, or their pages handed back).
#pragma once

#include "zero/compiler.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "zero/engine/layout.hpp"
#include "zero/error.hpp"

namespace zero::detail {

// Host memory [p, p + bytes) reads as zeros afterwards: the pages wholly
// inside it go back to the operating system (resident memory drops; they
// come back, zero-filled, when written), the partial pages at its ends are
// zeroed. For anonymous private memory (malloc, new, mmap): the caller's
// arrays.
inline void give_back_pages(void* p, std::size_t bytes) {
  if (bytes == 0) return;
  static const std::uintptr_t page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(p), end = begin + bytes;
  const std::uintptr_t first = (begin + page - 1) / page * page, last = end / page * page;
  if (first >= last) {
    std::memset(p, 0, bytes);
    return;
  }
  std::memset(p, 0, first - begin);
  std::memset(reinterpret_cast<void*>(last), 0, end - last);
  if (madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED) != 0)
    std::memset(reinterpret_cast<void*>(first), 0, last - first);  // (refused: zeroed all the same)
}

template <class Ops, class P, class G, bool host_memory>
class OwnMemory {
 public:
  struct View {
    P* values = nullptr;
    G* grads = nullptr;
  };

  // Before finalize(): parameter `param` of `layout` lives at `values` (and
  // its gradient at `grads`) for the caller's model.
  void add(const Layout& layout, std::size_t param, P* values, G* grads) {
    const ParamInfo& info = layout.params()[param];
    require(values != nullptr || grads != nullptr, "use_memory('", info.name,
            "'): both pointers are null; pass where your model reads the parameter, where backward writes its "
            "gradient, or both");
    views_.resize(layout.params().size());
    views_[param] = View{values, grads};
  }

  // At finalize(): a unit's gradient comes from the caller's memory for all
  // of its parameters or for none (it is reduced as one buffer).
  void bind(const Layout& layout, bool give_back) {
    views_.resize(layout.params().size());
    give_back_ = give_back && host_memory;
    unit_grads_.assign(layout.units().size(), false);
    unit_values_.assign(layout.units().size(), false);
    for (std::size_t u = 0; u < layout.units().size(); ++u) {
      const UnitInfo& unit = layout.units()[u];
      std::size_t with_grads = 0;
      for (const std::size_t p : unit.params) {
        with_grads += views_[p].grads != nullptr ? 1 : 0;
        unit_values_[u] = unit_values_[u] || views_[p].values != nullptr;
      }
      require(with_grads == 0 || with_grads == unit.params.size(), "finalize(): unit '", unit.name, "' has ",
              with_grads, " of its ", unit.params.size(), " parameters' gradients in your memory (use_memory); "
              "a unit is reduced as one buffer: give every parameter of the unit its gradient's memory, or none");
      unit_grads_[u] = with_grads != 0;
      any_ = any_ || with_grads != 0 || unit_values_[u];
    }
  }

  bool any() const { return any_; }
  bool grads_of(std::size_t unit) const { return any_ && unit_grads_[unit]; }

  // The unit's viewed parameters from `unit_values` (the unit's padded
  // parameters in the backend's memory).
  void write_values(const Layout& layout, std::size_t unit, const P* unit_values) {
    if (!any_ || !unit_values_[unit]) return;
    for (const std::size_t p : layout.units()[unit].params) write_value(layout, p, unit_values);
  }
  // One parameter's (set_param: the unit's others may not be set yet, and
  // their views hold the caller's values still).
  void write_value(const Layout& layout, std::size_t param, const P* unit_values) {
    const ParamInfo& info = layout.params()[param];
    if (any_ && views_[param].values != nullptr) Ops::copy(views_[param].values, unit_values + info.offset, info.numel);
  }
  // Stage 3, the unit released: its slices may give their pages back.
  void release_values(const Layout& layout, std::size_t unit) {
    if (!give_back_ || !unit_values_[unit]) return;
    Ops::synchronize();  // (host memory: nothing in flight reads it)
    for (const std::size_t p : layout.units()[unit].params)
      if (views_[p].values != nullptr) give_back_pages(views_[p].values, layout.params()[p].numel * sizeof(P));
  }

  // The unit's gradient from the caller's memory into `g` (the engine's
  // buffer for it, padded layout): assigned, or added where the buffer sums
  // micro-batches in place; then the views are cleared for the next +=.
  void take_grads(const Layout& layout, std::size_t unit, G* g, bool assign) {
    for (const std::size_t p : layout.units()[unit].params) {
      const ParamInfo& info = layout.params()[p];
      Ops::accumulate(g + info.offset, views_[p].grads, info.numel, assign);
    }
    if (give_back_) Ops::synchronize();
    for (const std::size_t p : layout.units()[unit].params) {
      const ParamInfo& info = layout.params()[p];
      if (give_back_)
        give_back_pages(views_[p].grads, info.numel * sizeof(G));
      else
        Ops::zero(views_[p].grads, info.numel);
    }
  }

 private:
  std::vector<View> views_;         // per parameter; null pointers: none
  std::vector<bool> unit_values_;   // per unit: some parameter is viewed
  std::vector<bool> unit_grads_;    // per unit: every parameter's gradient is in the caller's memory
  bool any_ = false;
  bool give_back_ = false;
};

}  // namespace zero::detail
