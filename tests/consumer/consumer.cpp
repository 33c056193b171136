// Uses zero the way a user's project does: through dependency('zero').
#include <cstdio>

#include "zero/zero.hpp"

int main() {
  using Opt = zero::ZeroOptimizer<zero::precision::Mixed<zero::bf16>, zero::optim::AdamW, zero::stage<2>,
                                  zero::offload::None, zero::backend::Host>;
  int failures = 0;
  zero::comm::LocalGroup group(2);
  group.run([&](zero::comm::Local& comm) {
    Opt opt(comm, {});
    const auto unit = opt.add_unit("layer");
    const auto w = opt.add_param(unit, "w", 100);
    opt.finalize();
    float init[100] = {};
    opt.set_param(w, init);
    opt.acquire_unit(unit);
    zero::bf16* g = opt.grad_buffer(unit);
    for (int i = 0; i < 100; ++i) g[i] = zero::from_float<zero::bf16>(1.0f);
    opt.grad_ready(unit);
    opt.release_unit(unit);
    if (!opt.step().stepped) ++failures;
    const auto values = opt.master_values(w);
    if (comm.rank() == 0 && !(values[0] < 0.0f)) ++failures;  // moved against the gradient
  });
  std::printf("consumer: %s\n", failures == 0 ? "ok" : "FAILED");
  return failures == 0 ? 0 : 1;
}
