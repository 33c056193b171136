// Equivalence: for every precision and optimizer, training with N in-process
// ranks gives the same parameters as one rank on the whole batch (masters
// within 1e-5 relative, low-precision copies within one ulp), with and
// without gradient accumulation and clipping. Both are held to a plain
// single-process reference that shares no engine code (engine_harness.hpp).
// One test case per ZeRO stage, tagged [stage0]..[stage3]: Meson runs each
// stage as its own test of this one executable (one compile instead of four:
// the reference, the harness and Catch2 are compiled once).
#include "engine_harness.hpp"

namespace {

template <class P, class O>
struct Config {
  using Precision = P;
  using Optimizer = O;
};

using Configs = std::tuple<
    Config<zero::precision::Full<float>, zero::optim::Adam>, Config<zero::precision::Full<float>, zero::optim::AdamW>,
    Config<zero::precision::Full<float>, zero::optim::Sgd>, Config<zero::precision::Mixed<zero::bf16>, zero::optim::Adam>,
    Config<zero::precision::Mixed<zero::bf16>, zero::optim::AdamW>,
    Config<zero::precision::Mixed<zero::bf16>, zero::optim::Sgd>, Config<zero::precision::Mixed<zero::fp16>, zero::optim::Adam>,
    Config<zero::precision::Mixed<zero::fp16>, zero::optim::AdamW>,
    Config<zero::precision::Mixed<zero::fp16>, zero::optim::Sgd>>;

template <int S, class TestType>
void check_equivalence() {
  using Opt = zero::ZeroOptimizer<typename TestType::Precision, typename TestType::Optimizer,
                                  zero::stage<S>, zero::offload::None, zero::backend::Host>;
  const auto hyper = zero::test::test_hyper<typename TestType::Optimizer>();
  using zero::ReduceDType;
  using zero::test::one_unit_bucket;
  using zero::test::whole_model_bucket;
  const zero::test::Variant variants[] = {
      {"plain", 1, 0.0, ReduceDType::same_as_grad, whole_model_bucket},
      {"accumulate 3 + clip, one unit per bucket", 3, 0.05, ReduceDType::same_as_grad, one_unit_bucket},
      {"accumulate 2, reduce in fp32", 2, 0.0, ReduceDType::fp32, whole_model_bucket},
      {"reduce in fp32, one unit per bucket", 1, 0.0, ReduceDType::fp32, one_unit_bucket}};
  for (const int ranks : {1, 2, 3, 4, 7}) {
    for (const auto& v : variants) {
      INFO("ranks " << ranks << ", " << v.name);
      const zero::Options options = v.options();
      zero::test::TrainSpec spec;
      spec.steps = 5;
      spec.parts = ranks;
      const auto got = zero::test::train_local<Opt>(ranks, hyper, options, spec);

      const auto want = zero::test::reference_train<typename TestType::Precision, typename TestType::Optimizer>(
          ranks, hyper, options, spec.steps);
      // The same run on one engine rank with the whole batch.
      zero::Options single_options = options;
      single_options.gradient_divisor = static_cast<double>(ranks * v.accumulation);
      spec.sum_all_parts = true;
      const auto single = zero::test::train_local<Opt>(1, hyper, single_options, spec);

      REQUIRE(got.steps.size() == want.steps.size());
      for (std::size_t i = 0; i < got.steps.size(); ++i) {
        REQUIRE(got.steps[i].stepped);
        CHECK(got.steps[i].grad_norm == Approx(want.steps[i].grad_norm).epsilon(1e-9));
      }
      zero::test::require_equivalent<typename Opt::param_type>(single, want);
      zero::test::require_equivalent<typename Opt::param_type>(got, want);
      // Training moved the parameters (two runs that both ignored the
      // gradients would agree too).
      std::size_t moved = 0, k = 0;
      const auto& model = zero::test::test_model();
      for (std::size_t p = 0; p < model.size(); ++p)
        for (std::size_t i = 0; i < model[p].numel; ++i, ++k) moved += got.masters[k] != zero::test::init_value(p, i);
      CHECK(moved > k * 9 / 10);
    }
  }
}

}  // namespace

// One test case per stage, tagged [stage<S>] (Meson runs each as a test of its own).
#define ZERO_EQUIVALENCE_TEST(S)                                                                    \
  TEMPLATE_LIST_TEST_CASE("N ranks train exactly like one rank on the whole batch, stage " #S,    \
                          "[engine][equivalence][stage" #S "]", Configs) {                         \
    check_equivalence<S, TestType>();                                                               \
  }
ZERO_EQUIVALENCE_TEST(0)
ZERO_EQUIVALENCE_TEST(1)
ZERO_EQUIVALENCE_TEST(2)
ZERO_EQUIVALENCE_TEST(3)
