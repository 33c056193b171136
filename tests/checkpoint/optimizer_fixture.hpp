// The optimizer-checkpoint tests' shared fixture: a three-unit model of
// unequal, unaligned sizes, the equivalence tests' gradients, and the state a
// run ends in (masters, 16-bit copies, and the parameters forward reads).
#pragma once

#include <catch2/catch.hpp>

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <type_traits>
#include <vector>

#include "../engine/reference.hpp"
#include "zero/zero.hpp"

namespace zero::test::ckpt {

namespace fs = std::filesystem;
using zero::bf16;
using zero::fp16;
using namespace zero::precision;

struct TempDir {
  fs::path path;
  TempDir() {
    char name[] = "/tmp/zero-ckpt-test-XXXXXX";
    REQUIRE(::mkdtemp(name) != nullptr);
    path = name;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// Three units of unequal, unaligned sizes (shards padded differently for
// every rank count).
inline constexpr std::size_t kSizes[] = {700, 1301, 257};

// Shapes for `shaped` builds: one 3-D, one flat (none given), one 1-D.
inline const zero::Shape kShapes[] = {{7, 4, 25}, {}, {257}};

template <class Opt>
void build(Opt& opt, bool initialise, bool shaped = false) {
  for (std::size_t u = 0; u < 3; ++u) {
    const auto unit = opt.add_unit("block" + std::to_string(u));
    if (shaped)
      opt.add_param(unit, "w" + std::to_string(u), kSizes[u], kShapes[u]);
    else
      opt.add_param(unit, "w" + std::to_string(u), kSizes[u]);  // the three-argument form stays
  }
  opt.finalize();
  if (!initialise) return;
  for (std::size_t p = 0; p < 3; ++p) {
    std::vector<float> v(kSizes[p]);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = zero::test::init_value(p, i);
    opt.set_param(zero::ParamId{p}, v.data());
  }
}

// Optimizer steps first..last (1-based), each of `micro` micro-batches, with
// the gradients of the equivalence tests for this rank's part, plus w/8 of
// the parameters w that forward read (acquire_unit), as a trainer's gradient
// depends on them: a run whose forward reads wrong values ends elsewhere.
template <class Opt>
void train_steps(Opt& opt, int rank, int first, int last) {
  using G = typename Opt::grad_type;
  using Ops = zero::backend::Ops<typename Opt::backend_policy>;
  const int micro = opt.options().grad_accumulation_steps;
  std::vector<G> g(opt.layout().max_unit());
  std::vector<typename Opt::param_type> w(opt.layout().max_unit());
  for (int step = first; step <= last; ++step)
    for (int m = 0; m < micro; ++m) {
      for (std::size_t u = 3; u-- > 0;) {
        const zero::UnitId id{u};
        const zero::UnitInfo& info = opt.layout().unit(id);
        Ops::download(w.data(), opt.acquire_unit(id), info.padded);
        G* buffer = opt.grad_buffer(id);
        for (std::size_t i = 0; i < info.padded; ++i)
          g[i] = zero::from_float<G>(static_cast<float>(opt.loss_scale()) *
                                     (zero::test::grad_part(rank, u, i % kSizes[u], step, m) +
                                      0.125f * zero::to_float(w[i])));
        Ops::upload(buffer, g.data(), info.padded);
        opt.grad_ready(id);
        opt.release_unit(id);
      }
      opt.step();
    }
}

struct Final {
  std::vector<float> masters, params;
  std::int64_t steps = 0;
  double loss_scale = 0;
};

template <class Opt>
Final final_state(Opt& opt) {
  Final f;
  f.masters.resize(opt.layout().padded_total());
  opt.gather_masters(f.masters.data());
  std::vector<typename Opt::param_type> low(opt.layout().padded_total());
  opt.gather_params(low.data());
  for (const auto& v : low) f.params.push_back(zero::to_float(v));
  f.steps = opt.step_count();
  f.loss_scale = opt.loss_scale();
  return f;
}

// The values of every parameter element (the padding dropped), model order.
std::vector<float> unpadded(const zero::Layout& layout, const std::vector<float>& padded) {
  std::vector<float> out;
  for (const auto& u : layout.units())
    for (std::size_t p : u.params) {
      const auto& info = layout.params()[p];
      for (std::size_t i = 0; i < info.numel; ++i) out.push_back(padded[u.full_offset + info.offset + i]);
    }
  return out;
}

template <class Opt>
zero::Options options_for() {
  zero::Options o;
  o.grad_accumulation_steps = 2;
  o.clip_norm = 0.5;
  o.loss_scale.initial_scale = 256;
  o.loss_scale.growth_interval = 3;  // the scale changes during the run: its state must resume
  o.stochastic_rounding = std::is_same_v<typename Opt::param_type, bf16>;
  return o;
}


// The parameters forward reads, unit by unit (acquire_unit: at stage 3 the
// gathered copy; collective there), widened to fp32, padding included. A
// load that restores the master but not these would train on wrong values
// while gather_masters() looks right.
template <class Opt>
std::vector<float> forward_params(Opt& opt) {
  using Ops = zero::backend::Ops<typename Opt::backend_policy>;
  std::vector<float> out;
  std::vector<typename Opt::param_type> unit;
  for (std::size_t u = 0; u < opt.layout().units().size(); ++u) {
    const zero::UnitId id{u};
    const zero::UnitInfo& info = opt.layout().unit(id);
    unit.resize(info.padded);
    Ops::download(unit.data(), opt.acquire_unit(id), info.padded);
    opt.release_unit(id);
    for (const auto& v : unit) out.push_back(zero::to_float(v));
  }
  return out;
}

}  // namespace zero::test::ckpt
