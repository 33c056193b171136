// Why: evaluation and text generation at stage 3 would otherwise gather
// every unit at every acquire_unit, as a collective, so every rank would have
// to join a forward pass only one of them wants. ZeroOptimizer::hold_whole()
// gathers the parameters once into a whole copy and returns this scope: while
// it lives, acquire_unit and release_unit are local; when it ends, the copy
// is freed. Move-only; ending it is local (no collective), so it may end in
// any order on the ranks, and during unwinding.
#pragma once

#include "zero/compiler.hpp"

#include <functional>
#include <utility>

namespace zero {

// [[nodiscard]]: a scope dropped where it is made ends at once, its gather wasted.
class [[nodiscard]] HeldWhole {
 public:
  HeldWhole() = default;
  explicit HeldWhole(std::function<void()> end) : end_(std::move(end)) {}
  HeldWhole(HeldWhole&& other) noexcept : end_(std::exchange(other.end_, nullptr)) {}
  HeldWhole& operator=(HeldWhole&& other) noexcept {
    if (this != &other) {
      release();
      end_ = std::exchange(other.end_, nullptr);
    }
    return *this;
  }
  HeldWhole(const HeldWhole&) = delete;
  HeldWhole& operator=(const HeldWhole&) = delete;
  ~HeldWhole() { release(); }
  // Ends the scope now: the whole copy is freed.
  void release() {
    if (end_) std::exchange(end_, nullptr)();
  }

 private:
  std::function<void()> end_;
};

}  // namespace zero
