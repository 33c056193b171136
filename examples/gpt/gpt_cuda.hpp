// Why: the GPT's arithmetic on a GPU, for GptModel<CudaCompute>: cuBLAS for
// the matrix products, and kernels that call the same per-row and
// per-element functions of gpt_ops.hpp as the host loops (gpt_host.hpp), so
// the host tests against PyTorch, which CI runs, check the arithmetic these
// kernels do. Kernels are one thread per row, column or element: written to
// be read beside the host loops and to match them, not yet tuned (rows and
// columns reduce sequentially, in the host's order, with no atomics). What
// has no per-row function to share is Thrust's and CUB's (docs/design.md,
// "Thrust and CUB, and the kernels we keep"): the fill, the bias gradients'
// column sums and the loss total.
//
// This header is host code (any C++20 compiler, given the CUDA toolkit's
// headers), so that the model and the training loop around it compile at the
// host compiler's speed; the kernels and the calls that launch them are in
// gpt_cuda.cu, the one file nvcc compiles (link its object and -lcublas).
// Everything runs on one stream (by default the calling thread's zero
// stream, Ops<Cuda>::stream()). The losses add up on the device: the host
// waits only to read them (take_loss_sum), in download(), and before it
// rewrites a token staging buffer whose last copy has not finished.
#pragma once

#include <cublas_v2.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "gpt/gpt_model.hpp"
#include "zero/backend/cuda.hpp"
#include "zero/cuda/check.hpp"
#include "zero/cuda/stream.hpp"
#include "zero/error.hpp"

namespace gpt {

// Device memory that frees itself (the library's, zero-filled on allocation).
template <class T>
using DeviceArray = zero::backend::CudaBuffer<T>;

inline void check_cublas(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw zero::BackendError(zero::detail::concat("cuBLAS ", call, " failed with status ", static_cast<int>(status)));
}

class CudaCompute {
 public:
  using Buffer = DeviceArray<float>;
  static Buffer allocate(std::size_t floats) { return Buffer(floats); }

  // Works on this thread's current stream (zero::cuda::current_stream(), the
  // rank's, which the optimizer uses too): the buffers it makes on the way
  // (CudaBuffer) are zero-filled there, so another stream would race them.
  CudaCompute() : stream_(zero::cuda::current_stream()) {
    cublasHandle_t handle = nullptr;
    check_cublas(cublasCreate(&handle), "cublasCreate");
    handle_.reset(handle);
    check_cublas(cublasSetStream(handle, stream_), "cublasSetStream");
    // fp32 products in fp32 (no TF32): the host and PyTorch fixtures are fp32.
    check_cublas(cublasSetMathMode(handle, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode");
  }

  // Copies host token ids to the device (slot 0: tokens, 1: targets) through
  // page-locked memory, so the copy is enqueued without a host wait. The
  // buffers grow to the largest request and are reused after.
  const std::uint8_t* stage_tokens(const std::uint8_t* ids, std::size_t n, int slot) {
    TokenSlot& s = slots_[static_cast<std::size_t>(slot)];
    if (s.copied.created()) ZERO_CUDA_CHECK(cudaEventSynchronize(s.copied.get()));  // the last copy left s.host
    if (s.device.size() < n) {
      s.device = DeviceArray<std::uint8_t>(n);
      s.host = zero::backend::CudaPinnedBuffer<std::uint8_t>(n);
    }
    std::copy(ids, ids + n, s.host.data());
    ZERO_CUDA_CHECK(cudaMemcpyAsync(s.device.data(), s.host.data(), n, cudaMemcpyHostToDevice, stream_));
    ZERO_CUDA_CHECK(cudaEventRecord(s.copied.get(), stream_));
    return s.device.data();
  }
  void download(float* host, const float* src, std::size_t n) {
    ZERO_CUDA_CHECK(cudaMemcpyAsync(host, src, n * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    zero::cuda::wait_stream(stream_);  // watched: a dead NCCL peer is a CommError, not a hang
  }

  void fill(float* p, std::size_t n, float value);
  void copy(float* dst, const float* src, std::size_t n) {
    ZERO_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
  }

  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T; with
  // `accumulate`, C += op(A) op(B).
  void gemm(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda, const float* B, int ldb,
            float* C, int ldc, bool accumulate = false) {
    const float one = 1.0f, zero = 0.0f;
    check_cublas(cublasSgemm(handle_.get(), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                             N, M, K, &one, B, ldb, A, lda, accumulate ? &one : &zero, C, ldc),
                 "cublasSgemm");
  }
  // Causal attention as one product per head (see GptModel::for_each_query_block).
  static constexpr int causal_block() { return 0; }
  void embed_forward(const std::uint8_t* tokens, const float* wte, const float* wpe, std::size_t N, int T, int C,
                     float* x);
  void embed_backward(const std::uint8_t* tokens, const float* d, std::size_t N, int T, int C, float* dwte,
                      float* dwpe);
  void layernorm_forward(const float* x, const float* w, const float* b, std::size_t N, int C, float* out,
                         float* mean, float* rstd);
  void layernorm_backward(const float* dout, const float* x, const float* w, const float* mean, const float* rstd,
                          std::size_t N, int C, float* dx, float* dw, float* db);
  // out[n] = b, plus residual[n] unless it is null.
  void bias_rows(float* out, const float* b, const float* residual, std::size_t N, int O);
  // out[o] = the sum of column o of d (N x O, row-major); 0 where N is 0.
  // A CUB segment (one thread block) per column: in float, as the host sums,
  // but in CUB's tree order, not the host's blocks of rows.
  void column_sums(const float* d, std::size_t N, int O, float* out);
  void gelu_forward(const float* x, float* y, std::size_t n);
  void gelu_backward(const float* x, float* d, std::size_t n);
  void causal_softmax(float* att, std::size_t matrices, int T, float scale);
  void causal_softmax_backward(const float* att, float* datt, std::size_t matrices, int T, float scale);
  // Adds the N rows' losses to a running total on the device; with
  // `backward`, logits become grad_scale x d(loss)/d(logits).
  void cross_entropy(float* logits, const std::uint8_t* targets, std::size_t N, int V, bool backward,
                     float grad_scale);
  // The total since the last call: waits for the stream.
  double take_loss_sum() {
    if (loss_total_.size() == 0) return 0.0;
    double total = 0.0;
    ZERO_CUDA_CHECK(cudaMemcpyAsync(&total, loss_total_.data(), sizeof total, cudaMemcpyDeviceToHost, stream_));
    zero::cuda::wait_stream(stream_);
    ZERO_CUDA_CHECK(cudaMemsetAsync(loss_total_.data(), 0, sizeof total, stream_));
    return total;
  }

 private:
  // Runs a CUB device-wide algorithm twice (the bytes it needs, then the
  // work) in scratch_ (gpt_cuda.cu).
  template <class Algorithm>
  void run_cub(const char* name, Algorithm&& algorithm);

  struct DestroyCublas {
    void operator()(cublasHandle_t h) const { cublasDestroy(h); }
  };
  // A CUDA event made on first use, destroyed with its owner.
  class Event {
   public:
    Event() = default;
    Event(Event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
    Event& operator=(Event&&) = delete;
    ~Event() {
      if (e_ != nullptr) cudaEventDestroy(e_);
    }
    bool created() const { return e_ != nullptr; }
    cudaEvent_t get() {
      if (e_ == nullptr) ZERO_CUDA_CHECK(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming));
      return e_;
    }

   private:
    cudaEvent_t e_ = nullptr;
  };
  struct TokenSlot {
    DeviceArray<std::uint8_t> device;
    zero::backend::CudaPinnedBuffer<std::uint8_t> host;  // what the copy reads
    Event copied;                                         // recorded after the copy
  };

  cudaStream_t stream_;
  std::unique_ptr<cublasContext, DestroyCublas> handle_;
  std::array<TokenSlot, 2> slots_;
  DeviceArray<float> losses_;          // per row, of the last cross_entropy
  DeviceArray<double> loss_total_;     // since take_loss_sum()
  DeviceArray<std::uint8_t> scratch_;  // CUB's temporary storage (run_cub)
};

using CudaGpt = GptModel<CudaCompute>;

}  // namespace gpt
