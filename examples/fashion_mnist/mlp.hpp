// Why this header exists: the Fashion-MNIST example needs a model whose
// parameters the ZeRO optimizer owns, so the model here owns none. Each layer
// is one ZeRO *unit*: its parameters are one flat fp32 span laid out as
// [W (out x in, row-major), b (out)], and its gradients are written to a flat
// span of the same layout. Forward and backward are per-layer steps, so the
// caller asks for a layer's parameters just before use and hands them back
// just after (stage 3 all-gathers and frees one unit at a time), and hands
// on each layer's gradient as soon as it is written (stages 2 and 3
// reduce-scatter it while the rest of backward runs): the trainer makes
// those calls itself, between the steps; forward_backward makes them
// through hooks.
//
// Gradients are d(sum of per-example losses)/d(params) divided by a caller-
// given `grad_divisor`, not by the local batch: with the global batch size as
// divisor, N ranks each holding a slice of the batch produce gradients whose
// sum over ranks equals one rank's gradient on the whole batch. A loss scale S
// (fp16) is applied by passing grad_divisor / S.
//
// Threads: an Mlp holds per-batch scratch (activations), so each rank thread
// uses its own Mlp. The matrix products are OpenBLAS sgemm; with ranks running
// as threads, each sgemm must stay on its calling thread or N ranks x M BLAS
// threads oversubscribe the cores: call use_single_threaded_blas() once before
// starting the rank threads (OpenBLAS's thread count is process-wide).
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "zero/error.hpp"

namespace fashion_mnist {

// Makes every BLAS call run on the thread that makes it. No-op for a BLAS
// other than OpenBLAS (reference BLAS is single-threaded anyway).
inline void use_single_threaded_blas() {
#if defined(OPENBLAS_VERSION)
  openblas_set_num_threads(1);
#endif
}

// Threads a BLAS call may use (1 unless OpenBLAS was allowed more).
inline int blas_threads() {
#if defined(OPENBLAS_VERSION)
  return openblas_get_num_threads();
#else
  return 1;
#endif
}

// One fully-connected layer y = x W^T + b; its flat parameters are
// [W: out*in floats, row-major (row o holds the weights into output o)][b: out floats].
struct LayerShape {
  int in = 0;
  int out = 0;

  std::size_t weight_numel() const { return static_cast<std::size_t>(in) * static_cast<std::size_t>(out); }
  std::size_t bias_offset() const { return weight_numel(); }
  std::size_t numel() const { return weight_numel() + static_cast<std::size_t>(out); }
};

// How a pass reaches the parameters of layer `l`. acquire(l) returns the
// layer's flat parameters (LayerShape::numel() floats), which must stay valid
// until release(l); release may be empty.
struct ParamHooks {
  std::function<const float*(int layer)> acquire;
  std::function<void(int layer)> release;
};

// Where backward writes the gradient of layer `l`. buffer(l) returns
// LayerShape::numel() floats which backward OVERWRITES (never accumulates);
// ready(l) is called once they hold the final values; ready may be empty.
struct GradHooks {
  std::function<float*(int layer)> buffer;
  std::function<void(int layer)> ready;
};

class Mlp {
 public:
  // sizes = {inputs, hidden..., classes}; ReLU after every layer but the last,
  // softmax cross-entropy on the last.
  explicit Mlp(std::vector<int> sizes = {784, 256, 128, 10}) : sizes_(std::move(sizes)) {
    zero::require(sizes_.size() >= 2, "Mlp sizes need at least an input and an output size, got ", sizes_.size(),
                  " entries");
    for (std::size_t i = 0; i < sizes_.size(); ++i)
      zero::require(sizes_[i] > 0, "Mlp sizes[", i, "] must be positive, got ", sizes_[i]);
    for (std::size_t i = 0; i + 1 < sizes_.size(); ++i) layers_.push_back(LayerShape{sizes_[i], sizes_[i + 1]});
    act_.resize(sizes_.size());
  }

  const std::vector<int>& sizes() const { return sizes_; }
  const std::vector<LayerShape>& layers() const { return layers_; }
  int num_layers() const { return static_cast<int>(layers_.size()); }
  int input_size() const { return sizes_.front(); }
  int num_classes() const { return sizes_.back(); }
  std::size_t num_params() const {
    std::size_t n = 0;
    for (const LayerShape& l : layers_) n += l.numel();
    return n;
  }

  // torch.nn.Linear's default initialisation: W and b uniform in
  // [-1/sqrt(in), 1/sqrt(in)] (kaiming_uniform with a = sqrt(5)), drawn from
  // mt19937_64(seed) so every platform and rank gets the same values.
  static void init_layer(const LayerShape& shape, float* params, std::uint64_t seed) {
    zero::require(params != nullptr, "Mlp::init_layer: params is null");
    std::mt19937_64 gen(seed);
    const float bound = 1.0f / std::sqrt(static_cast<float>(shape.in));
    for (std::size_t i = 0; i < shape.numel(); ++i) {
      const float u = static_cast<float>(gen() >> 40) * 0x1p-24f;  // [0, 1), 24 random bits
      params[i] = bound * (2.0f * u - 1.0f);
    }
  }

  // Initialises every layer: layer l from seed + l.
  void init_params(const std::vector<float*>& params, std::uint64_t seed) const {
    check_count(params.size(), "init_params: params");
    for (int l = 0; l < num_layers(); ++l) init_layer(layers_[l], params[l], seed + static_cast<std::uint64_t>(l));
  }

  // One training pass, step by step, for a caller that makes the optimizer's
  // calls between the steps itself (train_fashion_mnist.cpp), for L layers:
  //   start(x, batch)               the batch: x is batch x inputs, row-major,
  //                                 and must stay valid until the pass ends
  //   forward(l, params)            l = 0 .. L-1: layer l's output
  //   loss_gradient(y, divisor)     the mean loss over the batch (labels y)
  //   param_gradient(l, grad)       l = L-1 .. 0: layer l's gradient into grad,
  //   input_gradient(l, params)     and for l > 0 the one passed to layer l-1
  // params are the layer's flat parameters (LayerShape::numel() floats).
  // After the forward steps, predictions() gives each example's class.
  void start(const float* x, int batch) {
    zero::require(x != nullptr, "Mlp: input x is null");
    zero::require(batch > 0, "Mlp: batch must be positive, got ", batch);
    reserve(batch);
    x_ = x;
    batch_ = batch;
  }

  // act_[l + 1] = relu(input W^T + b) (no ReLU on the last layer: the logits).
  void forward(int l, const float* params) {
    zero::require(params != nullptr, "Mlp::forward: layer ", l, "'s parameters are null");
    const LayerShape& s = layers_[l];
    const float* input = l == 0 ? x_ : act_[l].data();
    float* out = act_[l + 1].data();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, batch_, s.out, s.in, 1.0f, input, s.in, params, s.in, 0.0f,
                out, s.out);
    const float* b = params + s.bias_offset();
    const bool relu = l + 1 < num_layers();
    for (int i = 0; i < batch_; ++i) {
      float* row = out + static_cast<std::size_t>(i) * s.out;
      for (int o = 0; o < s.out; ++o) {
        const float v = row[o] + b[o];
        row[o] = relu ? std::max(v, 0.0f) : v;
      }
    }
  }

  // Softmax cross-entropy: returns the mean loss over the batch; its
  // gradient d(loss)/d(logits) = softmax - onehot, divided by grad_divisor,
  // overwrites the logits (backward starts from it).
  float loss_gradient(const std::uint8_t* y, float grad_divisor) {
    zero::require(y != nullptr, "Mlp::loss_gradient: labels y is null");
    zero::require(grad_divisor > 0.0f && std::isfinite(grad_divisor),
                  "Mlp::loss_gradient: grad_divisor must be positive and finite (the global batch size), got ",
                  grad_divisor);
    const int classes = num_classes();
    float* logits = act_.back().data();
    const float inv_divisor = 1.0f / grad_divisor;
    double loss_sum = 0.0;
    for (int i = 0; i < batch_; ++i) {
      float* z = logits + static_cast<std::size_t>(i) * classes;
      const int label = y[i];
      zero::require(label < classes, "Mlp::loss_gradient: label ", label, " of example ", i, " is not below the ",
                    classes, " classes");
      const float zmax = *std::max_element(z, z + classes);
      const float label_shifted = z[label] - zmax;  // log-softmax(label) = label_shifted - log(sum)
      float sum = 0.0f;
      for (int c = 0; c < classes; ++c) {
        z[c] = std::exp(z[c] - zmax);  // z now holds exp(z - max)
        sum += z[c];
      }
      loss_sum += static_cast<double>(std::log(sum)) - static_cast<double>(label_shifted);
      const float scale = inv_divisor / sum;
      for (int c = 0; c < classes; ++c) z[c] *= scale;
      z[label] -= inv_divisor;
    }
    delta_ = logits;
    return static_cast<float>(loss_sum / batch_);
  }

  // Layer l's gradient, from the gradient of its output (delta_, batch x
  // out) and its input: [dW = delta^T input (out x in)][db = column sums of
  // delta], written over `grad`.
  void param_gradient(int l, float* grad) {
    zero::require(grad != nullptr, "Mlp::param_gradient: layer ", l, "'s gradient buffer is null");
    const LayerShape& s = layers_[l];
    const float* input = l == 0 ? x_ : act_[l].data();
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, s.out, s.in, batch_, 1.0f, delta_, s.out, input, s.in, 0.0f,
                grad, s.in);
    float* db = grad + s.bias_offset();
    std::fill(db, db + s.out, 0.0f);
    for (int i = 0; i < batch_; ++i) {
      const float* row = delta_ + static_cast<std::size_t>(i) * s.out;
      for (int o = 0; o < s.out; ++o) db[o] += row[o];
    }
  }

  // The gradient of layer l's input (l > 0): delta W, then through the ReLU
  // that produced the input; it becomes delta_ for layer l-1.
  void input_gradient(int l, const float* params) {
    zero::require(l > 0, "Mlp::input_gradient: layer 0's input is the data, which takes no gradient");
    zero::require(params != nullptr, "Mlp::input_gradient: layer ", l, "'s parameters are null");
    const LayerShape& s = layers_[l];
    const float* input = act_[l].data();
    float* next = (delta_ == delta_a_.data()) ? delta_b_.data() : delta_a_.data();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, batch_, s.in, s.out, 1.0f, delta_, s.out, params, s.in, 0.0f,
                next, s.in);
    const std::size_t n = static_cast<std::size_t>(batch_) * s.in;
    for (std::size_t k = 0; k < n; ++k)
      if (input[k] <= 0.0f) next[k] = 0.0f;
    delta_ = next;
  }

  // The class with the largest logit, for each example of the batch.
  void predictions(int* out_labels) const {
    zero::require(out_labels != nullptr, "Mlp::predictions: out_labels is null");
    const int classes = num_classes();
    for (int i = 0; i < batch_; ++i) {
      const float* z = act_.back().data() + static_cast<std::size_t>(i) * classes;
      out_labels[i] = static_cast<int>(std::max_element(z, z + classes) - z);
    }
  }

  // The same pass in one call, reaching the parameters and gradients
  // through hooks. Returns the mean loss over these `batch` examples; writes
  // d(sum of losses)/d(params) / grad_divisor into the grads.
  //
  // Hook order, for L layers:
  //   forward   l = 0 .. L-1:  acquire(l), release(l)
  //   backward  l = L-1 .. 0:  acquire(l), buffer(l), ready(l), release(l)
  // ready(l) comes as soon as layer l's gradient is written; backward then
  // still reads layer l's parameters (to pass the gradient to layer l-1)
  // before release(l).
  float forward_backward(const float* x, const std::uint8_t* y, int batch, const ParamHooks& params,
                         const GradHooks& grads, float grad_divisor) {
    zero::require(static_cast<bool>(grads.buffer), "Mlp::forward_backward: GradHooks::buffer is empty");
    forward_pass(x, batch, params);
    const float loss = loss_gradient(y, grad_divisor);
    for (int l = num_layers() - 1; l >= 0; --l) {
      const float* w = acquire(params, l);
      param_gradient(l, grads.buffer(l));
      if (grads.ready) grads.ready(l);
      if (l > 0) input_gradient(l, w);
      if (params.release) params.release(l);
    }
    return loss;
  }

  // Same, with every layer's parameters and gradient buffers resident.
  float forward_backward(const float* x, const std::uint8_t* y, int batch, const std::vector<const float*>& params,
                         const std::vector<float*>& grads, float grad_divisor) {
    check_count(params.size(), "forward_backward: params");
    check_count(grads.size(), "forward_backward: grads");
    return forward_backward(x, y, batch, resident(params), GradHooks{[&grads](int l) { return grads[l]; }, {}},
                            grad_divisor);
  }

  // Class with the largest logit for each of `batch` examples. Hook order:
  // acquire(l), release(l) for l = 0 .. L-1.
  void predict(const float* x, int batch, const ParamHooks& params, int* out_labels) {
    forward_pass(x, batch, params);
    predictions(out_labels);
  }

  void predict(const float* x, int batch, const std::vector<const float*>& params, int* out_labels) {
    check_count(params.size(), "predict: params");
    predict(x, batch, resident(params), out_labels);
  }

 private:
  void check_count(std::size_t n, const char* what) const {
    zero::require(n == layers_.size(), "Mlp::", what, " has ", n, " entries, one per layer expected (",
                  layers_.size(), ")");
  }

  static ParamHooks resident(const std::vector<const float*>& params) {
    return ParamHooks{[&params](int l) { return params[l]; }, {}};
  }

  static const float* acquire(const ParamHooks& params, int l) {
    const float* w = params.acquire(l);
    zero::require(w != nullptr, "Mlp: ParamHooks::acquire(", l, ") returned null");
    return w;
  }

  // Grows the scratch to `batch` rows (never shrinks: sized once for the largest batch).
  void reserve(int batch) {
    if (batch <= capacity_) return;
    capacity_ = batch;
    int widest = 0;
    for (std::size_t i = 1; i < sizes_.size(); ++i) {
      act_[i].resize(static_cast<std::size_t>(batch) * sizes_[i]);
      widest = std::max(widest, sizes_[i]);
    }
    delta_a_.resize(static_cast<std::size_t>(batch) * widest);
    delta_b_.resize(static_cast<std::size_t>(batch) * widest);
  }

  // start, then forward through every layer, reaching each through the hooks.
  void forward_pass(const float* x, int batch, const ParamHooks& params) {
    zero::require(static_cast<bool>(params.acquire), "Mlp: ParamHooks::acquire is empty");
    start(x, batch);
    for (int l = 0; l < num_layers(); ++l) {
      forward(l, acquire(params, l));
      if (params.release) params.release(l);
    }
  }

  std::vector<int> sizes_;
  std::vector<LayerShape> layers_;
  int capacity_ = 0;                    // rows the scratch holds
  const float* x_ = nullptr;            // the pass's input (start)
  int batch_ = 0;                       // and its rows
  std::vector<std::vector<float>> act_;  // act_[l] = input of layer l (l >= 1); act_.back() = logits
  std::vector<float> delta_a_, delta_b_;  // ping-pong d(loss)/d(activation)
  const float* delta_ = nullptr;        // d(loss)/d(output) of backward's layer: the logits, then delta_a_/_b_
};

}  // namespace fashion_mnist
