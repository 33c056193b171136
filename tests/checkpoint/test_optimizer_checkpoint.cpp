// Why: a checkpoint is only worth its resume. A run saved after k steps and
// resumed in a fresh optimizer with the same configuration must continue bit
// for bit (master, every state slot, 16-bit parameters with stochastic
// rounding, step counter, loss scaler); a checkpoint saved with N ranks at
// one stage, or from another offload tier, must load on M ranks at another
// stage with every master value where it belongs; and loading into another
// optimizer is an error on every rank.
#include <catch2/catch.hpp>

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <vector>

#include "../engine/reference.hpp"
#include "zero/checkpoint/optimizer_io.hpp"
#include "zero/offload/disk_state_store.hpp"
#include "zero/zero.hpp"

namespace {

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

template <class Opt>
void build(Opt& opt, bool initialise) {
  for (std::size_t u = 0; u < 3; ++u)
    opt.add_param(opt.add_unit("block" + std::to_string(u)), "w" + std::to_string(u), kSizes[u]);
  opt.finalize();
  if (!initialise) return;
  for (std::size_t p = 0; p < 3; ++p) {
    std::vector<float> v(kSizes[p]);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = zero::test::init_value(p, i);
    opt.set_param(zero::ParamId{p}, v.data());
  }
}

// Optimizer steps first..last (1-based), each of `micro` micro-batches, with
// the gradients of the equivalence tests for this rank's part.
template <class Opt>
void train_steps(Opt& opt, int rank, int first, int last) {
  using G = typename Opt::grad_type;
  using Ops = zero::backend::Ops<typename Opt::backend_policy>;
  const int micro = opt.options().grad_accumulation_steps;
  std::vector<G> g(opt.layout().max_unit());
  for (int step = first; step <= last; ++step)
    for (int m = 0; m < micro; ++m) {
      for (std::size_t u = 3; u-- > 0;) {
        const zero::UnitId id{u};
        opt.acquire_unit(id);
        G* buffer = opt.grad_buffer(id);
        const zero::UnitInfo& info = opt.layout().unit(id);
        for (std::size_t i = 0; i < info.padded; ++i)
          g[i] = zero::from_float<G>(static_cast<float>(opt.loss_scale()) *
                                     zero::test::grad_part(rank, u, i % kSizes[u], step, m));
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

}  // namespace

TEMPLATE_TEST_CASE("a resumed run continues bit for bit", "[checkpoint][resume]",
                   (zero::ZeroOptimizer<Mixed<bf16>, zero::optim::AdamW, zero::stage<2>>),
                   (zero::ZeroOptimizer<Mixed<fp16>, zero::optim::Adam, zero::stage<3>>),
                   (zero::ZeroOptimizer<Full<float>, zero::optim::Sgd, zero::stage<1>>),
                   (zero::ZeroOptimizer<Mixed<bf16>, zero::optim::Adam, zero::stage<0>>)) {
  using Opt = TestType;
  TempDir dir;
  const zero::Options options = options_for<Opt>();
  const auto hyper = zero::test::test_hyper<typename Opt::optimizer_policy>();
  const int ranks = 2;
  std::vector<Final> uninterrupted(ranks), resumed(ranks);
  std::vector<std::string> errors(ranks);
  zero::comm::LocalGroup group(ranks);
  group.run([&](zero::comm::Local& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    {
      Opt opt(c, hyper, options);
      build(opt, true);
      train_steps(opt, c.rank(), 1, 4);
      opt.save((dir.path / "step-4").string());
      train_steps(opt, c.rank(), 5, 7);
      uninterrupted[r] = final_state(opt);
    }
    Opt fresh(c, hyper, options);
    build(fresh, false);  // no set_param: everything comes from the checkpoint
    const auto loaded = fresh.load(dir.path.string());
    if (loaded.manifest.run.step != 4) errors[r] = "step " + std::to_string(loaded.manifest.run.step);
    train_steps(fresh, c.rank(), 5, 7);
    resumed[r] = final_state(fresh);
  });
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r);
    CHECK(errors[r].empty());
    CHECK(resumed[r].masters == uninterrupted[r].masters);
    CHECK(resumed[r].params == uninterrupted[r].params);
    CHECK(resumed[r].steps == uninterrupted[r].steps);
    CHECK(resumed[r].loss_scale == uninterrupted[r].loss_scale);
  }
}

TEST_CASE("a checkpoint loads on another rank count, stage and offload tier", "[checkpoint][reshard]") {
  using Saved = zero::ZeroOptimizer<Mixed<bf16>, zero::optim::AdamW, zero::stage<2>, zero::offload::Nvme>;
  TempDir dir, swap;
  zero::Options options = options_for<Saved>();
  options.nvme.directory = swap.path.string();
  const auto hyper = zero::test::test_hyper<zero::optim::AdamW>();
  std::vector<float> saved_masters, saved_params;
  {
    zero::comm::LocalGroup group(3);
    group.run([&](zero::comm::Local& c) {
      Saved opt(c, hyper, options);
      build(opt, true);
      train_steps(opt, c.rank(), 1, 3);
      opt.save((dir.path / "ckpt").string());
      const Final f = final_state(opt);
      if (c.rank() == 0) {
        saved_masters = unpadded(opt.layout(), f.masters);
        saved_params = unpadded(opt.layout(), f.params);
      }
    });
  }
  auto check_loaded = [&](auto tag, int ranks, bool fp32) {
    using Opt = typename decltype(tag)::type;
    std::vector<std::vector<float>> masters(static_cast<std::size_t>(ranks)), params(masters.size());
    zero::comm::LocalGroup group(ranks);
    group.run([&](zero::comm::Local& c) {
      Opt opt(c, hyper, options);
      build(opt, false);
      opt.load((dir.path / "ckpt").string());
      const Final f = final_state(opt);
      masters[static_cast<std::size_t>(c.rank())] = unpadded(opt.layout(), f.masters);
      params[static_cast<std::size_t>(c.rank())] = unpadded(opt.layout(), f.params);
      train_steps(opt, c.rank(), 4, 4);  // and it trains on
    });
    for (int r = 0; r < ranks; ++r) {
      INFO(ranks << " rank(s), rank " << r);
      CHECK(masters[static_cast<std::size_t>(r)] == saved_masters);
      // The 16-bit copy is the saved one, or (fp32) the master itself.
      CHECK(params[static_cast<std::size_t>(r)] == (fp32 ? saved_masters : saved_params));
    }
  };
  check_loaded(std::type_identity<zero::ZeroOptimizer<Mixed<bf16>, zero::optim::AdamW, zero::stage<3>>>{}, 2, false);
  check_loaded(std::type_identity<zero::ZeroOptimizer<Mixed<bf16>, zero::optim::AdamW, zero::stage<0>>>{}, 1, false);
  check_loaded(std::type_identity<zero::ZeroOptimizer<Full<float>, zero::optim::AdamW, zero::stage<1>>>{}, 4, true);
}

TEST_CASE("loading into another optimizer is an error on every rank", "[checkpoint][errors]") {
  TempDir dir;
  const zero::Options options;
  std::vector<std::string> errors(2);
  zero::comm::LocalGroup group(2);
  group.run([&](zero::comm::Local& c) {
    {
      zero::ZeroOptimizer<Mixed<bf16>, zero::optim::AdamW, zero::stage<2>> opt(
          c, zero::test::test_hyper<zero::optim::AdamW>(), options);
      build(opt, true);
      opt.save(dir.path.string() + "/a");
    }
    zero::ZeroOptimizer<Mixed<bf16>, zero::optim::Sgd, zero::stage<2>> other(
        c, zero::test::test_hyper<zero::optim::Sgd>(), options);
    build(other, false);
    try {
      other.load(dir.path.string() + "/a");
    } catch (const zero::Error& e) {
      errors[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  for (const auto& e : errors) CHECK_THAT(e, Catch::Contains("adamw") && Catch::Contains("sgd"));
}
