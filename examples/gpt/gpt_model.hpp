// Why this header exists: a GPT whose parameters the ZeRO optimizer owns, so
// the model here owns none. It is cut into units the way stage 3 gathers
// them: unit 0 the token and position embeddings, units 1..L the transformer
// blocks, unit L+1 the final LayerNorm. Forward and backward ask for a unit's
// parameters just before use and hand them back after, and announce each
// unit's finished gradient so stages 2 and 3 can reduce-scatter it while the
// rest of backward runs.
//
// The model: token + position embeddings; L pre-LayerNorm blocks
//   x = x + proj(attention(ln1(x))),  x = x + out(gelu(fc(ln2(x))))
// with causal multi-head self-attention and a 4x-wide tanh-GELU MLP; a final
// LayerNorm; logits = ln_f(x) wte^T (the output head tied to the token
// embedding); mean cross-entropy. Linear weights are stored as PyTorch's
// nn.Linear stores them ([out, in], row-major), so a state dict maps 1:1.
//
// Activations live in one arena sized at construction for the largest
// micro-batch: nothing is allocated per step. With activation checkpointing
// the arena keeps each block's input only, plus one block's worth of
// activations that backward recomputes block by block.
//
// GptModel<Compute> is the order of the computation, written once; Compute
// says how each step runs: HostCompute (gpt_host.hpp: OpenBLAS, OpenMP;
// gpt::Gpt) or CudaCompute (gpt_cuda.hpp: cuBLAS and kernels). Both call the
// per-row and per-element math of gpt_ops.hpp. Each rank thread uses its own
// model (the arena is per model). Parameter, gradient, token and logit
// pointers live where Compute computes (device memory for CUDA).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "zero/error.hpp"

namespace gpt {

struct Config {
  int vocab = 85;
  int context = 128;
  int width = 128;
  int heads = 4;
  int layers = 4;

  int head_size() const { return width / heads; }
  void validate() const {
    zero::require(vocab >= 2 && vocab <= 256, "GPT vocab is ", vocab, "; it must be in [2, 256] (byte tokens)");
    zero::require(context >= 1, "GPT --context is ", context, "; it must be >= 1");
    zero::require(layers >= 1, "GPT --layers is ", layers, "; it must be >= 1");
    zero::require(heads >= 1 && width >= 1 && width % heads == 0, "GPT --width ", width,
                  " is not a positive multiple of --heads ", heads);
  }
};

// The parameters of each kind of unit, in registration order.
enum EmbeddingParam : int { kTokenEmbedding, kPositionEmbedding, kEmbeddingParams };
enum BlockParam : int {
  kLn1Weight, kLn1Bias, kQkvWeight, kQkvBias, kAttnProjWeight, kAttnProjBias,
  kLn2Weight, kLn2Bias, kFcWeight, kFcBias, kMlpProjWeight, kMlpProjBias, kBlockParams
};
enum FinalParam : int { kLnfWeight, kLnfBias, kFinalParams };

struct ParamSpec {
  std::string name;
  std::size_t numel = 0;
  std::vector<std::uint64_t> shape;  // as PyTorch holds it (Linear weights [out, in])
};

// One unit's parameters and where each starts in the unit's flat buffer
// (packed by default; set_offsets() adopts the optimizer's padded layout).
struct UnitSpec {
  std::string name;
  std::vector<ParamSpec> params;
  std::vector<std::size_t> offsets;
  std::size_t numel = 0;  // the flat buffer's length, padding included
};

inline std::vector<UnitSpec> describe_units(const Config& c) {
  const auto C = static_cast<std::uint64_t>(c.width);
  auto param = [](std::string name, std::vector<std::uint64_t> shape) {
    std::size_t numel = 1;
    for (std::uint64_t d : shape) numel *= static_cast<std::size_t>(d);
    return ParamSpec{std::move(name), numel, std::move(shape)};
  };
  std::vector<UnitSpec> units;
  units.push_back({"embedding", {param("wte", {static_cast<std::uint64_t>(c.vocab), C}),
                                 param("wpe", {static_cast<std::uint64_t>(c.context), C})}, {}, 0});
  for (int l = 0; l < c.layers; ++l) {
    const std::string p = "h" + std::to_string(l) + ".";
    units.push_back({"block" + std::to_string(l),
                     {param(p + "ln_1.weight", {C}), param(p + "ln_1.bias", {C}),
                      param(p + "attn.c_attn.weight", {3 * C, C}), param(p + "attn.c_attn.bias", {3 * C}),
                      param(p + "attn.c_proj.weight", {C, C}), param(p + "attn.c_proj.bias", {C}),
                      param(p + "ln_2.weight", {C}), param(p + "ln_2.bias", {C}),
                      param(p + "mlp.c_fc.weight", {4 * C, C}), param(p + "mlp.c_fc.bias", {4 * C}),
                      param(p + "mlp.c_proj.weight", {C, 4 * C}), param(p + "mlp.c_proj.bias", {C})},
                     {}, 0});
  }
  units.push_back({"ln_f", {param("ln_f.weight", {C}), param("ln_f.bias", {C})}, {}, 0});
  for (UnitSpec& u : units) {
    for (const ParamSpec& p : u.params) {
      u.offsets.push_back(u.numel);
      u.numel += p.numel;
    }
  }
  return units;
}

// How a pass reaches unit u's parameters: acquire(u) returns the unit's flat
// buffer, valid until release(u) (which may be empty).
struct ParamHooks {
  std::function<const float*(int unit)> acquire;
  std::function<void(int unit)> release;
};

// Where backward writes unit u's gradient: buffer(u) returns the unit's flat
// gradient, which backward OVERWRITES; ready(u) follows once it is final.
// One unit at a time: buffer(u), writes, ready(u), then the next unit.
struct GradHooks {
  std::function<float*(int unit)> buffer;
  std::function<void(int unit)> ready;
};

// Bytes of the activation arena: what forward keeps for backward, and the
// temporaries of backward.
struct ActivationBytes {
  std::size_t saved = 0;
  std::size_t scratch = 0;
  std::size_t total() const { return saved + scratch; }
};

// A bump allocator over one float buffer. Without a base it only counts, so
// the same carving code sizes the arena and then hands it out.
class Arena {
 public:
  Arena() = default;
  Arena(float* base, std::size_t floats) : base_(base), capacity_(floats) {}
  float* take(std::size_t n) {
    n = (n + 15) / 16 * 16;  // 64-byte steps: rows of different buffers never share a cache line
    float* p = base_ != nullptr ? base_ + used_ : nullptr;
    used_ += n;
    zero::require(base_ == nullptr || used_ <= capacity_, "gpt::Arena: carved past its end (", used_, " > ",
                  capacity_, " floats)");
    return p;
  }
  std::size_t used_floats() const { return used_; }

 private:
  float* base_ = nullptr;
  std::size_t capacity_ = 0;
  std::size_t used_ = 0;
};

// torch-style normal initialisation from mt19937_64 (Box-Muller), so every
// rank and platform draws the same values from the same seed.
inline void fill_normal(float* out, std::size_t n, float stddev, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  auto uniform = [&gen] { return (static_cast<double>(gen() >> 11) + 0.5) * 0x1p-53; };  // (0, 1)
  for (std::size_t i = 0; i < n; ++i) {
    const double r = std::sqrt(-2.0 * std::log(uniform()));
    out[i] = static_cast<float>(stddev * r * std::cos(6.283185307179586 * uniform()));
  }
}

template <class Compute>
class GptModel {
 public:
  // Sized for micro-batches of up to max_batch sequences of config.context tokens.
  GptModel(const Config& config, int max_batch, bool checkpoint_activations, Compute compute = {})
      : cfg_(config), max_batch_(max_batch), checkpoint_(checkpoint_activations), units_(describe_units(config)),
        compute_(std::move(compute)) {
    cfg_.validate();
    zero::require(max_batch >= 1, "GPT micro-batch is ", max_batch, "; it must be >= 1");
    Arena counter;
    carve(counter);
    storage_ = Compute::allocate(counter.used_floats());
    Arena arena(storage_.data(), counter.used_floats());
    carve(arena);
  }
  GptModel(const GptModel&) = delete;
  GptModel& operator=(const GptModel&) = delete;

  const Config& config() const { return cfg_; }
  int max_batch() const { return max_batch_; }
  bool checkpointing() const { return checkpoint_; }
  const std::vector<UnitSpec>& units() const { return units_; }
  int num_units() const { return static_cast<int>(units_.size()); }
  static int block_unit(int layer) { return 1 + layer; }
  int final_unit() const { return cfg_.layers + 1; }
  std::size_t num_params() const {
    std::size_t n = 0;
    for (const UnitSpec& u : units_)
      for (const ParamSpec& p : u.params) n += p.numel;
    return n;
  }

  // Adopts a unit layout with gaps (the optimizer's: each parameter starts at
  // an aligned offset). `numel` is the unit's padded length.
  void set_layout(int unit, std::vector<std::size_t> offsets, std::size_t numel) {
    UnitSpec& u = units_.at(static_cast<std::size_t>(unit));
    zero::require(offsets.size() == u.params.size(), "Gpt::set_layout: unit '", u.name, "' has ", u.params.size(),
                  " parameters, got ", offsets.size(), " offsets");
    for (std::size_t k = 0; k < offsets.size(); ++k)
      zero::require(offsets[k] + u.params[k].numel <= numel && (k == 0 || offsets[k] >= offsets[k - 1] + u.params[k - 1].numel),
                    "Gpt::set_layout: parameter '", u.params[k].name, "' at offset ", offsets[k],
                    " overlaps another or leaves the unit of ", numel, " elements");
    u.offsets = std::move(offsets);
    u.numel = numel;
  }

  // GPT-2's initialisation of parameter k of unit u into `out` (its numel
  // values): weights and embeddings normal(0, 0.02), the projections back
  // into the residual stream 0.02 / sqrt(2 L), biases 0, LayerNorm weights 1.
  void init_param(int unit, int k, float* out, std::uint64_t seed) const {
    const UnitSpec& u = units_.at(static_cast<std::size_t>(unit));
    const std::size_t n = u.params.at(static_cast<std::size_t>(k)).numel;
    const std::uint64_t stream = seed * 1000003u + static_cast<std::uint64_t>(unit) * 64u + static_cast<std::uint64_t>(k);
    const bool block = unit >= 1 && unit <= cfg_.layers;
    const bool final = unit == final_unit();
    const bool ln_weight = (block && (k == kLn1Weight || k == kLn2Weight)) || (final && k == kLnfWeight);
    const bool residual_proj = block && (k == kAttnProjWeight || k == kMlpProjWeight);
    const bool matrix = unit == 0 || (block && (k == kQkvWeight || k == kAttnProjWeight || k == kFcWeight || k == kMlpProjWeight));
    if (ln_weight) {
      std::fill(out, out + n, 1.0f);
    } else if (matrix) {
      fill_normal(out, n, residual_proj ? 0.02f / std::sqrt(2.0f * static_cast<float>(cfg_.layers)) : 0.02f, stream);
    } else {
      std::fill(out, out + n, 0.0f);
    }
  }

  // Activation bytes measured from this model's arena.
  ActivationBytes activation_bytes() const { return bytes_; }
  // The same figure for another setting, from the same carving code.
  static ActivationBytes plan_activation_bytes(const Config& config, int max_batch, bool checkpoint_activations) {
    return GptModel(config, max_batch, checkpoint_activations, PlanOnly{}).bytes_;
  }

  // Token ids (and targets, or null) where Compute reads them (device memory
  // for CUDA), from stage(); at(s) is the batch that starts at sequence s.
  struct Tokens {
    const std::uint8_t* tokens = nullptr;
    const std::uint8_t* targets = nullptr;
    std::size_t context = 0;
    Tokens at(std::size_t sequence) const {
      return {tokens + sequence * context, targets != nullptr ? targets + sequence * context : nullptr, context};
    }
  };

  // Checks `sequences` x context token ids (and targets unless null) against
  // the vocabulary on the host and copies them where Compute reads them, in
  // one copy: several micro-batches take their slices with Tokens::at. Valid
  // until the next stage() (which the host-pointer passes below call).
  Tokens stage(const std::uint8_t* tokens, const std::uint8_t* targets, std::size_t sequences) {
    const std::size_t n = sequences * static_cast<std::size_t>(cfg_.context);
    check_ids(tokens, n, "token");
    if (targets != nullptr) check_ids(targets, n, "target");
    return {compute_.stage_tokens(tokens, n, 0), targets != nullptr ? compute_.stage_tokens(targets, n, 1) : nullptr,
            static_cast<std::size_t>(cfg_.context)};
  }

  // One forward and backward pass over the first `batch` sequences of staged
  // tokens. Adds the sum of their token losses to the total that
  // take_loss_sum() reads (no host wait here), and writes
  // grad_scale x d(sum of token losses)/d(params) into the gradients
  // (grad_scale = 1 / tokens for the mean loss, times fp16's loss scale).
  //
  // Hook order, L blocks, units E (embedding), 1..L, F (final LayerNorm):
  //   forward:  acquire/release E, 1, ..., L, F; acquire E (head)
  //   head:     loss, d(logits), head backward; release E
  //   backward: acquire F, buffer F, ready F, release F; then for l = L..1:
  //             acquire l, buffer l, ready l, release l; finally buffer E, ready E
  // (with checkpointing, "acquire l" is followed by recomputing block l).
  void forward_backward(const Tokens& in, int batch, const ParamHooks& params, const GradHooks& grads,
                        float grad_scale) {
    zero::require(static_cast<bool>(grads.buffer), "Gpt::forward_backward: GradHooks::buffer is empty");
    zero::require(in.targets != nullptr, "Gpt::forward_backward: the staged tokens have no targets");
    zero::require(std::isfinite(grad_scale) && grad_scale > 0.0f, "Gpt::forward_backward: grad_scale is ", grad_scale,
                  "; it must be positive and finite");
    const std::size_t N = rows(batch);
    forward_to_head(in.tokens, batch, params);
    const std::uint8_t* ids = in.tokens;
    const float* wte = acquire(params, 0) + units_[0].offsets[kTokenEmbedding];
    head_logits(wte, N);
    add_cross_entropy(in.targets, N, true, grad_scale);
    // Head backward: d(wte) from the head (added to the lookup's later),
    // d(ln_f output) = d(logits) wte.
    const int C = cfg_.width, V = cfg_.vocab, n = static_cast<int>(N);
    compute_.gemm(true, false, V, C, n, logits_, V, lnf_out_, C, head_wte_grad_, C);
    compute_.gemm(false, false, n, C, V, logits_, V, wte, C, dtmp_, C);
    release(params, 0);

    // Final LayerNorm.
    {
      const int u = final_unit();
      const float* p = acquire(params, u);
      float* g = grad_buffer(grads, u);
      const std::vector<std::size_t>& off = units_[static_cast<std::size_t>(u)].offsets;
      compute_.fill(dres_, N * static_cast<std::size_t>(C), 0.0f);
      compute_.layernorm_backward(dtmp_, inputs_[static_cast<std::size_t>(cfg_.layers)], p + off[kLnfWeight],
                                  lnf_mean_, lnf_rstd_, N, C, dres_, g + off[kLnfWeight], g + off[kLnfBias]);
      zero_gaps(u, g);
      if (grads.ready) grads.ready(u);
      release(params, u);
    }
    for (int l = cfg_.layers - 1; l >= 0; --l) {
      const int u = block_unit(l);
      const float* p = acquire(params, u);
      BlockActs& a = acts_for(l);
      if (checkpoint_) block_forward(p, units_[static_cast<std::size_t>(u)].offsets, a, batch);
      float* g = grad_buffer(grads, u);
      block_backward(p, units_[static_cast<std::size_t>(u)].offsets, a, batch, g);
      zero_gaps(u, g);
      if (grads.ready) grads.ready(u);
      release(params, u);
    }
    // Embeddings: the head's gradient plus the lookup's.
    {
      float* g = grad_buffer(grads, 0);
      const std::vector<std::size_t>& off = units_[0].offsets;
      float* dwte = g + off[kTokenEmbedding];
      float* dwpe = g + off[kPositionEmbedding];
      compute_.copy(dwte, head_wte_grad_, static_cast<std::size_t>(V) * C);
      compute_.fill(dwpe, static_cast<std::size_t>(cfg_.context) * C, 0.0f);
      compute_.embed_backward(ids, dres_, N, cfg_.context, C, dwte, dwpe);
      zero_gaps(0, g);
      if (grads.ready) grads.ready(0);
    }
  }

  // Forward only over the first `batch` staged sequences: logits() then holds
  // their logits (batch x context x vocab); with targets, the sum of their
  // token losses is added to take_loss_sum()'s total.
  void forward(const Tokens& in, int batch, const ParamHooks& params) {
    const std::size_t N = rows(batch);
    forward_to_head(in.tokens, batch, params);
    head_logits(acquire(params, 0) + units_[0].offsets[kTokenEmbedding], N);
    release(params, 0);
    if (in.targets != nullptr) add_cross_entropy(in.targets, N, false, 1.0f);
  }

  // The sum of the token losses of the passes since the last call, and the
  // rows they had (the one host wait of a step on a GPU).
  struct LossSum {
    double sum = 0.0;
    std::size_t tokens = 0;
    double mean() const { return tokens == 0 ? 0.0 : sum / static_cast<double>(tokens); }
  };
  LossSum take_loss_sum() {
    const LossSum taken{compute_.take_loss_sum(), loss_tokens_};
    loss_tokens_ = 0;
    return taken;
  }

  // The same passes on host token ids (batch x context each), staged here:
  // they return the mean loss over the batch's tokens themselves, so
  // take_loss_sum() must have read every pass before them.
  float forward_backward(const std::uint8_t* tokens, const std::uint8_t* targets, int batch, const ParamHooks& params,
                         const GradHooks& grads, float grad_scale) {
    require_no_untaken_loss("forward_backward");
    forward_backward(stage(tokens, targets, static_cast<std::size_t>(batch)), batch, params, grads, grad_scale);
    return static_cast<float>(take_loss_sum().mean());
  }
  // Forward only; targets may be null (no loss, 0 returned).
  float loss(const std::uint8_t* tokens, const std::uint8_t* targets, int batch, const ParamHooks& params) {
    require_no_untaken_loss("loss");
    forward(stage(tokens, targets, static_cast<std::size_t>(batch)), batch, params);
    return static_cast<float>(take_loss_sum().mean());
  }
  // Where Compute computes (device memory for CUDA).
  const float* logits() const { return logits_; }
  Compute& compute() { return compute_; }

 private:
  struct PlanOnly {};
  GptModel(const Config& config, int max_batch, bool checkpoint_activations, PlanOnly)
      : cfg_(config), max_batch_(max_batch), checkpoint_(checkpoint_activations), units_(describe_units(config)) {
    cfg_.validate();
    Arena counter;
    carve(counter);
  }

  // One block's activations; x_in and x_out belong to the residual stream.
  struct BlockActs {
    const float* x_in = nullptr;
    float* x_out = nullptr;
    float *ln1 = nullptr, *ln1_mean = nullptr, *ln1_rstd = nullptr;
    float* qkv = nullptr;
    float* att = nullptr;  // softmax probabilities, batch x heads x context x context
    float* y = nullptr;    // attention output before its projection
    float* x_mid = nullptr;
    float *ln2 = nullptr, *ln2_mean = nullptr, *ln2_rstd = nullptr;
    float* fc = nullptr;    // before GELU
    float* gelu = nullptr;  // after GELU
  };

  std::size_t rows(int batch) const {
    zero::require(batch >= 1 && batch <= max_batch_, "Gpt: batch ", batch, " is outside [1, ", max_batch_,
                  "], the micro-batch the model was sized for");
    return static_cast<std::size_t>(batch) * static_cast<std::size_t>(cfg_.context);
  }

  void carve_block(Arena& a, BlockActs& b) {
    const std::size_t N = static_cast<std::size_t>(max_batch_) * cfg_.context, C = cfg_.width;
    b.ln1 = a.take(N * C);
    b.ln1_mean = a.take(N);
    b.ln1_rstd = a.take(N);
    b.qkv = a.take(N * 3 * C);
    b.att = a.take(static_cast<std::size_t>(max_batch_) * cfg_.heads * cfg_.context * cfg_.context);
    b.y = a.take(N * C);
    b.x_mid = a.take(N * C);
    b.ln2 = a.take(N * C);
    b.ln2_mean = a.take(N);
    b.ln2_rstd = a.take(N);
    b.fc = a.take(N * 4 * C);
    b.gelu = a.take(N * 4 * C);
  }

  // Lays out every buffer; run once to count and once to hand out.
  void carve(Arena& a) {
    const std::size_t N = static_cast<std::size_t>(max_batch_) * cfg_.context, C = cfg_.width;
    const auto L = static_cast<std::size_t>(cfg_.layers);
    // Saved for backward: the residual stream at each block's input and after
    // the last block, the blocks' inner activations (one set when recomputed),
    // the final LayerNorm and the logits.
    inputs_.assign(L + 1, nullptr);
    for (std::size_t l = 0; l <= L; ++l) inputs_[l] = a.take(N * C);
    blocks_.assign(checkpoint_ ? 1 : L, BlockActs{});
    for (BlockActs& b : blocks_) carve_block(a, b);
    lnf_out_ = a.take(N * C);
    lnf_mean_ = a.take(N);
    lnf_rstd_ = a.take(N);
    logits_ = a.take(N * static_cast<std::size_t>(cfg_.vocab));
    bytes_.saved = a.used_floats() * sizeof(float);
    // Backward's temporaries.
    dres_ = a.take(N * C);
    dtmp_ = a.take(N * C);
    d4_ = a.take(N * 4 * C);
    dqkv_ = a.take(N * 3 * C);
    datt_ = a.take(static_cast<std::size_t>(max_batch_) * cfg_.heads * cfg_.context * cfg_.context);
    head_wte_grad_ = a.take(static_cast<std::size_t>(cfg_.vocab) * C);
    bytes_.scratch = a.used_floats() * sizeof(float) - bytes_.saved;
  }

  BlockActs& acts_for(int layer) {
    BlockActs& a = blocks_[checkpoint_ ? 0 : static_cast<std::size_t>(layer)];
    a.x_in = inputs_[static_cast<std::size_t>(layer)];
    a.x_out = inputs_[static_cast<std::size_t>(layer) + 1];
    return a;
  }

  static const float* acquire(const ParamHooks& params, int u) {
    const float* p = params.acquire(u);
    zero::require(p != nullptr, "Gpt: ParamHooks::acquire(", u, ") returned null");
    return p;
  }
  static void release(const ParamHooks& params, int u) {
    if (params.release) params.release(u);
  }
  static float* grad_buffer(const GradHooks& grads, int u) {
    float* g = grads.buffer(u);
    zero::require(g != nullptr, "Gpt: GradHooks::buffer(", u, ") returned null");
    return g;
  }
  // The unit's padding holds no gradient: zero it so the whole flat buffer is defined.
  void zero_gaps(int u, float* g) {
    const UnitSpec& s = units_[static_cast<std::size_t>(u)];
    std::size_t end = 0;
    for (std::size_t k = 0; k <= s.params.size(); ++k) {
      const std::size_t begin = k < s.params.size() ? s.offsets[k] : s.numel;
      if (begin > end) compute_.fill(g + end, begin - end, 0.0f);
      if (k < s.params.size()) end = s.offsets[k] + s.params[k].numel;
    }
  }


  // Checks the ids on the host, before they are staged.
  void check_ids(const std::uint8_t* ids, std::size_t N, const char* what) const {
    zero::require(ids != nullptr, "Gpt: ", what, " is null");
    for (std::size_t n = 0; n < N; ++n)
      zero::require(ids[n] < cfg_.vocab, "Gpt: ", what, " ", static_cast<int>(ids[n]), " at position ", n,
                    " is not below the vocabulary size ", cfg_.vocab);
  }

  // Embeddings, every block, the final LayerNorm on staged ids: lnf_out_
  // holds its output.
  void forward_to_head(const std::uint8_t* ids, int batch, const ParamHooks& params) {
    zero::require(static_cast<bool>(params.acquire), "Gpt: ParamHooks::acquire is empty");
    const std::size_t N = rows(batch);
    const int C = cfg_.width;
    {
      const float* p = acquire(params, 0);
      compute_.embed_forward(ids, p + units_[0].offsets[kTokenEmbedding], p + units_[0].offsets[kPositionEmbedding],
                             N, cfg_.context, C, inputs_[0]);
      release(params, 0);
    }
    for (int l = 0; l < cfg_.layers; ++l) {
      const int u = block_unit(l);
      const float* p = acquire(params, u);
      block_forward(p, units_[static_cast<std::size_t>(u)].offsets, acts_for(l), batch);
      release(params, u);
    }
    const int u = final_unit();
    const float* p = acquire(params, u);
    const std::vector<std::size_t>& off = units_[static_cast<std::size_t>(u)].offsets;
    compute_.layernorm_forward(inputs_[static_cast<std::size_t>(cfg_.layers)], p + off[kLnfWeight], p + off[kLnfBias],
                               N, C, lnf_out_, lnf_mean_, lnf_rstd_);
    release(params, u);
  }

  void head_logits(const float* wte, std::size_t N) {
    compute_.gemm(false, true, static_cast<int>(N), cfg_.vocab, cfg_.width, lnf_out_, cfg_.width, wte, cfg_.width,
                  logits_, cfg_.vocab);
  }

  // Adds the N rows' losses (of staged targets) to take_loss_sum()'s total;
  // with `backward`, logits_ becomes grad_scale x d(sum)/d(logits).
  void add_cross_entropy(const std::uint8_t* targets, std::size_t N, bool backward, float grad_scale) {
    compute_.cross_entropy(logits_, targets, N, cfg_.vocab, backward, grad_scale);
    loss_tokens_ += N;
  }
  void require_no_untaken_loss(const char* pass) const {
    zero::require(loss_tokens_ == 0, "Gpt::", pass, ": ", loss_tokens_,
                  " token losses of staged passes were not read; call take_loss_sum() first");
  }

  // out (N x O) = in (N x I) W^T + b, W as nn.Linear: O x I, plus the
  // residual stream (N x O) unless it is null; with gelu_out, also
  // gelu_out = gelu(out). A Compute with its own linear_forward (the host's:
  // all steps on a block of rows while the rows are in cache, one parallel
  // loop) runs it; otherwise the bias and residual are laid down first, the
  // product added to them, and GELU applied over the whole output.
  void linear_forward(const float* in, const float* w, const float* b, std::size_t N, int I, int O, float* out,
                      const float* residual = nullptr, float* gelu_out = nullptr) {
    if constexpr (requires { compute_.linear_forward(in, w, b, residual, N, I, O, out, gelu_out); }) {
      compute_.linear_forward(in, w, b, residual, N, I, O, out, gelu_out);
    } else {
      compute_.bias_rows(out, b, residual, N, O);
      compute_.gemm(false, true, static_cast<int>(N), O, I, in, I, w, I, out, O, /*accumulate=*/true);
      if (gelu_out != nullptr) compute_.gelu_forward(out, gelu_out, N * static_cast<std::size_t>(O));
    }
  }

  // dW = dout^T in, db = column sums of dout, din = dout W (all
  // overwritten). With gelu_in (the input of a GELU whose output `in` is),
  // din continues through the GELU: din = d(loss)/d(gelu_in). A Compute with
  // its own linear_backward (the host's: one parallel loop over blocks of
  // rows) runs it.
  void linear_backward(const float* dout, const float* in, const float* w, std::size_t N, int I, int O, float* dw,
                       float* db, float* din, const float* gelu_in = nullptr) {
    if constexpr (requires { compute_.linear_backward(dout, in, w, N, I, O, dw, db, din, gelu_in); }) {
      compute_.linear_backward(dout, in, w, N, I, O, dw, db, din, gelu_in);
    } else {
      compute_.gemm(true, false, O, I, static_cast<int>(N), dout, O, in, I, dw, I);
      compute_.column_sums(dout, N, O, db);
      compute_.gemm(false, false, static_cast<int>(N), I, O, dout, O, w, I, din, I);
      if (gelu_in != nullptr) compute_.gelu_backward(gelu_in, din, N * static_cast<std::size_t>(I));
    }
  }

  // Query, key and value of head h of sequence b inside qkv (rows of 3C), and
  // the head's slice of a C-wide row.
  std::size_t qkv_at(int b, int h) const {
    return static_cast<std::size_t>(b) * cfg_.context * 3 * cfg_.width + static_cast<std::size_t>(h) * cfg_.head_size();
  }
  std::size_t head_at(int b, int h) const {
    return static_cast<std::size_t>(b) * cfg_.context * cfg_.width + static_cast<std::size_t>(h) * cfg_.head_size();
  }
  std::size_t att_at(int b, int h) const {
    return (static_cast<std::size_t>(b) * cfg_.heads + h) * cfg_.context * cfg_.context;
  }

  // body(q0, q1) for each block of query rows [q0, q1) of causal attention:
  // those rows attend to keys [0, q1) only, so the products skip the blocks
  // above the diagonal (a little over half the work). Compute::causal_block()
  // says the rows per block: the host's many small products side by side
  // gain; 0 (CUDA, one product per head queued in order) takes the whole
  // context as one block, the square whose upper half the softmax zeroes.
  template <class Body>
  void for_each_query_block(const Body& body) const {
    const int T = cfg_.context;
    const int block = compute_.causal_block() > 0 ? std::min(compute_.causal_block(), T) : T;
    for (int q0 = 0; q0 < T; q0 += block) body(q0, std::min(T, q0 + block));
  }

  // Attention's three steps for every head h of every sequence b of the
  // batch: before(b, h), softmax(first, matrices) over `matrices` T x T
  // matrices from element `first` of the heads' matrices, after(b, h). The
  // heads are independent of each other. A Compute with parallel_for (the
  // host's OpenMP threads) runs the heads side by side, each head's three
  // steps together, while its matrix is in cache; otherwise (CUDA, one
  // stream) each step is queued for all heads in turn, the softmax as one
  // launch.
  template <class Before, class Softmax, class After>
  void attention_heads(int batch, const Before& before, const Softmax& softmax, const After& after) {
    const int H = cfg_.heads;
    auto head = [&](int i) {
      before(i / H, i % H);
      softmax(att_at(i / H, i % H), std::size_t{1});
      after(i / H, i % H);
    };
    if constexpr (requires { compute_.parallel_for(batch * H, head); }) {
      compute_.parallel_for(batch * H, head);
    } else {
      for (int i = 0; i < batch * H; ++i) before(i / H, i % H);
      softmax(std::size_t{0}, static_cast<std::size_t>(batch) * H);
      for (int i = 0; i < batch * H; ++i) after(i / H, i % H);
    }
  }

  // a.x_out = block(a.x_in).
  void block_forward(const float* p, const std::vector<std::size_t>& off, BlockActs& a, int batch) {
    const int C = cfg_.width, T = cfg_.context, hs = cfg_.head_size();
    const std::size_t N = rows(batch);
    compute_.layernorm_forward(a.x_in, p + off[kLn1Weight], p + off[kLn1Bias], N, C, a.ln1, a.ln1_mean, a.ln1_rstd);
    linear_forward(a.ln1, p + off[kQkvWeight], p + off[kQkvBias], N, C, 3 * C, a.qkv);
    // Scores q k^T, causal softmax of scores / sqrt(head size), then P v;
    // query rows [q0, q1) against keys [0, q1).
    const std::size_t row3 = 3 * static_cast<std::size_t>(C);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
    attention_heads(
        batch,
        [&](int b, int h) {
          const float* q = a.qkv + qkv_at(b, h);
          float* s = a.att + att_at(b, h);
          for_each_query_block([&](int q0, int q1) {
            compute_.gemm(false, true, q1 - q0, q1, hs, q + q0 * row3, 3 * C, q + C, 3 * C, s + q0 * T, T);
          });
        },
        [&](std::size_t first, std::size_t matrices) { compute_.causal_softmax(a.att + first, matrices, T, scale); },
        [&](int b, int h) {
          const float* s = a.att + att_at(b, h);
          for_each_query_block([&](int q0, int q1) {
            compute_.gemm(false, false, q1 - q0, hs, q1, s + q0 * T, T, a.qkv + qkv_at(b, h) + 2 * C, 3 * C,
                          a.y + head_at(b, h) + q0 * static_cast<std::size_t>(C), C);
          });
        });
    linear_forward(a.y, p + off[kAttnProjWeight], p + off[kAttnProjBias], N, C, C, a.x_mid, a.x_in);
    compute_.layernorm_forward(a.x_mid, p + off[kLn2Weight], p + off[kLn2Bias], N, C, a.ln2, a.ln2_mean, a.ln2_rstd);
    linear_forward(a.ln2, p + off[kFcWeight], p + off[kFcBias], N, C, 4 * C, a.fc, nullptr, a.gelu);
    linear_forward(a.gelu, p + off[kMlpProjWeight], p + off[kMlpProjBias], N, 4 * C, C, a.x_out, a.x_mid);
  }

  // dres_ holds d(loss)/d(a.x_out) and becomes d(loss)/d(a.x_in); g gets the
  // block's parameter gradients.
  void block_backward(const float* p, const std::vector<std::size_t>& off, const BlockActs& a, int batch, float* g) {
    const int C = cfg_.width, T = cfg_.context, hs = cfg_.head_size();
    const std::size_t N = rows(batch);
    // MLP: x_out = x_mid + proj(gelu(fc(ln2(x_mid)))).
    linear_backward(dres_, a.gelu, p + off[kMlpProjWeight], N, 4 * C, C, g + off[kMlpProjWeight], g + off[kMlpProjBias],
                    d4_, a.fc);
    linear_backward(d4_, a.ln2, p + off[kFcWeight], N, C, 4 * C, g + off[kFcWeight], g + off[kFcBias], dtmp_);
    compute_.layernorm_backward(dtmp_, a.x_mid, p + off[kLn2Weight], a.ln2_mean, a.ln2_rstd, N, C, dres_,
                                g + off[kLn2Weight], g + off[kLn2Bias]);
    // Attention: x_mid = x_in + proj(attention(ln1(x_in))); dtmp_ = d(attention output).
    linear_backward(dres_, a.y, p + off[kAttnProjWeight], N, C, C, g + off[kAttnProjWeight], g + off[kAttnProjBias],
                    dtmp_);
    // Per query block [q0, q1): its rows of dP and dq reach keys [0, q1).
    // The same range as a key block [k0, k1) = [q0, q1): its rows of dv and
    // dk gather from the queries [k0, T) that see those keys.
    const std::size_t row = static_cast<std::size_t>(C), row3 = 3 * row;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
    attention_heads(
        batch,
        [&](int b, int h) {
          const float* v = a.qkv + qkv_at(b, h) + 2 * C;
          const float* dy = dtmp_ + head_at(b, h);
          const float* P = a.att + att_at(b, h);
          float* dP = datt_ + att_at(b, h);
          float* dv = dqkv_ + qkv_at(b, h) + 2 * C;
          for_each_query_block([&](int q0, int q1) {
            compute_.gemm(false, true, q1 - q0, q1, hs, dy + q0 * row, C, v, 3 * C, dP + q0 * T, T);  // dP = dy v^T
            compute_.gemm(true, false, q1 - q0, hs, T - q0, P + q0 * T + q0, T, dy + q0 * row, C, dv + q0 * row3,
                          3 * C);  // dv = P^T dy
          });
        },
        [&](std::size_t first, std::size_t matrices) {
          compute_.causal_softmax_backward(a.att + first, datt_ + first, matrices, T, scale);
        },
        [&](int b, int h) {
          const float* q = a.qkv + qkv_at(b, h);
          const float* dS = datt_ + att_at(b, h);
          float* dq = dqkv_ + qkv_at(b, h);
          for_each_query_block([&](int q0, int q1) {
            compute_.gemm(false, false, q1 - q0, hs, q1, dS + q0 * T, T, q + C, 3 * C, dq + q0 * row3, 3 * C);  // dq = dS k
            compute_.gemm(true, false, q1 - q0, hs, T - q0, dS + q0 * T + q0, T, q + q0 * row3, 3 * C,
                          dq + C + q0 * row3, 3 * C);  // dk = dS^T q
          });
        });
    linear_backward(dqkv_, a.ln1, p + off[kQkvWeight], N, C, 3 * C, g + off[kQkvWeight], g + off[kQkvBias], dtmp_);
    compute_.layernorm_backward(dtmp_, a.x_in, p + off[kLn1Weight], a.ln1_mean, a.ln1_rstd, N, C, dres_,
                                g + off[kLn1Weight], g + off[kLn1Bias]);
  }

  Config cfg_;
  int max_batch_;
  bool checkpoint_;
  std::vector<UnitSpec> units_;
  Compute compute_;
  typename Compute::Buffer storage_;  // the arena
  ActivationBytes bytes_;
  std::size_t loss_tokens_ = 0;     // rows added to Compute's loss total since take_loss_sum()
  std::vector<float*> inputs_;      // residual stream: inputs_[l] enters block l, inputs_[L] leaves the last
  std::vector<BlockActs> blocks_;   // one per block, or one shared when recomputing
  float* lnf_out_ = nullptr;
  float *lnf_mean_ = nullptr, *lnf_rstd_ = nullptr;
  float* logits_ = nullptr;         // logits, then grad_scale x d(loss)/d(logits)
  float* dres_ = nullptr;           // d(loss)/d(residual stream)
  float* dtmp_ = nullptr;           // d(loss)/d(a LayerNorm output or the attention output)
  float* d4_ = nullptr;             // d(loss)/d(MLP hidden)
  float* dqkv_ = nullptr;
  float* datt_ = nullptr;
  float* head_wte_grad_ = nullptr;  // the output head's share of d(wte)
};

}  // namespace gpt
