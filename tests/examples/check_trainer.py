#!/usr/bin/env python3
"""Smoke test of the main job: a short Fashion-MNIST run must end with a
`test_accuracy=<value>` line at or above a floor, and print one progress line
per epoch. Skips (77) when the data set is not installed.

    check_trainer.py MIN_ACCURACY [LAUNCHER...] -- TRAINER [ARGS...]
"""
import os
import re
import subprocess
import sys

DATA = "/usr/share/datasets/fashion-mnist"


def main():
    floor = float(sys.argv[1])
    sep = sys.argv.index("--")
    launcher, command = sys.argv[2:sep], sys.argv[sep + 1:]
    if not os.path.isdir(DATA):
        print(f"SKIP: {DATA} missing (apt-get install dataset-fashion-mnist)")
        return 77
    run = subprocess.run(launcher + command, capture_output=True, text=True, timeout=600)
    print(run.stdout[-4000:])
    print(run.stderr[-4000:], file=sys.stderr)
    if run.returncode != 0:
        print(f"FAIL: exit code {run.returncode}")
        return 1
    lines = run.stdout.strip().splitlines()
    match = re.fullmatch(r"test_accuracy=([0-9.]+)", lines[-1]) if lines else None
    if not match:
        print("FAIL: the last line is not test_accuracy=<value>")
        return 1
    epochs = int(command[command.index("--epochs") + 1]) if "--epochs" in command else 8
    progress = [l for l in lines if l.startswith("epoch ")]
    if len(progress) != epochs:
        print(f"FAIL: {len(progress)} progress lines for {epochs} epochs")
        return 1
    accuracy = float(match.group(1))
    print(f"test_accuracy {accuracy:.4f} (floor {floor})")
    return 0 if accuracy >= floor else 1


if __name__ == "__main__":
    sys.exit(main())
