#!/usr/bin/env python3
"""PyTorch's CPU AdamW beside zero's host fused step, on the same parameter
count, in the same run, with the same number of threads.

    /usr/bin/python3 bench/torch_cpu_adamw.py [--n 67108864] [--bench build/bench/bench_step_host]

Prints one line per configuration and the speed-up of zero over torch
(torch seconds per step / zero seconds per step). With --json, JSON lines.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def torch_step_seconds(n, reps, threads, foreach):
    import torch

    torch.set_num_threads(threads)
    p = torch.nn.Parameter(torch.full((n,), 0.5))
    p.grad = torch.full((n,), 0.01)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=1e-2, foreach=foreach)
    opt.step()  # warm-up: allocates exp_avg / exp_avg_sq
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), torch.__version__


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=64 << 20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bench", default=os.path.join("build", "bench", "bench_step_host"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not os.path.exists(args.bench):
        sys.exit(f"{args.bench} not found: build it first with `meson setup build && ninja -C build bench/bench_step_host`, "
                 "or pass --bench PATH")
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("PyTorch is not installed: apt-get install python3-torch, and run this with /usr/bin/python3")
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count()))

    out = subprocess.run([args.bench, "--n", str(args.n), "--reps", str(args.reps), "--json"],
                         check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    zero = {}
    for line in out.stdout.splitlines():
        rec = json.loads(line)
        zero[rec["config"]] = rec

    rows = []
    for foreach in (False, True):
        t, version = torch_step_seconds(args.n, args.reps, threads, foreach)
        label = f"torch {version} AdamW fp32 (foreach={foreach})"
        for cfg in ("fp32_adamw", "bf16_mixed_adamw"):
            z = zero[cfg]
            rows.append({"bench": "torch_cpu_adamw", "n": args.n, "threads": threads, "torch": label,
                         "torch_seconds": t, "zero_config": cfg, "zero_seconds": z["seconds"],
                         "zero_ratio_to_probe": z["ratio_to_probe"], "speedup_vs_torch": t / z["seconds"]})
    for r in rows:
        if args.json:
            print(json.dumps(r))
        else:
            print(f"{r['torch']:<42} {r['torch_seconds']*1e3:8.1f} ms/step | zero {r['zero_config']:<17} "
                  f"{r['zero_seconds']*1e3:7.1f} ms/step (ratio to probe {r['zero_ratio_to_probe']:.3f}) | "
                  f"speed-up {r['speedup_vs_torch']:.1f}x  [n={r['n']}, {r['threads']} threads]")


if __name__ == "__main__":
    main()
