#!/usr/bin/env python3
"""Smoke test of the main job: a short Fashion-MNIST run must end with a
`test_accuracy=<value>` line at or above a floor, and print one progress line
per epoch. Skips (77) when the data set is not installed.

    check_trainer.py MIN_ACCURACY [LAUNCHER...] -- TRAINER [ARGS...]
"""
import os
import sys

from trainer_output import run_for_last_line

DATA = "/usr/share/datasets/fashion-mnist"


def main():
    floor = float(sys.argv[1])
    sep = sys.argv.index("--")
    launcher, command = sys.argv[2:sep], sys.argv[sep + 1:]
    if not os.path.isdir(DATA):
        print(f"SKIP: {DATA} missing (apt-get install dataset-fashion-mnist)")
        return 77
    stdout, accuracy = run_for_last_line(launcher + command, "test_accuracy")
    if stdout is None:
        return 1
    lines = stdout.strip().splitlines()
    epochs = int(command[command.index("--epochs") + 1]) if "--epochs" in command else 8
    progress = [l for l in lines if l.startswith("epoch ")]
    if len(progress) != epochs:
        print(f"FAIL: {len(progress)} progress lines for {epochs} epochs")
        return 1
    print(f"test_accuracy {accuracy:.4f} (floor {floor})")
    return 0 if accuracy >= floor else 1


if __name__ == "__main__":
    sys.exit(main())
