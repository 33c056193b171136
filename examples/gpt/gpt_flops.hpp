// Why: a GPU run of the GPT trainer reports model FLOPs utilisation (MFU),
// which needs two numbers the trainer cannot measure: the FLOPs a token
// costs (a formula of the model's shape) and the GPU's peak throughput (a
// datasheet figure). Both live here, apart from CUDA, so the host tests
// check them against hand-computed values.
#pragma once

#include <string>
#include <vector>

#include "gpt/gpt_model.hpp"

namespace gpt {

// Training FLOPs per token, as PaLM (Chowdhery et al. 2022, appendix B) and
// nanoGPT's estimate_mfu define them:
//
//   flops/token = 6 N + 12 L C T
//
// N: the parameters that take part in matrix products, i.e. all of them
// but the position embeddings (a lookup); the token embedding counts once,
// as the output head it is tied to. 6 N: 2 N multiply-adds forward, twice
// that backward. 12 L C T: attention's scores and weighted sum, q k^T and
// P v over the whole T x T matrix (the causal half is not discounted), 2 x 2
// x C x T per token and layer forward, times 3 with backward. Recomputation
// (activation checkpointing) is not counted: MFU counts the model's FLOPs,
// not the hardware's.
inline double flops_per_token(const Config& c) {
  double n = 0.0;
  for (const UnitSpec& u : describe_units(c))
    for (const ParamSpec& p : u.params) n += static_cast<double>(p.numel);
  n -= static_cast<double>(c.context) * c.width;  // wpe
  return 6.0 * n + 12.0 * c.layers * static_cast<double>(c.width) * c.context;
}

// A GPU's dense peak throughput in TFLOPS: fp32 on the CUDA cores (what this
// model's products run at: fp32, TF32 off) and bf16 on the tensor cores.
struct PeakThroughput {
  double fp32_tflops = 0.0;
  double bf16_tensor_tflops = 0.0;
  std::string source;  // which table row, or how it was estimated
};

// The datasheet figures (dense, boost clock) for the GPU named `device_name`
// (cudaDeviceProp::name); otherwise an estimate from the SM count, the SM
// clock and the per-SM rates of its compute capability (Ampere 8.0: 64 fp32
// lanes and 1024 bf16 tensor FMAs per clock; Hopper 9.0: 128 and 2048), or
// zeros when the architecture is not one of those.
inline PeakThroughput peak_throughput(const std::string& device_name, int sms, double clock_ghz, int cc_major,
                                      int cc_minor) {
  struct Row {
    const char* match;  // a substring of the device name; the first row that matches wins
    double fp32, bf16;
    const char* label;
  };
  static const std::vector<Row> table = {
      {"H200 NVL", 60.0, 835.5, "H200 NVL datasheet"},
      {"H200", 66.9, 989.4, "H200 SXM datasheet"},
      {"H100 NVL", 60.0, 835.5, "H100 NVL datasheet"},
      {"H100 PCIe", 51.2, 756.5, "H100 PCIe datasheet"},
      {"H100", 66.9, 989.4, "H100 SXM datasheet"},
      {"A100", 19.5, 312.0, "A100 datasheet"},
  };
  for (const Row& r : table)
    if (device_name.find(r.match) != std::string::npos) return {r.fp32, r.bf16, r.label};
  double fp32_lanes = 0.0, tensor_fmas = 0.0;
  if (cc_major == 8 && cc_minor == 0) {
    fp32_lanes = 64.0;
    tensor_fmas = 1024.0;
  } else if (cc_major == 9 && cc_minor == 0) {
    fp32_lanes = 128.0;
    tensor_fmas = 2048.0;
  }
  const double per_sm_clock = static_cast<double>(sms) * clock_ghz * 1e9 * 2.0 / 1e12;  // 2 FLOPs per FMA
  return {per_sm_clock * fp32_lanes, per_sm_clock * tensor_fmas,
          fp32_lanes == 0.0 ? std::string("unknown GPU: pass --peak-tflops")
                            : "estimated from " + std::to_string(sms) + " SMs x " + std::to_string(clock_ghz) +
                                  " GHz (not in the table)"};
}

// Model FLOPs utilisation: achieved over peak (0 when the peak is unknown).
inline double mfu(double tokens_per_second, double flops_per_token, double peak_tflops) {
  return peak_tflops > 0.0 ? tokens_per_second * flops_per_token / (peak_tflops * 1e12) : 0.0;
}

}  // namespace gpt
