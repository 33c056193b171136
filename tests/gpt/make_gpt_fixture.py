#!/usr/bin/python3
"""Writes gpt_fixture.bin: one batch through a tiny GPT in PyTorch 1.13, in
float64, as the reference test_gpt_model.cpp holds the C++ model to.

    /usr/bin/python3 tests/gpt/make_gpt_fixture.py   # rewrites tests/gpt/gpt_fixture.bin

Weights and tokens are not stored: both sides compute them from a formula
(splitmix64 of the parameter's index and the element's index, mapped to an
exact multiple of 2^-24, then scaled), so the fixture holds only what PyTorch
computed. Layout, little-endian:
    b"GPTFIX01"; int32 vocab, context, width, heads, layers, batch
    uint8 tokens[batch*context]; uint8 targets[batch*context]
    float64 loss
    float32 logits[batch*context*vocab]
    float32 gradient of each parameter, in registration order (torch_gpt.param_specs)
"""
import os
import struct
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_gpt  # noqa: E402

# A context of 40 spans two blocks of the host's causal attention (gpt_host.hpp:
# 32 query rows), the second one partial.
VOCAB, CONTEXT, WIDTH, HEADS, LAYERS, BATCH = 64, 40, 32, 2, 2, 2
MASK = (1 << 64) - 1


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def unit_uniform(stream, i):
    """In [-1, 1): an exact multiple of 2^-23."""
    u = (splitmix64((stream << 32) | i) >> 40) * 2.0 ** -24
    return 2.0 * u - 1.0


def offset_and_scale(name, shape):
    """The formula's centre and half-width for a parameter (as the C++ test)."""
    if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
        return 1.0, 0.2
    if name in ("wte", "wpe"):
        return 0.0, 0.5
    if name.endswith(".weight"):
        return 0.0, (3.0 / shape[1]) ** 0.5  # unit variance out of unit variance in
    return 0.0, 0.2  # biases


def formula_params():
    params = {}
    for k, (_, name, shape) in enumerate(torch_gpt.param_specs(VOCAB, CONTEXT, WIDTH, LAYERS)):
        centre, half = offset_and_scale(name, shape)
        n = 1
        for d in shape:
            n *= d
        values = [centre + half * unit_uniform(k + 1, i) for i in range(n)]
        # Rounded to float32 as the C++ side stores them, then computed in float64.
        params[name] = torch.tensor(values, dtype=torch.float32).to(torch.float64).view(shape).requires_grad_(True)
    return params


def formula_tokens(stream):
    return [splitmix64((stream << 40) | n) % VOCAB for n in range(BATCH * CONTEXT)]


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                  "gpt_fixture.bin")
    torch.manual_seed(0)
    params = formula_params()
    tokens = formula_tokens(1)
    targets = formula_tokens(2)
    tok = torch.tensor(tokens, dtype=torch.long).view(BATCH, CONTEXT)
    tgt = torch.tensor(targets, dtype=torch.long).view(BATCH, CONTEXT)
    logits, loss = torch_gpt.forward(params, tok, HEADS, tgt)
    loss.backward()
    with open(out_path, "wb") as f:
        f.write(b"GPTFIX01")
        f.write(struct.pack("<6i", VOCAB, CONTEXT, WIDTH, HEADS, LAYERS, BATCH))
        f.write(bytes(tokens))
        f.write(bytes(targets))
        f.write(struct.pack("<d", loss.item()))
        f.write(logits.detach().to(torch.float32).contiguous().numpy().tobytes())
        for _, name, _ in torch_gpt.param_specs(VOCAB, CONTEXT, WIDTH, LAYERS):
            f.write(params[name].grad.to(torch.float32).contiguous().numpy().tobytes())
    print(f"{out_path}: loss {loss.item():.9f}, {os.path.getsize(out_path)} bytes")


if __name__ == "__main__":
    main()
