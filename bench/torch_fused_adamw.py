#!/usr/bin/env python3
"""PyTorch's CUDA optimizers on the same parameter counts as bench_step_cuda,
timed with CUDA events: the peers for zero's fused step (fp32 AdamW, bf16
AdamW, SGD with momentum), each as fused=True and foreach=True.

    python3 bench/torch_fused_adamw.py [--n 64M] [--reps 20] [--trials 5] [--json]

One flat parameter of n elements (zero steps a flat shard, too). Prints one
line per measurement, with --json one JSON object per line. Bytes per
parameter count torch's own access pattern: with bf16 parameters torch keeps
its state in bf16 and has no fp32 master, so it moves 14 bytes per parameter
against zero's 28 for bf16-mixed AdamW (fp32 master, m, v + bf16 grad and
copy); compare parameters/s for speed and bytes/s for bandwidth use.
Exits 77 (skip) when PyTorch or a CUDA device is missing.
"""
import argparse
import json
import statistics
import sys


def parse_count(text):
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower()
    if t and t[-1] in scale:
        return int(float(t[:-1]) * scale[t[-1]])
    return int(t)


def measure(torch, kind, dtype, impl, n, reps, trials):
    dev = torch.device("cuda")
    p = torch.nn.Parameter(torch.empty(n, device=dev, dtype=dtype).uniform_(-0.5, 0.5))
    p.grad = torch.empty(n, device=dev, dtype=dtype).uniform_(-0.01, 0.01)
    flag = {"fused": {"fused": True}, "foreach": {"foreach": True}}[impl]
    if kind == "adamw":
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=1e-2, **flag)
        state_slots = 2
    else:
        opt = torch.optim.SGD([p], lr=1e-2, momentum=0.9, **flag)
        state_slots = 1
    for _ in range(3):  # warm-up: allocates the state, compiles nothing further
        opt.step()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(trials):
        start.record()
        for _ in range(reps):
            opt.step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3 / reps)
    seconds = statistics.median(times)
    elem = torch.finfo(dtype).bits // 8
    # param read+write, grad read, each state slot read+write (state in the param dtype)
    bytes_per_param = elem * 2 + elem + state_slots * elem * 2
    del opt, p
    torch.cuda.empty_cache()
    return seconds, bytes_per_param


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=parse_count, default=64 << 20, help="parameters (K/M/G suffixes); default 64M")
    ap.add_argument("--reps", type=int, default=20, help="steps per timed run")
    ap.add_argument("--trials", type=int, default=5, help="timed runs; the median counts")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("SKIP: PyTorch is not installed", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device visible to PyTorch", file=sys.stderr)
        return 77

    name = torch.cuda.get_device_name(0)
    configs = [
        ("fp32_adamw", "adamw", torch.float32),
        ("bf16_adamw", "adamw", torch.bfloat16),
        ("fp32_sgd_momentum", "sgd", torch.float32),
    ]
    for label, kind, dtype in configs:
        for impl in ("fused", "foreach"):
            try:
                seconds, bpp = measure(torch, kind, dtype, impl, args.n, args.reps, args.trials)
            except (RuntimeError, TypeError, ValueError) as e:  # e.g. fused=True unsupported in this torch
                rec = {"bench": "torch_cuda_optim", "config": label, "impl": impl, "n": args.n, "error": str(e)}
                print(json.dumps(rec) if args.json else f"{label:<18} {impl:<8} failed: {e}")
                continue
            params_per_s = args.n / seconds
            rec = {
                "bench": "torch_cuda_optim", "config": label, "optimizer": kind, "impl": impl,
                "dtype": str(dtype).replace("torch.", ""), "n": args.n, "device": name, "torch": torch.__version__,
                "reps": args.reps, "trials": args.trials, "seconds": seconds, "params_per_s": params_per_s,
                "bytes_per_param": bpp, "gb_per_s": params_per_s * bpp / 1e9,
            }
            if args.json:
                print(json.dumps(rec))
            else:
                print(f"{label:<18} {impl:<8} n={args.n} {seconds * 1e3:8.3f} ms/step  {params_per_s:.3e} params/s  "
                      f"{rec['gb_per_s']:.1f} GB/s ({bpp} B/param)  [torch {torch.__version__}, {name}]")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
