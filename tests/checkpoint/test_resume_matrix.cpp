// Why: a resume that restores the master but not the parameters forward
// reads trains on wrong values with no error, while gather_masters() looks
// right (an fp32 disk-tier resume did exactly that). So every precision x
// stage x offload tier saves after 4 steps, resumes in a fresh optimizer that
// was given no values (everything must come from the checkpoint), and must
// then (a) read in forward exactly what the saved run read at the save and
// (b) end 3 steps later bit for bit where the uninterrupted run ends: masters,
// 16-bit copies, forward parameters, step count and loss scale.
//
// One source, one executable per placement of the state (ZERO_TEST_PLACEMENT,
// set by meson.build), so the 39 optimizer types compile in parallel:
//   0  offload::None on backend::Host
//   1  offload::Cpu  on a device backend (test::LateCopies: late async copies)
//   2  offload::Nvme on backend::Host
//   3  offload::Nvme on a device backend (test::LateCopies)
#include <catch2/catch.hpp>

#include <string>
#include <tuple>
#include <vector>

#include "../engine/late_copies.hpp"
#include "optimizer_fixture.hpp"
#include "zero/checkpoint/optimizer_io.hpp"
#include "zero/offload/disk_state_store.hpp"
#include "zero/zero.hpp"

namespace {

using namespace zero::test::ckpt;
using zero::optim::AdamW;

#if ZERO_TEST_PLACEMENT == 0
using Tier = zero::offload::None;
using Backend = zero::backend::Host;
constexpr int kFirstStage = 0;
#elif ZERO_TEST_PLACEMENT == 1
using Tier = zero::offload::Cpu;
using Backend = zero::backend::LateCopies;
constexpr int kFirstStage = 1;  // offload needs a partition (stage 1 or higher)
#elif ZERO_TEST_PLACEMENT == 2
using Tier = zero::offload::Nvme;
using Backend = zero::backend::Host;
constexpr int kFirstStage = 1;
#elif ZERO_TEST_PLACEMENT == 3
using Tier = zero::offload::Nvme;
using Backend = zero::backend::LateCopies;
constexpr int kFirstStage = 1;
#else
#error "ZERO_TEST_PLACEMENT must be 0-3 (see the comment at the top)"
#endif

template <class P, int S>
using Opt = zero::ZeroOptimizer<P, AdamW, zero::stage<S>, Tier, Backend>;

// Every precision at stages kFirstStage..3.
template <class P>
using Stages = std::conditional_t<kFirstStage == 0, std::tuple<Opt<P, 0>, Opt<P, 1>, Opt<P, 2>, Opt<P, 3>>,
                                  std::tuple<Opt<P, 1>, Opt<P, 2>, Opt<P, 3>>>;
template <class... Lists>
struct Concat;
template <class... A, class... B, class... C>
struct Concat<std::tuple<A...>, std::tuple<B...>, std::tuple<C...>> {
  using type = std::tuple<A..., B..., C...>;
};
using Configs = Concat<Stages<Full<float>>, Stages<Mixed<bf16>>, Stages<Mixed<fp16>>>::type;

struct RankResult {
  std::vector<float> forward_at_save, masters_at_save;  // the saved run, right after the save
  std::vector<float> forward_loaded, masters_loaded;    // the fresh optimizer, right after the load
  Final end;                                            // after 3 more steps
  std::vector<float> forward_end;
};

}  // namespace

TEMPLATE_LIST_TEST_CASE("every precision, stage and tier resumes bit for bit, forward parameters included",
                        "[checkpoint][resume][matrix]", Configs) {
  using O = TestType;
  const int ranks = 2;
  TempDir dir, swap_saved, swap_resumed;
  const auto hyper = zero::test::test_hyper<AdamW>();
  zero::Options saved_options = options_for<O>(), resumed_options = saved_options;
  saved_options.nvme.directory = swap_saved.path.string();  // (only offload::Nvme reads it)
  resumed_options.nvme.directory = swap_resumed.path.string();
  std::vector<RankResult> uninterrupted(ranks), resumed(ranks);
  zero::comm::LocalGroup group(ranks);
  group.run([&](zero::comm::Local& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    {
      O opt(c, hyper, saved_options);
      build(opt, true);
      train_steps(opt, c.rank(), 1, 4);
      opt.save((dir.path / "step-4").string());
      uninterrupted[r].forward_at_save = forward_params(opt);
      uninterrupted[r].masters_at_save = final_state(opt).masters;
      train_steps(opt, c.rank(), 5, 7);
      uninterrupted[r].end = final_state(opt);
      uninterrupted[r].forward_end = forward_params(opt);
    }
    O fresh(c, hyper, resumed_options);
    build(fresh, false);  // no set_param: every value must come from the checkpoint
    fresh.load(dir.path.string());
    resumed[r].forward_loaded = forward_params(fresh);
    resumed[r].masters_loaded = final_state(fresh).masters;
    train_steps(fresh, c.rank(), 5, 7);
    resumed[r].end = final_state(fresh);
    resumed[r].forward_end = forward_params(fresh);
  });
  for (int r = 0; r < ranks; ++r) {
    INFO("stage " << O::stage << ", " << Tier::name << " on " << Backend::name << ", precision "
                  << zero::dtype_name(zero::dtype_traits<typename O::param_type>::dtype) << ", rank " << r);
    const RankResult &want = uninterrupted[static_cast<std::size_t>(r)], &got = resumed[static_cast<std::size_t>(r)];
    CHECK(got.masters_loaded == want.masters_at_save);
    CHECK(got.forward_loaded == want.forward_at_save);
    CHECK(got.end.masters == want.end.masters);
    CHECK(got.end.params == want.end.params);
    CHECK(got.forward_end == want.forward_end);
    CHECK(got.end.steps == want.end.steps);
    CHECK(got.end.loss_scale == want.end.loss_scale);
  }
}
