// The host fused step over shards of every size: the SIMD paths (each ISA,
// aligned or not, streamed copies for shards past the last-level cache,
// thread splits) give the same bits as the scalar per-element body.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
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

namespace {

// The remainder master through the host step: for every ISA and size, the
// SIMD paths give the scalar body's bits, and the whole update is the one
// an fp32 master makes when its bf16 copy is rounded half away from zero
// (Options::round_ties_away): same master bits (read back by join_master),
// same copy, same state.
template <class Opt>
void check_remainder_step(std::size_t n, std::size_t misalign) {
  INFO("n " << n << ", misalign " << misalign << ", " << Opt::name << ", isa "
            << zero::simd::isa_name(zero::simd::active_isa()));
  constexpr int S = Opt::state_slots;
  const std::size_t total = n + misalign;
  std::vector<float> master(total);
  std::vector<zero::bf16> grad(total), copy(total), copy_simd, copy_fp32(total);
  std::vector<std::uint16_t> rest(total), rest_simd;
  std::vector<std::vector<float>> state(S, std::vector<float>(total)), state_simd, state_fp32;
  for (std::size_t i = 0; i < total; ++i) {
    std::uint32_t bits = std::bit_cast<std::uint32_t>(static_cast<float>(static_cast<int>(i % 2001) - 1000) * 1e-3f);
    if (i % 5 == 0) bits = (bits & 0xfffe0000u) | 0x8000u;  // ties, below an even copy: rounding to even breaks them
    master[i] = std::bit_cast<float>(bits);
    zero::split_master(master[i], copy[i], rest[i]);
    REQUIRE(std::bit_cast<std::uint32_t>(zero::join_master(copy[i], rest[i])) == bits);
    grad[i] = zero::from_float<zero::bf16>(static_cast<float>(static_cast<int>((i * 7) % 1001) - 500) * 1e-3f);
    for (int k = 0; k < S; ++k) state[k][i] = static_cast<float>((i * (k + 3)) % 97) * 1e-4f;
  }
  copy_simd = copy;
  rest_simd = rest;
  state_simd = state_fp32 = state;
  typename Opt::Hyper hyper;
  hyper.lr = 1e-2;
  zero::kernels::FusedStepArgs<Opt, zero::bf16, zero::bf16> args, ref, fp32;
  args.grad = grad.data() + misalign;
  args.n = n;
  args.grad_scale = 0.5f;
  args.scalars = Opt::prepare(hyper, 3);
  ref = fp32 = args;
  auto aim = [&](auto& a, std::vector<zero::bf16>& c, std::vector<std::uint16_t>& r, std::vector<std::vector<float>>& st) {
    a.param = c.data() + misalign;
    a.remainder = r.data() + misalign;
    for (int k = 0; k < S; ++k) a.state[k] = st[k].data() + misalign;
  };
  aim(args, copy_simd, rest_simd, state_simd);
  aim(ref, copy, rest, state);
  fp32.master = master.data() + misalign;
  fp32.param = copy_fp32.data() + misalign;
  fp32.ties_away = true;
  for (int k = 0; k < S; ++k) fp32.state[k] = state_fp32[k].data() + misalign;
  zero::kernels::host_fused_step(args);
  for (std::size_t i = 0; i < n; ++i) zero::kernels::fused_step_element(ref, i);
  zero::kernels::host_fused_step(fp32);
  CHECK(std::memcmp(copy_simd.data(), copy.data(), total * sizeof(zero::bf16)) == 0);
  CHECK(std::memcmp(rest_simd.data(), rest.data(), total * sizeof(std::uint16_t)) == 0);
  for (int k = 0; k < S; ++k) {
    CHECK(std::memcmp(state_simd[k].data(), state[k].data(), total * sizeof(float)) == 0);
    CHECK(std::memcmp(state_fp32[k].data(), state[k].data(), total * sizeof(float)) == 0);
  }
  std::size_t differ = 0, copies_differ = 0;
  for (std::size_t i = misalign; i < total; ++i) {
    differ += std::bit_cast<std::uint32_t>(zero::join_master(copy[i], rest[i])) != std::bit_cast<std::uint32_t>(master[i]);
    copies_differ += copy[i].bits != copy_fp32[i].bits;
  }
  CHECK(differ == 0);
  CHECK(copies_differ == 0);
}

}  // namespace

TEST_CASE("A remainder master is the fp32 master bit for bit, whatever the bits", "[kernels][remainder]") {
  // Every lower half for upper halves across the range: zeros, subnormals,
  // the largest finite values (whose ties round to infinity), infinities,
  // NaNs, both signs, and odd and even copies.
  std::vector<std::uint32_t> highs = {0x0000, 0x0001, 0x0002, 0x007f, 0x0080, 0x3f7f, 0x3f80, 0x3f81, 0x7f7e, 0x7f7f,
                                      0x7f80, 0x7f81, 0x7fc0, 0x7fff, 0x8000, 0x8001, 0xbf80, 0xff7f, 0xff80, 0xffff};
  for (std::uint32_t h = 0; h < 0x10000; h += 251) highs.push_back(h);
  // Counted, not asserted per value (130 million of them).
  std::size_t checked = 0, wrong_nan = 0, wrong_back = 0, wrong_copy = 0, not_nearest = 0;
  for (const std::uint32_t high : highs) {
    for (std::uint32_t low = 0; low < 0x10000; ++low) {
      const std::uint32_t bits = high << 16 | low;
      const float f = std::bit_cast<float>(bits);
      zero::bf16 copy;
      std::uint16_t rest;
      zero::split_master(f, copy, rest);
      const float back = zero::join_master(copy, rest);
      if (std::isnan(f)) {
        wrong_nan += !std::isnan(back) || copy.bits != 0x7fff;  // the nearest-even conversion's NaN
      } else {
        wrong_back += std::bit_cast<std::uint32_t>(back) != bits;
        // The copy is a nearest bf16 value (half away from zero on ties).
        wrong_copy += copy.bits != ((bits + 0x8000u) >> 16) || !(zero::bf16_ties_away(f) == copy);
        not_nearest += low != 0x8000 && !(copy == zero::from_float<zero::bf16>(f));
      }
      ++checked;
    }
  }
  CHECK(wrong_nan == 0);
  CHECK(wrong_back == 0);
  CHECK(wrong_copy == 0);
  CHECK(not_nearest == 0);
  CHECK(checked == highs.size() * 65536);
  // Rounding to nearest even has 65,537 values for an even copy: the tie
  // above it is one of them, and no 16-bit remainder could tell it apart.
  const float tie_above_even = std::bit_cast<float>(0x3f808000u);  // copy 0x3f80 is even
  CHECK(zero::from_float<zero::bf16>(tie_above_even).bits == 0x3f80);
  CHECK(zero::bf16_ties_away(tie_above_even).bits == 0x3f81);
}

TEST_CASE("The host fused step with a remainder master matches the scalar body and the fp32 master",
          "[kernels][remainder]") {
  const std::size_t sizes[] = {1, 15, 1000, (std::size_t{1} << 15) + 17};
  for (const auto isa : zero::simd::supported_isas()) {
    zero::simd::force_isa(isa);
    for (std::size_t n : sizes)
      for (std::size_t misalign : {std::size_t{0}, std::size_t{1}}) {
        check_remainder_step<zero::optim::AdamW>(n, misalign);
        check_remainder_step<zero::optim::Adam>(n, misalign);
        check_remainder_step<zero::optim::Sgd>(n, misalign);
      }
  }
  zero::simd::force_isa(zero::simd::detect_isa_from_cpu());
}

namespace {

// bf16 state (Options::states): the SIMD paths give the scalar body's bits,
// rounded to nearest even or stochastically, beside an fp32 or remainder
// master.
template <class Opt, class Grad, class Param>
void check_bf16_states_step(std::size_t n, std::size_t misalign, bool stochastic, bool remainder) {
  INFO("n " << n << ", misalign " << misalign << ", " << Opt::name << ", stochastic " << stochastic
            << ", remainder " << remainder << ", isa " << zero::simd::isa_name(zero::simd::active_isa()));
  constexpr int S = Opt::state_slots;
  const std::size_t total = n + misalign;
  std::vector<float> master(total);
  std::vector<Grad> grad(total);
  std::vector<Param> copy(total);
  std::vector<std::uint16_t> rest(total);
  std::vector<std::vector<zero::bf16>> state(S, std::vector<zero::bf16>(total));
  for (std::size_t i = 0; i < total; ++i) {
    master[i] = static_cast<float>(static_cast<int>(i % 2001) - 1000) * 1e-3f;
    if constexpr (std::is_same_v<Param, zero::bf16>) zero::split_master(master[i], copy[i], rest[i]);
    grad[i] = zero::from_float<Grad>(static_cast<float>(static_cast<int>((i * 7) % 1001) - 500) * 1e-3f);
    for (int k = 0; k < S; ++k) state[k][i] = zero::from_float<zero::bf16>(static_cast<float>((i * (k + 3)) % 97) * 1e-4f);
  }
  auto master_ref = master;
  auto copy_ref = copy;
  auto rest_ref = rest;
  auto state_ref = state;
  typename Opt::Hyper hyper;
  hyper.lr = 1e-2;
  if constexpr (requires { hyper.momentum; }) hyper.momentum = 0.9;  // SGD keeps its buffer unchanged without
  zero::kernels::FusedStepArgs<Opt, Grad, Param> args, ref;
  args.grad = grad.data() + misalign;
  args.n = n;
  args.grad_scale = 0.5f;
  args.scalars = Opt::prepare(hyper, 3);
  args.state_rounding = zero::StochasticRounding{stochastic, 99, 3};
  args.global_offset = 1000;
  ref = args;
  auto aim = [&](auto& a, std::vector<float>& m, std::vector<Param>& c, std::vector<std::uint16_t>& r,
                 std::vector<std::vector<zero::bf16>>& st) {
    a.master = m.data() + misalign;
    a.param = c.data() + misalign;
    if constexpr (std::is_same_v<Param, zero::bf16>)
      if (remainder) {
        a.master = nullptr;
        a.remainder = r.data() + misalign;
      }
    for (int k = 0; k < S; ++k) a.state16[k] = st[k].data() + misalign;
  };
  aim(args, master, copy, rest, state);
  aim(ref, master_ref, copy_ref, rest_ref, state_ref);
  zero::kernels::host_fused_step(args);
  for (std::size_t i = 0; i < n; ++i) zero::kernels::fused_step_element(ref, i);
  CHECK(std::memcmp(master.data(), master_ref.data(), total * sizeof(float)) == 0);
  CHECK(std::memcmp(copy.data(), copy_ref.data(), total * sizeof(Param)) == 0);
  CHECK(std::memcmp(rest.data(), rest_ref.data(), total * sizeof(std::uint16_t)) == 0);
  std::size_t moved = 0;
  for (int k = 0; k < S; ++k) {
    CHECK(std::memcmp(state[k].data(), state_ref[k].data(), total * sizeof(zero::bf16)) == 0);
    for (std::size_t i = misalign; i < total; ++i)
      moved += !(state[k][i] == zero::from_float<zero::bf16>(static_cast<float>((i * (k + 3)) % 97) * 1e-4f));
  }
  CHECK(moved > 0);  // the state was updated (and stored), not left alone
}

}  // namespace

TEST_CASE("The host fused step with bf16 states matches the scalar body", "[kernels][states]") {
  const std::size_t sizes[] = {1, 15, 1000, (std::size_t{1} << 15) + 17};
  for (const auto isa : zero::simd::supported_isas()) {
    zero::simd::force_isa(isa);
    for (std::size_t n : sizes)
      for (std::size_t misalign : {std::size_t{0}, std::size_t{1}})
        for (const bool stochastic : {false, true}) {
          check_bf16_states_step<zero::optim::AdamW, zero::bf16, zero::bf16>(n, misalign, stochastic, false);
          check_bf16_states_step<zero::optim::AdamW, zero::bf16, zero::bf16>(n, misalign, stochastic, true);
          check_bf16_states_step<zero::optim::Sgd, float, float>(n, misalign, stochastic, false);
          check_bf16_states_step<zero::optim::Adam, zero::fp16, zero::fp16>(n, misalign, stochastic, false);
        }
  }
  zero::simd::force_isa(zero::simd::detect_isa_from_cpu());
}
