// Why: every operation of the GPT other than a matrix product is written here
// once, per element or per row, and called by both the host loops
// (gpt_model.hpp, OpenMP) and the CUDA kernels (one thread block per row or
// one thread per element). The host tests, which CI runs against PyTorch,
// then check the arithmetic of kernels that CI can compile but not run -- the
// library's fused step shares its update between host and device the same
// way (zero/kernels/fused_step.hpp).
//
// Rows are contiguous float spans; sums and maxima over a row run in the
// fixed order of row_sum and row_max, the same on both sides. The float
// functions of <math.h> (expf, tanhf, ...) exist in host and device code alike.
#pragma once

#include "zero/compiler.hpp"

#include <math.h>

// On the host, the loops marked ZERO_GPT_SIMD_LOOP call glibc's vector expf
// (libmvec, which libm links as needed; 16 values per call with AVX-512)
// where expf is declared a SIMD function: GELU's expf, one call per element,
// was a quarter of the host's time, the softmax's a twentieth. The vector
// expf's results differ from the scalar one's by an ulp or so, as CUDA's
// expf does. GCC only: Clang 14 needs -fveclib to call libmvec and warns
// that it could not vectorise the loops.
#if ZERO_HAS_OPENMP && ZERO_HOST_SIMD_X86 && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__CUDACC__)
extern "C" {
#pragma omp declare simd notinbranch
float expf(float) noexcept;
}
#define ZERO_GPT_SIMD_LOOP _Pragma("omp simd")
#else
#define ZERO_GPT_SIMD_LOOP
#endif

namespace gpt::ops {

inline constexpr float kLayerNormEps = 1e-5f;  // torch.nn.LayerNorm's default
// tanh-approximated GELU (GPT-2's; torch.nn.GELU(approximate="tanh")).
inline constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
inline constexpr float kGeluCubic = 0.044715f;

// A row's sum runs as kLanes interleaved partial sums (lane l takes
// elements l, l + kLanes, ...), combined pairwise at the end. The order is
// fixed, so every host instruction set and CUDA get the same bits; the host
// compiler keeps the lanes in one vector register, where a left-to-right sum
// waits for each add in turn (the host's LayerNorm and softmax rows were
// bound by that latency).
inline constexpr int kLanes = 16;

// term(i) summed over i in [0, n).
template <class Term>
ZERO_HOST_DEVICE inline float row_sum(int n, const Term& term) {
  float acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += term(i + l);
  for (int l = 0; i + l < n; ++l) acc[l] += term(i + l);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// The largest x[i] over i in [0, n), n >= 1 (the same lanes as row_sum).
ZERO_HOST_DEVICE inline float row_max(const float* x, int n) {
  float acc[kLanes];
  for (int l = 0; l < kLanes; ++l) acc[l] = x[0];
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = x[i + l] > acc[l] ? x[i + l] : acc[l];
  for (int l = 0; i + l < n; ++l) acc[l] = x[i + l] > acc[l] ? x[i + l] : acc[l];
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] = acc[l + w] > acc[l] ? acc[l + w] : acc[l];
  return acc[0];
}

// What a LayerNorm row keeps for its backward pass.
struct RowStats {
  float mean = 0.0f;
  float rstd = 0.0f;  // 1 / sqrt(variance + eps), biased variance as PyTorch
};

// out = (x - mean) * rstd * w + b over one row of n features.
ZERO_HOST_DEVICE inline RowStats layernorm_forward_row(const float* x, const float* w, const float* b, float* out,
                                                       int n) {
  const float mean = row_sum(n, [&](int i) { return x[i]; }) / static_cast<float>(n);
  const float sq = row_sum(n, [&](int i) {
    const float d = x[i] - mean;
    return d * d;
  });
  const float rstd = 1.0f / sqrtf(sq / static_cast<float>(n) + kLayerNormEps);
  for (int i = 0; i < n; ++i) out[i] = (x[i] - mean) * rstd * w[i] + b[i];
  return RowStats{mean, rstd};
}

// The normalised input (before weight and bias): d(out)/d(w) per element,
// which the weight gradient sums over rows.
ZERO_HOST_DEVICE inline float layernorm_normalized(float x, RowStats s) { return (x - s.mean) * s.rstd; }

// dx += d(loss)/d(x) of one row, from dout = d(loss)/d(out):
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dout * w.
// Accumulates because every LayerNorm here sits on a residual branch (the
// final one's caller zeroes dx first).
ZERO_HOST_DEVICE inline void layernorm_backward_row(const float* dout, const float* x, const float* w, RowStats s,
                                                    float* dx, int n) {
  const float mean_g = row_sum(n, [&](int i) { return dout[i] * w[i]; }) / static_cast<float>(n);
  const float mean_gx =
      row_sum(n, [&](int i) { return dout[i] * w[i] * layernorm_normalized(x[i], s); }) / static_cast<float>(n);
  for (int i = 0; i < n; ++i) {
    const float g = dout[i] * w[i];
    dx[i] += s.rstd * (g - mean_g - layernorm_normalized(x[i], s) * mean_gx);
  }
}

// 0.5 (1 + tanh(u)) is the logistic sigmoid of 2u: one expf instead of
// tanhf (whose expm1f dominated the host profile), and no cancellation.
ZERO_HOST_DEVICE inline float gelu_gate(float x) {
  const float u = kGeluScale * (x + kGeluCubic * x * x * x);
  return 1.0f / (1.0f + expf(-2.0f * u));
}

ZERO_HOST_DEVICE inline float gelu_forward(float x) { return x * gelu_gate(x); }

// d(loss)/d(x) from d(loss)/d(gelu(x)): with s the gate,
// d/dx [x s] = s + x * 2 s (1 - s) * du/dx.
ZERO_HOST_DEVICE inline float gelu_backward(float x, float dout) {
  const float s = gelu_gate(x);
  const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
  return dout * (s + 2.0f * x * s * (1.0f - s) * du);
}

// Row `row` of causal attention scores (n = context entries): softmax of
// scale * score over the entries 0..row, and 0 after them (the future).
ZERO_HOST_DEVICE inline void causal_softmax_row(float* score, int row, int n, float scale) {
  for (int j = 0; j <= row; ++j) score[j] *= scale;
  const float max = row_max(score, row + 1);
  ZERO_GPT_SIMD_LOOP
  for (int j = 0; j <= row; ++j) score[j] = expf(score[j] - max);
  const float sum = row_sum(row + 1, [&](int j) { return score[j]; });
  const float inv = 1.0f / sum;
  for (int j = 0; j <= row; ++j) score[j] *= inv;
  for (int j = row + 1; j < n; ++j) score[j] = 0.0f;
}

// Backward of causal_softmax_row: turns dprob (d(loss)/d(probability)) into
// d(loss)/d(raw score) in place, from the row's probabilities p.
ZERO_HOST_DEVICE inline void causal_softmax_backward_row(const float* p, float* dprob, int row, int n, float scale) {
  const float dot = row_sum(row + 1, [&](int j) { return p[j] * dprob[j]; });
  for (int j = 0; j <= row; ++j) dprob[j] = scale * p[j] * (dprob[j] - dot);
  for (int j = row + 1; j < n; ++j) dprob[j] = 0.0f;
}

// Cross-entropy of one row of n logits against `target`; returns the loss
// (nats) and, when dlogits is not null, writes grad_scale * d(loss)/d(logits)
// = grad_scale * (softmax - onehot) there (dlogits may be logits itself).
ZERO_HOST_DEVICE inline float cross_entropy_row(const float* logits, float* dlogits, int n, int target,
                                                float grad_scale) {
  const float max = row_max(logits, n);
  const float sum = row_sum(n, [&](int j) { return expf(logits[j] - max); });
  const float loss = logf(sum) - (logits[target] - max);
  if (dlogits != nullptr) {
    const float inv = 1.0f / sum;
    for (int j = 0; j < n; ++j) dlogits[j] = grad_scale * (expf(logits[j] - max) * inv - (j == target ? 1.0f : 0.0f));
  }
  return loss;
}

// Residual and bias additions, the one elementwise op left.
ZERO_HOST_DEVICE inline float add(float a, float b) { return a + b; }

}  // namespace gpt::ops
