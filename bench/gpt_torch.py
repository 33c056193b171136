#!/usr/bin/python3
"""Host speed of the GPT example beside PyTorch 1.13, side by side in one run.

    /usr/bin/python3 bench/gpt_torch.py --trainer build/examples/gpt_train [--steps 20] [--rounds 2]

Trains the same model (tests/gpt/torch_gpt.py: 4 layers, width 128, 4 heads,
context 128 on The Devil's Dictionary, AdamW, clipping at 1) on the same
global batch (32 windows of 128 characters = 4096 tokens per step) with:
  torch      PyTorch, one process, torch.set_num_threads(2)
  zero 1r s0 gpt_train --ranks 1 --stage 0 --micro-batch 32
  zero 4r s3 gpt_train --ranks 4 --stage 3 --micro-batch 8
alternating them for --rounds rounds (the machine's speed drifts), and prints
each one's tokens/s (median over rounds) and the ratios. PyTorch and the
trainer both use OpenBLAS; on CPUs OpenBLAS 0.3.21 does not recognise, both
get OPENBLAS_CORETYPE as the trainer sets it for itself
(examples/common/openblas_core.hpp). The trainer also sets
OMP_WAIT_POLICY=passive for itself where the environment sets no policy;
PyTorch keeps the environment's (run the script under OMP_WAIT_POLICY=passive
to give both the same; the summary line prints the policy PyTorch ran with).
"""
import argparse
import gzip
import os
import re
import statistics
import subprocess
import sys
import time


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


if "OPENBLAS_CORETYPE" not in os.environ:  # before torch loads OpenBLAS
    flags = cpu_flags()
    if "avx512f" in flags:
        os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"
    elif "avx2" in flags:
        os.environ["OPENBLAS_CORETYPE"] = "Haswell"

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpt"))
import torch_gpt  # noqa: E402

LAYERS, WIDTH, HEADS, CONTEXT, BATCH = 4, 128, 4, 128, 32
CORPUS = "/usr/share/dictd/devil.dict.dz"


def torch_tokens_per_s(text, steps, warmup=3):
    torch.manual_seed(1)
    alphabet = sorted(set(text))
    vocab = len(alphabet)
    ids = torch.tensor([alphabet.index(b) for b in text[: len(text) * 9 // 10]], dtype=torch.long)
    params = {}
    for unit, name, shape in torch_gpt.param_specs(vocab, CONTEXT, WIDTH, LAYERS):
        if name.endswith(("ln_1.weight", "ln_2.weight")) or name == "ln_f.weight":
            t = torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape) * 0.02
        params[name] = t.requires_grad_(True)
    opt = torch.optim.AdamW(params.values(), lr=3e-3)
    times = []
    for step in range(warmup + steps):
        starts = torch.randint(0, len(ids) - CONTEXT - 1, (BATCH,))
        x = torch.stack([ids[s:s + CONTEXT] for s in starts])
        y = torch.stack([ids[s + 1:s + CONTEXT + 1] for s in starts])
        t0 = time.perf_counter()
        _, loss = torch_gpt.forward(params, x, HEADS, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return BATCH * CONTEXT * len(times) / sum(times)


def zero_tokens_per_s(trainer, ranks, stage, steps):
    cmd = [trainer, "--ranks", str(ranks), "--stage", str(stage), "--micro-batch", str(BATCH // ranks),
           "--layers", str(LAYERS), "--width", str(WIDTH), "--heads", str(HEADS), "--context", str(CONTEXT),
           "--steps", str(steps), "--eval-every", str(steps), "--sample", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    m = re.search(r"^training: ([0-9.]+) s, ([0-9.]+) tokens/s, ([0-9.]+) ms/step", out, re.M)
    if not m:
        sys.exit("no 'training:' line in the trainer's output:\n" + out)
    return float(m.group(2)), float(m.group(3))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(2)
    text = gzip.open(CORPUS).read()
    runs = {"torch": [], "zero 1r s0": [], "zero 4r s3": []}
    ms = {"zero 1r s0": [], "zero 4r s3": []}
    for r in range(args.rounds):
        runs["torch"].append(torch_tokens_per_s(text, args.steps))
        for key, ranks, stage in (("zero 1r s0", 1, 0), ("zero 4r s3", 4, 3)):
            tps, step_ms = zero_tokens_per_s(args.trainer, ranks, stage, args.steps)
            runs[key].append(tps)
            ms[key].append(step_ms)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f} tokens/s" for k, v in runs.items()), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '')} "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')} torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {BATCH}x{CONTEXT} tokens/step, {args.steps} steps x {args.rounds} rounds")
    for k, v in med.items():
        print(f"{k:11s} {v:8.0f} tokens/s  ({v / med['torch']:.2f}x torch)")
    s0, s3 = statistics.median(ms["zero 1r s0"]), statistics.median(ms["zero 4r s3"])
    print(f"time per step: 4 ranks stage 3 {s3:.1f} ms / 1 rank stage 0 {s0:.1f} ms = {s3 / s0:.2f}")


if __name__ == "__main__":
    main()
