#!/usr/bin/env python3
"""PyTorch's CPU AdamW beside zero's host fused step, on the same parameter
count, with the same number of threads, interleaved in one run so that the
machine's drift hits both alike (the fastest repetition of each is kept).

    /usr/bin/python3 bench/torch_cpu_adamw.py [--n 67108864] [--rounds 5] [--bench build/bench/bench_step_host] [--json]

Prints one line per pairing and the speed-up of zero over torch
(torch seconds per step / zero seconds per step).
"""
import argparse
import json
import os
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=64 << 20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bench", default=os.path.join("build", "bench", "bench_step_host"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not os.path.exists(args.bench):
        sys.exit(f"{args.bench} not found: build it first (meson setup build && ninja -C build bench/bench_step_host), "
                 "or pass --bench PATH")
    try:
        import torch
    except ImportError:
        sys.exit("PyTorch is not installed: apt-get install python3-torch, and run this with /usr/bin/python3")
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count()))
    torch.set_num_threads(threads)

    optimizers = {}
    for foreach in (False, True):
        p = torch.nn.Parameter(torch.full((args.n,), 0.5))
        p.grad = torch.full((args.n,), 0.01)
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=1e-2, foreach=foreach)
        opt.step()  # warm-up: allocates exp_avg / exp_avg_sq
        optimizers[foreach] = (p, opt)

    torch_best = {False: float("inf"), True: float("inf")}
    zero_best = {}
    for _ in range(args.rounds):
        for foreach, (_, opt) in optimizers.items():
            t0 = time.perf_counter()
            opt.step()
            torch_best[foreach] = min(torch_best[foreach], time.perf_counter() - t0)
        out = subprocess.run([args.bench, "--n", str(args.n), "--reps", "2", "--json"], check=True,
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        for line in out.stdout.splitlines():
            rec = json.loads(line)
            best = zero_best.get(rec["config"])
            if best is None or rec["seconds"] < best["seconds"]:
                zero_best[rec["config"]] = rec

    for foreach in (False, True):
        for cfg in ("fp32_adamw", "bf16_mixed_adamw"):
            z = zero_best[cfg]
            row = {"bench": "torch_cpu_adamw", "n": args.n, "threads": threads,
                   "torch": f"torch {torch.__version__} AdamW fp32 (foreach={foreach})",
                   "torch_seconds": torch_best[foreach], "zero_config": cfg, "zero_seconds": z["seconds"],
                   "zero_ratio_to_probe": z["ratio_to_probe"], "speedup_vs_torch": torch_best[foreach] / z["seconds"]}
            if args.json:
                print(json.dumps(row))
            else:
                print(f"{row['torch']:<42} {row['torch_seconds']*1e3:8.1f} ms/step | zero {cfg:<17} "
                      f"{row['zero_seconds']*1e3:7.1f} ms/step (ratio to probe {row['zero_ratio_to_probe']:.3f}) | "
                      f"speed-up {row['speedup_vs_torch']:.1f}x  [n={args.n}, {threads} threads, {args.rounds} rounds]")


if __name__ == "__main__":
    main()
