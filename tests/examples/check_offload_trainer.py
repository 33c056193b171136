#!/usr/bin/env python3
"""The trainer with --offload nvme (master weights and optimizer state in swap
files) must print the same test_accuracy, to the last digit, as the same run
with the state in memory, leave no swap file behind, and refuse --offload nvme
without --nvme-dir. Skips (77) when the data set is not installed.

    check_offload_trainer.py TRAINER [ARGS...]
"""
import os
import re
import subprocess
import sys
import tempfile

DATA = "/usr/share/datasets/fashion-mnist"


def accuracy(command):
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    print(" ".join(command))
    print(run.stdout[-1500:])
    print(run.stderr[-1500:], file=sys.stderr)
    if run.returncode != 0:
        raise SystemExit(f"FAIL: exit code {run.returncode}")
    last = run.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"test_accuracy=([0-9.]+)", last)
    if not match:
        raise SystemExit("FAIL: the last line is not test_accuracy=<value>")
    return match.group(1)


def main():
    if not os.path.isdir(DATA):
        print(f"SKIP: {DATA} missing (apt-get install dataset-fashion-mnist)")
        return 77
    command = sys.argv[1:]
    with tempfile.TemporaryDirectory(dir="/tmp") as swap:
        in_memory = accuracy(command + ["--offload", "none"])
        on_disk = accuracy(command + ["--offload", "nvme", "--nvme-dir", swap, "--nvme-window-mib", "1"])
        left = os.listdir(swap)
    print(f"test_accuracy: {in_memory} in memory, {on_disk} with --offload nvme")
    if in_memory != on_disk:
        print("FAIL: the accuracies differ")
        return 1
    if left:
        print(f"FAIL: swap files left behind: {left}")
        return 1
    refused = subprocess.run(command[:1] + ["--offload", "nvme"], capture_output=True, text=True, timeout=60)
    if refused.returncode != 2 or "--nvme-dir" not in refused.stderr + refused.stdout:
        print(f"FAIL: --offload nvme without --nvme-dir: exit {refused.returncode}, {refused.stderr!r}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
