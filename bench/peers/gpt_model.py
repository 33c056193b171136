"""The GPT of tests/gpt/torch_gpt.py (the model of examples/gpt/) as torch.nn
modules, for the peers that need modules: FSDP2 shards per module
(fully_shard on each block and on the root), DeepSpeed and torch.compile
take a module. The arithmetic is torch_gpt.forward's (token + position
embeddings, pre-LayerNorm blocks of causal attention and a 4x tanh-GELU MLP,
a final LayerNorm, the head tied to the token embedding, mean
cross-entropy); `attention="sdpa"` computes the same attention with
F.scaled_dot_product_attention (PyTorch 2.x's fused kernel). Runs on
PyTorch 1.13 too (with attention="matmul"), so that
tests/scripts/check_peers_harness.py can hold it to torch_gpt.forward with
Debian's PyTorch."""
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "gpt"))
import torch_gpt  # noqa: E402


class Block(nn.Module):
    def __init__(self, width, heads, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.ln_1 = nn.LayerNorm(width, eps=1e-5)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(width, 3 * width)
        self.attn.c_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width, eps=1e-5)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(width, 4 * width)
        self.mlp.c_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        hs = c // self.heads
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, hs).transpose(1, 2) for z in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
            y = att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        x = x + self.attn.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, vocab, context, width, heads, layers, attention="matmul"):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads, attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, eps=1e-5)

    def forward(self, tokens, targets, reduction="mean"):
        """The loss (mean or sum of the cross-entropy over every position)."""
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)

    @torch.no_grad()
    def init_gpt2(self, seed):
        """GPT-2's initialisation, as examples/gpt/gpt_model.hpp's init_param: embeddings and
        weight matrices normal(0, 0.02), the projections back into the residual stream
        0.02 / sqrt(2 L), biases 0, LayerNorm weights 1 (torch's generator, seeded: the same on
        every rank; the values differ from the C++ trainer's, the distribution does not)."""
        gen = torch.Generator().manual_seed(seed)
        layers = len(self.h)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.02 / math.sqrt(2 * layers)))
            elif name.endswith(".weight") and (name.startswith(("wte", "wpe")) or p.dim() == 2):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            elif ".ln_" in name or name.startswith("ln_f"):
                p.fill_(1.0 if name.endswith(".weight") else 0.0)
            else:
                p.zero_()


def torch_gpt_name(name):
    """This module's parameter name as torch_gpt.param_specs names it ("h.0.ln_1.weight" -> "h0.ln_1.weight")."""
    if name in ("wte.weight", "wpe.weight"):
        return name.split(".")[0]
    if name.startswith("h."):
        _, layer, rest = name.split(".", 2)
        return f"h{layer}.{rest}"
    return name


def check_names(model, vocab, context, width, layers):
    """The module's parameters are torch_gpt.param_specs', in the same order and shapes."""
    ours = [(torch_gpt_name(n), tuple(p.shape)) for n, p in model.named_parameters()]
    theirs = [(n, tuple(s)) for _, n, s in torch_gpt.param_specs(vocab, context, width, layers)]
    return ours == theirs, ours, theirs
