// Hyper-parameter validation (clear messages naming the field), the policy
// concept, and the per-element rules against a double-precision reference.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "zero/optim/adam.hpp"
#include "zero/optim/policy.hpp"
#include "zero/optim/sgd.hpp"

using zero::optim::Adam;
using zero::optim::AdamW;
using zero::optim::Sgd;

static_assert(zero::optim::Policy<Adam>);
static_assert(zero::optim::Policy<AdamW>);
static_assert(zero::optim::Policy<Sgd>);
static_assert(zero::optim::Policy<zero::optim::PlainSgd>);
struct NotAPolicy {};
static_assert(!zero::optim::Policy<NotAPolicy>);

TEST_CASE("Invalid Adam hyper-parameters are rejected with the field named", "[optim][policy]") {
  auto bad = [](auto mutate, const char* field) {
    Adam::Hyper h;
    mutate(h);
    REQUIRE_THROWS_AS(h.validate(), zero::InvalidArgument);
    REQUIRE_THROWS_WITH(h.validate(), Catch::Contains(field));
  };
  bad([](auto& h) { h.lr = -1e-3; }, "'lr'");
  bad([](auto& h) { h.lr = std::numeric_limits<double>::quiet_NaN(); }, "'lr'");
  bad([](auto& h) { h.beta1 = 1.0; }, "'beta1'");
  bad([](auto& h) { h.beta2 = -0.1; }, "'beta2'");
  bad([](auto& h) { h.eps = 0.0; }, "'eps'");
  bad([](auto& h) { h.weight_decay = -1.0; }, "'weight_decay'");
  Adam::Hyper ok;
  REQUIRE_NOTHROW(ok.validate());
  CHECK(AdamW::Hyper{}.weight_decay == Approx(0.01));  // torch.optim.AdamW default
  REQUIRE_THROWS_WITH(Adam::prepare(ok, 0), Catch::Contains("steps count from 1"));
}

TEST_CASE("Invalid SGD hyper-parameters are rejected with the field named", "[optim][policy]") {
  Sgd::Hyper h;
  h.lr = -1;
  REQUIRE_THROWS_WITH(h.validate(), Catch::Contains("'lr'"));
  h = {};
  h.dampening = 2;
  REQUIRE_THROWS_WITH(h.validate(), Catch::Contains("'dampening'"));
  h = {};
  h.nesterov = true;
  REQUIRE_THROWS_WITH(h.validate(), Catch::Contains("'nesterov'"));
  h.momentum = 0.9;
  REQUIRE_NOTHROW(h.validate());
}

TEST_CASE("Adam's per-element rule matches a double-precision reference", "[optim][policy]") {
  Adam::Hyper h;
  h.lr = 1e-2f;
  h.weight_decay = 0.1f;
  float w = 0.5f, st[2] = {0.0f, 0.0f};
  double wd = 0.5, m = 0, v = 0;
  for (int t = 1; t <= 50; ++t) {
    const float g = std::sin(0.3f * t) + 0.1f;
    Adam::update(Adam::prepare(h, t), w, g, st);
    const double gd = g + 0.1 * wd;
    m = 0.9 * m + 0.1 * gd;
    v = 0.999 * v + 0.001 * gd * gd;
    const double mhat_scale = 1.0 / (1 - std::pow(0.9, t));
    const double denom = std::sqrt(v) / std::sqrt(1 - std::pow(0.999, t)) + 1e-8;
    wd -= 1e-2 * mhat_scale * m / denom;
  }
  CHECK(w == Approx(wd).epsilon(1e-5));
}

TEST_CASE("AdamW decays the weight, Adam the gradient", "[optim][policy]") {
  // With a zero gradient, AdamW still shrinks the weight by (1 - lr*wd) on
  // step 1 and moves it no further; Adam's L2 term becomes a gradient.
  AdamW::Hyper h;
  h.lr = 0.1f;
  h.weight_decay = 0.5f;
  float w = 2.0f, st[2] = {0, 0};
  AdamW::update(AdamW::prepare(h, 1), w, 0.0f, st);
  CHECK(w == Approx(2.0f * (1 - 0.05f)));
  Adam::Hyper ha;
  ha.lr = 0.1f;
  ha.weight_decay = 0.5f;
  float wa = 2.0f, sa[2] = {0, 0};
  Adam::update(Adam::prepare(ha, 1), wa, 0.0f, sa);
  CHECK(wa == Approx(2.0f - 0.1f).epsilon(1e-4));  // first Adam step moves by ~lr
  CHECK(sa[0] != 0.0f);
}
