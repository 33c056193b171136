// The PyTorch fixture of the GPT tests (tests/gpt/make_gpt_fixture.py writes
// it): reading it, the weight formula both sides compute, and the error
// measure. Shared by the host test (Catch2) and the CUDA test (nvcc, its own
// harness), so it depends on neither.
//
// "Within 1e-5 relative" means, per tensor, max |ours - torch| <= 1e-5 x
// max |torch| (the error against the tensor's scale, so elements that cancel
// to near zero need no more digits than fp32 has); the loss is a scalar:
// |ours - torch| <= 1e-5 |torch|.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpt/gpt_model.hpp"

namespace gpt::fixture {

constexpr double kTolerance = 1e-5;

struct Fixture {
  Config config;
  int batch = 0;
  std::vector<std::uint8_t> tokens, targets;
  double loss = 0;
  std::vector<float> logits;
  std::vector<std::vector<std::vector<float>>> grads;  // [unit][param]
};

inline Fixture load(const char* path) {
  std::FILE* f = std::fopen(path, "rb");
  if (f == nullptr)
    throw std::runtime_error(std::string("cannot open the fixture ") + path +
                             " (regenerate: /usr/bin/python3 tests/gpt/make_gpt_fixture.py)");
  auto read = [&](auto* out, std::size_t n) {
    if (std::fread(out, sizeof *out, n, f) != n) {
      std::fclose(f);
      throw std::runtime_error(std::string("the fixture ") + path + " is truncated");
    }
  };
  Fixture x;
  char magic[8];
  read(magic, 8);
  if (std::memcmp(magic, "GPTFIX01", 8) != 0) {
    std::fclose(f);
    throw std::runtime_error(std::string(path) + " is not a GPTFIX01 fixture");
  }
  std::int32_t dims[6];
  read(dims, 6);
  x.config = Config{dims[0], dims[1], dims[2], dims[3], dims[4]};
  x.batch = dims[5];
  const std::size_t n = static_cast<std::size_t>(x.batch) * static_cast<std::size_t>(x.config.context);
  x.tokens.resize(n);
  x.targets.resize(n);
  read(x.tokens.data(), n);
  read(x.targets.data(), n);
  read(&x.loss, 1);
  x.logits.resize(n * static_cast<std::size_t>(x.config.vocab));
  read(x.logits.data(), x.logits.size());
  for (const UnitSpec& u : describe_units(x.config)) {
    x.grads.emplace_back();
    for (const ParamSpec& p : u.params) {
      x.grads.back().emplace_back(p.numel);
      read(x.grads.back().back().data(), p.numel);
    }
  }
  char extra;
  const bool trailing = std::fread(&extra, 1, 1, f) != 0;
  std::fclose(f);
  if (trailing) throw std::runtime_error(std::string("the fixture ") + path + " has data after the last gradient");
  return x;
}

// The fixture's weight formula (make_gpt_fixture.py: splitmix64, then centre
// and half-width by the parameter's kind).
inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  std::uint64_t z = x;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

inline void formula_values(const std::string& name, std::size_t numel, std::size_t fan_in, std::uint64_t stream, float* out) {
  double centre = 0.0, half = 0.2;  // biases
  if (ends_with(name, "ln_1.weight") || ends_with(name, "ln_2.weight") || name == "ln_f.weight") {
    centre = 1.0;
  } else if (name == "wte" || name == "wpe") {
    half = 0.5;
  } else if (ends_with(name, ".weight")) {
    half = std::sqrt(3.0 / static_cast<double>(fan_in));
  }
  for (std::size_t i = 0; i < numel; ++i) {
    const double u = static_cast<double>(splitmix64((stream << 32) | i) >> 40) * 0x1p-24;
    out[i] = static_cast<float>(centre + half * (2.0 * u - 1.0));
  }
}

// Writes parameter k of unit u (fixture weights) into out.
struct FormulaWeights {
  const Config& config;
  void operator()(int unit, int k, float* out) const {
    const auto units = describe_units(config);
    std::uint64_t stream = 1;  // parameters are numbered from 1 in registration order
    for (int v = 0; v < unit; ++v) stream += units[static_cast<std::size_t>(v)].params.size();
    stream += static_cast<std::uint64_t>(k);
    const ParamSpec& p = units[static_cast<std::size_t>(unit)].params[static_cast<std::size_t>(k)];
    // nn.Linear weights are [out, in]: fan-in is the row length. The MLP's
    // output projection reads 4 x width, every other matrix width.
    const bool wide_in = ends_with(p.name, "mlp.c_proj.weight");
    formula_values(p.name, p.numel, static_cast<std::size_t>(config.width) * (wide_in ? 4 : 1), stream, out);
  }
};

// max |a - b| / max |b| over a tensor; b, the reference, in float (PyTorch's
// fixtures) or double (host math).
template <class Reference>
double relative_error(const float* a, const Reference* b, std::size_t n) {
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return scale > 0.0 ? diff / scale : diff;
}

}  // namespace gpt::fixture
