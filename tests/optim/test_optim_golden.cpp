// Holds the fused step to PyTorch 1.13's torch.optim trajectories (24 steps,
// fixture made by tests/golden/gen_optim_golden.py), for every storage
// combination and every host instruction set. fp32: relative error <= 1e-6
// (the update rules round like ATen's portable kernels, so in practice the
// match is exact); mixed precision: the fp32 master matches and the
// low-precision copy equals the rounded master.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "zero/kernels/host_step.hpp"
#include "zero/optim/adam.hpp"
#include "zero/optim/sgd.hpp"

namespace {

struct GoldenCase {
  std::string name, optimizer;
  std::size_t n = 0;
  int steps = 0;
  std::map<std::string, double> hyper;
  std::vector<float> init;
  std::vector<std::vector<float>> grad, param, state0, state1;  // [step-1][i]
};

std::vector<float> parse_floats(std::istringstream& in) {
  std::vector<float> v;
  std::string tok;
  while (in >> tok) v.push_back(std::strtof(tok.c_str(), nullptr));
  return v;
}

std::vector<GoldenCase> load_golden() {
  const std::string path = std::string(ZERO_GOLDEN_DIR) + "/optim_golden.txt";
  std::ifstream file(path);
  REQUIRE(file.good());
  std::vector<GoldenCase> cases;
  std::string line;
  while (std::getline(file, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream in(line);
    std::string kind;
    in >> kind;
    if (kind == "case") {
      GoldenCase c;
      in >> c.name;
      std::string kv;
      while (in >> kv) {
        const auto eq = kv.find('=');
        const std::string key = kv.substr(0, eq), value = kv.substr(eq + 1);
        if (key == "optimizer")
          c.optimizer = value;
        else if (key == "n")
          c.n = std::stoul(value);
        else if (key == "steps")
          c.steps = std::stoi(value);
        else
          c.hyper[key] = std::strtod(value.c_str(), nullptr);
      }
      c.grad.resize(c.steps);
      c.param.resize(c.steps);
      c.state0.resize(c.steps);
      c.state1.resize(c.steps);
      cases.push_back(std::move(c));
    } else if (kind == "init") {
      cases.back().init = parse_floats(in);
    } else if (kind == "grad" || kind == "param" || kind == "state0" || kind == "state1") {
      int step;
      in >> step;
      GoldenCase& c = cases.back();
      auto& dst = kind == "grad" ? c.grad : kind == "param" ? c.param : kind == "state0" ? c.state0 : c.state1;
      dst.at(step - 1) = parse_floats(in);
    }
  }
  REQUIRE(cases.size() >= 9);
  return cases;
}

const std::vector<GoldenCase>& golden() {
  static const std::vector<GoldenCase> cases = load_golden();
  return cases;
}

// Largest |a-b| / max(|b|, floor) over the arrays; the floor keeps values that
// cross zero from dominating (an absolute error of 1e-12 near zero).
double max_rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double scale = std::max(std::fabs(static_cast<double>(b[i])), 1e-6);
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]) / scale);
  }
  return worst;
}

template <class Opt>
typename Opt::Hyper hyper_of(const GoldenCase& c) {
  typename Opt::Hyper h;
  h.lr = (c.hyper.at("lr"));
  h.weight_decay = (c.hyper.at("weight_decay"));
  if constexpr (requires { h.momentum; }) {  // Sgd and PlainSgd
    h.momentum = (c.hyper.at("momentum"));
    h.dampening = (c.hyper.at("dampening"));
    h.nesterov = c.hyper.at("nesterov") != 0.0;
  } else {
    h.beta1 = (c.hyper.at("beta1"));
    h.beta2 = (c.hyper.at("beta2"));
    h.eps = (c.hyper.at("eps"));
  }
  h.validate();
  return h;
}

// Runs one golden case with gradients stored as Grad (multiplied by
// loss_scale, which the step divides out) and a Param copy; checks every step.
template <class Opt, class Grad, class Param>
void run_case(const GoldenCase& c, float loss_scale) {
  INFO("case " << c.name << ", grad " << zero::dtype_traits<Grad>::name << ", param "
               << zero::dtype_traits<Param>::name << ", isa " << zero::simd::isa_name(zero::simd::active_isa()));
  const std::size_t n = c.n;
  std::vector<float> master = c.init;
  std::vector<std::vector<float>> state(Opt::state_slots, std::vector<float>(n, 0.0f));
  std::vector<Grad> grad(n);
  std::vector<Param> copy(n);
  const auto hyper = hyper_of<Opt>(c);

  zero::kernels::FusedStepArgs<Opt, Grad, Param> args;
  args.master = master.data();
  args.grad = grad.data();
  for (int k = 0; k < Opt::state_slots; ++k) args.state[k] = state[k].data();
  args.param = copy.data();
  args.n = n;
  args.grad_scale = 1.0f / loss_scale;

  for (int step = 1; step <= c.steps; ++step) {
    INFO("step " << step);
    for (std::size_t i = 0; i < n; ++i) {
      const float scaled = c.grad[step - 1][i] * loss_scale;
      grad[i] = zero::from_float<Grad>(scaled);
      REQUIRE(zero::to_float(grad[i]) == scaled);  // the fixture's gradients are exact in every type
    }
    args.scalars = Opt::prepare(hyper, step);
    zero::kernels::host_fused_step(args);

    CHECK(max_rel_error(master, c.param[step - 1]) <= 1e-6);
    if (Opt::state_slots >= 1 && !c.state0[step - 1].empty()) CHECK(max_rel_error(state[0], c.state0[step - 1]) <= 1e-6);
    if (Opt::state_slots >= 2 && !c.state1[step - 1].empty()) CHECK(max_rel_error(state[1], c.state1[step - 1]) <= 1e-6);
    if constexpr (!std::is_same_v<Param, float>) {
      std::size_t mismatched = 0;
      for (std::size_t i = 0; i < n; ++i) mismatched += !(copy[i] == zero::from_float<Param>(master[i]));
      CHECK(mismatched == 0);
    }
  }
}

template <class Opt>
void run_all_storage(const GoldenCase& c) {
  run_case<Opt, float, float>(c, 1.0f);
  run_case<Opt, zero::bf16, zero::bf16>(c, 1.0f);
  run_case<Opt, float, zero::bf16>(c, 1.0f);
  run_case<Opt, zero::fp16, zero::fp16>(c, 256.0f);  // fp16 mixed precision trains with a loss scale
}

void run_golden_case(const GoldenCase& c) {
  for (const auto isa : zero::simd::supported_isas()) {
    zero::simd::force_isa(isa);
    if (c.optimizer == "adam")
      run_all_storage<zero::optim::Adam>(c);
    else if (c.optimizer == "adamw")
      run_all_storage<zero::optim::AdamW>(c);
    else if (c.optimizer == "sgd") {
      run_all_storage<zero::optim::Sgd>(c);
      // Without momentum torch keeps no buffer, and PlainSgd no state slot: the same steps.
      if (c.hyper.at("momentum") == 0.0) run_all_storage<zero::optim::PlainSgd>(c);
    }
    else
      FAIL("unknown optimizer in fixture: " << c.optimizer);
  }
  zero::simd::force_isa(zero::simd::detect_isa_from_cpu());
}

}  // namespace

TEST_CASE("Adam and AdamW follow torch.optim trajectories", "[optim][golden]") {
  int seen = 0;
  for (const auto& c : golden())
    if (c.optimizer != "sgd") {
      SECTION(c.name) { run_golden_case(c); }
      ++seen;
    }
  CHECK(seen == 4);
}

TEST_CASE("SGD (momentum, dampening, Nesterov, weight decay) follows torch.optim.SGD", "[optim][golden]") {
  int seen = 0;
  for (const auto& c : golden())
    if (c.optimizer == "sgd") {
      SECTION(c.name) { run_golden_case(c); }
      ++seen;
    }
  CHECK(seen == 5);
}

TEST_CASE("The golden check can fail: a wrong hyper-parameter diverges", "[optim][golden]") {
  GoldenCase c = golden().front();
  c.hyper["beta2"] = 0.99;  // not what PyTorch used
  const auto hyper = hyper_of<zero::optim::Adam>(c);
  std::vector<float> master = c.init, m(c.n, 0.0f), v(c.n, 0.0f);
  zero::kernels::FusedStepArgs<zero::optim::Adam, float, float> args;
  args.master = master.data();
  args.grad = c.grad[0].data();
  args.state[0] = m.data();
  args.state[1] = v.data();
  args.n = c.n;
  for (int step = 1; step <= 3; ++step) {
    args.grad = c.grad[step - 1].data();
    args.scalars = zero::optim::Adam::prepare(hyper, step);
    zero::kernels::host_fused_step(args);
  }
  CHECK(max_rel_error(master, c.param[2]) > 1e-6);
}
