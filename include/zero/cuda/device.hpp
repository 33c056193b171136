// Why: memory belongs to the device it was allocated on, and a thread may
// have moved to another device by the time it frees it (one thread driving
// several GPUs, or a destructor running on another thread). Freeing must then
// switch to the owner and back, without throwing, and every allocation the
// library makes must be counted, so that tests can hold a steady-state step
// to allocating nothing. Both are written once, here.
#pragma once

#include "zero/cuda/runtime.hpp"

#include <atomic>
#include <cstdint>

namespace zero::cuda {

// Makes `device` the calling thread's current device for a scope and restores
// the previous one at its end. Never throws: it serves destructors, where a
// failure has nothing left to protect (the frees it guards then run on
// whatever device is current, as they would without it).
class DeviceScope {
 public:
  explicit DeviceScope(int device) noexcept {
    switched_ = cudaGetDevice(&previous_) == cudaSuccess && previous_ != device && cudaSetDevice(device) == cudaSuccess;
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope() {
    if (switched_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
  bool switched_ = false;
};

namespace detail {

// Device allocations made so far by the library (all threads and devices):
// the backend's buffers and the gradient-statistics workspaces.
inline std::atomic<std::uint64_t>& device_allocations() {
  static std::atomic<std::uint64_t> n{0};
  return n;
}

}  // namespace detail

// Counts `n` library allocations (see device_allocations()).
inline void count_device_allocations(std::uint64_t n = 1) {
  detail::device_allocations().fetch_add(n, std::memory_order_relaxed);
}
inline std::uint64_t device_allocation_count() { return detail::device_allocations().load(); }

}  // namespace zero::cuda
