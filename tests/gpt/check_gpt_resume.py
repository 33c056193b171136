#!/usr/bin/env python3
"""--save and --resume of the GPT trainer. A run saving every 20 steps is
killed with SIGKILL right after its step-40 checkpoint; resumed on the same
configuration it must print the uninterrupted run's val_loss to the last
digit. Resumed on another --ranks and --stage it must finish below the
unigram entropy (its windows differ: each rank draws its own). Another --seed,
another model width, and a directory without a checkpoint are clear errors.
--save-async reports each save begun and completed; --keep-last keeps the newest.
On the host, an fp16 run resumed after steps that overflowed (and took no
optimizer step) prints the uninterrupted run's val_loss too.
Skips (77) when The Devil's Dictionary is not installed (and no --data is given).

    check_gpt_resume.py TRAINER [TRAINER OPTIONS...]

TRAINER OPTIONS go on every command line: bench/gpu_check.sh runs this with
`--backend cuda --data CORPUS` (two ranks on one GPU, then one).
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from trainer_output import kill_then_resume, last_value_text, run_checked as run  # noqa: E402

CORPUS = "/usr/share/dictd/devil.dict.dz"
MODEL = ["--layers", "2", "--width", "64", "--heads", "2", "--context", "32", "--micro-batch", "16"]
BASE = MODEL + ["--ranks", "2", "--stage", "3", "--steps", "60", "--eval-every", "30", "--warmup", "10",
                "--lr", "5e-3", "--min-lr", "5e-4", "--sample", "20", "--seed", "5"]


def with_flags(args, **values):
    """args with the value after each --flag replaced (flag names with _ for -)."""
    out = list(args)
    for flag, value in values.items():
        out[out.index("--" + flag.replace("_", "-")) + 1] = value
    return out


def last_val_loss(out):
    return last_value_text(out, "val_loss")


def refused(cmd, words):
    """The command fails, and its error names every one of `words`."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    said = r.stdout + r.stderr
    if r.returncode == 0 or not all(w in said for w in words):
        return f"{' '.join(cmd[-4:])}: exit {r.returncode}, {said[-300:]!r} (expected an error naming {words})"
    print(f"refused as expected: {said.strip().splitlines()[-1]}")
    return None


def main():
    options = sys.argv[2:]
    if "--data" not in options and not os.path.exists(CORPUS):
        print(f"SKIP: {CORPUS} missing (apt-get install dict-devil)")
        return 77
    trainer = sys.argv[1]
    base = BASE + options
    failures = []
    whole = last_val_loss(run([trainer] + base))
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        same, problems = kill_then_resume([trainer] + base, ckpt, 20, 40)
        failures += problems
        if last_val_loss(same) != whole:
            failures.append(f"resumed on the same configuration: val_loss {last_val_loss(same)}, uninterrupted {whole}")
        moved = run([trainer] + with_flags(base, ranks="1", stage="1") + ["--resume", ckpt])
        entropy = re.search(r"unigram entropy ([0-9.]+) nats/char", moved)
        if not entropy or not float(last_val_loss(moved)) < float(entropy.group(1)):
            failures.append("resumed on 1 rank at stage 1: no val_loss below the unigram entropy")
        # --save-async and --keep-last 2: each save reported as begun, then as
        # complete (the last at the end of the run); the two newest kept; the
        # training unchanged by saving.
        kept = os.path.join(tmp, "kept")
        out = run([trainer] + base + ["--save", kept, "--save-every", "20", "--save-async", "--keep-last", "2"])
        for step in (20, 40, 60):
            for said in (f"saving checkpoint in the background: {kept}/step-{step:09d}",
                         f"saved checkpoint {kept}/step-{step:09d}"):
                if said not in out:
                    failures.append(f"--save-async: no '{said}' in the output")
        if sorted(os.listdir(kept)) != ["latest", "step-000000040", "step-000000060"]:
            failures.append(f"--keep-last 2 left {sorted(os.listdir(kept))}")
        if last_val_loss(out) != whole:
            failures.append(f"with --save-async: val_loss {last_val_loss(out)}, without saves {whole}")
        # fp16 (host only) takes no optimizer step when the gradients overflow
        # (a few early steps here): a resume continues at the step after the
        # checkpoint, not at the optimizer's step count. The second
        # checkpoint comes after such skips.
        if "cuda" not in options:
            fp16 = with_flags(base, steps="40") + ["--precision", "fp16"]
            fp16_ckpt = os.path.join(tmp, "fp16")
            fp16_whole = last_val_loss(run([trainer] + fp16 + ["--save", fp16_ckpt, "--save-every", "10"]))
            for later in sorted(n for n in os.listdir(fp16_ckpt) if n.startswith("step-"))[2:]:
                shutil.rmtree(os.path.join(fp16_ckpt, later))
            fp16_resumed = last_val_loss(run([trainer] + fp16 + ["--resume", fp16_ckpt]))
            if fp16_resumed != fp16_whole:
                failures.append(f"fp16 resumed after its second checkpoint: val_loss {fp16_resumed}, "
                                f"uninterrupted {fp16_whole}")
        for problem in (refused([trainer] + with_flags(base, seed="6") + ["--resume", ckpt], ["seed", "5", "6"]),
                        refused([trainer] + with_flags(base, width="96") + ["--resume", ckpt], [ckpt]),
                        refused([trainer] + base + ["--resume", os.path.join(tmp, "nothing")], ["nothing"])):
            if problem:
                failures.append(problem)
    for f in failures:
        print("FAIL:", f)
    print(f"uninterrupted val_loss={whole}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
