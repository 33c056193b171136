// A user's translation unit, as the README writes one: it must compile without
// a single warning under -Wall -Wextra -Werror at -O2, with g++ and Clang
// (tests/compile/check_compile.py, mode "warnings"). It instantiates every
// host kernel the library has (each precision with each optimizer, every
// stage, every conversion), because g++ reports some warnings (-Wpsabi) only
// for code it generates, and only once per translation unit.
#include <cstdio>
#include <vector>

#include "zero/zero.hpp"

namespace {

template <class Precision, class Optimizer, int Stage>
float train_one_step() {
  using Opt = zero::ZeroOptimizer<Precision, Optimizer, zero::stage<Stage>, zero::offload::None, zero::backend::Host>;
  float result = 0.0f;
  zero::comm::LocalGroup group(2);
  group.run([&](zero::comm::Local& comm) {
    zero::Options options;
    options.clip_norm = 1.0;
    Opt opt(comm, typename Optimizer::Hyper{}, options);
    const auto unit = opt.add_unit("layer");
    const auto w = opt.add_param(unit, "w", 1000);
    opt.finalize();
    const std::vector<float> init(1000, 0.5f);
    opt.set_param(w, init.data());
    opt.acquire_unit(unit);
    auto* g = opt.grad_buffer(unit);
    for (int i = 0; i < 1000; ++i) g[i] = zero::from_float<typename Opt::grad_type>(0.25f);
    opt.grad_ready(unit);
    opt.release_unit(unit);
    opt.step();
    const auto values = opt.master_values(w);
    if (comm.rank() == 0) result = values[0];
  });
  return result;
}

template <class From, class To>
float convert() {
  std::vector<From> src(1 << 16, zero::from_float<From>(1.5f));
  std::vector<To> dst(src.size());
  zero::kernels::host_convert(src.data(), dst.data(), src.size());
  zero::kernels::host_accumulate(dst.data(), src.data(), src.size());
  return zero::to_float(dst[0]);
}

}  // namespace

int main() {
  using zero::bf16;
  using zero::fp16;
  using namespace zero::precision;
  using namespace zero::optim;
  const float sum = train_one_step<Full<float>, AdamW, 0>() + train_one_step<Full<float>, Adam, 1>() +
                    train_one_step<Full<float>, Sgd, 2>() + train_one_step<Mixed<bf16>, AdamW, 3>() +
                    train_one_step<Mixed<bf16>, Adam, 0>() + train_one_step<Mixed<bf16>, Sgd, 1>() +
                    train_one_step<Mixed<fp16>, AdamW, 2>() + train_one_step<Mixed<fp16>, Adam, 3>() +
                    train_one_step<Mixed<fp16>, Sgd, 3>() + convert<float, bf16>() + convert<float, fp16>() +
                    convert<bf16, float>() + convert<fp16, float>() + convert<bf16, fp16>() +
                    convert<fp16, bf16>();
  std::printf("%g\n", static_cast<double>(sum));
}
