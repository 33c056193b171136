// The GPT's kernels and the CudaCompute calls that launch them
// (gpt_cuda.hpp says what each does): the one file of the GPT example that
// nvcc compiles. Kernels call the per-row functions of gpt_ops.hpp, as the
// host loops do; Thrust and CUB do the fill, the column sums and the loss total.
#include <thrust/fill.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <thrust/iterator/transform_output_iterator.h>
#include <thrust/system/cuda/execution_policy.h>
#include <thrust/system_error.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cub/device/device_reduce.cuh>
#include <cub/device/device_segmented_reduce.cuh>
#include <cuda/std/functional>
#include <string>

#include "gpt/gpt_cuda.hpp"
#include "gpt/gpt_ops.hpp"

namespace gpt {

namespace cuda_kernels {

inline constexpr int kThreads = 256;
inline unsigned blocks_for(std::size_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }
__device__ inline std::size_t thread_index() { return static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; }

__global__ void embed_forward(const std::uint8_t* tokens, const float* wte, const float* wpe, std::size_t N, int T,
                              int C, float* x) {
  const std::size_t i = thread_index();
  if (i >= N * C) return;
  const std::size_t n = i / C, c = i % C;
  x[i] = ops::add(wte[static_cast<std::size_t>(tokens[n]) * C + c], wpe[(n % T) * C + c]);
}

// One thread per column, rows in order (as the host).
__global__ void embed_backward(const std::uint8_t* tokens, const float* d, std::size_t N, int T, int C, float* dwte,
                               float* dwpe) {
  const std::size_t c = thread_index();
  if (c >= static_cast<std::size_t>(C)) return;
  for (std::size_t n = 0; n < N; ++n) {
    dwte[static_cast<std::size_t>(tokens[n]) * C + c] += d[n * C + c];
    dwpe[(n % T) * C + c] += d[n * C + c];
  }
}

__global__ void layernorm_forward(const float* x, const float* w, const float* b, std::size_t N, int C, float* out,
                                  float* mean, float* rstd) {
  const std::size_t n = thread_index();
  if (n >= N) return;
  const ops::RowStats s = ops::layernorm_forward_row(x + n * C, w, b, out + n * C, C);
  mean[n] = s.mean;
  rstd[n] = s.rstd;
}

__global__ void layernorm_backward_rows(const float* dout, const float* x, const float* w, const float* mean,
                                        const float* rstd, std::size_t N, int C, float* dx) {
  const std::size_t n = thread_index();
  if (n >= N) return;
  ops::layernorm_backward_row(dout + n * C, x + n * C, w, ops::RowStats{mean[n], rstd[n]}, dx + n * C, C);
}

__global__ void layernorm_param_grads(const float* dout, const float* x, const float* mean, const float* rstd,
                                      std::size_t N, int C, float* dw, float* db) {
  const std::size_t c = thread_index();
  if (c >= static_cast<std::size_t>(C)) return;
  float sw = 0.0f, sb = 0.0f;
  for (std::size_t n = 0; n < N; ++n) {
    sw += dout[n * C + c] * ops::layernorm_normalized(x[n * C + c], ops::RowStats{mean[n], rstd[n]});
    sb += dout[n * C + c];
  }
  dw[c] = sw;
  db[c] = sb;
}

__global__ void bias_rows(float* out, const float* b, const float* residual, std::size_t N, int O) {
  const std::size_t i = thread_index();
  if (i < N * O) out[i] = residual == nullptr ? b[i % O] : ops::add(b[i % O], residual[i]);
}

__global__ void gelu_forward(const float* x, float* y, std::size_t n) {
  const std::size_t i = thread_index();
  if (i < n) y[i] = ops::gelu_forward(x[i]);
}

__global__ void gelu_backward(const float* x, float* d, std::size_t n) {
  const std::size_t i = thread_index();
  if (i < n) d[i] = ops::gelu_backward(x[i], d[i]);
}

__global__ void causal_softmax(float* att, std::size_t rows, int T, float scale) {
  const std::size_t r = thread_index();
  if (r < rows) ops::causal_softmax_row(att + r * T, static_cast<int>(r % T), T, scale);
}

__global__ void causal_softmax_backward(const float* att, float* datt, std::size_t rows, int T, float scale) {
  const std::size_t r = thread_index();
  if (r < rows) ops::causal_softmax_backward_row(att + r * T, datt + r * T, static_cast<int>(r % T), T, scale);
}

__global__ void cross_entropy(float* logits, const std::uint8_t* targets, std::size_t N, int V, bool backward,
                              float grad_scale, float* losses) {
  const std::size_t n = thread_index();
  if (n >= N) return;
  float* z = logits + n * V;
  losses[n] = ops::cross_entropy_row(z, backward ? z : nullptr, V, targets[n], grad_scale);
}

// Functors for CUB's reductions (functors, not lambdas: nvcc takes device
// lambdas only with --extended-lambda).

// A row-major N x O matrix read column after column: element i of the view
// is row i % N of column i / N, so column o is the range [o N, (o + 1) N)
// that a segmented reduction sums.
struct ColumnMajorRead {
  const float* d;
  std::size_t N, O;
  __device__ float operator()(std::size_t i) const { return d[(i % N) * O + i / N]; }
};
struct TimesRows {  // where column o's segment starts
  std::size_t N;
  __host__ __device__ std::size_t operator()(std::size_t o) const { return o * N; }
};

// What a reduction's result becomes before it is stored at `total`: the old
// total plus the result, so the reduction adds to a running total. CUB
// stores its result once, from one thread, after every input is read.
struct AddToTotal {
  const double* total;
  __device__ double operator()(double sum) const { return *total + sum; }
};

}  // namespace cuda_kernels

namespace {

template <class Kernel, class... Args>
void launch(cudaStream_t stream, Kernel kernel, const char* name, std::size_t threads, Args... args) {
  if (threads == 0) return;
  kernel<<<cuda_kernels::blocks_for(threads), cuda_kernels::kThreads, 0, stream>>>(args...);
  zero::cuda::check_launch(name);
}

// Thrust (by exception) and CUB (by return value) report a failed launch
// but leave it pending (they peek at it): take it, so that the next
// launch's check does not report it again, and throw what every launch
// here throws.
[[noreturn]] void library_call_failed(const char* name, const std::string& why) {
  cudaGetLastError();
  throw zero::BackendError(zero::detail::concat(name, " failed: ", why,
                                                "; if it says no kernel image is available, rebuild with this GPU's "
                                                "architecture in -Dgpu_arch"));
}

}  // namespace

// Runs a CUB device-wide algorithm, algorithm(scratch, bytes) -> cudaError_t,
// twice: with a null scratch it only says how many bytes it needs, then it
// runs on the stream. The scratch space grows to the largest need and is
// reused (stream order keeps its users apart), so once every size has been
// seen a pass allocates nothing.
template <class Algorithm>
void CudaCompute::run_cub(const char* name, Algorithm&& algorithm) {
  std::size_t bytes = 0;
  cudaError_t status = algorithm(nullptr, bytes);
  // At least one byte: a null scratch would ask for the size again.
  if (status == cudaSuccess && scratch_.size() < std::max<std::size_t>(bytes, 1))
    scratch_ = DeviceArray<std::uint8_t>(std::max<std::size_t>(bytes, 1));
  if (status == cudaSuccess) status = algorithm(scratch_.data(), bytes);
  if (status != cudaSuccess)
    library_call_failed(name, zero::detail::concat(cudaGetErrorName(status), " (", cudaGetErrorString(status), ")"));
}

void CudaCompute::fill(float* p, std::size_t n, float value) {
  try {
    thrust::fill_n(thrust::cuda::par_nosync.on(stream_), p, n, value);
  } catch (const thrust::system_error& e) {
    library_call_failed("thrust::fill_n (gpt fill)", e.what());
  }
}

void CudaCompute::embed_forward(const std::uint8_t* tokens, const float* wte, const float* wpe, std::size_t N, int T,
                                int C, float* x) {
  launch(stream_, cuda_kernels::embed_forward, "gpt embed_forward", N * C, tokens, wte, wpe, N, T, C, x);
}

void CudaCompute::embed_backward(const std::uint8_t* tokens, const float* d, std::size_t N, int T, int C, float* dwte,
                                 float* dwpe) {
  launch(stream_, cuda_kernels::embed_backward, "gpt embed_backward", static_cast<std::size_t>(C), tokens, d, N, T, C,
         dwte, dwpe);
}

void CudaCompute::layernorm_forward(const float* x, const float* w, const float* b, std::size_t N, int C, float* out,
                                    float* mean, float* rstd) {
  launch(stream_, cuda_kernels::layernorm_forward, "gpt layernorm_forward", N, x, w, b, N, C, out, mean, rstd);
}

void CudaCompute::layernorm_backward(const float* dout, const float* x, const float* w, const float* mean,
                                     const float* rstd, std::size_t N, int C, float* dx, float* dw, float* db) {
  launch(stream_, cuda_kernels::layernorm_backward_rows, "gpt layernorm_backward_rows", N, dout, x, w, mean, rstd, N, C,
         dx);
  launch(stream_, cuda_kernels::layernorm_param_grads, "gpt layernorm_param_grads", static_cast<std::size_t>(C), dout,
         x, mean, rstd, N, C, dw, db);
}

void CudaCompute::bias_rows(float* out, const float* b, const float* residual, std::size_t N, int O) {
  launch(stream_, cuda_kernels::bias_rows, "gpt bias_rows", N * O, out, b, residual, N, O);
}

void CudaCompute::column_sums(const float* d, std::size_t N, int O, float* out) {
  const auto columns = thrust::make_transform_iterator(
      thrust::counting_iterator<std::size_t>(0), cuda_kernels::ColumnMajorRead{d, N, static_cast<std::size_t>(O)});
  const auto begins =
      thrust::make_transform_iterator(thrust::counting_iterator<std::size_t>(0), cuda_kernels::TimesRows{N});
  run_cub("cub::DeviceSegmentedReduce::Sum (gpt column_sums)", [&](void* scratch, std::size_t& bytes) {
    return cub::DeviceSegmentedReduce::Sum(scratch, bytes, columns, out, O, begins, begins + 1, stream_);
  });
}

void CudaCompute::gelu_forward(const float* x, float* y, std::size_t n) {
  launch(stream_, cuda_kernels::gelu_forward, "gpt gelu_forward", n, x, y, n);
}

void CudaCompute::gelu_backward(const float* x, float* d, std::size_t n) {
  launch(stream_, cuda_kernels::gelu_backward, "gpt gelu_backward", n, x, d, n);
}

void CudaCompute::causal_softmax(float* att, std::size_t matrices, int T, float scale) {
  const std::size_t rows = matrices * static_cast<std::size_t>(T);
  launch(stream_, cuda_kernels::causal_softmax, "gpt causal_softmax", rows, att, rows, T, scale);
}

void CudaCompute::causal_softmax_backward(const float* att, float* datt, std::size_t matrices, int T, float scale) {
  const std::size_t rows = matrices * static_cast<std::size_t>(T);
  launch(stream_, cuda_kernels::causal_softmax_backward, "gpt causal_softmax_backward", rows, att, datt, rows, T,
         scale);
}

void CudaCompute::cross_entropy(float* logits, const std::uint8_t* targets, std::size_t N, int V, bool backward,
                                float grad_scale) {
  if (N == 0) return;
  if (losses_.size() < N) losses_ = DeviceArray<float>(N);
  if (loss_total_.size() == 0) loss_total_ = DeviceArray<double>(1);
  launch(stream_, cuda_kernels::cross_entropy, "gpt cross_entropy", N, logits, targets, N, V, backward, grad_scale,
         losses_.data());
  // The rows' losses summed in double, added to the total on the device.
  double* total = loss_total_.data();
  const auto add_to_total = thrust::make_transform_output_iterator(total, cuda_kernels::AddToTotal{total});
  run_cub("cub::DeviceReduce::Reduce (gpt loss sum)", [&](void* scratch, std::size_t& bytes) {
    return cub::DeviceReduce::Reduce(scratch, bytes, losses_.data(), add_to_total, N, cuda::std::plus<double>{}, 0.0,
                                     stream_);
  });
}

}  // namespace gpt
