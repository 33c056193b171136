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

// The hyper-parameters of the state-format tests' step (SGD with momentum,
// which keeps its buffer unchanged without).
template <class Opt>
typename Opt::Hyper step_hyper() {
  typename Opt::Hyper hyper;
  hyper.lr = 1e-2;
  if constexpr (requires { hyper.momentum; }) hyper.momentum = 0.9;
  return hyper;
}

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
  zero::kernels::FusedStepArgs<Opt, Grad, Param> args, ref;
  args.grad = grad.data() + misalign;
  args.n = n;
  args.grad_scale = 0.5f;
  args.scalars = Opt::prepare(step_hyper<Opt>(), 3);
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

namespace {

// 8-bit block-wise states (Options::states = blockwise8): the SIMD paths
// (AVX-512: tables in registers and the segments' arithmetic; AVX2: gathers)
// give the scalar block body's codes, absmax, master and copies bit for bit,
// with the built-in tables and with a table of the user's own (the same
// values at another address: no lookups, the scalar body).
template <class Opt, class Grad, class Param>
void check_blockwise8_step(std::size_t n, std::uint32_t block, std::uint32_t phase, bool remainder, bool own_tables) {
  INFO("n " << n << ", block " << block << ", phase " << phase << ", " << Opt::name << ", remainder " << remainder
            << ", own tables " << own_tables << ", isa " << zero::simd::isa_name(zero::simd::active_isa()));
  constexpr int S = Opt::state_slots;
  namespace q = zero::quant;
  static const q::CodeTable own_signed = q::dynamic_code_signed, own_unsigned = q::dynamic_code_unsigned;
  zero::kernels::FusedStepArgs<Opt, Grad, Param> args;
  args.n = n;
  args.block = block;
  args.block_phase = phase;
  const std::size_t blocks = args.block_count();
  std::vector<float> master(n);
  std::vector<Grad> grad(n);
  std::vector<Param> copy(n);
  std::vector<std::uint16_t> rest(n);
  std::vector<std::vector<std::uint8_t>> codes(S, std::vector<std::uint8_t>(n));
  std::vector<std::vector<float>> absmax(S, std::vector<float>(blocks));
  std::uint64_t state = 0x243f6a8885a308d3ull;
  auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<std::uint32_t>(state >> 32);
  };
  for (std::size_t i = 0; i < n; ++i) {
    master[i] = static_cast<float>(static_cast<int>(next() % 2001) - 1000) * 1e-3f;
    if constexpr (std::is_same_v<Param, zero::bf16>) zero::split_master(master[i], copy[i], rest[i]);
    // Gradients over six decades, so the states' codes use every level.
    const float magnitude = std::ldexp(static_cast<float>(next() % 1000 + 1) * 1e-3f, -static_cast<int>(next() % 20));
    grad[i] = zero::from_float<Grad>((next() & 1u) ? -magnitude : magnitude);
    for (int k = 0; k < S; ++k) codes[k][i] = static_cast<std::uint8_t>(next());
  }
  for (int k = 0; k < S; ++k) {
    const bool non_negative = zero::optim::state_values<Opt>(k) == zero::optim::StateValues::non_negative;
    for (std::size_t b = 0; b < blocks; ++b) absmax[k][b] = static_cast<float>(next() % 100 + 1) * 1e-3f;
    args.code[k] = own_tables ? (non_negative ? own_unsigned.data() : own_signed.data()) : q::code_for(non_negative);
  }
  auto master_ref = master;
  auto copy_ref = copy;
  auto rest_ref = rest;
  auto codes_ref = codes;
  auto absmax_ref = absmax;
  args.grad = grad.data();
  args.grad_scale = 0.5f;
  args.scalars = Opt::prepare(step_hyper<Opt>(), 3);
  auto ref = args;
  auto aim = [&](auto& a, std::vector<float>& m, std::vector<Param>& c, std::vector<std::uint16_t>& r,
                 std::vector<std::vector<std::uint8_t>>& st, std::vector<std::vector<float>>& am) {
    a.master = m.data();
    a.param = c.data();
    if constexpr (std::is_same_v<Param, zero::bf16>)
      if (remainder) {
        a.master = nullptr;
        a.remainder = r.data();
      }
    for (int k = 0; k < S; ++k) {
      a.state8[k] = st[k].data();
      a.absmax[k] = am[k].data();
    }
  };
  aim(args, master, copy, rest, codes, absmax);
  aim(ref, master_ref, copy_ref, rest_ref, codes_ref, absmax_ref);
  zero::kernels::host_fused_step(args);
  std::vector<float> scratch(static_cast<std::size_t>(S) * block);
  for (std::size_t b = 0; b < blocks; ++b) zero::kernels::fused_step_block(ref, b, scratch.data());
  CHECK(std::memcmp(master.data(), master_ref.data(), n * sizeof(float)) == 0);
  CHECK(std::memcmp(copy.data(), copy_ref.data(), n * sizeof(Param)) == 0);
  CHECK(std::memcmp(rest.data(), rest_ref.data(), n * sizeof(std::uint16_t)) == 0);
  std::size_t changed = 0;
  for (int k = 0; k < S; ++k) {
    for (std::size_t i = 0; i < n; ++i) {
      if (codes[k][i] != codes_ref[k][i]) {
        FAIL_CHECK("slot " << k << " element " << i << ": code " << int(codes[k][i]) << ", scalar "
                           << int(codes_ref[k][i]));
        break;
      }
    }
    CHECK(std::memcmp(absmax[k].data(), absmax_ref[k].data(), blocks * sizeof(float)) == 0);
    for (std::size_t b = 0; b < blocks; ++b) changed += absmax[k][b] != static_cast<float>(0);
  }
  CHECK(changed > 0);
}

}  // namespace

TEST_CASE("The host fused step with 8-bit states matches the scalar block body", "[kernels][states]") {
  struct Case {
    std::size_t n;
    std::uint32_t block, phase;
  };
  const Case cases[] = {{1, 64, 0}, {100, 64, 17}, {5000, 2048, 0}, {(std::size_t{1} << 16) + 37, 2048, 1000},
                        {(std::size_t{1} << 16), 256, 3}};
  for (const auto isa : zero::simd::supported_isas()) {
    zero::simd::force_isa(isa);
    for (const Case& c : cases)
      for (const bool own_tables : {false, true}) {
        check_blockwise8_step<zero::optim::AdamW, zero::bf16, zero::bf16>(c.n, c.block, c.phase, true, own_tables);
        check_blockwise8_step<zero::optim::AdamW, zero::bf16, zero::bf16>(c.n, c.block, c.phase, false, own_tables);
        check_blockwise8_step<zero::optim::Adam, float, float>(c.n, c.block, c.phase, false, own_tables);
        check_blockwise8_step<zero::optim::Sgd, zero::fp16, zero::fp16>(c.n, c.block, c.phase, false, own_tables);
      }
  }
  zero::simd::force_isa(zero::simd::detect_isa_from_cpu());
}

// The segments' arithmetic (quant::CodeSegments, what AVX-512 encodes with)
// gives quantize()'s index wherever it does not defer, and defers rarely.
TEST_CASE("The code segments find quantize()'s index without a table read", "[quant][kernels]") {
  namespace q = zero::quant;
  for (const bool non_negative : {false, true}) {
    INFO((non_negative ? "unsigned" : "signed") << " table");
    const float* code = q::code_for(non_negative);
    const q::CodeSegments segments(code);
    REQUIRE(segments.usable());
    CHECK(segments.segments() == (non_negative ? 9 : 14));  // the levels (0 and the lowest merged), and 1.0
    // Deferrals are counted where states lie: an unsigned table's values
    // (Adam's second moment) are never negative, and a negative y there
    // defers near every integer t passes (exact, and slower).
    std::size_t checked = 0, deferred = 0, wrong = 0, rated = 0;
    auto check = [&](float y) {
      if (!(y >= -1.0f && y <= 1.0f)) return;
      ++checked;
      const bool counts = !non_negative || !std::signbit(y);
      rated += counts;
      const int index = segments.index_or_defer(y);
      if (index < 0) {
        deferred += counts;
      } else if (index != q::quantize(y, code) && ++wrong < 5) {
        FAIL_CHECK("y = " << y << ": segments " << index << ", quantize " << int(q::quantize(y, code)));
      }
    };
    auto around = [&](float v) {
      const auto bits = std::bit_cast<std::uint32_t>(v);
      for (int d = -8; d <= 8; ++d) check(std::bit_cast<float>(bits + static_cast<std::uint32_t>(d)));
    };
    for (int j = 0; j < q::code_size; ++j) {
      around(code[j]);
      if (j + 1 < q::code_size) around((code[j] + code[j + 1]) * 0.5f);
    }
    const std::size_t edges = checked, rated_edges = rated;
    // Every 61st float of [-1, 1].
    for (std::uint32_t bits = 0; bits <= 0x3f800000u; bits += 61) {
      check(std::bit_cast<float>(bits));
      check(-std::bit_cast<float>(bits));
    }
    CHECK(wrong == 0);
    CHECK(checked > edges + 34000000);  // both signs
    CHECK(deferred < (rated - rated_edges) / 500);  // under 0.2% of as many values off the edges
  }
  // A table without the structure: unusable (the step keeps its gathers).
  q::CodeTable linear{};
  for (int j = 0; j < q::code_size; ++j) linear[j] = static_cast<float>(j * j) / (255.0f * 255.0f);
  CHECK_FALSE(q::CodeSegments(linear.data()).usable());
}

#if ZERO_HOST_SIMD_X86
namespace {

struct EncodeBody {
  template <class Isa>
  static void run(const std::vector<float>& x, const float* code, std::vector<std::uint8_t>& q) {
    zero::simd::encode_codes<Isa>(x.data(), x.size(), 1.0f, *zero::quant::nearest_code_for(code),
                                  zero::quant::code_segments_for(code), q.data());
  }
};
struct DecodeBody {
  template <class Isa>
  static void run(const std::vector<std::uint8_t>& q, const float* code, float scale, std::vector<float>& x) {
    zero::simd::decode_codes<Isa>(q.data(), q.size(), code, scale, x.data());
  }
};

}  // namespace

// Where the segments' arithmetic is least sure (every midpoint, where a
// value rounds either way, and its neighbours) the SIMD encoders defer to
// the exact lookup and give quantize()'s index; the decoders give every code.
TEST_CASE("The SIMD code lookups give quantize() and dequantize() on every edge", "[quant][kernels]") {
  namespace q = zero::quant;
  for (const bool non_negative : {false, true}) {
    const float* code = q::code_for(non_negative);
    std::vector<float> x;
    for (int j = 0; j + 1 < q::code_size; ++j) {
      const auto bits = std::bit_cast<std::uint32_t>((code[j] + code[j + 1]) * 0.5f);
      for (int d = -3; d <= 3; ++d) x.push_back(std::bit_cast<float>(bits + static_cast<std::uint32_t>(d)));
    }
    x.push_back(1.0f);
    // Every code, shuffled, then 37 more: a tail shorter than any decoder's pack.
    std::vector<std::uint8_t> all(q::code_size + 37);
    for (std::size_t j = 0; j < all.size(); ++j) all[j] = static_cast<std::uint8_t>(j * 37 + 11);
    for (const auto isa : zero::simd::supported_isas()) {
      INFO((non_negative ? "unsigned" : "signed") << " table, isa " << zero::simd::isa_name(isa));
      std::vector<std::uint8_t> codes(x.size());
      zero::simd::dispatch<EncodeBody>(isa, x, code, codes);
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < x.size(); ++i) wrong += codes[i] != q::quantize(x[i], code);
      CHECK(wrong == 0);
      std::vector<float> back(all.size());
      zero::simd::dispatch<DecodeBody>(isa, all, code, 0.75f, back);
      for (std::size_t i = 0; i < all.size(); ++i) REQUIRE(back[i] == q::dequantize(all[i], code, 0.75f));
      // AVX-512 decodes through byte permutes where the CPU has VBMI; its
      // float-permute decoder (CPUs without VBMI) is checked here as well.
      if (isa == zero::simd::IsaLevel::avx512) {
        std::fill(back.begin(), back.end(), -2.0f);
        zero::simd::detail::decode_codes_avx512(all.data(), all.size(), code, 0.75f, back.data());
        for (std::size_t i = 0; i < all.size(); ++i) REQUIRE(back[i] == q::dequantize(all[i], code, 0.75f));
      }
    }
  }
}
#endif
