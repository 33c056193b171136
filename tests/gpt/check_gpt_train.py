#!/usr/bin/env python3
"""Smoke test of the GPT trainer: a short run must print a progress line per
--eval-every steps, end with `val_loss=<value>` (finite), and bring the
validation loss below the corpus' unigram entropy (which the trainer prints).
Skips (77) when The Devil's Dictionary is not installed.

    check_gpt_train.py TRAINER [ARGS...]
"""
import math
import os
import re
import subprocess
import sys

CORPUS = "/usr/share/dictd/devil.dict.dz"


def main():
    command = sys.argv[1:]
    if not os.path.exists(CORPUS):
        print(f"SKIP: {CORPUS} missing (apt-get install dict-devil)")
        return 77
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    print(run.stdout[-4000:])
    print(run.stderr[-4000:], file=sys.stderr)
    if run.returncode != 0:
        print(f"FAIL: exit code {run.returncode}")
        return 1
    lines = run.stdout.strip().splitlines()
    last = re.fullmatch(r"val_loss=([-+0-9.eEnaif]+)", lines[-1]) if lines else None
    if not last:
        print("FAIL: the last line is not val_loss=<value>")
        return 1
    val = float(last.group(1))
    entropy = re.search(r"unigram entropy ([0-9.]+) nats/char", run.stdout)
    progress = [float(m.group(1)) for m in re.finditer(r"^step \d+/\d+ .* val_loss ([0-9.]+) nats/char", run.stdout, re.M)]
    steps = int(command[command.index("--steps") + 1])
    every = int(command[command.index("--eval-every") + 1])
    if len(progress) != (steps + every - 1) // every:
        print(f"FAIL: {len(progress)} progress lines for {steps} steps, one every {every}")
        return 1
    if not math.isfinite(val) or not entropy or abs(progress[-1] - val) > 1e-4:
        print(f"FAIL: val_loss {val} is not finite, or differs from the last progress line, or no unigram entropy")
        return 1
    h = float(entropy.group(1))
    print(f"val_loss {val:.4f} nats/char, unigram entropy {h:.4f}, progress {progress}")
    if not val < h:
        print("FAIL: the validation loss is not below the unigram entropy")
        return 1
    if any(b >= a for a, b in zip(progress, progress[1:])):
        print("FAIL: the validation loss did not decrease at every evaluation")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
