// The protocol in plain view: a model of two units trained with ZeRO stage 3
// on four ranks (threads), each holding a quarter of the data and of every
// parameter, gradient and optimizer state. The model, y = v.(W x) + d, is a
// linear regression in two layers, each one unit (what stage 3 gathers at
// once); gradient descent takes its loss down to the noise in the data, the
// least-squares minimum, which tests/examples/check_minimal.py computes alone.
#include <cmath>
#include <cstdio>
#include <vector>

#include "zero/zero.hpp"

constexpr int kRanks = 4, kExamples = 256, kInputs = 8, kHidden = 4, kSteps = 20;

// The model's arithmetic over n examples, x row-major (n x kInputs): h = W x.
void hidden_forward(const float* W, const float* x, int n, float* h) {
  for (int i = 0; i < n; ++i)
    for (int k = 0; k < kHidden; ++k) {
      h[i * kHidden + k] = 0;
      for (int j = 0; j < kInputs; ++j) h[i * kHidden + k] += W[k * kInputs + j] * x[i * kInputs + j];
    }
}
// y = v.h + d; returns the mean squared error against the targets, dy = d loss / d y.
double output_forward(const float* v, float d, const float* h, const float* target, int n, float* dy) {
  double loss = 0;
  for (int i = 0; i < n; ++i) {
    float error = d - target[i];
    for (int k = 0; k < kHidden; ++k) error += v[k] * h[i * kHidden + k];
    loss += error * error / n;
    dy[i] = 2 * error / n;
  }
  return loss;
}
// The output layer's gradient (dv, dd), and dh = d loss / d h, which backward passes down.
void output_backward(const float* v, const float* h, const float* dy, int n, float* dv, float* dd, float* dh) {
  *dd = 0;
  for (int k = 0; k < kHidden; ++k) dv[k] = 0;
  for (int i = 0; i < n; ++i) {
    *dd += dy[i];
    for (int k = 0; k < kHidden; ++k) {
      dv[k] += dy[i] * h[i * kHidden + k];
      dh[i * kHidden + k] = dy[i] * v[k];
    }
  }
}
// The hidden layer's gradient dW = dh^T x: it does not read W.
void hidden_backward(const float* dh, const float* x, int n, float* dW) {
  for (int k = 0; k < kHidden; ++k)
    for (int j = 0; j < kInputs; ++j) {
      dW[k * kInputs + j] = 0;
      for (int i = 0; i < n; ++i) dW[k * kInputs + j] += dh[i * kHidden + k] * x[i * kInputs + j];
    }
}

int main() {
  // The data: x_ij = cos(0.37 i (j+1)), y_i = sum_j ±(j+1)/8 x_ij + 0.5 + noise.
  std::vector<float> x(kExamples * kInputs), y(kExamples);
  for (int i = 0; i < kExamples; ++i) {
    double target = 0.5 + 0.1 * std::sin(1.7 * i * i);
    for (int j = 0; j < kInputs; ++j) {
      const double xij = std::cos(0.37 * (i * (j + 1)));
      x[i * kInputs + j] = static_cast<float>(xij);
      target += (j % 2 == 0 ? 1 : -1) * (j + 1) / 8.0 * xij;
    }
    y[i] = static_cast<float>(target);
  }
  // The initial values: W_kj = 0.5 sin(k kInputs + j + 1), v_k = 0.5 cos(k + 1), d = 0.
  std::vector<float> W0(kHidden * kInputs), v0(kHidden);
  for (int k = 0; k < kHidden; ++k) {
    v0[k] = 0.5f * std::cos(k + 1.0f);
    for (int j = 0; j < kInputs; ++j) W0[k * kInputs + j] = 0.5f * std::sin(k * kInputs + j + 1.0f);
  }

  // Stage 3 in fp32, plain SGD, on the host.
  using Opt = zero::ZeroOptimizer<zero::precision::Full<float>, zero::optim::PlainSgd, zero::stage<3>,
                                  zero::offload::None, zero::backend::Host>;
  zero::comm::LocalGroup group(kRanks);
  group.run([&](zero::comm::Local& comm) {
    Opt opt(comm, {.lr = 0.2});
    const zero::UnitId hidden = opt.add_unit("hidden"), output = opt.add_unit("output");
    const zero::ParamId W = opt.add_param(hidden, "W", kHidden * kInputs);
    const zero::ParamId v = opt.add_param(output, "v", kHidden), d = opt.add_param(output, "d", 1);
    opt.finalize();                // collective: every rank registered the same units
    opt.set_param(W, W0.data());   // the same values on every rank; each keeps its shard
    opt.set_param(v, v0.data());
    auto at = [&](zero::ParamId p) { return opt.layout().param(p).offset; };  // in its unit's buffer

    const int n = kExamples / kRanks;  // this rank's examples
    const float *xs = &x[comm.rank() * n * kInputs], *ys = &y[comm.rank() * n];
    std::vector<float> h(n * kHidden), dy(n), dh(n * kHidden);
    for (int step = 1; step <= kSteps; ++step) {
      // Forward, unit by unit: at stage 3, acquire_unit gathers the unit and release_unit frees it.
      const float* p = opt.acquire_unit(hidden);
      hidden_forward(p + at(W), xs, n, h.data());
      opt.release_unit(hidden);
      p = opt.acquire_unit(output);  // held into backward, which reads v
      double loss = output_forward(p + at(v), p[at(d)], h.data(), ys, n, dy.data());
      // Backward, last unit first: this rank's mean gradient, written over the unit's buffer.
      float* g = opt.grad_buffer(output);
      output_backward(p + at(v), h.data(), dy.data(), n, g + at(v), g + at(d), dh.data());
      opt.grad_ready(output);  // stages 2 and 3 reduce-scatter it now, while backward goes on
      opt.release_unit(output);
      g = opt.grad_buffer(hidden);  // (no acquire_unit: its gradient does not read W)
      hidden_backward(dh.data(), xs, n, g + at(W));
      opt.grad_ready(hidden);
      opt.step();  // the ranks' gradients averaged; each rank updates its shard
      loss = opt.mean_over_ranks(loss);
      if (comm.rank() == 0) std::printf("step %2d  loss %.6f\n", step, loss);
      if (comm.rank() == 0 && step == kSteps) std::printf("loss=%.6f\n", loss);
    }
  });
}
