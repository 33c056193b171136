"""The GPT of examples/gpt/gpt_model.hpp in PyTorch 1.13, written from the same
description (not translated from the C++): token + position embeddings,
pre-LayerNorm blocks of causal multi-head self-attention and a 4x tanh-GELU
MLP, a final LayerNorm, the output head tied to the token embedding, mean
cross-entropy. Parameters are plain tensors named and ordered as the C++
model registers them (unit by unit), so a fixture's gradients line up with
the C++ units. Used by make_gpt_fixture.py and bench/gpt_torch.py."""
import math

import torch
import torch.nn.functional as F


def param_specs(vocab, context, width, layers):
    """[(unit, name, shape)] in the C++ registration order."""
    c = width
    specs = [("embedding", "wte", (vocab, c)), ("embedding", "wpe", (context, c))]
    for l in range(layers):
        u, p = f"block{l}", f"h{l}."
        specs += [(u, p + "ln_1.weight", (c,)), (u, p + "ln_1.bias", (c,)),
                  (u, p + "attn.c_attn.weight", (3 * c, c)), (u, p + "attn.c_attn.bias", (3 * c,)),
                  (u, p + "attn.c_proj.weight", (c, c)), (u, p + "attn.c_proj.bias", (c,)),
                  (u, p + "ln_2.weight", (c,)), (u, p + "ln_2.bias", (c,)),
                  (u, p + "mlp.c_fc.weight", (4 * c, c)), (u, p + "mlp.c_fc.bias", (4 * c,)),
                  (u, p + "mlp.c_proj.weight", (c, 4 * c)), (u, p + "mlp.c_proj.bias", (c,))]
    specs += [("ln_f", "ln_f.weight", (c,)), ("ln_f", "ln_f.bias", (c,))]
    return specs


def forward(params, tokens, heads, targets=None):
    """logits (batch, context, vocab) and, with targets, the mean loss."""
    wte, wpe = params["wte"], params["wpe"]
    b, t = tokens.shape
    c = wte.shape[1]
    hs = c // heads
    x = wte[tokens] + wpe[torch.arange(t)]
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    layers = sum(1 for k in params if k.endswith("ln_1.weight"))
    for l in range(layers):
        p = lambda n: params[f"h{l}.{n}"]
        h = F.layer_norm(x, (c,), p("ln_1.weight"), p("ln_1.bias"), eps=1e-5)
        q, k, v = F.linear(h, p("attn.c_attn.weight"), p("attn.c_attn.bias")).split(c, dim=2)
        q, k, v = (z.view(b, t, heads, hs).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + F.linear(y, p("attn.c_proj.weight"), p("attn.c_proj.bias"))
        h = F.layer_norm(x, (c,), p("ln_2.weight"), p("ln_2.bias"), eps=1e-5)
        h = F.gelu(F.linear(h, p("mlp.c_fc.weight"), p("mlp.c_fc.bias")), approximate="tanh")
        x = x + F.linear(h, p("mlp.c_proj.weight"), p("mlp.c_proj.bias"))
    x = F.layer_norm(x, (c,), params["ln_f.weight"], params["ln_f.bias"], eps=1e-5)
    logits = x @ wte.t()
    if targets is None:
        return logits, None
    return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
