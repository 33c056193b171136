// Why: a resume that restores the master but not the parameters forward
// reads trains on wrong values with no error, while gather_masters() looks
// right (an fp32 disk-tier resume did exactly that). So every precision x
// stage x offload tier saves after 4 steps, resumes in a fresh optimizer that
// was given no values (everything must come from the checkpoint), and must
// then (a) read in forward exactly what the saved run read at the save and
// (b) end 3 steps later bit for bit where the uninterrupted run ends: masters,
// 16-bit copies, forward parameters, step count and loss scale.
//
// Four placements of the state, each its own test case (tagged [none],
// [cpu], [nvme_host], [nvme_device]; meson.build runs each as a test of its
// own, side by side); their engines are the build's, compiled once:
//   none         offload::None on backend::Host
//   cpu          offload::Cpu  on a device backend (test::LateCopies: late async copies)
//   nvme_host    offload::Nvme on backend::Host
//   nvme_device  offload::Nvme on a device backend (test::LateCopies)
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

template <class... Lists>
struct Concat;
template <class... A, class... B, class... C>
struct Concat<std::tuple<A...>, std::tuple<B...>, std::tuple<C...>> {
  using type = std::tuple<A..., B..., C...>;
};

// Every precision at stages FirstStage..3 (offload needs a partition: stage 1 or higher).
template <class Tier, class Backend, int FirstStage>
struct Placement {
  template <class P, int S>
  using Opt = zero::ZeroOptimizer<P, AdamW, zero::stage<S>, Tier, Backend>;
  template <class P>
  using Stages = std::conditional_t<FirstStage == 0, std::tuple<Opt<P, 0>, Opt<P, 1>, Opt<P, 2>, Opt<P, 3>>,
                                    std::tuple<Opt<P, 1>, Opt<P, 2>, Opt<P, 3>>>;
  using Configs = typename Concat<Stages<Full<float>>, Stages<Mixed<bf16>>, Stages<Mixed<fp16>>>::type;
};
using NoneOnHost = Placement<zero::offload::None, zero::backend::Host, 0>::Configs;
using CpuOnDevice = Placement<zero::offload::Cpu, zero::backend::LateCopies, 1>::Configs;
using NvmeOnHost = Placement<zero::offload::Nvme, zero::backend::Host, 1>::Configs;
using NvmeOnDevice = Placement<zero::offload::Nvme, zero::backend::LateCopies, 1>::Configs;

struct RankResult {
  std::vector<float> forward_at_save, masters_at_save;  // the saved run, right after the save
  std::vector<float> forward_loaded, masters_loaded;    // the fresh optimizer, right after the load
  Final end;                                            // after 3 more steps
  std::vector<float> forward_end;
};

}  // namespace

namespace {

// `saved_params`, `resumed_params`: where each run keeps stage 3's
// parameter shards (Options::param_place).
template <class O>
void check_resume(zero::ParamPlace saved_params = zero::ParamPlace::device,
                  zero::ParamPlace resumed_params = zero::ParamPlace::device) {
  const int ranks = 2;
  TempDir dir, swap_saved, swap_resumed;
  const auto hyper = zero::test::test_hyper<AdamW>();
  zero::Options saved_options = options_for<O>(), resumed_options = saved_options;
  saved_options.param_place = saved_params;
  resumed_options.param_place = resumed_params;
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
    INFO("stage " << O::stage << ", " << O::offload_policy::name << " on " << O::backend_policy::name << ", precision "
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

}  // namespace

TEMPLATE_LIST_TEST_CASE("every precision and stage resumes bit for bit: offload::None on the host",
                        "[checkpoint][resume][matrix][none]", NoneOnHost) {
  check_resume<TestType>();
}
TEMPLATE_LIST_TEST_CASE("every precision and stage resumes bit for bit: offload::Cpu on a device backend",
                        "[checkpoint][resume][matrix][cpu]", CpuOnDevice) {
  check_resume<TestType>();
}
TEMPLATE_LIST_TEST_CASE("every precision and stage resumes bit for bit: offload::Nvme on the host",
                        "[checkpoint][resume][matrix][nvme_host]", NvmeOnHost) {
  check_resume<TestType>();
}
// Stage 3 with its parameter shards on disk (Options::param_place = disk): saved
// from the file and loaded into it, and across placements both ways.
using NvmeStage3 = std::tuple<Placement<zero::offload::Nvme, zero::backend::Host, 1>::Opt<Full<float>, 3>,
                              Placement<zero::offload::Nvme, zero::backend::Host, 1>::Opt<Mixed<bf16>, 3>,
                              Placement<zero::offload::Nvme, zero::backend::Host, 1>::Opt<Mixed<fp16>, 3>>;
TEMPLATE_LIST_TEST_CASE("stage 3 resumes bit for bit with its parameter shards on disk, and across placements",
                        "[checkpoint][resume][matrix][params_disk]", NvmeStage3) {
  using zero::ParamPlace;
  SECTION("disk to disk") { check_resume<TestType>(ParamPlace::disk, ParamPlace::disk); }
  SECTION("disk to device") { check_resume<TestType>(ParamPlace::disk, ParamPlace::device); }
  SECTION("device to disk") { check_resume<TestType>(ParamPlace::device, ParamPlace::disk); }
}
TEMPLATE_LIST_TEST_CASE("every precision and stage resumes bit for bit: offload::Nvme on a device backend",
                        "[checkpoint][resume][matrix][nvme_device]", NvmeOnDevice) {
  check_resume<TestType>();
}
