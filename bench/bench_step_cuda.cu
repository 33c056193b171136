// CUDA fused-step benchmark: parameters/s, bytes/s, the ratio to the
// bandwidth limit of the same access pattern (ProbePolicy through the same
// kernel, same element types and launch shape, timed interleaved with the
// real step in this run) and, where the device reports it, to the memory's
// theoretical peak. Also the gradient statistics pass and a device-to-device
// copy for reference. Exits 77 without a CUDA device.
//
//   bench_step_cuda [--n PARAMS (default 64M; K/M/G suffixes)] [--reps R] [--trials T] [--json]
//                   [--threads T] [--blocks-per-sm B]
#include <cuda_runtime.h>
#include <thrust/system/cuda/execution_policy.h>
#include <thrust/tabulate.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "bench_args.hpp"
#include "probe_policy.hpp"
#include "zero/cuda/check.hpp"
#include "zero/kernels/cuda_step.cuh"
#include "zero/optim/adam.hpp"
#include "zero/optim/sgd.hpp"

namespace {

using zero::bf16;
using zero::kernels::CudaLaunch;
using zero::kernels::FusedStepArgs;

struct Options {
  std::size_t n = std::size_t{64} << 20;
  int reps = 20;   // steps per timed run
  int trials = 5;  // timed runs of each kernel, alternating; the median counts
  bool json = false;
  CudaLaunch launch{};
};

struct Device {
  std::string name;
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
  double peak_bytes_per_s = 0.0;  // 0: not reported by this device/runtime
};

Device describe_device() {
  int device = 0;
  ZERO_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  ZERO_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  Device d;
  d.name = prop.name;
  d.sm_count = prop.multiProcessorCount;
  d.cc_major = prop.major;
  d.cc_minor = prop.minor;
  // cudaDeviceProp lost memoryClockRate in CUDA 13; the attribute may still
  // answer. Double data rate: two transfers per clock.
  int clock_khz = 0, bus_bits = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device) == cudaSuccess &&
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) == cudaSuccess && clock_khz > 0 &&
      bus_bits > 0)
    d.peak_bytes_per_s = 2.0 * clock_khz * 1e3 * bus_bits / 8.0;
  cudaGetLastError();  // an unsupported attribute leaves nothing behind
  return d;
}

__device__ float hash_uniform(std::uint64_t seed, std::size_t i) {  // [-1, 1)
  const std::uint64_t h = zero::detail::mix64(seed * 0x9e3779b97f4a7c15ull + i);
  return static_cast<float>(static_cast<std::int64_t>(h >> 40) - (std::int64_t{1} << 23)) * (1.0f / 8388608.0f);
}

// Element i: scale x hash_uniform(seed, i), its absolute value with `absolute`.
template <class T>
struct RandomValue {
  std::uint64_t seed;
  float scale;
  bool absolute;
  __device__ T operator()(std::size_t i) const {
    const float u = hash_uniform(seed, i);
    return zero::from_float<T>(scale * (absolute ? fabsf(u) : u));
  }
};

// On stream 0, as every setup call here; the callers synchronise the device
// before timing.
template <class T>
void fill(T* p, std::size_t n, std::uint64_t seed, float scale, bool absolute = false) {
  thrust::tabulate(thrust::cuda::par_nosync.on(cudaStream_t{}), p, p + n, RandomValue<T>{seed, scale, absolute});
}

class Timer {
 public:
  Timer() {
    ZERO_CUDA_CHECK(cudaEventCreate(&start_));
    ZERO_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~Timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  // Seconds per call of f(r) over `reps` calls enqueued back to back on `stream`.
  template <class F>
  double seconds_per_call(cudaStream_t stream, int reps, F&& f) {
    ZERO_CUDA_CHECK(cudaEventRecord(start_, stream));
    for (int r = 0; r < reps; ++r) f(r);
    ZERO_CUDA_CHECK(cudaEventRecord(stop_, stream));
    ZERO_CUDA_CHECK(cudaEventSynchronize(stop_));
    float ms = 0.0f;
    ZERO_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    return ms * 1e-3 / reps;
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string peak_json(double bytes_per_s, const Device& d) {
  if (d.peak_bytes_per_s <= 0.0) return "\"peak_gb_per_s\":null,\"ratio_to_peak\":null";
  char buf[128];
  std::snprintf(buf, sizeof buf, "\"peak_gb_per_s\":%.1f,\"ratio_to_peak\":%.4f", d.peak_bytes_per_s / 1e9,
                bytes_per_s / d.peak_bytes_per_s);
  return buf;
}

std::string peak_text(double bytes_per_s, const Device& d) {
  if (d.peak_bytes_per_s <= 0.0) return "peak n/a";
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.3f of peak %.0f GB/s", bytes_per_s / d.peak_bytes_per_s, d.peak_bytes_per_s / 1e9);
  return buf;
}

template <class Opt, class Grad, class Param>
void run(const char* label, const typename Opt::Hyper& hyper, const Options& o, const Device& dev,
         cudaStream_t stream) {
  constexpr int slots = Opt::state_slots;
  constexpr bool low = !std::is_same_v<Param, float>;
  using Probe = zero::bench::ProbePolicy<slots>;
  const std::size_t n = o.n;

  float* master = nullptr;
  Grad* grad = nullptr;
  float* state[slots > 0 ? slots : 1] = {};
  Param* param = nullptr;
  ZERO_CUDA_CHECK(cudaMalloc(&master, n * sizeof(float)));
  ZERO_CUDA_CHECK(cudaMalloc(&grad, n * sizeof(Grad)));
  for (int k = 0; k < slots; ++k) ZERO_CUDA_CHECK(cudaMalloc(&state[k], n * sizeof(float)));
  if (low) ZERO_CUDA_CHECK(cudaMalloc(&param, n * sizeof(Param)));
  fill(master, n, 1, 0.5f);
  fill(grad, n, 2, 0.01f);
  for (int k = 0; k < slots; ++k) fill(state[k], n, 3 + k, k == 1 ? 1e-4f : 0.01f, k == 1);  // Adam's v >= 0
  ZERO_CUDA_CHECK(cudaDeviceSynchronize());

  FusedStepArgs<Opt, Grad, Param> a;
  FusedStepArgs<Probe, Grad, Param> p;
  a.master = p.master = master;
  a.grad = p.grad = grad;
  for (int k = 0; k < slots; ++k) a.state[k] = p.state[k] = state[k];
  a.param = p.param = param;
  a.n = p.n = n;
  a.grad_scale = p.grad_scale = 1.0f / 1024.0f;
  p.scalars = Probe::prepare(typename Probe::Hyper{}, 1);
  std::int64_t step = 1;
  auto real_step = [&](int) {
    a.scalars = Opt::prepare(hyper, step++);
    zero::kernels::cuda_fused_step(a, stream, o.launch);
  };
  auto probe_step = [&](int) { zero::kernels::cuda_fused_step(p, stream, o.launch); };

  Timer timer;
  timer.seconds_per_call(stream, 3, real_step);  // warm-up: clocks, caches, first-launch costs
  timer.seconds_per_call(stream, 3, probe_step);
  std::vector<double> real, probe;
  for (int t = 0; t < o.trials; ++t) {  // alternate, so drift hits both
    real.push_back(timer.seconds_per_call(stream, o.reps, real_step));
    probe.push_back(timer.seconds_per_call(stream, o.reps, probe_step));
  }
  const double t_real = median(real), t_probe = median(probe);

  // The launch shape the kernel got (as cuda_fused_step chooses it).
  constexpr int V = zero::kernels::detail::cuda_vector_width<Grad, Param>();
  const auto kernel = zero::kernels::detail::fused_step_kernel<V, Opt, Grad, Param>;
  const auto shape = zero::kernels::detail::grid_for(kernel, o.launch, (n + V - 1) / V, "bench");

  const double bytes_per_param = 4.0 * (1 + slots) * 2 + sizeof(Grad) + (low ? sizeof(Param) : 0);
  const double params_per_s = static_cast<double>(n) / t_real;
  const double bytes_per_s = params_per_s * bytes_per_param;
  const double probe_bytes_per_s = static_cast<double>(n) * bytes_per_param / t_probe;
  const double ratio = t_probe / t_real;
  if (o.json) {
    std::printf(
        "{\"bench\":\"step_cuda\",\"config\":\"%s\",\"optimizer\":\"%s\",\"grad\":\"%s\",\"param\":\"%s\",\"n\":%zu,"
        "\"device\":\"%s\",\"cc\":\"%d.%d\",\"threads\":%d,\"blocks\":%d,\"vector_width\":%d,\"reps\":%d,\"trials\":%d,"
        "\"seconds\":%.9f,\"probe_seconds\":%.9f,\"params_per_s\":%.4e,\"bytes_per_param\":%.0f,\"gb_per_s\":%.2f,"
        "\"probe_gb_per_s\":%.2f,\"ratio_to_probe\":%.4f,%s}\n",
        label, Opt::name, zero::dtype_traits<Grad>::name, zero::dtype_traits<Param>::name, n, dev.name.c_str(),
        dev.cc_major, dev.cc_minor, shape.threads, shape.blocks, V, o.reps, o.trials, t_real, t_probe, params_per_s,
        bytes_per_param, bytes_per_s / 1e9, probe_bytes_per_s / 1e9, ratio, peak_json(bytes_per_s, dev).c_str());
  } else {
    std::printf(
        "%-18s n=%zu %dx%d  %.3f ms/step  %.3e params/s  %.1f GB/s (%.0f B/param)  probe %.3f ms (%.1f GB/s)  "
        "ratio to probe %.3f  %s\n",
        label, n, shape.blocks, shape.threads, t_real * 1e3, params_per_s, bytes_per_s / 1e9, bytes_per_param,
        t_probe * 1e3, probe_bytes_per_s / 1e9, ratio, peak_text(bytes_per_s, dev).c_str());
  }
  std::fflush(stdout);

  cudaFree(master);
  cudaFree(grad);
  for (int k = 0; k < slots; ++k) cudaFree(state[k]);
  cudaFree(param);
}

// The gradient statistics pass (read-only) and a device-to-device copy of the
// same bytes, for reference: the fastest a pure stream can go on this device.
void run_reference(const Options& o, const Device& dev, cudaStream_t stream) {
  const std::size_t n = o.n;
  bf16* g = nullptr;
  float *src = nullptr, *dst = nullptr;
  ZERO_CUDA_CHECK(cudaMalloc(&g, n * sizeof(bf16)));
  ZERO_CUDA_CHECK(cudaMalloc(&src, n * sizeof(float)));
  ZERO_CUDA_CHECK(cudaMalloc(&dst, n * sizeof(float)));
  fill(g, n, 5, 0.01f);
  fill(src, n, 6, 1.0f);
  ZERO_CUDA_CHECK(cudaDeviceSynchronize());
  // CudaGradStats takes 128, 256, 512 or 1024 threads; other --threads values leave it at its default.
  const int t = o.launch.threads;
  const bool stats_threads_ok = t == 0 || t == 128 || t == 256 || t == 512 || t == 1024;
  zero::kernels::CudaGradStats stats(stats_threads_ok ? o.launch : CudaLaunch{});
  Timer timer;
  auto stats_call = [&](int) { stats.enqueue(g, n, stream); };
  auto copy_call = [&](int) {
    ZERO_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  };
  timer.seconds_per_call(stream, 3, stats_call);
  timer.seconds_per_call(stream, 3, copy_call);
  std::vector<double> ts, tc;
  for (int t = 0; t < o.trials; ++t) {
    ts.push_back(timer.seconds_per_call(stream, o.reps, stats_call));
    tc.push_back(timer.seconds_per_call(stream, o.reps, copy_call));
  }
  struct Row {
    const char* config;
    double seconds;
    double bytes;
  };
  const Row rows[] = {{"grad_stats_bf16", median(ts), 2.0 * n}, {"d2d_copy_fp32", median(tc), 8.0 * n}};
  for (const Row& r : rows) {
    const double bytes_per_s = r.bytes / r.seconds;
    if (o.json) {
      std::printf(
          "{\"bench\":\"step_cuda\",\"config\":\"%s\",\"n\":%zu,\"device\":\"%s\",\"cc\":\"%d.%d\",\"reps\":%d,"
          "\"trials\":%d,\"seconds\":%.9f,\"params_per_s\":%.4e,\"bytes_per_param\":%.0f,\"gb_per_s\":%.2f,%s}\n",
          r.config, n, dev.name.c_str(), dev.cc_major, dev.cc_minor, o.reps, o.trials, r.seconds, n / r.seconds,
          r.bytes / n, bytes_per_s / 1e9, peak_json(bytes_per_s, dev).c_str());
    } else {
      std::printf("%-18s n=%zu  %.3f ms  %.3e params/s  %.1f GB/s (%.0f B/param)  %s\n", r.config, n, r.seconds * 1e3,
                  n / r.seconds, bytes_per_s / 1e9, r.bytes / n, peak_text(bytes_per_s, dev).c_str());
    }
  }
  std::fflush(stdout);
  cudaFree(g);
  cudaFree(src);
  cudaFree(dst);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  zero::bench::Args args(argc, argv,
                         "[--n PARAMS (K/M/G suffixes)] [--reps R] [--trials T] [--json] [--threads T] "
                         "[--blocks-per-sm B]");
  while (args.next()) {
    if (args.is("--n"))
      o.n = args.count();
    else if (args.is("--reps"))
      o.reps = args.positive();
    else if (args.is("--trials"))
      o.trials = args.positive();
    else if (args.is("--json"))
      o.json = true;
    else if (args.is("--threads"))
      o.launch.threads = args.positive();
    else if (args.is("--blocks-per-sm"))
      o.launch.blocks_per_sm = args.positive();
    else
      args.usage();
  }
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    // stderr: with --json, stdout carries JSON lines only.
    std::fprintf(stderr, "SKIP: no CUDA device (%s)\n",
                 status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
    return 77;
  }
  try {
    const Device dev = describe_device();
    std::size_t free_bytes = 0, total_bytes = 0;
    ZERO_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    const std::size_t need = o.n * 28 + (std::size_t{1} << 28);
    if (free_bytes < need) {
      std::fprintf(stderr, "--n %zu needs about %.1f GiB of device memory; %.1f GiB are free\n", o.n,
                   need / 1073741824.0, free_bytes / 1073741824.0);
      return 1;
    }
    if (!o.json) {
      char peak[64] = "not reported";
      if (dev.peak_bytes_per_s > 0) std::snprintf(peak, sizeof peak, "%.0f GB/s", dev.peak_bytes_per_s / 1e9);
      std::printf("device: %s (cc %d.%d, %d SMs), theoretical memory bandwidth %s\n", dev.name.c_str(), dev.cc_major,
                  dev.cc_minor, dev.sm_count, peak);
    }
    cudaStream_t stream = nullptr;
    ZERO_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    zero::optim::AdamW::Hyper adamw;
    zero::optim::Sgd::Hyper sgd;
    sgd.momentum = 0.9;
    run<zero::optim::AdamW, float, float>("fp32_adamw", adamw, o, dev, stream);
    run<zero::optim::AdamW, bf16, bf16>("bf16_mixed_adamw", adamw, o, dev, stream);
    run<zero::optim::Sgd, float, float>("fp32_sgd_momentum", sgd, o, dev, stream);
    run_reference(o, dev, stream);
    cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_step_cuda: %s\n", e.what());
    return 1;
  }
  return 0;
}
