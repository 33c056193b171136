#!/usr/bin/python3
"""Host speed of the GPT example beside PyTorch 1.13, side by side in one run.

This measures Debian 12's PyTorch 1.13 (python3-torch), three years old, not
the PyTorch users run today. The comparison against PyTorch 2.x (eager and
torch.compile), FSDP2 and DeepSpeed ZeRO-3, on the same GPT and on the main
job, is bench/peers/run.sh; the README and docs/performance.md quote that
one. Its reason for two PyTorch runs (below) was measured on 1.13; for PyTorch
2.x, bench/peers/run.sh runs eager under both wait policies and takes the
faster as the peer.

    /usr/bin/python3 bench/gpt_torch.py --trainer build/examples/gpt_train [--steps 20] [--rounds 2] [--threads 2]

Trains the same model (tests/gpt/torch_gpt.py: 4 layers, width 128, 4 heads,
context 128 on The Devil's Dictionary, AdamW, clipping at 1) on the same
global batch (32 windows of 128 characters = 4096 tokens per step) with:
  torch default  PyTorch, one process, torch.set_num_threads(--threads), OpenMP's
                 wait policy as the environment leaves it (libgomp's default
                 when unset: spin a while, then sleep)
  torch passive  the same under OMP_WAIT_POLICY=passive (waiting threads sleep)
  zero 1r s0     gpt_train --ranks 1 --stage 0 --micro-batch 32
  zero 4r s3     gpt_train --ranks 4 --stage 3 --micro-batch 8
alternating them for --rounds rounds (the machine's speed drifts), and prints
each one's tokens/s (median over rounds) and the ratios to both PyTorch runs
and to the faster of them. The trainer runs with OMP_NUM_THREADS=--threads.
On cores other work shares, --threads 1 compares what each side does with
one core: with 2 threads, how much of the second core each side gets
depends on the other work.

Why two PyTorch runs: the trainer sets OMP_WAIT_POLICY=passive for itself
where the environment sets no policy (examples/common/openmp_waits.hpp), and
on busy cores that policy alone makes PyTorch 1.5x-3x faster too. libgomp
reads the policy once, as it loads, so each PyTorch run is a subprocess of
this script with its own environment. PyTorch and the trainer both use
OpenBLAS; on CPUs OpenBLAS 0.3.21 does not recognise, both get
OPENBLAS_CORETYPE as the trainer sets it for itself
(examples/common/openblas_core.hpp).
"""
import argparse
import gzip
import os
import re
import statistics
import subprocess
import sys
import time

LAYERS, WIDTH, HEADS, CONTEXT, BATCH = 4, 128, 4, 128, 32
CORPUS = "/usr/share/dictd/devil.dict.dz"
# PyTorch's runs: name -> OMP_WAIT_POLICY (None: as the environment leaves it).
TORCH_POLICIES = {"torch default": None, "torch passive": "passive"}


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def openblas_coretype():
    """OPENBLAS_CORETYPE as the trainer picks it, unless the environment sets one."""
    if "OPENBLAS_CORETYPE" in os.environ:
        return os.environ["OPENBLAS_CORETYPE"]
    flags = cpu_flags()
    return "SkylakeX" if "avx512f" in flags else "Haswell" if "avx2" in flags else ""


def torch_tokens_per_s(steps, threads, warmup=3):
    """Runs in a subprocess (see --torch-worker), after its environment is set."""
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpt"))
    import torch_gpt

    torch.set_num_threads(threads)
    torch.manual_seed(1)
    text = gzip.open(CORPUS).read()
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
    print(f"tokens/s {BATCH * CONTEXT * len(times) / sum(times)} torch {torch.__version__} "
          f"threads {torch.get_num_threads()}")


def run_torch(steps, threads, policy):
    env = dict(os.environ)
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", "--steps", str(steps), "--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    m = re.search(r"^tokens/s ([0-9.]+) torch (\S+) threads (\d+)", out, re.M)
    if not m:
        sys.exit("no 'tokens/s' line in the PyTorch run's output:\n" + out)
    return float(m.group(1)), f"torch {m.group(2)}, {m.group(3)} threads"


def zero_tokens_per_s(trainer, ranks, stage, steps, threads):
    cmd = [trainer, "--ranks", str(ranks), "--stage", str(stage), "--micro-batch", str(BATCH // ranks),
           "--layers", str(LAYERS), "--width", str(WIDTH), "--heads", str(HEADS), "--context", str(CONTEXT),
           "--steps", str(steps), "--eval-every", str(steps), "--sample", "0"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    m = re.search(r"^training: ([0-9.]+) s, ([0-9.]+) tokens/s, ([0-9.]+) ms/step", out, re.M)
    if not m:
        sys.exit("no 'training:' line in the trainer's output:\n" + out)
    return float(m.group(2)), float(m.group(3))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ["OPENBLAS_CORETYPE"] = openblas_coretype()  # before torch loads OpenBLAS
    if args.torch_worker:
        torch_tokens_per_s(args.steps, args.threads)
        return
    if not args.trainer:
        ap.error("--trainer is required")
    zero_runs = {"zero 1r s0": (1, 0), "zero 4r s3": (4, 3)}
    runs = {k: [] for k in list(TORCH_POLICIES) + list(zero_runs)}
    ms = {k: [] for k in zero_runs}
    torch_desc = ""
    for r in range(args.rounds):
        for key, policy in TORCH_POLICIES.items():
            tps, torch_desc = run_torch(args.steps, args.threads, policy)
            runs[key].append(tps)
        for key, (ranks, stage) in zero_runs.items():
            tps, step_ms = zero_tokens_per_s(args.trainer, ranks, stage, args.steps, args.threads)
            runs[key].append(tps)
            ms[key].append(step_ms)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in runs.items()) + " tokens/s, load "
              + " ".join(f"{x:.1f}" for x in os.getloadavg()), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    fastest = max(TORCH_POLICIES, key=lambda k: med[k])
    env_policy = os.environ.get("OMP_WAIT_POLICY", "(unset)")
    print(f"OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']}; {torch_desc}; torch default ran with "
          f"OMP_WAIT_POLICY={env_policy}, the trainer with {env_policy if env_policy != '(unset)' else 'passive'} "
          f"and OMP_NUM_THREADS={args.threads}; "
          f"{BATCH}x{CONTEXT} tokens/step, {args.steps} steps x {args.rounds} rounds, medians:")
    print(f"{'':13s} {'tokens/s':>9s}" + "".join(f"{'vs ' + t:>19s}" for t in TORCH_POLICIES))
    for k, v in med.items():
        print(f"{k:13s} {v:9.0f}" + "".join(f"{v / med[t]:18.2f}x" for t in TORCH_POLICIES))
    print(f"the faster PyTorch: {fastest} ({med[fastest]:.0f} tokens/s); against it: "
          + ", ".join(f"{k} {med[k] / med[fastest]:.2f}x" for k in zero_runs))
    s0, s3 = statistics.median(ms["zero 1r s0"]), statistics.median(ms["zero 4r s3"])
    print(f"time per step: 4 ranks stage 3 {s3:.1f} ms / 1 rank stage 0 {s0:.1f} ms = {s3 / s0:.2f}")


if __name__ == "__main__":
    main()
