// Why: a GPT written the way a LibTorch user writes one, with torch::nn
// modules and autograd, knowing nothing of ZeRO except one seam: forward
// calls each unit (the token and position embeddings, each block, the final
// norm, the tied output layer) through `UnitCall`, which is the identity for
// plain training and zero::integrations::TorchModule::run for a model trained
// at stage 3 (the places FSDP wraps in Python). Character-level, on the
// corpus of examples/gpt/text_corpus.hpp.
#pragma once

#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>
#include <functional>
#include <string>

namespace torch_gpt {

struct GptShape {
  int vocab = 85;
  int context = 32;
  int width = 64;
  int heads = 2;
  int layers = 2;
};

// Runs one unit's forward f on x: `unit` names the module ("wte", "wpe",
// "blocks.0", ..., "ln_f"); `reads_params_in_backward` is false where f's
// backward needs no parameter values (an embedding lookup).
using UnitFn = std::function<torch::Tensor(torch::Tensor)>;
using UnitCall = std::function<torch::Tensor(const std::string& unit, torch::Tensor x, const UnitFn& f,
                                             bool reads_params_in_backward)>;
inline torch::Tensor plain_call(const std::string&, torch::Tensor x, const UnitFn& f, bool) { return f(x); }

// Pre-norm transformer block: causal self-attention and a 4x MLP.
struct BlockImpl : torch::nn::Module {
  BlockImpl(const GptShape& s)
      : heads(s.heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.width})))),
        qkv(register_module("qkv", torch::nn::Linear(s.width, 3 * s.width))),
        proj(register_module("proj", torch::nn::Linear(s.width, s.width))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.width})))),
        fc(register_module("fc", torch::nn::Linear(s.width, 4 * s.width))),
        out(register_module("out", torch::nn::Linear(4 * s.width, s.width))) {}

  torch::Tensor forward(torch::Tensor x) {
    const auto b = x.size(0), t = x.size(1), c = x.size(2), hs = c / heads;
    auto q_k_v = qkv(ln1(x)).view({b, t, 3, heads, hs}).permute({2, 0, 3, 1, 4});  // 3, B, H, T, hs
    auto att = torch::matmul(q_k_v[0], q_k_v[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(hs));
    const auto future = torch::ones({t, t}, torch::kBool).triu(1);
    att = torch::softmax(att.masked_fill(future, -INFINITY), -1);
    auto y = torch::matmul(att, q_k_v[2]).transpose(1, 2).reshape({b, t, c});
    x = x + proj(y);
    return x + out(torch::gelu(fc(ln2(x))));
  }

  int heads;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc, out;
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  explicit GptImpl(const GptShape& s)
      : shape(s),
        wte(register_module("wte", torch::nn::Embedding(s.vocab, s.width))),
        wpe(register_module("wpe", torch::nn::Embedding(s.context, s.width))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.width})))) {
    for (int l = 0; l < s.layers; ++l) blocks->push_back(Block(s));
    // GPT-2's initialisation, scaled down: N(0, 0.02), zero biases.
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters()) {
      if (p.key().find("ln") != std::string::npos) continue;
      if (p.key().ends_with(".bias"))
        p.value().zero_();
      else
        p.value().normal_(0.0, 0.02);
    }
  }

  // Token ids [B, T] -> logits [B, T, vocab]; the output layer is the token
  // embedding (tied), so "wte" is called at both ends of the pass.
  torch::Tensor forward(const torch::Tensor& idx, const UnitCall& call = plain_call) {
    const auto t = idx.size(1);
    const auto pos = torch::arange(t, torch::kLong);
    auto x = call("wte", idx, [&](torch::Tensor i) { return wte(i); }, false) +
             call("wpe", pos, [&](torch::Tensor i) { return wpe(i); }, false);
    for (std::size_t l = 0; l < blocks->size(); ++l) {
      auto block = blocks->ptr<BlockImpl>(l);
      x = call("blocks." + std::to_string(l), x, [&](torch::Tensor h) { return block->forward(h); }, true);
    }
    x = call("ln_f", x, [&](torch::Tensor h) { return ln_f(h); }, true);
    return call("wte", x, [&](torch::Tensor h) { return torch::nn::functional::linear(h, wte->weight); }, true);
  }

  // Mean cross-entropy of the next character.
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets, const UnitCall& call = plain_call) {
    const auto logits = forward(idx, call);
    return torch::nn::functional::cross_entropy(logits.reshape({-1, shape.vocab}), targets.reshape({-1}));
  }

  GptShape shape;
  torch::nn::Embedding wte, wpe;
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln_f;
};
TORCH_MODULE(Gpt);

}  // namespace torch_gpt
