// A user's file of a program that compiles the built-in engines once
// (zero/runtime/precompiled.hpp): compiled with -DZERO_PRECOMPILED_ENGINES
// and including the disk tier, it must call the engines, make_optimizer's
// handles and the disk tier's stores without compiling any of them
// (tests/compile/check_compile.py, mode "precompiled", reads its symbols).
// A member that extern template cannot hold back (one defined inline in its
// class) would show up here as compiled.
#include <vector>

#include "zero/comm/local.hpp"
#include "zero/offload/disk_state_store.hpp"
#include "zero/runtime/make_optimizer.hpp"
#include "zero/zero.hpp"

int main() {
  zero::comm::LocalGroup group(1);
  group.run([](zero::comm::Local& comm) {
    zero::Config config;
    config.optimizer = "sgd";  // momentum 0: optim::PlainSgd, no momentum buffer
    config.stage = 2;
    config.offload = zero::OffloadTier::nvme;
    auto handle = zero::make_optimizer<zero::backend::Host, zero::offload::Nvme>(comm, config);
    const auto unit = handle->add_unit("layer");
    handle->add_param(unit, "w", 64);
    handle->finalize();
    handle->step();

    using Typed = zero::ZeroOptimizer<zero::precision::Mixed<zero::bf16>, zero::optim::AdamW, zero::stage<3>>;
    Typed typed(comm, {});
    const auto w = typed.add_param(typed.add_unit("layer"), "w", 64);
    typed.finalize();
    const std::vector<float> values(64, 0.5f);
    typed.set_param(w, values.data());
    typed.step();
  });
}
