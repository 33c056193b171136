#!/usr/bin/env python3
"""--save and --resume of the Fashion-MNIST trainer. A run saving every 100
steps is killed with SIGKILL right after its step-300 checkpoint (in epoch 2);
resumed on the same configuration it must print the uninterrupted run's
test_accuracy to the last digit, and resumed on other --ranks and --stage (and
with --offload nvme) within 0.003. Resumed from its last step's checkpoint it
prints the same test_accuracy without training; in fp16, whose overflowing
batches take no optimizer step, to the last digit too. A directory without a
complete checkpoint, and a truncated rank file, are clear errors. Skips (77)
when the data set is not installed.

    check_resume_trainer.py TRAINER
"""
import os
import shutil
import subprocess
import sys
import tempfile

from trainer_output import kill_then_resume, last_value_text, run_checked as run

DATA = "/usr/share/datasets/fashion-mnist"
BASE = ["--epochs", "2", "--ranks", "2", "--stage", "2", "--batch", "256", "--seed", "3"]


def last_accuracy(out):
    return last_value_text(out, "test_accuracy")


def main():
    if not os.path.isdir(DATA):
        print(f"SKIP: {DATA} missing (apt-get install dataset-fashion-mnist)")
        return 77
    trainer = sys.argv[1]
    failures = []
    whole = last_accuracy(run([trainer] + BASE))
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        # Stopped by SIGKILL as soon as it reports step 300's checkpoint, then resumed.
        same, problems = kill_then_resume([trainer] + BASE, ckpt, 100, 300)
        failures += problems
        if last_accuracy(same) != whole:
            failures.append(f"resumed on the same configuration: {last_accuracy(same)}, uninterrupted {whole}")
        other = [trainer, "--epochs", "2", "--ranks", "3", "--stage", "3", "--batch", "256", "--seed", "3",
                 "--resume", ckpt]
        # The trainer needs --batch divisible by --ranks: 256 is not by 3, so 4 ranks at stage 1 instead.
        other[4] = "4"
        other[6] = "1"
        moved = last_accuracy(run(other))
        if abs(float(moved) - float(whole)) > 0.003:
            failures.append(f"resumed on 4 ranks at stage 1: {moved}, uninterrupted {whole} (limit 0.003)")
        nvme = os.path.join(tmp, "swap")
        os.mkdir(nvme)
        on_disk = last_accuracy(run([trainer] + BASE + ["--resume", ckpt, "--offload", "nvme", "--nvme-dir", nvme,
                                                        "--save", ckpt]))
        if on_disk != whole:
            failures.append(f"resumed with --offload nvme: {on_disk}, uninterrupted {whole}")
        # That run saved its last step: resumed from there, only the evaluation is left.
        complete = run([trainer] + BASE + ["--resume", ckpt])
        if "training is complete" not in complete or last_accuracy(complete) != whole:
            failures.append(f"resumed after the last step: {last_accuracy(complete)}, uninterrupted {whole}")
        empty = os.path.join(tmp, "empty")
        os.mkdir(empty)
        bad = subprocess.run([trainer] + BASE + ["--resume", empty], capture_output=True, text=True, timeout=120)
        if bad.returncode == 0 or "empty" not in bad.stderr + bad.stdout:
            failures.append(f"--resume of an empty directory: exit {bad.returncode}, {bad.stderr[-300:]!r}")
        # fp16 skips the optimizer step of a batch whose gradients overflow (the
        # first few here): a resume continues at the batch after the
        # checkpoint, not at the optimizer's step count.
        fp16 = [trainer, "--epochs", "1", "--ranks", "2", "--stage", "1", "--batch", "600", "--precision", "fp16"]
        fp16_ckpt = os.path.join(tmp, "fp16")
        fp16_whole = last_accuracy(run(fp16 + ["--save", fp16_ckpt, "--save-every", "20"]))
        for later in sorted(n for n in os.listdir(fp16_ckpt) if n.startswith("step-"))[1:]:  # as if killed after the first
            shutil.rmtree(os.path.join(fp16_ckpt, later), ignore_errors=True)
        fp16_resumed = last_accuracy(run(fp16 + ["--resume", fp16_ckpt]))
        if fp16_resumed != fp16_whole:
            failures.append(f"fp16 resumed after its first checkpoint: {fp16_resumed}, uninterrupted {fp16_whole}")
        # A damaged rank file fails the load on every rank; the rank that read
        # it names it, the others say it failed elsewhere. Whichever rank
        # fails first, the error names the file (five tries: it was a race).
        four = [trainer, "--epochs", "1", "--ranks", "4", "--stage", "2", "--batch", "600"]
        four_ckpt = os.path.join(tmp, "four")
        run(four + ["--save", four_ckpt])
        damaged = os.path.join(four_ckpt, "step-000000100", "rank-1-of-4.safetensors")
        os.truncate(damaged, 1000)
        for _ in range(5):
            bad = subprocess.run(four + ["--resume", four_ckpt], capture_output=True, text=True, timeout=120)
            if bad.returncode != 1 or damaged not in bad.stderr or "terminate" in bad.stderr:
                failures.append(f"--resume with {damaged} truncated: exit {bad.returncode}, {bad.stderr[-600:]!r}")
                break
        other_batch = subprocess.run([trainer] + BASE[:-4] + ["--batch", "128", "--seed", "3", "--resume", ckpt],
                                     capture_output=True, text=True, timeout=120)
        if other_batch.returncode == 0 or "--batch" not in other_batch.stderr + other_batch.stdout:
            failures.append(f"--resume with another --batch: exit {other_batch.returncode}")
    for f in failures:
        print("FAIL:", f)
    print(f"uninterrupted test_accuracy={whole}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
