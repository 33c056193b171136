// Why: the five template arguments of zero::ZeroOptimizer are policies, small
// tag types gathered here (as CUTLASS keeps its tags in one place) so a user
// reads every choice in one file. Runtime values never live in these types:
// they go in zero::Options and the optimizer's Hyper struct.
#pragma once

#include "zero/compiler.hpp"

#include <concepts>
#include <type_traits>

#include "zero/precision/types.hpp"

namespace zero {

namespace precision {

// Everything in T (fp32 training): the parameters are their own master copy.
template <class T>
struct Full {
  static_assert(std::is_same_v<T, float>,
                "zero::precision::Full<T>: training entirely in 16-bit floats (no fp32 master weights) loses small "
                "updates and is not supported; use zero::precision::Mixed<zero::bf16> or Mixed<zero::fp16>");
  using param_type = T;
  using grad_type = T;
  static constexpr bool mixed = false;
  static constexpr bool loss_scaling = false;
};

// Parameters and gradients in a 16-bit type, fp32 master weights and
// optimizer state. fp16 needs dynamic loss scaling; bf16 does not.
template <class T>
struct Mixed {
  static_assert(std::is_same_v<T, bf16> || std::is_same_v<T, fp16>,
                "zero::precision::Mixed<T> needs a 16-bit type (zero::bf16 or zero::fp16); for fp32 training use "
                "zero::precision::Full<float>");
  using param_type = T;
  using grad_type = T;
  static constexpr bool mixed = true;
  static constexpr bool loss_scaling = std::is_same_v<T, fp16>;
};

}  // namespace precision

// Partition stage of the ZeRO paper: 0 = plain data parallel, 1 = optimizer
// states (P_os), 2 = + gradients (P_os+g), 3 = + parameters (P_os+g+p).
template <int S>
struct stage {
  static_assert(S >= 0 && S <= 3, "zero::stage<S>: ZeRO has stages 0, 1, 2 and 3");
  static constexpr int value = S;
};

namespace offload {
// Master weights and optimizer state stay with the backend's memory.
struct None {
  static constexpr bool to_host = false;
  static constexpr const char* name = "none";
};
// ZeRO-Offload: the fp32 master and optimizer state live in page-locked host
// memory, updated by the CPU (the host fused step) while the GPU computes
// (backend::Cuda, stages 1-3; docs/offload.md).
struct Cpu {
  static constexpr bool to_host = true;
  static constexpr const char* name = "cpu";
};
// ZeRO-Infinity's disk tier: as Cpu, with the master and state in swap files
// on a local disk (Options::nvme), streamed through a host window at each
// step; #include "zero/offload/disk_state_store.hpp" (liburing, xxHash);
// any backend, stages 1-3 (docs/offload-disk.md).
struct Nvme {
  static constexpr bool to_host = true;
  static constexpr const char* name = "nvme";
};
}  // namespace offload

namespace backend {
// CPU only: buffers in host memory, host SIMD kernels; what CI runs.
struct Host {
  static constexpr bool device = false;
  static constexpr const char* name = "host";
};
// NVIDIA GPUs: device buffers, streams, fused CUDA kernels (zero/backend/cuda.hpp).
struct Cuda {
  static constexpr bool device = true;
  static constexpr const char* name = "cuda";
};
}  // namespace backend

template <class P>
concept PrecisionPolicy = requires {
  typename P::param_type;
  typename P::grad_type;
  { P::mixed } -> std::convertible_to<bool>;
  { P::loss_scaling } -> std::convertible_to<bool>;
};

template <class S>
concept StagePolicy = requires { { S::value } -> std::convertible_to<int>; };

template <class O>
concept OffloadPolicy = requires { { O::to_host } -> std::convertible_to<bool>; };

template <class B>
concept BackendPolicy = requires { { B::device } -> std::convertible_to<bool>; };

}  // namespace zero
