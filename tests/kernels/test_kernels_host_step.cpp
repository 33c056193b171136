// The host fused step over shards of every size: the SIMD paths (each ISA,
// aligned or not, streamed copies for shards past the last-level cache,
// thread splits) give the same bits as the scalar per-element body.
#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "zero/kernels/host_step.hpp"
#include "zero/optim/adam.hpp"
#include "zero/optim/sgd.hpp"

namespace {

template <class Opt, class Grad, class Param>
void check_matches_scalar(std::size_t n, std::size_t misalign) {
  INFO("n " << n << ", misalign " << misalign << ", grad " << zero::dtype_traits<Grad>::name << ", param "
            << zero::dtype_traits<Param>::name << ", isa " << zero::simd::isa_name(zero::simd::active_isa()));
  constexpr int S = Opt::state_slots;
  const std::size_t total = n + misalign;
  std::vector<float> master(total), master_ref;
  std::vector<Grad> grad(total);
  std::vector<std::vector<float>> state(S, std::vector<float>(total)), state_ref;
  std::vector<Param> copy(total), copy_ref(total);
  for (std::size_t i = 0; i < total; ++i) {
    master[i] = static_cast<float>(static_cast<int>(i % 2001) - 1000) * 1e-3f;
    grad[i] = zero::from_float<Grad>(static_cast<float>(static_cast<int>((i * 7) % 1001) - 500) * 1e-3f);
    for (int k = 0; k < S; ++k) state[k][i] = static_cast<float>((i * (k + 3)) % 97) * 1e-4f;
  }
  master_ref = master;
  state_ref = state;
  typename Opt::Hyper hyper;
  hyper.lr = 1e-2;
  zero::kernels::FusedStepArgs<Opt, Grad, Param> args, ref;
  args.master = master.data() + misalign;
  args.grad = grad.data() + misalign;
  args.param = copy.data() + misalign;
  for (int k = 0; k < S; ++k) args.state[k] = state[k].data() + misalign;
  args.n = n;
  args.grad_scale = 0.5f;
  args.scalars = Opt::prepare(hyper, 3);
  ref = args;
  ref.master = master_ref.data() + misalign;
  ref.param = copy_ref.data() + misalign;
  for (int k = 0; k < S; ++k) ref.state[k] = state_ref[k].data() + misalign;
  zero::kernels::host_fused_step(args);
  for (std::size_t i = 0; i < n; ++i) zero::kernels::fused_step_element(ref, i);
  CHECK(std::memcmp(master.data(), master_ref.data(), total * sizeof(float)) == 0);
  for (int k = 0; k < S; ++k) CHECK(std::memcmp(state[k].data(), state_ref[k].data(), total * sizeof(float)) == 0);
  CHECK(std::memcmp(copy.data(), copy_ref.data(), total * sizeof(Param)) == 0);
}

}  // namespace

TEST_CASE("The host fused step matches the scalar body bit for bit at every size", "[kernels][host]") {
  // Past 2^24 elements the low-precision copy is streamed (non-temporal stores).
  const std::size_t sizes[] = {1, 15, 1000, (std::size_t{1} << 15) + 17, (std::size_t{1} << 24) + 37};
  for (const auto isa : zero::simd::supported_isas()) {
    zero::simd::force_isa(isa);
    for (std::size_t n : sizes) {
      for (std::size_t misalign : {std::size_t{0}, std::size_t{1}}) {
        if (n > (1u << 20) && isa == zero::simd::IsaLevel::portable) continue;  // slow and not streamed
        check_matches_scalar<zero::optim::AdamW, zero::bf16, zero::bf16>(n, misalign);
        check_matches_scalar<zero::optim::Adam, zero::fp16, zero::fp16>(n, misalign);
        if (n < (1u << 20)) {
          check_matches_scalar<zero::optim::AdamW, float, float>(n, misalign);
          check_matches_scalar<zero::optim::Sgd, float, zero::bf16>(n, misalign);
        }
      }
    }
  }
  zero::simd::force_isa(zero::simd::detect_isa_from_cpu());
}
