// Why: the fp32 master weights and the optimizer state are most of a model's
// training memory (12 of the 16 bytes per parameter with Adam in mixed
// precision), and the offload policy decides where they live: in the
// backend's memory, in host memory updated by the CPU (ZeRO-Offload), or on
// disk behind a host window (ZeRO-Infinity). Everything else in the engine,
// initialisation, the step, gathering the master and checkpoints, goes
// through this one owner, so a tier is one class here and not a condition in
// every function that touches state.
//
// Coordinates: the store holds this rank's owned range of every unit, laid
// end to end (unit u's range starts at the engine's state offset of u), and
// every operation names a range of those "owned elements". Values cross the
// store's boundary in host memory (import/export) or as the fused step's
// arguments (update), so no caller needs to know where the state is.
#pragma once

#include "zero/config.hpp"

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "zero/backend/host.hpp"
#include "zero/error.hpp"
#include "zero/kernels/fused_step.hpp"
#include "zero/optim/policy.hpp"
#include "zero/policies.hpp"

namespace zero {

// Bytes of one kind of state by where they live.
struct PlacedBytes {
  std::uint64_t device = 0, host = 0, disk = 0;
  std::uint64_t total() const { return device + host + disk; }
  PlacedBytes& operator+=(const PlacedBytes& o) {
    device += o.device;
    host += o.host;
    disk += o.disk;
    return *this;
  }
};

// Which array of the store an import/export addresses: the fp32 master, or
// optimizer-state slot k (Adam: 0 = first moment, 1 = second moment).
struct StateSlot {
  static constexpr int master = -1;
  int index = master;
  bool is_master() const { return index == master; }
};

// The offload::None tier: master and state resident in the backend's memory
// (device memory on a GPU), updated by the backend's fused step.
template <optim::Policy Optimizer, BackendPolicy Backend>
class ResidentStateStore {
  using Ops = backend::Ops<Backend>;
  template <class T>
  using Buffer = typename Ops::template Buffer<T>;

 public:
  static constexpr int state_slots = Optimizer::state_slots;
  static constexpr const char* tier = "resident";

  // `allocate(n, what)` returns a Buffer<float> of n elements (the engine's
  // allocator, which turns a failure into an error naming the buffer).
  // `separate_master` false: fp32 training without offload, where the
  // parameters are their own master and update() receives them as such.
  template <class Allocate>
  void allocate(std::size_t owned, bool separate_master, Allocate&& allocate) {
    owned_ = owned;
    if (separate_master) master_ = allocate(owned, "fp32 master weights");
    for (int k = 0; k < state_slots; ++k) states_[k] = allocate(owned, "optimizer state");
  }
  bool owns_master() const { return master_.size() != 0; }

  // Host values into owned elements [offset, offset + n) of a slot, and back.
  void import_values(StateSlot slot, std::size_t offset, const float* host, std::size_t n) {
    Ops::upload(array(slot, offset, n), host, n);
  }
  void export_values(StateSlot slot, std::size_t offset, float* host, std::size_t n) {
    Ops::download(host, array(slot, offset, n), n);
  }

  // The fused step over owned elements [offset, offset + args.n): the
  // caller fills the gradient, the parameter copy, scalars and rounding;
  // the store points the step at its master and state. Without a master of
  // its own (fp32) args.master must already point at the parameters.
  template <class Grad, class Param>
  void update(std::size_t offset, kernels::FusedStepArgs<Optimizer, Grad, Param>& args) {
    if (owns_master()) args.master = master_.data() + offset;
    for (int k = 0; k < state_slots; ++k) args.state[k] = states_[k].data() + offset;
    Ops::fused_step(args);
  }

  PlacedBytes master_bytes() const { return place(master_.bytes()); }
  PlacedBytes state_bytes() const {
    std::uint64_t b = 0;
    for (int k = 0; k < state_slots; ++k) b += states_[k].bytes();
    return place(b);
  }

 private:
  static PlacedBytes place(std::uint64_t bytes) {
    PlacedBytes p;
    (Backend::device ? p.device : p.host) = bytes;
    return p;
  }
  float* array(StateSlot slot, std::size_t offset, std::size_t n) {
    require(offset <= owned_ && n <= owned_ - offset, "model-state store: owned elements [", offset, ", ", offset + n,
            ") are outside this rank's ", owned_);
    if (slot.is_master()) {
      require(owns_master(), "model-state store: fp32 training keeps no separate master (the parameters are it)");
      return master_.data() + offset;
    }
    require(slot.index >= 0 && slot.index < state_slots, "model-state store: the optimizer has ", state_slots,
            " state slot(s), not slot ", slot.index);
    return states_[slot.index].data() + offset;
  }

  std::size_t owned_ = 0;
  Buffer<float> master_;
  Buffer<float> states_[state_slots > 0 ? state_slots : 1];
};

// The store an offload policy selects.
template <class Offload, optim::Policy Optimizer, BackendPolicy Backend>
struct StateStoreFor {
  static_assert(!Offload::to_host, "zero: this offload tier has no model-state store in this version");
  using type = ResidentStateStore<Optimizer, Backend>;
};

}  // namespace zero
