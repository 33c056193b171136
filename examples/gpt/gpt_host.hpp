// Why: the GPT's arithmetic on the CPU. GptModel (gpt_model.hpp) says what
// to compute in which order; this says how on the host: OpenBLAS sgemm for
// the matrix products, and OpenMP loops over rows or elements that call the
// math of gpt_ops.hpp, which the CUDA kernels (gpt_cuda.cuh) call too.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "gpt/gpt_model.hpp"
#include "gpt/gpt_ops.hpp"

namespace gpt {

class HostCompute {
 public:
  using Buffer = std::vector<float>;
  static Buffer allocate(std::size_t floats) { return Buffer(floats, 0.0f); }

  // Token ids are read where the caller keeps them.
  const std::uint8_t* stage_tokens(const std::uint8_t* ids, std::size_t, int) { return ids; }
  // Results the caller reads (logits) are already on the host.
  void download(float* host, const float* src, std::size_t n) { std::copy(src, src + n, host); }

  void fill(float* p, std::size_t n, float value) { std::fill(p, p + n, value); }
  void copy(float* dst, const float* src, std::size_t n) { std::copy(src, src + n, dst); }

  // C (M x N) = op(A) op(B), row-major; op(A) is M x K.
  void gemm(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda, const float* B, int ldb,
            float* C, int ldc) {
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K,
                1.0f, A, lda, B, ldb, 0.0f, C, ldc);
  }

  // x[n] = wte[token n] + wpe[n mod T].
  void embed_forward(const std::uint8_t* tokens, const float* wte, const float* wpe, std::size_t N, int T, int C,
                     float* x) {
#pragma omp parallel for schedule(static)
    for (std::size_t n = 0; n < N; ++n)
      for (int c = 0; c < C; ++c)
        x[n * C + c] = ops::add(wte[static_cast<std::size_t>(tokens[n]) * C + c], wpe[(n % T) * C + c]);
  }
  // dwte[token n] += d[n], dwpe[n mod T] += d[n] (rows in order: deterministic).
  void embed_backward(const std::uint8_t* tokens, const float* d, std::size_t N, int T, int C, float* dwte,
                      float* dwpe) {
    for (std::size_t n = 0; n < N; ++n)
      for (int c = 0; c < C; ++c) {
        dwte[static_cast<std::size_t>(tokens[n]) * C + c] += d[n * C + c];
        dwpe[(n % T) * C + c] += d[n * C + c];
      }
  }

  void layernorm_forward(const float* x, const float* w, const float* b, std::size_t N, int C, float* out,
                         float* mean, float* rstd) {
#pragma omp parallel for schedule(static)
    for (std::size_t n = 0; n < N; ++n) {
      const ops::RowStats s = ops::layernorm_forward_row(x + n * C, w, b, out + n * C, C);
      mean[n] = s.mean;
      rstd[n] = s.rstd;
    }
  }
  // dx += d(loss)/d(x); dw, db overwritten.
  void layernorm_backward(const float* dout, const float* x, const float* w, const float* mean, const float* rstd,
                          std::size_t N, int C, float* dx, float* dw, float* db) {
#pragma omp parallel for schedule(static)
    for (std::size_t n = 0; n < N; ++n)
      ops::layernorm_backward_row(dout + n * C, x + n * C, w, ops::RowStats{mean[n], rstd[n]}, dx + n * C, C);
    std::fill(dw, dw + C, 0.0f);
    std::fill(db, db + C, 0.0f);
    for (std::size_t n = 0; n < N; ++n)
      for (int c = 0; c < C; ++c) {
        dw[c] += dout[n * C + c] * ops::layernorm_normalized(x[n * C + c], ops::RowStats{mean[n], rstd[n]});
        db[c] += dout[n * C + c];
      }
  }

  void add_bias(float* out, const float* b, std::size_t N, int O) {
#pragma omp parallel for schedule(static)
    for (std::size_t n = 0; n < N; ++n)
      for (int o = 0; o < O; ++o) out[n * O + o] = ops::add(out[n * O + o], b[o]);
  }
  void column_sums(const float* d, std::size_t N, int O, float* out) {
    std::fill(out, out + O, 0.0f);
    for (std::size_t n = 0; n < N; ++n)
      for (int o = 0; o < O; ++o) out[o] += d[n * O + o];
  }
  void add_into(float* x, const float* y, std::size_t n) {
#pragma omp parallel for schedule(static)
    for (std::size_t i = 0; i < n; ++i) x[i] = ops::add(x[i], y[i]);
  }

  void gelu_forward(const float* x, float* y, std::size_t n) {
#pragma omp parallel for schedule(static)
    for (std::size_t i = 0; i < n; ++i) y[i] = ops::gelu_forward(x[i]);
  }
  // d = d(loss)/d(x) from d = d(loss)/d(gelu(x)), in place.
  void gelu_backward(const float* x, float* d, std::size_t n) {
#pragma omp parallel for schedule(static)
    for (std::size_t i = 0; i < n; ++i) d[i] = ops::gelu_backward(x[i], d[i]);
  }

  // `matrices` T x T score matrices back to back; row r is row r mod T of its matrix.
  void causal_softmax(float* att, std::size_t matrices, int T, float scale) {
    const std::size_t rows = matrices * static_cast<std::size_t>(T);
#pragma omp parallel for schedule(static)
    for (std::size_t r = 0; r < rows; ++r) ops::causal_softmax_row(att + r * T, static_cast<int>(r % T), T, scale);
  }
  void causal_softmax_backward(const float* att, float* datt, std::size_t matrices, int T, float scale) {
    const std::size_t rows = matrices * static_cast<std::size_t>(T);
#pragma omp parallel for schedule(static)
    for (std::size_t r = 0; r < rows; ++r)
      ops::causal_softmax_backward_row(att + r * T, datt + r * T, static_cast<int>(r % T), T, scale);
  }

  // Adds the N rows' losses to the running total; with `backward`, logits
  // become grad_scale x d(loss)/d(logits).
  void cross_entropy(float* logits, const std::uint8_t* targets, std::size_t N, int V, bool backward,
                     float grad_scale) {
    double sum = 0.0;
#pragma omp parallel for reduction(+ : sum) schedule(static)
    for (std::size_t n = 0; n < N; ++n) {
      float* z = logits + n * static_cast<std::size_t>(V);
      sum += ops::cross_entropy_row(z, backward ? z : nullptr, V, targets[n], grad_scale);
    }
    loss_sum_ += sum;
  }
  // The total since the last call.
  double take_loss_sum() { return std::exchange(loss_sum_, 0.0); }

 private:
  double loss_sum_ = 0.0;
};

using Gpt = GptModel<HostCompute>;

}  // namespace gpt
