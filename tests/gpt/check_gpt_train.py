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
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from trainer_output import run_for_last_line  # noqa: E402

CORPUS = "/usr/share/dictd/devil.dict.dz"


def main():
    command = sys.argv[1:]
    if not os.path.exists(CORPUS):
        print(f"SKIP: {CORPUS} missing (apt-get install dict-devil)")
        return 77
    stdout, val = run_for_last_line(command, "val_loss")
    if stdout is None:
        return 1
    entropy = re.search(r"unigram entropy ([0-9.]+) nats/char", stdout)
    progress = [float(m.group(1)) for m in re.finditer(r"^step \d+/\d+ .* val_loss ([0-9.]+) nats/char", stdout, re.M)]
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
