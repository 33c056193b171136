// Why: the CUDA step must give the same bits as the host step (ZeRO-Offload
// moves shards between them), for every optimizer, storage type, size,
// alignment and launch shape, and the gradient statistics must find the norm
// and every inf/NaN. This program holds cuda_step.cuh to that on a real GPU.
// It is self-contained (GPU machines may lack Catch2): a tiny CHECK harness,
// a closing "N passed, M failed" line, exit 77 (skip) without a CUDA device.
//
//   test_cuda_kernels [--quick] [--only errors|stats|step|large]
//     --quick (or ZERO_CUDA_TEST_QUICK=1): smaller sizes and no >2^31 shard,
//     for runs under compute-sanitizer; --only: one group of tests.
#include <cuda_runtime.h>
#include <thrust/fill.h>
#include <thrust/system/cuda/execution_policy.h>
#include <thrust/tabulate.h>

#include <cmath>
#include <cstdarg>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "zero/backend/host.hpp"
#include "zero/comm/reduce.cuh"
#include "zero/cuda/check.hpp"
#include "zero/error.hpp"
#include "zero/kernels/cuda_quantize.cuh"
#include "zero/kernels/cuda_step.cuh"
#include "zero/kernels/host_step.hpp"
#include "zero/optim/adam.hpp"
#include "zero/optim/sgd.hpp"
#include "zero/precision/stochastic.hpp"
#include "zero/quant/symmetric.hpp"

#include "check_harness.hpp"

namespace {

using zero::bf16;
using zero::fp16;
using zero::kernels::CudaGradStats;
using zero::kernels::CudaLaunch;
using zero::kernels::FusedStepArgs;
using zero::kernels::GradStats;

// ---- harness: tests/cuda/check_harness.hpp ----------------------------
using zero::test::bits_of;
using zero::test::fmt;
using zero::test::g_failed;
using zero::test::g_passed;

using Options = zero::test::TestArgs;

// ---- deterministic data, the same on host and device ---------------------
// Uniform in [-1, 1) with 24 random bits: exact in float, so host and device
// generators agree bit for bit.
ZERO_HOST_DEVICE inline float uniform(std::uint64_t seed, std::uint64_t i) {
  const std::uint64_t h = zero::detail::mix64(seed * 0x9e3779b97f4a7c15ull + i);
  return static_cast<float>(static_cast<std::int64_t>(h >> 40) - (std::int64_t{1} << 23)) * (1.0f / 8388608.0f);
}

// Gradient values: uniform, with zeros, signed zeros, float subnormals, tiny
// and large values sprinkled in (no inf/NaN: a step never runs on those).
ZERO_HOST_DEVICE inline float grad_value(std::uint64_t seed, std::uint64_t i) {
  if (i % 101 == 7) {
    switch ((i / 101) % 6) {
      case 0:
        return 0.0f;
      case 1:
        return -0.0f;
      case 2:
        return 1.5e-39f;  // fp32 subnormal
      case 3:
        return -3.0e-8f;  // fp16 subnormal
      case 4:
        return 6.0e4f;  // near fp16's largest
      default:
        return -1.0e-30f;
    }
  }
  return 4.0f * uniform(seed, i);
}

template <class T>
T sentinel() {
  if constexpr (std::is_same_v<T, float>) {
    return -12345.678f;
  } else {
    return T{0x5a5a};
  }
}

// ---- device memory -------------------------------------------------------
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t count) : count_(count) {
    ZERO_CUDA_CHECK(cudaMalloc(&data_, (count > 0 ? count : 1) * sizeof(T)));
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(data_); }
  T* get() const { return data_; }
  void upload(const std::vector<T>& h, cudaStream_t s) {
    ZERO_CUDA_CHECK(cudaMemcpyAsync(data_, h.data(), count_ * sizeof(T), cudaMemcpyHostToDevice, s));
  }
  std::vector<T> download(cudaStream_t s) const {
    std::vector<T> h(count_);
    ZERO_CUDA_CHECK(cudaMemcpyAsync(h.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost, s));
    ZERO_CUDA_CHECK(cudaStreamSynchronize(s));
    return h;
  }

 private:
  T* data_ = nullptr;
  std::size_t count_ = 0;
};

class Stream {
 public:
  Stream() { ZERO_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { cudaStreamDestroy(s_); }
  operator cudaStream_t() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// Whole arrays, padding included, so writes outside [offset, offset + n)
// show up as a changed sentinel.
template <class T>
bool same_bits(const std::vector<T>& host, const std::vector<T>& device, std::size_t offset, const char* array,
               std::string& why) {
  if (std::memcmp(host.data(), device.data(), host.size() * sizeof(T)) == 0) return true;
  for (std::size_t i = 0; i < host.size(); ++i) {
    if (bits_of(host[i]) != bits_of(device[i])) {
      const long long rel = static_cast<long long>(i) - static_cast<long long>(offset);
      why += fmt("%s differs first at element %lld of the shard (host bits 0x%llx, device bits 0x%llx); ", array, rel,
                 static_cast<unsigned long long>(bits_of(host[i])), static_cast<unsigned long long>(bits_of(device[i])));
      return false;
    }
  }
  return false;
}

// ---- fused step: device == host, bit for bit -----------------------------
struct Offsets {
  std::size_t master, grad, state, param;
  const char* name;
};

constexpr std::size_t kPad = 40;                                         // sentinel elements after each shard
constexpr std::uint64_t kGlobalOffset = (std::uint64_t{1} << 33) + 977;  // stochastic index beyond 32 bits

template <class Opt, class Grad, class Param>
void step_case(const char* label, const typename Opt::Hyper& hyper, std::size_t n, const Offsets& off, bool rounding,
               const CudaLaunch& launch, cudaStream_t stream) {
  constexpr int S = Opt::state_slots;
  constexpr bool low = !std::is_same_v<Param, float>;
  const std::string what = fmt("%s grad=%s param=%s n=%zu offsets=%s rounding=%s launch=%dx%d", label,
                               zero::dtype_traits<Grad>::name, zero::dtype_traits<Param>::name, n, off.name,
                               rounding ? "stochastic" : "nearest", launch.threads, launch.blocks_per_sm);
  try {
    std::vector<float> master(off.master + n + kPad, sentinel<float>());
    std::vector<std::vector<float>> state(S, std::vector<float>(off.state + n + kPad, sentinel<float>()));
    std::vector<Param> param(low ? off.param + n + kPad : 1, sentinel<Param>());
    std::vector<Grad> grad(off.grad + n + kPad, sentinel<Grad>());
    for (std::size_t i = 0; i < n; ++i) {
      master[off.master + i] = uniform(11, i);
      for (int k = 0; k < S; ++k) {
        const float u = uniform(21 + static_cast<std::uint64_t>(k), i);
        // Adam's second moment (slot 1) is never negative.
        state[k][off.state + i] = (std::is_same_v<Opt, zero::optim::Sgd> || k == 0) ? 0.1f * u : 0.01f * std::fabs(u);
      }
    }
    DeviceArray<float> d_master(master.size());
    std::vector<std::unique_ptr<DeviceArray<float>>> d_state;
    for (int k = 0; k < S; ++k) d_state.push_back(std::make_unique<DeviceArray<float>>(state[k].size()));
    DeviceArray<Param> d_param(param.size());
    DeviceArray<Grad> d_grad(grad.size());
    d_master.upload(master, stream);
    for (int k = 0; k < S; ++k) d_state[k]->upload(state[k], stream);
    d_param.upload(param, stream);

    for (std::int64_t step = 1; step <= 3; ++step) {
      for (std::size_t i = 0; i < n; ++i)
        grad[off.grad + i] = zero::from_float<Grad>(grad_value(100 + static_cast<std::uint64_t>(step), i));
      d_grad.upload(grad, stream);

      FusedStepArgs<Opt, Grad, Param> h;
      h.n = n;
      h.grad_scale = 0.37f;
      h.scalars = Opt::prepare(hyper, step);
      h.rounding = zero::StochasticRounding{rounding, 0x5eedull, static_cast<std::uint64_t>(step)};
      h.global_offset = kGlobalOffset;
      FusedStepArgs<Opt, Grad, Param> d = h;
      h.master = master.data() + off.master;
      d.master = d_master.get() + off.master;
      h.grad = grad.data() + off.grad;
      d.grad = d_grad.get() + off.grad;
      for (int k = 0; k < S; ++k) {
        h.state[k] = state[k].data() + off.state;
        d.state[k] = d_state[k]->get() + off.state;
      }
      if constexpr (low) {
        h.param = param.data() + off.param;
        d.param = d_param.get() + off.param;
      }
      zero::kernels::host_fused_step(h);
      zero::kernels::cuda_fused_step(d, stream, launch);
    }
    ZERO_CUDA_CHECK(cudaStreamSynchronize(stream));

    std::string why;
    bool ok = same_bits(master, d_master.download(stream), off.master, "master", why);
    for (int k = 0; k < S; ++k)
      ok = same_bits(state[k], d_state[k]->download(stream), off.state, k == 0 ? "state[0]" : "state[1]", why) && ok;
    if constexpr (low) ok = same_bits(param, d_param.download(stream), off.param, "param", why) && ok;
    CHECK(ok, what + ": " + why);
  } catch (const std::exception& e) {
    CHECK(false, what + ": exception: " + e.what());
  }
}

template <class Opt, class Grad, class Param>
void step_suite(const char* label, const typename Opt::Hyper& hyper, const Options& o, cudaStream_t stream) {
  const int failed_before = g_failed;
  const int passed_before = g_passed;
  const std::size_t big = o.quick ? 70001 : (std::size_t{1} << 20) + 5;
  const std::size_t sizes[] = {1, 7, 4096 + 3, big};
  // Same offset on every array: aligned after a scalar head. Different
  // offsets: no common alignment, element-by-element path.
  const Offsets modes[] = {{0, 0, 0, 0, "aligned"}, {3, 3, 3, 3, "all+3"}, {0, 1, 2, 5, "mixed"}};
  for (std::size_t n : sizes)
    for (const Offsets& m : modes) step_case<Opt, Grad, Param>(label, hyper, n, m, true, CudaLaunch{}, stream);
  // A small grid: every thread walks the grid-stride loops many times.
  step_case<Opt, Grad, Param>(label, hyper, big, modes[0], true, CudaLaunch{64, 1}, stream);
  step_case<Opt, Grad, Param>(label, hyper, big, modes[2], true, CudaLaunch{96, 1}, stream);
  // Round-to-nearest copies.
  step_case<Opt, Grad, Param>(label, hyper, 4096 + 3, modes[1], false, CudaLaunch{}, stream);
  std::printf("step %-22s grad=%-4s param=%-4s %3d passed, %d failed\n", label, zero::dtype_traits<Grad>::name,
              zero::dtype_traits<Param>::name, g_passed - passed_before, g_failed - failed_before);
  std::fflush(stdout);
}

// The storage combinations training uses: fp32; bf16 or fp16 mixed
// precision (grads and copies in the low type); fp32 gradient accumulation
// with a low-precision copy.
template <class Opt>
void step_suite_all_types(const char* label, const typename Opt::Hyper& hyper, const Options& o, cudaStream_t stream) {
  step_suite<Opt, float, float>(label, hyper, o, stream);
  step_suite<Opt, bf16, bf16>(label, hyper, o, stream);
  step_suite<Opt, fp16, fp16>(label, hyper, o, stream);
  step_suite<Opt, float, bf16>(label, hyper, o, stream);
  step_suite<Opt, float, fp16>(label, hyper, o, stream);
}

void step_tests(const Options& o, cudaStream_t stream) {
  using namespace zero::optim;
  Adam::Hyper adam;
  adam.lr = 1e-2;
  step_suite_all_types<Adam>("adam", adam, o, stream);
  Adam::Hyper adam_l2 = adam;
  adam_l2.weight_decay = 0.05;
  step_suite_all_types<Adam>("adam(l2)", adam_l2, o, stream);
  AdamW::Hyper adamw;
  adamw.lr = 1e-2;
  adamw.weight_decay = 0.1;
  step_suite_all_types<AdamW>("adamw", adamw, o, stream);
  Sgd::Hyper sgd;
  sgd.lr = 0.05;
  step_suite_all_types<Sgd>("sgd", sgd, o, stream);
  Sgd::Hyper sgd_momentum = sgd;
  sgd_momentum.momentum = 0.9;
  sgd_momentum.dampening = 0.1;
  sgd_momentum.weight_decay = 1e-3;
  step_suite_all_types<Sgd>("sgd(momentum,wd)", sgd_momentum, o, stream);
  Sgd::Hyper nesterov = sgd;
  nesterov.momentum = 0.9;
  nesterov.nesterov = true;
  step_suite_all_types<Sgd>("sgd(nesterov)", nesterov, o, stream);
}

// ---- lean formats: device == host, bit for bit ----------------------------
// bf16 mixed precision with a remainder master, bf16 states (nearest or
// stochastic) or 8-bit block-wise states (blocks cut by a phase, a short
// last block), alone and together: three steps on each side, then every
// array compared whole.
enum class Lean { remainder, bf16_states, bf16_stochastic_states, blockwise8, blockwise8_remainder };

template <class Opt>
void lean_case(const typename Opt::Hyper& hyper, std::size_t n, Lean mode, cudaStream_t stream) {
  using zero::bf16;
  constexpr int S = Opt::state_slots;
  const bool split = mode == Lean::remainder || mode == Lean::blockwise8_remainder;
  const bool s16 = mode == Lean::bf16_states || mode == Lean::bf16_stochastic_states;
  const bool q8 = mode == Lean::blockwise8 || mode == Lean::blockwise8_remainder;
  const std::uint32_t block = 256, phase = 37;
  const std::string what = fmt("lean %s n=%zu mode=%d", Opt::name, n, static_cast<int>(mode));
  try {
    FusedStepArgs<Opt, bf16, bf16> probe;
    probe.n = n;
    probe.block = block;
    probe.block_phase = phase;
    const std::size_t blocks = probe.block_count();
    std::vector<float> master(n), state[S > 0 ? S : 1], absmax[S > 0 ? S : 1];
    std::vector<bf16> param(n), state16[S > 0 ? S : 1];
    std::vector<std::uint16_t> rest(n, 0);
    std::vector<std::uint8_t> codes[S > 0 ? S : 1];
    const float* tables[S > 0 ? S : 1] = {};
    for (std::size_t i = 0; i < n; ++i) {
      master[i] = uniform(11, i);
      param[i] = zero::from_float<bf16>(master[i]);
      if (split) zero::split_master(master[i], param[i], rest[i]);
    }
    for (int k = 0; k < S; ++k) {
      const bool non_negative = zero::optim::state_values<Opt>(k) == zero::optim::StateValues::non_negative;
      std::vector<float> init(n);
      for (std::size_t i = 0; i < n; ++i) {
        const float u = uniform(21 + static_cast<std::uint64_t>(k), i);
        init[i] = non_negative ? 0.01f * std::fabs(u) : 0.1f * u;
      }
      state[k] = init;
      state16[k].resize(n);
      for (std::size_t i = 0; i < n; ++i) state16[k][i] = zero::from_float<bf16>(init[i]);
      tables[k] = zero::quant::code_for(non_negative);
      codes[k].resize(n);
      absmax[k].resize(blocks);
      for (std::size_t b = 0; b < blocks; ++b) {
        const std::size_t lo = probe.block_begin(b), hi = probe.block_end(b);
        absmax[k][b] = zero::quant::quantize_block(init.data() + lo, hi - lo, tables[k], codes[k].data() + lo);
      }
    }
    DeviceArray<float> d_master(n);
    DeviceArray<bf16> d_param(n), d_grad(n);
    DeviceArray<std::uint16_t> d_rest(n);
    std::vector<std::unique_ptr<DeviceArray<float>>> d_state, d_absmax, d_table;
    std::vector<std::unique_ptr<DeviceArray<bf16>>> d_state16;
    std::vector<std::unique_ptr<DeviceArray<std::uint8_t>>> d_codes;
    d_master.upload(master, stream);
    d_param.upload(param, stream);
    d_rest.upload(rest, stream);
    for (int k = 0; k < S; ++k) {
      d_state.push_back(std::make_unique<DeviceArray<float>>(n));
      d_state.back()->upload(state[k], stream);
      d_state16.push_back(std::make_unique<DeviceArray<bf16>>(n));
      d_state16.back()->upload(state16[k], stream);
      d_codes.push_back(std::make_unique<DeviceArray<std::uint8_t>>(n));
      d_codes.back()->upload(codes[k], stream);
      d_absmax.push_back(std::make_unique<DeviceArray<float>>(blocks));
      d_absmax.back()->upload(absmax[k], stream);
      d_table.push_back(std::make_unique<DeviceArray<float>>(zero::quant::code_size));
      d_table.back()->upload(std::vector<float>(tables[k], tables[k] + zero::quant::code_size), stream);
    }
    std::vector<bf16> grad(n);
    for (std::int64_t step = 1; step <= 3; ++step) {
      for (std::size_t i = 0; i < n; ++i) grad[i] = zero::from_float<bf16>(grad_value(100 + static_cast<std::uint64_t>(step), i));
      d_grad.upload(grad, stream);
      FusedStepArgs<Opt, bf16, bf16> h = probe;
      h.grad_scale = 0.37f;
      h.scalars = Opt::prepare(hyper, step);
      h.global_offset = kGlobalOffset;
      h.ties_away = split;
      h.state_rounding = zero::StochasticRounding{mode == Lean::bf16_stochastic_states, 0x5eedull,
                                                  static_cast<std::uint64_t>(step)};
      FusedStepArgs<Opt, bf16, bf16> d = h;
      h.grad = grad.data();
      d.grad = d_grad.get();
      h.param = param.data();
      d.param = d_param.get();
      if (split) {
        h.remainder = rest.data();
        d.remainder = d_rest.get();
      } else {
        h.master = master.data();
        d.master = d_master.get();
      }
      for (int k = 0; k < S; ++k) {
        if (q8) {
          h.state8[k] = codes[k].data();
          d.state8[k] = d_codes[k]->get();
          h.absmax[k] = absmax[k].data();
          d.absmax[k] = d_absmax[k]->get();
          h.code[k] = tables[k];
          d.code[k] = d_table[k]->get();
        } else if (s16) {
          h.state16[k] = state16[k].data();
          d.state16[k] = d_state16[k]->get();
        } else {
          h.state[k] = state[k].data();
          d.state[k] = d_state[k]->get();
        }
      }
      zero::kernels::host_fused_step(h);
      zero::kernels::cuda_fused_step(d, stream);
    }
    ZERO_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::string why;
    bool ok = same_bits(param, d_param.download(stream), 0, "param", why);
    ok = (split ? same_bits(rest, d_rest.download(stream), 0, "remainder", why)
                : same_bits(master, d_master.download(stream), 0, "master", why)) && ok;
    for (int k = 0; k < S; ++k) {
      if (q8) {
        ok = same_bits(codes[k], d_codes[k]->download(stream), 0, "codes", why) && ok;
        ok = same_bits(absmax[k], d_absmax[k]->download(stream), 0, "absmax", why) && ok;
      } else if (s16) {
        ok = same_bits(state16[k], d_state16[k]->download(stream), 0, "bf16 state", why) && ok;
      } else {
        ok = same_bits(state[k], d_state[k]->download(stream), 0, "state", why) && ok;
      }
    }
    CHECK(ok, what + ": " + why);
  } catch (const std::exception& e) {
    CHECK(false, what + ": exception: " + e.what());
  }
}

void lean_tests(const Options& o, cudaStream_t stream) {
  using namespace zero::optim;
  const int failed_before = g_failed, passed_before = g_passed;
  AdamW::Hyper adamw;
  adamw.lr = 1e-2;
  adamw.weight_decay = 0.1;
  Sgd::Hyper sgd;
  sgd.lr = 0.05;
  sgd.momentum = 0.9;
  const std::size_t big = o.quick ? 70001 : (std::size_t{1} << 20) + 5;
  for (const Lean mode : {Lean::remainder, Lean::bf16_states, Lean::bf16_stochastic_states, Lean::blockwise8,
                          Lean::blockwise8_remainder})
    for (const std::size_t n : {std::size_t{1}, std::size_t{255}, std::size_t{4096 + 3}, big}) {
      lean_case<AdamW>(adamw, n, mode, stream);
      lean_case<Sgd>(sgd, n, mode, stream);
    }
  std::printf("lean formats %d passed, %d failed\n", g_passed - passed_before, g_failed - failed_before);
  std::fflush(stdout);
}

// ---- qwZ's and qgZ's int8/int4 blocks: device payloads, residuals and values == host, bit for bit ----
template <class T>
void qwz_case(std::size_t n, const zero::quant::Format& f, bool feedback, cudaStream_t stream) {
  const std::string what = fmt("quant %s n=%zu int%d block=%zu%s", zero::dtype_traits<T>::name, n, f.bits, f.block,
                               feedback ? " feedback" : "");
  // Two pieces of n elements, 3 elements apart, payloads 4 bytes apart.
  const zero::quant::Pieces pieces{2, n, n + 3, f.payload_bytes(n) + 4};
  const std::size_t values = 2 * n + 3, bytes = 2 * pieces.payload_stride;
  std::vector<T> x(values);
  for (std::size_t i = 0; i < values; ++i) x[i] = zero::from_float<T>(0.03f * uniform(1234 + n, i) - 0.015f);
  if (n > 5) x[5] = zero::from_float<T>(0.0f);
  std::vector<float> residual(values);
  for (std::size_t i = 0; i < values; ++i) residual[i] = feedback ? 0.001f * uniform(99 + n, i) - 0.0005f : 0.0f;
  std::vector<unsigned char> host(bytes, 0);
  std::vector<float> host_residual = residual;
  using HostOps = zero::backend::Ops<zero::backend::Host>;
  HostOps::quantize(x.data(), feedback ? host_residual.data() : nullptr, pieces, f, host.data());
  std::vector<T> host_back(values, zero::from_float<T>(0.0f));
  HostOps::dequantize(host.data(), pieces, f, host_back.data());
  std::vector<float> host_sum(n);
  HostOps::dequantize_sum(host.data(), 2, pieces.payload_stride, n, f, host_sum.data());
  DeviceArray<T> dx(values), dback(values);
  DeviceArray<float> dresidual(values), dsum(n);
  DeviceArray<unsigned char> dpayload(bytes);
  dx.upload(x, stream);
  dresidual.upload(residual, stream);
  dback.upload(std::vector<T>(values, zero::from_float<T>(0.0f)), stream);
  ZERO_CUDA_CHECK(cudaMemsetAsync(dpayload.get(), 0, bytes, stream));  // (the codes' padding bytes)
  zero::kernels::cuda_quantize(dx.get(), feedback ? dresidual.get() : nullptr, pieces, f, dpayload.get(), stream);
  zero::kernels::cuda_dequantize(dpayload.get(), pieces, f, dback.get(), stream);
  zero::kernels::cuda_dequantize_sum(dpayload.get(), 2, pieces.payload_stride, n, f, dsum.get(), stream);
  const auto device = dpayload.download(stream);
  std::string why;
  const bool payload_same = std::memcmp(device.data(), host.data(), bytes) == 0;
  if (!payload_same) why += "payload bytes differ; ";
  const bool values_same = same_bits(host_back, dback.download(stream), 0, "values", why);
  const bool residual_same = same_bits(host_residual, dresidual.download(stream), 0, "residual", why);
  const bool sum_same = same_bits(host_sum, dsum.download(stream), 0, "sum", why);
  CHECK(payload_same && values_same && residual_same && sum_same, what + ": " + why);
}

void qwz_tests(const Options& o, cudaStream_t stream) {
  const int failed_before = g_failed, passed_before = g_passed;
  const std::size_t big = o.quick ? 70001 : (std::size_t{1} << 22) + 7;
  for (const int bits : {8, 4})
    for (const std::size_t block : {std::size_t{32}, std::size_t{2048}, std::size_t{1} << 16})
      for (const std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{2049}, big}) {
        const zero::quant::Format f{bits, block};
        qwz_case<float>(n, f, bits == 4, stream);
        qwz_case<bf16>(n, f, false, stream);
        qwz_case<fp16>(n, f, bits == 4, stream);
      }
  std::printf("quant int8/int4 blocks %d passed, %d failed\n", g_passed - passed_before, g_failed - failed_before);
  std::fflush(stdout);
}

// ---- a shard beyond 2^31 elements -----------------------------------------
// Element i as the host computes it: grad_value(seed, i), or
// scale x uniform(seed, i).
template <class T>
struct TestValue {
  std::uint64_t seed;
  float scale;
  bool gradient;
  __device__ T operator()(std::uint64_t i) const {
    return zero::from_float<T>(gradient ? grad_value(seed, i) : scale * uniform(seed, i));
  }
};

template <class T>
void fill_device(T* p, std::size_t n, std::uint64_t seed, float scale, bool gradient, cudaStream_t stream) {
  thrust::tabulate(thrust::cuda::par_nosync.on(stream), p, p + n, TestValue<T>{seed, scale, gradient});
}

// AdamW, bf16 grads and copies, on (2^31 + 4099) elements: the windows at the
// start, across 2^31 and at the end match the host step on the same values
// (which also checks stochastic rounding's 64-bit element index). Then the
// gradient statistics over all of it, with one NaN past 2^31.
void large_shard_test(cudaStream_t stream) {
  using Opt = zero::optim::AdamW;
  const std::size_t n = (std::size_t{1} << 31) + 4099;
  const std::size_t need = n * (4 + 4 + 4 + 2 + 2) + (std::size_t{2} << 30);
  std::size_t free_bytes = 0, total_bytes = 0;
  ZERO_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (free_bytes < need) {
    std::printf("SKIP large shard: needs %.1f GiB of device memory, %.1f GiB free\n", need / 1073741824.0,
                free_bytes / 1073741824.0);
    return;
  }
  float *master = nullptr, *m = nullptr, *v = nullptr;
  bf16 *grad = nullptr, *param = nullptr;
  ZERO_CUDA_CHECK(cudaMalloc(&master, n * 4));
  ZERO_CUDA_CHECK(cudaMalloc(&m, n * 4));
  ZERO_CUDA_CHECK(cudaMalloc(&v, n * 4));
  ZERO_CUDA_CHECK(cudaMalloc(&grad, n * 2));
  ZERO_CUDA_CHECK(cudaMalloc(&param, n * 2));
  try {
    fill_device(master, n, 11, 1.0f, false, stream);
    fill_device(m, n, 21, 0.1f, false, stream);
    fill_device(v, n, 22, 0.0f, false, stream);  // zeros: v is never negative
    fill_device(grad, n, 101, 0.0f, true, stream);
    Opt::Hyper hyper;
    hyper.lr = 1e-2;
    FusedStepArgs<Opt, bf16, bf16> d;
    d.master = master;
    d.grad = grad;
    d.state[0] = m;
    d.state[1] = v;
    d.param = param;
    d.n = n;
    d.grad_scale = 0.37f;
    d.scalars = Opt::prepare(hyper, 1);
    d.rounding = zero::StochasticRounding{true, 0x5eedull, 1};
    d.global_offset = kGlobalOffset;
    zero::kernels::cuda_fused_step(d, stream);
    ZERO_CUDA_CHECK(cudaStreamSynchronize(stream));

    const std::size_t window = 4096;
    const std::size_t starts[] = {0, (std::size_t{1} << 31) - window / 2, n - window};
    for (std::size_t start : starts) {
      std::vector<float> hm(window), hs0(window), hs1(window);
      std::vector<bf16> hg(window), hp(window);
      for (std::size_t j = 0; j < window; ++j) {
        hm[j] = uniform(11, start + j);
        hs0[j] = 0.1f * uniform(21, start + j);
        hs1[j] = 0.0f * uniform(22, start + j);  // signed zeros, as fill_device writes
        hg[j] = zero::from_float<bf16>(grad_value(101, start + j));
      }
      FusedStepArgs<Opt, bf16, bf16> h = d;
      h.master = hm.data();
      h.grad = hg.data();
      h.state[0] = hs0.data();
      h.state[1] = hs1.data();
      h.param = hp.data();
      h.n = window;
      h.global_offset = kGlobalOffset + start;
      zero::kernels::host_fused_step(h);

      std::vector<float> dm(window), ds0(window), ds1(window);
      std::vector<bf16> dp(window);
      ZERO_CUDA_CHECK(cudaMemcpy(dm.data(), master + start, window * 4, cudaMemcpyDeviceToHost));
      ZERO_CUDA_CHECK(cudaMemcpy(ds0.data(), m + start, window * 4, cudaMemcpyDeviceToHost));
      ZERO_CUDA_CHECK(cudaMemcpy(ds1.data(), v + start, window * 4, cudaMemcpyDeviceToHost));
      ZERO_CUDA_CHECK(cudaMemcpy(dp.data(), param + start, window * 2, cudaMemcpyDeviceToHost));
      std::string why;
      bool ok = same_bits(hm, dm, 0, "master", why);
      ok = same_bits(hs0, ds0, 0, "state[0]", why) && ok;
      ok = same_bits(hs1, ds1, 0, "state[1]", why) && ok;
      ok = same_bits(hp, dp, 0, "param", why) && ok;
      CHECK(ok, fmt("large shard n=%zu, window at %zu: %s", n, start, why.c_str()));
    }

    // Statistics over the whole shard: every element 0.5 (so the exact sum
    // is n/4), then one NaN past 2^31.
    thrust::fill_n(thrust::cuda::par_nosync.on(stream), grad, n, zero::from_float<bf16>(0.5f));
    CudaGradStats stats;
    const GradStats s = stats.compute(grad, n, stream);
    CHECK(s.sum_squares == static_cast<double>(n) * 0.25 && !s.non_finite,
          fmt("large shard stats: sum %.17g (want %.17g), non_finite %d", s.sum_squares, n * 0.25, s.non_finite));
    const bf16 nan{0x7fc0};
    const std::size_t at = (std::size_t{1} << 31) + 5;
    // On `stream`, where the statistics read it: a plain cudaMemcpy from
    // pageable memory may return before its DMA on the legacy default stream
    // lands, and that stream does not order the non-blocking `stream`.
    ZERO_CUDA_CHECK(cudaMemcpyAsync(grad + at, &nan, 2, cudaMemcpyHostToDevice, stream));
    CHECK(stats.compute(grad, n, stream).non_finite, "large shard stats: NaN at 2^31 + 5 not found");
    std::printf("large shard (%zu elements) done\n", n);
  } catch (const std::exception& e) {
    CHECK(false, std::string("large shard: exception: ") + e.what());
  }
  cudaFree(master);
  cudaFree(m);
  cudaFree(v);
  cudaFree(grad);
  cudaFree(param);
}

// ---- gradient statistics ---------------------------------------------------
template <class Grad>
GradStats reference_stats(const std::vector<Grad>& g, std::size_t offset, std::size_t n) {
  GradStats s;
  for (std::size_t i = 0; i < n; ++i) {
    const float x = zero::to_float(g[offset + i]);
    s.sum_squares += static_cast<double>(x) * static_cast<double>(x);
    s.non_finite = s.non_finite || !std::isfinite(x);
  }
  return s;
}

bool close(double got, double want) { return got == want || std::fabs(got - want) <= 1e-6 * std::fabs(want); }

template <class Grad>
Grad special(bool nan) {
  if constexpr (std::is_same_v<Grad, float>) {
    return nan ? std::numeric_limits<float>::quiet_NaN() : -std::numeric_limits<float>::infinity();
  } else if constexpr (std::is_same_v<Grad, fp16>) {
    return fp16{static_cast<std::uint16_t>(nan ? 0x7e00 : 0xfc00)};
  } else {
    return bf16{static_cast<std::uint16_t>(nan ? 0x7fc0 : 0xff80)};
  }
}

template <class Grad>
void grad_stats_suite(const Options& o, cudaStream_t stream) {
  const int failed_before = g_failed;
  const int passed_before = g_passed;
  const char* type = zero::dtype_traits<Grad>::name;
  std::vector<std::size_t> sizes = {0, 1, 7, 4096 + 3, (std::size_t{1} << 20) + 5};
  if (!o.quick) sizes.push_back((std::size_t{1} << 24) + 3);
  const std::size_t offsets[] = {0, 1, 3};
  CudaGradStats stats;
  try {
    for (std::size_t n : sizes) {
      for (std::size_t off : offsets) {
        std::vector<Grad> g(off + n + 8, special<Grad>(true));  // NaN padding: reading past n would show
        for (std::size_t i = 0; i < n; ++i) g[off + i] = zero::from_float<Grad>(grad_value(7 + n, i));
        DeviceArray<Grad> d(g.size());
        d.upload(g, stream);
        const std::string what = fmt("grad stats %s n=%zu offset=%zu", type, n, off);

        const GradStats want = reference_stats(g, off, n);
        const GradStats got = stats.compute(d.get() + off, n, stream);
        CHECK(close(got.sum_squares, want.sum_squares) && !got.non_finite,
              what + fmt(": device sum %.17g, host double reference %.17g, non_finite %d", got.sum_squares,
                         want.sum_squares, got.non_finite));
        const GradStats host = zero::kernels::host_grad_stats(g.data() + off, n);
        CHECK(close(got.sum_squares, host.sum_squares) && got.non_finite == host.non_finite,
              what + fmt(": device sum %.17g, host_grad_stats %.17g", got.sum_squares, host.sum_squares));

        if (n >= 1) {
          const std::size_t positions[] = {0, n / 2, n - 1};
          for (bool nan : {false, true}) {
            for (std::size_t p : positions) {
              const Grad saved = g[off + p];
              const Grad bad = special<Grad>(nan);
              ZERO_CUDA_CHECK(cudaMemcpyAsync(d.get() + off + p, &bad, sizeof(Grad), cudaMemcpyHostToDevice, stream));
              CHECK(stats.compute(d.get() + off, n, stream).non_finite,
                    what + fmt(": %s at %zu not found", nan ? "NaN" : "-inf", p));
              ZERO_CUDA_CHECK(cudaMemcpyAsync(d.get() + off + p, &saved, sizeof(Grad), cudaMemcpyHostToDevice, stream));
              ZERO_CUDA_CHECK(cudaStreamSynchronize(stream));
            }
          }
          CHECK(!stats.compute(d.get() + off, n, stream).non_finite, what + ": flag stuck after restoring");
        }
      }
    }

    // Accumulation over shards, and the flag of one bad shard.
    const std::size_t na = 5000, nb = 123457;
    std::vector<Grad> a(na), b(nb);
    for (std::size_t i = 0; i < na; ++i) a[i] = zero::from_float<Grad>(grad_value(1, i));
    for (std::size_t i = 0; i < nb; ++i) b[i] = zero::from_float<Grad>(grad_value(2, i));
    DeviceArray<Grad> da(na), db(nb);
    da.upload(a, stream);
    db.upload(b, stream);
    const double want = reference_stats(a, 0, na).sum_squares + reference_stats(b, 0, nb).sum_squares;
    stats.enqueue(da.get(), na, stream);
    stats.enqueue(db.get(), nb, stream, true);
    GradStats s = stats.fetch(stream);
    CHECK(close(s.sum_squares, want) && !s.non_finite, fmt("accumulate %s: %.17g vs %.17g", type, s.sum_squares, want));
    const Grad nan = special<Grad>(true);
    ZERO_CUDA_CHECK(cudaMemcpyAsync(db.get() + 77, &nan, sizeof(Grad), cudaMemcpyHostToDevice, stream));
    stats.enqueue(da.get(), na, stream);
    stats.enqueue(db.get(), nb, stream, true);
    CHECK(stats.fetch(stream).non_finite, fmt("accumulate %s: NaN in the second shard not found", type));
    CHECK(!stats.compute(da.get(), na, stream).non_finite, fmt("accumulate %s: a fresh enqueue resets", type));
    // device_result() holds what fetch() returns.
    GradStats on_device;
    ZERO_CUDA_CHECK(cudaMemcpy(&on_device, stats.device_result(), sizeof on_device, cudaMemcpyDeviceToHost));
    CHECK(close(on_device.sum_squares, reference_stats(a, 0, na).sum_squares), "device_result() matches");

    // Other block sizes and small grids (many grid-stride passes per thread).
    const std::size_t nl = (std::size_t{1} << 20) + 5;
    std::vector<Grad> l(nl);
    for (std::size_t i = 0; i < nl; ++i) l[i] = zero::from_float<Grad>(grad_value(3, i));
    DeviceArray<Grad> dl(nl);
    dl.upload(l, stream);
    const double want_l = reference_stats(l, 0, nl).sum_squares;
    for (CudaLaunch launch : {CudaLaunch{128, 1}, CudaLaunch{512, 0}, CudaLaunch{1024, 2}}) {
      CudaGradStats other(launch);
      for (int repeat = 0; repeat < 2; ++repeat) {  // the block counter resets between launches
        const GradStats r = other.compute(dl.get(), nl, stream);
        CHECK(close(r.sum_squares, want_l) && !r.non_finite,
              fmt("grad stats %s threads=%d blocks/SM=%d: %.17g vs %.17g", type, launch.threads, launch.blocks_per_sm,
                  r.sum_squares, want_l));
      }
    }
  } catch (const std::exception& e) {
    CHECK(false, std::string("grad stats ") + type + ": exception: " + e.what());
  }
  std::printf("grad stats %-4s %3d passed, %d failed\n", type, g_passed - passed_before, g_failed - failed_before);
  std::fflush(stdout);
}

// ---- errors ----------------------------------------------------------------
void error_tests(cudaStream_t stream) {
  CHECK_THROWS(ZERO_CUDA_CHECK(cudaSetDevice(1 << 20)), zero::BackendError, "cudaSetDevice(1 << 20)");
  CHECK_THROWS(ZERO_CUDA_CHECK(cudaSetDevice(1 << 20)), zero::BackendError, "test_cuda_kernels.cu:");
  cudaGetLastError();  // that failure leaves no sticky error, but be tidy

  DeviceArray<float> buf(64);
  FusedStepArgs<zero::optim::Sgd, float, float> a;
  a.master = buf.get();
  a.grad = buf.get();
  a.state[0] = buf.get();
  a.n = 64;
  a.scalars = zero::optim::Sgd::prepare(zero::optim::Sgd::Hyper{}, 1);
  CHECK_THROWS(zero::kernels::cuda_fused_step(a, stream, CudaLaunch{100, 0}), zero::InvalidArgument,
               "CudaLaunch::threads is 100");
  CHECK_THROWS(zero::kernels::cuda_fused_step(a, stream, CudaLaunch{256, -1}), zero::InvalidArgument,
               "CudaLaunch::blocks_per_sm is -1");
  FusedStepArgs<zero::optim::Sgd, float, float> no_state = a;
  no_state.state[0] = nullptr;
  CHECK_THROWS(zero::kernels::cuda_fused_step(no_state, stream), zero::InvalidArgument, "state[0] is null");
  FusedStepArgs<zero::optim::Sgd, bf16, bf16> no_copy;
  no_copy.master = buf.get();
  no_copy.grad = reinterpret_cast<const bf16*>(buf.get());
  no_copy.state[0] = buf.get();
  no_copy.n = 8;
  CHECK_THROWS(zero::kernels::cuda_fused_step(no_copy, stream), zero::InvalidArgument, "param is null");
  FusedStepArgs<zero::optim::Sgd, float, float> empty;  // n == 0: nothing to do, nothing checked
  bool threw = false;
  try {
    zero::kernels::cuda_fused_step(empty, stream);
  } catch (...) {
    threw = true;
  }
  CHECK(!threw, "an empty shard is a no-op");
  CHECK_THROWS(CudaGradStats(CudaLaunch{96, 0}), zero::InvalidArgument, "must be 128, 256, 512 or 1024");
  std::printf("errors: done\n");
}

// comm::Nccl's call check (comm/nccl.hpp), the kernel alone (two ranks need
// two GPUs): the ranks' minimum of {h, ~h} equal to this rank's pair leaves
// the output and the flag alone; any other minimum (a rank whose call
// differs) poisons the whole output with 0xFF bytes and flags the call,
// keeping the first flagged call.
void call_check_tests(cudaStream_t stream) {
  const std::uint64_t code = 0x1234abcd5678ef90ull, other = 0x0fedcba987654321ull;
  const std::size_t bytes = 3 * 4096 + 5;
  std::uint64_t* flag = nullptr;
  ZERO_CUDA_CHECK(cudaHostAlloc(&flag, sizeof(std::uint64_t), cudaHostAllocMapped));
  std::uint64_t* flag_on_device = nullptr;
  ZERO_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&flag_on_device), flag, 0));
  *flag = 0;
  DeviceArray<std::uint64_t> reduced(2);
  DeviceArray<unsigned char> out(bytes);
  const std::vector<unsigned char> payload = [&] {
    std::vector<unsigned char> p(bytes);
    for (std::size_t i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(i * 7 % 251);
    return p;
  }();
  auto run = [&](std::uint64_t least, std::uint64_t least_complement, std::uint64_t call) {
    reduced.upload({least, least_complement}, stream);
    out.upload(payload, stream);
    zero::comm::detail::launch_check_call<std::uint64_t>(reduced.get(), code, out.get(), bytes, call, flag_on_device,
                                                         stream);
    ZERO_CUDA_CHECK(cudaGetLastError());
    return out.download(stream);
  };
  CHECK(run(code, ~code, 5) == payload && *flag == 0, "the same call on every rank changed the output or the flag");
  const std::uint64_t low = std::min(code, other), high = std::max(code, other);
  const std::vector<unsigned char> poisoned(bytes, 0xFF);
  CHECK(run(low, ~high, 6) == poisoned, "a rank whose code differs: the output is not all 0xFF");
  CHECK(*flag == 6, fmt("a rank whose code differs: the flag says %llu, not call 6",
                        static_cast<unsigned long long>(*flag)));
  CHECK(run(code, ~high, 7) == poisoned && *flag == 6, "a later mismatch: not poisoned, or the first call not kept");
  cudaFreeHost(flag);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!zero::test::parse_test_args(argc, argv, {"errors", "stats", "step", "lean", "qwz", "large", "callcheck"}, true, o)) return 2;
  if (zero::test::no_cuda_device()) return 77;
  try {
    cudaDeviceProp prop{};
    ZERO_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device 0: %s, compute capability %d.%d, %d SMs%s\n", prop.name, prop.major, prop.minor,
                prop.multiProcessorCount, o.quick ? " (quick)" : "");
    Stream stream;
    if (o.runs("errors")) error_tests(stream);
    if (o.runs("stats")) {
      grad_stats_suite<float>(o, stream);
      grad_stats_suite<bf16>(o, stream);
      grad_stats_suite<fp16>(o, stream);
    }
    if (o.runs("step")) step_tests(o, stream);
    if (o.runs("lean")) lean_tests(o, stream);
    if (o.runs("qwz")) qwz_tests(o, stream);
    if (o.runs("large") && !o.quick) large_shard_test(stream);
    if (o.runs("callcheck")) call_check_tests(stream);
  } catch (const std::exception& e) {
    CHECK(false, std::string("uncaught exception: ") + e.what());
  }
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
