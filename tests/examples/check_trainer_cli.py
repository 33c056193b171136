#!/usr/bin/env python3
"""The trainer's command line: --help lists every option with its default and
exits 0; each bad value exits 2 with a message naming the option; and
--history-json writes the configuration and one record per epoch that agree
with the printed `epoch` lines (that part skips without the data set).

    check_trainer_cli.py TRAINER
"""
import json
import os
import re
import subprocess
import sys
import tempfile

DATA = "/usr/share/datasets/fashion-mnist"
# Every option and the default --help must show for it (None: a flag, or no default).
OPTIONS = {"--ranks": "4", "--comm": "local", "--stage": "3", "--precision": "bf16", "--optimizer": "adamw",
           "--epochs": "8", "--batch": "256", "--lr": "0.002", "--seed": "1", "--data": DATA,
           "--report": None, "--history-json": None}
# Bad command lines and the option each error must name.
BAD = [(["--stage", "7"], "--stage"), (["--stage", "-1"], "--stage"), (["--precision", "fp8"], "--precision"),
       (["--optimizer", "lamb"], "--optimizer"), (["--comm", "gloo"], "--comm"), (["--ranks", "0"], "--ranks"),
       (["--ranks", "65"], "--ranks"), (["--epochs", "0"], "--epochs"), (["--lr", "-1"], "--lr"),
       (["--lr", "fast"], "--lr"), (["--batch", "255"], "--batch"), (["--stage"], "--stage"),
       (["--bogus"], "--bogus"), (["--history-json", "/nonexistent/dir/h.json"], "--history-json")]


def run(trainer, *args, timeout=60):
    return subprocess.run([trainer, *args], capture_output=True, text=True, timeout=timeout)


def check_help(trainer):
    failures = []
    result = run(trainer, "--help")
    if result.returncode != 0:
        failures.append(f"--help exited {result.returncode}")
    for option, default in OPTIONS.items():
        # CLI11 prints `--name TYPE:CHECK=default`, the description on the same or the next line.
        line = re.search(rf"^ +{re.escape(option)}\b(.*?)(?: {{2,}}|$)", result.stdout, re.M)
        if not line:
            failures.append(f"--help does not list {option}")
        elif default is not None and not line.group(1).endswith("=" + default):
            failures.append(f"--help shows {option}{line.group(1)}, not its default {default}")
    print(f"--help: {len(OPTIONS)} options checked")
    return failures, result.stdout


def check_errors(trainer):
    failures = []
    for args, option in BAD:
        result = run(trainer, *args)
        named = option in result.stderr
        print(f"{' '.join(args):40} exit {result.returncode}: {result.stderr.splitlines()[0] if result.stderr else ''}")
        if result.returncode != 2 or not named:
            failures.append(f"{' '.join(args)}: exit {result.returncode} (want 2), message names {option}: {named}")
    return failures


def check_history(trainer):
    if not os.path.isdir(DATA):
        print(f"history: skipped, {DATA} missing (apt-get install dataset-fashion-mnist)")
        return []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "history.json")
        args = ["--epochs", "2", "--ranks", "2", "--stage", "2", "--precision", "fp32", "--history-json", path]
        result = run(trainer, *args, timeout=600)
        if result.returncode != 0:
            return [f"{' '.join(args)} exited {result.returncode}: {result.stderr[-2000:]}"]
        with open(path) as f:
            history = json.load(f)
    failures = []
    config = history["config"]
    want = {"ranks": 2, "comm": "local", "stage": 2, "precision": "fp32", "optimizer": "adamw", "epochs": 2,
            "batch": 256, "lr": 0.002, "seed": 1}
    for key, value in want.items():
        if config.get(key) != value:
            failures.append(f"history config {key} = {config.get(key)!r}, want {value!r}")
    printed = re.findall(r"^epoch (\d+)/\d+  loss ([0-9.]+)  test_accuracy ([0-9.]+)  (\d+) samples/s  ([0-9.]+) s",
                         result.stdout, re.M)
    epochs = history["epochs"]
    if len(epochs) != 2 or len(printed) != 2:
        return failures + [f"{len(epochs)} history records and {len(printed)} epoch lines for 2 epochs"]
    for record, (epoch, loss, accuracy, rate, seconds) in zip(epochs, printed):
        expected = {"epoch": int(epoch), "loss": float(loss), "test_accuracy": float(accuracy),
                    "samples_per_s": float(rate), "seconds": float(seconds)}
        for key, value in expected.items():  # the printed line rounds: half a unit of its last digit
            tolerance = {"loss": 5e-5, "test_accuracy": 5e-5, "samples_per_s": 0.5, "seconds": 0.05}.get(key, 0)
            if abs(record[key] - value) > tolerance:
                failures.append(f"epoch {epoch}: history {key} = {record[key]}, printed {value}")
    final = float(re.search(r"^test_accuracy=([0-9.]+)$", result.stdout, re.M).group(1))
    if abs(epochs[-1]["test_accuracy"] - final) > 5e-5:
        failures.append(f"last history test_accuracy {epochs[-1]['test_accuracy']} != test_accuracy={final}")
    print(f"history: {json.dumps(epochs[-1])}")
    return failures


def main():
    trainer = sys.argv[1]
    failures, _ = check_help(trainer)
    failures += check_errors(trainer)
    failures += check_history(trainer)
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
