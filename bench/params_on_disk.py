#!/usr/bin/env python3
"""Parameters on demand, measured: the GPT trainer at stage 3 with its
parameter and gradient shards and its optimizer state on disk
(--param-place disk --offload nvme, bf16, activation checkpointing), one
rank, and the two limits its step time is held against, each measured in
the same run:

  GEMM limit  the step's matrix products (forward, the checkpointed
              forward again, backward's two products per forward one) at
              the rate this machine's BLAS gives those shapes: NumPy's
              float32 matmul on the same OpenBLAS (Debian's libblas.so.3),
              timed here;
  disk limit  the bytes a step moves (below) at the rates of a raw
              io_uring O_DIRECT probe of the same directory (bench_disk's
              probe: reads at its read rate, writes at its write rate).

Bytes a step moves, per parameter (P parameters, bf16, fp32 master and
Adam's moments): the state's records read and written (12 + 12 bytes), each
parameter shard read for the forward gather, for backward's and for the
update (2 + 2 + 2) and written once updated (2), each gradient shard written
by its reduction (2; per micro-batch) and read by the update (2): 20 bytes
read and 16 written (less where a shard is still in a page, as the units
backward used last are when the update starts).

The learning rate is small (2e-6) because Adam's first steps move every
weight by about the learning rate in the direction of its gradient's sign:
on 128 characters a step, a model this wide and deep diverges at 1e-5.

Also the run's peak resident memory (ru_maxrss through wait4) beside what
the engine's memory report holds in host memory plus the activations the
trainer reports (the planner's figure for this run: memory_report equals it
to the byte), and the peak's share of 16 bytes per parameter.

    bench/params_on_disk.py --trainer build/examples/gpt_train --bench-disk build/bench/bench_disk \\
        --dir DIR [--layers 56 --width 2048 --heads 16 --context 64 --micro-batch 2 --steps 3] [--json FILE]

DIR needs room for 16 bytes per parameter plus a 2 GiB probe file. Prints
one line per figure and, last, the step time as a ratio to the larger limit.
"""
import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time

CORPUS = "/usr/share/dictd/devil.dict.dz"


def gemm_seconds(shapes, reps=3):
    """Seconds of one pass of `shapes` [(m, k, n, count)], the best of `reps`."""
    import numpy as np
    rng = np.random.default_rng(1)
    total = 0.0
    for m, k, n, count in shapes:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        a @ b  # warm: OpenBLAS's buffers
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        total += best * count
    return total


def block_shapes(width, heads, context, windows):
    """One transformer block's forward matrix products as (m, k, n, count)."""
    tokens = windows * context
    hd = width // heads
    return [(tokens, width, 3 * width, 1), (tokens, width, width, 1), (tokens, width, 4 * width, 1),
            (tokens, 4 * width, width, 1),
            (context, hd, context, heads * windows), (context, context, hd, heads * windows)]


def probe_disk(bench_disk, directory):
    out = subprocess.run([bench_disk, "--dir", directory, "--bytes", "2G", "--reps", "2", "--json"],
                         capture_output=True, text=True, check=True).stdout
    row = json.loads(out[out.index("{"):])["rows"][0]
    return row["probe_read_GBps"], row["probe_write_GBps"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainer", required=True)
    ap.add_argument("--bench-disk", required=True)
    ap.add_argument("--dir", required=True, help="a directory on the disk to page to")
    ap.add_argument("--layers", type=int, default=56)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args()

    read_gbps, write_gbps = probe_disk(a.bench_disk, a.dir)
    print(f"disk probe ({a.dir}): read {read_gbps:.2f} GB/s, write {write_gbps:.2f} GB/s", flush=True)
    forward = gemm_seconds(block_shapes(a.width, a.heads, a.context, a.micro_batch))
    gemm_limit = a.layers * 4 * forward  # forward, recomputed forward, backward's two
    print(f"GEMM probe: one block's forward products {1e3 * forward:.1f} ms; the step's {4 * a.layers} block "
          f"passes {gemm_limit:.2f} s", flush=True)

    with tempfile.TemporaryDirectory(prefix="zero-bench-params-", dir=a.dir) as tmp:
        text = os.path.join(tmp, "devil.txt")
        with gzip.open(CORPUS, "rb") as f, open(text, "wb") as out:
            out.write(f.read(24000)[20000:])  # definitions; a short validation split: the step is measured
        nvme = os.path.join(tmp, "nvme")
        os.mkdir(nvme)
        cmd = [a.trainer, "--ranks", "1", "--stage", "3", "--precision", "bf16", "--offload", "nvme",
               "--param-place", "disk", "--nvme-dir", nvme, "--checkpoint-activations", "--layers", str(a.layers),
               "--width", str(a.width), "--heads", str(a.heads), "--context", str(a.context), "--micro-batch",
               str(a.micro_batch), "--steps", str(a.steps), "--eval-every", "1", "--warmup", "0", "--lr", "2e-6",
               "--min-lr", "2e-6", "--sample", "0", "--data", text, "--report"]
        print("$", " ".join(cmd), flush=True)
        t0 = time.time()
        log = os.path.join(tmp, "trainer.out")
        # Resident memory sampled each second, with the lines printed by
        # then: when the peak came (setup, a step, the evaluation).
        rss_peak = (0, 0.0, "")
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
            usage = None
            while usage is None:
                try:
                    with open(f"/proc/{proc.pid}/status") as st:
                        rss = next(int(l.split()[1]) * 1024 for l in st if l.startswith("VmRSS:"))
                except (OSError, StopIteration):
                    rss = 0
                if rss > rss_peak[0]:
                    with open(log) as o:
                        lines = [l for l in o.read().splitlines() if l.startswith(("step ", "training:"))]
                    rss_peak = (rss, time.time() - t0, lines[-1][:12] if lines else "setup")
                pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
                if pid:  # the trainer's own peak (not the probe's, another child)
                    usage, proc.returncode = ru, os.waitstatus_to_exitcode(status)
                else:
                    time.sleep(1.0)
        wall = time.time() - t0
        peak = usage.ru_maxrss * 1024
        with open(log) as f:
            out = f.read()
    print(out[-3000:])
    print(f"resident memory sampled each second: highest {rss_peak[0] / 2**30:.2f} GiB at {rss_peak[1]:.0f} s "
          f"(after: {rss_peak[2]})")
    if proc.returncode != 0:
        return 1
    params = int(re.search(r"vocab \d+: (\d+) parameters", out).group(1))
    ms_step = float(re.search(r"([0-9.]+) ms/step", out).group(1))
    train = [float(x) for x in re.findall(r"train_loss (\S+)", out)]
    memory = json.loads(next(line for line in out.splitlines() if line.startswith('{"report":"memory"')))
    activations = float(re.search(r"arena\): ([0-9.]+) MiB with checkpointing", out).group(1)) * 2**20
    host = sum(v.get("host", 0) for v in memory["placed"].values())
    predicted = host + activations
    disk_bytes = 36 * params
    disk_limit = 20 * params / (read_gbps * 1e9) + 16 * params / (write_gbps * 1e9)
    step = ms_step / 1e3
    figures = {
        "params": params, "bytes_16_per_param": 16 * params, "layers": a.layers, "width": a.width,
        "tokens_per_step": a.micro_batch * a.context, "train_loss": train, "step_seconds": step,
        "gemm_limit_seconds": gemm_limit, "disk_bytes_per_step": disk_bytes, "disk_limit_seconds": disk_limit,
        "probe_read_GBps": read_gbps, "probe_write_GBps": write_gbps, "peak_rss_bytes": peak,
        "predicted_host_bytes": predicted, "wall_seconds": wall,
        "step_lines": re.findall(r"^step \d+/\d+.*$", out, re.M),
        "step_over_larger_limit": step / max(gemm_limit, disk_limit),
        "rss_over_prediction": peak / predicted,
    }
    print(f"model: {params} parameters ({16 * params / 2**30:.1f} GiB at 16 bytes each), "
          f"{a.micro_batch * a.context} tokens per step; train_loss {train}")
    print(f"peak resident memory {peak / 2**30:.2f} GiB; the engine's host memory plus activations "
          f"{predicted / 2**30:.2f} GiB ({peak / predicted:.2f}x); 16 bytes per parameter are "
          f"{16 * params / peak:.1f}x the peak")
    print(f"step {step:.1f} s; GEMM limit {gemm_limit:.1f} s; disk limit {disk_limit:.1f} s "
          f"({disk_bytes / 1e9:.1f} GB); whole run {wall:.0f} s")
    print(f"step / larger limit = {step / max(gemm_limit, disk_limit):.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
